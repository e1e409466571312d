"""The only acceptance maths in sdbench.

Notation (as in the speculative-sampling papers that write it this way, and in the issue tracker):
  p  - the DRAFT's distribution over the vocabulary at a drafted position,
  q  - the TARGET's distribution at the same position,
  x  - the drafted token.
A drafted token is accepted with probability min(1, q(x) / p(x)); at the first rejection the replacement is
drawn from norm(max(0, q - p)); when every drafted token is accepted a bonus token is drawn from q at the
next position. The committed tokens then follow q exactly. A deterministic draft (n-gram lookup, or a greedy
draft model whose distribution is not kept) is the one-hot p = 1[x], which gives acceptance q(x) and residual
q with x removed.

Temperature and top-p are applied by `probs_from_logits` to draft and target alike; greedy decoding is the
temperature-0 limit (accept while the drafted token equals the target's argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdbench.config import SamplingConfig


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] long, number of drafted tokens accepted (0..n_draft[b])
    next_token: torch.Tensor  # [B] long, the correction (after a rejection) or bonus token


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature then nucleus (top-p) filtering; [..., V] float32 probabilities."""
    logits = logits.float() / max(cfg.temperature, 1e-6)
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from probs [B, V] -> [B]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None):
    """The plain decoding choice from logits [B, V]: (tokens [B], probs [B, V] or None under greedy)."""
    if cfg.greedy:
        return logits.argmax(-1), None
    probs = probs_from_logits(logits, cfg)
    return sample(probs, generator), probs


def verify_greedy(draft: torch.Tensor, n_draft: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """draft [B, G], n_draft [B], target_logits [B, G+1, V]: accept while draft == argmax q."""
    best = target_logits.argmax(-1)  # [B, G+1]
    G = draft.shape[1]
    valid = torch.arange(G, device=draft.device)[None] < n_draft[:, None]
    ok = (draft == best[:, :G]) & valid
    accepted = ok.long().cumprod(-1).sum(-1)
    return Verdict(accepted, best.gather(1, accepted[:, None]).squeeze(1))


def verify_sampling(draft: torch.Tensor, n_draft: torch.Tensor, p: torch.Tensor | None, q: torch.Tensor,
                    generator: torch.Generator | None) -> Verdict:
    """Lossless speculative sampling.

    draft [B, G] drafted tokens x; n_draft [B] how many are real; p [B, G, V] the draft's distributions
    (None: deterministic draft, p = one-hot at x); q [B, G+1, V] the target's distributions.
    """
    B, G = draft.shape
    rows = torch.arange(B, device=draft.device)
    p = _aligned(p, q.shape[-1])
    if G:
        inside = draft < q.shape[-1]  # a draft id past the target's vocabulary (a padded row) has q(x) = 0
        x = draft.clamp(max=q.shape[-1] - 1)[..., None]
        q_x = q[:, :G].gather(-1, x).squeeze(-1) * inside  # [B, G]
        p_x = torch.ones_like(q_x) if p is None else p.gather(-1, x).squeeze(-1)
        u = torch.rand(B, G, generator=generator, device=q.device)
        valid = torch.arange(G, device=draft.device)[None] < n_draft[:, None]
        ok = (u * p_x < q_x) & valid
        accepted = ok.long().cumprod(-1).sum(-1)
    else:
        accepted = torch.zeros(B, dtype=torch.long, device=draft.device)
    q_next = q[rows, accepted]  # [B, V]
    rejected = accepted < n_draft
    if rejected.any():
        at = accepted.clamp(max=max(G - 1, 0))
        if p is None:
            residual = q_next.clone()
            x = draft[rows, at]
            residual[rows, x.clamp(max=q.shape[-1] - 1)] *= (x >= q.shape[-1]).float()
        else:
            residual = (q_next - p[rows, at]).clamp(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        # mass can only vanish through rounding (q == p); q itself is then the exact residual
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), q_next)
        dist = torch.where(rejected[:, None], residual, q_next)
    else:
        dist = q_next
    return Verdict(accepted, sample(dist, generator))


def _aligned(p: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """The draft's p [..., V_d] over the target's V rows. A draft and target that share a tokenizer may pad
    their vocabulary rows to different widths (Qwen 151936 / 152064, Pythia 50304 / 50432): rows past the
    draft's have p = 0 (it never drafts them); rows past the target's are padding it cannot produce, so a
    draft of one is rejected (q(x) = 0, `verify_sampling`) and only the target's rows enter the residual."""
    if p is None or p.shape[-1] == width:
        return p
    if p.shape[-1] < width:
        return torch.nn.functional.pad(p, (0, width - p.shape[-1]))
    return p[..., :width]


def verify(draft: torch.Tensor, n_draft: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> Verdict:
    """Dispatch on the sampling config. target_logits [B, G+1, V]."""
    if cfg.greedy:
        return verify_greedy(draft, n_draft, target_logits)
    return verify_sampling(draft, n_draft, draft_probs, probs_from_logits(target_logits, cfg), generator)
