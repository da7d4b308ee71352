"""A policy with phases exported (autoprec/tune/export/_schedule.py): one file per phase, each the target's own export
of that phase alone (the reference), a manifest listing them with how the framework switches, and `autoprec verify`
checking each phase's file against its phase; a file swapped between phases, a manifest from another policy and a
missing one are caught."""

import json
import re

import pytest

from autoprec import Policy, UserError, load_policy
from autoprec.tune._cli import main
from autoprec.tune.export import SUFFIXES, TARGETS, export, export_target_named
from autoprec.tune.export.verify import verify_phases

ROLES = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
NAMES = [f"model.layers.{i}.{r}" for i in range(4) for r in ROLES]
# MXFP8 FFNs and NVFP4 attention, healed late: the attention to MXFP8 at 60%, everything to bf16 at 90%
SCHEDULE = Policy(
    layers={"": "bf16", **{n: ("mxfp8" if "mlp" in n else "nvfp4") for n in NAMES}},
    phases=[
        {"from_fraction": 0.6, "layers": {n: "mxfp8" for n in NAMES if "self_attn" in n}},
        {"from_fraction": 0.9, "layers": dict.fromkeys(NAMES, "bf16")},
    ],
)


def written(tmp_path, target, policy=SCHEDULE, name="p"):
    out = tmp_path / f"{name}_{target}{SUFFIXES[target]}"
    given = {"num_layers": 4} if target == "megatron" else {}
    return out, export(policy, target, out, source="p.json", **given)


def without_source(text):
    """An exported file less the line that names its source (the phase's file says which phase it is)."""
    return "\n".join(line for line in text.splitlines() if "p.json" not in line)


@pytest.mark.parametrize("target", TARGETS)
def test_each_phase_is_written_as_the_targets_export_of_that_phase_alone_with_a_manifest(tmp_path, target):
    out, lines = written(tmp_path, target)
    files = [out, out.with_name(f"{out.stem}_phase1{out.suffix}"), out.with_name(f"{out.stem}_phase2{out.suffix}")]
    for index, path in enumerate(files):
        alone = tmp_path / "alone" / path.name
        alone.parent.mkdir(exist_ok=True)
        given = {"num_layers": 4} if target == "megatron" else {}
        export(SCHEDULE.in_phase(index), target, alone, source="p.json", **given)
        assert without_source(path.read_text()) == without_source(alone.read_text()), index
    manifest = json.loads(out.with_name(f"{out.stem}_schedule.json").read_text())
    assert [(p["phase"], p["from_fraction"], p["file"]) for p in manifest["phases"]] == [
        (0, 0.0, files[0].name),
        (1, 0.6, files[1].name),
        (2, 0.9, files[2].name),
    ]
    assert manifest["phases"][2]["changes"] == dict.fromkeys(NAMES, "bf16")
    assert manifest["switch"] == export_target_named(target).switch and manifest["written_by"] == f"autoprec export --to {target}"
    said = lines[-1]
    assert said.startswith("note: a schedule of 3 phases, one file each") and export_target_named(target).switch in said
    # what a phase cannot express is said for that phase; each requirement (a note) once
    assert all(line.startswith(("note: ", "phase 0: ", "phase 1: ", "phase 2: ")) for line in lines)
    assert len([line for line in lines if line.startswith("note: ")]) == len(
        {line for line in lines if line.startswith("note: ")}
    )


@pytest.mark.parametrize("target", ["torchao", "torchtitan", "megatron-precision", "transformer-engine"])
def test_verify_checks_each_phases_file_against_its_phase_and_catches_a_file_of_the_wrong_phase(tmp_path, target):
    policy = Policy(
        layers={"": "bf16", **dict.fromkeys(NAMES, "mxfp8")},
        phases=[{"from_fraction": 0.75, "layers": dict.fromkeys(NAMES[:4], "bf16")}],
    )
    out, _ = written(tmp_path, target, policy)
    results = verify_phases(out, policy, NAMES)
    assert [heading.split(":")[0] for heading, _ in results] == ["phase 0 (from 0 of the run)", "phase 1 (from 0.75 of the run)"]
    assert all(result.ok for _, result in results)
    second = out.with_name(f"{out.stem}_phase1{out.suffix}")
    second.write_text(out.read_text())  # the first phase's file where the second's should be
    results = verify_phases(out, policy, NAMES)
    assert results[0][1].ok and results[1][1].differing == NAMES[:4]


