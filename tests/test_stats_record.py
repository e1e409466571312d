"""The typed per-row stats each strategy records in `strategy_stats`: what is written round-trips through JSON,
and a file written before a field existed (or with keys no field knows) still reads."""

import json

from sdbench.dsi.orchestrator import DSIRowStats
from sdbench.engine.counters import AdaptiveRowStats
from sdbench.strategies.chain_levels import LevelRecord
from sdbench.strategies.polybasic import PolybasicRowStats


def _through_json(record):
    return type(record).from_dict(json.loads(json.dumps(record.to_dict(), sort_keys=True)))


def test_adaptive_stats_round_trip_with_gammas_as_numbers():
    stats = AdaptiveRowStats(1.5, {0: 2, 3: 8}, {"tiny-draft": 8}, 1, {"tiny-draft": 0.75})
    written = stats.to_dict()
    assert written["gamma_hist"] == {"0": 2, "3": 8}  # JSON keys
    assert set(written) == {"gamma_mean", "gamma_hist", "drafts", "switches", "alpha"}  # select=prompt's left out
    assert _through_json(stats) == stats
    chosen = AdaptiveRowStats(selected="ngram", exploring=False)
    assert chosen.to_dict()["selected"] == "ngram" and chosen.to_dict()["exploring"] is False
    assert _through_json(chosen) == chosen


def test_older_or_other_stats_read_as_defaults():
    assert AdaptiveRowStats.from_dict({}) == AdaptiveRowStats() == AdaptiveRowStats.from_dict(None)
    assert AdaptiveRowStats.from_dict({"levels": [], "busy": [0.5]}).gamma_hist == {}  # another strategy's row
    dsi = DSIRowStats.from_dict({"rejections": 10, "drafted_total": 60, "unknown": 1})
    assert (dsi.rejections, dsi.drafted_total, dsi.verify_s_per_job, dsi.busy) == (10, 60, None, [])
    old_level = {"level": 1, "model": "m", "forwards": 4, "forward_s": 0.2, "blocks": 2, "rounds": 2,
                 "committed": 5, "proposals": 2, "proposed": 6, "accepted": 4}  # before prefill_s and committed_sq
    level = PolybasicRowStats.from_dict({"levels": [old_level]}).levels[0]
    assert level == LevelRecord(**old_level) and level.prefill_s == 0.0 and level.committed_sq == 0


def test_dsi_stats_leave_the_backend_to_the_decoder():
    stats = DSIRowStats(workers=2, lookahead=4, busy=[0.5, 0.25], rejections=3)
    assert "backend" not in stats.to_dict() and stats.to_dict()["verify_s_per_job"] is None
    assert _through_json(stats) == stats
    assert DSIRowStats.from_dict({**stats.to_dict(), "backend": "mp"}).backend == "mp"


def test_chain_stats_round_trip_level_by_level():
    stats = PolybasicRowStats([LevelRecord(0, "t", 3, 0.1, rounds=3, committed=7, mean_accepted_len=7 / 3),
                               LevelRecord(1, "ngram", 3, proposals=3, proposed=9, accepted=4)])
    assert [level["model"] for level in stats.to_dict()["levels"]] == ["t", "ngram"]
    assert _through_json(stats) == stats
