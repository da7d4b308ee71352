"""The Python API: a search from a model and its batches, the same code path (and study) as the command line."""

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from short_timing import FAST_PROFILE, TINY

import autoprec.tune
from autoprec import Policy
from autoprec.tune import load_task
from autoprec.tune._cli import main
from autoprec.tune._core._space import space_from_dict

MODELS = Path(__file__).parent / "models"
FAST = {"timing": TINY, "final_timing": TINY, "profile": FAST_PROFILE, "finalists": 1, "progress": False}
SPACE = {
    "default": ["fp32", "bf16"],
    "layers": {"Linear": ["fp32", "bf16", "fp16"]},
    "prune": {"slower_than": 1e6},
    "sampler": "random",
}  # no timing prunes: the choices are the same every run


def overflow_task():
    return load_task(MODELS / "overflow_mlp.py")


def test_a_search_from_python_returns_the_policy_writes_the_clis_files_and_leaves_the_model_alone(tmp_path):
    task = overflow_task()
    model = task.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = autoprec.tune.search(
        model, task.loss_fn, task.batches("train"), task.batches("eval"), evaluate=task.evaluate, budget=0.05, trials=3,
        device="cpu", out=tmp_path, space=space_from_dict(SPACE), name="net", **FAST,
    )  # fmt: skip
    assert isinstance(result.policy, Policy) and result.policy.layers["big"].value != "fp16"  # it overflows fp16
    for name in ("policy.json", "summary.md", "trials.csv", "finalists.csv", "profile.csv", "profile.png", "study.journal"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "policy.json").read_text()) == result.policy.to_dict()
    assert result.policy.measured["model"] == "net" and result.policy.measured["budget"] == 0.05
    assert "uniform bf16" in result.summary() and "| uniform bf16 |" in result.summary(markdown=True)
    assert "autoprec.tune.search(net, budget='0.05', seed=0)" in (tmp_path / "summary.md").read_text()
    # the caller's model: same weights, same object types, not wrapped, still on its device
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.fc1) is torch.nn.Linear and next(model.parameters()).device.type == "cpu"


