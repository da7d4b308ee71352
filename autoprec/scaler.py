"""grad_scaler: a torch.amp.GradScaler with the policy's loss-scale settings that, when the scale
collapses, names the layers whose gradients were non-finite."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from autoprec.apply import applied_summary, models_with
from autoprec.formats import Format, default_device
from autoprec.policy import Policy, as_policy

DEFAULT_WARN_AFTER_SKIPS = 10


def _governing_layer(param_name: str, layers: Mapping[str, Format]) -> str | None:
    """The innermost listed layer whose format covers this parameter, or None."""
    parts = param_name.split(".")[:-1]
    for cut in range(len(parts), -1, -1):
        name = ".".join(parts[:cut])
        if name in layers:
            return name
    return None


def _layers_now(model: torch.nn.Module, policy: Policy) -> Mapping[str, Format]:
    """The layers of the phase the model runs now, where it runs this policy's schedule; else the policy's layers."""
    summary = applied_summary(model)
    if summary is not None and summary.policy == policy:
        return policy.phase_layers(summary.phase)
    return policy.layers


def nonfinite_layers(model: torch.nn.Module, policy: Policy) -> list[str]:
    """The layers whose parameters hold non-finite gradients, as "name (format)": fp16 layers first (an
    overflow there is the usual cause, and it spreads to every layer before it), then in model order.

    A parameter outside every listed layer is named by its module, marked "not in the policy".
    One device sync for the whole model.
    """
    model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper prefixes every name with _orig_mod
    layers = _layers_now(model, policy)
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return []
    dev = named[0][1].device
    finite = torch.stack([torch.isfinite(g).all().to(dev) for _, g in named]).tolist()
    out: list[str] = []
    for (name, _), ok in zip(named, finite):
        if ok:
            continue
        layer = _governing_layer(name, layers)
        label = (
            f"{layer or '<model>'} ({layers[layer]})"
            if layer is not None
            else f"{name.rpartition('.')[0] or '<model>'} (not in the policy)"
        )
        if label not in out:
            out.append(label)
    return sorted(out, key=lambda label: not label.endswith(f"({Format.FP16})"))


def _checks_inf_itself(optimizer: torch.optim.Optimizer) -> bool:
    """Fused (and other amp-aware) optimizers take GradScaler's inf flags into their own step, which then always
    runs; GradScaler.step branches on the same attribute."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False) or optimizer.defaults.get("fused"))


