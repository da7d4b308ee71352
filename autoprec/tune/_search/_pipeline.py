"""The one pipeline a search and a sweep both are: check the output folder and the storage, profile (or reuse
the saved profile), run the Optuna study, gather each budget's finalists beside the alternatives, re-measure
them together, choose per budget, and write a verified policy per budget with the trial and finalist tables.

A search is this pipeline with one budget and one objective (the goal's value, `SearchConfig.objective`: the
speedup, or the peak memory; _goals.py); a sweep has several budgets and a second objective (the metric drop), so
the study's Pareto front serves every budget. `Plan` holds what differs: a sweep's budgets, the objectives, the file
names. The budgets as the user gave them (a search's `SearchConfig.budget`, a sweep's `Plan.budgets`) are resolved
once, at the start (`run`), into the `Budgets` record every stage after it reads. A memory limit
(`SearchConfig.max_memory`) is a second constraint beside the budget.

The budget applies to one of two measurements (`Mode`): the metric of the given weights with the policy
applied (`weights`, cheap), or the metric after K training steps with the policy and its GradScaler,
against K steps of fp32 from the same weights in the same batch order (`train`), whose noise floor (the
fp32 result's own spread over seeds) is measured and reported beside the budget.

`search` runs it with one budget (`search_plan`); a sweep's plan is _sweeper.py's. The stages are this module's
(`start`, then `_run`); the finalists, gathered and re-measured together, are _finalists.py's, and the policy file's
`measured` record is _provenance.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import pandas as pd

from autoprec.errors import UserError
from autoprec.files import write_atomically
from autoprec.policy import Policy
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._budget import Budgets, resolve_budgets
from autoprec.tune._core._config import (
    BUDGET_FINAL_SHARE,
    FINAL_SHARE,
    NOISY_SPREAD,
    SETTLED_FINAL_ROUNDS,
    TIME_BUDGET_TOLERANCE,
    Mode,
    SearchConfig,
)
from autoprec.tune._core._names import ALTERNATIVES, GREEDY
from autoprec.tune._core._records import Candidate, Chosen, Finals, Measured, StudyRef
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._decide._choose import choose_per_budget
from autoprec.tune._decide._trials import complete_count, device_noise, first_of_run, trial_costs, trials_table
from autoprec.tune._measure._choices import Choices, build_choices, searches_fp8_all_gather, warm_starts
from autoprec.tune._measure._coverage import Coverage, coverage
from autoprec.tune._measure._metric import workload_fp32_metric
from autoprec.tune._measure._profile_data import SPEED_UNJUDGED
from autoprec.tune._measure._speed import LayerTimes
from autoprec.tune._measure._task import Workload
from autoprec.tune._measure._timing import Stopwatch
from autoprec.tune._report._results import SearchResult
from autoprec.tune._search._finalists import final_remeasure, gather_candidates
from autoprec.tune._search._objective import Judge, Objective, run_trials
from autoprec.tune._search._out_dir import claim_out_dir, disk_full, earlier_result, reuse_or_profile
from autoprec.tune._search._plan import Plan, Run, Started
from autoprec.tune._search._provenance import measured_record
from autoprec.tune._search._storage import check_storage, hide_credentials, open_study

if TYPE_CHECKING:
    from autoprec.tune._core._goal import Goal

log = logging.getLogger("autoprec")


def run(
    workload: Workload,
    space: SearchSpace,
    config: SearchConfig,
    out_dir: str | Path,
    plan: Plan,
    *,
    announce: Callable[[Budgets], None] | None = None,
) -> Run:
    """Profile, search, re-measure, choose and write (see the module's docstring). `announce` is told the budgets
    once resolved, before the profile (the command line says a relative one's value on stderr)."""
    given = plan.given_budgets(config)
    if memory.source(workload.device) is None and (config.objective.needs_peak or config.max_memory is not None):
        flag = f"--objective {config.objective.name}" if config.objective.needs_peak else "--max-memory"
        raise UserError(f"{flag}: peak memory is {memory.not_measured(workload.device)}; search for speed without a limit")
    try:  # each message names the space file's list or the target, and the fix; bound to the profile in start()
        goal = config.objective.check_space(space, config)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not goal.timed and space.prune_slower_than < SPEED_UNJUDGED:
        # this machine's speed says nothing of the target's: a format slow here (emulated) is no less a candidate
        space = dataclasses.replace(space, prune_slower_than=SPEED_UNJUDGED)
    # the fp32 metric is evaluated here only where a budget is relative, and then cached for the profile to read
    budgets = resolve_budgets(given, lambda: workload_fp32_metric(workload))
    if announce is not None:
        announce(budgets)
    out_dir = Path(out_dir)
    with claim_out_dir(workload, out_dir):  # also makes the folder
        try:
            return _run(workload, space, config, out_dir, plan, budgets, goal)
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


def _run(
    workload: Workload, space: SearchSpace, config: SearchConfig, out_dir: Path, plan: Plan, budgets: Budgets, goal: Goal
) -> Run:
    check_storage(config, out_dir)  # before minutes of profiling; opening the study checks it again
    began = time.perf_counter()
    watch = Stopwatch()
    started = start(
        workload,
        space,
        config,
        out_dir,
        watch,
        budgets,
        goal=goal,
        objectives=plan.objectives,
        profile_folder=plan.profile_folder,
    )
    parts = {"the profile": time.perf_counter() - began}  # this run's own time, for the overrun line
    config = started.config  # its goal bound to the profile, once
    layer_times = LayerTimes.from_rows(started.profile.rows)
    objective = Objective(
        workload, started.choices, space, started.judge, config, objectives=plan.objectives, layer_times=layer_times
    )
    objective.since = first_of_run(started.study)  # as run_trials sets it: should_stop reads this run's trials
    target = config.trials or space.trials
    if (complete_count(started.study) < target and not objective.should_stop(started.study)) or config.remeasure:
        started.judge.measure()  # before the trials (its own line in the cost table); a result that stands needs none
    if config.time_budget is not None:  # the trials stop where the final re-measure's share still fits
        objective.deadline = began + config.time_budget / (1 + BUDGET_FINAL_SHARE)
        _say_if_no_trial_fits(config.time_budget, time.perf_counter() - began, objective.deadline - began)
    mark = time.perf_counter()
    trials_file = out_dir / plan.trials_file

    def write_trials(study: optuna.Study) -> None:  # after each trial: a run stopped at a deadline keeps them
        table = trials_table(study, started.choices, started.profile)
        _write_as_it_goes(trials_file, lambda tmp: table.to_csv(tmp, index=False))

    try:
        ran = run_trials(started.study, objective, target, progress=config.progress, after_trial=write_trials)
    finally:
        objective.close()  # its eager fp32 baseline leaves the device to the final re-measure's candidates
    parts["the trials"] = time.perf_counter() - mark
    stopped = None
    if objective.stopped is not None and complete_count(started.study) < target:
        left = target - complete_count(started.study)
        stopped = f"stopped after {complete_count(started.study)} of {target} trials: {objective.stopped}"
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
        watch.count("trials: run earlier, none now (their time is in the earlier run's table)", complete_count(started.study))
    candidates, greedy, notes = gather_candidates(
        workload, space, started, plan, config.finalists, goal=config.objective, cuda_graphs=config.cuda_graphs
    )
    noise = device_noise(started.study, since=objective.since)
    mark = time.perf_counter()
    partial = out_dir / partial_file(plan.finalists_file)

    def write_rounds(rows: list[dict[str, Any]]) -> None:  # after each round: what a stopped run leaves
        _write_as_it_goes(partial, lambda tmp: pd.DataFrame(rows).to_csv(tmp, index=False))

    finals = final_remeasure(
        workload,
        candidates,
        started.judge,
        config,
        watch,
        cap_s=_final_cap(config, watch, began, ran),
        noisy_device=noise is not None and noise > NOISY_SPREAD,
        each_round=write_rounds,
    )
    parts["the final re-measure"] = time.perf_counter() - mark
    if config.time_budget is not None:
        _say_if_overrun(config.time_budget, time.perf_counter() - began, parts)
    # the tables first, the policy files last: a policy file marks a complete result (see _earlier_result)
    trials = trials_table(started.study, started.choices, started.profile)
    write_atomically(out_dir / plan.trials_file, lambda tmp: trials.to_csv(tmp, index=False))
    finals.to_csv(out_dir / plan.finalists_file)
    partial.unlink(missing_ok=True)  # the rounds so far: finalists.csv holds them all now
    chosen = []
    picks = choose_per_budget(finals, candidates, budgets.absolute, greedy, goal=config.objective)
    for name, b in {name: b for b, (name, _) in reversed(list(zip(budgets.absolute, picks)))}.items():
        _warn_unfit(finals.within(b), name, b, config.max_memory)  # once per policy, at its smallest budget
    for b, (name, why) in zip(budgets.absolute, picks):
        compared = {a: a for a in ALTERNATIVES if a != GREEDY and a in candidates} | {GREEDY: greedy[b]}
        measured = dataclasses.replace(
            measured_record(workload, started, config, finals, name, b, compared=compared, notes=notes),
            why=why,
            cost=watch.to_dict(),
            greedy=greedy[b],
            budget_given=budgets.given.get(b),
            stopped=stopped,
            not_separated=config.objective.ties(finals.within(b), name),
            sweep={"budgets": list(budgets.absolute), "study_budget": budgets.bound} if plan.is_sweep else None,
            run_steps=config.run_steps,
        )
        picked = candidates[name].policy
        measured = _with_estimates(measured, config.objective, picked, candidates, compared | {"policy": name})
        policy = dataclasses.replace(picked, measured=measured.to_dict())  # every setting the candidate ran with
        file = policy.save(out_dir / plan.policy_file(b))
        chosen.append(Chosen(budget=b, name=name, why=why, policy=policy, file=file, greedy=greedy[b]))
    return Run(started=started, candidates=candidates, finals=finals, chosen=chosen, trials=trials, cost=watch.to_dict())


def partial_file(finalists_file: str) -> str:
    """Where the final re-measure's rounds so far are written after each round (finalists.partial.csv), removed once
    the finalists file is written: a run stopped before then leaves them there."""
    stem, dot, suffix = finalists_file.rpartition(".")
    return f"{stem}.partial.{suffix}" if dot else f"{finalists_file}.partial"


def _write_as_it_goes(path: Path, write: Callable[[Path], object]) -> None:
    """A table written while the run goes on (whole, renamed into place): one that cannot be written is said and
    the run goes on (the study's journal holds the trials; the tables at the end are written or the run fails)."""
    try:
        write_atomically(path, write)
    except UserError as exc:
        log.warning("%s", exc)


def _with_estimates(
    measured: Measured, goal: Goal, picked: Policy, candidates: Mapping[str, Candidate], labels: Mapping[str, str]
) -> Measured:
    """The goal's estimates (Goal.estimated: the FLOP goal's), where it makes any: measured.estimate and each result's
    `estimate`, labelled as such, beside what was measured."""
    record = goal.estimate_record(picked, candidates)
    if record is None:
        return measured
    results = {
        label: dataclasses.replace(r, estimate=goal.estimated(candidates[labels[label]].policy))
        if labels.get(label) in candidates
        else r
        for label, r in measured.results.items()
    }
    return dataclasses.replace(measured, estimate=record, results=results)


def _say_if_no_trial_fits(budget_s: float, spent_s: float, trials_s: float) -> None:
    """--time-budget: said as soon as the profile (or a reused one's check) has used the trials' share of it."""
    if spent_s >= trials_s:
        log.warning(
            "--time-budget %.1f min: the profile alone took %.1f min, past the %.1f min the trials may use, so no trial "
            "runs; the answer is chosen among the alternatives (give a larger --time-budget)",
            budget_s / 60,
            spent_s / 60,
            trials_s / 60,
        )


def _say_if_overrun(budget_s: float, spent_s: float, parts: Mapping[str, float]) -> None:
    """--time-budget bounds the trials and the final re-measure's extra rounds; the profile and the re-measure's
    first SETTLED_FINAL_ROUNDS rounds are not cut short (docs/measuring.md). Past TIME_BUDGET_TOLERANCE, say where
    the time went: `parts`, seconds of this run by stage, and the rest of `spent_s`, so the parts add up to it (the
    cost table counts a resumed study's earlier trials too, which this run did not spend)."""
    if spent_s <= budget_s * (1 + TIME_BUDGET_TOLERANCE):
        return
    rest = max(0.0, spent_s - sum(parts.values()))
    where = ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in [*parts.items(), ("the rest", rest)])
    log.warning(
        "--time-budget %.1f min overrun: the search took %.1f min (%s); the profile and the final re-measure's first "
        "%d rounds are not cut short",
        budget_s / 60,
        spent_s / 60,
        where,
        SETTLED_FINAL_ROUNDS,
    )


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
        "or raise --max-memory",
        budget,
        memory.human_bytes(limit),
        smallest,
        name,
        why,
    )


