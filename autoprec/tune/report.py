"""Tables a person can read: console text and markdown for policies, profiles and search results. The figures are
plots.py's."""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from autoprec.errors import printable
from autoprec.formats import FP16_MAX, Format
from autoprec.policy import ROOT, Policy
from autoprec.tune.alternatives import ALTERNATIVES, BF16, TF32
from autoprec.tune.choices import role
from autoprec.tune.config import BREAK_ROWS, BREAK_SQNR_DB_16BIT, BREAK_SQNR_DB_FP8, NOISY_SPREAD
from autoprec.tune.cost import cost_rows
from autoprec.tune.goals import recorded_goal
from autoprec.tune.gradients import ScaleAdvice
from autoprec.tune.memory import format_change, human_bytes
from autoprec.tune.profile_data import NO_KERNEL, SQNR_COLUMNS, as_float, flag
from autoprec.tune.records import Finals, Measured, Measurement

if TYPE_CHECKING:  # the results import this module to print themselves
    from autoprec.tune.out_dir import SavedProfile
    from autoprec.tune.searcher import SearchResult
    from autoprec.tune.sweeper import SweepResult

WIDTH = 120  # columns a printed table keeps to (text_table wraps its last column to fit)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:.4g}"
    return str(value)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, width: int = WIDTH) -> str:
    """A plain aligned table; numbers right-aligned; a last column of text that would run past `width` columns
    is wrapped onto continuation lines under itself."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows) for i in range(len(headers))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if headers and not numeric[-1] and indent + widths[-1] > width:
        widths[-1] = max(len(headers[-1]), width - indent, 20)

    def line(values: Sequence[str]) -> list[str]:
        *rest, last = values
        parts = [last] if numeric[-1] else (textwrap.wrap(last, widths[-1], break_on_hyphens=False) or [""])
        first = "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip([*rest, parts[0]], widths, numeric))
        return [first.rstrip()] + [(" " * indent + p).rstrip() for p in parts[1:]]

    out = line(headers) + line(["-" * w for w in widths])
    for r in cells:
        out += line(r)
    return "\n".join(out)


# A recorded name or value (a policy's measured block, a candidate's error) is text, never markdown or HTML: `<`, `>` and
# `&` as entities, backticks (a code span) and `|` (a table's next cell) and `\` (which would escape what follows) escaped
_MARKDOWN = str.maketrans({"\\": "\\\\", "`": "\\`", "|": "\\|", "<": "&lt;", ">": "&gt;", "&": "&amp;"})


def markdown_text(text: str) -> str:
    """`text` shown as itself in markdown: no HTML, no code span, no table cell ends inside it."""
    return text.translate(_MARKDOWN)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; every cell escaped (markdown_text), its line breaks as spaces (a break would end the row)."""

    def cell(value: object) -> str:
        return " ".join(markdown_text(_cell(value)).splitlines())

    out = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(out)


def _layer_name(name: str) -> str:
    return "(model root: all else)" if name == ROOT else name


COMPACT_ABOVE = 24  # layers: beyond this, the layers of one block role that agree share a row
_SLOWER = re.compile(r"^measured (?P<ratio>[\d.]+)x the layer's fp32 time on this device$")
SLOWER_NOTE = "Nx: the profile measured the layer N times slower in that format than in fp32 on this device"


