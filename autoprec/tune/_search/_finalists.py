"""The finalists: what the final re-measure times together, and that re-measure. Each budget's alternatives
(_alternatives.py, its own profile-greedy policy among them) and its best trials within it by the goal, with the
safer variant of the first (`gather_candidates`), re-measured interleaved with a sequential test, a cap on its
extra rounds, and more rounds on a noisy machine (`final_remeasure`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import optuna

from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import (
    FINAL_SHARE,
    GROSS_SLOWDOWN,
    NOISY_SPREAD,
    SETTLED_FINAL_ROUNDS,
    SearchConfig,
    TimingConfig,
)
from autoprec.tune._core._goal import Goal
from autoprec.tune._core._names import FP32, GREEDY
from autoprec.tune._core._records import Candidate, Finals, Measurement, TrialRecord
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._decide._alternatives import Alternatives, alternatives
from autoprec.tune._decide._choose import safer_variant
from autoprec.tune._decide._goals import SPEED
from autoprec.tune._measure._choices import Choices, policy_from_params, searches_fp8_all_gather
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._measure._task import Workload
from autoprec.tune._measure._timing import Stopwatch, Timing, all_settled, more_if_noisy, spread_text
from autoprec.tune._measure._trainer import fp32_step_failed, measure_steps_or_fail
from autoprec.tune._search._objective import Judge
from autoprec.tune._search._plan import Plan, Started

log = logging.getLogger("autoprec")


def gather_candidates(
    workload: Workload,
    space: SearchSpace,
    started: Started,
    plan: Plan,
    k: int,
    *,
    goal: Goal = SPEED,
    cuda_graphs: bool = False,
) -> tuple[dict[str, Candidate], dict[float, str], dict[str, str]]:
    """What is re-measured: the alternatives (each budget with its own profile-greedy policy), then per budget
    its k best trials within it by the goal (the fastest; the smallest in peak memory) and the safer variant of the
    first of them (its fp16/fp8 layers in bf16), and, in a search of the fp8 all-gather, the first with that setting
    the other way, each policy once, under the first name it came by (a trial
    that is an alternative, the all-fp32 warm start say, is measured as the alternative). Returns the candidates, budget -> its greedy candidate's name, and the
    alternatives not measured with why."""
    candidates: dict[str, Candidate] = {}

    def add(name: str, candidate: Candidate) -> str:
        same = next((n for n, c in candidates.items() if c == candidate), None)
        if same is None:
            candidates[name] = candidate
        return same or name

    greedy, notes = {}, {}
    budgets = started.budgets.absolute
    for b in budgets:
        alts = baselines(workload, space, started.profile, started.choices, b, goal=goal, cuda_graphs=cuda_graphs)
        notes.update(alts.notes)
        own = plan.greedy_name(b, started.budgets)
        for name, candidate in alts.candidates.items():
            label = add(own if name == GREEDY else name, candidate)
            if name == GREEDY:
                greedy[b] = label
                if label != own:
                    notes[own] = f"the same policy as {label}, measured once under that name"
    for b in budgets:
        finalists = finalist_policies(started.study, started.choices, k, budget=b, exclude=list(candidates.values()), goal=goal)
        for name, candidate in finalists.items():
            add(name, candidate)
        if finalists:
            top_name, top = next(iter(finalists.items()))
            safer = safer_variant(top.policy, started.choices)
            if safer is not None:
                add(f"{top_name}, fp16/fp8 -> bf16", Candidate(safer))
            if started.choices.fp8_all_gather and top.policy.fp8_gatherable:
                # the setting's own effect on step time and memory, measured beside it in the same rounds
                gather = not top.policy.fsdp_fp8_all_gather
                flipped = dataclasses.replace(top.policy, fsdp_fp8_all_gather=gather)
                add(f"{top_name}, fp8 all-gather {'on' if gather else 'off'}", Candidate(flipped))
    return candidates, greedy, notes


def baselines(
    workload: Workload,
    space: SearchSpace,
    prof: Profile,
    choices: Choices,
    budget: float,
    *,
    goal: Goal = SPEED,
    cuda_graphs: bool = False,
) -> Alternatives:
    """What every result is compared with, measured in the same run: alternatives.alternatives (its profile-greedy
    policy priced by the goal; uniform bf16 under CUDA graphs where `cuda_graphs`; torchao's tensorwise recipe with
    its fp8 all-gather where the search measures that setting: searches_fp8_all_gather)."""
    offered = frozenset(f for formats in space.layers.values() for f in formats)
    return alternatives(
        workload.model,
        workload.device,
        prof,
        choices,
        budget,
        offered=offered,
        cost=goal.layer_cost,
        cuda_graphs=cuda_graphs,
        fp8_all_gather=searches_fp8_all_gather(workload.sharding is not None, goal),
    )


def finalist_policies(
    study: optuna.Study,
    choices: Choices,
    k: int,
    *,
    budget: float | None = None,
    exclude: Collection[Candidate] = (),
    goal: Goal = SPEED,
) -> dict[str, Candidate]:
    """The k best distinct feasible policies of the study in the goal's order (Goal.finalists: the fastest, or the
    smallest in peak memory; by speed, none whose timing is separated below the fastest trial's), with `budget`
    among those whose drop fits it, leaving out those in `exclude` (the alternatives, measured under their own
    names)."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    good = [(t, r) for t, r in ((t, TrialRecord.of(t)) for t in done) if r.feasible]
    if budget is not None:
        good = [(t, r) for t, r in good if r.metric_drop is not None and r.metric_drop <= budget]
    picked: dict[str, Candidate] = {}
    seen = {json.dumps(c.policy.to_dict(), sort_keys=True) for c in exclude if not c.tf32}
    for t, _ in goal.finalists(good):
        policy = policy_from_params(t.params, choices)
        key = json.dumps(policy.to_dict(), sort_keys=True)
        if key not in seen:
            seen.add(key)
            picked[f"trial {t.number}"] = Candidate(policy)
        if len(picked) == k:
            break
    return picked


