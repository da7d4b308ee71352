"""A profile's data: one row per (layer, format) of what lowering that layer alone measured (the profiler,
_profiler.py, writes it), saved beside the search's results, and the rules the rest of the tuner reads it by
(`ruled_out`). A row is a `ProfileRow`; a DataFrame only where profile.csv is written or read (`rows_frame`,
`Profile.load`). Reading a profile needs no measuring.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from autoprec.errors import shown
from autoprec.files import check_version, write_atomically
from autoprec.formats import FP16_MAX, NO_KERNEL, Format
from autoprec.tune._core._numbers import parse_decimal
from autoprec.tune._measure._gradients import ScaleAdvice, advise

NAN = math.nan

# What a report or figure writes for a lowered format the profile has no numbers for, and what each means: two
# causes, told apart (`unrun`). NOT_PROFILED opens the reason the profiler gives a layer its deadline left out.
CANNOT_RUN, NOT_PROFILED = "cannot run", "not profiled"
PREDICTED = "predicted"  # opens metric_source where a row's drop is a share of its group's, not measured alone
UNRUN = {
    CANNOT_RUN: "the format fails or is refused for the layer on this device (profile.csv's reason says why)",
    NOT_PROFILED: "the time budget's share for the profile ran out before the layer (it stays fp32)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileRow:
    """What lowering one layer alone to one format measured: a row of profile.csv, its fields the columns in order.
    NaN (None for `tokens`, `finite`, `overflow`; "" for text) where it was not measured: a format ruled out
    first, a layer the deadline left out."""

    layer: str
    type: str  # the module's class name
    shape: str  # its weight's shape ("64x32"), "-" for none
    # the rows (inputs' leading dimensions) the layer's calls took per training step, the mean over the profiled
    # train batches: a Linear's GEMMs are 2 * tokens * in * out FLOPs each (_flops.py); None where its calls were not
    # recorded
    tokens: float | None = None
    format: str
    status: str  # "ok", or "unsupported" (`reason` says why: `unrun`)
    reason: str = ""
    # SQNR (dB) against fp32 of each GEMM's result, the layer replayed alone (or, fed its own output, in the whole model):
    # sqnr_db its output (fprop), grad_sqnr_db its parameters' gradient (wgrad), dgrad_sqnr_db the gradient it sends to
    # its inputs (dgrad; NaN where none flows back in the model: a first layer on data). inf: equal; NaN with
    # finite False: that result went non-finite
    sqnr_db: float = NAN
    grad_sqnr_db: float = NAN
    dgrad_sqnr_db: float = NAN
    metric: float = NAN  # the task metric with this layer alone lowered
    metric_drop: float = NAN  # the fp32 model's metric minus `metric`
    finite: bool | None = None  # False: an output, gradient, loss or metric went non-finite; None: not measured
    overflow: bool | None = None  # True: fp16's output overflows; None: not measured
    max_abs: float = NAN  # the largest |output| of the layer in fp32
    time_ms: float = NAN  # the layer's own forward + backward time in this format
    time_spread: float = NAN  # the spread of its timing rounds relative to their median; NaN where probed only
    time_vs_fp32: float = NAN  # time_ms over the fp32 row's
    # the most the live tensor bytes rose over the layer's isolated forward + backward after its timing (its output,
    # what it saves for backward, its gradients and casts; _memory.py; no state, unlike a whole step's peak); NaN
    # where the device has no measurement
    step_rise_bytes: float = NAN
    # gradient ranges (_gradients.py), without loss scaling: largest and smallest nonzero |gradient| of the
    # layer, the fractions of nonzero gradient elements this format flushes to zero / leaves subnormal /
    # overflows, and (fp16 rows) the layer's own loss-scale range in log2
    grad_amax: float = NAN
    grad_amin: float = NAN
    grad_underflow: float = NAN
    grad_subnormal: float = NAN
    grad_overflow: float = NAN
    scale_low_log2: float = NAN
    scale_high_log2: float = NAN
    # the layer whose timing this row reuses: layers of one type, configuration and input shapes are timed once;
    # NO_KERNEL where the format runs an emulation only on this device (FormatFamily.has_kernels): not timed; ""
    # where nothing was timed
    timed_as: str = ""
    # "measured", or why the metric was not evaluated: a format the profile already rules out (slower than
    # fp32 by more than the space's prune.slower_than, non-finite, overflowing) is never chosen, whatever its drop
    metric_source: str = ""
    # whether the layer is an nn.Linear (any subclass, by type, as the search space types it): what the FLOP goal and
    # the step-time predictor price as GEMMs. None in a profile written before the column (a type named ...Linear
    # then counts as one)
    linear: bool | None = None

    def sqnr(self, gemm: str) -> float:
        """The SQNR (dB) of one GEMM's result: "fprop", "dgrad" or "wgrad" (SQNR_COLUMNS)."""
        return float(getattr(self, SQNR_COLUMNS[gemm]))

    @classmethod
    def from_cells(cls, cells: Mapping[str, Any]) -> ProfileRow:
        """A row from profile.csv's cells as pandas read them (empty: NaN; True/False; numbers as numpy's).
        ValueError naming the column and the value where a cell holds what the profiler never writes (a hand-edited
        file): a shape that is not sizes joined by "x", tokens that are not a finite number >= 0, text where a
        number or True/False belongs. Profile.load adds the file and the line."""
        texts = {"layer", "type", "shape", "format", "status", "reason", "timed_as", "metric_source"}
        values: dict[str, Any] = {}
        for name in COLUMNS:
            if name in OPTIONAL_COLUMNS and name not in cells:
                continue  # a profile written before it: the field's default
            cell = cells[name]
            if name in texts:
                values[name] = "" if _empty(cell) else str(cell)
            elif name in ("finite", "overflow", "linear"):
                values[name] = flag(cell)
                if values[name] is None and not _empty(cell):
                    raise _bad_cell(name, cell, "True, False or empty")
            else:
                values[name] = _number(name, cell)
        if not _SHAPE.fullmatch(values["shape"]):
            raise _bad_cell("shape", values["shape"], "a weight's sizes joined by x (a Linear's out x in: 64x32), or -")
        tokens = values["tokens"]
        if math.isnan(tokens):
            values["tokens"] = None if _empty(cells["tokens"]) else tokens
        if values["tokens"] is not None and not (math.isfinite(tokens) and tokens >= 0):
            raise _bad_cell("tokens", cells["tokens"], "a finite number >= 0 (the rows the layer took per step), or empty")
        return cls(**values)


