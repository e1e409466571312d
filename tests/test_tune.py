"""sdbench tune on tiny random models: trials run, resume, prune, fail on lossy output, write a preset."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest
import yaml
from optuna.trial import FixedTrial, TrialState

from sdbench.engine import loop
from sdbench.data import tasks
from sdbench.models.loading.pair import Pair
from sdbench.config import RunConfig, TuneConfig
from sdbench.data import Prompt
from sdbench.errors import SdbenchError
from sdbench.registry import Entry
from sdbench.reporting.results import read_results
from sdbench.strategies import resolve_strategy, strategy_registry
from sdbench.strategies.base import Proposer
from sdbench.strategies.spec import SearchContext, Strategy
from sdbench.commands.trials import objective_value
from sdbench.commands.tune import Tuner
from sdbench.commands.tune_space import draw
from sdbench.commands.tune_trial import ClearlyWorse
from tests.tune_processes import own_trials, seeded_draws, stored_trials, trials_or_none, tune_process, wait_until

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 10, 11, 12, 10, 11], [1, 2, 3, 4, 1, 2, 3]]


@pytest.fixture
def pair(target, small_draft):
    return Pair(target, None, [small_draft], eos=[], max_positions=1024)


@pytest.fixture(autouse=True)
def user_presets(tmp_path, monkeypatch):
    """The user's folder, where tune writes presets: tmp_path/strategies."""
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path))
    return tmp_path / "strategies"


@pytest.fixture(autouse=True)
def fixed_prompts(monkeypatch):
    def load(task, *, limit=None, seed=0, prompt_len=None, tokenizer=None, **_):
        return [Prompt(f"p{i}", "c", ("",), tuple(ids)) for i, ids in enumerate(PROMPTS[:limit])]

    monkeypatch.setattr(tasks, "load_prompts", load)


def tuner(tmp_path, pair, strategy="ngram", trials=3, **kwargs) -> Tuner:
    run_keys = {"limit": 2, "max_new_tokens": 8, "drafts": ("tiny-draft",)}
    run_keys.update({k: kwargs.pop(k) for k in list(kwargs) if k in RunConfig.__dataclass_fields__})
    run = RunConfig(target="tiny", strategy=strategy, device="cpu", out=str(tmp_path / "results"), **run_keys)
    pruner = kwargs.pop("pruner", None)
    return Tuner(TuneConfig(run, trials=trials, **kwargs), pair=pair, pruner=pruner)


def test_tune_writes_a_preset_and_resumes_the_study(tmp_path, pair, user_presets, capsys):
    first = tuner(tmp_path, pair, trials=2)
    study = first.tune()
    assert first.study_name.startswith("sdbench-tiny-ngram-mt-bench-cpu")
    assert len(study.trials) == 2 and (tmp_path / "results" / "tune.db").exists()
    completed = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert completed and all(t.user_attrs["lossless"] is True for t in completed)
    best = max(completed, key=lambda t: t.value)

    spec = yaml.safe_load(first.preset_path.read_text())
    assert first.preset_path == user_presets / "tuned-ngram-tiny.yaml"  # the user's folder, never the shipped one
    assert str(first.preset_path) in capsys.readouterr().out.replace("\n", "")  # and it says where
    # the lookahead as the run caps it: a step commits at most max_new_tokens - 1 = 7 tokens
    assert spec["gamma"] == min(best.params["gamma"], 7) and spec["tuned"]["trial"] == best.number
    assert spec["options"] == {"max_ngram": best.params["max_ngram"], "min_ngram": best.params["min_ngram"]}
    choice = resolve_strategy("tuned-ngram-tiny")  # what `run --strategy` reads
    assert (choice.base, choice.gamma, choice.options) == ("ngram", spec["gamma"], spec["options"])

    study = tuner(tmp_path, pair, trials=3).tune()  # a second session continues the same study
    assert [t.number for t in study.trials] == [0, 1, 2]
    trials = pd.read_parquet(first.folder / "trials" / "trials.parquet")
    assert list(trials["trial"]) == [0, 1, 2] and set(trials["study"]) == {first.study_name}
    assert all(Path(p).parent == first.folder and Path(p).exists() for p in trials["results"])
    # every trial's rows are a results file beside the others, readable by `sdbench report`
    rows = read_results([first.folder])
    assert rows["run_id"].nunique() == 3 and set(rows["role"]) == {"baseline", "strategy"}


def test_changed_settings_do_not_mix_into_a_study(tmp_path, pair, monkeypatch):
    assert len(tuner(tmp_path, pair, trials=1).tune().trials) == 1
    with pytest.raises(SdbenchError, match="was tuned with limit=2, not 3"):
        tuner(tmp_path, pair, trials=2, limit=3).tune()


