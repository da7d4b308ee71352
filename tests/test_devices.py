"""The device is a registered type (autoprec/devices.py): a Device registered from outside autoprec is the one its
callers ask (the clock's synchronisation, a training step, the device's name, peak memory, TF32, --device), and an
unregistered type is refused naming the registered ones."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from autoprec import Policy, devices
from autoprec.devices import CPUDevice, Device, UnknownDeviceError, device_for, register_device, unregister_device
from autoprec.errors import UserError
from autoprec.formats import device_name
from autoprec.tune import load_task, prepare
from autoprec.tune._commands._shared import check_device
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import TimingConfig, default_compile
from autoprec.tune._measure import _timing as timing
from autoprec.tune._measure._trainer import Trainer, matmul_precision

MODELS = Path(__file__).parent / "models"
META = torch.device("meta")


class ToyMeta(Device):
    """A device of torch's meta type, as a user's module would add one: a name, an allocator that keeps a peak,
    TF32, compiled by default. What it is asked is written down."""

    type = "meta"
    label = "Meta"
    unit = "toy"
    compile_by_default = True
    has_tf32 = True
    memory_source = "the toy allocator's peak"

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.allocated = 100

    def name(self, dev: torch.device) -> str:
        return "toy meta device"

    def matmul_precision(self, dev: torch.device, tf32: bool) -> contextlib.AbstractContextManager[None]:
        self.asked.append(f"tf32={tf32}")
        return contextlib.nullcontext()

    def allocated_bytes(self, dev: torch.device) -> int:
        return self.allocated

    def reset_peak_bytes(self, dev: torch.device) -> None:
        self.asked.append("reset_peak")

    def peak_bytes(self, dev: torch.device) -> int:
        return self.allocated + 250


@pytest.fixture
def toy_meta() -> Iterator[ToyMeta]:
    register_device(ToyMeta)
    try:
        toy = device_for("meta")
        assert isinstance(toy, ToyMeta)
        yield toy
    finally:
        unregister_device("meta")
    assert devices.registered() == ("cpu", "cuda")


class CountingCPU(CPUDevice):
    """A CPU-backed stand-in for a new device: the CPU, but its synchronisations are counted and it names itself."""

    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self, dev: torch.device) -> None:
        self.synchronized += 1

    def name(self, dev: torch.device) -> str:
        return "stand-in device"


@pytest.fixture
def counting_cpu() -> Iterator[CountingCPU]:
    original = device_for("cpu")
    stand_in = CountingCPU()
    register_device(stand_in, replace=True)
    try:
        yield stand_in
    finally:
        register_device(original, replace=True)
    assert devices.registered() == ("cpu", "cuda") and device_for("cpu") is original


def test_an_unregistered_device_type_is_refused_naming_the_registered_ones():
    with pytest.raises(UnknownDeviceError, match=r"autoprec measures on cpu or cuda, got meta \(the registered"):
        device_for(META)
    with pytest.raises(UserError, match="--device meta: autoprec measures on cpu or cuda, got meta"):
        check_device("meta")
    assert devices.lookup(META) is not None and memory.source(META) is None  # the runtime still works on it


def test_a_device_registered_from_outside_autoprec_is_the_one_its_callers_ask(toy_meta):
    assert devices.registered() == ("cpu", "cuda", "meta")
    assert check_device("meta") == META  # --device offers it
    with pytest.raises(UnknownDeviceError, match="autoprec measures on cpu, cuda or meta, got mps"):
        device_for("mps")
    assert device_name("meta") == "toy meta device"
    assert default_compile("meta") is True
    assert memory.source(META) == "the toy allocator's peak"
    ran: list[bool] = []
    assert memory.rise_bytes(META, lambda: ran.append(True)) == 250 and ran == [True]
    with matmul_precision(META, tf32=True):
        pass
    assert toy_meta.asked == ["reset_peak", "tf32=True"]


def test_register_device_refuses_a_taken_type_and_one_torch_does_not_know():
    with pytest.raises(ValueError, match=r"device type 'cpu' is already registered \(by autoprec\.devices\.CPUDevice\)"):
        register_device(CountingCPU)
    with pytest.raises(ValueError, match="type 'toaster' must be a torch device type"):
        register_device(type("Toaster", (Device,), {"type": "toaster"}))
    with pytest.raises(ValueError, match="type '' must be a torch device type"):
        register_device(Device)
    assert devices.registered() == ("cpu", "cuda")


def test_the_clock_and_a_training_step_synchronize_through_the_registered_device(counting_cpu, monkeypatch):
    monkeypatch.setattr(timing, "CLOCK", timing.DeviceClock())  # the real clock, not the suite's FormatClock
    work: dict[str, Callable[[], object]] = {"a": lambda: None}
    timing.interleaved_times(
        work, torch.device("cpu"), TimingConfig(warmup=1, rounds=2, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    )
    assert counting_cpu.synchronized == 2 * 3  # before and after each of the 3 timed blocks (1 sizing + 2 rounds)
    counting_cpu.synchronized = 0
    trainer = Trainer(prepare(load_task(MODELS / "overflow_mlp.py"), "cpu"), Policy())
    trainer.step()  # the first step is timed to its end (a compiled model's compilation)
    assert counting_cpu.synchronized == 2
    trainer.step()
    assert counting_cpu.synchronized == 2  # later steps return without synchronising
    assert device_name("cpu") == "stand-in device"


def test_the_cuda_devices_rise_is_its_allocators_peak_over_the_step_above_the_bytes_at_its_start(monkeypatch):
    # torch.cuda's calls stood in for (no GPU needed): what the CUDA device asks, in order, and what it makes of it
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: calls.append("allocated") or 1000)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: calls.append("peak") or 1600)
    assert memory.rise_bytes(torch.device("cuda"), lambda: calls.append("step")) == 600
    assert calls == ["synchronize", "allocated", "reset", "step", "synchronize", "peak"]
    assert memory.source(torch.device("cuda")) == memory.CUDA_SOURCE
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert devices.CUDA.rng_devices(torch.device("cuda")) == [3] and devices.CUDA.rng_devices(torch.device("cuda:1")) == [1]


def test_the_cpu_forks_the_generators_as_torch_2_11_takes_it(monkeypatch):
    """torch 2.11's fork_rng reads device_type=None as a device name and fails: every CPU prepare() failed there."""
    import contextlib

    from autoprec import devices

    seen = {}

    def fork_rng(devices=None, enabled=True, device_type="cuda", **kw):
        if device_type is None:
            raise TypeError("device() received an invalid combination of arguments - got (NoneType)")
        seen.update(devices=list(devices or []), device_type=device_type)
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    with devices.device_for("cpu").fork_rng(torch.device("cpu")):
        pass
    assert seen == {"devices": [], "device_type": "cuda"}  # torch's own default, untouched


