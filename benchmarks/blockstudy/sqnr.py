"""Phase 1 (`--part sqnr`, CPU, about a minute once the weights are cached): the per-GEMM SQNR by block depth.

    python benchmarks/block_study.py --part sqnr --out results/cpu-epyc-bf16-2core/block-study

The `mini` GPT-2 example (examples/gpt2/model.py, AUTOPREC_GPT2_SIZE=mini: GPT-2-small's 12 pre-norm blocks and tied
head, 128 wide), with its trained fp32 weights, runs one training step's worth of real data (--batches train batches,
forward and backward in fp32); hooks capture every nn.Linear's input x, weight W and output gradient g. For each
Linear and each of its three GEMMs (fprop x @ W^T contracting K, dgrad g @ W contracting N, wgrad g^T @ x contracting
the tokens M) the SQNR of the product with both operands quantised and dequantised, against the fp32 product, in each
format of FORMATS. Writes sqnr.csv, sqnr_by_depth.png and its section of summary.md.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from autoprec.formats.mx import blockscaled_linear

from .common import (
    FORMATS,
    GEMMS,
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


def reference_products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three GEMMs of out = x @ W^T in fp32: x [M, K], W [N, K], g = d loss / d out [M, N]."""
    x, w, g = x.float(), w.float(), g.float()
    return {"fprop": x @ w.t(), "dgrad": g @ w, "wgrad": g.t() @ x}


