"""What sdbench asks of an engine and what comes back, the same for every engine: a role (plain decoding or one of
the engine's own speculative decoders at a lookahead), one reply per prompt (its token ids, timings and the engine's
own acceptance counters), and the adapters' protocol (each engine's in its own module; known.py lists them)."""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from sdbench.config import SamplingConfig
from sdbench.engine.counters import CHAIN, Rounds
from sdbench.errors import SdbenchError
from sdbench.paths import repo_root

SDBENCH = "sdbench"  # --engine's default: sdbench's own runner, no engine started


def engines_dir(*parts: str) -> Path:
    """Where `make engines` installs each engine, in a folder of its own: $SDBENCH_ENGINES, else the checkout's
    .engines/."""
    env = os.environ.get("SDBENCH_ENGINES")
    return (Path(env) if env else repo_root() / ".engines").joinpath(*parts)


@dataclass(frozen=True)
class EngineRole:
    """One system an engine runs: `strategy` (autoregressive, ngram, draft or eagle: the sdbench strategies an engine
    may map to its own decoding, `Engine.own_names`) at lookahead `gamma`, drafting with `draft` (a model name, or a
    head's folder for eagle). synthetic: per-position acceptance rates the engine accepts drafts at instead of
    verifying them (its benchmarking mode; `Engine.synthetic`): sdbench's acceptance, replayed at the engine's costs."""

    strategy: str
    gamma: int = 0
    draft: str | None = None
    synthetic: tuple[float, ...] = ()

    @property
    def speculative(self) -> bool:
        return self.strategy != "autoregressive"

    @property
    def costs_only(self) -> bool:
        """Plain decoding of the draft model: a server started only to measure the draft's step cost."""
        return not self.speculative and self.draft is not None

    def model(self, target: str) -> str:
        """The model the server loads (the draft model, for plain decoding of the draft)."""
        return self.draft if self.costs_only else target

    def loaded(self, target: str) -> list[str]:
        """Every model the server loads: `model`, and a draft model beside it."""
        return [self.model(target)] + ([self.draft] if self.strategy == "draft" else [])


@dataclass
class Reply:
    """One prompt through an engine: the new token ids it returned, timed from the client's side."""

    tokens: list[int]
    seconds: float  # request sent -> stream ended (what sdbench's own rows time: prefill included)
    ttft: float | None  # request sent -> the first event carrying a token
    gaps: list[float]  # seconds between events carrying tokens (inter-token latency; an event may carry several)
    drafted: int | None = None  # the engine's own counters for this request, None where it gives none
    accepted: int | None = None
    accepted_by_position: list[int] | None = None  # vLLM: accepted drafts per draft position


@dataclass
class EngineTotals:
    """An engine system's replies over a measurement, summed the way sdbench's own rows are."""

    engine: str = ""  # the engine's name
    replies: list[Reply] = field(default_factory=list)
    gamma: int = 0  # the role's lookahead: the most drafts a round verifies

    def add(self, reply: Reply) -> None:
        self.replies.append(reply)

    @property
    def drafted(self) -> int | None:
        known = [r.drafted for r in self.replies if r.drafted is not None]
        return sum(known) if known else None

    @property
    def accepted(self) -> int | None:
        known = [r.accepted for r in self.replies if r.accepted is not None]
        return sum(known) if known else None

    @property
    def acceptance(self) -> float | None:
        """The engine's own definition: accepted drafted tokens over drafted tokens."""
        d, a = self.drafted, self.accepted
        return a / d if d and a is not None else None

    @property
    def itl(self) -> float | None:
        gaps = [g for r in self.replies for g in r.gaps]
        return statistics.median(gaps) if gaps else None

    def rounds(self) -> Rounds:
        """The replies' decoding after each first token, in rounds (`analysis/carry.py`, `reply_rounds`)."""
        found = Rounds()
        for r in self.replies:
            if len(r.tokens) < 2 or r.ttft is None:
                continue
            found.add(len(r.tokens) - 1, r.seconds - r.ttft, *reply_rounds(r, self.gamma))
        return found


def reply_rounds(reply: Reply, gamma: int | None) -> tuple[int, int, int]:
    """(rounds, drafted, accepted) of a reply's tokens after its first, from the engine's counters. Each round commits
    its accepted drafts and one token of the target's, so rounds = tokens - accepted. An engine counts the drafts
    its last round accepted past the token budget too, which the reply then cuts: accepted is held to what the
    fewest rounds that can return the tokens, one per γ + 1, leave (γ None, a user's server: as counted)."""
    n = max(len(reply.tokens) - 1, 0)
    accepted = min(reply.accepted or 0, n)
    if gamma:
        accepted = min(accepted, n - math.ceil(n / (gamma + 1)))
    return n - accepted, reply.drafted or 0, accepted


