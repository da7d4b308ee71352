"""Everything that configures the tuner, in one place: the enum of what a budget is measured on (what a search
optimises is a registered goal, _goals.py), the dataclasses a timing, a profile and a search take, and the tuning
constants, each with why it has its value. The command line and the Python API build a SearchConfig through
`search_config` alone."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import re
from collections.abc import Callable
from typing import Any

import torch

from autoprec import devices
from autoprec.formats import AutocastFamily, Float8Family
from autoprec.tune._core._budget import Budget, check_budget, parse_budget
from autoprec.tune._core._goal import DEFAULT_GOAL, Goal, goal_named, goals
from autoprec.tune._core._numbers import parse_option
from autoprec.tune._core._targets import target_named, targets

# ---- tuning constants --------------------------------------------------------------------------------------------

# A spread (interquartile range / median) beyond which step times cannot rank candidates a few percent apart:
# a loaded machine, a throttling GPU. A trial whose rounds spread beyond it, or any trial once the trials' timings do
# (trials.device_noise), is timed NOISE_ROUNDS only; once they do, a search predicting step times stops
# (objective.Objective.should_stop), and the final re-measure times on as long again (within FINAL_SHARE), and says
# so if it stays.
NOISY_SPREAD = 0.25
# The rounds a trial's timing is judged noisy from (objective.Objective's early stop), and the least a trial's
# timing needs to count towards the device's noise (trials.device_noise): timing.Timing gives the spread of fewer
# rounds as their full range, which one stalled round widens, and from 4 on as their interquartile range. The fewest
# that spread needs: on a noisy device more rounds per trial would not rank it, and the final re-measure decides.
NOISE_ROUNDS = 4

# The fewest training steps one timed sample averages, on every device and whatever a step costs: a sample of one
# step starts on an idle GPU and ends when it drains, so it carries all of the host's jitter at both ends (a bf16
# GPT-2-small step on an H200 spread ±10% sampled one at a time, fp32's ±0.1%); eight share those ends.
MIN_STEPS_PER_SAMPLE = 8
# A step whose device is busy for at most this share of its time is host-bound: the device waited on the host for
# the rest, so no format changes that step's time (CUDA graphs or a larger batch would); reported as such rather than
# as a noisy device. Decided from the device's busy time (a held block, Timing.busy_ms), not from the host's time
# issuing the step: on CUDA that includes the host's waits on a full launch queue, so a device-bound step (GPT-2-small
# in fp32 on an H200: 51 ms of host time in a 54.5 ms step, the GPU busy all 54.5) shows as much host time as a
# host-bound one.
HOST_BOUND = 0.9

MIN_ROUNDS = 3  # before a sequential test may stop the timing: a median and a spread need a few rounds
# Rounds agreeing within this (relative range or spread) settle a timing: a trial's (objective.Objective) after
# MIN_ROUNDS, the final re-measure's (every candidate's spread) after SETTLED_FINAL_ROUNDS. Also the least spread a
# trial's timing is granted when it is ruled out of the final re-measure (timing.beaten).
SETTLED = 0.05
SETTLED_FINAL_ROUNDS = 5
# A search worth its time costs at most this share of the training run it tunes (SearchConfig.run_steps)
SEARCH_SHARE_GOAL = 0.02
# Slower than fp32 by this much, a candidate is out of the running whatever the noise: the profile probes such a
# format once instead of timing it (ProfileConfig.gross_slowdown), and the final re-measure times no more a candidate
# whose every round so far, two at least, was this much slower a step than the slowest round of fp32 or of another
# candidate within budget (_finalists.out_of_the_running): on a CPU without bf16, uniform bf16's step takes 30x
# fp32's; on a GPU, fp32's takes 10x a bf16 one's; their further rounds would be most of a search's time.
GROSS_SLOWDOWN = 4.0

# The train batches of shapes the first ones do not show (an epoch's ragged last batch, another sequence length),
# the first of each: the profile runs them too, so a format that fails on a shape fails there, not in a trial; and a
# compiled candidate takes a step on each before its timing, so a recompilation for a new shape is compile time, not
# step time. Past this many (text of many lengths, where torch.compile goes dynamic after the second) the rest are
# left to the timing.
SHAPE_BATCHES = 4
# The all-fp32 metric is evaluated twice; apart by more than this (relative to it, or absolute below 1) it is not
# deterministic and the search is refused: GPU reductions differ by float rounding (1e-7), a sampled eval subset
# by far more.
METRIC_REPEAT_TOLERANCE = 1e-5
MEMORY_TRIES = 3  # steps the GradScaler skips before peak memory is given up (None) for a candidate

# A search's profile lowers a format's layers together first and predicts their single-layer drops where the
# group's drop is within this share of its smallest budget (ProfileConfig.group_tolerance sets another;
# ProfileConfig(group_testing=False) measures each alone).
GROUP_SHARE = 0.1

# Peaks closer than this share are the same memory to a user (an allocator's rounding, a small buffer): among them
# the fastest is chosen.
MEMORY_TIE = 0.01

# The search stops early (speed.ceiling) once no untried policy can beat the best timed trial beyond the noise; it
# checks the untried policies one by one, so only where the layout's format choices number at most this.
STOP_ENUMERATE = 20_000

# Predicting a trial's speedup from the profile's layer times (_speed.py; docs/measuring.md, "Predicted speed"):
# The least relative error a prediction is granted, however well the fit went (the fit's own error, the most a trial
# left out of it ran faster than predicted, where larger): a candidate is left untimed only where its prediction,
# raised by this, is still below the k-th fastest timed trial. A fit that matches its few trials exactly still
# predicts the policies between them with some error, so a perfect fit must not make the verdict a sure one.
MARGIN = 0.10
# Timed trials that lower a layer before a prediction is made: the fit's error is measured by leaving each trial
# out in turn, which with fewer would rest on two or three trials, about as many as a model has terms.
MIN_FIT = 4
# A trial slower than its fit (the best-predicting model, without it) by this many robust standard deviations
# (1.4826 MAD of the leave-one-out misses) is a load spike, left out of every model: far in the tail of noise that
# is normal, where a spike of a busy machine lands.
OUTLIER = 4.0
# ... but never more than this share of the trials: beyond it the fit itself is in doubt, and they all stay in.
OUTLIER_SHARE = 0.2
# A model predicting the trials left out less than this much better than a simpler one is not preferred (as
# cross-validation's one-standard-error rule prefers the simpler): on a noisy device a term per format follows the
# noise, and its predictions for the policies between the trials swing far.
MODEL_TIE = 0.05

# The final re-measure times on past its sequential test no longer than this share of the search's time before it
# (at least SETTLED_FINAL_ROUNDS rounds): on a noisy machine the candidates it cannot separate are reported as ties.
# As long as the search before it: where the trials stop early on a noisy device, the final re-measure's rounds are
# what decides, and a median of a few rounds at ±25% or more ranks by chance.
FINAL_SHARE = 1.0
# With a time budget, no trial starts once only this share of the trials' time is left for the final re-measure
# (which never runs past the budget either): a quiet device's settles in a few rounds, and a noisy device's trials
# stop on their own much sooner (objective.Objective.should_stop), leaving it the rest.
BUDGET_FINAL_SHARE = 0.25
# With --time-budget, the share of it the profile's per-layer work may take: past it, the layers not yet profiled
# stay in fp32 (their lowered formats not measured, so never chosen), and the trials get the rest.
PROFILE_SHARE = 0.5
# --time-budget is overrun by more than this share only where the profile or the final re-measure's first
# SETTLED_FINAL_ROUNDS rounds need it (neither is cut short); the search then says so, with where the time went.
TIME_BUDGET_TOLERANCE = 0.25

RETRIES = 3  # how often a trial whose worker died is run again before it stays failed

# "Which layer breaks" (report.breaks_summary): a GEMM result (fprop, dgrad, wgrad) whose SQNR against fp32 is below its
# format's floor, its family's sqnr_floor_db (why each is where it is: autoprec/formats/float8.py and autocast.py)
BREAK_SQNR_DB_FP8 = Float8Family.sqnr_floor_db
BREAK_SQNR_DB_16BIT = AutocastFamily.sqnr_floor_db
BREAK_ROWS = 15  # rows of the "which layer breaks" table shown; the rest are counted ("and N more")


# ---- what a budget is measured on, and a search's goal ------------------------------------------------------------


class Mode(str, enum.Enum):
    """What the budget is measured on."""

    WEIGHTS = "weights"  # the metric of the given weights with the policy applied
    TRAIN = "train"  # the metric after K training steps with the policy (and its GradScaler), vs fp32's

    def __str__(self) -> str:
        return self.value


def parse_goal(value: object) -> Goal:
    """The registered goal `value` names (_goal.goal_named; a Goal as it is), or a ValueError listing the names."""
    return goal_named(value)


def check_target(goal: Goal, target: object, spell: Callable[[str], str] = str) -> str | None:
    """The registered target's name (_targets.py) for a goal that plans for one (Goal.targeted), which requires it;
    None for any other goal, which refuses one. ValueError naming the targets (or the goal) otherwise."""

    names = ", ".join(t.name for t in targets())
    if not goal.targeted:
        if target is not None:
            takes = " or ".join(g.name for g in goals() if g.targeted)
            raise ValueError(f"{spell('target')} applies only to {spell('objective')} {takes}, not {goal.name}")
        return None
    if target is None:
        raise ValueError(f"{spell('objective')} {goal.name} needs {spell('target')}: one of {names}")
    try:
        return target_named(target).name
    except ValueError:
        raise ValueError(f"{spell('target')} must be one of {names}, but got {target!r}") from None


def _speed() -> Goal:
    return parse_goal(DEFAULT_GOAL)


def parse_mode(value: object) -> Mode:
    return parse_option(Mode, value, "mode")


# ---- the configurations ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    """How long to time: `warmup` calls per candidate first, and on until `warmup_s` seconds of them (a GPU's clocks
    and caches settle; the last call sizes the blocks), then `rounds` interleaved rounds. Every candidate takes the
    same steps in a round: enough that the fastest's block lasts `min_block_s`, at most `max_steps_per_block`, never
    fewer than `min_steps` (MIN_STEPS_PER_SAMPLE), and no more than the slowest runs in `max_block_s` (which alone
    may cut a block below `min_steps`: a step of seconds has no launch jitter to average). `busy`: on a device with a
    queue of its own, one more block of each timed held after the rounds (Timing.busy_ms, host_bound): the final
    re-measure's, whose table reports it; a trial does not pay it."""

    warmup: int = 3
    rounds: int = 7
    min_block_s: float = 0.05
    max_steps_per_block: int = 50
    warmup_s: float = 1.0
    max_block_s: float = 2.0
    # the fewest steps a sample averages: MIN_STEPS_PER_SAMPLE (the test suite's injected clocks run with fewer: their
    # prices have no jitter to average, and each step they run costs the suite's time)
    min_steps: int = MIN_STEPS_PER_SAMPLE
    busy: bool = False

    def __post_init__(self) -> None:
        if (
            self.warmup < 0
            or self.rounds < 1
            or self.min_block_s < 0
            or self.min_steps < 1
            or self.max_steps_per_block < self.min_steps
            or self.warmup_s < 0
            or self.max_block_s < 0
        ):
            raise ValueError(
                "TimingConfig needs warmup >= 0, rounds >= 1, min_block_s >= 0, warmup_s >= 0, max_block_s >= 0, "
                f"min_steps >= 1 and max_steps_per_block >= min_steps, got {self}"
            )


