"""A layer's own speed in a format: one forward+backward of the layer alone (_layer_step, on the inputs it saw in
the model, compiled where the profile is), timed per format against fp32 (_time_layer), with the peak memory of
one more step; and the key under which layers of one type and shapes share their timing (_timing_key).
"""

from __future__ import annotations

import copy

import torch

from autoprec.apply import apply_on_chosen_device
from autoprec.errors import describe
from autoprec.formats import Format, autocast_dtype
from autoprec.policy import Policy
from autoprec.tensors import map_tensors
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import ProfileConfig
from autoprec.tune._measure._sensitivity import _first_float, _Holder
from autoprec.tune._measure._task import Workload
from autoprec.tune._measure._timing import Step, interleaved_times, probe_times
from autoprec.tune._measure._trainer import compile_scope, fp32_step_failed, matmul_precision


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
