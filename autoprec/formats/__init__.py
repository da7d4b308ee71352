"""The precision formats, their numeric limits, and which device supports what.

Formats come in families (base.FormatFamily), each its own module: `autocast` (fp32, bf16, fp16), `float8`
(torchao's float8 training and its per-GEMM mixes) and `blockscaled` (MXFP8 and NVFP4 per GEMM, emulated). A format is a registered `Format` (a string equal to its name);
its facts are its `FormatSpec`, its runtime its family. `register_family` and `register_format` add new ones from
outside autoprec (docs/policy-file.md, "Adding a format family")."""

from __future__ import annotations

import torch

from autoprec import devices
from autoprec.formats.autocast import FP16_MAX, AutocastFamily
from autoprec.formats.base import (
    E4M3_MAX,
    GEMM_PRECISIONS,
    GEMMS,
    NO_KERNEL,
    REGISTRY,
    Converted,
    Format,
    FormatFamily,
    FormatSpec,
    GemmCast,
    OperandCast,
    autocast_name,
    caller_precision,
    families,
    family_named,
    format_names,
    other_half_to_fp32,
    parse_format,
    register_family,
    register_format,
    unregister_family,
    unregister_format,
)
from autoprec.formats.blockscaled import BlockGemms, BlockScaledFamily
from autoprec.formats.float8 import (
    FP8_DIM_MULTIPLE,
    Float8Family,
    Fp8Backend,
    Fp8Gemms,
    float8_linear_config,
    fp8_backend,
    fp8_input_dtype,
    fp8_shape_problem,
    has_fp8_kernels,
)


def fp8_formats() -> tuple[Format, ...]:
    """The registered formats whose values are 8-bit floats with scales (torchao's float8), asked now: a format
    registered later is among them."""
    return tuple(f for f in Format if f.spec.is_fp8)


def risky_formats() -> tuple[Format, ...]:
    """The registered formats worth choosing only for a measured gain (`FormatSpec.risky`), asked now."""
    return tuple(f for f in Format if f.spec.risky)


def autocast_dtype(fmt: Format | str) -> torch.dtype | None:
    """The dtype `fmt`'s forward runs under torch.autocast (bf16, fp16), or None where it does not run through
    autocast: its family's answer (FormatFamily.autocast_dtype), so a format registered later has one too."""
    found = Format(fmt)
    return found.family.autocast_dtype(found)


def default_device() -> torch.device:
    """Where autoprec works unless told: the GPU when there is one (autoprec.devices.default_device)."""
    return devices.default_device()


def _has_capability(dev: torch.device, need: tuple[int, int]) -> bool:
    """Whether `dev`'s kernels are rated `need` or above (CUDA's compute capability): the one place a format's
    kernels' capability (float8's MIN_CAPABILITY) is decided (tests/gpu_contract.py makes the CPU an H100 here)."""
    have = devices.lookup(dev).capability(dev)
    return have is not None and have >= need


def autocast_supported(device: torch.device | str, fmt: Format) -> bool:
    """Whether torch.autocast accepts this format's dtype on this device type."""
    return fmt.family.autocast_dtype(fmt) is None or REGISTRY[fmt].device_problem(device) is None


def format_problem(fmt: Format, module: torch.nn.Module, device: torch.device | str) -> str | None:
    """Why `module` cannot run in `fmt` on `device` (the device, then the module's type and shape), or None: its
    family's answer."""
    problem = REGISTRY[fmt].device_problem(device)
    return problem if problem is not None else fmt.family.module_problem(fmt, module)


def device_name(device: str) -> str:
    """A readable device name for reports and policy files (the registered device's name, else `device`)."""
    dev = torch.device(device)
    return devices.lookup(dev).name(dev)


__all__ = [
    "E4M3_MAX",
    "FP16_MAX",
    "FP8_DIM_MULTIPLE",
    "GEMMS",
    "GEMM_PRECISIONS",
    "NO_KERNEL",
    "REGISTRY",
    "AutocastFamily",
    "BlockGemms",
    "BlockScaledFamily",
    "Converted",
    "Float8Family",
    "Format",
    "FormatFamily",
    "FormatSpec",
    "GemmCast",
    "OperandCast",
    "Fp8Backend",
    "Fp8Gemms",
    "autocast_dtype",
    "autocast_name",
    "autocast_supported",
    "caller_precision",
    "default_device",
    "device_name",
    "families",
    "family_named",
    "float8_linear_config",
    "format_names",
    "format_problem",
    "fp8_formats",
    "fp8_backend",
    "fp8_input_dtype",
    "fp8_shape_problem",
    "has_fp8_kernels",
    "other_half_to_fp32",
    "parse_format",
    "risky_formats",
    "register_family",
    "register_format",
    "unregister_family",
    "unregister_format",
]
