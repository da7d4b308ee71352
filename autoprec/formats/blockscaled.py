"""The blockscaled family: MXFP8 and NVFP4 per GEMM, as the float8 family has fp8 per GEMM (issue 40, section 1).

Each format says, for an nn.Linear's three GEMMs (fprop: the output; dgrad: the input's gradient; wgrad: the weight's
gradient), which block-scaled format it runs in (`MXFP8(...)`, `NVFP4(...)`, autoprec.formats.mx) or None: high
precision. The layer runs `blockscaled_linear` (mx.py), the faithful emulation of the reference quantisers, on every
device: autoprec runs no MX/NVFP4 kernel (torchao's need CUDA compute capability 10.0, `is_sm_at_least_100` in
torchao/utils.py, and are prototypes it has not been run with). So `apply_policy` warns that the layer runs emulated,
the profile measures its numerics but records its time as "no kernel on this device" (`has_kernels`), and a search
that times its trials here does not offer it (one planning for another device, `--objective flops`, does:
profile_data.SPEED_UNJUDGED).

Operands and high precision: outside autocast the layer computes from fp32 (inputs arriving in bf16/fp16 are cast, as
an fp32 layer's are); under an outer autocast from its dtype (the input, weight and bias cast as autocast casts them
for a Linear). A GEMM in high precision is torch's own: the layer runs `F.linear` on those operands and routes its
gradient (or its value) there, so that GEMM is exactly what a bf16 (or fp32) layer computes, bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

import autoprec.formats.autocast  # noqa: F401  bf16, the fallback
import autoprec.formats.float8  # noqa: F401  registered first: the fp8 formats precede these in Format's order
from autoprec.formats.base import (
    GEMMS,
    Converted,
    Format,
    FormatFamily,
    GemmCast,
    OperandCast,
    caller_precision,
    register_family,
    register_format,
)
from autoprec.formats.mx import MXFP8, NVFP4, GemmFormat, blockscaled_linear

log = logging.getLogger("autoprec")


# The SQNR (dB) against fp32 below which a GEMM in each element format counts as broken, from docs/block-scaled.md's
# measured table (nn.Linear(512, 256), N(0, 1) inputs): MXFP8 E4M3 measures 28.4-28.6 dB on every GEMM, its 3-bit
# mantissa's rounding (a block's power-of-two scale keeps each block near it), so fp8's 20 dB floor holds: 8 dB below
# that, values were flushed or saturated. NVFP4's recipe measures 15.0-16.8 dB (stochastic rounding of the gradients
# costs ~1.5 dB; E2M1's rounding alone gives ~17): 10 dB is 5 dB below its lowest GEMM, about as far as fp8's floor
# is below fp8's rounding, where a 16x16 tile's outlier has flushed the rest of it, not rounded it.
SQNR_FLOOR_DB = {"mxfp8": 20.0, "nvfp4": 10.0}

# The scale rule torchao's MX training recipes use: MXFP8TrainingOpConfig.scale_calculation_mode defaults to RCEIL, and
# both its recipes ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp") name it (torchao 0.18,
# torchao/prototype/moe_training/config.py), e4m3 elements in blocks of 32 for every operand
# (torchao/prototype/moe_training/mxfp8_linear.py, _to_mxfp8_then_scaled_mm).
MX = MXFP8(elem=torch.float8_e4m3fn, scale_mode="rceil")
# NVIDIA's NVFP4 training recipe (Transformer Engine's NVFP4BlockScaling, "Pretraining LLMs with NVFP4"): 16x16 weight
# tiles, gradients rounded stochastically, the 16x16 random Hadamard transform on the wgrad operands, a per-tensor
# second-level scale: NVFP4()'s defaults.
NV = NVFP4()


@dataclasses.dataclass(frozen=True)
class BlockGemms:
    """Each GEMM's block-scaled format (None: high precision): Fp8Gemms's counterpart for this family."""

    fprop: GemmFormat = None
    dgrad: GemmFormat = None
    wgrad: GemmFormat = None

    def settings(self) -> dict[str, GemmFormat]:
        return {"fprop": self.fprop, "dgrad": self.dgrad, "wgrad": self.wgrad}

    @property
    def high_precision(self) -> tuple[str, ...]:
        return tuple(g for g, s in self.settings().items() if s is None)

    @property
    def elements(self) -> tuple[str, ...]:
        """The element formats its block-scaled GEMMs run in ('mxfp8', 'nvfp4'), each once, fprop's first."""
        return tuple(dict.fromkeys(e for e in map(element_name, self.settings().values()) if e is not None))

    @property
    def stochastic(self) -> bool:
        """Whether a GEMM rounds stochastically (NVFP4's gradients, in dgrad and wgrad): only then does the layer
        draw random bits, from its own generator in eager mode (from torch's global one when compiled: forward)."""
        return any(isinstance(s, NVFP4) and s.stochastic_gradients for s in (self.dgrad, self.wgrad))

    def rows_to_pad(self, rows: int) -> int:
        """Zero rows to add to a call of `rows` rows (tokens) so that the wgrad GEMM, which contracts over the rows,
        blocks them (32 for MXFP8, 16 for NVFP4 and its Hadamard transform). A zero row raises no block's amax nor the
        per-tensor one and adds nothing to the weight's gradient: as fp8's padding to 16 (Fp8Gemms.rows_to_pad)."""
        return -rows % self.wgrad.block if self.wgrad is not None else 0


