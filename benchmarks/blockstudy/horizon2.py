"""Phase 3, second attempt (`--part horizon2`): every policy's loss curve over 10x the search's train steps on fresh
data, its drop judged paired over the seeds.

    python benchmarks/block_study.py --part horizon2 --seeds 5 --eval-every 10 --out results/cpu-epyc-bf16-2core/block-study

The first horizon runs cycled the example's 4 fixed train batches and evaluated on its 4 eval batches, so over 50
steps the model overfit and bf16's own spread over the seeds outgrew the budgets. Here every step takes a batch of
windows not taken before in the run (a seed's own draw from the example's train split, the same for every policy), the
metric is taken on 16 eval batches of the eval split, and a drop is judged paired: seed by seed against bf16 trained
on the same stream, then a t interval over the seeds. Writes policies2.csv, loss_curves2.png, pareto2.png and its
section of summary.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

from .common import _mean, _pyplot, _rel, _save, update_summary, write_csv
from .policies import RULE_TEXT, all_policies, flops_table, gemm_share, gpt2_workload, label_budget, label_tag, searched_text
from .runs import COLORS, finished, load_curves, noise_floor_at, run_path, train_curve, write_run

HORIZON2_DIR = "horizon2"
N_EVAL_BATCHES = 16  # eval batches of `batch` windows from the eval split (the mini example's split holds 22)


def grid_starts(length: int, seq_len: int) -> torch.Tensor:
    """The starts of every non-overlapping window of seq_len + 1 bytes that fits a stream of `length` bytes."""
    return torch.arange(length // (seq_len + 1)) * (seq_len + 1)


def train_starts(length: int, seq_len: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, batch] window starts for a run with `seed`: a draw without replacement from the stream's
    non-overlapping windows (grid_starts), so no window repeats within the run; the same for every policy."""
    grid = grid_starts(length, seq_len)
    need = steps * batch
    if need > len(grid):
        raise ValueError(f"{steps} steps of {batch} windows need {need} windows; the train split holds {len(grid)}")
    g = torch.Generator().manual_seed(10_000 + seed)  # apart from the seeds batch_order and the model use
    return grid[torch.randperm(len(grid), generator=g)[:need]].view(steps, batch)


def eval_starts(length: int, seq_len: int, batch: int, n_batches: int) -> torch.Tensor:
    """[n_batches, batch] window starts spread evenly over the eval stream, non-overlapping (as the example's own
    fixed_batches lays them out)."""
    stride = (length - seq_len - 1) // (n_batches * batch)
    if stride < seq_len + 1:
        raise ValueError(f"{n_batches} eval batches of {batch} windows overlap: the eval split holds "
                         f"{length // (seq_len + 1)} windows")  # fmt: skip
    return (torch.arange(n_batches * batch) * stride).view(n_batches, batch)


def fresh_data(example, steps: int, seed: int, n_eval: int = N_EVAL_BATCHES) -> tuple[list, list]:
    """(train batches, one per step, for `seed`; eval batches) of the example's stdlib_text corpus: the train windows
    from its train split, the eval windows from its eval split (other bytes of the files), so the two never share a
    byte."""
    h = example.HPARAMS
    text = example.stdlib_text
    train, evals = text.text(h["bytes_per_file"], h["eval_frac"])
    seq, batch = h["seq_len"], h["batch"]
    tr = [text.windows(train, s, seq) for s in train_starts(len(train), seq, batch, steps, seed)]
    ev = [text.windows(evals, s, seq) for s in eval_starts(len(evals), seq, batch, n_eval)]
    return tr, ev


def eval_steps(steps: int, every: int, k: int) -> list[int]:
    """The steps the metric is taken at: 0, K, then every `every` steps, and the last."""
    return sorted({0, k, steps, *range(0, steps + 1, every)})


