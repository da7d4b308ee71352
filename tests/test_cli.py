"""autoprec/tune/_cli.py: a user's mistake exits 2 with one `autoprec: error:` line and no traceback.

No test here runs a real search or profile: every case fails before anything is measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autoprec import LossScale, Policy
from autoprec.tune._cli import EXIT_USER_ERROR, main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def search(capsys, tmp_path, model, *extra: str) -> tuple[int, str, str]:
    """`autoprec search MODEL --budget 0.1 --out TMP ...` (later options win)."""
    return run(capsys, "search", model, "--budget", "0.1", "--device", "cpu", "--out", tmp_path / "out", *extra)


def assert_user_error(code: int, err: str, *parts: str) -> str:
    """Exit 2, the last stderr line is the one error line, no traceback; return that line."""
    assert code == EXIT_USER_ERROR == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines, "nothing on stderr"
    errors = [line for line in lines if line.startswith("autoprec: error:")]
    assert errors == [lines[-1]], err
    for part in parts:
        assert part in lines[-1], lines[-1]
    return lines[-1]


# ---- search: model.py problems -----------------------------------------------------------------


def test_search_missing_model(capsys, tmp_path):
    path = tmp_path / "model.py"
    code, out, err = search(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), "no such file")
    assert out == ""
    assert not (tmp_path / "out").exists()


def test_search_of_a_folder_names_its_model_py(capsys, tmp_path, write_model, mlp_source):
    code, _, err = search(capsys, tmp_path, tmp_path)
    assert_user_error(code, err, f"{tmp_path}: a folder, not a model.py; give the path of the model.py inside it")
    write_model(mlp_source)
    code, _, err = search(capsys, tmp_path, tmp_path)
    assert_user_error(code, err, f"{tmp_path}: a folder, not a model.py; give its model.py: {tmp_path / 'model.py'}")


def test_a_space_the_goal_refuses_and_an_out_that_is_a_file_are_refused_before_model_py_is_built(capsys, tmp_path, write_model):
    """Building a large model takes minutes: what can be refused without it is refused first (here build_model would
    fail, and its error is not the one shown)."""
    path = write_model("def build_model():\n    raise RuntimeError('built')\n\ndef batches(split):\n    return []\n\n"
                       "def loss_fn(model, batch):\n    return 0\n")  # fmt: skip
    space = tmp_path / "space.yaml"
    space.write_text("layers:\n  Linear: [bf16, fp8]\n")
    code, _, err = search(capsys, tmp_path, path, "--space", space)
    assert_user_error(code, err, "layers.Linear must include fp32")
    (tmp_path / "afile").write_text("")
    code, _, err = search(capsys, tmp_path, path, "--out", tmp_path / "afile")
    assert_user_error(code, err, "a file, not a folder")
    code, _, err = search(capsys, tmp_path, path)
    assert_user_error(code, err, "built")  # and with neither, build_model's own error


def test_search_model_import_fails(capsys, tmp_path, write_model):
    path = write_model('raise RuntimeError("boom")\n')
    code, _, err = search(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), "import failed", "RuntimeError: boom")


def test_search_model_lacks_a_function(capsys, tmp_path, write_model, mlp_source):
    path = write_model(mlp_source + "\ndel loss_fn\n")
    code, _, err = search(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), "missing required function loss_fn()")


def test_search_model_yields_no_batches(capsys, tmp_path, write_model, mlp_source):
    path = write_model(mlp_source + "\ndef batches(split):\n    return []\n")
    code, _, err = search(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), "batches('train') yields no batches")


def test_search_loss_not_scalar(capsys, tmp_path, write_model, mlp_source):
    path = write_model(mlp_source + "\ndef loss_fn(model, batch):\n    return model(batch[0]).sum(0)\n")
    code, _, err = search(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), "loss_fn must return a scalar tensor", "shape (4,)")


def test_profile_reports_the_same_errors(capsys, tmp_path, write_model, mlp_source):
    path = write_model(mlp_source + "\ndel batches\n")
    code, _, err = run(capsys, "profile", path, "--device", "cpu", "--out", tmp_path / "out")
    assert_user_error(code, err, str(path), "missing required function batches()")


def test_an_exclude_that_leaves_no_layer_says_so(capsys, tmp_path, write_model, mlp_source):
    """--exclude of every Linear said "the model has no layer of the types the search space tunes" (issue 37, 13)."""
    path = write_model(mlp_source)
    for verb in ("profile", "search"):
        code, out, err = run(capsys, verb, path, "--device", "cpu", "--out", tmp_path / "out", "--exclude", "fc*",
                             "--exclude", "head")  # fmt: skip
        line = assert_user_error(code, err, "--exclude 'fc*' --exclude 'head' left no layer to tune",
                                 "excluded all 3 layers of the types the search space tunes")  # fmt: skip
        assert "the model has no layer" not in line and out == ""
    code, _, err = run(capsys, "profile", path, "--device", "cpu", "--out", tmp_path / "out", "--exclude", "*")
    assert_user_error(code, err, "--exclude '*' left no layer to tune: it excluded all 3 layers")


# ---- search: option problems -------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["-1", "nan", "inf"])
def test_search_bad_budget(capsys, tmp_path, write_model, mlp_source, budget):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--budget", budget)
    assert_user_error(code, err, "budget must be a finite number >= 0", budget)


@pytest.mark.parametrize("budget", ["1_0", "\u0661\u0660", "\uff11\uff10", "1_0%"])
def test_a_budget_in_other_than_ascii_digits_is_refused_naming_it_and_the_forms(
    capsys, tmp_path, write_model, mlp_source, budget
):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--budget", budget)
    assert_user_error(code, err, f"but got {budget!r}", "a number in the metric's units (0.01) or a percentage", "ASCII digits")
    code, _, err = run(capsys, "sweep", write_model(mlp_source), "--budgets", f"0,{budget}", "--device", "cpu", "--out", tmp_path)
    assert_user_error(code, err, f"but got {budget!r}", "ASCII digits")


@pytest.mark.parametrize("flag", ["--trials", "--seed", "--train-steps", "--noise-runs", "--time-budget"])
def test_a_numeric_option_in_other_than_ascii_digits_is_refused_naming_it_and_the_forms(capsys, tmp_path, flag):
    with pytest.raises(SystemExit) as info:
        search(capsys, tmp_path, tmp_path / "model.py", flag, "1_0")
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"argument {flag}: '1_0' is not a " in err and "in ASCII digits, such as " in err.splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "part"),
    [
        (["frobnicate"], "autoprec: error: argument {search,"),
        (["search"], "autoprec search: error: the following arguments are required: model"),
        (["export", "policy.json", "--to", "onnx"], "autoprec export: error: argument --to: invalid choice: 'onnx'"),
        (["predict", "model.py", "--target", "h100"], "autoprec predict: error: "),
        (["search", "model.py", "--bogus"], "autoprec search: error: unrecognized arguments: --bogus"),  # a typo
        (["--pluginn=x.py", "search", "model.py"], "autoprec: error: unrecognized arguments: --pluginn=x.py"),  # before it
    ],
)
def test_a_mistake_the_option_parser_finds_is_one_line_naming_where_the_options_are_listed(capsys, argv, part):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith(part) and err.rstrip().endswith("--help lists the options)"), err


def test_an_export_options_number_in_other_than_ascii_digits_is_refused(capsys, tmp_path):
    path = Policy(layers={"decoder.layers.0.fc": "fp8"}).save(tmp_path / "policy.json")
    with pytest.raises(SystemExit) as info:
        run(capsys, "export", path, "--to", "megatron", "--num-layers", "\u0661\u0660")
    assert (
        info.value.code == 2 and "argument --num-layers: '\u0661\u0660' is not a whole number in ASCII" in capsys.readouterr().err
    )


def test_an_export_check_that_cannot_read_its_model_names_the_check_option(capsys, tmp_path):
    path = Policy(layers={"blocks.0.fc": "fp8"}).save(tmp_path / "policy.json")
    code, _, err = run(capsys, "export", path, "--to", "torchao", "--out", tmp_path / "fp8.py", "--check", tmp_path / "nope.txt")
    assert (
        code == 2 and err.startswith(f"autoprec: error: --check {tmp_path / 'nope.txt'}: cannot read it") and "--model" not in err
    )


@pytest.mark.parametrize(
    ("budgets", "expected"),
    [("0,x", "--budgets 0,x: a budget must be a number in the metric's units (0.01) or a percentage of the fp32 metric (1%), but got 'x'"),
     ("0,-0.01", "--budgets 0,-0.01: a budget must be a finite number >= 0"), ("0,-1%", "but got '-1%'"),
     (",", "at least one number")],
)  # fmt: skip
def test_sweep_bad_budgets(capsys, tmp_path, write_model, mlp_source, budgets, expected):
    code, _, err = run(capsys, "sweep", write_model(mlp_source), "--budgets", budgets, "--device", "cpu", "--out", tmp_path)
    assert_user_error(code, err, expected)


def test_sweep_reports_model_problems_like_search(capsys, tmp_path):
    code, _, err = run(capsys, "sweep", tmp_path / "nope.py", "--budgets", "0,0.01", "--device", "cpu")
    assert_user_error(code, err, "nope.py: no such file")


def test_search_bad_trials(capsys, tmp_path, write_model, mlp_source):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--trials", "0")
    assert_user_error(code, err, "trials must be >= 1")


def test_search_bad_seed_is_refused_before_anything_is_profiled(capsys, tmp_path, write_model, mlp_source):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--seed", "-1")
    assert_user_error(code, err, "seed must be an integer from 0 to 2**32 - 1", "-1")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "body, expected",
    [
        ("return None", "evaluate() must return a number (higher is better), but returned NoneType None"),
        ("return 'good'", "but returned str 'good'"),
        ("return torch.tensor([0.5, 0.5])", "but returned a tensor of shape (2,)"),
        ("return True", "but returned bool True"),
        ("raise KeyError('accuracy')", "evaluate() failed on the fp32 model: KeyError: 'accuracy'"),
    ],
)
def test_a_broken_evaluate_is_one_line_naming_the_file(capsys, tmp_path, write_model, mlp_source, body, expected):
    path = write_model(mlp_source + f"\n\ndef evaluate(model):\n    {body}\n")
    code, _, err = search(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), expected)


def test_search_takes_one_budget(capsys, tmp_path, write_model, mlp_source):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--budget", "1%,2%")
    assert_user_error(code, err, "--budget 1%,2%: one budget; for several, run autoprec sweep --budgets 1%,2%")


def test_version_names_the_installed_package(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("autoprec ")


def test_search_bad_space(capsys, tmp_path, write_model, mlp_source):
    space = tmp_path / "space.yaml"
    space.write_text("layers: {Linr: [fp32]}\n", encoding="utf-8")
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--space", space)
    assert_user_error(code, err, str(space), "unknown module type 'Linr'")


@pytest.mark.parametrize(
    ("verb", "text", "extra", "expected"),
    [
        ("search", "default: [bf16]\nlayers: {Linear: [bf16]}\n", (), "default must include fp32"),
        ("sweep", "default: [bf16]\nlayers: {Linear: [bf16]}\n", (), "default must include fp32"),
        ("search", "default: [fp16]\nlayers: {Linear: [fp16]}\n", ("--objective", "flops", "--target", "h100"),
         "default must include fp32 or bf16"),
        ("search", "default: [fp32]\nlayers: {Linear: [fp32, bf16, mxfp8, nvfp4]}\n",
         ("--objective", "flops", "--target", "h100"), "Leave mxfp8, nvfp4 out of the search space"),
    ],
)  # fmt: skip
def test_a_space_the_goal_refuses_is_one_line_before_anything_is_measured(
    capsys, tmp_path, write_model, mlp_source, verb, text, extra, expected
):
    space = tmp_path / "space.yaml"
    space.write_text(text, encoding="utf-8")
    budget = ("--budget", "0.1") if verb == "search" else ("--budgets", "0.1")
    code, _, err = run(capsys, verb, write_model(mlp_source), *budget, "--device", "cpu", "--out", tmp_path / "out",
                       "--space", space, *extra)  # fmt: skip
    assert_user_error(code, err, expected)
    assert not (tmp_path / "out").exists()  # refused before the out folder is made


def test_a_space_file_nested_5000_deep_is_one_line_not_a_recursion_error(capsys, tmp_path, write_model, mlp_source):
    space = tmp_path / "space.yaml"
    space.write_text("layers: {Linear: [fp32]}\nexclude: " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--space", space)
    assert_user_error(code, err, str(space), "nested deeper than 32 levels")
    assert "RecursionError" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "layers: {Linear: [fp32]}\nloss_scale: {growth_factor: [.inf]}\n",
            "growth_factor must be a non-empty list of numbers > 1",
        ),
        ("layers: {Linear: [fp32]}\nloss_scale: {backoff_factor: [.nan]}\n", "backoff_factor must be a non-empty list"),
        ("layers: {Linear: [fp32]}\nprune: {slower_than: .nan}\n", "slower_than must be a finite number, but got nan"),
        ("layers: {Linear: [fp32]}\nprune: {slower_than: .inf}\n", "slower_than must be a finite number, but got inf"),
    ],
)
def test_a_non_finite_number_in_the_space_is_refused_before_profiling(capsys, tmp_path, write_model, mlp_source, text, expected):
    space = tmp_path / "space.yaml"
    space.write_text(text, encoding="utf-8")
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--space", space)
    assert_user_error(code, err, str(space), expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--mode", "bogus"], "error: --mode must be one of weights, train, but got 'bogus'"),
        (["--train-steps", "5"], "--train-steps applies only to --mode train"),
        (["--noise-runs", "2"], "--noise-runs applies only to --mode train"),
        (["--mode", "train", "--train-steps", "0"], "error: --train-steps must be an integer >= 1, but got 0"),
        (["--mode", "train", "--noise-runs", "-1"], "error: --noise-runs must be an integer >= 1, but got -1"),
        (["--trials", "0"], "error: --trials must be >= 1, but got 0"),  # a setting's own check, named by its flag
        (["--objective", "latency"], "error: --objective must be one of speed, memory, flops, but got 'latency'"),
        # a message that names the flag already is left as written
        (["--objective", "flops", "--target", "h100", "--max-memory", "40GB"], "error: max_memory (--max-memory) needs"),
    ],
)
def test_search_bad_mode_options(capsys, tmp_path, write_model, mlp_source, extra, expected):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), *extra)
    assert_user_error(code, err, expected)
    assert not (tmp_path / "out").exists()  # refused before anything was measured


@pytest.mark.parametrize(
    "device, expected",
    [("nonsense", "unknown device 'nonsense'"), ("meta", "autoprec measures on cpu or cuda")],
)
def test_search_bad_device(capsys, tmp_path, write_model, mlp_source, device, expected):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--device", device)
    assert_user_error(code, err, "--device", expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here, so --device cuda is valid")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_search_cuda_unavailable(capsys, tmp_path, write_model, mlp_source, device):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--device", device)
    assert_user_error(code, err, f"--device {device}", "CUDA is not available", "--device cpu")


def test_cuda_unavailable_mocked(capsys, tmp_path, write_model, mlp_source, monkeypatch):
    """The same error path on any machine, by mocking the capability check."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--device", "cuda")
    assert_user_error(code, err, "CUDA is not available")


