"""A layer's numerics in a format: the fp32 reference pass (each tunable layer's calls, their inputs and output
gradients, and which layers are fed their own output), and the SQNR against it of each of the layer's three GEMMs'
results (fprop, dgrad, wgrad) with only that layer lowered: replayed alone on its recorded calls (_replay), or in the
whole model (_in_model_run) where it cannot be. _profiler.py asks for them, layer by layer and format by format.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from autoprec.apply import apply_on_chosen_device
from autoprec.errors import UserError
from autoprec.formats import Format
from autoprec.policy import Policy
from autoprec.tensors import map_tensors
from autoprec.tune._core._config import ProfileConfig
from autoprec.tune._measure._metric import sqnr_db
from autoprec.tune._measure._task import Workload, check_loss
from autoprec.tune._measure._trainer import matmul_precision, policy_model


def _float_tensors(out: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(out, lambda t: found.append(t) if t.is_floating_point() else None)
    return found


def _first_float(out: Any) -> torch.Tensor | None:
    return next(iter(_float_tensors(out)), None)


def _param_grad(module: torch.nn.Module) -> torch.Tensor | None:
    grads = [p.grad.detach().flatten().float() for p in module.parameters() if p.grad is not None]
    return torch.cat(grads) if grads else None


@dataclasses.dataclass
class _Call:
    """One call of a layer in the fp32 model: its inputs, and the gradient of the loss with respect to each of its
    floating outputs (map_tensors order; None where none flowed back); `needs_grad`: whether each floating input
    required a gradient there (map_tensors order), so a replay computes the input gradients (dgrad) the model does."""

    inputs: tuple[tuple, dict]
    grads: list[torch.Tensor | None]
    batch: int = 0
    needs_grad: list[bool] = dataclasses.field(default_factory=list)


class _Capture:
    """Hooks on the tunable layers: every call's inputs and, once backward has run, its output gradients; and which
    layers are fed their own output (`fed_back`): a later call in the batch whose inputs derive, in the autograd graph,
    from an earlier one's output (a layer applied twice in a row), unlike one called again on other inputs (a siamese
    encoder). An earlier output autograd does not track (no_grad, a frozen layer on data) counts as fed back, to be
    safe; a path autograd cannot see (through .detach() or argmax) is missed, and such a layer reads a few dB high."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        modules = dict(model.named_modules())
        self.modules = {n: modules[n] for n in names}
        self.calls: dict[str, list[_Call]] = {n: [] for n in names}
        self.fed_back: set[str] = set()
        self._produced: dict[str, set] = {n: set() for n in names}  # autograd nodes of this batch's outputs
        self.batch = 0  # the train batch being run (_forward_backward counts them)
        self._handles = []
        for n, m in self.modules.items():
            self._handles.append(m.register_forward_pre_hook(self._pre(n), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(n)))

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            calls = self.calls[name]
            if calls and calls[-1].batch != self.batch:
                self._produced[name].clear()
            if self._produced[name] and name not in self.fed_back and _derives_from((args, kwargs), self._produced[name]):
                self.fed_back.add(name)
            needs = [t.requires_grad for t in _float_tensors((args, kwargs))]
            calls.append(_Call(map_tensors((args, kwargs), lambda t: t.detach().clone()), [], self.batch, needs))

        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            call = self.calls[name][-1]
            for i, t in enumerate(_float_tensors(output)):
                call.grads.append(None)
                # an output autograd does not track (no grad_fn) could feed a later call unseen: count it as fed back
                self._produced[name].add(t.grad_fn if t.grad_fn is not None else _UNTRACKED)
                if t.requires_grad:  # a hook on the tensor, not the module: an in-place op after it does no harm
                    t.register_hook(self._keep(call, i))

        return hook

    @staticmethod
    def _keep(call: _Call, i: int):
        def keep(grad: torch.Tensor) -> None:
            call.grads[i] = grad.detach().clone()

        return keep

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


_UNTRACKED = object()


def _derives_from(inputs: Any, nodes: set) -> bool:
    """Whether any tensor in `inputs` was computed from one of the autograd `nodes` (or they hold _UNTRACKED)."""
    if _UNTRACKED in nodes:
        return True
    stack: list = []
    map_tensors(inputs, lambda t: stack.append(t.grad_fn) if t.grad_fn is not None else None)
    seen: set = set()
    while stack:
        node = stack.pop()
        if node in nodes:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


