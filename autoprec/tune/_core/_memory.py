"""Peak memory of one training step: what a candidate needs to train, measured on the device, never estimated.

    peak = state + the most the live tensor bytes rose during one step above where they stood when it began

`state` is what a candidate keeps between steps: its parameters, buffers and optimizer state (counted exactly,
each storage once). The rise is measured with the gradients freed first, so it holds the gradients, the
activations saved for backward, the casts to lower formats and every temporary. The batch is the same for every
candidate and is not counted. How the rise is measured depends on the device (`source` says it in words); each
registered device (autoprec.devices) measures it its own way (Device.memory_rise, Device.memory_source):

- CUDA: the caching allocator's own peak (`torch.cuda.max_memory_allocated`): every tensor on the device,
  compiled kernels' buffers included. Not seen: blocks the allocator caches but no tensor uses
  (`memory_reserved`), cuBLAS/cuDNN/NCCL workspaces and the CUDA context. torch keeps one peak per device and
  has no scoped one, so it is reset before each measured step (`torch.cuda.reset_peak_memory_stats`): a peak the
  caller reads across a search starts over there.
- CPU: every allocation and free of the CPU tensor allocator during the step, traced by the autograd
  profiler's memory records and summed in time order. Not seen: the process's other memory (Python objects, allocator
  caching, library scratch space such as oneDNN's), so it is not the process's resident size.
- Other devices: not measured (None), and every report says so.

`parse_limit` reads `--max-memory`: a size ("40GB", "512MiB") or a share of the device's memory ("0.8", "80%").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch

from autoprec import devices
from autoprec.devices import CPU, CUDA
from autoprec.errors import UserError

CUDA_SOURCE = CUDA.memory_source
CPU_SOURCE = CPU.memory_source


def source(device: torch.device) -> str | None:
    """How peak memory is measured on `device`, in words; None where it is not (see the module's docstring)."""
    return devices.lookup(device).memory_source


def not_measured(device: torch.device) -> str:
    return f"not measured on {device.type}: autoprec reads peak memory from the CUDA allocator or, on CPU, the autograd profiler"


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied weight, a view: counted once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        try:
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            size = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage: count its elements
            key, size = ("", id(t)), t.numel() * t.element_size()
        if key[1] == 0 or key not in seen:
            seen.add(key)
            total += size
    return total


def rise_bytes(device: torch.device, step: Callable[[], object]) -> int | None:
    """The most the live tensor bytes on `device` rose above their level at the start of `step()`; None where
    this device has no measurement (Device.memory_rise)."""
    return devices.lookup(device).memory_rise(device, step)


MIB = 2**20
# decimal units are powers of 1000; binary ones, and the bare letters Slurm and Docker use (40G), of 1024
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE)


def device_total(device: torch.device) -> int | None:
    """The device's memory in bytes: the GPU's, or the machine's RAM for the CPU; None where unknown."""
    return devices.lookup(device).total_memory(device)


def parse_limit(value: str | int | float, device: torch.device) -> int:
    """`--max-memory` in bytes: a size with a unit ("40GB", "40 GiB", "40G", "512MB"; decimal units are powers of
    1000, binary ones and the bare letters K, M, G, T of 1024) or a share of the device's memory ("0.8" or "80%")."""
    text = str(value).strip()
    hint = "give a size such as 40GB, 40GiB or 512MiB, or a share of the device's memory such as 0.8 or 80%"
    if source(device) is None:
        raise UserError(f"--max-memory {text}: peak memory is {not_measured(device)}; leave --max-memory out")
    match = _SIZE.match(text)
    if not match or (match.group(2).upper() not in _UNITS and match.group(2) != "%"):
        raise UserError(f"--max-memory {text!r}: not a size; {hint}")
    number, unit = float(match.group(1)), match.group(2).upper()
    if unit == "%" or not unit:
        share = number / 100 if unit == "%" else number
        if not 0 < share <= 1:
            unit_hint = "" if unit == "%" else f"; for an absolute size add a unit, such as {text}GB"
            raise UserError(f"--max-memory {text}: a share of the device's memory must be in (0, 1] (or 1%..100%){unit_hint}")
        total = device_total(device)
        if total is None:
            raise UserError(f"--max-memory {text}: this device's total memory is unknown; give a size such as 40GB")
        if share * total < 1:
            raise UserError(f"--max-memory {text}: under 1 byte of this device's {human_bytes(total)}; {hint}")
        return int(share * total)
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise UserError(f"--max-memory {text}: must be at least 1 byte; {hint}")
    return int(size)


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; None or NaN -> '-'."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 999.5 or unit == "GiB":  # 999.5 to 1023 of a unit shows as 0.98 of the next, not as 1e+03
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}" if abs(n) < 1000 else f"{n:,.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_change(saving: float | None) -> str:
    """A saving as the peak's change from fp32's: 0.25 -> '-25%', -0.1 -> '+10%', None -> '-'."""
    if saving is None or saving != saving:
        return "-"
    text = f"{-100 * saving:+.0f}%"
    return "0%" if text in ("+0%", "-0%") else text


def saving(peak: int | None, fp32_peak: int | None) -> float | None:
    """The share of fp32's peak a candidate saves (0.25: a quarter less); None where either was not measured."""
    if peak is None or not fp32_peak:
        return None
    return 1.0 - peak / fp32_peak
