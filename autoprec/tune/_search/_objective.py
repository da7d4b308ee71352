"""The objective every trial runs, and the loop that runs the trials (where the study lives: _storage.py; what its trials
say: _trials.py).

A trial suggests a policy (_choices.py), measures its metric against the budget (`Judge`: the given
weights' metric, or K training steps in train mode) and, when within budget, its training-step speedup
over fp32, timed interleaved, and its peak memory per step (_memory.py). A single-objective study optimises the
search's goal (_goals.py: maximises the speedup, or minimises the peak) under the budget constraint, and
--max-memory's (_pipeline.py); a two-objective one also minimises the metric drop, for a Pareto front (_sweeper.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
import optuna.storages.journal  # `import optuna` loads it too, but mypy sees a submodule only where it is imported
from tqdm.auto import tqdm

from autoprec.errors import UserError, describe
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._budget import Budgets
from autoprec.tune._core._config import NOISE_ROUNDS, NOISY_SPREAD, SETTLED, STOP_ENUMERATE, Mode, SearchConfig
from autoprec.tune._core._goal import INFEASIBLE
from autoprec.tune._core._records import Candidate, TrialRecord
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._decide._trials import (
    best_timed,
    device_noise,
    finalist_mark,
    first_of_run,
    formats_key,
    timed_formats,
    timed_speedups,
    timed_trials,
)
from autoprec.tune._measure._choices import Choices, format_assignments, policy_from_params, setting_variants, suggest
from autoprec.tune._measure._metric import NoiseFloor, evaluate_metric, noise_floor, train_and_evaluate
from autoprec.tune._measure._speed import Features, LayerTimes, ceiling, too_slow
from autoprec.tune._measure._task import Workload
from autoprec.tune._measure._timing import Stopwatch, interleaved_times, noisiest, spread_text
from autoprec.tune._measure._trainer import (
    Trainer,
    compile_scope,
    fp32_step_failed,
    new_trainer,
    peak_memory_or_none,
    release_trainer,
    step_stats,
)
from autoprec.tune._search._storage import OBJECTIVES

log = logging.getLogger("autoprec")


def over_budget(drop: float, budget: float) -> float:
    """The drop's excess over the budget as a share of it (<= 0: within), as the peak's over --max-memory is: the
    sampler ranks infeasible trials by the sum of the two, which needs them in the same (no) unit. A zero budget
    leaves the plain excess. Kept below INFEASIBLE, which ranks a non-finite metric last."""
    return min((drop - budget) / budget if budget > 0 else drop - budget, INFEASIBLE / 2)


class Judge:
    """The metric a candidate is held to and the fp32 result it is compared with: the given weights'
    (weights mode), or after K training steps from them (train mode, with the noise floor measured). In train
    mode the noise floor is measured when first needed (`measure()`, or reading `noise` or `fp32_metric`), so a
    finished study whose result stands costs none: `known()` takes the one its policy file recorded. `budgets`: the
    run's, resolved once (budget.resolve_budgets); a trial is held to the largest, `budgets.bound`."""

    def __init__(
        self,
        workload: Workload,
        config: SearchConfig,
        weights_fp32_metric: float,
        *,
        budgets: Budgets,
        watch: Stopwatch | None = None,
    ):
        self.workload, self.config, self.budgets, self._watch = workload, config, budgets, watch
        self._weights_metric = weights_fp32_metric
        self._noise: NoiseFloor | None = None
        self._ready = config.mode is not Mode.TRAIN

    @property
    def noise(self) -> NoiseFloor | None:
        self.measure()
        return self._noise

    @property
    def fp32_metric(self) -> float:
        self.measure()
        return self._noise.reference if self._noise is not None else self._weights_metric

    def known(self, noise: NoiseFloor) -> None:
        """The noise floor an earlier run measured for this same study (its policy file's `measured.noise`)."""
        self._noise, self._ready = noise, True

    def measure(self) -> None:
        """Train mode: the noise floor (fp32 over seeds), once; a warning where the budget is below it."""
        if self._ready:
            return
        config = self.config
        watch = self._watch or Stopwatch()
        with watch.section("noise floor: fp32 trained over seeds"):
            noise = noise_floor(self.workload, config.train_steps, config.noise_runs)
        if not math.isfinite(noise.reference):
            raise UserError(
                f"{self.workload.task.path}: after {config.train_steps} fp32 training steps the metric is "
                f"{noise.reference}; train mode needs a finite one"
            )
        self._noise, self._ready = noise, True
        if self.budgets.bound < noise.spread:
            log.warning(
                "budget %g is below the noise floor %.4g (the fp32 metric's spread over %d seeds after %d training "
                "steps): the search cannot tell a real loss from noise there",
                self.budgets.bound,
                noise.spread,
                config.noise_runs,
                config.train_steps,
            )

    def metric(self, policy: Policy | Candidate) -> tuple[float, dict[str, Any]]:
        """The candidate's metric (NaN when anything went non-finite) and what else was measured on the way."""
        if self.config.mode is Mode.TRAIN:
            out = train_and_evaluate(self.workload, policy, self.config.train_steps)
            return (out.metric if out.finite else math.nan), {"train_skipped": out.skipped}
        return evaluate_metric(self.workload, policy), {}

    def safe_metric(self, policy: Policy | Candidate) -> tuple[float, dict[str, Any]]:
        try:
            return self.metric(policy)
        except UserError:
            raise
        except Exception as exc:  # e.g. the user's evaluate cannot run some format: infeasible, not fatal
            return math.nan, {"error": f"{type(exc).__name__}: {exc}"[:300]}