def test_pruned_trials_stop_after_their_first_batch(tmp_path, pair):
    t = tuner(tmp_path, pair, trials=2, pruner=optuna.pruners.ThresholdPruner(lower=1e9))
    study = t.tune()
    assert [s.state for s in study.trials] == [TrialState.PRUNED] * 2
    assert all(s.user_attrs["batches"] == 1 and "pruned after 1 batch" in s.user_attrs["reason"]
               for s in study.trials)
    assert not t.preset_path.exists()
    rows = read_results([study.trials[0].user_attrs["results"]])  # the aborted run's parts, merged
    assert sorted(rows["role"]) == ["baseline", "strategy"] and set(rows["prompt_id"]) == {"p0"}
    (said,) = set(rows["unfinished"])  # and `report` marks it partial, with why
    assert said.startswith("tune trial 0: pruned after 1 batch")


class Lossy(Proposer):
    """Plain decoding whose decoder changes one token (`lossy_decoder`): what a broken strategy would do."""

    name = "lossy"


class LossyStrategy(Strategy):
    name = "lossy"
    proposer = Lossy


def lossy_decoder(proposer):
    """sdbench.decoders.decoder_for, except that a Lossy proposer's output has its last token changed."""
    from sdbench.decoders import decoder_for

    if not isinstance(proposer, Lossy):
        return decoder_for(proposer)

    def decode(target, proposer, prompts, **kwargs):
        result = loop.generate(target, Proposer(), prompts, **kwargs)
        result.output_ids[0][-1] += 1
        return result

    return decode


@pytest.mark.parametrize("objective", ["speedup", "tokens"])
def test_lossy_trials_fail_and_are_never_best(tmp_path, pair, monkeypatch, objective):
    monkeypatch.setitem(strategy_registry._entries, "lossy", Entry("lossy", LossyStrategy))
    monkeypatch.setitem(strategy_registry._alias, "lossy", "lossy")
    monkeypatch.setattr("sdbench.commands.run.decoder_for", lossy_decoder)
    t = tuner(tmp_path, pair, strategy="lossy", trials=2, objective=objective)
    study = t.tune()
    assert [s.state for s in study.trials] == [TrialState.FAIL] * 2
    assert all(s.user_attrs["reason"] == "lossless broke: output differs from plain decoding on p0"
               for s in study.trials)
    assert not t.preset_path.exists()


def test_nothing_to_tune_and_bad_objective(tmp_path, pair):
    with pytest.raises(SdbenchError, match="'autoregressive' has nothing to tune"):
        tuner(tmp_path, pair, strategy="autoregressive").tune()
    assert not (tmp_path / "results" / "tune.db").exists()
    with pytest.raises(SdbenchError, match="--objective fast"):
        tuner(tmp_path, pair, objective="fast")


def test_hand_written_presets_are_not_overwritten(tmp_path, pair):
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "mine.yaml").write_text("name: mine\nstrategy: ngram\n")
    with pytest.raises(SdbenchError, match="hand-written preset"):
        tuner(tmp_path, pair, preset="mine")
    with pytest.raises(SdbenchError, match="that is a strategy's name"):
        tuner(tmp_path, pair, preset="draft")


def test_search_spaces_draw_checked_settings():
    space = SearchContext(("a", "b"), prompt_tokens=20, max_new_tokens=8)
    assert space.context_tokens == 28
    assert draw("draft", FixedTrial({"gamma": 3, "draft": "b"}), space) == {"gamma": 3, "options": {},
                                                                            "drafts": ["b"]}
    got = draw("ngram", FixedTrial({"gamma": 2, "max_ngram": 4, "min_ngram": 2}), SearchContext())
    assert got == {"gamma": 2, "options": {"max_ngram": 4, "min_ngram": 2}, "drafts": []}


def test_clearly_worse_prunes_only_well_below_the_median():
    study = optuna.create_study(direction="maximize", pruner=ClearlyWorse(margin=0.1, min_trials=2))
    for value in (1.0, 1.2, 1.4):
        trial = study.ask()
        trial.report(value, 1)
        study.tell(trial, value)
    close, far = study.ask(), study.ask()
    close.report(1.09, 1)  # median 1.2: within 10 %
    far.report(1.07, 1)
    assert (close.should_prune(), far.should_prune()) == (False, True)


def test_objective_aggregates_like_the_report():
    rows = pd.DataFrame([
        {"role": r, "strategy": s, "prompt_id": p, "batch_id": b, "repeat": 0, "new_tokens": 10, "wall_s": w,
         "steps": 10, "dataset": "d"}
        for r, s, w in (("baseline", "autoregressive", 1.0), ("strategy", "ngram", 0.5)) for b, p in enumerate("xy")
    ])
    assert objective_value(rows, "tokens") == 20.0 and objective_value(rows, "speedup") == 2.0


