"""Issue 63 item 3 (`--part schedule`): a per-layer precision schedule against the whole-model switch and the hand
rule, at equal predicted B200 time, trained 10 x K steps on fresh data and judged paired over the seeds.

    python benchmarks/block_study.py --part schedule --seeds 5 --eval-every 10 --out results/cpu-xeon-amx-2core/block-study

Five policies, all with a bf16 model root (as every policy of the study):

* `bf16`: every Linear bf16, the baseline every drop is paired against (trained here, on this CPU, in the same run);
* `nvfp4-all`: every Linear NVFP4 (that the format takes), the whole run;
* `rule-a`: torchtitan's hand rule, as policies.study_policies builds it: the last 15% of the blocks and the head bf16,
  the rest NVFP4, the whole run;
* `whole-switch`: nvfp4-all, then from the fraction f_w of the run every Linear raised to bf16 (Megatron-Bridge's
  healing raises the whole model late);
* `per-layer-schedule`: nvfp4-all, then from the fraction f_p only the Linears of a set S raised to bf16.

**The rule for S** (`raised_set`): the study's own per-layer measurement, `drop.csv`'s nvfp4 rows (the eval-loss rise
when that one Linear's forward GEMM is NVFP4 and everything else fp32; DROP_CSV, from the AMD EPYC run), each Linear
ranked by its drop per GEMM FLOP (policies.flops_table at the study's width and tokens; ties by name), S grown
greedily down that ranking, one Linear at a time, until its share of the Linears' GEMM FLOPs reaches RAISE_FACTOR (2)
times the share rule-a keeps in bf16, so that raising S for the whole run would cost more than rule-a and the switch
lands mid-run. Linears without a row in the table are not ranked.

**Equal predicted time** (`equal_time`): each schedule's predicted B200 step time at REAL_WIDTH (reprice.step_of: the
same 12-block pattern and module names, 2048 wide, sequences of REAL_SEQ tokens) is the phases' times averaged by
their shares of the run (autoprec's predict): f t_low + (1 - f) t_raised. Solved for rule-a's time t_a,
f* = (t_raised - t_a) / (t_raised - t_low), then rounded to the nearest whole step s of the 10 x K run (f = s / N, so
the phase starts at step s, Policy.Phase.start_step), and kept inside 1..N - 1 (a phase starts inside the run). Where
f* lies outside [0, 1] equality is impossible (the schedule is faster, or slower, than rule-a for every switch step)
and the closest feasible step is used; the table says which, and the rounding's residual time difference.

Each (policy, seed) run trains the trained weights 10 x K steps on horizon2's fresh streams with autoprec's Trainer
given the run's length (total_steps), so a scheduled policy switches in place at its step (follow_schedule); each run's
csv records the phase the model was in at each evaluation, and the part refuses a scheduled run whose model did not end
in its last phase. Writes schedule/<policy>-seed<s>.csv, schedule.csv, schedule_curves.png and the "schedule"
section of summary.md.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

from . import ROOT
from .common import _pyplot, _rel, _save, load_example, update_summary, write_csv
from .horizon2 import drop_columns, eval_steps, fresh_data, paired_drops, paired_stats, run_queue
from .policies import RULE_TEXT, flops_table, gemm_share, gpt2_workload, study_policies
from .reprice import REAL_HEADS, REAL_SEQ, REAL_WIDTH, TARGET, step_of
from .runs import COLORS, load_curves, run_path

SCHEDULE_DIR = "schedule"
DROP_CSV = ROOT / "results" / "cpu-epyc-bf16-2core" / "block-study" / "drop.csv"
RAISE_FACTOR = 2.0  # S's GEMM FLOP share: twice rule-a's bf16 share
POLICIES = ("bf16", "nvfp4-all", "rule-a", "whole-switch", "per-layer-schedule")
SCHEDULES = ("whole-switch", "per-layer-schedule")
SCHEDULE_COLORS = {**COLORS, "whole-switch": "#7570b3", "per-layer-schedule": "#e7298a"}
TEXT = {
    **RULE_TEXT,
    "whole-switch": "nvfp4-all, every Linear raised to bf16 from f_w",
    "per-layer-schedule": "nvfp4-all, the Linears of S raised to bf16 from f_p",
}


def read_drops(path: Path = DROP_CSV, fmt: str = "nvfp4") -> dict[str, float]:
    """{Linear: eval-loss rise} from drop.csv's rows of `fmt` (the all-Linears row left out)."""
    with open(path) as f:
        return {r["layer"]: float(r["drop"]) for r in csv.DictReader(f) if r["format"] == fmt and r["layer"] != "all"}