def test_a_gpu_index_past_the_gpus_present_is_refused_in_one_line(capsys, tmp_path, write_model, mlp_source, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--device", "cuda:2")
    assert_user_error(code, err, "--device cuda:2: this machine has 2 GPUs (cuda:0 to cuda:1)")
    assert not (tmp_path / "out").exists()


# ---- --debug -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["before-verb", "after-verb"])
def test_debug_shows_traceback_and_exits_2(capsys, tmp_path, write_model, where):
    path = write_model('raise RuntimeError("boom")\n')
    argv = ["search", str(path), "--budget", "0.1", "--out", str(tmp_path / "out")]
    argv = ["--debug", *argv] if where == "before-verb" else [*argv, "--debug"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" in err and "RuntimeError: boom" in err
    assert err.strip().splitlines()[-1].startswith("autoprec: error:")


# ---- show --------------------------------------------------------------------------------------


def test_show_missing_file(capsys, tmp_path):
    path = tmp_path / "policy.json"
    code, out, err = run(capsys, "show", path)
    assert_user_error(code, err, str(path), "no such policy file")
    assert out == ""


def test_show_malformed_json(capsys, tmp_path):
    path = tmp_path / "policy.json"
    path.write_text('{"version": 1, "layers": {', encoding="utf-8")
    code, _, err = run(capsys, "show", path)
    assert_user_error(code, err, str(path), "not valid JSON", "line 1")


def test_show_unknown_format(capsys, tmp_path):
    path = Policy(layers={"fc1": "bf16"}).save(tmp_path / "policy.json")
    data = json.loads(path.read_text())
    data["layers"]["fc1"] = "int8"
    path.write_text(json.dumps(data), encoding="utf-8")
    code, _, err = run(capsys, "show", path)
    assert_user_error(code, err, str(path), "layers['fc1']", "'int8'", "fp32, bf16, fp16, fp8")


def test_show_malformed_measured(capsys, tmp_path):
    data = Policy(layers={"fc1": "bf16"}).to_dict()
    data["measured"] = {"excluded": {"fc1": "fp8"}}
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    code, out, err = run(capsys, "show", path)
    # `measured` is provenance: a malformed part is skipped, the layers still show, no traceback.
    assert code == 0 and "Traceback" not in err and "fc1" in out and "bf16" in out


def make_policy(tmp_path: Path) -> Path:
    policy = Policy(
        layers={"": "bf16", "fc1": "fp16", "fc2": "fp8", "head": "fp32"},
        loss_scale=LossScale(init_scale=1024.0, growth_interval=500),
    )
    return policy.save(tmp_path / "policy.json")


def test_show_valid_policy(capsys, tmp_path):
    code, out, err = run(capsys, "show", make_policy(tmp_path))
    assert code == 0 and err == ""
    lines = out.splitlines()
    for name, fmt in [("fc1", "fp16"), ("fc2", "fp8"), ("head", "fp32")]:
        assert any(line.split()[:2] == [name, fmt] for line in lines), (name, out)
    assert any(line.startswith("(model root: all else)") and line.split()[4] == "bf16" for line in lines), out
    assert "loss scaling: init 1024" in out and "every 500" in out


def test_show_markdown(capsys, tmp_path):
    code, out, _ = run(capsys, "show", make_policy(tmp_path), "--markdown")
    assert code == 0
    for name, fmt in [("fc1", "fp16"), ("fc2", "fp8"), ("head", "fp32")]:
        assert f"| {name} | {fmt} |" in out


def test_show_policy_without_fp16(capsys, tmp_path):
    path = Policy(layers={"fc1": "bf16"}).save(tmp_path / "policy.json")
    code, out, _ = run(capsys, "show", path)
    assert code == 0 and "loss scaling: off (no fp16 layer)" in out


HOSTILE = "a|b <script>alert(1)</script> `rm -rf` &amp; c\\"  # a cell's end, HTML, a code span, an entity, a backslash


def test_show_markdown_shows_recorded_names_and_values_as_text(capsys, tmp_path):
    """`show --markdown` wrote a recorded name or value as it was: a `|` split its table row and `<script>` went into
    the markdown as HTML (issue 37, 15)."""
    import re

    measured = {"device": HOSTILE, "model": HOSTILE, "timing": HOSTILE, "versions": {"torch": HOSTILE},
                "excluded": {"fc1": {"fp8": HOSTILE}},
                "results": {HOSTILE: {"speedup": 1.5, "metric_drop": 0.0, "error": HOSTILE}, "fp32": {"speedup": 1.0}}}  # fmt: skip
    path = Policy(layers={"fc1": "fp16"}, measured=measured).save(tmp_path / "policy.json")
    code, out, err = run(capsys, "show", path, "--markdown")
    assert code == 0 and err == ""
    assert "<" not in out and ">" not in out and re.search(r"(?<!\\)`", out) is None, out
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in out and "&amp;amp;" in out and "a\\|b" in out
    for table in re.findall(r"(?:^\|.*\n?)+", out, flags=re.M):  # every row has its header's cells
        cells = {len(re.findall(r"(?<!\\)\|", row)) for row in table.splitlines()}
        assert len(cells) == 1, table
    results = next(line for line in out.splitlines() if line.startswith("| a\\|b"))
    assert results.startswith("| a\\|b &lt;script&gt;alert(1)&lt;/script&gt; \\`rm -rf\\` &amp;amp; c\\\\ | ")


# ---- as a process ------------------------------------------------------------------------------


def run_process(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # a hang guard, not a speed limit: a process that takes 12 s alone took over 120 s on a machine at load 10-14
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=1800)


def assert_one_error_line(proc: subprocess.CompletedProcess, *parts: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("autoprec: error:")
    for part in parts:
        assert part in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("module", ["autoprec", "autoprec.tune._cli"])
@pytest.mark.slow
def test_process_module_search_missing_model(tmp_path, module):
    proc = run_process([sys.executable, "-m", module, "search", "missing.py", "--budget", "0.1"], tmp_path)
    assert_one_error_line(proc, "missing.py: no such file")


@pytest.mark.slow
def test_process_model_calling_sys_exit_0_exits_2_with_one_line_not_0(tmp_path, write_model, mlp_source):
    """sys.exit(0) in build_model ended autoprec with exit 0 (success), no policy and no word. Under --json, what
    the model printed first goes to stderr: stdout stays empty on an error."""
    path = write_model(mlp_source + "\n\ndef build_model():\n    print('building')\n    raise SystemExit(0)\n")
    proc = run_process([sys.executable, "-m", "autoprec", "profile", str(path), "--device", "cpu", "--json"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.splitlines()[0] == "building"
    assert proc.stderr.splitlines()[1:] == [f"autoprec: error: {path}: build_model() called sys.exit(0) (SystemExit), which would "
                                            "end autoprec without a result; raise an exception instead, and keep exits under "
                                            "`if __name__ == '__main__':`"]  # fmt: skip


@pytest.mark.slow
def test_process_console_script_show_bad_policy(tmp_path):
    script = Path(sys.executable).with_name("autoprec")
    if not script.is_file():
        pytest.skip(f"no autoprec console script next to {sys.executable}")
    data = Policy(layers={"fc1": "bf16"}).to_dict()
    data["layers"]["fc1"] = "fp4"
    (tmp_path / "policy.json").write_text(json.dumps(data), encoding="utf-8")
    proc = run_process([str(script), "show", "policy.json"], tmp_path)
    assert_one_error_line(proc, "policy.json", "layers['fc1']", "'fp4'")


@pytest.mark.parametrize("first", ["", "import logging\nlogging.basicConfig()\n"], ids=["plain", "its own log handler"])
@pytest.mark.slow
def test_a_model_py_that_imports_torchao_first_prints_none_of_its_loader_noise(tmp_path, write_model, mlp_source, first):
    """transformers imports torchao before autoprec can: its 'Failed to load ..._C_mxfp8.so' and pytree deprecation
    lines must not reach the user's terminal, also where model.py sets up a log handler first, which the command's
    filter of libraries' lines has not covered yet; without the CLI importing torchao itself (3.3 s of every
    command on a CPU that never runs fp8)."""
    path = write_model(first + "import torchao\n" + mlp_source)
    proc = run_process([sys.executable, "-m", "autoprec", "profile", str(path), "--device", "cpu", "--out", str(tmp_path / "out"),
                        "--quiet"], tmp_path)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == ""


def _noisy_package(folder: Path, *, installed: bool) -> Path:
    """A package that warns and logs when imported, in `folder` (with its `*.dist-info` when `installed`)."""
    folder.mkdir()
    (folder / "noisy_pkg.py").write_text(
        "import logging, warnings\n"
        "warnings.warn('noisy_pkg: a note for its maintainers', UserWarning)\n"
        "logging.getLogger('noisy_pkg').warning('noisy_pkg: loader noise')\n"
    )
    if installed:  # what pip install --target leaves: the metadata, whose RECORD lists the files it installed
        (folder / "noisy_pkg-1.0.dist-info").mkdir()
        (folder / "noisy_pkg-1.0.dist-info" / "RECORD").write_text("noisy_pkg.py,,\nnoisy_pkg-1.0.dist-info/RECORD,,\n")
    return folder


@pytest.mark.slow
def test_a_library_installed_with_pip_target_on_pythonpath_is_a_library_and_kept_quiet(tmp_path, write_model, mlp_source):
    """On the H200 the wheels were installed with `pip install --target /tmp/site` and PYTHONPATH: torchao's
    SyntaxWarnings and Optuna's logged traceback of a trial stopped by SIGTERM reached the user, as if model.py's own."""
    path = write_model("import noisy_pkg\n" + mlp_source)
    site_dir = _noisy_package(tmp_path / "site", installed=True)
    env = {**os.environ, "PYTHONPATH": str(site_dir)}
    argv = [sys.executable, "-m", "autoprec", "profile", str(path), "--device", "cpu", "--out", str(tmp_path / "out"), "--quiet"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr[-2000:]


def test_a_module_on_pythonpath_without_installed_metadata_is_the_users_and_speaks(tmp_path, monkeypatch):
    from autoprec.tune import _log_noise as noise

    ours = _noisy_package(tmp_path / "mine", installed=False)
    theirs = _noisy_package(tmp_path / "site", installed=True)
    (theirs / "model.py").write_text("import warnings\n")  # the user's own file beside what pip installed there
    monkeypatch.setattr(sys, "path", [str(ours), str(theirs), *sys.path])
    noise.from_library.cache_clear()
    noise.installed_tops.cache_clear()
    try:
        assert not noise.from_library(str(ours / "noisy_pkg.py"))  # the user's helper module: its warnings are shown
        assert noise.from_library(str(theirs / "noisy_pkg.py"))
        assert not noise.from_library(str(theirs / "model.py"))  # not installed there: the user's, and it speaks
        # csv-quoted RECORD lines (pip quotes a path holding a comma) and a wheel's scripts, which are no package
        (theirs / "noisy_pkg-1.0.dist-info" / "RECORD").write_text('"odd,name.py",,\nbin/tool,,\nnoisy_pkg.py,,\n')
        (theirs / "bin").mkdir()
        noise.from_library.cache_clear()
        noise.installed_tops.cache_clear()
        assert noise.installed_tops(os.path.join(os.path.realpath(theirs), "")) == {"odd,name.py", "noisy_pkg.py"}
        assert not noise.from_library(str(theirs / "bin" / "helper.py"))  # the user's file in a folder named as scripts
    finally:
        noise.from_library.cache_clear()
        noise.installed_tops.cache_clear()


# ---- issue 12: results kept apart, torn files, user code that fails late --------------------------


def test_a_nan_fp32_loss_on_a_later_train_batch_is_one_line(capsys, tmp_path, write_model, mlp_source):
    path = write_model(mlp_source + (
        "\n\n_loss = loss_fn\n\ndef loss_fn(model, batch):\n    loss = _loss(model, batch)\n"
        "    return loss * float('nan') if float(batch[0][0, 0]) == float(batches('train')[1][0][0, 0]) else loss\n"
    ))  # fmt: skip
    code, _, err = search(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), "loss_fn returns nan for the fp32 model on train batch 1 (of 2)")


def test_an_out_folder_with_another_models_results_is_refused_before_anything_is_written(
    capsys, tmp_path, write_model, mlp_source
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "profile.json").write_text(json.dumps({"fingerprint": "0123456789abcdef", "device": "cpu"}))
    before = (out / "profile.json").read_text()
    code, _, err = search(capsys, tmp_path, write_model(mlp_source))
    assert_user_error(
        code, err, f"--out {out} holds results of another model structure", "pick another --out", "nothing was written"
    )
    assert sorted(p.name for p in out.iterdir()) == ["profile.json"] and (out / "profile.json").read_text() == before
    code, _, err = run(capsys, "profile", write_model(mlp_source), "--device", "cpu", "--out", out)
    assert_user_error(code, err, "holds results of another model structure")


@pytest.mark.parametrize(
    "what", ["out is a file", "policy.json is a folder", "storage is a folder", "storage's folder is a file"]
)
def test_paths_in_the_way_are_refused_before_profiling(capsys, tmp_path, write_model, mlp_source, what):
    out = tmp_path / "out"
    extra: list = []
    if what == "out is a file":
        out.write_text("x")
        expected = "a file, not a folder"
    elif what == "policy.json is a folder":
        (out / "policy.json").mkdir(parents=True)
        expected = "a folder is in the way of the results file"
    elif what == "storage is a folder":
        (tmp_path / "j").mkdir()
        extra = ["--storage", tmp_path / "j"]
        expected = "a folder; give a journal file's path"
    else:  # the journal cannot be made, even by root: once refused only after the whole profile
        (tmp_path / "afile").write_text("x")
        extra = ["--storage", tmp_path / "afile" / "study.journal"]
        expected = f"--storage {tmp_path / 'afile' / 'study.journal'}: cannot make it: {tmp_path / 'afile'} is a file"
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), *extra)
    assert_user_error(code, err, expected)
    assert not (out / "profile.csv").exists() if out.is_dir() else True  # refused before profiling
    assert not (out / "profile.json").exists() if out.is_dir() else True


def test_an_sqlite_file_given_as_a_journal_is_refused_untouched(capsys, tmp_path, write_model, mlp_source):
    import sqlite3

    db = tmp_path / "study.db"
    with sqlite3.connect(db) as conn:
        conn.execute("create table t (x)")
    before = db.read_bytes()
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--storage", db)
    assert_user_error(code, err, "an SQLite database, not a journal file", f"sqlite:///{db}")
    assert db.read_bytes() == before


@pytest.mark.parametrize("what", ["json", "csv", "devnull", "fifo", "bad line"])
def test_a_storage_that_is_not_a_journal_file_is_one_line_before_profiling_and_left_untouched(
    capsys, tmp_path, write_model, mlp_source, what
):
    import os

    path = tmp_path / "storage"
    if what == "json":
        path.write_bytes(b'{"a": 1}')  # once taken for a journal with a torn tail, and wiped
        expected = "not an Optuna journal file"
    elif what == "csv":
        path.write_bytes(b"a,b\n1,2\n")
        expected = "not an Optuna journal file"
    elif what == "devnull":
        path = Path(os.devnull)
        expected = "not a regular file (a device)"
    elif what == "fifo":
        os.mkfifo(path)
        expected = "not a regular file (a FIFO)"
    else:
        record = b'{"op_code":0,"worker_id":"w","study_name":"s","directions":[1]}\n'
        path.write_bytes(record + b"oops\n" + record)
        expected = "line 2 is not an Optuna journal record"
    before = path.read_bytes() if path.is_file() else None
    code, out, err = search(capsys, tmp_path, write_model(mlp_source), "--storage", path)
    assert_user_error(code, err, f"--storage {path}: {expected}")
    assert out == "" and not (tmp_path / "out" / "profile.csv").exists()  # refused before profiling
    assert before is None or path.read_bytes() == before


def test_a_bad_default_journal_in_out_is_refused_before_profiling(capsys, tmp_path, write_model, mlp_source):
    journal = tmp_path / "out" / "study.journal"
    journal.parent.mkdir()
    journal.write_bytes(b"{}")
    code, _, err = search(capsys, tmp_path, write_model(mlp_source))
    assert_user_error(code, err, f"{journal}: not an Optuna journal file")
    assert journal.read_bytes() == b"{}" and not (tmp_path / "out" / "profile.csv").exists()


@pytest.mark.parametrize("name, folder", [("...py", "__"), ("..py", "_"), ("a.b.py", "a.b"), ("x\\y.py", "x_y")])
def test_the_default_out_folder_never_leaves_results(name, folder):
    import argparse

    from autoprec.tune._commands._shared import folder_name, out_dir
    from autoprec.tune._measure._task import Task

    task = Task(path=Path("/models") / name, build_model=lambda: None, batches=lambda s: [], loss_fn=lambda m, b: None)
    assert out_dir(argparse.Namespace(out=None), task) == Path("results") / folder
    assert out_dir(argparse.Namespace(out="mine"), task) == Path("mine")
    assert folder_name("") == "_" and folder_name(".") == "_" and folder_name("a/../b") == "a_.._b"


@pytest.mark.parametrize("verb", ["search", "sweep", "profile"])
def test_a_model_named_dot_dot_py_writes_under_results_not_into_the_current_folder(capsys, tmp_path, write_model, mlp_source,
                                                                                   monkeypatch, verb):  # fmt: skip
    model = write_model(mlp_source, name="...py")  # its stem is "..": results/.. is the current folder
    cwd = tmp_path / "cwd"
    (cwd / "results").mkdir(parents=True)
    (cwd / "results" / "__").write_text("in the way")  # stops the run at the folder check, before any measuring
    monkeypatch.chdir(cwd)
    extra = ["--budgets", "0.1"] if verb == "sweep" else ["--budget", "0.1"] if verb == "search" else []
    code, _, err = run(capsys, verb, model, "--device", "cpu", *extra)
    assert_user_error(code, err, f"--out {Path('results') / '__'}: a file, not a folder")
    assert "'..' is not a folder name" in err and "results/__" in err
    assert sorted(p.name for p in cwd.iterdir()) == ["results"]


@pytest.mark.parametrize("verb", ["search", "sweep", "profile"])
def test_an_out_folder_a_run_for_another_model_holds_is_refused_before_anything_is_written(capsys, tmp_path, write_model,
                                                                                          mlp_source, verb):  # fmt: skip
    from autoprec.files import claim_folder

    out = tmp_path / "out"
    out.mkdir()
    other = {"model": "other", "fingerprint": "0123456789abcdef", "path": "/elsewhere/other.py"}
    extra = ["--budgets", "0.1"] if verb == "sweep" else ["--budget", "0.1"] if verb == "search" else []
    with claim_folder(out, other, key="fingerprint"):  # as a run of another model started a moment before
        code, out_text, err = run(capsys, verb, write_model(mlp_source), "--device", "cpu", "--out", out, *extra)
    assert_user_error(code, err, f"--out {out}: a run for another model is writing there now", "/elsewhere/other.py")
    assert out_text == "" and not [p for p in out.iterdir() if not p.name.startswith(".autoprec.claim")]


def test_show_on_a_folder_points_at_its_policy_file(capsys, tmp_path):
    (tmp_path / "policy.json").write_text(json.dumps(Policy(layers={"a": "bf16"}).to_dict()))
    code, _, err = run(capsys, "show", tmp_path)
    assert_user_error(code, err, "a folder, not a policy file", f"did you mean {tmp_path / 'policy.json'}?")


@pytest.mark.parametrize(
    "storage, expected",
    [("sqlite://", "an in-memory database dies with this process"), ("sqlite:///:memory:", "an in-memory database")],
)
def test_an_in_memory_storage_is_refused(capsys, tmp_path, write_model, mlp_source, storage, expected):
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--storage", storage)
    assert_user_error(code, err, expected, "sqlite:///study.db")
    assert not (tmp_path / "out" / "profile.csv").exists()  # refused before profiling


def test_an_out_folder_that_cannot_be_written_is_one_line(capsys, tmp_path, write_model, mlp_source):
    code, _, err = run(capsys, "search", write_model(mlp_source), "--budget", "0.1", "--device", "cpu", "--out", "/proc/autoprec")
    assert_user_error(code, err, "--out /proc/autoprec: cannot write results there", "pick another --out")


def test_a_binary_space_file_and_a_deeply_nested_policy_are_one_line(capsys, tmp_path, write_model, mlp_source):
    space = tmp_path / "space.yaml"
    space.write_bytes(b"\xff\xfe\x00binary")
    code, _, err = search(capsys, tmp_path, write_model(mlp_source), "--space", space)
    assert_user_error(code, err, str(space), "not UTF-8 text")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run(capsys, "show", deep)
    assert_user_error(code, err, str(deep), "nests too deeply")


@pytest.mark.parametrize(
    "body, expected",
    [("raise KeyError('accuracy')", "evaluate() failed on the fp32 model: KeyError: 'accuracy'"),
     ("return float('nan')", "the all-fp32 model's metric is nan; it must be finite"),
     ("raise SystemExit(0)", "evaluate() called sys.exit(0) (SystemExit), which would end autoprec without a result")],
)  # fmt: skip
def test_the_default_relative_budget_reports_a_broken_evaluate_in_one_line_too(
    capsys, tmp_path, write_model, mlp_source, body, expected
):
    """Resolving `1%` evaluates the fp32 model before the profile does: the same one-line errors."""
    path = write_model(mlp_source + f"\n\ndef evaluate(model):\n    {body}\n")
    for verb, extra in (("search", ()), ("sweep", ("--budgets", "0,1%"))):
        code, _, err = run(capsys, verb, path, "--device", "cpu", "--out", tmp_path / verb, *extra)
        assert_user_error(code, err, str(path), expected)


def test_ctrl_c_inside_the_models_code_still_interrupts_with_130(capsys, tmp_path, write_model, mlp_source):
    """Only SystemExit is made a user error: a KeyboardInterrupt from inside loss_fn stays an interrupt."""
    path = write_model(mlp_source + "\n\ndef loss_fn(model, batch):\n    raise KeyboardInterrupt\n")
    code, out, err = search(capsys, tmp_path, path, "--json")
    assert code == 130 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("autoprec: interrupted")


INTERRUPT_AT = """
CALLS = [0]


def loss_fn(model, batch):
    CALLS[0] += 1
    if CALLS[0] == {at}:
        raise KeyboardInterrupt
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
"""


@pytest.mark.slow
def test_ctrl_c_says_what_is_stored_and_names_only_the_options_that_were_given_to_resume_with(
    capsys, tmp_path, write_model, mlp_source
):
    """Ctrl-C during the profile said "the trials so far are stored" when there were none (issue 37, 11)."""
    path = write_model(mlp_source + "\n\ndef loss_fn(model, batch):\n    raise KeyboardInterrupt\n")
    code, _, err = run(capsys, "search", path, "--device", "cpu", "--out", tmp_path / "out")
    assert code == 130 and err.strip().splitlines()[-1] == (
        "autoprec: interrupted; nothing was stored yet (stopped before the profile finished): run the same command "
        "again (with the same --out) to start"
    )
    path = write_model(mlp_source + INTERRUPT_AT.format(at=5), "during_profile.py")  # past prepare's check: the profile
    code, _, err = run(capsys, "search", path, "--device", "cpu", "--out", tmp_path / "profiling")
    assert code == 130 and "nothing was stored yet" in err.strip().splitlines()[-1]
    code, _, err = run(capsys, "search", write_model(mlp_source, "whole.py"), "--device", "cpu", "--out", tmp_path / "o2")
    assert code == 0
    path = write_model(mlp_source + INTERRUPT_AT.format(at=1), "again.py")
    (tmp_path / "o2" / "study.journal").rename(tmp_path / "o2" / "kept.journal")
    code, _, err = run(capsys, "search", path, "--device", "cpu", "--out", tmp_path / "o2", "--study", "x", "--storage",
                       str(tmp_path / "o2" / "kept.journal"))  # fmt: skip
    assert code == 130 and err.strip().splitlines()[-1] == (
        "autoprec: interrupted; nothing was stored yet (stopped before the profile finished): run the same command "
        "again (with the same --out, --study, --storage) to start"
    )
    code, _, err = run(capsys, "profile", path, "--device", "cpu", "--out", tmp_path / "p")
    assert code == 130 and err.strip().splitlines()[-1] == "autoprec: interrupted"


@pytest.mark.slow
def test_sigterm_fails_the_running_trial_and_says_how_to_resume(tmp_path, write_model, mlp_source):
    """A timeout, Slurm or Kubernetes stops a search with SIGTERM: the running trial stayed RUNNING for good and
    nothing was printed (issue 37, 11). It is taken as Ctrl-C: the trial fails, the study is left to resume."""
    import optuna

    # The signal must land while a trial's own code runs (inside Optuna's objective), as a timeout's does in practice:
    # once a trial is seen running, the test leaves a file that makes loss_fn's next training step say so and sleep,
    # and signals then.
    go, marker = tmp_path / "go", tmp_path / "in_a_trial"
    slow = mlp_source.replace(
        "    x, y = batch\n",
        "    import pathlib, time\n"
        f"    if model.training and pathlib.Path({str(go)!r}).exists():\n"
        f"        pathlib.Path({str(marker)!r}).touch()\n"
        "        time.sleep(5)\n"
        "    x, y = batch\n",
    )
    path = write_model(slow)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoprec", "search", str(path), "--device", "cpu", "--out", str(out), "--trials", "200",
         "--time-every-trial"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def storage():
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(out / "study.journal")))

    for _ in range(6000):  # a hang guard of 10 minutes: the loop ends as soon as a trial runs, however slow the machine
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if not go.exists() and (out / "study.journal").is_file():
            with contextlib.suppress(KeyError):
                trials = optuna.load_study(study_name=path.parent.name, storage=storage()).trials  # model.py: its folder
                if any(t.state is optuna.trial.TrialState.RUNNING for t in trials):
                    go.touch()
        if marker.exists():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "autoprec: stopped (SIGTERM); the trials so far are stored: run the same command again (with the same --out) to resume"
    )
    states = [t.state for t in optuna.load_study(study_name=path.parent.name, storage=storage()).trials]
    assert optuna.trial.TrialState.RUNNING not in states and optuna.trial.TrialState.FAIL in states


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--max-memory", "lots"], "--max-memory 'lots': not a size; give a size such as 40GB"),
        (["--max-memory", "40"], "--max-memory 40: a share of the device's memory must be in (0, 1]"),
        (["--max-memory", "0%"], "--max-memory 0%: a share"),
        (["--objective", "fast"], "objective must be one of speed, memory, flops, but got 'fast'"),
    ],
)
def test_bad_memory_options_are_one_line_before_anything_is_measured(capsys, tmp_path, write_model, mlp_source, extra, expected):
    for verb in ("search", "sweep"):
        budget = ["--budget", "0.1"] if verb == "search" else ["--budgets", "0,0.1"]
        code, _, err = run(capsys, verb, write_model(mlp_source), *budget, "--device", "cpu", "--out", tmp_path / "out", *extra)
        assert_user_error(code, err, expected)
        assert not (tmp_path / "out").exists()


