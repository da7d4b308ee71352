"""Per-layer sensitivity and speed: lower one layer at a time and measure what moves.

For each tunable layer and each offered format, with only that layer lowered: the SQNR against fp32 of each of
its three GEMMs' results (its output, fprop; the gradient it sends to its inputs, dgrad; its weight gradient,
wgrad), the task metric and its drop, whether anything became non-finite, whether fp16 overflows, and the layer's
own forward+backward time in that format. Beside it, the layer's gradient ranges (gradients.py): what each format
would flush to zero or overflow, per loss scale, and from that the loss-scale range for fp16.

What it writes (the table, `Profile`) and the rules the rest of the tuner reads it by are profile_data.py's: reading a
profile needs none of the measuring here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from autoprec.apply import apply_on_chosen_device
from autoprec.errors import UserError, describe
from autoprec.formats import Format, autocast_dtype, device_name, format_problem
from autoprec.policy import Policy, model_fingerprint
from autoprec.tensors import map_tensors
from autoprec.tune import memory
from autoprec.tune.config import METRIC_REPEAT_TOLERANCE, ProfileConfig
from autoprec.tune.cost import Stopwatch
from autoprec.tune.gradients import LayerGradients, collect, profile_columns, scale_table
from autoprec.tune.metric import evaluate_metric, metric_name, metric_of, sqnr_db
from autoprec.tune.profile_data import COLUMNS, NO_KERNEL, SQNR_COLUMNS, Profile, as_float, ruled_out
from autoprec.tune.space import SearchSpace
from autoprec.tune.task import Workload, check_loss
from autoprec.tune.timing import Step, interleaved_times, probe_times
from autoprec.tune.trainer import compile_scope, fp32_step_failed, matmul_precision, policy_model

log = logging.getLogger("autoprec")

MEASURED = "measured"
SQNR_STAGE = "profile: output and gradient SQNR per format"
PENDING = "pending"  # in play after the SQNR pass: its metric is judged with the others of its format (_judge_group)


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


def _check_fp32_losses(workload: Workload) -> None:
    """The fp32 model's loss is finite on every train batch: a NaN on train batch 2 would otherwise be blamed on
    every format of every layer, and on fp32 itself. (The eval batches' losses are the default metric, whose
    check already ran.)"""
    model = workload.model
    splits = [("train", workload.train)]
    was_training = model.training
    model.eval()
    try:
        for split, batches in splits:
            for i, batch in enumerate(batches):
                try:  # with gradients on: a loss may differentiate inside (a gradient penalty)
                    loss = check_loss(workload.task, workload.task.loss_fn(model, batch)).detach()
                except UserError:
                    raise
                except Exception as exc:
                    raise UserError(
                        f"{workload.task.path}: loss_fn failed for the fp32 model on {split} batch {i}: {type(exc).__name__}: {exc}"
                    ) from exc
                if not bool(torch.isfinite(loss).all()):
                    raise UserError(
                        f"{workload.task.path}: loss_fn returns {float(loss)} for the fp32 model on {split} batch {i} "
                        f"(of {len(batches)}); every batch must give a finite loss before precision can be judged"
                    )
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)


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


def _autocast_problem(module: torch.nn.Module, inputs: tuple[tuple, dict], fmt: Format, device: torch.device) -> str | None:
    """Why autocast cannot run `module` in `fmt` on its first recorded call (it leaves it in fp32, or the forward
    fails: a CPU without fp16 LSTM kernels, say), or None. A failure is a finding about this layer and format,
    not a crash; a user's mistake (UserError) is not."""
    args, kwargs = inputs
    dtype = autocast_dtype(fmt)
    assert dtype is not None, fmt  # asked for autocast formats only
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
            out = _first_float(copy.deepcopy(module)(*args, **kwargs))
    except UserError:
        raise
    except Exception as exc:
        return f"{fmt.value} failed: {describe(exc, 200)}"
    if out is None or out.dtype != dtype:
        return f"torch.autocast does not lower {type(module).__name__} to {fmt.value} on {device.type}"
    return None