def raised_set(drops: dict[str, float], flops: dict[str, float], goal_share: float) -> list[str]:
    """S: the Linears ranked by drop per GEMM FLOP (highest first, ties by name), taken in that order until their
    share of the total GEMM FLOPs (over every Linear in `flops`) reaches `goal_share`; all ranked ones if it never
    does. Linears without a drop are not ranked."""
    total = sum(flops.values())
    ranked = sorted((n for n in flops if n in drops), key=lambda n: (-drops[n] / flops[n], n))
    chosen, acc = [], 0.0
    for name in ranked:
        if acc >= goal_share * total:
            break
        chosen.append(name)
        acc += flops[name]
    return chosen


def scheduled(start, raised: list[str], fraction: float):
    """`start` for the first `fraction` of the run, then the `raised` Linears in bf16 (the rest as they were)."""
    import dataclasses

    from autoprec.formats import Format
    from autoprec.policy import Phase

    return dataclasses.replace(start, phases=(Phase(fraction, dict.fromkeys(raised, Format.BF16)),))


def equal_time(step, start, raised: list[str], goal_ms: float, total_steps: int, target) -> dict:
    """The switch step at which `start` then `raised` in bf16 is predicted as fast as `goal_ms` on `step`: the exact
    fraction f* (predict prices a schedule as f t_low + (1 - f) t_raised), the nearest whole step s of `total_steps`
    (kept inside 1..total_steps - 1) and the residual of the rounded schedule's predicted time against the goal."""
    from autoprec.tune._measure._predict import predict

    t_low = predict(step, start, target).ms
    t_raised = predict(step, scheduled(start, raised, 0.5).in_phase(1), target).ms
    exact = (t_raised - goal_ms) / (t_raised - t_low) if t_raised != t_low else math.nan
    feasible = math.isfinite(exact) and 0.0 <= exact <= 1.0
    s = round(exact * total_steps) if math.isfinite(exact) else total_steps - 1
    s = min(max(s, 1), total_steps - 1)
    ms = predict(step, scheduled(start, raised, s / total_steps), target).ms
    return {
        "exact": exact,
        "feasible": feasible,
        "step": s,
        "fraction": s / total_steps,
        "t_low": t_low,
        "t_raised": t_raised,
        "ms": ms,
        "residual": ms / goal_ms - 1.0,
    }


def schedule_policies(model, drops: dict[str, float], flops: dict[str, float], real_step, total_steps: int, target):
    """({label: Policy}, {schedule: its equal_time answer and S}) for POLICIES, the schedules switched at the steps
    equal_time solves on `real_step` against rule-a."""
    from autoprec.tune._measure._predict import predict

    found = study_policies(model)
    base = {n: found[n] for n in ("bf16", "nvfp4-all", "rule-a")}
    start = base["nvfp4-all"]
    everything = [n for n in start.layers if n]
    rule_bf16 = gemm_share(base["rule-a"], flops).get("bf16", 0.0)
    chosen = raised_set({n: d for n, d in drops.items() if n in start.layers}, flops, RAISE_FACTOR * rule_bf16)
    goal = predict(real_step, base["rule-a"], target).ms
    solved, out = {}, dict(base)
    for label, raised in (("whole-switch", everything), ("per-layer-schedule", chosen)):
        answer = equal_time(real_step, start, raised, goal, total_steps, target)
        solved[label] = {**answer, "raised": raised, "raised_share": sum(flops[n] for n in raised) / sum(flops.values())}
        out[label] = scheduled(start, raised, answer["fraction"])
    solved["rule_a_bf16_share"] = rule_bf16
    return out, solved