def test_show_prints_each_results_peak_memory_and_how_it_was_measured(capsys, tmp_path):
    measured = {"device": "cpu", "memory": "CPU tensor allocations traced by the autograd profiler", "max_memory": 3 * 2**30,
                "results": {"fp32": {"speedup": 1.0, "peak_bytes": 2 * 2**30, "memory_saving": 0.0},
                            "policy": {"speedup": 1.5, "peak_bytes": 3 * 2**29, "memory_saving": 0.25}}}  # fmt: skip
    path = Policy(layers={"fc1": "bf16"}, measured=measured).save(tmp_path / "policy.json")
    code, out, _ = run(capsys, "show", path)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("policy"))
    assert "1.5 GiB" in row and "-25%" in row
    assert "peak memory: CPU tensor allocations traced by the autograd profiler; --max-memory 3 GiB" in out


def test_valid_memory_options_reach_the_search_settings():
    from autoprec.tune._cli import build_parser
    from autoprec.tune._commands.search import search_settings
    from autoprec.tune._decide._goals import MEMORY

    args = build_parser().parse_args(["search", "m.py", "--device", "cpu", "--max-memory", "40G", "--objective", "memory"])
    config = search_settings(args, torch.device("cpu"))
    assert config.max_memory == 40 * 2**30 and config.objective is MEMORY
    assert (
        search_settings(
            build_parser().parse_args(["sweep", "m.py", "--budgets", "0", "--device", "cpu"]), torch.device("cpu")
        ).max_memory
        is None
    )


