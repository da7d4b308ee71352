"""Fine-tune the digits model under Lightning with a policy autoprec wrote, through autoprec's precision plugin.

autoprec search examples/digits/model.py --budget 0.01          # writes results/digits/policy.json
python examples/digits/train_lightning.py results/digits/policy.json --steps 50
"""

import argparse
import importlib.util
from pathlib import Path

import lightning
import torch

from autoprec.integrations.lightning import PolicyPrecision

# this folder's model.py, by path: another module named `model` may already be imported
_SPEC = importlib.util.spec_from_file_location("digits_example", Path(__file__).with_name("model.py"))
example = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(example)


class Digits(lightning.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        return example.loss_fn(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit(policy, steps, net=None):
    """`steps` optimizer steps of the digits model under `policy`; returns (module, plugin)."""
    module = Digits(net if net is not None else example.build_model())
    plugin = PolicyPrecision(policy, device="cpu", submodule="net")  # the policy names the layers of self.net
    trainer = lightning.Trainer(plugins=[plugin], accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                                enable_model_summary=False, gradient_clip_val=1.0)  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(example.batches("train"), batch_size=None))  # already batched
    return module, plugin


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", help="a policy.json written by autoprec search")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    module, plugin = fit(args.policy, args.steps)
    module.net.eval()
    with torch.no_grad():
        accuracy = example.evaluate(module.net)
    print(
        f"accuracy {accuracy:.4f} after {args.steps} steps under {args.policy}; GradScaler "
        f"{'on' if plugin.scaler.is_enabled() else 'off (no fp16 layer)'}, {plugin.scaler.skipped_steps} steps skipped"
    )


if __name__ == "__main__":
    main()
