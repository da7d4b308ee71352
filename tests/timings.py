"""Step times that do not depend on this machine: a clock that prices a step by the formats its model runs in.

autoprec reads every step time through `autoprec.tune._measure._timing.CLOCK`. The test suite puts a `FormatClock` there
(conftest.py, `--timings`), so which formats the profile keeps and which policy a search chooses never depend on
whether this CPU runs bf16 fast (AMX) or a hundred times slower (AVX2 only). A test that needs lowered formats
to be faster or slower than fp32 says so with the `timings` fixture; every other test passes under both.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator, Mapping

import torch

from autoprec import devices
from autoprec.apply import applied_summary
from autoprec.formats import Format
from autoprec.tune._measure import _timing as timing

# The factor on a layer's share of the step time in each kind of format, per named device behaviour.
FASTER = {"half": 0.5, "fp8": 0.4}  # a GPU, or a CPU with AMX: every lowered format pays
SLOWER = {"half": 300.0, "fp8": 300.0}  # an AVX2-only or loaded CPU (bf16 100-300x fp32): every lowered format far slower
MODES = {"faster": FASTER, "slower": SLOWER}

STEP_S = 0.1  # an all-fp32 step, whatever the model: above any min_block_s, so each block is one step
FIXED = 0.1  # the share of a step no format changes (the optimizer, the data, the launch overhead)


def factor(fmt: Format, factors: Mapping[str, float]) -> float:
    """A layer's factor in `fmt`: an fp8 per-GEMM mix pays per GEMM (fprop, dgrad, wgrad a third each), fp8 for
    its fp8 GEMMs, and for the others bf16's ("half") or, where they run in the weight's fp32, fp32's (1)."""
    if fmt is Format.FP32:
        return 1.0
    gemms = fmt.family.fp8_gemms(fmt)
    if gemms is not None and gemms.high_precision:
        hp = factors["half"] if gemms.input_dtype(torch.float32, None) == torch.bfloat16 else 1.0
        return sum(hp if g in gemms.high_precision else factors["fp8"] for g in ("fprop", "dgrad", "wgrad")) / 3
    return factors["fp8"] if fmt.spec.is_fp8 else factors["half"]


def formats_of(model: torch.nn.Module) -> dict[str, Format]:
    """Each module that holds parameters -> the format it runs in: that of the longest name the applied policy
    lists that encloses it (fp32 where none does)."""
    summary = applied_summary(model)
    listed = {name: rec.format for name, rec in summary.layers.items()} if summary is not None else {}
    out = {}
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        enclosing = [n for n in listed if n == "" or name == n or name.startswith(n + ".")]
        out[name] = listed[max(enclosing, key=len)] if enclosing else Format.FP32
    return out


class FormatClock:
    """A timing.Clock that runs the work (so its steps count, its losses are checked, its weights change) and says
    it took STEP_S times (FIXED + the rest weighted by each parameter's format factor): a device on which every
    format's speed is what `factors` says. `noise`: each call's time times exp(N(0, noise)), seeded."""

    def __init__(self, factors: Mapping[str, float], *, noise: float = 0.0, seed: int = 0):
        self.factors = dict(factors)
        self.noise = noise
        self.rng = random.Random(seed)
        self.calls = 0

    def seconds(self, model: torch.nn.Module | None) -> float:
        """One call's price."""
        if model is None:
            return STEP_S
        sizes: dict[Format, int] = {}
        for name, fmt in formats_of(model).items():
            numel = sum(p.numel() for p in model.get_submodule(name).parameters(recurse=False))
            sizes[fmt] = sizes.get(fmt, 0) + numel
        total = sum(sizes.values())
        if total == 0:
            return STEP_S
        weighted = sum(n * factor(f, self.factors) for f, n in sizes.items()) / total
        return STEP_S * (FIXED + (1 - FIXED) * weighted)

    def time(self, work: Callable[[], object], calls: int, device: torch.device) -> float:
        for _ in range(calls):
            work()
        self.calls += calls
        per_call = self.seconds(getattr(work, "model", None))
        if self.noise:
            return sum(per_call * math.exp(self.rng.gauss(0.0, self.noise)) for _ in range(calls))
        return per_call * calls


@contextlib.contextmanager
def using(clock: timing.Clock) -> Iterator[timing.Clock]:
    """timing.CLOCK is `clock` inside (for fixtures wider than a test, which the `timings` fixture cannot reach)."""
    before = timing.CLOCK
    timing.CLOCK = clock
    try:
        yield clock
    finally:
        timing.CLOCK = before


class QueuedDevice(devices.Device):
    """A device with a queue of its own, as a CUDA GPU, standing in for the CPU (its tensors stay there; only the
    timing is this device's). `price(work)` says a call's (host seconds, device seconds): a block's time on the device
    is the later of the host's issuing and the device's running (it waits on a host slower than it). The host's time
    is reported apart and, as CUDA's, includes its waits on a full launch queue: where the device is the slower, the
    host issues ahead by QUEUE_CALLS calls' worth of work and then waits, so its time is nearly the device's. A
    `kernels` block (held: every call queued before the device starts) reports the device's busy time alone and the
    host's issuing alone."""

    type = "cpu"
    QUEUE_CALLS = 0.5  # GPT-2-small's fp32 step on an H200: 51.3 ms of host time in a 54.5 ms step, the GPU busy all of it

    def __init__(self, price: Callable[[object], tuple[float, float]]):
        self.price = price

    def time_block(self, dev, work, calls, *, kernels=False):
        for _ in range(calls):
            work()
        host, busy = self.price(work)
        if kernels:
            return devices.BlockTime(calls * busy, calls * host)
        return devices.BlockTime(calls * max(host, busy), max(calls * host, (calls - self.QUEUE_CALLS) * busy))


@contextlib.contextmanager
def queued_cpu(price: Callable[[object], tuple[float, float]]) -> Iterator[QueuedDevice]:
    """Inside: the CPU's registered Device is a QueuedDevice pricing work by `price`, and timing.CLOCK the real clock
    that asks it; both restored after."""
    device, cpu = QueuedDevice(price), devices.device_for("cpu")
    devices.register_device(device, replace=True)
    try:
        with using(timing.DeviceClock()):
            yield device
    finally:
        devices.register_device(cpu, replace=True)
