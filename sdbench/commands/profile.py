"""`sdbench profile RESULTS... [--format F] [--out FILE]`: each configuration's speculation profile
(reporting/profile.py) in one of the forms reporting/profile_formats.py registers, printed or written to a file.
Everything the command line decides (the form, the file) is checked before the results are read."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from sdbench.errors import SdbenchError
from sdbench.reporting.profile import configurations, profile_of
from sdbench.reporting.profile_formats import profile_formats
from sdbench.reporting.results import read_results


def write_profile(paths: list[str], fmt: str, out: str | None, run: str | None, strategy: str | None,
                  console: Console) -> None:
    form = profile_formats.entry(fmt)
    path = _out_file(out)
    found = configurations(read_results(paths))
    if not found:
        raise SdbenchError(f"no speculative rows in {', '.join(paths)}: no configuration drafted a token (plain "
                           "decoding only, or files from before per-position counts)")
    picked = [c for c in found if run in (None, c[0]) and strategy in (None, c[1], str(c[2]["method"].iloc[0]))]
    if not picked or (form.meta["one"] and len(picked) > 1):
        said = "no configuration matches --run/--strategy" if not picked else \
            f"--format {form.name} takes one configuration and {len(picked)} match"
        raise SdbenchError(f"{said}; choose one with --run RUN_ID --strategy LABEL among: {_names(found)}")
    profiles = [profile_of(*c) for c in picked]
    text = form.load()(profiles[0] if form.meta["one"] else profiles)
    if path is None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
        return
    _write(path, text + "\n")
    console.print(f"wrote {path} ({form.name}, {len(profiles)} configuration{'s' * (len(profiles) > 1)})",
                  markup=False, highlight=False)


def _out_file(out: str | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.is_dir():
        raise SdbenchError(f"--out {out} is a folder; give the file to write the profile into")
    return path


def _names(found) -> str:
    return ", ".join(f"'{label}' of {run_id}" for run_id, label, _ in found)


def _write(path: Path, text: str) -> None:
    """The whole file or none: written beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        if tmp.exists():  # only the half-written copy this call made
            tmp.unlink()
        raise SdbenchError(f"--out {path}: {e.strerror or e}") from None
