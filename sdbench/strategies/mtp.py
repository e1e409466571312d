"""MTP: the target's own multi-token-prediction module (--head, the speculators format; models/heads/mtp.py)
drafts as an EAGLE head does, from the target's final-norm state: a chain of gamma module steps, or a token tree
(tree_topk, tree_shape, tree_dynamic)."""

from __future__ import annotations

from sdbench.strategies.eagle import HeadStrategy, check_width, eagle_head
from sdbench.strategies.spec import register


@register
class MTPStrategy(HeadStrategy):
    name = "mtp"
    help = ("the target's multi-token-prediction module (--head, speculators format) drafting a chain from its "
            "final state, one module step per draft; tree_topk=K or tree_shape=... grows a token tree")
    head_kinds = ("mtp",)

    @classmethod
    def drafter(cls, head, target, gamma: int, tree=None, options: dict | None = None):
        from sdbench.drafting.heads import EagleDrafter
        from sdbench.models.heads.mtp import MTPHead

        forward = eagle_head(head, target, MTPHead)
        check_width(head.name, tree, forward.vocab_size)
        return EagleDrafter(forward, head.name, head.layers, tree)
