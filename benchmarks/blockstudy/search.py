"""Phase 2 (`--part search`): train-mode searches of the mini model with the FLOP goal on b200.

    python benchmarks/block_study.py --part search --out results/cpu-epyc-bf16-2core/block-study

K = --steps train steps, one search per --budgets value, layout --layout, each in search/budget-<b>[-<layout>]/ (with
--tag: search/budget-<b>-<layout>-<tag>/) with its policy.json; search.csv and its section of summary.md. The untagged
searches ran before autoprec's e97993f without the per-GEMM formats; `--tag postfix` ran after it, with them;
`--tag fallback` after the FLOP goal took bf16 as a list's fallback (no fp32 in the space) and priced its greedy start.
"""

from __future__ import annotations

import csv
import time
from collections import defaultdict
from pathlib import Path

from .common import _rel, update_summary, write_csv
from .policies import FALLBACK_TAGS, TAG_TEXT, flops_table, gemm_share, gpt2_workload, label_tag, searched_label

# The space's Linear formats (fp32 is the space's required fallback): the uniform ones and the per-GEMM mixes that
# keep the weight gradient (and for *-fwd-dgrad nothing else) in the autocast around the layer. Before autoprec's
# e97993f the FLOP estimate priced such a high-precision GEMM at fp32 even under a bf16 root, so the first searches
# (tag "", OLD_SEARCH_FORMATS) left the mixes out; the --tag postfix searches have them.
SEARCH_FORMATS = ("fp32", "bf16", "mxfp8", "mxfp8-fwd-dgrad", "nvfp4", "nvfp4-fwd-dgrad", "mxfp8-fwd-nvfp4-dgrad")
OLD_SEARCH_FORMATS = ("fp32", "bf16", "mxfp8", "nvfp4")


def search_formats(tag: str = "") -> tuple[str, ...]:
    """The Linear formats of a search: the first (untagged) searches had no per-GEMM mixes; the fallback ones have no
    fp32 (bf16 is their lists' fallback)."""
    if not tag:
        return OLD_SEARCH_FORMATS
    if tag in FALLBACK_TAGS:
        return tuple(f for f in SEARCH_FORMATS if f != "fp32")
    return SEARCH_FORMATS


def search_space(layout: str, trials: int, tag: str = "postfix"):
    from autoprec.tune._core._space import space_from_dict

    formats = list(search_formats(tag))
    root = ["bf16"] if tag in FALLBACK_TAGS else ["fp32", "bf16"]
    return space_from_dict(
        {"default": root, "layers": {"Linear": formats}, "layout": layout, "trials": trials},
        source="block_study.py",
    )


def searched_dir(out: Path, budget: float, layout: str = "ranked", tag: str = "") -> Path:
    """search/budget-<b>/ for the default layout, search/budget-<b>-<layout>/ for another; with a tag always
    search/budget-<b>-<layout>-<tag>/ (the layout named, so a label reads one way)."""
    if tag:
        return out / "search" / f"budget-{budget:g}-{layout}-{tag}"
    return out / "search" / (f"budget-{budget:g}" if layout == "ranked" else f"budget-{budget:g}-{layout}")


def run(args) -> None:
    """Train-mode searches (K steps, the FLOP goal on b200) at each budget, each in its own folder under search/."""
    import optuna

    import autoprec.tune
    from autoprec.tune._core._targets import target_named
    from autoprec.tune._decide._flops import estimated_speedup, gemm_flops

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out: Path = args.out
    example, workload = gpt2_workload(args.size)
    tokens = int(example.HPARAMS["batch"] * example.HPARAMS["seq_len"])
    flops = gemm_flops(flops_table(workload.model, tokens))
    target = target_named("b200")
    rows = []
    for budget in args.budgets:
        folder = searched_dir(out, budget, args.layout, args.tag)
        start = time.perf_counter()
        result = autoprec.tune.search(
            workload.model, example.loss_fn, example.batches("train"), example.batches("eval"), budget=budget,
            trials=args.trials, device="cpu", out=folder, space=search_space(args.layout, args.trials, args.tag), progress=False,
            name=f"gpt2-{args.size}", mode="train", train_steps=args.steps, noise_runs=args.noise_runs,
            objective="flops", target="b200", time_budget=args.search_seconds,
        )  # fmt: skip
        wall = time.perf_counter() - start
        (folder / "summary.txt").write_text(result.summary() + "\n")
        chosen = result.finals.by_name(_chosen_name(result)) if _chosen_name(result) else None
        share = gemm_share(result.policy, flops)
        rows.append(
            {
                "budget": budget,
                "layout": args.layout,
                "estimate": TAG_TEXT.get(args.tag, args.tag),
                "trials_asked": args.trials,
                "search_seconds": args.search_seconds,
                "policy": searched_label(folder),
                "wall_s": round(wall, 1),
                "trials": len(result.trials),
                "chosen": _chosen_name(result) or "",
                "low_gemm_share": round(share["low"], 4),
                "est_b200_speedup": round(estimated_speedup(result.policy, flops, target), 4),
                "drop_vs_fp32_at_K": "" if chosen is None else round(chosen.metric_drop, 6),
                "noise_floor_fp32_at_K": "" if result.noise is None else round(result.noise.spread, 6),
                "formats": _format_counts(result.policy, flops),
                "policy_file": _rel(folder / "policy.json"),
            }
        )
        print(f"budget {budget:g}: {rows[-1]} in {wall:.0f} s", flush=True)
    path = out / "search.csv"
    old = []
    if path.exists():  # keep the rows of budgets not rerun now
        with open(path) as f:
            old = [
                {"layout": "ranked", "estimate": TAG_TEXT[""], **r}
                for r in csv.DictReader(f)
                if (float(r["budget"]), r.get("layout", "ranked"), label_tag(r["policy"]))
                not in {(b, args.layout, args.tag) for b in args.budgets}
            ]
    order = list(TAG_TEXT.values())
    rows = sorted(
        old + rows,
        key=lambda r: (
            order.index(r["estimate"]) if r["estimate"] in order else len(order),
            r["layout"] != "ranked",
            float(r["budget"]),
        ),
    )
    write_csv(path, rows)
    update_summary(out, "search", search_summary(rows, args))
    print(f"wrote {path}, the policies under {_rel(out / 'search')}, summary.md")


