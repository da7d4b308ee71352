"""`autoprec predict`: a policy's training-step time on a target GPU, from the model's shapes (no GPU needed). The
predictor is autoprec/tune/_measure/_predict.py; this reads the flags, refuses mistakes in one line, and says the
prediction (text and --json)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from autoprec.apply import policy_problem
from autoprec.errors import UserError, shown
from autoprec.policy import ROOT, Policy, gatherable_text
from autoprec.tune._commands._shared import Verb, print_json
from autoprec.tune._core._numbers import NotANumber, parse_integer
from autoprec.tune._core._targets import targets as planned_for
from autoprec.tune._measure._layout import MAX_RANKS, MAX_TOKENS, Layout, read_layout
from autoprec.tune._measure._predict import (
    ABSOLUTE_SHORT,
    baseline,
    describe,
    grouped_kernel,
    lacking,
    predict,
    prices_data_parallel,
    regime_band,
    uniform,
)
from autoprec.tune._measure._step_shapes import traced

# --checkpointing's choices: none, or the whole forward recomputed in the backward
CHECKPOINTING = ("none", "full")


def _whole(value: str | int, flag: str, what: str, most: int, example: int) -> int:
    """A flag's whole number from 1 to `most` in ASCII digits (float() and int() take '1_0' and other scripts'
    digits); UserError naming the flag, what it counts and the range."""
    try:
        count = parse_integer(str(value))
    except NotANumber:
        count = 0
    if not 0 < count <= most:
        text = str(value) if len(str(value)) <= 24 else f"{str(value)[:20]}... ({len(str(value))} characters)"
        raise UserError(f"{flag} {text}: give {what}, a whole number from 1 to {most}, e.g. {example}")
    return count


def _count(value: str | int | None, flag: str, what: str) -> int:
    """--dp-shard, --grad-accum (1 where not given)."""
    return 1 if value is None else _whole(value, flag, what, MAX_RANKS, 8)


def _tokens(value: str | int | None) -> int | None:
    """--tokens."""
    if value is None:
        return None
    return _whole(value, "--tokens", "the tokens (rows) of one micro-batch", MAX_TOKENS, 8192)


def _with_layout(layout: str, given: dict[str, Any]) -> tuple[dict[str, Any], Layout]:
    """`given` (predict's layout flags, None where not given) completed from the file `layout` (_layout.py), and what
    the file said; UserError where the file leaves a value to the launch that no flag gives, or a flag overrides one
    the file derives others from (they would be stale)."""
    read = read_layout(layout)
    flags = {"--dp-shard": "dp_shard", "--dp-replicate": "dp_replicate", "--grad-accum": "grad_accum", "--tp": "tp"}
    unsaid = [(flag, why) for flag, why in read.needs if given[flags[flag]] is None]
    if unsaid:
        raise UserError(
            f"--layout {shown(layout, 80)}: {'; '.join(why for _, why in unsaid)}; give "
            + " and ".join(f"{flag} N" for flag, _ in unsaid)
        )
    taken = read.as_flags()
    for field, sources in read.derived:
        for flag in sources:
            mine, theirs = given[flags[flag]], taken.get(flags[flag], 1)
            if mine is not None and _number(mine) != theirs:
                raise UserError(
                    f"{flag} {str(mine)[:24]} beside --layout {shown(layout, 80)}, which derives its "
                    f"{field.replace('_', '-')} ({taken[field]}) from its own {flag[2:]} of {theirs}: edit the file, "
                    "or leave --layout out and give every flag"
                )
    merged = {k: (v if v is not None else taken.get(k)) for k, v in given.items()}
    return merged, read


def _number(value: Any) -> int | None:
    """A flag's whole number, None where it is none (its own check says why later)."""
    try:
        return parse_integer(str(value))
    except NotANumber:
        return None


def _check_experts(model: str, step: Any, ranks: int, source: str = "") -> None:
    """--ep N: the model runs grouped experts, each MoE layer's split evenly over the N ranks; UserError if not
    (`source`: where N came from, where not typed)."""
    if not step.grouped:
        raise UserError(f"--ep {ranks}: {model} runs no grouped experts (torch._grouped_mm) to spread; leave it out")
    counts = sorted({g.groups for g in step.grouped})
    if any(c % ranks for c in counts):
        shared = math.gcd(*counts)
        able = [str(d) for d in range(2, shared + 1) if shared % d == 0][:12]
        raise UserError(
            f"--ep {ranks}{source}: {model}'s MoE layers have {' or '.join(map(str, counts))} experts, which {ranks} ranks "
            f"cannot share evenly; give "
            + (f"one of {', '.join(able)}" if able else "--ep 1 (no count of ranks but 1 divides them all)")
        )


def command(
    model: str,
    *,
    target: str,
    policy: str | None = None,
    fmt: str | None = None,
    tokens: str | int | None = None,
    dp_shard: str | int | None = None,
    dp_replicate: str | int | None = None,
    fp8_all_gather: bool | None = None,
    grad_accum: str | int | None = None,
    tp: str | int | None = None,
    async_tp: bool | None = None,
    checkpointing: str | None = None,
    experts: str | None = None,
    ep: str | int | None = None,
    layout: str | None = None,
) -> tuple[dict[str, Any], str]:
    """`autoprec predict`: the predicted step times of uniform bf16 and of the candidate (`policy`, a policy file, or
    `fmt`, every Linear in it) on `target`, as (the --json object, the text); `dp_shard` data-parallel ranks sharing
    the optimizer's work (FSDP), `dp_replicate` replicas beside them (HSDP), `fp8_all_gather` whether the weights
    FSDP2 can gather in fp8 are (None: as the layout file says, else as the policy file does, else not), `grad_accum`
    micro-batches a step, `tp` tensor-parallel ranks, `async_tp` whether
    their collectives overlap as torch's asynchronous TP overlaps them (None: as the layout file says, else not),
    `checkpointing` "full" or "none", `experts` the format an MoE's grouped GEMMs are priced in (a plan: apply_policy runs them in
    the model root's), `ep` the expert-parallel ranks an MoE's experts are spread over, `layout` a file to read the
    layout from (a torchtitan TOML or a launch's arguments: _layout.py), whose values a flag given here overrides.
    UserError for a user's mistake."""
    from autoprec.formats import parse_format
    from autoprec.policy import load_policy
    from autoprec.tune._core._targets import target_named, targets
    from autoprec.tune._measure._task import load_task

    try:
        device = target_named(target)
    except ValueError as exc:
        raise UserError(f"--{exc}") from None
    read, from_file, typed_replicate = None, False, dp_replicate
    if layout is not None:
        typed = {
            "dp_shard": dp_shard,
            "dp_replicate": dp_replicate,
            "grad_accum": grad_accum,
            "tp": tp,
            "ep": ep,
            "checkpointing": checkpointing,
        }
        merged, read = _with_layout(layout, {**typed, "tokens": tokens, "async_tp": async_tp, "fp8_all_gather": fp8_all_gather})
        dp_shard, grad_accum, tp, ep = merged["dp_shard"], merged["grad_accum"], merged["tp"], merged["ep"]
        dp_replicate, fp8_all_gather = merged["dp_replicate"], merged["fp8_all_gather"]
        checkpointing, tokens, async_tp = merged["checkpointing"], merged["tokens"], merged["async_tp"]
        from_file = typed["ep"] is None and read.ep is not None
    wanted = _tokens(tokens)
    shards = _count(dp_shard, "--dp-shard", "the data-parallel ranks the optimizer's state is sharded over (FSDP)")
    replicas = _count(dp_replicate, "--dp-replicate", "the data-parallel replicas beside the shards (HSDP)")
    fsdp = read is None or read.fsdp is not False  # Megatron's data parallelism: its communication not priced
    if not fsdp and typed_replicate is not None:
        raise UserError(
            f"--dp-replicate {shown(str(dp_replicate), 24)} beside --layout {shown(str(layout), 80)}, a Megatron-LM launch, "
            "whose data-parallel ranks are the world over its TP; leave --dp-replicate out"
        )
    typed_gather = bool(fp8_all_gather) and (read is None or read.fp8_all_gather is None)
    if typed_gather and fsdp and shards == 1:
        raise UserError(
            "--fp8-all-gather: there is no FSDP sharding to gather over; give --dp-shard N (N above 1) or leave it out"
        )
    # what the data-parallel collectives leave out, where they are not priced
    unpriced = "" if fsdp else "Megatron's data-parallel communication, "
    if fsdp and (shards > 1 or replicas > 1) and not prices_data_parallel(device):
        unpriced = f"data-parallel communication (target {device.name} does not give both its NVLink and NIC bandwidths), "
    priced = not unpriced
    micro = _count(grad_accum, "--grad-accum", "the micro-batches of one optimizer step")
    tensor = _count(tp, "--tp", "the tensor-parallel ranks each Linear is sharded over")
    if tensor > 1 and device.link_gbs <= 0:
        raise UserError(f"--tp {tensor}: target {device.name} has no NVLink bandwidth to price its collectives; --tp 1")
    overlapped = bool(async_tp) and tensor > 1
    if async_tp and tensor == 1:
        if read is None or read.async_tp is None:  # typed: a mistake; from a run's config: nothing to overlap
            raise UserError("--async-tp: there is no tensor parallelism to overlap; give --tp N (N above 1) or leave it out")
    spread = _count(ep, "--ep", "the expert-parallel ranks an MoE's experts are spread over")
    if spread > 1 and device.link_gbs <= 0:
        raise UserError(f"--ep {spread}: target {device.name} has no NVLink bandwidth to price its all-to-alls; --ep 1")
    grouped_format = None
    if experts is not None:
        try:
            grouped_format = parse_format(experts, field="--experts")
            grouped_kernel(grouped_format)
        except ValueError as exc:
            raise UserError(f"--experts {shown(experts, 40)}: {exc}") from None
        if lacking({grouped_format}, device):
            raise UserError(f"--experts {grouped_format.value}: target {device.name} runs {', '.join(device.runs)}, not it")
    recompute = (checkpointing or "none").strip().lower()
    if recompute not in CHECKPOINTING:
        raise UserError(f"--checkpointing {shown(checkpointing, 40)}: give one of {', '.join(CHECKPOINTING)}")
    if fmt is not None:
        try:
            candidate_format = parse_format(fmt, field="--format")
        except ValueError as exc:
            raise UserError(str(exc)) from None
    given = None
    if fmt is None:
        try:
            given = load_policy(policy or "")
        except UserError as exc:  # it names the file already
            raise UserError(f"--policy {exc}") from None
        except ValueError as exc:
            raise UserError(f"--policy {policy}: {exc}") from None
    found = traced(load_task(model))
    if grouped_format is not None and not found.step.grouped_flops:
        raise UserError(
            f"--experts {grouped_format.value}: {model} runs no grouped experts (torch._grouped_mm) to price; leave it out"
        )
    said = list(read.said) if read is not None else []
    if async_tp and tensor == 1:
        said.append("asynchronous tensor parallelism left out: the layout has no tensor parallelism")
    if spread > 1 and from_file and not found.step.grouped:  # a run's config names it; this model has no experts
        said.append(f"expert parallelism {spread} left out: {model} runs no grouped experts")
        spread = 1
    if spread > 1:
        _check_experts(model, found.step, spread, f" (from --layout {layout})" if from_file else "")
    step = found.step if wanted is None else found.step.scaled(wanted)
    step = dataclasses.replace(
        step,
        shards=shards,
        replicas=replicas,
        fsdp=fsdp,
        micro_steps=micro,
        tensor_parallel=tensor,
        async_tp=overlapped,
        checkpointing=recompute == "full",
        expert_parallel=spread,
    )
    kept: dict[str, str] = {}  # the Linears the format cannot run (apply_policy would refuse them): priced in bf16
    if given is None:
        for shape in step.linears:
            problem = candidate_format.family.module_problem(candidate_format, found.model.get_submodule(shape.name))
            if problem:
                kept[shape.name] = problem
        chosen = uniform(candidate_format, step, keep=kept)
        label = f"{candidate_format.value} (every Linear it runs; the rest bf16)"
        refused = policy_problem(chosen, found.model)  # the rest of apply_policy's rules: fp32 weights, names
        if refused:
            raise UserError(f"--format {fmt}: apply_policy refuses it for {model}, so predict does not price it: {refused}")
    else:
        chosen = given
        # every name any phase lists: the last phase's layers hold them all (each phase adds to those before)
        unknown = [n for n in chosen.phase_layers(len(chosen.phases)) if n != ROOT and n not in step.modules]
        if unknown:
            raise UserError(
                f"--policy {policy}: names {unknown[0]!r}, which is no module of {model}; its modules are named as "
                "named_modules() gives them (e.g. "
                f"{', '.join(repr(n) for n in list(step.modules)[1:3])})"
            )
        refused = policy_problem(chosen, found.model)
        if refused:
            raise UserError(
                f"--policy {policy}: apply_policy refuses this policy for {model}, so predict does not price it: {refused}"
            )
        label = str(policy)
        if chosen.phases:
            shares = ", ".join(f"{share:.0%}" for share in chosen.phase_shares())
            label += f" (a schedule: {len(chosen.phases) + 1} phases priced alone, averaged by their shares of the run, {shares})"
    if fp8_all_gather is None and given is not None:  # neither the flag nor the layout says: the policy's own
        fp8_all_gather = given.fsdp_fp8_all_gather
    if typed_gather and chosen.phases:
        raise UserError(
            f"--fp8-all-gather: --policy {policy} has phases, and apply_policy refuses an fp8 all-gather with them (a "
            "phase switches formats in place; FSDP2 wraps the weights once); leave it out"
        )
    gathers_fp8 = bool(fp8_all_gather) and _gathers_fp8(chosen, shards, priced, said)
    step = dataclasses.replace(step, fp8_all_gather=gathers_fp8)
    formats = set(chosen.formats) | ({candidate_format} if given is None else set())
    missing = lacking(formats, device)
    if missing:
        needs = ", ".join(f"the {', '.join(p)} GEMMs {f} needs" for f, p in sorted(missing.items()))
        able = [t.name for t in targets() if not lacking(formats, t)]  # every format the candidate has, not just these
        it = "it" if len(missing) == 1 else "them"
        where = f"--target {' or '.join(able)} runs {it}" if able else "no registered target runs every format it holds"
        raise UserError(
            f"target {device.name} ({device.device}) runs {', '.join(device.runs)}, not {needs}: {where}; or predict "
            f"a format {device.name} runs"
        )
    base, mine = predict(step, baseline(), device), predict(step, chosen, device, experts=grouped_format)
    value = base.ms / mine.ms if mine.ms > 0 else 1.0
    stated = regime_band(
        step,
        chosen,
        outside_share=found.coverage.weighted_outside_share,
        experts=grouped_format,
        data_parallel=max(p.parts.get("data_parallel", 0.0) / p.ms if p.ms > 0 else 0.0 for p in (base, mine)),
        unhidden=max(p.unhidden_ms / p.ms if p.ms > 0 else 0.0 for p in (base, mine)),
    )
    result = {
        "model": str(model),
        "target": device.name,
        "device": device.device,
        "tokens": step.tokens,
        "candidate": label,
        "bf16_ms": base.ms,
        "candidate_ms": mine.ms,
        "speedup": value,
        "error": stated.error,
        "validation_points": stated.points,
        "predicted": True,
        "what": describe(value, device, stated.text),
        "band": stated.text,
        "parts_ms": {"bf16": dict(base.parts), "candidate": dict(mine.parts)},
        "kept_bf16": kept,
        "experts": None if grouped_format is None else grouped_format.value,
        "layout": {
            "dp_shard": shards,
            "dp_replicate": replicas,
            "fp8_all_gather": gathers_fp8,
            "grad_accum": micro,
            "tp": tensor,
            "async_tp": overlapped,
            "checkpointing": recompute,
            "ep": spread,
            "said": said,
            **({"from": str(layout)} if read is not None else {}),
        },
        "coverage": found.coverage.to_dict(),
        "traced_on": found.device,
        "absolute_validated": False,  # the times are the predictor's parts; only their ratio is checked against runs
        # published and measured bf16 steps took this many times the predicted one (docs/planning.md)
        "absolute_measured_over_predicted": list(ABSOLUTE_SHORT),
        "left_out": unpriced
        + "an MoE's unbalanced routing (balanced assumed)"
        + ("" if spread > 1 or not step.grouped else " and, if it trains expert-parallel, its all-to-alls (--ep N prices them)")
        + ", host overhead, power and clock limits",
    }
    lines = [
        f"{model}: {step.tokens * micro:,.0f} tokens per step"
        + (f" ({micro} micro-batches of {step.tokens:,.0f})" if micro > 1 else "")
        + f", {len(step.linears)} Linear layers, on {device.name} ({device.device}); "
        + _data_parallel_words(shards, replicas, fsdp, priced, gathers_fp8)
        + (
            f"; tensor parallel over {tensor} ranks (sequence-parallel, "
            + (
                "asynchronous: collectives fused with their GEMMs where torch fuses them)"
                if overlapped
                else "collectives not overlapped)"
            )
            if tensor > 1
            else ""
        )
        + (f"; experts over {spread} expert-parallel ranks (all-to-alls not overlapped)" if spread > 1 else "")
        + ("; full activation checkpointing" if recompute == "full" else "")
        + (f"; the layout read from {layout} (a flag given overrides it)" if read is not None else ""),
        f"  uniform bf16: {base.ms:.4g} ms per step (predicted; a step time, not a capacity plan: only the ratio of two "
        f"is validated; published bf16 steps took {ABSOLUTE_SHORT[0]:.1f}-{ABSOLUTE_SHORT[1]:.1f}x the predicted one, "
        "host time and the runs' clocks not being in it)",
        f"  {label}: {mine.ms:.4g} ms per step (predicted)",
        f"  speedup: {describe(value, device, stated.text)}; not a measurement",
        "  parts (ms, bf16 -> candidate): " + ", ".join(f"{k} {base.parts[k]:.3g} -> {mine.parts[k]:.3g}" for k in base.parts),
        f"  left out: {result['left_out']}",
    ]
    if said:
        lines.append(f"  layout: {'; '.join(said)}")
    if kept:
        first, why = next(iter(kept.items()))
        lines.insert(
            3,
            f"  {len(kept)} Linear(s) {candidate_format.value} cannot run, priced in bf16: {first!r} ({why}){', ...' if len(kept) > 1 else ''}",
        )
    if grouped_format is not None:
        lines.append(
            f"  experts: their grouped GEMMs priced in {grouped_format.value}, a plan: apply_policy runs an MoE's "
            "grouped experts in the model root's format; routing priced as balanced (a run with a new, unforced router "
            "gained far more from MXFP8 experts than predicted: docs/planning.md)"
        )
    if found.coverage.worth_saying:
        lines.append(
            "  outside the Linears: "
            + found.coverage.sentence(
                tuned="Linears priced in the policy's formats",
                rest="is priced in bf16 whatever the policy"
                + (f" (but the grouped experts, in {grouped_format.value} by --experts)" if grouped_format else ""),
            )
        )
    if found.meta_failure:
        lines.append(
            f"  traced on the CPU with the model's weights: the meta device could not run loss_fn ({found.meta_failure})"
        )
    return result, "\n".join(lines)


def _gathers_fp8(policy: Policy, shards: int, priced: bool, said: list[str]) -> bool:
    """Whether FSDP gathers some of `policy`'s weights in fp8, asked to; where it cannot, why is added to `said`, as
    apply_policy warns where no layer's format gathers in fp8. `priced`: the data-parallel communication is."""
    why = None
    if not priced:
        why = "the data-parallel communication is not priced"
    elif shards == 1:
        why = "the layout shards no weights over data-parallel ranks"
    elif policy.phases:
        why = "the policy has phases, and apply_policy refuses an fp8 all-gather with them"
    elif not policy.fp8_gatherable:
        why = f"no Linear runs a format FSDP2 gathers in fp8 ({gatherable_text()})"
    if why:
        said.append(f"torchao's fp8 all-gather left out: {why}")
    return why is None


def _data_parallel_words(shards: int, replicas: int, fsdp: bool, priced: bool, fp8: bool) -> str:
    """The data-parallel layout in words, as the text's first line says it; `fsdp` False: Megatron's."""
    if not fsdp:
        return "the optimizer's work on " + (
            f"{shards} data-parallel ranks (Megatron's distributed optimizer)" if shards > 1 else "every rank (Megatron)"
        )
    if shards == 1 and replicas == 1:
        return "the optimizer's work on one rank (--dp-shard N: FSDP over N)"
    if shards == 1:
        words = f"the optimizer's work on every one of {replicas} data-parallel replicas"
        how = " (their gradients all-reduced, overlapped with the backward)"
    else:
        words = f"the optimizer's work on {shards} data-parallel ranks" + (f", {replicas} replicas" if replicas > 1 else "")
        how = " (FSDP2's collectives overlapped as it overlaps them" + (", weights gathered in fp8)" if fp8 else ")")
    return words + (how if priced else " (their communication not priced)")


def _switch(p: argparse.ArgumentParser, flag: str, what: str, default: str = "as --layout says, else not") -> None:
    """A yes-or-no flag with its --no- form, unset (None) where not given, so that `default` (its help's words) holds."""
    p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"{what} (default: {default})")


