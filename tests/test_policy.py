"""autoprec/policy.py: Policy and LossScale, the policy file's validation and messages, model fingerprint."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from autoprec.errors import UserError
from autoprec.formats import Format
from autoprec.policy import POLICY_VERSION, ROOT, LossScale, Policy, load_policy, model_fingerprint

ALLOWED_FORMATS = "fp32, bf16, fp16, fp8"

VALID = {
    "version": 1,
    "layers": {"": "bf16", "fc1": "fp16", "fc2": "fp8", "head": "fp32"},
    "loss_scale": {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 500, "dynamic": True},
}


def valid() -> dict:
    return copy.deepcopy(VALID)


# ---- Policy in code ----------------------------------------------------------------------------


def test_policy_defaults_and_formats():
    policy = Policy(layers={"fc1": "bf16"})
    assert policy.layers == {"fc1": Format.BF16}
    assert isinstance(policy.layers["fc1"], Format)
    assert policy.loss_scale == LossScale()
    assert policy.version == POLICY_VERSION == 1
    assert policy.measured is None
    assert not policy.uses_fp16


def test_policy_accepts_format_values_and_reports_fp16():
    policy = Policy(layers={ROOT: Format.BF16, "head": "fp16"})
    assert policy.layers == {"": Format.BF16, "head": Format.FP16}
    assert policy.uses_fp16


def test_policy_loss_scale_from_mapping():
    policy = Policy(layers={}, loss_scale=VALID["loss_scale"])
    assert policy.loss_scale == LossScale(init_scale=1024.0, growth_interval=500)


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Policy().layers = {}  # type: ignore[misc]


def test_policy_bad_format_names_layer_value_and_choices():
    with pytest.raises(ValueError) as info:
        Policy(layers={"fc1": "int4"})
    msg = str(info.value)
    assert "fc1" in msg and "'int4'" in msg and ALLOWED_FORMATS in msg


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"layers": ["fc1"]}, "layers must map module names to formats"),
        ({"layers": {1: "bf16"}}, "module names (str)"),
        ({"loss_scale": 3}, "loss_scale must be a LossScale"),
        ({"version": 2}, "version must be 1, but got 2"),
        ({"measured": [1]}, "measured must be an object"),
    ],
)
def test_policy_invalid_in_code(kwargs, expected):
    with pytest.raises(ValueError) as info:
        Policy(**kwargs)
    assert expected in str(info.value)


def test_policy_save_load_round_trip(tmp_path):
    policy = Policy(
        layers={ROOT: "bf16", "fc1": "fp16", "fc2": "fp8", "head": "fp32"},
        loss_scale=LossScale(init_scale=2.0**12, growth_factor=3.0, backoff_factor=0.25, growth_interval=100, dynamic=False),
        measured={"device": "cpu: test", "budget": 0.01, "results": {}},
    )
    path = policy.save(tmp_path / "sub" / "policy.json")
    assert path.is_file()
    loaded = load_policy(path)
    assert loaded.to_dict() == policy.to_dict()
    assert loaded == policy
    assert json.loads(path.read_text())["layers"] == {"": "bf16", "fc1": "fp16", "fc2": "fp8", "head": "fp32"}


def test_to_dict_is_plain_json():
    data = Policy(layers={"fc1": "fp8"}).to_dict()
    assert data == {"version": 1, "layers": {"fc1": "fp8"}, "loss_scale": LossScale().to_dict()}
    assert type(data["layers"]["fc1"]) is str and json.loads(json.dumps(data)) == data


def test_fsdp_fp8_all_gather_is_a_policy_setting_written_only_where_it_is_on(tmp_path):
    on = Policy(layers={ROOT: "bf16", "fc1": "fp8", "fc2": "fp8-rowwise"}, fsdp_fp8_all_gather=True)
    assert on.fp8_gatherable == {Format.FP8}  # torchao all-gathers the tensorwise recipe only
    assert on.to_dict()["fsdp_fp8_all_gather"] is True and load_policy(on.save(tmp_path / "on.json")) == on
    off = dataclasses.replace(on, fsdp_fp8_all_gather=False)
    assert "fsdp_fp8_all_gather" not in off.to_dict()  # a file without it reads as before
    assert Policy.from_dict({**off.to_dict(), "fsdp_fp8_all_gather": False}) == off


def test_fsdp_fp8_all_gather_without_a_layer_fsdp2_gathers_in_fp8_is_refused_naming_the_formats(tmp_path):
    with pytest.raises(ValueError, match=r"no layer runs in a format FSDP2 can all-gather in fp8 \(fp8, fp8-fwd-dgrad\)"):
        Policy(layers={"fc1": "fp8-rowwise"}, fsdp_fp8_all_gather=True)
    msg = load_error(write(tmp_path, {**valid(), "fsdp_fp8_all_gather": "yes"}))
    assert "fsdp_fp8_all_gather must be true or false, but got 'yes'" in msg


# ---- load_policy errors ------------------------------------------------------------------------


def write(tmp_path, content) -> str:
    path = tmp_path / "policy.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return str(path)


def load_error(path) -> str:
    with pytest.raises(UserError) as info:
        load_policy(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    return msg


def test_load_policy_valid(tmp_path):
    policy = load_policy(write(tmp_path, valid()))
    assert policy.layers["fc2"] is Format.FP8 and policy.loss_scale.growth_interval == 500


def test_load_policy_missing_file(tmp_path):
    assert "no such policy file" in load_error(tmp_path / "nope.json")


def test_load_policy_malformed_json(tmp_path):
    msg = load_error(write(tmp_path, '{"version": 1,\n  "layers": }\n'))
    assert "not valid JSON" in msg and "line 2 column 13" in msg


def test_load_policy_not_utf8(tmp_path):
    path = tmp_path / "policy.json"
    path.write_bytes(b'{"version": "\xff"}')
    assert "not UTF-8" in load_error(path)


def test_load_policy_not_an_object(tmp_path):
    msg = load_error(write(tmp_path, "[1, 2]"))
    assert "must be a JSON object" in msg and "got list" in msg


def test_load_policy_unknown_top_level_key(tmp_path):
    data = valid()
    data["layer"] = {}
    msg = load_error(write(tmp_path, data))
    assert "unknown field 'layer'" in msg and "version, layers, loss_scale, measured" in msg


@pytest.mark.parametrize("field", ["version", "layers"])
def test_load_policy_missing_field(tmp_path, field):
    data = valid()
    del data[field]
    msg = load_error(write(tmp_path, data))
    assert f"missing field {field!r}" in msg and '{"version": 1, "layers": {"": "bf16"}}' in msg


def test_a_hand_written_policy_without_loss_scale_gets_gradscalers_defaults(tmp_path):
    """Only fp16 layers use the GradScaler: a policy written by hand for bf16/fp8 layers need not say its settings."""
    data = valid()
    del data["loss_scale"]
    assert load_policy(write(tmp_path, data)).loss_scale == LossScale()


@pytest.mark.parametrize("version", [2, 0, "1", True])
def test_load_policy_wrong_version(tmp_path, version):
    data = valid()
    data["version"] = version
    assert f"version must be 1, but got {version!r}" in load_error(write(tmp_path, data))


def test_load_policy_unknown_format(tmp_path):
    data = valid()
    data["layers"]["fc1"] = "int8"
    msg = load_error(write(tmp_path, data))
    assert "layers['fc1']" in msg and "'int8'" in msg and ALLOWED_FORMATS in msg


def test_load_policy_layers_not_an_object(tmp_path):
    data = valid()
    data["layers"] = ["fc1", "fc2"]
    msg = load_error(write(tmp_path, data))
    assert "layers must map module names" in msg and ALLOWED_FORMATS in msg


def test_load_policy_measured_not_an_object(tmp_path):
    data = valid()
    data["measured"] = "yesterday"
    assert "measured must be an object" in load_error(write(tmp_path, data))


def test_load_policy_loss_scale_not_an_object(tmp_path):
    data = valid()
    data["loss_scale"] = 65536
    msg = load_error(write(tmp_path, data))
    assert "loss_scale must be an object" in msg and "growth_interval" in msg


def test_load_policy_loss_scale_unknown_field(tmp_path):
    data = valid()
    data["loss_scale"]["scale"] = 1.0
    msg = load_error(write(tmp_path, data))
    assert "loss_scale: unknown field 'scale'" in msg and "init_scale" in msg


@pytest.mark.parametrize("field", ["init_scale", "growth_factor", "backoff_factor", "growth_interval", "dynamic"])
def test_load_policy_loss_scale_missing_field(tmp_path, field):
    data = valid()
    del data["loss_scale"][field]
    assert f"loss_scale: missing field {field!r}" in load_error(write(tmp_path, data))


@pytest.mark.parametrize(
    "field, value",
    [
        ("growth_interval", "often"),
        ("growth_interval", 2.5),
        ("growth_interval", True),
        ("init_scale", "big"),
        ("init_scale", True),
        ("dynamic", "yes"),
        ("dynamic", 1),
        ("backoff_factor", None),
    ],
)
def test_load_policy_loss_scale_wrong_type(tmp_path, field, value):
    data = valid()
    data["loss_scale"][field] = value
    msg = load_error(write(tmp_path, data))
    assert f"loss_scale.{field} must be" in msg and repr(value) in msg


@pytest.mark.parametrize(
    "field, value, rule",
    [
        ("backoff_factor", 1.5, "in (0, 1)"),
        ("backoff_factor", 0, "in (0, 1)"),
        ("init_scale", -1, "> 0"),
        ("init_scale", 0, "> 0"),
        ("growth_factor", 1.0, "> 1"),
        ("growth_interval", 0, ">= 1"),
    ],
)
def test_load_policy_loss_scale_out_of_range(tmp_path, field, value, rule):
    data = valid()
    data["loss_scale"][field] = value
    msg = load_error(write(tmp_path, data))
    assert f"loss_scale.{field} must be {rule}" in msg and str(value) in msg


def test_load_policy_loss_scale_nan(tmp_path):
    data = valid()
    data["loss_scale"]["init_scale"] = float("nan")
    assert "loss_scale.init_scale must be a finite number, but got nan" in load_error(write(tmp_path, data))  # json writes NaN


# ---- what a policy file may hold: module names, numbers Python can read --------------------------

HOSTILE_NAME = 'x"""+str(__import__("os").system("touch pwned"))+"""'


@pytest.mark.parametrize("name", ["", "fc1", "0", "blocks.3.attn.qkv", "encoder.layer.11.output.dense", "conv-1.bn_2", "ñorm"])
def test_a_layer_name_is_a_module_path(name):
    assert list(Policy(layers={name: "bf16"}).layers) == [name]


@pytest.mark.parametrize(
    "name",
    [HOSTILE_NAME, "a..b", ".a", "a.", "a b", "fc1\n", "\x1b]0;title\x07", "\x1b[2J", "a\rb", "a/b", "a'b", "a\\b", "a\u202eb"],
)
def test_a_layer_name_that_is_not_a_module_path_is_refused_by_name_and_rule(tmp_path, name):
    with pytest.raises(ValueError) as info:
        Policy(layers={name: "bf16"})
    assert repr(name) in str(info.value) and "module path" in str(info.value)
    data = valid()
    data["layers"][name] = "bf16"
    msg = load_error(write(tmp_path, data))
    assert repr(name) in msg and "blocks.3.attn.qkv" in msg and len(msg.splitlines()) == 1
    assert all(ch.isprintable() for ch in msg)  # the message itself cannot drive a terminal


def test_a_long_layer_name_is_shown_cut_short():
    with pytest.raises(ValueError) as info:
        Policy(layers={"a b" * 10_000: "bf16"})
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("where", ["measured", "loss_scale", "layers"])
def test_a_number_too_long_for_python_to_read_is_one_error_naming_the_file(tmp_path, where):
    big = "9" * 5000  # past Python's int max str digits (4300): json.loads raises a bare ValueError
    text = json.dumps(valid()).replace(
        '"growth_interval": 500', f'"growth_interval": {big}' if where == "loss_scale" else '"growth_interval": 500'
    )
    text = text.replace('"fc1": "fp16"', f'"fc1": {big}' if where == "layers" else '"fc1": "fp16"')
    if where == "measured":
        text = text[:-1] + f', "measured": {{"budget": {big}}}}}'
    msg = load_error(write(tmp_path, text))
    assert "4300 digits" in msg and len(msg.splitlines()) == 1


@pytest.mark.parametrize(
    "field, value, rule",
    [("init_scale", 10**400, "a finite number"), ("init_scale", 1e39, "at most"), ("growth_factor", 10**400, "a finite number"),
     ("growth_interval", 2**31, "at most 2147483647"), ("growth_interval", 10**4000, "at most 2147483647")],
    ids=["init_scale-10e400", "init_scale-1e39", "growth_factor-10e400", "growth_interval-2e31", "growth_interval-10e4000"],
)  # fmt: skip
def test_a_loss_scale_number_grad_scaler_cannot_hold_is_refused(tmp_path, field, value, rule):
    """GradScaler keeps the scale in a float32 tensor and counts clean steps in an int32 one: beyond those, a
    policy would load and then fail in the training loop (OverflowError, RuntimeError) instead."""
    data = valid()
    data["loss_scale"][field] = value
    msg = load_error(write(tmp_path, data))
    assert f"loss_scale.{field} must be" in msg and rule in msg and len(msg) < 400


# ---- LossScale ---------------------------------------------------------------------------------


def test_loss_scale_defaults_match_grad_scaler():
    ls = LossScale()
    scaler = torch.amp.GradScaler("cpu")
    assert ls.init_scale == scaler.get_scale() == 2.0**16
    assert (ls.growth_factor, ls.backoff_factor, ls.growth_interval, ls.dynamic) == (2.0, 0.5, 2000, True)
    assert LossScale.from_dict(ls.to_dict()) == ls


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"init_scale": math.nan}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"dynamic": "yes"}, "dynamic"),
    ],
)
def test_loss_scale_validation(kwargs, field):
    with pytest.raises(ValueError) as info:
        LossScale(**kwargs)
    msg = str(info.value)
    assert f"loss_scale.{field}" in msg and repr(next(iter(kwargs.values()))) in msg


def test_loss_scale_rejects_infinite_growth_factor():
    with pytest.raises(ValueError, match="growth_factor"):
        LossScale(growth_factor=math.inf)


def test_loss_scale_from_dict_converts_numbers_to_float():
    ls = LossScale.from_dict({**VALID["loss_scale"], "init_scale": 1024, "growth_factor": 2})
    assert isinstance(ls.init_scale, float) and isinstance(ls.growth_factor, float)
    assert isinstance(ls.growth_interval, int)


# ---- model_fingerprint -------------------------------------------------------------------------


def mlp(hidden: int = 32, act: type[nn.Module] = nn.ReLU, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, hidden), act(), nn.Linear(hidden, 32), nn.Linear(32, 4))


def test_fingerprint_same_architecture_same_hash():
    a, b = mlp(seed=0), mlp(seed=1)
    assert not torch.equal(a[0].weight, b[0].weight)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert len(model_fingerprint(a)) == 16 and int(model_fingerprint(a), 16) >= 0


@pytest.mark.parametrize(
    "other",
    [lambda: mlp(hidden=64), lambda: mlp(act=nn.GELU), lambda: nn.Sequential(*mlp())[:3]],
    ids=["layer-shape", "module-type", "layer-removed"],
)
def test_fingerprint_changes_with_structure(other):
    assert model_fingerprint(other()) != model_fingerprint(mlp())


# ---- a schedule: phases ------------------------------------------------------------------------------------------


def scheduled() -> dict:
    return {
        **valid(),
        "phases": [{"from_fraction": 0.8, "layers": {"fc2": "bf16"}}, {"from_fraction": 0.9, "layers": {"fc1": "bf16"}}],
    }


def test_a_schedule_round_trips_through_the_file_and_a_policy_without_one_writes_no_phases(tmp_path):
    policy = Policy.from_dict(scheduled())
    assert load_policy(policy.save(tmp_path / "p.json")) == policy and policy.scheduled
    assert policy.to_dict()["phases"] == scheduled()["phases"]
    assert "phases" not in Policy.from_dict(valid()).to_dict()
    assert policy.phase_layers(0) == policy.layers
    assert policy.phase_layers(1) == {**policy.layers, "fc2": Format.BF16}
    assert policy.in_phase(2) == Policy(layers={"": "bf16", "fc1": "bf16", "fc2": "bf16", "head": "fp32"},
                                        loss_scale=policy.loss_scale)  # fmt: skip


@pytest.mark.parametrize(
    ("step", "total", "phase"),
    [
        (0, 100, 0),
        (79, 100, 0),
        (80, 100, 1),
        (89, 100, 1),
        (90, 100, 2),
        (99, 100, 2),
        (7, 10, 0),
        (8, 10, 1),
        (1, 3, 0),
        (2, 3, 1),
    ],
)
def test_the_phase_of_a_step_starts_at_ceil_of_the_fraction_of_the_run(step, total, phase):
    # 0.8 of 3 steps is 2.4: the phase starts at step 3 (counted from 0), after the share is passed; 0.9 of 3 is 2.7
    assert Policy.from_dict(scheduled()).phase_at(step, total) == (phase if total != 3 else 0)


def test_a_fraction_written_as_step_over_steps_starts_at_that_step_for_any_run_length():
    for steps in (3, 7, 30, 999, 10**6 + 3, 10**9 + 7):
        for step in (1, steps // 3, steps - 1):
            policy = Policy(layers={"a": "fp8"}, phases=[{"from_fraction": step / steps, "layers": {"a": "bf16"}}])
            assert policy.phases[0].start_step(steps) == step, (step, steps)


def test_a_phase_with_fp16_turns_the_grad_scaler_on_from_the_start():
    assert Policy(layers={"a": "bf16"}, phases=[{"from_fraction": 0.5, "layers": {"a": "fp16"}}]).uses_fp16
    assert not Policy(layers={"a": "bf16"}, phases=[{"from_fraction": 0.5, "layers": {"a": "fp32"}}]).uses_fp16


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ({"from_fraction": 0.5}, "phases must be a list"),
        ([{"from_fraction": 0, "layers": {"fc1": "bf16"}}], r"phases\[0\]: a phase's from_fraction must be a number between 0 and 1 \(exclusive\).*got 0"),
        ([{"from_fraction": 1.0, "layers": {"fc1": "bf16"}}], "between 0 and 1"),
        ([{"from_fraction": True, "layers": {"fc1": "bf16"}}], "between 0 and 1.*got True"),
        ([{"from_fraction": "0.5", "layers": {"fc1": "bf16"}}], "between 0 and 1.*got '0.5'"),
        ([{"from_fraction": 0.5, "layers": {}}], "at least one module name"),
        ([{"from_fraction": 0.5, "layers": {"fc1": "fp7"}}], r"phases\[0\]: the phase's layers\['fc1'\] must be one of fp32, bf16, .*but got 'fp7'"),
        ([{"from_fraction": 0.5, "layers": {"a b": "bf16"}}], "is not a module path"),
        ([{"from_fraction": 0.5, "layers": {"fc1": "bf16"}, "until": 0.9}], r"phases\[0\]: unknown field 'until'"),
        ([{"layers": {"fc1": "bf16"}}], r"phases\[0\]: missing field 'from_fraction'"),
        ([{"from_fraction": 0.5, "layers": {"fc1": "fp16"}}], r"phases\[0\] \(from_fraction 0.5\) changes no layer's format"),
        ([{"from_fraction": 0.6, "layers": {"fc1": "bf16"}}, {"from_fraction": 0.6, "layers": {"fc2": "bf16"}}],
         r"phases\[1\] starts at from_fraction 0.6, not after phases\[0\] \(0.6\): list the phases in the order they start"),
    ],
)  # fmt: skip
def test_a_bad_phase_is_one_error_naming_the_file_the_phase_and_the_rule(tmp_path, phases, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**valid(), "phases": phases}))
    with pytest.raises(UserError, match=message) as caught:
        load_policy(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_fp8_all_gather_with_a_schedule_is_refused_since_a_switch_cannot_follow_it():
    with pytest.raises(ValueError, match="fsdp_fp8_all_gather is true in a policy with phases.*write one policy per phase"):
        Policy(layers={"fc1": "fp8"}, fsdp_fp8_all_gather=True, phases=[{"from_fraction": 0.5, "layers": {"fc1": "bf16"}}])


@pytest.mark.parametrize(("step", "total"), [(-1, 10), (0, 0), (True, 10), (1.0, 10)])
def test_phase_at_refuses_a_step_or_run_length_out_of_range(step, total):
    with pytest.raises(ValueError, match="must be a whole number"):
        Policy.from_dict(scheduled()).phase_at(step, total)
