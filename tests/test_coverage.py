"""autoprec/tune/_measure/_coverage.py: the tuned layers' share of a step's matmul FLOPs and of the parameters, and what
runs outside them (a Mixtral-style MoE's fused experts, which are no nn.Linear)."""

from __future__ import annotations

import logging

import pytest
import torch
from builders import small_task, tiny_mixtral

from autoprec import Policy
from autoprec.tune import load_task, prepare
from autoprec.tune._core._records import Measured
from autoprec.tune._core._space import load_space
from autoprec.tune._measure._coverage import Coverage, coverage, grouped_mm_flops, matmul_flop_registry, run_op

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS, TOKENS = 32, 64, 4, 2, 2, 4 * 16


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    pytest.importorskip("transformers", minversion="5.0")  # fused experts (no nn.Linear) from transformers 5
    path = tmp_path_factory.mktemp("mixtral") / "model.py"
    path.write_text(tiny_mixtral(HIDDEN, INTER, LAYERS, EXPERTS, TOP_K), encoding="utf-8")
    return prepare(load_task(path), "cpu")


def test_a_mixtral_moes_experts_are_counted_outside_the_tuned_linears(mixtral):
    """Issue 60, 5: the experts hold most of the parameters and the matmul work, as fused 3-D weights run by grouped
    matmuls, and a search reported "all 9 linears". Checked against the FLOPs written out by hand."""
    cover = coverage(mixtral, load_space())
    linear = 2 * TOKENS * (HIDDEN * HIDDEN * 2 + HIDDEN * HIDDEN // 2 * 2)  # q and o (32x32), k and v (32x16): per layer
    experts = 2 * TOKENS * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)  # each token's experts: gate_up, then down
    router = 2 * TOKENS * HIDDEN * EXPERTS
    head = 2 * TOKENS * HIDDEN * 128
    # attention's two matmuls (QK^T, then AV, over sequences of 16), where torch counts the CPU's flash attention:
    # torch 2.15 added its formula (earlier torch counted the GPU's kernels only)
    cpu_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    attention = 2 * (2 * TOKENS * 16 * HIDDEN) if cpu_attention in matmul_flop_registry() else 0
    total = LAYERS * (linear + experts + router + attention) + head
    assert cover.tuned_layers == 4 * LAYERS + 1  # q, k, v, o per layer and lm_head
    assert cover.flops_share == pytest.approx((LAYERS * linear + head) / total, rel=1e-6)
    [moe, gate] = cover.outside
    assert (moe.type, moe.modules) == ("MixtralExperts", LAYERS)
    assert moe.flops_share == pytest.approx(LAYERS * experts / total, rel=1e-6)
    assert moe.params_share > 0.5 and gate.type == "MixtralTopKRouter"
    assert cover.worth_saying
    text = cover.sentence()
    assert "the 9 layers the search tunes do" in text and f"2 MixtralExperts ({moe.flops_share:.0%} of the FLOPs" in text


def test_a_model_of_linears_alone_is_all_tuned_and_nothing_is_said(write_model, mlp_source):
    cover = coverage(prepare(load_task(write_model(mlp_source)), "cpu"), load_space())
    assert cover.flops_share == 1.0 and cover.params_share == pytest.approx(1.0) and cover.outside == ()
    assert not cover.worth_saying


@pytest.mark.parametrize(
    ("a", "b", "offsets", "out"),
    [((10, 8), (3, 8, 6), (4, 7, 10), (10, 6)), ((6, 10), (10, 5), (4, 7, 10), (3, 6, 5))],
    ids=["rows split (forward)", "contraction split (weight gradient)"],
)
def test_grouped_mm_flops_against_each_groups_own_matmul(a, b, offsets, out):
    """torch's flop_registry has no formula for torch._grouped_mm: the experts' work vanished from every count."""
    starts = (0, *offsets[:-1])
    if len(b) == 3:  # group g: rows starts[g]:offsets[g] of a times b[g]
        brute = sum(2 * (end - start) * a[1] * b[2] for start, end in zip(starts, offsets))
    else:  # group g: columns starts[g]:offsets[g] of a times rows of b
        brute = sum(2 * a[0] * (end - start) * b[1] for start, end in zip(starts, offsets))
    assert grouped_mm_flops(a, b, out_shape=out) == brute
    if hasattr(torch.ops.aten, "_grouped_mm"):
        assert torch.ops.aten._grouped_mm in matmul_flop_registry()


def test_the_coverage_round_trips_through_the_policy_file_and_show_says_it():
    from autoprec.tune._report._show import coverage_line, show_policy

    cover = Coverage(tuned_layers=9, flops_share=0.21, params_share=0.12, outside=(), elsewhere_share=0.0)
    measured = Measured(device="cpu", coverage=cover.to_dict())
    assert Coverage.from_dict(Measured.from_dict(measured.to_dict()).coverage) == cover
    policy = Policy(layers={"": "bf16"}, measured=measured.to_dict())
    assert coverage_line(Measured.of(policy)) in " ".join(show_policy(policy).split())
    assert Coverage.from_dict({"tuned_layers": "x"}) is None and Coverage.from_dict(None) is None


