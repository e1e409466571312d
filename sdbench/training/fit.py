"""Fitting a head on self-distillation data (training/data.py): one loop for every kind (eagle3.py, medusa.py
give `steps`, `labels` and `weights`), a wall-clock budget, held-out acceptance, checkpoints that make an
interrupted fit resumable, and the head written in the format engines load after every evaluation."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sdbench.training.data import Sequence, first_roots, pad_batch


@dataclass
class FitPlan:
    """How the head is fitted: the unrolled steps (EAGLE-3's training-time test; Medusa: its heads), the
    learning rate and batch size in tokens, and when to evaluate."""

    steps: int
    lr: float
    batch_tokens: int
    eval_every_s: float
    seed: int = 0
    max_steps: int | None = None  # stop there too (a fit measured step by step rather than by the clock)


@dataclass
class Progress:
    """Where a fit stands (kept in its checkpoint)."""

    step: int = 0
    seconds: float = 0.0  # time spent fitting, evaluations and checkpoints included, over every resumed run
    loss: float = float("nan")
    heldout: dict | None = None  # chain_acceptance of the last evaluation


def batches(seqs: list[Sequence], batch_tokens: int, rng: random.Random):
    """Endless shuffled batches of sequences of about batch_tokens tokens (padding counted)."""
    while True:
        order = sorted(seqs, key=lambda s: len(s.tokens) + rng.random())  # similar lengths pad little
        groups, cur = [], []
        for s in order:
            if cur and (len(cur) + 1) * max(len(s.tokens), *(len(c.tokens) for c in cur)) > batch_tokens:
                groups.append(cur)
                cur = []
            cur.append(s)
        if cur:
            groups.append(cur)
        rng.shuffle(groups)
        yield from groups


def step_losses(model, seqs: list[Sequence], n_steps: int, device, sample: torch.Generator | None = None):
    """The mean cross-entropy over every step's labelled positions (plus the trainee's `aux_loss` where it has one),
    each step's logits and labels. sample: for a
    trainee with `roots_per_batch` (a block drafter, whose every root costs a block; an MTP module, whose every
    root's logits cost a full-vocabulary head), the roots fitted are that
    many of the batch's labelled ones, drawn from this generator (logits and labels [R, ...] then)."""
    tokens, states, pred, lengths = (t.to(device) for t in pad_batch(seqs))
    before = torch.arange(tokens.shape[1], device=device)[None, :] < first_roots(seqs).to(device)[:, None]
    labels = [lab.masked_fill(before, -100) for lab in model.labels(pred, n_steps, lengths)]  # answers only
    many = getattr(model, "roots_per_batch", 0)
    if sample is not None and many:
        found = (labels[0] != -100).nonzero()  # [N, 2] (row, position)
        roots = found[torch.randperm(len(found), generator=sample)[:many].sort().values.to(found.device)]
        logits = model.steps(tokens, states, n_steps, roots)
        labels = [lab[roots[:, 0], roots[:, 1]] for lab in labels]
    else:
        logits = model.steps(tokens, states, n_steps)
    losses = [F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), lb.reshape(-1), ignore_index=-100)
              for lg, lb in zip(logits, labels) if bool((lb != -100).any())]
    loss = torch.stack(losses).mean()
    if hasattr(model, "aux_loss"):  # a head with a part fitted to its own target (DSpark's confidence head)
        loss = loss + model.aux_loss(logits, labels)
    return loss, logits, labels