def element_name(setting: GemmFormat) -> str | None:
    """'mxfp8', 'nvfp4', or None for high precision."""
    if setting is None:
        return None
    return "mxfp8" if isinstance(setting, MXFP8) else "nvfp4"


GEMM_FORMATS: dict[str, BlockGemms] = {}  # each registered format's GEMMs, keyed by name (add_format)


def _gemms(fmt: Format) -> BlockGemms:
    # looked up with the Format (a str equal to its name), not fmt.value: torch.compile cannot trace str.__str__
    return GEMM_FORMATS[fmt]


def shape_problem(fmt: Format, module: torch.nn.Module) -> str | None:
    """Why `module` cannot run in `fmt`, or None: a Linear only (its own computation), and each GEMM's contraction
    dimension a multiple of its format's block (the tokens of wgrad are padded instead, `rows_to_pad`)."""
    if not isinstance(module, torch.nn.Linear):
        return f"{fmt.value} covers nn.Linear only, not {type(module).__name__}"
    if type(module).forward is not torch.nn.Linear.forward:
        return (
            f"{fmt.value} computes an nn.Linear's three GEMMs from its weight and bias, so "
            f"{type(module).__name__}'s own forward would be skipped"
        )
    gemms = _gemms(fmt)
    in_f, out_f = module.in_features, module.out_features
    need: dict[str, int] = {}  # dimension -> block
    if gemms.fprop is not None:  # x @ W^T contracts over in_features
        need["in_features"] = gemms.fprop.block
    if gemms.dgrad is not None:  # g @ W contracts over out_features
        need["out_features"] = gemms.dgrad.block
    for s in (gemms.fprop, gemms.dgrad):  # NVFP4's weight in 16x16 tiles: both of its dimensions
        if isinstance(s, NVFP4) and s.two_d_weight:
            need["in_features"] = max(need.get("in_features", 1), s.block)
            need["out_features"] = max(need.get("out_features", 1), s.block)
    sizes = {"in_features": in_f, "out_features": out_f}
    bad = [(dim, block) for dim, block in need.items() if sizes[dim] % block]
    if not bad:
        return None
    said = " and ".join(f"{dim} divisible by {block}" for dim, block in bad)
    fix = ", ".join(f"{dim} {-(-sizes[dim] // block) * block}" for dim, block in bad)
    return f"{fmt.value} needs {said} (its GEMMs' blocks run along them), got Linear({in_f}, {out_f}); pad the layer to {fix}"