def _earlier_result(out_dir: Path, plan: Plan, started: Started) -> Run | None:
    """The result an earlier run of this finished study wrote to out_dir, where it stands (out_dir.earlier_result);
    else None, and the finalists are re-measured."""
    study = started.study
    files = {b: out_dir / plan.policy_file(b) for b in started.budgets.absolute}
    now = StudyRef(name=study.study_name, storage=started.storage, complete=complete_count(study))
    earlier = earlier_result(files, out_dir / plan.finalists_file, now, started.judge.config)
    if earlier is None:
        return None
    if earlier.noise is not None:  # every file matched: the result stands with the noise floor it recorded
        started.judge.known(earlier.noise)
    log.warning(
        "study %r is finished and its result in %s stands (nothing re-measured); pass --remeasure to re-measure its "
        "finalists and choose again, or --trials N for more trials (--time-every-trial past an early stop)",
        study.study_name,
        out_dir,
    )
    trials = trials_table(study, started.choices, started.profile)
    run_steps = started.judge.config.run_steps
    chosen = [_priced_against(c, run_steps) for c in earlier.chosen] if run_steps is not None else earlier.chosen
    return Run(started=started, candidates={}, finals=earlier.finals, chosen=chosen, trials=trials, cost=earlier.cost)


def _priced_against(chosen: Chosen, run_steps: int) -> Chosen:
    """A standing result priced against the training run this rerun names (--run-steps, as the summary suggests):
    the run's length prices the search's cost and changes no measurement, so the policy file is written again with
    it instead of the earlier run's."""
    measured = Measured.of(chosen.policy)
    if measured.run_steps == run_steps:
        return chosen  # the file stays byte for byte
    policy = dataclasses.replace(chosen.policy, measured=dataclasses.replace(measured, run_steps=run_steps).to_dict())
    return dataclasses.replace(chosen, policy=policy, file=policy.save(chosen.file))