def _predict_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a model.py (build_model, batches, loss_fn)")
    p.add_argument("--target", required=True, metavar="{" + ",".join(t.name for t in planned_for()) + "}")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy", help="a policy.json to price")
    which.add_argument("--format", help="price every Linear in this format, the rest in bf16")
    p.add_argument("--tokens", metavar="N", help="tokens (rows) per micro-batch (default: one train batch's)")
    p.add_argument("--dp-shard", metavar="N", help="data-parallel ranks the optimizer's state is sharded over (FSDP; default 1)")
    p.add_argument("--dp-replicate", metavar="N", help="data-parallel replicas beside the shards (HSDP; default 1)")
    _switch(
        p,
        "--fp8-all-gather",
        "FSDP gathers tensorwise-fp8 Linears' weights in fp8, as torchao's enable_fsdp_float8_all_gather does",
        "as --layout says, else as the policy file does, else not",
    )
    p.add_argument("--grad-accum", metavar="N", help="micro-batches per optimizer step (default 1)")
    p.add_argument("--tp", metavar="N", help="tensor-parallel ranks each Linear is sharded over (sequence-parallel; default 1)")
    _switch(
        p,
        "--async-tp",
        "tensor parallelism's collectives overlapped with their GEMMs, as torch's asynchronous TP (torchtitan's "
        "enable_async_tensor_parallel) runs them",
    )
    p.add_argument("--checkpointing", metavar="{none,full}", help="activation checkpointing (default none)")
    p.add_argument("--experts", metavar="F", help="price an MoE's grouped expert GEMMs in F (bf16 or mxfp8; a plan)")
    p.add_argument("--ep", metavar="N", help="expert-parallel ranks an MoE's experts are spread over (default 1)")
    p.add_argument(
        "--layout",
        metavar="FILE",
        help="read the layout from a torchtitan .toml or a launch's arguments (torchtitan's or Megatron-LM's flags)",
    )


def cmd_predict(args: argparse.Namespace) -> int:
    result, text = command(
        args.model,
        target=args.target,
        policy=args.policy,
        fmt=args.format,
        tokens=args.tokens,
        dp_shard=args.dp_shard,
        dp_replicate=args.dp_replicate,
        fp8_all_gather=args.fp8_all_gather,
        grad_accum=args.grad_accum,
        tp=args.tp,
        async_tp=args.async_tp,
        checkpointing=args.checkpointing,
        experts=args.experts,
        ep=args.ep,
        layout=args.layout,
    )
    if args.json:
        print_json(args, result, indent=2)
    else:
        print(text)
    return 0


PREDICT = Verb(
    "predict",
    "predict a policy's training-step time on a target GPU from the model's shapes (no GPU needed)",
    _predict_arguments,
    cmd_predict,
    description="predict the training-step time of uniform bf16 and of a policy or format on a target GPU, from "
    "the model's shapes on the meta device (docs/planning.md); a prediction with its error band, not a measurement",
)
