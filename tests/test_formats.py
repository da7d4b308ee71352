"""The format registry: one entry per format, and what the other modules read from it."""

import pytest
import torch
from builders import LoRALinear, TaggedLinear
from torch import nn

from autoprec.formats import (
    REGISTRY,
    Format,
    Fp8Gemms,
    float8_linear_config,
    format_names,
    format_problem,
    fp8_formats,
    fp8_shape_problem,
    has_fp8_kernels,
    parse_format,
    risky_formats,
)
from autoprec.tune._measure._choices import fit


def test_every_format_has_exactly_one_registry_entry_keyed_by_itself():
    assert set(REGISTRY) == set(Format)
    assert all(spec.format is fmt for fmt, spec in REGISTRY.items())
    assert format_names() == (
        "fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "fp8-rowwise-gw-hp",
        "fp8-fwd", "fp8-fwd-dgrad", "fp8-rowwise-fwd", "fp8-rowwise-fwd-dgrad",
        "mxfp8", "mxfp8-fwd", "mxfp8-fwd-dgrad", "nvfp4", "nvfp4-fwd", "nvfp4-fwd-dgrad", "mxfp8-fwd-nvfp4-dgrad",
    )  # fmt: skip


def test_every_built_in_format_is_a_class_attribute_named_after_it():
    for fmt in Format:
        assert getattr(Format, fmt.value.upper().replace("-", "_")) is fmt


def test_fallbacks_end_at_fp32_without_cycles():
    for fmt in Format:
        seen, current = [], fmt
        while current is not None:
            assert current not in seen, f"fallback cycle through {seen}"
            seen.append(current)
            current = current.spec.fallback
        assert seen[-1] is Format.FP32


@pytest.mark.parametrize(
    ("fmt", "options", "expected"),
    [("fp8-rowwise", ("fp32", "bf16"), "bf16"), ("fp16", ("fp32",), "fp32"), ("fp8", ("fp32", "fp8"), "fp8")],
)
def test_a_layout_falls_back_along_the_registry(fmt, options, expected):
    assert fit(fmt, options) == expected


def test_only_fp16_needs_a_loss_scale_and_the_low_formats_count_as_risky():
    assert [f for f in Format if f.spec.loss_scale] == [Format.FP16]
    blockscaled = {f for f in Format if f.family.name == "blockscaled"}
    assert Format.MXFP8 in blockscaled and len(blockscaled) == 7
    assert set(risky_formats()) == {Format.FP16, *fp8_formats(), *blockscaled}
    # mxfp8 is the blockscaled family's emulation, not torchao's float8
    assert set(fp8_formats()) == {
        Format.FP8, Format.FP8_ROWWISE, Format.FP8_ROWWISE_GW_HP,
        Format.FP8_FWD, Format.FP8_FWD_DGRAD, Format.FP8_ROWWISE_FWD, Format.FP8_ROWWISE_FWD_DGRAD,
    }  # fmt: skip


def test_fp8_recipes_name_torchao_recipes_that_exist_and_every_per_gemm_mix_is_a_config_torchao_accepts():
    from torchao.float8 import Float8LinearConfig, ScalingType

    for fmt in fp8_formats():
        gemms = fmt.family.fp8_gemms(fmt)
        if gemms is None:
            continue
        if gemms.recipe is not None:
            Float8LinearConfig.from_recipe_name(gemms.recipe)  # raises for an unknown name
        config = float8_linear_config(gemms.to_json())  # torchao checks both operands of a GEMM agree
        fp8 = {"fprop": config.cast_config_input, "dgrad": config.cast_config_grad_output,
               "wgrad": config.cast_config_input_for_grad_weight}  # fmt: skip
        assert {g for g, c in fp8.items() if c.scaling_type is ScalingType.DISABLED} == set(gemms.high_precision), fmt


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_per_gemm_builder_gives_torchaos_own_recipe_where_every_gemm_is_fp8(recipe):
    """One function builds every config: with all three GEMMs in fp8 it must be torchao's recipe of that scaling, so
    the per-GEMM mixes differ from the whole-layer formats only in the GEMMs they keep in high precision."""
    from torchao.float8 import Float8LinearConfig

    assert float8_linear_config(Fp8Gemms(recipe).to_json()) == Float8LinearConfig.from_recipe_name(recipe)


