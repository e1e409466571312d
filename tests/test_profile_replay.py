"""A speculation profile replayed by the real llama.cpp (built by `make test` where missing; in CI a missing build
fails): `sdbench profile --format llama.cpp` over a real SmolLM2 n-gram run writes the rates, the server bench's
replay starts (`LlamaCpp.command` with the role's synthetic rates, the same text) takes them, and its own counters
come back at the acceptance the profile implies, within four standard deviations of a round's accepted drafts."""

from __future__ import annotations

import math
import re

from sdbench.servers.client import post_json
from sdbench.servers.engines import EngineRole
from sdbench.servers.process import Server
from tests.conftest import run_cli

SMOL = "smollm2-135m"
GAMMA = 3


def expected_share(rates: list[float]) -> tuple[float, float]:
    """(mean, variance) of a round's accepted drafts over its drafted ones when position j is reached and
    accepted with unconditional probability rates[j]: P(A >= j + 1) = rates[j], so E[A] = sum r_j and
    E[A^2] = sum (2j + 1) r_j, j from 0."""
    mean = sum(rates)
    second = sum((2 * j + 1) * r for j, r in enumerate(rates))
    return mean / len(rates), (second - mean * mean) / len(rates) ** 2


def test_a_profile_is_replayed_by_llamacpp_at_its_acceptance(llamacpp, capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "--target", SMOL, "--strategy", "ngram", "--gamma", str(GAMMA), "--limit",
                           "2", "--max-new-tokens", "32", "--out", str(tmp_path / "r"))
    assert code == 0, err
    code, text, err = run_cli(capsys, "profile", str(tmp_path / "r"), "--format", "llama.cpp")
    assert code == 0, err
    found = re.fullmatch(r"--spec-draft-n-max (\d+) --spec-synth-rates ([0-9.,]+)", text.strip())
    assert found and int(found.group(1)) == GAMMA, text
    rates = [float(r) for r in found.group(2).split(",")]
    assert len(rates) == GAMMA and 0 < rates[-1] <= rates[0] < 0.9, rates  # an n-gram's: far from always
    # bench's replay: the draft-simple server at those rates, the target drafting for itself (every draft its own
    # next token, so the synthetic rates alone decide what is accepted)
    argv = llamacpp.command(SMOL, EngineRole("draft", GAMMA, SMOL, tuple(rates)), "q4_0", 1024, 2)
    assert argv[argv.index("--spec-synth-rates") + 1] == found.group(2)
    drafted = accepted = 0
    with Server("llama.cpp", argv, tmp_path / "server.log", llamacpp.health).start() as server:
        for k in range(8):
            prompt = [1, *range(2000 + 97 * k, 2032 + 97 * k)]
            body = {"prompt": prompt, "n_predict": 160, "temperature": 0.0, "cache_prompt": False, "seed": k}
            timings = post_json(server.url, "/completion", body).get("timings") or {}
            drafted += int(timings.get("draft_n") or 0)
            accepted += int(timings.get("draft_n_accepted") or 0)
    rounds = drafted / GAMMA
    assert rounds > 400, (drafted, accepted)
    mean, variance = expected_share(rates)
    assert abs(accepted / drafted - mean) <= 4 * math.sqrt(variance / rounds), (accepted / drafted, mean, rates)