def test_the_search_says_it_at_its_start(mixtral, caplog):
    from autoprec.tune._search._pipeline import _coverage

    with caplog.at_level(logging.WARNING, logger="autoprec"):
        cover = _coverage(mixtral, load_space())
    assert cover is not None and "MixtralExperts" in caplog.text


def test_export_and_verify_say_what_the_search_left_outside_the_linears(tmp_path, capsys):
    """Issue 60, 5: export and verify said "all 9 linears" of a model whose experts do most of the work."""
    from autoprec.tune._cli import main

    cover = Coverage(tuned_layers=9, flops_share=0.21, params_share=0.12, outside=(), elsewhere_share=0.0)
    policy = tmp_path / "policy.json"
    Policy(layers={"": "bf16"}, measured={"coverage": cover.to_dict()}).save(policy)
    assert main(["export", str(policy), "--to", "torchao", "--out", str(tmp_path / "fp8.py")]) == 0
    assert "outside the search: the 9 layers the search tunes do 21% of the step's matmul FLOPs" in capsys.readouterr().out
    Policy(layers={"": "bf16"}).save(policy)  # nothing recorded: nothing said
    assert main(["export", str(policy), "--to", "torchao", "--out", str(tmp_path / "fp8.py")]) == 0
    assert "outside the search" not in capsys.readouterr().out


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_grouped_mm"), reason="torch without _grouped_mm")
def test_a_grouped_matmul_of_fp32_experts_runs_on_the_meta_device_as_on_the_cpu():
    """Issue 60, 6: torch._grouped_mm's meta kernel takes bf16 only, so predict failed on a Mixtral with "check your
    loss_fn". On the meta device it gives the CPU's shape and dtype; elsewhere (and for other ops) the op as called."""
    op = torch.ops.aten._grouped_mm.default
    offs = torch.tensor([4, 7, 10], dtype=torch.int32)
    a, b = torch.randn(10, 8, generator=torch.Generator().manual_seed(0)), torch.randn(3, 8, 16)
    on_cpu = run_op(op, (a, b), {"offs": offs})
    try:  # torch 2.13 and 2.14 refuse fp32 there ("BF16", "BFloat16"); 2.15's meta kernel takes it
        op(a.to("meta"), b.to("meta"), offs=offs.to("meta"))
    except RuntimeError as exc:
        assert "BF16" in str(exc) or "BFloat16" in str(exc), exc
    on_meta = run_op(op, (a.to("meta"), b.to("meta")), {"offs": offs.to("meta")})
    assert (on_meta.shape, on_meta.dtype, on_meta.is_meta) == (on_cpu.shape, torch.float32, True)
    assert torch.equal(on_cpu, op(a, b, offs=offs))
    assert run_op(torch.ops.aten.mm.default, (a.to("meta"), b[0].to("meta")), {}).shape == (10, 16)


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_grouped_mm"), reason="torch without _grouped_mm")
def test_a_grouped_matmul_with_its_out_dtype_is_counted_on_the_meta_device_as_the_dispatcher_passes_it():
    """The dispatcher passes offs and out_dtype by position (a review found run_op read them as keywords only)."""
    from autoprec.tune._measure._coverage import count

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(3, 8, 16))

        def forward(self, x):
            offs = torch.tensor([4, 7, 10], dtype=torch.int32, device=x.device)
            return torch._grouped_mm(x, self.w, offs=offs, out_dtype=torch.float32)

    with torch.device("meta"):
        model, x = Experts(), torch.empty(10, 8)
    cover = count(model, lambda: model(x).sum(), [])
    assert [(o.type, o.flops_share) for o in cover.outside] == [("Experts", 1.0)]


def test_counting_leaves_the_models_buffers_and_the_random_generators_as_they_were(write_model):
    """A review found coverage() ran the loss in train mode on the search's reference model: a BatchNorm's running
    statistics moved and torch's generator advanced, so even fp32 showed a metric drop against the fp32 metric
    measured before it."""
    source = small_task(
        "class EMA(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.register_buffer('mean', torch.zeros(16))\n\n"
        "    def forward(self, x):\n        if self.training:\n"
        "            self.mean = 0.9 * self.mean + 0.1 * x.mean(0).detach()  # a new tensor, not an in-place update\n"
        "            self.calls = getattr(self, 'calls', 0) + 1  # a buffer of a new name each forward\n"
        "            self.register_buffer(f'seen{self.calls}', x.detach(), persistent=False)\n"
        "        return x - self.mean\n\n"
        "def build_model():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), EMA(), nn.Dropout(0.5), nn.Linear(16, 4))\n"
    )
    workload = prepare(load_task(write_model(source)), "cpu")
    model = workload.model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [(sorted(m._buffers), sorted(m._non_persistent_buffers_set)) for m in model.modules()]
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    cover = coverage(workload, load_space())
    assert cover.tuned_layers == 2 and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and set(model.state_dict()) == set(before)
    assert [(sorted(m._buffers), sorted(m._non_persistent_buffers_set)) for m in model.modules()] == names


def test_nothing_counted_is_nothing_to_say():
    assert not Coverage(tuned_layers=0, flops_share=0.0, params_share=0.0).worth_saying
