"""The Optuna study: where it is stored, how workers share it, and the objective every trial runs.

A trial suggests a policy (choices.py), measures its metric against the budget (`Judge`: the given
weights' metric, or K training steps in train mode) and, when within budget, its training-step speedup
over fp32, timed interleaved, and its peak memory per step (memory.py). A single-objective study maximises
the speedup (Goal.MEMORY: minimises the peak) under the budget constraint, and --max-memory's (searcher.py);
a two-objective one also minimises the metric drop, for a Pareto front (sweeper.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import stat
import statistics
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

import optuna
import optuna.storages.journal  # `import optuna` loads it too, but mypy sees a submodule only where it is imported
import pandas as pd
from tqdm.auto import tqdm

from autoprec.errors import UserError, describe, printable
from autoprec.formats import Format, device_name
from autoprec.policy import ROOT, Policy, model_fingerprint
from autoprec.tune import memory
from autoprec.tune.choices import Choices, is_param, policy_from_params, suggest, uniform_params
from autoprec.tune.config import RETRIES, SETTLED, Goal, Mode, SearchConfig
from autoprec.tune.cost import Stopwatch
from autoprec.tune.credentials import hide_credentials, hide_credentials_in
from autoprec.tune.measure import (
    Candidate,
    NoiseFloor,
    Trainer,
    compile_scope,
    evaluate_metric,
    fp32_step_failed,
    interleaved_times,
    noise_floor,
    peak_memory_or_none,
    step_stats,
    train_and_evaluate,
)
from autoprec.tune.profiler import Profile
from autoprec.tune.space import SearchSpace
from autoprec.tune.speed import LayerTimes, Timed, too_slow
from autoprec.tune.task import Workload

log = logging.getLogger("autoprec")

INFEASIBLE = 1e9  # constraint value of a candidate whose loss or metric is not finite


def over_budget(drop: float, budget: float) -> float:
    """The drop's excess over the budget as a share of it (<= 0: within), as the peak's over --max-memory is: the
    sampler ranks infeasible trials by the sum of the two, which needs them in the same (no) unit. A zero budget
    leaves the plain excess. Kept below INFEASIBLE, which ranks a non-finite metric last."""
    return min((drop - budget) / budget if budget > 0 else drop - budget, INFEASIBLE / 2)


def _storage(config: SearchConfig, out_dir: Path) -> tuple[Any, str]:
    url = config.storage
    if url is None or "://" not in url:
        # Optuna's recommended storage for several processes on one machine: a journal file behind a file
        # lock, no server. It has no heartbeat (optuna 5), so a killed worker's trial stays RUNNING.
        path = Path(url) if url else out_dir / "study.journal"
        label = _journal_label(config, path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _drop_torn_tail(path, label)  # first refuses, unchanged, what is not an Optuna journal (_check_journal)
            backend = optuna.storages.journal.JournalFileBackend(str(path))  # creates the file when missing
        except OSError as exc:
            raise UserError(
                f"{label}: cannot make or open it ({exc.strerror or exc}); give a journal file's path in a folder "
                "that can be written, or a database URL such as sqlite:///study.db"
            ) from None
        return optuna.storages.JournalStorage(backend), str(path)
    check_storage(config)
    return _database(url, config.heartbeat_s), hide_credentials(url)  # what is written and printed: no password


def _journal_label(config: SearchConfig, path: Path) -> str:
    return f"--storage {path}" if config.storage else str(path)


def check_storage(config: SearchConfig, out_dir: Path | None = None) -> None:
    """What can be told about --storage before profiling, without changing it: a folder, a device or a FIFO, an
    in-memory database, a file that is not an Optuna journal or holds a line that is not one of its records
    (with `out_dir`, the default out_dir/study.journal is read too)."""
    url = config.storage
    if url is None and out_dir is not None:
        _check_journal(Path(out_dir) / "study.journal", _journal_label(config, Path(out_dir) / "study.journal"))
    if url is None:
        return
    if "://" not in url:
        _check_journal(Path(url), _journal_label(config, Path(url)))
    if url.startswith("sqlite://") and url.removeprefix("sqlite://") in ("", "/", "/:memory:"):
        raise UserError(
            f"--storage {url}: an in-memory database dies with this process and no other worker can reach it; "
            "give a file (sqlite:///study.db) or leave --storage out for <out>/study.journal"
        )


# Optuna's journal (optuna.storages.journal, checked against optuna 5): one JSON object per line, written whole
# by one append of json.dumps(record, separators=(",", ":")) + "\n", whose first keys are an int "op_code" and a
# str "worker_id". A line without its newline is one Optuna has not finished writing and does not read.
RECORD_START = b'{"op_code":'


def _is_record(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError included (a binary file); nesting past Python's depth
        return None
    if not isinstance(record, dict) or type(record.get("op_code")) is not int or not isinstance(record.get("worker_id"), str):
        return None
    return record


def _journal_tail(path: Path, label: str, data: bytes) -> int:
    """How many bytes at the end of `data` (the journal file's content) are a torn record: the start of one
    Optuna did not finish writing, after its last complete line. Refuses (UserError, the file unchanged) a file
    that is not an Optuna journal, or one with a line that is not a record Optuna can read back."""
    if data.startswith(b"SQLite format 3\0"):
        raise UserError(f"{label}: an SQLite database, not a journal file; pass it as sqlite:///{path}")
    end = data.rfind(b"\n") + 1
    tail = data[end:]
    records: list[dict[str, Any]] = []
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        record = _is_record(line)
        if record is None:
            _refuse_line(path, label, number)
        records.append(record)
    # after complete records, any start of one (a write cut a few bytes in); alone in the file (a disk full at the
    # study's first write), no less than its opening key, which no file but Optuna's journal starts with
    torn = tail.startswith(RECORD_START) or bool(records) and RECORD_START.startswith(tail)
    if tail and not torn:
        _refuse_line(path, label, len(records) + 1)
    _replay(records, label)
    return len(tail)


def _refuse_line(path: Path, label: str, number: int) -> NoReturn:
    if number == 1:
        raise UserError(
            f"{label}: not an Optuna journal file (its first line is not a journal record); nothing was changed: "
            "give a journal file's path (a new one is made) or a database URL such as sqlite:///study.db"
        )
    raise UserError(
        f"{label}: line {number} is not an Optuna journal record (a stray write or a hand edit); nothing was changed: "
        f"remove that line if Optuna did not write it (or restore the file), or give another journal file's path"
    )


class _Lines(optuna.storages.journal.BaseJournalBackend):
    """Records already read, served to Optuna's own replay one at a time, so that the one it cannot apply is known."""

    def __init__(self, records: Sequence[dict[str, Any]]) -> None:
        self.records, self.line = records, 0

    def read_logs(self, log_number_from: int):
        for line, record in enumerate(self.records[log_number_from:], start=log_number_from + 1):
            self.line = line
            yield record

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        raise AssertionError("a replay to check a journal writes nothing")


def _replay(records: Sequence[dict[str, Any]], label: str) -> None:
    """Replay the records as Optuna will (a hand-edited field, an op_code it does not know), naming the line."""
    lines = _Lines(records)
    try:
        optuna.storages.JournalStorage(lines)
    except Exception as exc:
        raise UserError(
            f"{label}: line {lines.line} is not an Optuna journal record Optuna can replay ({describe(exc, 120)}; a hand "
            "edit?); nothing was changed: restore the file, or give another journal file's path"
        ) from None


def _check_journal(path: Path, label: str) -> int:
    """Refuse, unchanged, a path that is not an Optuna journal file (see _journal_tail), or not a regular file (a
    folder, /dev/null, a FIFO, whose reads would block). Returns the size of a torn tail (0: none, or no file)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return 0  # made when the study is opened
    except OSError as exc:
        raise UserError(f"{label}: cannot read it ({exc.strerror or exc}); give a journal file's path") from None
    if stat.S_ISDIR(mode):
        raise UserError(f"{label}: a folder; give a journal file's path (or a database URL)")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise UserError(
            f"{label}: not a regular file ({kind}); Optuna's journal is a file it appends to and reads back: give a "
            "journal file's path or a database URL such as sqlite:///study.db"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{label}: cannot read it ({exc.strerror or exc}); give a journal file's path") from None
    return _journal_tail(path, label, data)


def _drop_torn_tail(path: Path, label: str) -> None:
    """A journal whose last line was cut short (a killed process, a full disk) ends without a newline: Optuna
    would append the next record onto it and every later run would fail to parse the file. Under the journal's
    own lock (so no worker is mid-write), cut the torn tail off and say so; every complete record stays. Only
    the start of a record after the last complete one is ever cut (_journal_tail)."""
    if not _check_journal(path, label):
        return
    lock = optuna.storages.journal.JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        with open(path, "rb+") as fh:
            data = fh.read()
            torn = _journal_tail(path, label, data)  # again: a worker may have finished the line meanwhile
            if not torn:
                return
            fh.truncate(len(data) - torn)
        log.warning(
            "%s: its last line was cut short (%d bytes, a write interrupted by a kill or a full disk) and is dropped; "
            "every complete trial before it is kept", path, torn,
        )  # fmt: skip
    finally:
        lock.release()


def _database(url: str, heartbeat_s: int) -> optuna.storages.RDBStorage:
    """A database storage with Optuna's heartbeat: each running trial records a beat every `heartbeat_s`;
    a worker starting a trial fails those silent for twice that and queues them again (RETRIES times)."""
    import sqlalchemy.exc  # optuna's own dependency

    shown = hide_credentials(url)  # no message carries the password
    for attempt in range(3):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in optuna 5, and what we need
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=RETRIES)
                return optuna.storages.RDBStorage(
                    url, heartbeat_interval=heartbeat_s, grace_period=2 * heartbeat_s, heartbeat_stale_trial_callback=retry
                )
        except ImportError:
            hint = "PostgreSQL: pip install psycopg2-binary"
            raise UserError(f"--storage {shown}: its database driver is not installed ({hint})") from None
        except sqlalchemy.exc.ArgumentError as exc:
            raise UserError(
                f"--storage {shown}: not a storage URL Optuna can open ({hide_credentials_in(str(exc), url)}); use a journal file path, "
                "sqlite:///PATH or postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE"
            ) from None
        except Exception as exc:
            # Workers creating a new database's tables at the same moment collide once; the next try finds them.
            if attempt == 2:
                raise UserError(f"--storage {shown}: cannot open it: {hide_credentials_in(describe(exc, None), url)}") from None
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


def sampler_for(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    if space.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True)  # reads trial.constraints


# The study key's "version": the format of what a study holds (its key, the choices on its first trial, the parameters
# and user attributes of its trials). Raise it when any of them changes; a study of another version is refused.
STUDY_VERSION = 1


def _study_key(workload: Workload, space: SearchSpace, config: SearchConfig, objectives: int) -> dict[str, str]:
    # What shapes the choices, the measurements and which trials are feasible; not the file's path, sampler or
    # trial count.
    shape = (space.layers, space.default, space.loss_scale, space.prune_slower_than) + ((space.exclude,) if space.exclude else ())
    space_hash = hashlib.sha256(repr(shape).encode()).hexdigest()[:12]
    return {
        "version": str(STUDY_VERSION),
        "budget": repr(float(config.budget)),
        "device": device_name(str(workload.device)),
        "model": model_fingerprint(workload.model),
        "space": space_hash,
        "mode": config.mode.value if config.mode is Mode.WEIGHTS else f"{config.mode.value}, {config.train_steps} steps",
        "layout": f"{space.layout.value}, max_params {space.max_params}",
        "objectives": objective_names(objectives, config.objective),
        "compile": "compiled" if config.compile else "eager",
        "max_memory": str(config.max_memory) if config.max_memory else "none",
    }


OBJECTIVES = {1: "speedup", 2: "speedup, metric drop"}


def objective_names(objectives: int, goal: Goal) -> str:
    """The study's objectives in words: `speedup`, `peak memory, metric drop`."""
    return OBJECTIVES[objectives].replace("speedup", "peak memory") if goal is Goal.MEMORY else OBJECTIVES[objectives]


def directions(objectives: int, goal: Goal) -> list[Literal["minimize", "maximize"]]:
    first: Literal["minimize", "maximize"] = "minimize" if goal is Goal.MEMORY else "maximize"
    return [first, "minimize"][:objectives]


class Judge:
    """The metric a candidate is held to and the fp32 result it is compared with: the given weights'
    (weights mode), or after K training steps from them (train mode, with the noise floor measured). In train
    mode the noise floor is measured when first needed (`measure()`, or reading `noise` or `fp32_metric`), so a
    finished study whose result stands costs none: `known()` takes the one its policy file recorded."""

    def __init__(self, workload: Workload, config: SearchConfig, weights_fp32_metric: float, *, watch: Stopwatch | None = None):
        self.workload, self.config, self._watch = workload, config, watch
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
        if config.budget < noise.spread:
            log.warning(
                "budget %g is below the noise floor %.4g (the fp32 metric's spread over %d seeds after %d training "
                "steps): the search cannot tell a real loss from noise there",
                config.budget, noise.spread, config.noise_runs, config.train_steps,
            )  # fmt: skip

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
    """What a trial measures. One objective: the speedup (0 when over budget or broken; predicted, not timed, for
    a trial the profile's layer times put out of the running: _predicted_too_slow). Two: the speedup
    and the metric drop (INFEASIBLE when not finite), both under the constraint drop <= budget. With
    Goal.MEMORY, the peak memory in MiB (INFEASIBLE when not measured) takes the speedup's place; with a
    memory limit, peak <= limit is a second constraint."""

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
        # what predicts a trial's speedup (speed.py): only a speed search without a memory limit may skip timing
        predicts = config.predict_speed and objectives == 1 and config.objective is Goal.SPEED and config.max_memory is None
        self.layer_times = layer_times if predicts else None
        # timed beside every eager candidate; a compiled search builds a compiled one per trial instead
        self.baseline = None if config.compile else Trainer(workload, Policy(layers={ROOT: Format.FP32}))
        self._baseline_warm = False  # after its first timing, the baseline needs one warm-up call, not config.warmup
        self._fp32_peak: int | None = None
        self._fp32_peak_known = False  # measured once: the same fp32 model needs the same memory every time

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        policy = suggest(trial, self.choices, self.space)
        earlier = _same_policy(trial, policy, self.choices)
        if earlier is not None and "untimed" not in earlier.user_attrs:  # samplers propose a policy again: its
            self._reuse(trial, earlier)  # measurements stand, and cost nothing
            return self._values(trial)
        start = time.perf_counter()
        if earlier is not None:  # left untimed before: its metric stands; whether to time it is decided anew
            metric = earlier.user_attrs["metric"]
            extra = {k: earlier.user_attrs[k] for k in ("train_skipped",) if k in earlier.user_attrs}
            trial.set_user_attr("reevaluated_from", earlier.number)
        elif self.config.mode is Mode.WEIGHTS and _all_fp32(policy):
            metric, extra = self.judge.fp32_metric, {}  # the profile measured exactly this model
        else:
            metric, extra = self.judge.safe_metric(policy)
        if earlier is None:
            trial.set_user_attr("evaluate_s", time.perf_counter() - start)
        for key, value in extra.items():
            trial.set_user_attr(key, value)
        drop = self.judge.fp32_metric - metric
        feasible = math.isfinite(metric) and drop <= self.config.budget
        trial.set_user_attr("metric", metric if math.isfinite(metric) else None)
        trial.set_user_attr("metric_drop", drop if math.isfinite(drop) else None)
        constraint = over_budget(drop, self.config.budget) if math.isfinite(drop) else INFEASIBLE
        if feasible and _all_fp32(policy):  # the fp32 baseline itself: 1.0 by definition, nothing to time
            trial.set_user_attr("speedup", 1.0)
            self._record_memory(trial, self.fp32_peak(None))
        elif feasible and self._predicted_too_slow(trial, policy):
            pass  # its predicted speedup is its value (a finalist only where k faster ones are alternatives)
        elif feasible:  # only candidates within budget are worth the time it takes to time them
            start = time.perf_counter()
            feasible, constraint = self._time(trial, policy, constraint)
            trial.set_user_attr("measure_s", time.perf_counter() - start)
        over = self._over_memory(trial) if feasible else 0.0  # a trial not timed has no peak: its drop rules it out
        feasible = feasible and over <= 0
        trial.set_user_attr("feasible", feasible)
        if self.config.max_memory is None and over > 0:  # the memory objective without a peak: infeasible through
            constraint = max(constraint, INFEASIBLE)  # the one constraint every trial has
        trial.set_constraint("metric_drop_over_budget", constraint)
        if self.config.max_memory is not None:
            trial.set_constraint("peak_memory_over_limit", over)
        return self._values(trial)

    def fp32_peak(self, baseline: Trainer | None) -> int | None:
        """The all-fp32 model's peak memory per step (measured once): from `baseline` after its timing, or from
        a Trainer built for it (compiled as the search's candidates are)."""
        if not self._fp32_peak_known:
            trainer = baseline or self.baseline
            with compile_scope(self.config.compile, 1) if trainer is None else contextlib.nullcontext():
                trainer = trainer or Trainer(self.workload, Policy(layers={ROOT: Format.FP32}), compiled=self.config.compile)
                self._fp32_peak = peak_memory_or_none(trainer, "the fp32 baseline")
            self._fp32_peak_known = True
        return self._fp32_peak

    def _record_memory(self, trial: optuna.Trial, peak: int | None) -> None:
        trial.set_user_attr("peak_bytes", peak)
        trial.set_user_attr("memory_saving", memory.saving(peak, self.fp32_peak(None)))

    def _over_memory(self, trial: optuna.Trial) -> float:
        """How far the trial's peak is over --max-memory, as a share of it (<= 0: it fits); INFEASIBLE where the peak
        was not measured but is needed (a limit, or the memory objective)."""
        limit = self.config.max_memory
        peak = trial.user_attrs.get("peak_bytes")
        if peak is None and (limit is not None or self.config.objective is Goal.MEMORY):
            needs = "--max-memory" if limit is not None else "--objective memory"
            trial.set_user_attr("error", f"peak memory not measured, which {needs} needs")
            return INFEASIBLE
        if limit is None or peak is None:
            return 0.0
        if peak > limit:
            trial.set_user_attr("error", f"peak memory {memory.human_bytes(peak)} over --max-memory {memory.human_bytes(limit)}")
        return (peak - limit) / limit

    def _predicted_too_slow(self, trial: optuna.Trial, policy: Policy) -> bool:
        """Whether the profile's layer times, fitted on the trials timed so far (speed.fit), predict this candidate
        slower than the k-th fastest timed trial even with the fit's error in its favour: then it is not timed,
        and its predicted speedup (`predicted_speedup`, also its `speedup`) is what the sampler learns from."""
        if self.layer_times is None:
            return False
        mark = _finalist_mark(trial.study, self.config.finalists)
        found = too_slow(_timed(trial.study, self.choices, self.layer_times), self.layer_times.features(policy), mark)
        if found is None:
            return False
        predicted, speed_fit = found
        trial.set_user_attr("predicted_speedup", predicted)
        trial.set_user_attr("speedup", predicted)
        trial.set_user_attr("untimed", f"predicted {predicted:.3f}x (fit error {speed_fit.error:.1%}), below the "
                                       f"k-th fastest timed trial's {mark:.3f}x")  # fmt: skip
        return True

    def _settled(self, trial: optuna.Trial) -> Callable[[Mapping[str, Sequence[float]]], bool]:
        """When a trial's timing may stop early (a sequential test over the rounds so far). In a search with at
        least `finalists` timed trials (_finalist_mark): every round measured the candidate slower than the k-th
        fastest of them (its number does not matter), or faster than the fastest (a finalist for sure, re-measured
        with the others). In a search or a sweep (whose front also keeps slower trials with smaller drops): the
        per-round speedups agree within SETTLED. A candidate whose rounds straddle those marks, or disagree, is timed on."""
        ranked_by_speed = self.objectives == 1 and self.config.objective is Goal.SPEED
        kth = _finalist_mark(trial.study, self.config.finalists) if ranked_by_speed else None
        marks = (kth, max(_timed_speedups(trial.study))) if kth is not None else None

        def enough(samples: Mapping[str, Sequence[float]]) -> bool:
            ratios = [f / p for f, p in zip(samples["fp32"], samples["policy"]) if p > 0]
            if not ratios:
                return False
            if marks is not None and (max(ratios) < marks[0] or min(ratios) > marks[1]):
                return True
            return (max(ratios) - min(ratios)) / statistics.median(ratios) <= SETTLED

        return enough

    def _values(self, trial: optuna.Trial) -> float | tuple[float, float]:
        # Infeasible trials are not timed; the constraint, not this value, keeps them from winning.
        feasible = trial.user_attrs.get("feasible")
        if self.config.objective is Goal.MEMORY:
            peak = trial.user_attrs.get("peak_bytes")
            first = peak / memory.MIB if feasible and peak is not None else INFEASIBLE
        else:
            first = trial.user_attrs["speedup"] if feasible else 0.0
        if self.objectives == 1:
            return first
        drop = trial.user_attrs.get("metric_drop")
        return first, (drop if drop is not None else INFEASIBLE)

    def _reuse(self, trial: optuna.Trial, earlier: optuna.trial.FrozenTrial) -> None:
        for key in TRIAL_ATTRS:
            if key in earlier.user_attrs:
                trial.set_user_attr(key, earlier.user_attrs[key])
        trial.set_user_attr("reused_from", earlier.number)
        for key, value in earlier.system_attrs.items():
            if key.startswith("constraints:"):
                trial.set_constraint(key.split(":", 1)[1], value)

    def _time(self, trial: optuna.Trial, policy: Policy, constraint: float) -> tuple[bool, float]:
        try:
            with compile_scope(self.config.compile, 2):
                # compile_scope empties the compile caches, so a compiled fp32 baseline is built (mostly from
                # inductor's on-disk cache) in every trial, and its compilation counted with the candidate's
                fp32 = Policy(layers={ROOT: Format.FP32})
                baseline = Trainer(self.workload, fp32, compiled=True) if self.baseline is None else self.baseline
                try:
                    baseline.step()  # the fp32 baseline failing is no fault of the candidate's
                except Exception as exc:
                    raise fp32_step_failed(
                        self.workload, "all-fp32 training step", describe(exc), compiled=self.config.compile
                    ) from exc
                candidate = Trainer(self.workload, policy, compiled=self.config.compile)
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
            trial.set_user_attr("error", f"training step failed: {describe(exc)}")
            return False, INFEASIBLE
        self._record_memory(trial, peak)
        trial.set_user_attr("rounds", len(t["policy"].samples_ms))
        if candidate.compiled and candidate.first_step_s is not None and baseline.first_step_s is not None:
            # both have a first step by now (the baseline's above, the candidate's in the timing): always true
            trial.set_user_attr("compile_s", candidate.first_step_s + baseline.first_step_s)
        trial.set_user_attr("step_ms", t["policy"].median_ms)
        trial.set_user_attr("fp32_step_ms", t["fp32"].median_ms)
        trial.set_user_attr("spread", max(t["policy"].spread, t["fp32"].spread))
        trial.set_user_attr("skipped", stats.skipped)
        trial.set_user_attr("steps", stats.steps)
        if not stats.finite or not math.isfinite(stats.effective_ms):
            trial.set_user_attr("error", "non-finite training loss" if not stats.finite else "the GradScaler skipped every step")
            return False, INFEASIBLE
        trial.set_user_attr("effective_step_ms", stats.effective_ms)
        trial.set_user_attr("speedup", t["fp32"].median_ms / stats.effective_ms)
        return True, constraint


TRIAL_ATTRS = ("metric", "metric_drop", "feasible", "step_ms", "skipped", "steps", "effective_step_ms",
               "fp32_step_ms", "speedup", "spread", "peak_bytes", "memory_saving", "train_skipped", "error",
               "predicted_speedup", "untimed")  # fmt: skip
COST_ATTRS = ("evaluate_s", "measure_s", "compile_s", "rounds", "reused_from", "reevaluated_from")


def _all_fp32(policy: Policy) -> bool:
    return all(fmt is Format.FP32 for fmt in policy.layers.values())


def _same_policy(trial: optuna.Trial, policy: Policy, choices: Choices) -> optuna.trial.FrozenTrial | None:
    """A completed trial of the study (any worker's) whose params describe this same policy, or None. Grouped
    and ranked params can name one policy in several ways (a count past every layer a format suits)."""
    done = trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    same = [t for t in done if "feasible" in t.user_attrs and policy_from_params(t.params, choices) == policy]
    return next((t for t in same if "untimed" not in t.user_attrs), same[0] if same else None)  # a timed one first


def trials_table(study: optuna.Study, choices: Choices, prof: Profile | None = None) -> pd.DataFrame:
    """One row per trial: its formats, loss scale, what it measured, and (with the profile) the drop the
    sum of single-layer drops predicted for it."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state != optuna.trial.TrialState.COMPLETE:
            rows.append({"trial": t.number, "state": t.state.name})
            continue
        policy = policy_from_params(t.params, choices)
        row = {"trial": t.number, "state": t.state.name}
        row.update({("(default)" if n == ROOT else n): f.value for n, f in policy.layers.items()})
        if prof is not None:
            row["predicted_drop"] = prof.predicted_drop(policy.layers)
        for key in (*TRIAL_ATTRS, *COST_ATTRS):
            row[key] = t.user_attrs.get(key)
        if policy.uses_fp16:
            ls = policy.loss_scale
            row.update(init_scale=ls.init_scale, growth_interval=ls.growth_interval, growth_factor=ls.growth_factor,
                       backoff_factor=ls.backoff_factor, dynamic=ls.dynamic)  # fmt: skip
        row["duration_s"] = t.duration.total_seconds() if t.duration else None
        rows.append(row)
    return pd.DataFrame(rows)


KEY_ATTR, CHOICES_ATTR, WORKER_ATTR = "autoprec:key", "autoprec:choices", "autoprec:worker"


def _check_key(stored: Mapping[str, Any], key: Mapping[str, str], name: str, where: str) -> None:
    if stored.get("version") != key["version"]:  # its trials may mean something else here: never resumed
        was = printable(str(stored["version"]))[:20] if "version" in stored else "none"
        start_over = f"delete the study from {where}" if "://" in where else f"delete {where}"  # a database, or a journal
        raise UserError(
            f"study {name!r} in {where} was made by another autoprec version (study format version {was}; this version "
            f"makes {key['version']}): pass --study NEW_NAME to start another, or {start_over} to start over"
        )
    diff = [k for k, v in key.items() if stored.get(k) != v]
    if diff:
        was = ", ".join(f"{k} {stored.get(k)}, now {key[k]}" for k in diff)
        raise UserError(
            f"study {name!r} in {where} was made with a different {' and '.join(diff)} ({was}); "
            "pass --study NEW_NAME to start another"
        )


def _first_start(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The lowest-numbered trial that carries a worker's choices: the first one any worker wrote. Trial numbers
    follow the storage's own order of creation (the journal's log; the database locks the study row), and a
    worker reads after it writes, so every worker finds the same one."""
    carrying = (t for t in study.get_trials(deepcopy=False) if CHOICES_ATTR in t.user_attrs)
    return min(carrying, key=lambda t: t.number, default=None)


def open_study(
    workload: Workload,
    space: SearchSpace,
    choices: Choices,
    config: SearchConfig,
    out_dir: Path,
    warm_starts: Callable[[Choices], list[dict[str, Any]]] = lambda choices: [],
    *,
    objectives: int = 1,
):
    """Create or join the study (maximise the speedup, or minimise the peak memory with Goal.MEMORY; with
    `objectives=2`, also minimise the metric drop). Every worker proposes its choices on the all-fp32 warm-start trial; the first
    proposal in the storage wins, and only its worker queues the other warm starts (`warm_starts(choices)`).
    Two workers starting at the same moment may both queue the fp32 trial: it is then measured twice."""
    storage, where = _storage(config, out_dir)
    name = config.study_name or workload.task.name
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        directions=directions(objectives, config.objective),
        sampler=sampler_for(space, config.seed),
        load_if_exists=True,
    )
    key = _study_key(workload, space, config, objectives)
    first = _first_start(study)
    worker = uuid.uuid4().hex
    # Every study this version makes has its key on its first trial: one holding anything but none that carries it
    # is another version's. Read again first: another worker may have written its first trial since.
    if first is None and (study.user_attrs or study.get_trials(deepcopy=False)) and _first_start(study) is None:
        _check_key({}, key, name, where)
    if first is None:
        attrs = {KEY_ATTR: key, CHOICES_ATTR: choices.to_json(), WORKER_ATTR: worker}
        study.enqueue_trial(_warm_params(uniform_params(choices, "fp32"), choices), user_attrs=attrs)
        first = _first_start(study)
        assert first is not None, "a trial this worker queued is missing from the storage"
        if first.user_attrs[WORKER_ATTR] == worker:
            for params in warm_starts(choices):
                study.enqueue_trial(_warm_params(params, choices), skip_if_exists=True)
    _check_key(first.user_attrs[KEY_ATTR], key, name, where)
    if first.user_attrs[WORKER_ATTR] != worker:
        # Workers with one seed would suggest the same policies side by side: `seed` stays with the worker that
        # started the study, and one that joins (or resumes it) mixes in its own id.
        seed = (config.seed + int(worker[:8], 16)) % 2**32
        log.info("joining study %r as another worker; sampler seed %d", name, seed)
        study.sampler = sampler_for(space, seed)
    return study, Choices.from_json(first.user_attrs[CHOICES_ATTR]), where


