"""The float8 family: torchao's float8 training (Float8Linear) with a per-GEMM choice of which of a Linear's three
GEMMs run in fp8 and how their operands are scaled (`Fp8Gemms`). (MX fp8 is the blockscaled family's: blockscaled.py.)
apply_policy swaps each listed Linear for torchao's Float8Linear of its recipe (`Float8Family.convert`) and casts
its input by one rule on every device (`fp8_input_dtype`)."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from autoprec import devices
from autoprec.formats.base import (
    E4M3_MAX,
    GEMMS,
    Converted,
    Format,
    FormatFamily,
    GemmCast,
    OperandCast,
    _package,
    caller_precision,
    register_family,
    register_format,
)
from autoprec.tensors import map_tensors

log = logging.getLogger("autoprec")

# fp8's rounding alone measures about 29 dB (e4m3, 3 mantissa bits) and 24 dB (e5m2, 2 bits): below 20 dB the GEMM
# lost more than its rounding, values its scaling flushed to zero or saturated.
SQNR_FLOOR_DB = 20.0

# CUDA's fp8 GEMM (torch._scaled_mm, ATen's cuda/ScaledBlas.cpp) needs mat1's inner dimension and both of mat2's
# divisible by 16: in torchao's three GEMMs that is the weight's two dimensions and, in the weight gradient
# (grad_output^T @ input), the batch's token count.
FP8_DIM_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class Fp8Gemms:
    """Which of an nn.Linear's three GEMMs torchao runs in fp8, and how it scales their operands: fprop (the
    output), dgrad (the input's gradient), wgrad (the weight's gradient). torchao leaves both operands of a GEMM
    that is not fp8 uncast: it runs in high precision. `recipe`: torchao's recipe of that name
    (Float8LinearConfig.from_recipe_name), where this is one (torchtitan and Megatron know recipes by name);
    `float8_linear_config` builds the others from per-operand cast configs."""

    scaling: str  # "tensorwise": one scale per tensor, e5m2 gradients; "rowwise": one per row, e4m3 throughout
    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    recipe: str | None = None

    def to_json(self) -> dict[str, object]:
        """What float8_linear_config reads (and `autoprec export --to torchao` writes as data)."""
        return dataclasses.asdict(self)

    @property
    def high_precision(self) -> tuple[str, ...]:
        """The GEMMs it keeps in high precision, by name."""
        return tuple(g for g in GEMMS if not getattr(self, g))

    def input_dtype(self, weight_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> torch.dtype:
        """What the layer's input is cast to, autocast off inside the layer: fp8_input_dtype."""
        return fp8_input_dtype(self.to_json(), weight_dtype, autocast_dtype)

    def rows_to_pad(self, rows: int) -> int:
        """Zero rows to add to a call of `rows` rows (the batch's tokens) so that CUDA runs its fp8 GEMMs: the
        weight gradient's inner dimension is the rows. Zero rows raise no dynamic scale (an amax) and add nothing to
        the weight's gradient, so the numerics are the unpadded call's; only a ragged call (an epoch's last batch)
        pays the copy."""
        return -rows % FP8_DIM_MULTIPLE if self.wgrad else 0


@dataclasses.dataclass(frozen=True)
class Float8Format:
    """What the float8 family keeps of one of its formats (Float8Family.add_format)."""

    gemms: Fp8Gemms
    # the fp8 dtype its gradients are cast to with one dynamic scale per tensor, whose underflow the gradient
    # histograms can count (None: not such a cast; rowwise scales per row, which a histogram cannot follow)
    tensorwise_grad_dtype: torch.dtype | None = None
    # torchao can all-gather its weights in fp8 under FSDP2 (enable_fsdp_float8_all_gather: tensorwise scales only)
    fsdp_fp8_all_gather: bool = False


# each float8 format's, keyed by the Format (a str equal to its name): a plain dict lookup, which torch.compile traces
_FORMATS: dict[str, Float8Format] = {}

_FP8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)  # what a gradient is cast to per tensor

# the CUDA compute capability torch._scaled_mm's fp8 kernels need (has_fp8_kernels): Ada and Hopper on
MIN_CAPABILITY = (8, 9)


