"""benchmarks/block_study.py and its package benchmarks/blockstudy/ (issue 41): its per-GEMM SQNR against a
brute-force computation, and its --part sqnr and --part drop runs on the tiny GPT-2 example writing every layer x GEMM x
format row."""

import csv
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from autoprec.formats.mx import mxfp8
from autoprec.formats.nvfp4 import nvfp4, random_hadamard_transform

ROOT = Path(__file__).parents[1]
spec = importlib.util.spec_from_file_location("block_study", ROOT / "benchmarks" / "block_study.py")
block_study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(block_study)

from blockstudy import common, drop, horizon, horizon2, policies, runs, schedule, search, sqnr  # noqa: E402 (the package beside the script, which put it on the path)


def _fp8_brute(t, dtype):
    """Per-tensor scaling to the dtype's max, then each element to the nearest of all finite codes of the dtype (ties
    to the even code), scaled back; element by element."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = sorted({(float(v), i) for i, v in enumerate(codes.tolist()) if math.isfinite(v)})
    fmax = torch.finfo(dtype).max
    amax = max(abs(v) for v in t.flatten().tolist())
    scale = float(torch.tensor(fmax / max(amax, 1e-12), dtype=torch.float64).float())
    out = torch.empty_like(t)
    for idx, v in enumerate(t.flatten().tolist()):
        s = min(max(float(torch.tensor(v * scale, dtype=torch.float32)), -fmax), fmax)
        best = min(grid, key=lambda gv: (abs(gv[0] - s), gv[1] % 2))
        out.view(-1)[idx] = best[0] / scale
    return out


def _matmul_brute(a, b):
    """a [P, R] @ b [R, Q] by explicit sums, in Python floats (fp64)."""
    a, b = a.tolist(), b.tolist()
    return [[sum(a[i][r] * b[r][j] for r in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]


def _sqnr_brute(ref, q):
    sig = sum(v * v for row in ref for v in row)
    err = sum((v - w) ** 2 for rr, qr in zip(ref, q, strict=True) for v, w in zip(rr, qr, strict=True))
    return 10 * math.log10(sig / err)


def _operands_brute(name, x, w, g, seed):
    """Each GEMM's two quantised operands as docs/block-scaled.md's per-GEMM table lays them out, with the module's
    quantisers; the stochastic draws in blockscaled_linear's order (dgrad's gradient, then wgrad's)."""
    if name == "fp8-tensorwise":
        xq, wq, gq = _fp8_brute(x, torch.float8_e4m3fn), _fp8_brute(w, torch.float8_e4m3fn), _fp8_brute(g, torch.float8_e5m2)
        return {"fprop": (xq, wq.t()), "dgrad": (gq, wq), "wgrad": (gq.t(), xq)}
    if name == "mxfp8":
        return {
            "fprop": (mxfp8(x, dim=1), mxfp8(w, dim=1).t()),
            "dgrad": (mxfp8(g, dim=1), mxfp8(w, dim=0)),
            "wgrad": (mxfp8(g, dim=0).t(), mxfp8(x, dim=0)),
        }
    rht, sr = name in ("nvfp4-rht", "nvfp4-rht-sr"), name == "nvfp4-rht-sr"
    gen = torch.Generator().manual_seed(seed)
    rounding = "stochastic" if sr else "nearest"
    w2d = nvfp4(w, two_d=True)
    fprop = (nvfp4(x, dim=1), w2d.t())
    dgrad = (nvfp4(g, dim=1, rounding=rounding, generator=gen), w2d)
    gw, xw = (random_hadamard_transform(g, dim=0), random_hadamard_transform(x, dim=0)) if rht else (g, x)
    wgrad = (nvfp4(gw, dim=0, rounding=rounding, generator=gen).t(), nvfp4(xw, dim=0))
    return {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad}


@pytest.mark.parametrize("name", list(common.FORMATS))
def test_gemm_sqnr_of_a_tiny_linear_equals_a_brute_force_computation(name):
    torch.manual_seed(0)
    m, k, n = 32, 32, 32  # every blocked dimension a multiple of 32 (MXFP8) and of 16 (NVFP4 tiles, RHT)
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)  # columns of different scales: blocks matter
    x[3, 5] = 40.0  # an outlier
    g = torch.randn(m, n) * 1e-4
    w = lin.weight.detach()
    seed = 7
    got = sqnr.gemm_sqnr(x, w, g, common.FORMATS[name], torch.Generator().manual_seed(seed))
    ops = _operands_brute(name, x, w, g, seed)
    refs = {"fprop": (x, w.t()), "dgrad": (g, w), "wgrad": (g.t(), x)}
    for gemm in common.GEMMS:
        want = _sqnr_brute(_matmul_brute(*refs[gemm]), _matmul_brute(*ops[gemm]))
        assert 5 < got[gemm] < 60 and got[gemm] == pytest.approx(want, abs=1e-3), (name, gemm, got[gemm], want)