def paired_stats(values: list[float], level: float = 0.95) -> dict[str, float]:
    """Mean of the paired drops over the seeds and its two-sided `level` t interval: mean +- t(n-1) sd / sqrt(n),
    sd with n - 1; the half-width is the noise floor of that mean (nan below 2 seeds)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "half": math.nan, "lo": math.nan, "hi": math.nan, "sd": math.nan}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "half": half, "lo": mean - half, "hi": mean + half, "sd": sd}


def paired_drops(curves, name: str, step: int, base: str = "bf16") -> list[float]:
    """The policy's drop at `step` seed by seed against `base` trained on the same stream: base metric - its."""
    ref = curves.get(base, {})
    return [ref[s][step] - run[step] for s, run in sorted(curves.get(name, {}).items()) if s in ref and step in run]


def drop_columns(tag: str, drops: list[float]) -> dict[str, object]:
    """A table row's columns for the paired drops at one step (`tag`: "K", "10K"): seeds, mean, the 95% interval's
    ends, its half-width, and each seed's drop."""
    st = paired_stats(drops)
    return {
        f"seeds_{tag}": st["n"],
        f"drop_{tag}_mean": round(st["mean"], 6),
        f"drop_{tag}_ci_lo": round(st["lo"], 6),
        f"drop_{tag}_ci_hi": round(st["hi"], 6),
        f"drop_{tag}_half_width": round(st["half"], 6),
        f"drop_{tag}_by_seed": " ".join(f"{v:.5f}" for v in drops),
    }


def budget_verdict(stats_: dict[str, float], budget: float) -> str:
    """holds (the interval's top at or under the budget), broken (its bottom above it), or undecided."""
    if not math.isfinite(stats_["half"]):
        return "undecided (one seed)"
    if stats_["hi"] <= budget:
        return "holds"
    if stats_["lo"] > budget:
        return "broken"
    return "undecided"


def horizon2_policies(model: nn.Module, out: Path) -> dict[str, object]:
    """bf16 and fp32 (the references), the tagged (postfix, fallback) searched policies, the rules and NVFP4 everywhere, then the
    pre-fix searched policies (run last: dropped first when time runs out)."""
    from autoprec.formats import Format
    from autoprec.policy import Policy

    found = all_policies(model, out)
    refs = {"bf16": found["bf16"], "fp32": Policy(layers={"": Format.FP32})}
    twins = same_as(found)
    found = {n: p for n, p in found.items() if n not in twins}  # run once, under the first label
    searched = [n for n in found if n.startswith("searched")]
    post = {n: found[n] for n in searched if label_tag(n)}
    rules = {n: p for n, p in found.items() if n not in searched and n != "bf16"}
    pre = {n: found[n] for n in searched if not label_tag(n)}
    return {**refs, **post, **rules, **pre}


def same_as(found: dict[str, object]) -> dict[str, str]:
    """{searched label: the earlier label whose policy it equals} for the searched policies that chose the same
    Linears and loss scale as one listed before them (two searches may end on one policy, e.g. the profile-greedy
    start): its runs would repeat the other's bit for bit (this CPU reproduces a seed exactly), so it is run once."""
    seen: dict[tuple, str] = {}
    twins = {}
    for name, policy in found.items():
        key = (tuple(sorted((n, f.value) for n, f in policy.layers.items())), policy.loss_scale)
        if name.startswith("searched") and key in seen:
            twins[name] = seen[key]
        seen.setdefault(key, name)
    return twins