class Objective:
    """What a trial measures. One objective: the goal's value (Goal.trial_value; the speedup, 0 when over budget
    or broken, predicted, not timed, for a trial the profile's layer times put out of the running:
    _predicted_too_slow; the peak memory in MiB, INFEASIBLE when not measured). Two: that and the metric drop
    (INFEASIBLE when not finite), both under the constraint drop <= budget. With a memory limit, peak <= limit is
    a second constraint."""

    def __init__(
        self,
        workload: Workload,
        choices: Choices,
        space: SearchSpace,
        judge: Judge,
        config: SearchConfig,
        *,
        objectives: int = 1,
        layer_times: LayerTimes | None = None,
    ):
        if objectives not in OBJECTIVES:
            raise ValueError(f"objectives must be one of {sorted(OBJECTIVES)}, but got {objectives!r}")
        self.workload, self.choices, self.space = workload, choices, space
        self.judge, self.config, self.objectives = judge, config, objectives
        # what predicts a trial's speedup (_speed.py): only a search ranked by speed without a memory limit may skip timing
        goal = config.objective
        predicts = config.predict_speed and objectives == 1 and goal.ranks_by_speed and config.max_memory is None
        self.layer_times = layer_times if predicts else None
        # timed beside every eager candidate; a compiled search builds a compiled one per trial instead
        self.baseline = None if config.compile else new_trainer(workload, Policy(layers={ROOT: Format.FP32}))
        self._baseline_warm = False  # after its first timing, the baseline needs one warm-up call, not config.warmup
        self._fp32_peak: int | None = None
        self._fp32_peak_known = False  # measured once: the same fp32 model needs the same memory every time
        self.deadline: float | None = None  # time.perf_counter() past which no trial starts (a time budget)
        self.stopped: str | None = None  # why the trials stopped before their number: should_stop
        self._policies: list[tuple[str, Features | None]] | None = None  # every policy's formats and features
        self.since = 0  # this run's first trial number (trials.first_of_run): the device's noise is read from its trials

    def should_stop(self, study: optuna.Study) -> bool:
        """Whether to run no more trials: past the deadline, or (a speed search predicting step times) on a device
        whose timings spread too wide to rank trials (trials.device_noise beyond NOISY_SPREAD), or with every policy
        timed, or where none untried can beat the best timed trial beyond the noise (speed.ceiling). Sets `stopped`."""
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            self.stopped = "the time budget: the rest of it is the final re-measure's"
            return True
        best = best_timed(study) if self.layer_times is not None else None
        if best is None or self.layer_times is None:
            return False
        noise = device_noise(study, since=self.since)
        if noise is not None and noise > NOISY_SPREAD:
            # a trial's few rounds resolve only what differs by about the noise: more trials buy no ranking, and the
            # final re-measure's many rounds of the few best decide (a tie going to the safer candidate)
            self.stopped = (
                f"the trials' step times spread {spread_text(noise)}, too wide for a trial's timing to rank "
                f"policies. The final re-measure decides among the fastest timed trials and the "
                f"alternatives; a rerun on a quieter machine searches on"
            )
            return True
        if self._policies is None:
            assignments = format_assignments(self.choices, STOP_ENUMERATE) or []  # none: too many to check
            # each setting its own point; the layer times price formats only (the fp8 all-gather's alike)
            every = (v for a in assignments for v in setting_variants(policy_from_params(a, self.choices), self.choices))
            policies = {formats_key(p): self.layer_times.features(p) for p in every}
            self._policies = list(policies.items())
        if not self._policies:
            return False
        tried = timed_formats(study, self.choices)
        tried.add(formats_key(Policy(layers=dict.fromkeys(policy_from_params({}, self.choices).layers, Format.FP32))))
        untried = [features for key, features in self._policies if key not in tried]  # all-fp32: 1.0x, never timed
        if not untried:
            self.stopped = "every policy of the search space was timed"
            return True
        found = ceiling(timed_trials(study, self.choices, self.layer_times), untried, best)
        if found is None:
            return False
        self.stopped = found.describe()
        return True

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        policy = suggest(trial, self.choices, self.space)
        earlier = _same_policy(trial, policy, self.choices)
        if earlier is not None and earlier[1].untimed is None:  # samplers propose a policy again: its
            self._reuse(trial, *earlier)  # measurements stand, and cost nothing
            return self._values(trial, policy)
        start = time.perf_counter()
        if earlier is not None:  # left untimed before (so within budget): its metric stands; whether to time it is
            before = earlier[1]  # decided anew
            metric = before.metric if before.metric is not None else math.nan
            extra: dict[str, Any] = {} if before.train_skipped is None else {"train_skipped": before.train_skipped}
            TrialRecord.write(trial, reevaluated_from=earlier[0].number)
        elif self.config.mode is Mode.WEIGHTS and _all_fp32(policy):
            metric, extra = self.judge.fp32_metric, {}  # the profile measured exactly this model
        else:
            metric, extra = self.judge.safe_metric(policy)
        if earlier is None:
            TrialRecord.write(trial, evaluate_s=time.perf_counter() - start)
        TrialRecord.write(trial, **extra)
        drop = self.judge.fp32_metric - metric
        feasible = math.isfinite(metric) and drop <= self.judge.budgets.bound
        TrialRecord.write(
            trial, metric=metric if math.isfinite(metric) else None, metric_drop=drop if math.isfinite(drop) else None
        )
        constraint = over_budget(drop, self.judge.budgets.bound) if math.isfinite(drop) else INFEASIBLE
        if feasible and _all_fp32(policy):  # the fp32 baseline itself: 1.0 by definition, nothing to time
            TrialRecord.write(trial, speedup=1.0)
            self._record_memory(trial, self.fp32_peak(None))
        elif feasible and not self.config.objective.timed:
            pass  # its value is the goal's estimate from the policy (_flops.py): nothing to time on this machine
        elif feasible and self._predicted_too_slow(trial, policy):
            pass  # its predicted speedup is its value (a finalist only where k faster ones are alternatives)
        elif feasible:  # only candidates within budget are worth the time it takes to time them
            start = time.perf_counter()
            feasible, constraint = self._time(trial, policy, constraint)
            TrialRecord.write(trial, measure_s=time.perf_counter() - start)
        over = self._over_memory(trial) if feasible else 0.0  # a trial not timed has no peak: its drop rules it out
        feasible = feasible and over <= 0
        TrialRecord.write(trial, feasible=feasible)
        if self.config.max_memory is None and over > 0:  # the memory objective without a peak: infeasible through
            constraint = max(constraint, INFEASIBLE)  # the one constraint every trial has
        trial.set_constraint("metric_drop_over_budget", constraint)
        if self.config.max_memory is not None:
            trial.set_constraint("peak_memory_over_limit", over)
        return self._values(trial, policy)

    def fp32_peak(self, baseline: Trainer | None) -> int | None:
        """The all-fp32 model's peak memory per step (measured once): from `baseline` after its timing, or from
        a Trainer built for it (compiled as the search's candidates are)."""
        if not self._fp32_peak_known:
            trainer = baseline or self.baseline
            with compile_scope(self.config.compile, 1) if trainer is None else contextlib.nullcontext():
                fp32 = Policy(layers={ROOT: Format.FP32})
                own = new_trainer(self.workload, fp32, compiled=self.config.compile) if trainer is None else None
                try:
                    self._fp32_peak = peak_memory_or_none(own or trainer, "the fp32 baseline")  # type: ignore[arg-type]
                finally:
                    release_trainer(own)  # built for this alone
            self._fp32_peak_known = True
        return self._fp32_peak

    def close(self) -> None:
        """After its trials: the eager fp32 baseline's model and optimizer state leave the device (Trainer.release),
        so the final re-measure's candidates have it to themselves."""
        release_trainer(self.baseline)
        self.baseline = None

    def _record_memory(self, trial: optuna.Trial, peak: int | None) -> None:
        TrialRecord.write(trial, peak_bytes=peak, memory_saving=memory.saving(peak, self.fp32_peak(None)))

    def _over_memory(self, trial: optuna.Trial) -> float:
        """How far the trial's peak is over --max-memory, as a share of it (<= 0: it fits); INFEASIBLE where the peak
        was not measured but is needed (a limit, or a goal that needs it: the memory objective)."""
        limit = self.config.max_memory
        peak = TrialRecord.of(trial).peak_bytes
        if peak is None and (limit is not None or self.config.objective.needs_peak):
            needs = "--max-memory" if limit is not None else f"--objective {self.config.objective.name}"
            TrialRecord.write(trial, error=f"peak memory not measured, which {needs} needs")
            return INFEASIBLE
        if limit is None or peak is None:
            return 0.0
        if peak > limit:
            TrialRecord.write(
                trial, error=f"peak memory {memory.human_bytes(peak)} over --max-memory {memory.human_bytes(limit)}"
            )
        return (peak - limit) / limit

    def _predicted_too_slow(self, trial: optuna.Trial, policy: Policy) -> bool:
        """Whether the profile's layer times, fitted on the trials timed so far (speed.fit), predict this candidate
        slower than the k-th fastest timed trial even with the fit's error in its favour: then it is not timed,
        and its predicted speedup (`predicted_speedup`, also its `speedup`) is what the sampler learns from."""
        if self.layer_times is None:
            return False
        mark = finalist_mark(trial.study, self.config.finalists)
        found = too_slow(timed_trials(trial.study, self.choices, self.layer_times), self.layer_times.features(policy), mark)
        if found is None:
            return False
        predicted, speed_fit = found
        TrialRecord.write(
            trial,
            predicted_speedup=predicted,
            speedup=predicted,
            untimed=f"predicted {predicted:.3f}x (fit error {speed_fit.error:.1%}), below the "
            f"k-th fastest timed trial's {mark:.3f}x",
        )
        return True

    def _settled(self, trial: optuna.Trial) -> Callable[[Mapping[str, Sequence[float]]], bool]:
        """When a trial's timing may stop early (a sequential test over the rounds so far). In a search with at
        least `finalists` timed trials (finalist_mark): every round measured the candidate slower than the k-th
        fastest of them (its number does not matter), or faster than the fastest (a finalist for sure, re-measured
        with the others). In a search or a sweep (whose front also keeps slower trials with smaller drops): the
        per-round speedups agree within SETTLED. A candidate whose rounds straddle those marks, or disagree, is timed on,
        unless its rounds (or the device's timings so far: trials.device_noise) spread beyond NOISY_SPREAD after
        NOISE_ROUNDS: there more rounds would not rank it, and NOISE_ROUNDS are enough for the device's noise to be
        read and for the final re-measure to judge it."""
        ranked_by_speed = self.objectives == 1 and self.config.objective.ranks_by_speed
        kth = finalist_mark(trial.study, self.config.finalists) if ranked_by_speed else None
        marks = (kth, max(timed_speedups(trial.study))) if kth is not None else None
        noise = device_noise(trial.study, since=self.since)
        noisy = noise is not None and noise > NOISY_SPREAD  # more rounds would not rank it: the re-measure decides

        def enough(samples: Mapping[str, Sequence[float]]) -> bool:
            ratios = [f / p for f, p in zip(samples["fp32"], samples["policy"]) if p > 0]
            if not ratios:
                return False
            if len(ratios) >= NOISE_ROUNDS and (noisy or noisiest(samples) > NOISY_SPREAD):  # an interquartile
                return True  # spread from NOISE_ROUNDS on (device_noise reads it): beyond NOISY_SPREAD, they stay wide
            if marks is not None and (max(ratios) < marks[0] or min(ratios) > marks[1]):
                return True
            return (max(ratios) - min(ratios)) / statistics.median(ratios) <= SETTLED

        return enough

    def _values(self, trial: optuna.Trial, policy: Policy) -> float | tuple[float, float]:
        # Infeasible trials are not timed; the constraint, not this value, keeps them from winning.
        record = TrialRecord.of(trial)
        first = self.config.objective.trial_value(record, policy)
        if self.objectives == 1:
            return first
        drop = record.metric_drop
        return first, (drop if drop is not None else INFEASIBLE)

    def _reuse(self, trial: optuna.Trial, earlier: optuna.trial.FrozenTrial, before: TrialRecord) -> None:
        TrialRecord.write(trial, **before.to_attrs(costs=False), reused_from=earlier.number)
        for key, value in earlier.system_attrs.items():
            if key.startswith("constraints:"):
                trial.set_constraint(key.split(":", 1)[1], value)

    def _time(self, trial: optuna.Trial, policy: Policy, constraint: float) -> tuple[bool, float]:
        built: list[Trainer] = []  # this trial's own trainers: their device memory freed when it ends, whatever happens
        try:
            return self._timed(trial, policy, constraint, built)
        finally:
            for trainer in built:
                release_trainer(trainer)

    def _timed(self, trial: optuna.Trial, policy: Policy, constraint: float, built: list[Trainer]) -> tuple[bool, float]:
        try:
            with compile_scope(self.config.compile, 2):
                # compile_scope empties the compile caches, so a compiled fp32 baseline is built (mostly from
                # inductor's on-disk cache) in every trial, and its compilation counted with the candidate's
                fp32 = Policy(layers={ROOT: Format.FP32})
                if self.baseline is None:
                    built.append(new_trainer(self.workload, fp32, compiled=True))
                baseline = built[-1] if self.baseline is None else self.baseline
                try:
                    baseline.step()  # the fp32 baseline failing is no fault of the candidate's
                except Exception as exc:
                    raise fp32_step_failed(
                        self.workload, "all-fp32 training step", describe(exc), compiled=self.config.compile
                    ) from exc
                candidate = new_trainer(self.workload, policy, compiled=self.config.compile)
                built.append(candidate)
                if self.config.compile:  # each batch shape compiled before the timing, counted as compile time
                    baseline.warm_shapes()
                    candidate.step()
                    candidate.warm_shapes()
                work = {"fp32": baseline, "policy": candidate}  # Steps: a clock sees each one's model
                warmed = ("fp32",) if self._baseline_warm else ()
                t = interleaved_times(work, self.workload.device, self.config.timing, enough=self._settled(trial), warmed=warmed)
                self._baseline_warm = self.baseline is not None
                stats = step_stats({"policy": candidate}, t)["policy"]  # the timed steps, before the memory's
                self.fp32_peak(baseline)  # after the timing, never inside it; as the candidate's
                peak = peak_memory_or_none(candidate, f"trial {trial.number}")
        except UserError:
            raise
        except Exception as exc:  # a step the user's code cannot take in this format: infeasible, not fatal
            TrialRecord.write(trial, error=f"training step failed: {describe(exc)}")
            return False, INFEASIBLE
        self._record_memory(trial, peak)
        TrialRecord.write(trial, rounds=len(t["policy"].samples_ms))
        if candidate.compiled and candidate.first_step_s is not None and baseline.first_step_s is not None:
            # both have a first step by now (the baseline's above, the candidate's in the timing): always true
            TrialRecord.write(trial, compile_s=candidate.first_step_s + baseline.first_step_s)
        TrialRecord.write(
            trial,
            step_ms=t["policy"].median_ms,
            fp32_step_ms=t["fp32"].median_ms,
            spread=max(t["policy"].spread, t["fp32"].spread),
            skipped=stats.skipped,
            steps=stats.steps,
        )
        if not stats.finite or not math.isfinite(stats.effective_ms):
            TrialRecord.write(
                trial, error="non-finite training loss" if not stats.finite else "the GradScaler skipped every step"
            )
            return False, INFEASIBLE
        TrialRecord.write(trial, effective_step_ms=stats.effective_ms, speedup=t["fp32"].median_ms / stats.effective_ms)
        return True, constraint