def _forward_backward(workload: Workload, model: torch.nn.Module, batches: int, cap: _Capture | None = None) -> bool:
    """Loss and backward on the first train batches and one of each other batch shape (Workload.profile_batches;
    `cap` told which one runs); True when every loss is finite."""
    finite = True
    for i, batch in enumerate(workload.profile_batches(batches)):
        if cap is not None:
            cap.batch = i
        loss = check_loss(workload.task, workload.task.loss_fn(model, batch))
        finite &= bool(torch.isfinite(loss).item())
        loss.backward()
    return finite


def _run(workload: Workload, model: torch.nn.Module, names: list[str], batches: int) -> tuple[_Capture, bool]:
    model.eval()  # no dropout noise: only the format differs between runs
    cap = _Capture(model, names)
    try:
        finite = _forward_backward(workload, model, batches, cap)
    finally:
        cap.remove()
    return cap, finite


class _Holder(torch.nn.Module):
    """Wraps a single layer so a policy can name it (and torchao can swap it) for isolated timing."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _Replay:
    """The layer run alone on its recorded calls (`_replay`): its first floating output of each call, flattened
    and concatenated in fp32 (fprop); its parameters' gradient, concatenated (wgrad; None without one); the gradient
    it sent to each floating input that needed one, concatenated over the calls (dgrad; None where none did); all
    finite."""

    output: torch.Tensor
    grad: torch.Tensor | None
    finite: bool
    dgrad: torch.Tensor | None = None

    @classmethod
    def of(
        cls, output: torch.Tensor, grad: torch.Tensor | None, dgrad: torch.Tensor | None = None, *, losses_finite: bool = True
    ) -> _Replay:
        finite = losses_finite and all(t is None or bool(torch.isfinite(t).all()) for t in (output, grad, dgrad))
        return cls(output, grad, finite, dgrad)


def _replay(module: torch.nn.Module, calls: list[_Call], fmt: Format, device: torch.device) -> _Replay:
    """The layer alone in `fmt` on each of its calls in the fp32 model: forward on the inputs it saw there, backward
    from the output gradients the fp32 model gave it. With only this layer lowered, the model feeds it exactly these
    inputs, so its output is what the model would compute; its gradients differ from the model's only in what the
    lowered output changes downstream, which the metric measures (tests/test_profile.py: a fraction of a dB). Not
    for a layer fed its own output (_Capture.fed_back): a later call sees its own lowered output there, fp32 here (a
    few dB apart), so _in_model_run measures it. One layer step per call instead of a forward and backward
    of the whole model per layer and format. fp32 matmuls are strict (no TF32), as the trials' fp32 baseline's."""
    holder = apply_on_chosen_device(_Holder(copy.deepcopy(module)).eval(), Policy(layers={"layer": fmt}))  # eval: as recorded
    with matmul_precision(device, False):
        outputs, grad, dgrad = _replay_calls(holder, calls)
    return _Replay.of(outputs, grad, dgrad)


def _replay_calls(holder: _Holder, calls: list[_Call]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    outputs, taps = [], _Taps()
    for call in calls:
        args, kwargs = _replay_inputs(call, taps)
        floats = _float_tensors(holder(*args, **kwargs))
        if floats:
            outputs.append(floats[0].detach().float().flatten())
        pairs = [(t, g.to(t.dtype)) for t, g in zip(floats, call.grads) if g is not None and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    return (torch.cat(outputs) if outputs else torch.zeros(0)), _param_grad(holder.layer), taps.gradient()


def _replay_inputs(call: _Call, taps: _Taps) -> tuple[tuple, dict]:
    """The call's inputs, copied (a layer may write its input in place); a leaf where the model's input needed a
    gradient, so backward computes the input gradients (dgrad) the model does, and no other."""
    needs = iter(call.needs_grad)

    def prepare(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        return taps.leaf(t) if t.is_floating_point() and next(needs, False) else t

    return map_tensors(call.inputs, prepare)


class _Taps:
    """The gradient a layer sends to its inputs, call after call: a leaf (replay) or a tap (in the model: an alias of
    the input that only this layer reads, so its gradient is this layer's share, not the input's total, which a
    residual adds to) per floating input that needs a gradient, in call and map_tensors order."""

    def __init__(self) -> None:
        self._leaves: list[tuple[int, torch.Tensor]] = []  # (slot, leaf): its .grad is read at the end
        self._grads: list[torch.Tensor | None] = []
        self._sizes: list[int] = []

    def leaf(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().requires_grad_(True)
        self._leaves.append((len(self._grads), t))
        self._sizes.append(t.numel())
        self._grads.append(None)
        return t

    def tap(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.is_floating_point() and t.requires_grad):
            return t
        i = len(self._grads)
        self._grads.append(None)
        self._sizes.append(t.numel())
        alias = t.view_as(t)

        def keep(grad: torch.Tensor) -> None:
            self._grads[i] = grad.detach().float().flatten().clone()

        alias.register_hook(keep)
        return alias

    def gradient(self) -> torch.Tensor | None:
        """Every input gradient, concatenated (zeros where one never flowed back); None where none did."""
        for i, t in self._leaves:
            if t.grad is not None:
                self._grads[i] = t.grad.detach().float().flatten()
        if all(g is None for g in self._grads):
            return None
        return torch.cat([g if g is not None else torch.zeros(n) for g, n in zip(self._grads, self._sizes)])


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _sensitivity(module: torch.nn.Module, calls: list[_Call], fmt: Format, ref: _Replay, device: torch.device) -> dict:
    """Output and weight-gradient SQNR of the layer in `fmt` against fp32 (each `_replay`ed on the fp32 model's
    calls over the first train batches), and whether anything went non-finite or fp16 overflowed; the metric comes
    later (_profile_layer), where it counts."""
    return _sensitivity_of(_replay(module, calls, fmt, device), fmt, ref)


def _sensitivity_of(run: _Replay, fmt: Format, ref: _Replay) -> dict:
    # an autocast format with a narrow range (fp16) saturates to inf: fp8's scaled casts do not
    limit = fmt.family.overflow_limit(fmt)
    overflow = limit is not None and (_max_abs(ref.output) > limit or not bool(torch.isfinite(run.output).all()))
    return {
        "sqnr_db": sqnr_db(ref.output, run.output),
        "grad_sqnr_db": _sqnr_or_nan(ref.grad, run.grad),
        "dgrad_sqnr_db": _sqnr_or_nan(ref.dgrad, run.dgrad),
        "finite": run.finite,
        "overflow": overflow,
    }


def _sqnr_or_nan(ref: torch.Tensor | None, other: torch.Tensor | None) -> float:
    """sqnr_db; NaN where either side has no such result (no parameters, no gradient into the inputs)."""
    if ref is None or other is None or ref.numel() != other.numel():
        return math.nan
    return sqnr_db(ref, other)


def _in_model_run(workload: Workload, name: str, fmt: Format, batches: int) -> _Replay:
    """What _replay gives, measured in the whole model with only `name` in `fmt` (forward and backward on the first
    train batches): for a layer fed its own output, or one that cannot run alone."""
    model = policy_model(workload, Policy(layers={name: fmt})).eval()  # eval: as recorded
    module, outputs, taps = model.get_submodule(name), [], _Taps()  # after apply_policy: torchao may have swapped it

    def keep(module: torch.nn.Module, args: Any, out: Any) -> None:
        first = _first_float(out)
        if first is not None:
            outputs.append(first.detach().float().flatten().clone())

    def tap(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        aliases: dict[int, torch.Tensor] = {}  # one tensor passed twice stays one (attention's `query is key` path)

        def alias(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in aliases:
                aliases[id(t)] = taps.tap(t)
            return aliases[id(t)]

        return map_tensors((args, kwargs), alias)

    # prepended: the inputs as the model passes them, before any hook of the policy's
    handles = [module.register_forward_hook(keep), module.register_forward_pre_hook(tap, with_kwargs=True, prepend=True)]
    try:
        with matmul_precision(workload.device, False):
            finite = _forward_backward(workload, model, batches)
    finally:
        for handle in handles:
            handle.remove()
    output, grad = (torch.cat(outputs) if outputs else torch.zeros(0)), _param_grad(module)
    return _Replay.of(output, grad, taps.gradient(), losses_finite=finite)


@dataclasses.dataclass
class _Reference:
    names: list[str]
    calls: dict[str, list[_Call]]
    uncalled: list[str] = dataclasses.field(default_factory=list)  # tunable layers loss_fn never calls
    fed_back: set[str] = dataclasses.field(default_factory=set)  # layers a later call feeds their own output (_Capture)


def _reference(workload: Workload, names: list[str], config: ProfileConfig) -> _Reference:
    model = copy.deepcopy(workload.model)
    cap, _ = _run(workload, model, names, config.batches)
    missing = [n for n in names if not cap.calls[n]]
    if len(missing) == len(names):
        raise UserError(f"{workload.task.path}: layers {', '.join(missing)} are never called by loss_fn; nothing to tune there")
    return _Reference(names=[n for n in names if n not in missing], calls=cap.calls, uncalled=missing, fed_back=cap.fed_back)
