"""A schedule followed: `follow_schedule` switches a model with a scheduled policy applied (Policy.phases) into the
phase of the run's step, in place. apply_policy puts the first phase on and keeps what a switch needs (apply._Schedule:
the modules a family swapped out); a switch takes the current phase's own layers off and puts the next phase's on with
apply's own steps, every check first, so a refused switch leaves the model in its phase.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping

import torch

from autoprec.apply import (
    _FORMAT_ATTR,
    _FORWARDS,
    _NO_PICKLE_ATTR,
    _RESOLVED_ATTR,
    _SCHEDULE_ATTR,
    _SUMMARY_ATTR,
    AppliedSummary,
    _check_policy,
    _names_by_module,
    _param_device,
    _put,
    _Schedule,
    applied_summary,
)
from autoprec.formats import Format
from autoprec.policy import Policy


def follow_schedule(model: torch.nn.Module, *, step: int, total_steps: int) -> bool:
    """Put each scheduled policy on `model` in the phase that step `step` of the run is in; call it before each
    optimizer step (the trainer integrations do). Returns whether a layer changed format on this call.

    A policy with phases (`Policy.phases`) starts in its first phase at apply_policy; as `step` passes a phase's
    start (`Phase.start_step(total_steps)`), the layers it lists switch format in place: the same module objects and
    Parameters (an optimizer's state and a checkpoint's keys stay valid), fp8 layers swapped to and from torchao's
    Float8Linear with the Linear's own weight. A compiled model recompiles once at the switch (the formats are part
    of what torch.compile guards on, so no graph of the old phase runs again; CUDA graphs are recorded anew). A
    model with no schedule, or already in that phase, is left as it is: calling it every step costs one lookup.

    Args:
        model: The model the policy was applied to, or a module holding it (a LightningModule, a compiled wrapper).
        step: The optimizer steps taken so far (0 before the first), a whole number >= 0. Resuming from a
            checkpoint, pass the step the run resumes at: the phase follows from it, not from the calls before.
        total_steps: The run's length in optimizer steps, >= 1: the phases' from_fraction are shares of it.

    Raises:
        ValueError: `step` or `total_steps` out of range; a switch that swaps an fp8 layer's module on a model sharded
            by FSDP2 (whose parameter groups hold the modules: under FSDP2 a schedule switches bf16, fp16, fp32 and
            block-scaled layers); a listed layer wrapped or replaced since apply_policy (activation checkpointing's
            wrapper); a phase's format that cannot run on the device the model has moved to since apply_policy. The
            model stays in its phase.

    Example:
        >>> import torch
        >>> import autoprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> policy = autoprec.Policy(layers={"": "bf16", "2": "fp16"}, phases=[{"from_fraction": 0.8, "layers": {"2": "bf16"}}])
        >>> model = autoprec.apply_policy(model, policy)
        >>> autoprec.follow_schedule(model, step=79, total_steps=100), autoprec.follow_schedule(model, step=80, total_steps=100)
        (False, True)
        >>> str(autoprec.applied_summary(model).layers["2"].format)
        'bf16'
    """
    switched = False
    # by the module's own attribute: a wrapper that forwards attributes (torch.compile's OptimizedModule) is no root
    roots = {id(m): m for m in model.modules() if _SCHEDULE_ATTR in m.__dict__}
    for root in roots.values():
        summary = applied_summary(root)
        assert summary is not None  # the schedule is kept beside the summary
        index = summary.policy.phase_at(step, total_steps)
        if index != summary.phase:
            _switch(root, summary, index)
            switched = True
    if not switched:  # still check the arguments where nothing is scheduled: a loop's mistake shows on the first call
        Policy().phase_at(step, total_steps)
    return switched


def _switch(root: torch.nn.Module, summary: AppliedSummary, index: int) -> None:
    """The model in phase `index`: the current phase taken off (its formats and wrappers, the modules swapped for a
    layer whose format changes put back), the next put on; every check first, and where the next phase cannot go
    on, the current one goes back on and the error is raised."""
    schedule: _Schedule = root.__dict__[_SCHEDULE_ATTR]
    policy = summary.policy
    current, target = policy.in_phase(summary.phase), policy.in_phase(index)
    paths = dict(root.named_modules(remove_duplicate=False))
    _refuse_moved(paths, current, target, schedule)
    # each module's format in either phase, by the module object (one module may be listed under two names)
    was = {id(paths[n]): (n, f) for n, f in current.layers.items()}
    will = {id(paths[n]): f for n, f in target.layers.items()}
    # a swapped module whose format does not change stays as it is: its hooks, its compiled code, FSDP2's hold on it
    kept_modules = {m for m, (_, f) in was.items() if f.family.replaces_modules and will.get(m) is f}
    kept = {n: summary.layers[was[id(paths[n])][0]] for n in target.layers if id(paths[n]) in kept_modules}
    kept_now = {n: summary.layers[n] for n in current.layers if id(paths[n]) in kept_modules}  # for a way back
    restore = {p: m for p, m in schedule.replaced.items() if id(paths[p]) not in kept_modules}
    _refuse_sharded_swap(paths, was, will, kept_modules)
    _refuse_lost_parameters(paths, restore)
    device = _param_device(root)
    _take_off(paths, current, restore)
    schedule.replaced = {p: m for p, m in schedule.replaced.items() if p not in restore}
    paths = dict(root.named_modules(remove_duplicate=False))
    names = _names_by_module(paths)
    try:
        _check_policy(target, paths, device, frozenset(kept))
        records, replaced = _put(root, target, paths, names, device, frozenset(), device_hint=False, kept=kept)
    except BaseException:
        _, back = _put(root, current, paths, names, device, frozenset(), device_hint=False, kept=kept_now)
        schedule.replaced.update(back)
        raise
    schedule.replaced.update(replaced)
    setattr(root, _SUMMARY_ATTR, dataclasses.replace(summary, layers=records, phase=index))


def _refuse_moved(paths: Mapping[str, torch.nn.Module], current: Policy, target: Policy, schedule: _Schedule) -> None:
    """Every layer of both phases, and every swapped module, where apply_policy found it: a wrapper inserted since
    (torch's apply_activation_checkpointing) renames the modules under it, and a switch by the old names would set a
    stray child on the wrapper and leave the module that runs in its old format."""
    moved = [n for n in dict.fromkeys((*current.layers, *target.layers, *schedule.replaced)) if n not in paths]
    # a listed module replaced at its own path since (a wrapper put there, a module recompiled and put back): the one
    # there now does not carry the format apply_policy put on, and the one that does runs on unseen
    moved += [n for n in current.layers if n in paths and _FORMAT_ATTR not in paths[n].__dict__]
    if moved:
        raise ValueError(
            f"follow_schedule: layer {moved[0]!r} is no longer at that path in the model, or another module stands there "
            "(a module wrapped since apply_policy, as torch's apply_activation_checkpointing wraps blocks), so the "
            "switch cannot find it; wrap "
            "nothing between apply_policy and training (checkpoint inside the block's forward, with "
            "torch.utils.checkpoint, or a Hugging Face model's gradient_checkpointing_enable()), or train each phase as "
            "its own run from a checkpoint"
        )


def _refuse_sharded_swap(
    paths: Mapping[str, torch.nn.Module],
    was: Mapping[int, tuple[str, Format]],
    will: Mapping[int, Format],
    kept: set[int],
) -> None:
    """FSDP2 holds each sharded module in its parameter group: a module swapped in or out would train a copy. `was`,
    `will`: each module's format in the current and the next phase, by module id; `kept`: those left as they are."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    modules = {id(m): (name, m) for name, m in paths.items()}
    for key in dict.fromkeys((*was, *will)):
        before, after = was[key][1] if key in was else None, will.get(key)
        swapping = [f for f in (before, after) if f is not None and f.family.replaces_modules]
        if key in kept or before is after or not swapping:
            continue
        name, module = modules[key]
        if any(isinstance(p, dtensor) for p in module.parameters()):
            raise ValueError(
                f"follow_schedule: layer {name!r} switches from {before or 'the surrounding precision'} to "
                f"{after or 'the surrounding precision'}, and {swapping[0]}'s family ({swapping[0].family.name}) runs a "
                "layer by swapping its module, but its parameters are sharded by FSDP2, which holds the module; under "
                "FSDP2 give this layer formats in both phases that swap no module (or the same format), or train each "
                "phase as its own run from a checkpoint (the checkpoint's keys are the same in every phase)"
            )


def _dtensor_type() -> type | None:
    """torch's DTensor (what FSDP2 shards parameters into), where torch.distributed is built and loaded; a model
    sharded by FSDP2 has imported it already, so a process that did not has no DTensor to find."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _refuse_lost_parameters(paths: Mapping[str, torch.nn.Module], restore: Mapping[str, torch.nn.Module]) -> None:
    """Each module to put back finds its Parameters in its replacement (the ones the optimizer steps)."""
    for path, original in restore.items():
        now = paths[path]
        missing = [key for key in original._parameters if original._parameters[key] is not None and key not in now._parameters]
        if now is not original and missing:
            raise ValueError(
                f"follow_schedule: layer {path!r} ({type(now).__name__}) no longer holds its parameter {missing[0]!r} "
                "(a wrapper flattened or moved it since apply_policy), so its module cannot be put back with the "
                "weights the optimizer steps; train each phase as its own run from a checkpoint"
            )


def _take_off(paths: Mapping[str, torch.nn.Module], current: Policy, restore: Mapping[str, torch.nn.Module]) -> None:
    """The current phase's formats and wrappers off its layers (only its own: a policy applied to a module inside
    keeps its), and the modules in `restore` put back, each with the Parameters its replacement holds now (the ones
    an optimizer steps) and its train/eval mode (its hooks are the same dictionaries: _carry)."""
    for name in current.layers:
        module = paths[name]
        if _FORMAT_ATTR not in module.__dict__:  # its own attribute, not one a wrapper forwards
            continue  # an alias of a layer done already
        delattr(module, _FORMAT_ATTR)
        delattr(module, _RESOLVED_ATTR)
        forward = module.__dict__.get("forward")
        # by the function, not the module's class: FSDP2's fully_shard gives a sharded module a class of its own
        if getattr(forward, "__func__", None) in set(_FORWARDS.values()):
            del module.__dict__["forward"]
            delattr(module, _NO_PICKLE_ATTR)
    for path, original in restore.items():
        now = paths[path]
        if now is original:
            continue
        for key in original._parameters:
            original._parameters[key] = now._parameters[key]
        original.train(now.training)
        original._is_full_backward_hook = now._is_full_backward_hook  # a full backward hook registered since
        parent, _, attr = path.rpartition(".")
        setattr(paths[parent], attr, original)


__all__ = ["follow_schedule"]
