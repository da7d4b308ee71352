"""Re-pricing (`--part reprice`): every policy the study reports, priced by autoprec's step-time predictor against
uniform bf16 on a B200, at the study's own width and at a real one. Trains nothing and needs no device: the models are
built on the meta device for their shapes.

    python benchmarks/block_study.py --part reprice --out results/cpu-epyc-bf16-2core/block-study

The study's "est." speedups are the FLOP goal's peak-rate ratio of the Linears' GEMMs alone (`estimated_speedup`), for
a 128-wide model. The predictor also prices the casts, launches, attention, elementwise ops and the optimizer
(docs/planning.md). Each policy is priced twice: on the study's model (its width, its batch of sequences) and on the
same layer pattern at REAL_WIDTH (the same module names and depth, so every policy applies unchanged; the FFN 4x wide as
in the example), with REAL_SEQ-long sequences of the study's batch, so that the Linears' GEMMs are most of a bf16 step.
Writes reprice.csv and its section of summary.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .common import _rel, load_example, update_summary, write_csv
from .horizon2 import same_as
from .policies import RULE_TEXT, all_policies, flops_table, searched_text

REAL_WIDTH = 2048  # d_model of the real-width pattern (FFN 4 x 2048 = 8192, as the example builds it)
REAL_HEADS = 16  # head dim 128, as the example's 2048-wide `1b` size has it
REAL_SEQ = 1024  # tokens per sequence at the real width; the study's batch of sequences kept
TARGET = "b200"


def step_of(example, hparams: dict, batch: int, seq: int):
    """The predictor's Step of one training step of the example's GPT built with `hparams`, on the meta device, for a
    batch of `batch` sequences of `seq` tokens."""
    from autoprec.tune._measure._step_shapes import trace_step

    with torch.device("meta"):
        model = example.GPT({**hparams, "seq_len": seq})
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return trace_step(model, lambda: example.loss_fn(model, (ids, ids)))


def repriced_policies(model, out: Path) -> dict[str, object]:
    """bf16 and fp32 (the references), then the anchors, rules and searched policies as the study rebuilds them
    (all_policies: every search under out/search/, its root bf16)."""
    from autoprec.formats import Format
    from autoprec.policy import Policy

    found = all_policies(model, out)
    return {"bf16": found.pop("bf16"), "fp32": Policy(layers={"": Format.FP32}), **found}


def reprice_table(policies: dict, study, real, flops, target) -> list[dict]:
    from autoprec.tune._decide._flops import estimated_speedup
    from autoprec.tune._measure._predict import regime_band, speedup

    twins = same_as(policies)
    rows = []
    for name, policy in policies.items():
        rule = RULE_TEXT.get(name) or ("every Linear fp32 (the reference)" if name == "fp32" else searched_text(name))
        rows.append(
            {
                "policy": name,
                "rule": rule,
                "same_as": twins.get(name, ""),
                "est_peak_flop_speedup": round(estimated_speedup(policy, flops, target), 4),
                "predicted_study_width": round(speedup(study, policy, target), 4),
                f"predicted_width_{REAL_WIDTH}": round(speedup(real, policy, target), 4),
                # the band of its regime at the real width (none: outside the validated range)
                f"band_width_{REAL_WIDTH}": regime_band(real, policy).error,
            }
        )
    return rows


def run(args) -> None:
    """Each policy's peak-FLOP estimate and its predicted speedups at the study's width and at REAL_WIDTH."""
    from autoprec.tune._core._targets import target_named
    from autoprec.tune._decide._flops import gemm_flops

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    example = load_example(args.size)
    h = example.HPARAMS
    model = example.GPT()  # untrained: the policies need only its module names and shapes
    target = target_named(TARGET)
    tokens = int(h["batch"] * h["seq_len"])
    flops = gemm_flops(flops_table(model, tokens))
    study = step_of(example, h, h["batch"], h["seq_len"])
    wide = {**h, "d_model": REAL_WIDTH, "n_heads": REAL_HEADS}
    real = step_of(example, wide, h["batch"], REAL_SEQ)
    narrow_tokens = step_of(example, wide, h["batch"], h["seq_len"])  # the real width at the study's tokens, for the text
    table = reprice_table(repriced_policies(model, out), study, real, flops, target)
    write_csv(out / "reprice.csv", table)
    update_summary(out, "reprice", reprice_summary(table, args, h, study, real, narrow_tokens, target))
    print("reprice: wrote reprice.csv, summary.md")


def _parts(step, target) -> tuple[float, dict[str, float]]:
    from autoprec.tune._measure._predict import baseline, predict

    p = predict(step, baseline(), target)
    return p.ms, {k: v / p.ms for k, v in p.parts.items()}


def _nvfp4(step, target) -> str:
    """NVFP4 everywhere against uniform bf16 on `step`, in words: what its GEMMs save and what its casts cost."""
    from autoprec.tune._measure._predict import baseline, predict, uniform

    base, mine = predict(step, baseline(), target).parts, predict(step, uniform("nvfp4", step), target).parts
    return (
        f"NVFP4 everywhere takes the GEMMs from {base['gemms']:.3g} to {mine['gemms']:.3g} ms and adds "
        f"{mine['casts']:.3g} ms of casts"
    )


def reprice_summary(table, args, h, study, real, narrow_tokens, target) -> str:
    from autoprec.tune._measure._predict import regime_band, speedup, uniform

    col = f"predicted_width_{REAL_WIDTH}"
    s_ms, s_parts = _parts(study, target)
    r_ms, r_parts = _parts(real, target)
    n_ms, n_parts = _parts(narrow_tokens, target)
    lines = [
        f"## The policies re-priced by the step-time predictor, at the study's width and at {REAL_WIDTH} (`--part reprice`)",
        "",
        f"    python benchmarks/block_study.py --part reprice --size {args.size} --out {_rel(args.out)}",
        "",
        f"No training, no device: each policy of the tables above (the rules, the anchors and every search under "
        f"search/, roots bf16 as the horizons run them; fp32 as the reference) priced against uniform bf16 on a "
        f"{target.name.upper()} by autoprec's step-time predictor (docs/planning.md; NVFP4 everywhere at width "
        f"{REAL_WIDTH}: {regime_band(real, uniform('nvfp4', real)).text}), from the models' shapes "
        f"on the meta device. `est.`: the peak-FLOP ratio the study reports (the Linears' GEMMs at the datasheet's "
        f"peak, nothing else). Two shapes, the same {h['n_layers']} blocks and module names, so every policy applies "
        "unchanged:",
        "",
        f"* the study's: {h['d_model']} wide, {h['batch']} x {h['seq_len']} = {study.tokens:,.0f} tokens a step; "
        f"uniform bf16 {s_ms:.3g} ms predicted, the Linears' GEMMs {s_parts['gemms']:.0%} of it; {_nvfp4(study, target)};",
        f"* a real width: {REAL_WIDTH} wide ({REAL_HEADS} heads, FFN {4 * REAL_WIDTH}), {h['batch']} x {REAL_SEQ} = "
        f"{real.tokens:,.0f} tokens a step; uniform bf16 {r_ms:.3g} ms predicted, the GEMMs {r_parts['gemms']:.0%}, the "
        f"optimizer {r_parts['optimizer']:.0%}; {_nvfp4(real, target)}. At the study's own {narrow_tokens.tokens:,.0f} tokens this width's step "
        f"is {n_parts['optimizer']:.0%} optimizer (GEMMs {n_parts['gemms']:.0%}) and NVFP4 everywhere is predicted "
        f"{speedup(narrow_tokens, uniform('nvfp4', narrow_tokens), target):.2f}x, so the sequences are made "
        f"{REAL_SEQ} long for a GEMM-bound step.",
        "",
        f"| policy | what | est. peak-FLOP speedup | predicted, width {h['d_model']} | predicted, width {REAL_WIDTH} |",
        "|---|---|---|---|---|",
    ]
    for r in table:
        name = r["policy"] + (f" (= {r['same_as']})" if r["same_as"] else "")
        lines.append(
            f"| {name} | {r['rule']} | {r['est_peak_flop_speedup']:.2f}x | {r['predicted_study_width']:.2f}x | {r[col]:.2f}x |"
        )
    low = [r for r in table if r["policy"] not in ("bf16", "fp32") and not r["same_as"]]
    lines += ["", "### Findings (computed from the table)", ""]
    if low:
        paying = [r for r in low if r["predicted_study_width"] > 1.0]
        best_est = max(low, key=lambda r: r["est_peak_flop_speedup"])
        best_real = max(low, key=lambda r: r[col])
        lines += [
            f"* At width {h['d_model']} {len(paying) or 'none'} of the {len(low)} policies besides bf16 and fp32 (twins once) "
            f"{'is' if len(paying) == 1 else 'are'} predicted faster than uniform bf16; they span {min(r['predicted_study_width'] for r in low):.2f}x-"
            f"{max(r['predicted_study_width'] for r in low):.2f}x where the peak-FLOP ratio says "
            f"{min(r['est_peak_flop_speedup'] for r in low):.2f}x-{max(r['est_peak_flop_speedup'] for r in low):.2f}x.",
            f"* At width {REAL_WIDTH} they span {min(r[col] for r in low):.2f}x-{max(r[col] for r in low):.2f}x "
            f"(each with its regime's band: band_width_{REAL_WIDTH} in reprice.csv); the fastest is {best_real['policy']} ({best_real[col]:.2f}x; est. "
            f"{best_real['est_peak_flop_speedup']:.2f}x), the highest peak-FLOP estimate {best_est['policy']} "
            f"({best_est['est_peak_flop_speedup']:.2f}x est., {best_est[col]:.2f}x predicted). Policies within the "
            "error band of each other are not told apart by the predictor.",
            "* Order by the predicted speedup at width "
            f"{REAL_WIDTH}: " + ", ".join(f"{r['policy']} {r[col]:.2f}x" for r in sorted(low, key=lambda r: -r[col])) + ".",
        ]
    lines.append("")
    return "\n".join(lines)
