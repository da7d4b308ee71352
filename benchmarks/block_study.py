"""Issue 41's study: which layers of a decoder LM tolerate which low-precision formats, by block depth.

One command per figure, each writing results/<device>/block-study/ (--out) with its own summary:

    python benchmarks/block_study.py --part sqnr --out results/cpu-epyc-bf16-2core/block-study   # phase 1

Phase 1 (`--part sqnr`, CPU, about a minute once the weights are cached): the `mini` GPT-2 example
(examples/gpt2/model.py, AUTOPREC_GPT2_SIZE=mini: GPT-2-small's 12 pre-norm blocks and tied head, 128 wide), with
its trained fp32 weights, runs one training step's worth of real data (--batches train batches, forward and
backward in fp32); hooks capture every nn.Linear's input x, weight W and output gradient g. For each Linear and
each of its three GEMMs (fprop x @ W^T contracting K, dgrad g @ W contracting N, wgrad g^T @ x contracting the
tokens M) the SQNR of the product with both operands quantised and dequantised, against the fp32 product, in each
format of FORMATS. Writes sqnr.csv, sqnr_by_depth.png and its section of summary.md.

    python benchmarks/block_study.py --part drop --out results/cpu-epyc-bf16-2core/block-study   # phase 1, metric

Each Linear alone with its forward GEMM in fp8 tensorwise, MXFP8 or NVFP4 (every other layer fp32): the eval-loss
rise (the example's metric drop), and every Linear at once. Writes drop.csv, drop_by_depth.png and its section of
summary.md (with the rank correlation against the SQNR when sqnr.csv is there).

Phase 2 (`--part search`): train-mode searches of the mini model with the FLOP goal on b200 (K = --steps train
steps, one search per --budgets value, layout --layout), each in search/budget-<b>[-<layout>]/ (with --tag:
search/budget-<b>-<layout>-<tag>/) with its policy.json; search.csv and its section of summary.md. The untagged
searches ran before autoprec's e97993f without the per-GEMM formats; `--tag postfix` ran after it, with them;
`--tag fallback` after the FLOP goal took bf16 as a list's fallback (no fp32 in the space) and priced its greedy start.

    python benchmarks/block_study.py --part search --out results/cpu-epyc-bf16-2core/block-study

Phase 3 (`--part horizon`): the anchors (bf16, NVFP4 everywhere), the hand rules (a)-(d) (rule_layers) and every
searched policy found under search/ (root set to bf16), each trained --horizon x K steps from the trained weights with
seeds 0..--seeds-1, the metric every K steps; each (policy, seed) run in horizon/<policy>-seed<s>.csv as it ends, a
rerun skipping the finished ones. Writes policies.csv, loss_curves.png, pareto.png and its section of summary.md.

    python benchmarks/block_study.py --part horizon --seeds 3 --out results/cpu-epyc-bf16-2core/block-study
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import math
import os
import platform
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's autoprec, whatever the working directory

from autoprec.formats.mx import MXFP8, NVFP4, blockscaled_linear  # noqa: E402

GPT2 = ROOT / "examples" / "gpt2" / "model.py"
DEFAULT_OUT = ROOT / "results" / "cpu-epyc-bf16-2core" / "block-study"
GEMMS = ("fprop", "dgrad", "wgrad")
ROLES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "lm_head")


@dataclass(frozen=True)
class Float8Tensorwise:
    """torchao's `tensorwise` float8 training recipe, emulated in plain torch: every operand scaled per tensor
    (dynamic: scale = max(dtype) / max(amax, 1e-12), computed in fp64 then rounded to fp32), multiplied, saturated to
    +-max(dtype), cast (round to nearest even) and divided by the scale again. Operand dtypes as torchao 0.18's
    Float8LinearConfig() (= from_recipe_name("tensorwise")) leaves them: input and weight float8_e4m3fn, grad_output
    float8_e5m2 (torchao/float8/config.py, Float8LinearConfig.__post_init__: the `default_dtype` of each operand).
    Per-tensor scaling makes each operand one tensor for both GEMMs it feeds, so no blocking dimension matters."""

    activation: torch.dtype = torch.float8_e4m3fn
    weight: torch.dtype = torch.float8_e4m3fn
    gradient: torch.dtype = torch.float8_e5m2

    def quantize(self, t: torch.Tensor, role: str) -> torch.Tensor:
        dtype = getattr(self, role)
        fmax = torch.finfo(dtype).max
        t = t.float()
        scale = (fmax / t.abs().amax().double().clamp(min=1e-12)).float()
        return (t * scale).clamp(-fmax, fmax).to(dtype).float() / scale


# name -> the format of all three GEMMs. MXFP8: E4M3 elements for all operands, rceil scales (Blackwell's cuBLAS /
# Transformer Engine rule). NVFP4: weights in 16x16 tiles and a dynamic per-tensor second-level scale throughout;
# `nvfp4` rounds everything to nearest and has no RHT, `nvfp4-rht` adds the 16x16 random Hadamard transform to the
# wgrad operands, `nvfp4-rht-sr` also rounds gradients stochastically (NVIDIA's training recipe, NVFP4()'s defaults).
FORMATS = {
    "fp8-tensorwise": Float8Tensorwise(),
    "mxfp8": MXFP8(),
    "nvfp4": NVFP4(stochastic_gradients=False, rht=False),
    "nvfp4-rht": NVFP4(stochastic_gradients=False),
    "nvfp4-rht-sr": NVFP4(),
}


def _pyplot():
    """matplotlib's pyplot on the file-only backend (no display on a server), imported when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """Lay the figure out, write it to `path` and free it: every figure of the study the same way."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def load_example(size: str):
    """examples/gpt2/model.py imported with AUTOPREC_GPT2_SIZE=size (the module reads it on import)."""
    old = os.environ.get("AUTOPREC_GPT2_SIZE")
    os.environ["AUTOPREC_GPT2_SIZE"] = size
    try:
        spec = importlib.util.spec_from_file_location(f"gpt2_example_{size}", GPT2)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["AUTOPREC_GPT2_SIZE"]
        else:
            os.environ["AUTOPREC_GPT2_SIZE"] = old
    return module


