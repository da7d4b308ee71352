"""Figures: the profile's heat maps (profile.png), the fp16 gradient ranges (grad_ranges.png) and a sweep's Pareto
plot (pareto.png), drawn with matplotlib, imported only where a figure is drawn. The text tables are _report.py's and _show.py's."""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd

from autoprec.files import write_atomically
from autoprec.tune._core._goal import recorded_goal
from autoprec.tune._core._memory import MIB
from autoprec.tune._core._names import BF16
from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._core._records import Measured
from autoprec.tune._decide._goals import SPEED
from autoprec.tune._measure._choices import role
from autoprec.tune._measure._gradients import ScaleAdvice
from autoprec.tune._measure._profile_data import PREDICTED, UNRUN, Profile, unrun
from autoprec.tune._report._results import BudgetRow, SweepResult

if TYPE_CHECKING:  # matplotlib only where a plot is drawn
    from matplotlib.figure import Figure

    from autoprec.tune._measure._validate import Validation

PathT = TypeVar("PathT", str, Path)  # a plot returns the path it was given


def _figure(figsize: tuple[float, float]) -> Figure:
    """A Figure of its own, drawn without pyplot: no backend chosen, no window, no state left in the process. Laid
    out by constrained layout, which makes room for the labels, legends and colour bars as drawn (tight_layout
    warned "not applied" and cut them off where a name was long)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, layout="constrained")


def _save(fig: Figure, path: PathT) -> PathT:
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    return path


DPI = 110
PROFILE_ROWS = 32  # rows profile.png draws at most: beyond, layers share a row per block role, or the most sensitive show
NAME_CHARS = 44  # a longer layer name is shortened from its front, so that a figure's width stays a screen's
CELL = (0.72, 0.27)  # inches per heat-map cell (width, height): room for "-0.00026" at 7 points
SIDE_BY_SIDE = 12.0  # inches: two panels wider than this are drawn one above the other


def short_names(names: list[str], limit: int = NAME_CHARS) -> list[str]:
    """`names` fit to `limit` characters where some are longer: first the dotted prefix they all share goes (as "…"),
    then a name still too long keeps its tail, the whole dotted parts that fit (what tells layers apart is nearest the
    end: their stage and block indices, their own name). Where that makes two names one, the parts before a name's
    last shorten to their first letter instead, front first, and numbers stay whole (stages.1.layers.0 -> s.1.l.0).
    profile.csv has every name whole."""
    if all(len(n) <= limit for n in names):
        return list(names)
    parts = [n.split(".") for n in names]
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    if shared:
        names = ["\u2026" + ".".join(p[shared:]) for p in parts]
    tails = [_tail(n, limit) for n in names]
    if len(set(tails)) == len(set(names)):
        return tails
    return [_tail(_initials(n, limit), limit) for n in names]


def _tail(name: str, limit: int) -> str:
    """`name`, or where longer than `limit`, "…" and the most whole dotted parts from its end that fit (the last
    part's end where even it does not)."""
    if len(name) <= limit:
        return name
    parts = name.split(".")
    kept = parts[-1]
    for part in reversed(parts[:-1]):
        if len(part) + 1 + len(kept) + 1 > limit:
            break
        kept = f"{part}.{kept}"
    return "\u2026" + (kept if len(kept) < limit else kept[len(kept) - (limit - 1) :])


def _initials(name: str, limit: int) -> str:
    """`name` with its parts before the last shortened to their first letter, front first, until it fits `limit`;
    a number stays whole (it is an index that tells layers apart)."""
    parts = name.split(".")
    for k in range(len(parts) - 1):
        if len(".".join(parts)) <= limit:
            break
        if not parts[k].isdigit():
            parts[k] = parts[k][:1]
    return ".".join(parts)


def _heat_cells(
    rows: Sequence[ProfileRow], layers: list[str], formats: list[str]
) -> tuple[list[list[float]], list[list[float]], list[list[str]], list[list[bool]]]:
    """Per (layer, format): SQNR (dB), metric drop, a label of what went wrong, if anything, and whether the drop is
    predicted (profile.csv's metric_source), not measured."""
    sqnr = [[math.nan] * len(formats) for _ in layers]
    drop = [[math.nan] * len(formats) for _ in layers]
    mark = [[""] * len(formats) for _ in layers]
    predicted = [[False] * len(formats) for _ in layers]
    row_of, column_of = {n: i for i, n in enumerate(layers)}, {f: j for j, f in enumerate(formats)}
    for r in rows:
        i, j = row_of[r.layer], column_of[r.format]
        if r.status != "ok":
            mark[i][j] = unrun(r)
        elif r.finite is False or r.overflow is True:
            mark[i][j] = "inf/nan"
        elif r.metric_source.startswith("not measured"):
            mark[i][j] = "ruled out"
        elif r.format == "fp32":
            mark[i][j] = "ref"
        else:
            sqnr[i][j], drop[i][j] = r.sqnr_db, r.metric_drop
            predicted[i][j] = r.metric_source.startswith(PREDICTED)
    return sqnr, drop, mark, predicted


@dataclasses.dataclass
class HeatRows:
    """What profile.png draws: one row per layer, per block role, or per sensitive layer (`note` says which)."""

    labels: list[str]
    formats: list[str]
    sqnr: list[list[float]]
    drop: list[list[float]]
    mark: list[list[str]]
    predicted: list[list[bool]]  # the drop shown is predicted, not measured: drawn as ~0.01
    note: str = ""


def _sensitivity(drop: list[float], mark: list[str]) -> float:
    """A layer's worst metric drop over its formats; non-finite output counts as the worst of all."""
    if any(m == "inf/nan" for m in mark):
        return math.inf
    return max((d for d in drop if not math.isnan(d)), default=-math.inf)


def _merged(values: list[float], pick: Any) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return pick(finite) if finite else math.nan


def heat_rows(rows: Sequence[ProfileRow], limit: int = PROFILE_ROWS) -> HeatRows:
    """The heat map's rows. Up to `limit` layers, one each; beyond, one per block role (`blocks.*.attn.q`) with the
    worst of its layers in each cell, where that makes `limit` rows or fewer; else the `limit` most sensitive layers
    (largest drop), in model order. A figure of a 1600-layer model stays a screen's size and draws in seconds."""
    layers = list(dict.fromkeys(r.layer for r in rows))
    formats = list(dict.fromkeys(r.format for r in rows))
    sqnr, drop, mark, predicted = _heat_cells(rows, layers, formats)
    if len(layers) <= limit:
        return HeatRows(short_names(layers), formats, sqnr, drop, mark, predicted)
    roles: dict[str, list[int]] = {}
    for i, name in enumerate(layers):
        roles.setdefault(role(name), []).append(i)
    if len(roles) <= limit:
        heat = HeatRows([], formats, [], [], [], [], f"{len(layers)} layers, a row per block role: the worst of its layers")
        for name, members in roles.items():
            heat.labels.append(layers[members[0]] if len(members) == 1 else f"{name} ({len(members)})")
            cells = [
                _merged_cell(
                    [sqnr[i][j] for i in members],
                    [drop[i][j] for i in members],
                    [mark[i][j] for i in members],
                    [predicted[i][j] for i in members],
                )
                for j in range(len(formats))
            ]
            heat.sqnr.append([c[0] for c in cells])
            heat.drop.append([c[1] for c in cells])
            heat.mark.append([c[2] for c in cells])
            heat.predicted.append([c[3] for c in cells])
        heat.labels = short_names(heat.labels)
        return heat
    ranked = sorted(range(len(layers)), key=lambda i: -_sensitivity(drop[i], mark[i]))
    kept = sorted(ranked[:limit])  # in model order
    note = f"the {limit} most sensitive of {len(layers)} layers ({len(layers) - limit} left out; profile.csv has them all)"
    return HeatRows(
        short_names([layers[i] for i in kept]),
        formats,
        [sqnr[i] for i in kept],
        [drop[i] for i in kept],
        [mark[i] for i in kept],
        [predicted[i] for i in kept],
        note,
    )


def _merged_cell(sqnr: list[float], drop: list[float], mark: list[str], predicted: list[bool]) -> tuple[float, float, str, bool]:
    """One block role's cell: any non-finite layer first (how many, where not all), else the worst SQNR and drop
    measured (predicted where the worst drop is), else what kept the layers unmeasured."""
    bad = sum(m == "inf/nan" for m in mark)
    if bad:
        return math.nan, math.nan, "inf/nan" if bad == len(mark) else f"{bad} inf/nan", False
    measured = [k for k, m in enumerate(mark) if not m]
    if measured:
        worst = max((k for k in measured if not math.isnan(drop[k])), key=lambda k: drop[k], default=None)
        guessed = worst is not None and predicted[worst]
        return _merged([sqnr[k] for k in measured], min), _merged([drop[k] for k in measured], max), "", guessed
    return math.nan, math.nan, next(m for m in ("ruled out", *UNRUN, "ref") if m in mark), False


def _text_colour(image: Any, value: float) -> str:
    """Black on a light cell, white on a dark one."""
    r, g, b, _ = image.cmap(image.norm(value))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def profile_figure(rows: Sequence[ProfileRow], *, title: str = "") -> Figure:
    """profile.png's figure (plot_profile)."""
    import numpy as np
    from matplotlib.patches import Rectangle

    heat = heat_rows(rows)
    n, formats = len(heat.labels), heat.formats
    label_w = 0.3 + 0.062 * max(map(len, heat.labels), default=4)  # inches of y tick labels at 8 points
    tilt = max(map(len, formats), default=4) * 0.062 > CELL[0]  # names wider than a cell are tilted
    format_h = 0.35 + (0.062 * max(map(len, formats), default=4) * 0.5 if tilt else 0.0)
    panel_w, panel_h = max(len(formats) * CELL[0], 1.8), max(n * CELL[1], 1.3)
    colour_bar_w = 1.0
    side = label_w + 2 * (panel_w + colour_bar_w) <= SIDE_BY_SIDE
    title_h = 0.5 if not heat.note else 0.7
    if side:
        size = (label_w + 2 * (panel_w + colour_bar_w) + 0.3, panel_h + format_h + 0.3 + title_h)
    else:
        size = (label_w + panel_w + colour_bar_w + 0.3, 2 * (panel_h + format_h + 0.3) + title_h)
    fig = _figure(size)
    axes = list(fig.subplots(1, 2) if side else fig.subplots(2, 1))
    finite_drops = [abs(d) for row in heat.drop for d in row if not math.isnan(d)]
    span = max(finite_drops, default=0.0)
    if span > 0:
        drop_label = "metric drop (red: worse than fp32)"
    else:  # a range of 0 is no range: a colour bar of -1e-12..1e-12 said nothing true
        drop_label = "metric drop: all drops 0" if finite_drops else "metric drop: none measured"
    panels = [
        (axes[0], heat.sqnr, "viridis", 0.0, 80.0, "output SQNR against fp32 (dB)", lambda v: f"{v:.0f}"),
        (axes[1], heat.drop, "coolwarm", -(span or 1.0), span or 1.0, drop_label, lambda v: f"{v:.2g}"),
    ]
    for k, (ax, values, cmap, vmin, vmax, label, text) in enumerate(panels):
        data = np.ma.masked_invalid(np.array(values, dtype=float).reshape(n, len(formats)))
        image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_facecolor("white")  # no number: white, apart from the colour of a drop of 0
        bar = fig.colorbar(image, ax=ax, fraction=0.08, pad=0.02, aspect=max(10, 3 * n))
        bar.set_label(label, fontsize=8)
        bar.ax.tick_params(labelsize=7)
        if not span and values is heat.drop:
            bar.set_ticks([0.0])
        ax.set_xticks(range(len(formats)), formats, fontsize=8, rotation=30 if tilt else 0, ha="right" if tilt else "center")
        ax.set_yticks(range(n), heat.labels if (k == 0 or not side) else [], fontsize=8)
        ax.set_title(label.split(" (")[0] if values is heat.drop else label, fontsize=9)
        for i in range(n):
            for j in range(len(formats)):
                mark, value = heat.mark[i][j], values[i][j]
                if mark.endswith("inf/nan"):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, color="#d62728", hatch="//", fill=True, alpha=0.8))
                if mark:
                    ax.text(j, i, mark, ha="center", va="center", fontsize=7, color="black")
                elif not math.isnan(value):
                    colour = _text_colour(image, min(max(value, vmin), vmax))
                    guessed = "~" if values is heat.drop and heat.predicted[i][j] else ""
                    ax.text(j, i, guessed + text(value), ha="center", va="center", fontsize=7, color=colour)
    heading = title or "each layer lowered alone"
    fig.suptitle(f"{heading}\n{heat.note}" if heat.note else heading, fontsize=10)
    notes = heat_notes(heat)
    if notes:
        fig.supxlabel(textwrap.fill("; ".join(notes), max(40, int(size[0] / 0.055))), fontsize=7, ha="center")
    return fig


