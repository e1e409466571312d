"""Errors a user can cause. The CLI prints each as one line and exits non-zero."""

from __future__ import annotations


class SdbenchError(Exception):
    """A known failure with a one-line message meant for the user."""

    exit_code = 2


class MissingPackageError(SdbenchError):
    """An optional package is needed; the message carries the exact install command."""

    def __init__(self, package: str, purpose: str, install: str | None = None):
        install = install or f"pip install {package}"
        super().__init__(f"{purpose} needs the package '{package}', which is not installed: run `{install}`")
        self.package = package
        self.install = install


class CheckFailed(SdbenchError):
    """A check that must hold did not (`check`: a probe, a tokenizer, a greedy run; `gpu-check`: a CUDA test, a
    fall back to the eager forward, a real divergence): the report is printed, and this line sums it up."""

    exit_code = 1


class Interrupted(SdbenchError):
    """The user stopped a long run (Ctrl-C); what finished is saved and the message says how to go on."""

    exit_code = 130
