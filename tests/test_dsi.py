"""DSI: the ledger's bookkeeping on scripted answers, and real worker processes reproducing greedy decoding."""

import re
import time

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.decoders import decoder_for
from sdbench.dsi.decoder import generate as dsi_generate
from sdbench.engine.loop import generate
from sdbench.dsi.ledger import Ledger
from sdbench.dsi.orchestrator import RowDecode
from sdbench.dsi import pools as pool_module
from sdbench.dsi.pools import WorkerFailed, discard_pool, get_pool, shutdown_pools
from sdbench.errors import SdbenchError
from sdbench.strategies import BuildContext, build_proposer
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.dsi import DSI
from tests.conftest import skip_unless_ci, tiny_model

GREEDY = SamplingConfig()
NEW = 16


def right_until_wrong(job, frontier, drafts):
    """The scripted target: the right token is always 0, a draft of 1 is wrong."""
    accepted = next((i for i, x in enumerate(drafts) if x != 0), len(drafts))
    return accepted, 0


# ---- the ledger, no models ---------------------------------------------------------------------------------


def test_rejection_cancels_the_speculation_built_on_it():
    led = Ledger([0], lookahead=2, max_new_tokens=10, workers=3)
    warm = led.warm()
    assert [(j.worker, j.start, j.end) for j in warm] == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]
    led.add_draft(0), led.add_draft(0)
    assert not led.want_draft() and led.dispatch() == []  # a full window waits: every worker is busy
    steps = led.finish(warm[0].id, 0, None, right_until_wrong)
    assert [(s.drafted, s.accepted, s.committed, s.rejected) for s in steps] == [(0, 0, 1, False)]
    assert led.committed == 2 and led.redundant == 2  # the other warm-ups predicted position 1 too
    (a,) = led.dispatch()  # nothing predicts position 2: verify the prefix now, with the one draft there is
    assert (a.worker, a.start, a.end) == (0, 2, 3)
    led.add_draft(1), led.add_draft(0)  # position 3 drafted wrong
    assert led.finish(warm[1].id, 1, None, right_until_wrong) == []  # redundant answers are ignored
    (b,) = led.dispatch()
    assert (b.worker, b.start, b.end) == (1, 3, 5)  # speculation on the unverified draft at 2
    led.finish(warm[2].id, 2, None, right_until_wrong)
    led.add_draft(0), led.add_draft(0)
    (c,) = led.dispatch()
    assert (c.worker, c.start, c.end) == (2, 5, 7)
    (step,) = led.finish(a.id, 0, None, right_until_wrong)
    # draft 2 accepted; the bonus token at 3 is the target's 0, not the drafted 1: b and c read that draft
    assert (step.drafted, step.accepted, step.committed, step.rejected) == (1, 1, 2, True)
    assert led.tokens == [0, 0, 0, 0] and led.committed == 4
    assert led.cancelled == 2 and led.live == {} and sorted(led.orphans()) == [1, 2]
    (d,) = led.dispatch()
    assert (d.worker, d.start, d.end) == (0, 4, 4)
    assert led.dispatched == led.redundant + led.cancelled + 2 + len(led.live)


def test_answers_out_of_order_wait_for_the_frontier():
    led = Ledger([0], lookahead=2, max_new_tokens=8, workers=3)
    (first,) = led.dispatch()  # no warm-up here: one frontier job, the rest idle
    for _ in range(4):
        led.add_draft(0)
    w1, w2 = led.dispatch()
    assert [(j.start, j.end) for j in (first, w1, w2)] == [(1, 1), (1, 3), (3, 5)]
    assert led.finish(w2.id, 2, None, right_until_wrong) == []  # its prefix is not committed yet
    assert led.committed == 1
    steps = led.finish(w1.id, 1, None, right_until_wrong)  # now both commit, in order
    assert [(s.job.id, s.drafted, s.accepted, s.committed) for s in steps] == [(w1.id, 2, 2, 3), (w2.id, 1, 1, 2)]
    assert led.committed == 6 and led.redundant == 1  # the frontier job was overtaken
    assert led.finish(first.id, 0, None, right_until_wrong) == []


def ticketed(led, token):
    ticket = led.ticket()
    return led.add_draft(token, ticket)


