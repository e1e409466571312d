"""A drafting model: its own KV cache (dense, or a fixed-budget sparse view), kept in step with the context."""

from __future__ import annotations

import functools

import torch

from sdbench.forward_step import Step
from sdbench.drafting.prefix import CachedPrefix
from sdbench.engine.runner import Runner
from sdbench.drafting.dynamic import DynamicTree, Expanded, grow, log_probs
from sdbench.engine.sampling import choose, choose_each, probs_from_logits
from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.tree import Tree, TreeBatch, child_picks, top_children
from sdbench.errors import SdbenchError
from sdbench.kv.cache import set_prompt_lengths
from sdbench.kv.sparse import SparseSpec, compress


def feed_context(runner, cache, prefix: CachedPrefix, ctx: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """One forward over each row's context ctx[b, :lens[b]] that the cache has not seen (one token, or two after
    a fully accepted step, or more after an idle spell): logits [B, V] after its last token, the first draft's."""
    prefix.agree(ctx, lens)
    feed, start, todo = prefix.unseen(ctx, lens)
    logits = runner.run(cache, Step(feed, start, at=torch.tensor(todo) - 1))
    prefix.wrote(feed, start)
    return logits


def draft_tokens(runner, cache, prefix: CachedPrefix, ctx: torch.Tensor, lens: list[int], gamma: int, sampling,
                 generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gamma tokens per row continuing ctx[b, :lens[b]], drawn from the model one at a time.

    One forward feeds each row's unseen context and gives the first draft (`feed_context`); then one forward
    per further draft. Returns tokens [B, gamma] on the model's device and, under sampling, the draft
    distributions [B, gamma, V]. Nothing here waits for the device: the tokens the cache was fed are read back
    lazily (CachedPrefix)."""
    logits = feed_context(runner, cache, prefix, ctx, lens)
    drafted, probs = [], []
    for i in range(gamma):
        x, p = choose(logits, sampling, generator)
        drafted.append(x)
        probs.append(p)
        if i + 1 < gamma:
            logits = runner.run(cache, Step(x[:, None], [n + i for n in lens]))[:, 0]
    tokens = torch.stack(drafted, 1)  # left on the device: drafting never waits for it
    prefix.wrote(tokens[:, : gamma - 1], list(lens))  # the last draft is not fed: it has no successor yet
    return tokens, None if sampling.greedy else torch.stack(probs, 1)


def draft_parallel(runner, cache, prefix: CachedPrefix, ctx: torch.Tensor, lens: list[int], gamma: int,
                   mask_id: int, sampling, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gamma tokens per row from one forward (PARD: a draft model trained to predict masked positions): each row's
    unseen context followed by gamma - 1 mask tokens; the logits after its last token and at each mask position
    give its drafts, which do not see each other. The cache records the masks it was fed, so the next round's
    `agree` feeds again from the first of them."""
    prefix.agree(ctx, lens)
    masks = torch.full((len(lens), gamma - 1), mask_id, dtype=torch.long)
    feed, start, todo = prefix.unseen(ctx, lens, masks)
    at = torch.tensor(todo)[:, None] - 1 + torch.arange(gamma)[None, :]
    logits = runner.run(cache, Step(feed, start, at=at))  # [B, gamma, V]
    prefix.wrote(feed, start)
    return choose_each(logits, sampling, generator)


def draft_tree(runner, cache, prefix: CachedPrefix, ctx: torch.Tensor, lens: list[int], shape: Tree,
               sampling=None, generator=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A token per node of `shape` below each row's context ctx[b, :lens[b]], grown level by level: the children
    of a node, by rank, are the model's likeliest tokens after the node's path, in order (distinct and
    deterministic: verified with p one-hot, `sampling.verify_tree`); or, given `sampling` (SpecInfer's sampled
    children), tokens drawn independently from the model's distribution after the node's path, with
    replacement (siblings may repeat), that distribution carried per child as p.

    `feed_context` gives the root's children; each further level is one tree forward over the nodes grown so
    far, placed after the context as the verifier places its tree (slot lens[b] + j, the position of the
    node's depth), read at the last level's nodes: shape.max_depth forwards in all, as a chain that deep.
    Returns tokens [B, N] on the model's device and p [B, N, V] (None for ranked children). The tree's slots
    are not context: the cache is told it holds only the leading nodes that lie on one line from the root (a
    chain's drafts), each at its own position."""
    logits = feed_context(runner, cache, prefix, ctx, lens)  # [B, V]
    tokens = torch.zeros(len(lens), len(shape), dtype=torch.long, device=logits.device)
    p = None if sampling is None else torch.zeros(*tokens.shape, logits.shape[-1], device=logits.device)

    def children(logits: torch.Tensor, nodes: tuple[int, ...]) -> None:
        if p is None:
            top_children(tokens, shape, logits, nodes)
        else:
            _sampled_children(tokens, p, shape, logits, nodes, sampling, generator)

    children(logits[:, None], (-1,))
    fed: tuple[int, ...] = ()
    grown = None
    for fed, grown, at, level in _levels(shape, len(lens)):
        logits = runner.run(cache, Step(tokens[:, list(fed)], list(lens), at=at, tree=grown))  # [B, M, V]
        children(logits, level)
    if grown is not None:
        _wrote_line(prefix, tokens[:, list(fed)], grown.trees[:1], lens)
    return tokens, p


def draft_dynamic_tree(runner, cache, prefix: CachedPrefix, ctx: torch.Tensor, lens: list[int],
                       spec: DynamicTree, sampling) -> tuple[list[Tree], torch.Tensor]:
    """EAGLE-2's dynamic tree (drafting/dynamic.py) below each row's context ctx[b, :lens[b]]: its scores are
    the model's log-probabilities (of its sampling distribution; at temperature 1 under greedy decoding).

    `feed_context` scores the root; each further level is one tree forward over the nodes expanded so far (K
    per level, each row its own tree), placed as in `draft_tree`, read at the frontier: spec.depth forwards in
    all, of at most K (depth - 1) tokens. Unlike a static shape, each level's tree is read back to the host to
    build that forward. Returns each row's tree and its tokens [B, N] on the model's device."""
    logits = feed_context(runner, cache, prefix, ctx, lens)  # [B, V]
    last: list = []

    def expand(nodes: Expanded) -> torch.Tensor:
        trees, M = nodes.trees(), nodes.tokens.shape[1]
        at = torch.arange(M - spec.topk, M).repeat(len(lens), 1)  # the frontier: the last K nodes
        out = runner.run(cache, Step(nodes.tokens, list(lens), at=at, tree=TreeBatch.of(trees)))  # [B, K, V]
        last[:] = [nodes.tokens, trees]
        return log_probs(out, sampling)

    trees, tokens = grow(spec, log_probs(logits, sampling), expand)
    if last:
        _wrote_line(prefix, *last, lens)
    return trees, tokens


def _wrote_line(prefix: CachedPrefix, fed: torch.Tensor, trees, lens: list[int]) -> None:
    """After tree forwards over fed [B, M] (row b's tree trees[b], or trees[0] for every row), tell the cache's
    bookkeeping it holds as context the leading nodes that lie on one line from the root in every row: node i
    at depth i + 1, its key the one plain decoding would have written at that slot."""
    line = min(_line(t) for t in trees)
    if line:
        prefix.wrote(fed[:, :line], list(lens))


def _line(tree: Tree) -> int:
    line = 0
    while line < len(tree) and tree.parents[line] == line - 1:
        line += 1
    return line


@functools.lru_cache(maxsize=32)
def _levels(shape: Tree, batch: int) -> tuple:
    """The tree forwards that grow `shape` for `batch` rows, one per level d = 1 .. depth - 1: (the nodes of
    depth <= d, fed in their order; their TreeBatch; at [B, M]: where the level-d nodes are among them; those
    nodes), made once per shape and batch size."""
    out = []
    for d in range(1, shape.max_depth):
        grown, fed = shape.to_depth(d)
        where = [j for j, i in enumerate(fed) if shape.depth[i] == d]
        out.append((fed, TreeBatch.of([grown] * batch), torch.tensor(where).repeat(batch, 1),
                    tuple(fed[j] for j in where)))
    return tuple(out)


def _sampled_children(tokens: torch.Tensor, p: torch.Tensor, shape: Tree, logits: torch.Tensor,
                      nodes: tuple[int, ...], sampling, generator) -> None:
    """Fill in the children of `nodes` (-1: the root) in tokens [B, N] by independent draws, with replacement,
    from the model's distribution at their parent (logits [B, M, V], M = len(nodes)), kept in p [B, N, V]."""
    child, m, r = child_picks(shape, nodes)
    if not child:
        return
    probs = probs_from_logits(logits, sampling)  # [B, M, V]
    B, M, V = probs.shape
    drawn = torch.multinomial(probs.reshape(B * M, V), max(r) + 1, replacement=True,
                              generator=generator).view(B, M, -1)
    tokens[:, child] = drawn[:, m, r]
    p[:, child] = probs[:, m]


class ModelDrafter:
    """Drafts autoregressively with its own KV cache, kept in step with the context by a `CachedPrefix`: each
    draft first feeds the context tokens the cache has not seen (one, or two when every draft was accepted),
    then drafts. Whatever the verifier accepted, corrected or rewound, the cache keeps the longest prefix
    that agrees with the context.

    sparse: draft through a fixed-budget sparse view of the prompt's keys (StreamingLLM or SnapKV), sized for
    `lookahead` drafts per round; self_speculation: the runner is the target, whose prefilled cache is
    compressed instead of prefilling again; tree: draft a token tree of this shape per row (`draft_tree`, over a
    dense or a sparse cache: `lookahead` is then the tree's nodes), or a dynamic tree (`draft_dynamic_tree`),
    cut to each row's limit as a depth; sample_children: a static shape's children drawn from the model rather
    than ranked (under sampling only). After a fixed shape's verification (`keep_paths`), the accepted path's
    keys that the tree forwards wrote are moved into place, as the target's are."""

    def __init__(self, runner: Runner, sparse: SparseSpec | None = None, lookahead: int = 1,
                 self_speculation: bool = False, tree: Tree | DynamicTree | None = None,
                 sample_children: bool = False, mask_id: int | None = None):
        self.runner, self.sparse, self.lookahead = runner, sparse, lookahead
        self.self_speculation = self_speculation
        self.tree, self.sample_children = tree, sample_children
        self.mask_id = mask_id  # PARD: a chain drafted in one forward over mask tokens (`draft_parallel`)
        self.name = getattr(runner, "name", "") or "model"
        self.cache = None
        self._grown: tuple[Tree, list[int]] | None = None  # the last fixed-shape tree drafted, and its lengths

    def begin(self, state: DecodeState) -> None:
        fed = [n - 1 for n in state.lengths]  # the prompts: the first generated token is fed by the first step
        prompts = [state.row(b)[: fed[b]].tolist() for b in range(state.batch)]
        self.sampling, self.generator = state.sampling, state.generator
        self.prefix = CachedPrefix(state.batch, state.capacity)
        if self.sparse is None:
            self.cache = self.runner.new_cache(state.batch, state.capacity)
            set_prompt_lengths(self.cache, fed)  # also where the first draft feeds a prompt instead
            if self.tree is not None:
                self._check_tree()
            if min(fed) > 0:  # else nothing to prefill for some row: the first draft feeds every row's context
                if self._is_target(state):
                    self.cache.copy_prefix(state.target_cache, fed)
                else:
                    self.runner.prefill(self.cache, prompts)
                self.prefix.holds(state.tokens, fed)
            return
        self.prefix.holds(state.tokens, fed)
        if self.self_speculation:
            full = state.target_cache
        else:
            full = self.runner.new_cache(state.batch, max(len(p) for p in prompts) + 1)
            self.runner.prefill(full, prompts)
        self.cache = compress(self.runner, full, fed, state.tokens, self.sparse, self.lookahead)
        if full is not state.target_cache:
            self.runner.release(full)
        if self.tree is not None:
            self._check_tree()

    def _check_tree(self) -> None:
        """Refuse, before the draft's prefill, a draft runner or cache that cannot grow the tree."""
        why = self.runner.tree_refusal(self.cache, nodes=self.lookahead)  # a level's forward: at most every node
        if why is None and self.sample_children and self.sampling.greedy:
            why = "sampled children need sampling (a temperature above 0)"
        tree = self.tree
        widest = tree.widest if isinstance(tree, DynamicTree) else max(len(kids) for kids in tree.children)
        if why is None and widest > self.runner.vocab_size:
            why = f"a node has {widest} children, more than the draft's {self.runner.vocab_size} tokens"
        if why:
            raise SdbenchError(f"the draft model '{self.name}' cannot draft a token tree: {why}")

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        """Each joining row's prompt prefilled alone into its row of the (dense) draft cache."""
        if self.sparse is not None:
            raise NotImplementedError("a sparse draft cache is compressed from a whole batch's prompts")
        for b in rows:
            fed = state.lengths[b] - 1  # the prompt: the first generated token is fed by the first draft
            if self._is_target(state):
                self.cache.row(b).copy_prefix(state.target_cache.row(b), [fed])
            else:
                self.runner.prefill(self.cache.row(b), [state.row(b)[:fed].tolist()])
            self.prefix.holds_row(b, state.tokens[b], fed)

    def _is_target(self, state: DecodeState) -> bool:
        """Whether this model is the target whose cache the state holds (a dense cache its runner made): its prefill
        of the prompts is already there, key for key what the draft's own would write."""
        return getattr(state.target_cache, "maker", None) is self.runner

    def catch_up(self, ctx: torch.Tensor, lengths: list[int]) -> int:
        self.prefix.agree(ctx, lengths)
        return max(n - f for n, f in zip(lengths, self.prefix.fed))

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        k = max(limits, default=0)
        if k == 0:
            return Proposal.empty(len(lengths))
        if isinstance(self.tree, DynamicTree):
            trees, tokens = draft_dynamic_tree(self.runner, self.cache, self.prefix, ctx, lengths,
                                               self.tree.to_depth(k), self.sampling)
            return Proposal(tokens, torch.tensor([len(t) for t in trees]), trees=tuple(trees)).fit(limits)
        if self.tree is not None:
            shape, _ = self.tree.to_depth(k)
            sampled = (self.sampling, self.generator) if self.sample_children else ()
            tokens, probs = draft_tree(self.runner, self.cache, self.prefix, ctx, lengths, shape, *sampled)
            self._grown = shape, list(lengths)
            return Proposal(tokens, torch.full((len(lengths),), len(shape), dtype=torch.long), probs,
                            trees=(shape,) * len(lengths)).fit(limits)
        if self.mask_id is not None:
            tokens, probs = draft_parallel(self.runner, self.cache, self.prefix, ctx, lengths, k, self.mask_id,
                                           self.sampling, self.generator)
        else:
            tokens, probs = draft_tokens(self.runner, self.cache, self.prefix, ctx, lengths, k, self.sampling,
                                         self.generator)
        return Proposal(tokens, torch.tensor(limits, dtype=torch.long), probs)

    def keep_paths(self, proposal: Proposal | None, rnd) -> None:
        """After the verification of the fixed-shape tree drafted last: each taking-part row's cache keeps the
        accepted path's nodes that a tree forward fed (every level but the deepest) at the positions after the
        context (`keep_path`), and the bookkeeping says it holds them, so that the next round feeds only the
        tokens after them, as after a chain's accepted drafts."""
        grown, self._grown = self._grown, None
        if grown is None or proposal is None or rnd.paths is None:
            return
        levels = _levels(grown[0], len(grown[1]))
        if not levels:
            return
        shape, lens = grown
        block = {node: j for j, node in enumerate(levels[-1][0])}  # the last tree forward's nodes, in its order
        node_of = {shape.rank_path(i): i for i in range(len(shape))}  # the verified trees are cut from `shape`
        tokens = proposal.tokens.tolist()
        for b, path in enumerate(rnd.paths):
            if not rnd.active[b]:
                continue
            fed = []
            for i in path:
                j = block.get(node_of[rnd.trees[b].rank_path(i)])
                if j is None:
                    break
                fed.append(j)
            if fed and fed != list(range(len(fed))):  # the first nodes, in order, are already in place
                self.cache.keep_path(b, lens[b] - 1, [j + 1 for j in fed])  # node 0 of that block is at lens[b]
            self.prefix.kept(b, [tokens[b][i] for i in path[: len(fed)]], lens[b])

    def score(self, ctx: torch.Tensor, lengths: list[int], block: torch.Tensor) -> torch.Tensor:
        """For a model that also verifies (a middle level of a polybasic chain): one forward over each row's
        unseen context and then block [B, G]; logits [B, G+1, V] at the context's last token and at each block
        token."""
        self.prefix.agree(ctx, lengths)
        tokens, start, todo = self.prefix.unseen(ctx, lengths, block)
        at = (torch.tensor(todo) - 1)[:, None] + torch.arange(block.shape[1] + 1)  # [B, G+1]
        logits = self.runner.run(self.cache, Step(tokens, start, at=at))
        self.prefix.wrote(tokens, start)
        return logits

    def end(self) -> None:
        if self.cache is not None:
            self.runner.release(self.cache)
            self.cache = None
