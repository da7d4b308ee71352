"""Per-layer sensitivity and speed: lower one layer at a time and measure what moves.

For each tunable layer and each offered format, with only that layer lowered: the SQNR against fp32 of each of
its three GEMMs' results (its output, fprop; the gradient it sends to its inputs, dgrad; its weight gradient,
wgrad), the task metric and its drop, whether anything became non-finite, whether fp16 overflows, and the layer's
own forward+backward time in that format. Beside it, the layer's gradient ranges (_gradients.py): what each format
would flush to zero or overflow, per loss scale, and from that the loss-scale range for fp16.

Here: the order of it all (cheapest first, a format ruled out on the way measured no further), the metric, and the
layer's own step time (`_time_layer`, at the bottom). The numerics (the fp32 reference pass, each GEMM's SQNR) are
_sensitivity.py's.
What it writes (`Profile`, a `ProfileRow` per layer and format) and the rules the rest of the tuner reads it by are
_profile_data.py's: reading a profile needs none of the measuring here.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm

from autoprec.apply import apply_on_chosen_device
from autoprec.errors import UserError, describe
from autoprec.formats import Format, autocast_dtype, device_name, format_problem
from autoprec.policy import Policy, model_fingerprint
from autoprec.tensors import map_tensors
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import ProfileConfig
from autoprec.tune._core._profile_row import SQNR_COLUMNS, ProfileRow
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._measure._gradients import LayerGradients, collect, profile_columns, scale_table
from autoprec.tune._measure._metric import metric_name, metric_of, workload_fp32_metric
from autoprec.tune._measure._profile_data import NO_KERNEL, NOT_PROFILED, PREDICTED, Profile, is_linear, ruled_out
from autoprec.tune._measure._sensitivity import (
    _Call,
    _first_float,
    _Holder,
    _in_model_run,
    _max_abs,
    _reference,
    _replay,
    _sensitivity,
    _sensitivity_of,
)
from autoprec.tune._measure._task import Workload, check_loss
from autoprec.tune._measure._timing import Step, Stopwatch, interleaved_times, probe_times
from autoprec.tune._measure._trainer import compile_scope, fp32_step_failed, matmul_precision, policy_model

log = logging.getLogger("autoprec")

MEASURED = "measured"
SQNR_STAGE = "profile: output and gradient SQNR per format"
# The share of a time-budgeted profile's seconds (counted from its start) after which the gradient-range pass takes
# no more train batches: a fraction of the whole-model steps the layers' profiling needs, so the layers keep the rest.
GRADIENT_SHARE = 0.2
PENDING = "pending"  # in play after the SQNR pass: its metric is judged with the others of its format (_judge_group)


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
    if isinstance(weight, torch.Tensor) and weight.dim() > 0:
        return "x".join(map(str, weight.shape))
    return "-"  # no weight, or a 0-dim one (a learned scale): "" would fail profile.csv's own check when loaded


def _fp32_row(base: dict[str, Any], fp32_metric: float) -> ProfileRow:
    """A layer's fp32 row (`base`: its layer, type, shape and tokens): the reference, measured as the fp32 model."""
    return ProfileRow(
        **base,
        format="fp32",
        status="ok",
        sqnr_db=math.inf,
        metric=fp32_metric,
        metric_drop=0.0,
        finite=True,
        overflow=False,
        metric_source=MEASURED,
    )


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
) -> list[ProfileRow]:
    """The layer's rows, cheapest measurement first: what cannot run, the layer's own step time per format
    (shared by layers of one type and shapes), the gradient ranges; then, only for formats still in play, the
    output and gradient SQNR (the layer alone, replayed on its calls in the fp32 model: _replay); formats still in play after that
    are left PENDING for the metric, which `profile` judges per format over all layers (_judge_group). A format
    ruled out on the way (slower than fp32 beyond `slower_than`, fp16 gradients overflowing, non-finite,
    overflowing) is never chosen whatever the rest would say, so the rest is not measured, and `metric_source`
    says why."""
    base = {"layer": name, "type": type(module).__name__, "shape": _shape(module), "tokens": tokens(ref.calls[name])}
    base["linear"] = is_linear(module)
    rows: dict[Format, ProfileRow] = {Format.FP32: _fp32_row(base, fp32_metric)}
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
    rows[Format.FP32] = replace(
        rows[Format.FP32],
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
        rows[fmt] = ProfileRow(
            **base, format=fmt.value, max_abs=max_abs, status="unsupported" if reason else "ok", reason=reason or ""
        )
    ok = [f for f in formats if rows[f].status == "ok"]
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
        rows[fmt] = replace(rows[fmt], status="unsupported", reason=reason)
    fp32_ms = times[Format.FP32][0]
    for fmt, row in rows.items():
        ms, spread, peak = times.get(fmt, (math.nan, math.nan, None))
        rows[fmt] = replace(
            row,
            time_ms=ms,
            time_spread=spread,
            time_vs_fp32=ms / fp32_ms if fp32_ms > 0 else math.nan,
            timed_as=NO_KERNEL if fmt in emulated else timed_as,
            step_rise_bytes=float(peak) if peak is not None else math.nan,  # as loaded back: a float
            **profile_columns(grads, fmt.value, grad_table, config.max_underflow),
        )
    # numerics do not depend on the device's speed: only a search's own profile ("offered") leaves a slow format's out
    numerics = config.numerics or "all"  # a profile on its own measures them all (a search's config says "offered")
    numerics_slower_than = slower_than if numerics == "offered" else math.inf
    for fmt, row in rows.items():
        if fmt is Format.FP32 or row.status != "ok":
            continue
        # "all": the SQNR of every format that runs, even one its gradient ranges already rule out (a map, not a choice)
        if numerics == "offered" and (skipped := _not_measured(row, numerics_slower_than, watch)) is not None:
            rows[fmt] = skipped
            continue
        try:
            with watch.section(SQNR_STAGE):
                if in_model:
                    measured = _sensitivity_of(_in_model_run(workload, name, fmt, config.batches), fmt, fp32)
                else:
                    measured = _sensitivity(module, calls, fmt, fp32, workload.device)
        except Exception as exc:  # a format a layer cannot run in is a finding, not a crash; the user's mistake is not
            if isinstance(exc, UserError):
                raise
            rows[fmt] = replace(row, status="unsupported", reason=f"{fmt.value} failed: {describe(exc, 200)}")
            continue
        row = replace(row, **measured)
        rows[fmt] = _not_measured(row, numerics_slower_than, watch) or replace(row, metric_source=PENDING)
    return [rows[f] for f in formats if f in rows]


def _judge_group(
    workload: Workload, group: list[ProfileRow], fmt: Format, fp32_metric: float, tolerance: float | None, watch: Stopwatch
) -> dict[str, ProfileRow]:
    """The rows of `group` (one format, layers whose metric is pending) with their metric, by layer. Alone, a layer's
    is measured. Several are lowered together first: where their drop is within `tolerance`, the member with
    the lowest SQNR (the likeliest to matter) is measured alone too, and if it is within the tolerance as well
    the others take equal shares of the rest of the group's drop (single-layer drops add up closely:
    results/*/additivity); `metric_source` says so. That costs two evaluations instead of one per layer. A group
    (or its probe) over the tolerance is halved and each half judged alike, so a sensitive layer is found in
    about 2 log2(n) evaluations and measured alone. The probe guards against the one way a group hides a
    sensitive layer: others whose drops are negative and cancel its own."""
    if len(group) <= 2 or tolerance is None:  # two alone cost what a pair and its probe do, and are exact
        return {r.layer: _measure_alone(workload, r, fmt, fp32_metric, watch) for r in group}
    try:
        with watch.section("profile: metric per format (layers lowered together)"):
            metric = metric_of(workload, policy_model(workload, Policy(layers={r.layer: fmt for r in group})))
    except UserError:
        raise
    except Exception as exc:  # which layer cannot run it: the halves will say
        log.debug("%s: %d layers lowered together failed (%s); halving", fmt.value, len(group), describe(exc, 200))
        metric = math.nan
    drop = fp32_metric - metric
    judged: dict[str, ProfileRow] = {}
    if math.isfinite(drop) and abs(drop) <= tolerance:
        probe = min(group, key=_lowest_sqnr)
        alone = judged[probe.layer] = _measure_alone(workload, probe, fmt, fp32_metric, watch)
        group = [r for r in group if r is not probe]  # the probe is measured: the others are judged without it
        if alone.metric_source == MEASURED and abs(alone.metric_drop) <= tolerance:
            share = (drop - alone.metric_drop) / len(group)
            source = (
                f"{PREDICTED}: its {len(group) + 1} layers lowered together dropped the metric by {drop:.4g} (within "
                f"{tolerance:.4g}), {probe.layer} alone by {alone.metric_drop:.4g}; an equal share of the rest"
            )
            for row in group:
                judged[row.layer] = replace(row, metric=fp32_metric - share, metric_drop=share, metric_source=source)
            watch.count("profile: single-layer metrics predicted from a group's", len(group))
            return judged
    half = len(group) // 2
    judged.update(_judge_group(workload, group[:half], fmt, fp32_metric, tolerance, watch))
    judged.update(_judge_group(workload, group[half:], fmt, fp32_metric, tolerance, watch))
    return judged


def _lowest_sqnr(row: ProfileRow) -> float:
    """The lowest of a row's SQNRs (fprop, dgrad, wgrad); -inf where none is known (the most suspect)."""
    known = [v for v in (row.sqnr(g) for g in SQNR_COLUMNS) if not math.isnan(v)]
    return min(known, default=-math.inf)


def _measure_alone(workload: Workload, row: ProfileRow, fmt: Format, fp32_metric: float, watch: Stopwatch) -> ProfileRow:
    """`row` with its metric measured, the layer lowered alone; unsupported where it cannot run so."""
    try:
        with watch.section("profile: metric per format (one layer lowered)"):
            metric = metric_of(workload, policy_model(workload, Policy(layers={row.layer: fmt})))
    except UserError:
        raise
    except Exception as exc:  # a format a layer cannot run in is a finding, not a crash
        return replace(row, status="unsupported", reason=f"{fmt.value} failed: {describe(exc, 200)}", metric_source="")
    finite = row.finite and math.isfinite(metric)
    return replace(row, metric=metric, metric_drop=fp32_metric - metric, metric_source=MEASURED, finite=finite)


def _not_measured(row: ProfileRow, slower_than: float, watch: Stopwatch) -> ProfileRow | None:
    """`row` with its metric left unmeasured and why, when what is known of the format already rules it out; else None."""
    reason = ruled_out(row, None, slower_than)
    if reason is None:
        return None
    watch.count("profile: metric not evaluated (format already ruled out)")
    return replace(row, metric=math.nan, metric_drop=math.nan, metric_source=f"not measured: {reason}")


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
        Profile: `.rows` (one ProfileRow per layer and format: status, reason, step time, SQNR, metric and drop;
        the columns of profile.csv), `.fp32_metric`, `.grad_ranges`, `.advice()` (the loss-scale advice), `.cost`;
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
        >>> [(r.layer, r.format, r.metric_drop) for r in prof.rows]  # doctest: +SKIP
    """
    layers = space.tunable_layers(workload.model)
    if not layers:
        raise UserError(
            f"{workload.task.path}: the model has no layer of the types the search space tunes ({', '.join(space.layers)})"
        )
    watch = Stopwatch()
    deadline = Deadline(config.deadline_s, len(layers))  # the profile's share counts from here: every pass spends it
    with watch.section("profile: fp32 metric and the reference pass (each layer's inputs and output gradients)"):
        fp32_metric = workload_fp32_metric(workload)  # checked once, with the budget's resolution where that needed it
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
        grads = collect(workload, list(layers), config.grad_batches, enough=deadline.gradients_enough(workload, config))
        grad_table = scale_table(grads)
    modules = dict(workload.model.named_modules())
    rows: list[ProfileRow] = []
    timed: dict[str, tuple[str, dict, dict]] = {}
    deadline.begin_layers(len(layers))
    for name in tqdm(layers, desc="profiling layers", unit="layer", disable=not progress):
        formats = [Format.FP32] + [f for f in layers[name] if f is not Format.FP32]
        if deadline.passed():
            unprofiled = _unprofiled(name, modules[name], formats, fp32_metric, deadline.reason, ref.calls[name])
            # its gradient ranges were collected with every layer's: the loss-scale advice reads them
            rows += [replace(r, **profile_columns(grads[name], r.format, grad_table, config.max_underflow)) for r in unprofiled]
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
    for fmt in dict.fromkeys(r.format for r in rows):
        pending = [r for r in rows if r.format == fmt and r.metric_source == PENDING]
        if pending:
            tolerance = config.group_tolerance if config.group_testing else None
            judged = _judge_group(workload, pending, Format(fmt), fp32_metric, tolerance, watch)
            rows = [judged.get(r.layer, r) if r.format == fmt else r for r in rows]
    return Profile(
        rows=rows,
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
    """ProfileConfig.deadline_s over a whole profile, from its start: the gradient-range pass takes train batches
    while GRADIENT_SHARE of it is left (gradients_enough); the layers then go on until it is spent, said up front
    (once a layer's time is known) when the rest will not fit, and which layers it leaves out."""

    def __init__(self, seconds: float | None, layers: int):
        self.seconds, self.layers, self.began = seconds, layers, time.perf_counter()
        self.layers_began = self.began
        self.profiled = self.left_out = 0
        self.reason = ""

    def gradients_enough(self, workload: Workload, config: ProfileConfig) -> Callable[[int], bool] | None:
        """gradients.collect's `enough`: True once the pass has spent its share (GRADIENT_SHARE of the profile's,
        counted from the profile's start), said once; None without a deadline."""
        seconds = self.seconds
        if seconds is None:
            return None
        total = len(workload.train[: config.grad_batches])

        def enough(taken: int) -> bool:
            if time.perf_counter() - self.began <= GRADIENT_SHARE * seconds:
                return False
            log.warning(
                "--time-budget: gradient ranges from %d of %d train batches: the profile's share of the budget "
                "(%.1f min) leaves them %.1f min (a larger --time-budget measures them on every batch)",
                taken,
                total,
                seconds / 60,
                GRADIENT_SHARE * seconds / 60,
            )
            return True

        return enough

    def begin_layers(self, layers: int) -> None:
        """The per-layer profiling starts now, over `layers` layers (those loss_fn calls)."""
        self.layers, self.layers_began = layers, time.perf_counter()

    def passed(self) -> bool:
        if self.seconds is None or time.perf_counter() - self.began <= self.seconds:
            return False
        if not self.left_out:
            self.reason = (
                f"{NOT_PROFILED}: the time budget's share for the profile ({self.seconds / 60:.1f} min) was spent "
                f"after {self.profiled} of {self.layers} layers; a larger --time-budget (and --study NEW_NAME) profiles it"
            )
            log.warning("--time-budget: %s layers left in fp32 (%s)", self.layers - self.profiled, self.reason)
        self.left_out += 1
        return True

    def done_one(self) -> None:
        self.profiled += 1
        now = time.perf_counter()
        # the passes before the layers have spent their part; each layer left takes about as long as the first
        expected = now - self.began + (now - self.layers_began) * (self.layers - 1)
        if self.seconds is not None and self.profiled == 1 and expected > self.seconds:
            log.warning(
                "--time-budget: profiling every one of the %d layers would take about %.1f min, past the %.1f min the "
                "budget gives the profile: the layers it does not reach stay in fp32 (a larger --time-budget profiles "
                "them all)",
                self.layers,
                expected / 60,
                self.seconds / 60,
            )


def _unprofiled(
    name: str, module: torch.nn.Module, formats: list[Format], fp32_metric: float, reason: str, calls: list[_Call]
) -> list[ProfileRow]:
    """A layer the profile's deadline left out: fp32 as measured (the reference), every lowered format ruled out."""
    base: dict[str, Any] = {"layer": name, "type": type(module).__name__, "shape": _shape(module), "tokens": tokens(calls)}
    base["linear"] = is_linear(module)
    rows = [_fp32_row(base, fp32_metric)]
    rows += [ProfileRow(**base, format=f.value, status="unsupported", reason=reason) for f in formats[1:]]
    return rows


# A layer's own speed in a format: one forward+backward of the layer alone (_layer_step, on the inputs it saw in the
# model, compiled where the profile is), timed per format against fp32 (_time_layer), with the peak memory of one more
# step; and the key under which layers of one type and shapes share their timing (_timing_key).


def _layer_step(module: torch.nn.Module, inputs: tuple[tuple, dict], fmt: Format, compiled: bool = False) -> Step:
    """One forward+backward of the layer alone in `fmt`, on the inputs it saw in the model. bf16/fp16 are timed
    as inside a region of that format (a bf16 model root, say): inputs arrive in it and the output stays in
    it. A lone lowered layer also pays for casting in and out, but a policy that lowers its neighbours does
    not, and pruning on that cost would rule out small layers a lowered model runs faster with; the trials,
    timing whole steps, charge the casts where they happen. Timed by the device's busy time (Step.kernels): on a GPU
    the host takes longer to issue a lone layer's step than the GPU to run it, and that launch overhead is no cost
    of its format (inside a whole step the host issues it while the GPU runs the layers before). A format with no
    autocast dtype of its own is timed inside the region its family names (FormatFamily.timed_inside: bf16 for fp8,
    mxfp8 and nvfp4, as torchao and torchtitan run them and the alternatives measure them; on fp32 inputs their
    casts would read and write twice the bytes their bf16 rival's do)."""
    dtype = autocast_dtype(fmt)
    inside = fmt.family.timed_inside if dtype is None else None
    if inside is not None:
        dtype = autocast_dtype(inside)
        policy = Policy(layers={"": Format(inside), "layer": fmt})
    else:
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

    return Step(step, holder, kernels=True)


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

    return Step(run, step.model, step.kernels)


def _timing_key(module: torch.nn.Module, inputs: tuple[tuple, dict], formats: list[Format]) -> str:
    """What a layer's isolated step time depends on: its type and configuration, its parameters' shapes and
    dtypes, the shapes and dtypes of the inputs it saw, and the formats timed; not the values."""
    params = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    signature = map_tensors(inputs, lambda t: f"tensor{tuple(t.shape)}:{t.dtype}:{t.requires_grad}")
    return repr((type(module).__qualname__, repr(module), params, signature, [f.value for f in formats]))