def quantized_products(x, w, g, fmt, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The three GEMMs with both operands of each quantised and dequantised in `fmt`, multiplied in fp32.

    Block-scaled formats (MXFP8, NVFP4) go through autoprec's own emulated linear, `blockscaled_linear`, with `fmt`
    on all three GEMMs: its forward is fprop, and its backward, fed `g`, returns dgrad (grad of x) and wgrad
    (grad of W), each operand blocked along that GEMM's contraction dimension (docs/block-scaled.md)."""
    x, w, g = x.float(), w.float(), g.float()
    if isinstance(fmt, Float8Tensorwise):
        xq, wq, gq = fmt.quantize(x, "activation"), fmt.quantize(w, "weight"), fmt.quantize(g, "gradient")
        return {"fprop": xq @ wq.t(), "dgrad": gq @ wq, "wgrad": gq.t() @ xq}
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.enable_grad():
        out = blockscaled_linear(xr, wr, None, fprop=fmt, dgrad=fmt, wgrad=fmt, generator=generator)
        dgrad, wgrad = torch.autograd.grad(out, (xr, wr), g)
    return {"fprop": out.detach(), "dgrad": dgrad, "wgrad": wgrad}


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(|ref|^2 / |ref - q|^2) from the two sums of squares; inf when the product is exact."""
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise)


def energies(ref: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """(|ref|^2, |ref - q|^2), summed in fp64."""
    ref, q = ref.double(), q.double()
    return float((ref * ref).sum()), float(((ref - q) ** 2).sum())


def gemm_sqnr(x, w, g, fmt, generator=None) -> dict[str, float]:
    """The SQNR (dB) of each GEMM of one linear layer in `fmt` against fp32."""
    ref, q = reference_products(x, w, g), quantized_products(x, w, g, fmt, generator)
    return {gemm: sqnr_db(*energies(ref[gemm], q[gemm])) for gemm in GEMMS}


def capture(model: nn.Module, loss_fn, batches) -> dict[str, dict]:
    """Run each batch forward and backward in fp32 with hooks on every nn.Linear; per layer its weight and, per
    batch, the input x [M, K] and the output gradient g [M, N] (tokens flattened)."""
    records: dict[str, dict] = {}
    handles = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        rec = records[name] = {"weight": mod.weight.detach().float().clone(), "x": [], "g": []}

        def hook(mod, args, out, rec=rec):
            rec["x"].append(args[0].detach().reshape(-1, mod.in_features).float().clone())
            out.register_hook(lambda g: rec["g"].append(g.detach().reshape(-1, mod.out_features).float().clone()))

        handles.append(mod.register_forward_hook(hook))
    try:
        model.train()
        for batch in batches:
            model.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
        model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    return records


def run(args) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    example = load_example(args.size)
    start = time.perf_counter()
    model = example.build_model()
    build_s = time.perf_counter() - start
    train = example.batches("train")[: args.batches]
    evals = example.batches("eval")
    with torch.no_grad():
        eval_loss = sum(example.loss_fn(model.eval(), b).item() for b in evals) / len(evals)
    records = capture(model, example.loss_fn, train)
    rows = []
    start = time.perf_counter()
    for li, (name, rec) in enumerate(records.items()):
        block, role = layer_role(name)
        for fi, (fname, fmt) in enumerate(FORMATS.items()):
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + li * 101 + fi)  # per layer and format
            sig, noise = defaultdict(float), defaultdict(float)
            for x, g in zip(rec["x"], rec["g"], strict=True):  # batch by batch: each backward follows its forward
                ref, q = reference_products(x, rec["weight"], g), quantized_products(x, rec["weight"], g, fmt, gen)
                for gemm in GEMMS:
                    s, n = energies(ref[gemm], q[gemm])
                    sig[gemm] += s
                    noise[gemm] += n
            for gemm in GEMMS:
                rows.append(
                    {
                        "layer": name,
                        "block": block,
                        "role": role,
                        "gemm": gemm,
                        "format": fname,
                        "sqnr_db": round(sqnr_db(sig[gemm], noise[gemm]), 3),
                    }
                )
    sqnr_s = time.perf_counter() - start
    write_csv(out / "sqnr.csv", rows)
    n_layers = len(model.h)
    plot_sqnr(rows, n_layers, out / "sqnr_by_depth.png", args.size)
    info = {
        "size": args.size,
        "params": sum(p.numel() for p in model.parameters()),
        "hparams": example.HPARAMS,
        "eval_loss": eval_loss,
        "build_s": build_s,
        "sqnr_s": sqnr_s,
        "tokens": sum(int(x.shape[0]) for x in next(iter(records.values()))["x"]),
        "batches": len(train),
    }
    update_summary(out, "sqnr", summary(rows, n_layers, info, args))
    print(f"wrote {out / 'sqnr.csv'} ({len(rows)} rows), sqnr_by_depth.png, summary.md in {sqnr_s:.0f} s")


def plot_sqnr(rows, n_layers: int, path: Path, size: str) -> None:
    """A grid: rows the three GEMMs, columns the four block roles and the LM head; x block depth, one line per
    format; each GEMM row shares its y axis, so the panels of a row compare at a glance."""
    plt = _pyplot()

    colors = dict(zip(FORMATS, ("#1b9e77", "#7570b3", "#d95f02", "#e7298a", "#66a61e"), strict=True))
    styles = {"nvfp4-rht": (0, (4, 2)), "nvfp4-rht-sr": (0, (1, 1.5))}
    fig, axes = plt.subplots(
        len(GEMMS), len(ROLES), figsize=(17, 10), sharey="row", gridspec_kw={"width_ratios": [4, 4, 4, 4, 1]}
    )
    table = {(r["block"], r["role"], r["gemm"], r["format"]): r["sqnr_db"] for r in rows}
    for i, gemm in enumerate(GEMMS):
        for j, role in enumerate(ROLES):
            ax = axes[i, j]
            blocks = [-1] if role == "lm_head" else list(range(n_layers))
            for k, fname in enumerate(FORMATS):
                ys = [table[(b, role, gemm, fname)] for b in blocks]
                xs = [0.12 * (k - 2)] if role == "lm_head" else blocks  # the head's points side by side
                ax.plot(xs, ys, marker="o", ms=3.5, lw=1.6, color=colors[fname], ls=styles.get(fname, "-"), label=fname)
            if i == 0:
                ax.set_title(role)
            if j == 0:
                ax.set_ylabel(f"{gemm}\nSQNR (dB)")
            if role == "lm_head":
                ax.set_xticks([0], ["head"])
                ax.set_xlim(-0.6, 0.6)
            else:
                ax.set_xticks(range(0, n_layers, max(1, n_layers // 6)))
                if i == len(GEMMS) - 1:
                    ax.set_xlabel("block depth")
            ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="lower left", fontsize=8)
    fig.suptitle(
        f"Per-GEMM SQNR of every Linear of the GPT-2 example ({size}) by block depth: both operands quantised, "
        "against fp32 (higher is better)"
    )
    _save(fig, path)


def summary(rows, n_layers: int, info: dict, args) -> str:
    block_rows = [r for r in rows if r["block"] >= 0]
    by = defaultdict(list)
    for r in block_rows:
        by[(r["block"], r["gemm"], r["format"])].append(r["sqnr_db"])
    head = {(r["gemm"], r["format"]): r["sqnr_db"] for r in rows if r["role"] == "lm_head"}
    h = info["hparams"]
    lines = [
        "## Per-GEMM SQNR by block depth (`--part sqnr`)",
        "",
        "Command (from the repository root):",
        "",
        f"    python benchmarks/block_study.py --part sqnr --size {args.size} --batches {args.batches} "
        f"--seed {args.seed} --out {_rel(args.out)}",
        "",
        "Numbers only (no timings): they do not depend on the machine beyond fp32 summation order.",
        "",
        f"Model: examples/gpt2/model.py, AUTOPREC_GPT2_SIZE={info['size']}: {len(_blocks(rows))} blocks, d_model "
        f"{h['d_model']}, {h['n_heads']} heads, seq_len {h['seq_len']}, tied head, {info['params'] / 1e6:.2f}M "
        f"parameters, trained {h['steps']} steps (cached weights; eval loss {info['eval_loss']:.3f} nats/byte, "
        f"ln 256 = 5.545 untrained). Data: {info['batches']} train batches, {info['tokens']} tokens, forward and "
        "backward in fp32; each GEMM's SQNR pools the error energy of the batches: 10 log10(sum |ref|^2 / sum "
        "|ref - q|^2).",
        "",
        "Formats (all three GEMMs in the same one): `fp8-tensorwise` torchao's tensorwise recipe (per-tensor dynamic "
        "scales; x and W e4m3, gradients e5m2); `mxfp8` E4M3, 1x32 blocks, rceil E8M0 scales; `nvfp4` 1x16 blocks "
        "(16x16 weight tiles), per-tensor second scale, round-to-nearest, no RHT; `nvfp4-rht` adds the 16x16 random "
        "Hadamard transform to the wgrad operands; `nvfp4-rht-sr` also rounds gradients stochastically (NVIDIA's "
        "recipe; one seeded draw). fprop has no gradient operand and no RHT, so its three NVFP4 variants coincide.",
        "",
        "![SQNR by depth](sqnr_by_depth.png)",
        "",
    ]
    lines += findings(rows, n_layers)
    for gemm in GEMMS:
        lines += [
            "",
            f"### {gemm}: SQNR (dB), mean over the block's four Linears (worst of the four)",
            "",
            "| block | " + " | ".join(FORMATS) + " |",
            "|---|" + "---|" * len(FORMATS),
        ]
        for b in range(n_layers):
            cells = [f"{_mean(by[(b, gemm, f)]):.1f} ({min(by[(b, gemm, f)]):.1f})" for f in FORMATS]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("| lm_head | " + " | ".join(f"{head[(gemm, f)]:.1f}" for f in FORMATS) + " |")
    lines += ["", "Every layer's number: sqnr.csv (layer, block, role, gemm, format, sqnr_db).", ""]
    return "\n".join(lines)


def _blocks(rows) -> set[int]:
    return {r["block"] for r in rows if r["block"] >= 0}


def findings(rows, n_layers: int) -> list[str]:
    """Plain sentences computed from the numbers, so that a rerun keeps them true."""
    t = {(r["block"], r["role"], r["gemm"], r["format"]): r["sqnr_db"] for r in rows}
    blocks = sorted(_blocks(rows))
    third = max(1, n_layers // 4)
    first, last = blocks[:third], blocks[-third:]
    block_roles = ROLES[:-1]

    def avg(bs, gemm, fmt, roles=block_roles):
        return _mean(t[(b, r, gemm, fmt)] for b in bs for r in roles)

    out = ["### Findings (computed from sqnr.csv)", ""]
    trend = []
    for gemm in GEMMS:
        deltas = [avg(last, gemm, f) - avg(first, gemm, f) for f in FORMATS]
        lo, hi = min(deltas), max(deltas)
        trend.append(f"{gemm} {lo:+.1f} dB" if f"{lo:+.1f}" == f"{hi:+.1f}" else f"{gemm} {lo:+.1f} to {hi:+.1f} dB")
    out.append(
        f"* Depth: the mean SQNR of the last {third} blocks minus that of the first {third} (the range over the "
        "formats): " + "; ".join(trend) + "."
    )
    shape = []
    for gemm in GEMMS:
        means = {b: avg((b,), gemm, "nvfp4") for b in blocks}
        lo, hi = min(means, key=means.get), max(means, key=means.get)
        shape.append(f"{gemm} {means[lo]:.1f} (block {lo}) to {means[hi]:.1f} (block {hi})")
    out.append("* nvfp4's per-block mean SQNR spans, by GEMM: " + "; ".join(shape) + " dB.")
    per_role = []
    for gemm in GEMMS:
        for role in block_roles:
            deltas = [avg(last, gemm, f, (role,)) - avg(first, gemm, f, (role,)) for f in FORMATS]
            per_role.append((abs(_mean(deltas)), gemm, role, _mean(deltas)))
    per_role.sort(reverse=True)
    out.append(
        "* The largest depth trends by role (mean over formats, last minus first blocks): "
        + "; ".join(f"{role} {gemm} {d:+.1f} dB" for _, gemm, role, d in per_role[:3])
        + "."
    )
    for fmt in ("nvfp4", "nvfp4-rht-sr"):
        means = sorted(
            ((avg(blocks, gemm, fmt, (role,)), role, gemm) for gemm in GEMMS for role in block_roles),
        )
        worst = min(((v, b, r, gm) for (b, r, gm, f), v in t.items() if f == fmt), key=lambda item: item[0])
        where = "lm_head" if worst[1] < 0 else f"block {worst[1]} {worst[2]}"
        out.append(
            f"* {fmt}: worst role x GEMM on average over the blocks {means[0][1]} {means[0][2]} ({means[0][0]:.1f} dB), "
            f"then {means[1][1]} {means[1][2]} ({means[1][0]:.1f} dB); best {means[-1][1]} {means[-1][2]} "
            f"({means[-1][0]:.1f} dB). Worst single GEMM: {where} {worst[3]} ({worst[0]:.1f} dB); lm_head "
            + ", ".join(f"{gm} {t[(-1, 'lm_head', gm, fmt)]:.1f}" for gm in GEMMS)
            + " dB."
        )
    layers = sorted({(b, r) for b, r, _, _ in t})
    rht = [t[(b, r, "wgrad", "nvfp4-rht")] - t[(b, r, "wgrad", "nvfp4")] for b, r in layers]
    sr = [t[(b, r, "wgrad", "nvfp4-rht-sr")] - t[(b, r, "wgrad", "nvfp4-rht")] for b, r in layers]
    sr_d = [t[(b, r, "dgrad", "nvfp4-rht-sr")] - t[(b, r, "dgrad", "nvfp4")] for b, r in layers]
    both = [t[(b, r, "wgrad", "nvfp4-rht-sr")] - t[(b, r, "wgrad", "nvfp4")] for b, r in layers]
    out.append(
        f"* wgrad, all {len(layers)} Linears: the RHT changes NVFP4's SQNR by {_mean(rht):+.2f} dB on average "
        f"({min(rht):+.2f} to {max(rht):+.2f}; better in {sum(d > 0 for d in rht)} of {len(rht)}); stochastic "
        f"rounding of the gradient then {_mean(sr):+.2f} dB ({min(sr):+.2f} to {max(sr):+.2f}); the recipe (both) "
        f"against plain NVFP4 {_mean(both):+.2f} dB. Stochastic rounding on dgrad: {_mean(sr_d):+.2f} dB. SQNR "
        "scores one draw's error energy: it cannot show that stochastic rounding is unbiased, which is what the "
        "recipe buys with it."
    )
    gaps = []
    for gemm in GEMMS:
        gaps.append(
            f"{gemm}: fp8-tensorwise {avg(blocks, gemm, 'fp8-tensorwise'):.1f}, mxfp8 {avg(blocks, gemm, 'mxfp8'):.1f}, "
            f"nvfp4 {avg(blocks, gemm, 'nvfp4'):.1f}"
        )
    out.append("* Mean over all block Linears (dB): " + "; ".join(gaps) + ".")
    return out