def test_time_every_trial_turns_the_speed_prediction_off_for_a_search():
    from autoprec.tune._cli import build_parser
    from autoprec.tune._commands.search import search_settings

    parser = build_parser()
    assert search_settings(parser.parse_args(["search", "m.py"]), torch.device("cpu")).predict_speed is True
    assert (
        search_settings(parser.parse_args(["search", "m.py", "--time-every-trial"]), torch.device("cpu")).predict_speed is False
    )
    with pytest.raises(SystemExit):  # a sweep never predicts (its front keeps slower trials): no such flag there
        parser.parse_args(["sweep", "m.py", "--budgets", "0.1", "--time-every-trial"])


# ---- what a received policy holds cannot drive the terminal; the storage password is never written ----------

CONTROL = "\x1b]0;title\x07\x1b[2J\r\x9b31m\u2028\u202e\x00"  # a title, a clear screen, a carriage return, C1, bidi


def printable_lines(text: str) -> bool:
    return all(ch.isprintable() for line in text.split("\n") for ch in line)


def test_show_prints_text_from_a_policy_with_its_control_characters_escaped(capsys, tmp_path):
    measured = {"device": f"cpu{CONTROL}", "model": CONTROL, "metric": CONTROL, "budget_given": CONTROL, "fp8": CONTROL,
                "timing": CONTROL, "memory": CONTROL, "versions": {CONTROL: CONTROL}, "excluded": {"fc1": {"fp8": CONTROL}},
                "results": {f"trial{CONTROL}": {"speedup": 1.5, "peak_bytes": 2**20, "error": f"boom{CONTROL}"}}}  # fmt: skip
    path = Policy(layers={"fc1": "fp16"}, measured=measured).save(tmp_path / "policy.json")
    for extra in ((), ("--markdown",), ("--json",)):
        code, out, err = run(capsys, "show", path, *extra)
        assert code == 0 and printable_lines(out + err), (extra, out)
    code, out, _ = run(capsys, "show", path)
    assert "boom\\x1b]0;title\\x07\\x1b[2J\\r\\x9b31m\\u2028\\u202e\\x00" in out  # escaped, not dropped


