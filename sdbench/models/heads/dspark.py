"""DSpark's forward (DeepSeek 2026, deepseek-ai/DeepSpec; speculators `DSparkDraftModel`): DFlash's block
(dflash.py) read slot by slot through a Markov head and a confidence head.

The block's one forward gives every slot's output h_s as DFlash's does. Then, slot by slot, the Markov head adds
a low-rank bias to slot s's draft logits from the token before it (e = W1[prev], the bias W2 e; `gated`: W2
(sigmoid(G [h_s; e] + g) * e); `rnn`: a state r carried over the block, [a; c; o] = J [r; e; h_s] + j,
r <- sigmoid(a) r + (1 - sigmoid(a)) tanh(c), the bias W2 tanh(o)), so each draft sees the one drafted before
it; the first drafted slot's previous token is the anchor. The confidence head reads [h_s; e] (or h_s alone) and
predicts the chance that slot s's draft is accepted, sigmoid(w . [h_s; e] + b): it depends on the drafts before
slot s, never on slot s's own, so stopping on it keeps decoding lossless. Slots before the first drafted one
(the anchor's, where the anchor does not draft) still step the rnn state, with the anchor as their previous
token, as speculators' forward does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sdbench.models.heads.dflash import DFlashHead
from sdbench.models.heads.eagle import on_target_vocab


class DSparkHead(DFlashHead):
    """DFlash's block with DSpark's Markov and confidence heads over a target runner."""

    def __init__(self, head, target):
        super().__init__(head, target)
        self.rank, self.kind = head.markov["rank"], head.markov["type"]
        self.confident = head.markov["confidence"]
        self.with_markov = head.markov["with_markov"]

    def _bias(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        """The Markov bias [B, Vd] of a slot with output h [B, H] whose previous token's embedding is e [B, r],
        and the rnn state after it (None for the other kinds)."""
        p = "markov_head."
        if self.kind == "vanilla":
            return self._linear(p + "markov_w2", e), None
        if self.kind == "gated":
            gate = torch.sigmoid(self._linear(p + "gate_proj", torch.cat((h, e), -1)))
            return self._linear(p + "markov_w2", gate * e), None
        a, c, o = self._linear(p + "joint_proj", torch.cat((state, e, h), -1)).chunk(3, -1)
        gate = torch.sigmoid(a)
        state = gate * state + (1 - gate) * torch.tanh(c)
        return self._linear(p + "markov_w2", torch.tanh(o)), state

    def embed_prev(self, prev: torch.Tensor) -> torch.Tensor | None:
        """The Markov head's embedding [B, r] of the tokens before a slot (None without a Markov head)."""
        return F.embedding(prev.to(self.device), self.w["markov_head.markov_w1.weight"]) if self.rank else None

    def confidence(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """A slot's predicted acceptance [B] from its output h [B, H] and its previous token's embedding e."""
        features = torch.cat((h, e), -1) if self.with_markov else h
        return torch.sigmoid(self._linear("confidence_head.proj", features).float()).squeeze(-1)

    def biased(self, h: torch.Tensor, e: torch.Tensor | None, state: torch.Tensor | None):
        """A slot's draft logits [B, Vd] with the Markov bias added, and the rnn state after it."""
        logits = self.draft_logits(h)
        if e is None:
            return logits, state
        bias, state = self._bias(e, h, state)
        return logits + bias.float(), state

    def slot(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """One slot read: its draft logits [B, Vd] (the Markov bias added), its confidence [B] (None without a
        confidence head) and the rnn state after it; h [B, H] its output, prev [B] the token before it."""
        e = self.embed_prev(prev)
        logits, state = self.biased(h, e, state)
        return logits, (self.confidence(h, e) if self.confident else None), state

    @torch.inference_mode()
    def chain(self, out: torch.Tensor, anchors: torch.Tensor, k: int, pick, stop: float = 0.0):
        """As DFlashHead.chain, each slot's logits biased by the token drafted before it, with each slot's
        confidence [B, k']: the chain stops early (k' < k) at the first slot where every row's reach (the product
        of the confidences up to it) is below `stop`, which no row would verify (its confidence depends on the
        drafts before it only, so stopping there is the cut's own rule)."""
        B = out.shape[0]
        prev, tokens, probs, sure = anchors.to(self.device), [], [], []
        state = out.new_zeros(B, self.rank) if self.kind == "rnn" and self.rank else None
        reach = torch.ones(B, device=self.device)
        for s in range(self.first + k):
            if s < self.first and state is None:
                continue
            h, e = out[:, s], self.embed_prev(prev)
            if s >= self.first and self.confident:
                c = self.confidence(h, e)
                reach = reach * c
                if stop > 0 and tokens and bool((reach < stop).all()):
                    break
                sure.append(c)
            logits, state = self.biased(h, e, state)
            if s < self.first:  # the anchor's slot, not drafting: it only steps the rnn state
                continue
            token, p = pick(on_target_vocab(logits, self.to_target, self.target.vocab_size))
            tokens.append(token)
            probs.append(p)
            prev = token
        return tokens, probs, (torch.stack(sure, 1) if self.confident else None)
