"""What share of a step's matmul work the search can lower: the FLOPs of one forward on a train batch inside the layers
the space tunes, inside other modules that hold matmul weights (a Mixtral-style MoE's experts, whose fused 3-D weights
run grouped matmuls and are no nn.Linear), and elsewhere (attention's score matmuls, functional matmuls), with the
parameters of each. A search that tunes 9 Linears of a model whose experts hold 88% of its parameters says so, instead
of "all 9 linears" as if that were the model.

The backward of a matmul is two matmuls of the forward's size, so the forward's shares are the step's."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

import torch

from autoprec.tune._core._space import SearchSpace
from autoprec.tune._measure._task import Workload, random_state

# A share of the step's matmul FLOPs outside the tuned layers below which nothing is said (attention's scores alone are
# a few percent of a small transformer's)
SAY_FROM = 0.10


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of torch._grouped_mm (transformers' grouped experts; torch's flop_registry has no formula): 2 x the output's
    elements x the contracted size, where the groups split the rows (2-D x 3-D), or stack (3-D x 3-D); where both are 2-D
    the groups split the contracted size, each group writing its own [M, N] slice of the [G, M, N] output."""
    if out_shape is None:
        return 0
    elements = math.prod(out_shape)
    if len(a_shape) == 2 and len(b_shape) == 2:  # the weight gradient: K split among the G groups
        return 2 * (elements // max(1, out_shape[0])) * a_shape[1]
    return 2 * elements * a_shape[-1]


def matmul_flop_registry() -> dict[Any, Any]:
    """torch's flop formulas, with torch._grouped_mm's where torch has none: the one registry every FLOP count reads."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    registry = dict(flop_registry)
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    if grouped is not None and grouped not in registry:
        registry[grouped] = shape_wrapper(grouped_mm_flops)
    return registry


@dataclasses.dataclass(frozen=True)
class Outside:
    """Modules of one class outside the tuned layers that hold matmul weights (parameters of 2 or more dimensions)."""

    type: str
    modules: int
    flops_share: float
    params_share: float


@dataclasses.dataclass(frozen=True)
class Coverage:
    """The tuned layers' share of one forward's matmul FLOPs and of the parameters; the rest, by module class."""

    tuned_layers: int
    flops_share: float  # of the step's matmul FLOPs, inside the tuned layers
    params_share: float  # of the parameters, inside the tuned layers
    outside: tuple[Outside, ...] = ()  # the largest first
    elsewhere_share: float = 0.0  # matmul FLOPs in no module holding a weight (attention's scores, functional matmuls)

    @property
    def worth_saying(self) -> bool:
        # nothing counted (no matmul ran) is nothing to say, not "0% of the FLOPs"
        counted = self.flops_share > 0 or bool(self.outside) or self.elsewhere_share > 0
        return counted and 1.0 - self.flops_share >= SAY_FROM

    @property
    def weighted_outside_share(self) -> float:
        """The matmul FLOPs in modules outside the tuned layers that hold their own weights (experts, convolutions)."""
        return sum(o.flops_share for o in self.outside)

    def sentence(
        self,
        *,
        tuned: str = "layers the search tunes",
        rest: str = "runs in the model root's format, never in fp8 or a format of its own",
    ) -> str:
        """One line for a person: what the search (or who else chose the `tuned` layers) leaves out, and how much."""
        parts = [
            f"{o.modules} {o.type} ({o.flops_share:.0%} of the FLOPs, {o.params_share:.0%} of the parameters)"
            for o in self.outside
            if o.flops_share >= 0.005
        ]
        if self.elsewhere_share >= 0.005:
            parts.append(f"attention scores and other functional matmuls ({self.elsewhere_share:.0%})")
        return (
            f"the {self.tuned_layers} {tuned} do {self.flops_share:.0%} of the step's matmul FLOPs and hold "
            f"{self.params_share:.0%} of the parameters; the rest {rest}: {'; '.join(parts) or 'nothing named'}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tuned_layers": self.tuned_layers,
            "flops_share": round(self.flops_share, 4),
            "params_share": round(self.params_share, 4),
            "outside": [
                {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(o).items()} for o in self.outside
            ],
            "elsewhere_share": round(self.elsewhere_share, 4),
        }

    @classmethod
    def from_dict(cls, data: object) -> Coverage | None:
        """A policy file's `measured.coverage`, or None where it holds none or not this shape (read leniently)."""
        if not isinstance(data, Mapping):
            return None
        try:
            outside = tuple(
                Outside(str(o["type"]), int(o["modules"]), float(o["flops_share"]), float(o["params_share"]))
                for o in data.get("outside", ())
            )
            return cls(
                tuned_layers=int(data["tuned_layers"]),
                flops_share=float(data["flops_share"]),
                params_share=float(data["params_share"]),
                outside=outside,
                elsewhere_share=float(data.get("elsewhere_share", 0.0)),
            )
        except (KeyError, TypeError, ValueError):
            return None


def run_op(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """Call an aten op as a dispatch mode does, where the meta device's kernel is narrower than the real ones:
    torch._grouped_mm's meta kernel takes bf16 operands only (transformers' fp32 experts on the meta device), so there
    it runs in bf16 and gives the dtype the real kernel would (out_dtype, else the operands'). Only shapes come out of
    the meta device, so nothing is lost. Operands of two dtypes are left to fail as on a real device."""
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    if grouped is None or func._overloadpacket is not grouped:
        return func(*args, **kwargs)
    a, b = args[0], args[1]
    if not (a.is_meta and b.is_meta) or a.dtype != b.dtype or a.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    # _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None): the dispatcher passes them by position
    rest = {**dict(zip(("offs", "bias", "out_dtype"), args[2:])), **kwargs}
    out_dtype = rest.pop("out_dtype", None) or a.dtype
    if isinstance(rest.get("bias"), torch.Tensor):
        rest["bias"] = rest["bias"].to(torch.bfloat16)
    return func(a.to(torch.bfloat16), b.to(torch.bfloat16), **rest).to(out_dtype)


def coverage(workload: Workload, space: SearchSpace) -> Coverage:
    """The tuned layers' share of one forward of the loss on the first train batch (without gradients, the model as
    built) and of the parameters, with the matmul work outside them by module class. The model's buffers (a
    BatchNorm's running statistics) and the random generators are as they were after it: every candidate is copied
    from this model and judged against the fp32 metric measured before."""
    model = workload.model
    # each module's buffers as it holds them, which persist, and their values: a forward may update a buffer in place
    # (a BatchNorm's running statistics), assign a new tensor (an EMA: self.mean = 0.9 * self.mean + ...), or register
    # or delete one
    saved = [
        (
            m,
            dict(m._buffers),
            set(m._non_persistent_buffers_set),
            [(b, b.detach().clone()) for b in m._buffers.values() if b is not None],
        )
        for m in model.modules()
    ]
    try:
        with random_state(workload, 0):
            return count(model, lambda: workload.task.loss_fn(model, workload.train[0]), space.tunable_layers(model))
    finally:
        with torch.no_grad():
            for module, buffers, non_persistent, values in saved:
                for buffer, before in values:
                    buffer.copy_(before)
                module._buffers.clear()
                module._buffers.update(buffers)
                module._non_persistent_buffers_set.clear()
                module._non_persistent_buffers_set.update(non_persistent)


def count(model: torch.nn.Module, run: Any, tuned: Collection[str]) -> Coverage:
    """The `tuned` layers' (names of `model`'s modules) share of the matmul FLOPs of `run()` (one forward of the loss,
    run without gradients, on any device, the meta device included) and of the parameters, with the matmul work
    outside them by module class."""
    from torch.utils._python_dispatch import TorchDispatchMode

    inside_tuned = {id(m) for name, m in model.named_modules() if name in tuned}
    weighted: dict[int, str] = {}  # modules outside the tuned layers that hold matmul weights: id -> class name
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in tuned) or isinstance(module, torch.nn.Embedding):
            continue
        if any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            weighted[id(module)] = type(module).__name__
    registry = matmul_flop_registry()
    stack: list[str] = []  # "tuned", or the class of the weighted module the op runs inside
    flops: dict[str, float] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            out = run_op(func, args, kwargs)
            packet = func._overloadpacket
            formula = registry.get(packet, registry.get(func))
            if formula is not None:
                where = stack[-1] if stack else ""
                flops[where] = flops.get(where, 0.0) + float(formula(*args, **kwargs, out_val=out))
            return out

    def enter(label: str) -> Any:
        return lambda module, args: stack.append(label)

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        stack.pop()

    handles = []
    for module in model.modules():
        label = "tuned" if id(module) in inside_tuned else weighted.get(id(module))
        if label is not None:
            handles.append(module.register_forward_pre_hook(enter(label)))
            handles.append(module.register_forward_hook(leave))
    try:
        with torch.no_grad(), Count():
            run()
    finally:
        for handle in handles:
            handle.remove()
    total = sum(flops.values()) or 1.0
    params = {id(p): p for p in model.parameters()}  # tied weights once
    all_params = sum(p.numel() for p in params.values()) or 1
    tuned_params = {id(p): p for name in tuned for p in model.get_submodule(name).parameters()}
    by_type: dict[str, list[int]] = {}
    for module in model.modules():
        if id(module) in weighted:
            by_type.setdefault(weighted[id(module)], []).append(sum(p.numel() for p in module.parameters(recurse=False)))
    outside = sorted(
        (
            Outside(type=t, modules=len(sizes), flops_share=flops.get(t, 0.0) / total, params_share=sum(sizes) / all_params)
            for t, sizes in by_type.items()
            if flops.get(t, 0.0) > 0
        ),
        key=lambda o: -o.flops_share,
    )
    return Coverage(
        tuned_layers=len(tuned),
        flops_share=flops.get("tuned", 0.0) / total,
        params_share=sum(p.numel() for p in tuned_params.values()) / all_params,
        outside=tuple(outside),
        elsewhere_share=flops.get("", 0.0) / total,
    )
