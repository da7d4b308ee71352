"""Tables a person can read: console text and markdown for profiles (the breaking GEMMs, the gradient ranges) and
search and sweep results. A policy's own are _show.py's, the tables' layout _tables.py's, the figures _plots.py's."""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from autoprec.formats import FP16_MAX, Format
from autoprec.tune._core._config import BREAK_ROWS, BREAK_SQNR_DB_16BIT, BREAK_SQNR_DB_FP8
from autoprec.tune._core._profile_row import SQNR_COLUMNS, ProfileRow
from autoprec.tune._core._tables import WIDTH, markdown_table, text_table
from autoprec.tune._measure._gradients import ScaleAdvice
from autoprec.tune._measure._profile_data import NO_KERNEL, PREDICTED, UNRUN, by_layer, unrun

if TYPE_CHECKING:  # the results import this module to print themselves
    pass


def profile_summary(rows: Sequence[ProfileRow], *, markdown: bool = False) -> str:
    """Per layer: each format's output SQNR, metric drop and time relative to fp32."""
    fmt_table = markdown_table if markdown else text_table
    formats = list(dict.fromkeys(r.format for r in rows))
    headers = ["layer", "type", "shape"] + [f"{f} {k}" for f in formats if f != "fp32" for k in ("dB", "drop", "x time")]
    headers.insert(3, "fp32 ms")
    table = []
    for name, by in by_layer(rows).items():
        first = next(iter(by.values()))
        row: list[object] = [name, first.type, first.shape, by["fp32"].time_ms]
        for f in formats:
            if f == "fp32":
                continue
            r = by.get(f)
            if r is None or r.status != "ok":
                row += ["n/a" if r is None else unrun(r), "", ""]
                continue
            speed: object = NO_KERNEL if r.timed_as == NO_KERNEL else r.time_vs_fp32
            if r.finite is False or r.overflow is True:
                row += ["inf/nan", "", speed]
            elif r.metric_source.startswith("not measured"):
                row += ["ruled out", "", speed]
            elif r.metric_source.startswith(PREDICTED):
                row += [r.sqnr_db, f"~{r.metric_drop:.3g}", speed]
            else:
                row += [r.sqnr_db, r.metric_drop, speed]
        table.append(row)
    return fmt_table(headers, table)


@dataclasses.dataclass(frozen=True)
class Break:
    """One GEMM of one layer in one format that breaks (`breaks`); gemm "-": the row as a whole (its loss or metric)."""

    layer: str
    format: str
    gemm: str  # fprop, dgrad, wgrad (profile_data.SQNR_COLUMNS) or "-"
    sqnr_db: float  # NaN: non-finite, or no GEMM
    metric_drop: float
    why: str
    rank: int  # 0 non-finite or overflowing, 1 below its floor, 2 over the budget: worst first

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in dataclasses.asdict(self).items()
            if k != "rank"
        }


def break_floor(fmt: str) -> float:
    """The SQNR (dB) below which a GEMM result in `fmt` counts as broken (config.BREAK_SQNR_DB_*); -inf for fp32."""
    try:
        spec = Format(fmt).spec
    except ValueError:
        return -math.inf
    if spec.format is Format.FP32:
        return -math.inf
    return spec.format.family.sqnr_floor(spec.format)


def breaks(rows: Sequence[ProfileRow], budget: float | None = None) -> list[Break]:
    """The GEMMs of the profile (fprop, dgrad, wgrad per layer and format) that break, worst first: non-finite or
    overflowing fp16, then SQNR against fp32 below the format's floor (break_floor), lowest first, then (with a
    `budget`) a single-layer metric drop over it, largest first. A GEMM the layer does not run in fp32 (no gradient
    into the inputs of a first layer) is not judged."""
    runs = {r.layer: {g for g in SQNR_COLUMNS if not math.isnan(r.sqnr(g))} for r in rows if r.format == Format.FP32.value}
    found: list[Break] = []
    for r in rows:
        fmt, layer = r.format, r.layer
        if fmt == Format.FP32.value or r.status != "ok":
            continue
        drop, floor = r.metric_drop, break_floor(fmt)
        mine: list[Break] = []
        for gemm in SQNR_COLUMNS:
            if gemm not in runs.get(layer, set(SQNR_COLUMNS)):
                continue
            sqnr = r.sqnr(gemm)
            if gemm == "fprop" and r.overflow is True:
                why = f"fp16 overflow: max |output| {r.max_abs:.3g} > {FP16_MAX:g}"
                mine.append(Break(layer, fmt, gemm, sqnr, drop, why, 0))
            elif math.isnan(sqnr):  # measured and non-finite, or not measured (a format ruled out first)
                if r.finite is False:
                    mine.append(Break(layer, fmt, gemm, sqnr, drop, "non-finite", 0))
            elif sqnr < floor:
                mine.append(Break(layer, fmt, gemm, sqnr, drop, f"below {floor:g} dB", 1))
        if r.finite is False and not any(b.rank == 0 for b in mine):
            mine.append(Break(layer, fmt, "-", math.nan, drop, "non-finite loss or metric", 0))
        if budget is not None and drop > budget:
            mine.append(Break(layer, fmt, "-", math.nan, drop, f"metric drop over the budget {budget:g}", 2))
        found.extend(mine)
    return sorted(found, key=lambda b: (b.rank, b.sqnr_db if b.rank == 1 else 0.0, -b.metric_drop if b.rank == 2 else 0.0))


