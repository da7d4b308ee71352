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


def test_the_summarys_first_line_says_plainly_when_the_answer_is_a_tie_inside_the_noise():
    import types

    from builders import finals

    from autoprec import Policy
    from autoprec.tune._report._results import headline
    from autoprec.tune._report._show import show_policy

    rows = finals({"candidate": "fp32", "speedup": 1.0, "spread": 0.7, "feasible": True, "metric_drop": 0.0},
                  {"candidate": "uniform bf16", "speedup": 1.59, "spread": 1.03, "feasible": True, "metric_drop": 0.0})  # fmt: skip
    tied = Policy(layers={"": "bf16"}, measured={"chosen": "uniform bf16", "not_separated": ["fp32"], "budget": 0.01})
    line = headline(types.SimpleNamespace(policy=tied, finals=rows))
    # tied with fp32, its 1.59x is noise: never said as a gain
    assert line.startswith("a tie inside the noise, no gain over fp32 shown: uniform bf16 and fp32") and "--remeasure" in line
    assert "1.59x" not in line
    assert "103.0%" in line  # the widest spread of the tied candidates, as the results table writes it
    assert "not separated" in show_policy(tied) and "not shown faster than them" in show_policy(tied)
    clear = Policy(layers={"": "bf16"}, measured={"chosen": "uniform bf16", "budget": 0.01})
    line = headline(types.SimpleNamespace(policy=clear, finals=rows))
    assert line.startswith("chosen: uniform bf16, 1.59x fp32") and "tie" not in line
    assert "not separated" not in show_policy(clear)


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


def test_a_tie_among_equally_safe_searched_policies_is_not_called_the_safer_one():
    import types

    from builders import finals

    from autoprec import Policy
    from autoprec.tune._report._results import headline

    rows = finals(
        {"candidate": "trial 3", "speedup": 1.50, "spread": 0.04}, {"candidate": "trial 5", "speedup": 1.48, "spread": 0.04}
    )
    policy = Policy(
        layers={"": "bf16"}, measured={"chosen": "trial 3", "not_separated": ["trial 5"], "why": "the fastest within budget"}
    )
    line = headline(types.SimpleNamespace(policy=policy, finals=rows))
    assert "the fastest measured, is chosen" in line and "safer" not in line
    assert "1.50x fp32's" in line and "no gain" not in line  # tied with another policy, not with fp32: a gain


def test_a_tie_that_fp32_wins_says_no_gain_and_why_fp32():
    """Tied, fp32 is chosen over uniform bf16 (fewer layers below fp32): the first line says no gain is shown and why
    fp32, not bf16's measured "1.26x"."""
    import types

    from builders import finals

    from autoprec import Policy
    from autoprec.tune._decide._choose import choose
    from autoprec.tune._report._results import headline

    candidates = {"fp32": Policy(layers={"": "fp32", "a": "fp32"}), "uniform bf16": Policy(layers={"": "bf16", "a": "bf16"})}
    rows = finals({"candidate": "fp32", "speedup": 1.0, "spread": 0.6, "feasible": True, "metric_drop": 0.0},
                  {"candidate": "uniform bf16", "speedup": 1.26, "spread": 0.6, "feasible": True, "metric_drop": 0.0})  # fmt: skip
    name, why = choose(rows, candidates)
    policy = Policy(layers={"": "fp32"}, measured={"chosen": name, "why": why, "not_separated": ["uniform bf16"]})
    line = headline(types.SimpleNamespace(policy=policy, finals=rows))
    assert line.startswith("a tie inside the noise, no gain over fp32 shown: fp32 and uniform bf16")
    assert "fp32, the one with fewer layers below fp32, is chosen" in line and "1.26" not in line