NUMERICS = ("all", "offered")  # ProfileConfig.numerics


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """`batches`: train batches for the SQNR pass; a format slower than fp32 by `gross_slowdown` in a
    single probe is timed once rather than interleaved (bf16 and fp16 on a CPU without their kernels cost many
    times fp32 a call).
    `grad_batches`: train batches for the gradient ranges (None: all); `max_underflow`: the fraction of a
    layer's nonzero gradient elements fp16 may flush to zero at the low end of the loss-scale range.
    `group_tolerance`: None evaluates the metric with each layer lowered alone; a number first lowers a format's
    layers together and takes each one's share of a drop within it (see `_judge_group`). A search sets it to a
    tenth of its smallest budget when None and `group_testing` (GROUP_SHARE); `group_testing=False`
    measures every drop alone, whatever the tolerance."""

    batches: int = 2
    # a layer's step is short and timed in many formats: a fifth of a second warms it (a whole step's second would
    # cost a second per layer shape and format), and a block of half a second bounds a slow format's (a GPU's layer
    # takes microseconds to a millisecond: hundreds of steps; a CPU's emulated format a second: one)
    timing: TimingConfig = TimingConfig(warmup=2, rounds=5, min_block_s=0.02, warmup_s=0.2, max_block_s=0.5)
    gross_slowdown: float = GROSS_SLOWDOWN
    grad_batches: int | None = 8
    max_underflow: float = 1e-3
    compile: bool = False  # time each layer's step under torch.compile (in a search: SearchConfig.compile)
    group_tolerance: float | None = None
    group_testing: bool = True
    # "all": every layer x format this device can run or emulate has its numerics (SQNR, finiteness, overflow, metric
    # drop), however slow it runs here: they do not depend on the device's speed. "offered": only the formats the
    # timing keeps in play (a search's own profile: minutes saved); the others say "not measured" and why.
    numerics: str | None = None  # None: "all" for a profile on its own, "offered" for a search's (SearchConfig)
    # Seconds the per-layer profiling may take (a search's --time-budget gives it PROFILE_SHARE of the budget): the
    # layers not reached by then are not profiled, their lowered formats ruled out with that reason. None: no limit.
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.group_tolerance is not None and not (math.isfinite(self.group_tolerance) and self.group_tolerance >= 0):
            raise ValueError(f"group_tolerance must be a finite number >= 0 or None, but got {self.group_tolerance!r}")
        if self.grad_batches is not None and self.grad_batches < 1:
            raise ValueError(f"grad_batches must be >= 1 or None (all train batches), but got {self.grad_batches!r}")
        if not 0 <= self.max_underflow < 1:
            raise ValueError(f"max_underflow must be in [0, 1), but got {self.max_underflow!r}")
        if self.numerics is not None and self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, but got {self.numerics!r}")
        if self.deadline_s is not None and not (math.isfinite(self.deadline_s) and self.deadline_s >= 0):
            raise ValueError(f"deadline_s must be a number of seconds >= 0 or None, but got {self.deadline_s!r}")


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """How to search: the budget, the study, the timing and what the search optimises, validated on construction.

    Frozen; every field has a default (`budget`'s, None, is a sweep's: its budgets are its own list). The command
    line and the Python API (autoprec.tune.search, sweep) build one through `search_config`, which also reads
    --max-memory's forms ("40GB", "80%"), picks the compile default for the device and refuses train-mode settings
    in weights mode; construct one directly to call `pipeline.search` or `sweeper.sweep` yourself. A search's own
    profile measures the numerics only of the formats its timing keeps in play: `profile.numerics` None becomes
    "offered".

    Args:
        budget: A search's largest allowed metric drop from fp32, as the user gave it: a number in the metric's
            units (finite, >= 0), or a percentage of |fp32 metric| ("1%", a Budget), which the search resolves
            against the fp32 metric its profile measures. Default None: a sweep's (sweeper.sweep's `budgets` are
            its budgets, and it refuses this one set); a search refuses None.
        trials: The most trials in the study, every run's and worker's counted, so a rerun resumes up to it
            (>= 1). Default None: the search space's `trials`.
        seed: The Optuna sampler's seed, an integer from 0 to 2**32 - 1. Default 0.
        storage: An Optuna storage URL ("sqlite:///study.db", "postgresql://...") or a journal file's path.
            Default None: study.journal in the output folder.
        heartbeat_s: Database storages: a trial whose worker is silent for twice this many seconds is failed and
            run again (an integer >= 1). Default 60.
        study_name: The study's name in the storage. Default None: the task's name.
        timing: How each trial's step is timed (TimingConfig). Default TimingConfig(): 3 warm-up calls and at
            least 1 s of them, up to 7 interleaved rounds of at least 0.05 s and MIN_STEPS_PER_SAMPLE steps.
        final_timing: How the finalists and the alternatives are re-measured together at the end. Default
            TimingConfig(rounds=11, min_block_s=0.25, max_steps_per_block=1000, max_block_s=8.0).
        finalists: How many of the fastest trials within budget are re-measured (k, >= 1). Default 3.
        profile: How the search's profile measures (ProfileConfig). Default ProfileConfig(), its numerics
            "offered".
        progress: Show progress bars. Default True.
        mode: What the budget is measured on: Mode.WEIGHTS ("weights", the default: the given weights with the
            policy applied) or Mode.TRAIN ("train": the metric after `train_steps` training steps, against fp32's).
        train_steps: Train mode: the training steps K before the metric is taken (an integer >= 1). Default 50.
        noise_runs: Train mode: the fp32 seeds whose spread is the noise floor (an integer >= 1). Default 3.
        compile: Time the profile's layers, every trial and the re-measure under torch.compile (the metric is
            evaluated eagerly either way). Default False here; search_config's default is True on CUDA.
        remeasure: A rerun of a finished study re-measures its finalists and chooses again, on new timing noise,
            instead of keeping the result it wrote. Default False.
        cuda_graphs: The re-measure also times uniform bf16 compiled with CUDA graphs (torch.compile's
            mode="reduce-overhead"), beside the policies and never chosen: what speeds a host-bound step. Needs
            compile=True on a device that records CUDA graphs (search_config checks the device). Default False.
        objective: What the search optimises within the budget: a registered goal (_goals.py) or its name,
            "speed" (the default: the fastest step), "memory" (the smallest peak memory) or "flops" (the most GEMM
            work in low formats, weighted by a target device's nominal throughput: an estimate, never measured).
        target: The device a "flops" search plans for, a registered target's name (_targets.py: "b200", "h100");
            required by that goal and refused by the others. Default None.
        max_memory: The most peak memory a candidate may need, in bytes (an integer >= 1); above it a candidate is
            infeasible. Default None: no limit.
        predict_speed: Leave untimed a trial whose speedup, predicted from the profile's layer times, cannot make
            it a finalist (a single-objective speed search without max_memory, once enough trials are timed).
            Default True; False times every trial (--time-every-trial).
        time_budget: Seconds the whole search may take (a number > 0): the trials stop where the final re-measure
            still fits, and the answer is chosen from what was measured. Default None: no limit but `trials`.
        run_steps: The training run the search tunes, in steps: the summary says the search's own time as a share of
            it. Default None: in steps of the chosen policy alone.

    Raises:
        ValueError: A field out of range or of the wrong type (the message names it and what it accepts), an
            unknown `mode` or `objective`, or `profile=ProfileConfig(compile=True)` without `compile=True`.

    Example:
        >>> from autoprec.tune import Mode, SearchConfig
        >>> config = SearchConfig(budget=0.01, trials=50, finalists=3)
        >>> config.profile.numerics
        'offered'
        >>> SearchConfig(budget=0.01, mode="train", train_steps=20).mode is Mode.TRAIN
        True
        >>> SearchConfig(budget=0.01, objective="memory", max_memory=40 * 2**30).objective.name
        'memory'
    """

    budget: float | Budget | None = None  # as given: a number (float), a relative Budget ("1%" parsed), None
    trials: int | None = None  # None: the search space's `trials`
    seed: int = 0
    storage: str | None = None  # an Optuna storage URL or a journal file path; None: out_dir/study.journal
    heartbeat_s: int = 60  # database storages: a trial whose worker is silent for 2x this is failed and retried
    study_name: str | None = None  # None: the task's name
    timing: TimingConfig = TimingConfig()
    # blocks of a quarter second at least (a 1 ms GPU step: 250 steps), so a sample carries little of the host's jitter;
    # 8 steps of up to a second each (a large model's strict-fp32 step on a GPU) still fit max_block_s
    final_timing: TimingConfig = TimingConfig(rounds=11, min_block_s=0.25, max_steps_per_block=1000, max_block_s=8.0)
    finalists: int = 3
    profile: ProfileConfig = ProfileConfig()  # numerics None: "offered" (__post_init__)
    progress: bool = True
    mode: Mode = Mode.WEIGHTS
    train_steps: int = 50
    noise_runs: int = 3
    # Step times (the profile's layers, every trial, the re-measure) with the model under torch.compile, as
    # users who compile train; the CLI's default on CUDA. The metric is evaluated eagerly either way.
    compile: bool = False
    # A rerun of a finished study (no trials left to run) keeps the result it wrote; True re-measures its
    # finalists and chooses again, on new timing noise.
    remeasure: bool = False
    # The re-measure times uniform bf16 compiled with CUDA graphs too (torch.compile's mode="reduce-overhead"):
    # what makes a host-bound step faster, shown beside the policies, never chosen (a way to compile, not a
    # policy). Needs compile=True on a device with CUDA graphs (Device.cuda_graphs).
    cuda_graphs: bool = False
    # What the search optimises within the budget: a registered goal (_goals.py), or its name ("speed", the default;
    # "memory"); and the most peak memory a candidate may need, in bytes (memory.parse_limit reads "40GB", "0.8"):
    # above it, a candidate is infeasible.
    objective: Goal = dataclasses.field(default_factory=_speed)
    max_memory: int | None = None
    # Leave untimed a trial whose speedup, predicted from the profile's layer times, cannot make it a finalist
    # (_speed.py; a single-objective speed search without --max-memory, once enough trials are timed).
    predict_speed: bool = True
    # Seconds the whole search may take (--time-budget, in minutes there): the trials stop where the final re-measure
    # still fits (BUDGET_FINAL_SHARE), and the answer is chosen from what was measured. None: no limit but --trials.
    time_budget: float | None = None
    # The training run the search tunes, in steps (--run-steps): the summary prices the search's own time against it
    # (the goal: at most SEARCH_SHARE_GOAL of the run). None: priced in steps of the chosen policy alone.
    run_steps: int | None = None
    # The device a targeted goal plans for (_targets.py: "b200", "h100"), which needs one; refused with any other goal.
    target: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", _given_budget(self.budget))
        object.__setattr__(self, "mode", parse_mode(self.mode))
        object.__setattr__(self, "objective", parse_goal(self.objective))
        object.__setattr__(self, "target", check_target(self.objective, self.target))
        if not self.objective.timed and self.max_memory is not None:
            raise ValueError(
                f"max_memory (--max-memory) needs each trial's peak memory, which objective {self.objective.name} does "
                "not measure (its trials are not run on this machine's clock): leave it out, or search with objective "
                "speed or memory"
            )
        if self.max_memory is not None and (
            isinstance(self.max_memory, bool) or not isinstance(self.max_memory, int) or self.max_memory < 1
        ):
            raise ValueError(
                f"max_memory must be a number of bytes >= 1 (memory.parse_limit reads '40GB'), but got {self.max_memory!r}"
            )
        for name in ("train_steps", "noise_runs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, but got {value!r}")
        if self.time_budget is not None and not (
            isinstance(self.time_budget, (int, float))
            and not isinstance(self.time_budget, bool)
            and math.isfinite(self.time_budget)
            and self.time_budget > 0
        ):
            raise ValueError(f"time_budget must be a number of seconds > 0 or None, but got {self.time_budget!r}")
        if self.run_steps is not None and (
            isinstance(self.run_steps, bool) or not isinstance(self.run_steps, int) or self.run_steps < 1
        ):
            raise ValueError(f"run_steps must be an integer >= 1 (the training run's steps) or None, but got {self.run_steps!r}")
        if not isinstance(self.predict_speed, bool):
            raise ValueError(f"predict_speed must be True or False, but got {self.predict_speed!r}")
        if isinstance(self.heartbeat_s, bool) or not isinstance(self.heartbeat_s, int) or self.heartbeat_s < 1:
            raise ValueError(f"heartbeat_s must be an integer >= 1 (seconds), but got {self.heartbeat_s!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer from 0 to 2**32 - 1 (Optuna's sampler seed), but got {self.seed!r}")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"trials must be >= 1, but got {self.trials!r}")
        if self.finalists < 1:
            raise ValueError(f"finalists must be >= 1, but got {self.finalists!r}")
        if self.cuda_graphs and not self.compile:
            raise ValueError(
                "cuda_graphs=True needs compile=True: CUDA graphs are recorded by torch.compile's mode='reduce-overhead'"
            )
        if self.profile.compile and not self.compile:
            raise ValueError(
                "profile=ProfileConfig(compile=True) needs compile=True: one switch compiles the profile's "
                "layer timings, the trials and the re-measure; set SearchConfig(compile=True)"
            )
        if self.profile.numerics is None:  # a search's own profile: the numerics of formats it does not offer wait
            object.__setattr__(self, "profile", dataclasses.replace(self.profile, numerics="offered"))

    @property
    def profile_settings(self) -> ProfileConfig:
        """The profile this search measures: `profile`, its layer timings compiled as the search's steps are. One
        switch, `compile`, owns that: `profile.compile` is read only to refuse True without it."""
        return self.profile if self.profile.compile == self.compile else dataclasses.replace(self.profile, compile=self.compile)


