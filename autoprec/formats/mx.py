"""Faithful emulation of block-scaled GEMMs (MXFP8, NVFP4) on any device, in plain torch.

MXFP8 (OCP Microscaling Formats v1.0): FP8 elements (E4M3 or E5M2), one E8M0 scale (a power of two, 2**-127 ..
2**127, 0xFF = NaN) per block of 32 consecutive elements along the GEMM's contraction dimension.  The scale exponent is
chosen from the block's amax in one of two ways (torchao's ``ScaleCalculationMode``):

* ``floor`` (the OCP spec's, torchao's default): X = 2**(floor(log2(amax)) - emax_elem), emax_elem = 8 for E4M3 and 15
  for E5M2; values that then exceed the element's max saturate to it.
* ``rceil`` (cuBLAS / Transformer Engine on Blackwell): X = 2**ceil(log2(amax / max_elem)), the smallest power of two
  that does not overflow.  Computed exactly from the bits of amax / max_elem, as the ``cvt.rp.satfinite.ue8m0x2.f32``
  instruction does (torchao's eager CPU fallback goes through a float ``log2`` and may pick one exponent lower when
  amax / max_elem lies within a few fp32 ulps above a power of two; see docs/block-scaled.md).

Quantisation follows torchao 0.18's ``to_mx`` (the emulated path) step for step, corner cases included, so that
``mxfp8(x)`` is bit-identical to ``MXTensor.to_mx(x, elem, 32, mode).dequantize()``:

* floor: the data is divided by max(X, 2**-126) (torchao clamps the fp32 scale to the smallest normal), the block's
  E8M0 code is stored unclamped, and dequantisation multiplies by 2**(code - 127);
* rceil: the data is multiplied by 2**(127 - code), except code 0 (multiply by 1), code 254 (an infinite amax:
  2**-127) and code 255 (NaN), as Transformer Engine's ``exp2f_rcp`` does;
* a NaN anywhere in a block makes the whole block NaN (code 0xFF); the data is clamped to +-max_elem (saturation)
  before the round-to-nearest-even cast to FP8.

``blockscaled_linear`` is the per-GEMM emulated linear: each of the three GEMMs of a linear layer (fprop, dgrad,
wgrad) takes its own format, each operand is quantised along that GEMM's contraction dimension, and the product is
taken in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from autoprec.formats.base import E4M3_MAX
from autoprec.formats.nvfp4 import _check_blocks, nvfp4, random_hadamard_transform

__all__ = [
    "MXFP8",
    "NVFP4",
    "GemmFormat",
    "blockscaled_linear",
    "mxfp8",
    "mxfp8_scale_codes",
]

MX_BLOCK = 32
ScaleMode = Literal["rceil", "floor"]

# element format -> (largest finite value, exponent of the largest power of two in the format)
_ELEM = {
    torch.float8_e4m3fn: (E4M3_MAX, 8),
    torch.float8_e5m2: (57344.0, 15),
}
_F32_MIN_NORMAL = 2.0**-126


def _pow2_from_code(code: torch.Tensor) -> torch.Tensor:
    """2**(code - 127) in fp32 for E8M0 codes 0..254 (code 0 gives the fp32 subnormal 2**-127), NaN for 255."""
    c = code.to(torch.int32)
    normal = torch.bitwise_left_shift(c.clamp(min=1), 23).view(torch.float32)
    out = torch.where(c == 0, torch.tensor(2.0**-127, dtype=torch.float32, device=code.device), normal)
    return torch.where(c == 255, torch.tensor(float("nan"), device=code.device), out)


def _codes(amax: torch.Tensor, max_pos: float, emax: int, scale_mode: str) -> torch.Tensor:
    """The biased E8M0 exponent (int32, 0..255) of each block whose fp32 amax is given."""
    if scale_mode == "floor":
        bits = amax.view(torch.int32)
        exp = (torch.bitwise_right_shift(bits, 23) & 0xFF) - 127  # subnormal amax: -127, as torchao
        code = (exp - emax).clamp(-127, 128) + 127
        return torch.where(torch.isnan(amax), 255, code)
    if scale_mode == "rceil":
        descale = amax / max_pos
        bits = descale.view(torch.int32)
        field = torch.bitwise_right_shift(bits, 23) & 0xFF
        mant = bits & 0x7FFFFF
        # ceil(log2(descale)) exactly: normal numbers round up unless their mantissa is zero; subnormals lie below
        # 2**-126, so their ceiling is -126 above 2**-127 and at most -127 otherwise; zero gives -inf, clamped to -127
        normal_ceil = field - 127 + (mant != 0).to(torch.int32)
        sub_ceil = torch.where(mant > (1 << 22), -126, -127)
        ceil = torch.where(field == 0, torch.where(mant == 0, -127, sub_ceil), normal_ceil)
        code = ceil.clamp(-127, 127) + 127
        code = torch.where(torch.isinf(descale), 254, code)
        return torch.where(torch.isnan(descale), 255, code)
    raise ValueError(f"scale_mode must be 'rceil' or 'floor', got {scale_mode!r}")


def _mx_blocks(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, torch.Size]:
    if not x.is_floating_point():
        raise TypeError(f"mxfp8 quantises floating-point tensors, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("mxfp8 needs at least one dimension to block along")
    _check_blocks(x.shape, dim, block, "mxfp8")
    data = x.float().movedim(dim, -1)
    shape = data.shape
    return data.reshape(*shape[:-1], shape[-1] // block, block), shape


def mxfp8_scale_codes(
    x: torch.Tensor,
    *,
    dim: int = -1,
    block: int = MX_BLOCK,
    elem: torch.dtype = torch.float8_e4m3fn,
    scale_mode: ScaleMode = "rceil",
) -> torch.Tensor:
    """The E8M0 scale codes (uint8, 127 = 2**0, 255 = NaN) ``mxfp8`` gives each block, blocks along ``dim`` last."""
    if elem not in _ELEM:
        raise ValueError(f"MXFP8 elements are torch.float8_e4m3fn or torch.float8_e5m2, got {elem}")
    blocks, _ = _mx_blocks(x, dim, block)
    max_pos, emax = _ELEM[elem]
    return _codes(blocks.abs().amax(-1), max_pos, emax, scale_mode).to(torch.uint8)


def mxfp8(
    x: torch.Tensor,
    *,
    dim: int = -1,
    block: int = MX_BLOCK,
    elem: torch.dtype = torch.float8_e4m3fn,
    scale_mode: ScaleMode = "rceil",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quantise ``x`` to MXFP8 and dequantise it again (fake quantisation); the result has ``x``'s dtype by default.

    ``dim``: the dimension the blocks of ``block`` (32) consecutive elements run along, the GEMM's contraction
    dimension.  ``elem``: torch.float8_e4m3fn or torch.float8_e5m2.  ``scale_mode``: 'rceil' or 'floor' (see the
    module's docstring).  A blocked dimension that is not a multiple of ``block`` is refused, as torchao's ``to_mx``
    refuses it (it does not pad).
    """
    if elem not in _ELEM:
        raise ValueError(f"MXFP8 elements are torch.float8_e4m3fn or torch.float8_e5m2, got {elem}")
    out_dtype = out_dtype or x.dtype
    blocks, shape = _mx_blocks(x, dim, block)
    max_pos, emax = _ELEM[elem]
    amax = blocks.abs().amax(-1, keepdim=True)
    code = _codes(amax, max_pos, emax, scale_mode)
    if scale_mode == "floor":
        divisor = torch.bitwise_left_shift(code, 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
        scaled = blocks / divisor
    else:
        rcp = _pow2_from_code(254 - code)  # 2**(127 - code)
        rcp = torch.where(code == 0, 1.0, rcp)
        rcp = torch.where(code == 254, 2.0**-127, rcp)
        rcp = torch.where(code == 255, float("nan"), rcp)
        scaled = blocks * rcp
    q = scaled.clamp(-max_pos, max_pos).to(elem).float()
    out = (q * _pow2_from_code(code)).reshape(shape).movedim(-1, dim)
    return out.to(out_dtype)


@dataclass(frozen=True)
class MXFP8:
    """MXFP8 for one GEMM: both operands in 1x32 blocks along the contraction dimension, E8M0 scales."""

    elem: torch.dtype = torch.float8_e4m3fn
    scale_mode: ScaleMode = "rceil"
    block: int = MX_BLOCK

    def quantize(self, t: torch.Tensor, dim: int, role: str, generator: torch.Generator | None) -> torch.Tensor:
        return mxfp8(t, dim=dim, block=self.block, elem=self.elem, scale_mode=self.scale_mode, out_dtype=torch.float32)


@dataclass(frozen=True)
class NVFP4:
    """NVFP4 for one GEMM, NVIDIA's training recipe by default: activations and gradients in 1x16 blocks along the
    contraction dimension, the weight in 16x16 tiles (``two_d_weight``), gradients rounded stochastically
    (``stochastic_gradients``), the weight-gradient GEMM's operands through the 16x16 random Hadamard transform
    (``rht``, seeded by ``rht_seed``), a dynamic per-tensor second-level scale (``per_tensor_scale``)."""

    per_tensor_scale: bool = True
    two_d_weight: bool = True
    stochastic_gradients: bool = True
    rht: bool = True
    rht_seed: int = 0
    block: int = 16

    def quantize(self, t: torch.Tensor, dim: int, role: str, generator: torch.Generator | None) -> torch.Tensor:
        two_d = role == "weight" and self.two_d_weight
        stochastic = role == "gradient" and self.stochastic_gradients
        return nvfp4(
            t,
            dim=dim,
            block=self.block,
            per_tensor_scale=self.per_tensor_scale,
            two_d=two_d,
            rounding="stochastic" if stochastic else "nearest",
            generator=generator,
            out_dtype=torch.float32,
        )


GemmFormat = MXFP8 | NVFP4 | None


def _operand(fmt: GemmFormat, t: torch.Tensor, dim: int, role: str, generator: torch.Generator | None) -> torch.Tensor:
    return t.float() if fmt is None else fmt.quantize(t, dim, role, generator)


class _BlockScaledLinear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fprop: GemmFormat,
        dgrad: GemmFormat,
        wgrad: GemmFormat,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.formats = (dgrad, wgrad)
        ctx.generator = generator
        ctx.has_bias = bias is not None
        x2 = x.reshape(-1, x.shape[-1])
        # fprop: out[M, N] = x[M, K] @ W[N, K]^T, contraction K: x along its dim 1, W along its dim 1
        out = _operand(fprop, x2, 1, "activation", None) @ _operand(fprop, weight, 1, "weight", None).t()
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dgrad, wgrad = ctx.formats
        gen = ctx.generator
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dgrad: grad_x[M, K] = g[M, N] @ W[N, K], contraction N: g along its dim 1, W along its dim 0
            gx = _operand(dgrad, g2, 1, "gradient", gen) @ _operand(dgrad, weight, 0, "weight", gen)
            grad_x = gx.to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            # wgrad: grad_W[N, K] = g[M, N]^T @ x[M, K], contraction M (tokens): both along their dim 0
            gw_op, xw_op = g2, x2
            if isinstance(wgrad, NVFP4) and wgrad.rht:
                gw_op = random_hadamard_transform(g2, dim=0, block=wgrad.block, seed=wgrad.rht_seed)
                xw_op = random_hadamard_transform(x2, dim=0, block=wgrad.block, seed=wgrad.rht_seed)
            gw = _operand(wgrad, gw_op, 0, "gradient", gen).t() @ _operand(wgrad, xw_op, 0, "activation", gen)
            grad_w = gw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(grad_out.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def blockscaled_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    fprop: GemmFormat = None,
    dgrad: GemmFormat = None,
    wgrad: GemmFormat = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` with each of its three GEMMs emulated in its own block-scaled format.

    fprop  out    = x @ W^T      contraction K: x blocked along K, W along K (its rows)
    dgrad  grad_x = g @ W        contraction N: g blocked along N, W along N (its columns)
    wgrad  grad_W = g^T @ x      contraction M (tokens): g and x blocked along M
    Each setting is ``MXFP8(...)``, ``NVFP4(...)`` or None (high precision).  The operands are quantised and
    dequantised exactly as the reference quantisers do, then multiplied in fp32; results come back in the input's
    dtype.  ``generator`` drives NVFP4's stochastic rounding of gradients (None: torch's default generator).  The
    token count (all leading dimensions together) must be a multiple of the wgrad format's block.
    """
    return _BlockScaledLinear.apply(input, weight, bias, fprop, dgrad, wgrad, generator)