def test_cli_passes_settings_to_the_tuner(monkeypatch):
    import sdbench.commands.tune
    from sdbench.cli import main

    seen = {}
    monkeypatch.setattr(sdbench.commands.tune, "tune", lambda cfg, console: seen.setdefault("cfg", cfg))
    main(["tune", "--target", "m", "--draft", "a", "--draft", "b", "--strategy", "draft", "--limit", "3",
          "--trials", "7", "--timeout", "60", "--objective", "tokens", "--storage", "sqlite:///x.db",
          "--study", "s", "--preset", "p", "--seed", "5", "--max-new-tokens", "9"])
    cfg = seen["cfg"]
    assert (cfg.trials, cfg.timeout, cfg.objective, cfg.storage, cfg.study, cfg.preset) == (
        7, 60.0, "tokens", "sqlite:///x.db", "s", "p")
    run = cfg.run
    assert (run.target, run.drafts, run.strategy, run.limit, run.max_new_tokens, run.sampling.seed) == (
        "m", ("a", "b"), "draft", 3, 9, 5)
    assert run.sampling.greedy
    assert cfg.heads == ()
    seen.clear()
    main(["tune", "--target", "m", "--strategy", "eagle", "--head", "h1", "--head", "h2"])
    assert seen["cfg"].heads == ("h1", "h2")


@pytest.mark.slow
def test_cli_tunes_smollm2_end_to_end(tmp_path, monkeypatch, capsys):
    from sdbench.cli import main

    monkeypatch.undo()  # real prompts
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "home"))
    presets = tmp_path / "home" / "strategies"
    main(["tune", "--strategy", "ngram", "--limit", "1", "--max-new-tokens", "6", "--trials", "2",
          "--objective", "tokens", "--out", str(tmp_path), "--device", "cpu"])
    out = capsys.readouterr().out
    assert "trial 0: gamma=" in out and "trial 1: gamma=" in out and "best trials by tokens" in out
    assert yaml.safe_load((presets / "tuned-ngram-smollm2-135m.yaml").read_text())["strategy"] == "ngram"


def test_an_interrupted_tune_resumes(tmp_path, pair, monkeypatch):
    from sdbench.commands import tune_trial

    real = tune_trial.Feed.__call__

    def interrupt(self, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_trial.Feed, "__call__", interrupt)
    with pytest.raises(SdbenchError, match="interrupted: .* run the same command again to resume it \\(0/2 done\\)"):
        tuner(tmp_path, pair, trials=2).tune()
    monkeypatch.setattr(tune_trial.Feed, "__call__", real)
    study = tuner(tmp_path, pair, trials=2).tune()
    states = [(t.state, t.user_attrs.get("reason")) for t in study.trials]
    assert states[0] == (TrialState.FAIL, "interrupted") and len(states) == 3
    assert all(s != TrialState.FAIL for s, _ in states[1:])


def test_a_search_space_with_undeclared_settings_is_refused(monkeypatch):
    from sdbench.strategies.ngram import NGramStrategy as NGram

    monkeypatch.setattr(NGram, "search_space", classmethod(lambda cls, trial, space: (2, {"colour": 1})))
    with pytest.raises(SdbenchError, match="has no setting 'colour'"):
        draw("ngram", FixedTrial({}), SearchContext())
    monkeypatch.setattr(NGram, "search_space", classmethod(lambda cls, trial, space: 2))
    with pytest.raises(SdbenchError, match="search_space must return"):
        draw("ngram", FixedTrial({}), SearchContext())


def _study(*trials) -> optuna.Study:
    """A finished study from (value, interval, prompts) per trial."""
    study = optuna.create_study(direction="maximize")
    for i, (value, interval, prompts) in enumerate(trials):
        study.add_trial(optuna.trial.create_trial(
            value=value, params={}, distributions={},
            user_attrs={"settings": {"gamma": i + 1, "options": {}, "drafts": []}, "interval": interval,
                        "prompts": prompts, "speedup": value, "tokens_per_s": 10.0 * value}))
    return study


def test_a_best_inside_the_noise_is_not_claimed(tmp_path):
    from sdbench.commands.trials import best_table, doubts, write_preset

    tied = _study((1.15, [1.02, 1.28], 1), (1.10, [1.0, 1.2], 1))
    found = doubts(tied, "speedup")
    assert len(found) == 1 and "not shown better than trial 1" in found[0]
    assert "about 7 prompts" in found[0]  # 1 * (0.13 / 0.05)^2 = 6.8, an estimate
    noise = doubts(_study((1.02, [0.97, 1.07], 4)), "speedup")
    assert noise and "no speedup beyond noise" in noise[0] and "about 25 prompts" in noise[0]
    assert doubts(_study((1.4, [1.3, 1.5], 8), (1.1, [1.0, 1.2], 8)), "speedup") == []
    assert "no interval" in doubts(_study((1.3, None, 1)), "speedup")[0]

    run = RunConfig(target="tiny", limit=4)
    cfg = TuneConfig(run)
    path = write_preset(tmp_path / "p.yaml", "p", "draft", tied.best_trial, tied, cfg, run, found)
    spec = yaml.safe_load(path.read_text())
    assert spec["tuned"]["claimed"] is False and "not a claim" in spec["description"]
    assert "1.15x ±0.13" in spec["description"] and "x speedup" not in spec["description"]
    sure = _study((1.4, [1.3, 1.5], 8))
    spec = yaml.safe_load(write_preset(tmp_path / "q.yaml", "q", "draft", sure.best_trial, sure, cfg, run).read_text())
    assert spec["tuned"]["claimed"] is True and "1.4x speedup (95 % interval 1.40x ±0.10)" in spec["description"]
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(best_table(tied, "speedup"))
    text = console.export_text()
    assert "1.15x ±0.13" in text and "not shown better" in text


