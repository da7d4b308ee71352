"""autoprec/tune/_report/_report.py and _show.py, autoprec/tune/_core/_tables.py: the gradient summary, how a policy is shown (its mode, its layers), tables."""

from __future__ import annotations

import math

import pytest
from builders import every_format_profile

from autoprec.tune._report._report import gradient_summary
from autoprec.tune._report._show import mode_text

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def prof():
    return every_format_profile()


def test_gradient_summary_names_the_range_and_its_limits(prof):
    text = gradient_summary(prof.rows, prof.advice())
    lines = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in ("fc1", "big", "head")}
    assert "2^" in lines["big"] and "%" in lines["big"]
    assert "low end set by big" in text and "high end set by head" in text


def test_mode_text():
    from autoprec.tune._core._records import Measured

    assert mode_text(Measured.from_dict({})) == "weights mode"
    train = Measured.from_dict({"mode": "train", "train_steps": 20, "noise_floor": 0.0117})
    assert mode_text(train) == "train mode: 20 steps, noise floor 0.0117"
    assert mode_text(Measured(mode="train")) == "train mode: ? steps, noise floor -"


def test_a_policy_of_many_layers_shows_one_row_per_role_and_format():
    from autoprec import Policy
    from autoprec.tune._report._show import layer_rows

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


def test_a_layer_never_lists_the_format_it_runs_in_as_ruled_out():
    """Uniform bf16 chosen as a whole, where the profile measured one layer slower in bf16 alone: the table showed
    that layer as `bf16` with "bf16 2.67x" ruled out (issue 38)."""
    from autoprec import Policy
    from autoprec.tune._report._show import LayerTable

    slow = "measured 2.67x the layer's fp32 time on this device"
    excluded = {"fc1": {"bf16": slow, "fp8": "measured 3.1x the layer's fp32 time on this device"}}
    table = LayerTable(Policy(layers={"": "bf16", "fc1": "bf16"}, measured={"excluded": excluded}))
    assert table.rows[1] == ["fc1", "bf16", "fp8 3.1x"]


def test_the_layer_table_says_each_reason_once_groups_alike_layers_and_fits_120_columns():
    from autoprec import Policy
    from autoprec.tune._core._tables import WIDTH
    from autoprec.tune._report._show import LayerTable

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


def test_a_shared_row_that_counts_its_layers_names_them_under_the_table():
    """The layers table said "and 2 more like it" without naming them."""
    from autoprec import Policy
    from autoprec.tune._report._show import LayerTable

    names = ["encoder.block.0.attention.query", "encoder.block.1.attention.query", "encoder.block.2.attention.query"]
    table = LayerTable(Policy(layers={"": "fp32", **dict.fromkeys(names, "bf16")}))
    assert table.rows[1][0] == "encoder.block.0.attention.query and 2 more like it"
    for markdown in (False, True):
        flat = " ".join(table.render(markdown=markdown).split())
        assert f"encoder.block.0.attention.query and 2 more like it: {', '.join(names)}" in flat


def test_a_text_table_wraps_its_last_column_to_the_width_under_itself():
    from autoprec.tune._core._tables import text_table

    text = text_table(["layer", "reason"], [["fc1", "word " * 60], ["fc2", "short"]], width=60)
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines) and len(lines) > 4
    assert lines[2].startswith("fc1    word") and lines[3].startswith(" " * 7 + "word") and lines[-1].startswith("fc2    short")


def test_show_says_what_each_format_in_the_policy_means():
    from autoprec import Policy
    from autoprec.tune._report._show import show_policy

    text = show_policy(Policy(layers={"": "bf16", "fc": "fp8-rowwise"}))
    assert "formats: bf16 = torch.autocast(bfloat16); fp8-rowwise = torchao float8 training, rowwise" in text


