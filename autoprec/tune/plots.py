"""Figures: the profile's heat maps (profile.png), the fp16 gradient ranges (grad_ranges.png) and a sweep's Pareto
plot (pareto.png), drawn with matplotlib, imported only where a figure is drawn. The text tables are report.py's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd

from autoprec.files import write_atomically
from autoprec.tune.alternatives import BF16
from autoprec.tune.gradients import ScaleAdvice
from autoprec.tune.memory import MIB
from autoprec.tune.profile_data import Profile, as_float, flag
from autoprec.tune.records import Measured

if TYPE_CHECKING:  # matplotlib only where a plot is drawn
    from matplotlib.figure import Figure

    from autoprec.tune.sweeper import BudgetRow, SweepResult

PathT = TypeVar("PathT", str, Path)  # a plot returns the path it was given


def _figure(figsize: tuple[float, float]) -> Figure:
    """A Figure of its own, drawn without pyplot: no backend chosen, no window, no state left in the process."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def _heat_cells(
    table: pd.DataFrame, layers: list[str], formats: list[str]
) -> tuple[list[list[float]], list[list[float]], list[list[str]]]:
    """Per (layer, format): SQNR (dB), metric drop, and a label of what went wrong, if anything."""
    sqnr = [[math.nan] * len(formats) for _ in layers]
    drop = [[math.nan] * len(formats) for _ in layers]
    mark = [[""] * len(formats) for _ in layers]
    for _, r in table.iterrows():
        i, j = layers.index(r["layer"]), formats.index(r["format"])
        if r["status"] != "ok":
            mark[i][j] = "n/a"
        elif flag(r["finite"]) is False or flag(r["overflow"]) is True:
            mark[i][j] = "inf/nan"
        elif str(r["metric_source"]).startswith("not measured"):
            mark[i][j] = "ruled out"
        elif r["format"] == "fp32":
            mark[i][j] = "ref"
        else:
            sqnr[i][j], drop[i][j] = as_float(r["sqnr_db"]), as_float(r["metric_drop"])
    return sqnr, drop, mark


def plot_profile(table: pd.DataFrame, path: PathT, *, title: str = "") -> PathT:
    """A heat map, layers by formats: output SQNR (dB) and metric drop, each cell lowered alone.
    Cells that went non-finite or overflowed fp16 are red, formats a layer cannot run are grey, and formats its
    timing already ruled out (not run, so no numbers) say "ruled out"."""
    import numpy as np
    from matplotlib.patches import Rectangle

    layers = list(dict.fromkeys(table["layer"]))
    formats = list(dict.fromkeys(table["format"]))
    sqnr, drop, mark = _heat_cells(table, layers, formats)
    height = 1.2 + 0.45 * len(layers)
    fig = _figure((4 + 2.4 * len(formats), height))
    axes = fig.subplots(1, 2, squeeze=False)
    finite_drops = [abs(d) for row in drop for d in row if not math.isnan(d)]
    span = max(finite_drops + [1e-12])
    panels = [
        (axes[0][0], sqnr, "viridis", 0.0, 80.0, "output SQNR (dB)", lambda v: f"{v:.0f}"),
        (axes[0][1], drop, "coolwarm", -span, span, "metric drop", lambda v: f"{v:.3g}"),
    ]
    for ax, values, cmap, vmin, vmax, label, text in panels:
        data = np.ma.masked_invalid(np.array(values, dtype=float))
        image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_facecolor("#dddddd")
        fig.colorbar(image, ax=ax, label=label, fraction=0.05)
        ax.set_xticks(range(len(formats)), formats, rotation=30, ha="right")  # the fp8 recipes' long names overlap level
        ax.set_yticks(range(len(layers)), layers)
        ax.set_title(label)
        for i in range(len(layers)):
            for j in range(len(formats)):
                if mark[i][j] == "inf/nan":
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, color="#d62728", hatch="//", fill=True, alpha=0.8))
                if mark[i][j]:
                    ax.text(j, i, mark[i][j], ha="center", va="center", fontsize=8, color="black")
                elif not math.isnan(values[i][j]):
                    ax.text(
                        j,
                        i,
                        text(values[i][j]),
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if cmap == "viridis" else "black",
                    )
    fig.suptitle(title or "each layer lowered alone")
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return path


LEGEND_LAYERS = 12  # beyond this, grad_ranges.png names only the layers that bound the recommended range