class LayerTable:
    """The policy's layers as rows [layer, format, what the profile ruled out] and a legend: each reason is said once,
    as [k] in the rows, and a slowdown as its factor (fp8 3.2x). Layers with the same format and the same ruled-out
    cell share a row; in a policy of more than COMPACT_ABOVE layers, so do the layers of one role (`blocks.*.attn.q`)
    whose cells differ only in numbers, which show as their range (1.31-1.34x)."""

    def __init__(self, policy: Policy):
        excluded = Measured.of(policy).excluded
        self.legend: dict[str, int] = {}
        self.slower = False
        compact = len(policy.layers) > COMPACT_ABOVE
        # grouped by the reasons themselves (numbers masked in compact mode), before any legend number is given
        rows: dict[tuple, list[tuple[str, dict[str, str]]]] = {}
        for name, fmt in policy.layers.items():
            # the format a layer runs in is not "ruled out" for it: a whole policy (uniform bf16, an alternative) was
            # measured and chosen over the profile's single-layer verdict
            reasons = {f: why for f, why in excluded.get(name, {}).items() if f != fmt.value}
            label = role(name) if compact and name != ROOT else ""
            key = tuple((f, _NUMBER.sub("#", why) if compact else why) for f, why in reasons.items())
            rows.setdefault((label, fmt.value, key), []).append((name, reasons))
        self.rows = []
        for (label, value, key), members in rows.items():
            cell = ", ".join(self._tag(f, [r[f] for _, r in members]) for f, _ in key)
            self.rows.append([_layers_label(label, [n for n, _ in members]), value, cell])

    def _tag(self, fmt: str, whys: list[str]) -> str:
        """`fmt`'s cell for a row: its slowdown (a range over the row's layers), or [k] of its reason in the legend."""
        slower = [_SLOWER.match(why) for why in whys]
        if all(slower):
            self.slower = True
            ratios = sorted(float(m["ratio"]) for m in slower if m)
            span = f"{ratios[0]:.3g}" if ratios[0] == ratios[-1] else f"{ratios[0]:.3g}-{ratios[-1]:.3g}"
            return f"{fmt} {span}x"
        texts = [why[len(fmt) + 1 :] if why.startswith(fmt + " ") else why for why in whys]  # "fp8 needs", "fp8-rowwise needs"
        text = _number_ranges(texts)
        return f"{fmt} [{self.legend.setdefault(text, len(self.legend) + 1)}]"

    def notes(self) -> list[str]:
        """The legend's lines, each reason once."""
        lines = [f"[{k}] {text}" for text, k in self.legend.items()]
        return [textwrap.fill(line, WIDTH, subsequent_indent="    ") for line in ([SLOWER_NOTE] if self.slower else []) + lines]

    def render(self, *, markdown: bool = False) -> str:
        table = (
            markdown_table(["layer", "format", "ruled out by the profile"], self.rows)
            if markdown
            else text_table(["layer", "format", "ruled out by the profile"], self.rows)
        )
        notes = self.notes()
        if not notes:
            return table
        if markdown:
            return "\n".join([table, "", *(f"- {markdown_text(line)}" for line in notes)])
        return "\n".join([table, "", *notes])


SHARED_ROW_NAMES = 40  # characters of layer names a shared row lists before it counts them instead


def _layers_label(label: str, names: list[str]) -> str:
    if len(names) == 1:
        return _layer_name(names[0])
    if label:
        return f"{label} ({len(names)} layers)"
    listed = ", ".join(_layer_name(n) for n in names)
    return listed if len(listed) <= SHARED_ROW_NAMES else f"{_layer_name(names[0])} and {len(names) - 1} more like it"


def layer_rows(policy: Policy) -> list[list[str]]:
    """LayerTable's rows (its legend apart)."""
    return LayerTable(policy).rows


def _number_ranges(texts: Sequence[str]) -> str:
    """Texts equal but for their numbers, as the first one with each number that varies shown as min-max."""
    columns = list(zip(*(_NUMBER.findall(t) for t in texts)))
    spans = iter(c[0] if len(set(c)) == 1 else f"{min(c, key=float)}-{max(c, key=float)}" for c in columns)
    return _NUMBER.sub(lambda _: next(spans), texts[0])


_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _spread(value: float | None) -> str:
    spread = as_float(value)
    return "-" if math.isnan(spread) else f"±{100 * spread / 2:.1f}%"


def _saved(value: float | None) -> str:
    saving = as_float(value)
    return format_change(None if math.isnan(saving) else saving)


def result_rows(policy: Policy) -> list[list[object]]:
    """One row per result; the memory columns only where some result has a measured peak; the goal's estimate last,
    where it made one (result_headers names them)."""
    results = Measured.of(policy).results
    peaks = any(r.peak_bytes is not None for r in results.values())
    estimates = any(r.estimate is not None for r in results.values())
    return [
        [
            name,
            as_float(r.metric),
            as_float(r.metric_drop),
            as_float(r.step_ms),
            _spread(r.spread),
            as_float(r.speedup),
            *((human_bytes(r.peak_bytes), _saved(r.memory_saving)) if peaks else ()),
            *((as_float(r.estimate),) if estimates else ()),
        ]
        for name, r in results.items()
    ]


RESULT_HEADERS = ["", "metric", "drop", "step ms", "spread", "speedup", "peak memory", "vs fp32"]


def result_headers(policy: Policy) -> list[str]:
    """result_rows' headers: where the goal estimated (measured.estimate), the speedup is this machine's and the
    estimate's column says on which target, and that it is one."""
    m = Measured.of(policy)
    peaks = any(r.peak_bytes is not None for r in m.results.values())
    headers = RESULT_HEADERS[:6] + (RESULT_HEADERS[6:] if peaks else [])
    est = estimate_of(m)
    if est is None:
        return headers
    return [*headers[:5], "speedup here", *headers[6:], f"est. {est.get('target', '?')} (FLOPs)"]


