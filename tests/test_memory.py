import gc

import pytest
import torch

from autoprec import Policy
from autoprec.errors import UserError
from autoprec.formats import Format
from autoprec.tune import load_task, prepare
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import MEMORY_TRIES
from autoprec.tune._measure._trainer import Trainer

CPU = torch.device("cpu")

# Activations (4096 x 512 per hidden layer) outweigh the weights, as in training with real batches: lowering the
# matmuls to bf16 must show in the peak.
WIDE = """
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 4))

def batches(split):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return [(torch.randn(4096, 64, generator=g), torch.randint(0, 4, (4096,), generator=g))]

def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
"""


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "model.py"
    path.write_text(WIDE, encoding="utf-8")
    return prepare(load_task(path), "cpu")


def test_the_rise_is_the_highest_running_total_of_the_allocations_in_order():
    kept = []

    def step():
        a = torch.empty(1000, dtype=torch.float32)  # +4000
        kept.append(torch.empty(2000, dtype=torch.float32))  # +8000: 12000, the peak
        del a  # -4000
        kept.append(torch.empty(500, dtype=torch.float32))  # +2000: 10000

    assert memory.rise_bytes(CPU, step) == 12000


def test_a_step_that_frees_what_it_allocates_before_allocating_more_rises_by_the_largest_alone():
    def step():
        for n in (1000, 3000, 2000):
            torch.empty(n, dtype=torch.float64)  # freed at once: never two alive

    assert memory.rise_bytes(CPU, step) == 3000 * 8


@pytest.mark.parametrize("recorder", ["legacy", "kineto"])
def test_no_automatic_garbage_collection_runs_inside_the_recorded_step_and_the_collector_is_resumed(recorder, monkeypatch):
    # a collection inside the step would free earlier work's tensors, which the recorder cannot count
    if recorder == "kineto":
        monkeypatch.setattr(torch.autograd, "_enable_profiler_legacy", None)
    seen = []
    assert memory.rise_bytes(CPU, lambda: seen.append(gc.isenabled())) is not None
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that paused it itself finds it paused after
    try:
        memory.rise_bytes(CPU, lambda: None)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_profiler_of_the_users_is_left_alone_and_nothing_is_measured():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert memory.rise_bytes(CPU, lambda: torch.empty(10)) is None


def test_state_counts_each_storage_once():
    w = torch.zeros(100)
    tied = [w, w, w[:10], torch.zeros(5, dtype=torch.float64)]
    assert memory.state_bytes(tied) == 100 * 4 + 5 * 8


def test_a_devices_without_a_measurement_says_so():
    meta = torch.device("meta")
    assert memory.source(meta) is None and memory.rise_bytes(meta, lambda: None) is None
    assert "not measured on meta" in memory.not_measured(meta)
    assert memory.source(CPU) == memory.CPU_SOURCE


def test_fp32_peak_holds_the_state_the_gradients_and_the_activations(wide):
    trainer = Trainer(wide, Policy())
    peak = trainer.peak_memory()
    params = sum(p.numel() * 4 for p in trainer.model.parameters())
    state = memory.state_bytes(trainer.state())
    assert state == 3 * params + 6 * 4  # AdamW: weights, exp_avg, exp_avg_sq, a float32 step per tensor (6)
    activations = 4096 * 512 * 4  # one hidden layer's output, fp32
    assert peak > state + params + activations  # the gradients and a layer's activations coexist at some point
    assert peak < state + params + 20 * activations
    assert trainer.peak_memory() == peak  # deterministic: the same step needs the same bytes


def test_bf16_training_needs_less_peak_memory_than_fp32_when_activations_dominate(wide):
    fp32 = Trainer(wide, Policy()).peak_memory()
    bf16 = Trainer(wide, Policy(layers={"": Format.BF16})).peak_memory()
    assert bf16 < 0.8 * fp32


def test_a_trainer_that_never_stepped_takes_a_first_step_before_its_peak_is_measured(wide):
    trainer = Trainer(wide, Policy())
    trainer.peak_memory()
    assert trainer.steps == 2  # a first step to build the optimizer state, then the measured one