def heat_notes(heat: HeatRows) -> list[str]:
    """The footnote of profile.png: what each mark drawn means (only those drawn), and ~ where a drop is predicted."""
    drawn = {m for row in heat.mark for m in row}
    notes = [f"{mark}: {why}" for mark, why in UNRUN.items() if mark in drawn]
    if any(p for row in heat.predicted for p in row):
        notes.append("~: a predicted drop (an equal share of its group's), not measured alone")
    return notes


def plot_profile(rows: Sequence[ProfileRow], path: PathT, *, title: str = "") -> PathT:
    """A heat map, layers down, formats across: output SQNR (dB) and metric drop, each cell lowered alone, the two
    panels side by side where they fit a screen's width, else one above the other. Cells that went non-finite or
    overflowed fp16 are red; formats a layer cannot run say "cannot run", those of a layer the time budget left out
    "not profiled", and formats its timing already ruled out (not run, so no numbers) "ruled out"; a predicted drop
    reads ~0.01; a footnote says what the marks drawn mean. Beyond PROFILE_ROWS layers, rows are block roles or the
    most sensitive layers (heat_rows), said under the title."""
    return _save(profile_figure(rows, title=title), path)


GRAD_TITLE = "fp16 gradients at each loss scale: below 2^-24 (solid), above 65504 (dashed)"
LEGEND_LAYERS = 12  # beyond this, grad_ranges.png names only the layers that bound the recommended range
GREY_LINES = 48  # unnamed layers drawn one line each up to this many; beyond, the range they span, shaded


