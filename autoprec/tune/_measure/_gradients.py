"""Gradient ranges: how many gradient elements each format would flush to zero or overflow, per loss scale.

Over the train batches, each tunable layer's gradients in the fp32 model (unscaled loss) are kept as
histograms of floor(log2|g|): its weight gradients, the gradient flowing into it from above (w.r.t. its
output) and the gradient it sends on down (w.r.t. its inputs). A loss scale 2^k multiplies all of them by
2^k, so one histogram gives, exactly, the fraction of the nonzero elements a format would lose at every
scale: `underflow` (below the smallest subnormal: flushed to zero), `subnormal` (below the smallest normal:
fewer mantissa bits, underflow included) and `overflow` (above the largest finite value: inf in fp16,
saturated in fp8). From the fp16 fractions follows the loss-scale range to use and the layers that bound it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pandas as pd
import torch

from autoprec import devices
from autoprec.formats import Format
from autoprec.tensors import map_tensors
from autoprec.tune._measure._task import Workload, check_loss


@dataclasses.dataclass(frozen=True)
class NumberRange:
    """The magnitudes a floating format represents: 2^min_subnormal_log2 .. max_value."""

    name: str
    min_subnormal_log2: int
    min_normal_log2: int
    max_value: float

    @classmethod
    def of(cls, name: str, dtype: torch.dtype) -> NumberRange:
        info = torch.finfo(dtype)
        normal = round(math.log2(info.smallest_normal))
        return cls(name, normal + round(math.log2(info.eps)), normal, float(info.max))

    @property
    def max_log2(self) -> int:
        return math.floor(math.log2(self.max_value))

    @property
    def max_mantissa(self) -> float:
        """max_value / 2^max_log2, in [1, 2): 65504 is 1.999 * 2^15, 448 is 1.75 * 2^8."""
        return self.max_value / 2.0**self.max_log2


FP16 = NumberRange.of("fp16", torch.float16)
BF16 = NumberRange.of("bf16", torch.bfloat16)
E4M3 = NumberRange.of("fp8_e4m3", torch.float8_e4m3fn)
E5M2 = NumberRange.of("fp8_e5m2", torch.float8_e5m2)
SCALED = (FP16, E4M3, E5M2)  # the formats grad_ranges.csv tabulates per loss scale
FP8 = (E4M3, E5M2)
SCALES_LOG2 = tuple(range(25))  # candidate loss scales 2^0 .. 2^24
TENSORS = ("weight_grad", "output_grad", "input_grad")
ALL = "all"

# floor(log2|x|) of a finite nonzero fp32 spans [-149, 127]; the bins cover it with room to spare.
_E_MIN, _NBINS = -160, 300
_MANTISSAS = tuple(sorted({r.max_mantissa for r in (FP16, BF16, E4M3, E5M2)}))


class Histogram:
    """Counts of the finite nonzero |x| by floor(log2|x|), accumulated over tensors.

    `top[m][e]` counts the elements of bin e whose mantissa |x| / 2^e exceeds m, so that thresholds such
    as 65504 that are not powers of two are still counted exactly. `dynamic_underflow[fmt]` counts the
    elements an fp8 cast with per-tensor dynamic scaling (amax mapped to the format's max, as torchao
    does) flushes to zero.
    """

    def __init__(self) -> None:
        self.bins = torch.zeros(_NBINS, dtype=torch.int64)
        self.top = {m: torch.zeros(_NBINS, dtype=torch.int64) for m in _MANTISSAS}
        self.numel = self.zeros = self.nonfinite = 0
        self.amax, self.amin = 0.0, math.inf
        self.dynamic_underflow = {r.name: 0 for r in FP8}

    def add(self, x: torch.Tensor) -> None:
        a = x.detach().float().abs().flatten()
        finite = torch.isfinite(a)
        nz = a[finite & (a > 0)]
        self.numel += a.numel()
        self.nonfinite += int((~finite).sum())
        self.zeros += int((a == 0).sum())
        if not nz.numel():
            return
        mantissa, exponent = torch.frexp(nz)  # nz = mantissa * 2^exponent, mantissa in [0.5, 1)
        index = (exponent.long() - 1 - _E_MIN).clamp_(0, _NBINS - 1)
        self.bins += torch.bincount(index, minlength=_NBINS).cpu()
        for m in _MANTISSAS:
            self.top[m] += torch.bincount(index[2 * mantissa > m], minlength=_NBINS).cpu()
        amax = float(nz.max())
        self.amax, self.amin = max(self.amax, amax), min(self.amin, float(nz.min()))
        for r in FP8:
            self.dynamic_underflow[r.name] += int((nz < amax * 2.0**r.min_subnormal_log2 / r.max_value).sum())

    def merge(self, other: Histogram) -> Histogram:
        out = Histogram()
        out.bins, out.top = self.bins + other.bins, {m: self.top[m] + other.top[m] for m in _MANTISSAS}
        out.numel, out.zeros = self.numel + other.numel, self.zeros + other.zeros
        out.nonfinite = self.nonfinite + other.nonfinite
        out.amax, out.amin = max(self.amax, other.amax), min(self.amin, other.amin)
        out.dynamic_underflow = {k: v + other.dynamic_underflow[k] for k, v in self.dynamic_underflow.items()}
        return out

    @property
    def nonzero(self) -> int:
        return int(self.bins.sum())

    def below(self, log2_threshold: int, scale_log2: int = 0) -> int:
        """Elements with |x| * 2^scale < 2^threshold, i.e. floor(log2|x|) < threshold - scale."""
        cut = min(max(log2_threshold - scale_log2 - _E_MIN, 0), _NBINS)
        return int(self.bins[:cut].sum())

    def above(self, rng: NumberRange, scale_log2: int = 0) -> int:
        """Elements with |x| * 2^scale > rng.max_value (= f * 2^p): floor(log2|x|) > p - scale, or equal
        to it with a mantissa above f."""
        i = rng.max_log2 - scale_log2 - _E_MIN
        if i < 0:
            return self.nonzero
        if i >= _NBINS:
            return 0
        return int(self.bins[i + 1 :].sum()) + int(self.top[rng.max_mantissa][i])

    def fractions(self, rng: NumberRange, scale_log2: int = 0) -> dict[str, float]:
        """underflow, subnormal and overflow as fractions of the nonzero elements (0 when there are none)."""
        n = self.nonzero
        if not n:
            return {"underflow": 0.0, "subnormal": 0.0, "overflow": 0.0}
        return {
            "underflow": self.below(rng.min_subnormal_log2, scale_log2) / n,
            "subnormal": self.below(rng.min_normal_log2, scale_log2) / n,
            "overflow": self.above(rng, scale_log2) / n,
        }


class _Tap(torch.autograd.Function):
    """Identity that hands the gradient passing through it to `sink`. It returns a copy, not a view, so
    code after the layer may still modify the output in place (nn.ReLU(inplace=True)); a full backward
    hook forbids that."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: Histogram) -> torch.Tensor:
        ctx.sink = sink
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.sink.add(grad)
        return grad, None