COLUMNS = [f.name for f in dataclasses.fields(ProfileRow)]  # profile.csv's columns, in its order
OPTIONAL_COLUMNS = frozenset({"linear"})  # added since PROFILE_VERSION 3: a profile without them still reads

# prune.slower_than at or above which a search does not judge speed at all (a goal whose trials are not timed: an
# estimate for another device), so a format with no kernel here stays a candidate there
SPEED_UNJUDGED = 1e9

SQNR_COLUMNS = {"fprop": "sqnr_db", "dgrad": "dgrad_sqnr_db", "wgrad": "grad_sqnr_db"}  # each GEMM's column

# profile.json's "version": the format of profile.json, profile.csv and grad_ranges.csv together. Raise it when any of
# them changes (a column, a field, what a value means); Profile.load reads no other, and a search measures again.
PROFILE_VERSION = 3  # 2: dgrad_sqnr_db; 3: tokens


def unrun(row: ProfileRow) -> str:
    """Why a lowered format of a row with no numbers (status not "ok") has none, as UNRUN's key: the profile left its
    layer out for the time budget (NOT_PROFILED), or the format cannot run there (CANNOT_RUN)."""
    return NOT_PROFILED if row.reason.startswith(NOT_PROFILED + ":") else CANNOT_RUN


def rows_frame(rows: Iterable[ProfileRow]) -> pd.DataFrame:
    """The rows as profile.csv's table: one column per field, in COLUMNS' order."""
    return pd.DataFrame([[getattr(r, c) for c in COLUMNS] for r in rows], columns=COLUMNS)


def is_linear(module: object) -> bool:
    """Whether a module is priced as a Linear's three GEMMs (the FLOP goal, the step-time predictor): by type, nn.Linear
    and every subclass whatever its name, as the search space types layers."""
    return isinstance(module, torch.nn.Linear)


def by_layer(rows: Iterable[ProfileRow]) -> dict[str, dict[str, ProfileRow]]:
    """Each layer's rows by format, layers and formats in the rows' order."""
    out: dict[str, dict[str, ProfileRow]] = {}
    for r in rows:
        out.setdefault(r.layer, {})[r.format] = r
    return out


