"""What a model and its caches will take in memory, from its config alone, before anything is allocated: which
(batch, context) points of a profile fit beside the weights on a device, and why the others do not."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sdbench.errors import SdbenchError

HEADROOM = 0.9  # of the free memory a plan may use: allocators fragment, the process has other buffers
GIB = 1 << 30


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def kv_bytes(config, batch: int, capacity: int, dtype: torch.dtype) -> int:
    """A dense KV cache of `capacity` positions for `batch` rows: keys and values of every layer."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * batch * kv_heads * head_dim * capacity * element_bytes(dtype)


def working_bytes(config, batch: int, context: int, width: int) -> int:
    """The largest transient buffers of one forward of `width` tokens per row at `context`: float32 logits over
    the vocabulary and one layer's attention scores."""
    return 4 * batch * width * (config.vocab_size + config.num_attention_heads * context)


def free_bytes(device: torch.device) -> int | None:
    """Memory free for this process on the device now (CUDA: the driver's count; CPU: MemAvailable); None if
    it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def refuse_beyond_memory(names: list[str], weights: int, free: int | None, dtype: torch.dtype,
                         device: torch.device, then: str) -> None:
    """The one check that weights fit, before anything is allocated: one line saying what they need and what
    the device has free, when they take more than HEADROOM of it. then: what the command therefore does not do."""
    if free is None or weights <= HEADROOM * free:
        return
    whose = f"{names[0]}: its" if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}: their"
    raise SdbenchError(f"{whose} weights take {weights / GIB:.1f} GiB in {str(dtype).removeprefix('torch.')} and "
                       f"{free / GIB:.1f} GiB are free on {device}: {then}")


@dataclass
class MemoryPlan:
    """Which (batch, context) points fit beside the weights in `free` bytes."""

    weights: int
    free: int | None
    fits: set = field(default_factory=set)  # (batch, context)
    too_big: dict = field(default_factory=dict)  # (batch, context) -> bytes its caches and buffers need

    def line(self) -> str | None:
        """One line naming the points left out, per batch from the shortest context that does not fit, or None."""
        if not self.too_big:
            return None
        first: dict[int, tuple[int, int]] = {}
        for (b, s), need in sorted(self.too_big.items()):
            first.setdefault(b, (s, need))
        said = "; ".join(f"batch {b} from context {s} ({need / GIB:.1f} GiB of KV cache and buffers)"
                         for b, (s, need) in sorted(first.items()))
        return (f"not profiled, as they do not fit in {HEADROOM:.0%} of the {self.free / GIB:.1f} GiB free beside "
                f"the weights' {self.weights / GIB:.1f} GiB: {said}")


def plan(config, params: int, dtype: torch.dtype, device: torch.device, points, capacity_of, width: int) -> MemoryPlan:
    """points: (batch, context) pairs; capacity_of(context): the KV positions a point's caches hold (its sparse
    draft caches are small beside the dense one and ride in the headroom); width: the widest forward's tokens."""
    result = MemoryPlan(params * element_bytes(dtype), free_bytes(device))
    for b, s in points:
        need = kv_bytes(config, b, capacity_of(s), dtype) + working_bytes(config, b, s, width)
        if result.free is None or result.weights + need <= HEADROOM * result.free:
            result.fits.add((b, s))
        else:
            result.too_big[(b, s)] = need
    return result
