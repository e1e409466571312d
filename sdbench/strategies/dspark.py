"""DSpark: DFlash's block drafter (strategies/dflash.py) with a Markov head, so each draft of the block sees the
one before it, and a confidence head, whose predicted acceptance decides how many of a round's gamma drafts are
verified (--set confidence=P: a row verifies its leading drafts whose predicted reach, the chance that every
draft up to them is accepted, is at least P; 0 verifies all gamma)."""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.strategies.dflash import DFlashStrategy
from sdbench.strategies.spec import Option, SearchContext, register

CONFIDENCES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)  # what `tune` tries


@register
class DSparkStrategy(DFlashStrategy):
    name = "dspark"
    help = ("DSpark block drafter (--head, speculators format): DFlash's one-forward block, each draft biased by "
            "the one before it, a confidence head choosing how many of the gamma drafts are verified")
    head_kinds = ("dspark",)
    options = (Option("head", "", "the DSpark head: a folder or a hub id (also --head)", str),
               Option("confidence", 0.1, "verify a draft while the predicted chance that it and every draft "
                      "before it are accepted is at least this (0: every draft up to gamma)", float))

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        if not 0.0 <= options.get("confidence", 0.1) < 1.0:
            raise SdbenchError(f"--set confidence={options['confidence']}: must be at least 0 and below 1")
        super().validate(gamma, options, drafts, sampling)

    @classmethod
    def drafter(cls, head, target, gamma: int, tree=None, options: dict | None = None):
        from sdbench.models.heads.dspark import DSparkHead

        confidence = (options or {}).get("confidence", 0.1)
        return cls.block_drafter(DSparkHead, head, target, confidence if head.markov["confidence"] else 0.0)

    @classmethod
    def search_space(cls, trial, space: SearchContext) -> tuple:
        gamma, options = super().search_space(trial, space)
        return gamma, {**options, "confidence": trial.suggest_categorical("confidence", list(CONFIDENCES))}
