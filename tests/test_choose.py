"""autoprec/tune/_decide/_choose.py: the decision rule over re-measured candidates (records built by hand, tests/builders.py)."""

import dataclasses
import types

import torch
from builders import finals
from test_search import SPACE, fake_profile

from autoprec import Policy
from autoprec.tune._measure._choices import build_choices


def test_choose_prefers_fewer_fp16_fp8_layers_when_the_lead_is_noise():
    from autoprec import Policy
    from autoprec.tune._decide._choose import choose, safer_variant

    risky = Policy(layers={"": "fp32", "a": "fp16", "b": "bf16"})
    choices = build_choices(fake_profile([("a", "fp32", 0, 1, True, False), ("a", "bf16", 0, 1, True, False),
                                          ("a", "fp16", 0, 1, True, False), ("b", "fp32", 0, 1, True, False),
                                          ("b", "bf16", 0, 1, True, False)]), SPACE, 0.01, torch.device("cpu"))  # fmt: skip
    safe = safer_variant(risky, choices)
    assert {k: v.value for k, v in safe.layers.items()} == {"": "fp32", "a": "bf16", "b": "bf16"}
    assert safer_variant(safe, choices) is None
    candidates = {"fp32": Policy(), "risky": risky, "safe": safe}

    def measured(risky_speedup, spread):
        return finals(
            {"candidate": "fp32", "speedup": 1.0, "spread": spread, "feasible": True},
            {"candidate": "risky", "speedup": risky_speedup, "spread": spread, "feasible": True},
            {"candidate": "safe", "speedup": 1.5, "spread": spread, "feasible": True},
        )

    name, why = choose(measured(1.53, 0.04), candidates)  # 2% lead, 4% spread: noise
    assert name == "safe" and "inside the spread" in why
    assert choose(measured(1.65, 0.04), candidates)[0] == "risky"  # 10% lead: real


def test_a_searched_policy_not_separated_from_an_alternative_is_never_chosen_over_it():
    """Under load (spreads 120%), a bf16/fp32 mix measured 2.15x against uniform bf16's 1.60x and fp32's 1.00x is a
    tie: an alternative is chosen (fp32, the fewest layers below fp32) and the tie recorded, never the policy written as
    faster than what the user had."""
    from autoprec.tune._decide._choose import choose, not_separated

    candidates = {"fp32": Policy(), "uniform bf16": Policy(layers={"": "bf16"}),
                  "trial 7": Policy(layers={"": "bf16", "a": "fp32"})}  # fmt: skip
    rows = [
        {"candidate": "fp32", "speedup": 1.0, "spread": 1.2, "feasible": True},
        {"candidate": "uniform bf16", "speedup": 1.60, "spread": 1.2, "feasible": True},
        {"candidate": "trial 7", "speedup": 2.15, "spread": 1.2, "feasible": True},  # no more fp16/fp8 than bf16
    ]
    name, why = choose(finals(*rows), candidates)
    assert name == "fp32" and "not separated from the alternative fp32" in why
    assert set(not_separated(finals(*rows), name)) == {"uniform bf16", "trial 7"}
    for row in rows:
        row["spread"] = 0.04  # a quiet machine: the lead is real
    assert choose(finals(*rows), candidates)[0] == "trial 7" and not_separated(finals(*rows), "trial 7") == []


def test_choose_is_never_slower_than_the_fastest_alternative_within_budget():
    """A safer finalist tied with the top one is still refused when an alternative measured faster than it."""
    from autoprec.tune._decide._choose import choose

    candidates = {
        "fp32": Policy(),
        "uniform bf16": Policy(layers={"": "bf16"}),
        "trial 3": Policy(layers={"": "bf16", "a": "fp8", "b": "fp8"}),
        "trial 5": Policy(layers={"": "bf16", "a": "bf16"}),
    }
    rows = [
        {"candidate": "fp32", "speedup": 1.0, "spread": 0.04, "feasible": True},
        {"candidate": "uniform bf16", "speedup": 1.49, "spread": 0.04, "feasible": True},
        {"candidate": "trial 3", "speedup": 1.50, "spread": 0.04, "feasible": True},
        {"candidate": "trial 5", "speedup": 1.46, "spread": 0.04, "feasible": True},  # safer, tied, but below bf16
    ]
    name, why = choose(finals(*rows), candidates)
    assert name == "uniform bf16" and "inside the spread" in why
    rows[2]["speedup"] = 1.7  # a real lead: the searched policy
    assert choose(finals(*rows), candidates) == ("trial 3", "the fastest within budget")
    rows[2]["feasible"] = False
    name, why = choose(finals(*rows), candidates)
    assert name == "uniform bf16" and "is an alternative" in why


