"""The MODEL@VARIANT grammar, on names alone (nothing loads here): `@int8` copies and `@q8_0`/`@q4_0` copies in
llama.cpp's block types (`models/loading/variants.py`), and `@random` weights at a model's shape
(`models/loading/random_weights.py`). `--dtype q8_0|q4_0` names the block copy of every model of a run
(`with_weights`), and a GGUF file of one of those types names its own (read from its header: `gguf_header.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from sdbench.errors import SdbenchError
from sdbench.models.loading import gguf_header

RANDOM = "random"
BLOCK_TYPES = ("q8_0", "q4_0")  # llama.cpp's quantised block types sdbench's own products read
# llama.cpp's K-quant mixes: its server runs them (`--engine llama.cpp`), and `bench` puts sdbench beside it over the
# same weights de-quantised, in float32; sdbench's own runner has no products for them
ENGINE_TYPES = ("q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q3_k_m")
VARIANTS = ("int8", RANDOM, *BLOCK_TYPES)
FILE_ATTR = "sdbench_file"  # a model's own attribute naming the GGUF file whose blocks it holds (the probe keys on it)


def split_variant(name: str) -> tuple[str, str | None]:
    """'base@variant' -> (base, variant); a name without a variant suffix -> (name, None)."""
    base, sep, variant = name.rpartition("@")
    if not sep or not base or "/" in variant or "." in variant:
        return name, None
    if variant not in VARIANTS:
        raise SdbenchError(f"model '{name}': unknown variant '@{variant}' (variants: "
                           f"{', '.join('@' + v for v in VARIANTS)})")
    return base, variant


def is_random(name: str) -> bool:
    return split_variant(name)[1] == RANDOM


def weights_of(names: Iterable[str]) -> str:
    """What a result row records in `weights`: "random" when any of the named models has random weights."""
    return RANDOM if any(is_random(n) for n in names if n) else "real"


def tokenizer_name(name: str) -> str:
    """The model whose tokenizer `name` uses: an @int8 copy its base's; a @random model its own (the base's
    when at hand, else a stand-in: `random_weights.standin_tokenizer`)."""
    base, variant = split_variant(name)
    return base if variant and variant != RANDOM else name


def own_block_type(name: str) -> str | None:
    """The block type a GGUF file's matrices all are (`gguf_header.matrix_type`: Q8_0 or Q4_0), read from its header;
    None for any other model."""
    if not name.endswith(".gguf"):
        return None
    found = gguf_header.matrix_type(Path(name).expanduser().resolve())
    return found if found in BLOCK_TYPES else None


def with_weights(name: str, dtype: str, cpu: bool = True) -> str:
    """The model a run at `dtype` decodes with: MODEL@TYPE where dtype is a block type and the name names no
    variant of its own (a draft's own @q4_0 beside a q8_0 target stays); a GGUF file of a block type at float32 on
    a CPU (`cpu`) as that type, its own blocks (FILE@q4_0); else the name itself."""
    if not name or split_variant(name)[1] is not None:
        return name
    if dtype in BLOCK_TYPES:
        return f"{name}@{dtype}"
    own = own_block_type(name) if cpu and dtype == "float32" else None
    return f"{name}@{own}" if own else name
