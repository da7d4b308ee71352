"""autoprec/tune/report.py: the gradient summary, the heat maps, and how a policy's mode is shown."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from autoprec.tune import load_task, prepare, profile
from autoprec.tune.report import gradient_summary, mode_text, plot_all, plot_profile
from autoprec.tune.space import space_from_dict
from short_timing import FAST_PROFILE

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
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda self, x, y, s, **kw: texts.append((x, y, s)) or original(self, x, y, s, **kw))
    table = prof.table.copy()
    slow = (table["layer"] == "fc1") & (table["format"] == "bf16")
    table.loc[slow, ["metric_source", "sqnr_db", "metric_drop"]] = ["not measured: measured 2.00x the layer's fp32 time", math.nan, math.nan]
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
    assert rows[1] == ["blocks.*.q (29 layers)", "bf16",
                       "fp8 (measured 1.30-1.59x the layer's fp32 time on this device), fp8-rowwise (needs CUDA compute capability 8.9+)"]
    assert rows[2][:2] == ["blocks.3.q", "fp32"] and rows[3] == ["head", "fp32", ""]
    small = layer_rows(Policy(layers={"": "bf16", "blocks.0.q": "bf16"}, measured={"excluded": excluded}))
    assert small[1][2].startswith("fp8 (measured 1.30x the layer's fp32 time on this device)")


def test_show_says_what_each_format_in_the_policy_means():
    from autoprec import Policy
    from autoprec.tune.report import show_policy

    text = show_policy(Policy(layers={"": "bf16", "fc": "fp8-rowwise"}))
    assert "formats: bf16 = torch.autocast(bfloat16); fp8-rowwise = torchao float8 training, rowwise" in text