def run(args) -> None:
    """Solve the switch steps, train every (policy, seed) not yet finished, write the table."""
    from autoprec.tune._core._targets import target_named
    from autoprec.tune._decide._flops import gemm_flops

    out: Path = args.out
    folder = out / SCHEDULE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    example, workload = gpt2_workload(args.size)
    h = example.HPARAMS
    target = target_named(TARGET)
    steps = args.horizon * args.steps
    flops = gemm_flops(flops_table(workload.model, int(h["batch"] * h["seq_len"])))
    shapes = load_example(args.size)
    study = step_of(shapes, h, h["batch"], h["seq_len"])
    real = step_of(shapes, {**h, "d_model": REAL_WIDTH, "n_heads": REAL_HEADS}, h["batch"], REAL_SEQ)
    policies, solved = schedule_policies(workload.model, read_drops(), flops, real, steps, target)
    for label in SCHEDULES:
        policies[label].save(folder / f"{label}.policy.json")
    at = eval_steps(steps, args.eval_every or args.steps, args.steps)
    start = time.perf_counter()
    ran = [] if args.report_only else run_queue(example, workload, policies, folder, steps, at, args.seeds)
    print(f"ran {len(ran)} runs in {time.perf_counter() - start:.0f} s", flush=True)
    curves = load_curves(policies, folder, args.seeds, steps)
    check_phases(policies, folder, args.seeds, steps)
    start_drops = last_phase_at_start(example, workload, policies, steps)
    table = schedule_table(policies, solved, curves, args, flops, study, real, target, start_drops)
    if table:
        write_csv(out / "schedule.csv", table)
        plot_schedule(curves, solved, args, out / "schedule_curves.png")
        update_summary(out, "schedule", schedule_summary(table, solved, curves, args, steps))
    print("schedule: wrote schedule.csv, schedule_curves.png, summary.md")


def last_phase_at_start(example, workload, policies: dict, steps: int) -> dict[str, float]:
    """{policy: bf16's metric minus the metric of the starting (trained) weights evaluated in the policy's last
    phase's formats}, on the runs' eval batches (the same for every seed): how much of a drop taken at the end, in
    those formats, the quantised evaluation alone makes before any training. A run's metric is taken with the model
    in its formats of the moment, so a schedule that raised every Linear is evaluated in bf16 at the end, nvfp4-all in
    NVFP4."""
    import dataclasses

    from autoprec.tune._measure._metric import evaluate_metric

    _, evals = fresh_data(example, steps, 0)
    wl = dataclasses.replace(workload, eval=evals)
    last = {n: p.in_phase(len(p.phases)) for n, p in policies.items()}
    base = evaluate_metric(wl, last["bf16"])
    return {n: base - evaluate_metric(wl, p) for n, p in last.items()}


def check_phases(policies: dict, folder: Path, seeds: int, steps: int) -> None:
    """Every finished run of a scheduled policy ended in its last phase and started in its first (the csv's `phase`
    column, which runs.train_curve fills for a scheduled policy); RuntimeError naming the run otherwise."""
    for name, policy in policies.items():
        if not policy.phases:
            continue
        for seed in range(seeds):
            path = run_path(folder, name, seed)
            if not path.exists():
                continue
            with open(path) as f:
                rows = list(csv.DictReader(f))
            if int(rows[-1]["step"]) < steps:
                continue
            first, last = int(rows[0]["phase"]), int(rows[-1]["phase"])
            switch = int(rows[-1]["switched_at"])
            if first != 0 or last != len(policy.phases) or switch != policy.phases[0].start_step(steps):
                raise RuntimeError(
                    f"{path}: the schedule did not switch as planned (phase {first} at step 0, {last} at the end, "
                    f"switched at step {switch}; expected 0, {len(policy.phases)}, step {policy.phases[0].start_step(steps)})"
                )


