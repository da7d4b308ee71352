"""NVFP4 fake quantisation (quantise then dequantise) and the random Hadamard transform, in plain torch.

NVFP4 (NVIDIA, Blackwell): E2M1 elements (values 0, 0.5, 1, 1.5, 2, 3, 4, 6), one unsigned-E4M3 scale per block of 16
consecutive elements along the GEMM's contraction dimension, and a second, per-tensor fp32 scale that places the
block scales inside E4M3's range ("two-level scaling").  The training recipe of NVIDIA's "Pretraining Large Language
Models with NVFP4" (Transformer Engine's NVFP4BlockScaling; torchao's NVFP4 training tracker pytorch/ao#3293):

* activations and gradients: 1x16 blocks along the contraction dimension;
* weights: 16x16 2D tiles, so that the quantised weight is the same tensor for fprop (blocked along K) and dgrad
  (blocked along N);
* gradients (the upstream grad_output, in dgrad and wgrad) are rounded stochastically, everything else to nearest-even;
* the weight-gradient GEMM's two operands (grad_output and the input, both along the token dimension) go through a
  16x16 random Hadamard transform (RHT) first.

The arithmetic follows torchao 0.18's ``nvfp4_quantize`` (the emulated path that runs on a CPU) operation for
operation, so that the round trip is bit-identical to ``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=s).dequantize()``:
block amax / 6 (divided by the per-tensor scale when there is one) is clamped to [2**-6, 448] and cast to E4M3
(round-to-nearest-even), the data is multiplied by the reciprocal of the combined scale, clamped to +-6 and rounded to
E2M1; dequantisation multiplies the E2M1 value by per_tensor_scale * e4m3_scale in fp32.

This module imports only torch: it is the runtime.  torchao appears only in the tests.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from autoprec.formats.base import E4M3_MAX

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "NVFP4_BLOCK",
    "PER_TENSOR_SCALE_MIN",
    "hadamard_matrix",
    "nvfp4",
    "nvfp4_per_tensor_scale",
    "random_hadamard_transform",
    "round_to_e2m1",
]

E2M1_MAX = 6.0
# torch.finfo(torch.float8_e4m3fn).tiny: the smallest normal E4M3 number, the floor torchao clamps block scales to
E4M3_MIN_NORMAL = 2.0**-6
NVFP4_BLOCK = 16
# The per-tensor scale a tiny tensor gets instead of amax / (448 * 6) when that one's element multiplier,
# 1 / (scale * 2**-6) for a block scale at E4M3's floor, overflows fp32 (an amax below about 1e-33; below 3.8e-42 the
# scale is 0): the smallest power of two whose multiplier is finite. Transformer Engine's reference quantiser guards
# the same overflow (it caps its encode scale at fp32's max); torchao's round trip is NaN there (0 times inf).
PER_TENSOR_SCALE_MIN = 2.0**-121
# the grid of non-negative E2M1 values
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

Rounding = Literal["nearest", "stochastic"]


def _check_blocks(shape: torch.Size, dim: int, block: int, what: str) -> None:
    size = shape[dim]
    if size % block:
        padded = -(-size // block) * block
        raise ValueError(
            f"{what}: dimension {dim} of shape {tuple(shape)} has size {size}, not a multiple of the block size {block}. "
            f"The reference kernels refuse it too (torchao asserts the blocked dimension divides by the block size and "
            f"does not pad). Pad that dimension to {padded} with zeros (zeros change neither a block's amax nor a "
            f"GEMM's product), or choose a layer size that divides by {block}."
        )


def round_to_e2m1(x: torch.Tensor, *, rounding: Rounding = "nearest", generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 values already inside [-6, 6] to the E2M1 grid, as fp32.

    ``nearest``: round half to even (the E2M1 encoding whose mantissa bit is 0 wins a tie), as torchao's
    ``f32_to_f4_unpacked`` and the hardware's ``cvt.rn`` do.  ``stochastic``: round up to the next grid point with
    probability (x - lower) / (upper - lower), so that the expectation is x (unbiased), as ``cvt.rs`` does with its
    random bits.  Signed zero keeps its sign; NaN stays NaN.  Values outside [-6, 6] saturate to +-6.
    """
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    x = x.float()
    a = x.abs().clamp(max=E2M1_MAX)
    # spacing of the grid around a: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    lower = torch.floor(a / step) * step  # exact: a / step is a power-of-two scaling
    frac = (a - lower) / step  # in [0, 1), exact
    if rounding == "nearest":
        # the grid index of `lower` is odd exactly when lower / step is odd (0.5/0.5=1, 1.5/0.5=3, 3/1=3, ...)
        lower_odd = torch.remainder(lower / step, 2.0) == 1.0
        up = (frac > 0.5) | ((frac == 0.5) & lower_odd)
    else:
        # without a generator, no generator argument at all: torch.compile cannot trace torch.rand(generator=None)
        # at a symbolic size (a second batch shape); rand_like draws the same bits from the global generator
        if generator is None:
            u = torch.rand_like(a)
        else:
            u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
        up = u < frac
    mag = torch.where(up, lower + step, lower).clamp(max=E2M1_MAX)
    out = torch.copysign(mag, x)
    return torch.where(torch.isnan(x), x, out)


