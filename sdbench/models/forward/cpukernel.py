"""sdbench's own CPU products for float32 (`kernels/products.c`) and for weights in llama.cpp's Q8_0/Q4_0 blocks
(`kernels/quants.c`, `models/forward/quants.py`), built at first use with the machine's C compiler, and the rest of a
Llama layer's decode step around them (`kernels/layer.c`, `models/forward/cpulayer.py`).

One decode step of a model on a CPU is its weights streamed once through matrix-vector products, and the stock
products read them well below the machine's bandwidth at the widths decoding uses (1 row; 2-9 for a draft's
catch-up or a verification): docs/peers.md "Where a CPU decode step's time goes". These read every weight once per
call in one sequential stream per block of 8 outputs (the blocked layout, `pack`), any number of rows, and a weight
in place ([out, n], `linear_plain`, at most 8 rows a pass: a vocabulary head tied to the embedding table).

The library is compiled once per source, compiler, flags and CPU into sdbench's cache (`-O3 -march=native -fopenmp`,
seconds) and loaded with ctypes; its parallel loops run on the OpenMP runtime torch has already loaded (the same
`libgomp.so.1`), with torch's thread count. Where there is no compiler, no AVX2/FMA or the build fails, `available()`
is False, `why_not()` says why, and the fast path uses oneDNN's products instead. `build(variant)` builds the sources
for a narrower instruction set than the machine's (`VARIANTS`), so that a machine that has them all runs each branch
the sources take (tests/test_cpukernel.py); what users run is always `native`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from sdbench.env import cpu_name
from sdbench.models.forward import quants
from sdbench.paths import cache_dir

SOURCES = ("products.c", "layer.c", "quants.c")  # compiled as one unit, in this order
# float32: block weights meet float32 activations even where VNNI's integer products build (the exact product over
# the de-quantised weights, slower); int8 (the default): 8-bit activations where VNNI is there, as llama.cpp computes
ACTIVATIONS_ENV = "SDBENCH_BLOCK_ACTIVATIONS"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]  # and a variant's
PLAIN_ROWS = 8  # rows of x per pass of `linear_plain`
_lib = None
_why: str | None = None  # why the library is not available (None: not tried yet, or loaded)


@dataclass(frozen=True)
class Variant:
    """An instruction set the sources are built for: the compiler's flags for it, and the CPU flags (as /proc/cpuinfo
    names them) a machine needs to run what they build."""

    flags: tuple[str, ...]
    needs: frozenset[str]


_AVX2, _RUNS_AVX2 = ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd")
# What the sources' #ifs select: products.c and layer.c need AVX2 and FMA, which every variant has (the rest is the
# compiler's); quants.c's integer products over 8-bit activations take 512-bit vectors (AVX-512 F, BW and VNNI: 16
# output rows a group), else 256-bit ones (AVX-512 VNNI and VL without BW: its EVEX instruction; or AVX-VNNI's VEX
# one: 8 rows), else none (float32 activations over the blocks as stored). `native` is the machine's own set, the
# only one users build; on an AVX-512 VNNI machine it is the 512-bit branch, and every other variant also runs there
# except `avx-vnni` (a laptop's, Alder Lake's and later), which needs AVX-VNNI itself.
VARIANTS = {
    "native": Variant(("-march=native",), _RUNS_AVX2),
    "avx512-vnni-256": Variant((*_AVX2, "-mavx512vl", "-mavx512vnni"),
                               _RUNS_AVX2 | {"avx512f", "avx512vl", "avx512_vnni"}),
    "avx-vnni": Variant((*_AVX2, "-mavxvnni"), _RUNS_AVX2 | {"avx_vnni"}),
    "avx512": Variant((*_AVX2, *_AVX512), _RUNS_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    "avx2": Variant(_AVX2, _RUNS_AVX2),
}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runs_here(variant: str) -> bool:
    """Whether this CPU has every instruction set `variant` is built for."""
    return VARIANTS[variant].needs <= _cpu_flags()


def _flags(variant: str) -> list[str]:
    mode = os.environ.get(ACTIVATIONS_ENV, "int8").strip().lower()
    if mode not in ("int8", "float32"):
        raise RuntimeError(f"{ACTIVATIONS_ENV}={mode}: use int8 or float32")
    flags = [*FLAGS, *VARIANTS[variant].flags]
    return [*flags, "-DSD_NO_VNNI"] if mode == "float32" else flags


def compiled(variant: str = "native") -> Path:
    """The library built for `variant`, from the cache (keyed by the sources, flags, compiler and CPU) or compiled
    now, whether or not this CPU runs it; raises RuntimeError with the reason."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc; or set CC)")
    sources = [resources.files(__package__).joinpath("kernels", name).read_bytes() for name in SOURCES]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cc} does not run: {e}") from e
    flags = _flags(variant)
    digest = hashlib.sha256(b"\0".join([*sources, " ".join(flags).encode(), version.encode(),
                                        cpu_name().encode()])).hexdigest()[:16]
    folder = cache_dir("cpukernel")
    lib = folder / f"products-{variant}-{digest}.so"
    if not lib.exists():  # each process builds from its own copy into its own file, then moves it in place
        src = folder / f"products-{variant}-{digest}.{os.getpid()}.c"
        src.write_bytes(b"\n".join(sources))  # one unit, in order: the others use products.c's helpers
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        try:
            done = subprocess.run([cc, *flags, "-o", str(tmp), str(src), "-lm"], capture_output=True, text=True,
                                  timeout=300)
        finally:
            src.unlink(missing_ok=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"{cc} failed to build {', '.join(SOURCES)}: {last}")
        tmp.replace(lib)  # whole, or not there: a concurrent build lands the same file
    return lib