def layer_role(name: str) -> tuple[int, str]:
    """(block index, role) of a Linear of the GPT example: h.3.attn.c_attn -> (3, attn.c_attn); the MLP's Linears
    sit on the block itself (h.3.c_fc, h.3.c_proj); lm_head -> (-1, lm_head)."""
    parts = name.split(".")
    if parts[0] == "h":
        rest = ".".join(parts[2:])
        return int(parts[1]), rest if rest.startswith("attn.") else f"mlp.{rest}"
    return -1, name


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


def part_sqnr(args) -> None:
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
    with open(out / "sqnr.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
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


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


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


def part_drop(args) -> None:
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
    with open(out / "drop.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
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


def update_summary(out: Path, part: str, section: str) -> None:
    """summary.md holds one section per part, in PARTS order; a part rewrites its own and keeps the others."""
    path = out / "summary.md"
    sections = {}
    if path.exists():
        for m in re.finditer(r"<!-- part:(\w+) -->\n(.*?)<!-- /part:\1 -->\n", path.read_text(), re.DOTALL):
            sections[m.group(1)] = m.group(2)
    sections[part] = section.rstrip("\n") + "\n"
    text = [
        "# Block study (issue 41): which layers tolerate which low-precision formats, by block depth",
        "",
        f"CPU: {_cpu()}; torch threads: {torch.get_num_threads()}; torch {torch.__version__}, python "
        f"{platform.python_version()}. Each section below says the command that wrote it; docs/block-study.md "
        "explains the study.",
        "",
    ]
    for name in PARTS:
        if name in sections:
            text += [f"<!-- part:{name} -->", sections[name] + f"<!-- /part:{name} -->", ""]
    path.write_text("\n".join(text))


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------------------------------------------
# Phases 2 and 3: train-mode searches with the FLOP goal (`--part search`) against the hand rules, and every policy's
# loss curve over 10x the search's train steps with seeds (`--part horizon`).

BF16_KEPT_SHARE = 0.15  # rule (a): torchtitan's "last ~15% of blocks" kept in high precision
# The space's Linear formats (fp32 is the space's required fallback): the uniform ones and the per-GEMM mixes that
# keep the weight gradient (and for *-fwd-dgrad nothing else) in the autocast around the layer. Before autoprec's
# e97993f the FLOP estimate priced such a high-precision GEMM at fp32 even under a bf16 root, so the first searches
# (tag "", OLD_SEARCH_FORMATS) left the mixes out; the --tag postfix searches have them.
SEARCH_FORMATS = ("fp32", "bf16", "mxfp8", "mxfp8-fwd-dgrad", "nvfp4", "nvfp4-fwd-dgrad", "mxfp8-fwd-nvfp4-dgrad")
OLD_SEARCH_FORMATS = ("fp32", "bf16", "mxfp8", "nvfp4")
# The --tag fallback searches ran after autoprec let a FLOP goal's lists keep bf16 instead of fp32 (Goal.fallbacks) and
# priced the greedy start by the goal (the target's GEMM time): no list holds fp32 (which the estimate prices at 30x
# bf16's time), the root is bf16 already (bf16_root leaves it so), the low formats are the postfix searches'.
FALLBACK_TAGS = ("fallback",)
TAG_TEXT = {
    "": "before e97993f (HP GEMMs priced at fp32)",
    "postfix": "after e97993f (HP GEMMs in the autocast)",
    "fallback": "bf16 fallback, goal-priced greedy start (no fp32 in the space)",
}
HIGH = ("fp32", "tf32", "bf16", "fp16")  # GEMM element formats that are not low precision


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def last_blocks(n_blocks: int, share: float = BF16_KEPT_SHARE) -> list[int]:
    """The last `share` of the blocks: max(1, round(share * n)) of them (12 blocks: round(1.8) = 2, blocks 10-11)."""
    k = max(1, round(share * n_blocks))
    return list(range(n_blocks - k, n_blocks))


def rule_layers(names: list[str], n_blocks: int) -> dict[str, dict[str, str]]:
    """Each hand rule as {Linear name: low format} (every Linear not listed stays in the bf16 root):
    (a) the last 15% of blocks and the head in bf16, the rest NVFP4; (b) the first and the last block in bf16, the rest
    NVFP4 (the head too: the rule names blocks only); (c) everything NVFP4 but the head; (d) the MLP's Linears NVFP4,
    attention's MXFP8, the head bf16."""
    kept_a = set(last_blocks(n_blocks))
    rules: dict[str, dict[str, str]] = {"rule-a": {}, "rule-b": {}, "rule-c": {}, "rule-d": {}}
    for name in names:
        block, role = layer_role(name)
        if block < 0:  # the head
            rules["rule-b"][name] = "nvfp4"
            continue
        if block not in kept_a:
            rules["rule-a"][name] = "nvfp4"
        if block not in (0, n_blocks - 1):
            rules["rule-b"][name] = "nvfp4"
        rules["rule-c"][name] = "nvfp4"
        rules["rule-d"][name] = "mxfp8" if role.startswith("attn.") else "nvfp4"
    return rules


RULE_TEXT = {
    "bf16": "every Linear bf16 (the baseline)",
    "nvfp4-all": "every Linear NVFP4 (where the format takes its shape), the rest bf16",
    "rule-a": "last 15% of blocks and the head bf16, rest NVFP4",
    "rule-b": "first and last block bf16, rest NVFP4 (head included)",
    "rule-c": "everything NVFP4 but the head",
    "rule-d": "MLP NVFP4, attention MXFP8, head bf16",
}


def study_policies(model: nn.Module, device="cpu") -> dict[str, object]:
    """The anchors (uniform bf16, NVFP4 on every Linear that takes it) and the rules (a)-(d), as autoprec Policies
    with a bf16 root; a Linear whose shape a format refuses (format_problem) stays bf16."""
    from autoprec.formats import Format, format_problem, parse_format
    from autoprec.policy import Policy

    modules = dict(model.named_modules())
    names = linear_names(model)
    sets = {"bf16": {}, "nvfp4-all": dict.fromkeys(names, "nvfp4"), **rule_layers(names, len(model.h))}
    out = {}
    for label, layers in sets.items():
        ok = {n: parse_format(f) for n, f in layers.items() if format_problem(parse_format(f), modules[n], device) is None}
        out[label] = Policy(layers={"": Format.BF16, **ok})
    return out


def flops_table(model: nn.Module, tokens: int):
    """Profile rows with what gemm_flops reads (layer, type, shape "out x in", tokens) for every Linear of `model`,
    each called on `tokens` rows a training step (an fp32 row each: nothing else is measured)."""
    from autoprec.tune._profile_data import ProfileRow

    return [
        ProfileRow(
            layer=n,
            type=type(m).__name__,
            shape=f"{m.out_features}x{m.in_features}",
            tokens=float(tokens),
            format="fp32",
            status="ok",
        )
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]


def gemm_share(policy, flops: dict[str, float]) -> dict[str, float]:
    """The FLOP-weighted share of the Linears' GEMMs (three per Linear, each 2 x tokens x in x out) in each element
    format under `policy`, and `low` the share in a format below bf16 (fp8, mxfp8, nvfp4)."""
    from autoprec.tune._flops import format_of, gemm_precisions, outer_autocast

    by: dict[str, float] = defaultdict(float)
    for name, work in flops.items():
        # a per-GEMM mix's high-precision GEMMs run in the autocast around the layer (bf16 under a bf16 root)
        for precision in gemm_precisions(format_of(name, policy.layers), outer_autocast(name, policy.layers)):
            by[precision] += work
    total = sum(by.values())
    share = {p: v / total for p, v in by.items()}
    share["low"] = sum(v for p, v in share.items() if p not in HIGH)
    return share


def gpt2_workload(size: str):
    """The example's trained model as an autoprec Workload on the CPU (its train and eval batches, its loss)."""
    from autoprec.tune import prepare
    from autoprec.tune._api import task_from_objects

    example = load_example(size)
    model = example.build_model()
    task = task_from_objects(model, example.loss_fn, example.batches("train"), example.batches("eval"), name=f"gpt2-{size}")
    return example, prepare(task, "cpu")


def search_formats(tag: str = "") -> tuple[str, ...]:
    """The Linear formats of a search: the first (untagged) searches had no per-GEMM mixes; the fallback ones have no
    fp32 (bf16 is their lists' fallback)."""
    if not tag:
        return OLD_SEARCH_FORMATS
    if tag in FALLBACK_TAGS:
        return tuple(f for f in SEARCH_FORMATS if f != "fp32")
    return SEARCH_FORMATS


def search_space(layout: str, trials: int, tag: str = "postfix"):
    from autoprec.tune._space import space_from_dict

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


def searched_label(folder: Path) -> str:
    """search/budget-0.04-grouped -> searched-0.04-grouped."""
    return "searched-" + folder.name.split("-", 1)[1]


def label_tag(label: str) -> str:
    """searched-0.04-grouped-postfix -> postfix; searched-0.04-grouped, searched-0.04 -> ''."""
    parts = label.split("-")
    return parts[3] if len(parts) > 3 else ""


def searched_text(label: str) -> str:
    layout = label.split("-")[2] if label.count("-") > 1 else "ranked"
    root = "root bf16 as searched" if label_tag(label) in FALLBACK_TAGS else "root set to bf16"
    return (
        f"searched ({layout}), budget {label_budget(label):g} at K steps vs fp32; {root}; "
        f"{TAG_TEXT.get(label_tag(label), label_tag(label))}"
    )


def label_budget(label: str) -> float:
    """searched-0.04-grouped -> 0.04."""
    return float(label.split("-")[1])


def part_search(args) -> None:
    """Train-mode searches (K steps, the FLOP goal on b200) at each budget, each in its own folder under search/."""
    import optuna

    import autoprec.tune
    from autoprec.tune._flops import estimated_speedup, gemm_flops
    from autoprec.tune._targets import target_named

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
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    update_summary(out, "search", search_summary(rows, args))
    print(f"wrote {path}, the policies under {_rel(out / 'search')}, summary.md")


def _chosen_name(result) -> str | None:
    from autoprec.tune._records import Measured

    measured = Measured.of(result.policy)
    return getattr(measured, "chosen", None) or (result.policy.measured or {}).get("chosen")


def _format_counts(policy, flops: dict[str, float]) -> str:
    from autoprec.tune._flops import format_of

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


def run_path(folder: Path, policy: str, seed: int) -> Path:
    return folder / f"{policy}-seed{seed}.csv"


def finished(path: Path, steps: int) -> bool:
    """A run is finished when its csv exists and reached `steps` (written whole, by rename, when it ended)."""
    if not path.exists():
        return False
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return bool(rows) and int(rows[-1]["step"]) >= steps


def train_curve(workload, policy, steps: int, every: int, seed: int, order=None, at=None) -> list[dict]:
    """Train a fresh copy of the reference weights `steps` steps with `policy` as train mode does
    (autoprec.tune._metric.train_and_evaluate: the same Trainer, batch order and seed), taking the metric every `every`
    steps (and at step 0). The model has no dropout and evaluating draws nothing from the RNG, so the metric at step K
    is train_and_evaluate(workload, policy, K, seed=seed)'s. `order` replaces train mode's batch order (horizon2: each
    batch once, in turn); `at`, the steps the metric is taken at, replaces `every`."""
    from autoprec import devices
    from autoprec.tune._metric import batch_order, metric_of
    from autoprec.tune._trainer import Trainer, matmul_precision

    rows = []
    start = time.perf_counter()
    with devices.lookup(workload.device).fork_rng(workload.device):
        torch.manual_seed(seed)
        order = batch_order(len(workload.train), steps, seed) if order is None else order
        trainer = Trainer(workload, policy, order=order)
        take = set(at) if at is not None else {s for s in range(steps + 1) if s % every == 0 or s == steps}
        for step in range(steps + 1):
            if step in take:
                finite = trainer.finite
                with matmul_precision(workload.device, trainer.tf32):
                    metric = metric_of(workload, trainer.model) if finite else math.nan
                rows.append(
                    {"step": step, "metric": metric, "finite": finite, "skipped": trainer.skipped,
                     "wall_s": round(time.perf_counter() - start, 2)}
                )  # fmt: skip
            if step < steps:
                trainer.step()
    return rows


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


def write_run(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def read_run(path: Path) -> dict[int, float]:
    with open(path) as f:
        return {int(r["step"]): float(r["metric"]) for r in csv.DictReader(f)}


def all_policies(model: nn.Module, out: Path) -> dict[str, object]:
    """The anchors and rules, then each searched policy found under out/search/ (by budget)."""
    from autoprec.policy import load_policy

    found = study_policies(model)
    folders = sorted((out / "search").glob("budget-*"), key=lambda p: (p.name.count("-"), float(p.name.split("-")[1])))
    for folder in folders:
        if (folder / "policy.json").exists():
            found[searched_label(folder)] = bf16_root(load_policy(folder / "policy.json"))
    return found


def bf16_root(policy):
    """The policy with its model root in bf16 and every Linear as the search chose it. The untagged and postfix
    searches' root list had to hold fp32 (then autoprec's fallback), and the FLOP goal counts Linears only, so the root
    a FLOP search settles on is whatever the sampler drew; every policy of this study runs its norms, softmax and
    attention matmuls in bf16, so the searched ones do too (their Linears, all the goal counts, unchanged). The
    fallback searches' root is bf16 already (their root list holds only bf16): for them this changes nothing."""
    from autoprec.formats import Format
    from autoprec.policy import ROOT, Policy

    return Policy(layers={**policy.layers, ROOT: Format.BF16}, loss_scale=policy.loss_scale)


def part_horizon(args) -> None:
    """Every policy trained 10 x K steps from the same weights with seeds 0..S-1, the metric every K steps; each
    (policy, seed) run in its own csv under horizon/, skipped when already finished."""
    from autoprec.tune._flops import estimated_speedup, gemm_flops
    from autoprec.tune._targets import target_named

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
        with open(out / "policies.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
        curves = load_curves(policies, folder, args.seeds, steps)
        plot_curves(curves, args, out / "loss_curves.png")
        plot_pareto(table, args, out / "pareto.png")
        update_summary(out, "horizon", horizon_summary(table, curves, args, steps))
    print(f"horizon: {spent:.0f} s of training this run; wrote policies.csv, loss_curves.png, pareto.png, summary.md")


def load_curves(policies, folder: Path, seeds: int, steps: int) -> dict[str, dict[int, dict[int, float]]]:
    """{policy: {seed: {step: metric}}} for the finished runs."""
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for name in policies:
        for seed in range(seeds):
            path = run_path(folder, name, seed)
            if finished(path, steps):
                curves.setdefault(name, {})[seed] = read_run(path)
    return curves


def noise_floor_at(curves, step: int) -> float:
    """The spread (max - min) of bf16's metric at `step` over its seeds: what a drop must exceed to be told from the
    batch order alone (train mode's noise floor, taken against bf16 here and without the repeat of seed 0, which on
    this CPU reproduces seed 0 bit for bit)."""
    values = [run[step] for run in curves.get("bf16", {}).values() if step in run]
    return max(values) - min(values) if len(values) > 1 else math.nan


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


COLORS = {"nvfp4-all": "#d95f02", "rule-a": "#1b9e77", "rule-b": "#7570b3", "rule-c": "#e7298a", "rule-d": "#66a61e"}


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
        "FLOP-weighted over the Linears' three GEMMs (autoprec.tune._flops.gemm_flops; est. speedup: the FLOP goal's "
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


# ---------------------------------------------------------------------------------------------------------------------
# Phase 3, second attempt (`--part horizon2`): the first horizon runs cycled the example's 4 fixed train batches and
# evaluated on its 4 eval batches, so over 50 steps the model overfit and bf16's own spread over the seeds outgrew
# the budgets. Here every step takes a batch of windows not taken before in the run (a seed's own draw from the
# example's train split, the same for every policy), the metric is taken on 16 eval batches of the eval split, and a
# drop is judged paired: seed by seed against bf16 trained on the same stream, then a t interval over the seeds.

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


def part_horizon2(args) -> None:
    """Every policy trained 10 x K steps on fresh windows per seed, judged paired against bf16 (see above)."""
    from autoprec.tune._flops import estimated_speedup, gemm_flops
    from autoprec.tune._targets import target_named

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
        with open(out / "policies2.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in table for k in r)), restval="")
            writer.writeheader()
            writer.writerows(table)
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
            row |= {
                f"seeds_{tag}": st["n"],
                f"drop_{tag}_mean": round(st["mean"], 6),
                f"drop_{tag}_ci_lo": round(st["lo"], 6),
                f"drop_{tag}_ci_hi": round(st["hi"], 6),
                f"drop_{tag}_half_width": round(st["half"], 6),
                f"drop_{tag}_by_seed": " ".join(f"{v:.5f}" for v in d),
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


# summary.md's sections in this order: the second horizon attempt before the first, retired one
PARTS = {"sqnr": part_sqnr, "drop": part_drop, "search": part_search, "horizon2": part_horizon2, "horizon": part_horizon}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=sorted(PARTS), help="which figure to make")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {_rel(DEFAULT_OUT)})")
    parser.add_argument("--size", default="mini", help="AUTOPREC_GPT2_SIZE of the GPT-2 example (default: mini)")
    parser.add_argument("--batches", type=int, default=4, help="train batches run through the model (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seeds stochastic rounding (default: 0)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core machine two threads ran a mini training step 4x slower)",
    )
    parser.add_argument("--steps", type=int, default=5, help="search, horizon: K, train mode's steps (default: 5)")
    parser.add_argument(
        "--budgets",
        type=lambda v: [float(b) for b in v.split(",")],
        default=[0.015, 0.04],
        help="search: the budgets, comma-separated, metric units (default: 0.015,0.04: 2x and 5x the "
        "noise floor of 0.0075 measured at K = 5); each budget is its own search, a rerun of some keeps the others' rows",
    )
    parser.add_argument("--trials", type=int, default=60, help="search: trials per budget (default: 60; a trial costs ~3 s)")
    parser.add_argument("--layout", default="ranked", help="search: the space's layout (default: ranked)")
    parser.add_argument(
        "--tag",
        default="",
        help="search: a suffix for the folders and labels (search/budget-<b>-<layout>-<tag>/); a tag's space has the "
        "per-GEMM formats (postfix: searched after autoprec's e97993f; fallback: bf16 in place of fp32, root bf16, after "
        "the FLOP goal took bf16 as its fallback; untagged: the first searches, without them)",
    )
    parser.add_argument("--noise-runs", type=int, default=2, help="search: train mode's fp32 seeds (default: 2)")
    parser.add_argument("--search-seconds", type=float, default=480, help="search: time_budget per budget (default 480)")
    parser.add_argument("--horizon", type=int, default=10, help="horizon: the long run in multiples of K (default 10)")
    parser.add_argument("--seeds", type=int, default=2, help="horizon: seeds per policy (default: 2)")
    parser.add_argument(
        "--only",
        type=lambda v: v.split(","),
        default=None,
        help="horizon: run only these policies (and bf16) now; the table covers every finished run",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="horizon2: take the metric every this many steps, besides 0, K and the last (default: K)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="horizon2: run nothing, write the table from the finished runs"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    PARTS[args.part](args)


if __name__ == "__main__":
    main()
