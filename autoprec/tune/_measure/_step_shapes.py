"""A training step's shapes as the step-time predictor (_predict.py) prices them, and where they come from: a
profile's rows (step_from_rows: the search's planning goal), one traced forward of a model on any device, the meta
device included (trace_step), or a model file (traced: `autoprec predict`). Pricing lives in _predict.py; this module
only reads a model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from autoprec.errors import UserError
from autoprec.errors import describe as describe_error
from autoprec.tune._measure._coverage import Coverage, count, matmul_flop_registry, run_op
from autoprec.tune._measure._predict import BASELINE, ELEMENT_BYTES, GroupedShape, LinearShape, Step
from autoprec.tune._measure._profile_data import is_linear

if TYPE_CHECKING:
    from autoprec.tune._core._profile_row import ProfileRow
    from autoprec.tune._measure._task import Task


def step_from_rows(rows: Iterable[ProfileRow]) -> Step:
    """What a profile tells of a step: each Linear's shape and tokens (its first row per layer; a Linear by the
    row's `linear` flag, or by a type named ...Linear in a profile from before the flag), its layers' parameters, and
    each Linear's input and output read and written once, forward and backward, by the elementwise work around it
    (priced as traced bytes are: times Calibration.fusion). Attention's matmuls are in no profile: a prediction from
    one leaves them out."""
    linears: list[LinearShape] = []
    params = other = 0.0
    seen: set[str] = set()
    for row in rows:
        if row.layer in seen:
            continue
        seen.add(row.layer)
        dims = row.shape.split("x") if row.shape and row.shape != "-" else []
        try:
            sizes = [int(d) for d in dims]
        except ValueError:
            continue
        params += math.prod(sizes) if sizes else 0
        tokens = row.tokens
        linear = row.linear if row.linear is not None else row.type.endswith("Linear")
        if not linear or len(sizes) != 2 or tokens is None or not (math.isfinite(tokens) and tokens > 0):
            continue
        out_features, in_features = sizes
        linears.append(LinearShape(row.layer, in_features, out_features, float(tokens)))
        other += 3 * 2 * ELEMENT_BYTES[BASELINE] * tokens * (in_features + out_features)
    return Step(tuple(linears), other_bytes=other, params=params)


# ops that move no data (views, metadata) or make it (factories): not counted as the step's elementwise bytes
_NO_BYTES = frozenset(
    (
        "view",
        "reshape",
        "expand",
        "permute",
        "transpose",
        "t",
        "detach",
        "alias",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "split",
        "unbind",
        "as_strided",
        "_unsafe_view",
        "lift_fresh",
        "arange",
        "empty",
        "zeros",
        "ones",
        "full",
        "scalar_tensor",
        "_to_copy",
        "clone",
        "contiguous",
        "split_with_sizes",
        "chunk",
        "lift",
    )
)


def trace_step(model: torch.nn.Module, run: Any) -> Step:
    """The step's shapes from one forward of `model` (`run()` calls the loss on a batch), on any device, the meta
    device included: each Linear's (by type) rows, the FLOPs of every other matmul (attention, grouped experts,
    convolutions) and the elements the other ops write, then the backward as twice the forward's matmul FLOPs and
    bytes (the backward of a matmul is two matmuls; of an elementwise op, about a read of its input and its output
    gradient and a write of its input gradient). Bytes count each op's output in bf16, written once and read once (compiled: fused chains move less)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import sdpa_flop_count

    flop_registry = matmul_flop_registry()  # torch's, with the grouped matmuls of MoE experts

    rows: dict[str, float] = {}
    linears: dict[int, tuple[str, torch.nn.Linear]] = {}
    for name, module in model.named_modules():
        if is_linear(module) and id(module) not in linears:
            linears[id(module)] = (name, module)  # type: ignore[assignment]
    depth = [0]
    totals = {"flops": 0.0, "attention": 0.0, "elements": 0.0, "grouped": 0.0}
    grouped_mm = getattr(torch.ops.aten, "_grouped_mm", None)

    calls: list[GroupedShape] = []
    offsets: list[Any] = []  # each MoE layer's offsets tensor (kept alive: its id stays its own), in order
    readers: dict[int, tuple[str, torch.Tensor]] = {}  # an input tensor (kept alive: its id stays its own) -> first reader
    reads: dict[str, str] = {}

    def pre(module: torch.nn.Module, args: tuple) -> None:
        name, linear = linears[id(module)]
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and linear.in_features:
            rows[name] = rows.get(name, 0.0) + x.numel() / linear.in_features
            first = readers.setdefault(id(x), (name, x))[0]
            if first != name:
                reads.setdefault(name, first)
        depth[0] += 1

    def post(module: torch.nn.Module, args: tuple, out: Any) -> None:
        depth[0] -= 1

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            out = run_op(func, args, kwargs)
            if depth[0]:
                return out  # inside a Linear: priced as its GEMMs
            packet = func._overloadpacket
            if packet in flop_registry:
                key = "grouped" if packet is grouped_mm else "flops"
                totals[key] += float(flop_registry[packet](*args, **kwargs, out_val=out))
                if packet is grouped_mm:
                    found = _grouped_shape(args, kwargs, out, offsets)
                    if found is not None:
                        calls.append(found)
            elif packet.__name__.rstrip("_") not in _NO_BYTES:
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        totals["elements"] += t.numel()
            return out

    class Attention(TorchFunctionMode):
        """Fused attention (F.scaled_dot_product_attention) as one op: its matmuls' FLOPs, its output's elements;
        the math path it decomposes into on a CPU or the meta device (the scores materialised) is not what a GPU
        runs."""

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is not torch.nn.functional.scaled_dot_product_attention or depth[0]:
                return func(*args, **kwargs)
            q, k, v = (kwargs[n] if n in kwargs else args[i] for i, n in enumerate(("query", "key", "value")))
            heads = q.shape[-3]
            # grouped-query attention: the flop count wants one head count (each query head reads a key head)
            k_shape = (*k.shape[:-3], heads, *k.shape[-2:])
            v_shape = (*v.shape[:-3], heads, *v.shape[-2:])
            flops = float(sdpa_flop_count(q.shape, k_shape, v_shape))
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            # a causal mask skips half the scores (flash attention's tiles above the diagonal); the backward is five
            # matmuls to the forward's two (S recomputed, dV, dP, dQ, dK)
            totals["attention"] += (flops / 2 if causal else flops) * 3.5
            depth[0] += 1
            try:
                out = func(*args, **kwargs)
            finally:
                depth[0] -= 1
            totals["elements"] += out.numel()
            return out

    handles = []
    for _, module in linears.values():
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        with Count(), Attention():
            run()
    finally:
        for h in handles:
            h.remove()
    shapes = tuple(
        LinearShape(name, module.in_features, module.out_features, rows[name], reads.get(name))
        for name, module in linears.values()
        if name in rows
    )
    params = float(sum(p.numel() for p in model.parameters()))
    elementwise = 3 * 2 * ELEMENT_BYTES[BASELINE] * totals["elements"]
    modules = tuple(name for name, _ in model.named_modules())
    return Step(
        shapes,
        other_flops=3 * totals["flops"] + totals["attention"],
        other_bytes=elementwise,
        params=params,
        modules=modules,
        forward_other_flops=totals["flops"] + totals["attention"] / 3.5,
        grouped_flops=3 * totals["grouped"],
        grouped=tuple(calls),
    )