def nvfp4_per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor (second-level) fp32 scale for a tensor whose absolute maximum is ``amax``: amax / (448 * 6).

    That is torchao's ``per_tensor_amax_to_scale``: the block with the tensor's amax gets the E4M3 scale 448, the top of
    E4M3's range.  An all-zero tensor (amax 0) gets the scale 1 (NVIDIA's kernels guard amax == 0 the same way; torchao's
    division would give 0 and then NaN scales). A scale too small for fp32 to multiply the elements by its reciprocal
    (an amax below about 1e-33) is PER_TENSOR_SCALE_MIN (see `_finite_scale`).
    """
    amax = amax.to(torch.float32)
    scale = amax / (E4M3_MAX * E2M1_MAX)
    return _finite_scale(torch.where(amax == 0, torch.ones_like(scale), scale))


def _finite_scale(scale: torch.Tensor) -> torch.Tensor:
    """`scale` where the elements' multiplier (1 / scale) / s8 is finite for every block scale s8 >= 2**-6, else
    PER_TENSOR_SCALE_MIN: a tiny tensor then rounds to zeros, or to the E2M1 multiples of that scale it is near,
    never to NaN. Unchanged wherever torchao's round trip is finite (NaN stays NaN, inf stays inf)."""
    overflows = torch.isinf((1.0 / scale) / E4M3_MIN_NORMAL)
    return torch.where(overflows, torch.full_like(scale, PER_TENSOR_SCALE_MIN), scale)


