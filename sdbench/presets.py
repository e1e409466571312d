"""Named strategy presets: a strategy with saved settings, one YAML file each, read from two folders.

The shipped folder (`strategies/*.yaml` beside `tasks/`) is read-only; the user's folder
(`$SDBENCH_CONFIG/strategies`, by default `~/.config/sdbench/strategies`) is where `sdbench tune` writes. On a
name clash the user's preset wins.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from sdbench.paths import config_dir, repo_root


def shipped_dir() -> Path:
    return repo_root() / "strategies"


def user_dir() -> Path:
    return config_dir("strategies")


def read_presets() -> dict[str, dict]:
    """Lower-cased preset name -> its spec, the user's folder read last so that its presets win."""
    found = {}
    for folder in (shipped_dir(), user_dir()):
        for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            spec = yaml.safe_load(path.read_text()) or {}
            found[str(spec.get("name", path.stem)).lower()] = spec
    return found