def test_an_error_about_a_path_or_a_layer_name_is_one_printable_line(capsys, tmp_path):
    code, _, err = run(capsys, "show", tmp_path / f"policy{CONTROL}.json")
    assert_user_error(code, err, "no such policy file") and printable_lines(err)
    data = Policy(layers={"fc1": "bf16"}).to_dict()
    data["layers"][f"fc{CONTROL}"] = "bf16"
    (tmp_path / "policy.json").write_text(json.dumps(data), encoding="utf-8")
    for verb in (["show"], ["export", "--to", "torchao"]):
        code, out, err = run(capsys, verb[0], tmp_path / "policy.json", *verb[1:])
        assert_user_error(code, err, "not a module path") and printable_lines(err) and out == ""


def test_a_number_too_long_for_python_is_one_line_in_show_and_export(capsys, tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(Policy(layers={"fc1": "bf16"}).to_dict())[:-1] + ', "measured": {"budget": ' + "9" * 5000 + "}}")
    for verb in (["show"], ["export", "--to", "megatron"]):
        code, _, err = run(capsys, verb[0], path, *verb[1:])
        assert_user_error(code, err, str(path), "4300 digits")
    big = 10**400  # read, but past float's range: the numbers show as not measured
    measured = {"budget": big, "max_memory": big, "mode": "train", "train_steps": big, "noise_floor": big, "memory": "traced",
                "results": {"policy": {k: big for k in ("metric", "step_ms", "peak_bytes", "memory_saving", "speedup", "spread")}}}  # fmt: skip
    Policy(layers={"fc1": "fp16"}, measured=measured).save(path)
    for extra in ((), ("--markdown",)):
        code, out, err = run(capsys, "show", path, *extra)
        assert code == 0 and err == "" and "policy" in out