def _grouped_shape(args: Sequence[Any], kwargs: Mapping[str, Any], out: torch.Tensor, offsets: list[Any]) -> GroupedShape | None:
    """A torch._grouped_mm call of 2-D tokens and 3-D expert weights (an MoE's experts in the forward): its rows,
    K, N, experts and MoE layer (the index of its offsets tensor in `offsets`, which it joins if new); None for the
    other layouts (no expert-parallel traffic of theirs is priced)."""
    a, b = args[0], args[1]
    if a.dim() != 2 or b.dim() != 3:
        return None
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    layer = next((i for i, o in enumerate(offsets) if o is offs), None) if offs is not None else None
    if layer is None:
        offsets.append(offs if offs is not None else object())
        layer = len(offsets) - 1
    return GroupedShape(float(a.shape[0]), int(a.shape[-1]), int(out.shape[-1]), int(b.shape[0]), layer)


# The most work predict does on the CPU with the model's weights where the meta device cannot run its loss: twice
# the parameters times the batch's largest tensor (about a forward's FLOPs), a few seconds of a small CPU; past it,
# the cause is named instead.
REAL_TRACE_WORK = 10**12
# and the most parameters it builds there (4 GB in fp32), whatever the batch
REAL_TRACE_PARAMS = 10**9


@dataclasses.dataclass(frozen=True)
class Traced:
    """A model file's step as predict prices it: its shapes, the model they were traced from, the traced Linears'
    share of the step's matmul work (the rest is priced in bf16 whatever the policy), and the device it ran on: the
    meta device, or the CPU with the model's weights where the meta device could not run the loss (`meta_failure`)."""

    step: Step
    model: torch.nn.Module
    coverage: Coverage
    device: str = "meta"
    meta_failure: str | None = None


