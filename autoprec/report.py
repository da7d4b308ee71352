"""Tables a person can read: console text and markdown for policies, profiles and search results."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from autoprec.policy import ROOT, Policy


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:.4g}"
    return str(value)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned table; numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def _layer_name(name: str) -> str:
    return "(model root: all else)" if name == ROOT else name


def _mapping(value: Any) -> Mapping:
    """`measured` is free-form provenance: show what is well formed, skip the rest."""
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def layer_rows(policy: Policy) -> list[list[str]]:
    excluded = _mapping(_mapping(policy.measured).get("excluded"))
    rows = []
    for name, fmt in policy.layers.items():
        ruled_out = ", ".join(f"{f} ({why})" for f, why in _mapping(excluded.get(name)).items())
        rows.append([_layer_name(name), fmt.value, ruled_out])
    return rows


def _spread(value: Any) -> str:
    spread = _number(value)
    return "-" if math.isnan(spread) else f"±{100 * spread / 2:.1f}%"


def result_rows(policy: Policy) -> list[list[Any]]:
    results = _mapping(_mapping(policy.measured).get("results"))
    rows = []
    for name, r in results.items():
        r = _mapping(r)
        rows.append([name, *(_number(r.get(k)) for k in ("metric", "metric_drop", "step_ms")), _spread(r.get("spread")), _number(r.get("speedup"))])
    return rows


RESULT_HEADERS = ["", "metric", "drop", "step ms", "spread", "speedup"]


def show_policy(policy: Policy, *, markdown: bool = False) -> str:
    """A policy for a person: each layer's format, the loss scale, and what it was measured on."""
    table = markdown_table if markdown else text_table
    parts = [table(["layer", "format", "ruled out by the profile"], layer_rows(policy))]
    ls = policy.loss_scale
    scaler = "off (no fp16 layer)" if not policy.uses_fp16 else (
        f"init {ls.init_scale:g}, growth x{ls.growth_factor:g} every {ls.growth_interval} clean steps, "
        f"backoff x{ls.backoff_factor:g}, {'dynamic' if ls.dynamic else 'static'}"
    )
    parts.append(f"loss scaling: {scaler}")
    m = _mapping(policy.measured)
    if m:
        parts.append(
            f"measured on {m.get('device', '?')} for {m.get('model', '?')}; metric {m.get('metric', '?')}, "
            f"budget {m.get('budget', '?')} ({m.get('mode', 'weights')} mode); fp8: {m.get('fp8', '?')}"
        )
        if m.get("results"):
            parts.append(table(RESULT_HEADERS, result_rows(policy)))
            parts.append(f"step time: {m.get('timing', '')}; speedup = fp32 step time / step time")
        versions = _mapping(m.get("versions"))
        if versions:
            parts.append("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
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
        row: list[Any] = [name, first["type"], first["shape"], float(by["fp32"]["time_ms"])]
        for f in formats:
            if f == "fp32":
                continue
            r = by.get(f)
            if r is None or r["status"] != "ok":
                row += ["n/a", "", ""]
            elif not bool(r["finite"]) or bool(r["overflow"]):
                row += ["inf/nan", "", float(r["time_vs_fp32"])]
            else:
                row += [float(r["sqnr_db"]), float(r["metric_drop"]), float(r["time_vs_fp32"])]
        rows.append(row)
    return fmt_table(headers, rows)


def search_summary(result: Any, *, markdown: bool = False) -> str:
    """The end-of-search report: layer formats, then fp32 / uniform bf16 / policy measured side by side."""
    policy = result.policy
    table = markdown_table if markdown else text_table
    parts = [table(["layer", "format", "ruled out by the profile"], layer_rows(policy))]
    finals = result.finals
    rows = [
        [r["candidate"], r["metric"], r["metric_drop"], r["step_ms"], _spread(r["spread"]), r["speedup"],
         "yes" if r["feasible"] else "no"]
        for _, r in finals.iterrows()
    ]  # fmt: skip
    parts.append(table(RESULT_HEADERS + ["within budget"], rows))
    m = policy.measured or {}
    parts.append(
        f"chosen: {m.get('chosen')} (budget {m.get('budget')}, metric {m.get('metric')}); "
        f"device: {m.get('device')}; {m.get('timing')}; speedup = fp32 step time / step time"
    )
    rows = {r["candidate"]: r for _, r in finals.iterrows()}
    chosen, ref = rows.get(m.get("chosen")), rows.get("uniform bf16")
    if chosen is not None and ref is not None and chosen["candidate"] != "uniform bf16":
        lead = chosen["speedup"] / ref["speedup"] - 1
        noise = (chosen["spread"] + ref["spread"]) / 2
        if lead < noise:
            parts.append(
                f"note: {chosen['candidate']} leads uniform bf16 by {100 * lead:.1f}%, inside the measured spread "
                f"({100 * noise:.1f}%): on this device the two are not told apart"
            )
    if m.get("chosen") == "uniform bf16" and any(r[2] for r in layer_rows(policy)):
        parts.append(
            "note: the uniform-bf16 baseline measured fastest within budget, so it is the policy, though it "
            "lowers layers the profile ruled out on their own (a layer timed alone pays for casting its inputs)"
        )
    return "\n\n".join(parts)
