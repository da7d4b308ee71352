"""The study's trials read back (each as its records.TrialRecord): the trial table (trials.csv), where their time
went, and the queries the search asks of them (the best speedup so far, the k-th fastest timed trial, the trials a
speed fit learns from)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics

import optuna
import optuna.storages.journal  # `import optuna` loads it too, but mypy sees a submodule only where it is imported
import pandas as pd

from autoprec.policy import ROOT, Policy
from autoprec.tune._core._config import NOISE_ROUNDS
from autoprec.tune._core._records import TrialRecord
from autoprec.tune._measure._choices import Choices, policy_from_params
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._measure._speed import LayerTimes, Timed
from autoprec.tune._measure._timing import Stopwatch, spread_text

log = logging.getLogger("autoprec")


def _complete(study: optuna.Study) -> list[tuple[optuna.trial.FrozenTrial, TrialRecord]]:
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [(t, TrialRecord.of(t)) for t in done]


def complete_count(study: optuna.Study) -> int:
    """How many of the study's trials are complete (every run's and worker's)."""
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def trials_table(study: optuna.Study, choices: Choices, prof: Profile | None = None) -> pd.DataFrame:
    """One row per trial: its formats (and the fp8 all-gather where searched), loss scale, what it measured, and (with
    the profile) the drop the sum of single-layer drops predicted for it."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state != optuna.trial.TrialState.COMPLETE:
            rows.append({"trial": t.number, "state": t.state.name})
            continue
        policy = policy_from_params(t.params, choices)
        row = {"trial": t.number, "state": t.state.name}
        row.update({("(default)" if n == ROOT else n): f.value for n, f in policy.layers.items()})
        if choices.fp8_all_gather:  # a sharded search's setting beside the formats
            row["fp8_all_gather"] = policy.fsdp_fp8_all_gather
        if prof is not None:
            row["predicted_drop"] = prof.predicted_drop(policy.layers)
        record = TrialRecord.of(t)
        row.update({f.name: getattr(record, f.name) for f in dataclasses.fields(record)})
        if policy.uses_fp16:
            ls = policy.loss_scale
            row.update(
                init_scale=ls.init_scale,
                growth_interval=ls.growth_interval,
                growth_factor=ls.growth_factor,
                backoff_factor=ls.backoff_factor,
                dynamic=ls.dynamic,
            )
        row["duration_s"] = t.duration.total_seconds() if t.duration else None
        rows.append(row)
    return pd.DataFrame(rows)


def trial_costs(study: optuna.Study, watch: Stopwatch) -> None:
    """The study's completed trials (every worker's, every run's), split into evaluating the metric, measuring
    step times, and the rest of each trial's wall time: sampling, the storage, building the candidate."""
    done = _complete(study)
    fresh = [(t, r) for t, r in done if r.reused_from is None]  # a reused trial measured nothing
    evaluate = sum(r.evaluate_s or 0.0 for _, r in fresh)
    measure = sum(r.measure_s or 0.0 for _, r in fresh)
    compiling = sum(r.compile_s or 0.0 for _, r in fresh)
    wall = sum(t.duration.total_seconds() for t, _ in done if t.duration)
    watch.add("trials: evaluating the metric", evaluate, sum(r.evaluate_s is not None for _, r in fresh))
    if compiling:
        watch.add(
            "trials: compiling the candidate and the fp32 baseline (first steps)",
            compiling,
            sum(r.compile_s is not None for _, r in fresh),
        )
    watch.add("trials: measuring step times", measure - compiling, sum(r.measure_s is not None for _, r in fresh))
    rounds = sum(r.rounds or 0 for _, r in fresh)
    if rounds:
        watch.count("trials: timing rounds (a trial stops early once its ranking is clear)", rounds)
        # each round times the candidate and the fp32 baseline: a block of whole training steps each
        watch.count("trials: whole-step timings (each round: the candidate's and the fp32 baseline's)", 2 * rounds)
        spreads = [r.spread for _, r in fresh if r.spread is not None and math.isfinite(r.spread)]
        if spreads:
            noise = spread_text(statistics.median(spreads))
            watch.count(f"trials: this device's timing noise, the timed trials' median spread {noise}", len(spreads))
    watch.add("trials: sampling, storage, the rest", max(0.0, wall - evaluate - measure), len(done))
    watch.count("trials: a repeated policy, its measurements reused", len(done) - len(fresh))
    # policies, not trials: one proposed again is judged again (reevaluated_from), and counts once, as timed if ever
    timed = {_params_key(t) for t, r in fresh if r.timed}
    untimed = {_params_key(t) for t, r in fresh if r.untimed is not None} - timed
    if untimed:
        watch.count("trials: policies not timed (the profile's layer times predict them too slow to be finalists)", len(untimed))
    again = sum(r.reevaluated_from is not None for _, r in fresh)
    if again:
        watch.count("trials: a policy left untimed, proposed again and judged again", again)