# ---- several processes on one study (through the CLI, on the embedded SmolLM2) ------------------------------


@pytest.mark.slow
def test_two_processes_share_one_study(tmp_path):
    from sdbench.commands.studies import NOT_NEEDED, UNCOUNTED

    procs = [tune_process(tmp_path / "home", tmp_path / "out", trials=5) for _ in range(2)]
    logs = [p.communicate(timeout=1800)[0] for p in procs]  # a hang guard only
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    trials = stored_trials(tmp_path / "out")
    counted = [t for t in trials if t.user_attrs.get("reason") not in UNCOUNTED]
    assert len(counted) == 5 and all(t.state.is_finished() for t in trials)
    assert all(t.user_attrs.get("reason") == NOT_NEEDED for t in trials if t not in counted)
    own = [own_trials(log) for log in logs]  # each process prints every trial it ran itself
    assert all(own), f"a process ran no trial of its own: {own}"  # both worked on the study
    assert not own[0] & own[1] and own[0] | own[1] == {t.number for t in counted}, own
    drew, seeded = seeded_draws(trials, seed=0)  # tune's default --seed; each its own draws, not the other's again
    assert drew == seeded


@pytest.mark.slow
def test_a_killed_tune_resumes_with_the_killed_trial_failed(tmp_path):
    import signal

    from optuna.trial import TrialState

    from sdbench.commands.studies import STOPPED, reason

    out = tmp_path / "out"
    proc = tune_process(tmp_path / "home", out, trials=3, max_new=48)
    # kill it in the middle of its second trial: as soon as the study shows trial 1 running (the deadline only
    # guards against a hang)
    wait_until(lambda: any(t.number == 1 and t.state == TrialState.RUNNING for t in trials_or_none(out)), [proc],
               "trial 1 running")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [t.state for t in stored_trials(out)][:2] == [TrialState.COMPLETE, TrialState.RUNNING]
    rerun = tune_process(tmp_path / "home", out, trials=3, max_new=48)
    log = rerun.communicate(timeout=1800)[0]  # a hang guard only
    assert rerun.returncode == 0, log
    trials = stored_trials(out)
    assert (trials[1].state, reason(trials[1])) == (TrialState.FAIL, STOPPED)
    assert [t.number for t in trials] == [0, 1, 2, 3]  # the killed trial's place taken by one more
    # the pruner compares with at least two completed trials: 0 and 2 had fewer before them, so they completed
    assert [trials[0].state, trials[2].state] == [TrialState.COMPLETE, TrialState.COMPLETE]
    last = trials[3]
    if last.state == TrialState.PRUNED:  # allowed only by the pruner's own rule: 10 % below the median
        [(step, value)] = last.intermediate_values.items()
        before = [trials[k].intermediate_values[step] for k in (0, 2)]
        assert value < 0.9 * float(np.median(before)), (value, before)
    else:
        assert last.state == TrialState.COMPLETE


def test_a_trial_whose_process_died_before_its_first_heartbeat_is_failed_not_waited_for(tmp_path, monkeypatch):
    """Optuna never calls a running trial with no heartbeat stale: a process killed between taking a trial and
    its first beat must not leave every later process waiting on it (a resumed tune hung on one in CI)."""
    import time

    from sdbench.commands import studies

    monkeypatch.setattr(studies, "GRACE_S", 1)
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    study = optuna.create_study(study_name="s", storage=studies.storage(url), direction="maximize")
    study.tell(study.ask(), 1.0)
    study.ask()  # trial 1: taken by a process that died at once, no heartbeat recorded
    time.sleep(1.5)
    deadline = time.monotonic() + 30  # before the fix, next_trial waited here for trial 1 forever
    trial = studies.next_trial(study, 2, stop=lambda: time.monotonic() > deadline)
    assert trial is not None and trial.number == 2
    stale = study.get_trials()[1]
    assert (stale.state, studies.reason(stale)) == (TrialState.FAIL, studies.STOPPED)
    # a trial handed out by next_trial has its first heartbeat at once: Optuna's own check can fail it later
    assert studies._has_heartbeat(study._storage, trial._trial_id)


# ---- the study's fixed settings and --timeout, through the CLI on a tiny model folder ---------------------------


@pytest.fixture
def tiny_tune(tmp_path, monkeypatch):
    from tests.references import tiny_cli_files

    return ["tune", *tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2 w3 w4"]), "--strategy", "ngram",
            "--limit", "1", "--max-new-tokens", "6", "--study", "s", "--device", "cpu", "--out", str(tmp_path / "out")]