def _claim(path: Path) -> bool:
    """Take the run at `path` for this process (a .lock beside it holding our pid); a lock whose process is gone is
    taken over. Lets two workers share one queue."""
    lock = path.with_suffix(".lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            pid = int(lock.read_text() or 0)
            os.kill(pid, 0)
            return False  # another live worker has it
        except (ValueError, ProcessLookupError, FileNotFoundError):
            lock.unlink(missing_ok=True)
            return _claim(path)
        except PermissionError:
            return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def run_queue(example, workload, policies: dict, folder: Path, steps: int, at: list[int], seeds: int) -> list:
    """Train every unfinished (policy, seed), seed by seed in the policies' order (the pre-fix searched policies after
    every other run of every seed), each on its seed's fresh stream; each csv is written whole when its run ends."""
    late = [n for n in policies if n.startswith("searched") and not label_tag(n)]
    queue = [(s, n) for s in range(seeds) for n in policies if n not in late]
    queue += [(s, n) for s in range(seeds) for n in late]
    ran = []
    data: dict[int, tuple] = {}
    for seed, name in queue:
        path = run_path(folder, name, seed)
        if finished(path, steps) or not _claim(path):
            continue
        try:
            if seed not in data:
                data[seed] = fresh_data(example, steps, seed)
            train, evals = data[seed]
            wl = dataclasses.replace(workload, train=train, eval=evals)
            start = time.perf_counter()
            rows = train_curve(wl, policies[name], steps, 0, seed, order=range(steps), at=at)
            write_run(path, rows)
        finally:
            path.with_suffix(".lock").unlink(missing_ok=True)
        ran.append((name, seed))
        print(f"{name} seed {seed}: {steps} steps in {time.perf_counter() - start:.0f} s, "
              f"metric {rows[-1]['metric']:.4f}", flush=True)  # fmt: skip
    return ran


def run(args) -> None:
    """Every policy trained 10 x K steps on fresh windows per seed, judged paired against bf16 (see above)."""
    from autoprec.tune._core._targets import target_named
    from autoprec.tune._decide._flops import estimated_speedup, gemm_flops

    out: Path = args.out
    folder = out / HORIZON2_DIR
    folder.mkdir(parents=True, exist_ok=True)
    example, workload = gpt2_workload(args.size)
    policies = horizon2_policies(workload.model, out)
    if args.only:
        policies = {n: p for n, p in policies.items() if n in args.only or n in ("bf16", "fp32")}
    steps = args.horizon * args.steps
    at = eval_steps(steps, args.eval_every or args.steps, args.steps)
    start = time.perf_counter()
    ran = [] if args.report_only else run_queue(example, workload, policies, folder, steps, at, args.seeds)
    spent = time.perf_counter() - start
    print(f"ran {len(ran)} runs in {spent:.0f} s", flush=True)
    tokens = int(example.HPARAMS["batch"] * example.HPARAMS["seq_len"])
    flops = gemm_flops(flops_table(workload.model, tokens))
    curves = load_curves(policies, folder, args.seeds, steps)
    table = horizon2_table(policies, curves, args, flops, target_named("b200"), estimated_speedup)
    if table:
        write_csv(out / "policies2.csv", table)
        plot_curves2(curves, args, out / "loss_curves2.png")
        plot_pareto2(table, args, out / "pareto2.png")
        twins = same_as(all_policies(workload.model, out))
        update_summary(out, "horizon2", horizon2_summary(table, curves, args, steps, example, twins))
    print("horizon2: wrote policies2.csv, loss_curves2.png, pareto2.png, summary.md")


def horizon2_table(policies, curves, args, flops, target, estimated_speedup) -> list[dict]:
    steps = args.horizon * args.steps
    rows = []
    for name, policy in policies.items():
        if name not in curves or "bf16" not in curves:
            continue
        share = gemm_share(policy, flops)
        row = {
            "policy": name,
            "rule": RULE_TEXT.get(name) or ("every Linear fp32 (the reference)" if name == "fp32" else searched_text(name)),
            "budget": label_budget(name) if name.startswith("searched") else "",
            "low_gemm_share": round(share["low"], 4),
            "nvfp4_share": round(share.get("nvfp4", 0.0), 4),
            "mxfp8_share": round(share.get("mxfp8", 0.0), 4),
            "est_b200_speedup": round(estimated_speedup(policy, flops, target), 4),
        }
        for tag, step in (("K", args.steps), ("10K", steps)):
            d = paired_drops(curves, name, step)
            st = paired_stats(d)
            vs32 = paired_stats(paired_drops(curves, name, step, base="fp32")) if "fp32" in curves else None
            row |= drop_columns(tag, d)
            row |= {
                f"drop_vs_fp32_{tag}_mean": "" if vs32 is None else round(vs32["mean"], 6),
                f"drop_vs_fp32_{tag}_half_width": "" if vs32 is None else round(vs32["half"], 6),
                f"bf16_spread_{tag}": round(noise_floor_at(curves, step), 6),
            }
            row[f"verdict_{tag}"] = budget_verdict(st, row["budget"]) if row["budget"] != "" else ""
            if vs32 is not None and row["budget"] != "":  # the budget was set against fp32 in the search
                row[f"verdict_vs_fp32_{tag}"] = budget_verdict(vs32, row["budget"])
        # how the drop moved from K to 10 x K, seed by seed (each seed's 10 x K drop minus its K drop)
        k_by = dict(zip(sorted(curves[name]), paired_drops(curves, name, args.steps), strict=False))
        end_by = dict(zip(sorted(curves[name]), paired_drops(curves, name, steps), strict=False))
        growth = paired_stats([end_by[s] - k_by[s] for s in sorted(k_by) if s in end_by])
        row |= {"growth_mean": round(growth["mean"], 6), "growth_half_width": round(growth["half"], 6)}
        rows.append(row)
    return rows


def _pm(mean: float, half: float) -> str:
    return f"{mean:+.4f}" + (f" ± {half:.4f}" if math.isfinite(half) else " (one seed)")


def horizon2_findings(table) -> list[str]:
    """The paired drops in words: each policy's mean ± 95% half-width at K and 10 x K, how it moved, and each searched
    policy's budget verdicts."""
    by = {r["policy"]: r for r in table}
    if "bf16" not in by:
        return ["* bf16 has not run yet: no drops."]
    out = []
    if "fp32" in by:
        r = by["fp32"]
        out.append(
            f"* fp32 against bf16 on the same streams ({r['seeds_10K']} seeds): {_pm(r['drop_K_mean'], r['drop_K_half_width'])} "
            f"at K, {_pm(r['drop_10K_mean'], r['drop_10K_half_width'])} at 10 x K: bf16's own effect on this model."
        )
    others = [r for r in table if r["policy"] not in ("bf16", "fp32")]
    halves = {t: [r[f"drop_{t}_half_width"] for r in others if math.isfinite(r[f"drop_{t}_half_width"])] for t in ("K", "10K")}
    if halves["K"] and halves["10K"]:
        out.append(
            f"* The noise floor of a mean paired drop (its 95% half-width) spans {min(halves['K']):.4f}-"
            f"{max(halves['K']):.4f} at K and {min(halves['10K']):.4f}-{max(halves['10K']):.4f} at 10 x K over the "
            f"policies; bf16's max - min over the seeds (the first attempt's floor) is {by['bf16']['bf16_spread_K']:.4f} "
            f"and {by['bf16']['bf16_spread_10K']:.4f}."
        )
    pairs = [
        (float(k), float(e))
        for r in others
        for k, e in zip(r["drop_K_by_seed"].split(), r["drop_10K_by_seed"].split(), strict=False)
    ]
    if pairs:
        grew = sum(e > k for k, e in pairs)
        out.append(
            f"* Over every low-precision policy and seed, the drop at 10 x K exceeds the drop at K in {grew} of "
            f"{len(pairs)} runs (mean change {_mean([e - k for k, e in pairs]):+.4f})."
        )
    for r in others:
        g, gh = r["growth_mean"], r["growth_half_width"]
        if math.isfinite(gh) and g - gh > 0:
            moved = f"grew by {_pm(g, gh)}, beyond the noise"
        elif math.isfinite(gh) and g + gh < 0:
            moved = f"shrank by {_pm(g, gh)}, beyond the noise"
        else:
            moved = f"moved by {_pm(g, gh)}, not told from the noise"
        line = (
            f"* {r['policy']} ({r['low_gemm_share']:.0%} of the GEMM work low, est. {r['est_b200_speedup']:.2f}x, "
            f"{r['seeds_10K']} seed{'s' if r['seeds_10K'] != 1 else ''}): {_pm(r['drop_K_mean'], r['drop_K_half_width'])} at K, "
            f"{_pm(r['drop_10K_mean'], r['drop_10K_half_width'])} at 10 x K; seed by seed the drop {moved}."
        )
        if r["budget"] != "":
            line += f" Budget {r['budget']:g}: {r['verdict_K']} at K, {r['verdict_10K']} at 10 x K against bf16" + (
                f" ({r.get('verdict_vs_fp32_10K', '')} against fp32)." if r.get("verdict_vs_fp32_10K") else "."
            )
        out.append(line)
    return out


def plot_curves2(curves, args, path: Path) -> None:
    """Each policy's mean paired drop against bf16 over the steps, with its 95% t interval over the seeds: the searched
    policies (with their budgets) on the left, the references, rules and NVFP4 everywhere on the right."""
    plt = _pyplot()

    base = curves.get("bf16", {})
    if not base:
        return
    steps = sorted(next(iter(base.values())).keys())
    searched = [n for n in curves if n.startswith("searched") and label_tag(n)]
    others = [n for n in curves if n != "bf16" and not n.startswith("searched")]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5), sharey=True)
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#e377c2", "#bcbd22")
    for ax, names, title in ((axes[0], searched, "searched (after e97993f)"), (axes[1], others, "references and hand rules")):
        for i, name in enumerate(names):
            st = [paired_stats(paired_drops(curves, name, s)) for s in steps]
            color = "0.3" if name == "fp32" else COLORS.get(name, palette[i % len(palette)])
            mean = [x["mean"] for x in st]
            ax.plot(steps, mean, marker="o", ms=3, color=color, lw=1.6, label=f"{name} (n={st[-1]['n']})")
            ax.fill_between(steps, [x["lo"] for x in st], [x["hi"] for x in st], color=color, alpha=0.12)
        if names is searched:
            for b in sorted({label_budget(n) for n in names}):
                ax.axhline(b, color="r", lw=0.8, ls="--")
                ax.text(steps[-1], b, f" budget {b:g}", va="bottom", ha="right", color="r", fontsize=8)
        ax.axhline(0, color="k", lw=0.6)
        ax.axvline(args.steps, color="0.5", lw=0.8, ls=":")
        ax.set_title(title)
        ax.set_xlabel("training steps from the trained weights (a fresh batch each step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("paired drop vs bf16 (nats/byte): mean, 95% t interval")
    fig.suptitle(f"GPT-2 example ({args.size}), K = {args.steps}: each policy against bf16 on the same data stream")
    _save(fig, path)


def plot_pareto2(table, args, path: Path) -> None:
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(9, 6))
    for r in table:
        if r["policy"] == "bf16" or not math.isfinite(r["drop_10K_mean"]):
            continue
        searched = r["policy"].startswith("searched")
        err = r["drop_10K_half_width"] if math.isfinite(r["drop_10K_half_width"]) else 0.0
        ax.errorbar(r["est_b200_speedup"], r["drop_10K_mean"], yerr=err, fmt="*" if searched else "o",
                    ms=10 if searched else 6, color=COLORS.get(r["policy"], "k" if searched else "0.4"), capsize=3)  # fmt: skip
        ax.annotate(r["policy"], (r["est_b200_speedup"], r["drop_10K_mean"]), textcoords="offset points",
                    xytext=(6, 4), fontsize=7)  # fmt: skip
    for b in sorted({r["budget"] for r in table if r["budget"] != ""}):
        ax.axhline(b, color="r", lw=0.8, ls="--")
        ax.text(ax.get_xlim()[0], b, f" budget {b:g}", va="bottom", color="r", fontsize=8)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("estimated b200 GEMM speedup over all-bf16 (FLOP count, not measured)")
    ax.set_ylabel(f"paired drop vs bf16 after {args.horizon * args.steps} steps (mean, 95% t interval)")
    ax.set_title("Hand rules (dots) and searched policies (stars) at 10 x K, fresh data, paired over seeds")
    ax.grid(alpha=0.3)
    _save(fig, path)