def _layer_step(module: torch.nn.Module, inputs: tuple[tuple, dict], fmt: Format, compiled: bool = False) -> Step:
    """One forward+backward of the layer alone in `fmt`, on the inputs it saw in the model. bf16/fp16 are timed
    as inside a region of that format (a bf16 model root, say): inputs arrive in it and the output stays in
    it. A lone lowered layer also pays for casting in and out, but a policy that lowers its neighbours does
    not, and pruning on that cost would rule out small layers a lowered model runs faster with; the trials,
    timing whole steps, charge the casts where they happen."""
    dtype = autocast_dtype(fmt)
    policy = Policy(layers={"": fmt, "layer": fmt} if dtype else {"layer": fmt})
    holder = apply_on_chosen_device(_Holder(copy.deepcopy(module)).train(), policy)
    run = torch.compile(holder) if compiled else holder
    leaves: list[torch.Tensor] = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        t = t.detach().to(dtype or t.dtype).clone().requires_grad_(True)
        leaves.append(t)
        return t

    args, kwargs = map_tensors(inputs, leaf)

    def step() -> None:
        out = _first_float(run(*args, **kwargs))
        if out is None:  # nothing to take a gradient of: the step fails, naming why
            raise ValueError(f"{type(module).__name__} returned no floating-point tensor to backpropagate from")
        out.float().sum().backward()
        holder.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    return Step(step, holder)


def _time_layer(
    workload: Workload, name: str, module: torch.nn.Module, inputs, formats: list[Format], config: ProfileConfig
) -> tuple[dict[Format, tuple[float, float, int | None]], dict[Format, str]]:
    """(format -> (median ms, spread, peak bytes)) of the layer's step in each format, and (format -> why) for those
    whose step failed here (a compiler that cannot build a format's kernels, say): a finding, not a crash. The
    peak (memory.rise_bytes, None where not measured) is of one more step after the timing."""
    failed: dict[Format, str] = {}
    with compile_scope(config.compile, len(formats)):
        work: dict[Format, Step] = {}
        probe: dict[Format, float] = {}
        for fmt in formats:
            try:  # building the step converts the layer (torchao may refuse it): a finding too
                work[fmt] = _strict(workload.device, _layer_step(module, inputs, fmt, config.compile))
                probe.update(probe_times({fmt: work[fmt]}, workload.device, warmup=config.timing.warmup))
            except Exception as exc:
                if fmt is Format.FP32:
                    raise fp32_step_failed(
                        workload, f"fp32 step of layer {name!r}", describe(exc, 200), compiled=config.compile
                    ) from exc
                failed[fmt] = f"{fmt.value} step failed{' compiled' if config.compile else ''}: {describe(exc, 200)}"
        gross = {f for f in probe if f is not Format.FP32 and probe[f] > config.gross_slowdown * probe[Format.FP32]}
        timed = interleaved_times(
            {f: w for f, w in work.items() if f in probe and f not in gross}, workload.device, config.timing
        )
        peaks = {f: _rise_or_none(workload.device, work[f]) for f in probe}
    result = {f: (t.median_ms, t.spread, peaks[f]) for f, t in timed.items()}
    result.update({f: (probe[f], float("nan"), peaks[f]) for f in gross})  # probed only: the gap dwarfs any noise
    return result, failed


def _rise_or_none(device: torch.device, step) -> int | None:
    """memory.rise_bytes of one more layer step; None if it fails (the step just ran in the timing)."""
    try:
        return memory.rise_bytes(device, step)
    except Exception:
        return None


def _strict(device: torch.device, step: Step) -> Step:
    """The step with strict fp32 matmuls (CUDA), as the trials' fp32 baseline, whatever the process's TF32 setting."""

    def run() -> None:
        with matmul_precision(device, False):
            step()

    return Step(run, step.model)