def estimate_of(m: Measured) -> Mapping[str, Any] | None:
    """measured.estimate where the policy's goal made one (the FLOP goal's), else None."""
    return m.estimate if m.estimate and isinstance(m.estimate.get("what"), str) else None


def estimate_lines(m: Measured) -> list[str]:
    """What a report says of an estimate: what it is, what it counts and from where, and that the step times are this
    machine's, not the target's."""
    est = estimate_of(m)
    if est is None:
        return []
    rates = est.get("tflops")
    rated = ", ".join(f"{k} {v:g}" for k, v in rates.items()) if isinstance(rates, Mapping) else "?"
    return [
        f"estimate: {m.chosen or 'the policy'}: {est['what']}; 1.0 = {est.get('baseline', 'all-bf16')}'s GEMM time on "
        f"{est.get('device', est.get('target', '?'))}; counted: {est.get('counted', '?')}; nominal dense TFLOP/s: {rated} "
        f"({est.get('source', '?')})",
        f"speedup here: step times measured on this machine ({m.device or '?'}), not on {est.get('target', 'the target')}",
    ]


def memory_text(m: Measured) -> str:
    """How peak memory was measured, and the limit, for the line under a results table."""
    limit = f"; --max-memory {human_bytes(m.max_memory)} ({m.max_memory:,} bytes)" if m.max_memory else ""
    chosen = recorded_goal(m.objective)  # None: a goal not registered here, which a report says nothing about
    goal = f"; chosen for {chosen.chosen_for}" if chosen is not None and chosen.chosen_for else ""
    return f"peak memory: {m.memory or 'not recorded'}{limit}{goal}; vs fp32: the peak's change from all-fp32's"


def _by_speed(m: Measured) -> bool:
    """Whether the goal a policy was chosen for (measured.objective) ranks by the measured speed (Goal.ranks_by_speed);
    False for a goal not registered here (goals.recorded_goal)."""
    goal = recorded_goal(m.objective)
    return goal is not None and goal.ranks_by_speed


def mode_text(m: Measured) -> str:
    """`weights mode`, or `train mode: 50 steps, noise floor 0.01` from a policy's `measured` block."""
    if m.mode != "train":
        return f"{m.mode} mode"
    floor = "-" if m.noise_floor is None else f"{m.noise_floor:.4g}"
    return f"train mode: {m.train_steps if m.train_steps is not None else '?'} steps, noise floor {floor}"


def _budget(m: Measured) -> str:
    return m.budget_given or (f"{m.budget:g}" if m.budget is not None else "?")