@pytest.mark.parametrize(
    "text, expected",
    [("40GB", 40 * 10**9), ("40 GiB", 40 * 2**30), ("512mb", 512 * 10**6), ("1.5KiB", 1536), ("100", None), ("2e9B", 2 * 10**9)],
)
def test_a_limit_is_a_size_with_a_unit(text, expected):
    if expected is None:
        with pytest.raises(UserError, match="add a unit, such as 100GB"):
            memory.parse_limit(text, CPU)
    else:
        assert memory.parse_limit(text, CPU) == expected


def test_a_limit_without_a_unit_or_in_percent_is_a_share_of_the_devices_memory(monkeypatch):
    monkeypatch.setattr(memory, "device_total", lambda device: 1000)
    assert memory.parse_limit("0.8", CPU) == 800
    assert memory.parse_limit("25%", CPU) == 250
    assert memory.parse_limit("1", CPU) == 1000


@pytest.mark.parametrize("text", ["lots", "40 parsecs", "-3GB", "0", "0%", "150%", "nanGB", ""])
def test_a_malformed_limit_is_refused_with_the_forms_it_takes(text):
    with pytest.raises(UserError, match="--max-memory"):
        memory.parse_limit(text, CPU)


def test_a_limit_on_a_device_without_a_measurement_is_refused_before_anything_runs():
    with pytest.raises(UserError, match="not measured on meta"):
        memory.parse_limit("1GB", torch.device("meta"))


def test_human_bytes_and_saving():
    assert memory.human_bytes(512) == "512 B" and memory.human_bytes(1536) == "1.5 KiB"
    assert memory.human_bytes(3 * 2**30) == "3 GiB" and memory.human_bytes(None) == "-"
    assert memory.saving(75, 100) == pytest.approx(0.25)
    assert memory.saving(None, 100) is None and memory.saving(75, None) is None


def test_without_the_legacy_recorder_the_kineto_profiler_measures_the_same(monkeypatch):
    monkeypatch.delattr(torch.autograd, "_enable_profiler_legacy")

    def step():
        keep = torch.empty(1000, dtype=torch.float32)
        torch.empty(500, dtype=torch.float32)  # freed at once
        return keep

    assert memory.rise_bytes(CPU, step) == 4000 + 2000


UNEVEN = WIDE.replace(
    "return [(torch.randn(4096, 64, generator=g), torch.randint(0, 4, (4096,), generator=g))]",
    "return [(torch.randn(n, 64, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in (16, 4096, 512)]",
)


def test_every_candidate_is_measured_on_the_largest_batch_wherever_its_order_stands(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(UNEVEN, encoding="utf-8")
    uneven = prepare(load_task(path), "cpu")
    one, two = Trainer(uneven, Policy()), Trainer(uneven, Policy())
    one.step()
    for _ in range(2):
        two.step()  # the next batch in order: the 4096-row one for `one`, the 512-row one for `two`
    assert one.peak_memory() == two.peak_memory()
    assert one._next == 1 and two._next == 2  # the measured step took the largest batch, out of order


def test_a_step_the_grad_scaler_skipped_is_measured_again_and_given_up_after_the_tries(wide, monkeypatch):
    trainer = Trainer(wide, Policy())
    trainer.step()
    real = trainer.step
    calls, skip = {"n": 0}, set()

    def step(index=None):
        out = real(index)
        calls["n"] += 1
        if calls["n"] in skip:  # as GradScaler.step does on inf gradients: the optimizer's step did not run
            trainer.scaler.skipped_steps += 1
        return out

    monkeypatch.setattr(trainer, "step", step)
    skip.add(1)  # the first measured step (the largest batch was stepped on already: no unmeasured step first)
    assert trainer.peak_memory() == Trainer(wide, Policy()).peak_memory()
    assert calls["n"] == 2  # measured again once
    calls["n"], skip = 0, set(range(1, 1 + MEMORY_TRIES))
    assert trainer.peak_memory() is None and calls["n"] == MEMORY_TRIES
