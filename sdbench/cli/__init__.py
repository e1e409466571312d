"""The command line: thin commands over the engine. Known errors print one line and exit non-zero.

The commands live by group (measure.py: run, sweep, tune, bench, gpu-check; models.py: check, train-head,
datastore; results.py: list, report, profile, compare, site, schedule; predict.py: predict, simulate, reproduce) and are
registered on the one `app` here, in the order `sdbench --help` lists them."""

from __future__ import annotations

import signal
import sys
import threading

import typer
from rich.console import Console
from rich.markup import escape

from sdbench.cli import measure, models, predict, results
from sdbench.errors import SdbenchError

# Each command imports its command module (and what else it runs) inside its own function: those modules load
# torch, transformers or pandas, which `sdbench --help` and a light command (`predict speedup`) need not load.
# Only light modules are imported at the top.

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Benchmark and tune speculative decoding of language models.")
for name, command in (("run", measure.run), ("sweep", measure.sweep), ("check", models.check),
                      ("list", results.list_), ("report", results.report), ("profile", results.profile),
                      ("tune", measure.tune),
                      ("train-head", models.train_head), ("compare", results.compare), ("site", results.site),
                      ("bench", measure.bench),
                      ("gpu-check", measure.gpu_check), ("reproduce", predict.reproduce)):
    app.command(name)(command)
for name, group in (("schedule", results.schedule_app), ("datastore", models.datastore_app),
                    ("predict", predict.predict_app), ("simulate", predict.simulate_app)):
    app.add_typer(group, name=name)


INTERRUPTED = 130  # the exit status of an interrupted command (128 + SIGINT)


def _terminated(signum, frame) -> None:
    """SIGTERM (a `timeout`, a CI job cancelled) as Ctrl-C: finished results kept, servers sdbench started stopped."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    err = Console(stderr=True)
    main_thread = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        code = typer.main.get_command(app).main(args=argv, prog_name="sdbench", standalone_mode=False)
    except SdbenchError as e:  # escaped: a message may hold brackets, e.g. pip install 'sdbench[ray]'
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("[red]error:[/red] interrupted", highlight=False)
        sys.exit(INTERRUPTED)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.TyperException as e:  # usage errors: unknown option, bad value, missing argument
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        if message:  # empty when help was shown for a bare command
            err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
        sys.exit(getattr(e, "exit_code", 2) or 2)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code == INTERRUPTED:  # Ctrl-C (or SIGTERM) in a command: typer answers it with a silent Exit(130)
        err.print("[red]error:[/red] interrupted", highlight=False)
    if isinstance(code, int) and code:  # a command's typer.Exit(code) comes back as the return value here
        sys.exit(code)
