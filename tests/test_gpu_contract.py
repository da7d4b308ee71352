"""CUDA's rules on a CPU (tests/gpu_contract.py): the rules themselves, and autoprec's fp8 layers living by them.

The defects these keep fixed would each have failed the first GPU run: fp8 on a batch whose token count is not a
multiple of 16 (an epoch's ragged last batch: padded), a call with no rows (an MoE expert given no tokens: run in
the fallback), and the fp8 recipes' numerics on a CPU differing from what CUDA computes (torchao reads CUDA's
autocast only).
"""

import copy

import gpu_contract
import pytest
import torch
from builders import gemm_sqnrs
from gpu_contract import ContractError, check_scaled_mm, enforced, lifted
from torch import nn

import autoprec
from autoprec.apply import applied_summary
from autoprec.formats import Format, Fp8Backend, fp8_formats

FP8 = [f.value for f in fp8_formats() if f.family.fp8_gemms(f) is not None]  # torchao's float8 recipes
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.tensor(1.0)


def _operands(m, k, n, a=E4M3, b=E4M3):
    """mat1 (m, k) row-major and mat2 (k, n) column-major, as torchao hands them to torch._scaled_mm."""
    return torch.zeros(m, k).to(a), torch.zeros(n, k).to(b).t()


# ---------------------------------------------------------------------------------------------------
# The contract's own rules: each refuses what CUDA refuses and passes what torchao sends


def test_what_torchao_sends_passes_tensorwise_and_rowwise():
    mat1, mat2 = _operands(8, 32, 48)  # mat1's rows are free: only K and N must be multiples of 16
    check_scaled_mm(mat1, mat2, ONE, ONE, out_dtype=torch.float32)
    check_scaled_mm(mat1, mat2, torch.ones(8, 1), torch.ones(1, 48), out_dtype=torch.bfloat16)
    check_scaled_mm(mat1, mat2, ONE, ONE, bias=torch.zeros(48, dtype=torch.bfloat16), out_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "case, match",
    [
        (lambda: (*_operands(16, 24, 32), ONE, ONE), "trailing dimension of mat1"),  # K = 24
        (lambda: (*_operands(16, 32, 40), ONE, ONE), r"mat2 shape \(32x40\)"),  # N = 40
        (lambda: (torch.zeros(16, 32).to(E4M3), torch.zeros(32, 16).to(E4M3), ONE, ONE), "column-major"),
        (lambda: (torch.zeros(32, 16).to(E4M3).t(), _operands(16, 32, 16)[1], ONE, ONE), "row-major"),
        (lambda: (*_operands(16, 32, 16, E5M2, E5M2), ONE, ONE), "two Float8_e5m2"),
        (lambda: (*_operands(16, 32, 16), torch.ones(16), torch.ones(16)), "neither tensorwise nor rowwise"),
        (lambda: (*_operands(16, 32, 16), ONE.double(), ONE), "float32"),
    ],
    ids=["K not /16", "N not /16", "mat2 row-major", "mat1 column-major", "e5m2 x e5m2", "scale shapes", "scale dtype"],
)
def test_each_rule_refuses_what_cuda_refuses(case, match):
    with pytest.raises(ContractError, match=match):
        check_scaled_mm(*case(), out_dtype=torch.bfloat16)


