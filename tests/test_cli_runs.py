"""The profile and train-mode search verbs end to end on tiny models, with the measurements cut short."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import autoprec.tune.sweeper  # noqa: F401  (the fixture patches its module)
from autoprec import load_policy
from autoprec.tune import ProfileConfig
from autoprec.tune.cli import main
from autoprec.tune.measure import TimingConfig

MODELS = Path(__file__).parent / "models"
TINY = TimingConfig(warmup=1, rounds=2, min_block_s=0.0)
FAST_PROFILE = ProfileConfig(batches=1, timing=TINY)


@pytest.fixture
def fast(monkeypatch):
    """The verbs' own code path, with short timing: profile() and search() get fast configs."""
    profile_module, search_module = sys.modules["autoprec.tune.profiler"], sys.modules["autoprec.tune.searcher"]
    real_profile, real_search = profile_module.profile, search_module.search

    def profile(workload, space, config=None, **kw):
        return real_profile(workload, space, FAST_PROFILE, progress=False)

    def search(workload, space, config, out):
        quick = dataclasses.replace(config, timing=TINY, final_timing=TINY, profile=FAST_PROFILE, finalists=1, progress=False)
        return real_search(workload, space, quick, out)

    sweep_module = sys.modules["autoprec.tune.sweeper"]
    real_sweep = sweep_module.sweep

    def sweep(workload, space, budgets, config, out):
        quick = dataclasses.replace(config, timing=TINY, final_timing=TINY, profile=FAST_PROFILE, finalists=1, progress=False)
        return real_sweep(workload, space, budgets, quick, out)

    monkeypatch.setattr(profile_module, "profile", profile)
    monkeypatch.setattr(search_module, "search", search)
    monkeypatch.setattr(sweep_module, "sweep", sweep)


def test_profile_writes_csvs_heat_maps_and_a_gradient_summary(fast, capsys, tmp_path):
    code = main(["profile", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    for name in ("profile.csv", "profile.json", "grad_ranges.csv", "profile.png", "grad_ranges.png"):
        assert (tmp_path / name).is_file(), name
    assert "fp16 loss scale" in out and "recommended loss scale 2^" in out and "high end set by head" in out
    assert "inf/nan" in out  # big overflows fp16


def test_train_mode_search_writes_mode_steps_and_noise_floor(fast, capsys, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("default: [fp32]\nlayers: {Linear: [fp32, fp16]}\nprune: {slower_than: 100}\n", encoding="utf-8")
    argv = ["search", str(MODELS / "underflow_mlp.py"), "--budget", "0.03", "--device", "cpu", "--out", str(tmp_path / "out"),
            "--space", str(space), "--trials", "3", "--mode", "train", "--train-steps", "8", "--noise-runs", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    measured = json.loads((tmp_path / "out" / "policy.json").read_text())["measured"]
    assert measured["mode"] == "train" and measured["train_steps"] == 8 and measured["noise_floor"] is not None
    assert "noise floor" in out and "train mode: 8 steps" in out
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## Gradient ranges" in summary and "(profile.png)" in summary


def test_sweep_writes_a_table_a_pareto_plot_and_a_policy_per_budget(fast, capsys, tmp_path):
    argv = ["sweep", str(MODELS / "overflow_mlp.py"), "--budgets", "0.3,0,0.05", "--device", "cpu", "--out", str(tmp_path),
            "--trials", "6"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in ("sweep.csv", "sweep.md", "pareto.png", "sweep_trials.csv", "profile.png", *(f"policy-budget-{b}.json" for b in ("0", "0.05", "0.3"))):
        assert (tmp_path / name).is_file(), name
    assert "profile greedy" in out and "Pareto front" in out and "policy-budget-0.05.json" in out
    assert load_policy(tmp_path / "policy-budget-0.05.json").measured["budget"] == 0.05
    md = (tmp_path / "sweep.md").read_text()
    assert "## Pareto front of the study" in md and "(pareto.png)" in md
    assert "'overflow_mlp-sweep'" in out  # its own study, beside a search's in the same storage
