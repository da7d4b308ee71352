"""`autoprec predict`: a policy's training-step time on a target GPU, from the model's shapes (no GPU needed)."""

from __future__ import annotations

import argparse

from autoprec.tune._commands._shared import Verb, print_json
from autoprec.tune._core._targets import targets as planned_for
from autoprec.tune._measure._predict import command


def _predict_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a model.py (build_model, batches, loss_fn)")
    p.add_argument("--target", required=True, metavar="{" + ",".join(t.name for t in planned_for()) + "}")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy", help="a policy.json to price")
    which.add_argument("--format", help="price every Linear in this format, the rest in bf16")
    p.add_argument("--tokens", metavar="N", help="tokens (rows) per micro-batch (default: one train batch's)")
    p.add_argument("--dp-shard", metavar="N", help="data-parallel ranks the optimizer's state is sharded over (FSDP; default 1)")
    p.add_argument("--grad-accum", metavar="N", help="micro-batches per optimizer step (default 1)")
    p.add_argument("--tp", metavar="N", help="tensor-parallel ranks each Linear is sharded over (sequence-parallel; default 1)")
    p.add_argument("--checkpointing", metavar="{none,full}", help="activation checkpointing (default none)")
    p.add_argument("--experts", metavar="F", help="price an MoE's grouped expert GEMMs in F (bf16 or mxfp8; a plan)")


def cmd_predict(args: argparse.Namespace) -> int:
    result, text = command(
        args.model,
        target=args.target,
        policy=args.policy,
        fmt=args.format,
        tokens=args.tokens,
        dp_shard=args.dp_shard,
        grad_accum=args.grad_accum,
        tp=args.tp,
        checkpointing=args.checkpointing,
        experts=args.experts,
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
