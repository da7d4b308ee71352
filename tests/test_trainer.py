"""One candidate's training steps: the Trainer, its GradScaler, compiled steps and their timing (autoprec/tune/_measure/_trainer.py)."""

import math
from pathlib import Path

import pytest
import torch

from autoprec import LossScale, Policy
from autoprec.tune import load_task, prepare
from autoprec.tune._core._config import TimingConfig
from autoprec.tune._measure._trainer import Trainer, measure_steps

MODELS = Path(__file__).parent / "models"
FAST = TimingConfig(warmup=1, rounds=3, min_block_s=0.0, warmup_s=0.0, min_steps=1)


@pytest.fixture(scope="module")
def workload():
    return prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")


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
    stats = measure_steps(
        workload, policies, TimingConfig(warmup=1, rounds=1, min_block_s=0.0, warmup_s=0.0, min_steps=1), compiled=True
    )
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


def test_the_retire_rule_judges_effective_step_times_so_a_candidate_whose_steps_are_all_skipped_is_infinitely_slow(workload):
    """A step the GradScaler skips updates nothing: a candidate skipping every step is no bar for the others, however
    fast its raw steps, and is itself out of the running (its effective step time is infinite)."""
    from autoprec.tune._measure._trainer import measure_steps_or_fail

    high = Policy(layers={"head": "fp16"}, loss_scale=LossScale(init_scale=2.0**30))  # every step skipped
    seen = []

    def retire(samples):
        seen.append({name: list(v) for name, v in samples.items()})
        return set()

    measure_steps_or_fail(workload, {"high": high, "fp32": Policy()}, FAST, retire=retire, peak_memory=False)
    assert seen and all(set(s) == {"high", "fp32"} for s in seen)
    assert all(math.isinf(x) for s in seen for x in s["high"]) and all(math.isfinite(x) for s in seen for x in s["fp32"])


def test_without_fp16_nothing_is_skipped(workload):
    trainer = Trainer(workload, Policy(layers={"": "bf16"}))
    for _ in range(3):
        trainer.step()
    assert not trainer.scaler.is_enabled() and trainer.skipped == 0


def test_a_candidate_whose_step_fails_is_reported_and_the_others_are_timed(workload):
    from autoprec.tune._measure._trainer import measure_steps_or_fail

    # head is Linear(64, 4): mxfp8's dgrad needs out_features in blocks of 32
    stats, failed = measure_steps_or_fail(workload, {"fp32": Policy(), "bad": Policy(layers={"head": "mxfp8"})}, FAST)
    assert set(stats) == {"fp32"} and set(failed) == {"bad"}
    assert failed["bad"].startswith("ValueError: layer 'head' cannot be mxfp8 here")


def test_matmul_precision_sets_strict_or_tf32_on_cuda_and_restores_the_callers_settings(no_gpu_contract):
    from autoprec.tune._measure._trainer import matmul_precision

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
    from autoprec.devices import float32_matmul_precision
    from autoprec.tune._measure._trainer import matmul_precision

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


def test_a_compiled_candidate_steps_on_every_batch_shape_before_its_timing(monkeypatch, write_model, mlp_source):
    """Batches of 8, 8 and 5 rows: under torch.compile the 5-row batch compiles a graph of its own, which inside a
    timed round would be counted as step time; it is taken in the warm-up and counted as compile time."""
    from autoprec.tune import load_task, prepare
    from autoprec.tune._measure import _timing as timing
    from autoprec.tune._measure._trainer import Trainer, measure_steps_or_fail

    source = mlp_source + (
        "\ndef batches(split):\n    g = torch.Generator().manual_seed(0)\n"
        "    return [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in (8, 8, 5)]\n"
    )
    workload = prepare(load_task(write_model(source)), "cpu")
    assert workload.shape_batches == (0, 2)
    monkeypatch.setattr(
        "autoprec.tune._measure._trainer.compile_model", lambda model, mode=None: model
    )  # compiled in name: what is stepped is the point
    seen = []
    real_time = timing.CLOCK.time

    def time(work, calls, device):
        seen.append(set(work._stepped))  # the batches each candidate had stepped on when a timing began
        return real_time(work, calls, device)

    monkeypatch.setattr(timing.CLOCK, "time", time)
    stats, failed = measure_steps_or_fail(workload, {"fp32": Policy()}, FAST, compiled=True, peak_memory=False)
    assert not failed and seen and all(2 in stepped for stepped in seen)
    assert stats["fp32"].compile_s is not None and stats["fp32"].compile_s > 0
    eager = Trainer(workload, Policy())
    eager.step()
    eager.warm_shapes()
    assert eager._stepped == {0, 2} and eager.steps == 2