def _given_budget(value: object) -> float | Budget | None:
    """SearchConfig.budget as the user gave it, checked: a number as a float (-0.0 as 0.0, which would name another
    study), "0.01" too; "1%" (or a relative Budget) as a Budget, resolved by the pipeline; None as it is."""
    if value is None:
        return None
    if isinstance(value, (str, Budget)):
        spec = parse_budget(value)
        return spec if spec.relative else spec.value
    return check_budget(value, what="budget")


def default_compile(device: str | torch.device) -> bool:
    """Whether step times are compiled when the user does not say: the device's `compile_by_default` (autoprec.devices):
    on CUDA (how GPU training runs, and where fp8 pays only compiled), not elsewhere (inductor's CPU code is not what a
    CPU user is likely to train with)."""
    try:
        return devices.lookup(device).compile_by_default
    except (RuntimeError, TypeError):  # a bad device is reported where it is used, with the choices
        return False


def compile_setting(given: bool | None, device: str | torch.device) -> bool:
    """--compile / compile= as given, else the device's default (default_compile)."""
    return default_compile(device) if given is None else bool(given)


def search_config(
    *,
    device: str | torch.device,
    budget: float | str | Budget | None = None,
    compile: bool | None = None,
    mode: object = Mode.WEIGHTS,
    train_steps: int | None = None,
    noise_runs: int | None = None,
    max_memory: object = None,
    numerics: str | None = None,
    spell: Callable[[str], str] = str,
    **settings: Any,
) -> SearchConfig:
    """THE builder of a SearchConfig, for the command line and the Python API alike: the compile default for the
    device, `max_memory` as --max-memory reads it (a size "40GB", a share 0.8 or "80%", or a number of bytes), and
    train-mode settings refused in weights mode. `settings`: SearchConfig's other fields. Raises ValueError naming
    the setting as `spell` writes it (the CLI: its flag) and shows it as one line."""
    try:
        the_mode = parse_mode(mode)
        compiled = compile_setting(compile, device)
        if settings.get("cuda_graphs"):
            _check_cuda_graphs(device, compiled, spell)
        if "objective" in settings or "target" in settings:  # the flags' own words, before SearchConfig's
            check_target(parse_goal(settings.get("objective", DEFAULT_GOAL)), settings.get("target"), spell)
        if the_mode is Mode.WEIGHTS:
            given = [spell(n) for n, value in (("train_steps", train_steps), ("noise_runs", noise_runs)) if value is not None]
            if given:
                verb = "apply" if len(given) > 1 else "applies"
                raise ValueError(f"{' and '.join(given)} {verb} only to {spell('mode')} train (the mode is {the_mode.value})")
        for name, value in (("train_steps", train_steps), ("noise_runs", noise_runs)):
            if value is not None:  # None: SearchConfig's default
                settings[name] = value
        if numerics is not None:
            settings["profile"] = dataclasses.replace(settings.get("profile", ProfileConfig()), numerics=numerics)
        return SearchConfig(
            budget=_given_budget(budget),
            mode=the_mode,
            compile=compiled,
            max_memory=_memory_limit(max_memory, device),
            **settings,
        )
    except ValueError as exc:
        raise _spelled(exc, spell, settings) from None


