"""Typed records that flow between the tuner's stages, in place of dicts and DataFrames:

- `Measurement`: one candidate re-measured beside the others (a row of finalists.csv);
- `Finals`: all of them, in the order they were measured, looked up by name;
- `Result`: what a policy file keeps of one measurement (`measured.results[label]`);
- `Measured`: a policy file's `measured` block, written by the pipeline and read by the reports;
- `Chosen`: one budget's result, the policy file written for it;
- `TrialRecord`: what one search trial measured, as its Optuna user attributes hold it (trials.csv's columns);
- `Candidate`: what one timed training step runs: a policy and the step's own settings (TF32, CUDA graphs).

The runtime's `Policy.measured` stays a plain mapping (it is provenance, and a training script needs none of
this); `Measured.of(policy)` is its typed view, lenient: a policy edited or written by hand reads as far as it is
well formed.
pandas appears only where a table meets a CSV file (`Finals.to_frame`, `Finals.read_csv`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import NoneType
from typing import TYPE_CHECKING, Any, Protocol, get_args, get_type_hints, overload

import numpy as np

from autoprec.files import check_version, write_atomically

if TYPE_CHECKING:
    import pandas as pd

    from autoprec.policy import Policy


class _Attributed(Protocol):
    """An optuna.Trial or FrozenTrial, as far as TrialRecord reads and writes them."""

    @property
    def user_attrs(self) -> Mapping[str, Any]: ...


# finalists.csv's last column, `version`, on every row: the format of its columns. Raise it when a column is added,
# removed or means something else; Finals.read_csv reads no other (the pipeline then re-measures the finalists).
FINALS_VERSION = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurement:
    """One re-measured candidate. `runs`: the metric and every loss were finite and some step updated the
    weights; `feasible`: that, and the drop within the budget it was measured for; `speedup`: fp32's
    effective step time over this one's; `spread`: the step time's interquartile range over its median;
    `skipped` of `steps`: steps the GradScaler skipped while timed; `train_skipped`: while trained (train mode);
    `rounds`: the interleaved timing rounds its median is of (0: not timed); `peak_bytes`: one training step's peak
    memory (_memory.py; None: not measured), `memory_saving` the share of fp32's it saves; `fits`: within
    --max-memory (always, without one); `feasible` needs it too. `host_ms`: on a device with a queue of its own,
    the host's time issuing a step (`step_ms` is then the device's; None elsewhere), `busy_ms` the device's busy
    time a step, and `host_bound` whether the device waited on the host for more than a little of the step
    (timing.Timing.host_bound: no format changes that step's time)."""

    candidate: str
    metric: float
    metric_drop: float
    runs: bool
    feasible: bool
    step_ms: float
    skipped: int
    steps: int
    effective_step_ms: float
    spread: float
    compile_s: float | None = None
    train_skipped: int | None = None
    error: str | None = None
    speedup: float = math.nan
    rounds: int = 0
    peak_bytes: int | None = None
    memory_saving: float | None = None
    fits: bool = True
    host_ms: float | None = None
    host_bound: bool = False
    busy_ms: float | None = None

    @property
    def over_memory(self) -> bool:
        """It ran and its measured peak is over --max-memory."""
        return self.runs and not self.fits and self.peak_bytes is not None

    @property
    def unshown_to_fit(self) -> bool:
        """It ran, but without a measured peak it cannot be shown to fit --max-memory."""
        return self.runs and not self.fits and self.peak_bytes is None

    def within(self, budget: float) -> Measurement:
        """The same measurement judged against another budget (and, as measured, the memory limit)."""
        return dataclasses.replace(self, feasible=self.runs and self.fits and self.metric_drop <= budget)


class Finals(Sequence[Measurement]):
    """The re-measured candidates, in measuring order; `finals[i]` by position, `finals.get(name)` by name."""

    def __init__(self, rows: Iterable[Measurement] = ()) -> None:
        self._rows = tuple(rows)
        self._by_name = {r.candidate: r for r in self._rows}
        if len(self._by_name) != len(self._rows):
            raise ValueError(f"each candidate is measured once, but got {[r.candidate for r in self._rows]}")

    @overload
    def __getitem__(self, index: int) -> Measurement: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Measurement]: ...
    def __getitem__(self, index: int | slice) -> Measurement | Sequence[Measurement]:
        return self._rows[index]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Measurement]:
        return iter(self._rows)

    def __repr__(self) -> str:
        return f"Finals({list(self._rows)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Finals) and self._rows == other._rows

    __hash__ = None  # type: ignore[assignment]

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str | None) -> Measurement | None:
        return self._by_name.get(name) if name is not None else None

    def by_name(self, name: str) -> Measurement:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no candidate {name!r} was re-measured; the candidates are {self.names}") from None

    def within(self, budget: float) -> Finals:
        """Every measurement judged against `budget` (a sweep judges one re-measure against each of its budgets)."""
        return Finals(r.within(budget) for r in self._rows)

    def with_each(self, **changes: Any) -> Finals:
        """Every row with `changes` (tests and what-if reports)."""
        return Finals(dataclasses.replace(r, **changes) for r in self._rows)

    def noisiest(self, *, device_only: bool = False) -> float:
        """The widest step-time spread among the candidates that ran (0 when none did), leaving out a candidate timed
        fewer rounds than the most (put out of the running early: its few rounds' spread is their range, and it ranks
        nothing); `device_only`: among those not host-bound (a host-bound step's spread is the host's jitter, not a
        noisy device's)."""
        most = max((r.rounds for r in self._rows if r.runs), default=0)
        spreads = [
            r.spread
            for r in self._rows
            if r.runs and r.rounds == most and math.isfinite(r.spread) and not (device_only and r.host_bound)
        ]
        return max(spreads, default=0.0)

    def to_frame(self) -> pd.DataFrame:
        """A DataFrame with one row per candidate and the fields as columns (finalists.csv)."""
        import pandas as pd

        columns = [f.name for f in dataclasses.fields(Measurement)]
        return pd.DataFrame([dataclasses.asdict(r) for r in self._rows], columns=columns)

    def to_csv(self, path: str | Path) -> None:
        """finalists.csv: to_frame's table and a `version` column (FINALS_VERSION), no index column."""
        frame = self.to_frame().assign(version=FINALS_VERSION)
        write_atomically(path, lambda tmp: frame.to_csv(tmp, index=False))

    @classmethod
    def read_csv(cls, path: str | Path) -> Finals:
        """Read what `to_csv` wrote (finalists.csv): files.OtherVersion for a file of another FINALS_VERSION (or
        none), ValueError for a missing column or a malformed value."""
        import pandas as pd

        frame = pd.read_csv(path, dtype={"candidate": str, "error": str})
        for found in dict.fromkeys(frame["version"].tolist()) if "version" in frame else (None,):
            check_version(path, found, FINALS_VERSION)
        rows = []
        for i, record in enumerate(frame.to_dict("records")):
            try:
                rows.append(
                    Measurement(
                        candidate=str(record["candidate"]),
                        metric=float(record["metric"]),
                        metric_drop=float(record["metric_drop"]),
                        runs=_flag(record["runs"]),
                        feasible=_flag(record["feasible"]),
                        step_ms=float(record["step_ms"]),
                        skipped=int(record["skipped"]),
                        steps=int(record["steps"]),
                        effective_step_ms=float(record["effective_step_ms"]),
                        spread=float(record["spread"]),
                        compile_s=_optional(record["compile_s"], float),
                        train_skipped=_optional(record["train_skipped"], int),
                        error=_optional(record["error"], str),
                        speedup=float(record["speedup"]),
                        rounds=int(record["rounds"]),
                        peak_bytes=_optional(record["peak_bytes"], int),
                        memory_saving=_optional(record["memory_saving"], float),
                        fits=_flag(record["fits"]),
                        host_ms=_optional(record["host_ms"], float),
                        host_bound=_flag(record["host_bound"]),
                        busy_ms=_optional(record["busy_ms"], float),
                    )
                )
            except KeyError as exc:
                raise ValueError(f"{path}: no column {exc.args[0]!r}") from None
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}: row {i + 2} ({record.get('candidate')!r}) is malformed: {exc}") from None
        return cls(rows)


