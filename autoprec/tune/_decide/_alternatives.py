"""What a user would run instead of a tuned policy, measured beside every result in the same run.

- `fp32`: strict IEEE fp32 matmuls (on CUDA, whatever the process's TF32 setting);
- `TF32` (CUDA only): fp32 with TF32 tensor-core matmuls, `torch.set_float32_matmul_precision("high")`;
- `uniform bf16`: every layer and the root under bf16 autocast, what AMP does;
- `fp8 everywhere` and `fp8 rowwise everywhere`: torchao's float8 training (its tensorwise and its rowwise
  recipe) on every Linear torchao's own size filter for that recipe accepts (`_auto_filter_for_recipe`: fixed
  thresholds from H100 benchmarks, not measured on this model or device), the rest under bf16 autocast, as
  torchao's README recommends; each measured only where fp8 has kernels (emulation is never faster) and the search
  space offers that recipe's format (`fp8`, `fp8-rowwise`); in a sharded search of a measured goal the tensorwise one
  all-gathers its weights in fp8 under FSDP2, as torchtitan's float8 guide runs it;
- `profile greedy`: autoprec's own shortcut, each layer's fastest allowed format while the summed
  single-layer drops fit the budget; the search has to beat it to be worth its trials.

TF32 is a process-wide setting, not a per-layer format, so it is measured and shown but never becomes the
policy: where it wins, the summary says so. So is `uniform bf16, CUDA graphs` (`--cuda-graphs`, compiled on CUDA):
uniform bf16 compiled with torch.compile's mode="reduce-overhead", how a host-bound step is made faster; a way to
compile, not a policy.
"""

from __future__ import annotations

import dataclasses

import torch

from autoprec import devices
from autoprec.formats import Format, Fp8Backend, device_name, format_problem, fp8_backend
from autoprec.policy import ROOT, Policy
from autoprec.tune._core._names import BF16, BF16_GRAPHS, FP8_EVERYWHERE, FP8_ROWWISE_EVERYWHERE, FP32, GREEDY, TF32
from autoprec.tune._core._records import Candidate
from autoprec.tune._measure._choices import Choices, LayerCost, greedy_policy, measured_time
from autoprec.tune._measure._profile_data import Profile

# torchao's recipes a user would turn on everywhere, each with its own size filter: (torchao recipe name, the format)
TORCHAO_RECIPES = {FP8_EVERYWHERE: ("tensorwise", Format.FP8), FP8_ROWWISE_EVERYWHERE: ("rowwise", Format.FP8_ROWWISE)}


@dataclasses.dataclass(frozen=True)
class Alternatives:
    """The candidates (name -> Candidate) and, per alternative left out, why (shown under the table)."""

    candidates: dict[str, Candidate]
    notes: dict[str, str]


def torchao_fp8_layers(model: torch.nn.Module, device: torch.device, recipe: str = "tensorwise") -> tuple[list[str], int]:
    """(names of the Linears torchao's auto filter for `recipe` ("tensorwise" or "rowwise") converts and autoprec
    can apply, number of Linears looked at). Linears inside a module that never calls them (MultiheadAttention's
    out_proj) are left out, as apply_policy refuses them."""
    from autoprec.apply import uncalled_children  # noqa: PLC0415 (torchao only when needed)
    from autoprec.formats.float8 import import_float8  # noqa: PLC0415

    fmt = {name: f for name, f in TORCHAO_RECIPES.values()}[recipe]
    accept = import_float8()._auto_filter_for_recipe(recipe, filter_fqns=[])
    skip = uncalled_children(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n and n not in skip]
    chosen = [n for n, m in linears if accept(m, n) and format_problem(fmt, m, device) is None]
    return chosen, len(linears)


def alternatives(
    model: torch.nn.Module,
    device: torch.device,
    prof: Profile,
    choices: Choices,
    budget: float,
    *,
    offered: frozenset[Format] | None = None,
    cost: LayerCost = measured_time,
    cuda_graphs: bool = False,
    fp8_all_gather: bool = False,
) -> Alternatives:
    """The alternatives every search and sweep result is re-measured beside (see the module's docstring).
    `offered`: the formats the search space offers its layers (None: all); a torchao recipe whose format it does not
    offer is left out. `cost`: how the profile-greedy policy prices a layer (the goal's Goal.layer_cost).
    `cuda_graphs`: uniform bf16 under CUDA graphs too (SearchConfig.cuda_graphs, which checked the device).
    `fp8_all_gather`: the candidates train under FSDP2 and the search measures FSDP2's fp8 all-gather (torchao's
    tensorwise recipe then all-gathers in fp8)."""
    every = [ROOT, *choices.layers]
    fp32 = Policy(layers=dict.fromkeys(every, Format.FP32))
    out: dict[str, Candidate] = {FP32: Candidate(fp32)}
    notes: dict[str, str] = {}
    if devices.lookup(device).has_tf32:
        out[TF32] = Candidate(fp32, tf32=True)
    else:
        notes[TF32] = f"TF32 is a CUDA tensor-core mode; not measured on {device.type}"
    out[BF16] = Candidate(Policy(layers=dict.fromkeys(every, Format.BF16)))
    if cuda_graphs:
        out[BF16_GRAPHS] = Candidate(out[BF16].policy, cuda_graphs=True)
    for name, (recipe, fmt) in TORCHAO_RECIPES.items():
        layers: list[str] = []
        n_linear = 0
        if offered is not None and fmt not in offered:
            notes[name] = f"not measured: the search space offers no `{fmt}` layer"
        elif fp8_backend(device) is Fp8Backend.EMULATION:
            notes[name] = (
                f"not measured: {device_name(str(device))} has no fp8 kernels, and torchao's emulation runs "
                "high-precision matmuls plus the fp8 casts"
            )
        else:
            try:
                layers, n_linear = torchao_fp8_layers(model, device, recipe)
            except (ImportError, AttributeError) as exc:  # a torchao without the filter: say so, do not guess its thresholds
                notes[name] = f"not measured: this torchao has no _auto_filter_for_recipe ({type(exc).__name__}: {exc})"
        if layers:
            gather = fp8_all_gather and fmt.family.fsdp_fp8_all_gather(fmt)
            out[name] = Candidate(Policy(layers={ROOT: Format.BF16, **dict.fromkeys(layers, fmt)}, fsdp_fp8_all_gather=gather))
        elif name not in notes:
            notes[name] = (
                f"same as uniform bf16 here: torchao's {recipe} size filter (H100 thresholds) converts none of the "
                f"model's {n_linear} Linears"
            )
    out[GREEDY] = Candidate(greedy_policy(prof, choices, budget, cost=cost))
    return Alternatives(candidates=out, notes=notes)