def test_rowwise_needs_a_bf16_output_and_bias_rules_follow_the_output():
    mat1, mat2 = _operands(16, 32, 16)
    with pytest.raises(ContractError, match="bf16 output only"):
        check_scaled_mm(mat1, mat2, torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    with pytest.raises(ContractError, match="out_dtype is float32"):
        check_scaled_mm(mat1, mat2, ONE, ONE, bias=torch.zeros(16), out_dtype=torch.float32)
    with pytest.raises(ContractError, match="bias must be torch.bfloat16"):
        check_scaled_mm(mat1, mat2, ONE, ONE, bias=torch.zeros(16, dtype=torch.float16), out_dtype=torch.bfloat16)


def test_under_the_contract_torchaos_kernel_path_runs_through_the_checked_gemm(gpu_contract_on):
    """autoprec sees fp8 kernels, so torchao calls torch._scaled_mm, which refuses a raw ragged weight-gradient GEMM."""
    layer = nn.Sequential(nn.Linear(32, 32))
    autoprec.apply_policy(layer, autoprec.Policy(layers={"0": "fp8"}))
    assert applied_summary(layer).fp8_backends() == {"0": Fp8Backend.KERNELS}
    assert layer[0].config.emulate is False
    with pytest.raises(ContractError, match="trailing dimension of mat1"):
        type(layer[0]).forward(layer[0], torch.randn(8, 32)).sum().backward()  # torchao itself, no policy around it


def test_the_contract_is_undone_after_its_block_even_when_it_raises(no_gpu_contract):
    from autoprec import formats

    def state():
        return (torch._scaled_mm, torch.is_autocast_enabled, torch.get_autocast_gpu_dtype, formats._has_capability,
                gpu_contract._precision())  # fmt: skip

    before = state()
    with pytest.raises(KeyError), enforced():
        assert torch._scaled_mm is not before[0] and formats.has_fp8_kernels("cpu")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()  # as after a model.py set TF32 through torch's new API
        raise KeyError
    assert state() == before  # every patch and every backend's fp32 precision, and the legacy getter answers again


# ---------------------------------------------------------------------------------------------------
# Defect 1: a policy applied in training never crashes on a batch shape


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@pytest.mark.parametrize("root", ["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FP8)
def test_the_readmes_training_loop_finishes_an_epoch_with_a_ragged_last_batch(gpu_contract_on, fmt, root):
    """Batches of 256, 256 and 157 rows (the quick start's digits ends on 157): the last one's weight-gradient GEMM
    has 157 as its inner dimension, which CUDA refuses, so that call is padded to 160 rows."""
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(n, 64, generator=g), torch.randint(0, 16, (n,), generator=g)) for n in (256, 256, 157)]
    model = Mlp()
    policy = autoprec.Policy(layers={"": root, "fc1": fmt, "fc2": fmt})
    model = autoprec.apply_policy(model, policy)
    scaler = autoprec.grad_scaler(policy, model=model)
    optimizer = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("fmt", ["fp8", "fp8-rowwise", "fp8-fwd-dgrad"])
def test_the_readmes_compiled_training_loop_finishes_an_epoch_with_a_ragged_last_batch(gpu_contract_on, monkeypatch, fmt):
    """As the README trains: apply_policy, then compile_model. The ragged batch is a new shape for the compiled graph
    (and the padding a new branch in it); aot_eager traces what inductor would compile, without its minutes here."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model=None, **kw: real_compile(model, **{**kw, "backend": "aot_eager"}))
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(n, 64, generator=g), torch.randint(0, 16, (n,), generator=g)) for n in (256, 256, 157)]
    policy = autoprec.Policy(layers={"": "bf16", "fc1": fmt, "fc2": fmt})
    model = autoprec.compile_model(autoprec.apply_policy(Mlp(), policy))
    optimizer = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)


@pytest.mark.parametrize("fmt", FP8)
def test_a_call_with_no_rows_runs_in_the_fallback(gpu_contract_on, fmt):
    """An MoE expert that got no tokens: torchao's scale of an empty tensor fails; the call gives an empty output."""
    model = autoprec.apply_policy(Mlp(), autoprec.Policy(layers={"fc1": fmt}))
    x = torch.randn(0, 64, requires_grad=True)
    out = model(x)
    out.sum().backward()
    assert out.shape == (0, 16) and x.grad.shape == (0, 64)
    for dtype in (torch.bfloat16, torch.float16):  # the dtype a call with rows gives: an MoE's index_add_ mixes both
        with torch.autocast("cpu", dtype=dtype):
            assert model.fc1(torch.randn(0, 64)).dtype == model.fc1(torch.randn(16, 64)).dtype


def _scaled_mm_calls(model, x):
    """The mat1 shapes of the fp8 GEMMs one forward and backward of `model` on `x` runs."""
    calls, real = [], torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    torch._scaled_mm = counting
    try:
        model(x).sum().backward()
    finally:
        torch._scaled_mm = real
    return calls


def test_a_ragged_batch_still_runs_its_three_gemms_in_fp8_padded_to_16_rows(gpu_contract_on):
    model = autoprec.apply_policy(Mlp(), autoprec.Policy(layers={"fc1": "fp8"}))
    assert sorted(_scaled_mm_calls(model, torch.randn(32, 64))) == [(32, 64), (32, 64), (64, 32)]
    assert sorted(_scaled_mm_calls(model, torch.randn(3, 11, 64))) == [(48, 64), (48, 64), (64, 48)]  # 33 rows + 15


def test_fp8_forward_only_formats_run_ragged_batches_unpadded(gpu_contract_on):
    """Where the weight gradient is high precision, no fp8 GEMM has the tokens as its inner dimension."""
    model = autoprec.apply_policy(Mlp(), autoprec.Policy(layers={"fc1": "fp8-fwd-dgrad"}))
    assert sorted(_scaled_mm_calls(model, torch.randn(33, 64))) == [(33, 64), (33, 64)]  # fprop and dgrad


@pytest.mark.parametrize("fmt", ["fp8", "fp8-rowwise"])
def test_padding_changes_no_number(no_gpu_contract, fmt):
    """Zero rows raise no scale and add nothing to the weight gradient: a padded call computes what torchao computes
    on the ragged batch itself (emulated here, where torchao needs no padding)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 32))
    padded = autoprec.apply_policy(copy.deepcopy(ref), autoprec.Policy(layers={"0": fmt}))
    plain = autoprec.apply_policy(copy.deepcopy(ref), autoprec.Policy(layers={"0": fmt}))
    x = torch.randn(5, 7, 64)
    grad = torch.randn(5, 7, 32)
    out_padded = padded(x)
    out_plain = type(plain[0]).forward(plain[0], x)  # torchao itself: no padding
    out_padded.backward(grad)
    out_plain.backward(grad)
    torch.testing.assert_close(out_padded, out_plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(padded[0].weight.grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded[0].bias.grad, plain[0].bias.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Defect 3: every fp8 format's numerics on a CPU are what CUDA's contract computes


@pytest.mark.parametrize("root", ["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FP8)
def test_each_fp8_formats_numerics_on_a_cpu_match_cudas_within_half_a_db(fmt, root):
    """Emulated here (torchao's emulate=True) against the kernel path under CUDA's contract, per GEMM."""
    assert Format(fmt).spec.device_problem("cpu") is None  # every fp8 format is measurable on a CPU
    with lifted():
        emulated = gemm_sqnrs(fmt, root)
    with enforced():
        contract = gemm_sqnrs(fmt, root)
    for gemm, db in emulated.items():
        assert db == contract[gemm] or abs(db - contract[gemm]) <= 0.5, (gemm, emulated, contract)  # inf: exact
    assert emulated["fprop"] >= 20
