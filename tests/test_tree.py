"""Token trees: the structure against hand computations and the causal chain, and tree verification against
hand-built greedy cases, the chain verifiers (same random stream, same verdicts) and the target's exact
distributions (chi-square at every depth, for sampled and for deterministic children; the same check run on a
deliberately wrong rule must fail)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from sdbench.engine import sampling
from sdbench.engine.sampling import (verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling)
from sdbench.engine.tree import Tree, TreeBatch
from sdbench.errors import SdbenchError

# the root's children 0, 1, 2; node 0 has children 3, 4; node 1 has child 5; node 3 has child 6
SPEC = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


# structure


def test_a_vllm_tree_by_hand():
    t = Tree.from_vllm(SPEC)
    assert t.parents == (-1, -1, -1, 0, 0, 1, 3)
    assert t.depth == (1, 1, 1, 2, 2, 2, 3)
    assert t.children == ((0, 1, 2), (3, 4), (5,), (), (6,), (), (), ())
    assert t.children_of(-1) == (0, 1, 2) and t.rank == (0, 1, 2, 0, 1, 0, 0)
    assert t.path_to(6) == (0, 3, 6) and t.rank_path(4) == (0, 1)
    assert t.paths() == [(2,), (0, 4), (1, 5), (0, 3, 6)]
    assert t.positions(10).tolist() == [10, 10, 10, 11, 11, 11, 12]
    sees = {0: {0}, 1: {1}, 2: {2}, 3: {0, 3}, 4: {0, 4}, 5: {1, 5}, 6: {0, 3, 6}}
    expected = torch.tensor([[j in sees[i] for j in range(7)] for i in range(7)])
    assert torch.equal(t.ancestors, expected)
    mask = t.attention_mask(4)
    assert mask.shape == (7, 11) and mask[:, :4].all() and torch.equal(mask[:, 4:], expected)
    # the order written does not matter: nodes are numbered breadth-first, as vLLM sorts them
    assert Tree.from_vllm("[(0, 0, 0), (0, 1), (2,), (1, 0), (0,), (0, 0), (1,)]") == t
    assert Tree.from_vllm([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]) == t


@pytest.mark.parametrize("gamma", [0, 1, 5])
def test_the_chain_is_the_causal_chain(gamma):
    """The decode loop places the verifying forward's tokens [last, d_0..d_γ-1] at start + t, start = L - 1
    (L committed tokens): drafts at L + j over a causal mask."""
    L = 7
    t = Tree.chain(gamma)
    assert t.parents == tuple(range(-1, gamma - 1)) and t.paths() == ([tuple(range(gamma))] if gamma else [])
    assert torch.equal(t.positions(L), L + torch.arange(gamma))
    causal = torch.ones(L + gamma, L + gamma, dtype=torch.bool).tril()[L:]  # queries at L.., keys 0..L+γ-1
    assert torch.equal(t.attention_mask(L), causal)
    rooted = t.with_root()
    assert rooted == Tree.chain(gamma + 1)
    assert torch.equal(rooted.positions(L - 1), (L - 1) + torch.arange(gamma + 1))
    assert torch.equal(rooted.attention_mask(L - 1), torch.ones(L + gamma, L + gamma, dtype=torch.bool).tril()[L - 1:])


def test_with_root_places_the_root_before_the_tree():
    t = Tree.from_vllm(SPEC).with_root()
    assert t.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert t.positions(9).tolist() == [9, 10, 10, 10, 11, 11, 11, 12]


def test_topk_depth_keeps_the_best_ranked():
    # k=2, depth=2: rank sums (0,)=0 (0,0)=0 (1,)=1 (0,1)=1 (1,0)=1 (1,1)=2, ties to the shallower then smaller
    assert Tree.topk_depth(2, 2, 4) == Tree.from_vllm("[(0,), (1,), (0, 0), (0, 1)]")
    assert Tree.topk_depth(2, 2, 5) == Tree.from_vllm("[(0,), (1,), (0, 0), (0, 1), (1, 0)]")
    assert Tree.topk_depth(2, 2, 100) == Tree.from_vllm("[(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]")
    assert Tree.topk_depth(1, 4, 100) == Tree.chain(4)
    assert Tree.topk_depth(3, 1, 2) == Tree.from_vllm("[(0,), (1,)]")
    full = Tree.topk_depth(3, 3, 10**6)
    assert len(full) == 3 + 9 + 27 and full.max_depth == 3
    assert all(len(k) == 3 for k in full.children[: 1 + 12]) and not any(full.children[1 + 12:])
    big = Tree.topk_depth(50, 50, 30)  # never enumerates the full 50^50 tree
    assert len(big) == 30 and big.max_depth <= 30


@pytest.mark.parametrize("spec, message", [
    ("[(0,), (1,)", "not a list of tuples"),
    ("[(0,), 3]", "not a list of non-empty tuples"),
    ("[(0,), ()]", "not a list of non-empty tuples"),
    ("[(0,), (True,)]", "not a list of non-empty tuples"),
    ("[]", "has no nodes"),
    ("[(0,), (0, 0), (1, 0)]", r"node \(1, 0\) has no parent \(1,\)"),
    ("[(0,), (1,), (0,)]", r"node \(0,\) is listed twice"),
    ("[(0,), (2,)]", r"node \(2,\) has rank 2 without a sibling of rank 1"),
    ("[(0,), (0, -1)]", "negative rank"),
])
def test_a_bad_vllm_tree_is_refused_in_one_line(spec, message):
    with pytest.raises(SdbenchError, match=message) as e:
        Tree.from_vllm(spec)
    assert "\n" not in str(e.value)


def test_bad_trees_and_budgets_are_refused_in_one_line():
    cases = [
        (lambda: Tree((-1, 1)), "node 1 has parent 1"),
        (lambda: Tree((0,)), "node 0 has parent 0"),
        (lambda: Tree((-1, -2)), "node 1 has parent -2"),
        (lambda: Tree.chain(-1), "at least 0"),
        (lambda: Tree.topk_depth(0, 2, 4), "at least 1"),
        (lambda: Tree.from_vllm(SPEC).within(max_depth=2), "3 levels deep; at most 2"),
        (lambda: Tree.from_vllm(SPEC).within(max_nodes=6), "7 nodes; at most 6"),
    ]
    for build, message in cases:
        with pytest.raises(SdbenchError, match=message) as e:
            build()
        assert "\n" not in str(e.value)
    t = Tree.from_vllm(SPEC)
    assert t.within(max_depth=3, max_nodes=7) is t


def test_a_ragged_batch_pads_to_the_largest_tree():
    trees = [Tree.from_vllm(SPEC), Tree.chain(2), Tree.chain(0)]
    batch = TreeBatch.of(trees)
    assert batch.n_nodes.tolist() == [7, 2, 0] and batch.max_depth == 3
    assert batch.valid.tolist()[1] == [True, True] + [False] * 5 and not batch.valid[2].any()
    assert batch.parents[1].tolist() == [-1, 0, -1, -1, -1, -1, -1]
    assert batch.depth[1].tolist() == [1, 2, 0, 0, 0, 0, 0]
    assert batch.children.shape == (3, 8, 3)
    assert batch.children[0, 0].tolist() == [0, 1, 2] and batch.children[0, 2].tolist() == [5, -1, -1]
    assert batch.children[1, :3].tolist() == [[0, -1, -1], [1, -1, -1], [-1, -1, -1]]
    assert (batch.children[2] == -1).all()
    assert torch.equal(batch.ancestors[0], trees[0].ancestors)
    assert torch.equal(batch.ancestors[1, :2, :2], torch.ones(2, 2, dtype=torch.bool).tril())
    assert torch.equal(batch.ancestors[2], torch.eye(7, dtype=torch.bool))  # padding sees itself only
    assert batch.positions(torch.tensor([10, 5, 3]))[:2].tolist() == [[10, 10, 10, 11, 11, 11, 12],
                                                                      [5, 6, 5, 5, 5, 5, 5]]


# greedy


def _one_hot_logits(best: list[int], V: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(best), V).float()[None]  # [1, N+1, V]


def test_greedy_follows_the_matching_sibling_and_ends_with_the_bonus():
    t = TreeBatch.of([Tree.from_vllm(SPEC)])
    #                     nodes: 0  1  2  3  4  5  6
    draft = torch.tensor([[4, 7, 2, 1, 8, 3, 5]])
    # target argmax per row: root, after node 0..6
    v = verify_tree_greedy(t, draft, _one_hot_logits([7, 9, 3, 9, 9, 9, 6, 9]))
    assert v.path.tolist() == [[1, 5, -1]] and v.accepted.tolist() == [2] and v.next_token.tolist() == [6]
    assert v.committed(draft) == [[7, 3, 6]]  # second sibling, its child (a leaf), the bonus after it
    v = verify_tree_greedy(t, draft, _one_hot_logits([4, 8, 9, 9, 9, 0, 9, 9]))  # node 0, then its 2nd child
    assert v.path.tolist() == [[0, 4, -1]] and v.next_token.tolist() == [0]
    v = verify_tree_greedy(t, draft, _one_hot_logits([4, 1, 9, 9, 2, 9, 9, 9]))  # stops at depth 2: 5 != 2
    assert v.committed(draft) == [[4, 1, 2]]
    v = verify_tree_greedy(t, draft, _one_hot_logits([4, 1, 9, 9, 5, 9, 9, 6]))  # the whole deepest path
    assert v.committed(draft) == [[4, 1, 5, 6]] and v.accepted.tolist() == [3]
    v = verify_tree_greedy(t, draft, _one_hot_logits([0, 9, 9, 9, 9, 9, 9, 9]))  # nothing matches at the root
    assert v.accepted.tolist() == [0] and v.next_token.tolist() == [0] and v.path.tolist() == [[-1, -1, -1]]


def test_greedy_on_chains_is_the_chain_verifier():
    g = torch.Generator().manual_seed(1)
    B, G, V = 500, 4, 3
    draft = torch.randint(V, (B, G), generator=g)
    logits = torch.randn(B, G + 1, V, generator=g)
    n_draft = torch.randint(G + 1, (B,), generator=g)
    n_draft[0] = G
    chain = verify_greedy(draft, n_draft, logits)
    tree = verify_tree_greedy(TreeBatch.of([Tree.chain(n) for n in n_draft.tolist()]), draft, logits)
    assert torch.equal(tree.accepted, chain.accepted) and torch.equal(tree.next_token, chain.next_token)
    assert chain.accepted.float().mean() > 0.3  # the agreement is not all zeros


# sampling: the chain


@pytest.mark.parametrize("deterministic", [False, True])
def test_sampling_on_chains_is_the_chain_verifier(deterministic):
    """Same generator state in, the same verdicts out, row by row (ragged chains included)."""
    g = torch.Generator().manual_seed(2)
    B, G, V = 4000, 4, 5
    q = torch.softmax(torch.randn(B, G + 1, V, generator=g), -1)
    p = torch.softmax(torch.randn(B, G, V, generator=g), -1)
    draft = torch.multinomial(p.flatten(0, 1), 1, generator=g).view(B, G)
    p = None if deterministic else p
    n_draft = torch.randint(G + 1, (B,), generator=g)
    n_draft[0] = G
    chain = verify_sampling(draft, n_draft, p, q, torch.Generator().manual_seed(7))
    tree = verify_tree_sampling(TreeBatch.of([Tree.chain(n) for n in n_draft.tolist()]), draft, p, q,
                                torch.Generator().manual_seed(7))
    assert torch.equal(tree.accepted, chain.accepted) and torch.equal(tree.next_token, chain.next_token)
    assert torch.equal(tree.path, torch.where(torch.arange(G) < chain.accepted[:, None], torch.arange(G), -1))
    assert 0.1 < chain.accepted.float().mean() < 2.5  # some rows accept, some reject


def test_deterministic_children_are_the_one_hot_draft():
    g = torch.Generator().manual_seed(4)
    B, V = 3000, 6
    t = Tree.from_vllm(SPEC)
    q = torch.softmax(torch.randn(B, len(t) + 1, V, generator=g), -1)
    draft = torch.randint(V, (B, len(t)), generator=g)
    one_hot = torch.nn.functional.one_hot(draft, V).float()
    a = verify_tree_sampling(TreeBatch.of([t] * B), draft, None, q, torch.Generator().manual_seed(5))
    b = verify_tree_sampling(TreeBatch.of([t] * B), draft, one_hot, q, torch.Generator().manual_seed(5))
    assert torch.equal(a.path, b.path) and torch.equal(a.next_token, b.next_token)


# sampling: the committed tokens follow the target, depth by depth

V = 6
TRIALS = 40000
ALPHA = 1e-4  # false-alarm rate per chi-square check


def _tables(seed: int, like: list[torch.Tensor] | None = None, levels: int = 4) -> list[torch.Tensor]:
    """levels distribution tables, table d [V]*d + [V]: the next token after a d-token context. like: tables
    to resemble (a draft near the target, so that the deeper levels are reached often)."""
    g = torch.Generator().manual_seed(seed)
    noise = [torch.randn(*([V] * (d + 1)), generator=g) for d in range(levels)]
    if like is None:
        return [torch.softmax(1.5 * z, -1) for z in noise]
    return [torch.softmax(t.log() + z, -1) for t, z in zip(like, noise)]


def _at(table: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    """table's distribution [n, V] after each context ctx [n, d] (d = 0: the same one for all)."""
    if ctx.shape[1] == 0:
        return table.expand(len(ctx), V)
    return table[tuple(ctx.T)]