def build(variant: str = "native") -> ctypes.CDLL:
    """The library built for `variant` (`VARIANTS`), loaded, its functions declared; raises RuntimeError with the
    reason where this CPU lacks the variant's instructions or the build fails."""
    if not runs_here(variant):
        lacks = ", ".join(sorted(flag.upper() for flag in VARIANTS[variant].needs - _cpu_flags()))
        raise RuntimeError(f"the CPU lacks {lacks}, which the {variant} build needs")
    found = ctypes.CDLL(str(compiled(variant)))
    ptr, n = ctypes.c_void_p, ctypes.c_long
    found.sd_pack.argtypes = found.sd_unpack.argtypes = [ptr, ptr, n, n]
    found.sd_linear_blocked.argtypes = found.sd_linear_plain.argtypes = [ptr, ptr, ptr, ptr, n, n, n]
    found.sd_linear_plain.restype = ctypes.c_int
    found.sd_grouped.restype = ctypes.c_int
    found.group_rows = int(found.sd_grouped())  # asked on every product: read once
    for kind in quants.TYPES:
        getattr(found, f"sd_linear_{kind}").argtypes = [ptr, ptr, ptr, ptr, n, n, n]
        if found.group_rows:
            getattr(found, f"sd_linear_grouped_{kind}").argtypes = [ptr, ptr, ptr, ptr, n, n, n]
    found.sd_rms_norm.argtypes = [ptr, ptr, ptr, n, n, ctypes.c_float]
    found.sd_silu_mul.argtypes = [ptr, ptr, n, n]
    found.sd_attend.argtypes = [ptr] * 6 + [n] * 8 + [ctypes.c_float, ptr]
    return found


def library() -> ctypes.CDLL | None:
    global _lib, _why
    if _lib is None and _why is None:
        try:
            _lib = build()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _why = str(e) or type(e).__name__
    return _lib


def available() -> bool:
    return library() is not None


def why_not() -> str | None:
    """Why the products are not available here (None where they are)."""
    library()
    return _why


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The blocked copy of a float32 [out, n] weight: (out rounded up to 8) * n values, padded with zeros."""
    w = weight.detach().contiguous()
    out, n = w.shape
    blocked = torch.empty(-(-out // 8) * 8 * n, dtype=torch.float32)
    library().sd_pack(w.data_ptr(), blocked.data_ptr(), out, n)
    return blocked


def unpack(blocked: torch.Tensor, out: int, n: int) -> torch.Tensor:
    """The [out, n] weight back from its blocked copy (exactly: values are moved, not rounded)."""
    w = torch.empty(out, n, dtype=torch.float32)
    library().sd_unpack(blocked.data_ptr(), w.data_ptr(), out, n)
    return w


def linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out: int) -> torch.Tensor:
    """x [..., n] W^T (+ bias) -> [..., out], W blocked (`pack`), any number of rows."""
    x = x.contiguous()
    n = x.shape[-1]
    y = x.new_empty(*x.shape[:-1], out)
    library().sd_linear_blocked(x.data_ptr(), blocked.data_ptr(), None if bias is None else bias.data_ptr(),
                                y.data_ptr(), x.numel() // n, n, out)
    return y


def linear_plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., n] W^T (+ bias) -> [..., out], W plain [out, n] read in place, PLAIN_ROWS rows a pass."""
    x = x.contiguous()
    w = weight.detach().contiguous()
    out, n = w.shape
    y = x.new_empty(*x.shape[:-1], out)
    rows = x.numel() // n
    lib, b = library(), None if bias is None else bias.data_ptr()
    for r in range(0, rows, PLAIN_ROWS):
        k = min(PLAIN_ROWS, rows - r)
        lib.sd_linear_plain(x.data_ptr() + r * n * 4, w.data_ptr(), b, y.data_ptr() + r * out * 4, k, n, out)
    return y