def remeasure(
    workload: Workload,
    candidates: Mapping[str, Candidate],
    judge: Judge,
    budget: float,
    timing: TimingConfig,
    *,
    progress: str | None = None,
    compiled: bool = False,
    enough: Callable[[Mapping[str, Sequence[float]]], bool] | None = None,
    more: Callable[[Mapping[str, Sequence[float]]], int] | None = None,
    retire: Callable[[Mapping[str, Sequence[float]]], Collection[str]] | None = None,
    max_memory: int | None = None,
    judged: Mapping[str, tuple[float, dict[str, Any]]] | None = None,
    each_round: Callable[[Mapping[str, Sequence[float]]], None] | None = None,
) -> Finals:
    """Metric, step time and peak memory of each candidate, timed interleaved with the others; speedup vs fp32
    in effective steps (those the GradScaler did not skip), memory saving vs fp32's peak, and whether the peak fits
    `max_memory` (bytes; None: no limit); see records.Measurement. `enough`, `more`, `retire`, `each_round`: as
    timing.interleaved_times'. A candidate that fails to build or in its rounds (out of the device's memory) is a row
    that does not run, its error said; the others are timed on. `judged`: each candidate's metric (judge_metrics),
    where the caller needed it before the timing; else measured after it."""
    stats, failed = measure_steps_or_fail(
        workload,
        candidates,
        timing,
        progress=progress,
        compiled=compiled,
        enough=enough,
        more=more,
        retire=retire,
        each_round=each_round,
    )
    if FP32 in failed:
        raise fp32_step_failed(workload, "all-fp32 training step", failed[FP32], compiled=compiled)
    fp32_ms = stats[FP32].effective_ms
    fp32_peak = stats[FP32].peak_bytes
    metrics = judged if judged is not None else judge_metrics(judge, candidates)
    rows = []
    for name in candidates:
        metric, extra = metrics[name]
        drop = judge.fp32_metric - metric
        s = stats.get(name)
        runs = s is not None and math.isfinite(metric) and s.finite and math.isfinite(s.effective_ms)
        effective_ms = s.effective_ms if s else math.nan
        rows.append(
            Measurement(
                candidate=name,
                metric=metric,
                metric_drop=drop,
                runs=runs,
                feasible=False,  # judged below, by Measurement.within
                step_ms=s.timing.median_ms if s else math.nan,
                skipped=s.skipped if s else 0,
                steps=s.steps if s else 0,
                effective_step_ms=effective_ms,
                spread=s.timing.spread if s else math.nan,
                compile_s=s.compile_s if s else None,
                train_skipped=extra.get("train_skipped"),
                error=failed.get(name) or extra.get("error"),
                speedup=fp32_ms / effective_ms if effective_ms else math.inf,
                rounds=len(s.timing.samples_ms) if s else 0,
                peak_bytes=s.peak_bytes if s else None,
                memory_saving=memory.saving(s.peak_bytes if s else None, fp32_peak),
                fits=max_memory is None or (s is not None and s.peak_bytes is not None and s.peak_bytes <= max_memory),
                host_ms=s.timing.host_ms if s else None,
                host_bound=s.timing.host_bound if s else False,
                busy_ms=s.timing.busy_ms if s else None,
            )
        )
    return Finals(rows).within(budget)