def _printable_tree(value: Any, depth: int = 4) -> Any:
    """`value` with every string in it, key or value, escaped (errors.printable), `depth` mappings down: what
    show prints lies at most three down (results.<name>.error); deeper, nothing is printed."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, Mapping) and depth > 0:
        return {_printable_tree(k, 0): _printable_tree(v, depth - 1) for k, v in value.items()}
    return value


def show_policy(policy: Policy, *, markdown: bool = False) -> str:
    """A policy for a person: each layer's format, the loss scale, and what it was measured on. A received
    policy's text is printed escaped: a control character in it cannot set the title or clear the screen, and in
    markdown, no name or value is HTML or markup (markdown_text)."""
    table = markdown_table if markdown else text_table
    say = markdown_text if markdown else str  # the lines between the tables, which escape their own cells
    if policy.measured:
        policy = Policy(layers=policy.layers, loss_scale=policy.loss_scale, measured=_printable_tree(policy.measured))
    parts = [LayerTable(policy).render(markdown=markdown)]
    ls = policy.loss_scale
    scaler = (
        "off (no fp16 layer)"
        if not policy.uses_fp16
        else (
            f"init {ls.init_scale:g}, growth x{ls.growth_factor:g} every {ls.growth_interval} clean steps, "
            f"backoff x{ls.backoff_factor:g}, {'dynamic' if ls.dynamic else 'static'}"
        )
    )
    parts.append(say(f"loss scaling: {scaler}"))
    used = sorted(set(policy.layers.values()), key=list(Format).index)
    if used:
        parts.append(say("formats: " + "; ".join(f"{f} = {f.spec.inside}" for f in used)))
    if policy.measured:
        m = Measured.of(policy)
        parts.append(
            say(
                f"measured on {m.device or '?'} for {m.model or '?'}; metric {m.metric or '?'}, "
                f"budget {_budget(m)} ({mode_text(m)}); "
                + (
                    f"fp8: {m.fp8 or '?'}; " if any(f.spec.is_fp8 for f in policy.layers.values()) else ""
                )  # only where it runs fp8
                + f"step times {'compiled' if m.compiled else 'eager'}"
            )
        )
        if m.not_separated:
            parts.append(
                say(
                    f"not separated: the step times measured could not tell {m.chosen or 'this policy'} from "
                    f"{_names(list(m.not_separated))} (inside their spread); it was chosen as the {_kind(m)}, and is "
                    "not shown faster than them"
                )
            )
        parts.extend(say(line) for line in estimate_lines(m))
        if m.results:
            rows = result_rows(policy)
            parts.append(table(result_headers(policy), rows))
            parts.extend(say(f"{n} failed: {r.error}") for n, r in m.results.items() if r.error)
            parts.append(say(f"step time: {m.timing or ''}; speedup = fp32 step time / step time"))
            if m.memory:
                parts.append(say(memory_text(m)))
        if m.versions:
            parts.append(say("versions: " + ", ".join(f"{k} {v}" for k, v in m.versions.items())))
    return "\n\n".join(parts)


def profile_summary(table: pd.DataFrame, *, markdown: bool = False) -> str:
    """Per layer: each format's output SQNR, metric drop and time relative to fp32."""
    fmt_table = markdown_table if markdown else text_table
    formats = list(dict.fromkeys(table["format"]))
    headers = ["layer", "type", "shape"] + [f"{f} {k}" for f in formats if f != "fp32" for k in ("dB", "drop", "x time")]
    headers.insert(3, "fp32 ms")
    rows = []
    for name, group in table.groupby("layer", sort=False):
        by = {r["format"]: r for _, r in group.iterrows()}
        first = group.iloc[0]
        row: list[object] = [name, first["type"], first["shape"], float(by["fp32"]["time_ms"])]
        for f in formats:
            if f == "fp32":
                continue
            r = by.get(f)
            if r is None or r["status"] != "ok":
                row += ["n/a", "", ""]
                continue
            speed: object = NO_KERNEL if r["timed_as"] == NO_KERNEL else float(r["time_vs_fp32"])
            if flag(r["finite"]) is False or flag(r["overflow"]) is True:
                row += ["inf/nan", "", speed]
            elif str(r["metric_source"]).startswith("not measured"):
                row += ["ruled out", "", speed]
            elif str(r["metric_source"]).startswith("predicted"):
                row += [float(r["sqnr_db"]), f"~{float(r['metric_drop']):.3g}", speed]
            else:
                row += [float(r["sqnr_db"]), float(r["metric_drop"]), speed]
        rows.append(row)
    return fmt_table(headers, rows)


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


def breaks(table: pd.DataFrame, budget: float | None = None) -> list[Break]:
    """The GEMMs of the profile (fprop, dgrad, wgrad per layer and format) that break, worst first: non-finite or
    overflowing fp16, then SQNR against fp32 below the format's floor (break_floor), lowest first, then (with a
    `budget`) a single-layer metric drop over it, largest first. A GEMM the layer does not run in fp32 (no gradient
    into the inputs of a first layer) is not judged."""
    runs: dict[str, set[str]] = {}
    for _, r in table[table["format"] == Format.FP32.value].iterrows():
        runs[r["layer"]] = {g for g, col in SQNR_COLUMNS.items() if not math.isnan(as_float(r.get(col)))}
    found: list[Break] = []
    for _, r in table.iterrows():
        fmt, layer = str(r["format"]), str(r["layer"])
        if fmt == Format.FP32.value or r["status"] != "ok":
            continue
        drop, floor, finite = as_float(r.get("metric_drop")), break_floor(fmt), flag(r.get("finite"))
        mine: list[Break] = []
        for gemm, col in SQNR_COLUMNS.items():
            if gemm not in runs.get(layer, set(SQNR_COLUMNS)):
                continue
            sqnr = as_float(r.get(col))
            if gemm == "fprop" and flag(r.get("overflow")) is True:
                why = f"fp16 overflow: max |output| {as_float(r.get('max_abs')):.3g} > {FP16_MAX:g}"
                mine.append(Break(layer, fmt, gemm, sqnr, drop, why, 0))
            elif math.isnan(sqnr):  # measured and non-finite, or not measured (a format ruled out first)
                if finite is False:
                    mine.append(Break(layer, fmt, gemm, sqnr, drop, "non-finite", 0))
            elif sqnr < floor:
                mine.append(Break(layer, fmt, gemm, sqnr, drop, f"below {floor:g} dB", 1))
        if finite is False and not any(b.rank == 0 for b in mine):
            mine.append(Break(layer, fmt, "-", math.nan, drop, "non-finite loss or metric", 0))
        if budget is not None and drop > budget:
            mine.append(Break(layer, fmt, "-", math.nan, drop, f"metric drop over the budget {budget:g}", 2))
        found.extend(mine)
    return sorted(found, key=lambda b: (b.rank, b.sqnr_db if b.rank == 1 else 0.0, -b.metric_drop if b.rank == 2 else 0.0))