def _params_key(trial: optuna.trial.FrozenTrial) -> str:
    return json.dumps(trial.params, sort_keys=True, default=str)


def timed_speedups(study: optuna.Study) -> list[float]:
    """The speedups of the study's trials timed within budget, warm starts included (not the all-fp32 baseline,
    which is not timed, nor repeats)."""
    return [r.speedup for _, r in _complete(study) if r.feasible and r.timed and r.speedup is not None]


def finalist_mark(study: optuna.Study, k: int) -> float | None:
    """The k-th fastest timed trial's speedup (timed_speedups); None before k are timed. A candidate surely slower
    needs no precise number: each of those k is re-measured at the end (an alternative always is; a searched policy
    faster than the candidate ranks above it for the k finalists' places), or the candidate takes a place itself
    and is re-measured with them."""
    speeds = sorted(timed_speedups(study), reverse=True)
    return speeds[k - 1] if len(speeds) >= k and speeds[k - 1] > 0 else None


def timed_trials(study: optuna.Study, choices: Choices, layer_times: LayerTimes) -> list[Timed]:
    """The study's trials timed beside fp32 (not repeats), as speed.fit takes them."""
    out = []
    for t, r in _complete(study):
        if not r.timed or r.step_ms is None or r.fp32_step_ms is None:
            continue
        features = layer_times.features(policy_from_params(t.params, choices))
        if features is not None:
            out.append(Timed(features, r.fp32_step_ms, r.step_ms))
    return out


def formats_key(policy: Policy) -> str:
    """What tells policies apart for a speed prediction and the stopping rule: their formats and, where on, their fp8
    all-gather under FSDP2 (a step time of its own), not their loss scale."""
    key: dict[str, object] = {name: fmt.value for name, fmt in policy.layers.items()}
    if policy.fsdp_fp8_all_gather:
        key = {"layers": key, "fsdp_fp8_all_gather": True}
    return json.dumps(key, sort_keys=True)


def timed_formats(study: optuna.Study, choices: Choices) -> set[str]:
    """The formats_key of every policy the study has timed (any loss scale)."""
    return {formats_key(policy_from_params(t.params, choices)) for t, r in _complete(study) if r.rounds}


def best_timed(study: optuna.Study) -> tuple[float, float] | None:
    """(speedup, spread) of the fastest trial timed within budget (not a prediction, not a repeat); None before one."""
    timed = [(r.speedup, r.spread) for _, r in _complete(study) if r.feasible and r.timed and r.speedup is not None]
    if not timed:
        return None
    speedup, spread = max(timed, key=lambda pair: pair[0])
    return speedup, spread if spread is not None and math.isfinite(spread) else 0.0


def first_of_run(study: optuna.Study) -> int:
    """The number of the first trial a run starting now adds: after every finished one (earlier runs'); the warm
    starts it enqueued before starting are numbered after them, and count as its own."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    return max((t.number for t in study.get_trials(deepcopy=False, states=states)), default=-1) + 1


def device_noise(study: optuna.Study, least: int = 5, *, since: int = 0) -> float | None:
    """This device's timing noise as the search has seen it: the median spread of its trials (numbered `since` on:
    this run's, where an earlier run's machine may have been busier) timed at least NOISE_ROUNDS rounds (an
    interquartile range: one stalled round does not widen it); None before `least` of them."""
    spreads = [
        r.spread
        for t, r in _complete(study)
        if t.number >= since and r.timed and (r.rounds or 0) >= NOISE_ROUNDS and r.spread is not None and math.isfinite(r.spread)
    ]
    return statistics.median(spreads) if len(spreads) >= least else None


def best_speedup(study: optuna.Study) -> float:
    """The highest speedup timed among the study's completed trials within budget (0 before there is one): a trial's
    own short timing, never a prediction (an untimed trial's), and re-measured before any choice."""
    return max((r.speedup or 0.0 for _, r in _complete(study) if r.feasible and r.timed), default=0.0)


def smallest_peak(study: optuna.Study) -> int | None:
    """The smallest peak memory among the study's completed trials within budget (None before there is one)."""
    return min((r.peak_bytes for _, r in _complete(study) if r.feasible and r.peak_bytes), default=None)