def _spelled(exc: ValueError, spell: Callable[[str], str], settings: dict[str, Any]) -> ValueError:
    """A setting's own check names its field (SearchConfig's "trials must be ..."): named as `spell` writes it (the
    CLI: its flag); a message that names the flag itself already is left as it is."""
    text = str(exc)
    field = text.split(" ", 1)[0]
    named = field in settings or field in ("mode", "budget", "compile", "max_memory", "numerics")
    if named and not re.search(rf"(?<![\w-]){re.escape(spell(field))}(?![\w-])", text):
        return type(exc)(spell(field) + text[len(field) :])  # a UserError stays one
    return exc


def _check_cuda_graphs(device: str | torch.device, compiled: bool, spell: Callable[[str], str]) -> None:
    """CUDA graphs asked for where they can be recorded: a compiled search on a device that has them."""
    dev = torch.device(device)
    if not devices.lookup(dev).cuda_graphs:
        with_graphs = [t for t in devices.registered() if devices.device_for(t).cuda_graphs]
        raise ValueError(
            f"{spell('cuda_graphs')} needs a device that records CUDA graphs ({', '.join(with_graphs) or 'none registered'}), "
            f"but the device is {dev}; leave it out on {dev.type}"
        )
    if not compiled:
        raise ValueError(
            f"{spell('cuda_graphs')} needs a compiled search (torch.compile records the graphs); leave {spell('compile')} on"
        )


def _memory_limit(limit: object, device: str | torch.device) -> int | None:
    from autoprec.tune._core import _memory as memory  # noqa: PLC0415 (torch's device queries only where a limit is given)

    if limit is None:
        return None
    dev = torch.device(device)
    if isinstance(limit, str) or (isinstance(limit, float) and 0 < limit <= 1):  # "40GB", "80%", 0.8
        return memory.parse_limit(str(limit), dev)
    if isinstance(limit, numbers.Real) and not isinstance(limit, bool):  # a number of bytes (40e9, a numpy int too)
        size = int(limit) if isinstance(limit, numbers.Integral) else limit
        return memory.parse_limit(f"{size}B", dev)
    raise ValueError(
        f"max_memory must be a size ('40GB'), a share of the device's memory (0.8, '80%') or bytes, but got {limit!r}"
    )
