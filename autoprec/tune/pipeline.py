"""The one pipeline a search and a sweep both are: check the output folder and the storage, profile (or reuse
the saved profile), run the Optuna study, gather each budget's finalists beside the alternatives, re-measure
them together, choose per budget, and write a verified policy per budget with the trial and finalist tables.

A search is this pipeline with one budget and one objective (the goal's value, `SearchConfig.objective`: the
speedup, or the peak memory; goals.py); a sweep has several budgets and a second objective (the metric drop), so
the study's Pareto front serves every budget. `Plan` holds what differs: the budgets, the objectives, the file
names. A memory limit (`SearchConfig.max_memory`) is a second constraint beside the budget.

The budget applies to one of two measurements (`Mode`): the metric of the given weights with the policy
applied (`weights`, cheap), or the metric after K training steps with the policy and its GradScaler,
against K steps of fp32 from the same weights in the same batch order (`train`), whose noise floor (the
fp32 result's own spread over seeds) is measured and reported beside the budget.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import torch

from autoprec import devices
from autoprec.apply import fp8_backend
from autoprec.devices import float32_matmul_precision
from autoprec.errors import UserError
from autoprec.files import write_atomically
from autoprec.formats import Format, device_name
from autoprec.policy import Policy, model_fingerprint
from autoprec.tune import memory
from autoprec.tune.alternatives import (
    ALTERNATIVES,
    FP32,
    GREEDY,
    Alternatives,
    alternatives,
)
from autoprec.tune.budget import check_ascending
from autoprec.tune.choices import Choices, build_choices, policy_from_params, warm_starts
from autoprec.tune.choose import choose_per_budget, safer_variant
from autoprec.tune.config import (
    BUDGET_FINAL_SHARE,
    FINAL_SHARE,
    NOISY_SPREAD,
    SETTLED,
    SETTLED_FINAL_ROUNDS,
    TIME_BUDGET_TOLERANCE,
    Mode,
    SearchConfig,
    TimingConfig,
)
from autoprec.tune.cost import Stopwatch
from autoprec.tune.credentials import hide_credentials
from autoprec.tune.goals import SPEED, Goal
from autoprec.tune.objective import Judge, Objective, run_trials
from autoprec.tune.out_dir import SavedProfile, claim_out_dir, disk_full, earlier_result, reuse_or_profile
from autoprec.tune.profile_data import Profile
from autoprec.tune.records import Chosen, Finals, Measured, Measurement, Result, StudyRef, TrialRecord
from autoprec.tune.space import SearchSpace
from autoprec.tune.speed import LayerTimes
from autoprec.tune.storage import check_storage, open_study
from autoprec.tune.task import Workload
from autoprec.tune.timing import all_settled, more_if_noisy
from autoprec.tune.trainer import Candidate, fp32_step_failed, measure_steps_or_fail
from autoprec.tune.trials import device_noise, first_of_run, trial_costs, trials_table

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger("autoprec")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What differs between a search and a sweep. `budgets`: ascending, the largest one bounds the study
    (`SearchConfig.budget`); `objectives`: 1 (the goal's value, SearchConfig.objective) or 2 (that and
    the metric drop, a Pareto front);
    the files written: one policy per budget, the trials table, the re-measured finalists."""

    budgets: tuple[float, ...]
    objectives: int
    policy_file: Callable[[float], str]
    trials_file: str
    finalists_file: str
    given: Mapping[float, str] = dataclasses.field(default_factory=dict)  # budget -> how the user gave it, if relative
    # a subfolder for a profile of its own where the output folder's does not serve (a sweep: never over a search's)
    profile_folder: str | None = None

    def __post_init__(self) -> None:
        check_ascending(self.budgets, what="plan.budgets")

    @property
    def is_sweep(self) -> bool:
        return self.objectives == 2

    def greedy_name(self, budget: float) -> str:
        """Each budget has its own profile-greedy policy; with one budget it keeps the plain name."""
        return GREEDY if len(self.budgets) == 1 else f"{GREEDY} {budget:g}"


@dataclasses.dataclass
class Started:
    """A study ready for trials: the profile (and where it is saved), the agreed choices, the study, where it lives,
    the judge."""

    profile: Profile
    choices: Choices
    study: optuna.Study
    storage: str
    judge: Judge
    saved: SavedProfile  # where the profile is saved, and whether this run measured it