def breaks_summary(table: pd.DataFrame, *, budget: float | None = None, limit: int = BREAK_ROWS) -> str:
    """The answer to "which layer breaks?" in a few lines: `breaks`, at most `limit` rows and a count of the rest;
    one line when nothing does."""
    found = breaks(table, budget)
    floors = f"{BREAK_SQNR_DB_FP8:g} dB (fp8) / {BREAK_SQNR_DB_16BIT:g} dB (bf16, fp16)"
    # the other floors of the formats in the table (the block-scaled ones: 20 dB MXFP8, 10 dB NVFP4)
    others: dict[float, list[str]] = {}
    for f in dict.fromkeys(table["format"]):
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
    rows = [[b.layer, b.format, b.gemm, _sqnr_cell(b), _drop_cell(b.metric_drop), b.why] for b in found[:limit]]
    parts = [textwrap.fill(title, WIDTH), text_table(["layer", "format", "GEMM", "SQNR dB", "metric drop", "why"], rows)]
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


def search_summary(result: SearchResult, *, markdown: bool = False) -> str:
    """The end-of-search report: layer formats, then fp32 / uniform bf16 / policy measured side by side."""
    policy = result.policy
    table = markdown_table if markdown else text_table
    parts = [textwrap.fill(headline(result), WIDTH), LayerTable(policy).render(markdown=markdown)]
    finals: Finals = result.finals
    m = Measured.of(policy)
    est = estimate_of(m)
    estimated = est.get("candidates") if est is not None else None
    rows = [
        [
            r.candidate,
            r.metric,
            r.metric_drop,
            r.step_ms,
            _spread(r.spread),
            f"{r.skipped}/{r.steps}",
            r.speedup,
            human_bytes(r.peak_bytes),
            _saved(r.memory_saving),
            _verdict(r),
            *((as_float(estimated.get(r.candidate)),) if isinstance(estimated, Mapping) else ()),
        ]
        for r in finals
    ]
    headers = RESULT_HEADERS[:5] + ["skipped", "speedup", "peak memory", "vs fp32", "within budget"]
    if isinstance(estimated, Mapping):  # the goal's value is an estimate: its column says so, the speedup is here
        headers = [*headers[:6], "speedup here", *headers[7:], f"est. {est.get('target', '?')} (FLOPs)"]  # type: ignore[union-attr]
    parts.append(table(headers, rows))
    parts.extend(estimate_lines(m))
    parts.append(
        f"chosen: {m.chosen}{f' ({m.why})' if m.why else ''}; budget {_budget(m)}, "
        f"metric {m.metric}, {mode_text(m)}; search space {m.search_space or 'per layer'}; "
        f"device: {m.device}; {m.timing}; speedup = fp32 step time / effective step time"
    )
    parts.append(memory_text(m))
    if m.stopped:
        parts.append(f"trials: {m.stopped}")
    parts.extend(_unfit_lines(finals, m))
    noise = result.noise
    if noise is not None:
        parts.append(
            f"noise floor: the fp32 metric after {noise.steps} training steps spans {noise.spread:.4g} over seeds "
            f"0..{len(noise.metrics) - 1} and a repeat of seed 0 ({', '.join(f'{v:.4g}' for v in (*noise.metrics, noise.repeat))})"
            + (
                f"; the budget {m.budget} is below it: the search cannot tell a real loss from noise there"
                if m.budget is not None and m.budget < noise.spread
                else ""
            )
        )
    ls = m.loss_scale_search
    if ls.get("advice"):
        parts.append(
            f"loss scale: {ls['advice']}; searched init scales 2^{ls['init_scale_log2'][0]} .. 2^{ls['init_scale_log2'][1]}"
        )
    for name, why in m.alternatives_not_measured.items():
        parts.append(f"{name}: {why}")
    parts.extend(f"{r.candidate} failed: {r.error}" for r in finals if r.error)
    tf32, picked = finals.get(TF32), finals.get(m.chosen)
    speed = _by_speed(m)  # the notes below are about ranking by speed
    if speed and tf32 is not None and picked is not None and tf32.feasible and tf32.speedup > picked.speedup:
        parts.append(
            f"note: TF32 measured {tf32.speedup / picked.speedup:.2f}x the chosen policy's speed within budget; it is a "
            "process-wide setting, not a per-layer format: torch.set_float32_matmul_precision('high') in your script "
            "also speeds the policy's fp32 layers"
        )
    if speed and finals.noisiest() > NOISY_SPREAD:
        parts.append(
            f"note: step times spread up to {_spread(finals.noisiest())} even over more rounds: too wide to rank "
            "candidates closer than that (they count as ties, and the one with fewer fp16/fp8 layers is chosen); "
            "rerun on a quieter machine with --remeasure"
        )
    ref = finals.get(BF16)
    # the tie the decision recorded (choose.not_separated), not judged again here
    if speed and picked is not None and ref is not None and BF16 in m.not_separated and picked.speedup >= ref.speedup:
        parts.append(
            f"note: {picked.candidate} leads uniform bf16 by {100 * (picked.speedup / ref.speedup - 1):.1f}%, inside "
            f"the measured spread ({100 * (picked.spread + ref.spread) / 2:.1f}%): on this device the two are not told apart"
        )
    overruled = [n for n, f in policy.layers.items() if f.value in m.excluded.get(n, {})]
    if m.chosen == BF16 and overruled:
        parts.append(
            f"note: the policy is the uniform-bf16 baseline, measured as a whole step, though the profile ruled "
            f"out bf16 for {', '.join(map(_layer_name, overruled))} on its own (a layer timed alone is not the whole step)"
        )
    if result.cost:
        parts.append(table(["where the time went", "seconds", "share", "count"], cost_rows(result.cost)))
    return "\n\n".join(parts)


