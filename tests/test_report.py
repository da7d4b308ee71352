"""autoprec/tune/report.py: the gradient summary, the heat maps, and how a policy's mode is shown."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from short_timing import FAST_PROFILE

from autoprec.tune import load_task, prepare, profile
from autoprec.tune.report import gradient_summary, mode_text, plot_all, plot_profile
from autoprec.tune.space import space_from_dict

MODELS = Path(__file__).parent / "models"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def prof():
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    # nothing ruled out for its speed (fp16 and fp8 are slow on CPUs): every measurement is there to show
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16", "fp16", "fp8"]}, "prune": {"slower_than": 1e9}})
    return profile(workload, space, FAST_PROFILE, progress=False)


def test_heat_maps_are_written(prof, tmp_path):
    paths = plot_all(prof, tmp_path, title="overflow_mlp")
    assert [p.name for p in paths] == ["profile.png", "grad_ranges.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000


def test_heat_map_marks_what_went_wrong(prof, tmp_path, monkeypatch):
    texts = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.text
    monkeypatch.setattr(
        matplotlib.axes.Axes, "text", lambda self, x, y, s, **kw: texts.append((x, y, s)) or original(self, x, y, s, **kw)
    )
    table = prof.table.copy()
    slow = (table["layer"] == "fc1") & (table["format"] == "bf16")
    table.loc[slow, ["metric_source", "sqnr_db", "metric_drop"]] = [
        "not measured: measured 2.00x the layer's fp32 time",
        math.nan,
        math.nan,
    ]
    plot_profile(table, tmp_path / "p.png")
    formats, layers = ["fp32", "bf16", "fp16", "fp8"], ["fc1", "big", "head"]
    at = {(layers[y], formats[x]): s for x, y, s in texts}
    assert at[("big", "fp16")] == "inf/nan"  # fp16 overflows big's output
    assert at[("head", "fp8")] == "n/a"  # 4 outputs: no fp8
    assert at[("fc1", "fp32")] == "ref"
    assert at[("fc1", "bf16")] == "ruled out"  # its timing ruled it out: nothing else was measured
    from autoprec.tune.report import profile_summary

    fc1 = next(line for line in profile_summary(table).splitlines() if line.startswith("fc1"))
    assert "ruled out" in fc1 and "inf/nan" not in fc1


def test_gradient_summary_names_the_range_and_its_limits(prof):
    text = gradient_summary(prof.table, prof.advice())
    lines = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in ("fc1", "big", "head")}
    assert "2^" in lines["big"] and "%" in lines["big"]
    assert "low end set by big" in text and "high end set by head" in text


def test_mode_text():
    from autoprec.tune.records import Measured

    assert mode_text(Measured.from_dict({})) == "weights mode"
    train = Measured.from_dict({"mode": "train", "train_steps": 20, "noise_floor": 0.0117})
    assert mode_text(train) == "train mode: 20 steps, noise floor 0.0117"
    assert mode_text(Measured(mode="train")) == "train mode: ? steps, noise floor -"


def test_a_policy_of_many_layers_shows_one_row_per_role_and_format():
    from autoprec import Policy
    from autoprec.tune.report import layer_rows

    layers = {"": "bf16", **{f"blocks.{i}.q": ("fp32" if i == 3 else "bf16") for i in range(30)}, "head": "fp32"}
    excluded = {f"blocks.{i}.q": {"fp8": f"measured {1.3 + i / 100:.2f}x the layer's fp32 time on this device",
                                  "fp8-rowwise": "needs CUDA compute capability 8.9+"} for i in range(30)}  # fmt: skip
    rows = layer_rows(Policy(layers=layers, measured={"excluded": excluded}))
    assert rows[0][:2] == ["(model root: all else)", "bf16"]
    # a number the layers differ in shows as its range; one they share, as itself
    assert rows[1] == ["blocks.*.q (29 layers)", "bf16", "fp8 1.3-1.59x, fp8-rowwise [1]"]
    assert rows[2][:2] == ["blocks.3.q", "fp32"] and rows[3] == ["head", "fp32", ""]
    small = layer_rows(Policy(layers={"": "bf16", "blocks.0.q": "bf16"}, measured={"excluded": excluded}))
    assert small[1][2] == "fp8 1.3x, fp8-rowwise [1]"


LONG = ("needs CUDA compute capability 8.9+ kernels on this device; torchao's emulation of this recipe fails inside bf16 "
        "autocast (a long reason that once ran to 400 characters a row, four times over)")  # fmt: skip


def test_the_layer_table_says_each_reason_once_groups_alike_layers_and_fits_120_columns():
    from autoprec import Policy
    from autoprec.tune.report import WIDTH, LayerTable

    layers = {"": "bf16", "fc1": "bf16", "fc2": "bf16", "fc3": "bf16", "head": "bf16"}
    excluded = {
        "fc1": {"fp8": "measured 6.39x the layer's fp32 time on this device", "fp8-rowwise-gw-hp": f"fp8-rowwise-gw-hp {LONG}"},
        **{n: {"fp8": "measured 3.21x the layer's fp32 time on this device", "fp8-rowwise-gw-hp": f"fp8-rowwise-gw-hp {LONG}"}
           for n in ("fc2", "fc3")},
        "head": {"fp8": "fp8 needs in/out features divisible by 16, got (1024, 10)",
                 "fp8-rowwise": "fp8-rowwise needs in/out features divisible by 16, got (1024, 10)",
                 "fp8-rowwise-gw-hp": f"fp8-rowwise-gw-hp {LONG}"},
    }  # fmt: skip
    table = LayerTable(Policy(layers=layers, measured={"excluded": excluded}))
    assert table.rows == [
        ["(model root: all else)", "bf16", ""],
        ["fc1", "bf16", "fp8 6.39x, fp8-rowwise-gw-hp [1]"],
        ["fc2, fc3", "bf16", "fp8 3.21x, fp8-rowwise-gw-hp [1]"],  # the same formats and reasons: one row
        ["head", "bf16", "fp8 [2], fp8-rowwise [2], fp8-rowwise-gw-hp [1]"],  # one reason, whichever format says it
    ]
    text = table.render()
    assert text.count("needs CUDA compute capability") == 1 and text.count("divisible by 16") == 1
    flat = " ".join(text.split())  # the legend wraps its lines to the width
    assert "[1] " + " ".join(LONG.split()) in flat and "[2] needs in/out features divisible by 16, got (1024, 10)" in flat
    assert "Nx: the profile measured the layer N times slower" in flat
    assert all(len(line) <= WIDTH for line in text.splitlines())


def test_a_text_table_wraps_its_last_column_to_the_width_under_itself():
    from autoprec.tune.report import text_table

    text = text_table(["layer", "reason"], [["fc1", "word " * 60], ["fc2", "short"]], width=60)
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines) and len(lines) > 4
    assert lines[2].startswith("fc1    word") and lines[3].startswith(" " * 7 + "word") and lines[-1].startswith("fc2    short")


def test_show_says_what_each_format_in_the_policy_means():
    from autoprec import Policy
    from autoprec.tune.report import show_policy

    text = show_policy(Policy(layers={"": "bf16", "fc": "fp8-rowwise"}))
    assert "formats: bf16 = torch.autocast(bfloat16); fp8-rowwise = torchao float8 training, rowwise" in text


def test_the_summarys_first_line_says_plainly_when_the_answer_is_a_tie_inside_the_noise():
    import types

    from builders import finals

    from autoprec import Policy
    from autoprec.tune.report import headline, show_policy

    rows = finals({"candidate": "fp32", "speedup": 1.0, "spread": 0.7, "feasible": True, "metric_drop": 0.0},
                  {"candidate": "uniform bf16", "speedup": 1.59, "spread": 1.03, "feasible": True, "metric_drop": 0.0})  # fmt: skip
    tied = Policy(layers={"": "bf16"}, measured={"chosen": "uniform bf16", "not_separated": ["fp32"], "budget": 0.01})
    line = headline(types.SimpleNamespace(policy=tied, finals=rows))
    assert line.startswith("a tie inside the noise: uniform bf16") and "fp32" in line and "--remeasure" in line
    assert "±51.5%" in line  # the widest spread of the tied candidates, as the results table writes it
    assert "not separated" in show_policy(tied) and "not as the fastest" in show_policy(tied)
    clear = Policy(layers={"": "bf16"}, measured={"chosen": "uniform bf16", "budget": 0.01})
    line = headline(types.SimpleNamespace(policy=clear, finals=rows))
    assert line.startswith("chosen: uniform bf16, 1.59x fp32") and "tie" not in line
    assert "not separated" not in show_policy(clear)


def test_show_speaks_of_the_fp8_backend_only_for_a_policy_that_runs_fp8():
    from autoprec import Policy
    from autoprec.tune.report import show_policy

    measured = {"device": "cpu", "fp8": "emulation", "chosen": "uniform bf16"}
    assert "fp8: emulation" not in show_policy(Policy(layers={"": "bf16"}, measured=measured))
    assert "fp8: emulation" in show_policy(Policy(layers={"": "bf16", "fc": "fp8"}, measured=measured))