@dataclasses.dataclass
class Run:
    """What the pipeline measured: the study's start, every re-measured candidate (`finals`), each budget's
    choice, the trials table, and where the time went."""

    started: Started
    candidates: dict[str, Candidate]
    finals: Finals
    chosen: list[Chosen]
    trials: pd.DataFrame  # trials.csv's rows
    cost: dict[str, Any]


def run(workload: Workload, space: SearchSpace, config: SearchConfig, out_dir: str | Path, plan: Plan) -> Run:
    """Profile, search, re-measure, choose and write (see the module's docstring)."""
    if plan.budgets[-1] > config.budget:
        raise ValueError(
            f"config.budget bounds the study and must be >= the largest budget, but got "
            f"config.budget={config.budget!r} and budgets up to {plan.budgets[-1]!r}"
        )
    if memory.source(workload.device) is None and (config.objective.needs_peak or config.max_memory is not None):
        flag = f"--objective {config.objective.name}" if config.objective.needs_peak else "--max-memory"
        raise UserError(f"{flag}: peak memory is {memory.not_measured(workload.device)}; search for speed without a limit")
    out_dir = Path(out_dir)
    with claim_out_dir(workload, out_dir):  # also makes the folder
        try:
            return _run(workload, space, config, out_dir, plan)
        except UserError:
            raise
        except Exception as exc:
            full = disk_full(exc)
            if full is None:
                raise
            # Optuna's own write of the study (or a compiler's cache) on a full disk: every complete trial is kept,
            # and a torn journal record is dropped on the next run (study._drop_torn_tail)
            where = (
                f"writing {full.filename}"
                if full.filename
                else f"writing the study ({hide_credentials(config.storage or str(out_dir / 'study.journal'))})"
            )
            raise UserError(
                f"--out {out_dir}: no space left on the device ({where}); free some space and run the same command "
                "again: the study resumes from its complete trials"
            ) from exc


def _run(workload: Workload, space: SearchSpace, config: SearchConfig, out_dir: Path, plan: Plan) -> Run:
    check_storage(config, out_dir)  # before minutes of profiling; opening the study checks it again
    began = time.perf_counter()
    watch = Stopwatch()
    started = start(
        workload, space, config, out_dir, watch, objectives=plan.objectives, smallest_budget=plan.budgets[0],
        profile_folder=plan.profile_folder,
    )  # fmt: skip
    layer_times = LayerTimes.from_table(started.profile.table.to_dict("records"))
    objective = Objective(
        workload, started.choices, space, started.judge, config, objectives=plan.objectives, layer_times=layer_times
    )
    objective.since = first_of_run(started.study)  # as run_trials sets it: should_stop reads this run's trials
    target = config.trials or space.trials
    if (_complete(started.study) < target and not objective.should_stop(started.study)) or config.remeasure:
        started.judge.measure()  # before the trials (its own line in the cost table); a result that stands needs none
    if config.time_budget is not None:  # the trials stop where the final re-measure's share still fits
        objective.deadline = began + config.time_budget / (1 + BUDGET_FINAL_SHARE)
        _say_if_no_trial_fits(config.time_budget, time.perf_counter() - began, objective.deadline - began)
    ran = run_trials(started.study, objective, target, progress=config.progress)
    stopped = None
    if objective.stopped is not None and _complete(started.study) < target:
        left = target - _complete(started.study)
        stopped = f"stopped after {_complete(started.study)} of {target} trials: {objective.stopped}"
        log.info("search: %s", stopped)
        watch.count("trials: not run, the search stopped early (why: the summary's `trials:` line)", left)
    if not ran and not config.remeasure:
        earlier = _earlier_result(out_dir, plan, started)
        if earlier is not None:
            return earlier
    started.judge.measure()  # a no-op once measured; else now, not inside the final re-measure's time
    if ran or not config.remeasure:  # trials of an interrupted run, or other workers', belong to this result
        trial_costs(started.study, watch)
    else:  # a finished study re-measured (--remeasure): its trials' time was spent by the earlier run, not this one
        watch.count("trials: run earlier, none now (their time is in the earlier run's table)", _complete(started.study))
    candidates, greedy, notes = gather_candidates(workload, space, started, plan, config.finalists, goal=config.objective)
    noise = device_noise(started.study, since=objective.since)
    finals = final_remeasure(
        workload, candidates, started.judge, config, watch, cap_s=_final_cap(config, watch, began, ran),
        noisy_device=noise is not None and noise > NOISY_SPREAD,
    )  # fmt: skip
    if config.time_budget is not None:
        _say_if_overrun(config.time_budget, time.perf_counter() - began, watch)
    # the tables first, the policy files last: a policy file marks a complete result (see _earlier_result)
    trials = trials_table(started.study, started.choices, started.profile)
    write_atomically(out_dir / plan.trials_file, lambda tmp: trials.to_csv(tmp, index=False))
    finals.to_csv(out_dir / plan.finalists_file)
    chosen = []
    picks = choose_per_budget(finals, candidates, plan.budgets, greedy, goal=config.objective)
    for name, b in {name: b for b, (name, _) in reversed(list(zip(plan.budgets, picks)))}.items():
        _warn_unfit(finals.within(b), name, b, config.max_memory)  # once per policy, at its smallest budget
    for b, (name, why) in zip(plan.budgets, picks):
        compared = {a: a for a in ALTERNATIVES if a != GREEDY and a in candidates} | {GREEDY: greedy[b]}
        measured = dataclasses.replace(
            measured_record(workload, started, config, finals, name, b, compared=compared, notes=notes),
            why=why, cost=watch.to_dict(), greedy=greedy[b], budget_given=plan.given.get(b), stopped=stopped,
            not_separated=config.objective.ties(finals.within(b), name),
            sweep={"budgets": list(plan.budgets), "study_budget": config.budget} if plan.is_sweep else None,
        )  # fmt: skip
        picked = candidates[name].policy
        policy = Policy(layers=picked.layers, loss_scale=picked.loss_scale, measured=measured.to_dict())
        file = policy.save(out_dir / plan.policy_file(b))
        chosen.append(Chosen(budget=b, name=name, why=why, policy=policy, file=file, greedy=greedy[b]))
    return Run(started=started, candidates=candidates, finals=finals, chosen=chosen, trials=trials, cost=watch.to_dict())


