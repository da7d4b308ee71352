import math
from pathlib import Path

import pytest
import torch

from autoprec import Policy
from autoprec.tune import load_task, measure, prepare
from autoprec.tune.config import TimingConfig
from autoprec.tune.measure import (
    Timing,
    Trainer,
    default_evaluate,
    evaluate_metric,
    interleaved_times,
    measure_steps,
    probe_times,
    sqnr_db,
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
    timed = order[3:]  # after one sizing call each
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"] and timed[6:] == ["c", "a", "b"]


def test_warmup_counts_every_call_before_the_rounds_and_the_last_one_sizes_the_blocks():
    calls = {"a": 0}
    work = {"a": lambda: calls.__setitem__("a", calls["a"] + 1)}
    interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=3, rounds=2, min_block_s=0.0))
    assert calls["a"] == 3 + 2  # three warm-up calls (no extra sizing call), one step per round
    calls["a"] = 0
    interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=3, rounds=2, min_block_s=0.0), warmed={"a"})
    assert calls["a"] == 1 + 2  # warmed up before: one call to size the blocks


def test_a_sequential_test_stops_the_rounds_once_enough_but_never_before_min_rounds():
    from autoprec.tune.config import MIN_ROUNDS

    work = {"a": lambda: None, "b": lambda: None}
    config = TimingConfig(warmup=0, rounds=9, min_block_s=0.0)
    asked = []

    def enough(samples):
        asked.append(len(samples["a"]))
        return len(samples["a"]) >= 4

    times = interleaved_times(work, torch.device("cpu"), config, enough=enough)
    assert asked == [MIN_ROUNDS, 4] and all(len(t.samples_ms) == 4 for t in times.values())
    never = interleaved_times(work, torch.device("cpu"), config, enough=lambda s: False)
    assert all(len(t.samples_ms) == 9 for t in never.values())


def test_more_rounds_are_pooled_with_the_first_on_the_same_warm_callables_and_keep_the_rotation():
    order = []
    work = {name: (lambda n=name: order.append(n)) for name in "ab"}
    asked = []

    def more(samples):
        asked.append({n: len(v) for n, v in samples.items()})
        return 3

    times = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=2, rounds=3, min_block_s=0.0), more=more)
    assert asked == [{"a": 3, "b": 3}]  # asked once, after the rounds
    assert all(len(t.samples_ms) == 6 for t in times.values())  # the extra rounds pooled with the first three
    assert order[4:] == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]  # no warm-up again; round 4 rotates on
    assert interleaved_times({}, torch.device("cpu"), TimingConfig(warmup=0, rounds=2), more=more) == {}
    none = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=0, rounds=2, min_block_s=0.0), more=lambda s: 0)
    assert all(len(t.samples_ms) == 2 for t in none.values())


def test_more_rounds_only_when_a_spread_is_too_wide_to_rank(caplog):
    from autoprec.tune.config import NOISY_SPREAD
    from autoprec.tune.measure import more_if_noisy, noisiest

    calm = {"a": [10.0, 10.2, 9.9, 10.1, 10.0], "b": [20.0, 20.5, 19.8, 20.1, 20.0]}
    loud = dict(calm, b=[20.0, 35.0, 12.0, 28.0, 20.0])
    assert noisiest(calm) < NOISY_SPREAD < noisiest(loud) and noisiest({}) == 0.0
    with caplog.at_level("WARNING", logger="autoprec"):
        assert more_if_noisy(11)(calm) == 0 and not caplog.records
        assert more_if_noisy(11)(loud) == 11
    assert "timing 11 rounds more" in caplog.records[0].message


def test_a_sequential_test_may_stop_the_extra_rounds_too():
    work = {"a": lambda: None}
    asked = []

    def enough(samples):
        asked.append(len(samples["a"]))
        return len(samples["a"]) >= 6

    times = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=0, rounds=4, min_block_s=0.0),
                              enough=lambda s: enough(s) and len(s["a"]) > 4, more=lambda s: 10)  # fmt: skip
    assert len(times["a"].samples_ms) == 6 and asked == [3, 5, 6]  # not asked at the first pass's last round


