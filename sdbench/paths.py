"""Where sdbench keeps things: the repository's data folders, the user's configuration and cache."""

from __future__ import annotations

import os
from pathlib import Path

from sdbench.errors import SdbenchError


def repo_root() -> Path:
    """The folder holding tasks/ and strategies/ (the checkout, for an editable install)."""
    env = os.environ.get("SDBENCH_HOME")
    return Path(env) if env else Path(__file__).resolve().parent.parent


def tasks_dir() -> Path:
    return repo_root() / "tasks"


def config_dir(*parts: str) -> Path:
    """The user's own files: $SDBENCH_CONFIG, else $XDG_CONFIG_HOME/sdbench, else ~/.config/sdbench. Not created
    here: only a command that writes there creates it."""
    env = os.environ.get("SDBENCH_CONFIG")
    if env:
        return Path(env).joinpath(*parts)
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config").joinpath("sdbench", *parts)


def cache_dir(*parts: str) -> Path:
    """~/.cache/sdbench (or $SDBENCH_CACHE), created on demand."""
    base = Path(os.environ.get("SDBENCH_CACHE", Path.home() / ".cache" / "sdbench"))
    path = base.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def output_dir(path: str | Path, option: str = "--out") -> Path:
    """A folder to write into, created on demand; a path that cannot be one is a one-line error."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise SdbenchError(f"{option} {path}: a file of that name exists; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SdbenchError(f"{option} {path}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK):
        raise SdbenchError(f"{option} {path}: the folder is not writable")
    return folder
