"""autoprec/tune/_report/_results.py: what a search and a sweep return, read as a person reads it (the summary's first
line, the sweep's table, the search's cost)."""

from __future__ import annotations


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


def test_a_policy_that_all_gathers_fp8_weights_says_so_in_the_search_summary_and_in_show():
    """The layer table shows formats only: a sharded search's fp8 all-gather is said beside it, with the call it needs."""
    import types

    from builders import finals

    from autoprec import Policy
    from autoprec.tune._report._results import search_summary
    from autoprec.tune._report._show import show_policy

    rows = finals({"candidate": "fp32", "speedup": 1.0, "spread": 0.01}, {"candidate": "trial 4", "speedup": 1.3, "spread": 0.01})
    measured = {"chosen": "trial 4", "budget": 0.01}
    gathering = Policy(layers={"": "bf16", "a": "fp8", "b": "fp8-rowwise"}, measured=measured, fsdp_fp8_all_gather=True)
    line = "FSDP2: the weights of the fp8 layers all-gathered in fp8"
    for policy, said in ((gathering, True), (Policy(layers=gathering.layers, measured=measured), False)):
        result = types.SimpleNamespace(policy=policy, finals=rows, noise=None, cost=None, run_steps=None)
        assert (line in search_summary(result)) is said and (line in show_policy(policy)) is said
    assert "autoprec.after_optimizer_step(model) after each optimizer step" in show_policy(gathering)


def test_a_policy_tied_with_fp32_and_with_a_faster_one_is_not_said_to_show_no_gain():
    """Separation is not transitive: uniform bf16 is tied with trial 3 (the fastest, told from fp32) and with fp32, and
    is chosen as the alternative. "no gain over fp32 shown" beside a bf16 policy read as a reason to run fp32 (issue 60,
    10): the line names the candidate measured ahead of fp32 that the choice is tied with."""
    import types

    from builders import finals

    from autoprec import Policy
    from autoprec.tune._decide._choose import choose, not_separated
    from autoprec.tune._report._results import headline

    candidates = {
        "fp32": Policy(layers={"": "fp32"}),
        "uniform bf16": Policy(layers={"": "bf16"}),
        "trial 3": Policy(layers={"": "bf16", "head": "fp32"}),
    }
    rows = finals({"candidate": "fp32", "speedup": 1.0, "spread": 0.10, "feasible": True, "metric_drop": 0.0},
                  {"candidate": "uniform bf16", "speedup": 1.08, "spread": 0.10, "feasible": True, "metric_drop": 0.0},
                  {"candidate": "trial 3", "speedup": 1.16, "spread": 0.10, "feasible": True, "metric_drop": 0.0})  # fmt: skip
    name, why = choose(rows, candidates)
    tied = not_separated(rows, name)
    assert name == "uniform bf16" and "fp32" in tied and "trial 3" in tied  # the case, as the choice makes it
    policy = Policy(layers={"": "bf16"}, measured={"chosen": name, "why": why, "not_separated": tied, "budget": 0.01})
    line = headline(types.SimpleNamespace(policy=policy, finals=rows))
    assert "no gain over fp32" not in line
    assert line.startswith("a tie inside the noise: uniform bf16 (1.08x fp32's")
    assert "trial 3 measured faster than fp32 beyond the spread" in line and "is chosen as the alternative" in line
