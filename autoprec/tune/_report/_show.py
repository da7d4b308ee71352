"""A policy for a person (`autoprec show`, show_policy): each layer's format and what the profile ruled out for it
(LayerTable), the loss scale, and its `measured` block (the results it was chosen among, on what, how); the pieces
of it the search and sweep summaries (_report.py) show too."""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from autoprec.errors import printable
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune._core._goal import recorded_goal
from autoprec.tune._core._memory import format_change, human_bytes
from autoprec.tune._core._names import ALTERNATIVES
from autoprec.tune._core._profile_row import as_float
from autoprec.tune._core._records import Measured
from autoprec.tune._core._tables import WIDTH, markdown_table, markdown_text, text_table
from autoprec.tune._decide._choose import FEWER_LOWERED, WITHOUT_GATHER
from autoprec.tune._measure._choices import role
from autoprec.tune._measure._coverage import Coverage
from autoprec.tune._measure._timing import spread_text


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
        self.named: list[str] = []  # a shared row's layers too many to list in its cell: each named under the table
        for (label, value, key), members in rows.items():
            cell = ", ".join(self._tag(f, [r[f] for _, r in members]) for f, _ in key)
            names = [n for n, _ in members]
            shown, counted = _layers_label(label, names)
            if counted:
                self.named.append(f"{shown}: {', '.join(map(_layer_name, names))}")
            self.rows.append([shown, value, cell])

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
        lines = ([SLOWER_NOTE] if self.slower else []) + lines + self.named
        return [textwrap.fill(line, WIDTH, subsequent_indent="    ") for line in lines]

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


SHARED_ROW_NAMES = 40  # characters of layer names a shared row lists before it counts them (and names them below)


def _layers_label(label: str, names: list[str]) -> tuple[str, bool]:
    """A row's layer cell, and whether it counts layers it does not name (LayerTable names them under the table)."""
    if len(names) == 1:
        return _layer_name(names[0]), False
    if label:
        return f"{label} ({len(names)} layers)", False
    listed = ", ".join(_layer_name(n) for n in names)
    if len(listed) <= SHARED_ROW_NAMES:
        return listed, False
    return f"{_layer_name(names[0])} and {len(names) - 1} more like it", True


def layer_rows(policy: Policy) -> list[list[str]]:
    """LayerTable's rows (its legend apart)."""
    return LayerTable(policy).rows


def _number_ranges(texts: Sequence[str]) -> str:
    """Texts equal but for their numbers, as the first one with each number that varies shown as min-max."""
    columns = list(zip(*(_NUMBER.findall(t) for t in texts)))
    spans = iter(c[0] if len(set(c)) == 1 else f"{min(c, key=float)}-{max(c, key=float)}" for c in columns)
    return _NUMBER.sub(lambda _: next(spans), texts[0])


_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _saved(value: float | None) -> str:
    saving = as_float(value)
    return format_change(None if math.isnan(saving) else saving)