@pytest.mark.parametrize("form", ["--storage", "--storage=", "--stor"])
def test_the_command_written_to_the_reports_hides_the_storage_password(monkeypatch, form):
    from autoprec.tune._commands.search import command_line

    url = "postgresql+psycopg2://alice:s3cret-pw@db.example:5432/autoprec"
    given = [f"{form}{url}"] if form.endswith("=") else [form, url]
    monkeypatch.setattr(sys, "argv", ["autoprec", "search", "model.py", *given, "--budget", "1%"])
    command = command_line("search", url)
    assert "s3cret" not in command and "alice:***@db.example:5432/autoprec" in command and command.endswith("--budget 1%")


@pytest.mark.slow
def test_inductors_kernel_notes_are_kept_out_of_the_output_unless_debug(capsys, tmp_path, write_model, mlp_source):
    """--compile made inductor print a dozen 'bf16 and fp16 are mixed in the scheduler node' UserWarnings."""
    body = (
        "\n\nimport warnings\n_loss = loss_fn\n\ndef loss_fn(model, batch):\n"
        "    warnings.warn_explicit('bf16 and fp16 are mixed in the scheduler node.', UserWarning, 'cpp.py', 1,"
        " module='torch._inductor.codegen.cpp')\n    return _loss(model, batch)\n"
    )
    import warnings

    path = write_model(mlp_source + body)
    for flags, out, shown in (((), "p", False), (("--debug",), "d", True)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            code, _, _ = run(capsys, *flags, "profile", path, "--device", "cpu", "--out", tmp_path / out, "--quiet")
        assert code == 0 and any("scheduler node" in str(w.message) for w in seen) is shown, flags


@pytest.mark.parametrize("minutes", ["0", "-1", "nan"])
def test_search_time_budget_must_be_positive_minutes(capsys, tmp_path, minutes):
    code, _, err = search(capsys, tmp_path, tmp_path / "model.py", "--time-budget", minutes)
    assert_user_error(code, err, f"--time-budget {float(minutes):g}", "a number > 0")
    assert not (tmp_path / "out").exists()  # refused before the model is loaded


@pytest.mark.parametrize("flags", [(), ("--json",)])
@pytest.mark.slow
def test_show_into_a_reader_that_stops_early_ends_quietly_as_unix_tools_do(tmp_path, flags):
    """`autoprec show policy.json | head` ended in a BrokenPipeError traceback (issue 38)."""
    from autoprec.tune._cli import EXIT_BROKEN_PIPE

    # 20,000 layers, no two alike: well over a pipe's buffer (64 KiB), so the writer is still writing when the reader goes
    path = Policy(layers={f"m{i}": ("bf16", "fp16")[i % 2] for i in range(20_000)}).save(tmp_path / "policy.json")
    argv = [sys.executable, "-m", "autoprec", *flags, "show", str(path)]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()  # what `head -1` reads
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=1800) == EXIT_BROKEN_PIPE == 141 and err == "", err  # as `cat big | head` ends


