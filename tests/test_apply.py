import copy
import json

import pytest
import torch
from torch import nn

from autoprec import Policy, apply_policy, grad_scaler
from autoprec.apply import applied_policy
from autoprec.measure import sqnr_db
from autoprec.policy import LossScale


class Probe(nn.Module):
    """Records the autocast state and input dtype its forward sees."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), x.dtype))
        return self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.probe = Probe()
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        return self.head(torch.relu(self.probe(self.a(x))))


def test_bf16_layer_runs_under_autocast_and_returns_fp32_outside_it():
    model = apply_policy(Net(), Policy(layers={"probe": "bf16"}))
    out = model(torch.randn(4, 16))
    assert model.probe.seen == [(True, torch.bfloat16, torch.float32)]
    assert out.dtype == torch.float32


def test_fp32_layer_inside_bf16_root_disables_autocast_and_casts_inputs_up():
    model = apply_policy(Net(), Policy(layers={"": "bf16", "probe": "fp32"}))
    out = model(torch.randn(4, 16))
    enabled, _, in_dtype = model.probe.seen[0]
    assert not enabled and in_dtype == torch.float32  # `a` produced bf16 under the root; probe got fp32
    assert model.probe.lin(torch.randn(1, 16)).dtype == torch.float32
    assert out.dtype == torch.float32  # the root casts back: the caller was not in autocast


def test_inside_a_users_autocast_the_policy_still_decides_and_outputs_stay_low():
    model = apply_policy(Net(), Policy(layers={"probe": "fp16"}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 16))
    assert model.probe.seen[0][:2] == (True, torch.float16)
    assert out.dtype == torch.bfloat16  # the user's region: AMP semantics, no cast back


def test_state_dict_keys_and_dtypes_do_not_change():
    plain = Net()
    before = {k: v.dtype for k, v in plain.state_dict().items()}
    applied = apply_policy(Net(), Policy(layers={"": "bf16", "a": "fp8", "probe": "fp16", "head": "fp32"}))
    assert {k: v.dtype for k, v in applied.state_dict().items()} == before
    applied.load_state_dict(plain.state_dict(), strict=True)
    Net().load_state_dict(applied.state_dict(), strict=True)


def test_fp8_layer_is_torchao_float8_with_torchao_sqnr_thresholds():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128))
    low = apply_policy(copy.deepcopy(ref), Policy(layers={"0": "fp8"}))
    assert type(low[0]).__name__ == "Float8Linear" and isinstance(low[0], nn.Linear)
    x = torch.randn(32, 64)
    y_ref, y = ref(x), low(x)
    y_ref.sum().backward()
    y.sum().backward()
    assert sqnr_db(y_ref, y) >= 20
    assert sqnr_db(ref[0].weight.grad, low[0].weight.grad) >= 17


def test_fp8_refuses_shapes_torchao_cannot_run():
    with pytest.raises(ValueError, match=r"'head' cannot be fp8.*divisible by 16.*\(16, 4\)"):
        model = nn.Sequential()
        model.add_module("head", nn.Linear(16, 4))
        apply_policy(model, Policy(layers={"head": "fp8"}))


def test_unknown_layer_names_are_named():
    with pytest.raises(ValueError, match=r"lacks: 'fc9', 'b\.c'"):
        apply_policy(Net(), Policy(layers={"fc9": "bf16", "b.c": "fp32"}))


def test_applying_twice_is_a_clear_error():
    model = apply_policy(Net(), Policy(layers={"a": "bf16"}))
    with pytest.raises(ValueError, match="already has a policy applied"):
        apply_policy(model, Policy(layers={"a": "bf16"}))


def test_accepts_a_policy_path(tmp_path):
    path = Policy(layers={"a": "bf16"}).save(tmp_path / "p.json")
    model = apply_policy(Net(), str(path))
    assert applied_policy(model).layers["a"].value == "bf16"


def test_a_layer_in_its_ancestors_format_needs_no_second_wrapper():
    model = apply_policy(Net(), Policy(layers={"": "bf16", "a": "bf16", "probe": "fp32"}))
    assert "forward" in model.__dict__ and "forward" in model.probe.__dict__
    assert "forward" not in model.a.__dict__


def test_deepcopy_of_an_applied_model_uses_its_own_weights():
    model = apply_policy(Net(), Policy(layers={"a": "bf16"}))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.a.weight.zero_()
        clone.a.bias.zero_()
    x = torch.randn(2, 16)
    assert torch.count_nonzero(clone.a(x)) == 0  # the clone's forward is bound to the clone
    assert torch.count_nonzero(model.a(x)) > 0


def test_autocast_state_is_restored_after_an_exception():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(Boom())
    apply_policy(model, Policy(layers={"0": "bf16"}))
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(1))
    assert not torch.is_autocast_enabled("cpu")


def test_grad_scaler_follows_the_policy():
    assert not grad_scaler(Policy(layers={"a": "bf16"}), "cpu").is_enabled()
    ls = LossScale(init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    scaler = grad_scaler(Policy(layers={"a": "fp16"}, loss_scale=ls), "cpu")
    assert scaler.is_enabled()
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (
        1024.0, 3.0, 0.25, 7,
    )  # fmt: skip
    static = grad_scaler(Policy(layers={"a": "fp16"}, loss_scale=LossScale(dynamic=False)), "cpu")
    assert static.get_growth_interval() == 2**31 - 1


def test_grad_scaler_reads_a_policy_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(Policy(layers={"a": "fp16"}).to_dict()))
    assert grad_scaler(path, "cpu").is_enabled()