def group_rows() -> int:
    """The output rows per group where the integer products over 8-bit activations build here (VNNI: 16 with
    AVX-512, else 8), block weights then grouped so (`quants.group`) and read by them, as llama.cpp's CPU products
    compute; 0 where they do not, the blocks then staying as stored, de-quantised in registers against float32
    activations."""
    return library().group_rows


def grouped() -> bool:
    return group_rows() > 0


def pack_blocks(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A float32 [out, n] weight (on `kind`'s grid) as the blocks `linear_blocks` reads: grouped where `grouped()`."""
    return pack_stored(quants.quantise(weight, kind), kind)


def pack_stored(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Stored blocks [out, n / BLOCK * bytes] (a GGUF file's, or `quants.quantise`'s) as `linear_blocks` reads them."""
    return quants.group(blocks, kind, group_rows()) if grouped() else blocks.contiguous()


def unpack_blocks(packed: torch.Tensor, kind: str, out: int, n: int) -> torch.Tensor:
    """The float32 [out, n] weight `pack_blocks` packed (exactly, for a weight on the grid)."""
    return quants.dequantise(quants.ungroup(packed, kind, out, n, group_rows()) if grouped() else packed, kind)


def linear_blocks(x: torch.Tensor, packed: torch.Tensor, kind: str, bias: torch.Tensor | None,
                  out: int) -> torch.Tensor:
    """x [..., n] W^T (+ bias) -> [..., out], W [out, n] packed by `pack_blocks`, any number of rows."""
    x = x.contiguous()
    n = x.shape[-1]
    y = x.new_empty(*x.shape[:-1], out)
    name = f"sd_linear_grouped_{kind}" if grouped() else f"sd_linear_{kind}"
    getattr(library(), name)(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                             y.data_ptr(), x.numel() // n, n, out)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm over the last dimension of a float32 x."""
    x = x.contiguous()
    n = x.shape[-1]
    y = torch.empty_like(x)
    library().sd_rms_norm(x.data_ptr(), weight.detach().contiguous().data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [..., 2 I] holding gate then up: [..., I]."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    y = gate_up.new_empty(*gate_up.shape[:-1], inter)
    library().sd_silu_mul(gate_up.data_ptr(), y.data_ptr(), gate_up.numel() // (2 * inter), inter)
    return y


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           start: int, n_heads: int, scale: float, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T new tokens per row at slots start..start+T-1 over a dense cache, their keys rotated and
    written with their values into it first: qkv [B, T, (Hq + 2 Hk) D], cos/sin' [B, 1, T, Dr] contiguous (the rotary
    tables, as `cpulayer.tables` makes them), keys/values [B, Hk, capacity, D] (contiguous) -> [B, T, Hq D]. tree:
    the tokens are a token tree's nodes, tree [B, T, T] uint8 (contiguous) holding 1 where node u is node t or one of
    its ancestors (`kv.cache.TreeStep.ancestors`): each node sees the slots before start and its own path."""
    B, T, _ = qkv.shape
    _, n_kv, cap, D = keys.shape
    qkv = qkv.contiguous()
    out = qkv.new_empty(B, T, n_heads * D)
    library().sd_attend(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
                        out.data_ptr(), B, T, n_heads, n_kv, D, cos.shape[-1], start, cap, scale,
                        None if tree is None else tree.data_ptr())
    return out
