"""REST (retrieval drafting): a token tree of the continuations a datastore holds for the context's longest suffix."""

from __future__ import annotations

from sdbench.drafting.retrieval import RetrievalDrafter, check_retrieval
from sdbench.strategies.base import FixedLookahead
from sdbench.strategies.spec import (TREE_NODE_BUDGETS, BuildContext, Option, SearchContext, Strategy, need_gamma,
                                     register)


class Rest(FixedLookahead):
    name = "rest"
    proposes_trees = True

    def __init__(self, drafter: RetrievalDrafter, gamma: int, datastore: str):
        super().__init__(drafter, gamma)
        self.datastore = datastore

    @property
    def max_lookahead(self) -> int:
        return self.drafter.tree_nodes  # a tree's nodes, however deep

    def params(self) -> dict:
        d = self.drafter
        return {"gamma": self.gamma, "datastore": self.datastore, "tree_nodes": d.tree_nodes,
                "max_matches": d.max_matches, "max_suffix": d.max_suffix, "min_suffix": d.min_suffix}


@register
class RestStrategy(Strategy):
    name = "rest"
    help = "retrieval drafting (REST): a tree of a datastore's continuations of the context's suffix (no model)"
    aliases = ("retrieval",)
    options = (
        Option("datastore", "", "the datastore to draft from (`sdbench datastore build NAME --from ...`)", str),
        Option("tree_nodes", 16, "most nodes in a drafted tree: the continuations' most frequent prefixes"),
        Option("max_matches", 5000, "most occurrences of the matched suffix whose continuations are counted"),
        Option("max_suffix", 16, "longest context suffix (tokens) to search for"),
        Option("min_suffix", 2, "shortest context suffix (tokens) to search for"),
    )
    proposer = Rest

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        from sdbench.drafting import datastore
        from sdbench.errors import SdbenchError

        need_gamma(cls.name, gamma)
        check_retrieval(cls.name, options["tree_nodes"], options["max_matches"], options["max_suffix"],
                        options["min_suffix"])
        if not options["datastore"]:
            raise SdbenchError(f"strategy '{cls.name}' needs --set datastore=NAME; make one with "
                               f"`{datastore.build_command('NAME', 'MODEL')}`")
        datastore.need(options["datastore"])

    @classmethod
    def build(cls, ctx: BuildContext) -> Rest:
        from sdbench.drafting import datastore
        from sdbench.errors import SdbenchError

        o = ctx.options
        store = datastore.load(o["datastore"], ctx.tokenizer, ctx.target.name)
        if len(store.tokens) and int(store.tokens.max()) >= ctx.target.vocab_size:
            raise SdbenchError(f"--set datastore={o['datastore']} holds token ids past {ctx.target.name}'s "
                               f"vocabulary of {ctx.target.vocab_size}: it was built for {store.meta.target}")
        drafter = RetrievalDrafter(store.tokens, store.suffixes, o["tree_nodes"], o["max_matches"], o["max_suffix"],
                                   o["min_suffix"])
        return Rest(drafter, ctx.gamma, o["datastore"])

    @classmethod
    def search_space(cls, trial, space: SearchContext) -> tuple:
        """gamma (the tree's depth), the tree's node budget (always: a retrieval tree is no chain, so `tune --trees`
        adds nothing), and the datastore: one of those built (`datastore list`)."""
        from sdbench.drafting import datastore
        from sdbench.errors import SdbenchError

        names = [m.name for m in datastore.known()]
        if not names:
            raise SdbenchError(f"strategy '{cls.name}' needs a datastore to tune with; make one with "
                               f"`{datastore.build_command('NAME', 'MODEL')}`")
        name = names[0] if len(names) == 1 else trial.suggest_categorical("datastore", names)
        return (trial.suggest_int("gamma", 1, 8),
                {"datastore": name, "tree_nodes": trial.suggest_categorical("tree_nodes", list(TREE_NODE_BUDGETS))})