def fp8_input_dtype(gemms: dict, weight_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """What an fp8 layer's input is cast to, autocast off inside the layer, for an Fp8Gemms (its to_json()): the one
    rule for apply_policy and, its source copied, the file `autoprec export --to torchao` writes. It makes torchao
    compute the same on every device (its Float8Linear reads CUDA's autocast state only, so on a CPU it would not
    follow the caller's). A recipe: the caller's autocast dtype, as torchao's own forward casts under CUDA autocast,
    else the weight's. A per-GEMM mix: operands of one dtype for each high-precision GEMM (torchao's do not cast
    them): the weight's dtype where dgrad is high precision (it multiplies the output's gradient by the stored
    weight), else bf16 (wgrad multiplies the output's gradient by the input)."""
    if gemms["recipe"] is not None:
        return autocast_dtype or weight_dtype
    return weight_dtype if not gemms["dgrad"] else torch.bfloat16


def float8_linear_config(gemms: dict) -> Any:
    """torchao's Float8LinearConfig for an Fp8Gemms (its to_json()): the one place that builds it, for apply_policy
    and, its source copied, for the file `autoprec export --to torchao` writes. Scales and dtypes follow torchao's
    recipes: tensorwise casts the gradient to e5m2, rowwise casts everything to e4m3 with power-of-two scales."""
    from torchao.float8.config import (
        CastConfig,
        Float8LinearConfig,
        ScalingGranularity,
        ScalingType,
        e4m3_dtype,
        e5m2_dtype,
    )

    if gemms["recipe"] is not None:
        return Float8LinearConfig.from_recipe_name(gemms["recipe"])
    rowwise = gemms["scaling"] == "rowwise"
    granularity = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE

    def cast(gemm, dtype):
        # a new CastConfig per operand: torchao fills in a missing target dtype in place
        if not gemms[gemm]:
            return CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=dtype)
        return CastConfig(scaling_granularity=granularity, target_dtype=dtype)

    grad = e4m3_dtype if rowwise else e5m2_dtype
    return Float8LinearConfig(
        cast_config_input=cast("fprop", e4m3_dtype),
        cast_config_weight=cast("fprop", e4m3_dtype),
        cast_config_grad_output=cast("dgrad", grad),
        cast_config_weight_for_grad_input=cast("dgrad", e4m3_dtype),
        cast_config_input_for_grad_weight=cast("wgrad", e4m3_dtype),
        cast_config_grad_output_for_grad_weight=cast("wgrad", grad),
        round_scales_to_power_of_2=rowwise,
    )


class Fp8Backend(str, enum.Enum):
    """How torchao runs an fp8 layer on a device; apply_policy logs and records it per layer."""

    KERNELS = "torchao float8 kernels"  # torch._scaled_mm on the GPU's fp8 tensor cores
    EMULATION = "torchao float8 emulation"  # fp8 rounding and scaling emulated with high-precision matmuls

    def __str__(self) -> str:
        return self.value


def has_fp8_kernels(device: torch.device | str) -> bool:
    """True where torch._scaled_mm has real fp8 kernels: CUDA devices of compute capability 8.9+."""
    return _package()._has_capability(torch.device(device), MIN_CAPABILITY)


def fp8_backend(device: torch.device | str) -> Fp8Backend:
    """How fp8 layers run on this device: real kernels or torchao's emulation (autoprec.formats.has_fp8_kernels,
    read there: tests stand in for an H100 by replacing it)."""
    return Fp8Backend.KERNELS if _package().has_fp8_kernels(device) else Fp8Backend.EMULATION


def _linear_losses(module: torch.nn.Linear) -> list[str]:
    """What of this Linear torchao's Float8Linear would drop: it replaces the layer by a plain Linear built from its
    weight and bias, so a subclass's own forward (a LoRA adapter, a scale, a gate) and anything else it holds
    would silently vanish from the output and the state_dict. Empty for nn.Linear and the subclasses that are it."""
    lost = []
    if type(module).forward is not torch.nn.Linear.forward:
        lost.append("its own forward")
    params = [n for n, _ in module.named_parameters(recurse=False, remove_duplicate=False) if n not in ("weight", "bias")]
    buffers = [n for n, _ in module.named_buffers(recurse=False)]
    children = [n for n, _ in module.named_children()]
    for kind, names in (("parameters", params), ("buffers", buffers), ("child modules", children)):
        if names:
            lost.append(f"its {kind} {', '.join(names)}")
    return lost