def tokens(calls: list[_Call]) -> float | None:
    """The rows a layer's recorded calls took per training step (a call's first floating input: every dimension but
    the last), the mean over the train batches recorded; None where none was recorded."""
    rows: dict[int, int] = {}
    for call in calls:
        first = _first_float(call.inputs)
        if first is not None and first.dim() >= 1:
            rows[call.batch] = rows.get(call.batch, 0) + math.prod(first.shape[:-1])
    return sum(rows.values()) / len(rows) if rows else None


def _shape(module: torch.nn.Module) -> str:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return "x".join(map(str, weight.shape))
    return "-"


def _timing_key(module: torch.nn.Module, inputs: tuple[tuple, dict], formats: list[Format]) -> str:
    """What a layer's isolated step time depends on: its type and configuration, its parameters' shapes and
    dtypes, the shapes and dtypes of the inputs it saw, and the formats timed; not the values."""
    params = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    signature = map_tensors(inputs, lambda t: f"tensor{tuple(t.shape)}:{t.dtype}:{t.requires_grad}")
    return repr((type(module).__qualname__, repr(module), params, signature, [f.value for f in formats]))


def _profile_layer(
    workload,
    name,
    module,
    formats,
    ref,
    fp32_metric,
    config,
    grads: LayerGradients,
    grad_table,
    watch: Stopwatch,
    timed: dict,
    slower_than: float,
) -> list[dict]:
    """The layer's rows, cheapest measurement first: what cannot run, the layer's own step time per format
    (shared by layers of one type and shapes), the gradient ranges; then, only for formats still in play, the
    output and gradient SQNR (the layer alone, replayed on its calls in the fp32 model: _replay); formats still in play after that
    are left PENDING for the metric, which `profile` judges per format over all layers (_judge_group). A format
    ruled out on the way (slower than fp32 beyond `slower_than`, fp16 gradients overflowing, non-finite,
    overflowing) is never chosen whatever the rest would say, so the rest is not measured, and `metric_source`
    says why."""
    base = {"layer": name, "type": type(module).__name__, "shape": _shape(module), "tokens": tokens(ref.calls[name])}
    rows: dict[Format, dict] = {
        Format.FP32: {
            **base,
            "format": "fp32",
            "status": "ok",
            "reason": "",
            "sqnr_db": math.inf,
            "metric": fp32_metric,
            "metric_drop": 0.0,
            "finite": True,
            "overflow": False,
            "metric_source": MEASURED,
        }
    }
    calls = ref.calls[name]
    in_model = name in ref.fed_back  # its later calls see its own lowered output: only the whole model has them
    with watch.section("profile: SQNR reference (each layer in fp32, alone on its recorded calls)"):
        fp32 = None
        if not in_model:
            try:
                fp32 = _replay(module, calls, Format.FP32, workload.device)
            except Exception as exc:  # it cannot run alone (state its parent sets, say): the whole model measures it
                if isinstance(exc, UserError):
                    raise
                log.debug("%s cannot be replayed alone (%s); its SQNR is measured in the whole model", name, describe(exc, 200))
                in_model = True
        if fp32 is None:
            fp32 = _in_model_run(workload, name, Format.FP32, config.batches)
    max_abs = _max_abs(fp32.output)
    # fp32 against itself: inf where the GEMM runs, empty where it does not (no gradient into the inputs, no parameters')
    rows[Format.FP32].update(
        max_abs=max_abs,
        grad_sqnr_db=math.inf if fp32.grad is not None else math.nan,
        dgrad_sqnr_db=math.inf if fp32.dgrad is not None else math.nan,
    )
    inputs = calls[0].inputs
    for fmt in formats:
        if fmt is Format.FP32:
            continue
        reason = format_problem(fmt, module, workload.device)
        if reason is None and autocast_dtype(fmt) is not None:
            reason = _autocast_problem(module, inputs, fmt, workload.device)
        rows[fmt] = {
            **base,
            "format": fmt.value,
            "max_abs": max_abs,
            "status": "unsupported" if reason else "ok",
            "reason": reason or "",
            "finite": None,
            "overflow": None,
            "metric_source": "",
        }
    ok = [f for f in formats if rows[f]["status"] == "ok"]
    # a format that runs an emulation only here is not timed: its time would say nothing of its speed (NO_KERNEL)
    emulated = {f for f in ok if not f.family.has_kernels(f, workload.device)}
    to_time = [f for f in ok if f not in emulated]
    key = _timing_key(module, inputs, to_time)
    if key in timed:  # a repeated block's layer: its time is the first one's
        timed_as, times, failed = timed[key]
        watch.count("profile: layer timings reused (same type, shapes and formats)", len(to_time))
    else:
        stage = "profile: layer timing (forward + backward per format" + (", compiled)" if config.compile else ")")
        with watch.section(stage):
            times, failed = _time_layer(workload, name, module, inputs, to_time, config)
        timed_as = name
        timed[key] = (timed_as, times, failed)
    for fmt, reason in failed.items():
        rows[fmt].update(status="unsupported", reason=reason)
    fp32_ms = times[Format.FP32][0]
    for fmt, row in rows.items():
        ms, spread, peak = times.get(fmt, (math.nan, math.nan, None))
        row.update(
            time_ms=ms,
            time_spread=spread,
            time_vs_fp32=ms / fp32_ms if fp32_ms > 0 else math.nan,
            timed_as=NO_KERNEL if fmt in emulated else timed_as,
            step_rise_bytes=peak if peak is not None else math.nan,
        )
        row.update(profile_columns(grads, fmt.value, grad_table, config.max_underflow))
    # numerics do not depend on the device's speed: only a search's own profile ("offered") leaves a slow format's out
    numerics = config.numerics or "all"  # a profile on its own measures them all (a search's config says "offered")
    numerics_slower_than = slower_than if numerics == "offered" else math.inf
    for fmt, row in rows.items():
        if fmt is Format.FP32 or row["status"] != "ok":
            continue
        # "all": the SQNR of every format that runs, even one its gradient ranges already rule out (a map, not a choice)
        if numerics == "offered" and _skip(row, numerics_slower_than, watch):
            continue
        try:
            with watch.section(SQNR_STAGE):
                if in_model:
                    row.update(_sensitivity_of(_in_model_run(workload, name, fmt, config.batches), fmt, fp32))
                else:
                    row.update(_sensitivity(module, calls, fmt, fp32, workload.device))
        except Exception as exc:  # a format a layer cannot run in is a finding, not a crash; the user's mistake is not
            if isinstance(exc, UserError):
                raise
            row.update(status="unsupported", reason=f"{fmt.value} failed: {describe(exc, 200)}", metric_source="")
            continue
        if not _skip(row, numerics_slower_than, watch):
            row["metric_source"] = PENDING
    return [rows[f] for f in formats if f in rows]