def grad_ranges_figure(grad_ranges: pd.DataFrame, advice: ScaleAdvice | None, *, title: str = "") -> Figure:
    """grad_ranges.png's figure (plot_grad_ranges)."""
    from matplotlib.lines import Line2D

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
    others = rows[~rows["layer"].isin(named)]
    handles: list[Any] = []
    if len(layers) - len(named) > GREY_LINES:  # a thousand grey lines cost minutes and show a grey mass: their range
        span = others.groupby("scale_log2")[["underflow", "overflow"]].agg(["min", "max"])
        count = len(layers) - len(named)
        handles.append(
            ax.fill_between(
                span.index,
                span[("underflow", "min")],
                span[("underflow", "max")],
                color="#d0d0d0",
                linewidth=0,
                label=f"{count} other layers: underflow range",
            )
        )
        handles.append(
            ax.fill_between(
                span.index,
                span[("overflow", "min")],
                span[("overflow", "max")],
                facecolor="none",
                edgecolor="#999999",
                hatch="///",
                linewidth=0,
                label=f"{count} other layers: overflow range",
            )
        )
    else:
        for _, group in others.groupby("layer", sort=False):
            ax.plot(group["scale_log2"], group["underflow"], "-", color="#bbbbbb", linewidth=0.6)
            ax.plot(group["scale_log2"], group["overflow"], "--", color="#bbbbbb", linewidth=0.6)
        if len(named) < len(layers):
            handles.append(Line2D([], [], color="#bbbbbb", label=f"{len(layers) - len(named)} other layers"))
    for i, (name, label) in enumerate(zip(named, short_names(named))):
        group, color = rows[rows["layer"] == name], f"C{i % 10}"
        ax.plot(group["scale_log2"], group["underflow"], "-", color=color)
        ax.plot(group["scale_log2"], group["overflow"], "--", color=color)
        handles.insert(i, Line2D([], [], color=color, label=label))  # one entry a layer: its solid and dashed lines
    handles += [
        Line2D([], [], color="black", label="underflow (solid)"),
        Line2D([], [], color="black", linestyle="--", label="overflow (dashed)"),
    ]
    if advice is not None and advice.search_range:
        lo, hi = advice.search_range
        handles.append(ax.axvspan(lo - 0.5, hi + 0.5, color="green", alpha=0.12, label=f"recommended 2^{lo}..2^{hi}"))
    ax.set_xlabel("loss scale (log2)")
    ax.set_ylabel("fraction of nonzero gradient elements")
    # symlog: a 0.1% underflow or the first overflowing elements matter as much as the bulk
    ax.set_yscale("symlog", linthresh=1e-5)
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{title}\n{GRAD_TITLE}" if title else GRAD_TITLE, fontsize=9)  # a given title names the model only
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_grad_ranges(grad_ranges: pd.DataFrame, advice: ScaleAdvice | None, path: PathT, *, title: str = "") -> PathT:
    """Per layer, the fraction of its nonzero gradient elements fp16 flushes to zero (solid) and overflows
    (dashed) against the loss scale; the recommended range shaded. Beyond LEGEND_LAYERS layers only those that bound
    the range are named, and beyond GREY_LINES more, the others show as the range they span."""
    return _save(grad_ranges_figure(grad_ranges, advice, title=title), path)