def fp8_shape_problem(module: torch.nn.Module, fmt: Format | None = None) -> str | None:
    """Why torchao cannot run this module in an fp8 format (`fmt`, fp8 by default), or None when it can.
    apply_policy refuses what this names and the profile rules it out, so the search never offers a format
    apply_policy would refuse."""
    fmt = fmt or Format.FP8
    if not isinstance(module, torch.nn.Linear):
        return f"{fmt.value} covers nn.Linear only, not {type(module).__name__}"
    lost = _linear_losses(module)
    if lost:
        return (
            f"{fmt.value} would replace this {type(module).__name__} by torchao's Float8Linear, a plain Linear of its "
            f"weight and bias, dropping {' and '.join(lost)}"
        )
    in_f, out_f = module.in_features, module.out_features
    if in_f % FP8_DIM_MULTIPLE or out_f % FP8_DIM_MULTIPLE:
        return f"{fmt.value} needs in/out features divisible by {FP8_DIM_MULTIPLE}, got ({in_f}, {out_f})"
    return None


@contextlib.contextmanager
def torchao_loading_quietly() -> Iterator[None]:
    """While torchao may be imported (here, or by model.py through transformers), its loader's noise (CUDA extensions
    a CPU lacks, torch's pytree deprecations) kept out of the logs, whatever handlers are set up meanwhile."""
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in noisy]
    for lg in noisy:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(noisy, levels):
            lg.setLevel(level)


def import_float8() -> Any:
    """torchao.float8, imported with its loader's noise kept out of the logs (torchao_loading_quietly)."""
    with torchao_loading_quietly():
        import torchao.float8 as float8
    return float8


# ---- apply: torchao Float8Linear, aliases and tied weights kept ----------------------------------------------------


def _set_submodule(model: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that are one Parameter object (tied weights), grouped."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _untied(model: torch.nn.Module, groups: list[list[str]]) -> list[str] | None:
    for names in groups:
        if len({id(model.get_parameter(n)) for n in names}) > 1:
            return names
    return None


def _convert_fp8(
    model: torch.nn.Module,
    recipes: Mapping[Fp8Gemms, list[torch.nn.Module]],
    names: Mapping[int, list[str]],
    device: torch.device,
    all_gather: frozenset[Fp8Gemms] = frozenset(),
    *,
    device_hint: bool = True,
) -> tuple[Fp8Backend, dict[str, torch.nn.Module]]:
    """Swap each recipe's modules for torchao Float8Linear of that recipe everywhere they are used (the recipes in
    `all_gather` with their weights all-gathered in fp8 under FSDP2); restore them all and raise if ties break.
    Returns the backend and the modules it replaced, by path (what undoing it puts back)."""
    float8 = import_float8()
    backend = fp8_backend(device)
    better = devices.preferred_over(device)
    if backend is Fp8Backend.EMULATION and better is not None and device_hint:
        warnings.warn(
            f"apply_policy: the model is on the {devices.device_for(device).unit}, so its fp8 layers use torchao's "
            f"emulation; move the model to the {better.unit} before apply_policy to use fp8 kernels",
            stacklevel=7,  # the user's apply_policy call: apply_policy, _apply, _put, _convert, convert, _convert_fp8
        )
    modules = [m for group in recipes.values() for m in group]
    originals = {path: m for m in modules for path in names[id(m)]}
    ties = _tied_groups(model)
    try:
        for recipe, group in recipes.items():
            ids = {id(m) for m in group}
            config = dataclasses.replace(
                float8_linear_config(recipe.to_json()),
                emulate=backend is Fp8Backend.EMULATION,
                enable_fsdp_float8_all_gather=recipe in all_gather,
            )
            # Filter by object, not name: torchao visits each parent's children once, under one name.
            float8.convert_to_float8_training(model, module_filter_fn=lambda mod, fqn, ids=ids: id(mod) in ids, config=config)
        for m in modules:
            # torchao swaps per parent: a module at two places may become two Float8Linears, or stay a Linear
            # at the second; put the one Float8Linear at every place so the alias stays one object.
            paths = names[id(m)]
            new = next(model.get_submodule(p) for p in paths if model.get_submodule(p) is not m)
            for path in paths:
                _set_submodule(model, path, new)
        broken = _untied(model, ties)
        if broken:
            owners = [n.rpartition(".")[0] or "<model>" for n in broken]
            raise ValueError(
                f"apply_policy: fp8 would untie the weights that {', '.join(map(repr, owners))} share "
                f"(torchao's Float8Linear did not keep the shared Parameter); give the fp8 one bf16, fp16 or fp32"
            )
    except BaseException:
        _restore(model, originals)  # a refused policy leaves the model as it was
        raise
    return backend, originals


def _restore(model: torch.nn.Module, originals: Mapping[str, torch.nn.Module]) -> None:
    for path, original in originals.items():
        _set_submodule(model, path, original)


# ---- a listed fp8 layer's call -------------------------------------------------------------------------------------


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)