def start(
    workload: Workload,
    space: SearchSpace,
    config: SearchConfig,
    out_dir: Path,
    watch: Stopwatch,
    budgets: Budgets,
    *,
    goal: Goal,
    objectives: int = 1,
    profile_folder: str | None = None,
) -> Started:
    """Profile (or reuse the saved profile; its drops as precise as the smallest of `budgets` needs;
    `profile_folder`: out_dir.reuse_or_profile's `own`), derive the choices (within the largest), create or join the
    study with its warm starts (all-fp32, then choices.warm_starts), and the judge of `budgets` (whose noise floor, in
    train mode, is measured when first needed)."""
    saved = reuse_or_profile(workload, space, out_dir, config, watch=watch, budget=budgets.smallest, own=profile_folder)
    prof = saved.profile
    try:  # the one binding: the goal checked against the space (`goal`, run's) and computed from the profile (the
        # FLOP goal: each Linear's FLOPs) holds it from here on, warm starts, trials and the choice too
        config = dataclasses.replace(config, objective=goal.bound(prof.rows, config))
    except ValueError as exc:
        raise UserError(f"--objective {config.objective.name}: {exc}") from None
    fallbacks = config.objective.layer_fallbacks(space, workload.model)  # fp32, or a FLOP goal's bf16 where a list has no fp32
    choices = build_choices(
        prof,
        space,
        budgets.bound,
        workload.device,
        judge_drop=config.mode is Mode.WEIGHTS,
        fallbacks=fallbacks,
        cost=config.objective.layer_cost,
        fp8_all_gather=searches_fp8_all_gather(workload.sharding is not None, config.objective),
    )

    def known(agreed: Choices) -> list[dict[str, Any]]:  # after all-fp32: known points first
        return warm_starts(prof, agreed, budgets.bound, cost=config.objective.layer_cost)

    study, choices, where = open_study(
        workload,
        space,
        choices,
        config,
        out_dir,
        known,
        budget=budgets.bound,
        objectives=objectives,
        profile_complete=prof.complete,
    )
    log.info("search space: %s", choices.describe())
    judge = Judge(workload, config, prof.fp32_metric, budgets=budgets, watch=watch)
    cover = _coverage(workload, space)
    return Started(
        profile=prof, choices=choices, study=study, storage=where, judge=judge, saved=saved, config=config, coverage=cover
    )


