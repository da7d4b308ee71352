"""CUDA's rules on a CPU: what an H100 refuses is refused here too, so a green suite means the code runs there.

`enforced()` (the `gpu_contract` fixture; `pytest --gpu-contract` puts it on every test of the session) makes this
process look to autoprec and torchao as an H100 does:

- autoprec sees fp8 kernels (compute capability 9.0) on the CPU, so its fp8 formats run torchao's kernel path
  (`emulate=False`), whose GEMMs call `torch._scaled_mm`;
- `torch._scaled_mm` checks its operands as CUDA's does (`check_scaled_mm`, each rule citing ATen's
  `aten/src/ATen/native/cuda/ScaledBlas.cpp`, `_scaled_mm_out_cuda`, and cuBLASLt's layout check in
  `aten/src/ATen/cuda/CUDABlas.cpp`), then runs the CPU kernel, which checks none of them;
- torchao's `Float8Linear.forward` reads autocast as on CUDA (`torchao/float8/float8_linear.py`:
  `torch.is_autocast_enabled()` with no argument and `torch.get_autocast_gpu_dtype()`, both CUDA's state): here
  they answer for the CPU's autocast, the one a CPU model runs under;
- fp32 matmul precision is set through torch's new API (`torch.backends.cuda.matmul.fp32_precision = "tf32"`, as
  a model.py may since torch 2.9), after which torch's legacy getter `torch.get_float32_matmul_precision()` raises
  (`torch/backends/__init__.py`: the two APIs are not to be mixed).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

H100 = (9, 0)  # the compute capability the contract stands for
ALIGN = 16  # ScaledBlas.cpp: "divisible by 16"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class ContractError(RuntimeError):
    """What CUDA's torch._scaled_mm would have raised."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(f"CUDA's torch._scaled_mm refuses this: {message}")


def check_scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_result: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> None:
    """Raise ContractError where CUDA's `torch._scaled_mm` (ScaledBlas.cpp, `_scaled_mm_out_cuda`) would refuse."""
    # "mat1 must be a matrix", "mat2 must be a matrix", "mat1 and mat2 shapes cannot be multiplied"
    _require(mat1.dim() == 2 and mat2.dim() == 2, f"mat1 and mat2 must be matrices, got {tuple(mat1.shape)}, {tuple(mat2.shape)}")
    (m, k), (k2, n) = mat1.shape, mat2.shape
    _require(k == k2, f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    # "Expected trailing dimension of mat1 to be divisible by 16" and "mat2 shape (KxN) must be divisible by 16":
    # mat1's rows (M) are free; in torchao's weight-gradient GEMM mat1 is grad_output^T, whose trailing dimension
    # is the batch's tokens
    _require(k % ALIGN == 0, f"the trailing dimension of mat1 ({m}x{k}) must be divisible by {ALIGN}")
    _require(k2 % ALIGN == 0 and n % ALIGN == 0, f"mat2 shape ({k2}x{n}) must be divisible by {ALIGN}")
    # "Expected mat1 to be Float8 matrix", "Multiplication of two Float8_e5m2 matrices is not supported"
    _require(mat1.dtype in _FP8 and mat2.dtype in _FP8, f"both operands must be fp8, got {mat1.dtype} and {mat2.dtype}")
    _require(not (mat1.dtype == mat2.dtype == torch.float8_e5m2), "multiplication of two Float8_e5m2 matrices")
    # cuBLASLt (CUDABlas.cpp, scaled_gemm via cublasCommonArgs): "Only multiplication of row-major and column-major
    # matrices is supported by cuBLASLt": mat1 row-major (unit stride along K), mat2 column-major (unit stride along K)
    _require(mat1.stride(1) == 1 and mat1.stride(0) >= max(1, k), f"mat1 must be row-major, got strides {mat1.stride()}")
    _require(mat2.stride(0) == 1 and mat2.stride(1) >= max(1, k), f"mat2 must be column-major, got strides {mat2.stride()}")
    # the scaling kinds (get_joint_scaling; "Invalid scaling configuration" otherwise, and never one of each):
    # tensorwise (one float32 each) or rowwise ((M, 1) and (1, N) float32, each contiguous along its row)
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    _require(
        tensorwise or rowwise,
        f"scales {tuple(scale_a.shape)} and {tuple(scale_b.shape)} are neither tensorwise nor rowwise for {m}x{k} @ {k}x{n}",
    )
    _require(scale_a.dtype == scale_b.dtype == torch.float32, f"scales must be float32, got {scale_a.dtype} and {scale_b.dtype}")
    if rowwise and not tensorwise:
        _require(scale_a.is_contiguous() and scale_b.is_contiguous(), "rowwise scales must be contiguous")
        # CUTLASS's rowwise kernel (cuda/RowwiseScaledMM.cu, check_inputs): "b.dtype() == at::kFloat8_e4m3fn"; its
        # output (ScaledBlas.cpp): bf16 only in the oldest release that states it ("Only bf16 high precision output
        # types are supported for row-wise scaling"), the strictest, which torchao's rowwise recipes meet
        _require(mat2.dtype == torch.float8_e4m3fn, f"rowwise scaling needs an e4m3 mat2, got {mat2.dtype}")
        _require(out_dtype == torch.bfloat16, f"rowwise scaling supports a bf16 output only, got {out_dtype}")
    out = out_dtype or mat1.dtype
    # "scale_result must be a float scalar"
    _require(
        scale_result is None or (scale_result.numel() == 1 and scale_result.dtype == torch.float32),
        "scale_result must be a float scalar",
    )
    if bias is not None:
        # "Bias must be size N", "Bias is not supported when out_dtype is set to Float32", "Bias must be either Half
        # or BFloat16", and a bias of the output's dtype
        _require(bias.numel() == n, f"bias must be size {n}, got {bias.numel()}")
        _require(out != torch.float32, "bias is not supported when out_dtype is float32")
        _require(bias.dtype in (torch.bfloat16, torch.float16), f"bias must be bf16 or fp16, got {bias.dtype}")
        _require(bias.dtype == out, f"bias must be {out} to compute a {out} output, got {bias.dtype}")


def _state() -> dict[str, object]:
    from autoprec import formats

    return {
        "_scaled_mm": torch._scaled_mm,
        "is_autocast_enabled": torch.is_autocast_enabled,
        "get_autocast_gpu_dtype": torch.get_autocast_gpu_dtype,
        "_has_capability": formats._has_capability,
        "precision": _precision(),
    }


def _set_state(state: dict[str, object]) -> None:
    from autoprec import formats

    torch._scaled_mm = state["_scaled_mm"]
    torch.is_autocast_enabled = state["is_autocast_enabled"]
    torch.get_autocast_gpu_dtype = state["get_autocast_gpu_dtype"]
    formats._has_capability = state["_has_capability"]
    legacy, values = state["precision"]
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)  # the legacy setter makes the legacy getter work again
    for path, value in values.items():  # then every backend's own setting exactly as it was
        _backend(path).fp32_precision = value


