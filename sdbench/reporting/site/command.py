"""The `sdbench run` command line that reproduces a run, from the configuration it saved beside its results
(`<run_id>.config.json`, a RunConfig as JSON): every setting that differs from run's default, as the flag that sets it.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict

from sdbench.config import RunConfig, SamplingConfig
from sdbench.engine.serving import format_slo

_DEFAULTS = {**asdict(RunConfig()), **asdict(SamplingConfig())}
_PLAIN = ("target", "strategy", "dataset", "limit", "max_new_tokens", "batch_size", "temperature", "top_p", "seed",
          "prompt_len", "device", "dtype", "repeats", "out", "turns", "probe", "engine", "engine_url", "engine_port")
_LISTS = {"gammas": "--gamma", "depths": "--depth", "request_rates": "--request-rate", "concurrencies": "--concurrency"}
_FIELDS = {"prompt": "--prompt-field", "category": "--category-field", "id": "--id-field"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def run_arguments(config: dict) -> list[str]:
    """The flags of `sdbench run` that make this configuration (a saved RunConfig as a dict)."""
    flat = {**config, **config.get("sampling", {})}
    args: list[str] = []
    for name in _PLAIN:
        if name in flat and flat[name] != _DEFAULTS[name]:
            args += [_flag(name), _number(flat[name])]
    for draft in flat.get("drafts") or ():
        args += ["--draft", draft]
    for name, flag in _LISTS.items():
        if flat.get(name):
            args += [flag, ",".join(_number(v) for v in flat[name])]
    for key, value in (flat.get("options") or {}).items():
        args += ["--set", f"{key}={value}"]
    for name, settings in (flat.get("compare") or {}).items():
        args += ["--compare", name] + [x for k, v in settings.items() for x in ("--set", f"{name}.{k}={v}")]
    for key, flag in _FIELDS.items():
        if (flat.get("fields") or {}).get(key):
            args += [flag, flat["fields"][key]]
    if flat.get("slo"):
        args += ["--slo", format_slo(flat["slo"])]
    if flat.get("baseline") is False:
        args.append("--no-baseline")
    if flat.get("fast") is False:
        args.append("--no-fast")
    return args


def run_command(config: dict) -> str:
    """`sdbench run ...` as one shell line."""
    return shlex.join(["sdbench", "run", *run_arguments(config)])