def _draft_and_score(tree: Tree, P: list[torch.Tensor], Q: list[torch.Tensor], deterministic: bool,
                     g: torch.Generator):
    """TRIALS drafts of `tree`, each node's token from the draft's P after its path's tokens (drawn, or the
    parent's rank-th best for deterministic children); q per row from the target's Q after each node's path."""
    n = TRIALS
    draft = torch.zeros(n, len(tree), dtype=torch.long)
    p = torch.zeros(n, len(tree), V)
    for i, parent in enumerate(tree.parents):
        ctx = draft[:, list(tree.path_to(parent))] if parent >= 0 else draft[:, :0]
        p[:, i] = _at(P[ctx.shape[1]], ctx)
        if deterministic:
            draft[:, i] = p[:, i].sort(dim=-1, descending=True, stable=True).indices[:, tree.rank[i]]
        else:
            draft[:, i] = torch.multinomial(p[:, i], 1, generator=g).squeeze(1)
    q = torch.stack([Q[0].expand(n, V)] + [_at(Q[tree.depth[i]], draft[:, list(tree.path_to(i))])
                                           for i in range(len(tree))], 1)
    return draft, (None if deterministic else p), q


def _committed(tree: Tree, deterministic: bool, seed: int, rows_off_by_one: bool = False) -> torch.Tensor:
    """[TRIALS, D+1] each trial's committed tokens (-1 past them), Q the target's tables. rows_off_by_one: the
    verifier handed q with node i's row at i instead of i + 1 (the root's row stays right)."""
    g = torch.Generator().manual_seed(seed)
    draft, p, q = _draft_and_score(tree, P_TABLES, Q_TABLES, deterministic, g)
    if rows_off_by_one:
        q = q[:, [0] + list(range(len(tree)))]
    v = verify_tree_sampling(TreeBatch.of([tree] * TRIALS), draft, p, q, g)
    tokens = torch.where(v.path >= 0, draft.gather(1, v.path.clamp(min=0)), -1)
    tokens = torch.cat([tokens, torch.full((TRIALS, 1), -1)], 1)
    return tokens.scatter(1, v.accepted[:, None], v.next_token[:, None])


