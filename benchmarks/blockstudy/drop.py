"""Phase 1's metric (`--part drop`): each Linear's eval-loss rise by block depth.

    python benchmarks/block_study.py --part drop --out results/cpu-epyc-bf16-2core/block-study

Each Linear alone with its forward GEMM in fp8 tensorwise, MXFP8 or NVFP4 (every other layer fp32): the eval-loss
rise (the example's metric drop), and every Linear at once. Writes drop.csv, drop_by_depth.png and its section of
summary.md (with the rank correlation against the SQNR when sqnr.csv is there).
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import torch
from torch import nn

from autoprec.formats.mx import blockscaled_linear

from .common import (
    FORMATS,
    ROLES,
    Float8Tensorwise,
    _mean,
    _pyplot,
    _rel,
    _save,
    layer_role,
    load_example,
    update_summary,
    write_csv,
)


def quantized_fprop(x: torch.Tensor, w: torch.Tensor, fmt) -> torch.Tensor:
    """x @ W^T with both operands quantised and dequantised in `fmt` (the forward GEMM alone), in fp32."""
    if isinstance(fmt, Float8Tensorwise):
        return fmt.quantize(x, "activation") @ fmt.quantize(w, "weight").t()
    with torch.no_grad():
        return blockscaled_linear(x.float(), w.float(), None, fprop=fmt)


def _fprop_hook(fmt):
    def hook(mod, args, out):
        x = args[0].reshape(-1, mod.in_features)
        y = quantized_fprop(x, mod.weight, fmt)
        if mod.bias is not None:
            y = y + mod.bias
        return y.to(out.dtype).reshape(out.shape)

    return hook


def eval_loss(model: nn.Module, loss_fn, batches) -> float:
    with torch.no_grad():
        return sum(loss_fn(model, b).item() for b in batches) / len(batches)


# fprop alone: the NVFP4 variants differ only in the backward GEMMs (stochastic rounding of gradients, the RHT on
# wgrad), so the eval drop has one NVFP4 column
DROP_FORMATS = ("fp8-tensorwise", "mxfp8", "nvfp4")


def run(args) -> None:
    """Each Linear alone with its forward GEMM in each format (all others fp32): the rise of the eval loss (the
    example's metric is -(mean eval loss), so the rise is the metric drop), and every Linear at once."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    example = load_example(args.size)
    model = example.build_model().eval()
    evals = example.batches("eval")
    base = eval_loss(model, example.loss_fn, evals)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    rows = []
    start = time.perf_counter()
    for fname in DROP_FORMATS:
        hook = _fprop_hook(FORMATS[fname])
        for name, mod in linears:
            handle = mod.register_forward_hook(hook)
            try:
                loss = eval_loss(model, example.loss_fn, evals)
            finally:
                handle.remove()
            block, role = layer_role(name)
            rows.append(
                {
                    "layer": name,
                    "block": block,
                    "role": role,
                    "format": fname,
                    "eval_loss": round(loss, 6),
                    "drop": round(loss - base, 6),
                }
            )
        handles = [mod.register_forward_hook(hook) for _, mod in linears]
        try:
            loss = eval_loss(model, example.loss_fn, evals)
        finally:
            for handle in handles:
                handle.remove()
        rows.append(
            {
                "layer": "all",
                "block": -2,
                "role": "all",
                "format": fname,
                "eval_loss": round(loss, 6),
                "drop": round(loss - base, 6),
            }
        )
    drop_s = time.perf_counter() - start
    write_csv(out / "drop.csv", rows)
    n_layers = len(model.h)
    plot_drop(rows, n_layers, out / "drop_by_depth.png", args.size)
    sqnr_rows = read_sqnr(out / "sqnr.csv")
    update_summary(out, "drop", drop_summary(rows, n_layers, base, len(evals), sqnr_rows, args))
    print(f"wrote {out / 'drop.csv'} ({len(rows)} rows), drop_by_depth.png, summary.md in {drop_s:.0f} s")


def read_sqnr(path: Path) -> list[dict] | None:
    if not path.exists():
        return None
    with open(path) as f:
        return [{**r, "block": int(r["block"]), "sqnr_db": float(r["sqnr_db"])} for r in csv.DictReader(f)]


def plot_drop(rows, n_layers: int, path: Path, size: str) -> None:
    """One panel per role and the LM head; x block depth, one line per format; y the eval-loss rise, symlog."""
    plt = _pyplot()

    colors = dict(zip(FORMATS, ("#1b9e77", "#7570b3", "#d95f02", "#e7298a", "#66a61e"), strict=True))
    table = {(r["block"], r["role"], r["format"]): r["drop"] for r in rows}
    fig, axes = plt.subplots(1, len(ROLES), figsize=(17, 4.2), sharey=True, gridspec_kw={"width_ratios": [4, 4, 4, 4, 1]})
    for j, role in enumerate(ROLES):
        ax = axes[j]
        for k, fname in enumerate(DROP_FORMATS):
            if role == "lm_head":
                xs, ys = [0.15 * (k - 1)], [table[(-1, role, fname)]]
            else:
                xs = list(range(n_layers))
                ys = [table[(b, role, fname)] for b in xs]
            ax.plot(xs, ys, marker="o", ms=3.5, lw=1.6, color=colors[fname], label=fname)
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(role)
        if role == "lm_head":
            ax.set_xticks([0], ["head"])
            ax.set_xlim(-0.6, 0.6)
        else:
            ax.set_xticks(range(0, n_layers, max(1, n_layers // 6)))
            ax.set_xlabel("block depth")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval-loss rise (nats/byte)")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(
        f"One Linear's forward GEMM quantised, all others fp32: the eval-loss rise of the GPT-2 example ({size}), "
        "by block depth (lower is better; symlog)"
    )
    _save(fig, path)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = _mean(ra), _mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def drop_summary(rows, n_layers: int, base: float, n_eval: int, sqnr_rows, args) -> str:
    t = {(r["block"], r["role"], r["format"]): r["drop"] for r in rows}
    block_roles = ROLES[:-1]
    lines = [
        "## Each Linear's metric drop by block depth (`--part drop`)",
        "",
        f"    python benchmarks/block_study.py --part drop --size {args.size} --out {_rel(args.out)}",
        "",
        f"Eval mode, the example's {n_eval} eval batches; fp32 eval loss {base:.4f} nats/byte. Each Linear alone has "
        "its forward GEMM (x @ W^T, both operands quantised as in the SQNR section) in the format, every other layer "
        "fp32; the drop is the eval-loss rise (the example's metric is -(mean eval loss)). Deterministic: no "
        "stochastic rounding in fprop. `all`: every Linear at once.",
        "",
        "![drop by depth](drop_by_depth.png)",
        "",
        "### Findings (computed from drop.csv)",
        "",
    ]
    k = max(1, round(0.15 * n_layers))
    for fname in DROP_FORMATS:
        singles = {(b, r): t[(b, r, fname)] for b in range(n_layers) for r in block_roles}
        singles[(-1, "lm_head")] = t[(-1, "lm_head", fname)]
        total = sum(singles.values())
        pos = {key: max(v, 0.0) for key, v in singles.items()}  # a layer whose rounding happened to help counts 0
        pos_total = sum(pos.values()) or 1.0
        worst = sorted(singles.items(), key=lambda item: -item[1])[:3]
        last = sum(v for (b, _), v in pos.items() if b >= n_layers - k)
        ends = sum(v for (b, _), v in pos.items() if b in (0, n_layers - 1))
        first = sum(v for (b, _), v in pos.items() if b == 0)
        head = pos[(-1, "lm_head")]
        n_neg = sum(v < 0 for v in singles.values())
        lines.append(
            f"* {fname}: all Linears at once {t[(-2, 'all', fname)]:+.4f}; the single-layer drops sum to "
            f"{total:+.4f} ({n_neg} of {len(singles)} negative: the rounding happened to lower the loss). Largest: "
            + ", ".join(f"{'lm_head' if b < 0 else f'block {b} {r}'} {v:+.4f}" for (b, r), v in worst)
            + f". Shares of the positive single drops: last {k} blocks (torchtitan's last ~15%) {last / pos_total:.0%}; "
            f"first and last block (Megatron's rule) {ends / pos_total:.0%}, of which block 0 {first / pos_total:.0%}; "
            f"lm_head {head / pos_total:.0%} (an even share would be {1 / len(singles):.0%} a Linear)."
        )
    if sqnr_rows is not None:
        s = {(r["block"], r["role"]): r["sqnr_db"] for r in sqnr_rows if r["gemm"] == "fprop" and r["format"] == "nvfp4"}
        keys = [(b, r) for b in range(n_layers) for r in block_roles] + [(-1, "lm_head")]
        rho = spearman([s[key] for key in keys], [t[(*key, "nvfp4")] for key in keys])
        lines.append(
            f"* Over the {len(keys)} Linears, the rank correlation of nvfp4's fprop SQNR with its single-layer drop is "
            f"{rho:+.2f} (Spearman; -1 would mean a lower SQNR always costs more)."
        )
    lines += [
        "",
        "### Single-layer drop (eval-loss rise, 1e-3 nats/byte): the block's four Linears, mean (largest)",
        "",
        "| block | " + " | ".join(DROP_FORMATS) + " |",
        "|---|" + "---|" * len(DROP_FORMATS),
    ]
    for b in range(n_layers):
        cells = []
        for fname in DROP_FORMATS:
            vals = [1e3 * t[(b, r, fname)] for r in block_roles]
            cells.append(f"{_mean(vals):.2f} ({max(vals):.2f})")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines.append("| lm_head | " + " | ".join(f"{1e3 * t[(-1, 'lm_head', f)]:.2f}" for f in DROP_FORMATS) + " |")
    lines.append("| all Linears | " + " | ".join(f"{1e3 * t[(-2, 'all', f)]:.2f}" for f in DROP_FORMATS) + " |")
    lines += ["", "Every layer's number: drop.csv (layer, block, role, format, eval_loss, drop).", ""]
    return "\n".join(lines)
