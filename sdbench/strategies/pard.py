"""PARD (parallel draft models; vLLM's parallel drafting with a draft model): a small draft model trained to
predict masked positions drafts the whole chain in one forward over the context followed by gamma - 1 mask tokens
(drafting/model.py `draft_parallel`). The mask token is the draft's `pard_token` (or `ptd_token_id`) from its
config.json, or --set mask_token=ID."""

from __future__ import annotations

import json
from pathlib import Path

from sdbench.drafting.model import ModelDrafter
from sdbench.errors import SdbenchError
from sdbench.strategies.base import FixedLookahead
from sdbench.strategies.spec import BuildContext, Option, Strategy, need_gamma, register

MASK_KEYS = ("pard_token", "ptd_token_id")  # where a parallel draft model's config names its mask token


class ParallelDraftModel(FixedLookahead):
    """A draft model drafting gamma tokens per round in one forward over mask tokens."""

    name = "pard"

    def __init__(self, runner, gamma: int, mask_token: int):
        super().__init__(ModelDrafter(runner, mask_id=mask_token), gamma)
        self.mask_token = mask_token

    @property
    def max_lookahead(self) -> int:
        # a row that fed fewer context tokens than another still writes the batch's width of slots, masks included
        return 2 * self.gamma

    def params(self) -> dict:
        return {"gamma": self.gamma, "mask_token": self.mask_token}


def config_mask(config: dict) -> int | None:
    """The mask token a parallel draft model's config names (None: none)."""
    return next((config[k] for k in MASK_KEYS if isinstance(config.get(k), int)), None)


@register
class PardStrategy(Strategy):
    name = "pard"
    help = ("PARD: a parallel draft model (--draft) drafts gamma tokens in one forward over mask tokens (its "
            "config's pard_token, or --set mask_token=ID)")
    options = (Option("mask_token", -1, "the draft's mask token id (-1: its config's pard_token)"),)
    needs_draft = model_draft = True
    proposer = ParallelDraftModel

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
        mask = options.get("mask_token", -1)
        if mask < -1:
            raise SdbenchError(f"--set mask_token={mask}: a token id (or -1: the draft's config's pard_token)")
        folder = Path(drafts[0]).expanduser() if drafts else None
        if mask == -1 and folder is not None and (folder / "config.json").is_file():
            if config_mask(json.loads((folder / "config.json").read_text())) is None:
                raise SdbenchError(f"--draft {drafts[0]}: its config.json names no pard_token (the mask token a "
                                   "parallel draft model predicts at): give --set mask_token=ID")

    @classmethod
    def build(cls, ctx: BuildContext) -> ParallelDraftModel:
        runner = ctx.drafts[0]
        mask = ctx.options["mask_token"]
        if mask == -1:
            config = getattr(runner, "config", None) or getattr(getattr(runner, "model", None), "config", None)
            mask = config_mask(config.to_dict() if config is not None else {})
        if mask is None:
            raise SdbenchError(f"--draft {runner.name}: its config names no pard_token (the mask token a parallel "
                               "draft model predicts at): give --set mask_token=ID")
        if not 0 <= mask < runner.vocab_size:
            raise SdbenchError(f"--set mask_token={mask}: not one of the draft's {runner.vocab_size} tokens")
        return ParallelDraftModel(runner, ctx.gamma, mask)

    @classmethod
    def search_space(cls, trial, space) -> tuple:
        return trial.suggest_int("gamma", 1, 8), {}