def _warm_params(params: Mapping[str, Any], choices: Choices) -> dict[str, Any]:
    return {k: v for k, v in params.items() if is_param(k, choices)}


def trial_costs(study: optuna.Study, watch: Stopwatch) -> None:
    """The study's completed trials (every worker's, every run's), split into evaluating the metric, measuring
    step times, and the rest of each trial's wall time: sampling, the storage, building the candidate."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    fresh = [t for t in done if "reused_from" not in t.user_attrs]  # a reused trial measured nothing
    evaluate = sum(t.user_attrs.get("evaluate_s", 0.0) for t in fresh)
    measure = sum(t.user_attrs.get("measure_s", 0.0) for t in fresh)
    compiling = sum(t.user_attrs.get("compile_s") or 0.0 for t in fresh)
    wall = sum(t.duration.total_seconds() for t in done if t.duration)
    watch.add("trials: evaluating the metric", evaluate, sum("evaluate_s" in t.user_attrs for t in fresh))
    if compiling:
        watch.add("trials: compiling the candidate and the fp32 baseline (first steps)", compiling,
                  sum("compile_s" in t.user_attrs for t in fresh))  # fmt: skip
    watch.add("trials: measuring step times", measure - compiling, sum("measure_s" in t.user_attrs for t in fresh))
    rounds = sum(t.user_attrs.get("rounds") or 0 for t in fresh)
    if rounds:
        watch.count("trials: timing rounds (a trial stops early once its ranking is clear)", rounds)
    watch.add("trials: sampling, storage, the rest", max(0.0, wall - evaluate - measure), len(done))
    watch.count("trials: a repeated policy, its measurements reused", len(done) - len(fresh))
    # policies, not trials: one proposed again is judged again (reevaluated_from), and counts once, as timed if ever
    timed = {_params_key(t) for t in fresh if t.user_attrs.get("rounds")}
    untimed = {_params_key(t) for t in fresh if "untimed" in t.user_attrs} - timed
    if untimed:
        watch.count("trials: policies not timed (the profile's layer times predict them too slow to be finalists)", len(untimed))
    again = sum("reevaluated_from" in t.user_attrs for t in fresh)
    if again:
        watch.count("trials: a policy left untimed, proposed again and judged again", again)


def _params_key(trial: optuna.trial.FrozenTrial) -> str:
    return json.dumps(trial.params, sort_keys=True, default=str)


def _timed_speedups(study: optuna.Study) -> list[float]:
    """The speedups of the study's trials timed within budget, warm starts included (not the all-fp32 baseline,
    which is not timed, nor repeats)."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [t.user_attrs["speedup"] for t in done
            if t.user_attrs.get("feasible") and t.user_attrs.get("rounds") and "reused_from" not in t.user_attrs]  # fmt: skip