# torch.backends' fp32-precision settings (torch >= 2.9), the process-wide one first
_PRECISION_PATHS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                    "mkldnn.rnn")  # fmt: skip


def _backend(path: str) -> Any:
    return functools.reduce(getattr, path.split("."), torch.backends) if path else torch.backends


def _precision() -> tuple[str | None, dict[str, str]]:
    """(the legacy API's setting, or None where it raises because the new one set it; every backend's own)."""
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    return legacy, {path: _backend(path).fp32_precision for path in _PRECISION_PATHS}


# What this process is without the contract, for `lifted`: taken when the suite imports this module, first.
_CPU = _state()


@contextlib.contextmanager
def lifted() -> Iterator[None]:
    """The process as it is without the contract until the block ends: for a test of a CPU's own behaviour (torchao's
    emulation, a CPU's refusals) in a session run with --gpu-contract."""
    saved = _state()
    _set_state(_CPU)
    try:
        yield
    finally:
        _set_state(saved)


def reference_scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_result: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """What CUDA's torch._scaled_mm computes, in float32 on any device: (mat1 * scale_a) @ (mat2 * scale_b) + bias,
    accumulated in fp32 and rounded once to the output dtype. Not the CPU's own kernel: torch 2.11's (oneDNN) takes
    tensorwise scales only."""
    out = (mat1.float() * scale_a.float()) @ (mat2.float() * scale_b.float())
    if bias is not None:
        out = out + bias.float()
    if scale_result is not None and out_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out = out * scale_result.float()
    return out.to(out_dtype or mat1.dtype)


@contextlib.contextmanager
def enforced() -> Iterator[None]:
    """CUDA's rules on this process until the block ends (see the module's docstring); everything restored after."""
    from autoprec import formats

    real_enabled = _CPU["is_autocast_enabled"]

    def scaled_mm(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        check_scaled_mm(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
        return reference_scaled_mm(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype)

    def is_autocast_enabled(device_type=None):
        # no argument: CUDA's autocast on a GPU, which is where a CPU model's autocast stands in the contract. (A
        # Python stand-in for a torch function: torch.compile breaks its graph here, which CUDA's own does not.)
        return real_enabled("cpu" if device_type is None else device_type)

    def get_autocast_gpu_dtype():
        return torch.get_autocast_dtype("cpu")

    def has_capability(dev: torch.device, need: tuple[int, int]) -> bool:
        return dev.type == "cpu" and H100 >= need

    saved = _state()
    torch._scaled_mm = scaled_mm
    torch.is_autocast_enabled = is_autocast_enabled
    torch.get_autocast_gpu_dtype = get_autocast_gpu_dtype
    formats._has_capability = has_capability
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        _set_state(saved)