def _depth_statistic(tokens: torch.Tensor, depth: int) -> tuple[float, int]:
    """Chi-square of the depth-th committed token against the target's q after the tokens before it, summed
    over every context seen at least 50 times: (statistic, degrees of freedom)."""
    rows = tokens[:, depth] >= 0
    ctx, nxt = tokens[rows, :depth], tokens[rows, depth]
    code = (ctx * V ** torch.arange(depth)).sum(-1)  # a context as one number
    stat, dof = 0.0, 0
    for c in code.unique().tolist():
        here = code == c
        if here.sum() < 50:
            continue
        counts = torch.bincount(nxt[here], minlength=V).double()
        expected = _at(Q_TABLES[depth], ctx[here][:1])[0].double() * counts.sum()
        stat += float(((counts - expected) ** 2 / expected).sum())
        dof += V - 1
    return stat, dof


Q_TABLES = _tables(12)
P_TABLES = _tables(11, like=Q_TABLES)


@pytest.mark.parametrize("deterministic", [False, True])
def test_committed_tokens_follow_the_target_at_every_depth(deterministic):
    """A three-level tree (three children at the root, two and one below, one at depth three): the first
    committed token follows q at the root, the second given the first q after it, the third given both."""
    tree = Tree.from_vllm(SPEC)
    tokens = _committed(tree, deterministic, seed=21)
    for depth in range(3):
        stat, dof = _depth_statistic(tokens, depth)
        assert dof >= V - 1, f"no context seen often enough at depth {depth}"
        assert stat < chi2.ppf(1 - ALPHA, dof), f"depth {depth}: chi-square {stat:.1f} with {dof} dof"
    reached = (tokens >= 0).sum(-1) - 1
    assert (reached >= 2).float().mean() > 0.15  # the deeper levels are exercised, not only the root