def rounds_so_far(
    samples: Mapping[str, Sequence[float]], judged: Mapping[str, tuple[float, dict[str, Any]]], fp32_metric: float
) -> list[dict[str, Any]]:
    """The final re-measure's rows as its rounds stand: each candidate timed so far, its metric and drop, rounds, the
    median step so far, its spread and speedup over fp32's median so far (raw steps: skipped ones are counted once
    the timing ends), and its samples. Not a result: finalists.csv is, written when the re-measure ends."""
    fp32 = samples.get(FP32)
    fp32_ms = Timing.from_samples(list(fp32)).median_ms if fp32 else math.nan
    rows = []
    for name, ms in samples.items():
        if not ms:
            continue
        metric = judged[name][0] if name in judged else math.nan
        t = Timing.from_samples(list(ms))
        rows.append({
            "candidate": name, "metric": metric, "metric_drop": fp32_metric - metric, "rounds": len(ms),
            "step_ms": t.median_ms, "spread": t.spread, "speedup": fp32_ms / t.median_ms if t.median_ms > 0 else math.nan,
            "samples_ms": " ".join(f"{x:.4f}" for x in ms),
        })  # fmt: skip
    return rows


def judge_metrics(judge: Judge, candidates: Mapping[str, Candidate]) -> dict[str, tuple[float, dict[str, Any]]]:
    """Each candidate's metric and what else its evaluation measured (Judge.safe_metric), by name."""
    return {name: judge.safe_metric(candidate) for name, candidate in candidates.items()}


def out_of_the_running(within: Collection[str]) -> Callable[[Mapping[str, Sequence[float]]], set[str]]:
    """interleaved_times' `retire` for the final re-measure: the candidates each of whose rounds so far (RETIRE_ROUNDS
    at least: one round's stall is not a verdict) was slower a step than GROSS_SLOWDOWN x the slowest round of a
    candidate in `within` (fp32 always: its drop is 0): out of the running whatever the noise, since that one is
    within every budget and faster (measure_steps_or_fail shows it effective step times: a skipped step's time
    counts for the steps taken, a non-finite loss as infinitely slow). They are timed no more, and their rounds so
    far are their row. On a CPU without fast bf16 that is uniform bf16 (its step 30x fp32's); on a GPU, fp32 itself
    (its step 10x a bf16 one's)."""
    fair = {FP32, *within}

    def retire(samples: Mapping[str, Sequence[float]]) -> set[str]:
        bars = [max(v) for name, v in samples.items() if name in fair and len(v) >= RETIRE_ROUNDS]
        return {
            name for name, v in samples.items() if len(v) >= RETIRE_ROUNDS and any(min(v) > GROSS_SLOWDOWN * bar for bar in bars)
        }

    return retire


RETIRE_ROUNDS = 2  # a spread needs two rounds, and a load spike on a shared machine lasts one


