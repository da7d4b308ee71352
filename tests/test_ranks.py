"""A search of a model that trains sharded (FSDP2's fully_shard) under torchrun, on 2 CPU processes (gloo): one policy
recording the layout, ranks that never disagree on a candidate, a rank's failure named without a hang, a rerun that
resumes the study; and the rules by which the ranks agree on what each measured."""

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoprec.devices import BlockTime
from autoprec.errors import UserError
from autoprec.policy import load_policy
from autoprec.tune._measure import _ranks
from autoprec.tune._measure._timing import DeviceClock, Step

MODEL = Path(__file__).parent / "models" / "sharded_decoder.py"
SPACE = """\
default: [fp32, bf16]
layers:
  Linear: [fp32, bf16]
prune:
  slower_than: 1000   # bf16 is kept in play whatever this CPU runs it at: the tests check the ranks, not a speed
sampler: random
"""


# fp8 kept in play on this CPU (torchao's emulation, whose time says nothing of fp8's): the setting beside the formats
FP8_SPACE = """\
default: [fp32, bf16]
layers:
  Linear: [fp32, fp8]
prune:
  slower_than: 1000000000   # no speed judged: a format that only runs emulated here stays offered
sampler: random
"""


def torchrun(tmp_path, *args, fail=None, timeout=240, space_text=SPACE):
    """`torchrun --nproc_per_node 2 -m autoprec search` of the sharded decoder; (exit code, stdout, stderr)."""
    space = tmp_path / "space.yaml"
    space.write_text(space_text)
    (tmp_path / "log").mkdir(exist_ok=True)
    env = {**os.environ, "AUTOPREC_TEST_LOG": str(tmp_path / "log"), "OMP_NUM_THREADS": "1"}
    env.pop("AUTOPREC_TEST_FAIL", None)
    if fail:
        env["AUTOPREC_TEST_FAIL"] = fail
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "autoprec", "search", str(MODEL), "--space", str(space), "--out", str(tmp_path / "out")]
    command += ["--device", "cpu", "--no-compile", "--budget", "0.05", "--time-every-trial", *args]
    # its own session: a hang is killed whole (torchrun and its workers), never left running past the test
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        pytest.fail(f"the sharded search hung past {timeout} s: {err[-2000:]}")
    return job.returncode, out, err


