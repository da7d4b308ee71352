"""Hugging Face Trainer under an autoprec policy.

    from autoprec.integrations.transformers import PolicyTrainer

    trainer = PolicyTrainer(policy="results/gpt2/policy.json", model=model, args=args, train_dataset=data)
    trainer.train()

PolicyTrainer is a `transformers.Trainer` that moves the model to the training device and applies the policy
before Trainer sees it, and, when the policy has fp16 layers, hands the policy's GradScaler (its loss-scale
settings) to Trainer's accelerator: the loss is scaled before backward, gradients unscaled before clipping, a
step with inf/NaN gradients skipped (the learning-rate schedule with it) and the scale updated. After each
optimizer step it does what the policy needs there (autoprec.after_optimizer_step: its fp8 weights' scales where
FSDP2 all-gathers them in fp8). A policy with phases follows its schedule: before each step, autoprec.follow_schedule
with Trainer's step counter and its max_steps (a resumed run switches from where it resumes). Leave
TrainingArguments' `bf16`/`fp16` off: they put the model under one autocast, around the policy, which changes the
layers the policy does not name (none, when it names the model itself, as a searched policy does).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

from autoprec.apply import after_optimizer_step, apply_policy
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy, as_policy
from autoprec.scaler import PolicyGradScaler, grad_scaler
from autoprec.schedule import follow_schedule

__all__ = ["PolicyTrainer"]


class PolicyTrainer(transformers.Trainer):
    """transformers.Trainer training `model` under `policy` (a Policy or a policy file); every other argument
    is Trainer's. `autoprec_scaler` is the policy's GradScaler (disabled when no layer is fp16)."""

    def __init__(
        self,
        *,
        policy: Policy | str | Path,
        model: torch.nn.Module,
        args: transformers.TrainingArguments | None = None,
        **kwargs: Any,
    ):
        policy = as_policy(policy, caller="PolicyTrainer")
        args = args if args is not None else transformers.TrainingArguments(output_dir="trainer_output")
        _warn_conflicts(policy, args)
        if getattr(model, "hf_device_map", None) is None:  # a model HF placed across devices stays where it is
            model = model.to(args.device)
        model = apply_policy(model, policy)  # on its device first, as apply_policy asks
        super().__init__(model=model, args=args, **kwargs)
        self.add_callback(_AfterOptimizerStep())
        if policy.phases:
            self.add_callback(_FollowSchedule())
        self.autoprec_scaler: PolicyGradScaler = grad_scaler(policy, args.device, model=model)
        if self.autoprec_scaler.is_enabled():
            # accelerate scales the loss in backward and steps, skips and updates through its scaler
            self.accelerator.scaler = self.autoprec_scaler

    def training_step(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, *args, **kwargs)
        accelerate_unscales = self.accelerator.native_amp and self.accelerator.mixed_precision == "fp16"
        if self.autoprec_scaler.is_enabled() and self.accelerator.sync_gradients and not accelerate_unscales:
            # before Trainer clips: accelerate unscales (with our scaler) only under its own fp16 mode, and a clip
            # of scaled gradients would shrink every step by the loss scale
            inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps the torch optimizer
            assert inner is not None, "Trainer steps with an optimizer"
            self.autoprec_scaler.unscale_(inner)
        return loss


class _AfterOptimizerStep(transformers.TrainerCallback):
    """What the policy needs after each optimizer step (autoprec.after_optimizer_step), where Trainer steps."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if model is not None:
            after_optimizer_step(model)


class _FollowSchedule(transformers.TrainerCallback):
    """The policy's schedule followed by Trainer's step counter: each step in the phase its share of max_steps says."""

    def on_step_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if model is not None:
            follow_schedule(model, step=state.global_step, total_steps=state.max_steps)


def _warn_conflicts(policy: Policy, args: transformers.TrainingArguments) -> None:
    root = policy.layers.get(ROOT, Format.FP32)
    flags = [name for name in ("bf16", "fp16") if getattr(args, name, False) and name != root.value]
    if not flags:
        return
    flag = flags[0]
    if ROOT in policy.layers:
        # The model's own wrapper sets its format inside (fp32: autocast off), so Trainer's autocast stops at it.
        what = (
            f"does not change how the model runs: the policy names the model itself ({root}), whose format holds "
            f"inside it, so every layer runs as the policy says and {flag} autocast reaches only code outside the "
            f"model's forward (a loss computed from its outputs); set {flag}=False, which trains the model the same"
        )
    else:
        what = (
            f"puts the whole model under {flag} autocast, around the policy: its layers keep their formats, but "
            f"everything else runs in {flag} where the policy says {root}; set {flag}=False to train as the policy "
            "was measured"
        )
    warnings.warn(
        f"TrainingArguments({flag}=True) {what}"
        + ("; the policy's GradScaler replaces the one fp16=True makes" if "fp16" in flags and policy.uses_fp16 else ""),
        stacklevel=3,
    )
