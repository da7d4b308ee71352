"""Train the example under HF Trainer with a policy autoprec wrote, default TrainingArguments but for the length.

autoprec search examples/hf_gpt2/model.py --budget 0.02      # writes results/hf_gpt2/policy.json
python examples/hf_gpt2/train.py results/hf_gpt2/policy.json --steps 50
"""

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch
import transformers

from autoprec.integrations.transformers import PolicyTrainer

# this folder's model.py, by path: another module named `model` may already be imported
_SPEC = importlib.util.spec_from_file_location("hf_gpt2_example", Path(__file__).with_name("model.py"))
example = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(example)


def eval_loss(net):
    net.eval()
    device = next(net.parameters()).device
    with torch.no_grad():
        losses = [example.loss_fn(net, {k: v.to(device) for k, v in b.items()}).item() for b in example.batches("eval")]
    return sum(losses) / len(losses)


def train(policy, steps, model=None):
    """`steps` Trainer steps under `policy` on the train windows; returns the trainer."""
    net = model if model is not None else example.build_model()
    data = [{"input_ids": row, "labels": row} for b in example.batches("train") for row in b["input_ids"]]
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf_gpt2-"), max_steps=steps, report_to=[])
    trainer = PolicyTrainer(policy=policy, model=net, args=args, train_dataset=data)
    trainer.train()
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", help="a policy.json written by autoprec search")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    net = example.build_model()
    before = eval_loss(net)
    trainer = train(args.policy, args.steps, net)
    print(
        f"eval loss {before:.4f} -> {eval_loss(net):.4f} after {args.steps} steps under {args.policy}; "
        f"GradScaler {'on' if trainer.autoprec_scaler.is_enabled() else 'off (no fp16 layer)'}, "
        f"{trainer.autoprec_scaler.skipped_steps} steps skipped"
    )


if __name__ == "__main__":
    main()