def _all_fp32(policy: Policy) -> bool:
    return all(fmt is Format.FP32 for fmt in policy.layers.values())


def _same_policy(trial: optuna.Trial, policy: Policy, choices: Choices) -> tuple[optuna.trial.FrozenTrial, TrialRecord] | None:
    """A completed trial of the study (any worker's) whose params describe this same policy, and its record; or None.
    Grouped and ranked params can name one policy in several ways (a count past every layer a format suits)."""
    done = trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    judged = [(t, TrialRecord.of(t)) for t in done]
    same = [(t, r) for t, r in judged if r.feasible is not None and policy_from_params(t.params, choices) == policy]
    return next((found for found in same if found[1].untimed is None), same[0] if same else None)  # a timed one first


def run_trials(
    study: optuna.Study,
    objective: Objective,
    target: int,
    *,
    progress: bool = True,
    after_trial: Callable[[optuna.Study], None] | None = None,
) -> int:
    """Run trials until the study holds `target` completed ones (every worker's and earlier run's count; one
    cut short by Ctrl-C or a crash is run again on resume), with a progress bar showing the goal's best so far
    (Goal.progress: the best speedup, the smallest peak); fewer where `objective.should_stop` says so (its
    `stopped` says why). `after_trial(study)`: told after each trial this call completes (the trial log written as
    it goes). Returns how many trials this call set out to run (0: the study was finished, or stopped, already)."""
    complete = (optuna.trial.TrialState.COMPLETE,)
    objective.since = first_of_run(study)  # an earlier run's noise need not be this machine's now
    remaining = max(0, target - len(study.get_trials(deepcopy=False, states=complete)))
    if remaining and objective.should_stop(study):  # a run resumed after an early stop: nothing left worth timing
        return 0
    with tqdm(total=remaining, desc="search trials", unit="trial", disable=not progress) as bar:

        def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            bar.set_postfix(objective.config.objective.progress(study))
            bar.update(1)
            if after_trial is not None:
                after_trial(study)
            if objective.should_stop(study):
                study.stop()

        if remaining:
            # Other workers complete trials too: stop once the study holds the target. A trial another worker
            # is still running then also completes, so N workers may overshoot by up to N - 1 trials.
            stop = optuna.study.MaxTrialsCallback(target, states=complete)
            study.optimize(objective, n_trials=remaining, callbacks=[stop, callback])
    return remaining
