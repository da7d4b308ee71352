"""The precision formats, their numeric limits, and which device supports what."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from typing import Any

import torch

from autoprec import devices


class Format(str, enum.Enum):
    """A per-layer precision format; the string value is what files and Optuna params hold. What each one
    means (its dtype or torchao fp8 GEMMs, loss scaling, range, fallback, where it runs) is its `FormatSpec`."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP8_ROWWISE = "fp8-rowwise"
    FP8_ROWWISE_GW_HP = "fp8-rowwise-gw-hp"
    FP8_FWD = "fp8-fwd"
    FP8_FWD_DGRAD = "fp8-fwd-dgrad"
    FP8_ROWWISE_FWD = "fp8-rowwise-fwd"
    FP8_ROWWISE_FWD_DGRAD = "fp8-rowwise-fwd-dgrad"
    MXFP8 = "mxfp8"

    def __str__(self) -> str:
        return self.value

    @property
    def spec(self) -> FormatSpec:
        return REGISTRY[self]

    def fallbacks(self) -> Iterator[Format]:
        """The safer formats after this one, in order (fp16/fp8 -> bf16 -> fp32)."""
        current = self.spec.fallback
        while current is not None:
            yield current
            current = current.spec.fallback


FP16_MAX = torch.finfo(torch.float16).max  # 65504
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448

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
        return tuple(g for g in ("fprop", "dgrad", "wgrad") if not getattr(self, g))

    def input_dtype(self, weight_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> torch.dtype:
        """What the layer's input is cast to, autocast off inside the layer: fp8_input_dtype."""
        return fp8_input_dtype(self.to_json(), weight_dtype, autocast_dtype)

    def rows_to_pad(self, rows: int) -> int:
        """Zero rows to add to a call of `rows` rows (the batch's tokens) so that CUDA runs its fp8 GEMMs: the
        weight gradient's inner dimension is the rows. Zero rows raise no dynamic scale (an amax) and add nothing to
        the weight's gradient, so the numerics are the unpadded call's; only a ragged call (an epoch's last batch)
        pays the copy."""
        return -rows % FP8_DIM_MULTIPLE if self.wgrad else 0


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


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """Everything autoprec knows about one format. Adding a format is one entry in REGISTRY (and its tests).

    `autocast`: the dtype the layer's forward runs under torch.autocast (bf16, fp16), or None.
    `fp8`: the GEMMs torchao's float8 training runs in fp8 and their scaling (a recipe, or a per-GEMM mix).
    `loss_scale`: whether it needs a GradScaler (gradients that underflow without one).
    `max_value`: the largest finite value its forward's low-precision values can hold (None: fp32/bf16 range).
    `fallback`: the next safer format, when a layout or a variant must lower a layer less.
    `risky`: fewer mantissa bits or a narrow range: worth choosing only for a measured gain.
    `linear_only`: runs on nn.Linear only (torchao's float8 swaps Linears).
    `inside`: what the layer computes in, for the README and `autoprec show`.
    """

    format: Format
    inside: str
    autocast: torch.dtype | None = None
    fp8: Fp8Gemms | None = None
    loss_scale: bool = False
    max_value: float | None = None
    fallback: Format | None = None
    risky: bool = False
    linear_only: bool = False
    # the fp8 dtype its gradients are cast to with one dynamic scale per tensor, whose underflow the gradient
    # histograms can count (None: not such a cast; rowwise scales per row, which a histogram cannot follow)
    tensorwise_grad_dtype: torch.dtype | None = None
    # torchao can all-gather its weights in fp8 under FSDP2 (enable_fsdp_float8_all_gather: tensorwise scales only)
    fsdp_fp8_all_gather: bool = False
    min_capability: tuple[int, int] | None = None  # CUDA compute capability its kernels need
    emulation_works: bool = True  # False: no working emulation, so a device without its kernels refuses it
    why_no_emulation: str = ""

    @property
    def is_fp8(self) -> bool:
        return self.fp8 is not None or self.format is Format.MXFP8

    def device_problem(self, device: torch.device | str) -> str | None:
        """Why this format cannot run on `device` at all, or None when it can (maybe emulated)."""
        dev = torch.device(device)
        if self.autocast is not None:
            if not devices.lookup(dev).autocast_available(dev):
                return f"torch.autocast is not available on {dev.type}"
            if not devices.lookup(dev).supports_dtype(dev, self.autocast):
                return f"{device_name(str(dev))} has no {self.format.value}"
            return None
        if self.min_capability is None:
            return None
        has = _has_capability(dev, self.min_capability)
        if self.format is Format.MXFP8 and has:
            # No session has had a Blackwell GPU to build and test it on; refuse rather than run it untested.
            return "autoprec does not yet run mxfp8 (torchao's mxfp8 training is a prototype it has not been tested with)"
        if has or self.emulation_works:
            return None
        need = ".".join(map(str, self.min_capability))
        return f"{self.format.value} needs CUDA compute capability {need}+ kernels on this device; {self.why_no_emulation}"


REGISTRY: dict[Format, FormatSpec] = {
    spec.format: spec
    for spec in (
        FormatSpec(Format.FP32, inside="autocast off; inputs arriving in bf16/fp16 are cast to fp32"),
        FormatSpec(Format.BF16, inside="torch.autocast(bfloat16)", autocast=torch.bfloat16, fallback=Format.FP32),
        FormatSpec(
            Format.FP16,
            inside="torch.autocast(float16), with a GradScaler",
            autocast=torch.float16,
            loss_scale=True,
            max_value=FP16_MAX,
            fallback=Format.BF16,
            risky=True,
        ),
        FormatSpec(
            Format.FP8,
            inside="torchao float8 training, tensorwise: e4m3 forward, e5m2 gradients, one dynamic scale per tensor",
            fp8=Fp8Gemms("tensorwise", recipe="tensorwise"),
            max_value=E4M3_MAX,
            fallback=Format.BF16,
            risky=True,
            linear_only=True,
            tensorwise_grad_dtype=torch.float8_e5m2,
            fsdp_fp8_all_gather=True,
            min_capability=(8, 9),
        ),
        FormatSpec(
            Format.FP8_ROWWISE,
            inside="torchao float8 training, rowwise: e4m3 everywhere, one scale per row (more accurate, slower)",
            fp8=Fp8Gemms("rowwise", recipe="rowwise"),
            max_value=E4M3_MAX,
            fallback=Format.BF16,
            risky=True,
            linear_only=True,
            min_capability=(8, 9),
        ),
        FormatSpec(
            Format.FP8_ROWWISE_GW_HP,
            inside="torchao float8 training, rowwise_with_gw_hp: rowwise, the weight gradient in high precision",
            fp8=Fp8Gemms("rowwise", wgrad=False, recipe="rowwise_with_gw_hp"),
            max_value=E4M3_MAX,
            fallback=Format.BF16,
            risky=True,
            linear_only=True,
            min_capability=(8, 9),
        ),
        FormatSpec(
            Format.FP8_FWD,
            inside="torchao float8, tensorwise, forward only: e4m3 output GEMM; both gradient GEMMs in the weight's "
            "dtype (fp32 master weights: fp32)",
            fp8=Fp8Gemms("tensorwise", dgrad=False, wgrad=False),
            max_value=E4M3_MAX,
            fallback=Format.BF16,
            risky=True,
            linear_only=True,
            min_capability=(8, 9),
        ),
        FormatSpec(
            Format.FP8_FWD_DGRAD,
            inside="torchao float8, tensorwise, forward and input gradient: e4m3 forward, e5m2 gradient; the weight "
            "gradient in bf16",
            fp8=Fp8Gemms("tensorwise", wgrad=False),
            max_value=E4M3_MAX,
            fallback=Format.BF16,
            risky=True,
            linear_only=True,
            tensorwise_grad_dtype=torch.float8_e5m2,  # cast once per tensor for dgrad
            fsdp_fp8_all_gather=True,  # the weight is cast tensorwise wherever it is fp8, and wgrad never reads it
            min_capability=(8, 9),
        ),
        FormatSpec(
            Format.FP8_ROWWISE_FWD,
            inside="torchao float8, rowwise, forward only: e4m3 output GEMM, one scale per row; both gradient GEMMs "
            "in the weight's dtype (fp32 master weights: fp32)",
            fp8=Fp8Gemms("rowwise", dgrad=False, wgrad=False),
            max_value=E4M3_MAX,
            fallback=Format.BF16,
            risky=True,
            linear_only=True,
            min_capability=(8, 9),
        ),
        FormatSpec(
            Format.FP8_ROWWISE_FWD_DGRAD,
            inside="torchao float8, rowwise, forward and input gradient: e4m3, one scale per row; the weight gradient in bf16",
            fp8=Fp8Gemms("rowwise", wgrad=False),
            max_value=E4M3_MAX,
            fallback=Format.BF16,
            risky=True,
            linear_only=True,
            min_capability=(8, 9),
        ),
        FormatSpec(
            Format.MXFP8,
            inside="MX fp8: e4m3 with one power-of-two scale per 32 elements (Blackwell tensor cores)",
            max_value=E4M3_MAX,
            fallback=Format.BF16,
            risky=True,
            linear_only=True,
            min_capability=(10, 0),
            emulation_works=False,
            why_no_emulation="autoprec does not run torchao's mxfp8 training prototype, which needs that hardware",
        ),
    )
}

FORMATS: tuple[str, ...] = tuple(f.value for f in Format)
FP8_FORMATS: tuple[Format, ...] = tuple(f for f in Format if REGISTRY[f].is_fp8)
RISKY: tuple[Format, ...] = tuple(f for f in Format if REGISTRY[f].risky)

# Formats that run through torch.autocast and the dtype each one lowers to.
AUTOCAST_DTYPE: dict[Format, torch.dtype] = {f: s.autocast for f, s in REGISTRY.items() if s.autocast is not None}


def parse_format(value: object, *, field: str = "format") -> Format:
    """Return the Format for a string such as "bf16"; raise ValueError naming the choices."""
    if isinstance(value, Format):
        return value
    try:
        return Format(str(value).strip().lower())
    except ValueError:
        raise ValueError(f"{field} must be one of {', '.join(FORMATS)}, but got {value!r}") from None


def default_device() -> torch.device:
    """Where autoprec works unless told: the GPU when there is one (autoprec.devices.default_device)."""
    return devices.default_device()


def _has_capability(dev: torch.device, need: tuple[int, int]) -> bool:
    """Whether `dev`'s kernels are rated `need` or above (CUDA's compute capability): the one place a format's
    `min_capability` is decided (tests/gpu_contract.py makes the CPU an H100 here)."""
    have = devices.lookup(dev).capability(dev)
    return have is not None and have >= need


def has_fp8_kernels(device: torch.device | str) -> bool:
    """True where torch._scaled_mm has real fp8 kernels: CUDA devices of compute capability 8.9+."""
    need = REGISTRY[Format.FP8].min_capability
    return need is not None and _has_capability(torch.device(device), need)


class Fp8Backend(str, enum.Enum):
    """How torchao runs an fp8 layer on a device; apply_policy logs and records it per layer."""

    KERNELS = "torchao float8 kernels"  # torch._scaled_mm on the GPU's fp8 tensor cores
    EMULATION = "torchao float8 emulation"  # fp8 rounding and scaling emulated with high-precision matmuls

    def __str__(self) -> str:
        return self.value


def fp8_backend(device: torch.device | str) -> Fp8Backend:
    """How fp8 layers run on this device: real kernels or torchao's emulation."""
    return Fp8Backend.KERNELS if has_fp8_kernels(device) else Fp8Backend.EMULATION


def autocast_supported(device: torch.device | str, fmt: Format) -> bool:
    """Whether torch.autocast accepts this format's dtype on this device type."""
    return fmt not in AUTOCAST_DTYPE or REGISTRY[fmt].device_problem(device) is None


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


def fp8_shape_problem(module: torch.nn.Module, fmt: Format = Format.FP8) -> str | None:
    """Why torchao cannot run this module in an fp8 format, or None when it can. apply_policy refuses what this
    names and the profile rules it out, so the search never offers a format apply_policy would refuse."""
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


def format_problem(fmt: Format, module: torch.nn.Module, device: torch.device | str) -> str | None:
    """Why `module` cannot run in `fmt` on `device` (the device, then the module's type and shape), or None."""
    spec = REGISTRY[fmt]
    problem = spec.device_problem(device)
    if problem is None and spec.linear_only:
        problem = fp8_shape_problem(module, fmt)
    return problem


def device_name(device: str) -> str:
    """A readable device name for reports and policy files (the registered device's name, else `device`)."""
    dev = torch.device(device)
    return devices.lookup(dev).name(dev)