def test_show_says_each_phase_of_a_schedule_and_the_formats_of_every_phase():
    from autoprec import Policy
    from autoprec.tune._report._show import show_policy

    policy = Policy(layers={"": "bf16", "fc": "nvfp4"}, phases=[{"from_fraction": 0.8, "layers": {"fc": "mxfp8", "": "fp32"}}])
    text = show_policy(policy)
    assert "from 0.8 of the run: fc mxfp8, <model> fp32" in text
    assert "formats: fp32 = " in text and "mxfp8 = " in text and "nvfp4 = " in text


def test_show_speaks_of_the_fp8_backend_only_for_a_policy_that_runs_fp8():
    from autoprec import Policy
    from autoprec.tune._report._show import show_policy

    measured = {"device": "cpu", "fp8": "emulation", "chosen": "uniform bf16"}
    assert "fp8: emulation" not in show_policy(Policy(layers={"": "bf16"}, measured=measured))
    assert "fp8: emulation" in show_policy(Policy(layers={"": "bf16", "fc": "fp8"}, measured=measured))


# ---- which layer breaks --------------------------------------------------------------------------------------------


def _gemm_table(rows):
    """A profile's rows of (layer, format, fprop dB, dgrad dB, wgrad dB, finite, overflow, metric drop); fp32 rows added."""
    from autoprec.tune._core._profile_row import ProfileRow

    out = []
    for layer in dict.fromkeys(r[0] for r in rows):
        out.append(ProfileRow(layer=layer, type="Linear", shape="8x8", format="fp32", status="ok", sqnr_db=math.inf,
                              dgrad_sqnr_db=math.inf, grad_sqnr_db=math.inf, finite=True, overflow=False, max_abs=1.0,
                              metric_drop=0.0))  # fmt: skip
    for layer, fmt, fprop, dgrad, wgrad, finite, overflow, drop in rows:
        out.append(ProfileRow(layer=layer, type="Linear", shape="8x8", format=fmt, status="ok", sqnr_db=fprop,
                              dgrad_sqnr_db=dgrad, grad_sqnr_db=wgrad, finite=finite, overflow=overflow, max_abs=9e4,
                              metric_drop=drop))  # fmt: skip
    return out


def test_a_profile_where_nothing_breaks_says_so_in_one_line():
    from autoprec.tune._report._report import breaks_summary

    table = _gemm_table([("fc1", "bf16", 50.0, 50.0, 50.0, True, False, 0.0), ("fc1", "fp8", 29.0, 24.0, 20.0, True, False, 0.01),
                         ("fc1", "fp16", 69.0, 30.0, 69.0, True, False, 0.0)])  # fmt: skip
    text = breaks_summary(table)
    assert text == (
        "which layer breaks: none; every GEMM measured is finite, its SQNR against fp32 >= 20 dB (fp8) / 30 dB (bf16, fp16)"
    )
    assert len(text) <= 120


def test_which_layer_breaks_lists_non_finite_first_then_the_lowest_sqnr_within_the_width():
    from autoprec.tune._core._tables import WIDTH
    from autoprec.tune._report._report import breaks, breaks_summary

    table = _gemm_table([
        ("fc1", "fp8", 28.0, 12.0, 19.9, True, False, 0.001),  # dgrad and wgrad under fp8's 20 dB
        ("fc1", "bf16", 50.0, 29.0, 50.0, True, False, 0.0),  # dgrad under 16-bit formats' 30 dB
        ("big", "fp16", math.nan, 6.0, 3.0, False, True, math.nan),  # overflows: its output non-finite
        ("big", "fp8", 29.0, 25.0, math.nan, False, False, math.nan),  # the weight gradient non-finite
        ("head", "fp8", 30.0, 25.0, 25.0, False, False, math.nan),  # every GEMM finite: the loss or metric was not
        ("ok", "fp8", 20.0, 20.0, 20.0, True, False, 0.5),  # at the floor: not broken
    ])  # fmt: skip
    found = [(b.layer, b.format, b.gemm) for b in breaks(table)]
    assert found == [("big", "fp16", "fprop"), ("big", "fp8", "wgrad"), ("head", "fp8", "-"),
                     ("big", "fp16", "wgrad"), ("big", "fp16", "dgrad"), ("fc1", "fp8", "dgrad"),
                     ("fc1", "fp8", "wgrad"), ("fc1", "bf16", "dgrad")]  # fmt: skip
    text = breaks_summary(table)
    assert "fp16 overflow: max |output| 9e+04 > 65504" in text and "non-finite loss or metric" in text
    assert all(len(line) <= WIDTH for line in text.splitlines())
    short = breaks_summary(table, limit=3)
    assert "and 5 more" in short and "fc1" not in short.split("and 5 more")[0].split("-----")[-1]
    # a budget adds the rows whose single-layer drop is over it, after those the GEMMs break
    over = breaks(table, budget=0.1)
    assert (over[-1].layer, over[-1].gemm, over[-1].why) == ("ok", "-", "metric drop over the budget 0.1")