def test_a_study_refuses_a_session_whose_objective_or_dtype_changed(capsys, tmp_path, tiny_tune):
    from tests.conftest import run_cli

    code, _, err = run_cli(capsys, *tiny_tune, "--trials", "1")
    assert code == 0, err
    for changed, said in ((["--objective", "tokens"], "objective=speedup, not tokens"),
                          (["--dtype", "bfloat16"], "dtype=float32, not bfloat16")):
        code, _, err = run_cli(capsys, *tiny_tune, "--trials", "2", *changed)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and f"study s was tuned with {said}" in lines[0], err
    assert len(stored_trials(tmp_path / "out", "s")) == 1  # the refused sessions ran nothing


def test_tune_timeout_stops_starting_trials(capsys, tmp_path, tiny_tune):
    from tests.conftest import run_cli

    code, out, err = run_cli(capsys, *tiny_tune, "--trials", "50", "--timeout", "0")
    assert code == 0, err
    assert "--timeout 0s reached" in out
    assert stored_trials(tmp_path / "out", "s") == []  # the time was up before the first trial was taken


# ---- trained heads: the head is a choice of the search space, like a draft ----------------------------------


def _recorded(folder, target: str, kind: str):
    from sdbench.models.heads.registry import HeadRecord, write_record

    write_record(folder, HeadRecord(target=target, kind=kind))
    return str(Path(folder).resolve())


def test_tune_chooses_among_the_targets_recorded_heads(tmp_path, pair):
    from tests.heads import eagle3_dir, medusa_dir

    layers = (0, 1, 1)  # the tiny target has 2 layers
    first = _recorded(eagle3_dir(tmp_path / "e-a", pair.target.model, layer_ids=layers, seed=1), "tiny", "eagle3")
    second = _recorded(eagle3_dir(tmp_path / "e-b", pair.target.model, layer_ids=layers, seed=2), "tiny", "eagle3")
    _recorded(medusa_dir(tmp_path / "m", pair.target.model), "tiny", "medusa")  # another kind
    _recorded(eagle3_dir(tmp_path / "o", pair.target.model, layer_ids=layers), "other-target", "eagle3")
    t = tuner(tmp_path, pair, strategy="eagle", trials=4, drafts=(), objective="tokens",
              pruner=optuna.pruners.NopPruner())
    assert t.heads == (first, second)  # the target's eagle heads only
    study = t.tune()
    done = [s for s in study.trials if s.state == TrialState.COMPLETE]
    assert len(done) == 4  # each checked token for token against plain decoding (a lossy trial fails)
    assert {s.params["head"] for s in done} == {first, second}  # a categorical, as --draft candidates are
    for s in done:  # the trial drafted with the head it drew: its rows record it
        rows = read_results([s.user_attrs["results"]])
        heads = rows[rows["role"] != "baseline"]["params"].map(lambda p: json.loads(p)["head"])
        assert set(heads) == {s.params["head"]}
    best = max(done, key=lambda s: s.value)
    choice = resolve_strategy(t.preset_name)  # the preset runs the best trial's head
    assert (choice.base, choice.gamma, choice.options) == ("eagle", min(best.params["gamma"], 7), {"head": best.params["head"]})


def test_tune_medusa_draws_no_more_drafts_than_heads(tmp_path, pair):
    from tests.heads import medusa_dir

    head = str(medusa_dir(tmp_path / "m", pair.target.model, heads=2))
    study = tuner(tmp_path, pair, strategy="medusa", trials=3, drafts=(), heads=(head,), objective="tokens",
                  pruner=optuna.pruners.NopPruner()).tune()
    assert [s.state for s in study.trials] == [TrialState.COMPLETE] * 3
    assert {s.params["gamma"] for s in study.trials} <= {1, 2} and "head" not in study.trials[0].params


def test_one_study_chooses_between_an_eagle_a_dflash_and_a_dspark_head(tmp_path, pair, user_presets):
    """Each --head goes to the strategy drafting with its kind; DFlash's gamma is drawn up to its block's drafts
    (a block of 3: 1 or 2), DSpark's with its confidence cut too, each trial checked token for token against
    plain decoding."""
    from sdbench.strategies.dspark import CONFIDENCES
    from tests.heads import dflash_dir, eagle3_dir

    eagle = str(eagle3_dir(tmp_path / "e", pair.target.model, layer_ids=(0, 1, 1), seed=1))
    block = str(dflash_dir(tmp_path / "d", pair.target.model, block=3, layer_ids=(1, 2)))
    spark = str(dflash_dir(tmp_path / "s", pair.target.model, block=3, layer_ids=(1, 2), anchor=True, dspark={}))
    t = tuner(tmp_path, pair, strategy="eagle", strategies=("eagle", "dflash", "dspark"), heads=(eagle, block, spark),
              trials=8, objective="tokens", pruner=optuna.pruners.NopPruner())
    assert t.heads_of == {"eagle": (eagle,), "dflash": (block,), "dspark": (spark,)}
    done = [s for s in t.tune().trials if s.state == TrialState.COMPLETE]
    assert len(done) == 8 and {s.params["strategy"] for s in done} == {"eagle", "dflash", "dspark"}
    drawn = [s.params["dflash.gamma"] for s in done if s.params["strategy"] == "dflash"]
    assert set(drawn) <= {1, 2}
    for s in done:
        if s.params["strategy"] == "dflash":
            assert s.user_attrs["settings"]["options"] == {"head": block}
        if s.params["strategy"] == "dspark":
            assert s.params["dspark.gamma"] <= 3 and s.params["dspark.confidence"] in CONFIDENCES
            assert s.user_attrs["settings"]["options"] == {"head": spark, "confidence": s.params["dspark.confidence"]}


