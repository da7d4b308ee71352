"""The blockscaled family (issue 40, section 1): mxfp8 and nvfp4 per GEMM through apply_policy, the profile and a policy
file, each GEMM bit for bit blockscaled_linear's (the low ones) or torch's own (the high-precision ones)."""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
from short_timing import TINY
from torch import nn

from autoprec import Policy, apply_policy, load_policy
from autoprec.apply import apply_on_chosen_device
from autoprec.formats import Format, format_problem, fp8_formats, parse_format, risky_formats
from autoprec.formats.blockscaled import _RNG_ATTR, GEMM_FORMATS, MX, NV, BlockScaledFamily, seed_of
from autoprec.formats.mx import MXFP8, NVFP4, blockscaled_linear
from autoprec.tune import ProfileConfig, load_task, prepare, profile
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._measure._profile_data import NO_KERNEL, ruled_out
from autoprec.tune._report._report import break_floor, profile_summary

MODELS = Path(__file__).parent / "models"
# name -> (fprop, dgrad, wgrad): None is high precision
SETTINGS: dict[str, tuple] = {
    "mxfp8": (MX, MX, MX),
    "mxfp8-fwd": (MX, None, None),
    "mxfp8-fwd-dgrad": (MX, MX, None),
    "nvfp4": (NV, NV, NV),
    "nvfp4-fwd": (NV, None, None),
    "nvfp4-fwd-dgrad": (NV, NV, None),
    "mxfp8-fwd-nvfp4-dgrad": (MX, NV, None),
}
EMULATED = "runs emulated|run emulated"


def test_every_format_is_registered_with_its_family_and_its_gemms():
    for name, (fprop, dgrad, wgrad) in SETTINGS.items():
        fmt = parse_format(name)
        assert isinstance(fmt.family, BlockScaledFamily) and fmt.family.name == "blockscaled"
        gemms = GEMM_FORMATS[name]
        assert (gemms.fprop, gemms.dgrad, gemms.wgrad) == (fprop, dgrad, wgrad)
        spec = fmt.spec
        assert spec.risky and spec.linear_only and spec.fallback is Format.BF16 and not spec.loss_scale
        assert fmt in risky_formats() and fmt not in fp8_formats()  # not torchao's float8: the fp8 reports do not read it
        expected = tuple({MX: "mxfp8", NV: "nvfp4", None: "fp32"}[s] for s in (fprop, dgrad, wgrad))
        assert fmt.family.gemm_precisions(fmt) == expected
    assert Format.MXFP8 is Format("mxfp8")
    # torchao's MX training recipe: e4m3 everywhere, blocks of 32, rceil scales; NVIDIA's NVFP4 recipe
    assert MX == MXFP8(torch.float8_e4m3fn, "rceil", 32)
    assert NV == NVFP4(per_tensor_scale=True, two_d_weight=True, stochastic_gradients=True, rht=True)


def test_floors_and_names():
    assert break_floor("mxfp8") == 20.0 and break_floor("nvfp4") == 10.0 and break_floor("mxfp8-fwd-nvfp4-dgrad") == 10.0
    assert break_floor("fp8") == 20.0 and break_floor("bf16") == 30.0  # the other families' as before
    fam = Format.MXFP8.family
    assert fam.export_name(Format.MXFP8) is None  # no export target writes MX or NVFP4 (they write torchao float8)
    assert [fam.recipe_name(Format(n)) for n in ("mxfp8", "nvfp4", "mxfp8-fwd-dgrad", "nvfp4-fwd")] == [
        "mxfp8", "nvfp4", "mxfp8_rceil_wgrad_with_hp", None,
    ]  # fmt: skip
    assert not fam.has_kernels(Format.MXFP8, torch.device("cpu"))
    assert Format.BF16.family.has_kernels(Format.BF16, torch.device("cpu"))  # the default


def test_a_policy_file_naming_mxfp8_loads_and_applies(tmp_path):
    path = tmp_path / "policy.json"
    Policy(layers={"0": "fp32"}).save(path)  # a file as autoprec writes it, then one naming mxfp8 in it
    path.write_text(path.read_text(encoding="utf-8").replace('"0": "fp32"', '"0": "mxfp8", "2": "nvfp4-fwd"'), encoding="utf-8")
    policy = load_policy(path)
    assert policy.layers["0"] is Format.MXFP8 and policy.layers["2"] is Format("nvfp4-fwd")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    with pytest.warns(UserWarning, match=EMULATED):
        apply_policy(model, policy)
    assert torch.isfinite(model(torch.randn(16, 32))).all()


# ---------------------------------------------------------------- training


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32))


