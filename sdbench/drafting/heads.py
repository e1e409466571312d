"""Trained heads as drafters: a chain (one candidate per position) or a token tree from the target's hidden
states.

The loop hands the drafter the target's states of the tokens each verification committed to the target's
cache (`see`, engine/hidden.py `TargetStates`); the next `draft` starts from them.

EAGLE: the head's cache position p holds the pair (token p + 1, the state of token p), so after a verification
that committed the tokens at positions s..N-2 to the target's cache (N: the committed length), the head feeds
those pairs, which overwrite whatever its own drafts left there (the whole of rewinding), and drafts from its
output at N - 2; each further draft feeds the drafted token with the head's own output.

Medusa (Cai et al., 2024): head k reads the target's final state of token N - 2 and proposes token N + k
(the target's own head proposed token N - 1); the heads need no cache.

Token trees (a `Tree` given, engine/tree.py): the children of a node, by rank, are the drafter's likeliest
tokens there, in order (distinct and deterministic: verified with p one-hot, `sampling.verify_tree`). EAGLE
grows the tree level by level: the feed's output at N - 2 gives the root's children; each further level is one
head forward over the level's nodes, each fed its token with its parent's output (the root's: the feed's),
placed after the head's context as the verifier places its tree (models/heads/eagle.py `TreeLevel`: node j at
slot N - 1 + j, at the position of its depth), seeing the context and its ancestors only; its outputs give the
next level's children. The tree's slots are not context: the next feed overwrites from N - 1 on, and a later
tree's nodes never see a slot past its own context.

EAGLE-2's dynamic tree (a `DynamicTree` given, drafting/dynamic.py) is grown the same way, a shape of its own per
row: the feed's output scores the root; each further level is one head forward over the K frontier nodes only
(the nodes expanded before them are in the head's cache already), each fed its token with its parent's output,
placed as above in its row's tree of the nodes expanded so far; their log-probabilities score the next level.

Medusa's tree is the heads' top-k: a node of depth d and rank r takes head d - 1's (r + 1)-th likeliest token,
whatever its parent (Medusa's own tree). Its dynamic tree scores a node of depth d by head d - 1's
log-probabilities (every frontier node expanded by the same head's ranking, no forward), so the shape, per row,
follows the heads' confidence at each depth.
"""

from __future__ import annotations

import torch

from sdbench.drafting.dynamic import DynamicTree, Expanded, grow, log_probs
from sdbench.engine.hidden import TargetStates
from sdbench.engine.sampling import choose
from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.tree import Tree, top_children


def levels(tree: Tree) -> list[tuple[int, ...]]:
    """The nodes of each depth 1 .. max_depth, in index order."""
    return [tuple(i for i, d in enumerate(tree.depth) if d == level) for level in range(1, tree.max_depth + 1)]


def tree_proposal(tokens: torch.Tensor, tree: Tree, limits: list[int]) -> Proposal:
    """A tree of drafted tokens [B, N], the same shape per row, cut to each row's limit as a depth."""
    return Proposal(tokens, torch.full((len(limits),), len(tree), dtype=torch.long),
                    trees=(tree,) * len(limits)).fit(limits)


