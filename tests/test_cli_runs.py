"""The profile and train-mode search verbs end to end on tiny models, with the measurements cut short."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
from short_timing import FAST_PROFILE, TINY

import autoprec.tune._search._sweeper  # noqa: F401  (the fixture patches its module)
from autoprec import load_policy
from autoprec.tune._cli import main
from autoprec.tune._core._records import FINALS_VERSION

MODELS = Path(__file__).parent / "models"


@pytest.fixture
def fast(monkeypatch):
    """The verbs' own code path, with short timing: profile() and search() get fast configs."""
    profile_module, search_module = (
        sys.modules["autoprec.tune._measure._profiler"],
        sys.modules["autoprec.tune._search._pipeline"],
    )
    real_profile, real_search = profile_module.profile, search_module.search

    def profile(workload, space, config=None, **kw):
        return real_profile(workload, space, FAST_PROFILE, progress=False)

    def search(workload, space, config, out, **kw):
        quick = dataclasses.replace(config, timing=TINY, final_timing=TINY, profile=FAST_PROFILE, finalists=1, progress=False)
        return real_search(workload, space, quick, out, **kw)

    sweep_module = sys.modules["autoprec.tune._search._sweeper"]
    real_sweep = sweep_module.sweep

    def sweep(workload, space, budgets, config, out, **kw):
        quick = dataclasses.replace(config, timing=TINY, final_timing=TINY, profile=FAST_PROFILE, finalists=1, progress=False)
        return real_sweep(workload, space, budgets, quick, out, **kw)

    monkeypatch.setattr(profile_module, "profile", profile)
    monkeypatch.setattr(search_module, "search", search)
    monkeypatch.setattr(sweep_module, "sweep", sweep)