def test_siblings_from_different_drafts_keep_the_target():
    """Each child drawn from its own draft (here: the root's three children from three distributions), each
    rejection taking that child's p off q."""
    g = torch.Generator().manual_seed(31)
    tree = Tree.from_vllm("[(0,), (1,), (2,)]")
    p = torch.softmax(2.0 * torch.randn(3, V, generator=g), -1).expand(TRIALS, 3, V)
    draft = torch.multinomial(p.flatten(0, 1), 1, generator=g).view(TRIALS, 3)
    q = Q_TABLES[0].expand(TRIALS, 4, V)
    v = verify_tree_sampling(TreeBatch.of([tree] * TRIALS), draft, p, q, g)
    first = torch.where(v.accepted > 0, draft.gather(1, v.path[:, :1].clamp(min=0)).squeeze(1), v.next_token)
    counts = torch.bincount(first, minlength=V).double()
    expected = Q_TABLES[0].double() * TRIALS
    assert float(((counts - expected) ** 2 / expected).sum()) < chi2.ppf(1 - ALPHA, V - 1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_rule_that_keeps_q_after_a_rejection_fails_the_check(deterministic, monkeypatch):
    """The check above can fail: the same verifier with q left as it was after each rejection (no residual)."""
    monkeypatch.setattr(sampling, "_residual", lambda q, p, x, inside: q)
    tokens = _committed(Tree.from_vllm(SPEC), deterministic, seed=21)
    stat, dof = _depth_statistic(tokens, 0)
    assert stat > 10 * chi2.ppf(1 - ALPHA, dof), f"chi-square {stat:.1f} with {dof} dof"


def test_a_target_row_off_by_one_fails_the_deeper_checks():
    """The checks past the root can fail too: q rows shifted by one node leave the first token right (the
    root's row is untouched) and put the second off."""
    tokens = _committed(Tree.from_vllm(SPEC), False, seed=21, rows_off_by_one=True)
    stat, dof = _depth_statistic(tokens, 0)
    assert stat < chi2.ppf(1 - ALPHA, dof)
    stat, dof = _depth_statistic(tokens, 1)
    assert stat > 10 * chi2.ppf(1 - ALPHA, dof), f"chi-square {stat:.1f} with {dof} dof"
