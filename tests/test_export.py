"""`autoprec export --to torchao`: the file, loaded and run with torchao, converts exactly the policy's fp8 layers
with their recipes, and lists what it cannot express."""

import importlib.util
import json

import pytest
from torch import nn

from autoprec import Policy
from autoprec.tune.cli import main
from autoprec.tune.export import export

POLICY = Policy(layers={"": "bf16", "a": "fp8", "b": "fp8-rowwise", "c": "bf16", "d": "fp32", "e.0": "fp8"})


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))
        self.e = nn.Sequential(nn.Linear(32, 32))
        self.f = nn.Linear(32, 32)  # not in the policy


def load(path):
    spec = importlib.util.spec_from_file_location(f"exported_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_torchao_file_converts_exactly_the_policys_fp8_layers_with_their_recipes(tmp_path):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    left_out = export(POLICY, "torchao", tmp_path / "policy_torchao.py")
    model = load(tmp_path / "policy_torchao.py").convert(Net())
    converted = {n: m.config for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert set(converted) == {"a", "b", "e.0"}
    assert converted["a"] == converted["e.0"] == Float8LinearConfig.from_recipe_name("tensorwise")
    assert converted["b"] == Float8LinearConfig.from_recipe_name("rowwise")
    assert [type(m) for m in (model.c, model.d, model.f)] == [nn.Linear] * 3
    assert len(left_out) == 2 and "model root" in left_out[0] and "bf16" in left_out[0] and "'c' runs in bf16" in left_out[1]
    assert all(line in (tmp_path / "policy_torchao.py").read_text() for line in left_out)  # in the file, too


def test_the_export_verb_writes_beside_the_policy_and_lists_what_it_left_out(tmp_path, capsys):
    POLICY.save(tmp_path / "policy.json")
    assert main(["export", str(tmp_path / "policy.json"), "--to", "torchao"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"wrote {tmp_path / 'policy_torchao.py'}" and len(out) == 3 and out[2].startswith("not expressed: layer 'c'")
    assert main(["export", str(tmp_path / "policy.json"), "--to", "torchao", "--out", str(tmp_path / "x.py"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["file"] == str(tmp_path / "x.py")
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["export", str(tmp_path / "policy.json"), "--to", "megatron"])
    assert "invalid choice: 'megatron'" in capsys.readouterr().err


def test_a_policy_without_fp8_layers_says_the_file_converts_nothing(tmp_path):
    left_out = export(Policy(layers={"a": "bf16"}), "torchao", tmp_path / "p.py")
    assert left_out[-1] == "the policy has no fp8 layer: the file's convert(model) changes nothing"
    model = load(tmp_path / "p.py").convert(Net())
    assert all(type(m) in (nn.Linear, nn.Sequential, Net) for m in model.modules())
