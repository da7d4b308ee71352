"""apply_policy and grad_scaler: per-module autocast, torchao float8 linears, a GradScaler from the policy."""

from __future__ import annotations

import logging
import types
import warnings
from pathlib import Path
from typing import Any

import torch

from autoprec.formats import AUTOCAST_DTYPE, Format, fp8_shape_problem, has_fp8_kernels
from autoprec.policy import ROOT, Policy, load_policy
from autoprec.task import map_tensors

log = logging.getLogger("autoprec")

_FORMAT_ATTR = "_autoprec_format"
_APPLIED_ATTR = "_autoprec_policy"
_LOW = (torch.float16, torch.bfloat16)


def _import_float8() -> Any:
    """torchao.float8, imported with its loader's noise (missing CUDA extensions on CPU) kept out of the logs."""
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in noisy]
    for lg in noisy:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for lg, level in zip(noisy, levels):
            lg.setLevel(level)
    return float8


def fp8_backend(device: torch.device | str) -> str:
    """How fp8 layers run on this device: real kernels or torchao's emulation."""
    return "torchao float8 kernels" if has_fp8_kernels(device) else "torchao float8 emulation"


def _first_device_type(module: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    param = next(module.parameters(), None)
    return param.device.type if param is not None else "cpu"


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW else t


def _policy_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module the policy lists: its format inside, the caller's precision outside."""
    fmt: Format = getattr(self, _FORMAT_ATTR)
    dev = _first_device_type(self, args, kwargs)
    inner = type(self).forward
    if fmt is Format.FP32:
        # Inputs may arrive in bf16/fp16 from a lowered neighbour; autocast-off code needs fp32.
        args, kwargs = map_tensors((args, kwargs), _to_fp32)
        with torch.autocast(dev, enabled=False):
            return inner(self, *args, **kwargs)
    outer_autocast = torch.is_autocast_enabled(dev)
    if fmt is Format.FP8:
        out = inner(self, *args, **kwargs)  # Float8Linear follows the surrounding autocast dtype
    else:
        with torch.autocast(dev, dtype=AUTOCAST_DTYPE[fmt]):
            out = inner(self, *args, **kwargs)
    # Outside any autocast the caller's code expects fp32, as it did before the policy.
    return out if outer_autocast else map_tensors(out, _to_fp32)


def _check_layers(model: torch.nn.Module, policy: Policy) -> dict[str, torch.nn.Module]:
    modules = dict(model.named_modules())
    missing = [name for name in policy.layers if name not in modules]
    if missing:
        known = [n for n in modules if n][:8]
        raise ValueError(
            f"policy names layers the model lacks: {', '.join(map(repr, missing))} "
            f"(the model has e.g. {', '.join(known)}{', ...' if len(modules) > 9 else ''})"
        )
    for name, fmt in policy.layers.items():
        if fmt is Format.FP8:
            problem = fp8_shape_problem(modules[name])
            if problem:
                raise ValueError(f"layer {name!r} cannot be fp8: {problem}")
    return modules


def _convert_fp8(model: torch.nn.Module, names: set[str], device: torch.device) -> None:
    float8 = _import_float8()
    emulate = not has_fp8_kernels(device)
    config = float8.Float8LinearConfig(emulate=emulate)
    if emulate and device.type == "cpu" and torch.cuda.is_available():
        warnings.warn(
            "apply_policy: the model is on the CPU, so its fp8 layers use torchao's emulation; "
            "move the model to the GPU before apply_policy to use fp8 kernels",
            stacklevel=3,
        )
    float8.convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in names, config=config)
    log.info("fp8 layers %s use %s", sorted(names), fp8_backend(device))


def _nearest_listed_ancestor(name: str, layers: dict[str, Format]) -> Format | None:
    parts = name.split(".") if name else []
    for cut in range(len(parts) - 1, -1, -1):
        ancestor = ".".join(parts[:cut])
        if ancestor in layers:
            return layers[ancestor]
    return None


def apply_policy(model: torch.nn.Module, policy: Policy | str | Path) -> torch.nn.Module:
    """Put a policy on a model in place (also accepts a policy file's path) and return the model.

    State-dict keys and dtypes do not change: listed modules keep their parameters and get a forward
    that runs under their format; fp8 linears become torchao Float8Linear (a subclass of nn.Linear).
    """
    if not isinstance(policy, Policy):
        policy = load_policy(policy)
    if any(hasattr(m, _FORMAT_ATTR) for m in model.modules()) or hasattr(model, _APPLIED_ATTR):
        raise ValueError("apply_policy: this model already has a policy applied; apply a policy once, to a fresh model")
    _check_layers(model, policy)
    fp8 = {name for name, fmt in policy.layers.items() if fmt is Format.FP8}
    if fp8:
        param = next(model.parameters(), None)
        _convert_fp8(model, fp8, param.device if param is not None else torch.device("cpu"))
    modules = dict(model.named_modules())
    for name, fmt in sorted(policy.layers.items(), key=lambda kv: kv[0].count(".") + bool(kv[0])):
        module = modules[name]
        if "forward" in module.__dict__:
            raise ValueError(f"apply_policy: layer {name!r} already has a per-instance forward; autoprec cannot wrap it")
        setattr(module, _FORMAT_ATTR, fmt)
        # A layer in the same format as its nearest listed ancestor is already covered by it.
        if fmt is not Format.FP8 and fmt is _nearest_listed_ancestor(name, policy.layers):
            continue
        module.forward = types.MethodType(_policy_forward, module)
    setattr(model, _APPLIED_ATTR, policy)
    return model


def applied_policy(model: torch.nn.Module) -> Policy | None:
    """The policy apply_policy put on this model, or None."""
    return getattr(model, _APPLIED_ATTR, None)


def grad_scaler(policy: Policy | str | Path, device: str | torch.device | None = None) -> torch.amp.GradScaler:
    """A GradScaler with the policy's loss-scale settings; disabled when no layer is fp16.

    `device` defaults to cuda when available, else cpu. Static scaling (`dynamic: false`) never grows
    the scale; a step with inf/NaN gradients is still skipped and the scale backs off.
    """
    if not isinstance(policy, Policy):
        policy = load_policy(policy)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ls = policy.loss_scale
    return torch.amp.GradScaler(
        torch.device(device).type,
        init_scale=ls.init_scale,
        growth_factor=ls.growth_factor,
        backoff_factor=ls.backoff_factor,
        growth_interval=ls.growth_interval if ls.dynamic else 2**31 - 1,
        enabled=policy.uses_fp16,
    )


__all__ = ["apply_policy", "applied_policy", "grad_scaler", "fp8_backend", "ROOT"]