def _shares(policy, flops) -> tuple[float, float, float]:
    """The low-precision GEMM share in the first phase, the last, and averaged over the run by the phases' shares."""
    each = [gemm_share(policy.in_phase(i), flops)["low"] for i in range(len(policy.phases) + 1)]
    return each[0], each[-1], sum(w * s for w, s in zip(policy.phase_shares(), each))


def schedule_table(policies, solved, curves, args, flops, study, real, target, start_drops=None) -> list[dict]:
    from autoprec.tune._measure._predict import regime_band, speedup

    steps = args.horizon * args.steps
    a_ms = _ms(real, policies["rule-a"], target)
    rows = []
    for name, policy in policies.items():
        first, last, mean = _shares(policy, flops)
        s = solved.get(name)
        row = {
            "policy": name,
            "what": TEXT[name],
            "raised_layers": len(s["raised"]) if s else "",
            "raised_gemm_share": round(s["raised_share"], 4) if s else "",
            "raised": " ".join(s["raised"]) if s else "",
            "switch_step": s["step"] if s else "",
            "switch_fraction": round(s["fraction"], 4) if s else "",
            "solved_fraction": round(s["exact"], 4) if s else "",
            "equal_time_feasible": s["feasible"] if s else "",
            "low_share_first": round(first, 4),
            "low_share_last": round(last, 4),
            "low_share_run": round(mean, 4),
            "pred_speedup_128": round(speedup(study, policy, target), 4),
            f"pred_speedup_{REAL_WIDTH}": round(speedup(real, policy, target), 4),
            f"pred_ms_{REAL_WIDTH}": round(_ms(real, policy, target), 4),
            f"time_vs_rule_a_{REAL_WIDTH}": round(_ms(real, policy, target) / a_ms - 1.0, 5),
            f"band_{REAL_WIDTH}": regime_band(real, policy).error,
            "last_phase_eval_drop_at_start": round(start_drops[name], 6) if start_drops and name in start_drops else "",
        }
        if name in curves and "bf16" in curves:
            for tag, step in (("K", args.steps), ("10K", steps)):
                row |= drop_columns(tag, paired_drops(curves, name, step))
            taken = sorted(next(iter(curves["bf16"].values())))
            row["drop_curve_mean"] = " ".join(f"{t}:{paired_stats(paired_drops(curves, name, t))['mean']:+.5f}" for t in taken)
        rows.append(row)
    return rows


def _ms(step, policy, target) -> float:
    from autoprec.tune._measure._predict import predict

    return predict(step, policy, target).ms


def differences(curves, a: str, b: str, step: int) -> dict[str, float]:
    """a's paired drop minus b's at `step`, seed by seed over the seeds both finished (= b's metric - a's, on the
    same stream), and its t interval."""
    da = dict(zip(sorted(s for s in curves.get(a, {}) if s in curves.get("bf16", {})), paired_drops(curves, a, step)))
    db = dict(zip(sorted(s for s in curves.get(b, {}) if s in curves.get("bf16", {})), paired_drops(curves, b, step)))
    return paired_stats([da[s] - db[s] for s in sorted(da) if s in db])


def _pm(st: dict) -> str:
    if not st["n"]:
        return "n/a"
    return f"{st['mean']:+.4f}" + (f" ± {st['half']:.4f}" if math.isfinite(st["half"]) else f" (n={st['n']})")


def _told(st: dict) -> str:
    if not math.isfinite(st["half"]):
        return "one seed: not judged"
    if st["lo"] > 0:
        return "larger, beyond the noise"
    if st["hi"] < 0:
        return "smaller, beyond the noise"
    return "not told apart"