def test_each_per_gemm_mix_keeps_fp8s_safety_settings():
    for fmt in (Format.FP8_FWD, Format.FP8_FWD_DGRAD, Format.FP8_ROWWISE_FWD, Format.FP8_ROWWISE_FWD_DGRAD):
        spec = fmt.spec
        assert spec.risky and spec.linear_only and spec.fallback is Format.BF16 and not spec.loss_scale
        family, gemms = fmt.family, fmt.family.fp8_gemms(fmt)
        tensorwise_grad = gemms.scaling == "tensorwise" and gemms.dgrad  # the gradient is cast per tensor
        assert (family.tensorwise_grad_dtype(fmt) is not None) == tensorwise_grad, fmt
        assert family.fsdp_fp8_all_gather(fmt) == (gemms.scaling == "tensorwise" and gemms.dgrad), fmt  # hp dgrad reads it
        assert "divisible by 16" in format_problem(fmt, nn.Linear(16, 4), "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusals")
def test_on_a_cpu_every_fp8_and_mx_format_runs_emulated(no_gpu_contract):
    # apply_policy casts their inputs, so torchao's emulation runs each fp8 recipe; mxfp8 and nvfp4 are emulated by
    # the blockscaled family everywhere (they were refused, "needs CUDA compute capability 10.0+", before it)
    for fmt in (*fp8_formats(), *(f for f in Format if f.family.name == "blockscaled")):
        assert format_problem(fmt, nn.Linear(32, 32), "cpu") is None, fmt


def test_a_linear_only_format_names_itself_when_the_module_cannot_take_it():
    assert format_problem(Format.FP8_ROWWISE, nn.Conv1d(16, 16, 3), "cpu") == "fp8-rowwise covers nn.Linear only, not Conv1d"
    assert "divisible by 16" in format_problem(Format.FP8, nn.Linear(16, 4), "cpu")
    assert format_problem(Format.BF16, nn.Conv1d(16, 16, 3), "cpu") is None


def test_fp8_takes_a_linear_subclass_only_where_torchaos_plain_float8linear_would_lose_nothing_of_it():
    # torchao's Float8Linear keeps a Linear's weight and bias only: a subclass's own forward and state would vanish
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    masked = TaggedLinear(32, 32)
    masked.register_buffer("mask", torch.ones(32))
    gated = TaggedLinear(32, 32)
    gated.gate = nn.Linear(32, 32)
    for fmt in fp8_formats():
        problem = fp8_shape_problem(LoRALinear(32, 32), fmt)
        assert problem == (
            f"{fmt} would replace this LoRALinear by torchao's Float8Linear, a plain Linear of its weight and bias, "
            "dropping its own forward and its parameters lora_a, lora_b"
        )
        assert fp8_shape_problem(Scaled(32, 32), fmt).endswith("Scaled by torchao's Float8Linear, a plain Linear of its "
                                                               "weight and bias, dropping its own forward")  # fmt: skip
        assert fp8_shape_problem(masked, fmt).endswith("dropping its buffers mask")
        assert fp8_shape_problem(gated, fmt).endswith("dropping its child modules gate")
        assert fp8_shape_problem(TaggedLinear(32, 32), fmt) is None  # a plain attribute is not lost: it is a Linear
        assert fp8_shape_problem(nn.MultiheadAttention(32, 2).out_proj, fmt) is None  # torch's own trivial subclass
    assert format_problem(Format.FP8, LoRALinear(32, 32), "cpu") == fp8_shape_problem(LoRALinear(32, 32))
    assert format_problem(Format.BF16, LoRALinear(32, 32), "cpu") is None  # autocast runs its own forward


def test_parse_format_lists_every_registered_format_on_a_typo():
    with pytest.raises(ValueError, match="fp8-rowwise-fwd-dgrad, mxfp8, .*, mxfp8-fwd-nvfp4-dgrad, but got 'fp8-row'"):
        parse_format("fp8-row")


def test_on_a_blackwell_gpu_mxfp8_runs_its_emulation_too(monkeypatch, no_gpu_contract):
    # autoprec runs no torchao MX kernel: the emulation, and the profile says "no kernel on this device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert Format.MXFP8.spec.device_problem("cuda") is None
    assert not Format.MXFP8.family.has_kernels(Format.MXFP8, torch.device("cuda"))
    assert Format.FP8_ROWWISE_GW_HP.spec.device_problem("cuda") is None  # fp8 kernels: every torchao recipe runs


def test_below_compute_capability_8_9_every_fp8_recipe_is_emulated(monkeypatch, no_gpu_contract):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    assert Format.FP8.spec.device_problem("cuda") is None
    assert Format.FP8_ROWWISE_GW_HP.spec.device_problem("cuda") is None
    assert not has_fp8_kernels("cuda")