def test_tf32_is_measured_but_never_chosen_as_the_policy():
    from autoprec.tune._core._records import Candidate
    from autoprec.tune._decide._choose import choose

    fp32 = Policy(layers={"": "fp32"})
    candidates = {"fp32": Candidate(fp32), "TF32": Candidate(fp32, tf32=True)}
    measured = finals(
        {"candidate": "fp32", "speedup": 1.0, "spread": 0.01, "feasible": True},
        {"candidate": "TF32", "speedup": 3.0, "spread": 0.01, "feasible": True},
    )
    assert choose(measured, candidates)[0] == "fp32"


def test_uniform_bf16_under_cuda_graphs_is_measured_but_never_chosen_as_the_policy():
    """CUDA graphs are a way to compile: the fastest row, but no per-layer policy can be written of it."""
    from autoprec.tune._core._names import BF16, BF16_GRAPHS
    from autoprec.tune._core._records import Candidate
    from autoprec.tune._decide._choose import choose

    bf16 = Policy(layers={"": "bf16"})
    candidates = {"fp32": Candidate(Policy()), BF16: Candidate(bf16), BF16_GRAPHS: Candidate(bf16, cuda_graphs=True)}
    measured = finals(
        {"candidate": "fp32", "speedup": 1.0, "spread": 0.01, "feasible": True},
        {"candidate": BF16, "speedup": 2.0, "spread": 0.01, "feasible": True},
        {"candidate": BF16_GRAPHS, "speedup": 5.2, "spread": 0.01, "feasible": True},
    )
    assert choose(measured, candidates)[0] == BF16


def test_choose_smallest_takes_the_least_peak_and_among_near_ties_the_faster():
    from autoprec.tune._decide._choose import choose_smallest

    candidates = {
        "fp32": Policy(),
        "uniform bf16": Policy(layers={"": "bf16"}),
        "trial 1": Policy(layers={"": "bf16", "a": "fp32"}),
    }
    rows = [
        {"candidate": "fp32", "speedup": 1.0, "peak_bytes": 1000, "memory_saving": 0.0},
        {"candidate": "uniform bf16", "speedup": 1.5, "peak_bytes": 604, "memory_saving": 0.396},
        {"candidate": "trial 1", "speedup": 1.2, "peak_bytes": 600, "memory_saving": 0.4},  # within 1% of bf16: a tie
    ]
    name, why = choose_smallest(finals(*rows), candidates)
    assert name == "uniform bf16" and "smallest peak memory" in why and "among the 2" in why
    rows[2]["peak_bytes"] = 500  # a real saving: the smaller wins although slower
    assert choose_smallest(finals(*rows), candidates)[0] == "trial 1"
    rows[2]["fits"] = rows[1]["fits"] = rows[0]["fits"] = False
    gone = finals(*rows).within(0.01)
    name, why = choose_smallest(gone, candidates)
    assert name == "fp32" and "--max-memory" in why