def _ci(row, tag: str) -> str:
    if not math.isfinite(row[f"drop_{tag}_half_width"]):
        return f"{row[f'drop_{tag}_mean']:+.4f} (n={row[f'seeds_{tag}']})"
    return f"{row[f'drop_{tag}_mean']:+.4f} ± {row[f'drop_{tag}_half_width']:.4f}"


def horizon2_summary(table, curves, args, steps: int, example, twins: dict[str, str] | None = None) -> str:
    h = example.HPARAMS
    train, evals = example.stdlib_text.text(h["bytes_per_file"], h["eval_frac"])
    n_train = len(grid_starts(len(train), h["seq_len"]))
    n_eval = len(grid_starts(len(evals), h["seq_len"]))
    seeds = sorted(curves.get("bf16", {}))
    lines = [
        "## Loss curves over 10 x K steps on fresh data, drops paired over seeds (`--part horizon2`)",
        "",
        f"    python benchmarks/block_study.py --part horizon2 --size {args.size} --steps {args.steps} "
        f"--horizon {args.horizon} --seeds {args.seeds}{f' --eval-every {args.eval_every}' if args.eval_every else ''} "
        f"--out {_rel(args.out)}",
        "",
        f"The second attempt at the horizon (the first, `--part horizon` below, cycled the example's 4 fixed train "
        "batches: over 50 steps the model overfit them and bf16's seed-to-seed spread outgrew the budgets). Data: the "
        f"example's stdlib_text corpus ({len(train)} train bytes, {len(evals)} eval bytes: the first 90% and the last "
        f"10% of each file's first {h['bytes_per_file']} bytes). Its train split holds {n_train} non-overlapping windows "
        f"of {h['seq_len'] + 1} bytes ({n_train // h['batch']} batches of {h['batch']}); each seed draws "
        f"{steps * h['batch']} of them without replacement, one new batch of {h['batch']} a step, the same stream for "
        f"every policy (the example's weights were pretrained on random windows of this split, ~2.4 passes: the "
        f"windows are new to the run, not to the model). The metric, -(mean eval loss), is taken on {N_EVAL_BATCHES} "
        f"batches ({N_EVAL_BATCHES * h['batch']} of the eval split's {n_eval} windows, spread evenly), which share no "
        f"byte with any train window. Every policy has a bf16 root and trains a fresh copy of the trained weights "
        f"{steps} steps (K = {args.steps}, {args.horizon} x K) with autoprec's Trainer as train mode does (AdamW as "
        f"the example leaves it, the policy's GradScaler), seeds {', '.join(map(str, seeds))} finished for bf16.",
        "",
        "Drop, paired: for each seed, bf16's metric minus the policy's at the same step on the same stream; the table "
        "gives the mean over the seeds ± the half-width of its 95% t interval (t(n-1) sd / sqrt(n)): that half-width "
        "is the noise floor of the mean. A searched policy's budget (set against fp32 at K in its search) holds when "
        "the interval's top is at or under it, is broken when its bottom is above it, undecided otherwise. fp32 is "
        "trained alongside as a reference (its row: bf16 minus fp32). `bf16 spread`: the first attempt's noise floor "
        "(max - min of bf16's metric over the seeds), shown for continuity only. Each (policy, seed) run is "
        f"{HORIZON2_DIR}/<policy>-seed<s>.csv, written whole when it ends; a rerun skips the finished ones.",
        "",
        "![loss curves](loss_curves2.png) ![pareto](pareto2.png)",
        "",
        "| policy | what | low-precision GEMM share (nvfp4 / mxfp8) | est. b200 speedup | seeds | drop at K | "
        "drop at 10 x K | budget: at K / at 10 x K | drop vs fp32 at 10 x K | bf16 spread K / 10 x K |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        verdict = f"{r['budget']:g}: {r['verdict_K']} / {r['verdict_10K']}" if r["budget"] != "" else ""
        vs32 = "" if r["drop_vs_fp32_10K_mean"] == "" else f"{r['drop_vs_fp32_10K_mean']:+.4f}"
        lines.append(
            f"| {r['policy']} | {r['rule']} | {r['low_gemm_share']:.1%} ({r['nvfp4_share']:.1%} / {r['mxfp8_share']:.1%}) "
            f"| {r['est_b200_speedup']:.2f}x | {r['seeds_10K']} | {_ci(r, 'K')} | {_ci(r, '10K')} | {verdict} | {vs32} | "
            f"{r['bf16_spread_K']:.4f} / {r['bf16_spread_10K']:.4f} |"
        )
    lines += ["", "Each seed's drop: policies2.csv (drop_K_by_seed, drop_10K_by_seed).", ""]
    if twins:
        lines += [
            "Searched policies equal to one listed before them (the same Linears and loss scale), so not run again: "
            + "; ".join(f"{n} = {first}" for n, first in twins.items())
            + ".",
            "",
        ]
    lines += ["### Findings (computed from the runs)", "", *horizon2_findings(table), ""]
    return "\n".join(lines)