def test_a_cuda_graphs_candidate_is_compiled_with_reduce_overhead_and_only_compiled(monkeypatch, write_model, mlp_source):
    from autoprec.tune._core._records import Candidate
    from autoprec.tune._measure._trainer import Trainer

    workload = prepare(load_task(write_model(mlp_source)), "cpu")
    modes = []
    monkeypatch.setattr("autoprec.tune._measure._trainer.compile_model", lambda model, mode=None: modes.append(mode) or model)
    Trainer(workload, Candidate(Policy(layers={"": "bf16"}), cuda_graphs=True), compiled=True)
    Trainer(workload, Candidate(Policy(layers={"": "bf16"})), compiled=True)
    assert modes == ["reduce-overhead", None]
    with pytest.raises(ValueError, match="CUDA-graphs candidate is a compiled one"):
        Trainer(workload, Candidate(Policy(layers={"": "bf16"}), cuda_graphs=True))


@pytest.mark.slow
def test_a_compiled_search_trial_steps_on_every_batch_shape_before_its_timing(monkeypatch, write_model, mlp_source, tmp_path):
    """The trials empty the compile caches for each candidate: the ragged batch compiled inside a timed round."""
    from autoprec.tune import SearchConfig, load_task, prepare
    from autoprec.tune._core._space import space_from_dict
    from autoprec.tune._measure import _timing as timing
    from autoprec.tune._search._pipeline import search

    source = mlp_source + (
        "\ndef batches(split):\n    g = torch.Generator().manual_seed(0)\n"
        "    return [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in (8, 8, 5)]\n"
    )
    workload = prepare(load_task(write_model(source)), "cpu")
    monkeypatch.setattr(
        "autoprec.tune._measure._trainer.compile_model", lambda model, mode=None: model
    )  # compiled in name: what is stepped is the point
    seen = []
    real_time = timing.CLOCK.time

    def time(work, calls, device):
        seen.append(set(getattr(work, "_stepped", {0, 2})))
        return real_time(work, calls, device)

    monkeypatch.setattr(timing.CLOCK, "time", time)
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}, "trials": 3})
    search(workload, space, SearchConfig(budget=1.0, compile=True, timing=FAST, final_timing=FAST, progress=False,
                                         predict_speed=False), tmp_path)  # fmt: skip
    assert seen and all(2 in stepped for stepped in seen)


def test_a_sharded_policy_gathering_fp8_weights_has_their_scales_precomputed_after_each_step(one_rank):
    """Under FSDP2 (a mesh of one), a candidate whose policy all-gathers fp8 weights trains as a user's loop does:
    torchao's fp8 weight subclass, and every fp8 weight's scale precomputed after the optimizer's step."""
    import dataclasses
    import types

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    mesh = init_device_mesh("cpu", (1,))

    def shard(model):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    workload = prepare(load_task(MODELS / "sharded_decoder.py"), "cpu")
    workload = dataclasses.replace(workload, sharding=types.SimpleNamespace(shard=shard))
    layers = {"": "bf16", "blocks.0.up": "fp8", "blocks.0.down": "fp8-rowwise"}
    for gather in (False, True):
        trainer = Trainer(workload, Policy(layers=layers, fsdp_fp8_all_gather=gather))
        trainer.step()
        up, down = (trainer.model.blocks[0].up.weight._local_tensor, trainer.model.blocks[0].down.weight._local_tensor)
        assert isinstance(up, WeightWithDynamicFloat8CastTensor) is gather and type(down) is torch.Tensor
        if gather:  # the scale of the weights the step just updated: max|w| over them, to e4m3's range
            amax = trainer.model.blocks[0].up.weight.full_tensor().abs().max()
            torch.testing.assert_close(up._precomputed_scale, torch.finfo(torch.float8_e4m3fn).max / amax.double().float())
        assert math.isfinite(trainer.step().item())
