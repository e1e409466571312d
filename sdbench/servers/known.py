"""The engines sdbench drives, by name."""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.servers.engines import SDBENCH, Engine
from sdbench.servers.llamacpp import LlamaCpp
from sdbench.servers.vllm import Vllm


def all_engines() -> list[Engine]:
    return [LlamaCpp(), Vllm()]


def engine(name: str) -> Engine:
    known = {e.name: e for e in all_engines()}
    if name not in known:
        raise SdbenchError(f"unknown engine '{name}': choose one of {SDBENCH}, {', '.join(known)}")
    return known[name]
