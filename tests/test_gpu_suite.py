"""The GPU suite's --smoke run on a CPU: the same parts and files as on a GPU, tiny, so it cannot rot while no
GPU is at hand (its numbers mean nothing)."""

import csv
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_suite_smoke_runs_the_tests_the_benchmarks_and_a_compiled_search_and_writes_the_summary(tmp_path):
    out = tmp_path / "suite"
    env_cache = {"AUTOPREC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_suite.py",
            "--smoke",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--pack",
            str(tmp_path / "pack"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, **env_cache},
        timeout=3600,
    )  # fmt: skip  (a hang guard only: --smoke has no deadline, its work is bounded by its sizes, so load only slows it)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("tests.txt", "fp8_linear.txt", "overhead.txt", "summary.md", "search-gpt2/policy.json"):
        assert (out / name).is_file(), name
    assert "speedup over bf16: fp8" in (out / "fp8_linear.txt").read_text()
    result = json.loads((out / "search-gpt2" / "result.json").read_text())
    names = {f["candidate"] for f in result["finals"]}
    assert {"fp32", "uniform bf16", "profile greedy"} <= names and result["chosen"] in names
    policy = json.loads((out / "search-gpt2" / "policy.json").read_text())
    assert policy["measured"]["compiled"] is True
    summary = (out / "summary.md").read_text()
    assert "| gpt2 (tiny) |" in summary and "policy / bf16" in summary
    assert "Peak memory per training step" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| gpt2 (tiny) |") and "iB" in line)
    assert row.count("iB") >= 3  # fp32, uniform bf16 and the policy measured on this CPU (fp8 everywhere: not here)
    # the timing tables a replay serves: each profiled layer x format, and whole steps of fp32, uniform bf16 and a
    # random policy, each timed beside fp32 with its spread and samples
    layers = list(csv.DictReader(open(out / "tables-gpt2" / "layer_times.csv")))
    assert layers and {"layer", "format", "time_ms", "time_spread"} <= set(layers[0])
    steps = list(csv.DictReader(open(out / "tables-gpt2" / "step_times.csv")))
    # the random policy is drawn from the profile's choices, which this machine's speed narrows (a format measured
    # grossly slower here is ruled out, on a loaded CPU fp16 too): where it leaves fp32 and bf16 alone there is none
    named = [r["policy"] for r in steps]
    assert named[:2] == ["fp32", "uniform bf16"] and named[2:] in ([], ["random 1"])
    for r in steps:
        assert r["state"] == "COMPLETE" and float(r["step_ms"]) > 0 and float(r["fp32_step_ms"]) > 0, r
        assert len(r["samples_ms"].split()) == int(r["rounds"]) and r["(default)"] in ("fp32", "bf16")
    assert "Timing tables for a replay" in summary
    status = json.loads((out / "status.json").read_text())
    assert {p: s["state"] for p, s in status.items()} == dict.fromkeys(["tests", "bench", "gpt2", "tables-gpt2"], "complete")
    assert sorted(f.name for f in (tmp_path / "pack").iterdir()) == ["status.json", "suite.tar.gz", "summary.md"]
    with tarfile.open(tmp_path / "pack" / "suite.tar.gz") as tar:
        assert "suite/tables-gpt2/step_times.csv" in tar.getnames()


@pytest.mark.slow
def test_gpu_suite_refuses_an_unknown_part_and_packs_what_there_is_when_no_time_is_left(tmp_path):
    def suite(*args):
        cmd = [sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--device", "cpu", "--out", str(tmp_path / "out"), *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)  # a hang guard only

    proc = suite("--part", "gpt2,gtp2")
    assert proc.returncode == 2 and "unknown gtp2" in proc.stderr and "tables-gpt2" in proc.stderr
    proc = suite("--part", "tests,gpt2", "--deadline-s", "1", "--pack", str(tmp_path / "pack"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = json.loads((tmp_path / "pack" / "status.json").read_text())
    assert set(status) == {"tests", "gpt2"} and all(s["state"].startswith("not started") for s in status.values())


def _suite_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_suite_refuses_a_gpu_other_than_the_one_its_command_names(monkeypatch):
    import argparse

    import torch

    suite = _suite_module()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    args = argparse.Namespace(smoke=False, out=None, device="cuda", gpu="h100")
    assert suite.gpu_problem(args) == (
        "--gpu h100: this machine's device is NVIDIA H200, not an H100; run with --gpu h200 (results/h200)"
    )
    assert suite.gpu_problem(argparse.Namespace(smoke=False, out=None, device="cuda", gpu="h200")) is None
    assert "needs --out" in suite.gpu_problem(argparse.Namespace(smoke=True, out=None, device="cpu", gpu="h100"))


def test_a_tables_folder_timed_on_another_device_is_timed_again(tmp_path):
    """A fresh machine of another kind resumes the same folder: its rows are not this device's numbers."""
    suite = _suite_module()
    fields = ["trial", "policy", "state", "step_ms"]
    with open(tmp_path / "step_times.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerow({"trial": 0, "policy": "fp32", "state": "COMPLETE", "step_ms": 1.5})
    assert suite.kept_rows(tmp_path, "NVIDIA H100 80GB HBM3", fields) == {}  # no device.json: where is unknown
    assert not (tmp_path / "step_times.csv").exists()  # moved aside, so a stop now cannot leave them to be reused
    (tmp_path / "step_times.unknown.csv").rename(tmp_path / "step_times.csv")
    (tmp_path / "device.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    assert suite.kept_rows(tmp_path, "NVIDIA H200", fields)["fp32"]["step_ms"] == "1.5"
    assert suite.kept_rows(tmp_path, "NVIDIA H100 80GB HBM3", fields) == {}
    assert (tmp_path / "step_times.NVIDIA_H200.csv").is_file() and not (tmp_path / "step_times.csv").exists()
    (tmp_path / "step_times.NVIDIA_H200.csv").rename(tmp_path / "step_times.csv")
    assert suite.kept_rows(tmp_path, "NVIDIA H200", [*fields, "layer"]) == {}  # other columns: other choices