def _padded(args: tuple, kwargs: dict, pad: int) -> tuple[tuple, dict]:
    """A Linear's call with its input flattened to rows and `pad` zero rows added (Fp8Gemms.rows_to_pad)."""

    def pad_rows(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t.reshape(-1, t.shape[-1]), (0, 0, 0, pad))

    if args:
        return (pad_rows(args[0]), *args[1:]), kwargs
    key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    return args, {**kwargs, key: pad_rows(kwargs[key])}


def _empty_linear(layer: torch.nn.Module, x: Any, dtype: torch.dtype) -> torch.Tensor:
    """A Linear's output for an input with no rows, in the dtype its fp8 call gives (an MoE's index_add_ needs one
    dtype from every expert), with gradients to its weight and bias (zero)."""
    weight, bias = layer.weight, getattr(layer, "bias", None)
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))  # an fp8 layer's
    return torch.nn.functional.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))


@register_family
class Float8Family(FormatFamily):
    name = "float8"
    replaces_modules = True
    fp8 = True
    timed_inside = "bf16"
    sqnr_floor_db = SQNR_FLOOR_DB
    gemm_floor_rules_out = True

    # device_problem: the default (None): torchao emulates every one of its formats where the device has no fp8 kernels

    def has_kernels(self, fmt: Format, device: torch.device) -> bool:
        # where torchao emulates fp8 (no fp8 kernels: a CPU, a GPU below MIN_CAPABILITY), its time is that of
        # high-precision matmuls plus the casts: nothing of fp8's speed, as the alternatives already say
        return _package().has_fp8_kernels(device)

    def add_format(
        self,
        fmt: Format,
        *,
        gemms: Fp8Gemms | None = None,
        tensorwise_grad_dtype: torch.dtype | None = None,
        fsdp_fp8_all_gather: bool = False,
        **facts: Any,
    ) -> None:
        """`gemms` (required): the GEMMs torchao's float8 training runs in fp8 and their scaling (a recipe, or a
        per-GEMM mix); `tensorwise_grad_dtype`, `fsdp_fp8_all_gather`: Float8Format's."""
        super().add_format(fmt, **facts)  # refuses any other
        if not isinstance(gemms, Fp8Gemms):
            raise ValueError(
                f"format {fmt.value!r}: gemms must be an Fp8Gemms, such as Fp8Gemms('tensorwise'), but got {gemms!r}"
            )
        casts_grad = gemms.scaling == "tensorwise" and (gemms.dgrad or gemms.wgrad)  # a gradient GEMM in fp8
        if tensorwise_grad_dtype not in ((None, *_FP8_DTYPES) if casts_grad else (None,)):
            raise ValueError(
                f"format {fmt.value!r}: tensorwise_grad_dtype must be "
                + ("None or an fp8 dtype (torch.float8_e5m2, torch.float8_e4m3fn)" if casts_grad else "None")
                + f" (its gradient is {'cast per tensor' if casts_grad else 'cast by no tensorwise fp8 GEMM'}), "
                f"but got {tensorwise_grad_dtype!r}"
            )
        _FORMATS[fmt] = Float8Format(gemms, tensorwise_grad_dtype, bool(fsdp_fp8_all_gather))

    def remove_format(self, fmt: Format) -> None:
        _FORMATS.pop(fmt, None)

    def fp8_gemms(self, fmt: Format) -> Fp8Gemms:
        return _FORMATS[fmt].gemms

    def tensorwise_grad_dtype(self, fmt: Format) -> torch.dtype | None:
        return _FORMATS[fmt].tensorwise_grad_dtype

    def fsdp_fp8_all_gather(self, fmt: Format) -> bool:
        return _FORMATS[fmt].fsdp_fp8_all_gather

    def after_optimizer_step(self, model: torch.nn.Module) -> None:
        # every sharded fp8-gathered weight's scale in one all-reduce (torchao skips weights that are not sharded)
        import_float8().precompute_float8_dynamic_scale_for_fsdp(model)

    def module_problem(self, fmt: Format, module: torch.nn.Module) -> str | None:
        return fp8_shape_problem(module, fmt)

    def root_problem(self, fmt: Format) -> str | None:
        # torchao replaces a root Linear by a new object; apply_policy changes the model in place.
        return (
            "torchao would replace it by a new module, and apply_policy works in place; wrap the Linear in "
            "nn.Sequential and name its child"
        )

    def export_name(self, fmt: Format) -> str | None:
        return _FORMATS[fmt].gemms.recipe or fmt.value

    def gemm_precisions(self, fmt: Format, outer: str | None = None) -> tuple[str, str, str]:
        """A GEMM its Fp8Gemms runs in fp8 is "fp8". One left in high precision runs in the dtype fp8_input_dtype
        casts the input to, autocast off inside the layer: a per-GEMM mix's by a fixed rule whatever the caller's
        autocast (dgrad high: the weight's dtype, fp32 master weights, so "fp32"; dgrad fp8: bf16); a recipe's in the
        caller's autocast dtype (`outer`), else the weight's, fp32 (rowwise_with_gw_hp's wgrad)."""
        gemms = _FORMATS[fmt].gemms
        if gemms.recipe is not None:
            high = outer or "fp32"
        else:
            high = "fp32" if not gemms.dgrad else "bf16"
        fprop, dgrad, wgrad = ("fp8" if getattr(gemms, g) else high for g in GEMMS)
        return (fprop, dgrad, wgrad)

    def gemm_casts(self, fmt: Format) -> tuple[GemmCast | None, GemmCast | None, GemmCast | None]:
        """Each fp8 GEMM's operands cast to 8 bits: tensorwise with one fp32 scale per tensor from its amax (a pass of
        its own), rowwise with one per row along the GEMM's contraction (the amax within the cast's pass)."""
        gemms = _FORMATS[fmt].gemms
        tensorwise = gemms.scaling == "tensorwise"
        operand = OperandCast(bits=8, block=0 if tensorwise else -1, scale_bytes=4, tensor_amax=tensorwise)
        cast = GemmCast(f"fp8-{gemms.scaling}", operand, operand)
        fprop, dgrad, wgrad = (cast if getattr(gemms, g) else None for g in GEMMS)
        return fprop, dgrad, wgrad

    def convert(
        self,
        model: torch.nn.Module,
        listed: Mapping[str, Format],
        paths: Mapping[str, torch.nn.Module],
        names: Mapping[int, list[str]],
        device: torch.device,
        *,
        all_gather: frozenset[Format] = frozenset(),
        device_hint: bool = True,
    ) -> Converted:
        recipes: dict[Fp8Gemms, dict[int, torch.nn.Module]] = {}
        for n, f in listed.items():
            recipes.setdefault(_FORMATS[f].gemms, {})[id(paths[n])] = paths[n]
        if not recipes:
            return Converted()
        fp8 = {recipe: list(group.values()) for recipe, group in recipes.items()}
        gathered = frozenset(_FORMATS[f].gemms for f in all_gather if f in _FORMATS)
        backend, originals = _convert_fp8(model, fp8, names, device, gathered, device_hint=device_hint)
        log.info("apply_policy: fp8 layers %s use %s", sorted(listed), backend)
        return Converted(backend=backend, undo=lambda: _restore(model, originals), replaced=originals)

    def forward(
        self, fmt: Format, module: torch.nn.Module, inner: Callable[..., Any], device_type: str, args: tuple, kwargs: dict
    ) -> Any:
        dev = device_type
        outer_autocast = torch.is_autocast_enabled(dev)
        weight = getattr(module, "weight", None)
        x = _first_tensor(args, kwargs)
        gemms = _FORMATS[fmt].gemms
        if not isinstance(weight, torch.Tensor) or x is None:
            with torch.autocast(dev, dtype=torch.bfloat16):
                return caller_precision(inner(module, *args, **kwargs), outer_autocast)
        # Fp8Gemms.input_dtype: the same dtypes into torchao on every device, whatever autocast torchao can see
        cast = gemms.input_dtype(weight.dtype, torch.get_autocast_dtype(dev) if outer_autocast else None)
        args, kwargs = map_tensors((args, kwargs), lambda t: t.to(cast) if t.is_floating_point() else t)
        rows = math.prod(x.shape[:-1])
        pad = gemms.rows_to_pad(rows)
        if pad:  # a ragged batch (an epoch's last): padded so that CUDA's fp8 GEMMs take it, the padding cut off
            args, kwargs = _padded(args, kwargs, pad)
        with torch.autocast(dev, enabled=False):
            if rows == 0:  # no rows (an MoE expert given no tokens): torchao's amax of an empty tensor fails
                out = _empty_linear(module, _first_tensor(args, kwargs), cast)
            else:
                out = inner(module, *args, **kwargs)
        if pad:
            out = out[:rows].reshape(*x.shape[:-1], out.shape[-1])
        return caller_precision(out, outer_autocast)