def breaks_summary(rows: Sequence[ProfileRow], *, budget: float | None = None, limit: int = BREAK_ROWS) -> str:
    """The answer to "which layer breaks?" in a few lines: `breaks`, at most `limit` rows and a count of the rest;
    one line when nothing does."""
    found = breaks(rows, budget)
    floors = f"{BREAK_SQNR_DB_FP8:g} dB (fp8) / {BREAK_SQNR_DB_16BIT:g} dB (bf16, fp16)"
    # the other floors of the formats in the table (the block-scaled ones: 20 dB MXFP8, 10 dB NVFP4)
    others: dict[float, list[str]] = {}
    for f in dict.fromkeys(r.format for r in rows):
        floor = break_floor(f)
        if math.isfinite(floor) and floor not in (BREAK_SQNR_DB_FP8, BREAK_SQNR_DB_16BIT):
            others.setdefault(floor, []).append(f)
    floors += "".join(f" / {floor:g} dB ({', '.join(names)})" for floor, names in others.items())
    over = f", no metric drop over {budget:g}" if budget is not None else ""
    if not found:
        line = f"which layer breaks: none; every GEMM measured is finite, its SQNR against fp32 >= {floors}{over}"
        return textwrap.fill(line, WIDTH)
    over = f", or the metric drops over {budget:g}" if budget is not None else ""
    title = (
        "which layer breaks, worst first (fprop: the layer's output; dgrad: the gradient it sends to its inputs; "
        f"wgrad: its weight gradient): a GEMM result non-finite, or its SQNR against fp32 below {floors}{over}"
    )
    cells = [[b.layer, b.format, b.gemm, _sqnr_cell(b), _drop_cell(b.metric_drop), b.why] for b in found[:limit]]
    parts = [textwrap.fill(title, WIDTH), text_table(["layer", "format", "GEMM", "SQNR dB", "metric drop", "why"], cells)]
    if len(found) > limit:
        parts.append(f"and {len(found) - limit} more (profile.csv: sqnr_db, dgrad_sqnr_db, grad_sqnr_db per layer and format)")
    notes = [
        "metric drop: the layer lowered alone in the given weights, untrained: a broken dgrad or wgrad shows in "
        "training only (search --mode train)"
    ]
    if any(b.format == Format.FP16.value and b.gemm in ("dgrad", "wgrad") for b in found[:limit]):
        notes.append("fp16 gradients are replayed at loss scale 1: a GradScaler lifts those flushed to zero (gradient ranges)")
    parts.extend(textwrap.fill(n, WIDTH) for n in notes)
    return "\n".join(parts)


def _sqnr_cell(b: Break) -> str:
    if math.isnan(b.sqnr_db):
        return "-" if b.gemm == "-" else "nan"
    return f"{b.sqnr_db:.1f}"


def _drop_cell(drop: float) -> str:
    return "-" if math.isnan(drop) else f"{drop:.3g}"


def gradient_summary(rows: Sequence[ProfileRow], advice: ScaleAdvice | None = None, *, markdown: bool = False) -> str:
    """Per layer: its gradient magnitudes, what fp16 (unscaled) and fp8 (dynamic scaling) would lose, and
    the layer's own loss-scale range; then the model's recommended range and the layers that bound it."""
    fmt_table = markdown_table if markdown else text_table
    table = []
    for name, by in by_layer(rows).items():
        first = next(iter(by.values()))
        fp16, fp8 = by.get("fp16"), by.get("fp8")
        low = fp16.scale_low_log2 if fp16 is not None else math.nan
        high = fp16.scale_high_log2 if fp16 is not None else math.nan
        scale_range = "-" if fp16 is None else ("overflows at 2^0" if math.isnan(high) else f"2^{low:.0f} .. 2^{high:.0f}")
        table.append(
            [
                name,
                first.grad_amax,
                first.grad_amin,
                _percent(fp16.grad_underflow) if fp16 is not None else "-",
                _percent(fp16.grad_overflow) if fp16 is not None else "-",
                scale_range,
                _percent(fp8.grad_underflow) if fp8 is not None and fp8.status == "ok" else "-",
            ]
        )
    headers = ["layer", "max |grad|", "min |grad|", "fp16 underflow", "fp16 overflow", "fp16 loss scale", "fp8 e5m2 underflow"]
    parts = [fmt_table(headers, table)]
    parts.append(
        "underflow / overflow: fraction of the layer's nonzero gradient elements (weight, output and input "
        "gradients) below fp16's smallest subnormal 2^-24 / above 65504 at loss scale 1; fp8: the gradient "
        "entering the layer cast to e5m2 with per-tensor dynamic scaling. fp16 loss scale: the layer's range."
    )
    if advice is not None:
        parts.append("loss scale: " + advice.describe())
    return "\n\n".join(parts)


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.3g}%"


def profile_notes() -> str:
    """What the profile table's cells mean, under it in summary.md and sweep.md."""
    unrun = "; ".join(f"`{mark}`: {why}" for mark, why in UNRUN.items())
    return (
        f"dB: output SQNR against fp32; drop: metric drop with the layer lowered alone (~: predicted, an equal share "
        f"of its group's drop; `ruled out`: not run, the format already was: slower than fp32 beyond "
        f"prune.slower_than, non-finite or overflowing; profile.csv's metric_source says which; {unrun}); x time: the "
        f"layer's forward+backward time over fp32's ({NO_KERNEL}: a format that runs emulated here, not timed)."
    )