def _say_if_no_trial_fits(budget_s: float, spent_s: float, trials_s: float) -> None:
    """--time-budget: said as soon as the profile (or a reused one's check) has used the trials' share of it."""
    if spent_s >= trials_s:
        log.warning(
            "--time-budget %.1f min: the profile alone took %.1f min, past the %.1f min the trials may use, so no trial "
            "runs; the answer is chosen among the alternatives (give a larger --time-budget)",
            budget_s / 60, spent_s / 60, trials_s / 60,
        )  # fmt: skip


def _say_if_overrun(budget_s: float, spent_s: float, watch: Stopwatch) -> None:
    """--time-budget bounds the trials and the final re-measure's extra rounds; the profile and the re-measure's
    first SETTLED_FINAL_ROUNDS rounds are not cut short (docs/measuring.md). Past TIME_BUDGET_TOLERANCE, say where
    the time went."""
    if spent_s <= budget_s * (1 + TIME_BUDGET_TOLERANCE):
        return
    stages = sorted(watch.seconds.items(), key=lambda kv: -kv[1])[:2]
    where = ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in stages)
    log.warning(
        "--time-budget %.1f min overrun: the search took %.1f min (%s); the profile and the final re-measure's first "
        "%d rounds are not cut short", budget_s / 60, spent_s / 60, where, SETTLED_FINAL_ROUNDS,
    )  # fmt: skip


def _final_cap(config: SearchConfig, watch: Stopwatch, began: float, ran: int) -> float | None:
    """Seconds the final re-measure may time past its sequential test: FINAL_SHARE of the search's time (the profile
    and every trial of the study, earlier runs' too: the stopwatch's stages so far), within what is left of
    --time-budget. None (no cap) for --remeasure of a finished study: re-measuring is then the whole point."""
    if config.remeasure and not ran:
        return None
    spent = max(sum(watch.seconds.values()), time.perf_counter() - began)
    cap = FINAL_SHARE * spent
    if config.time_budget is not None:
        cap = min(cap, max(0.0, config.time_budget - (time.perf_counter() - began)))
    return cap


