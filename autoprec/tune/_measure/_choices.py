"""What the study may pick, and how Optuna's parameters name it.

`Choices` holds, per tunable layer, the offered formats the profile did not rule out (and why the rest
were), the root's formats, and the loss-scale range. A `Layout` turns them into Optuna parameters:

- `per_layer`: one categorical per layer; exact, and what small models get.
- `grouped`: one categorical per role of a repeated block (`blocks.*.attn.q`: the same name but for the
  block index, type and weight shape), so 12 blocks of 9 layers are 9 parameters, not 108. A member that
  the profile ruled a format out for takes the next safer one (fp16/fp8 -> bf16 -> fp32).
- `ranked`: per lowered format f, one integer `lowered:f`, the number of layers allowed f that take it,
  least sensitive first (the profile's single-layer metric drop, then output SQNR); a layer in several
  formats' sets takes the one it profiled fastest in. A handful of integers whatever the model's size.
- `auto`: per_layer up to `max_params` searched layers, else grouped up to `max_params` groups, else ranked.

Beside the formats: the loss scale where a trial has fp16 layers, and, in a sharded search (FSDP2), whether a trial
with layers in a format FSDP2 can gather in fp8 all-gathers their weights in fp8 (`fsdp:fp8_all_gather`).

Choices travel with the study (the first trial's attributes), so every worker decodes params alike.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import optuna
import torch

from autoprec.formats import Format, autocast_supported, format_names
from autoprec.policy import ROOT, LossScale, Policy
from autoprec.tune._core._goal import Goal
from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._core._space import Layout, SearchSpace, parse_layout
from autoprec.tune._measure._profile_data import Profile, ruled_out

log = logging.getLogger("autoprec")

DEFAULT_PARAM = "default"
LAYER_PARAM = "layer:"
GROUP_PARAM = "group:"
RANK_PARAM = "lowered:"
LS_PARAM = "loss_scale:"
FSDP_PARAM = "fsdp:fp8_all_gather"


@dataclasses.dataclass(frozen=True)
class Choices:
    """What the study may pick: root formats, per-layer formats, and why the rest were ruled out.
    `loss_scale`: the initial-scale range (log2) searched for fp16 trials and where it came from.
    `layout`: how params name the choices (never auto here); `groups`: role -> member layers (grouped);
    `ranking`: format -> layers allowed it, least sensitive first, and `preference`: layer -> its formats,
    fastest profiled first (ranked). `fp8_all_gather`: whether a trial may all-gather its fp8 weights in fp8 under
    FSDP2 (a sharded search whose layers may take a format FSDP2 gathers in fp8)."""

    default: tuple[str, ...]
    layers: Mapping[str, tuple[str, ...]]
    excluded: Mapping[str, Mapping[str, str]]
    loss_scale: Mapping[str, Any] | None = None
    layout: str = Layout.PER_LAYER.value
    groups: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    ranking: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    preference: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    fp8_all_gather: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Choices:
        data = json.loads(text)
        return cls(
            default=tuple(data["default"]),
            layers={k: tuple(v) for k, v in data["layers"].items()},
            excluded=data["excluded"],
            loss_scale=data["loss_scale"],
            layout=data["layout"],
            groups={k: tuple(v) for k, v in data["groups"].items()},
            ranking={k: tuple(v) for k, v in data["ranking"].items()},
            preference={k: tuple(v) for k, v in data["preference"].items()},
            fp8_all_gather=data.get("fp8_all_gather", False),  # a study begun before the setting was searched
        )

    @property
    def fp16_layers(self) -> list[str]:
        return [name for name, options in self.layers.items() if any(Format(f).spec.loss_scale for f in options)]

    @property
    def searched(self) -> list[str]:
        """Layers with more than one choice."""
        return [name for name, options in self.layers.items() if len(options) > 1]

    def describe(self) -> str:
        """One line for a person: how many parameters stand for how many layers (and the fp8 all-gather, searched)."""
        gather = "; and FSDP2's fp8 all-gather, where a trial has a layer to gather in fp8" if self.fp8_all_gather else ""
        return self._describe_layers() + gather

    def _describe_layers(self) -> str:
        n = len(self.searched)
        if n == 0:
            return "no layer has a format left beside its fallback after the profile: only the model root's format is searched"
        if self.layout == Layout.GROUPED.value:
            return f"grouped: {len(self.groups)} parameters for the roles of {n} searched layers"
        if self.layout == Layout.RANKED.value:
            counts = ", ".join(f"{f} 0..{len(v)}" for f, v in self.ranking.items())
            k = len(self.ranking)
            return f"ranked: {k} parameter{'s' if k != 1 else ''} ({counts} least sensitive layers) for {n} searched layers"
        return f"per_layer: one parameter for each of {n} searched layers"


LayerCost = Callable[[ProfileRow], float]  # a profile row's cost by the search's goal (Goal.layer_cost)


def measured_time(row: ProfileRow) -> float:
    """The layer's step time in the row's format, as its profile measured it on this device (NaN: not timed)."""
    return row.time_ms


def searches_fp8_all_gather(sharded: bool, goal: Goal) -> bool:
    """Whether a search offers FSDP2's fp8 all-gather beside the formats (where a layer may take a format FSDP2
    gathers in fp8): its candidates train sharded, and its goal measures them (the setting moves communication,
    which the FLOP goal's estimate does not price)."""
    return sharded and goal.timed


# ------------------------------------------------------------------ what the profile rules out


def build_choices(
    prof: Profile,
    space: SearchSpace,
    budget: float,
    device: torch.device,
    *,
    judge_drop: bool = True,
    fallbacks: Mapping[str, Format] | None = None,
    cost: LayerCost = measured_time,
    fp8_all_gather: bool = False,
) -> Choices:
    """Per-layer choices: the offered formats the profile did not rule out; each layer's fallback always stays, first
    (`fallbacks`: Goal.layer_fallbacks, its list's under the goal; fp32 where None or unlisted). The profile measures
    fp32 for every layer, as the reference: a layer whose fallback is another format (bf16, under the FLOP goal) is
    offered fp32 only where its list holds it (`fallbacks` then says fp32). With `judge_drop` False (train mode) a
    single layer's drop of the given weights' metric rules nothing out. The space's layout is resolved here (a ranked
    one orders each layer's formats by `cost`, the goal's Goal.layer_cost). `fp8_all_gather`: the candidates train
    under FSDP2 and the goal measures them, so where a layer may take a format FSDP2 gathers in fp8, the fp8
    all-gather is searched too."""
    layers: dict[str, tuple[str, ...]] = {}
    excluded: dict[str, dict[str, str]] = {}
    for name, rows in prof.by_layer().items():
        keep = (fallbacks or {}).get(name, Format.FP32).value
        allowed = []
        for fmt, row in rows.items():
            if fmt == Format.FP32.value and keep != fmt:
                continue  # profiled as the reference, not offered
            reason = None if fmt == keep else ruled_out(row, budget if judge_drop else None, space.prune_slower_than)
            if reason is None:
                allowed.append(fmt)
            else:
                excluded.setdefault(name, {})[fmt] = reason
        layers[name] = tuple(sorted(allowed, key=lambda f: f != keep))  # the fallback first: fallback() reads it
    default = tuple(f.value for f in space.default if autocast_supported(device, f))
    gatherable = any(Format(f).family.fsdp_fp8_all_gather(Format(f)) for options in layers.values() for f in options)
    choices = Choices(default=default, layers=layers, excluded=excluded, fp8_all_gather=fp8_all_gather and gatherable)
    choices = dataclasses.replace(choices, loss_scale=loss_scale_choice(prof, choices, space))
    return with_layout(choices, prof, space.layout, space.max_params, cost=cost)


def loss_scale_choice(prof: Profile, choices: Choices, space: SearchSpace) -> dict[str, Any]:
    """The initial-scale range to search: the space's, narrowed to the profile's recommendation for the
    layers that may be fp16. Where the two do not overlap the measurement wins over the file's guess."""
    lo, hi = space.loss_scale.init_scale_log2
    advice = prof.advice(choices.fp16_layers) if choices.fp16_layers else None
    out: dict[str, Any] = {"space": [lo, hi], "recommended": None, "advice": advice.describe() if advice else None}
    recommended = advice.search_range if advice else None
    if recommended is None:
        out["init_scale_log2"] = [lo, hi]
        return out
    out["recommended"] = list(recommended)
    narrowed = (max(lo, recommended[0]), min(hi, recommended[1]))
    if narrowed[0] > narrowed[1]:
        log.warning(
            "the profile recommends loss scales 2^%d..2^%d, outside the search space's init_scale_log2 [%d, %d]; "
            "searching the recommended range",
            *recommended,
            lo,
            hi,
        )
        narrowed = recommended
    out["init_scale_log2"] = list(narrowed)
    return out


# ------------------------------------------------------------------ layouts


def role(name: str) -> str:
    """A layer's name with every block index replaced by `*`: `blocks.3.attn.q` -> `blocks.*.attn.q`."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def group_layers(prof: Profile, layers: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Searched layers by role, type and weight shape; a role with layers of several shapes or types gets
    one group per kind, named with the shape (`layers.* [64x32]`)."""
    kind = {name: next(iter(rows.values())) for name, rows in prof.by_layer().items()}
    by_key: dict[tuple[str, str, str], list[str]] = {}
    for name, options in layers.items():
        if len(options) > 1:
            by_key.setdefault((role(name), kind[name].type, kind[name].shape), []).append(name)
    kinds_per_role = Counter(r for r, _, _ in by_key)
    return {(r if kinds_per_role[r] == 1 else f"{r} [{t} {s}]"): tuple(members) for (r, t, s), members in by_key.items()}


def _sensitivity_key(row: ProfileRow) -> tuple[float, float, str]:
    drop, sqnr, name = row.metric_drop, row.sqnr_db, row.layer
    return (drop if math.isfinite(drop) else math.inf, -sqnr if not math.isnan(sqnr) else math.inf, name)


def rank_layers(
    prof: Profile, layers: Mapping[str, tuple[str, ...]], *, cost: LayerCost = measured_time
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(ranking, preference): per lowered format (any but a layer's fallback, its first option: fp32, or bf16 in a
    FLOP goal's space), the layers allowed it, least sensitive first (single-layer metric drop, then output SQNR,
    highest first); per layer, its lowered formats by `cost` (the goal's Goal.layer_cost: this device's profiled
    time, or the target's GEMM time), cheapest first."""
    rows = prof.by_layer()
    ranking: dict[str, tuple[str, ...]] = {}
    for fmt in format_names():
        allowed = [n for n, options in layers.items() if fmt in options[1:]]
        if allowed:
            ranking[fmt] = tuple(sorted(allowed, key=lambda n: _sensitivity_key(rows[n][fmt])))
    order = format_names()  # the order options are listed in (fp32, bf16, fp16, the fp8s, ...), read now
    preference = {}
    for name, options in layers.items():
        lowered = list(options[1:])
        costs = {f: cost(rows[name][f]) for f in lowered}
        preference[name] = tuple(
            sorted(lowered, key=lambda f: (costs[f] if math.isfinite(costs[f]) else math.inf, order.index(f)))
        )
    return ranking, preference


def with_layout(
    choices: Choices, prof: Profile, layout: Layout | str, max_params: int, *, cost: LayerCost = measured_time
) -> Choices:
    """`choices` with its layout resolved (auto picks by size) and the groups or ranking it needs."""
    layout = parse_layout(layout)
    searched = choices.searched
    groups = group_layers(prof, choices.layers)
    if layout is Layout.AUTO:
        if len(searched) <= max_params:
            layout = Layout.PER_LAYER
        elif len(groups) <= max_params:
            layout = Layout.GROUPED
        else:
            layout = Layout.RANKED
    if layout is Layout.GROUPED:
        return dataclasses.replace(choices, layout=layout.value, groups=groups)
    if layout is Layout.RANKED:
        ranking, preference = rank_layers(prof, choices.layers, cost=cost)
        return dataclasses.replace(choices, layout=layout.value, ranking=ranking, preference=preference)
    return dataclasses.replace(choices, layout=Layout.PER_LAYER.value)


def _union(options: list[tuple[str, ...]]) -> tuple[str, ...]:
    present = {f for o in options for f in o}
    return tuple(f for f in format_names() if f in present)


def fallback(options: tuple[str, ...]) -> str:
    """A layer's fallback among its choices (build_choices puts it first): fp32, or the format its list holds
    instead under the goal (bf16 for the FLOP goal)."""
    return options[0]


def root_fallback(default: tuple[str, ...]) -> str:
    """The root's fallback among its choices: fp32 where offered, else the first (a FLOP goal's space: bf16)."""
    return Format.FP32.value if Format.FP32.value in default or not default else default[0]


def fit(fmt: str, options: tuple[str, ...]) -> str:
    """`fmt` where the layer may take it, else the next safer format it may along the formats' fallbacks
    (fp16/fp8 -> bf16 -> fp32), else the layer's fallback."""
    first = Format(fmt)
    return next((f.value for f in (first, *first.fallbacks()) if f.value in options), fallback(options))


def layer_formats(params: Mapping[str, Any], choices: Choices) -> dict[str, str]:
    """Each layer's format under `params` (the root not included); a layer with a single choice keeps it."""
    out = {name: options[0] for name, options in choices.layers.items()}
    if choices.layout == Layout.GROUPED.value:
        for group, members in choices.groups.items():
            fmt = params.get(GROUP_PARAM + group, Format.FP32.value)  # fit: each member's fallback where not offered
            out.update({m: fit(fmt, choices.layers[m]) for m in members})
    elif choices.layout == Layout.RANKED.value:
        taken: dict[str, set[str]] = {}
        for fmt, order in choices.ranking.items():
            for name in order[: int(params.get(RANK_PARAM + fmt, 0))]:
                taken.setdefault(name, set()).add(fmt)
        for name, fmts in taken.items():
            out[name] = next(f for f in choices.preference[name] if f in fmts)
    else:
        for name, options in choices.layers.items():
            out[name] = params.get(LAYER_PARAM + name, options[0])
    return out


def policy_from_params(params: Mapping[str, Any], choices: Choices) -> Policy:
    """The policy a trial's params describe."""
    layers = {ROOT: params.get(DEFAULT_PARAM, choices.default[0]), **layer_formats(params, choices)}
    loss_scale = LossScale()
    if any(Format(f).spec.loss_scale for f in layers.values()) and LS_PARAM + "init_scale_log2" in params:
        defaults = LossScale()
        loss_scale = LossScale(
            init_scale=2.0 ** params[LS_PARAM + "init_scale_log2"],
            growth_interval=int(params[LS_PARAM + "growth_interval"]),
            growth_factor=float(params.get(LS_PARAM + "growth_factor", defaults.growth_factor)),
            backoff_factor=float(params.get(LS_PARAM + "backoff_factor", defaults.backoff_factor)),
            dynamic=bool(params[LS_PARAM + "dynamic"]),
        )
    policy = Policy(layers=layers, loss_scale=loss_scale)
    if params.get(FSDP_PARAM) and policy.fp8_gatherable:  # asked only where the trial has such a layer (suggest)
        policy = dataclasses.replace(policy, fsdp_fp8_all_gather=True)
    return policy


def format_params(choices: Choices) -> dict[str, tuple]:
    """Every format parameter of the layout: name -> its categorical options, or (low, high) for ranked counts."""
    out: dict[str, tuple] = {}
    if len(choices.default) > 1:
        out[DEFAULT_PARAM] = tuple(choices.default)
    if choices.layout == Layout.GROUPED.value:
        for group, members in choices.groups.items():
            out[GROUP_PARAM + group] = _union([choices.layers[m] for m in members])
    elif choices.layout == Layout.RANKED.value:
        for fmt, order in choices.ranking.items():
            out[RANK_PARAM + fmt] = (0, len(order))
    else:
        for name in choices.searched:
            out[LAYER_PARAM + name] = choices.layers[name]
    return out


def setting_variants(policy: Policy, choices: Choices) -> list[Policy]:
    """`policy` and, where the search offers the fp8 all-gather and the policy has a layer FSDP2 gathers in fp8, the
    same formats with it on: the distinct policies one format assignment stands for."""
    if choices.fp8_all_gather and policy.fp8_gatherable:
        return [policy, dataclasses.replace(policy, fsdp_fp8_all_gather=True)]
    return [policy]


def format_assignments(choices: Choices, limit: int) -> list[dict[str, Any]] | None:
    """Every combination of the layout's format params (the loss scale aside), or None where there are more than
    `limit`: what a stopping rule may check one by one."""
    params = format_params(choices)
    domains = [
        [(key, n) for n in range(options[0], options[1] + 1)] if key.startswith(RANK_PARAM) else [(key, o) for o in options]
        for key, options in params.items()
    ]
    if math.prod(len(d) for d in domains) > limit:
        return None
    return [dict(combo) for combo in itertools.product(*domains)]


def suggest(trial: optuna.Trial, choices: Choices, space: SearchSpace) -> Policy:
    """Ask the trial for every parameter of the layout (and the loss scale when a layer came out fp16, and the fp8
    all-gather when the search offers it and a layer came out in a format FSDP2 gathers in fp8)."""
    params: dict[str, Any] = {}
    for key, options in format_params(choices).items():
        if key.startswith(RANK_PARAM):
            params[key] = trial.suggest_int(key, *options)
        else:
            params[key] = trial.suggest_categorical(key, options)
    if policy_from_params(params, choices).uses_fp16:  # loss scaling matters only then
        ls = space.loss_scale
        lo, hi = (choices.loss_scale or {}).get("init_scale_log2", ls.init_scale_log2)
        params[LS_PARAM + "init_scale_log2"] = trial.suggest_int(LS_PARAM + "init_scale_log2", lo, hi)
        for name, options in (
            ("growth_interval", ls.growth_interval),
            ("growth_factor", ls.growth_factor),
            ("backoff_factor", ls.backoff_factor),
            ("dynamic", ls.dynamic),
        ):
            params[LS_PARAM + name] = trial.suggest_categorical(LS_PARAM + name, options)
    if choices.fp8_all_gather and policy_from_params(params, choices).fp8_gatherable:
        params[FSDP_PARAM] = trial.suggest_categorical(FSDP_PARAM, (False, True))
    return policy_from_params(params, choices)


def params_for(root: str, layers: Mapping[str, str], choices: Choices) -> dict[str, Any]:
    """The layout's params nearest to a per-layer assignment (warm starts): exact per layer; per group its
    members' most common format (ties: the safer); ranked, per format the number of layers assigned it."""
    params: dict[str, Any] = {}
    if len(choices.default) > 1:
        params[DEFAULT_PARAM] = root if root in choices.default else root_fallback(choices.default)
    if choices.layout == Layout.GROUPED.value:
        for group, members in choices.groups.items():
            votes = Counter(layers.get(m, fallback(choices.layers[m])) for m in members)
            params[GROUP_PARAM + group] = min(votes, key=lambda f: (-votes[f], format_names().index(f)))
    elif choices.layout == Layout.RANKED.value:
        for fmt, order in choices.ranking.items():
            params[RANK_PARAM + fmt] = sum(layers.get(n) == fmt for n in order)
    else:
        for name in choices.searched:
            params[LAYER_PARAM + name] = layers.get(name, fallback(choices.layers[name]))
    return params


def uniform_layers(choices: Choices, fmt: str) -> dict[str, str]:
    """Every layer in `fmt` where it may take it, else in its fallback (fp32, or bf16 in a FLOP goal's space)."""
    return {name: fmt if fmt in options else fallback(options) for name, options in choices.layers.items()}


def uniform_params(choices: Choices, fmt: str) -> dict[str, Any]:
    return params_for(fmt, uniform_layers(choices, fmt), choices)


def greedy_layers(prof: Profile, choices: Choices, budget: float, *, cost: LayerCost = measured_time) -> dict[str, str]:
    """A policy from the profile alone: each layer's cheapest allowed format, biggest saving over the format it
    keeps first, while the sum of single-layer metric drops stays within the budget (an estimate; trials measure). A
    layer no move fits keeps its fallback (fp32, or bf16 in a FLOP goal's space). `cost`: a profile row's cost by the
    search's goal (Goal.layer_cost): by default the time measured on this device; the FLOP goal's, on its target."""
    layers = {name: fallback(options) for name, options in choices.layers.items()}
    moves = []
    for name, rows in prof.by_layer().items():
        kept = fallback(choices.layers[name])
        reference = cost(rows.get(kept) or rows[Format.FP32.value])
        priced = [(cost(r), r) for f, r in rows.items() if f in choices.layers[name] and f != kept]
        priced = [(c, r) for c, r in priced if not math.isnan(c)]  # unpriced (untimed, or no rate): no move
        if priced:
            best_cost, best = min(priced, key=lambda cr: cr[0])
            if best_cost < reference:
                moves.append((reference - best_cost, name, best.format, max(0.0, best.metric_drop)))
    spent = 0.0
    for _saving, name, fmt, drop in sorted(moves, reverse=True):
        if spent + drop <= budget:
            layers[name] = fmt
            spent += drop
    return layers


def greedy_params(
    prof: Profile, choices: Choices, budget: float, *, root: str = Format.BF16.value, cost: LayerCost = measured_time
) -> dict[str, Any]:
    return params_for(root, greedy_layers(prof, choices, budget, cost=cost), choices)


def greedy_policy(prof: Profile, choices: Choices, budget: float, *, cost: LayerCost = measured_time) -> Policy:
    """The profile-greedy policy itself (a layout may only approximate it), with a bf16 root where allowed,
    as AMP would run the rest of the model."""
    root = Format.BF16 if Format.BF16.value in choices.default else Format(root_fallback(choices.default))
    layers = greedy_layers(prof, choices, budget, cost=cost)
    return Policy(layers={ROOT: root, **{name: Format(fmt) for name, fmt in layers.items()}})


def warm_starts(prof: Profile, choices: Choices, budget: float, *, cost: LayerCost = measured_time) -> list[dict[str, Any]]:
    """Known points the study measures after all-fp32: uniform bf16 and the profile-greedy layers, each with
    the root (everything outside the layers: norms, softmax, activations) in bf16 and in fp32. The profile
    does not time the root, and the devices differ: on a CPU a bf16 root can cost more than lowered layers
    save, on a GPU it is usually a gain. Duplicates (a single root choice) are dropped."""
    out: list[dict[str, Any]] = []
    for root in (Format.BF16.value, Format.FP32.value):
        for params in (
            params_for(root, uniform_layers(choices, Format.BF16.value), choices),
            greedy_params(prof, choices, budget, root=root, cost=cost),
        ):
            if params not in out:
                out.append(params)
    return out


def is_param(key: str, choices: Choices) -> bool:
    return key in format_params(choices)
