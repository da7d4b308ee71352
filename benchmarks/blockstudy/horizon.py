"""Phase 3, first attempt (`--part horizon`, retired: `--part horizon2` replaces it).

    python benchmarks/block_study.py --part horizon --seeds 3 --out results/cpu-epyc-bf16-2core/block-study

The anchors (bf16, NVFP4 everywhere), the hand rules (a)-(d) (rule_layers) and every searched policy found under
search/ (root set to bf16), each trained --horizon x K steps from the trained weights with seeds 0..--seeds-1, the
metric every K steps; each (policy, seed) run in horizon/<policy>-seed<s>.csv as it ends, a rerun skipping the
finished ones. Writes policies.csv, loss_curves.png, pareto.png and its section of summary.md.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from .common import _mean, _pyplot, _rel, _save, update_summary, write_csv
from .policies import RULE_TEXT, all_policies, flops_table, gemm_share, gpt2_workload, label_budget, searched_text
from .runs import COLORS, finished, load_curves, noise_floor_at, run_path, train_curve, write_run


def run_missing(workload, policies: dict, folder: Path, steps: int, every: int, seeds: int) -> list[tuple[str, int]]:
    """Train each (policy, seed) whose csv is not finished, seed by seed, writing each csv as its run ends (so an
    interrupted study resumes at the first unfinished run); returns the runs made."""
    ran = []
    for seed in range(seeds):
        for name, policy in policies.items():
            path = run_path(folder, name, seed)
            if finished(path, steps):
                continue
            start = time.perf_counter()
            rows = train_curve(workload, policy, steps, every, seed)
            write_run(path, rows)
            ran.append((name, seed))
            print(
                f"{name} seed {seed}: {steps} steps in {time.perf_counter() - start:.0f} s, metric {rows[-1]['metric']:.4f}",
                flush=True,
            )
    return ran


def run(args) -> None:
    """Every policy trained 10 x K steps from the same weights with seeds 0..S-1, the metric every K steps; each
    (policy, seed) run in its own csv under horizon/, skipped when already finished."""
    from autoprec.tune._core._targets import target_named
    from autoprec.tune._decide._flops import estimated_speedup, gemm_flops

    out: Path = args.out
    folder = out / "horizon"
    folder.mkdir(parents=True, exist_ok=True)
    example, workload = gpt2_workload(args.size)
    policies = all_policies(workload.model, out)
    if args.only:
        run_names = [n for n in policies if n in args.only or n == "bf16"]
    else:
        run_names = list(policies)
    steps = args.horizon * args.steps
    start = time.perf_counter()
    ran = run_missing(workload, {n: policies[n] for n in run_names}, folder, steps, args.steps, args.seeds)
    spent = time.perf_counter() - start
    print(f"ran {len(ran)} runs in {spent:.0f} s", flush=True)
    tokens = int(example.HPARAMS["batch"] * example.HPARAMS["seq_len"])
    flops = gemm_flops(flops_table(workload.model, tokens))
    target = target_named("b200")
    table = horizon_table(policies, folder, args, flops, target, estimated_speedup)
    if table:
        write_csv(out / "policies.csv", table)
        curves = load_curves(policies, folder, args.seeds, steps)
        plot_curves(curves, args, out / "loss_curves.png")
        plot_pareto(table, args, out / "pareto.png")
        update_summary(out, "horizon", horizon_summary(table, curves, args, steps))
    print(f"horizon: {spent:.0f} s of training this run; wrote policies.csv, loss_curves.png, pareto.png, summary.md")


def drops(curves, name: str, step: int) -> list[float]:
    """The policy's drop against bf16 at `step`, seed by seed (same seed: same batch order): bf16 metric - its."""
    base = curves.get("bf16", {})
    return [base[s][step] - run[step] for s, run in sorted(curves.get(name, {}).items()) if s in base and step in run]


