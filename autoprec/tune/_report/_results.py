"""What a search and a sweep return (SearchResult, SweepResult with a BudgetRow per budget, and the SavedProfile
each used), and how each reads: the summary the command line prints, summary.md and sweep.md. The records hold
only what the stages below measured; the pipeline (_search) builds them, the figures (_plots.py) draw them.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from autoprec.policy import Policy
from autoprec.tune._core._config import NOISY_SPREAD, SEARCH_SHARE_GOAL
from autoprec.tune._core._memory import human_bytes
from autoprec.tune._core._names import BF16, BF16_GRAPHS, FP32, TF32
from autoprec.tune._core._profile_row import as_float
from autoprec.tune._core._records import Finals, Measured, Measurement
from autoprec.tune._core._tables import WIDTH, markdown_table, markdown_text, text_table
from autoprec.tune._measure._choices import Choices
from autoprec.tune._measure._metric import NoiseFloor
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._measure._timing import separated, spread_text
from autoprec.tune._report._report import gradient_summary, profile_notes, profile_summary
from autoprec.tune._report._show import (
    RESULT_HEADERS,
    LayerTable,
    _budget,
    _by_speed,
    _kind,
    _layer_name,
    _names,
    _saved,
    coverage_line,
    estimate_column,
    estimate_lines,
    estimate_of,
    gather_line,
    layout_text,
    memory_text,
    mode_text,
)


@dataclasses.dataclass(frozen=True)
class SavedProfile:
    """The profile a run uses, the folder it is saved in (`own`: the run's own subfolder of the output folder),
    whether this run measured it (else it was reused), and why the output folder's profile did not serve (None: it
    did, or there was none)."""

    profile: Profile
    folder: Path
    measured: bool
    own: bool = False
    why_not: str | None = None


@dataclasses.dataclass
class SearchResult:
    policy: Policy
    profile: Profile
    choices: Choices
    trials: pd.DataFrame
    finals: Finals  # every re-measured candidate: the alternatives and the finalists (finals.to_frame(): a DataFrame)
    study_name: str
    storage: str
    noise: NoiseFloor | None = None  # train mode: the fp32 result's spread over seeds
    cost: dict[str, Any] | None = None  # timing.Stopwatch.to_dict(): where this search's time went

    def summary(self, *, markdown: bool = False) -> str:
        """The table the command line prints: each layer's format, then every re-measured candidate."""
        return search_summary(self, markdown=markdown)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetRow:
    """One budget's result, a row of sweep.csv: the chosen candidate's re-measured numbers beside uniform
    bf16's and this budget's profile-greedy policy's, from the same re-measure."""

    budget: float
    budget_given: str | None  # how the user gave it, where relative
    chosen: str
    metric: float
    metric_drop: float
    step_ms: float  # effective: skipped steps count as time without progress
    spread: float
    speedup: float
    uniform_bf16_speedup: float
    uniform_bf16_drop: float
    greedy_speedup: float
    greedy_drop: float
    peak_bytes: int | None  # the chosen policy's peak memory per step (None: not measured on this device)
    memory_saving: float | None  # the share of fp32's peak it saves
    formats: str  # "bf16 100, fp32 9": the listed layers' formats, the root not counted
    root: str
    policy_file: str
    why: str
    # the candidates the step times could not tell from the chosen one ("; "-joined): its policy file's
    # measured.not_separated, as the search records it (choose.not_separated); "" where the choice is clear
    not_separated: str = ""


@dataclasses.dataclass
class SweepResult:
    """`table`: one row per budget (sweep.csv); `policies`: budget -> its policy; `front`: the study's
    Pareto-optimal trials; `finals`: every re-measured candidate."""

    table: list[BudgetRow]
    policies: dict[float, Policy]
    front: pd.DataFrame
    trials: pd.DataFrame
    finals: Finals
    profile: Profile
    choices: Choices
    study_name: str
    storage: str
    noise: NoiseFloor | None = None
    cost: dict[str, Any] | None = None
    saved: SavedProfile | None = None  # where the profile is saved, and whether this sweep measured it

    def summary(self, *, markdown: bool = False) -> str:
        """The table the command line prints: per budget, the chosen policy beside uniform bf16 and greedy."""
        return sweep_summary(self, markdown=markdown)