PAIRS = (("per-layer-schedule", "whole-switch"), ("per-layer-schedule", "rule-a"), ("whole-switch", "rule-a"),
         ("per-layer-schedule", "nvfp4-all"), ("whole-switch", "nvfp4-all"), ("rule-a", "nvfp4-all"))  # fmt: skip


def schedule_summary(table, solved, curves, args, steps: int) -> str:
    by = {r["policy"]: r for r in table}
    col = f"pred_speedup_{REAL_WIDTH}"
    lines = [
        "## A per-layer schedule against the whole-model switch and rule (a), at equal predicted B200 time (`--part schedule`)",
        "",
        f"    python benchmarks/block_study.py --part schedule --size {args.size} --steps {args.steps} --horizon "
        f"{args.horizon} --seeds {args.seeds}{f' --eval-every {args.eval_every}' if args.eval_every else ''} "
        f"--out {_rel(args.out)}",
        "",
        f"Issue 63 item 3. Every policy has a bf16 root and trains the trained weights {steps} steps (K = {args.steps}, "
        f"{args.horizon} x K) on horizon2's fresh streams, its drop paired seed by seed against bf16 trained here on "
        "the same stream: mean ± the half-width of its 95% t interval. The two schedules start as nvfp4-all and raise "
        f"Linears to bf16 from a switch step solved so that their predicted B200 step time at width {REAL_WIDTH} "
        "(the phases averaged by their shares of the run) equals rule-a's, rounded to a whole step. S, the "
        "per-layer schedule's raised set: the Linears ranked by drop.csv's single-layer NVFP4 drop "
        f"({_rel(DROP_CSV)}) per GEMM FLOP, taken until their FLOP share reaches {RAISE_FACTOR:g} x rule-a's bf16 "
        f"share ({RAISE_FACTOR:g} x {solved['rule_a_bf16_share']:.1%}); its {len(solved['per-layer-schedule']['raised'])} "
        f"Linears ({solved['per-layer-schedule']['raised_share']:.1%} of the GEMM FLOPs): "
        + ", ".join(solved["per-layer-schedule"]["raised"])
        + ". Each run's csv: schedule/<policy>-seed<s>.csv (its `phase` column: the phase at each evaluation; "
        "`switched_at`: the step the switch took effect). A run's metric is taken with the model in its formats of the "
        "moment, so at 10 x K the whole-model switch is evaluated in bf16, nvfp4-all and rule-a in their NVFP4: the "
        "last column is the drop those last formats alone make on the starting weights (one evaluation, the same "
        "eval batches for every seed), the quantised evaluation's part before any training.",
        "",
        "![schedule curves](schedule_curves.png)",
        "",
        f"| policy | what | switch step (solved f*) | low GEMM share: first / last / run | predicted B200 speedup, width 128 / "
        f"{REAL_WIDTH} | time vs rule-a, width {REAL_WIDTH} | seeds | drop at K | drop at 10 x K | the last phase's "
        "formats at step 0 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        switch = (
            f"{r['switch_step']} of {steps} ({r['solved_fraction']:.3f}{'' if r['equal_time_feasible'] else ', infeasible'})"
            if r["switch_step"] != ""
            else ""
        )
        drops = f"{r['seeds_10K']} | {_ci(r, 'K')} | {_ci(r, '10K')}" if "seeds_10K" in r else "0 | | "
        lines.append(
            f"| {r['policy']} | {r['what']} | {switch} | {r['low_share_first']:.1%} / {r['low_share_last']:.1%} / "
            f"{r['low_share_run']:.1%} | {r['pred_speedup_128']:.2f}x / {r[col]:.3f}x | "
            f"{r[f'time_vs_rule_a_{REAL_WIDTH}']:+.2%} | {drops} | {_num(r['last_phase_eval_drop_at_start'])} |"
        )
    lines += ["", "Paired differences of the drops (first minus second, seed by seed on the same stream):", ""]
    lines += ["| pair | at K | at 10 x K | at 10 x K, told apart? |", "|---|---|---|---|"]
    for a, b in PAIRS:
        if a in curves and b in curves:
            k, e = differences(curves, a, b, args.steps), differences(curves, a, b, steps)
            lines.append(f"| {a} - {b} | {_pm(k)} | {_pm(e)} | {_told(e)} |")
    lines += ["", "### Findings (computed from the runs)", "", *schedule_findings(by, solved, curves, args, steps), ""]
    return "\n".join(lines)


