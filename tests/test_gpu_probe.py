"""The one-call GPU probe (benchmarks/gpu_probe.py) on a CPU: which rows it names host-bound, which stages a call may
name, and what its search's tarball keeps of a search stopped at the deadline (its numbers: a GPU's only)."""

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from autoprec.devices import BlockTime

ROOT = Path(__file__).resolve().parents[1]


def _probe_module():
    spec = importlib.util.spec_from_file_location("gpu_probe", ROOT / "benchmarks" / "gpu_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class HostBoundGPU:
    """A GPU's clock on a host-bound step, as the H200 measured GPT-2-small's bf16 one: 28 ms a step by the events,
    the host 27 ms issuing it, the GPU busy 8.5 ms of it (a held block times that alone)."""

    def time(self, work, calls, device):
        if getattr(work, "kernels", False):
            return BlockTime(0.0085 * calls, host_s=0.027 * calls, held=True)
        work()
        return BlockTime(0.028 * calls, host_s=0.027 * calls)


class Counted:
    def __init__(self):
        self.steps = 0

    def __call__(self):
        self.steps += 1


def test_the_probe_names_a_host_bound_step_from_autoprecs_own_timing():
    """configs() left TimingConfig.busy off, so the GPU's busy time was never measured beside the rounds and no row
    was ever named host-bound (the H200's bf16 step is: 8.5 ms busy of 28)."""
    probe = _probe_module()
    for smoke in (False, True):
        _, new = probe.configs(smoke)
        rows = probe.timed_rows("a", "gpt2", "autoprec", {"uniform bf16": Counted()}, torch.device("cpu"), new, HostBoundGPU())
        assert rows[0]["host_bound"] is True and rows[0]["median_ms"] == pytest.approx(28.0), smoke
        assert rows[0]["busy_ms"] == pytest.approx(8.5)


def test_a_call_names_its_stages_and_never_times_the_llama_candidates_twice():
    """GPU_PLAN's calls: `--stages search,d`, then `--stages a`. Stage c times uniform bf16 and torchao's filters on
    the Llama model, which the search's final re-measure times beside its policy: never both in one call."""
    probe = _probe_module()
    assert probe.stages_named("search,d") == ["search", "d"] and probe.stages_named(" a ") == ["a"]
    assert probe.stages_named(",".join(probe.DEFAULT_STAGES)) == list(probe.DEFAULT_STAGES)
    assert "c" not in probe.DEFAULT_STAGES and probe.DEFAULT_STAGES[:2] == ("search", "d")
    for wrong, said in (("search,c", "final re-measure"), ("a,a", "each stage once"), ("e", "must name"), ("", "must name")):
        with pytest.raises(ValueError, match=said):
            probe.stages_named(wrong)
    assert probe.NEEDS["a"] >= 120  # measured 105-120 s on the H200, where 60 s were reserved


def test_the_search_tarball_keeps_the_trial_log_and_the_rounds_of_a_search_stopped_at_its_deadline(tmp_path):
    probe = _probe_module()
    folder = tmp_path / "search"
    folder.mkdir()
    for name in ("study.journal", "trials.csv", "finalists.partial.csv", "profile.csv", "profile.json", "space.yaml"):
        (folder / name).write_text(name)
    (folder / ".trials.csv.0123.tmp").write_text("torn")  # a write the kill cut short: not a result
    probe.pack_search(folder, tmp_path / "c_search.tar.gz")
    with tarfile.open(tmp_path / "c_search.tar.gz") as tar:
        names = sorted(tar.getnames())
    assert names == sorted(f"search-llama/{n}" for n in
                           ("study.journal", "trials.csv", "finalists.partial.csv", "profile.csv", "profile.json", "space.yaml"))  # fmt: skip


@pytest.mark.slow
def test_the_probe_smoke_runs_the_plans_first_call_on_a_cpu(tmp_path):
    """`gpu_probe.py --smoke --stages search,d`: the plan's first call, tiny and eager on this CPU (minutes)."""
    out = tmp_path / "probe"
    cmd = [sys.executable, "benchmarks/gpu_probe.py", "--smoke", "--out", str(out), "--stages", "search,d"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)  # a hang guard: no deadline
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert {k: v["state"] for k, v in status.items() if k != "device"} == {"search": "complete", "d": "complete"}
    with tarfile.open(out / "c_search.tar.gz") as tar:
        names = tar.getnames()
    assert {"search-llama/trials.csv", "search-llama/study.journal", "search-llama/finalists.csv"} <= set(names)