def _judge_group(
    workload: Workload, group: list[dict], fmt: Format, fp32_metric: float, tolerance: float | None, watch: Stopwatch
) -> None:
    """Fill in the metric of each row of `group` (one format, layers whose metric is pending). Alone, a layer's
    is measured. Several are lowered together first: where their drop is within `tolerance`, the member with
    the lowest SQNR (the likeliest to matter) is measured alone too, and if it is within the tolerance as well
    the others take equal shares of the rest of the group's drop (single-layer drops add up closely:
    results/*/additivity); `metric_source` says so. That costs two evaluations instead of one per layer. A group
    (or its probe) over the tolerance is halved and each half judged alike, so a sensitive layer is found in
    about 2 log2(n) evaluations and measured alone. The probe guards against the one way a group hides a
    sensitive layer: others whose drops are negative and cancel its own."""
    if len(group) <= 2 or tolerance is None:  # two alone cost what a pair and its probe do, and are exact
        for row in group:
            _measure_alone(workload, row, fmt, fp32_metric, watch)
        return
    try:
        with watch.section("profile: metric per format (layers lowered together)"):
            metric = metric_of(workload, policy_model(workload, Policy(layers={r["layer"]: fmt for r in group})))
    except UserError:
        raise
    except Exception as exc:  # which layer cannot run it: the halves will say
        log.debug("%s: %d layers lowered together failed (%s); halving", fmt.value, len(group), describe(exc, 200))
        metric = math.nan
    drop = fp32_metric - metric
    if math.isfinite(drop) and abs(drop) <= tolerance:
        probe = min(group, key=_lowest_sqnr)
        _measure_alone(workload, probe, fmt, fp32_metric, watch)
        probed = as_float(probe.get("metric_drop"))
        if probe["metric_source"] == MEASURED and abs(probed) <= tolerance:
            rest = [r for r in group if r is not probe]
            share = (drop - probed) / len(rest)
            source = (
                f"predicted: its {len(group)} layers lowered together dropped the metric by {drop:.4g} (within "
                f"{tolerance:.4g}), {probe['layer']} alone by {probed:.4g}; an equal share of the rest"
            )
            for row in rest:
                row.update(metric=fp32_metric - share, metric_drop=share, metric_source=source)
            watch.count("profile: single-layer metrics predicted from a group's", len(rest))
            return
        group = [r for r in group if r is not probe]  # the probe is measured: judge the others without it
    half = len(group) // 2
    _judge_group(workload, group[:half], fmt, fp32_metric, tolerance, watch)
    _judge_group(workload, group[half:], fmt, fp32_metric, tolerance, watch)