def headline(result: SearchResult) -> str:
    """The summary's first line: what was chosen and how much faster than fp32, or, when the step times could not
    tell it from other candidates within budget, that the answer is a tie inside the noise and what to do."""
    m = Measured.of(result.policy)
    finals: Finals = result.finals
    picked = finals.get(m.chosen)
    if picked is None or not picked.feasible:
        return f"chosen: {m.chosen} ({m.why or 'nothing else within budget'})"
    speed = f"{picked.speedup:.2f}x fp32's training-step speed ({_spread(picked.spread)})"
    est = estimate_of(m)
    if est is not None:  # the goal's value is an estimate for another device: said as one, the step times as here
        return (
            f"chosen: {m.chosen}, {est['what']}, metric drop {picked.metric_drop:.4g} within budget {_budget(m)}; "
            f"on this machine ({m.device}): {speed}"
        )
    tied = tie(m, finals)
    if tied is None:
        return f"chosen: {m.chosen}, {speed}, metric drop {picked.metric_drop:.4g} within budget {_budget(m)}"
    return (
        f"a tie inside the noise: {m.chosen} ({speed}) and {_names(tied.others)} measured within their spread (up to "
        f"{_spread(tied.spread)}): this machine's timing cannot rank them, so {m.chosen}, the "
        f"{tied.kind}, is chosen; {RANK_THEM}"
    )


RANK_THEM = "to rank them, rerun with --remeasure on a quiet machine"


@dataclasses.dataclass(frozen=True)
class Tie:
    """A choice the step times could not tell from other candidates within budget: those (`others`), the widest spread
    among them all, and what the chosen one is among them (`kind`: `_kind`)."""

    chosen: str
    others: list[str]
    spread: float
    kind: str


def tie(m: Measured, finals: Finals) -> Tie | None:
    """The tie a policy's decision recorded (`measured.not_separated`: the pipeline's choose.not_separated at its
    budget), or None where the choice is clear: what a search's first line and a sweep's table both report, so
    that neither judges a tie on its own."""
    picked = finals.get(m.chosen) if m.chosen else None
    if not _by_speed(m) or picked is None or not picked.feasible:
        return None
    others = [n for n in m.not_separated if n in finals.names]
    if not others:
        return None
    spread = max([picked.spread] + [finals.by_name(n).spread for n in others])
    return Tie(chosen=picked.candidate, others=others, spread=spread, kind=_kind(m))


def _kind(m: Measured) -> str:
    """What a choice among ties is, from the decision's own reason (choose.choose's `why`): the alternative the user
    would run anyway, the one with fewer fp16/fp8 layers, a smaller budget's choice the step times put above this
    budget's pick, or simply the fastest measured."""
    why = m.why or ""
    if "the safer one" in why:
        return "safer one"
    if why.startswith("kept from the smaller budget"):
        return "smaller budget's choice"
    if m.chosen in {*ALTERNATIVES, m.greedy}:
        return "alternative"
    return "fastest measured"


def _names(names: Sequence[str]) -> str:
    sep = "; " if any("," in n for n in names) else ", "  # "trial 5, fp16/fp8 -> bf16" is one name
    shown = sep.join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return shown