def search_summary(result: SearchResult, *, markdown: bool = False) -> str:
    """The end-of-search report: layer formats, then fp32 / uniform bf16 / policy measured side by side."""
    policy = result.policy
    table = markdown_table if markdown else text_table
    parts = [textwrap.fill(headline(result), WIDTH), LayerTable(policy).render(markdown=markdown)]
    gather = gather_line(policy)
    if gather:  # a sharded search's setting beside the formats, which the layer table does not show
        parts.append(gather)
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
            spread_text(r.spread),
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
        headers = [*headers[:6], "speedup here", *headers[7:], estimate_column(est)]  # type: ignore[arg-type]
    parts.append(table(headers, rows))
    parts.extend(estimate_lines(m))
    parts.append(
        f"chosen: {m.chosen}{f' ({m.why})' if m.why else ''}; budget {_budget(m)}, "
        f"metric {m.metric}, {mode_text(m)}; search space {m.search_space or 'per layer'}; "
        f"device: {m.device}{f', {layout_text(m)}' if layout_text(m) else ''}; {m.timing}; "
        "speedup = fp32 step time / effective step time"
    )
    parts.extend(line for line in [coverage_line(m)] if line)
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
    graphs = finals.get(BF16_GRAPHS)
    if speed and graphs is not None and picked is not None and graphs.feasible and graphs.speedup > picked.speedup:
        parts.append(
            f"note: uniform bf16 under CUDA graphs measured {graphs.speedup / picked.speedup:.2f}x the chosen policy's "
            "speed: CUDA graphs are a way to compile, not a policy; compile with "
            "autoprec.compile_model(model, mode='reduce-overhead') to use them (the policy under them was not measured)"
        )
    noisiest = finals.noisiest(device_only=True)  # a host-bound step's jitter is said below
    if speed and noisiest > NOISY_SPREAD:
        parts.append(
            f"note: step times spread up to {spread_text(noisiest)} even over more rounds: too wide to rank "
            "candidates closer than that (they count as ties, and the one with fewer fp16/fp8 layers is chosen); "
            "rerun on a quieter machine with --remeasure"
        )
    bound = [r for r in finals if r.runs and r.host_bound and r.busy_ms is not None]
    if speed and bound:
        parts.append(
            "note: host-bound: "
            + ", ".join(f"{r.candidate} (the device busy {r.busy_ms:.3g} of {r.step_ms:.3g} ms a step)" for r in bound)
            + ": the device waits on the host for the rest of these steps; "
            "precision cannot change their step time (CUDA graphs or a larger batch can), and their spread is the "
            "host's jitter, not a noisy device"
        )
    ref = finals.get(BF16)
    # the tie the decision recorded (choose.not_separated), not judged again here
    if speed and picked is not None and ref is not None and BF16 in m.not_separated and picked.speedup >= ref.speedup:
        parts.append(
            f"note: {picked.candidate} leads uniform bf16 by {100 * (picked.speedup / ref.speedup - 1):.1f}%, inside "
            f"the measured spread ({spread_text((picked.spread + ref.spread) / 2)}): on this device the two are not told apart"
        )
    overruled = [n for n, f in policy.layers.items() if f.value in m.excluded.get(n, {})]
    if m.chosen == BF16 and overruled:
        parts.append(
            f"note: the policy is the uniform-bf16 baseline, measured as a whole step, though the profile ruled "
            f"out bf16 for {', '.join(map(_layer_name, overruled))} on its own (a layer timed alone is not the whole step)"
        )
    if result.cost:
        parts.append(table(["where the time went", "seconds", "share", "count"], cost_rows(result.cost)))
        priced = search_cost(result.cost, picked.effective_step_ms if picked is not None else math.nan, m.run_steps)
        if priced:
            parts.append(priced)
    return "\n\n".join(parts)


def search_cost(cost: Mapping[str, Any], step_ms: float, run_steps: int | None) -> str:
    """The search's own time (the cost table's stages, an earlier run's trials included) in training steps of the
    chosen policy, and, given the run it tunes (--run-steps), as a share of that run beside SEARCH_SHARE_GOAL."""
    seconds = sum(cost.get("seconds", {}).values())
    if seconds <= 0 or not (math.isfinite(step_ms) and step_ms > 0):
        return ""
    steps = seconds * 1e3 / step_ms
    line = f"search cost: {seconds:.0f} s, the time of {steps:,.0f} training steps of the chosen policy ({step_ms:.4g} ms each)"
    if run_steps is None:
        return line + "; --run-steps N prices it as a share of the training run it tunes"
    share = steps / run_steps
    verdict = "within" if share <= SEARCH_SHARE_GOAL else "over"
    return line + f": {share:.2%} of a {run_steps:,}-step run, {verdict} the {SEARCH_SHARE_GOAL:.0%} a search should cost"