def test_eos_budget_and_stale_drafts():
    led = Ledger([5], lookahead=3, max_new_tokens=5, workers=2, eos=(9,))
    (job,) = led.dispatch()
    ticket = led.ticket()
    led.finish(job.id, 0, None, lambda j, f, d: (0, 7))  # commits 7 while a draft for position 1 was under way
    assert not led.add_draft(4, ticket) and led.tokens == [5, 7]  # that draft's position is taken: dropped
    assert ticketed(led, 9) and not led.want_draft()  # a drafted EOS ends drafting
    (job,) = led.dispatch()  # the lone draft goes out without waiting for a full window
    assert (job.start, job.end) == (2, 3)
    steps = led.finish(job.id, 0, None, lambda j, f, d: (1, 3))
    assert led.done and led.generated() == [7, 9] and steps[0].committed == 1  # stops at EOS
    assert not led.want_draft() and led.dispatch() == []

    led = Ledger([5], lookahead=4, max_new_tokens=2, workers=1)
    (job,) = led.dispatch()
    led.finish(job.id, 0, None, lambda j, f, d: (0, 1))
    assert ticketed(led, 2) and not led.want_draft()  # the budget allows one more position only
    (job,) = led.dispatch()
    led.finish(job.id, 0, None, lambda j, f, d: (1, 3))
    assert led.done and led.generated() == [1, 2]


# ---- real workers --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pools(target):
    get_pool("process", target, 4, 1)  # start all four at once; N = 1 and 2 use the first ones
    yield
    shutdown_pools()


def reference(target, prompts, eos=()):
    return generate(target, Autoregressive(), prompts, max_new_tokens=NEW, sampling=GREEDY, eos_ids=eos).output_ids


def run_dsi(target, draft, prompts, workers, gamma=3, eos=()):
    proposer = DSI(draft, gamma, workers=workers, threads=1)
    return proposer, dsi_generate(target, proposer, prompts, max_new_tokens=NEW, sampling=GREEDY, eos_ids=eos)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_dsi_matches_greedy(pools, target, small_draft, prompts, workers):
    ref = reference(target, prompts)
    for draft in (target, small_draft):  # the target itself always agrees; the small random one rarely does
        proposer, out = run_dsi(target, draft, prompts, workers)
        assert out.output_ids == ref
        for row, ids, extra in zip(out.rows, out.output_ids, out.extras):
            # the prompt's verification gives the first token (not a step); each step commits its accepted
            # drafts plus the target's token, which only the budget or an EOS at the end can cut
            assert len(ids) - 1 <= row.accepted + row.steps <= len(ids)
            assert extra["verifications"] == 1 + row.steps + extra["cancelled"] + extra["redundant"]
            assert extra["workers"] == workers and len(extra["busy"]) == workers
            assert all(0.0 <= b <= 1.0 for b in extra["busy"])
            if draft is target:
                assert row.accepted == row.drafted and row.rejections == 0
        assert out.wall_s > 0 and all(e["backend"] == proposer.backend for e in out.extras)
        # prompts decode one after another: the batch's wall time and TTFT both sum theirs
        assert out.wall_s == pytest.approx(sum(e["wall_s"] for e in out.extras))
        assert out.ttft_s == pytest.approx(sum(e["ttft_s"] for e in out.extras))


def test_dsi_stops_at_eos(pools, target, small_draft, prompts):
    ref = reference(target, prompts)
    eos = ref[0][9]
    stopped = reference(target, prompts, eos=(eos,))
    for draft in (target, small_draft):
        assert run_dsi(target, draft, prompts, 2, gamma=4, eos=(eos,))[1].output_ids == stopped