def test_the_final_remeasure_is_settled_once_every_candidates_rounds_agree_and_not_before_five():
    from autoprec.tune.config import SETTLED_FINAL_ROUNDS
    from autoprec.tune.measure import all_settled

    tight = [10.0, 10.1, 9.9, 10.05, 10.0]
    assert all_settled({"a": tight, "b": [20.0, 20.1, 19.9, 20.0, 20.2]})
    assert not all_settled({"a": tight[: SETTLED_FINAL_ROUNDS - 1], "b": tight[: SETTLED_FINAL_ROUNDS - 1]})
    assert not all_settled({"a": tight, "b": [20.0, 26.0, 19.0, 22.0, 20.5]})  # one candidate still noisy


def test_timing_median_and_spread():
    t = Timing.from_samples([1.0, 2.0, 4.0])
    assert t.median_ms == 2.0 and t.spread == pytest.approx(1.5)  # few samples: the full range
    t = Timing.from_samples([10.0, 10.0, 11.0, 12.0, 100.0])  # one stalled round barely moves it
    assert t.median_ms == 11.0 and t.spread == pytest.approx(2.0 / 11.0)


class ScriptedClock:
    """Each call takes the next of `seconds`."""

    def __init__(self, seconds):
        self.seconds = iter(seconds)

    def time(self, work, calls, device):
        for _ in range(calls):
            work()
        return sum(next(self.seconds) for _ in range(calls))


def test_probe_times_takes_the_fastest_call(monkeypatch):
    monkeypatch.setattr(measure, "CLOCK", ScriptedClock([0.06, 0.002, 0.06]))  # a slow, a fast and a slow call
    calls = []
    probe = probe_times({"x": lambda: calls.append(1)}, torch.device("cpu"), warmup=2, repeats=3)
    assert len(calls) == 5 and probe["x"] == pytest.approx(2.0)  # the 2 ms call, not the median (60) or the mean (41)


def test_the_device_clock_runs_the_work_and_reads_the_wall_time_it_took():
    import time

    calls = []
    seconds = measure.DeviceClock().time(lambda: calls.append(time.sleep(0.01)), 3, torch.device("cpu"))
    assert len(calls) == 3 and seconds >= 0.03  # a lower bound only: a busy machine takes longer, never shorter


def test_every_step_time_is_read_through_the_clock(monkeypatch):
    # interleaved_times: the sizing call, then a block per round, each priced by the clock and per step
    monkeypatch.setattr(measure, "CLOCK", ScriptedClock([0.001] + [0.004, 0.002, 0.003]))
    t = interleaved_times({"x": lambda: None}, torch.device("cpu"), TimingConfig(warmup=1, rounds=3, min_block_s=0.0))
    assert t["x"].samples_ms == pytest.approx((4.0, 2.0, 3.0)) and t["x"].median_ms == pytest.approx(3.0)


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


def test_measure_steps_reports_each_policy(workload):
    stats = measure_steps(workload, {"fp32": Policy(), "bf16": Policy(layers={"": "bf16"})}, FAST)
    assert set(stats) == {"fp32", "bf16"} and all(s.timing.median_ms > 0 for s in stats.values())
    assert {n: s.finite for n, s in stats.items()} == {"fp32": True, "bf16": True}
    assert all(s.compile_s is None for s in stats.values())  # eager: nothing compiled