def headline(result: SearchResult) -> str:
    """The summary's first line: what was chosen and how much faster than fp32, or, when the step times could not
    tell it from other candidates within budget, that the answer is a tie inside the noise and what to do; a tie
    with fp32 says no gain is shown, never its speedup."""
    m = Measured.of(result.policy)
    finals: Finals = result.finals
    picked = finals.get(m.chosen)
    if picked is None or not picked.feasible:
        return f"chosen: {m.chosen} ({m.why or 'nothing else within budget'})"
    speed = f"{picked.speedup:.2f}x fp32's training-step speed ({spread_text(picked.spread)})"
    est = estimate_of(m)
    if est is not None:  # the goal's value is an estimate for another device: said as one, the step times as here
        return (
            f"chosen: {m.chosen}, {est['what']}, metric drop {picked.metric_drop:.4g} within budget {_budget(m)}; "
            f"on this machine ({m.device}): {speed}"
        )
    tied = tie(m, finals)
    if tied is None:
        return f"chosen: {m.chosen}, {speed}, metric drop {picked.metric_drop:.4g} within budget {_budget(m)}"
    ahead = _shown_ahead_of_fp32(m, finals) if tied.chosen != FP32 else []
    if FP32 in tied.others and ahead:  # separation is not transitive: tied with fp32 and with one faster than it
        return (
            f"a tie inside the noise: {m.chosen} ({speed}) and {_names(tied.others)} measured within their spread (up "
            f"to {spread_text(tied.spread)}); {_names(ahead)} measured faster than fp32 beyond the spread and "
            f"{m.chosen}, tied with it, is chosen as the {tied.kind}, though its own lead over fp32 is inside the "
            f"spread; {RANK_THEM}"
        )
    if FP32 in (tied.chosen, *tied.others):  # not told from fp32: its measured speedup is noise, not a gain
        return (
            f"a tie inside the noise, no gain over fp32 shown: {m.chosen} and {_names(tied.others)} measured within "
            f"their spread (up to {spread_text(tied.spread)}): this machine's timing cannot rank them, so {m.chosen}, the "
            f"{tied.kind}, is chosen; {RANK_THEM}"
        )
    return (
        f"a tie inside the noise: {m.chosen} ({speed}) and {_names(tied.others)} measured within their spread (up to "
        f"{spread_text(tied.spread)}): this machine's timing cannot rank them, so {m.chosen}, the "
        f"{tied.kind}, is chosen; {RANK_THEM}"
    )


RANK_THEM = "to rank them, rerun with --remeasure on a quiet machine"


def _shown_ahead_of_fp32(m: Measured, finals: Finals) -> list[str]:
    """The candidates tied with the chosen one that the step times put ahead of fp32 beyond the spread (within budget):
    why a policy not itself told from fp32 was chosen over it (choose ties it with the fastest, which fp32 is not)."""
    fp32, picked = finals.get(FP32), finals.get(m.chosen)
    if fp32 is None or picked is None or m.budget is None:
        return []
    return [
        r.candidate
        for r in finals.within(m.budget)
        if r.feasible
        and r.candidate not in (FP32, m.chosen)
        and r.speedup > fp32.speedup
        and separated(r, fp32)
        and not separated(r, picked)
    ]


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
        "file",
        "formats",
    ]
    # the formats last, the one column a text table wraps (at its spaces): a file name is never cut; in markdown the
    # files are a list under the table, a line each, which no viewer breaks at a file name's hyphens
    if markdown:
        headers.remove("file")
    rows, ties, files = [], [], []
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
                spread_text(r.spread),
                human_bytes(r.peak_bytes),
                _saved(r.memory_saving),
                bf16,
                greedy,
                *(() if markdown else (r.policy_file,)),
                f"{r.root} root; {r.formats}",
            ]
        )
        files.append(f"- {markdown_text(r.budget_given or f'{r.budget:g}')}: {markdown_text(r.policy_file)}")
        if tied:
            ties.append(
                f"{r.budget_given or f'{r.budget:g}'}: tie with {_names(tied.others)} within {spread_text(tied.spread)} "
                f"noise: {tied.chosen}, the {tied.kind}, is written"
            )
    parts = [table(headers, rows)]
    if markdown:
        parts.append("policy files:\n" + "\n".join(files))
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
        [int(r["trial"]), as_float(r["metric_drop"]), as_float(r["speedup"]), spread_text(as_float(r["spread"])), _bytes_cell(p)]
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
        f"## Profile (one layer lowered at a time)\n\n{profile_summary(prof.rows, markdown=True)}\n\n"
        f"{profile_notes()}\n\n"
        f"![profile heat map](profile.png)\n\n"
        f"## Gradient ranges\n\n{gradient_summary(prof.rows, prof.advice(), markdown=True)}\n\n"
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
        f"## Profile (one layer lowered at a time)\n\n{profile_summary(result.profile.rows, markdown=True)}\n\n"
        f"{profile_notes()}\n"
    )


def cost_rows(cost: Mapping[str, Mapping[str, float]]) -> list[list[object]]:
    """[stage, seconds, share of the total, count] rows, in the order the stages ran, then their total, then
    what was counted but took no time of its own (work avoided)."""
    seconds, counts = cost.get("seconds", {}), cost.get("counts", {})
    total = sum(seconds.values())
    rows: list[list[object]] = []
    for name, s in seconds.items():
        rows.append([name, f"{s:.1f}", f"{100 * s / total:.0f}%" if total > 0 else "-", counts.get(name, "")])
    if seconds:
        rows.append(["total of the stages above", f"{total:.1f}", "100%", ""])
    for name, n in counts.items():
        if name not in seconds:
            rows.append([name, "-", "-", n])
    return rows
