"""The fidelity probe's verdicts, kept so that the same weights are probed once, not on every run.

A verdict depends on the weights, the dtype, the device, the forward path (runner kind, CPU packing or CUDA
graphs), the code that computes the model (sdbench's runner, the library's reference forward, torch) and the
longest context probed. All but the last make the key; a verdict is reused for a run whose context is at
most the one it probed, and is replaced by a probe over a longer one. Only measured verdicts are kept (a
probe that could not run at all, e.g. out of memory, is not).

The weights are fingerprinted by where they were read from, at no cost: the weight files of the folder the
model was loaded from (a local folder, the hub cache's snapshot, the safetensors a GGUF was de-quantised to; a
GGUF file read as its own blocks is its own file),
by path, size and modification time; a MODEL@random by its name and config (its values follow from them and
the seed in sdbench's code, which the key holds too). A model with no such files (built in memory) by its
values: per tensor its name, shape, dtype, its sum and 2-norm in float64 and its first and last values (a
pass over the weights: seconds per GB on a small CPU).

Verdicts live in $SDBENCH_PROBES, else the sdbench cache's `probes/` folder, one JSON file per key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import sdbench
from sdbench.env import _gpu, _version, cpu_name
from sdbench.models.forward import cpufast
from sdbench.models.loading.names import FILE_ATTR, RANDOM, split_variant
from sdbench.paths import cache_dir

EDGE = 64  # values of each tensor's start and end that enter the fingerprint as they are
CODE = ("models/forward", "models/probing", "kv")  # sdbench's folders whose code computes the model (the runner, the probe, the caches)


def weights_fingerprint(model, name: str = "") -> str:
    """A digest of the model's weights (see the module docstring)."""
    if split_variant(name)[1] == RANDOM:
        return "random:" + hashlib.sha256(f"{name}|{model.config.to_json_string()}".encode()).hexdigest()[:32]
    files = weight_files(model)
    if files:
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        return "files:" + hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:32]
    return "values:" + values_fingerprint(model)


def weight_files(model) -> list[Path]:
    """The weight files a model was loaded from (the GGUF file whose blocks it holds, its folder, or the hub
    cache's snapshot of its id); [] when none is found."""
    own = getattr(model, FILE_ATTR, None)
    if own:
        return [Path(own)]
    where = str(getattr(model, "name_or_path", "") or "")
    folder = Path(where) if where else None
    if folder is None or not folder.is_dir():
        folder = _hub_snapshot(where) if where else None
    if folder is None:
        return []
    return sorted(p for ext in ("*.safetensors", "*.bin", "*.pt") for p in folder.glob(ext))


def _hub_snapshot(repo: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache  # only for a model loaded by hub id

        found = try_to_load_from_cache(repo, "config.json")
    except Exception:  # noqa: BLE001 - not an id the hub library reads: no files to name
        return None
    return Path(found).parent if isinstance(found, str) else None


@torch.inference_mode()
def values_fingerprint(model) -> str:
    """A digest of the model's weight values (see the module docstring), read in the library's layout."""
    h = hashlib.sha256()
    seen = set()
    with cpufast.plain(model):
        for name, t in model.state_dict().items():
            if t.data_ptr() in seen or t.numel() == 0:  # tied weights are one tensor
                continue
            seen.add(t.data_ptr())
            flat = t.detach().reshape(-1)
            stats = torch.stack((flat.sum(dtype=torch.float64),
                                 torch.linalg.vector_norm(flat, dtype=torch.float64)))
            edges = torch.cat((flat[:EDGE], flat[-EDGE:])).float().cpu()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            h.update(stats.cpu().numpy().tobytes() + edges.numpy().tobytes())
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """A digest of the source of sdbench's model-computing folders (a changed runner is probed again)."""
    h = hashlib.sha256(sdbench.__version__.encode())
    root = Path(sdbench.__file__).resolve().parent
    for folder in CODE:
        for path in sorted(p for p in (root / folder).rglob("*") if p.suffix in (".py", ".c")):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def runner_key(runner, weights: str) -> dict:
    """Everything a runner's verdict depends on but the context length."""
    device = str(runner.device)
    path = getattr(getattr(runner, "path", None), "kind", "library")
    return {
        "weights": weights,
        "runner": getattr(runner, "kind", "native"),
        "path": path,
        "static": bool(getattr(runner, "static", False)),
        "blocks": getattr(runner, "block_activations", lambda: None)(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": _gpu(device)[0] if device.startswith("cuda") else f"cpu:{cpu_name()}",
        "code": code_fingerprint(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }


@dataclass
class Verdict:
    """A kept probe result: what `ProbeResult` needs to be rebuilt, and when it was measured."""

    length: int
    gaps: dict
    worst: list
    measured: str  # ISO date and time of the probe

    def to_json(self) -> dict:
        return {"length": self.length, "gaps": self.gaps, "worst": list(self.worst), "measured": self.measured}


class ProbeCache:
    """Verdicts on disk by key. mode "auto" reads and writes; "always" only writes (a fresh probe replaces
    the kept one)."""

    def __init__(self, mode: str = "auto", folder: Path | None = None):
        self.mode = mode
        env = os.environ.get("SDBENCH_PROBES")
        self.folder = folder or (Path(env) if env else cache_dir("probes"))
        self._weights: dict[int, str] = {}  # id(model) -> fingerprint, while this cache lives

    def key(self, runner) -> dict:
        model = runner.model
        if id(model) not in self._weights:
            self._weights[id(model)] = weights_fingerprint(model, runner.name)
        return runner_key(runner, self._weights[id(model)])

    def _file(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.folder / f"{digest}.json"

    def get(self, runner, length: int) -> Verdict | None:
        """The kept verdict for this runner over at least `length` positions, or None."""
        if self.mode != "auto":
            return None
        key = self.key(runner)
        try:
            data = json.loads(self._file(key).read_text())
        except (OSError, ValueError):
            return None
        if data.get("key") != key or int(data.get("length", 0)) < length:
            return None
        return Verdict(int(data["length"]), dict(data["gaps"]), list(data["worst"]), data["measured"])

    def put(self, runner, result) -> None:
        """Keep a measured result (never one that failed to run, nor a skipped one). A passing verdict over a
        shorter context than the one kept does not replace it (the same key cannot pass there and fail here)."""
        if result.error or result.skipped:
            return
        key = self.key(runner)
        kept = ProbeCache("auto", self.folder)
        kept._weights = self._weights
        if result.passed and kept.get(runner, result.length + 1) is not None:
            return
        verdict = Verdict(result.length, dict(result.gaps), list(result.worst),
                          time.strftime("%Y-%m-%dT%H:%M:%S"))
        path = self._file(key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, **verdict.to_json()}, indent=1))
            tmp.replace(path)  # whole or not at all, also with two runs writing at once
        except OSError:
            pass  # a read-only cache costs the next run a probe, nothing else
