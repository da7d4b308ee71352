"""The autocast family: formats whose layer runs under torch.autocast of one dtype (bf16, fp16), and fp32 (autocast
off inside the layer). apply_policy changes no module for them: the layer's wrapped forward sets the autocast."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoprec import devices
from autoprec.formats.base import (
    Format,
    FormatFamily,
    caller_precision,
    other_half_to_fp32,
    register_family,
    register_format,
    to_fp32,
)
from autoprec.tensors import map_tensors

FP16_MAX = torch.finfo(torch.float16).max  # 65504
# bf16's rounding alone measures about 50 dB, fp16's 69: below 30 dB values were flushed or overflowed, not rounded
# (fp16 gradients are replayed at loss scale 1; a GradScaler lifts those flushed, the gradient ranges say how far).
SQNR_FLOOR_DB = 30.0

# each autocast format's dtype (None: fp32, autocast off inside the layer), keyed by the Format (a str equal to its
# name): a plain dict lookup, which torch.compile traces
_DTYPES: dict[str, torch.dtype | None] = {}


@register_family
class AutocastFamily(FormatFamily):
    name = "autocast"
    sqnr_floor_db = SQNR_FLOOR_DB

    def add_format(self, fmt: Format, *, autocast: torch.dtype | None = None, **facts: Any) -> None:
        """`autocast`: the dtype the layer's forward runs under torch.autocast (bf16, fp16); None: fp32."""
        super().add_format(fmt, **facts)  # refuses any other
        if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
            raise ValueError(
                f"format {fmt.value!r}: autocast must be a floating torch.dtype, such as torch.bfloat16, but got {autocast!r}"
            )
        _DTYPES[fmt] = autocast

    def remove_format(self, fmt: Format) -> None:
        _DTYPES.pop(fmt, None)

    def autocast_dtype(self, fmt: Format) -> torch.dtype | None:
        return _DTYPES[fmt]

    def device_problem(self, fmt: Format, device: torch.device) -> str | None:
        dtype = _DTYPES[fmt]
        if dtype is None:
            return None
        if not devices.lookup(device).autocast_available(device):
            return f"torch.autocast is not available on {device.type}"
        if not devices.lookup(device).supports_dtype(device, dtype):
            return f"{devices.lookup(device).name(device)} has no {fmt.value}"
        return None

    def overflow_limit(self, fmt: Format) -> float | None:
        return fmt.spec.max_value if _DTYPES[fmt] is not None else None

    def forward(
        self, fmt: Format, module: torch.nn.Module, inner: Callable[..., Any], device_type: str, args: tuple, kwargs: dict
    ) -> Any:
        dtype = _DTYPES[fmt]
        if dtype is None:
            # Inputs may arrive in bf16/fp16 from a lowered neighbour; autocast-off code needs fp32.
            args, kwargs = map_tensors((args, kwargs), to_fp32)
            with torch.autocast(device_type, enabled=False):
                return inner(module, *args, **kwargs)
        outer_autocast = torch.is_autocast_enabled(device_type)
        args, kwargs = other_half_to_fp32((args, kwargs), dtype)  # a bf16 input of an fp16 block, or the reverse
        with torch.autocast(device_type, dtype=dtype):
            out = inner(module, *args, **kwargs)
        return caller_precision(out, outer_autocast)


Format.FP32 = register_format("fp32", family="autocast", inside="autocast off; inputs arriving in bf16/fp16 are cast to fp32")
Format.BF16 = register_format(
    "bf16", family="autocast", inside="torch.autocast(bfloat16)", autocast=torch.bfloat16, fallback=Format.FP32
)
Format.FP16 = register_format(
    "fp16",
    family="autocast",
    inside="torch.autocast(float16), with a GradScaler",
    autocast=torch.float16,
    loss_scale=True,
    max_value=FP16_MAX,
    fallback=Format.BF16,
    risky=True,
)