def test_tune_head_refusals(tmp_path, pair):
    with pytest.raises(SdbenchError, match="'eagle' needs a trained head to tune with: give --head"):
        tuner(tmp_path, pair, strategy="eagle", drafts=())
    with pytest.raises(SdbenchError, match="--head needs --strategy eagle, peagle, medusa.* not 'ngram'"):
        tuner(tmp_path, pair, strategy="ngram", heads=("x",))
    with pytest.raises(SdbenchError, match="--head /nonexistent: no such folder"):
        tuner(tmp_path, pair, strategy="eagle", drafts=(), heads=("/nonexistent",))


# ---- several strategies in one study: the draft choice among draft models, heads and n-gram -----------------


def test_one_study_chooses_among_a_draft_model_a_head_and_ngram(tmp_path, pair, user_presets):
    from tests.heads import eagle3_dir

    head = str(eagle3_dir(tmp_path / "e", pair.target.model, layer_ids=(0, 1, 1), seed=1))
    t = tuner(tmp_path, pair, strategy="draft", strategies=("draft", "eagle", "ngram"), heads=(head,), trials=5,
              objective="tokens", pruner=optuna.pruners.NopPruner())
    assert t.strategies == ("draft", "eagle", "ngram") and t.heads_of == {"draft": (), "eagle": (head,), "ngram": ()}
    assert t.study_name.startswith("sdbench-tiny-draft+eagle+ngram-") and t.preset_name == "tuned-draft-eagle-ngram-tiny"
    study = t.tune()
    done = [s for s in study.trials if s.state == TrialState.COMPLETE]
    assert len(done) == 5  # each checked token for token against plain decoding
    assert [s.params["strategy"] for s in done[:3]] == ["draft", "eagle", "ngram"]  # each measured once first
    for s in done:  # each strategy's settings are its own parameters, and the trial ran the strategy it drew
        chosen = s.params["strategy"]
        assert all(k == "strategy" or k.startswith(f"{chosen}.") for k in s.params), s.params
        settings = s.user_attrs["settings"]
        assert settings["strategy"] == chosen and settings["gamma"] == min(s.params[f"{chosen}.gamma"], 7)
        rows = read_results([s.user_attrs["results"]])
        assert set(rows[rows["role"] != "baseline"]["strategy"]) == {chosen}
        assert settings["drafts"] == (["tiny-draft"] if chosen == "draft" else [])
        if chosen == "eagle":
            assert settings["options"] == {"head": head}
    best = max(done, key=lambda s: s.value)
    spec = yaml.safe_load(t.preset_path.read_text())
    assert (spec["strategy"], spec["gamma"]) == (best.params["strategy"], best.user_attrs["settings"]["gamma"])
    choice = resolve_strategy(t.preset_name)  # what `run --strategy` reads: the best strategy with its settings
    assert (choice.base, choice.options) == (best.params["strategy"], best.user_attrs["settings"]["options"])
    trials = pd.read_parquet(t.folder / "trials" / "trials.parquet")
    assert list(trials["strategy"]) == [s.params["strategy"] for s in study.trials]


def test_heads_go_to_the_strategy_of_their_kind(tmp_path, pair):
    from sdbench.strategies import heads_for
    from tests.heads import eagle3_dir, medusa_dir

    eagle = str(eagle3_dir(tmp_path / "e", pair.target.model, layer_ids=(0, 1, 1)))
    medusa = str(medusa_dir(tmp_path / "m", pair.target.model))
    assert heads_for(("eagle", "medusa", "ngram"), "tiny", (medusa, eagle)) == {
        "eagle": (eagle,), "medusa": (medusa,), "ngram": ()}
    with pytest.raises(SdbenchError, match=f"--head {re.escape(medusa)}: no --strategy tuned here drafts with it"):
        heads_for(("eagle", "ngram"), "tiny", (eagle, medusa))
    with pytest.raises(SdbenchError, match="'medusa' needs a trained head to tune with"):
        heads_for(("eagle", "medusa"), "tiny", (eagle,))  # and the target has none recorded