def test_a_missing_or_foreign_manifest_is_one_error_saying_to_export_again(tmp_path):
    out, _ = written(tmp_path, "torchao")
    manifest = out.with_name(f"{out.stem}_schedule.json")
    other = Policy(layers=SCHEDULE.layers, phases=[{"from_fraction": 0.5, "layers": dict.fromkeys(NAMES, "bf16")}])
    with pytest.raises(UserError, match=re.escape("its phases start at [0.0, 0.6, 0.9], the policy's at [0.0, 0.5]")):
        verify_phases(out, other, NAMES)
    data = json.loads(manifest.read_text())
    data["phases"][1]["file"] = "../elsewhere.py"
    manifest.write_text(json.dumps(data))
    with pytest.raises(UserError, match="phase 1's file must be a file name beside it, got '../elsewhere.py'"):
        verify_phases(out, SCHEDULE, NAMES)
    manifest.unlink()
    with pytest.raises(UserError, match=r"the policy has a schedule \(3 phases\), but no p_torchao_schedule.json lists"):
        verify_phases(out, SCHEDULE, NAMES)


def test_the_commands_export_a_schedule_check_it_and_fail_on_a_wrong_phase_naming_it(tmp_path, capsys):
    policy = Policy(
        layers={"": "bf16", **dict.fromkeys(NAMES, "mxfp8")},
        phases=[{"from_fraction": 0.75, "layers": dict.fromkeys(NAMES[:4], "bf16")}],
    )
    policy.save(tmp_path / "p.json")
    (tmp_path / "names.txt").write_text("\n".join(NAMES) + "\n")
    argv = ["export", str(tmp_path / "p.json"), "--to", "torchtitan", "--check", str(tmp_path / "names.txt")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "phase 1 (from 0.75 of the run): " in out and "note: a schedule of 2 phases" in out
    (tmp_path / "p_torchtitan_phase1.py").write_text((tmp_path / "p_torchtitan.py").read_text())
    verify = [
        "verify",
        str(tmp_path / "p_torchtitan.py"),
        "--policy",
        str(tmp_path / "p.json"),
        "--model",
        str(tmp_path / "names.txt"),
    ]
    assert main(verify) == 1
    assert "autoprec: the export differs from the policy at model.layers.0.self_attn.q_proj" in capsys.readouterr().err
    assert main([*verify, "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["matches"] is False and [p["matches"] for p in record["phases"]] == [True, False]


def test_verify_checks_the_file_it_is_given_as_the_first_phase_and_refuses_an_empty_name(tmp_path):
    """A review found a manifest listing another file as the first phase made verify check that file, never the one
    named, and an empty name a pathlib traceback."""
    out, _ = written(tmp_path, "torchao")
    manifest = out.with_name(f"{out.stem}_schedule.json")
    data = json.loads(manifest.read_text())
    data["phases"][0]["file"] = data["phases"][1]["file"]
    manifest.write_text(json.dumps(data))
    with pytest.raises(UserError, match="its first phase is p_torchao_phase1.py, not p_torchao.py"):
        verify_phases(out, SCHEDULE, NAMES)
    data["phases"][0]["file"] = ""
    manifest.write_text(json.dumps(data))
    with pytest.raises(UserError, match="phase 0's file must be a file name beside it, got ''"):
        verify_phases(out, SCHEDULE, NAMES)
    assert json.loads(manifest.read_text())["start_step"] == "ceil(round(from_fraction * total_steps, 6)), counting steps from 0"


def test_a_policy_without_phases_written_over_a_schedule_removes_its_list_and_says_so(tmp_path):
    out, _ = written(tmp_path, "torchao")
    lines = export(SCHEDULE.in_phase(0), "torchao", out, source="p.json")
    assert not out.with_name("p_torchao_schedule.json").exists() and out.with_name("p_torchao_phase1.py").exists()
    assert lines[-1].startswith("note: removed p_torchao_schedule.json, an earlier export's list of a schedule's phases")


def test_a_schedules_export_never_replaces_or_removes_a_file_it_did_not_write(tmp_path):
    """A review found the export deleted a user's `train_schedule.json` (an LR schedule) when writing `train.py`, and
    the policy itself when it was named like the list, and overwrote a policy named like a phase's file."""
    theirs = tmp_path / "p_torchao_schedule.json"
    theirs.write_text('{"lr": [0.1, 0.01]}')
    export(SCHEDULE.in_phase(0), "torchao", tmp_path / "p_torchao.py", source="p.json")  # no phases: the list stays
    assert theirs.read_text() == '{"lr": [0.1, 0.01]}'
    with pytest.raises(UserError, match="p_torchao_schedule.json: exists and autoprec did not write it"):
        written(tmp_path, "torchao")
    assert theirs.read_text() == '{"lr": [0.1, 0.01]}'
    policy = tmp_path / "q_torchao_phase1.py"
    SCHEDULE.save(policy)
    with pytest.raises(
        UserError, match="q_torchao_phase1.py: the export of the schedule writes one of its files there, and it is the policy"
    ):
        export(SCHEDULE, "torchao", tmp_path / "q_torchao.py", source=str(policy))
    assert load_policy(policy) == SCHEDULE
    out, _ = written(tmp_path, "torchao", name="r")  # its own earlier files are replaced, as --out is
    written(tmp_path, "torchao", name="r")