def nvfp4(
    x: torch.Tensor,
    *,
    dim: int = -1,
    block: int = NVFP4_BLOCK,
    per_tensor_scale: bool | torch.Tensor | None = True,
    two_d: bool = False,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quantise ``x`` to NVFP4 and dequantise it again (fake quantisation); the result has ``x``'s dtype by default.

    ``dim``: the dimension blocks of ``block`` (16) consecutive elements run along, the GEMM's contraction dimension.
    ``per_tensor_scale``: True computes the second-level scale from ``x``'s own amax (the dynamic per-tensor scale of
    NVIDIA's recipe and of torchao's ``use_dynamic_per_tensor_scale``); a tensor uses that scale (torchao's
    ``per_tensor_scale`` argument); None or False: block scales only, clamped to E4M3's range.
    ``two_d``: 16x16 tiles over the last two dimensions instead of 1x16 blocks (the recipe's weight scaling): one scale
    per tile, so the result does not depend on ``dim``.
    ``rounding``: 'nearest' (round half to even) or 'stochastic' (the recipe's rounding of gradients), drawing from
    ``generator``.
    A blocked dimension that is not a multiple of ``block`` is refused (torchao and the kernels refuse it).
    """
    if not x.is_floating_point():
        raise TypeError(f"nvfp4 quantises floating-point tensors, got {x.dtype}")
    out_dtype = out_dtype or x.dtype
    if x.dim() == 0:
        raise ValueError("nvfp4 needs at least one dimension to block along")
    dim = dim % x.dim()
    if two_d:
        if x.dim() < 2:
            raise ValueError(f"two_d NVFP4 scaling tiles the last two dimensions; shape {tuple(x.shape)} has one")
        _check_blocks(x.shape, -2, block, "nvfp4 (16x16 tiles)")
        _check_blocks(x.shape, -1, block, "nvfp4 (16x16 tiles)")
        data = x.float()
    else:
        _check_blocks(x.shape, dim, block, "nvfp4")
        data = x.float().movedim(dim, -1)
    shape = data.shape

    if two_d:
        r, c = shape[-2], shape[-1]
        tiles = data.reshape(*shape[:-2], r // block, block, c // block, block)
        amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
    else:
        tiles = data.reshape(*shape[:-1], shape[-1] // block, block)
        amax = tiles.abs().amax(dim=-1, keepdim=True)
    block_scale = amax / E2M1_MAX

    if per_tensor_scale is None or per_tensor_scale is False:
        s8 = block_scale.clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        scaled = tiles * (1.0 / s8)
        dq_scale = s8
    else:
        if per_tensor_scale is True:
            pts = nvfp4_per_tensor_scale(data.abs().amax())
        else:
            pts = _finite_scale(per_tensor_scale.to(device=data.device, dtype=torch.float32))
        s8 = (block_scale / pts).clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        scaled = tiles * ((1.0 / pts) / s8)
        dq_scale = pts * s8
    scaled = scaled.clamp(-E2M1_MAX, E2M1_MAX)
    q = round_to_e2m1(scaled, rounding=rounding, generator=generator)
    out = (q * dq_scale).reshape(shape)
    if not two_d:
        out = out.movedim(-1, dim)
    return out.to(out_dtype)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


_HADAMARD: dict[tuple[int, int], torch.Tensor] = {}


def hadamard_matrix(n: int = NVFP4_BLOCK, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n x n random Hadamard matrix (1/sqrt(n)) * H_n @ diag(s): Sylvester's Hadamard matrix with its columns'
    signs flipped by a sign vector ``s`` drawn from ``seed``.  It is orthogonal: H^T H = I.

    Built once per (n, seed) and kept in a plain dict: torch.compile cannot trace the making of a Generator (the signs'
    draw), and warns on an lru_cache, so the recipe's own (16, seed 0) is built at import and a compiled step only
    reads it."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    if (n, seed) not in _HADAMARD:
        g = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
        _HADAMARD[(n, seed)] = (_sylvester(n) * signs) / math.sqrt(n)
    return _HADAMARD[(n, seed)].to(dtype, copy=True)  # a copy: the kept one stays as built


def random_hadamard_transform(
    x: torch.Tensor, *, dim: int = -1, block: int = NVFP4_BLOCK, seed: int = 0, inverse: bool = False
) -> torch.Tensor:
    """Apply the block-diagonal random Hadamard transform along ``dim``: each run of ``block`` consecutive elements v
    becomes H^T v (``inverse``: H v), in fp32.

    NVIDIA's NVFP4 recipe (Transformer Engine, torchtitan's/torchao's NVFP4 training) applies it, with 16x16 blocks, to
    the two operands of the weight-gradient GEMM only, grad_output and the layer input, along their shared contraction
    dimension (the tokens): since Q = blockdiag(H) is orthogonal, (Q^T g)^T (Q^T x) = g^T x, so the product is unchanged
    in exact arithmetic while outliers are spread over 16 elements before quantisation.
    """
    _check_blocks(x.shape, dim, block, "random_hadamard_transform")
    h = hadamard_matrix(block, seed=seed, dtype=torch.float32).to(x.device)
    m = h if inverse else h.t()
    data = x.float().movedim(dim, -1)
    shape = data.shape
    blocks = data.reshape(*shape[:-1], shape[-1] // block, block)
    # row vector form: (H^T v)^T = v^T H
    out = blocks @ m.t()
    return out.reshape(shape).movedim(-1, dim)


hadamard_matrix(NVFP4_BLOCK, seed=0)  # the recipe's RHT matrix, built before any torch.compile traces a step