# The figures drawn from a saved profile, beside its files: the heat map, and the gradient ranges where measured
PROFILE_FIGURE, GRAD_RANGES_FIGURE = "profile.png", "grad_ranges.png"
PROFILE_FIGURES = (PROFILE_FIGURE, GRAD_RANGES_FIGURE)


def plot_all(prof: Profile, out_dir: str | Path, *, title: str = "") -> list[Path]:
    """profile.png (heat map) and, with gradient ranges, grad_ranges.png, under out_dir."""
    folder = Path(out_dir)
    paths = [plot_profile(prof.rows, folder / PROFILE_FIGURE, title=title)]
    if prof.grad_ranges is not None:
        paths.append(plot_grad_ranges(prof.grad_ranges, prof.advice(), folder / GRAD_RANGES_FIGURE, title=title))
    return paths


def pareto_figure(result: SweepResult, *, title: str = "") -> Figure:
    """pareto.png's figure (plot_pareto)."""
    # `table` and `timed` annotated: mypy defers this function (an import cycle through sweeper) and then
    # cannot infer them for the comprehension below
    trials, front = result.trials, result.front
    table: list[BudgetRow] = result.table
    first = next(iter(result.policies.values()), None)
    # the goal's axis (Goal.axis: the speedup, the peak memory); by speed for a goal without one, or not registered here
    goal = recorded_goal(Measured.of(first).objective) if first is not None else None
    goal = goal if goal is not None and goal.axis is not None else SPEED
    axis = goal.axis
    assert axis is not None  # SPEED's is set
    fig = _figure((8.8, 5))
    ax = fig.subplots()
    timed: pd.DataFrame = (
        trials[trials.get("feasible", pd.Series(dtype=bool)).eq(True)] if "feasible" in trials else trials.iloc[0:0]
    )
    bf16 = result.finals.get(BF16)
    drops = [float(v) for v in (*timed["metric_drop"], *(r.metric_drop for r in table), *([bf16.metric_drop] if bf16 else []))]
    # every drop 0: an axis of drops would stack every trial in one column, each hiding the last; the trials by number
    flat = len(timed) > 0 and all(d == 0 for d in drops if math.isfinite(d))

    def y_of(frame: pd.DataFrame) -> Any:
        return frame[axis.column].astype(float) / axis.unit

    def value(row: object) -> float:  # a budget's row, a re-measured candidate
        found = getattr(row, axis.column, None)
        return math.nan if found is None else float(found) / axis.unit

    def x_of(frame: pd.DataFrame) -> Any:
        return (frame["trial"] if "trial" in frame else frame.index) if flat else frame["metric_drop"]

    peaks = timed["peak_bytes"].astype(float) / MIB if "peak_bytes" in timed else pd.Series(math.nan, index=timed.index)
    ys = y_of(timed) if axis.column in timed else pd.Series(math.nan, index=timed.index)
    shown = timed[ys.notna()]  # the axis has no place for a trial without a value (a peak not measured)
    ax.scatter(
        x_of(shown),
        y_of(shown) if len(shown) else [],
        s=14,
        color="#999999",
        label="trials (timed in the study)" + (": all drops 0" if flat else ""),
    )
    if axis.column != "peak_bytes" and peaks.notna().any():  # coloured by peak where measured; grey beneath: trials
        dots = ax.scatter(x_of(timed), ys, s=16, c=peaks, cmap="viridis_r", plotnonfinite=False)  # without one
        bar = fig.colorbar(dots, ax=ax, label="peak memory per step (MiB)", fraction=0.05)
        if peaks.nunique() == 1:  # one peak: a scale around it would show differences there are none of
            bar.set_ticks([float(peaks.dropna().iloc[0])])
            bar.set_label(f"peak memory per step: all {float(peaks.dropna().iloc[0]):.3g} MiB")
    if flat:
        best = front if len(front) else timed.iloc[0:0]
        ax.scatter(
            x_of(best),
            y_of(best),
            s=80,
            facecolors="none",
            edgecolors="C0",
            linewidths=1.5,
            zorder=3,
            label=f"Pareto front: {axis.best}",
        )
        budgets = ", ".join(dict.fromkeys(f"{r.budget:g}" for r in table))
        chosen = dict.fromkeys(value(r) for r in table)
        for i, y in enumerate(v for v in chosen if math.isfinite(v)):
            ax.axhline(
                y,
                color="C3",
                linestyle=":",
                linewidth=1.5,
                label=f"chosen for budgets {budgets} (re-measured)" if i == 0 else None,
            )
        if bf16 is not None:
            ax.axhline(value(bf16), color="C2", linestyle="--", linewidth=1.2, label="uniform bf16 (re-measured)")
    else:
        if len(front):
            ax.step(front["metric_drop"], y_of(front), where="post", color="C0", label="Pareto front (trials)")
        for i, r in enumerate(table):
            ax.axvline(r.budget, color="C3", linestyle=":", linewidth=1, label="budgets" if i == 0 else None)
        ax.scatter(
            [r.metric_drop for r in table],
            [value(r) for r in table],
            marker="*",
            s=160,
            color="C3",
            zorder=3,
            label="chosen per budget (re-measured)",
        )
        if bf16 is not None:
            ax.scatter(
                [bf16.metric_drop], [value(bf16)], marker="s", s=50, color="C2", zorder=3, label="uniform bf16 (re-measured)"
            )
    fp32 = result.finals.get("fp32")
    if axis.fp32 is not None:  # fp32's value by definition (a speedup's 1.0)
        ax.axhline(axis.fp32, color="black", linewidth=0.6)
    elif fp32 is not None and math.isfinite(value(fp32)) and value(fp32):  # as re-measured (its peak)
        ax.axhline(value(fp32), color="black", linewidth=0.6, label=axis.fp32_label)
    # Drops often sit orders of magnitude below the budgets: symlog shows both, and negative drops too.
    values = [
        abs(float(v)) for v in (*timed["metric_drop"], *(r.budget for r in table)) if float(v) != 0 and math.isfinite(float(v))
    ]
    if flat:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # trial numbers
        ax.set_xlabel("trial (every metric drop from fp32 is 0: the trials in the order they ran)")
    elif values:
        ax.set_xscale("symlog", linthresh=10 ** math.floor(math.log10(min(values))))
        ax.set_xlabel("metric drop from fp32 (lower is better; symmetric log scale)")
    else:
        ax.set_xlabel("metric drop from fp32 (lower is better)")
    ax.set_ylabel(axis.title)
    what = goal.label
    ax.set_title(title or (f"{what} of each trial: all drops 0" if flat else f"{what} against metric drop"), fontsize=10)
    ax.legend(fontsize=8, loc="best")
    return fig


