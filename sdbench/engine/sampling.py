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

Token trees (engine/tree.py; the chain stays the fast path above) are verified from the root down. At a node
the children x_1..x_m are tried in rank order against the target's q there: x_i is accepted with probability
min(1, q(x_i) / p_i(x_i)), where p_i is the draft's distribution x_i was drawn from; on a rejection q becomes
norm(max(0, q - p_i)) and the next child is tried. This is SpecInfer's multi-step speculative sampling for
children drawn independently (i.i.d. from one p, or from several drafts); for DETERMINISTIC children (the
draft's top-k, n-gram branches: p_i one-hot at x_i) it is: accept with q(x_i), else zero q(x_i) and
renormalise. An accepted child becomes the node (its own q); when every child is rejected, or a leaf is
reached, the next token is drawn from the final q. Greedy: descend to the child equal to the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdbench.config import SamplingConfig
from sdbench.engine.tree import TreeBatch


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


def choose_each(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None):
    """`choose` at every position of logits [B, k, V] on its own, the positions in order (drafts that do not see
    each other): (tokens [B, k], probs [B, k, V] or None under greedy)."""
    tokens, probs = zip(*(choose(logits[:, i], cfg, generator) for i in range(logits.shape[1])))
    return torch.stack(tokens, 1), None if cfg.greedy else torch.stack(probs, 1)


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
        x = draft[rows, at]
        residual = _residual(q_next, None if p is None else p[rows, at], x.clamp(max=q.shape[-1] - 1),
                             x < q.shape[-1])
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


@dataclass
class TreeVerdict:
    path: torch.Tensor  # [B, D] long: the accepted nodes from the root's child down, -1 past accepted[b]
    accepted: torch.Tensor  # [B] long: accepted nodes (the path's length)
    next_token: torch.Tensor  # [B] long: the correction (all children of the last node rejected) or bonus token

    def committed(self, draft: torch.Tensor) -> list[list[int]]:
        """Per row, the tokens the verification commits: the accepted path's drafts, then next_token."""
        tokens = draft.gather(1, self.path.clamp(min=0).to(draft.device)).tolist()
        return [t[:a] + [n] for t, a, n in zip(tokens, self.accepted.tolist(), self.next_token.tolist())]


def verify_tree_greedy(trees: TreeBatch, draft: torch.Tensor, target_logits: torch.Tensor) -> TreeVerdict:
    """draft [B, N] a token per node; target_logits [B, N+1, V] (row 0 at the root, i + 1 after node i): from
    the root, descend to the first-ranked child equal to the target's argmax; next token: argmax at the end."""
    B = draft.shape[0]
    rows = torch.arange(B, device=draft.device)
    best = target_logits.argmax(-1)  # [B, N+1]
    kids = trees.children.to(draft.device)  # [B, N+1, K]
    kid_tokens = torch.where(kids >= 0, draft.gather(1, kids.clamp(min=0).flatten(1)).view_as(kids), -1)
    D = trees.max_depth
    path = torch.full((B, D), -1, dtype=torch.long, device=draft.device)
    at = torch.zeros(B, dtype=torch.long, device=draft.device)  # the current row: 0 root, i + 1 node i
    live = torch.ones(B, dtype=torch.bool, device=draft.device)
    for d in range(D):
        match = (kid_tokens[rows, at] == best[rows, at][:, None]) & live[:, None]  # [B, K]
        live = match.any(-1)
        child = kids[rows, at, match.int().argmax(-1)]  # argmax: the first match by rank
        path[:, d] = torch.where(live, child, -1)
        at = torch.where(live, child + 1, at)
    return TreeVerdict(path, (path >= 0).sum(-1), best[rows, at])


def verify_tree_sampling(trees: TreeBatch, draft: torch.Tensor, p: torch.Tensor | None, q: torch.Tensor,
                         generator: torch.Generator | None) -> TreeVerdict:
    """Lossless tree verification (the rule in the module docstring).

    draft [B, N] a token per node (padding nodes are never read); p [B, N, V]: p[b, i] the draft's distribution
    node i was drawn from (the draft's at i's parent; equal rows for i.i.d. siblings), None for deterministic
    children (p one-hot at the drafted token); q [B, N+1, V] the target's distributions, row 0 after the last
    committed token, row i + 1 after node i. The random stream is the chain's: one uniform per node (rand
    [B, N], read when the node is tried), then one draw of the next token, so `Tree.chain(γ)` gives exactly
    `verify_sampling`'s verdicts for the same generator state."""
    B, N = draft.shape
    V = q.shape[-1]
    dev = q.device
    rows = torch.arange(B, device=dev)
    p = _aligned(p, V)
    kids = trees.children.to(dev)  # [B, N+1, K]
    u = torch.rand(B, N, generator=generator, device=dev) if N else None
    inside = draft < V  # a draft id past the target's vocabulary has q(x) = 0
    x_all = draft.clamp(0, V - 1)
    D, K = trees.max_depth, kids.shape[-1]
    path = torch.full((B, D), -1, dtype=torch.long, device=dev)
    at = torch.zeros(B, dtype=torch.long, device=dev)  # the current row: 0 root, i + 1 node i
    q_at = q[:, 0]  # [B, V] the target's q at the current node, after the rejections there so far
    live = torch.ones(B, dtype=torch.bool, device=dev)
    for d in range(D):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for r in range(K):
            child = kids[rows, at, r]
            trying = live & ~moved & (child >= 0)
            if not trying.any():
                break  # children are contiguous by rank: no row has a child of a higher rank
            c = child.clamp(min=0)
            x = x_all[rows, c]
            q_x = q_at.gather(1, x[:, None]).squeeze(1) * inside[rows, c]
            p_x = torch.ones_like(q_x) if p is None else p[rows, c].gather(1, x[:, None]).squeeze(1)
            ok = trying & (u[rows, c] * p_x < q_x)
            rejected = trying & ~ok
            if rejected.any():
                q_at = torch.where(rejected[:, None], _residual(q_at, None if p is None else p[rows, c], x,
                                                                inside[rows, c]), q_at)
            q_at = torch.where(ok[:, None], q[rows, c + 1], q_at)
            at = torch.where(ok, c + 1, at)
            path[:, d] = torch.where(ok, c, path[:, d])
            moved |= ok
        live = moved
        if not live.any():
            break
    return TreeVerdict(path, (path >= 0).sum(-1), sample(q_at, generator))


def _residual(q: torch.Tensor, p: torch.Tensor | None, x: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """norm(max(0, q - p)) [B, V] after the draft x [B] drawn from p [B, V] was rejected; p None: one-hot at x,
    i.e. q with x removed (an x past the target's vocabulary removes nothing)."""
    if p is None:
        residual = q.clone()
        residual[torch.arange(len(x), device=x.device), x] *= (~inside).float()
    else:
        residual = (q - p).clamp(min=0.0)
    mass = residual.sum(-1, keepdim=True)
    # mass can only vanish through rounding (q == p); q itself is then the exact residual
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), q)


def verify_tree(trees: TreeBatch, draft: torch.Tensor, draft_probs: torch.Tensor | None,
                target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> TreeVerdict:
    """Dispatch on the sampling config. draft [B, N], draft_probs [B, N, V] or None, target_logits [B, N+1, V]."""
    if cfg.greedy:
        return verify_tree_greedy(trees, draft, target_logits)
    return verify_tree_sampling(trees, draft, draft_probs, probs_from_logits(target_logits, cfg), generator)