def horizon_table(policies, folder, args, flops, target, estimated_speedup) -> list[dict]:
    steps = args.horizon * args.steps
    curves = load_curves(policies, folder, args.seeds, steps)
    rows = []
    for name, policy in policies.items():
        if name not in curves:
            continue
        share = gemm_share(policy, flops)
        at_k, at_end = drops(curves, name, args.steps), drops(curves, name, steps)
        rows.append(
            {
                "policy": name,
                "rule": RULE_TEXT[name] if name in RULE_TEXT else searched_text(name),
                "low_gemm_share": round(share["low"], 4),
                "nvfp4_share": round(share.get("nvfp4", 0.0), 4),
                "mxfp8_share": round(share.get("mxfp8", 0.0), 4),
                "est_b200_speedup": round(estimated_speedup(policy, flops, target), 4),
                "seeds": len(at_end),
                "drop_at_K_mean": round(_mean(at_k), 6) if at_k else "",
                "drop_at_10K_mean": round(_mean(at_end), 6) if at_end else "",
                "drop_at_K_by_seed": " ".join(f"{d:.5f}" for d in at_k),
                "drop_at_10K_by_seed": " ".join(f"{d:.5f}" for d in at_end),
                "noise_floor_at_K": round(noise_floor_at(curves, args.steps), 6),
                "noise_floor_at_10K": round(noise_floor_at(curves, steps), 6),
            }
        )
    return rows