def test_profile_writes_csvs_heat_maps_and_a_gradient_summary(fast, capsys, tmp_path):
    space = tmp_path / "space.yaml"  # nothing ruled out for its speed (fp16 is slow on CPUs): fp16 runs, and overflows
    space.write_text("default: [fp32]\nlayers: {Linear: [fp32, bf16, fp16]}\nprune: {slower_than: 100}\n", encoding="utf-8")
    code = main(["profile", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--out", str(tmp_path), "--space", str(space)])
    out = capsys.readouterr().out
    assert code == 0
    for name in ("profile.csv", "profile.json", "grad_ranges.csv", "profile.png", "grad_ranges.png"):
        assert (tmp_path / name).is_file(), name
    assert "fp16 loss scale" in out and "recommended loss scale 2^" in out and "high end set by head" in out
    assert "inf/nan" in out  # big overflows fp16
    # it ends with the short answer: which layer breaks, worst first; big's fp16 output overflows
    last = out.rstrip().split("\n\n")[-1].splitlines()
    assert last[0].startswith("which layer breaks, worst first")
    row = last[last.index(next(line for line in last if line.startswith("-----"))) + 1].split()
    assert row[:3] == ["big", "fp16", "fprop"] and "overflow" in " ".join(row)
    argv = ["profile", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--out", str(tmp_path), "--space", str(space)]
    assert main([*argv, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["breaks"]
    assert found[0]["layer"] == "big" and found[0]["gemm"] == "fprop" and found[0]["sqnr_db"] is None  # non-finite: null


@pytest.mark.slow
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


@pytest.mark.slow
def test_sweep_writes_a_table_a_pareto_plot_and_a_policy_per_budget(fast, capsys, tmp_path):
    argv = ["sweep", str(MODELS / "overflow_mlp.py"), "--budgets", "0.3,0,0.05", "--device", "cpu", "--out", str(tmp_path),
            "--trials", "6"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in (
        "sweep.csv",
        "sweep.md",
        "pareto.png",
        "sweep_trials.csv",
        "profile.png",
        *(f"policy-budget-{b}.json" for b in ("0", "0.05", "0.3")),
    ):
        assert (tmp_path / name).is_file(), name
    assert "profile greedy" in out and "Pareto front" in out and "policy-budget-0.05.json" in out
    assert load_policy(tmp_path / "policy-budget-0.05.json").measured["budget"] == 0.05
    md = (tmp_path / "sweep.md").read_text()
    assert "## Pareto front of the study" in md and "(pareto.png)" in md
    assert "'overflow_mlp-sweep'" in out  # its own study, beside a search's in the same storage


# ---- the default and relative budgets, --json, --quiet, autoprec's own log prefix ---------------------------


@pytest.mark.slow
def test_search_without_a_budget_allows_one_percent_of_the_fp32_metric_and_says_so(fast, capsys, tmp_path):
    assert main(["search", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--out", str(tmp_path), "--trials", "2"]) == 0
    out, err = capsys.readouterr()
    measured = load_policy(tmp_path / "policy.json").measured
    fp32 = measured["fp32_metric"]
    # rounded to 4 significant digits: a rerun whose evaluation differs in the last bits is the same study
    assert measured["budget"] == float(f"{0.01 * abs(fp32):.4g}") and measured["budget"] > 0
    assert measured["budget_given"] == f"1% of |fp32 metric {fp32:.6g}| = {0.01 * abs(fp32):.4g}"
    assert f"budget {measured['budget_given']} (the default; --budget sets another)" in err
    assert f"budget {measured['budget_given']}" in out and measured["budget_given"] in (tmp_path / "summary.md").read_text()


def small_search_argv(out) -> list[str]:
    """`autoprec search` of tests/models/overflow_mlp.py: 2 trials, budget 0.05, into `out`."""
    return ["search", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--out", str(out), "--trials", "2", "--budget", "0.05"]


@pytest.mark.slow
def test_json_prints_the_result_as_one_object_and_quiet_prints_nothing(fast, capsys, tmp_path):
    argv = small_search_argv(tmp_path)
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # the whole of stdout is one object
    assert result["policy_file"] == str(tmp_path / "policy.json")
    assert result["policy"] == json.loads((tmp_path / "policy.json").read_text())
    assert "on cpu, eager" not in err  # stderr holds no chatter either, only the progress bars (off here)
    assert main([*argv, "--quiet"]) == 0  # the study is finished: its result stands, nothing re-measured
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"autoprec: study 'overflow_mlp' is finished and its result in {tmp_path} stands "
                                              "(nothing re-measured); pass --remeasure to re-measure its finalists and "
                                              "choose again, or --trials N for more trials (--time-every-trial past an early stop)"]  # fmt: skip
    assert json.loads((tmp_path / "policy.json").read_text()) == result["policy"]
    assert main(["show", str(tmp_path / "policy.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == result["policy"]["layers"]


@pytest.mark.slow
def test_rerunning_a_finished_study_keeps_its_result_unless_asked_to_remeasure(fast, capsys, tmp_path, monkeypatch):
    pipeline = sys.modules["autoprec.tune._search._pipeline"]
    real, calls = pipeline.final_remeasure, []
    monkeypatch.setattr(pipeline, "final_remeasure", lambda *a, **k: calls.append(1) or real(*a, **k))
    argv = small_search_argv(tmp_path)
    assert main(argv) == 0 and len(calls) == 1
    first = (tmp_path / "policy.json").read_text()
    assert main(argv) == 0 and (tmp_path / "policy.json").read_text() == first  # byte for byte: not even rewritten
    assert len(calls) == 1 and "its result in" in capsys.readouterr().err
    # the summary's hint, followed: the standing result is priced against the run, nothing re-measured (issue 60, 10)
    assert main([*argv, "--run-steps", "1000"]) == 0 and len(calls) == 1
    assert "of a 1,000-step run" in capsys.readouterr().out and "of a 1,000-step run" in (tmp_path / "summary.md").read_text()
    assert json.loads((tmp_path / "policy.json").read_text())["measured"]["run_steps"] == 1000
    assert main([*argv, "--remeasure"]) == 0 and len(calls) == 2
    assert "its result in" not in capsys.readouterr().err
    cost = json.loads((tmp_path / "policy.json").read_text())["measured"]["cost"]  # no trial ran: none is charged to it
    assert not any(name.startswith("trials:") for name in cost["seconds"])
    assert cost["counts"]["trials: run earlier, none now (their time is in the earlier run's table)"] == 2
    assert main([*argv, "--storage", str(tmp_path / "other.journal")]) == 0 and len(calls) == 3  # another study: measured
    assert main(argv) == 0 and len(calls) == 4  # the policy there is the other storage's: not this study's result
    # more trials (every one timed: under --timings slower two policies are left, and the stopping rule would end it)
    more = [*argv[:-2], "--budget", "0.05", "--trials", "3", "--time-every-trial"]
    assert main(more) == 0 and len(calls) == 5  # more trials: measured again
    assert json.loads((tmp_path / "policy.json").read_text())["measured"]["study"]["complete"] == 3


@pytest.mark.slow
def test_a_finished_studys_finalists_file_of_another_version_is_re_measured_with_one_line(fast, capsys, tmp_path, monkeypatch):
    pipeline = sys.modules["autoprec.tune._search._pipeline"]
    real, calls = pipeline.final_remeasure, []
    monkeypatch.setattr(pipeline, "final_remeasure", lambda *a, **k: calls.append(1) or real(*a, **k))
    argv = small_search_argv(tmp_path)
    assert main(argv) == 0 and len(calls) == 1
    capsys.readouterr()
    path = tmp_path / "finalists.csv"
    pd.read_csv(path).drop(columns="version").to_csv(path, index=False)  # as a version without the column wrote it
    assert main(argv) == 0 and len(calls) == 2  # its result does not stand: the finalists are measured again
    err = capsys.readouterr().err
    assert (
        f"autoprec: {path}: written by another autoprec version (format version none; this version reads {FINALS_VERSION}); re-measuring the finalists"
        in err.splitlines()
    )
    assert "its result in" not in err and pd.read_csv(path)["version"].eq(FINALS_VERSION).all()


@pytest.mark.slow
def test_a_sweep_takes_relative_budgets_beside_absolute_ones(fast, capsys, tmp_path):
    argv = [
        "sweep",
        str(MODELS / "overflow_mlp.py"),
        "--budgets",
        "0,1%",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--trials",
        "2",
        "--json",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["budgets"]
    fp32 = rows[0]["policy"]["measured"]["fp32_metric"]
    assert [r["budget"] for r in rows] == [0.0, float(f"{0.01 * abs(fp32):.4g}")]
    assert rows[0]["budget_given"] is None and rows[1]["budget_given"].startswith("1% of |fp32 metric")
    assert all(Path(r["policy_file"]).is_file() for r in rows)


def test_only_autoprecs_own_log_lines_carry_its_prefix():
    """torchao's or transformers' warnings printed as `autoprec: ...` looked like our errors. A fresh process:
    the root logger has no handler there, as in the command line."""
    import subprocess

    code = ("import logging\nfrom autoprec.tune._log_noise import log_setup\nlog_setup(False)\n"
            "logging.getLogger('autoprec.tune._search._objective').warning('ours')\nlogging.getLogger('torchao.float8').warning('theirs')\n"
            "logging.getLogger('autoprec').info('not at the default level')\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stderr.splitlines()[-2:] == ["autoprec: ours", "theirs"], proc.stderr


@pytest.mark.slow
def test_exclude_keeps_a_layer_out_of_the_profile_and_a_typo_is_one_line(fast, capsys, tmp_path):
    argv = ["profile", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--out", str(tmp_path), "--exclude", "he*"]
    assert main(argv) == 0
    layers = set(pd.read_csv(tmp_path / "profile.csv")["layer"].astype(str))
    assert "head" not in layers and {"fc1", "big"} <= layers
    capsys.readouterr()
    assert main([*argv[:-1], "haed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["autoprec: error: --exclude 'haed' matches no module of the model (its modules include fc1, big, head); "
                   "patterns are fnmatch, e.g. pooler or '*.lm_head'"]  # fmt: skip


@pytest.mark.slow
def test_json_stdout_stays_one_object_when_the_model_prints(fast, capsys, tmp_path, write_model, mlp_source):
    """A model.py that prints (at import, in build_model, in loss_fn) under --json: its lines go to stderr, so
    stdout still parses as the one result object."""
    source = (
        "print('loading my model')\n"
        + mlp_source
        + (
            "\n_build, _loss = build_model, loss_fn\n"
            "\ndef build_model():\n    print('building')\n    return _build()\n"
            "\ndef loss_fn(model, batch):\n    print('loss')\n    return _loss(model, batch)\n"
        )
    )
    path = write_model(source)
    assert main(["profile", str(path), "--device", "cpu", "--out", str(tmp_path / "p"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["profile_csv"] == str(tmp_path / "p" / "profile.csv")
    assert "loading my model" in err and "building" in err and "loss" in err
    argv = ["search", str(path), "--device", "cpu", "--out", str(tmp_path / "s"), "--trials", "1", "--budget", "0.05", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["policy_file"] == str(tmp_path / "s" / "policy.json") and "building" in err
    assert main(["profile", str(path), "--device", "cpu", "--out", str(tmp_path / "p")]) == 0  # without --json: as it printed
    assert "building" in capsys.readouterr().out


@pytest.mark.slow
def test_budget_minus_zero_is_the_same_study_as_budget_zero(fast, capsys, tmp_path):
    argv = ["search", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--out", str(tmp_path), "--trials", "1", "--quiet"]
    assert main([*argv, "--budget", "0"]) == 0
    capsys.readouterr()
    assert main([*argv, "--budget=-0"]) == 0  # the finished study, not refused as another one
    assert "is finished and its result" in capsys.readouterr().err
    budget = load_policy(tmp_path / "policy.json").measured["budget"]
    assert budget == 0 and math.copysign(1.0, budget) == 1.0  # written as 0, not -0.0


def disk_full() -> OSError:
    import errno
    import os

    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_writing_results_is_one_line_naming_the_file_and_leaves_no_partial_file(fast, capsys, tmp_path, monkeypatch):
    write = Path.write_text

    def full(self, data, *args, **kwargs):  # profile.json's write: half its bytes, then the disk is full
        write(self, data[: len(data) // 2], *args, **kwargs)
        raise disk_full()

    monkeypatch.setattr(Path, "write_text", full)  # was a traceback

    out = tmp_path / "out"
    code = main(["profile", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"autoprec: error: {out / 'profile.json'}: cannot write it (No space left on device)")
    )
    assert not (out / "profile.json").exists() and not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("room", [0, 20], ids=["its-first-record", "mid-search"])
@pytest.mark.slow
def test_a_full_disk_writing_the_study_is_one_line_and_a_rerun_resumes(fast, capsys, tmp_path, monkeypatch, room):
    import optuna

    append = optuna.storages.journal.JournalFileBackend.append_logs
    appends = []

    out = tmp_path / "out"
    argv = [
        "search",
        str(MODELS / "overflow_mlp.py"),
        "--budget",
        "0.3",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--trials",
        "3",
        "--quiet",
    ]

    def full(self, logs):  # Optuna's own append, after `room` of them: half a record reaches the file, then the disk is full
        appends.append(len(logs))
        if len(appends) <= room:
            return append(self, logs)
        text = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        with open(self._file_path, "ab") as fh:
            fh.write(text[: len(text) // 2])
        raise disk_full()

    with monkeypatch.context() as m:
        m.setattr(optuna.storages.journal.JournalFileBackend, "append_logs", full)  # was a raw OSError
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        f"autoprec: error: --out {out}: no space left on the device (writing the study ({out / 'study.journal'}))"
    )
    assert "run the same command again" in line and len(appends) > room
    assert main(argv) == 0  # space freed: the same command runs (the journal's torn tail is dropped)


LIBRARY_NOISE = """

import logging
import warnings

import torch.utils._pytree

# What libraries say when model.py imports them (transformers, torchao), from their own files: a deprecation warning,
# and pytree's log line through torch's handler; a line that reaches the root, which has no handler; and one through
# a handler a library sets up as it is imported (transformers'), logged later, as the model is built.
_LIB = torch.utils._pytree.__file__
warnings.warn_explicit("libwarn: an old API is deprecated", FutureWarning, _LIB, 1, module="torch.utils._pytree")


def _library_log(name, level, message):
    log = logging.getLogger(name)
    log.handle(log.makeRecord(name, level, _LIB, 1, message, (), None))


_library_log("torch.utils._pytree", logging.WARNING, "liblog-torch: register_constant() on Enum subclasses is deprecated")
_library_log("torchao.fake", logging.WARNING, "liblog-root: failed to load an extension")
_library_log("torchao.fake", logging.ERROR, "liberror: a library's error")
logging.getLogger("fakelib").addHandler(logging.StreamHandler())
logging.getLogger("fakelib").propagate = False
warnings.warn("mine-warn: the user's own")
logging.getLogger("mine").warning("mine-log: the user's own")
_build = build_model


def build_model():
    _library_log("fakelib.modeling", logging.WARNING, "liblog-own-handler: some weights were not initialized")
    return _build()
"""


@pytest.mark.slow
def test_library_warnings_are_kept_out_of_the_output_unless_debug(tmp_path, write_model, mlp_source):
    """torch's pytree deprecation notices reached the terminal for any model.py that imports transformers (issue 38);
    the user's own warnings, and a library's errors, still show."""
    import subprocess

    path = write_model(mlp_source + LIBRARY_NOISE)
    space = tmp_path / "space.yaml"
    space.write_text("default: [fp32]\nlayers: {Linear: [fp32, bf16]}\n", encoding="utf-8")
    library = ("libwarn:", "liblog-torch:", "liblog-root:", "liblog-own-handler:")
    for flags, shown in (((), False), (("--debug",), True)):
        argv = [sys.executable, "-m", "autoprec", *flags, "profile", str(path), "--device", "cpu", "--quiet",
                "--space", str(space), "--out", str(tmp_path / f"out{len(flags)}")]  # fmt: skip
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=1800)  # a hang guard only
        assert proc.returncode == 0, proc.stderr
        for text in library:
            assert (text in proc.stderr) is shown, (flags, text, proc.stderr)
        for text in ("mine-warn:", "mine-log:", "liberror:"):
            assert text in proc.stderr, (flags, text, proc.stderr)
