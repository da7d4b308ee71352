"""The GPU suite's --smoke run on a CPU: the same parts and files as on a GPU, tiny, so it cannot rot while no
GPU is at hand (its numbers mean nothing)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_smoke_runs_the_tests_the_benchmarks_and_a_compiled_search_and_writes_the_summary(tmp_path):
    out = tmp_path / "suite"
    env_cache = {"AUTOPREC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--device", "cpu", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, env={**__import__("os").environ, **env_cache}, timeout=600,
    )  # fmt: skip
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
