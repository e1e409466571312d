"""A run's prompts as token ids, checked against the target's positions."""

from __future__ import annotations

from typing import Protocol

from sdbench.config import RunConfig
from sdbench.data import tasks  # the module, not its names: tests replace tasks.load_prompts
from sdbench.data.turns import Conversations
from sdbench.engine.state import needed_capacity
from sdbench.errors import SdbenchError


class Pair(Protocol):
    """What prompts need of a loaded pair (`models.pair.Pair`, which loads models and so imports this module:
    a protocol here keeps the import one way)."""

    tokenizer: object
    max_positions: int  # the target's positions


def encode_prompts(cfg: RunConfig, pair: Pair, lookahead: int | None = None):
    """The prompts as token ids; refuses any that, with the budget and the deepest lookahead, would run past
    the target's positions."""
    prompts = _load(cfg, pair)
    encoded = [tasks.encode_prompt(p, pair.tokenizer) for p in prompts]
    _positions(cfg, pair, prompts, lookahead)
    return prompts, encoded


def run_positions(cfg: RunConfig, pair: Pair, lookahead: int | None = None) -> int:
    """The most positions a run of cfg writes (every turn, the budget and the lookahead), refused as
    `encode_prompts` refuses when past the target's."""
    return _positions(cfg, pair, _load(cfg, pair), lookahead)


def _load(cfg: RunConfig, pair: Pair):
    return tasks.load_prompts(cfg.dataset, limit=cfg.limit, seed=cfg.sampling.seed, prompt_len=cfg.prompt_len,
                              tokenizer=pair.tokenizer, fields=cfg.fields, depths=cfg.depths)


def _positions(cfg: RunConfig, pair: Pair, prompts, lookahead: int | None) -> int:
    context = Conversations(prompts, pair.tokenizer, cfg.turns).longest(cfg.max_new_tokens)
    ahead = lookahead or cfg.gamma
    longest = needed_capacity(context, cfg.max_new_tokens, ahead)
    if longest > pair.max_positions:
        if needed_capacity(context, cfg.max_new_tokens, 1) <= pair.max_positions:  # the round's drafts are too many
            raise SdbenchError(f"a round drafts up to {ahead} tokens (--gamma, or a token tree's nodes: tree_nodes, "
                               f"else tree_topk x --gamma), so prompt plus --max-new-tokens plus one round need "
                               f"{longest} positions, but {cfg.target} supports {pair.max_positions}: lower --gamma "
                               "or the tree's size")
        raise SdbenchError(f"prompt plus --max-new-tokens needs {longest} positions, but {cfg.target} supports "
                           f"{pair.max_positions}: lower --prompt-len or --max-new-tokens")
    return longest