def plot_pareto(result: SweepResult, path: PathT, *, title: str = "") -> PathT:
    """Every timed trial (speedup, or peak memory for a memory sweep, against metric drop), the Pareto front,
    the budgets, and each budget's re-measured choice beside uniform bf16. Where peak memory was measured, the
    trials are coloured by it. Where every drop is 0, the trials are shown by number, and the legend says so."""
    return _save(pareto_figure(result, title=title), path)


def validation_figure(v: Validation, *, title: str = "") -> Figure:
    """validate.png's figure (plot_validation)."""
    fig = _figure((8.8, 6))
    gap, drop = fig.subplots(2, 1, sharex=True)
    steps = [p.step for p in v.curve]
    gap.plot(steps, [p.policy_loss - p.baseline_loss for p in v.curve], color="tab:blue", label="policy")
    switched = [(p.step, p.switched_loss - p.baseline_loss) for p in v.curve if p.switched_loss is not None]
    if switched:
        gap.plot(*zip(*switched), color="tab:green", label="with the switch")
    gap.axhline(0.0, color="0.6", linewidth=0.8)
    gap.set_ylabel(f"training loss - {v.baseline}'s")
    gap.legend(loc="best", fontsize=8)
    evaluated = [(p.step, p.drop) for p in v.curve if p.drop is not None]
    drop.plot(*zip(*evaluated), "o-", color="tab:blue", label="policy")
    after = [(p.step, p.switched_drop) for p in v.curve if p.switched_drop is not None]
    if after:
        drop.plot(*zip(*after), "o-", color="tab:green", label="with the switch")
    if v.budget is not None:
        drop.axhline(v.budget, color="tab:red", linestyle="--", linewidth=1, label=f"budget {v.budget:.4g}")
    if v.switch is not None:
        for ax in (gap, drop):
            ax.axvline(v.switch.step, color="tab:green", linestyle=":", linewidth=1)
    drop.set_xlabel("training step")
    drop.set_ylabel(f"metric drop from {v.baseline}")
    drop.legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(textwrap.shorten(title, 110), fontsize=10)
    return fig


def plot_validation(v: Validation, path: PathT, *, title: str = "") -> PathT:
    """The loss gap per step and the metric drop at each evaluation, the budget and, where measured, the switch."""
    return _save(validation_figure(v, title=title), path)