def _chosen_name(result) -> str | None:
    from autoprec.tune._core._records import Measured

    measured = Measured.of(result.policy)
    return getattr(measured, "chosen", None) or (result.policy.measured or {}).get("chosen")


def _format_counts(policy, flops: dict[str, float]) -> str:
    from autoprec.tune._decide._flops import format_of

    counts: dict[str, int] = defaultdict(int)
    for name in flops:
        counts[format_of(name, policy.layers).value] += 1
    return " ".join(f"{f}:{n}" for f, n in sorted(counts.items()))


def search_summary(rows, args) -> str:
    commands = []

    def key_of(r):
        # a row read back from search.csv holds strings, a fresh one numbers: one key for both
        return r["layout"], int(r["trials_asked"]), float(r["search_seconds"]), label_tag(r["policy"])

    for key in dict.fromkeys(key_of(r) for r in rows):
        budgets = ",".join(f"{float(r['budget']):g}" for r in rows if key_of(r) == key)
        commands.append(
            f"    python benchmarks/block_study.py --part search --size {args.size} --steps {args.steps} "
            f"--budgets {budgets} --trials {key[1]} --layout {key[0]} --noise-runs {args.noise_runs} "
            f"--search-seconds {float(key[2]):g}{f' --tag {key[3]}' if key[3] else ''} --out {_rel(args.out)}"
        )
    lines = [
        "## Train-mode searches with the FLOP goal (`--part search`)",
        "",
        *commands,
        "",
        f'`autoprec.tune.search(..., mode="train", train_steps={args.steps}, noise_runs={args.noise_runs}, '
        f'objective="flops", target="b200", time_budget=...)` on the CPU, one search per budget (a sweep\'s '
        "second objective is the drop beside a measured speed; this goal is an estimate, so each budget is its own "
        "search), each in its own folder under search/ (budget-<b>/, budget-<b>-<layout>/ for a layout other than "
        f"ranked, budget-<b>-<layout>-<tag>/ for a tagged one) with its policy.json, trials.csv and summary.txt. "
        f"Space: every Linear in {{{', '.join(SEARCH_FORMATS)}}} for the postfix searches (the per-GEMM mixes "
        "keep the GEMMs they leave high in the autocast around the layer, bf16 under a bf16 root), "
        f"{{{', '.join(OLD_SEARCH_FORMATS)}}} for the untagged ones, which ran before autoprec's e97993f: "
        "its FLOP estimate priced a GEMM a format leaves in high precision at fp32 (75 TFLOP/s on a B200) even "
        "under a bf16 root, so a mix could only lose there and the mixes were left out. Their lists hold fp32 (then a "
        "space's rule: autoprec's fallback), the root fp32 or bf16 (set to bf16 for the horizon), and the estimate "
        "prices a layer left in fp32 at 75 TFLOP/s. The fallback searches ran after the FLOP goal let a list keep "
        f"bf16 instead (Goal.fallbacks) and priced its greedy start at the target's GEMM time: every Linear in "
        f"{{{', '.join(search_formats('fallback'))}}}, the root bf16, no fp32 anywhere. The budget is on the metric (-(mean eval loss), "
        f"nats/byte) after {args.steps} train steps against fp32's after the same steps (train mode's own "
        f"baseline); the noise floor is the spread of {args.noise_runs} fp32 seeds and a repeat of seed 0. Wall: "
        "this command's seconds for that search (a resumed study counts only its new trials).",
        "",
        "| estimate | budget | layout | wall (s) | trials | chosen | low-precision GEMM share | est. b200 GEMM speedup | "
        "drop vs fp32 at K | noise floor at K | Linears by format |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('estimate') or TAG_TEXT['']} | {float(r['budget']):g} | {r['layout']} | {float(r['wall_s']):.0f} | {r['trials']} | {r['chosen']} | "
            f"{float(r['low_gemm_share']):.1%} | {float(r['est_b200_speedup']):.2f}x | {r['drop_vs_fp32_at_K']} | "
            f"{r['noise_floor_fp32_at_K']} | {r['formats']} |"
        )
    lines += ["", "The horizon part trains these policies 10x longer beside the hand rules.", ""]
    return "\n".join(lines)
