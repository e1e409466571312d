"""The token-tree settings a drafter that ranks its candidates takes (a draft model, an EAGLE head, Medusa heads):
`--set tree_topk=K [tree_nodes=N] [tree_dynamic=true]` or `tree_shape="[(0,), (1,), (0, 0)]"`, declared, checked
and turned into the `Tree` (or EAGLE-2's `DynamicTree`) it grows each round in one place."""

from __future__ import annotations

from sdbench.drafting.dynamic import DynamicTree
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError
from sdbench.strategies.spec import Option

TREE_OPTIONS = (
    Option("tree_topk", 0, "0: a chain of --gamma drafts; K >= 1: a token tree --gamma levels deep, each node's "
                           "children the drafter's K likeliest tokens (K = 1: the chain, as a tree)"),
    Option("tree_nodes", 0, "most nodes of a tree_topk tree, kept in rank order (0: tree_topk x gamma)"),
    Option("tree_shape", "", "a static tree in vLLM's notation, e.g. [(0,),(1,),(0,0)] (at most --gamma levels): "
                             "a rank-r child is the drafter's (r+1)-th likeliest token", str),
    Option("tree_dynamic", False, "EAGLE-2's dynamic tree: at each level expand the tree_topk nodes of highest "
                                  "cumulative draft probability, then keep the best tree_nodes by it (not by "
                                  "rank): a shape per row and round", bool),
)
TREE_SETTINGS = tuple(o.name for o in TREE_OPTIONS)


def tree_setting(name: str, gamma: int, tree_topk: int, tree_nodes: int, tree_shape: str,
                 tree_dynamic: bool = False) -> Tree | DynamicTree | None:
    """The token tree strategy `name` is asked to grow each round (None: the chain; a DynamicTree: a shape
    chosen per row and round); raises on impossible settings, in one line."""
    if tree_topk < 0 or tree_nodes < 0:
        raise SdbenchError(f"{name}: --set tree_topk and tree_nodes must be at least 0 (got tree_topk={tree_topk}, "
                           f"tree_nodes={tree_nodes})")
    if tree_nodes and not tree_topk:
        raise SdbenchError(f"{name}: --set tree_nodes is the node budget of a tree_topk tree: set tree_topk too")
    if tree_topk and tree_shape:
        raise SdbenchError(f"{name}: --set tree_topk and tree_shape each give the tree: set one")
    if tree_dynamic and tree_shape:
        raise SdbenchError(f"{name}: --set tree_dynamic grows a new shape every round, tree_shape is a static one: "
                           "set one")
    if tree_dynamic and not tree_topk:
        raise SdbenchError(f"{name}: --set tree_dynamic expands tree_topk children per node: set tree_topk too")
    if tree_shape:
        tree = Tree.from_vllm(tree_shape)
        if tree.max_depth > gamma:
            raise SdbenchError(f"{name}: --set tree_shape is {tree.max_depth} levels deep, deeper than --gamma "
                               f"{gamma}")
        return tree
    if tree_dynamic:
        return DynamicTree(tree_topk, gamma, tree_nodes or tree_topk * gamma)
    if tree_topk:
        return Tree.topk_depth(tree_topk, gamma, tree_nodes or tree_topk * gamma)
    return None


def tree_params(options: dict) -> dict:
    """The tree settings a result row records: those set (none for the chain)."""
    return {k: options[k] for k in TREE_SETTINGS if options.get(k)}


def widest(tree: Tree | DynamicTree) -> int:
    """The most children of one node: the ranks a drafter must tell apart."""
    if isinstance(tree, DynamicTree):
        return tree.widest
    return max(len(kids) for kids in tree.children)
