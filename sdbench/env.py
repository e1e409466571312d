"""What a result was measured on: recorded with every row, so numbers are never compared blind."""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from sdbench import __version__

try:
    import resource
except ImportError:  # not on Windows
    resource = None

_GIB = 1024**3
# Whether the kernel let this process clear its peak RSS; without it the CPU peak is lifetime-wide.
_RSS_RESET = {"done": False}


def environment(device: str, dtype: str) -> dict:
    """Everything recorded with every result. Never raises: unknown facts are None."""
    cpu = cpu_name()
    cores = os.cpu_count()
    memory = total_memory()
    gpu, gpu_memory = _gpu(device)
    return {
        "device": device,
        "dtype": dtype,
        "python_version": platform.python_version(),
        "torch_version": _version("torch"),
        "transformers_version": _version("transformers"),
        "sdbench_version": __version__,
        "git_commit": git_commit(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": cores,
        "threads": _torch_threads(),
        "memory_bytes": memory,
        "gpu": gpu,
        "gpu_memory_bytes": gpu_memory,
        "hardware": hardware_fingerprint(device, cpu, cores, memory, gpu),
    }


def hardware_fingerprint(device: str, cpu: str | None, cores: int | None, memory: int | None,
                         gpu: str | None) -> str:
    """A short stable key for 'this machine': tuning studies are stored per fingerprint."""
    kind = device.split(":", 1)[0]
    if kind == "cuda" and gpu:
        return f"cuda:{gpu}"
    mem = f"{round(memory / _GIB)}GiB" if memory else "?"
    return f"{kind}:{cpu or '?'} x{cores or '?'}/{mem}"


@functools.lru_cache(maxsize=None)
def git_commit(path: str | None = None) -> str | None:
    """Short sha of the sdbench checkout, '-dirty' when tracked files have uncommitted changes (untracked ones, a
    results or work folder say nothing of the code that ran); None outside git."""
    where = path or str(Path(__file__).resolve().parent.parent)
    sha = _git(where, "rev-parse", "--short", "HEAD")
    if not sha:
        return None
    status = _git(where, "status", "--porcelain", "--untracked-files=no")
    # An unreadable status must not claim a clean tree.
    return sha if status == "" else f"{sha}-dirty"


def _git(where: str, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", where, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return _squash(line.split(":", 1)[1])
    except OSError:
        pass
    return _squash(platform.processor() or platform.machine()) or None


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@functools.lru_cache(maxsize=None)
def total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _torch_threads() -> int:
    return torch.get_num_threads()


def _gpu(device: str) -> tuple[str | None, int | None]:
    try:
        if not device.startswith("cuda") or not torch.cuda.is_available():
            return None, None  # the GPU a run used: none for a CPU run, even on a machine that has one
        index = torch.device(device).index
        props = torch.cuda.get_device_properties(index or 0)
        return props.name, int(props.total_memory)
    except Exception:  # a broken driver must not stop a CPU run from being recorded
        return None, None


def peak_memory(device: str) -> tuple[int, str]:
    """(bytes, kind). On CPU this is the whole process's peak RSS, model weights included."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    kind = "process_peak_rss" if _RSS_RESET["done"] else "process_peak_rss_lifetime"
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024, kind
    if resource is None:
        return 0, "unavailable"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux but bytes on macOS; it cannot be reset.
    return (peak if sys.platform == "darwin" else peak * 1024), "process_peak_rss_lifetime"


def reset_peak_memory(device: str) -> None:
    """Start a new peak window. On Linux CPU this clears the kernel's RSS high-water mark."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _RSS_RESET["done"] = True
    except OSError:
        _RSS_RESET["done"] = False


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None