def test_among_tied_candidates_the_safer_comes_before_an_alternative_with_fp8_layers():
    """fp8 everywhere (an alternative, all layers fp8) tied with a searched bf16 policy: the bf16 one, safer."""
    from autoprec.tune._decide._choose import choose

    candidates = {"fp32": Policy(), "fp8 everywhere (torchao filter)": Policy(layers={"": "bf16", "a": "fp8", "b": "fp8"}),
                  "trial 4": Policy(layers={"": "bf16"})}  # fmt: skip
    candidates["trial 9"] = Policy(layers={"": "bf16", "a": "fp8", "b": "fp8", "c": "fp8"})
    rows = [
        {"candidate": "fp32", "speedup": 1.0, "spread": 0.04, "feasible": True},
        {"candidate": "fp8 everywhere (torchao filter)", "speedup": 1.50, "spread": 0.04, "feasible": True},
        {"candidate": "trial 4", "speedup": 1.51, "spread": 0.04, "feasible": True},
        {"candidate": "trial 9", "speedup": 1.55, "spread": 0.04, "feasible": True},
    ]
    name, why = choose(finals(*rows), candidates)
    assert name == "trial 4" and "the safer one" in why
    rows[2]["speedup"] = 1.49  # measured below the fastest alternative: never chosen over it
    assert choose(finals(*rows), candidates)[0] == "fp8 everywhere (torchao filter)"


def test_fp32_and_uniform_bf16_tied_write_fp32_whichever_median_leads():
    """A search wrote uniform bf16 at "1.26x" (a tie), a sweep of the same model and budget fp32, and a re-measure
    gave the bf16 policy 0.88x: which was written hung on medians inside the noise. Tied, the fewest layers below fp32
    wins, so the same candidates tied give the same file, and a searched bf16 policy tied with both is not written."""
    from autoprec.tune._decide._choose import choose

    candidates = {"fp32": Policy(layers={"": "fp32", "a": "fp32", "b": "fp32"}),
                  "uniform bf16": Policy(layers={"": "bf16", "a": "bf16", "b": "bf16"}),
                  "trial 2": Policy(layers={"": "fp32", "a": "bf16", "b": "bf16"})}  # fmt: skip
    for bf16, trial in ((1.26, 1.20), (0.88, 0.95), (1.10, 1.30)):
        rows = finals(
            {"candidate": "fp32", "speedup": 1.0, "spread": 0.6, "feasible": True},
            {"candidate": "uniform bf16", "speedup": bf16, "spread": 0.6, "feasible": True},
            {"candidate": "trial 2", "speedup": trial, "spread": 0.6, "feasible": True},
        )
        name, why = choose(rows, candidates)
        assert name == "fp32", (bf16, trial, why)
    quiet = finals({"candidate": "fp32", "speedup": 1.0, "spread": 0.02, "feasible": True},
                   {"candidate": "uniform bf16", "speedup": 1.26, "spread": 0.02, "feasible": True})  # fmt: skip
    assert choose(quiet, candidates)[0] == "uniform bf16"  # separated: the gain is real


def test_among_equally_safe_tied_searched_policies_the_fewest_layers_below_fp32_is_chosen():
    from autoprec.tune._decide._choose import choose

    candidates = {"fp32": Policy(), "uniform bf16": Policy(layers={"": "bf16", "a": "bf16", "b": "bf16", "c": "bf16"}),
                  "trial 3": Policy(layers={"": "fp32", "a": "bf16", "b": "bf16", "c": "bf16"}),
                  "trial 5": Policy(layers={"": "fp32", "a": "bf16", "b": "fp32", "c": "fp32"})}  # fmt: skip
    rows = finals(
        {"candidate": "fp32", "speedup": 1.0, "spread": 0.04, "feasible": True},
        {"candidate": "uniform bf16", "speedup": 1.2, "spread": 0.04, "feasible": True},
        {"candidate": "trial 3", "speedup": 1.50, "spread": 0.04, "feasible": True},
        {"candidate": "trial 5", "speedup": 1.48, "spread": 0.04, "feasible": True},
    )
    name, why = choose(rows, candidates)
    assert name == "trial 5" and "more layers below fp32 (3 against 1)" in why
    # a layer a policy does not list runs as its root: a bf16 root lowers every layer it leaves unlisted
    candidates["trial 3"] = Policy(layers={"": "bf16"})
    name, why = choose(rows, candidates)
    assert name == "trial 5" and "more layers below fp32 (4 against 1)" in why