class PolicyGradScaler(torch.amp.GradScaler):
    """A torch.amp.GradScaler that notices a collapsing loss scale and names the layers behind it.

    After `warn_after_skips` skipped steps in a row, or once the scale falls below 1, it warns once per
    run of skipped steps, naming the layers whose gradients were non-finite (it needs the model: passed
    as `model=`, or the one model this policy was applied to). It uses GradScaler's public API only: a
    skipped step is one whose optimizer step never ran (seen through the optimizer's step hook), so clean
    steps cost nothing extra; a fused optimizer, which runs its step and skips inside it, is read off the
    scale (one sync per update).
    """

    def __init__(
        self,
        device: str,
        *,
        policy: Policy,
        model: torch.nn.Module | None = None,
        warn_after_skips: int = DEFAULT_WARN_AFTER_SKIPS,
        warn: bool = True,
        **kwargs: Any,
    ) -> None:
        if isinstance(warn_after_skips, bool) or not isinstance(warn_after_skips, int) or warn_after_skips < 1:
            raise ValueError(f"warn_after_skips must be an integer >= 1, but got {warn_after_skips!r}")
        super().__init__(device, **kwargs)
        self.policy = policy
        self.warn_after_skips = warn_after_skips
        self.warn = warn  # False: count skipped steps, name no layers, warn never (a caller that reports them itself)
        self._model = weakref.ref(model) if model is not None else None
        self.skipped_steps = 0  # in total
        self.consecutive_skips = 0
        self.last_nonfinite_layers: list[str] = []  # from the latest skipped step
        self._warned = False
        # Since the last update: whether step() was called, and whether every optimizer's own step ran (None:
        # unknown, an optimizer that unscales inside its own step ran regardless).
        self._stepped = False
        self._all_ran: bool | None = True
        self._scale_seen = float(kwargs.get("init_scale", 2.0**16))  # the scale after the last update

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """GradScaler.step, noting whether the optimizer's step ran (a skipped step never calls it) through the
        optimizer's public step hook: no extra device sync."""
        if not self.is_enabled():
            return super().step(optimizer, *args, **kwargs)
        ran: list[bool] = []
        try:
            handle = optimizer.register_step_pre_hook(lambda *_: ran.append(True))
        except AttributeError:  # a wrapper that is not a torch Optimizer inside (accelerate's): read the scale instead
            handle = None
        try:
            out = super().step(optimizer, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        self._stepped = True
        if handle is None or _checks_inf_itself(optimizer):  # its step runs regardless: read off the scale
            self._all_ran = None
        elif self._all_ran is not None:
            self._all_ran = self._all_ran and bool(ran)  # one optimizer skipped: the step counts as skipped
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.is_enabled():
            self._scale_seen = self.get_scale()  # a resumed run's scale, for the next comparison

    def _the_model(self) -> torch.nn.Module | None:
        if self._model is not None:
            return self._model()
        # Equal, not only identical: grad_scaler and apply_policy may each have loaded the same file.
        matches = models_with(self.policy)
        return matches[0] if len(matches) == 1 else None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        stepped, all_ran = self._stepped, self._all_ran
        self._stepped, self._all_ran = False, True
        if not self.is_enabled() or new_scale is not None or not stepped:
            super().update(new_scale)
            if self.is_enabled():
                self._scale_seen = self.get_scale()
            return
        # A skipped step is known without a sync when the optimizer's step did not run; a fused optimizer's is
        # read off the scale, which backs off exactly when a step had inf/NaN gradients (static scaling too).
        skipped = not all_ran if all_ran is not None else None
        model = self._the_model() if skipped is not False and self.warn else None
        # gradients still hold the step's values; for the fused case this is spent only when the scale backs off
        layers = nonfinite_layers(model, self.policy) if model is not None and skipped else None
        super().update()
        if skipped is None:
            scale = self.get_scale()
            skipped = scale < self._scale_seen
            self._scale_seen = scale
            if skipped and model is not None:
                layers = nonfinite_layers(model, self.policy)
        if not skipped:
            self.consecutive_skips, self._warned = 0, False
            return
        if layers is not None:
            self.last_nonfinite_layers = layers
        self.skipped_steps += 1
        self.consecutive_skips += 1
        scale = self.get_scale()
        self._scale_seen = scale
        if self.warn and not self._warned and (self.consecutive_skips >= self.warn_after_skips or scale < 1.0):
            self._warned = True
            warnings.warn(self._collapse_message(scale, model is not None), stacklevel=2)

    def _collapse_message(self, scale: float, named: bool) -> str:
        head = f"autoprec: the loss scale is collapsing ({self.consecutive_skips} steps skipped in a row, scale now {scale:g}); "
        if not named:
            return head + "pass model= to grad_scaler to learn which layers' gradients were non-finite"
        where = ", ".join(self.last_nonfinite_layers) or "no parameter (the non-finite values were elsewhere)"
        return (
            head + f"non-finite gradients in: {where}. An fp16 layer that overflows is the usual cause: "
            "set it to bf16 or fp32 in the policy"
        )


def grad_scaler(
    policy: Policy | str | Path,
    device: str | torch.device | None = None,
    *,
    model: torch.nn.Module | None = None,
    warn_after_skips: int = DEFAULT_WARN_AFTER_SKIPS,
    warn: bool = True,
) -> PolicyGradScaler:
    """A GradScaler with the policy's loss-scale settings; disabled when no layer is fp16.

    Returns a torch.amp.GradScaler subclass (PolicyGradScaler), used as any GradScaler: `scale(loss).backward()`,
    `step(optimizer)`, `update()`. It is enabled only where a layer's format needs loss scaling (fp16, the policy's
    `uses_fp16`); disabled, its calls pass the loss and the step through unchanged, so a training loop can call it
    whatever the policy. It starts at the policy's `loss_scale.init_scale` with its growth and backoff settings.
    Static scaling (`dynamic: false`) never grows the scale; a step with inf/NaN gradients is still skipped and the
    scale backs off. A scale that collapses (`warn_after_skips` skipped steps in a row, or below 1) warns once per
    run of skipped steps, naming the layers with non-finite gradients of `model` (or of the one model this policy
    was applied to).

    Args:
        policy: An autoprec.Policy, or the path of a policy file (str or Path).
        device: The device type the scaler works on ("cuda", "cpu", or a torch.device, of which the type is
            used). Default None: cuda when available, else cpu.
        model: The model the policy was applied to, for naming the layers whose gradients were non-finite. Default
            None: the one live model this policy (or an equal one) was applied to, if exactly one; else the warning
            names none and says to pass `model=`.
        warn_after_skips: Skipped steps in a row before the collapse warning (an integer >= 1). Default 10.
        warn: False: never warn, only count the skipped steps (`skipped_steps`, `consecutive_skips`), for a caller
            that reports them itself. Default True.

    Returns:
        PolicyGradScaler: a torch.amp.GradScaler, enabled where the policy has an fp16 layer.

    Raises:
        ValueError: `warn_after_skips` is not an integer >= 1.
        TypeError: `policy` is a dict (use Policy.from_dict).
        autoprec.UserError: `policy` is a path that is not a readable, valid policy file.

    Example:
        >>> import torch
        >>> import autoprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> policy = autoprec.Policy(layers={"0": "fp16", "2": "bf16"})
        >>> model = autoprec.apply_policy(model, policy)
        >>> scaler = autoprec.grad_scaler(policy, "cpu", model=model)
        >>> scaler.is_enabled(), scaler.get_scale()
        (True, 65536.0)
        >>> autoprec.grad_scaler(autoprec.Policy(layers={"0": "bf16"}), "cpu").is_enabled()
        False
    """
    policy = as_policy(policy, caller="grad_scaler")
    if device is None:
        device = default_device()
    ls = policy.loss_scale
    return PolicyGradScaler(
        torch.device(device).type,
        policy=policy,
        model=model,
        warn_after_skips=warn_after_skips,
        warn=warn,
        init_scale=ls.init_scale,
        growth_factor=ls.growth_factor,
        backoff_factor=ls.backoff_factor,
        growth_interval=ls.growth_interval if ls.dynamic else 2**31 - 1,
        enabled=policy.uses_fp16,
    )


__all__ = ["grad_scaler", "PolicyGradScaler", "nonfinite_layers", "DEFAULT_WARN_AFTER_SKIPS"]
