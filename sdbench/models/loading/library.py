"""The library's loading calls (transformers' Auto classes) and their errors turned into one user line."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors import SafetensorError, safe_open

from sdbench.errors import SdbenchError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase



@contextlib.contextmanager
def as_user_error(name: str, folder: Path | None = None) -> Iterator[None]:
    """transformers reports unreadable checkpoints as OSError/ValueError/KeyError, and safetensors a corrupt
    weights file as its own SafetensorError (which names no file); make each one user line."""
    try:
        yield
    except SafetensorError as err:
        bad = unreadable_safetensors(folder) if folder is not None else None
        what = f"{bad} is not a readable safetensors file" if bad else "a safetensors file is unreadable"
        raise SdbenchError(f"model '{name}' could not be loaded: {what} ({first_line(err)})") from err
    except (OSError, ValueError, KeyError) as err:
        raise SdbenchError(f"model '{name}' could not be loaded: {first_line(err)}") from err


def unreadable_safetensors(folder: Path) -> Path | None:
    """The first of the folder's safetensors files whose header does not parse (reads headers only)."""
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError):
            return path
    return None


def first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def auto_tokenizer(ref: str, **kwargs) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer  # transformers: slow to import, and only loading needs it

    return AutoTokenizer.from_pretrained(ref, **kwargs)


# model types the library has no class for, whose main model is another type's: MiMo is Qwen2 plus MTP layers
# (the library drops them; models/heads/mtp_native.py reads them)
STAND_INS = {"mimo": "qwen2"}


def auto_config(ref: str, **kwargs) -> "PretrainedConfig":
    from transformers import AutoConfig  # transformers: slow to import, and only loading needs it

    try:
        return AutoConfig.from_pretrained(ref, **kwargs)
    except ValueError:  # a type the library does not recognise: the one it stands in for, if it is one
        config = _stand_in(ref, **kwargs)
        if config is None:
            raise
        return config


def auto_model(ref: str, dtype: torch.dtype, **kwargs) -> "PreTrainedModel":
    # transformers: slow to import, and only loading needs it
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # sdbench shows its own status while loading; the library's per-tensor bars would interleave with it
    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, **kwargs)
    except ValueError:  # a type the library does not recognise: loaded as the one it stands in for, if it is one
        config = _stand_in(ref, **kwargs)
        if config is None:
            raise
        return AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, config=config, **kwargs)


def _stand_in(ref: str, **kwargs) -> "PretrainedConfig | None":
    """The config of a model whose type the library lacks, as the type it stands in for (`STAND_INS`); None for
    any other model (or a config not readable here: the library's own error stands)."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(ref, **kwargs)
    except (OSError, ValueError):
        return None
    kind = STAND_INS.get(config.get("model_type"))
    if kind is None:
        return None
    return AutoConfig.for_model(kind, **{k: v for k, v in config.items()
                                         if k not in ("model_type", "architectures", "auto_map")})