def plot_grad_ranges(grad_ranges: pd.DataFrame, advice: ScaleAdvice | None, path: PathT, *, title: str = "") -> PathT:
    """Per layer, the fraction of its nonzero gradient elements fp16 flushes to zero (solid) and overflows
    (dashed) against the loss scale; the recommended range shaded."""
    rows = grad_ranges[(grad_ranges["tensor"] == "all") & (grad_ranges["format"] == "fp16")]
    fig = _figure((10, 4.5))
    ax = fig.subplots()
    layers = list(dict.fromkeys(rows["layer"]))
    named = layers
    if len(layers) > LEGEND_LAYERS:  # a legend of every layer would not fit: name those that bound the range
        bounding = [
            *(advice.low_limited_by if advice else ()),
            *(advice.high_limited_by if advice else ()),
            *(advice.unfit if advice else ()),
        ]
        named = list(dict.fromkeys(n for n in bounding if n in layers))[:LEGEND_LAYERS]
    for name, group in rows.groupby("layer", sort=False):
        if name not in named:
            ax.plot(group["scale_log2"], group["underflow"], "-", color="#bbbbbb", linewidth=0.6)
            ax.plot(group["scale_log2"], group["overflow"], "--", color="#bbbbbb", linewidth=0.6)
    for i, name in enumerate(named):
        group, color = rows[rows["layer"] == name], f"C{i % 10}"
        ax.plot(group["scale_log2"], group["underflow"], "-", color=color, label=f"{name} underflow")
        ax.plot(group["scale_log2"], group["overflow"], "--", color=color, label=f"{name} overflow")
    if len(named) < len(layers):
        ax.plot([], [], color="#bbbbbb", label=f"{len(layers) - len(named)} other layers")
    if advice is not None and advice.search_range:
        lo, hi = advice.search_range
        ax.axvspan(lo - 0.5, hi + 0.5, color="green", alpha=0.12, label=f"recommended 2^{lo}..2^{hi}")
    ax.set_xlabel("loss scale (log2)")
    ax.set_ylabel("fraction of nonzero gradient elements")
    # symlog: a 0.1% underflow or the first overflowing elements matter as much as the bulk
    ax.set_yscale("symlog", linthresh=1e-5)
    ax.set_ylim(0, 1.05)
    ax.set_title(title or "fp16 gradients: below 2^-24 (solid), above 65504 (dashed)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return path


def plot_all(prof: Profile, out_dir: str | Path, *, title: str = "") -> list[Path]:
    """profile.png (heat map) and, with gradient ranges, grad_ranges.png, under out_dir."""
    folder = Path(out_dir)
    paths = [plot_profile(prof.table, folder / "profile.png", title=title)]
    if prof.grad_ranges is not None:
        paths.append(plot_grad_ranges(prof.grad_ranges, prof.advice(), folder / "grad_ranges.png", title=title))
    return paths


def plot_pareto(result: SweepResult, path: PathT, *, title: str = "") -> PathT:
    """Every timed trial (speedup, or peak memory for a memory sweep, against metric drop), the Pareto front,
    the budgets, and each budget's re-measured choice beside uniform bf16. Where peak memory was measured, the
    trials are coloured by it."""
    # `table` and `timed` annotated: mypy defers this function (an import cycle through sweeper) and then
    # cannot infer them for the comprehension below
    trials, front = result.trials, result.front
    table: list[BudgetRow] = result.table
    first = next(iter(result.policies.values()), None)
    by_memory = first is not None and Measured.of(first).objective == "memory"
    fig = _figure((8.8, 5))
    ax = fig.subplots()
    timed: pd.DataFrame = (
        trials[trials.get("feasible", pd.Series(dtype=bool)).eq(True)] if "feasible" in trials else trials.iloc[0:0]
    )
    mib = float(MIB)

    def y_of(frame: pd.DataFrame) -> Any:
        return frame["peak_bytes"].astype(float) / mib if by_memory else frame["speedup"]

    peaks = timed["peak_bytes"].astype(float) / mib if "peak_bytes" in timed else pd.Series(math.nan, index=timed.index)
    shown = timed[peaks.notna()] if by_memory else timed  # a memory plot has no place for a trial without a peak
    ax.scatter(
        shown["metric_drop"], y_of(shown) if len(shown) else [], s=14, color="#999999", label="trials (timed in the study)"
    )
    if not by_memory and peaks.notna().any():  # coloured by peak where measured; grey beneath: trials without a measured peak
        dots = ax.scatter(timed["metric_drop"], timed["speedup"], s=16, c=peaks, cmap="viridis_r", plotnonfinite=False)
        fig.colorbar(dots, ax=ax, label="peak memory per step (MiB)", fraction=0.05)
    if len(front):
        ax.step(front["metric_drop"], y_of(front), where="post", color="C0", label="Pareto front (trials)")
    for i, r in enumerate(table):
        ax.axvline(r.budget, color="C3", linestyle=":", linewidth=1, label="budgets" if i == 0 else None)
    chosen_y = [(r.peak_bytes if r.peak_bytes is not None else math.nan) / mib if by_memory else r.speedup for r in table]
    ax.scatter([r.metric_drop for r in table], chosen_y, marker="*", s=160, color="C3", zorder=3,
               label="chosen per budget (re-measured)")  # fmt: skip
    bf16 = result.finals.get(BF16)
    if bf16 is not None:
        y = (bf16.peak_bytes or math.nan) / mib if by_memory else bf16.speedup
        ax.scatter([bf16.metric_drop], [y], marker="s", s=50, color="C2", zorder=3, label="uniform bf16 (re-measured)")
    fp32 = result.finals.get("fp32")
    if not by_memory:
        ax.axhline(1.0, color="black", linewidth=0.6)
    elif fp32 is not None and fp32.peak_bytes:
        ax.axhline(fp32.peak_bytes / mib, color="black", linewidth=0.6, label="fp32's peak")
    # Drops often sit orders of magnitude below the budgets: symlog shows both, and negative drops too.
    values = [
        abs(float(v)) for v in (*timed["metric_drop"], *(r.budget for r in table)) if float(v) != 0 and math.isfinite(float(v))
    ]
    if values:
        ax.set_xscale("symlog", linthresh=10 ** math.floor(math.log10(min(values))))
    ax.set_xlabel("metric drop from fp32 (lower is better; symmetric log scale)")
    ax.set_ylabel("peak memory per training step (MiB)" if by_memory else "training-step speedup over fp32")
    ax.set_title(title or ("peak memory" if by_memory else "speedup") + " against metric drop", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return path
