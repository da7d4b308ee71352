"""autoprec/tune/_report/_plots.py: the heat maps."""

from __future__ import annotations

import dataclasses
import math

import pytest
from builders import every_format_profile

from autoprec.tune._report._plots import plot_all, plot_profile

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
    slow = dict(metric_source="not measured: measured 2.00x the layer's fp32 time", sqnr_db=math.nan, metric_drop=math.nan)
    table = [dataclasses.replace(r, **slow) if (r.layer, r.format) == ("fc1", "bf16") else r for r in prof.rows]
    plot_profile(table, tmp_path / "p.png")
    formats, layers = ["fp32", "bf16", "fp16", "fp8"], ["fc1", "big", "head"]
    at = {(layers[y], formats[x]): s for x, y, s in texts}
    assert at[("big", "fp16")] == "inf/nan"  # fp16 overflows big's output
    assert at[("head", "fp8")] == "cannot run"  # 4 outputs: no fp8
    assert at[("fc1", "fp32")] == "ref"
    assert at[("fc1", "bf16")] == "ruled out"  # its timing ruled it out: nothing else was measured
    from autoprec.tune._report._report import profile_summary

    fc1 = next(line for line in profile_summary(table).splitlines() if line.startswith("fc1"))
    assert "ruled out" in fc1 and "inf/nan" not in fc1


# ---- laid out for a screen, and cheap at any size (issues 37 and 38) -----------------------------------------------

ALL_FORMATS = ["fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "fp8-rowwise-gw-hp", "fp8-fwd", "fp8-fwd-dgrad",
               "fp8-rowwise-fwd", "fp8-rowwise-fwd-dgrad", "mxfp8"]  # fmt: skip


def profile_table(layers, formats, drop=lambda layer, fmt: 0.0):
    """A profile's rows as the profiler writes them: every (layer, format) measured, SQNR 30 dB, the drop `drop` gives."""
    from autoprec.tune._core._profile_row import ProfileRow

    rows = []
    for layer in layers:
        for fmt in formats:
            ref = fmt == "fp32"
            rows.append(ProfileRow(layer=layer, type="Linear", shape="64x64", format=fmt, status="ok", finite=True,
                         overflow=False, metric_source="measured", time_ms=1.0, time_vs_fp32=1.0,
                         sqnr_db=math.inf if ref else 30.0, metric_drop=0.0 if ref else drop(layer, fmt)))  # fmt: skip
    return rows


def blocks(count, roles=("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down")):
    """`count` layer names of a transformer's blocks (blocks.0.attn.q ...), in model order."""
    return [f"blocks.{i // len(roles)}.{roles[i % len(roles)]}" for i in range(count)]


@pytest.fixture
def laid_out(monkeypatch):
    """The figures the plots save, laid out but not rendered: what a test of their size and rows needs, cheaply."""
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: figures.append(self))
    return figures


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plots save, rendered as they are saved."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: figures.append(self) or save(self, *args, **kwargs))
    return figures


def test_a_profile_of_every_format_is_laid_out_for_a_screen(tmp_path):
    """4 layers in 11 formats made a 3080x330 strip, unreadable at a screen's size (issue 38, 9)."""
    from matplotlib.image import imread

    plot_profile(profile_table(blocks(4), ALL_FORMATS, lambda layer, fmt: 0.001), tmp_path / "p.png")
    height, width, _ = imread(tmp_path / "p.png").shape
    assert width <= 1400 and width < 2.5 * height, (width, height)


def test_a_drop_colour_bar_says_every_drop_is_0(tmp_path, drawn):
    """Every drop 0: the colour bar read -1e-12 .. 1e-12 (issue 38, 9)."""
    plot_profile(profile_table(blocks(3), ["fp32", "bf16", "fp16"]), tmp_path / "p.png")
    (fig,) = drawn
    labels = [ax.get_ylabel() for ax in fig.axes] + [ax.get_title() for ax in fig.axes]
    assert any("all drops 0" in label for label in labels), labels
    ticks = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
    offsets = [ax.yaxis.get_offset_text().get_text() for ax in fig.axes]
    assert not any("e-12" in text.replace("\u2212", "-") or "e\u221212" in text for text in ticks + offsets), (ticks, offsets)