def _verdict(r: Measurement) -> str:
    if r.feasible:
        return "yes"
    if r.over_memory or r.unshown_to_fit:
        return "no: over --max-memory" if r.over_memory else "no: peak not measured"
    return "no"


def _unfit_lines(finals: Finals, m: Measured) -> list[str]:
    """Which re-measured candidates (the alternatives among them) --max-memory refused, and why."""
    if not m.max_memory:
        return []
    over = [r.candidate for r in finals if r.over_memory]
    unknown = [r.candidate for r in finals if r.unshown_to_fit]
    lines = [f"would not fit --max-memory {human_bytes(m.max_memory)}: {', '.join(over)}"] if over else []
    return lines + ([f"peak memory not measured, so not shown to fit: {', '.join(unknown)}"] if unknown else [])


def gradient_summary(table: pd.DataFrame, advice: ScaleAdvice | None = None, *, markdown: bool = False) -> str:
    """Per layer: its gradient magnitudes, what fp16 (unscaled) and fp8 (dynamic scaling) would lose, and
    the layer's own loss-scale range; then the model's recommended range and the layers that bound it."""
    fmt_table = markdown_table if markdown else text_table
    rows = []
    for name, group in table.groupby("layer", sort=False):
        by = {r["format"]: r for _, r in group.iterrows()}
        first = group.iloc[0]
        fp16, fp8 = by.get("fp16"), by.get("fp8")
        low = as_float(fp16["scale_low_log2"]) if fp16 is not None else math.nan
        high = as_float(fp16["scale_high_log2"]) if fp16 is not None else math.nan
        scale_range = "-" if fp16 is None else ("overflows at 2^0" if math.isnan(high) else f"2^{low:.0f} .. 2^{high:.0f}")
        rows.append(
            [
                name,
                as_float(first["grad_amax"]),
                as_float(first["grad_amin"]),
                _percent(fp16["grad_underflow"]) if fp16 is not None else "-",
                _percent(fp16["grad_overflow"]) if fp16 is not None else "-",
                scale_range,
                _percent(fp8["grad_underflow"]) if fp8 is not None and fp8["status"] == "ok" else "-",
            ]
        )
    headers = ["layer", "max |grad|", "min |grad|", "fp16 underflow", "fp16 overflow", "fp16 loss scale", "fp8 e5m2 underflow"]
    parts = [fmt_table(headers, rows)]
    parts.append(
        "underflow / overflow: fraction of the layer's nonzero gradient elements (weight, output and input "
        "gradients) below fp16's smallest subnormal 2^-24 / above 65504 at loss scale 1; fp8: the gradient "
        "entering the layer cast to e5m2 with per-tensor dynamic scaling. fp16 loss scale: the layer's range."
    )
    if advice is not None:
        parts.append("loss scale: " + advice.describe())
    return "\n\n".join(parts)


def _percent(value: float | None) -> str:
    v = as_float(value)
    return "-" if math.isnan(v) else f"{100 * v:.3g}%"


def sweep_summary(result: SweepResult, *, markdown: bool = False) -> str:
    """The end-of-sweep report: per budget the chosen policy's measured metric and speedup beside uniform
    bf16 and that budget's profile-greedy policy, all re-measured together."""
    table = markdown_table if markdown else text_table
    headers = [
        "budget",
        "chosen",
        "metric",
        "drop",
        "speedup",
        "spread",
        "peak memory",
        "vs fp32",
        "uniform bf16",
        "profile greedy",
        "formats",
        "file",
    ]
    rows, ties = [], []
    for r in result.table:
        mb = Measured.of(result.policies[r.budget])
        tied = tie(mb, result.finals)  # the tie its policy file records, as a search's first line reads it
        others = tied.others if tied else []
        bf16 = _beside(r.uniform_bf16_speedup, r.uniform_bf16_drop > r.budget, BF16 in others)
        greedy = _beside(r.greedy_speedup, r.greedy_drop > r.budget, mb.greedy in others)
        rows.append(
            [
                r.budget_given or r.budget,
                r.chosen + (" (tie)" if tied else ""),
                r.metric,
                r.metric_drop,
                r.speedup,
                _spread(r.spread),
                human_bytes(r.peak_bytes),
                _saved(r.memory_saving),
                bf16,
                greedy,
                f"{r.root} root; {r.formats}",
                r.policy_file,
            ]
        )
        if tied:
            ties.append(
                f"{r.budget_given or f'{r.budget:g}'}: tie with {_names(tied.others)} within {_spread(tied.spread)} "
                f"noise: {tied.chosen}, the {tied.kind}, is written"
            )
    parts = [table(headers, rows)]
    first = next(iter(result.policies.values()), None)
    m = Measured.of(first) if first else Measured()
    parts.append(
        f"speedup: fp32 step time / effective step time, re-measured together ({m.timing or ''}); uniform bf16 and "
        f"profile greedy: their speedups, '(over)' where their drop exceeds that budget; '(tie)': the chosen one and "
        f"those the step times could not tell from it. Study: {len(result.trials)} trials, "
        f"{len(result.front)} on the Pareto front; {result.choices.describe()}; {mode_text(m)}; device {m.device}"
    )
    parts.append(memory_text(m))
    if result.saved is not None:
        parts.append(_profile_line(result.saved))
    parts.extend(_unfit_lines(result.finals, m))
    if ties:
        parts.append(
            f"ties inside the noise (this machine's timing cannot rank them; {RANK_THEM}):\n" + "\n".join(f"- {t}" for t in ties)
        )
    notes = [f"{r.budget:g}: {r.why}" for r in result.table if r.why not in ("the fastest within budget",)]
    if notes:
        parts.append("why:\n" + "\n".join(f"- {n}" for n in notes))
    if result.cost:
        parts.append(table(["where the time went", "seconds", "share", "count"], cost_rows(result.cost)))
    return "\n\n".join(parts)


