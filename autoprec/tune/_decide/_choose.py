"""The decision rule: which re-measured candidate a budget gets, as pure functions over the measurements (records.Finals).

The fastest within budget, unless the measured spread cannot separate it from an alternative (the alternative is
chosen: a policy is never written as faster than what the user had) or from a candidate with fewer fp16/fp8 layers
(the safer one is chosen; timing.separated), or fewer layers below fp32 (fp32 before uniform bf16), or one
without FSDP2's fp8 all-gather: among tied candidates the order reads what they run, not their medians, so the same
candidates tied give the same file. Never a searched policy measured slower than the fastest alternative. For the smallest peak memory (goals.MEMORY):
`choose_smallest`. Each goal (_goals.py) calls the rule it chooses by.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping

from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import MEMORY_TIE
from autoprec.tune._core._goal import DEFAULT_GOAL, Goal, goal_named
from autoprec.tune._core._names import ALTERNATIVES, GREEDY, NOT_A_POLICY
from autoprec.tune._core._records import Candidate, Finals, Measurement
from autoprec.tune._measure._choices import Choices, fit
from autoprec.tune._measure._timing import separated


def _policy(policy: Policy | Candidate) -> Policy:
    return policy.policy if isinstance(policy, Candidate) else policy


def _risk(policy: Policy | Candidate) -> int:
    """Layers in fp16 (overflow, loss scaling) or fp8 (4 mantissa bits): worth it only for a measured gain."""
    return sum(fmt.spec.risky for fmt in _policy(policy).layers.values())


def safer_variant(policy: Policy, choices: Choices) -> Policy | None:
    """The policy with every fp16/fp8 layer in bf16 where the layer may be bf16, else fp32; None if none."""
    if not _risk(policy):
        return None
    layers = {}
    for name, fmt in policy.layers.items():
        if fmt.spec.risky and fmt.spec.fallback is not None:  # always: only fp32, not risky, has none
            options = choices.default if name == ROOT else choices.layers.get(name, ())
            fmt = Format(fit(fmt.spec.fallback.value, options))
        layers[name] = fmt
    return Policy(layers=layers)


def _lowered(policy: Policy | Candidate, names: Collection[str]) -> int:
    """Of `names` (every layer some candidate lists, the root among them), those `policy` runs below fp32: a layer it
    does not list runs as the nearest enclosing one it lists (the root, "all else"), else fp32. Among tied
    candidates, the fewer the better."""
    layers = (policy.policy if isinstance(policy, Candidate) else policy).layers

    def runs_in(name: str) -> Format:
        while name not in layers:
            if name == ROOT:
                return Format.FP32
            name = name.rpartition(".")[0]
        return layers[name]

    return sum(runs_in(name) is not Format.FP32 for name in names)


def choose(
    finals: Finals, candidates: Mapping[str, Policy | Candidate], alternatives: Collection[str] = ALTERNATIVES
) -> tuple[str, str]:
    """The fastest candidate within budget, unless its lead is inside the measured spread (the measurement cannot
    tell them apart). Among the candidates tied with the fastest, the order does not read their medians (which
    inside the spread are noise): the fewest fp16/fp8 layers, then an alternative (what the user would run without
    autoprec, so a policy is never written as faster than an alternative it was not separated from), then the
    fewest layers below fp32 (fp32 first, so fp32 and uniform bf16 tied is fp32), then without FSDP2's fp8
    all-gather (one setting fewer to train with), and only then the faster median.
    Never a searched policy measured slower than the fastest of `alternatives` (fp32, uniform bf16, fp8 and fp8
    rowwise everywhere, profile greedy; a sweep names each budget's own greedy policy) within budget; an
    alternative not separated from that fastest one counts as tied with it. TF32 is not a policy and is never
    chosen."""
    feasible = sorted((r for r in finals if r.feasible and r.candidate not in NOT_A_POLICY), key=lambda r: -r.speedup)
    if not feasible:
        return "fp32", _nothing_feasible(finals)
    top = feasible[0]
    fastest = max((r for r in feasible if r.candidate in alternatives), key=lambda r: r.speedup, default=None)

    def admissible(r: Measurement) -> bool:
        # a searched policy at least as fast as the fastest alternative; an alternative tied with that one
        if fastest is None or r.speedup >= fastest.speedup:
            return True
        return r.candidate in alternatives and not separated(r, fastest)

    names = {name for r in feasible for name in _policy(candidates[r.candidate]).layers} | {ROOT}

    def order(r: Measurement) -> tuple[int, bool, int, bool, float]:
        policy = candidates[r.candidate]
        gathers = _policy(policy).fsdp_fp8_all_gather
        return _risk(policy), r.candidate not in alternatives, _lowered(policy, names), gathers, -r.speedup

    tied = [r for r in feasible if not separated(top, r) and admissible(r)]
    pick = min(tied, key=order)
    if pick.candidate not in alternatives:
        # separation is not transitive: a safer pick tied with the top may be tied with an alternative that is not
        # tied with the top; that alternative is written then, unless it has more fp16/fp8 layers (the tie is
        # recorded either way)
        beside = [
            r
            for r in feasible
            if r.candidate in alternatives
            and admissible(r)
            and not separated(pick, r)
            and _risk(candidates[r.candidate]) <= _risk(candidates[pick.candidate])
        ]
        if beside:
            alternative = min(beside, key=order)
            return alternative.candidate, _tied_with_alternative(pick, alternative)
    if pick is top:
        if top.candidate in alternatives:
            return top.candidate, f"the fastest within budget is an alternative, {top.candidate}: no searched policy beat it"
        return top.candidate, "the fastest within budget"
    if pick.candidate in alternatives and top.candidate not in alternatives:
        return pick.candidate, _tied_with_alternative(top, pick)
    lead = 100 * (top.speedup / pick.speedup - 1)
    risk = _risk(candidates[top.candidate]), _risk(candidates[pick.candidate])
    if risk[0] != risk[1]:
        return pick.candidate, (
            f"{top.candidate} measured {lead:.1f}% faster, inside the spread, with more fp16/fp8 layers "
            f"({risk[0]} against {risk[1]}): the safer one"
        )
    lowered = _lowered(candidates[top.candidate], names), _lowered(candidates[pick.candidate], names)
    top_policy, pick_policy = _policy(candidates[top.candidate]), _policy(candidates[pick.candidate])
    if lowered[0] == lowered[1] and top_policy.fsdp_fp8_all_gather and not pick_policy.fsdp_fp8_all_gather:
        same = dataclasses.replace(top_policy, fsdp_fp8_all_gather=False) == pick_policy
        what = "the same formats" if same else f"as many fp16/fp8 layers and layers below fp32 ({lowered[0]})"
        return pick.candidate, (
            f"{top.candidate} measured {lead:.1f}% faster, inside the spread, with {what}, all-gathering its fp8 "
            f"weights in fp8 under FSDP2: {WITHOUT_GATHER}"
        )
    return pick.candidate, (
        f"{top.candidate} measured {lead:.1f}% faster, inside the spread, with more layers below fp32 "
        f"({lowered[0]} against {lowered[1]}): the one with {FEWER_LOWERED}"
    )


FEWER_LOWERED = "fewer layers below fp32"  # the words of choose's reason, which a report reads back (show._kind)
WITHOUT_GATHER = "the one without that setting"  # likewise, for a tie broken by FSDP2's fp8 all-gather


def _tied_with_alternative(policy: Measurement, alternative: Measurement) -> str:
    lead = 100 * (policy.speedup / alternative.speedup - 1)
    return (
        f"{policy.candidate} measured {lead:.1f}% faster, inside the spread: not separated from the alternative "
        f"{alternative.candidate}, which is chosen"
    )


def not_separated(finals: Finals, name: str) -> list[str]:
    """The candidates within budget (policies, not TF32) whose speed the measurement cannot tell from `name`'s:
    the chosen one is a tie with them inside the noise (the summary's first line and `autoprec show` say so)."""
    pick = finals.get(name)
    if pick is None or not pick.feasible or not math.isfinite(pick.speedup):
        return []
    return [
        r.candidate
        for r in finals
        if r.candidate != name
        and r.feasible
        and r.candidate not in NOT_A_POLICY
        and math.isfinite(r.speedup)
        and not separated(pick, r)
    ]


def choose_smallest(
    finals: Finals, candidates: Mapping[str, Policy | Candidate], alternatives: Collection[str] = ALTERNATIVES
) -> tuple[str, str]:
    """goals.MEMORY's choice: the candidate within budget (and --max-memory) with the smallest peak memory; among
    those within MEMORY_TIE of it, `choose`'s (the fastest, or inside the spread the safer, then the one with fewer
    layers below fp32). Every alternative within budget is a candidate here, so none with a smaller peak is passed
    over."""
    feasible = [r for r in finals if r.feasible and r.candidate not in NOT_A_POLICY and r.peak_bytes is not None]
    if not feasible:
        return "fp32", _nothing_feasible(finals)
    least = min(r.peak_bytes for r in feasible if r.peak_bytes is not None)
    tied = Finals(r for r in feasible if r.peak_bytes is not None and r.peak_bytes <= least * (1 + MEMORY_TIE))
    name, why = choose(tied, candidates, ())
    peak = finals.by_name(name)
    saved = f", {100 * peak.memory_saving:.0f}% less than fp32" if peak.memory_saving is not None else ""
    among = f"; among the {len(tied)} within {MEMORY_TIE:.0%} of it: {why}" if len(tied) > 1 else ""
    return name, f"the smallest peak memory within budget ({memory.human_bytes(peak.peak_bytes)}{saved}){among}"


def _nothing_feasible(finals: Finals) -> str:
    over = [r.candidate for r in finals if r.over_memory]
    unknown = [r.candidate for r in finals if r.runs and r.peak_bytes is None]
    if over:
        return (
            f"no candidate stayed within budget and --max-memory when re-measured ({len(over)} ran but needed more memory): fp32"
        )
    if unknown and any(not r.fits for r in finals):
        return f"no candidate stayed within budget with its peak memory measured ({len(unknown)} ran without one): fp32"
    return "no candidate stayed within budget when re-measured: fp32"


def choose_per_budget(
    finals: Finals,
    candidates: Mapping[str, Candidate],
    budgets: tuple[float, ...],
    greedy: Mapping[float, str],
    *,
    goal: Goal | None = None,
) -> list[tuple[str, str]]:
    """(candidate, why) per budget, ascending: the goal's choice (`Goal.choose`; None: goals.SPEED's, `choose`) among
    the re-measured candidates within it, never below that budget's own profile-greedy policy, as a search of that
    budget decides; where that measured worse than the previous budget's choice beyond the tie the goal's choice
    allows (`Goal.kept`: a tie is not transitive, a safer pick tied with the fastest may be separated below it), the
    previous stands. Inside the noise this budget's own choice stands: a sweep decides each budget as a search of it
    would."""
    if goal is None:
        goal = goal_named(DEFAULT_GOAL)
    picks: list[tuple[str, str]] = []
    for b in budgets:
        floor = [a for a in ALTERNATIVES if a != GREEDY] + [greedy[b]]
        name, why = goal.choose(finals.within(b), candidates, floor)
        better = goal.kept(finals.by_name(picks[-1][0]), finals.by_name(name), candidates) if picks else None
        if better is not None:
            before = picks[-1][0]
            name, why = before, f"kept from the smaller budget: {before} measured {better} than {name}, this budget's pick"
        picks.append((name, why))
    return picks
