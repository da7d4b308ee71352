"""apply_policy and grad_scaler: per-module autocast, torchao float8 linears, a GradScaler from the policy.

`apply_policy` checks everything it can before it changes the model (layer names, aliases, fp8 shapes,
modules whose parent never calls them), so a refused policy leaves the model as it was. It records what
it did (`applied_summary`): each layer's format, its other names, and which fp8 backend runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from autoprec.errors import describe
from autoprec.formats import Converted, Format, FormatFamily, Fp8Backend, format_problem, fp8_backend, other_half_to_fp32
from autoprec.policy import ROOT, Policy, as_policy, gatherable_text, model_fingerprint

_FORMAT_ATTR = "_autoprec_format"
_NO_PICKLE_ATTR = "_autoprec_no_pickle"
_SUMMARY_ATTR = "_autoprec_applied"
_SCHEDULE_ATTR = "_autoprec_schedule"
ModelT = TypeVar("ModelT", bound=torch.nn.Module)  # apply_policy returns the model it was given, of its own type

# Modules that use a child's parameters directly instead of calling the child, so a format set on the
# child would silently do nothing: nn.MultiheadAttention passes out_proj.weight to a functional kernel.
_UNCALLED_CHILDREN: tuple[type[torch.nn.Module], ...] = (torch.nn.MultiheadAttention,)

# Each format applied, and its family, by its plain name, resolved once at apply time. A policy layer's forward finds
# them here by the name it keeps: constructing a Format there (Format(name)) reads the name with str.__str__, which
# torch 2.11's dynamo cannot trace (every layer in a format other than the root's split its compiled block), and a
# Format object kept on the module is a str subclass that dynamo's guards do not tell apart between models (one ran
# another's graph), where the plain name is guarded by its value. The family resolved too: no registry lookup is
# traced, nor guarded on every call.
# Keyed by (name, family) as a plain int, so that a plugin's format unregistered and registered again under the same
# name leaves the models applied before it on the family they were applied with.
_RESOLVED: dict[int, tuple[Format, FormatFamily]] = {}
_RESOLVED_KEYS: dict[tuple[str, int], int] = {}
_RESOLVED_ATTR = "_autoprec_resolved"

# Models with a policy applied, so grad_scaler(policy) can name their layers without being given the model.
_APPLIED_MODELS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """What apply_policy did to one layer the policy lists."""

    name: str  # the name the policy uses
    format: Format
    module_type: str  # the type after apply (Float8Linear for fp8 layers)
    aliases: tuple[str, ...] = ()  # the module object's other names: it runs in this format there too
    fp8_backend: Fp8Backend | None = None  # kernels or emulation, for fp8 layers
    wrapped: bool = True  # False when an enclosing listed layer already runs it in this format
    fsdp_fp8_all_gather: bool = False  # its weight is all-gathered in fp8 under FSDP2 (the policy's or apply's setting)


@dataclasses.dataclass(frozen=True)
class AppliedSummary:
    """The policy on a model and, per listed layer, what it became; see `applied_summary`."""

    policy: Policy
    device: str  # where the parameters were when the policy was applied
    layers: Mapping[str, LayerRecord]  # the phase the model runs now: its layers
    phase: int = 0  # which part of the policy's schedule the model runs now (0: the first; see follow_schedule)

    def fp8_backends(self) -> dict[str, Fp8Backend]:
        """Each fp8 layer's backend: torchao's kernels or its emulation."""
        return {name: rec.fp8_backend for name, rec in self.layers.items() if rec.fp8_backend is not None}

    def aliases(self) -> dict[str, tuple[str, ...]]:
        """Listed layers whose module object is also used under other names."""
        return {name: rec.aliases for name, rec in self.layers.items() if rec.aliases}

    def __str__(self) -> str:
        where = f", phase {self.phase} of {len(self.policy.phases)}" if self.policy.phases else ""
        lines = [f"policy applied on {self.device}{where}:"]
        for name, rec in self.layers.items():
            extra = [rec.module_type]
            if rec.fp8_backend is not None:
                extra.append(str(rec.fp8_backend))
            if rec.fsdp_fp8_all_gather:
                extra.append("fp8 all-gather under FSDP2")
            if rec.aliases:
                extra.append("also used as " + ", ".join(map(repr, rec.aliases)))
            lines.append(f"  {name or '<model>'}: {rec.format} ({'; '.join(extra)})")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# The forward of a listed layer


def _first_device_type(module: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    param = next(module.parameters(), None)
    return param.device.type if param is not None else "cpu"


class WeightsChangedError(RuntimeError):
    """A listed layer's forward failed because its weights were cast or moved after apply_policy (see _changed)."""