def test_a_product_quantised_exactly_has_infinite_sqnr_and_the_roles_follow_the_gpt_names():
    x, w, g = torch.ones(32, 32), torch.ones(32, 32), torch.ones(32, 32)  # 1 is exact in every format
    for fmt in common.FORMATS.values():
        assert set(sqnr.gemm_sqnr(x, w, g, fmt).values()) == {math.inf}
    assert common.layer_role("h.3.attn.c_attn") == (3, "attn.c_attn")
    assert common.layer_role("h.11.c_proj") == (11, "mlp.c_proj")
    assert common.layer_role("lm_head") == (-1, "lm_head")


def test_an_unknown_part_is_refused_with_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        block_study.main(["--part", "loss"])
    err = capsys.readouterr().err
    assert "invalid choice: 'loss'" in err and "sqnr" in err.split("choose from", 1)[1]


@pytest.mark.slow
def test_part_sqnr_on_the_tiny_gpt_writes_every_layer_gemm_and_format(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE", str(tmp_path / "cache"))  # trains the tiny example's weights (seconds)
    out = tmp_path / "study"
    threads = torch.get_num_threads()
    try:
        block_study.main(["--part", "sqnr", "--size", "tiny", "--batches", "2", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    rows = list(csv.DictReader(open(out / "sqnr.csv")))
    layers = [f"h.{b}.{r}" for b in range(2) for r in ("attn.c_attn", "attn.c_proj", "c_fc", "c_proj")] + ["lm_head"]
    keys = [(r["layer"], r["gemm"], r["format"]) for r in rows]
    assert sorted(keys) == sorted((la, gm, f) for la in layers for gm in common.GEMMS for f in common.FORMATS)
    assert {(r["layer"], r["block"], r["role"]) for r in rows if r["layer"] in ("h.1.c_fc", "lm_head")} == {
        ("h.1.c_fc", "1", "mlp.c_fc"),
        ("lm_head", "-1", "lm_head"),
    }
    assert all(0 < float(r["sqnr_db"]) < 80 for r in rows)
    by = {(r["layer"], r["gemm"], r["format"]): float(r["sqnr_db"]) for r in rows}
    assert all(by[(la, gm, "mxfp8")] > by[(la, gm, "nvfp4")] + 5 for la in layers for gm in common.GEMMS)
    summary = (out / "summary.md").read_text()
    assert "--part sqnr --size tiny" in summary and "## Findings" in summary and "| lm_head |" in summary
    assert (out / "sqnr_by_depth.png").stat().st_size > 10_000

    try:  # the drop part adds its own section and keeps the SQNR one
        block_study.main(["--part", "drop", "--size", "tiny", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    drops = list(csv.DictReader(open(out / "drop.csv")))
    assert sorted((r["layer"], r["format"]) for r in drops) == sorted(
        (la, f) for la in [*layers, "all"] for f in drop.DROP_FORMATS
    )
    summary = (out / "summary.md").read_text()
    assert summary.index("<!-- part:sqnr -->") < summary.index("<!-- part:drop -->")
    assert "--part sqnr --size tiny" in summary and "rank correlation" in summary
    assert (out / "drop_by_depth.png").stat().st_size > 10_000


def _gpt_names(n_blocks):
    roles = ("attn.c_attn", "attn.c_proj", "c_fc", "c_proj")
    return [f"h.{b}.{r}" for b in range(n_blocks) for r in roles] + ["lm_head"]


def test_last_fifteen_percent_of_the_blocks_rounds_to_nearest_and_keeps_at_least_one():
    # max(1, round(0.15 n)): 12 blocks -> round(1.8) = 2; 4 -> round(0.6) = 1; 2 -> round(0.3) = 0 -> 1;
    # 10 -> round(1.5) = 2 (Python rounds halves to even); 30 -> round(4.5) = 4
    assert policies.last_blocks(12) == [10, 11]
    assert policies.last_blocks(4) == [3]
    assert policies.last_blocks(2) == [1]
    assert policies.last_blocks(10) == [8, 9]
    assert policies.last_blocks(30) == [26, 27, 28, 29]


def test_the_hand_rules_on_twelve_blocks_lower_the_layers_they_say():
    names = _gpt_names(12)
    rules = policies.rule_layers(names, 12)
    blocks = lambda layers: sorted({common.layer_role(n)[0] for n in layers})  # noqa: E731
    # (a) the last 15% (blocks 10-11) and the head bf16, blocks 0-9 NVFP4
    assert blocks(rules["rule-a"]) == list(range(10)) and set(rules["rule-a"].values()) == {"nvfp4"}
    assert len(rules["rule-a"]) == 40
    # (b) the first and the last block bf16, everything else NVFP4, the head included
    assert blocks(rules["rule-b"]) == [-1, *range(1, 11)] and len(rules["rule-b"]) == 41
    # (c) all but the head
    assert "lm_head" not in rules["rule-c"] and len(rules["rule-c"]) == 48
    # (d) attention MXFP8, the MLP NVFP4, the head bf16
    assert rules["rule-d"]["h.5.attn.c_attn"] == rules["rule-d"]["h.5.attn.c_proj"] == "mxfp8"
    assert rules["rule-d"]["h.5.c_fc"] == rules["rule-d"]["h.5.c_proj"] == "nvfp4"
    assert "lm_head" not in rules["rule-d"] and len(rules["rule-d"]) == 48


def test_gemm_shares_and_the_b200_estimate_match_a_hand_computation():
    from autoprec.tune._core._targets import B200
    from autoprec.tune._decide._flops import estimated_speedup, gemm_flops

    model = common.load_example("tiny").GPT()  # 2 blocks, 64 wide, vocab 256: untrained, shapes only
    named = policies.study_policies(model)
    flops = gemm_flops(policies.flops_table(model, tokens=100))
    # per block: c_attn 64x192, attn c_proj 64x64, c_fc 64x256, mlp c_proj 256x64 = 49152 in*out; head 64x256 = 16384
    attn, mlp, head = 2 * (64 * 192 + 64 * 64), 2 * (64 * 256 + 256 * 64), 64 * 256
    total = attn + mlp + head
    assert flops["h.0.c_fc"] == 2 * 100 * 64 * 256
    assert policies.gemm_share(named["bf16"], flops)["low"] == 0
    assert policies.gemm_share(named["nvfp4-all"], flops)["low"] == pytest.approx(1)
    assert policies.gemm_share(named["rule-c"], flops)["low"] == pytest.approx((attn + mlp) / total)  # 6/7
    d = policies.gemm_share(named["rule-d"], flops)
    assert d["nvfp4"] == pytest.approx(mlp / total) and d["mxfp8"] == pytest.approx(attn / total)
    assert d["bf16"] == pytest.approx(head / total)
    # b200 (TFLOP/s): bf16 2250, mxfp8 4500, nvfp4 9000; the estimate is all-bf16's GEMM time over the policy's
    hand = (total / 2250) / (mlp / 9000 + attn / 4500 + head / 2250)
    assert estimated_speedup(named["rule-d"], flops, B200) == pytest.approx(hand)
    # rule (a) on 2 blocks: round(0.3) = 0, at least one kept -> block 1 and the head bf16, block 0 NVFP4
    assert sorted(named["rule-a"].layers) == ["", "h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.c_fc", "h.0.c_proj"]
    # rule (b) on 2 blocks: both are first or last, so only the head is NVFP4
    assert sorted(named["rule-b"].layers) == ["", "lm_head"]


def test_a_finished_run_is_skipped_and_an_unfinished_one_is_run_again(tmp_path, monkeypatch):
    calls = []

    def fake_curve(workload, policy, steps, every, seed):
        calls.append((policy, seed))
        return [{"step": s, "metric": -1.0 - s / 100, "finite": True, "skipped": 0, "wall_s": 0.0}
                for s in range(0, steps + 1, every)]  # fmt: skip

    monkeypatch.setattr(horizon, "train_curve", fake_curve)  # as run_missing finds it
    runs.write_run(runs.run_path(tmp_path, "bf16", 0), fake_curve(None, "x", 20, 2, 0))
    runs.write_run(runs.run_path(tmp_path, "rule-a", 0), fake_curve(None, "x", 8, 2, 0))  # stopped at 8
    calls.clear()
    ran = horizon.run_missing(None, {"bf16": "bf16", "rule-a": "rule-a"}, tmp_path, 20, 2, seeds=2)
    assert ran == [("rule-a", 0), ("bf16", 1), ("rule-a", 1)]
    assert runs.finished(runs.run_path(tmp_path, "rule-a", 0), 20)
    assert horizon.run_missing(None, {"bf16": "bf16", "rule-a": "rule-a"}, tmp_path, 20, 2, seeds=2) == []
    assert not list(tmp_path.glob("*.tmp"))


def test_drops_are_taken_seed_by_seed_against_bf16_and_the_floor_is_bf16s_spread():
    curves = {
        "bf16": {0: {5: -2.00, 50: -2.30}, 1: {5: -2.01, 50: -2.36}},
        "rule-c": {0: {5: -2.03, 50: -2.40}, 1: {5: -2.02, 50: -2.38}},
    }
    assert horizon.drops(curves, "rule-c", 5) == pytest.approx([0.03, 0.01])
    assert horizon.drops(curves, "rule-c", 50) == pytest.approx([0.10, 0.02])
    assert runs.noise_floor_at(curves, 5) == pytest.approx(0.01)
    assert runs.noise_floor_at(curves, 50) == pytest.approx(0.06)


def test_a_searched_policy_keeps_its_linears_and_gets_a_bf16_root():
    from autoprec.policy import Policy

    searched = Policy(layers={"": "fp32", "h.0.c_fc": "mxfp8", "lm_head": "bf16", "h.1.c_proj": "fp32"})
    moved = policies.bf16_root(searched)
    assert moved.layers[""].value == "bf16"
    assert {n: f.value for n, f in moved.layers.items() if n} == {"h.0.c_fc": "mxfp8", "lm_head": "bf16", "h.1.c_proj": "fp32"}


def test_the_horizon_table_names_rules_and_searched_policies_and_takes_drops_per_seed(tmp_path):
    from autoprec.policy import Policy
    from autoprec.tune._core._targets import B200
    from autoprec.tune._decide._flops import estimated_speedup

    def run(name, seed, metrics):
        rows = [{"step": s, "metric": m, "finite": True, "skipped": 0, "wall_s": 0} for s, m in zip((0, 2, 4), metrics)]
        runs.write_run(runs.run_path(tmp_path, name, seed), rows)

    run("bf16", 0, (-2.0, -2.10, -2.30))
    run("bf16", 1, (-2.0, -2.12, -2.34))
    run("searched-0.04-grouped", 0, (-2.0, -2.11, -2.33))
    run("searched-0.04-grouped", 1, (-2.0, -2.12, -2.32))
    named = {"bf16": Policy(layers={"": "bf16"}), "searched-0.04-grouped": Policy(layers={"": "bf16", "a": "nvfp4"})}
    args = type("Args", (), {"steps": 2, "horizon": 2, "seeds": 2})()
    table = horizon.horizon_table(named, tmp_path, args, {"a": 1.0, "b": 1.0}, B200, estimated_speedup)
    by = {r["policy"]: r for r in table}
    assert by["bf16"]["rule"].startswith("every Linear bf16") and by["bf16"]["drop_at_10K_mean"] == 0
    s = by["searched-0.04-grouped"]
    assert s["rule"].startswith("searched (grouped), budget 0.04")
    assert s["low_gemm_share"] == 0.5 and s["drop_at_K_by_seed"] == "0.01000 0.00000"
    assert s["drop_at_10K_by_seed"] == "0.03000 -0.02000" and s["drop_at_10K_mean"] == pytest.approx(0.005)
    assert s["noise_floor_at_K"] == pytest.approx(0.02)
    assert s["noise_floor_at_10K"] == pytest.approx(0.04)
    assert "above" not in " ".join(horizon.horizon_findings(table))


def test_tagged_searches_get_their_own_folders_and_labels_and_the_per_gemm_formats(tmp_path):
    from autoprec.formats import format_names

    assert set(search.SEARCH_FORMATS) <= set(format_names())
    old = search.searched_dir(tmp_path, 0.04, "grouped")
    new = search.searched_dir(tmp_path, 0.015, "ranked", "postfix")
    assert old.name == "budget-0.04-grouped" and new.name == "budget-0.015-ranked-postfix"
    assert search.searched_dir(tmp_path, 0.04).name == "budget-0.04"
    label = policies.searched_label(new)
    assert label == "searched-0.015-ranked-postfix" and policies.label_budget(label) == 0.015
    assert policies.label_tag(label) == "postfix" and policies.label_tag("searched-0.04-grouped") == ""
    assert "ranked" in policies.searched_text(label) and "after e97993f" in policies.searched_text(label)
    assert "before e97993f" in policies.searched_text("searched-0.04")
    space = search.search_space("ranked", 4, "postfix")
    assert {f.value for f in space.layers["Linear"]} == set(search.SEARCH_FORMATS)
    assert {f.value for f in search.search_space("ranked", 4, "").layers["Linear"]} == {"fp32", "bf16", "mxfp8", "nvfp4"}


def test_the_fallback_tag_searches_without_fp32_under_a_bf16_root_and_its_folders_are_picked_up(tmp_path):
    from autoprec.policy import Policy
    from autoprec.tune._core._goal import goal_named

    space = search.search_space("grouped", 4, "fallback")
    assert [f.value for f in space.default] == ["bf16"]
    linear = [f.value for f in space.layers["Linear"]]
    assert "fp32" not in linear and linear[0] == "bf16"
    assert linear == [f for f in search.SEARCH_FORMATS if f != "fp32"]  # the postfix searches' low formats
    goal_named("flops").check_fallbacks(space)  # the FLOP goal takes bf16 as the lists' fallback
    with pytest.raises(ValueError, match="fp32"):
        goal_named("speed").check_fallbacks(space)  # a timed goal still needs fp32
    assert "fp32" in search.search_formats("postfix")  # the old tags' spaces are unchanged
    folder = search.searched_dir(tmp_path, 0.04, "grouped", "fallback")
    assert folder.name == "budget-0.04-grouped-fallback"
    label = policies.searched_label(folder)
    assert policies.label_tag(label) == "fallback" and policies.label_budget(label) == 0.04
    assert "root bf16 as searched" in policies.searched_text(label)
    assert "root set to bf16" in policies.searched_text("searched-0.04-grouped-postfix")
    folder.mkdir(parents=True)
    Policy(layers={"": "bf16", "h.0.mlp.c_fc": "nvfp4"}).save(folder / "policy.json")
    found = policies.all_policies(_tiny_gpt(), tmp_path)
    kept = found[label]
    assert kept.layers[""].value == "bf16" and kept.layers["h.0.mlp.c_fc"].value == "nvfp4"
    assert policies.bf16_root(kept).layers == kept.layers  # nothing to rewrite
    assert label in horizon2.horizon2_policies(_tiny_gpt(), tmp_path)


def _tiny_gpt(width: int = 32) -> torch.nn.Module:
    """GPT-2's Linear names (h.<b>.attn.c_attn, ..., lm_head) on two blocks of small Linears, nothing else."""

    def module(**children):
        m = torch.nn.Module()
        for name, child in children.items():
            m.add_module(name, child)
        return m

    def block():
        attn = module(c_attn=torch.nn.Linear(width, 3 * width), c_proj=torch.nn.Linear(width, width))
        return module(attn=attn, mlp=module(c_fc=torch.nn.Linear(width, 4 * width), c_proj=torch.nn.Linear(4 * width, width)))

    return module(h=torch.nn.ModuleList([block(), block()]), lm_head=torch.nn.Linear(width, 64))


def test_a_per_gemm_mix_under_a_bf16_root_is_priced_between_bf16_and_its_low_format():
    from autoprec.policy import Policy
    from autoprec.tune._core._targets import B200
    from autoprec.tune._decide._flops import estimated_speedup

    flops = {"a": 1.0}
    speed = {
        f: estimated_speedup(Policy(layers={"": "bf16", "a": f}), flops, B200)
        for f in ("bf16", "mxfp8-fwd-dgrad", "mxfp8", "nvfp4-fwd-dgrad", "nvfp4")
    }
    assert speed["bf16"] < speed["mxfp8-fwd-dgrad"] < speed["mxfp8"]
    assert speed["bf16"] < speed["nvfp4-fwd-dgrad"] < speed["nvfp4"]
    share = policies.gemm_share(Policy(layers={"": "bf16", "a": "nvfp4-fwd-dgrad"}), flops)
    assert share["low"] == pytest.approx(2 / 3)
    assert share["bf16"] == pytest.approx(1 / 3)  # its wgrad, in the bf16 root's autocast (not fp32)


def test_paired_drops_and_their_t_interval_match_a_hand_computation():
    curves = {
        "bf16": {0: {5: -2.00, 50: -1.90}, 1: {5: -2.01, 50: -1.92}, 2: {5: -2.02, 50: -1.91}},
        "fp32": {0: {5: -2.00, 50: -1.90}, 1: {5: -2.00, 50: -1.93}, 2: {5: -2.02, 50: -1.90}},
        "rule-c": {0: {5: -2.01, 50: -1.91}, 1: {5: -2.04, 50: -1.95}, 2: {5: -2.04, 50: -1.93}},
        "searched-0.015-ranked-postfix": {0: {5: -2.00, 50: -1.90}},  # one seed only: no interval
    }
    # seed by seed, bf16's metric minus the policy's on the same stream
    drops = horizon2.paired_drops(curves, "rule-c", 50)
    assert drops == pytest.approx([0.01, 0.03, 0.02])
    assert horizon2.paired_drops(curves, "rule-c", 50, base="fp32") == pytest.approx([0.01, 0.02, 0.03])
    st = horizon2.paired_stats(drops)
    # by hand: mean 0.02; sd = sqrt((0.01^2 + 0.01^2 + 0) / 2) = 0.01; t(0.975, 2 dof) = 4.302653 (tables);
    # half-width = 4.302653 * 0.01 / sqrt(3) = 0.0248414
    assert st["n"] == 3 and st["mean"] == pytest.approx(0.02) and st["sd"] == pytest.approx(0.01)
    assert st["half"] == pytest.approx(0.0248414, abs=1e-6)
    assert (st["lo"], st["hi"]) == pytest.approx((0.02 - 0.0248414, 0.02 + 0.0248414), abs=1e-6)
    # two seeds: t(0.975, 1) = 12.7062; drops 0.01, 0.02 at K -> mean 0.015, sd 0.0070711, half 12.7062 * 0.005
    two = horizon2.paired_stats([0.01, 0.02])
    assert two["half"] == pytest.approx(12.7062 * 0.005, rel=1e-4)
    one = horizon2.paired_stats(horizon2.paired_drops(curves, "searched-0.015-ranked-postfix", 50))
    assert one["n"] == 1 and one["mean"] == pytest.approx(-0.0) and math.isnan(one["half"])
    # the verdicts against a budget: the interval's top under it holds, its bottom above it breaks, else undecided
    assert horizon2.budget_verdict(st, 0.05) == "holds"
    assert horizon2.budget_verdict(st, 0.03) == "undecided"
    assert horizon2.budget_verdict(horizon2.paired_stats([0.10, 0.11, 0.12]), 0.04) == "broken"
    assert horizon2.budget_verdict(one, 0.04).startswith("undecided")


def _windows(batches) -> list[bytes]:
    return [bytes(torch.cat([x[i], y[i, -1:]]).to(torch.uint8).tolist()) for x, y in batches for i in range(len(x))]


def test_the_fresh_stream_takes_distinct_windows_each_step_and_never_an_eval_window():
    example = common.load_example("mini")  # the text only: no model is built
    h = example.HPARAMS
    train, evals = example.stdlib_text.text(h["bytes_per_file"], h["eval_frac"])
    steps, seq, batch = 50, h["seq_len"], h["batch"]
    for seed in (0, 1):
        starts = horizon2.train_starts(len(train), seq, batch, steps, seed).flatten().sort().values
        assert len(starts) == steps * batch and (starts.diff() >= seq + 1).all()  # no two windows overlap
        assert int(starts[-1]) + seq + 1 <= len(train)
    ev = horizon2.eval_starts(len(evals), seq, batch, horizon2.N_EVAL_BATCHES).flatten()
    assert len(ev) == horizon2.N_EVAL_BATCHES * batch and (ev.diff() >= seq + 1).all()
    # the same seed draws the same stream (every policy trains on it); another seed another one
    a0, e0 = horizon2.fresh_data(example, steps, 0)
    a0b, e0b = horizon2.fresh_data(example, steps, 0)
    a1, e1 = horizon2.fresh_data(example, steps, 1)
    assert len(a0) == steps and all(torch.equal(x[0], y[0]) for x, y in zip(a0, a0b, strict=True))
    assert _windows(e0) == _windows(e1) == _windows(e0b)  # one eval set for every seed
    assert _windows(a0) != _windows(a1)
    # train windows come from the train split, eval windows from the eval split (other bytes of each file), and no
    # eval window's bytes equal any train window's, for any seed of the study
    eval_set = set(_windows(e0))
    for seed in range(5):
        assert not eval_set & set(_windows(horizon2.fresh_data(example, steps, seed)[0]))
    with pytest.raises(ValueError, match="the train split holds"):
        horizon2.train_starts(len(train), seq, batch, 10_000, 0)
    with pytest.raises(ValueError, match="overlap"):
        horizon2.eval_starts(len(evals), seq, batch, 64)


def test_eval_steps_take_zero_k_and_the_last():
    assert horizon2.eval_steps(50, 10, 5) == [0, 5, 10, 20, 30, 40, 50]
    assert horizon2.eval_steps(50, 5, 5) == list(range(0, 51, 5))


def test_the_horizon2_table_pairs_each_seed_and_judges_the_budget_on_the_interval(tmp_path):
    from autoprec.policy import Policy
    from autoprec.tune._core._targets import B200
    from autoprec.tune._decide._flops import estimated_speedup

    def run(name, seed, metrics):
        rows = [{"step": s, "metric": m, "finite": True, "skipped": 0, "wall_s": 0} for s, m in zip((0, 2, 4), metrics)]
        runs.write_run(runs.run_path(tmp_path, name, seed), rows)

    for seed, (k, end) in enumerate(((-2.10, -2.30), (-2.12, -2.34), (-2.11, -2.32))):
        run("bf16", seed, (-2.0, k, end))
        run("fp32", seed, (-2.0, k, end + 0.001))
        run("searched-0.04-grouped-postfix", seed, (-2.0, k - 0.01, end - 0.02 - 0.001 * seed))
    named = {
        "bf16": Policy(layers={"": "bf16"}),
        "fp32": Policy(layers={"": "fp32"}),
        "searched-0.04-grouped-postfix": Policy(layers={"": "bf16", "a": "nvfp4"}),
    }
    args = type("Args", (), {"steps": 2, "horizon": 2, "seeds": 3})()
    curves = runs.load_curves(named, tmp_path, 3, 4)
    table = horizon2.horizon2_table(named, curves, args, {"a": 1.0, "b": 1.0}, B200, estimated_speedup)
    by = {r["policy"]: r for r in table}
    assert by["bf16"]["drop_10K_mean"] == 0 and by["fp32"]["drop_10K_mean"] == pytest.approx(-0.001)
    s = by["searched-0.04-grouped-postfix"]
    assert s["budget"] == 0.04 and s["seeds_10K"] == 3
    assert s["drop_10K_by_seed"] == "0.02000 0.02100 0.02200"
    assert s["drop_10K_mean"] == pytest.approx(0.021)
    assert s["drop_10K_half_width"] == pytest.approx(4.302653 * 0.001 / math.sqrt(3), abs=1e-6)
    assert s["drop_K_mean"] == pytest.approx(0.01) and s["verdict_K"] == "holds"
    assert s["verdict_10K"] == "holds"  # 0.021 + 0.0025 < 0.04
    assert s["drop_vs_fp32_10K_mean"] == pytest.approx(0.022)
    assert s["bf16_spread_10K"] == pytest.approx(0.04)  # the first attempt's max - min, for continuity
    # each seed's drop moved from 0.01 at K to 0.020, 0.021, 0.022: +0.011 on average, beyond the noise
    assert s["growth_mean"] == pytest.approx(0.011) and s["verdict_vs_fp32_10K"] == "holds"
    words = " ".join(horizon2.horizon2_findings(table))
    assert "grew by +0.0110" in words and "Budget 0.04: holds at K, holds at 10 x K" in words


def test_a_searched_policy_equal_to_an_earlier_one_is_named_as_its_twin():
    from autoprec.policy import Policy

    a = Policy(layers={"": "bf16", "h.0.c_fc": "nvfp4"})
    found = {
        "bf16": Policy(layers={"": "bf16"}),
        "searched-0.015-ranked-fallback": a,
        "searched-0.015-grouped-fallback": Policy(layers={"h.0.c_fc": "nvfp4", "": "bf16"}),
        "searched-0.04-ranked-fallback": Policy(layers={"": "bf16", "h.0.c_fc": "mxfp8"}),
        "searched-0.04-grouped-fallback": Policy(layers={"": "bf16"}),  # all-bf16: named after bf16
    }
    assert horizon2.same_as(found) == {
        "searched-0.015-grouped-fallback": "searched-0.015-ranked-fallback",
        "searched-0.04-grouped-fallback": "bf16",
    }


def test_part_reprice_prices_every_policy_at_the_study_width_and_at_a_real_one(tmp_path):
    block_study.main(["--part", "reprice", "--size", "tiny", "--out", str(tmp_path)])
    with open(tmp_path / "reprice.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "policy",
        "rule",
        "same_as",
        "est_peak_flop_speedup",
        "predicted_study_width",
        "predicted_width_2048",
        "band_width_2048",
    ]
    by = {r["policy"]: r for r in rows}
    assert {"bf16", "fp32", "nvfp4-all", "rule-a", "rule-b", "rule-c", "rule-d"} <= set(by)
    assert float(by["bf16"]["predicted_study_width"]) == float(by["bf16"]["predicted_width_2048"]) == 1.0
    nvfp4 = by["nvfp4-all"]
    assert float(nvfp4["est_peak_flop_speedup"]) == 4.0  # the peak-FLOP ratio, whatever the width
    # 64 wide the casts cost more than NVFP4's GEMMs save; 2048 wide the GEMMs dominate the step
    assert float(nvfp4["predicted_study_width"]) < 1.0 < float(nvfp4["predicted_width_2048"])
    assert by["bf16"]["band_width_2048"] == ""  # no low-precision GEMM: outside the validated range, no band
    assert "<!-- part:reprice -->" in (tmp_path / "summary.md").read_text()


def test_the_raised_set_takes_the_highest_drop_per_flop_until_its_share_reaches_the_goal():
    flops = {"a": 100.0, "b": 10.0, "c": 50.0, "d": 40.0, "e": 0.0 + 20.0}  # e has no drop: never ranked
    drops = {"a": 0.05, "b": 0.002, "c": 0.04, "d": -0.01}  # per FLOP: c 8e-4, a 5e-4, b 2e-4, d < 0
    assert schedule.raised_set(drops, flops, 0.2) == ["c"]  # 50 / 220 = 0.227 reaches 0.2
    assert schedule.raised_set(drops, flops, 0.3) == ["c", "a"]  # 150 / 220
    assert schedule.raised_set(drops, flops, 0.75) == ["c", "a", "b", "d"]  # 160 / 220 = 0.727 < 0.75 <= 200 / 220
    assert schedule.raised_set(drops, flops, 0.95) == ["c", "a", "b", "d"]  # never reached: every ranked Linear
    # a seeded made-up table: S is the shortest prefix of the ranking by drop per FLOP whose share reaches the goal
    g = torch.Generator().manual_seed(63)
    names = [f"l{i}" for i in range(30)]
    flops = dict(zip(names, (torch.randint(1, 100, (30,), generator=g).double() * 1e6).tolist(), strict=True))
    drops = dict(zip(names, (torch.randn(30, generator=g, dtype=torch.float64) * 1e-3).tolist(), strict=True))
    total = sum(flops.values())
    for goal in (0.1, 0.356, 0.8):
        chosen = schedule.raised_set(drops, flops, goal)
        share = sum(flops[n] for n in chosen) / total
        assert share >= goal > share - flops[chosen[-1]] / total
        left = [drops[n] / flops[n] for n in names if n not in chosen]
        assert min(drops[n] / flops[n] for n in chosen) >= max(left)


def test_the_switch_step_gives_rule_as_predicted_time_within_one_steps_rounding():
    from autoprec.tune._core._targets import B200
    from autoprec.tune._measure._predict import predict

    example = common.load_example("tiny")  # 2 blocks; its pattern at the real width, on the meta device
    h = example.HPARAMS
    real = schedule.step_of(example, {**h, "d_model": 2048, "n_heads": 16}, h["batch"], 1024)
    named = policies.study_policies(example.GPT())
    start, everything = named["nvfp4-all"], [n for n in named["nvfp4-all"].layers if n]
    goal = predict(real, named["rule-a"], B200).ms
    # raising every Linear: feasible; raising block 0's attention alone or the head alone is not (at this width
    # either phase is already faster than rule-a): then the step closest to rule-a's time is used
    for raised, steps, feasible in ((everything, 50, True), (everything, 37, True), (everything[:2], 40, False),
                                    (["lm_head"], 200, False)):  # fmt: skip
        s = schedule.equal_time(real, start, raised, goal, steps, B200)
        f = s["exact"]
        # the exact fraction prices the schedule at rule-a's time: f t_low + (1 - f) t_raised
        assert f * s["t_low"] + (1 - f) * s["t_raised"] == pytest.approx(goal, rel=1e-12)
        assert s["feasible"] is feasible and (0 <= f <= 1) is feasible
        policy = schedule.scheduled(start, raised, s["fraction"])
        assert policy.phases[0].start_step(steps) == s["step"] and s["fraction"] == s["step"] / steps
        assert predict(real, policy, B200).ms == pytest.approx(s["ms"], rel=1e-12)
        assert s["residual"] == pytest.approx(s["ms"] / goal - 1)
        # the chosen step is the closest to rule-a's time of every step inside the run (brute force)
        gaps = {k: abs(predict(real, schedule.scheduled(start, raised, k / steps), B200).ms - goal) for k in range(1, steps)}
        assert gaps[s["step"]] == pytest.approx(min(gaps.values()), rel=1e-9, abs=1e-12)
        if feasible:  # the nearest step: within half a step's time
            assert abs(s["ms"] - goal) <= abs(s["t_raised"] - s["t_low"]) / steps / 2 * (1 + 1e-9)
    # a goal faster than nvfp4-all everywhere: no switch step reaches it; the latest step is the closest
    fast = schedule.equal_time(real, start, everything, 0.5 * predict(real, start, B200).ms, 50, B200)
    assert not fast["feasible"] and fast["step"] == 49
    # a goal at bf16's time: f* = 0, the first step inside the run is the closest
    slow = schedule.equal_time(real, start, everything, predict(real, named["bf16"], B200).ms, 50, B200)
    assert slow["exact"] == pytest.approx(0, abs=1e-12) and slow["step"] == 1


def test_a_schedule_round_trips_and_switches_at_its_step_in_a_training_run(tmp_path):
    import dataclasses

    from autoprec.policy import Policy, load_policy
    from autoprec.tune import prepare
    from autoprec.tune._api import task_from_objects

    example = common.load_example("tiny")
    torch.manual_seed(0)
    model = example.GPT()
    named = policies.study_policies(model)
    raised = ["h.0.attn.c_attn", "lm_head"]
    policy = schedule.scheduled(named["nvfp4-all"], raised, 2 / 4)
    assert Policy.from_dict(policy.to_dict()) == policy
    assert load_policy(policy.save(tmp_path / "p.json")) == policy
    assert {n: f.value for n, f in policy.phase_layers(1).items() if f.value == "bf16"} == dict.fromkeys(["", *raised], "bf16")
    assert policy.phase_shares() == (0.5, 0.5) and policy.in_phase(0) == named["nvfp4-all"]
    assert policy.phases[0].start_step(4) == 2
    g = torch.Generator().manual_seed(1)
    seq = example.HPARAMS["seq_len"]
    data = [(torch.randint(0, 256, (1, seq), generator=g),) * 2 for _ in range(4)]
    task = task_from_objects(model, example.loss_fn, data, data[:1], name="tiny-schedule")
    workload = prepare(task, "cpu")
    # the metric at step 2 is taken before step 2 is trained: the model is still in the first phase there
    rows = runs.train_curve(workload, policy, 4, 0, 0, order=range(4), at=[0, 2, 3, 4])
    assert [r["phase"] for r in rows] == [0, 0, 1, 1] and rows[-1]["switched_at"] == 2
    runs.write_run(runs.run_path(tmp_path, "s", 0), rows)
    schedule.check_phases({"s": policy}, tmp_path, 1, 4)
    # a run that never switched is refused
    runs.write_run(runs.run_path(tmp_path, "s", 0), [{**r, "phase": 0} for r in rows])
    with pytest.raises(RuntimeError, match="did not switch"):
        schedule.check_phases({"s": policy}, tmp_path, 1, 4)
    # an unscheduled policy's rows have no phase columns
    plain = runs.train_curve(workload, dataclasses.replace(policy, phases=()), 1, 0, 0, order=range(1), at=[0, 1])
    assert "phase" not in plain[-1] and "switched_at" not in plain[-1]