def _lowest_sqnr(row: dict) -> float:
    """The lowest of a row's SQNRs (fprop, dgrad, wgrad); -inf where none is known (the most suspect)."""
    known = [v for v in (as_float(row.get(k)) for k in SQNR_COLUMNS.values()) if not math.isnan(v)]
    return min(known, default=-math.inf)


def _measure_alone(workload: Workload, row: dict, fmt: Format, fp32_metric: float, watch: Stopwatch) -> None:
    try:
        with watch.section("profile: metric per format (one layer lowered)"):
            metric = metric_of(workload, policy_model(workload, Policy(layers={row["layer"]: fmt})))
    except UserError:
        raise
    except Exception as exc:  # a format a layer cannot run in is a finding, not a crash
        row.update(status="unsupported", reason=f"{fmt.value} failed: {describe(exc, 200)}", metric_source="")
        return
    row.update(
        metric=metric, metric_drop=fp32_metric - metric, metric_source=MEASURED, finite=row["finite"] and math.isfinite(metric)
    )


def _skip(row: dict, slower_than: float, watch: Stopwatch) -> bool:
    """True (and the row says why) when what is known of the format already rules it out."""
    reason = ruled_out(row, None, slower_than)
    if reason is None:
        return False
    row.update(metric=math.nan, metric_drop=math.nan, metric_source=f"not measured: {reason}")
    watch.count("profile: metric not evaluated (format already ruled out)")
    return True


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


def checked_fp32_metric(workload: Workload) -> float:
    """The all-fp32 model's metric, or one UserError naming the file when the user's evaluate() (or loss_fn on
    the eval batches) fails on it or gives a non-finite number: their bug, not a format's."""
    what = "evaluate()" if workload.task.evaluate is not None else "loss_fn() on the eval batches"
    try:
        # twice: a metric that moves on its own (sampling, a random eval subset) would rule formats out on its noise
        fp32_metric, again = evaluate_metric(workload, Policy()), evaluate_metric(workload, Policy())
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{workload.task.path}: {what} failed on the fp32 model: {type(exc).__name__}: {exc}") from exc
    if not math.isfinite(fp32_metric):
        raise UserError(f"{workload.task.path}: the all-fp32 model's metric is {fp32_metric}; it must be finite")
    if abs(again - fp32_metric) > METRIC_REPEAT_TOLERANCE * max(1.0, abs(fp32_metric)):
        raise UserError(
            f"{workload.task.path}: {what} gave {fp32_metric:.6g}, then {again:.6g} for the same fp32 model: a budget "
            "cannot be judged on a metric that moves on its own; make it deterministic (the same eval batches every "
            "call, no sampling, a fixed seed inside evaluate)"
        )
    return fp32_metric