@torch.no_grad()
def chain_acceptance(model, seqs: list[Sequence], n_steps: int, device, batch_tokens: int) -> dict:
    """Greedy chain drafting of n_steps tokens from every answer position of held-out sequences whose whole
    chain lies in the sequence (the positions decoding drafts from; a prompt's are easier and would flatter
    it): how many drafts the target accepts (the leading run of drafts equal to the target's own choices), as
    the mean accepted length τ (with the target's bonus token) and per-step acceptance."""
    model.eval()
    roots, per_step = 0, [0] * n_steps
    for group in _once(seqs, batch_tokens):
        _, logits, labels = step_losses(model, group, n_steps, device)
        if len(logits) < n_steps:
            continue
        T = labels[0].shape[1]
        lengths = torch.tensor([len(s.tokens) for s in group], device=device)
        roots_at = torch.arange(T, device=device)[None, :]
        full = (roots_at + n_steps < lengths[:, None]) & (roots_at >= first_roots(group).to(device)[:, None])
        # the chain fits, and starts where decoding drafts from (an answer's positions)
        run = torch.ones_like(full)
        for k in range(n_steps):
            run = run & (logits[k].argmax(-1) == labels[k]) & (labels[k] != -100)
            per_step[k] += int((run & full).sum())
        roots += int(full.sum())
    model.train()
    if roots == 0:
        return {"tau": float("nan"), "per_step": [], "positions": 0}
    reach = [c / roots for c in per_step]  # P(the first k + 1 drafts all accepted)
    return {"tau": 1.0 + sum(reach), "per_step": reach, "positions": roots}


def _once(seqs: list[Sequence], batch_tokens: int):
    """Every sequence once, in batches."""
    count = 0
    for group in batches(seqs, batch_tokens, random.Random(0)):
        yield group
        count += len(group)
        if count >= len(seqs):
            return


def lr_at(step: int, base: float, warmup: int = 10) -> float:
    return base * min(1.0, (step + 1) / warmup)


def fit(model, optimizer, train: list[Sequence], heldout: list[Sequence], plan: FitPlan, progress: Progress,
        budget_s: float, device, on_eval, on_step=None) -> Progress:
    """Train until budget_s seconds of fitting (steps, evaluations and checkpoints: the wall clock's, over every
    resumed run; progress.seconds counts them) have passed, or plan.max_steps steps; evaluate on `heldout` every
    plan.eval_every_s and at the end, calling on_eval(progress) then (it writes the checkpoint and the head).
    on_step(progress) after every step (the progress bar). The batches are drawn from plan.seed alone and a resumed fit skips the progress.step already
    taken, so that, on the same data, it goes on exactly as the fit that was not interrupted."""
    stream = batches(train, plan.batch_tokens, random.Random(plan.seed))
    for _ in range(progress.step):  # resumed: on with the batches the fit would have drawn had it not stopped
        next(stream)
    last_eval = time.perf_counter()
    model.train()
    while progress.seconds < budget_s and (plan.max_steps is None or progress.step < plan.max_steps):
        t0 = time.perf_counter()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(progress.step, plan.lr)
        sample = torch.Generator().manual_seed(plan.seed * 1_000_003 + progress.step)  # the same on a resumed fit
        loss, _, _ = step_losses(model, next(stream), plan.steps, device, sample)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        progress.step += 1
        value = loss.item()
        progress.loss = value if math.isnan(progress.loss) else 0.95 * progress.loss + 0.05 * value
        progress.seconds += time.perf_counter() - t0
        if on_step is not None:
            on_step(progress)
        if time.perf_counter() - last_eval >= plan.eval_every_s and progress.seconds < budget_s:
            _evaluate(model, heldout, plan, progress, device, on_eval)
            last_eval = time.perf_counter()
    _evaluate(model, heldout, plan, progress, device, on_eval)
    return progress


def _evaluate(model, heldout, plan: FitPlan, progress: Progress, device, on_eval) -> None:
    """Held-out acceptance, then on_eval (the checkpoint and the head written); their time counts in the budget, as
    the steps' does (a checkpoint's own writing counts from the next one on)."""
    t0 = time.perf_counter()
    progress.heldout = chain_acceptance(model, heldout, plan.steps, device, plan.batch_tokens)
    progress.seconds += time.perf_counter() - t0
    t0 = time.perf_counter()
    on_eval(progress)
    progress.seconds += time.perf_counter() - t0
