import math
from pathlib import Path

import pytest
import torch

from autoprec import Policy, load_task, prepare
from autoprec.measure import (
    TimingConfig,
    Timing,
    Trainer,
    default_evaluate,
    evaluate_metric,
    interleaved_times,
    probe_times,
    sqnr_db,
    time_steps,
)

MODELS = Path(__file__).parent / "models"
FAST = TimingConfig(warmup=1, rounds=3, min_block_s=0.0)


@pytest.fixture(scope="module")
def workload():
    return prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")


def test_sqnr_db_against_known_noise():
    torch.manual_seed(0)
    x = torch.randn(10_000)
    noise = torch.randn(10_000)
    noise *= 0.1 * x.norm() / noise.norm()
    assert sqnr_db(x, x + noise) == pytest.approx(20.0, abs=1e-4)  # fp32 rounding of x + noise
    assert sqnr_db(x, x) == math.inf
    assert math.isnan(sqnr_db(x, torch.full_like(x, float("inf"))))


def test_interleaved_times_rotates_and_counts_rounds():
    order = []
    work = {name: (lambda n=name: order.append(n)) for name in "abc"}
    times = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=0, rounds=3, min_block_s=0.0))
    assert set(times) == {"a", "b", "c"} and all(len(t.samples_ms) == 3 for t in times.values())
    timed = order[3:]  # after one calibration call each
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"] and timed[6:] == ["c", "a", "b"]


def test_timing_median_and_spread():
    t = Timing.from_samples([1.0, 2.0, 4.0])
    assert t.median_ms == 2.0 and t.spread == pytest.approx(1.5)  # few samples: the full range
    t = Timing.from_samples([10.0, 10.0, 11.0, 12.0, 100.0])  # one stalled round barely moves it
    assert t.median_ms == 11.0 and t.spread == pytest.approx(2.0 / 11.0)


def test_probe_times_takes_the_fastest_call():
    calls = []
    probe = probe_times({"x": lambda: calls.append(1)}, torch.device("cpu"), warmup=2, repeats=3)
    assert len(calls) == 5 and probe["x"] >= 0


def test_trainer_steps_update_weights_and_track_finiteness(workload):
    trainer = Trainer(workload, Policy(layers={"fc1": "bf16"}))
    before = trainer.model.fc1.weight.detach().clone()
    trainer.step()
    assert not torch.equal(before, trainer.model.fc1.weight) and trainer.finite
    assert torch.equal(before, workload.model.fc1.weight)  # the reference model is never trained
    broken = Trainer(workload, Policy(layers={"big": "fp16"}))  # overflows: inf logits, NaN loss
    broken.step()
    assert not broken.finite


def test_fp16_policy_steps_through_an_enabled_grad_scaler(workload):
    trainer = Trainer(workload, Policy(layers={"fc1": "fp16"}))
    assert trainer.scaler.is_enabled()
    trainer.step()
    assert trainer.steps == 1


def test_time_steps_reports_each_policy(workload):
    timings, finite = time_steps(workload, {"fp32": Policy(), "bf16": Policy(layers={"": "bf16"})}, FAST)
    assert set(timings) == {"fp32", "bf16"} and all(t.median_ms > 0 for t in timings.values())
    assert finite == {"fp32": True, "bf16": True}


def test_metric_is_the_users_evaluate_or_minus_mean_eval_loss(workload):
    model = workload.model
    assert evaluate_metric(workload, Policy()) == workload.task.evaluate(model)
    with torch.no_grad():
        expected = -sum(workload.task.loss_fn(model, b).item() for b in workload.eval) / len(workload.eval)
    assert default_evaluate(workload, model) == pytest.approx(expected, rel=1e-6)