def result_rows(policy: Policy) -> list[list[object]]:
    """One row per result; the memory columns only where some result has a measured peak; the goal's estimate last,
    where it made one (result_headers names them)."""
    m = Measured.of(policy)
    results = m.results
    peaks = any(r.peak_bytes is not None for r in results.values())
    estimates = estimate_of(m) is not None  # one rule for the column, here and in result_headers
    return [
        [
            name,
            as_float(r.metric),
            as_float(r.metric_drop),
            as_float(r.step_ms),
            spread_text(as_float(r.spread)),
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
    return [*headers[:5], "speedup here", *headers[6:], estimate_column(est)]


def estimate_column(est: Mapping[str, Any]) -> str:
    """The estimate's column header: the record's own ("predicted b200"), or that of a file from before it had one."""
    column = est.get("column")
    return column if isinstance(column, str) else f"est. {est.get('target', '?')} (FLOPs)"


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
    rated = ", ".join(f"{k} {_rate(v)}" for k, v in rates.items()) if isinstance(rates, Mapping) else "?"
    detail = est.get("detail")
    return [
        f"estimate: {m.chosen or 'the policy'}: {est['what']}; {detail}"
        if isinstance(detail, str)  # the step-time predictor's record says what it priced
        else f"estimate: {m.chosen or 'the policy'}: {est['what']}; 1.0 = {est.get('baseline', 'all-bf16')}'s GEMM time on "
        f"{est.get('device', est.get('target', '?'))}; counted: {est.get('counted', '?')}; nominal dense TFLOP/s: {rated} "
        f"({est.get('source', '?')})",
        f"speedup here: step times measured on this machine ({m.device or '?'}), not on {est.get('target', 'the target')}",
    ]


def _rate(value: object) -> str:
    """A rate from a policy file, which a hand may have edited: a number as such, anything else as '?'."""
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


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
        policy = dataclasses.replace(policy, measured=_printable_tree(policy.measured))
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
    for phase in policy.phases:  # the table above is the run's first part; each phase what changes from its share on
        changed = ", ".join(f"{name or '<model>'} {fmt}" for name, fmt in phase.layers.items())
        parts.append(say(f"from {phase.from_fraction:.4g} of the run: {changed}"))
    gather = gather_line(policy)
    if gather:
        parts.append(say(gather))
    used = sorted(policy.formats, key=list(Format).index)
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
                + (f"; {layout_text(m)}" if layout_text(m) else "")
            )
        )
        if coverage_line(m):
            parts.append(say(coverage_line(m) or ""))
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


def coverage_line(m: Measured) -> str | None:
    """What the search left in the model root's format (`measured.coverage`), where that is much of the step (a MoE's
    fused experts); None otherwise."""
    cover = Coverage.from_dict(m.coverage)
    return f"outside the search: {cover.sentence()}" if cover is not None and cover.worth_saying else None


def layout_text(m: Measured) -> str | None:
    """The layout a sharded search measured on (`measured.layout`), in words; None where it measured on one device."""
    layout = m.layout
    if not layout:
        return None
    mesh = layout.get("mesh")
    shape = "x".join(map(str, mesh)) if isinstance(mesh, (list, tuple)) else "?"
    return f"sharded over {layout.get('world_size', '?')} ranks (mesh {shape}, by {layout.get('parallelize', '?')})"


def gather_line(policy: Policy) -> str | None:
    """The policy's FSDP2 fp8 all-gather in a line for a person, or None where it does not gather in fp8."""
    if not policy.fp8_all_gathered:
        return None
    gathered = ", ".join(sorted(map(str, policy.fp8_all_gathered)))
    return (
        f"FSDP2: the weights of the {gathered} layers all-gathered in fp8 (apply_policy does it; call "
        "autoprec.after_optimizer_step(model) after each optimizer step)"
    )


def _kind(m: Measured) -> str:
    """What a choice among ties is, from the decision's own reason (choose.choose's `why`): the alternative the user
    would run anyway, the one with fewer fp16/fp8 layers or fewer layers below fp32 or without FSDP2's fp8 all-gather, a
    smaller budget's choice the step times put above this budget's pick, or simply the fastest measured."""
    why = m.why or ""
    if "the safer one" in why:
        return "safer one"
    if why.endswith(FEWER_LOWERED):
        return f"one with {FEWER_LOWERED}"
    if why.endswith(WITHOUT_GATHER):
        return "one without FSDP2's fp8 all-gather"
    if why.startswith("kept from the smaller budget"):
        return "smaller budget's choice"
    if m.chosen in {*ALTERNATIVES, m.greedy}:
        return "alternative"
    return "fastest measured"


def _names(names: Sequence[str]) -> str:
    sep = "; " if any("," in n for n in names) else ", "  # "trial 5, fp16/fp8 -> bf16" is one name
    shown = sep.join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return shown