class _Route(torch.autograd.Function):
    """Forward, `sources[which]` (or `value` where which is None: a result no gradient flows through); backward, the
    output's gradient to each of `sources` (the computations whose gradients the layer keeps). So one GEMM's result
    comes from one computation and another GEMM's from another, each exact. The value is passed by index when it is a
    source: torch.compile cannot trace an autograd.Function given one tensor twice."""

    @staticmethod
    def forward(ctx: Any, which: int | None, value: torch.Tensor | None, *sources: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.dtypes = [s.dtype for s in sources]
        out = sources[which] if which is not None else value
        assert out is not None
        return out.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (None, None, *(grad.to(dtype) for dtype in ctx.dtypes))


def _linear(
    gemms: BlockGemms, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gen: torch.Generator | None
) -> torch.Tensor:
    """The layer's output with each GEMM in its format, operands already in the layer's precision."""
    rows = math.prod(x.shape[:-1])
    if rows == 0:  # no tokens (an MoE expert given none): nothing to quantise, the per-tensor amax of nothing fails
        return F.linear(x, weight, bias)
    low = [g for g in GEMMS if getattr(gemms, g) is not None]
    high = [g for g in GEMMS if getattr(gemms, g) is None]

    def emulated(xl: torch.Tensor, wl: torch.Tensor, bl: torch.Tensor | None) -> torch.Tensor:
        pad = gemms.rows_to_pad(rows) if xl.requires_grad or wl.requires_grad else 0
        if not pad:
            return blockscaled_linear(xl, wl, bl, fprop=gemms.fprop, dgrad=gemms.dgrad, wgrad=gemms.wgrad, generator=gen)
        padded = F.pad(xl.reshape(rows, xl.shape[-1]), (0, 0, 0, pad))
        out = blockscaled_linear(padded, wl, bl, fprop=gemms.fprop, dgrad=gemms.dgrad, wgrad=gemms.wgrad, generator=gen)
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])

    if not high:
        return emulated(x, weight, bias)
    # torch's own linear for the high-precision GEMMs (and the bias's gradient): the input's gradient where dgrad is
    # high precision, the weight's where wgrad is, the output where fprop is
    torch_out = F.linear(x if "dgrad" in high else x.detach(), weight if "wgrad" in high else weight.detach(), bias)
    block_out = emulated(
        x if "dgrad" in low else x.detach(),
        weight if "wgrad" in low else weight.detach(),
        None if bias is None else bias.detach(),
    )
    value = block_out if "fprop" in low else torch_out
    sources = [t for t in (torch_out, block_out) if t.requires_grad]
    if not sources:
        return value
    which = next((i for i, s in enumerate(sources) if s is value), None)
    return _Route.apply(which, None if which is not None else value, *sources)


def seed_of(layer: str) -> int:
    """The seed of a layer's stochastic rounding: CRC-32 of its name in the model (apply_policy passes the module's
    first name in named_modules() order, not the alias a policy lists it by, so it is the same whichever alias is
    listed); stable across runs and processes, unlike hash(), so a layer draws the same random bits in every run and
    two layers different ones. The generator is not in the state_dict: a run resumed from a checkpoint replays the
    draws from step 0 (docs/block-scaled.md)."""
    return zlib.crc32(layer.encode("utf-8"))


_SEED_ATTR = "_autoprec_blockscaled_seed"
_RNG_ATTR = "_autoprec_blockscaled_rng"


def generator_for(module: torch.nn.Module, device: torch.device) -> torch.Generator:
    """The module's generator on `device` for stochastic rounding, made on first use from its seed (`seed_of` its
    name, set by apply_policy; 0 where none was). A deep copy of the model copies its state."""
    rngs: dict[str, torch.Generator] = module.__dict__.setdefault(_RNG_ATTR, {})
    key = str(device)
    if key not in rngs:
        rngs[key] = torch.Generator(device=device).manual_seed(getattr(module, _SEED_ATTR, 0))
    return rngs[key]