def _beside(speedup: float, over: bool, tied: bool) -> str:
    """An alternative's speedup beside a budget's choice: `(over)` past that budget, `(tie)` not told from the choice."""
    return f"{speedup:.3f}" + (" (over)" if over else "") + (" (tie)" if tied else "")


def _profile_line(saved: SavedProfile) -> str:
    """Which profile a sweep used: the output folder's (a search's) reused, or its own and why."""
    where = f"{saved.folder.name}/profile.csv" if saved.own else "profile.csv"
    if not saved.measured:
        return f"profile: {where}, reused" + (" (the output folder's own is for other settings)" if saved.own else "")
    if not saved.own:
        return f"profile: measured for this sweep, saved as {where}"
    return (
        f"profile: measured for this sweep, saved as {where}: the output folder's profile.csv does not serve it "
        f"({saved.why_not}) and is left as it was"
    )


def front_rows(front: pd.DataFrame) -> list[list[object]]:
    peaks = front["peak_bytes"] if "peak_bytes" in front else [None] * len(front)
    return [
        [int(r["trial"]), as_float(r["metric_drop"]), as_float(r["speedup"]), _spread(r["spread"]), _bytes_cell(p)]
        for (_, r), p in zip(front.iterrows(), peaks)
    ]


FRONT_HEADERS = ["trial", "metric drop", "speedup", "spread", "peak memory"]


def _bytes_cell(value: float | None) -> str:
    n = as_float(value)
    return human_bytes(None if math.isnan(n) else n)


def search_markdown(result: SearchResult, command: str) -> str:
    """summary.md of a search: the command, the policy and every measured candidate, the profile, the gradients."""
    prof = result.profile
    return (
        f"# autoprec search: {Measured.of(result.policy).model}\n\n`{command}`\n\n"
        f"## Policy and measurements\n\n{search_summary(result, markdown=True)}\n\n"
        f"## Profile (one layer lowered at a time)\n\n{profile_summary(prof.table, markdown=True)}\n\n"
        f"dB: output SQNR against fp32; drop: metric drop with the layer lowered alone (~: predicted, an equal share "
        f"of its group's drop; `ruled out`: not run, the format already was: slower than fp32 beyond "
        f"prune.slower_than, non-finite or overflowing; profile.csv's metric_source says which); x time: the "
        f"layer's forward+backward time over fp32's ({NO_KERNEL}: a format that runs emulated here, not timed).\n\n"
        f"![profile heat map](profile.png)\n\n"
        f"## Gradient ranges\n\n{gradient_summary(prof.table, prof.advice(), markdown=True)}\n\n"
        f"![fp16 gradient underflow and overflow per loss scale](grad_ranges.png)\n"
    )


def sweep_markdown(result: SweepResult, command: str) -> str:
    """sweep.md: the command, the policy per budget, the Pareto plot and front, the profile."""
    name = Measured.of(next(iter(result.policies.values()))).model
    return (
        f"# autoprec sweep: {name}\n\n`{command}`\n\n## Policy per budget\n\n{sweep_summary(result, markdown=True)}\n\n"
        f"![the trials against metric drop](pareto.png)\n\n"
        f"## Pareto front of the study (trial measurements)\n\n"
        f"{markdown_table(FRONT_HEADERS, front_rows(result.front))}\n\n"
        f"## Profile (one layer lowered at a time)\n\n{profile_summary(result.profile.table, markdown=True)}\n"
    )
