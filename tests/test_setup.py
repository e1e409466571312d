"""`make setup` installs the versions the tests passed with: constraints.txt pins every dependency, the Makefile
installs through it, and the tests run on exactly those versions (where the pins hold: the Python they name)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def pins() -> list[Requirement]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def test_every_dependency_is_pinned_and_setup_installs_through_the_pins():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [d for extra in ("dev", "plots", "ray", "postgres")
                                        for d in project["optional-dependencies"][extra]]
    pinned = {canonicalize_name(r.name): r for r in pins()}
    for dep in map(Requirement, wanted):
        assert canonicalize_name(dep.name) in pinned, f"{dep.name} is not in constraints.txt: run `make constraints`"
        assert re.fullmatch(r"==[^,*]+", str(pinned[canonicalize_name(dep.name)].specifier)), dep.name
    assert "sdbench" not in pinned
    setup = (ROOT / "Makefile").read_text().split("$(STAMP):")[1].split("\n\n")[0]
    assert "-c $(CONSTRAINTS)" in setup and "CONSTRAINTS := constraints.txt" in (ROOT / "Makefile").read_text()


def test_the_tests_run_on_the_pinned_versions():
    held = [r for r in pins() if r.marker is None or r.marker.evaluate()]
    if not held:
        pytest.skip("constraints.txt pins versions for another Python")
    off = []
    for req in held:
        try:
            installed = Version(metadata.version(req.name))
        except metadata.PackageNotFoundError:
            continue  # pinned for an optional part this environment lacks
        if Version(installed.public) not in req.specifier:
            off.append(f"{req.name} {installed} (pinned {req.specifier})")
    assert not off, ("not the versions the tests passed with: " + ", ".join(off)
                     + "; `make setup` installs the pinned ones, `make upgrade` then `make test` moves the pins on")