def _flag(value: Any) -> bool:
    """A True/False CSV cell; anything else (an empty cell, text) is malformed."""
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"expected True or False, got {value!r}")


def _optional(value: Any, kind: type) -> Any:
    """None for a missing or empty CSV cell (NaN), else the value as `kind`."""
    if value is None or isinstance(value, float) and math.isnan(value):
        return None
    return kind(value)


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(float(value)) else None  # JSON has no inf/NaN: null


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """A measurement as a policy file keeps it; None where the number was not finite (a candidate that broke)."""

    metric: float | None = None
    metric_drop: float | None = None
    step_ms: float | None = None
    effective_step_ms: float | None = None
    spread: float | None = None
    speedup: float | None = None
    skipped_steps: int | None = None
    steps: int | None = None
    train_skipped_steps: int | None = None
    error: str | None = None
    peak_bytes: int | None = None
    memory_saving: float | None = None
    # the goal's estimate for this candidate, not measured (the FLOP goal's: _flops.py); None where the goal measures
    estimate: float | None = None

    @classmethod
    def of(cls, m: Measurement) -> Result:
        return cls(
            metric=_finite(m.metric),
            metric_drop=_finite(m.metric_drop),
            step_ms=_finite(m.step_ms),
            effective_step_ms=_finite(m.effective_step_ms),
            spread=_finite(m.spread),
            speedup=_finite(m.speedup),
            skipped_steps=m.skipped,
            steps=m.steps,
            train_skipped_steps=m.train_skipped,
            error=m.error,
            peak_bytes=m.peak_bytes,
            memory_saving=m.memory_saving,
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {
            k: v
            for k, v in out.items()
            if v is not None or k not in ("error", "train_skipped_steps", "peak_bytes", "memory_saving", "estimate")
        }

    @classmethod
    def from_dict(cls, data: Any) -> Result:
        data = _mapping(data)
        return cls(
            metric=_number(data.get("metric")),
            metric_drop=_number(data.get("metric_drop")),
            step_ms=_number(data.get("step_ms")),
            effective_step_ms=_number(data.get("effective_step_ms")),
            spread=_number(data.get("spread")),
            speedup=_number(data.get("speedup")),
            skipped_steps=_count(data.get("skipped_steps")),
            steps=_count(data.get("steps")),
            train_skipped_steps=_count(data.get("train_skipped_steps")),
            error=_text(data.get("error")),
            peak_bytes=_count(data.get("peak_bytes")),
            memory_saving=_number(data.get("memory_saving")),
            estimate=_number(data.get("estimate")),
        )


@dataclasses.dataclass(frozen=True)
class Chosen:
    """One budget's result: the candidate chosen (its name among the re-measured), why, the policy written
    (with `measured`), the file it went to, and the name of that budget's profile-greedy candidate."""

    budget: float
    name: str
    why: str
    policy: Policy
    file: Path
    greedy: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyRef:
    """Which Optuna study a result came from, and how many of its trials there were when it was chosen."""

    name: str | None = None
    storage: str | None = None
    trials: int | None = None
    complete: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """A policy file's `measured` block: where, on what and how the policy was chosen, and the re-measured
    results of the policy (`results["policy"]`) and of what it was compared with. Every field has a default
    so that a block edited or written by hand reads as far as it is well formed (the block is provenance, which
    the runtime never needs); fields this version does not know are kept in `extra` and written back."""

    device: str | None = None
    versions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    model: str | None = None
    fingerprint: str | None = None
    budget: float | None = None
    budget_given: str | None = None  # how the user gave it, where relative ("1% of |fp32 metric| ...")
    mode: str = "weights"
    train_steps: int | None = None
    noise_floor: float | None = None
    noise: Mapping[str, Any] | None = None
    fp32_metric: float | None = None
    metric: str | None = None
    chosen: str | None = None
    why: str | None = None
    greedy: str | None = None  # the name of this budget's profile-greedy candidate
    # the candidates within budget whose step times could not be told from the chosen one's (choose.not_separated):
    # a tie inside the noise, chosen as the alternative or the safer one, not measured faster than them
    not_separated: tuple[str, ...] = ()
    # why the trials ended before --trials (the stopping rule, the time budget: objective.Objective.should_stop)
    stopped: str | None = None
    results: Mapping[str, Result] = dataclasses.field(default_factory=dict)
    kept_fp32: Mapping[str, str] = dataclasses.field(default_factory=dict)
    excluded: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    fp8: str | None = None
    compiled: bool = False
    alternatives_not_measured: Mapping[str, str] = dataclasses.field(default_factory=dict)
    float32_matmul_precision: str | None = None
    timing: str | None = None
    memory: str | None = None  # how peak memory was measured (memory.source), or why not
    max_memory: int | None = None  # --max-memory in bytes
    objective: str = "speed"  # what the search optimised within the budget: speed, or memory
    # a goal's estimate, not a measurement (the FLOP goal's, _flops.py: goal, target, "estimate": true, the value and
    # its words, the FLOP shares, the target's rates and their source, every candidate's estimate); None: none made
    estimate: Mapping[str, Any] | None = None
    loss_scale_search: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    search_space: str | None = None
    study: StudyRef = StudyRef()
    sweep: Mapping[str, Any] | None = None
    # the layout a sharded search measured on (world_size, mesh, parallelize: _ranks.Layout); None: one device
    layout: Mapping[str, Any] | None = None
    # the tuned layers' share of the step's matmul FLOPs and of the parameters, the rest by module class
    # (_coverage.Coverage: a MoE's fused experts are no Linear); None: not measured
    coverage: Mapping[str, Any] | None = None
    run_steps: int | None = None  # the training run the search was priced against (SearchConfig.run_steps)
    cost: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    created: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def policy_result(self) -> Result | None:
        return self.results.get("policy")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object a policy file holds; optional fields left unset are not written."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                continue
            if (
                f.name
                in (
                    "budget_given",
                    "why",
                    "greedy",
                    "stopped",
                    "sweep",
                    "layout",
                    "coverage",
                    "run_steps",
                    "created",
                    "memory",
                    "max_memory",
                    "estimate",
                )
                and value is None
            ):
                continue
            if f.name == "not_separated":
                value = list(value)
            elif f.name == "results":
                value = {k: r.to_dict() for k, r in value.items()}
            elif f.name == "study":
                value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
            elif isinstance(value, Mapping):
                value = _plain(value)
            out[f.name] = value
        return {**out, **{k: v for k, v in self.extra.items() if k not in out}}

    @classmethod
    def from_dict(cls, data: Any) -> Measured:
        """Read leniently: a field of the wrong type takes its default, as if it were missing."""
        data = _mapping(data)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        study = _mapping(data.get("study"))
        noise = data.get("noise")
        sweep = data.get("sweep")
        return cls(
            device=_text(data.get("device")),
            versions={str(k): str(v) for k, v in _mapping(data.get("versions")).items()},
            model=_text(data.get("model")),
            fingerprint=_text(data.get("fingerprint")),
            budget=_number(data.get("budget")),
            budget_given=_text(data.get("budget_given")),
            mode=_text(data.get("mode")) or "weights",
            train_steps=_count(data.get("train_steps")),
            noise_floor=_number(data.get("noise_floor")),
            noise=noise if isinstance(noise, Mapping) else None,
            fp32_metric=_number(data.get("fp32_metric")),
            metric=_text(data.get("metric")),
            chosen=_text(data.get("chosen")),
            why=_text(data.get("why")),
            greedy=_text(data.get("greedy")),
            not_separated=tuple(str(n) for n in data.get("not_separated") or () if isinstance(n, str))
            if isinstance(data.get("not_separated"), list)
            else (),
            stopped=_text(data.get("stopped")),
            results={str(k): Result.from_dict(v) for k, v in _mapping(data.get("results")).items()},
            kept_fp32={str(k): str(v) for k, v in _mapping(data.get("kept_fp32")).items()},
            excluded={
                str(k): {str(f): str(w) for f, w in _mapping(v).items()} for k, v in _mapping(data.get("excluded")).items()
            },
            fp8=_text(data.get("fp8")),
            compiled=data.get("compiled") is True,
            alternatives_not_measured={str(k): str(v) for k, v in _mapping(data.get("alternatives_not_measured")).items()},
            float32_matmul_precision=_text(data.get("float32_matmul_precision")),
            timing=_text(data.get("timing")),
            memory=_text(data.get("memory")),
            max_memory=_count(data.get("max_memory")),
            objective=_text(data.get("objective")) or "speed",
            estimate=data.get("estimate") if isinstance(data.get("estimate"), Mapping) else None,
            loss_scale_search=dict(_mapping(data.get("loss_scale_search"))),
            search_space=_text(data.get("search_space")),
            study=StudyRef(
                name=_text(study.get("name")),
                storage=_text(study.get("storage")),
                trials=_count(study.get("trials")),
                complete=_count(study.get("complete")),
            ),
            sweep=sweep if isinstance(sweep, Mapping) else None,
            layout=data.get("layout") if isinstance(data.get("layout"), Mapping) else None,
            coverage=data.get("coverage") if isinstance(data.get("coverage"), Mapping) else None,
            run_steps=_count(data.get("run_steps")),
            cost=dict(_mapping(data.get("cost"))),
            created=_text(data.get("created")),
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def of(cls, policy: Policy) -> Measured:
        """The typed view of `policy.measured` (all defaults when the policy has none)."""
        return cls.from_dict(policy.measured)


def _mapping(value: Any) -> Mapping:
    return value if isinstance(value, Mapping) else {}


def _plain(value: Any) -> Any:
    """Nested mappings as plain dicts (json writes any Mapping only when it is a dict)."""
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def _number(value: Any) -> float | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past float's range: no measurement, read as missing
        return None


def _count(value: Any) -> int | None:
    # beyond int64, not a count of anything measured (bytes, steps, trials): read as missing, so no table overflows
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63 else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _real(value: Any) -> float | None:
    """A JSON number as stored (an int stays one), so that what a trial wrote reads back as written."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _flag_or_none(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


_COST = {"cost": True}  # a TrialRecord field that says what the trial cost, not what the policy measured


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """What one search trial measured (objective.Objective writes it field by field as it measures, `write`), kept
    as its Optuna user attributes: one attribute per field, of the same name, a JSON value; None and missing alike
    mean not measured. Its fields, in order, are trials.csv's measurement columns.

    `metric`, `metric_drop`: None where not finite; `feasible`: within budget (and --max-memory), and it ran;
    `step_ms`, `fp32_step_ms`: the candidate's and fp32's median step times, timed together `rounds` times, `spread`
    the wider of their interquartile ranges over the median; `skipped` of `steps`: steps the GradScaler skipped while
    timed, `effective_step_ms` the step time per step that updated the weights; `speedup`: fp32's over that (1.0 for
    the all-fp32 trial, not timed; the prediction for an untimed one); `peak_bytes`, `memory_saving`: as in
    Measurement; `train_skipped`: steps skipped while trained (train mode); `error`: why it broke or does not fit;
    `predicted_speedup`, `untimed`: the speed model's prediction and why it left the trial untimed.
    What it cost (not copied to a repeat): `evaluate_s`, `measure_s`, `compile_s` (within measure_s); `reused_from`:
    a repeat of that trial's policy, its measurements copied; `reevaluated_from`: one left untimed, judged again."""

    metric: float | None = None
    metric_drop: float | None = None
    feasible: bool | None = None
    step_ms: float | None = None
    skipped: int | None = None
    steps: int | None = None
    effective_step_ms: float | None = None
    fp32_step_ms: float | None = None
    speedup: float | None = None
    spread: float | None = None
    peak_bytes: int | None = None
    memory_saving: float | None = None
    train_skipped: int | None = None
    error: str | None = None
    predicted_speedup: float | None = None
    untimed: str | None = None
    evaluate_s: float | None = dataclasses.field(default=None, metadata=_COST)
    measure_s: float | None = dataclasses.field(default=None, metadata=_COST)
    compile_s: float | None = dataclasses.field(default=None, metadata=_COST)
    rounds: int | None = dataclasses.field(default=None, metadata=_COST)
    reused_from: int | None = dataclasses.field(default=None, metadata=_COST)
    reevaluated_from: int | None = dataclasses.field(default=None, metadata=_COST)

    @property
    def timed(self) -> bool:
        """Timed beside fp32 in this trial (some rounds), not a repeat that copied an earlier trial's timing."""
        return bool(self.rounds) and self.reused_from is None

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> TrialRecord:
        """Read leniently: a missing attribute, or one of the wrong type, is unset; others (the study's own) are not read."""
        return cls(**{name: _TRIAL_READERS[name](attrs.get(name)) for name in _TRIAL_READERS})

    @classmethod
    def of(cls, trial: _Attributed) -> TrialRecord:
        """The record of an optuna.Trial (while it runs) or FrozenTrial."""
        return cls.from_attrs(trial.user_attrs)

    def to_attrs(self, *, costs: bool = True) -> dict[str, Any]:
        """The set fields as attributes (`costs=False`: only the measurements, what a repeat of the policy copies)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None and (costs or not f.metadata.get("cost"))
        }

    @staticmethod
    def write(trial: _Writable, **fields: Any) -> None:
        """Store `fields` as the trial's attributes (None too: measured as missing). TypeError, before anything is
        written, for a name that is no field or a value from_attrs would not read back as given."""
        for name, value in fields.items():
            if name not in _TRIAL_READERS:
                raise TypeError(f"a trial has no field {name!r}; its fields are {list(_TRIAL_READERS)}")
            if value is not None and _TRIAL_READERS[name](value) is not value:
                raise TypeError(f"trial field {name} is {_TRIAL_KINDS[name].__name__} or None, but got {value!r}")
        for name, value in fields.items():
            trial.set_user_attr(name, value)


class _Writable(_Attributed, Protocol):
    def set_user_attr(self, key: str, value: Any) -> None: ...


def _kind(hint: Any) -> type:
    """`float` of `float | None`."""
    (kind,) = (t for t in get_args(hint) if t is not NoneType)
    return kind


_TRIAL_KINDS: dict[str, type] = {name: _kind(hint) for name, hint in get_type_hints(TrialRecord).items()}
# each kind's reader returns the value itself where it is of that kind (JSON's, as stored), None otherwise
_TRIAL_READERS: dict[str, Callable[[Any], Any]] = {
    name: {bool: _flag_or_none, int: _count, float: _real, str: _text}[kind] for name, kind in _TRIAL_KINDS.items()
}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What one timed training step runs: a policy, whether fp32 matmuls may use TF32 (CUDA only; a
    process-wide setting, not a per-layer format, so it is set around each of this candidate's steps), and whether a
    compiled step runs under CUDA graphs (torch.compile's mode="reduce-overhead": how the model is compiled, not a
    format)."""

    policy: Policy
    tf32: bool = False
    cuda_graphs: bool = False


def as_candidate(value: Policy | Candidate) -> Candidate:
    return value if isinstance(value, Candidate) else Candidate(value)