@pytest.mark.parametrize("names", ["roles", "flat"])
def test_a_profile_of_1600_layers_draws_a_screen_of_rows(tmp_path, laid_out, names):
    """A 1200-Linear model's profile.png took longer than the search and 5 GB (issue 37, 10): one row a layer. Now
    beyond PROFILE_ROWS the layers of one block role share a row, the worst of them shown, or, where the names have
    no block roles, the most sensitive layers are drawn and the title says how many were left out."""
    layers = blocks(1600) if names == "roles" else [f"stage{i // 40}_conv{i % 40}" for i in range(1600)]
    worst = layers[6 * 100]  # blocks.100.attn.q: its role's row shows its drop
    table = profile_table(layers, ALL_FORMATS, lambda layer, fmt: 0.5 if layer == worst and fmt == "bf16" else 0.001)
    plot_profile(table, tmp_path / "p.png", title="big")
    (fig,) = laid_out
    heat_maps = [ax for ax in fig.axes if ax.images and ax.get_xticklabels()]
    rows = {ax.images[0].get_array().shape[0] for ax in heat_maps}
    assert max(rows) <= 40, rows  # a screen's
    from autoprec.tune._report._plots import PROFILE_ROWS

    assert rows == ({6} if names == "roles" else {PROFILE_ROWS}), rows
    assert sum(len(ax.texts) for ax in heat_maps) <= 2 * PROFILE_ROWS * len(ALL_FORMATS)
    width, height = fig.get_size_inches()
    assert width <= 14 and height <= 2 * PROFILE_ROWS * 0.3 + 4, (width, height)
    labels = [t.get_text() for t in heat_maps[0].get_yticklabels()]
    title = fig.get_suptitle()
    if names == "roles":
        assert labels[0] == "blocks.*.attn.q (267)" and "1600 layers" in title, (labels, title)
        texts = {(t.get_position(), t.get_text()) for t in heat_maps[1].texts}
        assert ((1, 0), "0.5") in texts  # bf16, blocks.*.attn.q: the worst of the role
    else:
        assert f"{PROFILE_ROWS} most sensitive of 1600" in title and f"{1600 - PROFILE_ROWS} left out" in title, title
        assert "stage15_conv0" in labels  # the one layer that drops 0.5 is among them


def grad_table(layers):
    """grad_ranges.csv's fp16 rows for `layers`: each underflows below 2^(8 + k % 5) and overflows above 2^20."""
    import pandas as pd

    rows = [{"layer": name, "tensor": "all", "format": "fp16", "scale_log2": s, "nonzero": 100,
             "underflow": 1.0 if s < 8 + k % 5 else 0.0, "subnormal": 0.0, "overflow": 0.1 if s > 20 else 0.0}
            for k, name in enumerate(layers) for s in range(25)]  # fmt: skip
    return pd.DataFrame(rows)


def test_grad_ranges_of_1200_layers_draw_a_bounded_number_of_lines(tmp_path, laid_out):
    """grad_ranges.png drew two lines for every layer of a 1200-Linear model (issue 37, 10): beyond GREY_LINES
    unnamed layers, the range they span is shaded instead."""
    from autoprec.tune._measure._gradients import ScaleAdvice
    from autoprec.tune._report._plots import LEGEND_LAYERS, plot_grad_ranges

    layers = blocks(1200)
    advice = ScaleAdvice(low=12, high=20, low_limited_by=(layers[4],), high_limited_by=(layers[7],))
    plot_grad_ranges(grad_table(layers), advice, tmp_path / "g.png")
    (fig,) = laid_out
    ax = fig.axes[0]
    assert len(ax.lines) <= 2 * LEGEND_LAYERS + 4, len(ax.lines)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == [layers[4], layers[7]] and any(text.startswith("1198 other layers") for text in legend), legend


def sweep_result(drops, speedups):
    """A sweep's result with a trial per drop and speedup, budgets 0 and 0.01, each choosing the fastest trial."""
    import pandas as pd
    from builders import finals

    from autoprec import Policy
    from autoprec.tune._report._results import BudgetRow, SweepResult

    trials = pd.DataFrame({"trial": range(len(drops)), "metric_drop": drops, "speedup": speedups, "spread": 0.01,
                           "feasible": True})  # fmt: skip
    front = trials.sort_values("speedup").tail(1)
    best = front.iloc[0]
    table = [BudgetRow(budget=b, budget_given=None, chosen=f"trial {best['trial']}", metric=1.0, metric_drop=best["metric_drop"],
                       step_ms=10.0, spread=0.01, speedup=best["speedup"], uniform_bf16_speedup=1.5, uniform_bf16_drop=0.0,
                       greedy_speedup=1.4, greedy_drop=0.0, peak_bytes=None, memory_saving=None, formats="bf16 3",
                       root="fp32", policy_file=f"policy_{b}.json", why="") for b in (0.0, 0.01)]  # fmt: skip
    return SweepResult(
        table=table, policies={r.budget: Policy(layers={"fc1": "bf16"}) for r in table}, front=front, trials=trials,
        finals=finals({"candidate": "fp32"}, {"candidate": "uniform bf16", "speedup": 1.5}), profile=None, choices=None,
        study_name="s", storage="s.journal",
    )  # fmt: skip


def test_a_sweep_whose_drops_are_all_0_shows_each_trial_and_says_so(tmp_path, laid_out):
    """Every drop 0: pareto.png stacked every trial in one column at 0, each hiding the last (issue 38, 9)."""
    from autoprec.tune._report._plots import plot_pareto

    plot_pareto(sweep_result([0.0] * 12, [1.0 + k / 20 for k in range(12)]), tmp_path / "pareto.png")
    (fig,) = laid_out
    ax = fig.axes[0]
    trials = ax.collections[0].get_offsets()
    assert len(set(trials[:, 0])) == 12, trials
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("all drops 0" in text for text in legend), legend