class Watched(Ledger):
    """The orchestrator's ledger, recording what it does. Its methods run under the orchestrator's lock, so what
    it records is never half-written: each job's inputs, the jobs whose answers may go back (`free`: every live
    job but the one reaching furthest, and a job reaching the budget), and each discard with the jobs it
    cancelled and whether each was still in flight (a worker on it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inputs_of: dict[int, list[int]] = {}
        self.free: set[int] = set()
        self.discards: list[tuple[int, list[tuple[int, bool]]]] = []

    def _open(self, worker, start, width):
        job = super()._open(worker, start, width)
        self.inputs_of[job.id] = list(self.tokens[: job.end])
        furthest = max(self.live.values(), key=lambda j: (j.end, j.id))
        self.free |= {j for j in self.live if j != furthest.id}
        if job.end >= self.cap - 1:  # no job can reach past it
            self.free.add(job.id)
        return job

    def _discard_from(self, p):
        doomed, running = [j for j, job in self.live.items() if job.end > p], set(self.running.values())
        super()._discard_from(p)
        self.discards.append((p, [(j, j in running) for j in doomed]))


class Gated:
    """A pool that gives answers back one per poll, each only once the ledger lets it go: once a job reaching
    further has been opened (so whichever verification commits a position finds the speculation built on it
    still out), or when its job is no longer needed, reaches the budget, or the row is done. The order is
    the ledger's doing, not the clock's: a slow drafter only makes the answer wait longer. `guard_s` only keeps
    a broken ledger from hanging the test (the test then fails on `guard_fired`)."""

    def __init__(self, pool, ledgers: list, guard_s: float = 120.0):
        self.pool, self.ledgers, self.guard_s = pool, ledgers, guard_s
        self.held: list = []  # (answer, when it arrived)
        self.seqs: set = set()  # the rows decoded through this gate (a shared pool may answer earlier ones)
        self.guard_fired = 0

    def submit(self, worker, task):
        self.seqs.add(task.seq)
        self.pool.submit(worker, task)

    def _may_go(self, answer, since: float) -> bool:
        led = self.ledgers[-1]
        if answer.seq not in self.seqs or led.done or answer.job not in led.live or answer.job in led.free:
            return True
        if time.monotonic() - since > self.guard_s:
            self.guard_fired += 1
            return True
        return False

    def poll(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            self.held += [(a, now) for a in self.pool.poll(0.01 if self.held else timeout)]
            for i, (answer, since) in enumerate(self.held):
                if self._may_go(answer, since):
                    del self.held[i]
                    return [answer]  # one at a time: the next is judged on the ledger this one leaves
            if time.monotonic() >= deadline:
                return []


def test_a_rejection_cancels_the_verifications_in_flight_on_the_rejected_draft(pools, target, prompts, monkeypatch):
    """The drafter is scripted (plain decoding's tokens, but a wrong one at position `w`) and the pool gated,
    so the order is forced: the verification that commits position w rejects the wrong draft while a
    verification built on it is out, and that one is cancelled and its answer ignored."""
    from sdbench.dsi import orchestrator

    prompt, lookahead = prompts[0], 2
    ref = reference(target, [prompt])[0]
    w = len(prompt) + 3  # the 4th new token: after the prompt's verifications, well before the budget
    script = prompt + ref
    wrong = script[w] = (ref[3] + 1) % target.vocab_size

    class Scripted:
        def __init__(self, runner, prompt, capacity, sampling):
            pass

        def next_token(self, tokens):
            return script[len(tokens)]

        def end(self):
            pass

    ledgers: list[Watched] = []
    monkeypatch.setattr(orchestrator, "PromptDrafter", Scripted)
    monkeypatch.setattr(orchestrator, "Ledger", lambda *a, **k: ledgers.append(Watched(*a, **k)) or ledgers[-1])
    pool = Gated(get_pool("process", target, 2, 1), ledgers)
    row = RowDecode(pool, None, prompt, lookahead=lookahead, workers=2, max_new_tokens=NEW, eos=(),
                    sampling=GREEDY, generator=None).run()
    (led,) = ledgers
    assert pool.guard_fired == 0  # every answer went back on the ledger's word, none on the hang guard
    assert row.tokens == ref  # the wrong draft never reached the output
    # exactly one discard, at the wrong draft: it cancelled verifications whose inputs held that draft, one
    # of them still running on its worker
    ((at, cancelled),) = led.discards
    assert at == w and cancelled and all(led.inputs_of[j][w] == wrong for j, _ in cancelled)
    assert any(in_flight for _, in_flight in cancelled)
    assert row.extras["cancelled"] == len(cancelled) and row.stats.rejections <= 1
    assert row.extras["verifications"] == 1 + row.stats.steps + row.extras["cancelled"] + row.extras["redundant"]


def test_only_the_drafter_thread_waits_for_the_device(pools, target, small_draft, prompts, monkeypatch):
    """On a GPU the drafter thread captures CUDA graphs: a device synchronisation in another thread of the
    process during a capture breaks it, so the calling thread times itself without waiting for the device."""
    import threading

    from sdbench.dsi import orchestrator

    waits, real = [], orchestrator.now

    def now(device=None):
        if device is not None:
            waits.append(threading.current_thread().name)
        return real(device)

    monkeypatch.setattr(orchestrator, "now", now)
    pool = get_pool("process", target, 2, 1)
    row = RowDecode(pool, small_draft, prompts[0], lookahead=2, workers=2, max_new_tokens=NEW, eos=(),
                    sampling=GREEDY, generator=None).run()
    assert row.tokens == reference(target, prompts[:1])[0]
    assert set(waits) <= {"sdbench-dsi-drafter"}  # the drafter reads its tokens back; nothing else ever waits


def test_dsi_matches_greedy_with_the_cpu_fast_path(pools, target, small_draft, prompts):
    """Workers of a fast-path target receive its plain weights and build the fast path themselves."""
    from sdbench.models.forward import cpufast
    from sdbench.models.forward.runner import ModelRunner

    fast_target = ModelRunner(tiny_model(0), "tiny-fast", fast=True)
    if not fast_target.cpu_fast:
        skip_unless_ci("no packed GEMM on this CPU build")
    fast_pools = []
    try:
        for draft in (fast_target, small_draft):
            out = run_dsi(fast_target, draft, prompts, 2)[1]
            assert out.output_ids == reference(target, prompts)
        fast_pools = [pool for key, pool in pool_module._pools.items() if key[-1]]
        assert len(fast_pools) == 1  # workers for a fast-path target are their own pool
    finally:
        for pool in fast_pools:
            discard_pool(pool)
    assert cpufast.fast_model(fast_target.model) is fast_target.path.fast  # ours untouched


def test_a_worker_that_cannot_start_is_named_at_once(target):
    from transformers import GPT2Config, GPT2LMHeadModel

    unsupported = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=32))
    # named at once: the worker's own reason, not the start timeout's "did not start in N s"
    with pytest.raises(WorkerFailed, match=r"^DSI worker 0 failed to start: SdbenchError: .*gpt2") as failure:
        pool_module.ProcessPool(unsupported, "tiny-gpt2", "cpu", 1).ensure(1)
    assert "\n" not in str(failure.value) and "Traceback" in failure.value.details
    unsendable = tiny_model(0)
    unsendable.packed = torch.randn(4, 4).to_mkldnn()  # an opaque tensor: no storage to share
    with pytest.raises(WorkerFailed, match=r"^DSI worker 0 could not be sent the target model: "):
        pool_module.ProcessPool(unsendable, "tiny", "cpu", 1).ensure(1)


def test_ray_backend_matches_greedy(ray_cluster, target, small_draft, prompts):
    try:
        proposer = DSI(small_draft, 3, workers=2, backend="ray", threads=1)
        out = dsi_generate(target, proposer, prompts[:2], max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == reference(target, prompts[:2])
    finally:
        shutdown_pools()


def test_bad_settings_are_one_line_errors(target, small_draft, prompts):
    with pytest.raises(SdbenchError, match="greedily only"):
        run = DSI(small_draft, 3, workers=1)
        dsi_generate(target, run, prompts, max_new_tokens=4, sampling=SamplingConfig(temperature=0.7))
    with pytest.raises(SdbenchError, match="backend=spark"):
        build_proposer("dsi", BuildContext(target, [small_draft], 3, {"backend": "spark"}))
    with pytest.raises(SdbenchError, match="needs a draft model"):
        build_proposer("dsi", BuildContext(target, ["ngram"], 3, {}))
    with pytest.raises(SdbenchError, match="workers=0"):
        build_proposer("dsi", BuildContext(target, [small_draft], 3, {"workers": "0"}))
    with pytest.raises(SdbenchError, match="--gamma"):
        build_proposer("dsi", BuildContext(target, [small_draft], 0, {}))


def test_ray_missing_is_a_clear_error(monkeypatch, target):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("no ray")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    from sdbench.dsi.pools import RayPool
    from sdbench.errors import MissingPackageError

    with pytest.raises(MissingPackageError, match="pip install ray") as missing:
        RayPool(target.model, "t", "cpu", 1)
    assert "pip install 'sdbench[ray]'" in str(missing.value)


def test_a_failure_is_raised_and_the_pool_replaced(pools, target, small_draft, prompts):
    """A worker that fails its task is reported in one line naming the worker and the reason. The prompt's last
    token is one only the drafter knows (a larger vocabulary), so the drafter runs and only the target fails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sdbench.models.forward.runner import ModelRunner

    torch.manual_seed(0)
    wide = ModelRunner(LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    num_key_value_heads=1, initializer_range=0.3)).eval())
    broken = prompts[0] + [150]  # outside the target's 96 tokens: its forwards fail in the workers
    proposer = DSI(wide, 3, workers=2, threads=1)
    with pytest.raises(WorkerFailed) as failure:
        dsi_generate(target, proposer, [broken], max_new_tokens=4, sampling=GREEDY)
    message = str(failure.value)
    assert re.fullmatch(r"DSI worker [01] [a-z ]+: IndexError: index out of range in self", message), message
    assert "Traceback" in failure.value.details  # the worker's own traceback is kept, off the one line
    assert pool_module._pools == {}  # discarded: the next generation starts fresh workers
    _, out = run_dsi(target, small_draft, prompts[:1], 2)
    assert out.output_ids == reference(target, prompts[:1])