class FakeEvent:
    """A CUDA event on a fake clock: each record is one millisecond after the last."""

    now = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        FakeEvent.now += 1.0
        self.at = FakeEvent.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


def test_a_held_cuda_block_goes_in_sub_blocks_the_launch_queue_holds_on_the_named_device(monkeypatch):
    """A held block (the layer's kernels alone) of many calls would overfill CUDA's launch queue (about a thousand
    kernels): the host would wait for room while the spin runs out, and the GPU's waits on it would be timed. So each
    sub-block issues at most _HELD_ISSUE_S of calls, behind its own spin, and their times are summed; all of it on
    the device named, whichever is current."""
    entered, spins, calls = [], [], []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", spins.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: entered.append(dev) or contextlib.nullcontext())
    monkeypatch.setattr(devices, "_spin_cycles_per_s", lambda dev: 1e9)
    monkeypatch.setattr(devices, "_HELD_ISSUE_S", 3.0)
    clock = iter(range(10_000))
    # each call of the work: one second of issuing, on autoprec.devices' clock alone
    monkeypatch.setattr(devices, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    cuda = devices.CUDADevice()
    block = cuda.time_block(torch.device("cuda", 1), lambda: calls.append(1), 10, kernels=True)
    assert entered == [torch.device("cuda", 1)]
    assert len(calls) == 11  # one unheld call sizes the spin, then the 10 timed
    # sub-blocks of 3, 3, 3 and 1 calls: each behind a spin of twice its issuing time and a millisecond
    assert spins == [int((2.0 * n + 1e-3) * 1e9) for n in (3, 3, 3, 1)]
    assert block.seconds == pytest.approx(4 * 1e-3)  # four sub-blocks of one fake millisecond each, summed
    # each sub-block's host issued for a fake second behind a spin the events time at a millisecond: it outran the
    # hold, so the device's waits on it are in the time, and the block says so
    assert block.held is False
    unheld = cuda.time_block(torch.device("cuda", 0), lambda: calls.append(1), 5)
    assert unheld.seconds == pytest.approx(1e-3) and len(spins) == 4 and unheld.held is None  # one block, no spin
    fast = iter(range(10_000))  # a microsecond a call now: the spin's millisecond outlasts every sub-block's issuing
    monkeypatch.setattr(devices, "time", types.SimpleNamespace(perf_counter=lambda: next(fast) * 1e-6))
    assert cuda.time_block(torch.device("cuda", 0), lambda: None, 10, kernels=True).held is True


def test_seeding_for_a_device_seeds_the_cpus_generator_and_that_devices_own_alone(monkeypatch):
    """A review found random_state's torch.manual_seed reseeded every GPU while fork_rng restored the workload's
    device alone: a search on cuda:0 moved the other GPUs' generators."""
    torch.manual_seed(1)
    expected = torch.rand(3)
    devices.lookup(torch.device("cpu")).manual_seed(torch.device("cpu"), 1)
    assert torch.equal(torch.rand(3), expected)

    class Generator:
        def __init__(self):
            self.seeds = []

        def manual_seed(self, seed):
            self.seeds.append(seed)

    fake = (Generator(), Generator())
    started = []
    monkeypatch.setattr(torch.cuda, "default_generators", fake)
    monkeypatch.setattr(torch.cuda, "init", lambda: started.append(True))  # no CUDA here
    cuda = devices.lookup(torch.device("cuda", 1))
    cuda.manual_seed(torch.device("cuda", 1), 7)
    assert (fake[0].seeds, fake[1].seeds) == ([], [7]) and started  # CUDA started before its generators are read