@dataclasses.dataclass
class Profile:
    """One row per (layer, format), in the order the profiler measured them; `fp32_metric` is the all-fp32 model's
    metric. `grad_ranges`: the per-loss-scale gradient table (gradients.scale_table), saved as grad_ranges.csv;
    `max_underflow`: the tolerance the loss-scale advice uses."""

    rows: list[ProfileRow]
    fp32_metric: float
    metric_name: str
    device: str
    fingerprint: str
    grad_ranges: pd.DataFrame | None = None
    max_underflow: float = 1e-3
    cost: dict[str, Any] | None = None  # cost.Stopwatch.to_dict() of the profiling run
    compiled: bool = False  # layer times measured under torch.compile
    uncalled: list[str] = dataclasses.field(default_factory=list)  # tunable layers loss_fn never calls: left out
    group_tolerance: float | None = None  # ProfileConfig's: the drops it predicted are that precise
    numerics: str = "all"  # ProfileConfig's: "offered" left the numerics of formats its timing ruled out unmeasured
    weights: str | None = None  # policy.weights_digest of the model measured (None: a profile from before it was kept)
    complete: bool = True  # False: a time budget's deadline left layers unprofiled (ProfileConfig.deadline_s)
    deadline_s: float | None = None  # ProfileConfig's: a run with as little time reuses a profile it cut short

    def save(self, out_dir: str | Path) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        fields = (
            "fp32_metric",
            "metric_name",
            "device",
            "fingerprint",
            "max_underflow",
            "cost",
            "compiled",
            "uncalled",
            "group_tolerance",
            "numerics",
            "weights",
            "complete",
            "deadline_s",
        )
        meta: dict[str, Any] = {"version": PROFILE_VERSION, **{k: getattr(self, k) for k in fields}}
        advice = self.advice()
        meta["loss_scale_advice"] = advice.to_dict() if advice else None
        text = json.dumps(meta, indent=2) + "\n"
        table = self.frame()
        write_atomically(out_dir / "profile.csv", lambda tmp: table.to_csv(tmp, index=False))
        write_atomically(out_dir / "profile.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))
        if self.grad_ranges is not None:
            grad_ranges = self.grad_ranges
            write_atomically(out_dir / "grad_ranges.csv", lambda tmp: grad_ranges.to_csv(tmp, index=False))
        return out_dir / "profile.csv"

    @classmethod
    def load(cls, out_dir: str | Path) -> Profile:
        """What `save` wrote to out_dir, at this PROFILE_VERSION (files.OtherVersion for another, or none)."""
        out_dir = Path(out_dir)
        meta = json.loads((out_dir / "profile.json").read_text(encoding="utf-8"))
        check_version(out_dir / "profile.json", meta.get("version") if isinstance(meta, dict) else None, PROFILE_VERSION)
        del meta["version"]
        meta.pop("loss_scale_advice", None)  # derived from grad_ranges on demand
        # names are strings even when they look like numbers (nn.Sequential's "0", "2"; a 1-d weight's shape "64")
        texts = dict.fromkeys(("layer", "type", "shape", "format", "timed_as"), str)
        table = pd.read_csv(out_dir / "profile.csv", keep_default_na=True, dtype=texts)
        missing = [c for c in COLUMNS if c not in table and c not in OPTIONAL_COLUMNS]
        if missing:
            raise ValueError(f"{out_dir / 'profile.csv'}: no column {missing[0]!r}")
        rows = []
        for line, cells in enumerate(
            table[[c for c in COLUMNS if c in table]].to_dict("records"), start=2
        ):  # line 1: the column names
            try:
                rows.append(ProfileRow.from_cells(cells))
            except ValueError as exc:
                layer = "" if _empty(cells["layer"]) else f" (layer {cells['layer']!r})"
                raise ValueError(f"{out_dir / 'profile.csv'}: line {line}{layer}, {exc}") from None
        grad_ranges = pd.read_csv(out_dir / "grad_ranges.csv", dtype={"layer": str})  # profile() always measures them
        return cls(rows=rows, grad_ranges=grad_ranges, **meta)

    def frame(self) -> pd.DataFrame:
        """The rows as profile.csv's table (rows_frame): for what writes or draws a table, not for reading rows."""
        return rows_frame(self.rows)

    def layers(self) -> list[str]:
        return list(dict.fromkeys(r.layer for r in self.rows))

    def by_layer(self) -> dict[str, dict[str, ProfileRow]]:
        return by_layer(self.rows)

    def row(self, layer: str, fmt: Format | str) -> ProfileRow | None:
        """The row of one layer in one format; None where the profile has none."""
        fmt = str(getattr(fmt, "value", fmt))
        return next((r for r in self.rows if r.layer == layer and r.format == fmt), None)

    def advice(self, layers: list[str] | None = None) -> ScaleAdvice | None:
        """The loss-scale range for fp16 in the given layers (None: those the profile ran in fp16)."""
        if self.grad_ranges is None:
            return None
        if layers is None:
            layers = list(dict.fromkeys(r.layer for r in self.rows if r.format == Format.FP16.value))
        return advise(self.grad_ranges, layers, self.max_underflow)

    def predicted_drop(self, layers: Mapping[str, Format | str]) -> float:
        """The sum of the single-layer metric drops of a policy's lowered layers: what the profile predicts
        for the policy if the layers' effects add up. Layers it did not profile (the model root) count 0."""
        drops = {(r.layer, r.format): r.metric_drop for r in self.rows}
        total = 0.0
        for name, fmt in layers.items():
            fmt = str(getattr(fmt, "value", fmt))
            if fmt != Format.FP32.value and (name, fmt) in drops:
                total += float(drops[(name, fmt)])
        return total


def ruled_out(row: ProfileRow, budget: float | None, slower_than: float) -> str | None:
    """Why the profile rules a format out for a layer (its row), or None. `budget` None: do not judge the
    single-layer drop (train mode, whose budget is on another measurement; or before it is known).
    `slower_than` inf or at least SPEED_UNJUDGED: do not judge speed (a profile on its own; a search for another
    device's estimate), which also keeps a format with no kernel here."""
    if row.status != "ok":
        return row.reason
    if row.finite is False:
        return "non-finite output, gradient, loss or metric when lowered alone"
    if row.overflow is True:
        return f"fp16 overflows: max |output| {row.max_abs:.4g} > {FP16_MAX:g} or inf when lowered"
    if row.format == Format.FP16.value and row.grad_overflow > 0:
        return f"fp16 gradients overflow even at loss scale 1 ({100 * row.grad_overflow:.2g}% of elements above {FP16_MAX:g})"
    fmt = Format(row.format)
    if fmt.family.gemm_floor_rules_out:
        # a GEMM whose scaling flushed or saturated (report.breaks), below its family's floor for the format: a
        # per-GEMM format that keeps it in high precision is the layer's way to keep its other GEMMs low
        floor = fmt.family.sqnr_floor(fmt)
        whose = "fp8" if fmt.family.fp8 else fmt.value
        for gemm in SQNR_COLUMNS:
            sqnr = row.sqnr(gemm)
            if sqnr < floor:
                return f"its {gemm} GEMM measures {sqnr:.1f} dB against fp32, below {whose}'s {floor:g} dB floor"
    drop = row.metric_drop
    if budget is not None and drop > budget:
        return f"alone drops the metric by {drop:.4g} > budget {budget:g}"
    if row.timed_as == NO_KERNEL and slower_than < SPEED_UNJUDGED:
        # a search weighs each format's speed on this device: one that only runs emulated here has none to weigh
        return f"{NO_KERNEL}: {row.format} runs emulated here, so its speed is unknown"
    ratio, spread = row.time_vs_fp32, row.time_spread  # spread NaN where probed only: many times slower, beyond any noise
    # measured inside wide noise (a loaded machine), a slowdown rules nothing out: the search's whole steps judge it
    fast_end = ratio * (1 - spread / 2) if math.isfinite(spread) else ratio
    if math.isfinite(ratio) and fast_end > slower_than:
        return f"measured {ratio:.2f}x the layer's fp32 time on this device"
    return None


def _empty(cell: Any) -> bool:
    return cell is None or (isinstance(cell, float) and math.isnan(cell))


_SHAPE = re.compile(r"-|[0-9]+(?:x[0-9]+)*", re.ASCII)  # what _profiler._shape writes: "64x32", "64", "-"


def _bad_cell(column: str, cell: Any, what: str) -> ValueError:
    return ValueError(f"column {column}: {shown(cell)} is not {what}")


def _number(column: str, cell: Any) -> float:
    """A number cell as a float, NaN where empty; ValueError (_bad_cell) for anything else: text, True/False."""
    if _empty(cell):
        return NAN
    if isinstance(cell, (int, float, np.integer, np.floating)) and not isinstance(cell, (bool, np.bool_)):
        return float(cell)
    try:
        return parse_decimal(cell)  # a column pandas read as text holds its numbers as text
    except ValueError:
        raise _bad_cell(column, cell, "a number or empty") from None


def flag(value: Any) -> bool | None:
    """A True/False cell of profile.csv as pandas read it (text in a column it read as text); None where it was not
    measured (empty) or holds neither."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    return {"True": True, "False": False}.get(value) if isinstance(value, str) else None


def as_float(value: Any) -> float:
    """A cell as a float; NaN where it holds none (empty, text)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
