"""Medusa-1: k trained heads (--head) draft the next k tokens at once from the target's last hidden state (or
Medusa's token tree over the heads' top-k)."""

from __future__ import annotations

from sdbench.drafting.dynamic import DynamicTree
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError
from sdbench.strategies.eagle import MAX_TUNED_GAMMA, HeadStrategy, check_width
from sdbench.strategies.spec import register


@register
class MedusaStrategy(HeadStrategy):
    name = "medusa"
    help = ("Medusa-1 trained heads (--head) drafting a chain from the target's last hidden state, fixed gamma; "
            "tree_topk=K or tree_shape=... drafts a tree over the heads' top-k, tree_dynamic=true a shape per row and "
            "round (EAGLE-2's selection)")
    head_kinds = ("medusa",)

    @classmethod
    def drafter(cls, head, target, gamma: int, tree: Tree | DynamicTree | None = None, options: dict | None = None):
        from sdbench.drafting.heads import MedusaDrafter
        from sdbench.models.heads.medusa import MedusaHead

        heads = int(head.config["medusa_num_heads"])
        if gamma > heads:
            raise SdbenchError(f"--gamma {gamma}: --head {head.name} has {heads} Medusa heads, one per draft")
        forward = MedusaHead(head, target)
        check_width(head.name, tree, forward.vocab_size)
        return MedusaDrafter(forward, head.name, head.layers, tree)

    @classmethod
    def max_gamma(cls, heads: tuple[str, ...]) -> int:
        """One draft per Medusa head: at most the fewest heads among the candidates (read from their configs)."""
        from sdbench.models.heads.load import medusa_heads

        return min([MAX_TUNED_GAMMA, *(n for n in map(medusa_heads, heads) if n)])
