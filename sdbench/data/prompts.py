"""A run's prompts as token ids, checked against the target's positions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdbench.config import RunConfig
from sdbench.engine.state import needed_capacity
from sdbench.errors import SdbenchError

if TYPE_CHECKING:
    from sdbench.models.pair import Pair


def encode_prompts(cfg: RunConfig, pair: "Pair", lookahead: int | None = None):
    """The prompts as token ids; refuses any that, with the budget and the deepest lookahead, would run past
    the target's positions."""
    from sdbench.data.tasks import encode_prompt, load_prompts
    from sdbench.data.turns import Conversations

    prompts = load_prompts(cfg.dataset, limit=cfg.limit, seed=cfg.sampling.seed, prompt_len=cfg.prompt_len,
                           tokenizer=pair.tokenizer, fields=cfg.fields, depths=cfg.depths)
    encoded = [encode_prompt(p, pair.tokenizer) for p in prompts]
    context = Conversations(prompts, pair.tokenizer, cfg.turns).longest(cfg.max_new_tokens)
    longest = needed_capacity(context, cfg.max_new_tokens, lookahead or cfg.gamma)
    if longest > pair.max_positions:
        raise SdbenchError(f"prompt plus --max-new-tokens needs {longest} positions, but {cfg.target} supports "
                           f"{pair.max_positions}: lower --prompt-len or --max-new-tokens")
    return prompts, encoded