def _coverage(workload: Workload, space: SearchSpace) -> Coverage | None:
    """The tuned layers' share of the step's matmuls, said where much runs outside them (a MoE's fused experts); None
    where the count fails (an op the counting mode cannot pass through): it reports, it never stops a search."""
    try:
        cover = coverage(workload, space)
    except Exception as exc:
        log.debug("the tuned layers' share of the matmuls could not be counted: %s: %s", type(exc).__name__, exc)
        return None
    if cover.worth_saying:
        log.warning("%s", cover.sentence())
    return cover


# A search: the pipeline with one budget and one objective, the training-step speedup (or, with `--objective memory`,
# the peak memory); writes policy.json, trials.csv and finalists.csv.


def search_plan() -> Plan:
    """A search's plan: its one budget is its SearchConfig.budget."""
    return Plan(objectives=1, policy_file=lambda b: "policy.json", trials_file="trials.csv", finalists_file="finalists.csv")


def search(
    workload: Workload,
    space: SearchSpace,
    config: SearchConfig,
    out_dir: str | Path,
    *,
    announce: Callable[[Budgets], None] | None = None,
) -> SearchResult:
    """Profile, search, re-measure the finalists, and write policy.json, profile.csv, trials.csv to out_dir, within
    `config.budget` (a relative one resolved against the fp32 metric the profile measures, and recorded as given in
    the policy). `announce`: run's, told the resolved budget."""
    done = run(workload, space, config, out_dir, search_plan(), announce=announce)
    started = done.started
    return SearchResult(
        policy=done.chosen[0].policy,
        profile=started.profile,
        choices=started.choices,
        trials=done.trials,
        finals=done.finals,
        study_name=started.study.study_name,
        storage=started.storage,
        noise=started.judge.noise,
        cost=done.cost,
    )