class Engine:
    """An engine's adapter. Subclasses name the engine, how it is installed, which strategies it runs, how its server
    starts for a role, and how a request and its streamed reply look."""

    name: str = ""
    folder: str = ""  # under engines_dir()
    install: str = ""  # the exact command, run in sdbench's checkout
    own_names: dict[str, str] = {}  # sdbench strategy -> the engine's name for it
    draft_round: str = CHAIN  # how its draft model spends a round's forwards (`engine/counters.py`)
    dtypes: tuple = ("float32", "bfloat16", "float16")  # the --dtype values its weights take
    synthetic: bool = False  # accepts drafts at given per-position rates instead of verifying (EngineRole.synthetic)
    busy_after_s: float = 0.0  # how long its server keeps a core busy after a reply (waited out, untimed: `settle`)

    def executable(self) -> Path:
        raise NotImplementedError

    def installed(self) -> bool:
        """Its executable is there and its install finished (`make` writes the stamp last)."""
        return self.executable().is_file() and engines_dir(self.folder, ".installed").is_file()

    def check_dtype(self, dtype: str) -> None:
        """Refuse, in one line, a --dtype the engine's weights cannot take."""
        if dtype not in self.dtypes:
            raise SdbenchError(f"--dtype {dtype}: {self.name} runs --dtype {', '.join(self.dtypes)} here")

    def check_installed(self) -> None:
        if not self.installed():
            raise SdbenchError(f"engine '{self.name}' is not installed (looked for {self.executable()}): run "
                               f"`{self.install}` in sdbench's checkout (`sdbench list engines` says what is "
                               "installed)")

    def refuse(self, role: EngineRole, target: str | None = None) -> str | None:
        """Why this engine cannot run `role` (for `target`), or None."""
        if role.strategy not in self.own_names:
            runs = ", ".join(self.own_names)
            return f"{self.name} runs no '{role.strategy}' (it runs: {runs})"
        return None

    def served_dtype(self, model: str, dtype: str) -> str:
        """The type the server runs `model` at (llama.cpp: a GGUF file's own block type)."""
        return dtype

    def label(self, role: EngineRole, dtype: str) -> str:
        own = self.own_names[role.strategy]
        if role.costs_only:
            return f"{self.name} plain decoding of the draft {role.draft} ({dtype})"
        if not role.speculative:
            return f"{self.name} plain decoding ({dtype})"
        if role.synthetic:
            return f"{self.name} {own} (γ={role.gamma}, {dtype}) at sdbench's acceptance (synthetic)"
        return f"{self.name} {own} (γ={role.gamma}, {dtype})"

    def footprint(self, target: str, role: EngineRole, dtype: str, capacity: int):
        """What its server for `role` will hold in memory (`servers/footprint.py` Footprint), from the models'
        configs alone; None where not known."""
        return None

    def command(self, target: str, role: EngineRole, dtype: str, capacity: int, threads: int) -> list[str]:
        """The server's argv, `{port}` where its port goes; models converted for the engine here, once."""
        raise NotImplementedError

    def server_env(self, threads: int) -> dict[str, str]:
        return {}

    health: str = "/health"

    def request(self, prompt: list[int], max_new: int, sampling: SamplingConfig | None = None) -> tuple[str, dict]:
        """(path, JSON body) of one streamed generation from token ids: greedy, or sampled at `sampling`'s
        temperature and top-p with its seed (the request's own: `request_seed`)."""
        raise NotImplementedError

    def reply(self, streamed, url: str, before: dict | None) -> Reply:
        """A Reply from a streamed request; `before`: what counters() read before it."""
        raise NotImplementedError

    def counters(self, url: str) -> dict | None:
        """Server-wide counters read before a request, where the engine keeps its acceptance there (vLLM)."""
        return None

    def probe(self, url: str, prompt: list[int]) -> tuple[float, int]:
        """(seconds the engine itself spent on the prompt's forward, prompt tokens it computed) for a one-token
        generation over `prompt`, reusing what its cache holds of the prompt's prefix from the request before: a
        forward over the prompt's new tokens alone, as a verification is (`servers/costs.py`)."""
        raise NotImplementedError


def request_seed(seed: int, prompt: list[int]) -> int:
    """A sampled request's seed, from `seed` (the run's, its repeat and batch folded in by the caller) and the
    prompt's token ids: another prompt or repeat samples afresh, the same run again samples the same tokens."""
    digest = hashlib.sha256(f"{seed}:{','.join(map(str, prompt))}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def token_gaps(times: list[float], counts: list[int]) -> tuple[float | None, list[float]]:
    """(time of the first event carrying tokens, gaps between consecutive events carrying tokens)."""
    stamps = [t for t, n in zip(times, counts) if n > 0]
    if not stamps:
        return None, []
    return stamps[0], [b - a for a, b in zip(stamps, stamps[1:])]