def _finalist_mark(study: optuna.Study, k: int) -> float | None:
    """The k-th fastest timed trial's speedup (_timed_speedups); None before k are timed. A candidate surely slower
    needs no precise number: each of those k is re-measured at the end (an alternative always is; a searched policy
    faster than the candidate ranks above it for the k finalists' places), or the candidate takes a place itself
    and is re-measured with them."""
    speeds = sorted(_timed_speedups(study), reverse=True)
    return speeds[k - 1] if len(speeds) >= k and speeds[k - 1] > 0 else None


def _timed(study: optuna.Study, choices: Choices, layer_times: LayerTimes) -> list[Timed]:
    """The study's trials timed beside fp32 (not repeats), as speed.fit takes them."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    out = []
    for t in done:
        step, fp32 = t.user_attrs.get("step_ms"), t.user_attrs.get("fp32_step_ms")
        if not t.user_attrs.get("rounds") or "reused_from" in t.user_attrs or step is None or fp32 is None:
            continue
        features = layer_times.features(policy_from_params(t.params, choices))
        if features is not None:
            out.append(Timed(features, fp32, step))
    return out


def _best_speedup(study: optuna.Study) -> float:
    """The highest speedup among the study's completed trials within budget (0 before there is one)."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return max((t.user_attrs.get("speedup", 0.0) for t in done if t.user_attrs.get("feasible")), default=0.0)