class EagleDrafter:
    """Drafts with an EAGLE head (models/heads/eagle.py: its forward, over a KV cache of its own kept in step
    with the target's). layers: the target states it reads (engine/hidden.py); tree: a static shape or an
    EAGLE-2 dynamic tree to grow each round (cut to each row's limit as a depth), None: a chain."""

    def __init__(self, head, name: str, layers: tuple[int, ...], tree: Tree | DynamicTree | None = None):
        self.head, self.name, self.layers, self.tree = head, name, layers, tree
        self.cache, self.pending = None, None

    def begin(self, state: DecodeState) -> None:
        self.sampling, self.generator = state.sampling, state.generator
        self.cache = self.head.new_cache(state.batch, state.capacity)
        self.pending = None

    def see(self, states: TargetStates) -> None:
        self.pending = states

    def _feed(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending target states fed with the tokens that follow them; (logits [B, V], output [B, H]) at
        each row's last one."""
        ts = self.pending
        self.pending = None
        T = ts.states.shape[1]
        start = torch.tensor(ts.start)
        nxt = (start[:, None] + torch.arange(1, T + 1)).clamp(max=ctx.shape[1] - 1)  # past a row's count: padding
        at = (torch.tensor(ts.count) - 1).clamp(min=0)  # a row with nothing new (done) drafts nothing anyway
        return self.head.forward(self.cache, ctx.gather(1, nxt), ts.states, ts.start, at)

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        k = max(limits, default=0)
        if self.pending is None:
            raise RuntimeError("an EAGLE head drafts from the target's states, which the loop did not give")
        logits, out = self._feed(ctx)
        if k == 0:
            return Proposal.empty(len(lengths))
        if isinstance(self.tree, DynamicTree):
            trees, tokens = self._grow_dynamic(self.tree.to_depth(k), logits, out, [n - 1 for n in lengths])
            return Proposal(tokens, torch.tensor([len(t) for t in trees]), trees=tuple(trees)).fit(limits)
        if self.tree is not None:
            shape, _ = self.tree.to_depth(k)
            return tree_proposal(self._grow(shape, logits, out, [n - 1 for n in lengths]), shape, limits)
        drafted, probs = [], []
        zero = torch.zeros(len(lengths), dtype=torch.long)
        for i in range(k):
            x, p = choose(logits, self.sampling, self.generator)
            drafted.append(x)
            probs.append(p)
            if i + 1 < k:
                logits, out = self.head.forward(self.cache, x[:, None], out[:, None], [n - 1 + i for n in lengths],
                                                zero)
        tokens = torch.stack(drafted, 1)
        return Proposal(tokens, torch.tensor(limits, dtype=torch.long),
                        None if self.sampling.greedy else torch.stack(probs, 1))

    def _grow(self, tree: Tree, logits: torch.Tensor, out: torch.Tensor, start: list[int]) -> torch.Tensor:
        """tokens [B, N] of `tree` grown below the root, whose logits [B, V] and output [B, H] the feed gave; the
        tree sits after each row's first start[b] slots of the head's cache."""
        B = logits.shape[0]
        tokens = torch.zeros(B, len(tree), dtype=torch.long, device=logits.device)
        outs = out.new_zeros(B, len(tree), out.shape[-1])  # [B, N, H] the head's output at each node
        top_children(tokens, tree, logits[:, None], (-1,))
        parents = torch.tensor(tree.parents, device=out.device)
        for nodes in levels(tree)[:-1]:  # the last level's nodes have no children to find
            at = list(nodes)
            above = parents[at]  # [M] each node's parent, -1: the root (whose output is the feed's)
            fed = torch.where((above < 0)[None, :, None], out[:, None], outs[:, above.clamp(min=0)])  # [B, M, H]
            logits, outs[:, at] = self.head.forward(self.cache, tokens[:, at], fed, start, None, tree, nodes)
            top_children(tokens, tree, logits, nodes)
        return tokens

    def _grow_dynamic(self, spec: DynamicTree, logits: torch.Tensor, out: torch.Tensor,
                      start: list[int]) -> tuple[list[Tree], torch.Tensor]:
        """Each row's dynamic tree below the root, whose logits [B, V] and output [B, H] the feed gave, and its
        tokens [B, N]: `grow` scoring the frontier with one head forward over it, the expanded nodes sitting
        after each row's first start[b] slots of the head's cache."""
        K = spec.topk
        outs = [out[:, None]]  # [B, 1 + M, H] once joined: the root's output, then each expanded node's

        def expand(nodes: Expanded) -> torch.Tensor:
            M = nodes.tokens.shape[1]
            up = nodes.parents[:, M - K:] + 1  # [B, K] each frontier node's parent in `outs` (0: the root)
            above = torch.cat(outs, 1)
            fed = above.gather(1, up[..., None].expand(-1, -1, above.shape[-1]))  # [B, K, H]
            logits, new = self.head.forward(self.cache, nodes.tokens[:, M - K:], fed, start, None, nodes.trees(),
                                            tuple(range(M - K, M)))
            outs.append(new)
            return log_probs(logits, self.sampling)  # [B, K, V]

        return grow(spec, log_probs(logits, self.sampling), expand)

    def end(self) -> None:
        self.cache = self.pending = None


class MedusaDrafter:
    """Drafts with Medusa-1 heads (models/heads/medusa.py) over the target's final state."""

    def __init__(self, head, name: str, layers: tuple[int, ...], tree: Tree | DynamicTree | None = None):
        self.head, self.name, self.layers, self.tree = head, name, layers, tree
        self.last = None  # [B, H] each row's latest target state

    def begin(self, state: DecodeState) -> None:
        self.sampling, self.generator = state.sampling, state.generator
        self.last = None

    def see(self, states: TargetStates) -> None:
        dev = states.states.device
        count = torch.tensor(states.count, device=dev)
        h = states.states[torch.arange(len(count), device=dev), (count - 1).clamp(min=0)]
        if self.last is not None:  # rows with nothing new keep their state
            h = torch.where((count > 0)[:, None], h, self.last)
        self.last = h

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        k = max(limits, default=0)
        if k == 0:
            return Proposal.empty(len(lengths))
        if isinstance(self.tree, DynamicTree):
            spec = self.tree.to_depth(k)

            def expand(nodes: Expanded) -> torch.Tensor:  # the frontier, at depth d: head d's ranking, K times
                return self._log_probs(nodes.tokens.shape[1] // spec.topk)[:, None].expand(-1, spec.topk, -1)

            trees, tokens = grow(spec, self._log_probs(0), expand)
            return Proposal(tokens, torch.tensor([len(t) for t in trees]), trees=tuple(trees)).fit(limits)
        if self.tree is not None:
            shape, _ = self.tree.to_depth(k)
            return tree_proposal(self._tree_tokens(shape), shape, limits)
        drafted, probs = [], []
        for i in range(k):  # each head on its own: a chain whose positions are drawn independently
            x, p = choose(self.head.logits(i, self.last), self.sampling, self.generator)
            drafted.append(x)
            probs.append(p)
        return Proposal(torch.stack(drafted, 1), torch.tensor(limits, dtype=torch.long),
                        None if self.sampling.greedy else torch.stack(probs, 1))

    def _log_probs(self, d: int) -> torch.Tensor:
        """[B, V] head d's scores (drafting/dynamic.py `log_probs`)."""
        return log_probs(self.head.logits(d, self.last), self.sampling)

    def _tree_tokens(self, tree: Tree) -> torch.Tensor:
        """tokens [B, N]: each node of depth d the token of its rank in head d - 1's ranking."""
        tokens = torch.zeros(self.last.shape[0], len(tree), dtype=torch.long, device=self.last.device)
        parents = [(-1,)] + levels(tree)[:-1]
        for d, above in enumerate(parents):  # every parent of a level ranks the same head's tokens
            top_children(tokens, tree, self.head.logits(d, self.last)[:, None].expand(-1, len(above), -1), above)
        return tokens

    def end(self) -> None:
        self.last = None