@register_family
class BlockScaledFamily(FormatFamily):
    name = "blockscaled"
    gemm_floor_rules_out = True
    timed_inside = "bf16"

    def add_format(self, fmt: Format, *, gemms: BlockGemms | None = None, **facts: Any) -> None:
        """`gemms` (required): each of a Linear's three GEMMs' element format (MXFP8, NVFP4, or None: high
        precision)."""
        super().add_format(fmt, **facts)  # refuses any other
        if not isinstance(gemms, BlockGemms):
            raise ValueError(f"format {fmt.value!r}: gemms must be a BlockGemms, but got {gemms!r}")
        GEMM_FORMATS[fmt] = gemms

    def remove_format(self, fmt: Format) -> None:
        GEMM_FORMATS.pop(fmt, None)

    def module_problem(self, fmt: Format, module: torch.nn.Module) -> str | None:
        return shape_problem(fmt, module)

    def root_problem(self, fmt: Format) -> str | None:
        return (
            f"{fmt.value} runs an nn.Linear's three GEMMs, not a whole model's ops; list the Linear layers by name "
            "(a model that is one Linear: wrap it in nn.Sequential and name its child)"
        )

    def has_kernels(self, fmt: Format, device: torch.device) -> bool:
        # autoprec runs the emulation everywhere, also where torchao has kernels (compute capability 10.0)
        return False

    def sqnr_floor(self, fmt: Format) -> float:
        return min(SQNR_FLOOR_DB[e] for e in map(element_name, _gemms(fmt).settings().values()) if e is not None)

    def export_name(self, fmt: Format) -> str | None:
        # export_name is a torchao float8 recipe name (the float8 targets write one for every name given here): these
        # formats have none. The exports that write MX and NVFP4 (torchtitan, megatron-precision, transformer-engine:
        # autoprec/tune/export/) ask recipe_name and the GEMM table instead.
        return None

    def recipe_name(self, fmt: Format) -> str | None:
        """What the training frameworks call the recipe, where one has it: "mxfp8" (torchtitan's MXFP8 converter,
        docs/mxfp8.md; Transformer Engine's MXFP8BlockScaling; torchao's "mxfp8_rceil"), "nvfp4" (Transformer
        Engine's NVFP4BlockScaling), "mxfp8_rceil_wgrad_with_hp" (torchao's MXFP8TrainingRecipe for fprop and dgrad
        in MXFP8, wgrad in high precision); None for the other per-GEMM mixes."""
        return _RECIPES.get(fmt.value)

    def block_scaled_gemms(self, fmt: Format) -> tuple[str | None, str | None, str | None]:
        fprop, dgrad, wgrad = (None if g == "fp32" else g for g in self.gemm_precisions(fmt))
        return fprop, dgrad, wgrad

    def gemm_precisions(self, fmt: Format, outer: str | None = None) -> tuple[str, str, str]:
        """Each GEMM's element format; a GEMM in high precision runs in the caller's autocast dtype (`outer`: the
        layer casts its operands to it), fp32 outside one."""
        fprop, dgrad, wgrad = (element_name(s) or outer or "fp32" for s in _gemms(fmt).settings().values())
        return fprop, dgrad, wgrad

    def gemm_casts(self, fmt: Format) -> tuple[GemmCast | None, GemmCast | None, GemmCast | None]:
        """Each block-scaled GEMM's operands in blocks along its contraction: MXFP8 8-bit elements with a 1-byte
        E8M0 scale per 32; NVFP4 4-bit elements with a 1-byte E4M3 scale per 16, a per-tensor amax for its second
        level, the weight in square tiles (one cast for both orientations), the wgrad operands through the RHT."""
        out: list[GemmCast | None] = []
        for gemm, setting in _gemms(fmt).settings().items():
            if setting is None:
                out.append(None)
                continue
            kernel = element_name(setting) or ""
            if isinstance(setting, NVFP4):
                rht = gemm == "wgrad" and setting.rht

                def nv(weight: bool, setting: NVFP4 = setting, rht: bool = rht) -> OperandCast:
                    return OperandCast(
                        bits=4,
                        block=setting.block,
                        scale_bytes=1,
                        tensor_amax=setting.per_tensor_scale,
                        tile=weight and setting.two_d_weight,
                        rht=rht,
                    )

                out.append(GemmCast(kernel, nv(False), nv(gemm != "wgrad")))  # wgrad's b is the input, not the weight
            else:
                operand = OperandCast(bits=8, block=setting.block, scale_bytes=1)
                out.append(GemmCast(kernel, operand, operand))
        return out[0], out[1], out[2]

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
        if device_hint:  # the tuner's path (apply_on_chosen_device) knows, and records it as the profile's time
            # warned before anything changes: under warnings-as-errors apply_policy raises with the model as it was
            used = dict.fromkeys(f.value for f in listed.values())
            elements = dict.fromkeys(e for f in listed.values() for e in _gemms(f).elements)
            warnings.warn(
                f"apply_policy: its {', '.join(used)} layers run emulated (no {'/'.join(elements)} kernel on this "
                "device): numerics as the reference kernels, speed not representative",
                stacklevel=6,  # the user's apply_policy call: apply_policy, _apply, _put, _convert, convert
            )
        seeded = []
        for name in listed:
            module = paths[name]
            if _SEED_ATTR not in module.__dict__:
                module.__dict__[_SEED_ATTR] = seed_of(names[id(module)][0])
                module.__dict__.pop(_RNG_ATTR, None)
                seeded.append(module)
        log.info("apply_policy: block-scaled layers %s run emulated", sorted(listed))

        def undo() -> None:
            for module in seeded:
                module.__dict__.pop(_SEED_ATTR, None)
                module.__dict__.pop(_RNG_ATTR, None)

        return Converted(undo=undo)

    def forward(
        self, fmt: Format, module: torch.nn.Module, inner: Callable[..., Any], device_type: str, args: tuple, kwargs: dict
    ) -> Any:
        outer_autocast = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if outer_autocast else torch.float32
        x = args[0] if args else kwargs["input"]
        weight, bias = module.weight, module.bias
        assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))  # a Linear's
        with torch.autocast(device_type, enabled=False):
            # the operands as autocast gives them to a Linear (fp32 outside it), so high precision is the control's
            gemms = _gemms(fmt)
            out = _linear(
                gemms,
                x.to(dtype),
                weight.to(dtype),
                None if bias is None else bias.to(dtype),
                # compiled, the draws come from torch's global generator (seeded by the user's torch.manual_seed):
                # torch.compile cannot trace a torch.Generator argument, so a layer's own stream is eager mode's
                generator_for(module, x.device) if gemms.stochastic and not torch.compiler.is_compiling() else None,
            )
        return caller_precision(out, outer_autocast)