def test_a_gemm_the_layer_does_not_run_is_not_judged():
    import dataclasses

    from autoprec.tune._report._report import breaks

    table = _gemm_table([("first", "fp8", 29.0, math.nan, 25.0, False, False, math.nan)])
    table[0] = dataclasses.replace(table[0], dgrad_sqnr_db=math.nan)  # its fp32 row, on data: no gradient into its inputs
    assert [(b.gemm, b.why) for b in breaks(table)] == [("-", "non-finite loss or metric")]


def test_a_compact_table_keeps_each_formats_reasons_apart_and_says_each_once():
    """30 layers of one role whose reasons differ only in numbers share a row; one format's reason never lands under
    another's, and the legend has one line per reason, its numbers as ranges."""
    from autoprec import Policy
    from autoprec.tune._report._show import LayerTable

    layers = {"": "bf16", **{f"blocks.{i}.fc": "bf16" for i in range(30)}}
    excluded = {
        f"blocks.{i}.fc": {"fp16": "fp16 gradients overflow even at loss scale 1 (0.5% of elements above 65504)",
                           "fp8": f"alone drops the metric by {0.01 + i / 1000:.3g} > budget 0.01"}
        for i in range(30)
    }  # fmt: skip
    table = LayerTable(Policy(layers=layers, measured={"excluded": excluded}))
    assert table.rows[1] == ["blocks.*.fc (30 layers)", "bf16", "fp16 [1], fp8 [2]"]
    notes = table.notes()
    assert len(notes) == 2 and notes[0].startswith("[1] gradients overflow even at loss scale 1")
    assert notes[1] == "[2] alone drops the metric by 0.01-0.039 > budget 0.01"


def test_a_markdown_table_keeps_each_row_on_its_line():
    """A recorded value with a line break or a `|` ended its row or split its cell in summary.md (issue 37, 15)."""
    from autoprec.tune._core._tables import markdown_table

    text = markdown_table(["name", "error"], [["trial 3", "boom\nTraceback | <b>line</b>\r\n`x`"]])
    assert text.splitlines() == [
        "| name | error |",
        "|---|---|",
        "| trial 3 | boom Traceback \\| &lt;b&gt;line&lt;/b&gt; \\`x\\` |",
    ]


def test_show_says_the_layout_a_sharded_search_measured_on():
    """The sharded policy recorded its world size and mesh, but neither `show` nor the summary said them (issue 60, 9):
    a policy measured on 8 ranks read as one measured on one device."""
    from autoprec import Policy
    from autoprec.tune._report._show import show_policy

    layout = {"world_size": 8, "mesh": [2, 4], "parallelize": "model.py:parallelize"}
    text = " ".join(show_policy(Policy(layers={"": "bf16"}, measured={"device": "cuda", "layout": layout})).split())
    assert "sharded over 8 ranks (mesh 2x4, by model.py:parallelize)" in text
    assert "sharded" not in show_policy(Policy(layers={"": "bf16"}, measured={"device": "cuda"}))