def _tap(obj: Any, sink: Histogram) -> Any:
    def one(t: torch.Tensor) -> torch.Tensor:
        return _Tap.apply(t, sink) if t.is_floating_point() and t.requires_grad else t

    return map_tensors(obj, one)


@dataclasses.dataclass
class LayerGradients:
    """One layer's gradient histograms by tensor (TENSORS); `input_grad` stays empty for a layer whose
    inputs need no gradient (the first layer, fed by data)."""

    layer: str
    tensors: dict[str, Histogram] = dataclasses.field(default_factory=lambda: {t: Histogram() for t in TENSORS})

    def combined(self) -> Histogram:
        out = Histogram()
        for h in self.tensors.values():
            out = out.merge(h)
        return out


def _hooks(module: torch.nn.Module, record: LayerGradients) -> list:
    def pre(mod, args, kwargs):
        return _tap((args, kwargs), record.tensors["input_grad"])

    def post(mod, args, output):
        return _tap(output, record.tensors["output_grad"])

    return [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]


def collect(
    workload: Workload, names: Iterable[str], batches: int | None = None, *, enough: Callable[[int], bool] | None = None
) -> dict[str, LayerGradients]:
    """Gradient histograms of each named layer over the first `batches` train batches (None: all).

    The fp32 model in train mode takes loss and backward per batch (no optimizer step), seeded so that
    dropout draws the same masks every run. `enough`, asked after each batch but the last with the batches taken
    so far: True ends the pass there (a time budget's share spent); the first batch is always taken.
    """
    model = copy.deepcopy(workload.model).train()
    modules = dict(model.named_modules())
    records = {n: LayerGradients(n) for n in names}
    handles = [h for n, r in records.items() for h in _hooks(modules[n], r)]
    try:
        device = devices.lookup(workload.device)
        with device.fork_rng(workload.device):
            device.manual_seed(workload.device, 0)
            taken = workload.train[:batches]
            for i, batch in enumerate(taken, start=1):
                model.zero_grad(set_to_none=True)
                check_loss(workload.task, workload.task.loss_fn(model, batch)).backward()
                for n, r in records.items():
                    for p in modules[n].parameters():
                        if p.grad is not None:
                            r.tensors["weight_grad"].add(p.grad)
                if enough is not None and i < len(taken) and enough(i):
                    break
    finally:
        for h in handles:
            h.remove()
    return records