def test_the_drafter_drafts_after_a_one_token_prompt(small_draft):
    """Nothing to prefill before the first draft: it feeds the whole (one-token) prompt itself."""
    from sdbench.dsi.orchestrator import PromptDrafter

    drafter = PromptDrafter(small_draft, [5], 16, GREEDY)
    with torch.no_grad():
        want = small_draft.model(torch.tensor([[5]])).logits[0, -1].argmax()
    assert drafter.next_token([5]) == int(want)
    drafter.end()


def test_the_command_picks_the_dsi_decoder_and_the_one_loop_for_every_other_strategy():
    from sdbench.strategies import strategy_registry

    for e in strategy_registry:
        cls = e.load().proposer
        assert decoder_for(cls.__new__(cls)) is (dsi_generate if e.name == "dsi" else generate), e.name


def test_the_one_loop_refuses_a_proposer_of_another_decoder(target, small_draft):
    """Calling the loop with DSI would decode plainly and look right: it refuses, naming the way."""
    with pytest.raises(ValueError, match="runs on the 'dsi' decoder"):
        generate(target, DSI(small_draft, 2, workers=1), [[1, 2, 3]], max_new_tokens=4, sampling=GREEDY)


def test_a_drafter_failure_is_raised_by_the_calling_thread(pools, target, prompts, monkeypatch):
    """The drafter thread's error stops its thread and is raised where the decode was called, not lost in the
    thread (which would leave the calling thread waiting for drafts that never come)."""
    from sdbench.dsi import orchestrator

    class Failing:
        def __init__(self, runner, prompt, capacity, sampling):
            self.ended = False

        def next_token(self, tokens):
            raise ValueError("the draft model broke")

        def end(self):
            self.ended = True

    monkeypatch.setattr(orchestrator, "PromptDrafter", Failing)
    row = RowDecode(get_pool("process", target, 2, 1), None, prompts[0], lookahead=2, workers=2,
                    max_new_tokens=NEW, eos=(), sampling=GREEDY, generator=None)
    with pytest.raises(ValueError, match="the draft model broke"):
        row.run()
    assert not row.drafts.thread.is_alive() and row.drafts.drafter.ended
    discard_pool(row.pool)  # its workers may still hold the prompt's verifications: later tests start fresh ones


def test_every_drafting_second_goes_to_one_step(pools, target, small_draft, prompts):
    """The drafter counts its time; each committing step takes what was drafted since the previous one (the
    first step also what came before the first token): the steps' draft_s and what is left after the last
    step add up to the drafter's total, nothing counted twice or lost across the two threads."""
    row = RowDecode(get_pool("process", target, 2, 1), small_draft, prompts[0], lookahead=2, workers=2,
                    max_new_tokens=NEW, eos=(), sampling=GREEDY, generator=None)
    out = row.run()
    assert out.tokens == reference(target, prompts[:1])[0]
    drafts = row.drafts
    assert out.stats.steps > 0 and drafts.made == out.extras["drafted_total"] > 0
    assert out.stats.draft_s + drafts.unassigned_s == pytest.approx(drafts.draft_s)
    assert 0 < drafts.first_s <= drafts.draft_s