def test_fp32_and_a_barely_faster_bf16_timed_through_a_noisy_clock_give_the_same_file_for_every_seed(timings):
    """The re-measure itself, its step times from an injected clock on which bf16 is 3% faster than fp32 with 30%
    noise per step: whichever median leads on a seed, the file says fp32."""
    from pathlib import Path

    from short_timing import TINY

    from autoprec.tune import load_task, prepare
    from autoprec.tune._core._records import Candidate
    from autoprec.tune._decide._choose import choose
    from autoprec.tune._measure._timing import separated
    from autoprec.tune._search._finalists import remeasure

    workload = prepare(load_task(Path(__file__).parent / "models" / "overflow_mlp.py"), "cpu")
    every = ["", "fc1", "big", "head"]
    candidates = {"fp32": Candidate(Policy(layers=dict.fromkeys(every, "fp32"))),
                  "uniform bf16": Candidate(Policy(layers=dict.fromkeys(every, "bf16")))}  # fmt: skip
    judge = types.SimpleNamespace(fp32_metric=0.5, safe_metric=lambda candidate: (0.5, {}))
    config = dataclasses.replace(TINY, rounds=11)
    leads, picks = set(), set()
    for seed in range(6):
        timings({"half": 0.97, "fp8": 0.4}, noise=0.3, seed=seed)
        rows = remeasure(workload, candidates, judge, 0.01, config)
        if separated(rows.by_name("fp32"), rows.by_name("uniform bf16")):
            continue  # 11 rounds of a 30% noise can still look apart (the rule's own limit, not this one's)
        leads.add(rows.by_name("uniform bf16").speedup > 1.0)
        picks.add(choose(rows, candidates)[0])
    assert leads == {True, False}  # among the ties, the medians landed both ways
    assert picks == {"fp32"}


def test_the_fp8_all_gather_tied_inside_the_spread_is_left_off():
    """A sharded search re-measures its fastest with the setting the other way: a lead inside the spread is noise,
    and the policy without the setting (nothing more to train with) is written."""
    from autoprec.tune._decide._choose import choose

    on = Policy(layers={"": "bf16", "a": "fp8", "b": "bf16"}, fsdp_fp8_all_gather=True)
    candidates = {
        "fp32": Policy(),
        "trial 4": on,
        "trial 4, fp8 all-gather off": dataclasses.replace(on, fsdp_fp8_all_gather=False),
    }
    rows = finals(
        {"candidate": "fp32", "speedup": 1.0, "spread": 0.02, "feasible": True},
        {"candidate": "trial 4", "speedup": 1.31, "spread": 0.04, "feasible": True},
        {"candidate": "trial 4, fp8 all-gather off", "speedup": 1.30, "spread": 0.04, "feasible": True},
    )
    name, why = choose(rows, candidates)
    assert name == "trial 4, fp8 all-gather off" and why.endswith(
        "with the same formats, all-gathering its fp8 weights in fp8 under FSDP2: the one without that setting"
    )
    # two policies of other layers, as many of each kind: the reason does not call them the same formats
    candidates["trial 4, fp8 all-gather off"] = Policy(layers={"": "bf16", "a": "bf16", "b": "fp8"})
    assert "with as many fp16/fp8 layers and layers below fp32 (3)" in choose(rows, candidates)[1]
    from autoprec.tune._report._show import _kind

    measured = types.SimpleNamespace(why=why, chosen=name, greedy=None)
    assert _kind(measured) == "one without FSDP2's fp8 all-gather"  # what show and the summary's tie line say of it
    rows = finals(
        {"candidate": "fp32", "speedup": 1.0, "spread": 0.02, "feasible": True},
        {"candidate": "trial 4", "speedup": 1.45, "spread": 0.01, "feasible": True},  # separated: the setting pays
        {"candidate": "trial 4, fp8 all-gather off", "speedup": 1.30, "spread": 0.01, "feasible": True},
    )
    assert choose(rows, candidates)[0] == "trial 4"