def scale_table(records: Mapping[str, LayerGradients]) -> pd.DataFrame:
    """Long form, one row per layer, tensor (TENSORS and ALL), format (fp16, fp8_e4m3, fp8_e5m2) and loss
    scale 2^k: the fractions of nonzero elements that underflow, are subnormal, overflow. fp8 rows are a
    plain cast of the scaled gradient (no per-tensor scaling)."""
    rows = []
    for name, record in records.items():
        tensors = {**record.tensors, ALL: record.combined()}
        for tensor, hist in tensors.items():
            for rng in SCALED:
                for k in SCALES_LOG2:
                    rows.append(
                        {
                            "layer": name,
                            "tensor": tensor,
                            "format": rng.name,
                            "scale_log2": k,
                            "nonzero": hist.nonzero,
                            **hist.fractions(rng, k),
                        }
                    )
    return pd.DataFrame(
        rows, columns=["layer", "tensor", "format", "scale_log2", "nonzero", "underflow", "subnormal", "overflow"]
    )


def layer_range(table: pd.DataFrame, layer: str, max_underflow: float) -> tuple[int | None, int | None, float]:
    """(low, high, floor) in log2 for one layer's fp16 gradients.

    high: the largest candidate scale at which none of its gradient elements overflow (None: even 2^0
    overflows). floor: the fraction of nonzero elements still flushed to zero at `high`, the least any safe
    scale achieves (a trained model's tiniest gradients are often beyond every scale's reach). low: the
    smallest scale whose underflow is within `max_underflow` of that floor.
    """
    rows = table[(table["layer"] == layer) & (table["tensor"] == ALL) & (table["format"] == FP16.name)]
    rows = rows.sort_values("scale_log2")
    # overflow only grows with the scale: the range ends just below the first scale that overflows
    overflowing = rows.loc[rows["overflow"] > 0, "scale_log2"]
    first = int(overflowing.min()) if len(overflowing) else max(SCALES_LOG2) + 1
    if first <= min(SCALES_LOG2) or rows.empty:
        return None, None, math.nan
    high = first - 1
    floor = float(rows.loc[rows["scale_log2"] == high, "underflow"].iloc[0])
    ok = rows.loc[(rows["scale_log2"] <= high) & (rows["underflow"] <= floor + max_underflow), "scale_log2"]
    return int(ok.min()), high, floor


@dataclasses.dataclass(frozen=True)
class ScaleAdvice:
    """The loss-scale range (log2) for fp16 layers, and which layers bound it.

    `low`: the smallest scale at which every layer's underflow is within `max_underflow` of the least it
    can reach without overflow; `high`: the largest at which no layer's gradients overflow. `unfit`:
    layers whose gradients overflow fp16 even at 2^0, which no candidate scale saves. `search_range` is
    what the search uses: (low, high), or (high, high) when they conflict (overflow skips steps;
    underflow only costs accuracy, which the budget then judges).
    """

    low: int | None
    high: int | None
    low_limited_by: tuple[str, ...] = ()
    high_limited_by: tuple[str, ...] = ()
    unfit: tuple[str, ...] = ()
    max_underflow: float = 1e-3
    note: str = ""

    @property
    def search_range(self) -> tuple[int, int] | None:
        if self.low is None or self.high is None:
            return None
        return (self.low, self.high) if self.low <= self.high else (self.high, self.high)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update({k: list(v) for k, v in data.items() if isinstance(v, tuple)})
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScaleAdvice:
        fields: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
        return cls(**fields)

    def describe(self) -> str:
        parts = []
        if self.search_range:
            lo, hi = self.search_range
            parts.append(f"recommended loss scale 2^{lo} .. 2^{hi}")
            parts.append(f"low end set by {', '.join(self.low_limited_by)}")
            parts.append(
                f"high end set by {', '.join(self.high_limited_by)}"
                + (" (no overflow up to 2^24)" if self.high == max(SCALES_LOG2) else "")
            )
        if self.unfit:
            parts.append(f"fp16 gradients overflow even at 2^0 in {', '.join(self.unfit)}")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts) or "no layer to advise on"