def _smallest_peak(study: optuna.Study) -> int | None:
    """The smallest peak memory among the study's completed trials within budget (None before there is one)."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return min((t.user_attrs["peak_bytes"] for t in done if t.user_attrs.get("feasible") and t.user_attrs.get("peak_bytes")),
               default=None)  # fmt: skip


def run_trials(study: optuna.Study, objective: Objective, target: int, *, progress: bool = True) -> int:
    """Run trials until the study holds `target` completed ones (every worker's and earlier run's count; one
    cut short by Ctrl-C or a crash is run again on resume), with a progress bar showing the best speedup.
    Returns how many trials this call set out to run (0: the study was finished already)."""
    complete = (optuna.trial.TrialState.COMPLETE,)
    remaining = max(0, target - len(study.get_trials(deepcopy=False, states=complete)))
    with tqdm(total=remaining, desc="search trials", unit="trial", disable=not progress) as bar:

        def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            if objective.config.objective is Goal.MEMORY:
                bar.set_postfix(smallest_peak=memory.human_bytes(_smallest_peak(study)))
            else:
                bar.set_postfix(best_speedup=f"{_best_speedup(study):.3f}")
            bar.update(1)

        if remaining:
            # Other workers complete trials too: stop once the study holds the target. A trial another worker
            # is still running then also completes, so N workers may overshoot by up to N - 1 trials.
            stop = optuna.study.MaxTrialsCallback(target, states=complete)
            study.optimize(objective, n_trials=remaining, callbacks=[stop, callback])
    return remaining