def _register(name: str, inside: str, gemms: BlockGemms) -> Format:
    fmt = register_format(
        name,
        family="blockscaled",
        inside=inside,
        fallback=Format.BF16,
        risky=True,
        linear_only=True,
        gemms=gemms,
        # no capability check: torchao's MX/NVFP4 kernels need compute capability 10.0, but autoprec runs the
        # emulation on every device (has_kernels is False everywhere), so no device check would read it
    )
    return fmt


_HP = "in high precision (the caller's autocast dtype, fp32 outside one)"
Format.MXFP8 = _register(
    "mxfp8",
    "MXFP8 (emulated): e4m3, one power-of-two (E8M0, rceil) scale per 32 elements along each GEMM's contraction, "
    "in fprop, dgrad and wgrad (torchao's mxfp8_rceil)",
    BlockGemms(MX, MX, MX),
)
Format.MXFP8_FWD = _register("mxfp8-fwd", f"MXFP8 (emulated) forward only: fprop as mxfp8; dgrad and wgrad {_HP}", BlockGemms(MX))
Format.MXFP8_FWD_DGRAD = _register(
    "mxfp8-fwd-dgrad",
    f"MXFP8 (emulated) forward and input gradient: fprop and dgrad as mxfp8; wgrad {_HP} (torchao's mxfp8_rceil_wgrad_with_hp)",
    BlockGemms(MX, MX),
)
Format.NVFP4 = _register(
    "nvfp4",
    "NVFP4 (emulated), NVIDIA's recipe: e2m1, an e4m3 scale per 16 elements and a per-tensor fp32 scale; weights in "
    "16x16 tiles, gradients rounded stochastically, a 16x16 random Hadamard transform on wgrad's operands",
    BlockGemms(NV, NV, NV),
)
Format.NVFP4_FWD = _register("nvfp4-fwd", f"NVFP4 (emulated) forward only: fprop as nvfp4; dgrad and wgrad {_HP}", BlockGemms(NV))
Format.NVFP4_FWD_DGRAD = _register(
    "nvfp4-fwd-dgrad",
    f"NVFP4 (emulated) forward and input gradient: fprop and dgrad as nvfp4; wgrad {_HP}",
    BlockGemms(NV, NV),
)
Format.MXFP8_FWD_NVFP4_DGRAD = _register(
    "mxfp8-fwd-nvfp4-dgrad",
    f"mixed (emulated), as Transformer Engine's heterogeneous recipe: fprop as mxfp8, dgrad as nvfp4, wgrad {_HP}",
    BlockGemms(MX, NV),
)
_RECIPES = {"mxfp8": "mxfp8", "nvfp4": "nvfp4", "mxfp8-fwd-dgrad": "mxfp8_rceil_wgrad_with_hp"}