def test_several_strategies_refusals(tmp_path, pair):
    with pytest.raises(SdbenchError, match="--strategy ngram is given twice"):
        tuner(tmp_path, pair, strategies=("ngram", "ngram"))
    (tmp_path / "strategies").mkdir(exist_ok=True)
    (tmp_path / "strategies" / "mine.yaml").write_text("name: mine\nstrategy: ngram\n")
    with pytest.raises(SdbenchError, match="two of ngram, mine are strategy 'ngram'"):
        tuner(tmp_path, pair, strategies=("ngram", "mine"))
    with pytest.raises(SdbenchError, match="strategy 'draft' needs"):
        tuner(tmp_path, pair, strategies=("ngram", "draft"), drafts=())  # each strategy checked as run checks it
    from sdbench.commands.schedule import tune_schedule

    run = RunConfig(target="tiny", strategy="ngram", device="cpu", out=str(tmp_path / "r"), drafts=("tiny-draft",))
    with pytest.raises(SdbenchError, match="a schedule holds one strategy's settings per bucket"):
        tune_schedule(TuneConfig(run, batches=(1, 2), strategies=("ngram", "draft")), None, pair=pair)


def test_cli_takes_several_strategies(monkeypatch):
    import sdbench.commands.tune
    from sdbench.cli import main

    seen = {}
    monkeypatch.setattr(sdbench.commands.tune, "tune", lambda cfg, console: seen.setdefault("cfg", cfg))
    main(["tune", "--target", "m", "--strategy", "draft,eagle", "-s", "ngram", "--draft", "a"])
    assert seen["cfg"].strategies == ("draft", "eagle", "ngram") and seen["cfg"].run.strategy == "draft"


# ---- tree shapes: `tune --trees` draws them where a strategy grows trees; the chain stays a choice ----------------