def _warn_unfit(finals: Finals, name: str, budget: float, limit: int | None) -> None:
    """Say so when the candidate written for `budget` does not fit --max-memory: nothing within budget did."""
    written = finals.by_name(name)
    if limit is None or written.fits:
        return
    within = [r for r in finals if r.runs and r.metric_drop <= budget and r.peak_bytes is not None]
    least = min(within, key=lambda r: r.peak_bytes or 0, default=None)
    smallest = (
        f"; the smallest peak within budget was {memory.human_bytes(least.peak_bytes)} ({least.candidate})" if least else ""
    )
    why = "whose peak was not measured" if written.peak_bytes is None else "which does not fit either"
    log.warning(
        "no candidate within budget %g fits --max-memory %s%s; the policy written is %s, %s: lower the batch size, "
        "or raise --max-memory", budget, memory.human_bytes(limit), smallest, name, why,
    )  # fmt: skip


def _complete(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def _earlier_result(out_dir: Path, plan: Plan, started: Started) -> Run | None:
    """The result an earlier run of this finished study wrote to out_dir, where it stands (out_dir.earlier_result);
    else None, and the finalists are re-measured."""
    study = started.study
    files = {b: out_dir / plan.policy_file(b) for b in plan.budgets}
    now = StudyRef(name=study.study_name, storage=started.storage, complete=_complete(study))
    earlier = earlier_result(files, out_dir / plan.finalists_file, now, started.judge.config)
    if earlier is None:
        return None
    if earlier.noise is not None:  # every file matched: the result stands with the noise floor it recorded
        started.judge.known(earlier.noise)
    log.warning(
        "study %r is finished and its result in %s stands (nothing re-measured); pass --remeasure to re-measure its "
        "finalists and choose again, or --trials N for more trials (--time-every-trial past an early stop)",
        study.study_name, out_dir,
    )  # fmt: skip
    trials = trials_table(study, started.choices, started.profile)
    return Run(started=started, candidates={}, finals=earlier.finals, chosen=earlier.chosen, trials=trials, cost=earlier.cost)


def gather_candidates(
    workload: Workload, space: SearchSpace, started: Started, plan: Plan, k: int, *, goal: Goal = SPEED
) -> tuple[dict[str, Candidate], dict[float, str], dict[str, str]]:
    """What is re-measured: the alternatives (each budget with its own profile-greedy policy), then per budget
    its k best trials within it by the goal (the fastest; the smallest in peak memory) and the safer variant of the
    first of them (its fp16/fp8 layers in bf16), each policy once, under the first name it came by (a trial
    that is an alternative, the all-fp32 warm start say, is measured as the alternative). Returns the candidates, budget -> its greedy candidate's name, and the
    alternatives not measured with why."""
    candidates: dict[str, Candidate] = {}

    def add(name: str, candidate: Candidate) -> str:
        same = next((n for n, c in candidates.items() if c == candidate), None)
        if same is None:
            candidates[name] = candidate
        return same or name

    greedy, notes = {}, {}
    for b in plan.budgets:
        alts = baselines(workload, space, started.profile, started.choices, b)
        notes.update(alts.notes)
        for name, candidate in alts.candidates.items():
            label = add(plan.greedy_name(b) if name == GREEDY else name, candidate)
            if name == GREEDY:
                greedy[b] = label
                if label != plan.greedy_name(b):
                    notes[plan.greedy_name(b)] = f"the same policy as {label}, measured once under that name"
    for b in plan.budgets:
        finalists = finalist_policies(started.study, started.choices, k, budget=b, exclude=list(candidates.values()), goal=goal)
        for name, candidate in finalists.items():
            add(name, candidate)
        if finalists:
            top_name, top = next(iter(finalists.items()))
            safer = safer_variant(top.policy, started.choices)
            if safer is not None:
                add(f"{top_name}, fp16/fp8 -> bf16", Candidate(safer))
    return candidates, greedy, notes


def start(
    workload: Workload,
    space: SearchSpace,
    config: SearchConfig,
    out_dir: Path,
    watch: Stopwatch,
    *,
    objectives: int = 1,
    smallest_budget: float | None = None,
    profile_folder: str | None = None,
) -> Started:
    """Profile (or reuse the saved profile; its drops as precise as `smallest_budget` needs, default the
    config's; `profile_folder`: out_dir.reuse_or_profile's `own`), derive the choices, create or join the study with
    its warm starts (all-fp32, then choices.warm_starts), and the judge (whose noise floor, in train mode, is measured
    when first needed)."""
    saved = reuse_or_profile(workload, space, out_dir, config, watch=watch, budget=smallest_budget, own=profile_folder)
    prof = saved.profile
    choices = build_choices(prof, space, config.budget, workload.device, judge_drop=config.mode is Mode.WEIGHTS)

    def known(agreed: Choices) -> list[dict[str, Any]]:  # after all-fp32: known points first
        return warm_starts(prof, agreed, config.budget)

    study, choices, where = open_study(
        workload, space, choices, config, out_dir, known, objectives=objectives, profile_complete=prof.complete
    )
    log.info("search space: %s", choices.describe())
    judge = Judge(workload, config, prof.fp32_metric, watch=watch)
    return Started(profile=prof, choices=choices, study=study, storage=where, judge=judge, saved=saved)


def baselines(workload: Workload, space: SearchSpace, prof: Profile, choices: Choices, budget: float) -> Alternatives:
    """What every result is compared with, measured in the same run: alternatives.alternatives."""
    fp8_offered = any(Format.FP8 in formats for formats in space.layers.values())
    return alternatives(workload.model, workload.device, prof, choices, budget, fp8_offered=fp8_offered)


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
    max_memory: int | None = None,
) -> Finals:
    """Metric, step time and peak memory of each candidate, timed interleaved with the others; speedup vs fp32
    in effective steps (those the GradScaler did not skip), memory saving vs fp32's peak, and whether the peak fits
    `max_memory` (bytes; None: no limit); see records.Measurement. `enough`, `more`: as timing.interleaved_times'."""
    stats, failed = measure_steps_or_fail(
        workload, candidates, timing, progress=progress, compiled=compiled, enough=enough, more=more
    )
    if FP32 in failed:
        raise fp32_step_failed(workload, "all-fp32 training step", failed[FP32], compiled=compiled)
    fp32_ms = stats[FP32].effective_ms
    fp32_peak = stats[FP32].peak_bytes
    rows = []
    for name, candidate in candidates.items():
        metric, extra = judge.safe_metric(candidate)
        drop = judge.fp32_metric - metric
        s = stats.get(name)
        runs = s is not None and math.isfinite(metric) and s.finite and math.isfinite(s.effective_ms)
        effective_ms = s.effective_ms if s else math.nan
        rows.append(Measurement(
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
        ))  # fmt: skip
    return Finals(rows).within(budget)


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "optuna": optuna.__version__}
    for dist in ("torchao", "autoprec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def final_remeasure(
    workload: Workload,
    candidates: Mapping[str, Candidate],
    judge: Judge,
    config: SearchConfig,
    watch: Stopwatch,
    *,
    cap_s: float | None = None,
    noisy_device: bool = False,
) -> Finals:
    """The finalists and the alternatives re-measured together (remeasure), the compilation timed apart. `cap_s`:
    seconds of timing after which it stops once SETTLED_FINAL_ROUNDS rounds are in (FINAL_SHARE of the search).
    `noisy_device`: the trials found the device too noisy to rank (trials.device_noise beyond NOISY_SPREAD): its
    configured rounds only, as a quiet device's, since more rounds at that noise separate nothing, and it says so."""
    label = f"re-measuring {len(candidates)} candidates" if config.progress else None
    start = time.perf_counter()
    capped: list[int] = []
    noisy = more_if_noisy(config.final_timing.rounds)

    def more(samples: Mapping[str, Sequence[float]]) -> int:
        # past the cap, or on a device the trials found too noisy: no more rounds, and no warning that promises them
        return 0 if capped or noisy_device else noisy(samples)

    def enough(samples: Mapping[str, Sequence[float]]) -> bool:
        # stops early once every candidate's rounds agree (timing.all_settled), or once past the cap: the
        # candidates it has not separated by then are reported as ties, the safer one chosen (choose.py)
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
        workload, candidates, judge, config.budget, config.final_timing, progress=label, compiled=config.compile,
        enough=enough, more=more, max_memory=config.max_memory,
    )  # fmt: skip
    watch.count("final re-measure: whole-step timings (each round: every candidate's)", sum(r.rounds for r in finals))
    if capped:
        watch.count(f"final re-measure: rounds stopped at its cap ({FINAL_SHARE:.0%} of the search's time before it)", capped[0])
    if finals.noisiest() > NOISY_SPREAD and noisy_device:
        log.warning(
            "this machine is too noisy to separate these candidates (step times spread up to ±%.0f%%, as in the "
            "trials): candidates closer than that are ties, and the safer one is chosen; rerun on a quieter machine "
            "with --remeasure for a ranking", 50 * finals.noisiest(),
        )  # fmt: skip
    elif finals.noisiest() > NOISY_SPREAD:
        log.warning(
            "step times still spread up to ±%.0f%%: candidates closer than that are ties, and the safer one is "
            "chosen; rerun on a quieter machine with --remeasure for a ranking", 50 * finals.noisiest(),
        )  # fmt: skip
    seconds = time.perf_counter() - start
    compiling = sum(r.compile_s or 0.0 for r in finals)
    if compiling:
        watch.add(f"final re-measure: compiling {len(candidates)} candidates (first step)", compiling)
    watch.add(f"final re-measure of {len(candidates)} candidates", seconds - compiling)
    return finals