_FP8: dict[str, Any] = {
    "family": "float8",
    "max_value": E4M3_MAX,
    "fallback": Format.BF16,
    "risky": True,
    "linear_only": True,
}
Format.FP8 = register_format(
    "fp8",
    inside="torchao float8 training, tensorwise: e4m3 forward, e5m2 gradients, one dynamic scale per tensor",
    gemms=Fp8Gemms("tensorwise", recipe="tensorwise"),
    tensorwise_grad_dtype=torch.float8_e5m2,
    fsdp_fp8_all_gather=True,
    **_FP8,
)
Format.FP8_ROWWISE = register_format(
    "fp8-rowwise",
    inside="torchao float8 training, rowwise: e4m3 everywhere, one scale per row (more accurate, slower)",
    gemms=Fp8Gemms("rowwise", recipe="rowwise"),
    **_FP8,
)
Format.FP8_ROWWISE_GW_HP = register_format(
    "fp8-rowwise-gw-hp",
    inside="torchao float8 training, rowwise_with_gw_hp: rowwise, the weight gradient in high precision",
    gemms=Fp8Gemms("rowwise", wgrad=False, recipe="rowwise_with_gw_hp"),
    **_FP8,
)
Format.FP8_FWD = register_format(
    "fp8-fwd",
    inside="torchao float8, tensorwise, forward only: e4m3 output GEMM; both gradient GEMMs in the weight's "
    "dtype (fp32 master weights: fp32)",
    gemms=Fp8Gemms("tensorwise", dgrad=False, wgrad=False),
    **_FP8,
)
Format.FP8_FWD_DGRAD = register_format(
    "fp8-fwd-dgrad",
    inside="torchao float8, tensorwise, forward and input gradient: e4m3 forward, e5m2 gradient; the weight gradient in bf16",
    gemms=Fp8Gemms("tensorwise", wgrad=False),
    tensorwise_grad_dtype=torch.float8_e5m2,  # cast once per tensor for dgrad
    fsdp_fp8_all_gather=True,  # the weight is cast tensorwise wherever it is fp8, and wgrad never reads it
    **_FP8,
)
Format.FP8_ROWWISE_FWD = register_format(
    "fp8-rowwise-fwd",
    inside="torchao float8, rowwise, forward only: e4m3 output GEMM, one scale per row; both gradient GEMMs "
    "in the weight's dtype (fp32 master weights: fp32)",
    gemms=Fp8Gemms("rowwise", dgrad=False, wgrad=False),
    **_FP8,
)
Format.FP8_ROWWISE_FWD_DGRAD = register_format(
    "fp8-rowwise-fwd-dgrad",
    inside="torchao float8, rowwise, forward and input gradient: e4m3, one scale per row; the weight gradient in bf16",
    gemms=Fp8Gemms("rowwise", wgrad=False),
    **_FP8,
)