def final_remeasure(
    workload: Workload,
    candidates: Mapping[str, Candidate],
    judge: Judge,
    config: SearchConfig,
    watch: Stopwatch,
    *,
    cap_s: float | None = None,
    noisy_device: bool = False,
    each_round: Callable[[list[dict[str, Any]]], None] | None = None,
) -> Finals:
    """The finalists and the alternatives re-measured together (remeasure), the compilation timed apart. `cap_s`:
    seconds of timing after which it stops once SETTLED_FINAL_ROUNDS rounds are in (FINAL_SHARE of the search).
    `noisy_device`: the trials found the device too noisy to rank (trials.device_noise beyond NOISY_SPREAD): its
    configured rounds only, as a quiet device's, since more rounds at that noise separate nothing, and it says so.
    `each_round(rows)`: told after every round the rows so far (rounds_so_far), for a file a run stopped before
    the end leaves behind."""
    label = f"re-measuring {len(candidates)} candidates" if config.progress else None
    # the metrics first: a candidate within budget may put another out of the running while the rounds go on. Within
    # the smallest budget (a sweep's), so a candidate retired is out of the running for every budget; with a memory
    # limit, fp32 alone, since a faster candidate may not fit it
    start = time.perf_counter()
    judged = judge_metrics(judge, candidates)
    smallest = judge.budgets.smallest
    within = (
        {n for n, (metric, _) in judged.items() if judge.fp32_metric - metric <= smallest}  # NaN: never within
        if config.max_memory is None
        else set()
    )
    metrics_s = time.perf_counter() - start
    start = time.perf_counter()
    capped: list[int] = []
    noisy = more_if_noisy(config.final_timing.rounds)

    def more(samples: Mapping[str, Sequence[float]]) -> int:
        # past the cap, or on a device the trials found too noisy: no more rounds, and no warning that promises them
        # or under a goal that does not rank by this machine's clock (Goal.timed: an estimate for another device)
        return 0 if capped or noisy_device or not config.objective.timed else noisy(samples)

    def enough(samples: Mapping[str, Sequence[float]]) -> bool:
        # stops early once every candidate's rounds agree (timing.all_settled), or once past the cap: the
        # candidates it has not separated by then are reported as ties, the safer one chosen (_choose.py)
        if all_settled(samples):
            return True
        over = (
            cap_s is not None and time.perf_counter() - start > cap_s and min(map(len, samples.values())) >= SETTLED_FINAL_ROUNDS
        )
        if over and not capped:
            capped.append(min(map(len, samples.values())))
        return over

    # a loaded machine times on as long again, pooled with the first rounds, within the cap (timing.more_if_noisy)
    finals = remeasure(
        workload,
        candidates,
        judge,
        judge.budgets.bound,
        dataclasses.replace(config.final_timing, busy=True),  # the table says which step is host-bound
        progress=label,
        compiled=config.compile,
        enough=enough,
        more=more,
        retire=out_of_the_running(within),
        max_memory=config.max_memory,
        judged=judged,
        each_round=None if each_round is None else lambda samples: each_round(rounds_so_far(samples, judged, judge.fp32_metric)),
    )
    watch.count("final re-measure: whole-step timings (each round: every candidate's)", sum(r.rounds for r in finals))
    if capped:
        watch.count(f"final re-measure: rounds stopped at its cap ({FINAL_SHARE:.0%} of the search's time before it)", capped[0])
    if not config.objective.timed:
        pass  # the step times are this machine's, reported as such; no choice depends on their noise
    elif finals.noisiest() > NOISY_SPREAD and noisy_device:
        log.warning(
            "this machine is too noisy to separate these candidates (step times spread up to %s, as in the "
            "trials): candidates closer than that are ties, and the safer one is chosen; rerun on a quieter machine "
            "with --remeasure for a ranking",
            spread_text(finals.noisiest()),
        )
    elif finals.noisiest() > NOISY_SPREAD:
        log.warning(
            "step times still spread up to %s: candidates closer than that are ties, and the safer one is "
            "chosen; rerun on a quieter machine with --remeasure for a ranking",
            spread_text(finals.noisiest()),
        )
    seconds = time.perf_counter() - start
    compiling = sum(r.compile_s or 0.0 for r in finals)
    if compiling:
        watch.add(f"final re-measure: compiling {len(candidates)} candidates (first step)", compiling)
    watch.add(f"final re-measure of {len(candidates)} candidates", seconds - compiling + metrics_s)
    return finals