def plot_curves(curves, args, path: Path) -> None:
    plt = _pyplot()

    base = curves.get("bf16", {})
    steps = sorted(next(iter(base.values())).keys()) if base else []
    fig, ax = plt.subplots(figsize=(12, 5.5))
    if len(base) > 1:
        spread = [noise_floor_at(curves, s) for s in steps]
        ax.fill_between(steps, [-v for v in spread], spread, color="0.8", label=f"bf16 noise floor (spread of {len(base)} seeds)")
    searched = [n for n in curves if n.startswith("searched")]
    styles = dict(zip(searched, ("-", "--", ":"), strict=False))
    for name in curves:
        if name == "bf16":
            continue
        ys = [_mean(drops(curves, name, s)) for s in steps]
        color = COLORS.get(name, "k")
        ax.plot(steps, ys, marker="o", ms=3, lw=2 if name in styles else 1.4, color=color, ls=styles.get(name, "-"), label=name)
    ax.axhline(0, color="k", lw=0.6)
    ax.axvline(args.steps, color="0.5", lw=0.8, ls=":")
    ax.text(args.steps, ax.get_ylim()[1], " K", va="top", color="0.4")
    ax.set_xlabel("training steps from the trained weights")
    ax.set_ylabel("drop vs bf16 (eval-loss rise, nats/byte; mean over seeds)")
    ax.set_title(f"GPT-2 example ({args.size}): each policy's eval-loss rise over bf16 trained alongside, "
                 f"same seeds, K = {args.steps}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(fig, path)


def plot_pareto(table, args, path: Path) -> None:
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(8, 5.5))
    floor = next((r["noise_floor_at_10K"] for r in table if r["policy"] == "bf16"), math.nan)
    if isinstance(floor, float) and math.isfinite(floor):
        ax.axhspan(-floor, floor, color="0.85", label="bf16 noise floor at 10K")
    for r in table:
        if r["drop_at_10K_mean"] == "":
            continue
        searched = r["policy"].startswith("searched")
        ax.scatter(r["est_b200_speedup"], r["drop_at_10K_mean"], s=70 if searched else 45,
                   marker="*" if searched else "o", color=COLORS.get(r["policy"], "k"), zorder=3)  # fmt: skip
        ax.annotate(r["policy"], (r["est_b200_speedup"], r["drop_at_10K_mean"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)  # fmt: skip
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("estimated b200 GEMM speedup over all-bf16 (FLOP count, not measured)")
    ax.set_ylabel(f"drop vs bf16 after {args.horizon * args.steps} steps (nats/byte, mean over seeds)")
    ax.set_title("Hand rules (dots) and searched policies (stars): estimate against drop at 10 x K")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)


def horizon_summary(table, curves, args, steps: int) -> str:
    lines = [
        "## Loss curves over 10 x K steps with seeds (`--part horizon`): the first attempt, retired",
        "",
        "Kept as the record of the first attempt; `--part horizon2` (above) replaces it. These runs cycled the "
        "example's 4 fixed train batches and took the metric on its 4 eval batches, so over 50 steps the model "
        "overfit and bf16's own spread over the seeds (max - min) grew to 2-6x the budgets: no drop below could be "
        "told from it.",
        "",
        f"    python benchmarks/block_study.py --part horizon --size {args.size} --steps {args.steps} "
        f"--horizon {args.horizon} --seeds {args.seeds} --out {_rel(args.out)}",
        "",
        f"Each policy (bf16 root) trains a fresh copy of the trained weights {steps} steps (K = {args.steps}, "
        f"{args.horizon} x K) with seeds 0..{args.seeds - 1}, as train mode trains (autoprec's Trainer: AdamW as the "
        "example leaves it, the policy's GradScaler; seed 0 the example's 4 train batches in order, other seeds "
        "reshuffled each pass), the metric -(mean eval loss) over the 4 eval batches every K steps. Drop = bf16's "
        "metric minus the policy's, same seed; the table gives the mean over seeds and each seed's. Noise floor at a "
        "step = max - min of bf16's metric over the seeds at that step (with 2 seeds, their difference). Each "
        "(policy, seed) run is horizon/<policy>-seed<s>.csv; a rerun skips the finished ones. GEMM shares are "
        "FLOP-weighted over the Linears' three GEMMs (autoprec.tune._decide._flops.gemm_flops; est. speedup: the FLOP goal's "
        "own estimated_speedup on b200).",
        "",
        "![loss curves](loss_curves.png) ![pareto](pareto.png)",
        "",
        "| policy | what | low-precision GEMM share (nvfp4 / mxfp8) | est. b200 speedup | drop at K (by seed) | "
        "drop at 10K (by seed) | noise floor K / 10K |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['policy']} | {r['rule']} | {r['low_gemm_share']:.1%} ({r['nvfp4_share']:.1%} / {r['mxfp8_share']:.1%}) | "
            f"{r['est_b200_speedup']:.2f}x | {_num(r['drop_at_K_mean'])} ({r['drop_at_K_by_seed']}) | "
            f"{_num(r['drop_at_10K_mean'])} ({r['drop_at_10K_by_seed']}) | "
            f"{r['noise_floor_at_K']:.4f} / {r['noise_floor_at_10K']:.4f} |"
        )
    lines += ["", "### Findings (computed from the runs)", ""]
    lines += horizon_findings(table)
    lines.append("")
    return "\n".join(lines)


def _num(value) -> str:
    return "" if value == "" or (isinstance(value, float) and math.isnan(value)) else f"{float(value):+.4f}"


def horizon_findings(table) -> list[str]:
    out = []
    by = {r["policy"]: r for r in table}
    base = by.get("bf16")
    if base is None:
        return ["* bf16 has not run yet: no drops."]
    f_k, f_end = base["noise_floor_at_K"], base["noise_floor_at_10K"]
    out.append(f"* bf16's own spread over the seeds (the noise floor): {f_k:.4f} at K, {f_end:.4f} at 10 x K.")
    for r in table:
        if r["policy"] == "bf16" or r["drop_at_10K_mean"] == "":
            continue
        k, end = r["drop_at_K_mean"], r["drop_at_10K_mean"]
        verdict_k = "within" if abs(k) <= f_k else "above"
        verdict_end = "within" if abs(end) <= f_end else "above"
        line = (
            f"* {r['policy']} ({r['low_gemm_share']:.0%} of the GEMM work low, est. {r['est_b200_speedup']:.2f}x): drop "
            f"{k:+.4f} at K ({verdict_k} the floor), {end:+.4f} at 10 x K ({verdict_end} it); the drop "
            f"{'grew' if end > k else 'shrank'} by {abs(end - k):.4f}."
        )
        if r["policy"].startswith("searched"):
            budget = label_budget(r["policy"])
            line += (
                f" Its budget {budget:g} (against fp32 at K) {'holds' if end <= budget else 'is broken'} at 10 x K against bf16 "
                f"on the mean over the seeds{'' if budget >= f_end else ', inside a noise floor larger than the budget'}."
            )
        out.append(line)
    return out
