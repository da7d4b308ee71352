"""autoprec/tune/plots.py: the heat maps."""

from __future__ import annotations

import math

import pytest
from builders import every_format_profile

from autoprec.tune.plots import plot_all, plot_profile

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def prof():
    return every_format_profile()


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
