"""Lightning under an autoprec policy: a precision plugin.

    from autoprec.integrations.lightning import PolicyPrecision

    trainer = lightning.Trainer(plugins=[PolicyPrecision("results/mymodel/policy.json")], ...)
    trainer.fit(module, data)

The plugin applies the policy to the LightningModule when the strategy converts it (on its device, before any
DDP wrapper), runs the forward as the policy says (no whole-model autocast around it) and, for fp16 layers,
scales the loss with the policy's GradScaler: gradients unscaled before clipping, a step with inf/NaN gradients
skipped, the scale updated; after each optimizer step, what the policy needs there (autoprec.after_optimizer_step:
its fp8 weights' scales where FSDP2 all-gathers them in fp8). A policy with phases follows its schedule: before each
training forward, autoprec.follow_schedule with the Trainer's global_step and its estimated_stepping_batches (the run's
optimizer steps: max_steps, or the epochs' batches). Pass it instead of Trainer's `precision=`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from autoprec import devices
from autoprec.apply import after_optimizer_step, applied_policy, apply_policy
from autoprec.formats import default_device
from autoprec.policy import Policy, as_policy
from autoprec.scaler import grad_scaler
from autoprec.schedule import follow_schedule

__all__ = ["PolicyPrecision"]


class PolicyPrecision(MixedPrecision):
    """Lightning's mixed-precision plugin with the policy in place of one autocast: `policy` is a Policy or a
    policy file, `device` the accelerator type ("cuda", "cpu"; default cuda when available), `submodule` where
    the searched model sits inside the LightningModule (`"net"` for `self.net`; default the LightningModule
    itself). `scaler` is the policy's GradScaler, disabled (every call a no-op) when no layer is fp16."""

    def __init__(self, policy: Policy | str | Path, device: str | None = None, *, submodule: str = "") -> None:
        self.policy = as_policy(policy, caller="PolicyPrecision")
        self.submodule = submodule
        device = device or default_device().type
        super().__init__("16-mixed", device, scaler=grad_scaler(self.policy, device))
        self.precision = "autoprec-policy"  # type: ignore[assignment]  # trainer.precision: per layer, not one dtype
        self._module: Any = None  # the LightningModule converted last: its trainer's step counter drives a schedule
        self._total_steps: tuple[int, int] | None = None  # (id of the trainer, its run's optimizer steps)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = module.to(self._root_device(module))  # apply_policy wants the model on its device
        try:
            searched = module.get_submodule(self.submodule)
        except AttributeError:
            children = ", ".join(name for name, _ in module.named_children()) or "none"
            raise ValueError(
                f"PolicyPrecision(submodule={self.submodule!r}): the LightningModule has no such submodule "
                f"(its children: {children}); name the attribute that holds the searched model"
            ) from None
        self._module, self._total_steps = module, None
        if applied_policy(searched) == self.policy:
            return module  # converted for an earlier fit (Lightning converts on every fit, validate, test, predict)
        apply_policy(searched, self.policy)
        # a fresh scaler that knows the model, to name the layers if the scale collapses (nothing has trained yet:
        # a checkpoint's scaler state is loaded after this)
        self.scaler = grad_scaler(self.policy, self.device, model=searched)
        return module

    def _root_device(self, module: torch.nn.Module) -> torch.device:
        """The strategy's device (a CPU run on a GPU machine runs on the CPU), else this plugin's."""
        try:
            return torch.device(module.trainer.strategy.root_device)  # type: ignore[union-attr,arg-type]
        except (AttributeError, RuntimeError):  # not attached to a Trainer
            return devices.lookup(self.device).indexed(torch.device(self.device))

    # Lightning's MixedPrecision.optimizer_step, whose signature mypy compares with fabric's Precision's
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        out = super().optimizer_step(optimizer, model, closure, **kwargs)
        after_optimizer_step(model)  # the LightningModule holds the policy's model (`submodule`)
        return out

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        yield  # the policy's own wrappers set each layer's precision

    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        if self.policy.phases:
            self._follow_schedule()
        with self.forward_context():
            yield

    def _follow_schedule(self) -> None:
        """The schedule's phase for the fit's step counter, before a training forward (also each micro-batch of an
        accumulated step, so all of a step's micro-batches run in one phase)."""
        trainer = getattr(self._module, "_trainer", None)  # None where not attached (a step outside a fit)
        if trainer is None:
            return
        if self._total_steps is None or self._total_steps[0] != id(trainer):
            total = trainer.estimated_stepping_batches
            if not isinstance(total, int) and not (isinstance(total, float) and total.is_integer()):
                raise ValueError(
                    f"PolicyPrecision: the policy has phases (a schedule over the run), but this fit's length is "
                    f"{total} optimizer steps; give the Trainer max_steps or max_epochs, so each phase's share of the "
                    "run is a step"
                )
            self._total_steps = (id(trainer), int(total))
        follow_schedule(self._module, step=trainer.global_step, total_steps=self._total_steps[1])
