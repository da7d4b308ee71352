"""The device as a registered type: what autoprec asks of the hardware a model runs on, one class per device type.

A device type (torch's `torch.device(...).type`: "cpu", "cuda") is a subclass of `Device` with its class
attributes and the methods it has, registered with `@register_device`. Everything in autoprec that depends on the
device asks it through `device_for` (the registered device, or a clear error naming the registered ones) or
`lookup` (the registered device, or the `Device` base, which knows nothing of the type): nothing outside this
module compares `device.type`. The base's answers are a device that has nothing: no synchronisation, no memory
reading, no compute capability, no TF32, compiled only when asked; a device type overrides what it has.

This module is part of the runtime (`import autoprec`): it imports torch only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import heapq
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar, TypeVar

import torch

from autoprec.errors import UserError
from autoprec.registry import Registry


class UnknownDeviceError(UserError):
    """A device type no registered Device stands for."""


@dataclasses.dataclass(frozen=True)
class BlockTime:
    """What one timed block of calls took: `seconds`, the device's time from its first call to the end of its last
    (wall time where the device runs work as it is issued; the device's own markers where it has a queue), and
    `host_s`, the host's time issuing the calls (None where the device has no queue of its own: there the two are
    one). `held`: for a block timed by the device's busy time (Device.time_block's `kernels`), whether every call was
    queued before the device reached it; False where the host outran the hold (one call issuing for longer than the
    spin held the stream: its time then includes the device's waits on the host); None for any other block."""

    seconds: float
    host_s: float | None = None
    held: bool | None = None


class Device:
    """What autoprec asks of one device type. Subclass it, set `type` and what differs from the defaults below,
    override the methods the device has, and register it with `@register_device` (see docs/devices.md). Every
    method takes the `torch.device` it is asked about, so an index (cuda:1) reaches the device."""

    type: ClassVar[str] = ""  # torch's device type: torch.device("cuda:1").type == "cuda"
    label: ClassVar[str] = ""  # the device's name in messages: "CUDA is not available here"
    unit: ClassVar[str] = "device"  # what one of them is called: "this machine has 2 GPUs", "the model is on the CPU"
    numbered: ClassVar[bool] = False  # "<type>:N" names one of several (an index is checked against device_count())
    auto: ClassVar[bool] = False  # autoprec works on it unless told (default_device) where it is available
    compile_by_default: ClassVar[bool] = False  # step times compiled when the user does not say (--compile)
    has_tf32: ClassVar[bool] = False  # matmul_precision sets fp32 matmuls strict or TF32 (the TF32 alternative)
    # torch.compile's mode="reduce-overhead" records CUDA graphs here: a compiled step's launches replayed as one
    # (--cuda-graphs measures uniform bf16 so)
    cuda_graphs: ClassVar[bool] = False
    # the default optimizer (a model.py without its own) is torch's fused AdamW: one kernel for every parameter's
    # update instead of a dozen small ones each, whose launches would otherwise be a large share of a short GPU step
    fused_adamw: ClassVar[bool] = False
    # how memory_rise measures, in words for reports; None: it does not (memory_rise returns None)
    memory_source: ClassVar[str | None] = None

    def is_available(self) -> bool:
        """Whether this process can run work on this device type."""
        return True

    def device_count(self) -> int | None:
        """How many of them this process sees; None where the type is not numbered."""
        return None

    def indexed(self, dev: torch.device) -> torch.device:
        """`dev` with its index filled in where it names none and the device has a current one."""
        return dev

    def synchronize(self, dev: torch.device) -> None:
        """Wait until the work queued on `dev` has finished (a clock reads wall time between two of these)."""

    def time_block(self, dev: torch.device, work: Callable[[], object], calls: int, *, kernels: bool = False) -> BlockTime:
        """Run `work` `calls` times and say what it took (autoprec.tune._measure._timing's DeviceClock reads every step time
        here). This base, for a device that runs work as it is issued (the CPU): the wall time between two
        synchronisations. A device with a queue of its own overrides it to time the queue with its own markers and
        the host's issuing apart. `kernels`: the device's busy time alone, without the gaps where it waited for the
        host (a layer's kernels, not its launch overhead); here the same wall time."""
        self.synchronize(dev)
        start = time.perf_counter()
        for _ in range(calls):
            work()
        self.synchronize(dev)
        return BlockTime(time.perf_counter() - start)

    def name(self, dev: torch.device) -> str:
        """A readable name for reports and policy files: the model of GPU or CPU."""
        return str(dev)

    def capability(self, dev: torch.device) -> tuple[int, int] | None:
        """The compute capability its kernels are rated by (CUDA's (major, minor)); None where there is none. A
        float8 family's `MIN_CAPABILITY` is compared with it (autoprec.formats._has_capability): fp8 kernels need 8.9."""
        return None

    def autocast_available(self, dev: torch.device) -> bool:
        """Whether torch.autocast runs on this device type."""
        return torch.amp.autocast_mode.is_autocast_available(dev.type)

    def supports_dtype(self, dev: torch.device, dtype: torch.dtype) -> bool:
        """Whether autocast to `dtype` computes on `dev` (a GPU without bf16: False)."""
        return True

    def matmul_precision(self, dev: torch.device, tf32: bool) -> contextlib.AbstractContextManager[None]:
        """fp32 matmuls strict (IEEE) or, `tf32`, TF32 for the duration of the block where the device has TF32
        (`has_tf32`), the caller's settings restored after; elsewhere nothing changes."""
        return contextlib.nullcontext()

    def rng_devices(self, dev: torch.device) -> list[int]:
        """The device indices torch.random.fork_rng must save and restore for work on `dev` (the CPU's generator
        is always saved)."""
        return []

    def manual_seed(self, dev: torch.device, seed: int) -> None:
        """Seed the generators work on `dev` draws from (the CPU's, and the device's own: rng_devices), and no
        other: torch.manual_seed would reseed every GPU, which fork_rng(dev) does not restore."""
        torch.default_generator.manual_seed(seed)

    def fork_rng(self, dev: torch.device) -> contextlib.AbstractContextManager[None]:
        """torch.random.fork_rng for work on `dev`: the random generators it draws from are restored after."""
        ids = self.rng_devices(dev)
        # no device_type where there are no device generators: torch 2.11 reads None as a device name and fails
        return torch.random.fork_rng(devices=ids, **({"device_type": self.type} if ids else {}))

    # Peak memory. A device with an allocator that keeps a peak implements the three methods below and states its
    # `memory_source`; the base memory_rise reads them. One without overrides memory_rise itself (the CPU traces).

    def allocated_bytes(self, dev: torch.device) -> int | None:
        """Bytes of the live tensors on `dev` by the allocator's count; None where there is no such count."""
        return None

    def reset_peak_bytes(self, dev: torch.device) -> None:
        """Start the allocator's peak over from what is allocated now."""

    def peak_bytes(self, dev: torch.device) -> int | None:
        """The allocator's peak since reset_peak_bytes; None where there is none."""
        return None

    def memory_rise(self, dev: torch.device, step: Callable[[], object]) -> int | None:
        """The most the live tensor bytes on `dev` rose above their level at the start of `step()`; None (and
        `step` not run) where this device has no measurement."""
        self.synchronize(dev)
        before = self.allocated_bytes(dev)
        if before is None:
            return None
        self.reset_peak_bytes(dev)
        step()
        self.synchronize(dev)
        peak = self.peak_bytes(dev)
        return None if peak is None else max(0, peak - before)

    def total_memory(self, dev: torch.device) -> int | None:
        """The device's memory in bytes (--max-memory as a share of it); None where unknown."""
        return None


# ---------------------------------------------------------------------------------------------------
# The registry

_REGISTRY: Registry[Device] = Registry("device type")  # torch device type -> its Device, in registration order
_GENERIC = Device()  # what lookup answers for a type nothing is registered for
D = TypeVar("D", bound=type[Device] | Device)


def register_device(device: D, *, replace: bool = False) -> D:
    """Register a Device for its `type`: a class (as a decorator, `@register_device`: one instance of it) or an
    instance; returns what it was given. Refuses (ValueError) a type torch does not know and, unless `replace`, one
    already registered; a replaced type keeps its place in the order (registered(), choices())."""
    kind = getattr(device, "type", "")
    what = device.__qualname__ if isinstance(device, type) else type(device).__qualname__
    try:
        known = isinstance(kind, str) and bool(kind) and torch.device(kind).type == kind
    except RuntimeError:
        known = False
    if not known:
        raise ValueError(f"device {what}: type {kind!r} must be a torch device type (torch.device(type))")
    if not replace:
        _REGISTRY.refuse_taken(kind, f"register_device({what}, replace=True) replaces it")
    _REGISTRY[kind] = device() if isinstance(device, type) else device
    return device


def unregister_device(kind: str) -> Device:
    """Remove the device registered for type `kind` and return it (KeyError if none is)."""
    return _REGISTRY.pop(kind)


def registered() -> tuple[str, ...]:
    """The registered device types, in registration order."""
    return tuple(_REGISTRY)


def choices() -> str:
    """The registered device types in words: "cpu or cuda"."""
    kinds = list(_REGISTRY)
    return " or ".join(kinds) if len(kinds) < 3 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def _type(device: torch.device | str) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def device_for(device: torch.device | str) -> Device:
    """The registered Device of `device`'s type; UnknownDeviceError (a UserError) naming the registered types where
    there is none. torch's RuntimeError for a string that is no device at all."""
    kind = _type(device)
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise UnknownDeviceError(
            f"autoprec measures on {choices()}, got {kind} (the registered device types; "
            "autoprec.devices.register_device adds one)"
        ) from None


def lookup(device: torch.device | str) -> Device:
    """The registered Device of `device`'s type, else the Device base, which knows nothing of it (no
    synchronisation, memory reading, capability or TF32): where an unregistered device (the meta device of a model
    built without weights) must still work as it did."""
    return _REGISTRY.get(_type(device), _GENERIC)


def default_device() -> torch.device:
    """Where autoprec works unless told: the first registered `auto` device available here (the GPU when there is
    one), else the CPU."""
    for device in _REGISTRY.values():
        if device.auto and device.is_available():
            return torch.device(device.type)
    return torch.device("cpu")


def preferred_over(device: torch.device | str) -> Device | None:
    """The device autoprec would rather run on than `device`, available here (the GPU for a model on the CPU), or
    None: `device` is that one already, or not a registered one."""
    try:
        here = device_for(device)
    except UnknownDeviceError:
        return None
    best = _REGISTRY.get(default_device().type)
    return best if best is not None and best is not here and best.auto else None


# ---------------------------------------------------------------------------------------------------
# CPU


@register_device
class CPUDevice(Device):
    type = "cpu"
    label = "CPU"
    unit = "CPU"
    memory_source = (
        "CPU tensor allocations traced by the autograd profiler over one training step, plus the model and optimizer "
        "state (not the process's resident memory)"
    )

    def name(self, dev: torch.device) -> str:
        return _cpu_name()

    def memory_rise(self, dev: torch.device, step: Callable[[], object]) -> int | None:
        return _traced_rise(step)

    def total_memory(self, dev: torch.device) -> int | None:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def _traced_rise(step: Callable[[], object]) -> int | None:
    """The CPU allocator's allocations and frees during `step()`, as the autograd profiler records them (its
    memory records, each thread's in order, merged by time), summed in order; the highest running total is the
    rise. None when a profiler is already running (the user's own): one cannot nest, and theirs must not be
    disturbed. The profiler's CPU-only recorder is used where torch has it: torch.profiler's (Kineto) prints
    lines to stderr at every start and stop, once per candidate."""
    if torch.autograd._profiler_enabled():
        return None
    enable, disable = (
        getattr(torch.autograd, "_enable_profiler_legacy", None),
        getattr(torch.autograd, "_disable_profiler_legacy", None),
    )
    try:  # private API: another torch version may lack it or take other arguments
        config = torch.autograd.ProfilerConfig(
            torch.autograd.ProfilerState.CPU, False, True, False, False, False, torch._C._profiler._ExperimentalConfig()
        )  # ProfilerConfig(state, record_shapes, profile_memory, with_stack, with_flops, with_modules, experimental)
    except (AttributeError, TypeError):
        config = None
    if enable is None or disable is None or config is None:
        return _kineto_rise(step)
    with collector_paused():
        enable(config)
        try:
            step()
        finally:
            threads = disable()
    start = next(r for records in threads for r in records if r.name() == "__start_profile")
    per_thread = [
        [(r.cpu_elapsed_us(start), r.cpu_memory_usage()) for r in records if r.kind() == "memory_alloc"] for records in threads
    ]
    return _highest_total(nbytes for _, nbytes in heapq.merge(*per_thread, key=lambda e: e[0]))


def _kineto_rise(step: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 (costly; only a measurement needs it)

    with collector_paused(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    return _highest_total(nbytes for _, nbytes in events)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for one recorded step, then resumed as it was. A collection that
    ran inside the step would free garbage of earlier work (tensors allocated before the recording started): the
    recorder cannot count those frees, and torch's CPU allocator prints a warning for the first one. Paused, the
    step's record holds its own allocations only, the same in every run. Explicit gc.collect() calls still run.
    The collector is process-wide: other threads' automatic collections wait for this one step too, and it is
    resumed only if it was running (nesting-safe)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _highest_total(changes: Iterable[int]) -> int:
    """The highest running total of allocations (+) and frees (-), from 0."""
    level = peak = 0
    for nbytes in changes:
        level += nbytes
        peak = max(peak, level)
    return peak


# ---------------------------------------------------------------------------------------------------
# CUDA


@register_device
class CUDADevice(Device):
    type = "cuda"
    label = "CUDA"
    unit = "GPU"
    numbered = True
    auto = True
    # how GPU training runs, and where fp8 pays only compiled (inductor's CPU code is not what a CPU user trains with)
    compile_by_default = True
    has_tf32 = True
    cuda_graphs = True
    fused_adamw = True
    memory_source = (
        "CUDA allocator peak (torch.cuda.max_memory_allocated) over one training step, plus the model and optimizer state"
    )

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def indexed(self, dev: torch.device) -> torch.device:
        return dev if dev.index is not None else torch.device(dev.type, torch.cuda.current_device())

    def synchronize(self, dev: torch.device) -> None:
        torch.cuda.synchronize(dev)

    def time_block(self, dev: torch.device, work: Callable[[], object], calls: int, *, kernels: bool = False) -> BlockTime:
        """CUDA events around the block in the stream (the GPU's time, free of the synchronisation's and the first
        launch's latency at its ends) and the host's issuing time apart, on `dev` whichever device is current.
        `kernels`: the GPU's busy time alone. The stream is first held by a spin kernel longer than the host takes to
        issue the calls (one unheld call is timed first), so every kernel is queued before the start event runs and
        the events bracket them back to back, without the gaps where the GPU waits for the host. CUDA's launch queue
        holds about a thousand kernels, and a host that waits for room lets those gaps back in: so the calls go in
        held sub-blocks of at most _HELD_ISSUE_S of issuing each, whose times are summed."""
        dev = self.indexed(dev)
        with torch.cuda.device(dev):
            torch.cuda.synchronize(dev)
            if not kernels:
                return _cuda_events_block(work, calls)
            start = time.perf_counter()
            work()
            one_s = time.perf_counter() - start
            torch.cuda.synchronize(dev)
            per = max(1, min(calls, int(_HELD_ISSUE_S / max(one_s, 1e-9))))
            spin = _spin_cycles_per_s(dev)
            seconds = host_s = 0.0
            done, held = 0, True
            while done < calls:
                n = min(per, calls - done)
                part = _cuda_events_block(work, n, hold_cycles=int((2.0 * n * one_s + 1e-3) * spin))
                seconds, host_s, done = seconds + part.seconds, host_s + (part.host_s or 0.0), done + n
                held = held and bool(part.held)
            return BlockTime(seconds, host_s, held)

    def name(self, dev: torch.device) -> str:
        return torch.cuda.get_device_name(dev) if torch.cuda.is_available() else str(dev)

    def capability(self, dev: torch.device) -> tuple[int, int] | None:
        return tuple(torch.cuda.get_device_capability(dev)) if torch.cuda.is_available() else None  # type: ignore[return-value]

    def supports_dtype(self, dev: torch.device, dtype: torch.dtype) -> bool:
        return dtype != torch.bfloat16 or torch.cuda.is_bf16_supported()

    def matmul_precision(self, dev: torch.device, tf32: bool) -> contextlib.AbstractContextManager[None]:
        return _cuda_matmul_precision(tf32)

    def rng_devices(self, dev: torch.device) -> list[int]:
        index = self.indexed(dev).index
        assert index is not None
        return [index]

    def manual_seed(self, dev: torch.device, seed: int) -> None:
        super().manual_seed(dev, seed)
        torch.cuda.init()  # the generators exist once CUDA has started (torch.cuda.manual_seed defers for it)
        for index in self.rng_devices(dev):
            torch.cuda.default_generators[index].manual_seed(seed)

    def allocated_bytes(self, dev: torch.device) -> int:
        return torch.cuda.memory_allocated(dev)

    def reset_peak_bytes(self, dev: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(dev)

    def peak_bytes(self, dev: torch.device) -> int:
        return torch.cuda.max_memory_allocated(dev)

    def total_memory(self, dev: torch.device) -> int:
        return int(torch.cuda.get_device_properties(dev).total_memory)


# The most issuing time one held sub-block may take (seconds): at the 2-5 us a launch costs, at most ~200-500 of the
# ~1000 kernels CUDA's launch queue holds, so the host does not wait for room while the spin holds the stream. One
# call is never split: a call of more kernels than the queue holds outruns its hold, and its block says so (held).
_HELD_ISSUE_S = 1e-3


def _cuda_events_block(work: Callable[[], object], calls: int, *, hold_cycles: int = 0) -> BlockTime:
    """`calls` calls of `work` between two CUDA events on the current stream (after a spin of `hold_cycles` where
    given); the GPU's seconds between the events, the host's issuing seconds and, held, whether the spin outlasted
    the issuing (a call that issues more kernels than the launch queue holds waits for room, and the spin runs out)."""
    spun, begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    if hold_cycles:
        spun.record()
        torch.cuda._sleep(hold_cycles)
    begin.record()
    start = time.perf_counter()
    for _ in range(calls):
        work()
    host_s = time.perf_counter() - start
    end.record()
    end.synchronize()
    held = spun.elapsed_time(begin) / 1e3 >= host_s if hold_cycles else None
    return BlockTime(begin.elapsed_time(end) / 1e3, host_s, held)


@functools.cache
def _spin_cycles_per_s(dev: torch.device) -> float:
    """How many cycles of torch.cuda._sleep's spin kernel run in a second on `dev`, timed once with events."""
    cycles = 10_000_000
    with torch.cuda.device(dev):
        torch.cuda._sleep(cycles)  # the first launch loads the kernel
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / max(begin.elapsed_time(end) / 1e3, 1e-6)


def new_precision_api() -> bool:
    """Whether the process set fp32 precision through torch's per-backend API (torch >= 2.9:
    `torch.backends.cuda.matmul.fp32_precision = "tf32"`), after which torch's legacy getters raise rather than
    mix the two; the legacy API (`torch.set_float32_matmul_precision`) is read and set where it still answers."""
    try:
        torch.get_float32_matmul_precision()
        torch.backends.cudnn.allow_tf32  # noqa: B018 (the read is the test: it raises once the APIs are mixed)
    except RuntimeError:
        return True
    return False


_LEGACY_WORDS = {"ieee": "highest", "tf32": "high", "bf16": "medium"}


def float32_matmul_precision(device_type: str = "cuda") -> str:
    """The process's fp32 matmul setting for a device type's backend (CUDA's cuBLAS, the CPU's oneDNN), in the
    legacy API's words ("highest", "high", "medium"), whichever API set it."""
    if not new_precision_api():
        return torch.get_float32_matmul_precision()
    backend = torch.backends.cuda.matmul if device_type == "cuda" else torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
    value = backend.fp32_precision
    if value == "none":  # inherits the process-wide setting
        value = torch.backends.fp32_precision  # type: ignore[attr-defined]
    return _LEGACY_WORDS.get(value, "highest")


@contextlib.contextmanager
def _cuda_matmul_precision(tf32: bool) -> Iterator[None]:
    """fp32 matmuls and cuDNN convolutions strict (IEEE) or TF32 for the duration of the block, the caller's
    settings restored after, through the API the caller used (see new_precision_api)."""
    if new_precision_api():
        matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv  # type: ignore[attr-defined]
        before = matmul.fp32_precision, conv.fp32_precision
        matmul.fp32_precision = conv.fp32_precision = "tf32" if tf32 else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision, conv.fp32_precision = before
        return
    legacy = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(legacy[0])
        torch.backends.cudnn.allow_tf32 = legacy[1]


CPU = device_for("cpu")
CUDA = device_for("cuda")

__all__ = [
    "BlockTime",
    "Device",
    "CPUDevice",
    "CUDADevice",
    "CPU",
    "CUDA",
    "UnknownDeviceError",
    "register_device",
    "unregister_device",
    "registered",
    "device_for",
    "lookup",
    "default_device",
    "preferred_over",
    "float32_matmul_precision",
]
