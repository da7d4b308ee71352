"""grad_scaler: skipped steps as in PyTorch's own GradScaler tests, and a warning when the scale collapses."""

import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import autoprec.scaler
from autoprec import LossScale, Policy, apply_policy, grad_scaler

FP16 = Policy(
    layers={"a": "fp16", "b": "bf16"},
    loss_scale=LossScale(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def _inject_inf(param):
    with torch.no_grad():
        param.grad[0, 0] = float("inf")


def _run(model, batches, *, scaler=None, bad_steps=(), skip_steps=(), inf_param="b", fused=False):
    """Adam steps; `bad_steps` get an inf in one gradient, `skip_steps` skip the optimizer (the control).
    `fused`: Adam's fused kernel, which takes the scaler's inf check into its own step."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **({"fused": True} if fused else {}))
    scales = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if i in bad_steps:
            _inject_inf(getattr(model, inf_param).weight)
        if scaler:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        elif i not in skip_steps:
            opt.step()
    return opt, scales


@pytest.mark.parametrize("applied", [False, True], ids=["fp32 model", "policy-applied model"])
def test_an_inf_gradient_skips_that_step_exactly_like_a_control_that_skipped_it(applied):
    n, k = 6, 2
    scaled = Net()
    control = copy.deepcopy(scaled)
    if applied:  # both run the fp16 layer; only the scaled run multiplies the loss
        apply_policy(scaled, FP16)
        apply_policy(control, FP16)
    scaler = grad_scaler(FP16, "cpu", model=scaled)
    opt_s, scales = _run(scaled, _batches(n), scaler=scaler, bad_steps={k})
    opt_c, _ = _run(control, _batches(n), skip_steps={k})

    for (name, ps), pc in zip(scaled.named_parameters(), control.parameters()):
        torch.testing.assert_close(ps, pc, msg=name)
    for state_s, state_c in zip(opt_s.state_dict()["state"].values(), opt_c.state_dict()["state"].values()):
        torch.testing.assert_close(state_s, state_c)  # Adam's step count and moments skipped the same step
    # growth_interval=1, so after each step the scale is init * growth^clean * backoff^skipped.
    clean = [sum(j != k for j in range(i + 1)) for i in range(n)]
    skipped = [int(i >= k) for i in range(n)]
    assert scales == [2.0**10 * 2.0**c * 0.5**s for c, s in zip(clean, skipped)]
    assert scaler.skipped_steps == 1 and scaler.consecutive_skips == 0
    assert scaler.last_nonfinite_layers == ["b (bf16)"]  # as the policy names it


def test_a_fused_optimizer_that_runs_its_own_inf_check_is_counted_and_named_the_same():
    """Fused Adam's step always runs (it skips inside, reading the scaler's inf flags): the skip is read off the
    scale instead, and clean steps still never look at the gradients."""
    runs = {}
    for fused in (False, True):
        model = apply_policy(Net(), FP16)
        scaler = grad_scaler(FP16, "cpu", model=model)
        opt, scales = _run(model, _batches(5), scaler=scaler, bad_steps={1, 2}, fused=fused)
        runs[fused] = (
            scales,
            scaler.skipped_steps,
            scaler.last_nonfinite_layers,
            [p.detach().clone() for p in model.parameters()],
        )
    assert runs[True][:3] == runs[False][:3] == (runs[False][0], 2, ["b (bf16)"])
    assert runs[False][0] == [2.0**11, 2.0**10, 2.0**9, 2.0**10, 2.0**11]
    for fused_p, plain_p in zip(runs[True][3], runs[False][3]):
        torch.testing.assert_close(fused_p, plain_p)


def test_a_collapsing_scale_warns_once_per_run_of_skips_naming_the_layer():
    model = apply_policy(Net(), FP16)
    scaler = grad_scaler(FP16, "cpu", model=model, warn_after_skips=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(model, _batches(5), scaler=scaler, bad_steps=set(range(5)), inf_param="a")
        assert len(caught) == 1  # warned at the third skip, not again at the fourth and fifth
        _run(model, _batches(4), scaler=scaler, bad_steps={1, 2, 3}, inf_param="a")  # one clean step, then 3 skips
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "3 steps skipped in a row" in messages[0] and "non-finite gradients in: a (fp16)" in messages[0]
    assert "set it to bf16 or fp32" in messages[0]


def test_a_scale_below_one_warns_before_the_skip_count_is_reached():
    policy = Policy(layers={"a": "fp16"}, loss_scale=LossScale(init_scale=2.0))
    model = apply_policy(Net(), policy)
    scaler = grad_scaler(policy, "cpu", model=model, warn_after_skips=100)
    with pytest.warns(UserWarning, match=r"2 steps skipped in a row, scale now 0\.5.*a \(fp16\)"):
        _run(model, _batches(2), scaler=scaler, bad_steps={0, 1}, inf_param="a")


def _overflow_task():
    path = Path(__file__).parent / "models" / "overflow_mlp.py"
    spec = importlib.util.spec_from_file_location("overflow_mlp_for_scaler_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_real_fp16_overflow_is_traced_to_its_layer_without_passing_the_model():
    task = _overflow_task()
    policy = Policy(layers={"fc1": "bf16", "big": "fp16"})
    model = apply_policy(task.build_model(), policy)
    scaler = grad_scaler(policy, "cpu", warn_after_skips=2)  # finds the one model this policy was applied to
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match=r"non-finite gradients in: big \(fp16\), fc1 \(bf16\), head \(not in the policy\)"):
        for batch in task.batches("train"):
            opt.zero_grad(set_to_none=True)
            scaler.scale(task.loss_fn(model, batch)).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.skipped_steps == 3


def test_when_the_model_is_ambiguous_the_warning_says_how_to_name_layers():
    policy = Policy(layers={"a": "fp16"}, loss_scale=LossScale(init_scale=2.0))
    models = [apply_policy(Net(), policy) for _ in range(2)]  # two models, one policy: which one?
    scaler = grad_scaler(policy, "cpu")
    with pytest.warns(UserWarning, match="pass model= to grad_scaler"):
        _run(models[0], _batches(2), scaler=scaler, bad_steps={0, 1}, inf_param="a")


def test_clean_steps_never_inspect_gradients(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("nonfinite_layers ran on a clean step")

    monkeypatch.setattr(autoprec.scaler, "nonfinite_layers", forbidden)
    model = apply_policy(Net(), FP16)
    scaler = grad_scaler(FP16, "cpu", model=model)
    _, scales = _run(model, _batches(3), scaler=scaler)
    assert scales == [2.0**11, 2.0**12, 2.0**13] and scaler.skipped_steps == 0


def test_a_scaler_told_not_to_warn_counts_skips_without_warning_or_looking_at_gradients(monkeypatch):
    monkeypatch.setattr(autoprec.scaler, "nonfinite_layers", lambda *a: pytest.fail("looked at the gradients"))
    model = apply_policy(Net(), FP16)
    scaler = grad_scaler(FP16, "cpu", model=model, warn=False, warn_after_skips=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        _run(model, _batches(4), scaler=scaler, bad_steps={0, 1, 2})
    assert scaler.skipped_steps == 3 and scaler.consecutive_skips == 0


def test_a_disabled_scaler_steps_and_updates_as_a_no_op():
    policy = Policy(layers={"a": "bf16"})
    model = apply_policy(Net(), policy)
    scaler = grad_scaler(policy, "cpu", model=model)
    assert not scaler.is_enabled()
    before = [p.detach().clone() for p in model.parameters()]
    _run(model, _batches(2), scaler=scaler)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_warn_after_skips_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=rf"warn_after_skips must be an integer >= 1, but got {bad!r}"):
        grad_scaler(FP16, "cpu", warn_after_skips=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_scaler_skips_an_inf_step_like_the_control():
    scaled = Net().cuda()
    control = copy.deepcopy(scaled)
    apply_policy(scaled, FP16)
    apply_policy(control, FP16)
    batches = [(x.cuda(), y.cuda()) for x, y in _batches(4)]
    scaler = grad_scaler(FP16, model=scaled)
    assert scaler._device == "cuda"
    _run(scaled, batches, scaler=scaler, bad_steps={1})
    _run(control, batches, skip_steps={1})
    for ps, pc in zip(scaled.parameters(), control.parameters()):
        torch.testing.assert_close(ps, pc)


def test_layers_are_named_through_a_torch_compile_wrapper():
    model = apply_policy(Net(), FP16)
    compiled = torch.compile(model, backend="aot_eager")  # not run: only its parameter names matter here
    nn.functional.mse_loss(model(torch.randn(2, 8)), torch.zeros(2, 4)).backward()
    _inject_inf(model.a.weight)
    assert autoprec.scaler.nonfinite_layers(compiled, FP16) == ["a (fp16)"]


def test_a_skip_in_one_of_two_optimizers_counts_as_a_skipped_step():
    model = apply_policy(Net(), FP16)
    scaler = grad_scaler(FP16, "cpu", model=model)
    opt_a = torch.optim.SGD(model.a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.b.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    _inject_inf(model.a.weight)  # only the first optimizer's gradients
    scaler.step(opt_a)
    scaler.step(opt_b)  # this one runs
    scaler.update()
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**9


def test_a_resumed_fused_run_compares_against_the_loaded_scale():
    """A clean fused step after load_state_dict is not a skip, though the loaded scale is below init_scale."""
    model = apply_policy(Net(), FP16)
    scaler = grad_scaler(FP16, "cpu", model=model)
    state = grad_scaler(FP16, "cpu").state_dict()
    scaler.load_state_dict({**state, "scale": 2.0**4})  # a run whose scale fell
    _, scales = _run(model, _batches(1), scaler=scaler, fused=True)
    assert scales == [2.0**5] and scaler.skipped_steps == 0