def profile(workload: Workload, space: SearchSpace, config: ProfileConfig = ProfileConfig(), *, progress: bool = True) -> Profile:
    """Profile every tunable layer of the workload's model in every format the space offers.

    What `autoprec profile` runs and a search runs first. It checks the fp32 model (a finite loss on every train
    batch, a metric that repeats), then measures, per layer and format, the cheapest things first: whether the
    format can run the layer here, the layer's own step time, its gradient ranges per loss scale, its output and
    gradient SQNR against fp32 and, for the formats still in play, the task metric's drop with the layer lowered
    (alone, or with the format's layers lowered together first where `config.group_tolerance` allows). A format
    ruled out on the way (slower than fp32 beyond the space's `prune.slower_than`, overflowing, non-finite) has the
    reason in its row instead of the rest. Layers that loss_fn never calls are left out, with a warning.

    Args:
        workload: The task made ready on its device (`prepare(load_task("model.py"), device)`).
        space: The search space (`load_space()`: the shipped default; a YAML file's path for another): which
            module types are tuned, which formats each is offered, which modules are excluded.
        config: How to measure (ProfileConfig): train batches for the SQNR pass, the timing, `compile`,
            `group_tolerance`, `numerics` ("all": every format's numerics; None counts as "all" here),
            `deadline_s`. Default ProfileConfig().
        progress: Show a progress bar over the layers. Default True.

    Returns:
        Profile: `.table` (one row per layer and format: status, reason, step time, SQNR, metric and drop; the
        columns of profile.csv), `.fp32_metric`, `.grad_ranges`, `.advice()` (the loss-scale advice), `.cost`;
        `.save(folder)` writes profile.csv, profile.json and grad_ranges.csv there.

    Raises:
        autoprec.UserError: The model has no layer of the types the space tunes (or a tunable module's name is not
            a module path a policy can hold), loss_fn fails or gives a non-finite loss for the fp32 model on a
            train batch, or the fp32 metric fails, is not finite, or differs between two evaluations.

    Example:
        >>> import autoprec.tune
        >>> workload = autoprec.tune.prepare(autoprec.tune.load_task("examples/digits/model.py"), "cpu")  # doctest: +SKIP
        >>> prof = autoprec.tune.profile(workload, autoprec.tune.load_space(), autoprec.tune.ProfileConfig())  # doctest: +SKIP
        >>> prof.save("results/digits-profile")  # doctest: +SKIP
        >>> prof.table[["layer", "format", "metric_drop"]]  # doctest: +SKIP
    """
    layers = space.tunable_layers(workload.model)
    if not layers:
        raise UserError(
            f"{workload.task.path}: the model has no layer of the types the search space tunes ({', '.join(space.layers)})"
        )
    watch = Stopwatch()
    with watch.section("profile: fp32 metric and the reference pass (each layer's inputs and output gradients)"):
        fp32_metric = workload.fp32_metric  # checked once, with the budget's resolution where that needed it
        _check_fp32_losses(workload)
        ref = _reference(workload, list(layers), config)
        if ref.uncalled:  # unused heads of a pretrained model (a pooler): nothing to measure, nothing to tune
            log.warning(
                "%s: layers %s are not called by loss_fn on the first %d train batches (eval mode); they are left out of "
                "the search and run in the model's default format",
                workload.task.path,
                ", ".join(ref.uncalled),
                config.batches,
            )
            layers = {n: f for n, f in layers.items() if n not in ref.uncalled}
    with watch.section("profile: gradient ranges"):
        grads = collect(workload, list(layers), config.grad_batches)
        grad_table = scale_table(grads)
    modules = dict(workload.model.named_modules())
    rows: list[dict] = []
    timed: dict[str, tuple[str, dict, dict]] = {}
    deadline = Deadline(config.deadline_s, len(layers))
    for name in tqdm(layers, desc="profiling layers", unit="layer", disable=not progress):
        formats = [Format.FP32] + [f for f in layers[name] if f is not Format.FP32]
        if deadline.passed():
            unprofiled = _unprofiled(name, modules[name], formats, fp32_metric, deadline.reason, ref.calls[name])
            for row in unprofiled:  # its gradient ranges were collected with every layer's: the loss-scale advice reads them
                row.update(profile_columns(grads[name], row["format"], grad_table, config.max_underflow))
            rows.extend(unprofiled)
            continue
        rows.extend(
            _profile_layer(
                workload,
                name,
                modules[name],
                formats,
                ref,
                fp32_metric,
                config,
                grads[name],
                grad_table,
                watch,
                timed,
                space.prune_slower_than,
            )
        )
        deadline.done_one()
    if deadline.left_out:
        watch.count("profile: layers not profiled, the time budget's share for it spent (they stay in fp32)", deadline.left_out)
    for fmt in dict.fromkeys(r["format"] for r in rows):
        pending = [r for r in rows if r["format"] == fmt and r["metric_source"] == PENDING]
        if pending:
            tolerance = config.group_tolerance if config.group_testing else None
            _judge_group(workload, pending, Format(fmt), fp32_metric, tolerance, watch)
    table = pd.DataFrame(rows, columns=COLUMNS)
    return Profile(
        table=table,
        fp32_metric=fp32_metric,
        metric_name=metric_name(workload),
        device=device_name(str(workload.device)),
        fingerprint=model_fingerprint(workload.model),
        weights=workload.weights,
        grad_ranges=grad_table,
        max_underflow=config.max_underflow,
        cost=watch.to_dict(),
        compiled=config.compile,
        uncalled=list(ref.uncalled),
        group_tolerance=config.group_tolerance if config.group_testing else None,
        numerics=config.numerics or "all",
        complete=not deadline.left_out,
        deadline_s=config.deadline_s,
    )


