"""Files sdbench writes into a folder the user names, recorded so that a rewrite removes only what sdbench wrote.

A command that fills a whole folder (`sdbench site --out DIR`) builds into a hidden staging folder inside it, then
publishes: the files its previous build recorded and the new build lacks are removed, the new files moved into place,
and the list of them written to `.sdbench-files.json`. Nothing else in the folder is ever removed or overwritten: a
folder holding files no sdbench build recorded is refused before anything is read, and a new file whose path holds a
file of the user's is refused before anything is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from sdbench.errors import SdbenchError

MANIFEST = ".sdbench-files.json"
_STAGING = ".sdbench-staging-"


def recorded(folder: Path) -> set[str] | None:
    """The relative paths the last build recorded in `folder`; None where no build of sdbench's wrote there."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        listed = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SdbenchError(f"{path}: not a list of files sdbench wrote; remove it, or give another folder") from None
    return {name for name in listed if isinstance(name, str) and _inside(folder, name)}


def _inside(folder: Path, name: str) -> bool:
    """Whether a recorded name stays inside the folder (a hand-edited record never reaches outside it)."""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return False
    return (folder / name).resolve().is_relative_to(folder.resolve())


def _visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def check_folder(folder: Path, option: str = "--out") -> None:
    """Refuses, in one line, a folder that holds files no sdbench build recorded (hidden entries such as .git
    aside); a new or empty folder, or one an earlier build wrote, passes."""
    if not folder.is_dir() or recorded(folder) is not None:
        return
    held = _visible(folder)
    if held:
        shown = ", ".join(held[:3]) + (", …" if len(held) > 3 else "")
        raise SdbenchError(f"{option} {folder}: holds files sdbench did not write ({shown}); nothing there is replaced "
                           "or removed: give a new or empty folder, or the folder of an earlier build")


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def publish(staging: Path, folder: Path, option: str = "--out") -> list[str]:
    """Moves the staged build into `folder`: removes the files the previous build recorded that this one lacks,
    refuses (touching nothing) where a new file would replace one no build recorded. Returns the files."""
    old = recorded(folder) or set()
    new = _files(staging)
    clash = [n for n in new if (n not in old and (folder / n).exists()) or (folder / n).is_dir()
             or any(p.exists() and not p.is_dir() for p in (folder / n).parents)]
    if clash:
        raise SdbenchError(f"{option} {folder}: {clash[0]} is not a file an earlier build wrote; nothing was replaced "
                           "(move it, or give another folder)")
    for name in sorted(old - set(new)):
        path = folder / name
        if path.is_file() or path.is_symlink():
            path.unlink()
    for name in new:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, folder / name)
    _prune_empty(folder, old - set(new))
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": new}, indent=1), encoding="utf-8")
    os.replace(tmp, folder / MANIFEST)
    return new


def _prune_empty(folder: Path, gone: set[str]) -> None:
    """The folders the removed files leave empty, deepest first (a folder still holding anything stays)."""
    parents = {p for name in gone for p in Path(name).parents if p != Path(".")}
    for rel in sorted(parents, key=lambda p: len(p.parts), reverse=True):
        path = folder / rel
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()


@contextmanager
def staged(folder: Path):
    """A hidden staging folder inside `folder`, removed afterwards whatever happens (it holds only what the build
    wrote into it)."""
    staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=folder))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