def test_without_trees_the_search_spaces_are_the_chains_parameter_for_parameter():
    """An existing study resumes: the same parameters, no tree drawn (a real study records what was asked)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for base, names in (("draft", {"gamma"}), ("ngram", {"gamma", "max_ngram", "min_ngram"})):
        for _ in range(12):
            trial = study.ask()
            assert draw(base, trial, SearchContext(("a",)))["options"].keys() <= {"max_ngram", "min_ngram"}
            assert set(trial.params) == names


@pytest.mark.parametrize("gamma, topk, budget, nodes", [
    (4, 2, 8, 8), (2, 3, 32, 12), (1, 2, 4, 2), (3, 4, 16, 16), (2, 2, 16, 6)])  # full trees: 3+9, 2, 4+16+64, 2+4
def test_trees_draw_a_topk_shape_capped_at_the_full_trees_size(gamma, topk, budget, nodes):
    from sdbench.strategies.draft import tree_spec

    space = SearchContext(("a",), trees=True)
    got = draw("draft", FixedTrial({"gamma": gamma, "tree_topk": topk, "tree_nodes": budget}), space)
    assert got["options"] == {"tree_topk": topk, "tree_nodes": nodes} and got["gamma"] == gamma
    tree = tree_spec(gamma, "dense", topk, nodes, "")
    assert len(tree) == nodes and tree.max_depth == min(gamma, nodes)  # the run grows exactly that many nodes
    assert draw("draft", FixedTrial({"gamma": 3, "tree_topk": 0}), space)["options"] == {}  # the chain: no settings
    ngram = FixedTrial({"gamma": 3, "max_ngram": 2, "min_ngram": 1, "tree": 3})
    assert draw("ngram", ngram, space)["options"] == {"max_ngram": 2, "min_ngram": 1, "tree": 3}
    chain = FixedTrial({"gamma": 3, "max_ngram": 2, "min_ngram": 1, "tree": 0})
    assert draw("ngram", chain, space)["options"] == {"max_ngram": 2, "min_ngram": 1}


def test_trees_keep_the_chain_a_choice_and_draw_a_budget_only_for_a_tree():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    space = SearchContext(("a",), trees=True)
    seen = set()
    for _ in range(60):
        trial = study.ask()
        options = draw("draft", trial, space)["options"]
        seen.add(trial.params["tree_topk"])
        assert ("tree_nodes" in trial.params) == (trial.params["tree_topk"] != 0) == bool(options)
    assert seen == {0, 2, 3, 4}
    assert {t.params.get("tree_nodes") for t in study.trials} == {None, 4, 8, 16, 32}
    for _ in range(30):
        trial = study.ask()
        options = draw("ngram", trial, space)["options"]
        assert options.get("tree", 0) == trial.params["tree"] in (0, 2, 3, 4)


def test_tune_trees_runs_the_tree_and_its_preset_reproduces_it(tmp_path, pair):
    from rich.console import Console

    from sdbench.commands.run import RunHarness

    t = tuner(tmp_path, pair, strategy="draft", trials=2, trees=True, objective="tokens",
              pruner=optuna.pruners.NopPruner())
    assert "-draft-trees-" in t.study_name  # a study of its own: the chain-only one keeps its trials apart
    study = optuna.create_study(study_name=t.study_name, storage=t.storage(), direction="maximize")
    study.enqueue_trial({"gamma": 2, "tree_topk": 2, "tree_nodes": 8})  # capped: the full tree has 2 + 4 nodes
    study.enqueue_trial({"gamma": 2, "tree_topk": 0})
    study = t.tune()
    tree, chain = study.trials
    assert [tree.state, chain.state] == [TrialState.COMPLETE] * 2  # both checked token for token
    assert tree.user_attrs["settings"]["options"] == {"tree_topk": 2, "tree_nodes": 6}
    assert chain.user_attrs["settings"]["options"] == {}
    for trial, stats in ((tree, {"tree_topk": 2, "tree_nodes": 6}), (chain, {})):
        rows = read_results([trial.user_attrs["results"]])
        mine = rows[rows["role"] != "baseline"]
        assert {json.dumps(json.loads(p), sort_keys=True) for p in mine["params"]} == {
            json.dumps({"gamma": trial.user_attrs["settings"]["gamma"], **stats}, sort_keys=True)}
        steps = list(mine["tree_steps"])  # a result column
        assert all(steps) if stats else not any(steps)  # the tree trial verified trees, the chain none
    trials = pd.read_parquet(t.folder / "trials" / "trials.parquet")
    assert list(trials["tree"]) == ["tree_topk=2 tree_nodes=6", ""]

    best = max((tree, chain), key=lambda s: s.value)
    choice = resolve_strategy(t.preset_name)  # what `run --strategy NAME` reads
    assert (choice.gamma, choice.options) == (best.user_attrs["settings"]["gamma"],
                                              best.user_attrs["settings"]["options"])
    # the tree trial's settings as a preset run the same tree
    from sdbench.commands.trials import write_preset

    write_preset(t.preset_path.with_name("tree.yaml"), "tree", "draft", tree, study, t.cfg, t.run)
    run = RunConfig(target="tiny", strategy="tree", drafts=("tiny-draft",), limit=2, max_new_tokens=8, device="cpu",
                    out=str(tmp_path / "again"))
    rows = read_results([RunHarness(run, Console(quiet=True), pair=pair).run()])
    mine = rows[rows["role"] != "baseline"]
    assert {json.dumps(json.loads(p), sort_keys=True) for p in mine["params"]} == {
        json.dumps({"gamma": 2, "tree_topk": 2, "tree_nodes": 6}, sort_keys=True)}
    assert mine["lossless"].all()


def test_tune_trees_refusals(tmp_path, pair, target, small_draft):
    from sdbench.models.forward.runner import ModelRunner

    with pytest.raises(SdbenchError, match="--trees: polybasic grows no token tree; the strategies that do are "
                                           "draft, eagle, lookahead, magicdec, medusa, mtp, ngram, rest, suffix"):
        tuner(tmp_path, pair, strategy="polybasic", trees=True)
    tuner(tmp_path, pair, strategies=("polybasic", "ngram"), trees=True)  # one of them grows trees: accepted
    from tests.heads import eagle3_dir

    head = str(eagle3_dir(tmp_path / "e", pair.target.model, layer_ids=(0, 1, 1)))
    from sdbench.strategies.eagle import EagleStrategy

    def no_tree(cls, trial, space):  # a strategy that grows trees on `run` but whose space draws none
        return trial.suggest_int("gamma", 1, 4), {"head": space.heads[0]}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleStrategy, "search_space", classmethod(no_tree))
        with pytest.raises(SdbenchError, match="--trees: the search space of eagle draws no tree shape yet"):
            tuner(tmp_path, pair, strategy="eagle", drafts=(), heads=(head,), trees=True)
    tuner(tmp_path, pair, strategy="eagle", drafts=(), heads=(head,), trees=True)  # heads draw trees now: accepted
    static = Pair(ModelRunner(target.model, "tiny-target", static=True), None, [small_draft], eos=[],
                  max_positions=1024)
    study = tuner(tmp_path / "static", static, strategy="ngram", trees=True, trials=2).tune()  # trees take the
    # static-shape forward too (models/forward/graphs.py), lossless
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert done and all(t.user_attrs["lossless"] is True for t in done)
    # a study's search space is fixed when it starts: a session with or without --trees is refused
    assert len(tuner(tmp_path, pair, strategy="ngram", trials=1, study="s").tune().trials) == 1
    with pytest.raises(SdbenchError, match="study s was tuned with trees=False, not True"):
        tuner(tmp_path, pair, strategy="ngram", trials=2, study="s", trees=True).tune()


def test_cli_passes_trees_and_fast_to_the_tuner(monkeypatch):
    import sdbench.commands.tune
    from sdbench.cli import main

    seen = []
    monkeypatch.setattr(sdbench.commands.tune, "tune", lambda cfg, console: seen.append(cfg))
    main(["tune", "--target", "m", "--strategy", "draft", "--draft", "a"])
    main(["tune", "--target", "m", "--strategy", "draft", "--draft", "a", "--trees", "--no-fast"])
    assert [(c.trees, c.run.fast) for c in seen] == [(False, True), (True, False)]