def advise(table: pd.DataFrame | None, layers: Iterable[str] | None = None, max_underflow: float = 1e-3) -> ScaleAdvice | None:
    """The loss-scale range for the given layers (None: every layer in the table), from scale_table rows."""
    if table is None or table.empty:
        return None
    known = set(table["layer"])
    names = list(dict.fromkeys(table["layer"])) if layers is None else [n for n in layers if n in known]
    if not names:
        return None
    # each layer's rows found once: layer_range's own filter over the whole table, once a layer, took 11 s of drawing
    # a 1600-layer model's figures
    fp16 = table[(table["tensor"] == ALL) & (table["format"] == FP16.name)]
    rows = {name: group for name, group in fp16.groupby("layer", sort=False)}
    ranges = {n: layer_range(rows.get(n, fp16.iloc[0:0]), n, max_underflow) for n in names}
    unfit = tuple(n for n, (_, hi, _) in ranges.items() if hi is None)
    # layer_range gives low and high both or neither: the layers with a high are those with a low
    fit = {n: (lo, hi, floor) for n, (lo, hi, floor) in ranges.items() if lo is not None and hi is not None}
    if not fit:
        return ScaleAdvice(None, None, unfit=unfit, max_underflow=max_underflow)
    low, high = max(lo for lo, _, _ in fit.values()), min(hi for _, hi, _ in fit.values())
    notes = [
        f"{n} flushes {100 * floor:.2g}% of its nonzero gradient elements to zero even at 2^{hi}"
        for n, (_, hi, floor) in fit.items()
        if floor > max_underflow
    ]
    if low > high:
        notes.append(
            f"no one scale suits every layer (2^{low} > 2^{high}): the search keeps 2^{high} and the budget judges the underflow"
        )
    return ScaleAdvice(
        low=low,
        high=high,
        low_limited_by=tuple(n for n, (lo, _, _) in fit.items() if lo == low),
        high_limited_by=tuple(n for n, (_, hi, _) in fit.items() if hi == high),
        unfit=unfit,
        max_underflow=max_underflow,
        note="; ".join(notes),
    )


def profile_columns(record: LayerGradients, fmt: str, table: pd.DataFrame, max_underflow: float) -> dict[str, Any]:
    """The gradient columns of one profile row (layer, format), without loss scaling.

    fp16 / bf16: all three gradient tensors cast as they are; fp8: the gradient entering the layer
    (torchao casts it to e5m2 with per-tensor dynamic scaling, so it saturates never and underflows
    relative to its own max); fp32: nothing is lost.
    """
    hist = record.combined()
    out: dict[str, Any] = {
        "grad_amax": hist.amax if hist.nonzero else math.nan,
        "grad_amin": hist.amin if hist.nonzero else math.nan,
        "grad_underflow": 0.0,
        "grad_subnormal": 0.0,
        "grad_overflow": 0.0,
        "scale_low_log2": math.nan,
        "scale_high_log2": math.nan,
    }
    if fmt in ("fp16", "bf16"):
        f = hist.fractions(FP16 if fmt == "fp16" else BF16)
        out.update(grad_underflow=f["underflow"], grad_subnormal=f["subnormal"], grad_overflow=f["overflow"])
    elif (lowered := Format(fmt)).spec.is_fp8:
        g = record.tensors["output_grad"]
        grad_dtype = lowered.family.tensorwise_grad_dtype(lowered)
        dyn = None if grad_dtype is None else {torch.float8_e5m2: E5M2.name, torch.float8_e4m3fn: E4M3.name}.get(grad_dtype)
        under = (g.dynamic_underflow[dyn] / g.nonzero if g.nonzero else 0.0) if dyn else math.nan
        out.update(grad_underflow=under, grad_subnormal=math.nan, grad_overflow=0.0 if dyn else math.nan)
    if fmt == "fp16":
        low, high, _ = layer_range(table, record.layer, max_underflow)
        out.update(scale_low_log2=math.nan if low is None else low, scale_high_log2=math.nan if high is None else high)
    return out


__all__ = [
    "NumberRange",
    "FP16",
    "BF16",
    "E4M3",
    "E5M2",
    "SCALES_LOG2",
    "TENSORS",
    "Histogram",
    "LayerGradients",
    "collect",
    "scale_table",
    "layer_range",
    "ScaleAdvice",
    "advise",
    "profile_columns",
]