def test_without_out_nothing_is_kept_on_disk_and_the_default_budget_is_relative(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.chdir(tmp_path / "cwd" if (tmp_path / "cwd").mkdir() is None else tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    task = overflow_task()
    result = autoprec.tune.search(task.build_model(), task.loss_fn, task.batches("train"), task.batches("eval"),
                                  evaluate=task.evaluate, trials=2, device="cpu", space=space_from_dict(SPACE), **FAST)  # fmt: skip
    assert list((tmp_path / "cwd").iterdir()) == [] and list((tmp_path / "tmp").iterdir()) == []
    assert result.storage.startswith("not kept")
    m = result.policy.measured
    assert m["budget"] == float(f"{0.01 * abs(m['fp32_metric']):.4g}") and m["budget_given"].startswith("1% of |fp32 metric")


@pytest.mark.slow
def test_the_api_and_the_command_line_run_the_same_study_from_the_same_seed(tmp_path, monkeypatch):
    """One code path: from the same profile (the API reuses the one the CLI saved, as a rerun would: its timings
    shape the greedy warm start) and a seeded random sampler, both propose the same policies in the same order."""
    import shutil

    space_file = tmp_path / "space.yaml"
    space_file.write_text(json.dumps(SPACE), encoding="utf-8")  # JSON is YAML
    pipeline = sys.modules["autoprec.tune._search._pipeline"]
    real = pipeline.search

    def quick(workload, space, config, out, **kw):  # the CLI's settings, with the same short timings as the API's
        import dataclasses

        return real(workload, space, dataclasses.replace(config, **FAST), out, **kw)

    monkeypatch.setattr(pipeline, "search", quick)
    argv = ["search", str(MODELS / "overflow_mlp.py"), "--budget", "0.05", "--trials", "5", "--seed", "7", "--device", "cpu",
            "--out", str(tmp_path / "cli"), "--space", str(space_file), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    monkeypatch.setattr(pipeline, "search", real)
    (tmp_path / "api").mkdir()
    for name in ("profile.csv", "profile.json", "grad_ranges.csv"):
        shutil.copy(tmp_path / "cli" / name, tmp_path / "api" / name)
    task = overflow_task()
    autoprec.tune.search(task.build_model(), task.loss_fn, task.batches("train"), task.batches("eval"), evaluate=task.evaluate,
                         budget=0.05, trials=5, seed=7, device="cpu", out=tmp_path / "api", space=space_file,
                         name="overflow_mlp", **FAST)  # fmt: skip
    formats = ["(default)", "fc1", "big", "head"]
    cli, api = (pd.read_csv(tmp_path / d / "trials.csv")[formats] for d in ("cli", "api"))
    assert len(cli) == 5 and cli.equals(api)


def test_a_wrong_argument_is_named():
    task = overflow_task()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        autoprec.tune.search(task.build_model, task.loss_fn, [])
    with pytest.raises(ValueError, match=r"budget must be .* but got '-1%'"):
        autoprec.tune.search(task.build_model(), task.loss_fn, task.batches("train"), budget="-1%")
    with pytest.raises(TypeError, match="sweep\\(\\) needs budgets="):
        autoprec.tune.sweep(task.build_model(), task.loss_fn, task.batches("train"))
    with pytest.raises(TypeError, match="positional arguments"):  # budgets and the rest by keyword only
        autoprec.tune.sweep(task.build_model(), task.loss_fn, task.batches("train"), task.batches("eval"), [0, 0.05])
    with pytest.raises(ValueError, match=r"budgets are its own list \(0,1%\), so config.budget='0.5' would be a second"):
        autoprec.tune.sweep(task.build_model(), task.loss_fn, task.batches("train"), task.batches("eval"), budgets="0,1%",
                            budget=0.5, device="cpu")  # fmt: skip
    with pytest.raises(TypeError, match="evaluate must be a function, got float"):
        autoprec.tune.search(task.build_model(), task.loss_fn, task.batches("train"), evaluate=0.5)


def test_a_sys_exit_or_a_wrong_optimizer_in_the_functions_given_is_a_user_error_before_anything_runs(tmp_path):
    """As from a model.py: sys.exit() in evaluate (first called to resolve the relative budget) would end the
    caller's script silently; an optimizer hook given the model instead of its parameters is found on the
    first batch, not after the profile."""
    task = overflow_task()
    model, train, held_out = task.build_model(), task.batches("train"), task.batches("eval")

    def evaluate(model):
        sys.exit(0)

    with pytest.raises(autoprec.UserError, match=r"^MLP: evaluate\(\) called sys.exit\(0\)"):
        autoprec.tune.search(
            model, task.loss_fn, train, held_out, evaluate=evaluate, device="cpu", out=tmp_path / "a", name="MLP", **FAST
        )
    with pytest.raises(autoprec.UserError, match=r"optimizer\(model\) raised TypeError.*model.parameters\(\)"):
        autoprec.tune.search(model, task.loss_fn, train, held_out, optimizer=lambda m: torch.optim.SGD(m, lr=0.1), device="cpu",
                             out=tmp_path / "b", **FAST)  # fmt: skip
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("limit, expected", [("1GB", 10**9), (2e9, 2 * 10**9), (3 * 2**30, 3 * 2**30)])
@pytest.mark.slow
def test_max_memory_from_python_takes_a_size_or_a_number_of_bytes(tmp_path, limit, expected):
    task = overflow_task()
    result = autoprec.tune.search(
        task.build_model(), task.loss_fn, task.batches("train"), task.batches("eval"), evaluate=task.evaluate, budget=0.05,
        trials=2, device="cpu", out=tmp_path, space=space_from_dict(SPACE), max_memory=limit, **FAST,
    )  # fmt: skip
    assert result.policy.measured["max_memory"] == expected
    assert result.finals.by_name(result.policy.measured["chosen"]).fits  # a tiny MLP needs far less


def test_a_malformed_max_memory_from_python_is_refused_before_anything_runs(tmp_path):
    task = overflow_task()
    with pytest.raises(autoprec.UserError, match=r"--max-memory 'lots': not a size"):
        autoprec.tune.search(task.build_model(), task.loss_fn, task.batches("train"), task.batches("eval"), device="cpu",
                             out=tmp_path / "o", max_memory="lots", **FAST)  # fmt: skip
    assert not (tmp_path / "o").exists()