@pytest.mark.parametrize("root", [None, "bf16"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_apply_policy_trains_an_mlp_with_ragged_batches(name, root):
    model = _mlp()
    layers = {"0": name, "2": name} | ({"": root} if root else {})
    with pytest.warns(UserWarning, match=EMULATED):
        apply_policy(model, Policy(layers=layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    for rows in (256, 256, 157):  # the last batch ragged: padded to the wgrad block and cut back
        x, y = torch.randn(rows, 64, generator=g), torch.randn(rows, 32, generator=g)
        loss = nn.functional.mse_loss(model(x).float(), y)
        assert torch.isfinite(loss)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


# ---------------------------------------------------------------- each GEMM, bit for bit


def _run(model: nn.Sequential, x: torch.Tensor, g: torch.Tensor, autocast: torch.dtype | None = None):
    """The output of the model (one Linear), its input gradient (dgrad), weight and bias gradients (wgrad) for
    output gradient `g`."""
    x = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(x)
    out.backward(g.to(out.dtype))
    return out.detach(), x.grad, model[0].weight.grad, model[0].bias.grad


def _applied(layer: nn.Linear, name: str) -> nn.Sequential:
    holder = nn.Sequential(copy.deepcopy(layer))
    return apply_on_chosen_device(holder, Policy(layers={"0": name}))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_gemm_is_blockscaled_linears_or_the_controls_bit_for_bit(name):
    torch.manual_seed(3)
    layer = nn.Linear(64, 96)
    x, g = torch.randn(4, 32, 64), torch.randn(4, 32, 96) * 1e-3  # a 3-d input: 128 tokens
    fprop, dgrad, wgrad = SETTINGS[name]
    model = _applied(layer, name)
    out, gx, gw, gb = _run(model, x, g)
    # the reference: blockscaled_linear with the same settings, its generator seeded as apply_policy seeds the layer's
    ref_layer = copy.deepcopy(layer)
    xr = x.clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(seed_of("0"))
    ref = blockscaled_linear(xr, ref_layer.weight, ref_layer.bias, fprop=fprop, dgrad=dgrad, wgrad=wgrad, generator=gen)
    ref.backward(g)
    control = _run(nn.Sequential(copy.deepcopy(layer)), x, g)  # fp32, no policy
    for what, got, low, setting, ctrl in (
        ("fprop", out, ref.detach(), fprop, control[0]),
        ("dgrad", gx, xr.grad, dgrad, control[1]),
        ("wgrad", gw, ref_layer.weight.grad, wgrad, control[2]),
    ):
        want = low if setting is not None else ctrl
        assert _same(got, want), f"{name} {what}: not bit for bit {'blockscaled_linear' if setting else 'fp32'}'s"
        if setting is not None:
            assert not torch.equal(got, ctrl)  # it did quantise
    assert _same(gb, control[3] if wgrad is None else ref_layer.bias.grad)


@pytest.mark.parametrize("name", [n for n, s in SETTINGS.items() if None in s])
def test_under_a_bf16_root_the_high_precision_gemms_are_a_bf16_layers_exactly(name):
    torch.manual_seed(4)
    layer = nn.Linear(64, 96)
    x, g = torch.randn(128, 64), torch.randn(128, 96) * 1e-3
    got = _run(_applied(layer, name), x, g, autocast=torch.bfloat16)
    control = _run(_applied(layer, "bf16"), x, g, autocast=torch.bfloat16)
    for i, (what, setting) in enumerate(zip(("fprop", "dgrad", "wgrad"), SETTINGS[name])):
        if setting is None:
            assert _same(got[i], control[i]), f"{name} {what} differs from the bf16 layer's"
        else:
            assert got[i].dtype == control[i].dtype and not torch.equal(got[i], control[i])
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32  # bf16 inside, fp32 master gradients
    # with bf16 operands, the low GEMMs are blockscaled_linear's on the bf16 casts
    fprop, dgrad, wgrad = SETTINGS[name]
    ref = blockscaled_linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16(), fprop=fprop)
    assert _same(got[0], ref.detach())


def test_a_ragged_batch_is_the_zero_padded_batch_cut_back():
    torch.manual_seed(5)
    layer = nn.Linear(64, 32)
    x, g = torch.randn(50, 64), torch.randn(50, 32)
    out, gx, gw, _ = _run(_applied(layer, "mxfp8"), x, g)
    xp = nn.functional.pad(x, (0, 0, 0, 14)).requires_grad_(True)
    ref = blockscaled_linear(xp, layer.weight, layer.bias, fprop=MX, dgrad=MX, wgrad=MX)
    ref.backward(nn.functional.pad(g, (0, 0, 0, 14)))
    assert _same(out, ref.detach()[:50]) and _same(gx, xp.grad[:50]) and _same(gw, layer.weight.grad)


@pytest.mark.parametrize("name", [n for n, s in SETTINGS.items() if NV in s[1:]])
def test_a_gradient_of_zeros_and_one_denormal_gives_finite_gradients(name):
    """NVFP4's per-tensor scale of such a gradient underflowed, and its round trip was NaN (zeros included)."""
    torch.manual_seed(9)
    model = _applied(nn.Linear(32, 32), name)
    for tiny in (1e-43, 1e-38, 1e-34):
        g = torch.zeros(16, 32)
        g[3, 5] = tiny
        _, gx, gw, gb = _run(model, torch.randn(16, 32), g)
        for what, got in (("dX", gx), ("dW", gw), ("db", gb)):
            assert got.isfinite().all() and got.abs().max() < 1e-30, f"{name} {what} for {tiny}"


def test_stochastic_rounding_is_seeded_by_the_layer_name():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    model[1].load_state_dict(model[0].state_dict())
    x = torch.randn(32, 64)

    def grads(m):
        m.zero_grad()
        m[1](m[0](x)).sum().backward()
        return m[0].weight.grad.clone(), m[1].weight.grad.clone()

    a = grads(apply_on_chosen_device(copy.deepcopy(model), Policy(layers={"0": "nvfp4", "1": "nvfp4"})))
    b = grads(apply_on_chosen_device(copy.deepcopy(model), Policy(layers={"0": "nvfp4", "1": "nvfp4"})))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # reproducible from run to run
    assert seed_of("0") != seed_of("1")


@pytest.mark.parametrize("name", sorted(GEMM_FORMATS))
def test_every_blockscaled_format_compiles_whole_for_any_batch_size_and_matches_eager(name):
    """fullgraph: any graph break is an error (the Format's own table lookup, a tensor given twice to an autograd
    Function and a Generator made or passed in a step each broke it). The rows are a symbol, as torch.compile makes
    them at a second batch shape (an epoch's ragged last batch): stochastic rounding's draw and the padding to the
    wgrad block take a symbolic size (a torch.rand given generator=None did not). Deterministic formats match eager
    bit for bit at each size; one that rounds stochastically draws from torch's global generator when compiled, so
    its gradients match eager's to the rounding noise, and a rerun from the same torch.manual_seed repeats them."""
    torch.manual_seed(7)
    sizes = (16, 24)  # 24: ragged for both blocks (16, 32)
    xs = [torch.randn(rows, 32) for rows in sizes]
    base = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    policy = Policy(layers={"0": name, "2": name})
    # a loss whose output gradient is not all ones, which every format holds exactly
    weights = [torch.randn(rows, 32) for rows in sizes]

    def grads(model, run):
        out = []
        for x, w in zip(xs, weights):
            model.zero_grad(set_to_none=True)
            (run(x) * w).sum().backward()
            out += [model[0].weight.grad, model[2].weight.grad]
        return out

    eager_model = apply_on_chosen_device(copy.deepcopy(base), policy)
    eager = grads(eager_model, eager_model)

    model = apply_on_chosen_device(copy.deepcopy(base), policy)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)

    def run(x):
        x = x.clone()
        torch._dynamo.maybe_mark_dynamic(x, 0)  # the rows a symbol, as a second batch size makes them
        return compiled(x)

    def compiled_grads():
        torch.manual_seed(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = grads(model, run)
        assert not [str(w.message)[:200] for w in caught if "ynamo" in str(w.message)]  # e.g. an lru_cache traced
        return got

    first = compiled_grads()
    if not GEMM_FORMATS[name].stochastic:  # equal to eager's bits: nothing left to repeat
        assert _RNG_ATTR not in eager_model[0].__dict__  # no generator: nothing draws from one
        assert all(torch.equal(a, b) for a, b in zip(first, eager))
    else:
        again = compiled_grads()  # the global generator, seeded the same: the same draws
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert not torch.equal(first[0], eager[0])  # other draws (layer 2's dgrad rounds stochastically) ...
        for got, want in zip(first, eager):
            assert got.isfinite().all()
            assert 10 * torch.log10(want.square().sum() / (got - want).square().sum().clamp_min(1e-30)) > 10  # ... alike
    torch._dynamo.reset()


# ---------------------------------------------------------------- refusals and the warning


def test_refusals_name_the_value_and_the_fix():
    assert format_problem(Format.MXFP8, nn.Conv1d(32, 32, 3), "cpu") == "mxfp8 covers nn.Linear only, not Conv1d"
    problem = format_problem(Format.MXFP8, nn.Linear(48, 64), "cpu")
    assert "in_features divisible by 32" in problem and "Linear(48, 64)" in problem and "in_features 64" in problem
    problem = format_problem(Format("nvfp4-fwd"), nn.Linear(32, 40), "cpu")  # 16x16 weight tiles: both dimensions
    assert "out_features divisible by 16" in problem and "out_features 48" in problem
    assert format_problem(Format("mxfp8-fwd"), nn.Linear(32, 40), "cpu") is None  # fprop contracts over in_features only
    with pytest.raises(
        ValueError, match=r"layer '0' cannot be mxfp8-fwd-dgrad here: .*out_features divisible by 32.*give it bf16"
    ):
        apply_policy(nn.Sequential(nn.Linear(32, 40)), Policy(layers={"0": "mxfp8-fwd-dgrad"}))
    with pytest.raises(ValueError, match=r"the model itself \(''\) cannot be nvfp4: .*list the Linear layers by name"):
        apply_policy(nn.Sequential(nn.Linear(32, 32)), Policy(layers={"": "nvfp4"}))

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert "Scaled's own forward would be skipped" in format_problem(Format.MXFP8, Scaled(32, 32), "cpu")


def test_apply_policy_warns_once_and_the_tuners_path_does_not():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_policy(model, Policy(layers={"0": "mxfp8", "1": "nvfp4"}))
    said = [str(w.message) for w in caught]
    assert said == [
        "apply_policy: its mxfp8, nvfp4 layers run emulated (no mxfp8/nvfp4 kernel on this device): numerics as the "
        "reference kernels, speed not representative"
    ]
    assert caught[0].filename == __file__  # points at the caller's apply_policy line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_on_chosen_device(copy.deepcopy(nn.Sequential(nn.Linear(32, 32))), Policy(layers={"0": "mxfp8"}))


def test_the_warning_names_the_element_formats_of_the_layers_it_lists():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_policy(nn.Sequential(nn.Linear(32, 32)), Policy(layers={"0": "mxfp8-fwd"}))
    assert [str(w.message) for w in caught] == [
        "apply_policy: its mxfp8-fwd layers run emulated (no mxfp8 kernel on this device): numerics as the "
        "reference kernels, speed not representative"
    ]


def test_warnings_as_errors_refuse_with_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    before = [dict(m.__dict__) for m in model.modules()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="run emulated"):
            apply_policy(model, Policy(layers={"0": "nvfp4", "2": "mxfp8"}))
    assert [dict(m.__dict__) for m in model.modules()] == before


# ---------------------------------------------------------------- the profile


@pytest.fixture(scope="module")
def prof():
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16", "mxfp8", "nvfp4", "nvfp4-fwd"]}})
    return profile(workload, space, ProfileConfig(batches=2, timing=TINY), progress=False)


def _row(prof, layer, fmt):
    return prof.row(layer, fmt)


def test_the_profile_reports_per_gemm_sqnr_and_no_kernel_for_the_time(prof):
    for layer in ("fc1", "big"):
        mx, nv, fwd = (_row(prof, layer, f) for f in ("mxfp8", "nvfp4", "nvfp4-fwd"))
        for r in (mx, nv, fwd):
            assert r.status == "ok" and r.timed_as == NO_KERNEL and math.isnan(r.time_ms)
            assert r.metric_source == "measured" and math.isfinite(r.metric_drop)  # a profile alone measures it
        # docs/block-scaled.md's ranges: MXFP8 ~28.5 dB, NVFP4's recipe 15-17.5 dB, per GEMM
        assert 26 < mx.sqnr_db < 32 and 26 < mx.grad_sqnr_db < 33
        assert 14 < nv.sqnr_db < 19 and 13.5 < nv.grad_sqnr_db < 19.5
        assert fwd.sqnr_db == nv.sqnr_db and fwd.grad_sqnr_db == math.inf  # its wgrad is fp32's
    # dgrad: fc1 sends none back (its input is data); big's
    assert math.isnan(_row(prof, "fc1", "mxfp8").dgrad_sqnr_db)
    assert 26 < _row(prof, "big", "mxfp8").dgrad_sqnr_db < 32 and 13.5 < _row(prof, "big", "nvfp4").dgrad_sqnr_db < 19
    assert _row(prof, "big", "nvfp4-fwd").dgrad_sqnr_db == math.inf
    head = _row(prof, "head", "mxfp8")
    assert head.status == "unsupported" and "out_features divisible by 32" in head.reason
    assert _row(prof, "fc1", "bf16").time_ms > 0  # the others are timed as before


def test_the_summary_says_no_kernel_and_a_search_rules_it_out(prof):
    text = profile_summary(prof.rows)
    assert "mxfp8 x time" in text and NO_KERNEL.split()[0] in text
    line = next(s for s in text.splitlines() if s.startswith("big"))
    assert "no kernel on this" in line
    r = _row(prof, "big", "mxfp8")
    assert ruled_out(r, None, math.inf) is None  # a profile on its own judges no speed
    assert ruled_out(r, None, 1.25) == "no kernel on this device: the format runs emulated here, so its speed is unknown"
    assert ruled_out(_row(prof, "big", "bf16"), None, 1e9) is None
