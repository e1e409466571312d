"""DFlash: a block drafter (--head, in the speculators or z-lab format) fills a block of mask tokens after the
last committed token in one non-causal forward, conditioned on several target layers' hidden states; the first
gamma of the block's drafts are verified each round (at most block_size - 1). A DFlash 2 head (convolutions along
the block, a candidate selector choosing each draft given the one before it) drafts under the same strategy."""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.strategies.eagle import HeadStrategy
from sdbench.strategies.spec import Option, SearchContext, register


@register
class DFlashStrategy(HeadStrategy):
    name = "dflash"
    help = ("DFlash or DFlash 2 block drafter (--head, speculators or z-lab format): one non-causal forward drafts a "
            "whole block from the target's hidden states; gamma: the block's drafts verified per round")
    head_kinds = ("dflash", "dflash2")
    options = (Option("head", "", "the DFlash or DFlash 2 head: a folder or a hub id (also --head)", str),)

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        """A trained head's checks, then gamma within the block (its config read; no weights)."""
        from sdbench.models.heads.load import block_drafts

        super().validate(gamma, options, drafts, sampling)
        most = block_drafts(options["head"])
        if most is not None and gamma > most:
            raise SdbenchError(f"--gamma {gamma}: --head {options['head']} drafts {most} tokens per block")

    @classmethod
    def tree(cls, gamma: int, options: dict):
        return None

    @classmethod
    def drafter(cls, head, target, gamma: int, tree=None, options: dict | None = None):
        from sdbench.models.heads.dflash import DFlashHead
        from sdbench.models.heads.dflash2 import DFlash2Head

        return cls.block_drafter(DFlash2Head if head.kind == "dflash2" else DFlashHead, head, target)

    @staticmethod
    def block_drafter(forward_type, head, target, confidence: float = 0.0):
        """The BlockDrafter over a loaded head's forward (`forward_type`: DFlashHead or one like it)."""
        from sdbench.drafting.block import BlockDrafter

        try:
            forward = forward_type(head, target)
        except (ValueError, KeyError, TypeError) as err:  # the library refuses its layers' config
            line = (str(err).strip() or type(err).__name__).splitlines()[0]
            raise SdbenchError(f"--head {head.name}: its layers' config is not one sdbench reads ({line})") from None
        return BlockDrafter(forward, head.name, head.layers, confidence)

    @classmethod
    def max_gamma(cls, heads: tuple[str, ...]) -> int:
        """Every lookahead up to the fewest drafts per block among the candidates."""
        from sdbench.models.heads.load import block_drafts

        return min((n for n in map(block_drafts, heads) if n), default=1)

    @classmethod
    def search_space(cls, trial, space: SearchContext) -> tuple:
        head = cls.chosen_head(trial, space)
        return trial.suggest_int("gamma", 1, cls.max_gamma((head,))), {"head": head}
