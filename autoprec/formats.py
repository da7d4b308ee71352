"""The precision formats, their numeric limits, and which device supports what."""

from __future__ import annotations

import enum
import functools

import torch


class Format(str, enum.Enum):
    """A per-layer precision format; the string value is what files and Optuna params hold."""

    FP32 = "fp32"  # autocast off inside the module, inputs cast up to fp32
    BF16 = "bf16"  # the module's forward runs under torch.autocast(bfloat16)
    FP16 = "fp16"  # the module's forward runs under torch.autocast(float16)
    FP8 = "fp8"  # torchao float8 training linear: e4m3 forward, e5m2 gradients, dynamic scaling

    def __str__(self) -> str:
        return self.value


FORMATS: tuple[str, ...] = tuple(f.value for f in Format)

# Formats that run through torch.autocast and the dtype each one lowers to.
AUTOCAST_DTYPE: dict[Format, torch.dtype] = {Format.BF16: torch.bfloat16, Format.FP16: torch.float16}

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
FP16_MIN_SUBNORMAL = 2.0**-24
E4M3_MAX = 448.0
E5M2_MAX = 57344.0

# torchao's float8 matmul (torch._scaled_mm) needs both weight dimensions divisible by 16.
FP8_DIM_MULTIPLE = 16


def parse_format(value: object, *, field: str = "format") -> Format:
    """Return the Format for a string such as "bf16"; raise ValueError naming the choices."""
    if isinstance(value, Format):
        return value
    try:
        return Format(str(value).strip().lower())
    except ValueError:
        raise ValueError(f"{field} must be one of {', '.join(FORMATS)}, but got {value!r}") from None


def device_type(device: torch.device | str) -> str:
    return torch.device(device).type


def is_cuda(device: torch.device | str) -> bool:
    return device_type(device) == "cuda"


def has_fp8_kernels(device: torch.device | str) -> bool:
    """True where torch._scaled_mm has real fp8 kernels: CUDA devices of compute capability 8.9+."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(dev) >= (8, 9)


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
    if fmt not in AUTOCAST_DTYPE:
        return True
    dtype = AUTOCAST_DTYPE[fmt]
    dev = torch.device(device)
    if not torch.amp.autocast_mode.is_autocast_available(dev.type):
        return False
    if dev.type == "cuda" and dtype == torch.bfloat16:
        return torch.cuda.is_bf16_supported()
    return True


def fp8_shape_problem(module: torch.nn.Module) -> str | None:
    """Why torchao cannot run this module in fp8, or None when it can."""
    if not isinstance(module, torch.nn.Linear):
        return f"fp8 covers nn.Linear only, not {type(module).__name__}"
    in_f, out_f = module.in_features, module.out_features
    if in_f % FP8_DIM_MULTIPLE or out_f % FP8_DIM_MULTIPLE:
        return f"fp8 needs in/out features divisible by {FP8_DIM_MULTIPLE}, got ({in_f}, {out_f})"
    return None


@functools.lru_cache(maxsize=None)
def device_name(device: str) -> str:
    """A readable device name for reports and policy files."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        return "cpu: " + line.split(":", 1)[1].strip()
        except OSError:
            pass
        import platform

        return "cpu: " + (platform.processor() or platform.machine())
    return str(dev)
