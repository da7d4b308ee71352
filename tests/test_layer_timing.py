"""A layer's own step time in each format (autoprec/tune/_measure/_layer_timing.py)."""

from pathlib import Path

import pytest
import timings
from short_timing import TINY

from autoprec.tune import ProfileConfig, load_task, prepare, profile
from autoprec.tune._core._space import space_from_dict

MODELS = Path(__file__).parent / "models"
HOST_S = 0.002  # issuing a lone layer's forward and backward: more than its kernels take, as on a GPU


def test_on_a_device_with_a_queue_the_profile_times_a_layers_kernels_not_its_launch_overhead():
    """The first GPU run's profile timed every isolated layer at 0.8-1.5 ms in every format (the host issuing it,
    the GPU waiting) and ruled fp8 out on that. On a device whose host takes longer to issue a layer's step than the
    device to run it, the profile's ratios follow the device's cost, so no format is ruled out on launch overhead."""
    clock = timings.FormatClock(timings.FASTER)  # prices a model by its formats: bf16 0.55 of fp32 here

    def price(work):
        return HOST_S, clock.seconds(getattr(work, "model", None)) / 100  # the device: 1 ms a layer in fp32

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}})
    with timings.queued_cpu(price):
        prof = profile(workload, space, ProfileConfig(batches=1, timing=TINY), progress=False)
    for layer in ("fc1", "big"):
        assert prof.row(layer, "bf16").time_vs_fp32 == pytest.approx(0.55)  # the device's ratio, not the host's 1.0
        assert prof.row(layer, "fp32").time_ms == pytest.approx(1.0)
        assert "slower" not in prof.row(layer, "bf16").metric_source


def test_a_layers_warm_up_on_a_device_with_a_queue_lasts_its_seconds_of_calls_not_of_the_devices_busy_time():
    """A layer's kernels take microseconds of the device where the host spends a millisecond issuing them: warm-up
    counted the device's time into warmup_s, so the profile's 0.2 s of warm-up ran 10,000 calls of one layer."""
    from autoprec import devices
    from autoprec.tune._measure._timing import Step, interleaved_times

    calls = []

    def price(work):
        calls.append(1)
        return 0.001, 0.00002  # host 1 ms, device 20 us

    config = ProfileConfig().timing
    with timings.queued_cpu(price):
        interleaved_times({"layer": Step(lambda: None, kernels=True)}, devices.torch.device("cpu"), config)
    warm_up = len(calls) - config.rounds  # the rest: one block a round, priced once each
    assert warm_up <= 2 * config.warmup_s / 0.001 + config.warmup + 8  # about 0.2 s of 1 ms calls, not 10,000


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "bf16", "fp32"])
def test_a_layer_step_runs_where_its_format_runs_in_a_model_fp8_and_block_scaled_in_a_bf16_region(fmt):
    """Each format's lone layer step is timed on the inputs it gets in a model: bf16 in a bf16 region, fp32 in fp32,
    and fp8/mxfp8 (no autocast dtype of their own) inside a bf16 region as torchao runs them. Timed on fp32 inputs
    (the H200 probe's profile did), their casts read and write twice the bytes bf16's do, biasing the ratio."""
    import warnings

    import torch

    from autoprec.formats import Format
    from autoprec.tune._measure._layer_timing import _layer_step

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp8 runs emulated on a CPU
        step = _layer_step(torch.nn.Linear(32, 32), ((torch.randn(16, 32),), {}), Format(fmt))
        seen = []
        step.model.layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
        step()
    assert seen == [torch.float32 if fmt == "fp32" else torch.bfloat16]