def complete(tmp_path):
    """The study's complete trials, from trials.csv (which lists the warm starts still waiting too)."""
    with open(tmp_path / "out" / "trials.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row["state"] == "COMPLETE"]


def built(tmp_path, rank):
    """The policies rank `rank` sharded a model for, in order (the test model logs each)."""
    return (tmp_path / "log" / f"rank{rank}.log").read_text().splitlines()


@pytest.mark.slow  # two torchrun jobs of two processes, about 30 s each
def test_a_sharded_search_writes_one_policy_with_its_layout_the_ranks_agree_and_a_rerun_resumes(tmp_path):
    code, out, err = torchrun(tmp_path, "--trials", "3")
    assert code == 0, err[-3000:]
    policy = json.loads((tmp_path / "out" / "policy.json").read_text())
    assert policy["measured"]["layout"] == {"world_size": 2, "mesh": [2], "parallelize": "sharded_decoder.py:parallelize"}
    said = "sharded over 2 ranks (mesh 2, by sharded_decoder.py:parallelize)"  # the summary says it (issue 60, 9)
    assert said in " ".join(out.split()) and said in " ".join((tmp_path / "out" / "summary.md").read_text().split())
    # rank 0 reports, once; rank 1 took its part quietly. Counted by the summary's last line, which every outcome
    # prints once (a policy that wins also names itself in the headline: "chosen:" would count the outcome)
    assert out.count("policy.json, profile.csv, profile.json, grad_ranges.csv") == 1, out
    # every candidate rank 0 measured, rank 1 built too, in the same order: only rank 0 decides one
    assert len(built(tmp_path, 0)) > 3 and built(tmp_path, 0) == built(tmp_path, 1)
    assert any('"bf16"' in line for line in built(tmp_path, 0))  # trials beyond the all-fp32 start
    first = complete(tmp_path)
    assert len(first) == 3
    code, out, err = torchrun(tmp_path, "--trials", "5")
    assert code == 0, err[-3000:]
    again = complete(tmp_path)
    measured = ("trial", "metric", "step_ms", "fp32_step_ms", "speedup")
    kept = [{k: row[k] for k in measured} for row in again[:3]]
    assert len(again) == 5 and kept == [{k: row[k] for k in measured} for row in first]  # its 3 trials as measured: 2 more
    assert built(tmp_path, 0) == built(tmp_path, 1)


@pytest.mark.slow  # a torchrun job of two processes, about 80 s
def test_a_sharded_search_tries_the_fp8_all_gather_beside_the_formats_and_every_rank_gathers_alike(tmp_path):
    code, out, err = torchrun(tmp_path, "--trials", "8", "--seed", "3", space_text=FP8_SPACE)
    assert code == 0, err[-3000:]
    rows = complete(tmp_path)
    assert all(row["fp8_all_gather"] in ("True", "False") for row in rows)  # trials.csv shows the setting
    linears = ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head")
    lowered = [row for row in rows if "fp8" in {row[name] for name in linears}]
    assert {row["fp8_all_gather"] for row in lowered} == {"True", "False"}, rows  # both tried (seeded draws)
    assert all(row["fp8_all_gather"] == "False" for row in rows if row not in lowered)  # none to gather: never on
    logged = [json.loads(line) for line in built(tmp_path, 0)]
    assert built(tmp_path, 0) == built(tmp_path, 1)  # the same candidates, the same layers gathered in fp8, on each rank
    gathering = [entry for entry in logged if entry["fp8_all_gather"]]
    assert gathering and all({entry["layers"][n] for n in entry["fp8_all_gather"]} == {"fp8"} for entry in gathering)
    policy = load_policy(tmp_path / "out" / "policy.json")  # valid: on only with an fp8 layer to gather
    assert policy.measured["layout"]["world_size"] == 2


@pytest.mark.slow
def test_a_rank_that_fails_on_a_candidate_ends_that_trial_naming_the_rank_and_the_search_goes_on(tmp_path):
    code, out, err = torchrun(tmp_path, "--trials", "3", fail="1:lowered")
    assert code == 0, err[-3000:]
    errors = [row["error"] for row in complete(tmp_path)]
    assert "OnRankError: rank 1 of 2: RuntimeError: this rank cannot shard a lowered Linear" in errors  # a trial's end
    assert errors[0] == ""  # all-fp32 ran on both
    assert json.loads((tmp_path / "out" / "policy.json").read_text())["measured"]["layout"]["world_size"] == 2


@pytest.mark.slow
def test_a_rank_that_fails_inside_fsdps_collectives_ends_the_run_on_every_rank_naming_it_within_the_timeout(tmp_path):
    # rank 1's evaluate raises while rank 0's waits in FSDP's all-gather for it: no agreement can reach rank 0 there,
    # so the run ends at --rank-timeout (30 s here), rank 1 having said at once what failed
    code, out, err = torchrun(tmp_path, "--trials", "3", "--rank-timeout", "0.5", fail="1:evaluate", timeout=150)
    assert code != 0
    assert "autoprec: rank 1: metric failed here: RuntimeError: evaluate broke on this rank" in err
    assert "autoprec: error (rank 1):" in err and "autoprec: error: rank 0 of 2:" in err  # each rank's one line
    assert not (tmp_path / "out" / "policy.json").exists()


@pytest.mark.slow
def test_a_rank_whose_model_py_checks_fail_is_named_by_rank_0_at_once(tmp_path):
    """Rank 1's build_model raised: rank 1 said so, rank 0 said nothing and waited in the mesh for it until the
    timeout (issue 60, 8). Every rank's checks are agreed first, so rank 0 names rank 1 and its error, exit 2."""
    code, out, err = torchrun(tmp_path, "--trials", "1", "--rank-timeout", "2", fail="1:build", timeout=100)
    assert code != 0  # (torchrun's own report of its failed workers follows the ranks' lines)
    assert "autoprec: error (rank 1):" in err and "build_model broke on this rank" in err
    assert "autoprec: error: rank 1 of 2: " in err  # rank 0's one line, naming rank 1's error
    assert err.count("build_model broke on this rank") == 2 and "no answer" not in err


def test_a_sharded_search_leaves_fp16_out_of_the_default_space_and_refuses_a_space_file_offering_it(capsys):
    """The sharded search offered fp16 without a word though docs/sharded.md says to search bf16 and fp8: each rank's
    GradScaler skips steps on its own, and 3 of 6 trials skipped steps (issue 60, 8)."""
    import argparse

    from autoprec.tune._commands._shared import _without_fp16
    from autoprec.tune._core._space import load_space

    default = load_space()
    assert "layers.Linear" in default.loss_scaled()  # the case: the default space offers fp16
    args = argparse.Namespace(space=None, quiet=False, json=False)
    space = _without_fp16(args, default)
    assert space.loss_scaled() == [] and "fp16 left out of the default space" in capsys.readouterr().err
    assert [f.value for f in space.layers["Linear"]] == [f.value for f in default.layers["Linear"] if f.value != "fp16"]
    with pytest.raises(UserError, match=r"space.yaml: layers.Linear.* offer.* fp16.*take fp16 out of the space file"):
        _without_fp16(argparse.Namespace(space="space.yaml", quiet=False, json=False), default)
    no_fp16 = default.without_loss_scaled()
    assert _without_fp16(argparse.Namespace(space="space.yaml", quiet=False, json=False), no_fp16) is no_fp16


def test_torchrun_ranks_reads_torchruns_environment():
    assert _ranks.torchrun_ranks({}) is None
    assert _ranks.torchrun_ranks({"WORLD_SIZE": "1", "RANK": "0"}) is None  # one rank: a search as on one device
    assert _ranks.torchrun_ranks({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"}) == (2, 4, 0)
    with pytest.raises(UserError, match="WORLD_SIZE='two'.*whole numbers"):
        _ranks.torchrun_ranks({"WORLD_SIZE": "two"})


def test_the_ranks_agree_on_the_slowest_block_the_largest_peak_and_the_mean_metric():
    blocks = [BlockTime(0.010, host_s=0.004, held=True), BlockTime(0.012, host_s=0.003, held=False)]
    assert _ranks._slowest(blocks) == BlockTime(0.012, host_s=0.004, held=False)  # a step is as slow as its slowest rank
    assert _ranks._slowest([BlockTime(0.5), BlockTime(0.7)]) == BlockTime(0.7)
    assert _ranks._largest([3, 7]) == 7 and _ranks._largest([3, None]) is None  # unmeasured on a rank: unknown
    assert _ranks._mean([1.0, 2.0]) == 1.5
    assert torch.isnan(torch.tensor(_ranks._mean([1.0, float("nan")])))  # non-finite on any rank: the candidate's


def test_layout_is_what_the_policy_file_records():
    layout = _ranks.Layout(world_size=8, mesh=(2, 4), parallelize="model.py:parallelize")
    assert layout.to_dict() == {"world_size": 8, "mesh": [2, 4], "parallelize": "model.py:parallelize"}


def test_the_clock_times_work_that_runs_on_every_rank_there_once_per_block():
    told = []

    class OnRanks:
        def __call__(self):
            raise AssertionError("stepped one call at a time by the leader's clock")

        def time_on_ranks(self, calls, *, kernels=False):
            told.append((calls, kernels))
            return BlockTime(0.25)

    work = OnRanks()
    assert DeviceClock().time(work, 8, torch.device("cpu")) == BlockTime(0.25)
    assert DeviceClock().time(Step(work, None, kernels=True), 4, torch.device("cpu")) == BlockTime(0.25)
    assert told == [(8, False), (4, True)]


def test_a_sharded_search_needs_an_initialised_job():
    assert not torch.distributed.is_initialized()
    with pytest.raises(UserError, match="run it under torchrun"):
        _ranks.Ranks(torch.device("cpu"), lambda model, mesh: None, where="model.py:parallelize")


def _search_from_python(rank, world, port, folder):
    """One rank of a script that calls autoprec.tune.search under its own torch.distributed job (gloo)."""
    import importlib.util

    import torch.distributed as dist

    import autoprec.tune

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOPREC_TEST_LOG=str(Path(folder) / "log"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = importlib.util.spec_from_file_location("sharded_decoder", MODEL)
        model_py = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(model_py)
        result = autoprec.tune.search(
            model_py.build_model(),
            model_py.loss_fn,
            model_py.batches("train"),
            evaluate=model_py.evaluate,
            parallelize=model_py.parallelize,
            budget=0.05,
            trials=2,
            device="cpu",
            compile=False,
            progress=False,
            space=str(Path(folder) / "space.yaml"),
            predict_speed=False,
        )
        said = None if result is None else {"layout": result.policy.measured["layout"]}
        Path(folder, f"result{rank}.json").write_text(json.dumps(said))
        # every rank done before any tears gloo down, as the CLI's torchrun job does: a rank leaving while its peer
        # still talks aborts the peer (SIGABRT, "terminate called without an active exception", seen in CI); on
        # success only, so a rank that raised is not left waiting for one that never comes
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes, about 30 s
def test_a_script_calling_search_on_every_rank_gets_the_result_on_rank_0_and_none_elsewhere(tmp_path):
    import socket

    import torch.multiprocessing as mp

    (tmp_path / "space.yaml").write_text(SPACE)
    (tmp_path / "log").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_search_from_python, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    assert json.loads((tmp_path / "result0.json").read_text()) == {
        "layout": {"world_size": 2, "mesh": [2], "parallelize": "Decoder:parallelize"}
    }
    assert json.loads((tmp_path / "result1.json").read_text()) is None  # rank 1 took its part; rank 0 holds the result
    assert built(tmp_path, 0) == built(tmp_path, 1)


def leading(parallelize):
    """A Ranks of one leading a small workload, as Ranks.lead sets it up."""
    import dataclasses

    from autoprec.tune import load_task, prepare

    ranks = _ranks.Ranks(torch.device("cpu"), parallelize, where="overflow_mlp.py:parallelize")
    workload = dataclasses.replace(
        prepare(load_task(Path(__file__).parent / "models" / "overflow_mlp.py"), "cpu"), sharding=ranks
    )
    ranks.workload = workload
    return ranks, workload


def test_a_dropped_handle_and_a_candidate_that_could_not_be_built_leave_no_trainer_behind(one_rank):
    import gc

    from autoprec import Policy
    from autoprec.apply import applied_policy
    from autoprec.tune._core._records import Candidate
    from autoprec.tune._measure._trainer import new_trainer

    def parallelize(model, mesh):
        if any(str(f) != "fp32" for f in applied_policy(model).layers.values()):
            raise RuntimeError("cannot shard a lowered layer")

    ranks, workload = leading(parallelize)
    handle = new_trainer(workload, Policy())
    assert isinstance(handle, _ranks.RankedTrainer) and list(ranks._trainers) == [handle.key]
    handle.step()
    assert handle.steps == 1 and handle.finite and handle.skipped == 0
    assert handle.time_on_ranks(2).seconds > 0
    with pytest.raises(RuntimeError, match="cannot shard a lowered layer"):
        new_trainer(workload, Policy(layers={"": "bf16"}))  # built nowhere here, its key released all the same
    del handle
    gc.collect()
    assert ranks.metric(workload, Candidate(Policy())) == pytest.approx(ranks.metric(workload, Candidate(Policy())))
    assert ranks._trainers == {}  # both went with that message


def test_a_candidate_built_here_but_not_on_another_rank_is_released_here_with_the_next_message(one_rank, monkeypatch):
    from autoprec import Policy
    from autoprec.tune._measure._trainer import new_trainer

    ranks, workload = leading(lambda model, mesh: None)
    gather = ranks._gather
    # the trainer op as a second rank answers it: built here, not there
    monkeypatch.setattr(ranks, "world", 2)
    monkeypatch.setattr(ranks, "_gather", lambda mine: [mine, (_ranks._Failure(False, False, "RuntimeError: boom"), True, None)])
    with pytest.raises(_ranks.OnRankError, match=r"^rank 1 of 2: RuntimeError: boom$"):
        new_trainer(workload, Policy())
    assert len(ranks._trainers) == 1 and ranks._released == list(ranks._trainers)  # built here, to go
    monkeypatch.setattr(ranks, "_gather", gather)
    monkeypatch.setattr(ranks, "world", 1)
    ranks.metric(workload, Policy())
    assert ranks._trainers == {}


def test_the_ranks_check_their_weights_and_batches_are_the_same_before_searching(one_rank, monkeypatch):
    ranks, workload = leading(lambda model, mesh: None)
    ranks._check_same(workload)  # one rank: the same as itself
    other = {"weights": "0" * 16, "batches": f"{_ranks._digest(workload.train)} {_ranks._digest(workload.eval)}"}
    monkeypatch.setattr(ranks, "_gather", lambda mine: [mine, other])  # as a second rank with other weights answers
    with pytest.raises(UserError, match=r"rank 1's weights differ from rank 0's.*seed build_model"):
        ranks._check_same(workload)
    assert _ranks._digest(workload.train) != _ranks._digest(workload.train[:-1])  # one batch fewer: other batches
