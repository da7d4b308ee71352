"""`autoprec validate`: a policy trained beside the baseline over a training horizon, and a phase switch where the
budget does not hold at the end."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from tqdm.auto import tqdm

from autoprec.apply import policy_problem
from autoprec.errors import UserError
from autoprec.files import write_text
from autoprec.policy import Policy, load_policy
from autoprec.tune._commands._shared import Verb, model_device, out_dir, prepare_model, print_json
from autoprec.tune._commands.export import searched_policy
from autoprec.tune._core._budget import parse_budget
from autoprec.tune._core._numbers import parse_integer
from autoprec.tune._core._tables import text_table
from autoprec.tune._measure._validate import BASELINES, SEEDS, Validation, validate
from autoprec.tune._report._plots import plot_validation


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a model.py (build_model, batches, loss_fn; optional evaluate, optimizer)")
    p.add_argument("policy", help="the policy.json to train beside the baseline")
    p.add_argument("--steps", type=parse_integer, required=True, metavar="N", help="training steps of each arm")
    p.add_argument("--every", type=parse_integer, metavar="K", help="evaluate both arms every K steps (default: a tenth of N)")
    p.add_argument("--baseline", choices=BASELINES, default="fp32", help="what the policy is judged against (default fp32)")
    p.add_argument(
        "--budget", help="the largest allowed metric drop at the end: B in the metric's units or P%% of |the baseline's "
        "final metric| (default: the policy's recorded budget)"
    )  # fmt: skip
    p.add_argument("--seed", type=parse_integer, default=0, help="the random draws' seed, the same for every arm (default 0)")
    p.add_argument("--device", default=None, help="where to train (default: cuda when available, else cpu)")
    p.add_argument("--out", help="output directory (default: results/<model name>)")
    p.set_defaults(space=None, exclude=None)


def cmd_validate(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: give the training steps of each arm, a whole number >= 1")
    if args.every is not None and not 1 <= args.every <= args.steps:
        raise UserError(f"--every {args.every}: give a whole number from 1 to --steps ({args.steps})")
    if not 0 <= args.seed < SEEDS:
        raise UserError(f"--seed {args.seed}: give a whole number from 0 to {SEEDS - 1}")
    given = None
    if args.budget is not None:
        try:
            given = parse_budget(args.budget)
        except ValueError as exc:
            raise UserError(f"--budget {args.budget}: {exc}") from None
    policy = searched_policy(args.policy)
    if args.device is None:
        from autoprec.devices import default_device

        args.device = str(default_device())
    device = model_device(args)
    task, _, workload = prepare_model(args, device, compiled=False)
    refused = policy_problem(policy, workload.model)
    if refused:
        raise UserError(f"{args.policy}: apply_policy refuses this policy for {args.model}: {refused}")
    out = out_dir(args, task)
    written_to = out / SCHEDULED
    if written_to.exists() and Path(args.policy).exists() and written_to.resolve() == Path(args.policy).resolve():
        raise UserError(
            f"{args.policy}: this run writes its measured switch to {written_to} (or removes an earlier run's there), "
            "which is the policy given; give --out another folder, or copy the policy elsewhere first"
        )
    budget = given if given is not None else _recorded_budget(policy)
    with tqdm(total=2 * args.steps, desc="training side by side", unit="step", disable=args.quiet or args.json) as bar:

        def more(steps: int) -> None:
            bar.total += steps
            bar.refresh()

        result = validate(workload, policy, args.steps, every=args.every, baseline=args.baseline, seed=args.seed,
                          budget=budget, progress=bar.update, more=more)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "validate.csv", _csv(result))
    written = ["validate.csv", "validate.json"]
    if result.switch is not None:
        _scheduled(result).save(out / SCHEDULED)
        written.append(SCHEDULED)
    elif _validated(out / SCHEDULED):  # an earlier run's switch, which this run did not measure: not its answer
        (out / SCHEDULED).unlink()
    record = _record(result, args)
    write_text(out / "validate.json", json.dumps(record, indent=2, allow_nan=False) + "\n")
    png = plot_validation(result, out / "validate.png", title=f"{task.name}: {args.policy} beside {args.baseline}")
    if args.json:
        print_json(args, record, indent=2)
        return 0
    if not args.quiet:
        print(summary(result))
        print(f"\nwrote {out / written[0]}, {', '.join([*written[1:], png.name])}")
        if result.switch is not None and result.switch.step > 0:
            print(
                f"{SCHEDULED}: the policy with the switch as a phase, as it was trained here; apply it as any policy and "
                "call autoprec.follow_schedule(model, step=..., total_steps=...) each step (the trainer integrations do)"
            )
    # 1, as verify's mismatch: the budget does not hold at the end, and no measured switch keeps it
    switch_holds = result.switch is not None and result.budget is not None and result.switch.drop <= result.budget
    return 0 if result.holds is not False or switch_holds else 1


SCHEDULED = "policy_scheduled.json"  # the measured switch written as a schedule, beside validate.json


def _validated(path: Path) -> bool:
    """Whether `path` is a policy file a validate run wrote (its record's `validated`), which a later run may remove."""
    if not path.is_file() or path.is_symlink():
        return False
    try:
        policy = load_policy(path)
    except UserError:
        return False
    return isinstance((policy.measured or {}).get("validated"), dict)


def _scheduled(v: Validation) -> Policy:
    """The switch's schedule, its record saying what this run measured of it (beside what the search measured)."""
    assert v.switch is not None
    policy = v.switch.policy
    measured = dict(policy.measured or {})
    measured["validated"] = {"steps": v.steps, "baseline": v.baseline, "budget": v.budget, "drop": _finite(v.switch.drop)}
    return dataclasses.replace(policy, measured=measured)


def _recorded_budget(policy) -> float | None:
    """The absolute budget the policy was searched with (measured.budget), or None."""
    recorded = (policy.measured or {}).get("budget")
    if isinstance(recorded, bool) or not isinstance(recorded, (int, float)):
        return None
    return float(recorded) if math.isfinite(recorded) and recorded >= 0 else None


def summary(v: Validation) -> str:
    """The evaluated steps as a table, then the verdict and, where measured, the switch."""
    headers = ["step", f"{v.baseline} loss", "policy loss", f"{v.baseline} metric", "policy metric", "drop"]
    if v.switch is not None:
        headers.append("drop with the switch")
    rows = []
    for p in v.curve:
        if p.drop is None:
            continue
        row = [p.step, f"{p.baseline_loss:.5g}", f"{p.policy_loss:.5g}", _number(p.baseline_metric, 6),
               _number(p.policy_metric, 6), _number(p.drop, 4)]  # fmt: skip
        if v.switch is not None:
            row.append(_number(p.switched_drop, 4))
        rows.append(row)
    lines = [text_table(headers, rows)]
    if v.budget is None:
        lines.append(f"metric drop at step {v.steps}: {v.final_drop:.4g}; no budget recorded in the policy: give --budget")
    elif v.holds:
        lines.append(f"the budget holds: metric drop {v.final_drop:.4g} <= {v.budget:.4g} after {v.steps} steps")
    else:
        lines.append(f"the budget does not hold: metric drop {v.final_drop:.4g} > {v.budget:.4g} after {v.steps} steps")
        if v.switch is None:
            lines.append("no layer of the policy is below bf16 to raise: search again with a smaller budget")
        else:
            verdict = "holds" if v.switch.drop <= v.budget else "does not hold either"
            if v.switch.step == 0:  # past half the budget at the first evaluation: no phase, the policy raised throughout
                first = next(p.step for p in v.curve if p.drop is not None)
                kept = f", its {len(v.switch.policy.phases)} later phase(s) kept" if v.switch.policy.phases else ""
                lines.append(
                    f"measured switch: {_layers(len(v.switch.layers))} raised to bf16 from the start (the drop passed half "
                    f"the budget at the first evaluation, step {first}): drop {v.switch.drop:.4g}, the budget {verdict}; "
                    f"that is no new phase but the policy with them in bf16 from its start{kept} ({SCHEDULED}): search "
                    "again with this budget, or evaluate more often (--every) to find a later switch"
                )
            elif v.switch.phase() is None:  # nothing below bf16 at the step: later phases kept from lowering them
                lines.append(
                    f"measured switch: {_layers(len(v.switch.layers))} kept at bf16 from step {v.switch.step} on, where "
                    f"later phases lowered them: drop {v.switch.drop:.4g}, the budget {verdict}; {SCHEDULED} is the "
                    "policy without those lowerings"
                )
            else:
                lines.append(
                    f"measured switch: {_layers(len(v.switch.layers))} raised to bf16 from step {v.switch.step} "
                    f"({v.switch.from_fraction:.0%} of the run, later phases too): drop {v.switch.drop:.4g}, the budget "
                    f"{verdict}; its phase in {SCHEDULED}: " + json.dumps(v.switch.phase())
                )
    return "\n".join(lines)


def _number(value: float | None, digits: int) -> str:
    """A table cell: `digits` significant digits, -0.0 (minus a zero metric) as 0, None as empty."""
    return "" if value is None else f"{value + 0.0:.{digits}g}"


def _layers(n: int) -> str:
    return f"{n} layer{'s' if n != 1 else ''}"


def _csv(v: Validation) -> str:
    cols = ["step", "baseline_loss", "policy_loss", "baseline_metric", "policy_metric", "switched_loss", "switched_metric"]

    def cell(value: object) -> str:
        return "" if value is None else repr(value) if isinstance(value, float) else str(value)

    return "\n".join([",".join(cols), *(",".join(cell(getattr(p, c)) for c in cols) for p in v.curve)]) + "\n"


def _record(v: Validation, args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "policy": args.policy,
        "baseline": v.baseline,
        "steps": v.steps,
        "budget": v.budget,
        "final_drop": _finite(v.final_drop),  # null where a metric went non-finite (the policy diverged)
        "holds": v.holds,
        "switch": None
        if v.switch is None
        else {
            **(v.switch.phase() or {"from_fraction": v.switch.from_fraction, "layers": dict(v.switch.layers)}),
            "step": v.switch.step,
            "drop": _finite(v.switch.drop),
            "holds": v.switch.drop <= (v.budget or 0),
            "policy": SCHEDULED,
        },
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


VALIDATE = Verb(
    "validate",
    "train a policy beside fp32 (or bf16) over N steps: the loss gap, whether the budget holds, a measured phase switch",
    _arguments,
    cmd_validate,
    description="train the baseline and the policy side by side from the same weights on the same batches and random "
    "draws; print the loss and metric gap, whether the budget holds at the end, and, where it does not, a phase switch "
    "(the layers below bf16 raised from a step on) trained from the policy's state and measured (docs/validate.md)",
)