def _changed(module: torch.nn.Module) -> str | None:
    """What of this layer's parameters changed since apply_policy so that its format cannot run, with what to do,
    or None. Asked only once its forward has failed, so a working forward pays nothing for it."""
    kept = getattr(module, _NO_PICKLE_ATTR).low_params
    for pname, p in module.named_parameters():
        if p.is_meta:
            return (
                f"its parameter {pname!r} is on the meta device, which holds shapes but no values (.to('meta')); "
                "give it real weights (to_empty, then load_state_dict) before running it"
            )
        if p.is_floating_point() and p.dtype != torch.float32 and pname not in kept:
            return (
                f"its parameter {pname!r} is {p.dtype}, but the policy was applied to fp32 weights (the model was cast "
                "after apply_policy: .to(dtype), .half(), .double()); keep the weights fp32: the policy lowers the compute"
            )
    return None


def _policy_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module the policy lists: its format inside, the caller's precision outside. A failure
    caused by weights cast or moved after apply_policy is said as that, naming the layer, not as torch's dtype or
    device mismatch from inside this wrapper."""
    try:
        return _forward_in_format(self, *args, **kwargs)
    except WeightsChangedError:
        raise  # an inner listed layer already said what happened
    except Exception as exc:
        what = _changed(self)
        if what is None:
            raise
        name = getattr(self, _NO_PICKLE_ATTR).layer or "<model>"
        raise WeightsChangedError(
            f"layer {name!r} ({type(self).__name__}) cannot run in {getattr(self, _FORMAT_ATTR)}: {what} "
            f"(torch said {describe(exc, 200)})"
        ) from None


def _forward_in_format(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    fmt, family = _RESOLVED[getattr(self, _RESOLVED_ATTR)]
    device_type = _first_device_type(self, args, kwargs)
    out = family.forward(fmt, self, type(self).forward, device_type, args, kwargs)
    if torch.is_autocast_enabled(device_type):  # a caller in one half dtype meets a layer in the other (fp16, bf16)
        return other_half_to_fp32(out, torch.get_autocast_dtype(device_type))
    return out


_FORWARDS: weakref.WeakKeyDictionary[type[torch.nn.Module], Callable[..., Any]] = weakref.WeakKeyDictionary()


def _policy_forward_for(cls: type[torch.nn.Module]) -> Callable[..., Any]:
    """_policy_forward under the name and signature of `cls.forward`: code that inspects `model.forward` (HF
    Trainer drops the batch's columns the forward does not name) sees the model's own parameters. One function
    per class, shared by its instances."""

    if cls not in _FORWARDS:

        @functools.wraps(cls.forward)
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _policy_forward(self, *args, **kwargs)

        # Its own name, not `forward`: pickle stores a bound method as getattr(obj, name), which under `forward`
        # would give back the class's plain forward, the format silently gone. No name can be found on a fresh
        # object without adding an attribute to the user's class, so pickling such a module is refused at save
        # time (_NoPickle); under this name, a file written another way still fails to load, loudly.
        forward.__name__ = forward.__qualname__ = "_autoprec_policy_forward"
        _FORWARDS[cls] = forward
    return _FORWARDS[cls]


class _NoPickle:
    """Kept on each module whose forward apply_policy wraps: pickling it (torch.save(model), multiprocessing)
    raises at save time, saying to save the state_dict. The bound forward it would hold cannot be unpickled
    (see _policy_forward_for), so the file written would only fail later, in torch.load. Copies (deepcopy, as
    the search makes of candidates) are not pickles and keep working."""

    def __init__(self, layer: str, low_params: frozenset[str] = frozenset()):
        self.layer = layer  # the name the policy gives it, for messages
        # its parameters that were not fp32 at apply (a frozen bf16 embedding the root holds): not cast after it
        self.low_params = low_params

    def __reduce_ex__(self, protocol: object) -> Any:
        raise pickle.PicklingError(
            f"a model with an autoprec policy applied cannot be pickled whole (torch.save(model)): layer "
            f"{self.layer or '<model>'!r} runs through a per-instance forward that would not load; save "
            "model.state_dict() instead, load it into a fresh model and call apply_policy on that"
        )

    def __deepcopy__(self, memo: dict) -> _NoPickle:
        return self

    def __copy__(self) -> _NoPickle:
        return self


# ---------------------------------------------------------------------------------------------------
# Checks, all before the model changes


def _names_by_module(paths: Mapping[str, torch.nn.Module]) -> dict[int, list[str]]:
    """Every name of every module object, in model order: a module used at two places has two."""
    names: dict[int, list[str]] = {}
    for name, module in paths.items():
        names.setdefault(id(module), []).append(name)
    return names


def _check_names(policy: Policy, paths: Mapping[str, torch.nn.Module]) -> None:
    missing = [name for name in policy.layers if name not in paths]
    if missing:
        known = [n for n in paths if n][:8]
        raise ValueError(
            f"policy names layers the model lacks: {', '.join(map(repr, missing))} "
            f"(the model has e.g. {', '.join(known)}{', ...' if len(paths) > 9 else ''})"
        )


def _check_aliases(policy: Policy, paths: Mapping[str, torch.nn.Module]) -> None:
    """One module object runs in one format, whichever of its names the policy uses."""
    seen: dict[int, tuple[str, Format]] = {}
    for name, fmt in policy.layers.items():
        first = seen.setdefault(id(paths[name]), (name, fmt))
        if first[1] is not fmt:
            raise ValueError(
                f"layers {first[0]!r} and {name!r} are the same module object (used at two places), which runs "
                f"in one format, but the policy gives it {first[1]} and {fmt}; give both names the same format"
            )


def uncalled_children(model: torch.nn.Module) -> set[str]:
    """Names of the modules inside a module that uses their weights without calling them (MultiheadAttention's
    out_proj): a format set on them would do nothing, so apply_policy refuses them."""
    return {
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if isinstance(module, _UNCALLED_CHILDREN)
        for child, _ in module.named_modules()
        if child
    }


def _check_called(policy: Policy, paths: Mapping[str, torch.nn.Module]) -> None:
    for name in policy.layers:
        parts = name.split(".") if name else []
        for cut in range(len(parts)):
            parent = ".".join(parts[:cut])
            if isinstance(paths[parent], _UNCALLED_CHILDREN):
                raise ValueError(
                    f"layer {name!r} cannot have its own format: {type(paths[parent]).__name__} {parent or '<model>'!r} "
                    f"uses its weights directly without calling it, so the format would have no effect; "
                    f"set the format on {parent!r} instead"
                )


def _check_formats(
    policy: Policy, paths: Mapping[str, torch.nn.Module], device: torch.device | None, kept: frozenset[str] = frozenset()
) -> None:
    """Each listed format can run on this module and device (fp8 recipes: Linear, shape, kernels or emulation); on
    any device where `device` is None (a device planned for, not this one). `kept`: layers a switch leaves converted
    to their format already (checked when they were converted)."""

    def problem_of(fmt: Format, module: torch.nn.Module) -> str | None:
        return fmt.family.module_problem(fmt, module) if device is None else format_problem(fmt, module, device)

    for name, fmt in policy.layers.items():
        root = fmt.family.root_problem(fmt) if name == ROOT else None
        if root:
            raise ValueError(f"the model itself ('') cannot be {fmt}: {root}")
        if name in kept:
            continue
        problem = problem_of(fmt, paths[name])
        if problem:
            safer = next((f for f in fmt.fallbacks() if problem_of(f, paths[name]) is None), None)
            raise ValueError(f"layer {name or '<model>'!r} cannot be {fmt} here: {problem}; give it {safer or Format.FP32}")


def _check_weights(policy: Policy, paths: Mapping[str, torch.nn.Module]) -> None:
    """fp32 weights in each listed layer (its children included: they run in its format) and the root's own: the
    formats lower the compute of fp32 master weights (autocast per layer, torchao's fp8 casts), and on weights
    already low, fp32 layers and fp8 casts fail at the first forward with torch's dtype mismatch. Modules the
    policy does not list (a frozen bf16 embedding) are the user's: they run as the user's code calls them."""
    for name in dict.fromkeys((ROOT, *policy.layers)):
        module = paths[name]
        for pname, p in module.named_parameters(recurse=name != ROOT):
            if p.is_floating_point() and p.dtype != torch.float32:
                raise ValueError(
                    f"layer {name or '<model>'!r} ({type(module).__name__}) has {p.dtype} weights ({pname!r}), but "
                    "autoprec's formats assume fp32 master weights and lower the compute per layer; keep the "
                    "parameters fp32 (no .to(torch.bfloat16) or .half() before apply_policy) and let the policy lower the compute"
                )


def _check_forwards(policy: Policy, paths: Mapping[str, torch.nn.Module]) -> None:
    for name in policy.layers:
        if "forward" in paths[name].__dict__:
            raise ValueError(f"apply_policy: layer {name!r} already has a per-instance forward; autoprec cannot wrap it")


def _check_policy(
    policy: Policy, paths: Mapping[str, torch.nn.Module], device: torch.device | None, kept: frozenset[str] = frozenset()
) -> None:
    for check in (_check_names, _check_aliases, _check_called, _check_forwards, _check_weights):
        check(policy, paths)
    _check_formats(policy, paths, device, kept)


def policy_problem(policy: Policy, model: torch.nn.Module) -> str | None:
    """Why apply_policy would refuse `policy` for `model` on any device (its names, and each format's rules for the
    module and the root), or None; nothing changes. For those who price a policy for a device planned for (predict)."""
    try:
        _checked_phases(policy, dict(model.named_modules(remove_duplicate=False)), None)
    except ValueError as exc:
        return str(exc)
    return None


def _check_fresh(model: torch.nn.Module) -> None:
    # torch.compile's wrapper holds the model as _orig_mod (checked by name: importing dynamo costs a second).
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        raise ValueError(
            "apply_policy: this model is already compiled; apply the policy to the plain model first, "
            "then call torch.compile on it"
        )
    if hasattr(model, _SUMMARY_ATTR) or any(hasattr(m, _FORMAT_ATTR) for m in model.modules()):
        raise ValueError("apply_policy: this model already has a policy applied; apply a policy once, to a fresh model")


# ---------------------------------------------------------------------------------------------------
# apply_policy


def _enclosing_format(path: str, paths: Mapping[str, torch.nn.Module], fmts: Mapping[int, Format]) -> Format | None:
    """The format of the innermost listed module around `path` (by object, so aliases count)."""
    parts = path.split(".") if path else []
    for cut in range(len(parts) - 1, -1, -1):
        fmt = fmts.get(id(paths[".".join(parts[:cut])]))
        if fmt is not None:
            return fmt
    return None


def _needs_wrapper(fmt: Format, own_names: list[str], paths: Mapping[str, torch.nn.Module], fmts: Mapping[int, Format]) -> bool:
    # A layer in the same format as the listed layer around it, at every place it is used, is covered by it.
    if fmt.family.replaces_modules:
        return True
    return any(_enclosing_format(path, paths, fmts) is not fmt for path in own_names)


def _param_device(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _warn_aliases(policy: Policy, names: Mapping[int, list[str]], paths: Mapping[str, torch.nn.Module]) -> None:
    warned: set[int] = set()
    for name, fmt in policy.layers.items():
        key = id(paths[name])
        listed = [n for n in names[key] if n in policy.layers]
        others = [n for n in names[key] if n not in policy.layers]
        if others and key not in warned:
            warned.add(key)
            warnings.warn(
                f"apply_policy: layer {' / '.join(map(repr, listed))} is also used as {', '.join(map(repr, others))} "
                f"(the same module object); it runs in {fmt} at every place",
                stacklevel=4,
            )


def _warn_other_model(policy: Policy, model: torch.nn.Module) -> None:
    """A policy measured on one model applied to another whose layer names happen to match: say so."""
    measured = policy.measured if isinstance(policy.measured, Mapping) else {}
    expected = measured.get("fingerprint")
    if isinstance(expected, str) and expected != model_fingerprint(model):
        warnings.warn(
            f"apply_policy: this policy was measured on {measured.get('model', 'another model')!r} (fingerprint {expected}), "
            f"and this model's structure differs ({model_fingerprint(model)}): its formats and speedups were not "
            "measured on it",
            stacklevel=4,
        )


def apply_policy(model: ModelT, policy: Policy | str | Path, *, fsdp_fp8_all_gather: bool | None = None) -> ModelT:
    """Put a policy on a model in place (also accepts a policy file's path) and return the model.

    Each layer the policy lists runs in its format from then on: its forward runs under the format (per-module
    autocast for bf16 and fp16), fp8 linears become torchao Float8Linear (a subclass of nn.Linear), and the caller's
    precision holds outside the listed layers (the policy's root entry "" covers the rest of the model). State-dict
    keys and dtypes do not change: the weights stay fp32, so checkpoints load either way. Every check runs before
    the model changes, so a refused policy leaves the model as it was. Apply after moving the model to its device,
    and before torch.compile (or autoprec.compile_model) and FSDP2's fully_shard; `applied_summary(model)` says
    what was done, per layer. A model with a policy applied cannot be pickled whole: save its state_dict.
    A policy with phases (a schedule) goes on in its first phase, every phase checked first; call
    `follow_schedule(model, step=..., total_steps=...)` in the training loop to switch as the run goes on.

    Args:
        model: The model (a torch.nn.Module), on its device, with fp32 weights, not compiled, no policy applied.
        policy: An autoprec.Policy, or the path of a policy file (str or Path) as load_policy reads it.
        fsdp_fp8_all_gather: Under FSDP2, all-gather the weights of the fp8 layers whose recipe torchao can
            all-gather in fp8 (tensorwise: `fp8`, `fp8-fwd-dgrad`) in fp8, a quarter of fp32's traffic; other
            layers gather in their own dtype. Default None: the policy's own setting (`Policy.fsdp_fp8_all_gather`,
            what a sharded search measured). True with no such layer warns and changes nothing. With it on, call
            `after_optimizer_step(model)` after each optimizer step (one reduction for every fp8 weight's scale).

    Returns:
        The same model object (its own type), with the policy applied.

    Raises:
        ValueError: The policy names a layer the model lacks; gives one module object (used under two names) two
            formats; sets a format on a module its parent never calls (MultiheadAttention's out_proj); gives a
            layer a format it cannot run here (an fp8 recipe on a non-Linear, on shapes or a device without its
            kernels; a block-scaled format (mxfp8, nvfp4, ...) on a module other than a plain nn.Linear, on a
            Linear whose features do not divide by its blocks, or on the model itself; the message names the safer
            format); finds non-fp32 weights in a listed layer or the root;
            or the model is compiled already, has a policy applied already, or a listed layer has a per-instance
            forward. For a policy with phases, any phase's problem, the message naming the phase; or
            fsdp_fp8_all_gather=True with phases.
        TypeError: `policy` is a dict (use Policy.from_dict).
        autoprec.UserError: `policy` is a path that is not a readable, valid policy file (the message names the
            file and the field).

    Warns:
        UserWarning: A listed layer is also used under names the policy does not list (it runs in its format
            there too), or the policy was measured on a model whose structure differs from this one; or it lists
            block-scaled layers, which run emulated (no MXFP8/NVFP4 kernel: numerics as the reference kernels,
            speed not representative). Each is warned before the model changes, so under warnings-as-errors the
            model stays as it was.

    Example:
        >>> import torch
        >>> import autoprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> policy = autoprec.Policy(layers={"0": "bf16", "2": "fp32"})  # or autoprec.load_policy("policy.json")
        >>> model = autoprec.apply_policy(model, policy)
        >>> str(autoprec.applied_summary(model).layers["0"].format)
        'bf16'
        >>> model(torch.randn(8, 16)).shape
        torch.Size([8, 4])
    """
    return _apply(model, policy, fsdp_fp8_all_gather=fsdp_fp8_all_gather, device_hint=True)


def apply_on_chosen_device(model: ModelT, policy: Policy) -> ModelT:
    """The tuner's apply_policy (the policy's own FSDP2 setting): its models are on the device the user chose for the
    run (`--device cpu` where a GPU is present, say), so the hint to move the model to the GPU first is not for them."""
    return _apply(model, policy, fsdp_fp8_all_gather=None, device_hint=False)


def after_optimizer_step(model: torch.nn.Module) -> None:
    """What the policy on `model` needs after each optimizer step, if anything; call it there in a training loop.

    Where the policy all-gathers fp8 weights under FSDP2 (`fsdp_fp8_all_gather`), torchao's
    precompute_float8_dynamic_scale_for_fsdp: every fp8 weight's scale in one reduction, instead of one per layer in
    the next forward. Otherwise, and on a model without a policy, nothing. Called once, it must be called after every
    step from then on (torchao keeps the precomputed scale until the next).

    Args:
        model: The model the policy was applied to, or a module holding it (a LightningModule, a wrapper), sharded
            or not, compiled in place or not.
    """
    # a policy's model may sit inside a wrapper (a LightningModule's submodule, a module parallelize returned), and
    # one module may hold several (a teacher and a student): each family's step once, over the whole of `model`
    summaries = [s for s in map(applied_summary, model.modules()) if s is not None]
    gathered = {rec.format for s in summaries for rec in s.layers.values() if rec.fsdp_fp8_all_gather}
    for family in {fmt.family.name: fmt.family for fmt in gathered}.values():
        family.after_optimizer_step(model)


def _convert(
    model: torch.nn.Module,
    policy: Policy,
    paths: Mapping[str, torch.nn.Module],
    names: Mapping[int, list[str]],
    device: torch.device,
    gathered: frozenset[Format],
    *,
    device_hint: bool,
    kept: frozenset[str] = frozenset(),
) -> dict[str, Converted]:
    """Each family's convert for its listed layers, all or nothing: where one refuses, those before are undone.
    `kept`: layers a switch left converted (a swapped module whose format does not change), converted again by none."""
    by_family: dict[str, dict[str, Format]] = {}
    for name, fmt in policy.layers.items():
        if name not in kept:
            by_family.setdefault(fmt.family.name, {})[name] = fmt
    done: dict[str, Converted] = {}
    try:
        for family, listed in by_family.items():
            own = frozenset(f for f in gathered if f.family.name == family)
            done[family] = Format(next(iter(listed.values()))).family.convert(
                model, listed, paths, names, device, all_gather=own, device_hint=device_hint
            )
    except BaseException:
        for conv in reversed(done.values()):
            conv.undo()
        raise
    return done


class _Schedule:
    """Kept on a model whose policy has phases: the modules a family swapped out for the phase it runs (torchao's
    Float8Linear for the fp8 layers), by path, put back before the next phase goes on. Plain data, so a deepcopy of
    the model (the search copies candidates) copies them with it, sharing its Parameters as the model's do."""

    def __init__(self, replaced: Mapping[str, torch.nn.Module]):
        self.replaced = dict(replaced)


def _checked_phases(policy: Policy, paths: Mapping[str, torch.nn.Module], device: torch.device | None) -> None:
    """_check_policy for every phase of the schedule, each naming its phase: a switch mid-run finds nothing new."""
    if not policy.phases:
        _check_policy(policy, paths, device)
        return
    for index in range(len(policy.phases) + 1):
        try:
            _check_policy(policy.in_phase(index), paths, device)
        except ValueError as exc:
            when = (
                "in the first phase"
                if index == 0
                else f"in phase {index} (from_fraction {policy.phases[index - 1].from_fraction:g})"
            )
            raise ValueError(f"{when}: {exc}") from None


def _apply(model: ModelT, policy: Policy | str | Path, *, fsdp_fp8_all_gather: bool | None, device_hint: bool) -> ModelT:
    policy = as_policy(policy, caller="apply_policy")
    _check_fresh(model)
    paths = dict(model.named_modules(remove_duplicate=False))
    device = _param_device(model)
    _checked_phases(policy, paths, device)
    if fsdp_fp8_all_gather and policy.phases:
        raise ValueError(
            "apply_policy(fsdp_fp8_all_gather=True) with a policy that has phases: a phase switches layers' formats in "
            "place, and FSDP2's fp8 all-gather wraps the weights once, at fully_shard; leave it off, or apply one "
            "policy per phase"
        )
    first = policy.in_phase(0)
    names = _names_by_module(paths)
    _warn_aliases(first, names, paths)
    _warn_other_model(policy, model)
    if fsdp_fp8_all_gather is None:
        fsdp_fp8_all_gather = policy.fsdp_fp8_all_gather
    gathered = policy.fp8_gatherable if fsdp_fp8_all_gather else frozenset()  # the argument may override the policy's
    if fsdp_fp8_all_gather and not gathered:
        warnings.warn(
            "apply_policy: fsdp_fp8_all_gather=True, but no layer of this policy runs in a format torchao all-gathers "
            f"in fp8 ({gatherable_text()}): every weight is all-gathered in its own dtype",
            stacklevel=3,
        )
    records, replaced = _put(model, first, paths, names, device, gathered, device_hint=device_hint)
    setattr(model, _SUMMARY_ATTR, AppliedSummary(policy=policy, device=str(device), layers=records))
    if policy.phases:
        setattr(model, _SCHEDULE_ATTR, _Schedule(replaced))
    _APPLIED_MODELS.add(model)
    return model


def _put(
    model: torch.nn.Module,
    policy: Policy,
    paths: Mapping[str, torch.nn.Module],
    names: Mapping[int, list[str]],
    device: torch.device,
    gathered: frozenset[Format],
    *,
    device_hint: bool,
    kept: Mapping[str, LayerRecord] | None = None,
) -> tuple[dict[str, LayerRecord], dict[str, torch.nn.Module]]:
    """Put one phase's layers (`policy`, checked) on the model: each family's convert, then each listed layer's
    format and wrapper. Returns the records and the modules the families swapped out (each swapped-in module given
    the original's train/eval mode and hooks). `kept`: the records of layers a switch left converted (their swapped
    module stays, not converted again)."""
    kept = kept or {}
    converted = _convert(model, policy, paths, names, device, gathered, device_hint=device_hint, kept=frozenset(kept))
    replaced = {path: module for conv in converted.values() for path, module in conv.replaced.items()}
    if replaced:
        paths = dict(model.named_modules(remove_duplicate=False))
        names = _names_by_module(paths)
        for path, original in replaced.items():
            _carry(original, paths[path])
    fmts = {id(paths[name]): fmt for name, fmt in policy.layers.items()}
    records = {}
    for name, fmt in policy.layers.items():
        module, own = paths[name], names[id(paths[name])]
        wrap = _needs_wrapper(fmt, own, paths, fmts)
        setattr(module, _FORMAT_ATTR, fmt.value)
        key = _RESOLVED_KEYS.setdefault((fmt.value, id(fmt.family)), len(_RESOLVED_KEYS))
        _RESOLVED[key] = (fmt, fmt.family)  # the family held here: its id is not reused while the key stands
        setattr(module, _RESOLVED_ATTR, key)
        if wrap and "forward" not in module.__dict__:
            module.forward = types.MethodType(_policy_forward_for(type(module)), module)
            low = frozenset(n for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != torch.float32)
            setattr(module, _NO_PICKLE_ATTR, _NoPickle(name, low))
        records[name] = LayerRecord(
            name=name,
            format=fmt,
            module_type=type(module).__name__,
            aliases=tuple(n for n in own if n != name),
            fp8_backend=kept[name].fp8_backend if name in kept else converted[fmt.family.name].backend,
            wrapped=wrap,
            fsdp_fp8_all_gather=fmt in gathered,
        )
    return records, replaced


# What a module holds of its callers' own: the hooks registered on it (torch.nn.Module's dictionaries of them)
_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _carry(original: torch.nn.Module, new: torch.nn.Module) -> None:
    """A module swapped in for `original` (torchao's Float8Linear for a Linear) runs as it was set up: its train/eval
    mode, and the hooks registered on it, by the same dictionaries, so a hook's handle still removes it."""
    new.train(original.training)
    for name in _HOOKS:
        if name in original.__dict__ and name in new.__dict__:
            new.__dict__[name] = original.__dict__[name]
    # whether its backward hooks are full ones (register_full_backward_hook): a flag, not a dictionary, read per call
    new._is_full_backward_hook = original._is_full_backward_hook


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of a transformer-like model: the children of a ModuleList or Sequential that share a class
    with a sibling and have children of their own (not a lone Linear), outermost ones only."""
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        for child in children:
            same = sum(type(c) is type(child) for c in children)
            if same >= 2 and any(True for _ in child.children()):
                found.append(child)
                inside.update(id(m) for m in child.modules())
    return found


def compile_model(model: torch.nn.Module, *, mode: str | None = None) -> torch.nn.Module:
    """Compile a model after apply_policy the way autoprec's compiled search measured it, as large models are
    trained (torchtitan compiles each transformer block): each repeated block compiled on its own (in place,
    nn.Module.compile), so a 12-block model compiles one block graph per distinct block policy rather than
    the whole unrolled model; a model without repeated blocks is compiled whole (torch.compile(model),
    returned). Use the returned model. `mode`: torch.compile's (None: its default; "reduce-overhead": CUDA
    graphs, what `autoprec search --cuda-graphs` measures beside the policies)."""
    blocks = repeated_blocks(model)
    if not blocks:
        return cast(torch.nn.Module, torch.compile(model, mode=mode))  # an OptimizedModule, typed as a callable by torch
    for block in blocks:
        block.compile(mode=mode)
    return model


def applied_summary(model: torch.nn.Module) -> AppliedSummary | None:
    """What apply_policy did to this model, per layer, or None where no policy was applied to it.

    Read-only: it returns the record apply_policy kept on the model, and changes nothing.

    Args:
        model: A torch.nn.Module, with or without a policy applied.

    Returns:
        AppliedSummary | None: `.policy` (the Policy applied), `.device` (where the parameters were then),
        `.layers` (per listed layer name, a LayerRecord: `format`, `module_type` after apply, e.g. Float8Linear,
        `aliases`, `fp8_backend` for fp8 layers: torchao's kernels or its emulation, `wrapped`,
        `fsdp_fp8_all_gather`), `.fp8_backends()` and `.aliases()`; `str()` of it is a table, one line per layer.
        None where apply_policy was never called on this model.

    Example:
        >>> import torch
        >>> import autoprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> autoprec.applied_summary(model) is None
        True
        >>> model = autoprec.apply_policy(model, autoprec.Policy(layers={"0": "bf16"}))
        >>> print(autoprec.applied_summary(model))
        policy applied on cpu:
          0: bf16 (Linear)
    """
    return getattr(model, _SUMMARY_ATTR, None)


def applied_policy(model: torch.nn.Module) -> Policy | None:
    """The policy apply_policy put on this model, or None."""
    summary = applied_summary(model)
    return summary.policy if summary is not None else None


def models_with(policy: Policy) -> list[torch.nn.Module]:
    """The live models that this policy, or an equal one, was applied to."""
    return [m for m in list(_APPLIED_MODELS) if applied_policy(m) == policy]


__all__ = [
    "apply_policy",
    "after_optimizer_step",
    "compile_model",
    "repeated_blocks",
    "applied_policy",
    "applied_summary",
    "models_with",
    "AppliedSummary",
    "LayerRecord",
    "fp8_backend",
    "Fp8Backend",
    "ROOT",
]