def test_the_quick_starts_output_folder_is_git_ignored_and_the_committed_results_are_not():
    """The quick start wrote results/digits/, which a clone's `git status` then listed to commit."""
    import argparse
    import re
    import shutil

    from autoprec.tune import load_task
    from autoprec.tune._commands._shared import out_dir

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    readme = (root / "README.md").read_text()
    [model] = re.findall(r"^python3 -m venv .*autoprec search (\S+)", readme, flags=re.MULTILINE)
    out = out_dir(argparse.Namespace(out=None), load_task(root / model))
    assert out == Path("results/digits")

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=root).returncode == 0

    assert ignored(str(out / "policy.json")) and ignored(str(out / "study.journal"))
    committed = subprocess.run(["git", "ls-files", "results"], cwd=root, capture_output=True, text=True).stdout.split()
    runs = [path for path in committed if path.count("/") >= 2][::50]  # results/<device>/...
    assert runs and not any(ignored(f"{path}.new") for path in runs)  # a new file beside a committed run: not ignored


def test_each_verbs_help_names_the_global_flags_it_accepts(capsys):
    """`autoprec predict --json` works, but the verb's --help did not say so: each verb's help names them now."""
    from autoprec.tune._cli import GLOBAL_FLAGS, build_parser

    parser = build_parser()
    for verb in ("search", "predict", "show", "export"):
        with pytest.raises(SystemExit):
            parser.parse_args([verb, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(flag in text for flag, _ in GLOBAL_FLAGS), verb
