"""A row of profile.csv: what lowering one layer alone to one format measured (`ProfileRow`, its fields the columns
in order) and how a cell of it is read back. Data only, at the bottom of the tuner, so that what prices a row (a goal,
_goal.py) reads it without importing the profile's measuring; the profile itself is _measure/_profile_data.py's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from autoprec.errors import shown
from autoprec.tune._core._numbers import parse_decimal

NAN = math.nan


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
                values[name] = "" if empty_cell(cell) else str(cell)
            elif name in ("finite", "overflow", "linear"):
                values[name] = flag(cell)
                if values[name] is None and not empty_cell(cell):
                    raise _bad_cell(name, cell, "True, False or empty")
            else:
                values[name] = _number(name, cell)
        if not _SHAPE.fullmatch(values["shape"]):
            raise _bad_cell("shape", values["shape"], "a weight's sizes joined by x (a Linear's out x in: 64x32), or -")
        tokens = values["tokens"]
        if math.isnan(tokens):
            values["tokens"] = None if empty_cell(cells["tokens"]) else tokens
        if values["tokens"] is not None and not (math.isfinite(tokens) and tokens >= 0):
            raise _bad_cell("tokens", cells["tokens"], "a finite number >= 0 (the rows the layer took per step), or empty")
        return cls(**values)


COLUMNS = [f.name for f in dataclasses.fields(ProfileRow)]  # profile.csv's columns, in its order
OPTIONAL_COLUMNS = frozenset({"linear"})  # added since PROFILE_VERSION 3: a profile without them still reads

SQNR_COLUMNS = {"fprop": "sqnr_db", "dgrad": "dgrad_sqnr_db", "wgrad": "grad_sqnr_db"}  # each GEMM's column


def empty_cell(cell: Any) -> bool:
    return cell is None or (isinstance(cell, float) and math.isnan(cell))


_SHAPE = re.compile(r"-|[0-9]+(?:x[0-9]+)*", re.ASCII)  # what _profiler._shape writes: "64x32", "64", "-"


def _bad_cell(column: str, cell: Any, what: str) -> ValueError:
    return ValueError(f"column {column}: {shown(cell)} is not {what}")


def _number(column: str, cell: Any) -> float:
    """A number cell as a float, NaN where empty; ValueError (_bad_cell) for anything else: text, True/False."""
    if empty_cell(cell):
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