def test_a_sweeps_table_says_the_tie_its_policy_file_records():
    """Issue 38, 2: the sweep showed a searched policy at 1.70x beside uniform bf16's 1.22x with no tie line, while the
    policy file it wrote listed uniform bf16 and fp32 as not separated from it (quiet, it ran at 1.02x of autocast)."""
    import types

    import pandas as pd
    from builders import finals

    from autoprec import Policy
    from autoprec.tune._report._results import BudgetRow, sweep_summary

    rows = finals({"candidate": "fp32", "speedup": 1.0, "spread": 1.1}, {"candidate": "uniform bf16", "speedup": 1.22, "spread": 1.1},
                  {"candidate": "profile greedy 0.01", "speedup": 1.75, "spread": 0.9},
                  {"candidate": "trial 12", "speedup": 1.70, "spread": 0.9})  # fmt: skip
    measured = {"chosen": "trial 12", "not_separated": ["fp32", "uniform bf16", "profile greedy 0.01"], "budget": 0.01,
                "greedy": "profile greedy 0.01", "why": "the fastest within budget"}  # fmt: skip
    row = BudgetRow(
        budget=0.01, budget_given=None, chosen="trial 12", metric=0.9, metric_drop=0.0, step_ms=10.0, spread=0.9,
        speedup=1.70, uniform_bf16_speedup=1.22, uniform_bf16_drop=0.0, greedy_speedup=1.75, greedy_drop=0.0,
        peak_bytes=None, memory_saving=None, formats="bf16 2", root="bf16", policy_file="policy-budget-0.01.json",
        why="the fastest within budget", not_separated="fp32; uniform bf16; profile greedy 0.01",
    )  # fmt: skip
    result = types.SimpleNamespace(
        table=[row], policies={0.01: Policy(layers={"": "bf16"}, measured=measured)}, finals=rows, trials=pd.DataFrame(),
        front=pd.DataFrame(), choices=types.SimpleNamespace(describe=lambda: "per layer"), cost=None, saved=None,
    )  # fmt: skip
    text = sweep_summary(result)
    [cells] = [line for line in text.splitlines() if line.lstrip().startswith("0.01 ")]
    assert "trial 12 (tie)" in cells and "1.220 (tie)" in cells and "1.750 (tie)" in cells
    assert (
        "- 0.01: tie with fp32, uniform bf16, profile greedy 0.01 within 110.0% noise: trial 12, the fastest measured, is written"
        in text
    )


def test_a_markdown_table_keeps_each_row_on_its_line():
    """A recorded value with a line break or a `|` ended its row or split its cell in summary.md (issue 37, 15)."""
    from autoprec.tune._core._tables import markdown_table

    text = markdown_table(["name", "error"], [["trial 3", "boom\nTraceback | <b>line</b>\r\n`x`"]])
    assert text.splitlines() == [
        "| name | error |",
        "|---|---|",
        "| trial 3 | boom Traceback \\| &lt;b&gt;line&lt;/b&gt; \\`x\\` |",
    ]


def test_a_sweeps_tables_never_break_a_policy_file_name():
    """sweep.md and the printed sweep table broke file names over lines (`results/digits/polic` / `y-budget-0.01.json`):
    the text table wraps only its formats column, at spaces; sweep.md lists the files under its table, a line each."""
    import types

    import pandas as pd
    from builders import finals

    from autoprec import Policy
    from autoprec.tune._report._results import BudgetRow, sweep_summary

    rows = finals(
        {"candidate": "fp32", "speedup": 1.0, "spread": 0.02}, {"candidate": "uniform bf16", "speedup": 1.2, "spread": 0.02}
    )
    file = "results/digits/policy-budget-0.01.json"
    row = BudgetRow(
        budget=0.01, budget_given=None, chosen="uniform bf16", metric=0.9, metric_drop=0.0, step_ms=10.0, spread=0.02,
        speedup=1.2, uniform_bf16_speedup=1.2, uniform_bf16_drop=0.0, greedy_speedup=1.1, greedy_drop=0.0,
        peak_bytes=None, memory_saving=None, formats="bf16 2, fp16 3, fp8-rowwise-gw-hp 4", root="bf16", policy_file=file,
        why="the fastest within budget", not_separated="",
    )  # fmt: skip
    result = types.SimpleNamespace(
        table=[row], policies={0.01: Policy(layers={"": "bf16"}, measured={"chosen": "uniform bf16", "budget": 0.01})},
        finals=rows, trials=pd.DataFrame(), front=pd.DataFrame(), choices=types.SimpleNamespace(describe=lambda: "x"),
        cost=None, saved=None,
    )  # fmt: skip
    text = sweep_summary(result)
    assert any(file in line and line.lstrip().startswith("0.01 ") for line in text.splitlines()), text
    markdown = sweep_summary(result, markdown=True)
    assert f"- 0.01: {file}" in markdown.splitlines()
    assert not any(file in line for line in markdown.splitlines() if line.startswith("|"))


def test_the_search_cost_is_priced_in_the_chosen_policys_steps_and_as_a_share_of_the_run_it_tunes():
    from autoprec.tune._report._results import search_cost

    cost = {"seconds": {"profile": 20.0, "trials": 70.0, "final re-measure": 30.0}, "counts": {}}
    assert search_cost(cost, 60.0, None) == (
        "search cost: 120 s, the time of 2,000 training steps of the chosen policy (60 ms each); --run-steps N prices "
        "it as a share of the training run it tunes"
    )
    assert search_cost(cost, 60.0, 200_000).endswith(": 1.00% of a 200,000-step run, within the 2% a search should cost")
    assert search_cost(cost, 60.0, 50_000).endswith(": 4.00% of a 50,000-step run, over the 2% a search should cost")
    assert search_cost(cost, float("nan"), 1000) == "" and search_cost({"seconds": {}}, 60.0, None) == ""