class Deadline:
    """ProfileConfig.deadline_s over a profile's layers: says up front (once a layer's time is known) when the rest
    will not fit, and which layers it leaves out."""

    def __init__(self, seconds: float | None, layers: int):
        self.seconds, self.layers, self.began = seconds, layers, time.perf_counter()
        self.profiled = self.left_out = 0
        self.reason = ""

    def passed(self) -> bool:
        if self.seconds is None or time.perf_counter() - self.began <= self.seconds:
            return False
        if not self.left_out:
            self.reason = (
                f"not profiled: the time budget's share for the profile ({self.seconds / 60:.1f} min) was spent "
                f"after {self.profiled} of {self.layers} layers; a larger --time-budget (and --study NEW_NAME) profiles it"
            )
            log.warning("--time-budget: %s layers left in fp32 (%s)", self.layers - self.profiled, self.reason)
        self.left_out += 1
        return True

    def done_one(self) -> None:
        self.profiled += 1
        spent = time.perf_counter() - self.began
        if self.seconds is not None and self.profiled == 1 and spent * self.layers > self.seconds:
            log.warning(
                "--time-budget: profiling every one of the %d layers would take about %.1f min, past the %.1f min the "
                "budget gives the profile: the layers it does not reach stay in fp32 (a larger --time-budget profiles "
                "them all)",
                self.layers,
                spent * self.layers / 60,
                self.seconds / 60,
            )


def _unprofiled(
    name: str, module: torch.nn.Module, formats: list[Format], fp32_metric: float, reason: str, calls: list[_Call]
) -> list[dict]:
    """A layer the profile's deadline left out: fp32 as measured (the reference), every lowered format ruled out."""
    base = {
        "layer": name,
        "type": type(module).__name__,
        "shape": _shape(module),
        "tokens": tokens(calls),
        "finite": None,
        "overflow": None,
    }
    rows = [
        {
            **base,
            "format": "fp32",
            "status": "ok",
            "reason": "",
            "sqnr_db": math.inf,
            "metric": fp32_metric,
            "metric_drop": 0.0,
            "finite": True,
            "overflow": False,
            "metric_source": MEASURED,
        }
    ]
    rows += [{**base, "format": f.value, "status": "unsupported", "reason": reason, "metric_source": ""} for f in formats[1:]]
    return rows