def test_no_figure_warns_of_its_layout(tmp_path, drawn):
    """matplotlib's 'Tight layout not applied' reached the output (issue 37, 17): one layer in every format, a
    legend of long layer names. Each figure is laid out to fit what it draws."""
    import warnings

    from autoprec.tune._measure._gradients import ScaleAdvice
    from autoprec.tune._report._plots import plot_grad_ranges, plot_pareto

    long = [f"model.encoder.layers.{k}.attention.self.query_key_value_projection" for k in range(20)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot_profile(profile_table(["head"], ALL_FORMATS, lambda layer, fmt: 0.002), tmp_path / "profile.png")
        plot_profile(profile_table(blocks(1600), ALL_FORMATS), tmp_path / "big.png", title="x" * 200)
        plot_grad_ranges(grad_table(long), ScaleAdvice(low=12, high=20, low_limited_by=tuple(long[:12])), tmp_path / "g.png")
        plot_pareto(sweep_result([0.0, 0.001, 0.004], [1.1, 1.3, 1.6]), tmp_path / "pareto.png", title="y" * 150)
        plot_pareto(sweep_result([0.0] * 3, [1.1, 1.3, 1.6]), tmp_path / "pareto0.png")
    assert len(drawn) == 5
    assert [str(w.message) for w in caught] == []


# ---- what the figures say: labels told apart, marks told apart, predictions marked, the format named ---------------


def heat_maps(fig):
    return [ax for ax in fig.axes if ax.images and ax.get_xticklabels()]


@pytest.mark.parametrize("where", ["middle", "end"])
def test_long_layer_names_that_differ_only_in_their_middle_or_end_stay_apart(tmp_path, laid_out, where):
    """profile.png cut long labels in their middle: ResNet's stages (`...stages.0.layers...`, `...stages.1...`) drew
    as one label. The tick labels drawn stay apart, within NAME_CHARS."""
    from autoprec.tune._report._plots import NAME_CHARS

    if where == "middle":
        layers = [f"model.encoder.stages.{k}.layers.0.layer.1.convolution.projection_weight_norm" for k in range(3)]
    else:
        layers = [f"model.encoder.stages.0.layers.0.layer.1.convolution.projection_{k}" for k in range(3)]
    layers.append("classifier")  # no dotted prefix shared by all
    plot_profile(profile_table(layers, ["fp32", "bf16"]), tmp_path / "p.png")
    (fig,) = laid_out
    labels = [t.get_text() for t in heat_maps(fig)[0].get_yticklabels()]
    assert len(set(labels)) == len(layers) and all(len(label) <= NAME_CHARS for label in labels), labels
    for k, label in enumerate(labels[:3]):
        assert (f".{k}." if where == "middle" else f"_{k}") in label, labels


def test_cannot_run_and_not_profiled_are_two_marks_with_a_footnote_and_a_predicted_drop_reads_tilde(tmp_path, laid_out):
    """ "n/a" meant both a format that cannot run and a layer the time budget left unprofiled; a predicted drop drew as
    a measured one (the tables write it ~0.01)."""
    from autoprec.tune._measure._profile_data import NOT_PROFILED

    table = profile_table(["a", "b", "c"], ["fp32", "bf16", "fp16"], lambda layer, fmt: 0.002)
    changed = {
        ("a", "fp16"): dict(status="unsupported", reason="fp16 failed: RuntimeError: no kernel"),
        ("b", "fp16"): dict(status="unsupported", reason=f"{NOT_PROFILED}: the time budget's share ran out"),
        ("c", "bf16"): dict(metric_source="predicted: its 3 layers lowered together dropped the metric by 0.006"),
    }
    table = [dataclasses.replace(r, **changed.get((r.layer, r.format), {})) for r in table]
    plot_profile(table, tmp_path / "p.png")
    (fig,) = laid_out
    sqnr, drop = heat_maps(fig)
    at = {(int(t.get_position()[1]), int(t.get_position()[0])): t.get_text() for t in drop.texts}
    assert at[(0, 2)] == "cannot run" and at[(1, 2)] == "not profiled"
    assert at[(2, 1)] == "~0.002" and at[(0, 1)] == "0.002"  # predicted, measured
    assert not any(t.get_text().startswith("~") for t in sqnr.texts)  # its SQNR was measured
    footnote = fig.get_supxlabel()
    assert "cannot run: " in footnote and "not profiled: " in footnote and "~: a predicted drop" in footnote
    laid_out.clear()
    plot_profile(profile_table(["a"], ["fp32", "bf16"]), tmp_path / "q.png")
    assert laid_out[0].get_supxlabel() == ""  # nothing to explain: no footnote


def test_grad_ranges_says_its_ranges_are_fp16s_under_a_given_title(tmp_path, laid_out):
    from autoprec.tune._report._plots import plot_grad_ranges

    plot_grad_ranges(grad_table(["a", "b"]), None, tmp_path / "g.png", title="resnet18")
    (fig,) = laid_out
    title = fig.axes[0].get_title()
    assert title.startswith("resnet18\n") and "fp16 gradients" in title, title