def traced(task: Task) -> Traced:
    """A model file's step shapes without its weights: the model built under the meta device (no memory, no values),
    one train batch moved there, its loss traced (trace_step). Where the meta device cannot run it (a kernel whose
    meta version is narrower than the real one, a value read), the same on the CPU with the model's weights, up to
    REAL_TRACE_WORK. UserError naming the file and the cause where neither runs, or where the loss's own bug shows on
    the meta device."""
    from autoprec.tune._measure._task import built, meta_model, to_device

    model = meta_model(task, verb="predict")
    try:
        batch = next(iter(task.batches("train")))
    except StopIteration:
        raise UserError(f"{task.path}: batches('train') gave no batch; predict takes the tokens of a step from one") from None
    except Exception as exc:
        raise UserError(f"{task.path}: batches('train') failed: {describe_error(exc, 200)}") from exc
    try:
        return _with_linears(_trace(model, to_device(batch, torch.device("meta")), task), task)
    except UserError:
        raise
    except Exception as exc:
        meta_failure = describe_error(exc, 200)
        if not _meta_limit(exc):  # the loss's own bug: the CPU would only build the model (train, download) to say it
            raise UserError(f"{task.path}: loss_fn could not run on the meta device ({meta_failure}); {_CHECK}") from exc
    params = sum(p.numel() for p in model.parameters())
    if params > REAL_TRACE_PARAMS:
        raise UserError(
            f"{task.path}: loss_fn could not run on the meta device ({meta_failure}), and the model's {params:,} "
            f"parameters are more than predict builds on the CPU to trace it there ({REAL_TRACE_PARAMS:,}); {_CHECK}"
        )
    work = 2 * params * _largest(batch)
    if work > REAL_TRACE_WORK:
        raise UserError(
            f"{task.path}: loss_fn could not run on the meta device ({meta_failure}), and tracing it on the CPU with the "
            f"model's weights is more work than predict does there ({work:.1e} > {REAL_TRACE_WORK:.0e}: twice the "
            f"parameters times the batch's largest tensor); {_CHECK}"
        )
    try:
        real = built(task)
    except UserError as exc:
        raise UserError(
            f"{task.path}: loss_fn could not run on the meta device ({meta_failure}), and building the model to trace "
            f"it on the CPU failed: {exc}"
        ) from exc
    try:
        with torch.no_grad():
            found = _trace(real, to_device(batch, torch.device("cpu")), task)
    except Exception as exc:
        on_cpu = describe_error(exc, 200)
        both = f"({on_cpu})" if on_cpu == meta_failure else f"on the CPU ({on_cpu}; on the meta device: {meta_failure})"
        raise UserError(f"{task.path}: loss_fn could not run {both}; {_CHECK}") from exc
    return _with_linears(dataclasses.replace(found, device="cpu", meta_failure=meta_failure), task)


_CHECK = (
    "check that loss_fn runs on a real batch (a bug there shows here too) and reads no tensor's value (.item(), a "
    "shape computed from values)"
)


# What the meta device's own limits say: a value read (.item(), a tensor formatted into a string, a data-dependent
# shape) or an op without a meta kernel ("meta tensors", "the 'Meta' backend")
_META_LIMITS = ("meta", "__format__", "item()", "data-dependent", "data dependent")


def _meta_limit(exc: BaseException) -> bool:
    """Whether an error is the meta device's, not the loss's (_META_LIMITS)."""
    text = str(exc).lower()
    return any(limit in text for limit in _META_LIMITS)


def _largest(batch: Any) -> int:
    from torch.utils._pytree import tree_leaves

    return max((t.numel() for t in tree_leaves(batch) if isinstance(t, torch.Tensor)), default=1)


def _trace(model: torch.nn.Module, batch: Any, task: Task) -> Traced:
    def run() -> Any:
        return task.loss_fn(model, batch)

    step = trace_step(model, run)
    return Traced(step, model, count(model, run, [s.name for s in step.linears]))


def _with_linears(found: Traced, task: Task) -> Traced:
    if not found.step.linears:
        raise UserError(f"{task.path}: the model calls no nn.Linear in loss_fn: nothing for a format to speed up")
    return found