def _num(value) -> str:
    return "" if value == "" else f"{value:+.4f}"


def _ci(row, tag: str) -> str:
    if not math.isfinite(row[f"drop_{tag}_half_width"]):
        return f"{row[f'drop_{tag}_mean']:+.4f} (n={row[f'seeds_{tag}']})"
    return f"{row[f'drop_{tag}_mean']:+.4f} ± {row[f'drop_{tag}_half_width']:.4f}"


def schedule_findings(by, solved, curves, args, steps: int) -> list[str]:
    col = f"pred_speedup_{REAL_WIDTH}"
    out = []
    for label in SCHEDULES:
        s = solved[label]
        how = (
            f"solved f* = {s['exact']:.4f}, rounded to step {s['step']} of {steps}"
            if s["feasible"]
            else f"equal time is impossible (f* = {s['exact']:.4f}); the closest feasible step, {s['step']}, is used"
        )
        out.append(
            f"* {label}: {how}; predicted {by[label][col]:.3f}x at width {REAL_WIDTH} against rule-a's "
            f"{by['rule-a'][col]:.3f}x (time {s['residual']:+.2%}; one step of the run moves it by "
            f"{abs(s['t_raised'] - s['t_low']) / steps / (s['ms'] / (1 + s['residual'])):.2%})."
        )
    if "bf16" not in curves:
        return [*out, "* bf16 has not run yet: no drops."]
    start = {r: by[r]["last_phase_eval_drop_at_start"] for r in by if by[r]["last_phase_eval_drop_at_start"] != ""}
    if start:
        out.append(
            "* Evaluated on the starting weights in each policy's last formats: "
            + ", ".join(f"{n} {v:+.4f}" for n, v in start.items() if n != "bf16")
            + ". A drop at 10 x K includes that evaluation's part: the schedules' raised Linears are evaluated in bf16."
        )
    for a, b in PAIRS[:3]:
        if a in curves and b in curves:
            e = differences(curves, a, b, steps)
            out.append(f"* At 10 x K, {a} minus {b}: {_pm(e)} over {e['n']} seeds: {_told(e)}.")
    return out


def plot_schedule(curves, solved, args, path: Path) -> None:
    """Each policy's mean paired drop against bf16 over the steps, 95% t band, the schedules' switch steps marked."""
    plt = _pyplot()

    base = curves.get("bf16", {})
    if not base:
        return
    steps = sorted(next(iter(base.values())).keys())
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name in curves:
        if name == "bf16":
            continue
        st = [paired_stats(paired_drops(curves, name, s)) for s in steps]
        color = SCHEDULE_COLORS.get(name, "k")
        ax.plot(steps, [x["mean"] for x in st], marker="o", ms=3, color=color, lw=1.6, label=f"{name} (n={st[-1]['n']})")
        ax.fill_between(steps, [x["lo"] for x in st], [x["hi"] for x in st], color=color, alpha=0.12)
        if name in solved:
            ax.axvline(solved[name]["step"], color=color, lw=0.9, ls="--")
    ax.axhline(0, color="k", lw=0.6)
    ax.axvline(args.steps, color="0.5", lw=0.8, ls=":")
    ax.set_xlabel("training steps from the trained weights (a fresh batch each step); dashed: switch steps")
    ax.set_ylabel("paired drop vs bf16 (nats/byte): mean, 95% t interval")
    ax.set_title(f"GPT-2 example ({args.size}): schedules at rule-a's predicted B200 time (width {REAL_WIDTH})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)