@pytest.mark.slow
def test_compiled_measurement_compiles_every_candidate_even_past_dynamos_recompile_limit(workload):
    """Eleven policies of one model class: with torch.compile's default limit of 8 variants per code object the
    last ones would run eagerly; each must run as a compiled graph of its own."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    names = [n for n, m in workload.model.named_modules() if isinstance(m, torch.nn.Linear)]
    policies = {"fp32": Policy()}
    for i in range(1, 11):  # ten distinct policies: layer b's format is base-3 digit b of i
        policies[f"p{i}"] = Policy(layers={n: ("fp32", "bf16", "fp16")[i // 3**b % 3] for b, n in enumerate(names)})
    assert len({str(p.layers) for p in policies.values()}) == 11
    counters.clear()
    stats = measure_steps(workload, policies, TimingConfig(warmup=1, rounds=1, min_block_s=0.0), compiled=True)
    assert counters["stats"]["unique_graphs"] >= 11  # one forward graph per candidate, none run eagerly
    assert all(s.compile_s is not None and s.compile_s > 0 for s in stats.values())
    assert torch._dynamo.config.recompile_limit == 8  # the raised limit was scoped to the measurement


def test_a_compiled_policy_trains_without_recompiling_after_its_first_step(workload):
    import torch._dynamo

    trainer = Trainer(workload, Policy(layers={"": "bf16", "big": "fp32"}), compiled=True)
    trainer.step()
    with torch._dynamo.config.patch(error_on_recompile=True):  # any recompile from here on raises
        for _ in range(2 * len(workload.train)):
            trainer.step()
    assert trainer.finite and trainer.first_step_s > 0


def test_metric_is_the_users_evaluate_or_minus_mean_eval_loss(workload):
    model = workload.model
    assert evaluate_metric(workload, Policy()) == workload.task.evaluate(model)
    with torch.no_grad():
        expected = -sum(workload.task.loss_fn(model, b).item() for b in workload.eval) / len(workload.eval)
    assert default_evaluate(workload, model) == pytest.approx(expected, rel=1e-6)


# ---- skipped steps, train mode and the noise floor ------------------------------------------------

from autoprec import LossScale  # noqa: E402
from autoprec.tune.measure import batch_order, noise_floor, train_and_evaluate  # noqa: E402


@pytest.fixture(scope="module")
def underflow():
    return prepare(load_task(MODELS / "underflow_mlp.py"), "cpu")


def test_batch_order_keeps_the_given_order_for_seed_0_and_reshuffles_otherwise():
    assert batch_order(3, 7) == (0, 1, 2, 0, 1, 2, 0)
    shuffled = batch_order(4, 8, seed=1)
    assert sorted(shuffled[:4]) == [0, 1, 2, 3] and sorted(shuffled[4:]) == [0, 1, 2, 3]
    assert shuffled != batch_order(4, 8) and shuffled == batch_order(4, 8, seed=1)


def test_a_too_high_loss_scale_skips_steps_and_costs_throughput(workload):
    # head's gradients overflow fp16 above a scale of about 2^17: from 2^30 the scaler backs off step by
    # step, and those steps update nothing
    policy = Policy(layers={"head": "fp16"}, loss_scale=LossScale(init_scale=2.0**30))
    trainer = Trainer(workload, policy)
    before = trainer.model.head.weight.detach().clone()
    trainer.step()
    assert trainer.skipped == 1 and torch.equal(before, trainer.model.head.weight)
    for _ in range(15):
        trainer.step()
    assert 8 <= trainer.skipped <= 15 and trainer.finite
    near = Policy(layers={"head": "fp16"}, loss_scale=LossScale(init_scale=2.0**19))
    stats = measure_steps(workload, {"high": policy, "near": near, "fp32": Policy()}, FAST)
    # the first step that builds the candidate, 1 warm-up (which sizes the blocks) and 3 rounds of 1 step: none
    # updated the weights
    assert stats["high"].skipped == stats["high"].steps == 5 and stats["high"].effective_ms == math.inf
    assert 0 < stats["near"].skipped < stats["near"].steps and stats["fp32"].skipped == 0
    assert stats["near"].effective_ms == pytest.approx(stats["near"].timing.median_ms / (1 - stats["near"].skip_fraction))
    assert stats["fp32"].effective_ms == stats["fp32"].timing.median_ms


def test_without_fp16_nothing_is_skipped(workload):
    trainer = Trainer(workload, Policy(layers={"": "bf16"}))
    for _ in range(3):
        trainer.step()
    assert not trainer.scaler.is_enabled() and trainer.skipped == 0


def test_train_and_evaluate_is_repeatable_and_leaves_the_callers_rng_alone(underflow):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = train_and_evaluate(underflow, Policy(), 5)
    assert torch.equal(torch.rand(1), expected_next)
    b = train_and_evaluate(underflow, Policy(), 5)
    assert a == b and a.finite and a.steps == 5 and a.skipped == 0
    assert a.metric > underflow.task.evaluate(underflow.model)  # training from untrained weights helps


def test_fp16_without_loss_scaling_stops_learning_with_tiny_gradients(underflow):
    fp32 = train_and_evaluate(underflow, Policy(), 15).metric
    start = underflow.task.evaluate(underflow.model)

    def fp16(log2_scale: int) -> float:
        ls = LossScale(init_scale=2.0**log2_scale, dynamic=False)
        return train_and_evaluate(underflow, Policy(layers={"": "fp16"}, loss_scale=ls), 15).metric

    assert fp32 - start > 0.3
    assert abs(fp16(0) - start) < 0.02  # every gradient flushed to zero: the weights barely move
    assert abs(fp16(20) - fp32) < 0.02  # the profile's recommended range: trains as fp32 does


def test_noise_floor_spans_seeds(underflow):
    noise = noise_floor(underflow, 10, runs=3)
    assert len(noise.metrics) == 3 and noise.reference == noise.metrics[0]
    assert noise.repeat == noise.reference  # the CPU is deterministic
    assert noise.spread == max(noise.metrics) - min(noise.metrics) >= 0
    assert noise.to_dict()["train_steps"] == 10
    with pytest.raises(ValueError, match="noise runs must be >= 1"):
        noise_floor(underflow, 10, runs=0)


def test_a_candidate_whose_step_fails_is_reported_and_the_others_are_timed(workload):
    from autoprec.tune.measure import measure_steps_or_fail

    stats, failed = measure_steps_or_fail(workload, {"fp32": Policy(), "bad": Policy(layers={"fc1": "mxfp8"})}, FAST)
    assert set(stats) == {"fp32"} and set(failed) == {"bad"}
    assert failed["bad"].startswith("ValueError: layer 'fc1' cannot be mxfp8 here")


def test_matmul_precision_sets_strict_or_tf32_on_cuda_and_restores_the_callers_settings(no_gpu_contract):
    from autoprec.tune.measure import matmul_precision

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        with matmul_precision(torch.device("cuda"), tf32=False):  # settable without a GPU
            assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        with matmul_precision(torch.device("cpu"), tf32=False):  # no TF32 on a CPU: nothing changes
            assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_matmul_precision_set_through_torchs_new_api_is_saved_set_and_restored_through_it(no_gpu_contract):
    """A model.py that sets `torch.backends.cuda.matmul.fp32_precision = "tf32"` (torch's API since 2.9): torch's
    legacy getter then raises, and every CUDA step used to fail on it."""
    from autoprec.tune.measure import float32_matmul_precision, matmul_precision

    legacy = torch.get_float32_matmul_precision()
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        matmul.fp32_precision = conv.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()  # what the CUDA path read before
        assert float32_matmul_precision() == "high"
        with matmul_precision(torch.device("cuda"), tf32=False):  # settable without a GPU
            assert matmul.fp32_precision == "ieee" and conv.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32" and conv.fp32_precision == "tf32"
        with matmul_precision(torch.device("cuda"), tf32=True):
            assert matmul.fp32_precision == "tf32"
        assert float32_matmul_precision() == "high"
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
        torch.set_float32_matmul_precision(legacy)  # the legacy API's view again, for the rest of the session


def test_evaluate_may_return_numpy_scalars_and_one_element_arrays(workload):
    import numpy as np

    from autoprec.tune.measure import _as_metric

    assert _as_metric(workload, np.float32(0.5)) == 0.5 and _as_metric(workload, np.int64(3)) == 3.0
    assert _as_metric(workload, np.array([0.25])) == 0.25 and _as_metric(workload, torch.tensor(0.75)) == 0.75


def test_a_compiled_candidate_steps_on_every_batch_shape_before_its_timing(monkeypatch, write_model, mlp_source):
    """Batches of 8, 8 and 5 rows: under torch.compile the 5-row batch compiles a graph of its own, which inside a
    timed round would be counted as step time; it is taken in the warm-up and counted as compile time."""
    from autoprec.tune import load_task, measure, prepare
    from autoprec.tune.measure import Trainer, measure_steps_or_fail

    source = mlp_source + (
        "\ndef batches(split):\n    g = torch.Generator().manual_seed(0)\n"
        "    return [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in (8, 8, 5)]\n"
    )
    workload = prepare(load_task(write_model(source)), "cpu")
    assert workload.shape_batches == (0, 2)
    monkeypatch.setattr(measure, "compile_model", lambda model: model)  # compiled in name: what is stepped is the point
    seen = []
    real_time = measure.CLOCK.time

    def time(work, calls, device):
        seen.append(set(work._stepped))  # the batches each candidate had stepped on when a timing began
        return real_time(work, calls, device)

    monkeypatch.setattr(measure.CLOCK, "time", time)
    stats, failed = measure_steps_or_fail(workload, {"fp32": Policy()}, FAST, compiled=True, peak_memory=False)
    assert not failed and seen and all(2 in stepped for stepped in seen)
    assert stats["fp32"].compile_s is not None and stats["fp32"].compile_s > 0
    eager = Trainer(workload, Policy())
    eager.step()
    eager.warm_shapes()
    assert eager._stepped == {0, 2} and eager.steps == 2


def test_every_callable_takes_the_same_steps_in_every_round_sized_by_the_slowest(monkeypatch):
    """A time budget's re-measure timed fp16 on 9 steps beside fp32's 254 and wrote it 22x faster (issue 37, 5): block
    sizes came from each candidate's own warm-up. One block size now, from the slowest."""
    from autoprec.tune import measure
    from autoprec.tune.config import TimingConfig
    from autoprec.tune.measure import interleaved_times

    seconds = {"fast": 0.001, "slow": 0.02}
    calls: dict[str, list[int]] = {"fast": [], "slow": []}

    class Clock:
        def time(self, work, n, device):
            calls[work.name].append(n)
            return seconds[work.name] * n

    class Work:
        def __init__(self, name):
            self.name = name

        def __call__(self):
            return None

    monkeypatch.setattr(measure, "CLOCK", Clock())
    config = TimingConfig(warmup=1, rounds=4, min_block_s=0.05, max_steps_per_block=50)
    interleaved_times({n: Work(n) for n in seconds}, torch.device("cpu"), config)
    assert calls["fast"][1:] == calls["slow"][1:] == [3] * 4  # ceil(0.05 / 0.02): the fast one's 50 no longer


def test_a_compiled_search_trial_steps_on_every_batch_shape_before_its_timing(monkeypatch, write_model, mlp_source, tmp_path):
    """The trials empty the compile caches for each candidate: the ragged batch compiled inside a timed round."""
    from autoprec.tune import SearchConfig, load_task, measure, prepare
    from autoprec.tune.searcher import search
    from autoprec.tune.space import space_from_dict

    source = mlp_source + (
        "\ndef batches(split):\n    g = torch.Generator().manual_seed(0)\n"
        "    return [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in (8, 8, 5)]\n"
    )
    workload = prepare(load_task(write_model(source)), "cpu")
    monkeypatch.setattr(measure, "compile_model", lambda model: model)  # compiled in name: what is stepped is the point
    seen = []
    real_time = measure.CLOCK.time

    def time(work, calls, device):
        seen.append(set(getattr(work, "_stepped", {0, 2})))
        return real_time(work, calls, device)

    monkeypatch.setattr(measure.CLOCK, "time", time)
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}, "trials": 3})
    search(workload, space, SearchConfig(budget=1.0, compile=True, timing=FAST, final_timing=FAST, progress=False,
                                         predict_speed=False), tmp_path)  # fmt: skip
    assert seen and all(2 in stepped for stepped in seen)
