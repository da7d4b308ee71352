"""Checkpoints do not change under a policy: same keys, fp32 dtypes, strict loads both ways, also through a file."""

import pytest
import torch
from torch import nn

from autoprec import Policy, apply_policy

POLICY = Policy(layers={"": "bf16", "a": "fp8", "b": "fp16", "head": "fp32"})


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)  # buffers too: running statistics and a counter
        self.b = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.b(self.norm(self.a(x)))))


def _dtypes(model):
    return {k: v.dtype for k, v in model.state_dict().items()}


def _trained(model, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
    return model


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_keys_and_fp32_dtypes_do_not_change_even_after_training():
    plain = _dtypes(Net())
    applied = _trained(apply_policy(Net(), POLICY))
    assert _dtypes(applied) == plain
    assert {d for k, d in plain.items() if not k.endswith("num_batches_tracked")} == {torch.float32}


@pytest.mark.parametrize("through_file", [False, True], ids=["in memory", "torch.save + weights_only load"])
def test_a_policy_checkpoint_loads_strictly_into_a_plain_model_and_back(tmp_path, through_file):
    def roundtrip(state):
        if not through_file:
            return state
        path = tmp_path / "ckpt.pt"
        torch.save(state, path)
        return torch.load(path, weights_only=True)

    applied = _trained(apply_policy(Net(), POLICY))
    plain = Net(seed=1)
    plain.load_state_dict(roundtrip(applied.state_dict()), strict=True)
    _assert_same_state(plain, applied)

    fresh = apply_policy(Net(seed=3), POLICY)
    fresh.load_state_dict(roundtrip(_trained(Net(seed=4)).state_dict()), strict=True)
    assert type(fresh.a).__name__ == "Float8Linear"  # loading weights keeps the policy in place
    x = torch.randn(4, 16)
    fresh.eval()
    assert fresh(x).dtype == torch.float32 and torch.isfinite(fresh(x)).all()


def test_a_loaded_checkpoint_gives_the_same_outputs_as_the_model_it_came_from():
    source = _trained(apply_policy(Net(), POLICY)).eval()
    target = apply_policy(Net(seed=5), POLICY).eval()
    target.load_state_dict(source.state_dict(), strict=True)
    x = torch.randn(4, 16)
    assert torch.equal(source(x), target(x))
