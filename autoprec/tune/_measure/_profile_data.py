"""A profile's data: one row per (layer, format) of what lowering that layer alone measured (the profiler,
_profiler.py, writes it), saved beside the search's results, and the rules the rest of the tuner reads it by
(`ruled_out`). A row is a `ProfileRow`; a DataFrame only where profile.csv is written or read (`rows_frame`,
`Profile.load`). Reading a profile needs no measuring.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from autoprec.files import check_version, write_atomically
from autoprec.formats import FP16_MAX, NO_KERNEL, Format
from autoprec.tune._core._profile_row import COLUMNS, OPTIONAL_COLUMNS, SQNR_COLUMNS, ProfileRow, empty_cell
from autoprec.tune._measure._gradients import ScaleAdvice, advise

# What a report or figure writes for a lowered format the profile has no numbers for, and what each means: two
# causes, told apart (`unrun`). NOT_PROFILED opens the reason the profiler gives a layer its deadline left out.
CANNOT_RUN, NOT_PROFILED = "cannot run", "not profiled"
PREDICTED = "predicted"  # opens metric_source where a row's drop is a share of its group's, not measured alone
UNRUN = {
    CANNOT_RUN: "the format fails or is refused for the layer on this device (profile.csv's reason says why)",
    NOT_PROFILED: "the time budget's share for the profile ran out before the layer (it stays fp32)",
}


# prune.slower_than at or above which a search does not judge speed at all (a goal whose trials are not timed: an
# estimate for another device), so a format with no kernel here stays a candidate there
SPEED_UNJUDGED = 1e9

# profile.json's "version": the format of profile.json, profile.csv and grad_ranges.csv together. Raise it when any of
# them changes (a column, a field, what a value means); Profile.load reads no other, and a search measures again.
PROFILE_VERSION = 4  # 2: dgrad_sqnr_db; 3: tokens; 4: fp8 where torchao emulates it is not timed (no kernel)


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
    cost: dict[str, Any] | None = None  # timing.Stopwatch.to_dict() of the profiling run
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
                layer = "" if empty_cell(cells["layer"]) else f" (layer {cells['layer']!r})"
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
        return f"{NO_KERNEL}: the format runs emulated here, so its speed is unknown"  # one footnote for them all
    ratio, spread = row.time_vs_fp32, row.time_spread  # spread NaN where probed only: many times slower, beyond any noise
    # measured inside wide noise (a loaded machine), a slowdown rules nothing out: the search's whole steps judge it
    fast_end = ratio * (1 - spread / 2) if math.isfinite(spread) else ratio
    if math.isfinite(ratio) and fast_end > slower_than:
        return f"measured {ratio:.2f}x the layer's fp32 time on this device"
    return None