def measured_record(
    workload: Workload,
    started: Started,
    config: SearchConfig,
    finals: Finals,
    best_name: str,
    budget: float,
    *,
    compared: Mapping[str, str] | None = None,
    notes: Mapping[str, str] | None = None,
) -> Measured:
    """The policy file's `measured`: the device, versions, budget, and the re-measured results of the policy
    and of `compared` (label -> candidate in `finals`; default the alternatives measured, under their own
    names); `notes`: alternatives not measured, and why."""
    compared = compared or {name: name for name in ALTERNATIVES if name in finals.names}
    prof, choices, judge, study = started.profile, started.choices, started.judge, started.study
    train = config.mode is Mode.TRAIN

    def result(name: str) -> Result:
        r = Result.of(finals.by_name(name))
        return r if train else dataclasses.replace(r, train_skipped_steps=None)

    kept = {
        n: "; ".join(f"{f}: {r}" for f, r in choices.excluded.get(n, {}).items())
        for n, o in choices.layers.items()
        if o == ("fp32",)
    }
    return Measured(
        device=device_name(str(workload.device)),
        versions=_versions(),
        model=workload.task.name,
        fingerprint=model_fingerprint(workload.model),
        budget=budget,
        mode=config.mode.value,
        train_steps=config.train_steps if train else None,
        noise_floor=judge.noise.spread if judge.noise else None,
        noise=judge.noise.to_dict() if judge.noise else None,
        fp32_metric=judge.fp32_metric,
        metric=prof.metric_name,
        chosen=best_name,
        results={**{label: result(name) for label, name in compared.items()}, "policy": result(best_name)},
        kept_fp32=kept,
        excluded={n: dict(r) for n, r in choices.excluded.items()},
        fp8=fp8_backend(workload.device),
        compiled=config.compile,
        alternatives_not_measured=dict(notes or {}),
        # on a device with TF32 (CUDA) every candidate but TF32 ran strict (trainer.matmul_precision); elsewhere the
        # process's setting for that device's backend
        float32_matmul_precision="highest"
        if devices.lookup(workload.device).has_tf32
        else float32_matmul_precision(workload.device.type),
        timing=(
            (
                "compiled after apply_policy (each repeated block, else the whole model), compilation excluded (warm-up); "
                if config.compile
                else "eager; "
            )
            + f"median of {max((r.rounds for r in finals), default=0)} interleaved rounds (up to {config.final_timing.rounds}, "
            f"stopped after {SETTLED_FINAL_ROUNDS} once every spread was within {SETTLED:.0%}; up to twice as many where "
            f"they stay noisy on a device the trials found quiet, within {FINAL_SHARE:.0%} of the search's time); spread = interquartile range / median; "
            "effective_step_ms = step_ms / (1 - skipped / steps): steps the GradScaler skipped update nothing"
        ),
        memory=memory.source(workload.device) or memory.not_measured(workload.device),
        max_memory=config.max_memory,
        objective=config.objective.name,
        loss_scale_search=dict(choices.loss_scale or {}),
        search_space=choices.describe(),
        study=StudyRef(name=study.study_name, storage=started.storage, trials=len(study.trials), complete=_complete(study)),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
