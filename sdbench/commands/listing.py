"""`sdbench list`: what is registered, with availability where it depends on this machine."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from sdbench.data.files import FORMATS
from sdbench.data.specs import task_registry
from sdbench.data.tasks import dataset_available
from sdbench.errors import SdbenchError
from sdbench.models.loading.aliases import drafts_of
from sdbench.models.forward.families import serving
from sdbench.models.heads.registry import known_heads, same_model
from sdbench.models.loading.loader import load_config, model_available, model_registry
from sdbench.models.loading.shapes import parameter_count, size_label
from sdbench.presets import read_presets
from sdbench.strategies import strategy_registry

KINDS = ("strategies", "datasets", "models", "engines")


def _mark(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[yellow]no[/yellow]"


def show(what: str, console: Console) -> None:
    kind = what.lower().rstrip("s")
    if kind == "strategie":
        console.print(_strategies())
    elif kind == "dataset":
        console.print(_file_formats(_available("datasets", *_datasets())))
    elif kind == "model":
        console.print(_models())
    elif kind == "engine":
        console.print(_engines())
    else:
        raise SdbenchError(f"cannot list '{what}': choose one of {', '.join(KINDS)}")


def _engines() -> Table:
    """The engines `bench --engine` drives: installed here or not, where, how to install, what each runs."""
    from sdbench.servers.known import all_engines

    table = Table(title="engines (bench --engine NAME; sdbench's own runner is --engine sdbench, the default)")
    for col in ("name", "installed", "where", "install (in sdbench's checkout)", "runs (sdbench strategy: theirs)"):
        table.add_column(col)
    for e in all_engines():
        runs = ", ".join(f"{mine}: {theirs}" for mine, theirs in e.own_names.items())
        table.add_row(e.name, _mark(e.installed()), _home(str(e.executable())), e.install, runs)
    return table


def _strategies() -> Table:
    table = Table(title="strategies")
    for col in ("name", "aliases", "needs draft", "settings (--set)", "description"):
        table.add_column(col)
    for e in strategy_registry:
        declared = e.load()
        settings = ", ".join(f"{o.name}={o.default}" for o in declared.options) or "-"
        table.add_row(e.name, ", ".join(e.aliases), "yes" if declared.needs_draft else "no", settings,
                      e.description)
    for name, spec in read_presets().items():
        kind = "schedule" if spec.get("schedule") else "preset"  # a schedule: `sdbench schedule show NAME`
        table.add_row(name, "", "", f"{kind} of {spec.get('strategy')}", str(spec.get("description", "")))
    return table


def _datasets():
    return task_registry, dataset_available


def _file_formats(table: Table) -> Table:
    """Prompt files a user can pass as --dataset PATH, one row per format."""
    table.add_section()
    for name, what in FORMATS:
        table.add_row(name, "", _mark(True), "--dataset PATH (--prompt-field / --category-field / --id-field)", what)
    return table


def _models() -> Table:
    """One row per alias: its shape from the shipped config (no hub), the runner that serves it, its drafts and
    the heads train-head recorded for it; then a row per other target (a folder, a hub id) that has heads."""
    table = Table(title="models")
    for col in ("name", "family", "size", "runner", "drafts", "heads", "offline now", "how / why"):
        table.add_column(col, overflow="fold")
    heads: dict[str, list[str]] = {}  # target (one name per model) -> its heads, one line each
    for h in known_heads():
        heads.setdefault(same_model(h.get("target", "")), []).append(f"{h.get('kind')} {_home(h['path'])}")
    for e in model_registry:
        try:
            config = load_config(e.name)
        except SdbenchError:
            family, size, runner = "?", "?", "?"
        else:
            family, size, runner = config.model_type, size_label(parameter_count(config, cached=True)), serving(config).runner
        ok, how = model_available(e.name)
        name = ", ".join((e.name, *e.aliases))
        table.add_row(name, family, size, runner, ", ".join(drafts_of(e.name)) or "-",
                      "\n".join(heads.pop(e.name, ())) or "-", _mark(ok), how)
    if heads:
        table.add_section()
    for target, lines in sorted(heads.items()):
        table.add_row(target, "", "", "", "", "\n".join(lines), "", "a target named by folder or hub id")
    return table


def _home(path: str) -> str:
    """A path under the home folder as ~/..."""
    home = str(Path.home())
    return "~" + path[len(home):] if path.startswith(home + "/") else path


def _available(title: str, registry, check) -> Table:
    table = Table(title=title)
    for col in ("name", "aliases", "offline now", "how / why", "description"):
        table.add_column(col, overflow="fold")
    for e in registry:
        ok, how = check(e.name)
        table.add_row(e.name, ", ".join(e.aliases), _mark(ok), how, e.description)
    return table
