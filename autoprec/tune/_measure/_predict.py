"""The step-time predictor: a training step's time on a named target device (_targets.py) under a policy, from the
model's shapes alone, for planning where the formats' kernels are not on this machine. A prediction, never a
measurement: calibrated on a stated few published and measured points and validated on others (docs/planning.md).

A step is priced in parts:

- each nn.Linear's three GEMMs (fprop M x N x K, dgrad M x K x N, wgrad N x K x M; M the rows its calls took per
  step, K its in_features, N its out_features), each
      max(FLOPs / (peak(precision) x efficiency(kernel, M, N, K)), bytes moved / bandwidth) + launch
  where the precision is what the format's family says the GEMM runs in (FormatFamily.gemm_precisions) and the
  kernel is its low-precision kernel where it has one (FormatFamily.gemm_casts), else the precision;
  efficiency = Calibration.gemm[kernel] x tiles / (tiles + Calibration.tiles) x K / (K + Calibration.contraction),
  tiles = ceil(M / 128) x ceil(N / 128), the output tiles a GEMM kernel spreads over the GPU's SMs;
- the casts each low-precision GEMM needs (FormatFamily.gemm_casts), from the bytes they read and write at the
  target's bandwidth (Calibration.casts' share of it by the scale's kind) plus a launch per pass. The fusion assumed is what torch.compile
  gives torchao's recipes: a tensorwise scale's amax is a pass of its own, then one pass casts the tensor for every
  orientation its GEMMs need (the transpose fused into the cast); a rowwise or block-scaled cast is one pass per
  orientation with the amax of each row or block inside it; square tiles (NVFP4's weight) serve both orientations
  from one pass; NVFP4's per-tensor scale is one amax pass per tensor and one more for the RHT'd operands of wgrad
  (the amax of the transformed tensor), the transform itself fused into the cast;
- the dtype conversions of a layer that computes in a narrower precision than its caller (a bf16 layer under an fp32
  caller: its input, weight and output gradient in, its output and gradients out);
- the rest of the step, which a policy does not lower (Step): the matmuls outside the Linears (attention's,
  convolutions) in bf16 at Calibration.gemm's bf16 share of its peak, whatever the policy, and a Mixture-of-Experts'
  grouped experts at Calibration.grouped's share (in bf16, or in the format predict's --experts names); the other ops' bytes (norms, elementwise, the loss) at the bandwidth; an
  AdamW update over the parameters (OPTIMIZER_BYTES each, split over the ranks: optimizer_params).

With a layout: tensor parallelism's collectives (tp_communication_ms: not overlapped, or under asynchronous TP
fused with their GEMMs where torch fuses them), expert parallelism's all-to-alls (ep_communication_ms), not
overlapped, and FSDP2's all-gathers and reduce-scatters (dp_communication_ms), where the compute does not hide them.
What it leaves out: Megatron's data-parallel communication, an MoE's routing imbalance (balanced routing assumed),
host overhead, power and clock limits, and kernels' behaviour beyond this roofline. Published runs include all of
these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from autoprec.formats import GEMMS, Format, GemmCast, OperandCast
from autoprec.policy import ROOT, Policy
from autoprec.tune._core._targets import Target
from autoprec.tune._measure._coverage import SAY_FROM

BASELINE = "bf16"  # the predicted speedup's 1.0: every layer in bf16 (the model root in bf16)

# Bytes per element of a GEMM's operands in each element format (GEMM_PRECISIONS, and tf32): a tensor held in a
# high-precision one, or a low-precision GEMM a family prices without casts (FormatFamily.gemm_casts' default).
ELEMENT_BYTES = {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "mxfp8": 1.0, "nvfp4": 0.5}
# The bytes an AdamW step reads and writes per fp32 parameter: the parameter, its gradient and two moments read,
# the parameter and the moments written.
OPTIMIZER_BYTES = 28.0
# The side of a GEMM kernel's output tile: a GEMM of fewer tiles than the GPU has SMs leaves some idle
TILE = 128
# How a Linear's three GEMMs read their operands: (tensor, orientation) of operand a and b. "row": contracted over
# the tensor's last dimension as stored; "col": over its first (a transposed copy, or a cast along columns).
OPERANDS = {
    "fprop": (("x", "row"), ("w", "row")),
    "dgrad": (("dy", "row"), ("w", "col")),
    "wgrad": (("dy", "col"), ("x", "col")),
}


# Measured, not fitted: torch._grouped_mm forward and backward on a B200 at Llama-4-Scout's and DeepSeek-V3's expert
# shapes, 1 to 8 experts (torchao's moe_training README; published_points.md B33-B40), the median share of the peak of
# the kernel's precision: bf16's (about half a dense GEMM's), and MXFP8's with its quantisation included
GROUPED = {"bf16": 0.349, "mxfp8": 0.276}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The predictor's fitted and assumed parameters (docs/planning.md says which is which): `gemm`, each kernel's
    fraction of its precision's peak at large shapes (the matmuls outside the Linears, attention's, reach bf16's);
    `tiles`, the output tiles at which a GEMM reaches half of it, and `contraction`, the K at which it does (the
    per-shape curve); `grouped`, the share of its precision's peak a grouped GEMM (an MoE's experts) reaches by
    kernel, its casts included; `memory`, the fraction of the bandwidth memory-bound passes reach; `casts`, that of a cast's
    passes by its scale's kind (cast_kind); `fusion`, the share of the bytes the traced step's other ops write and
    read that a compiled step still moves (torch.compile fuses chains of them)."""

    gemm: Mapping[str, float]
    memory: float
    fusion: float
    tiles: float
    contraction: float
    casts: Mapping[str, float]
    grouped: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(GROUPED))


# Fitted on the calibration points of docs/planning.md (benchmarks/predict_points.py, `fit`), never on the points it
# is validated on.
CALIBRATION = Calibration(
    gemm={
        "fp32": 0.777,
        "bf16": 0.738,
        "fp16": 0.738,  # bf16's: no point measures fp16 apart
        "fp8-tensorwise": 0.645,
        "fp8-rowwise": 0.818,
        "mxfp8": 0.645,  # fp8 tensorwise's: no point measures an MX GEMM alone
        "nvfp4": 0.37,
    },
    memory=0.80,  # assumed, not fitted
    fusion=0.324,
    tiles=39.7,
    contraction=66.0,
    # a block-scaled cast's passes run at `memory`'s share (none listed): no point measures them apart from the GEMM
    casts={"tensorwise": 0.541, "rowwise": 0.202},
    grouped=GROUPED,
)
# The predictor's error band: the largest |error| over its validation points (not fitted on), and how many there are.
# tests/test_predict_points.py recomputes both from the table.
ERROR = 0.15
VALIDATION_POINTS = 32
# How much longer than the predictor's absolute bf16 step the published and measured ones were, least and most
# (benchmarks/predict_points.py ABSOLUTE; tests/test_predict_points.py recomputes it): its parts are GPU time at
# fitted shares of peak, without host gaps or clock limits, so only ratios are validated
ABSOLUTE_SHORT = (1.16, 3.37)
# The regimes a prediction's band is stated in: the model's width class (width()), a low-precision GEMM kernel and the
# layout (tensor-parallel, vanilla or asynchronous, or not).
# Each validated regime's band is the largest |error| over the held-out points in it, and how many there are
# (benchmarks/predict_points.py; tests/test_predict_points.py recomputes them); a model in no validated regime is
# "outside the validated range", as is a model where much of the matmul work runs in modules of their own outside the
# Linears (MoE experts, convolutions: priced as bf16 matmuls, by no held-out point). The widest class ends at the
# widest held-out model (Llama-3-70B, a lone Linear(8192)).
WIDTH_CLASSES = ((1024, 2047), (2048, 8192))
# The share of the step's matmul FLOPs in weighted modules outside the Linears past which no dense regime is
# validated: the share past which the coverage is said (a step the validated dense models do not resemble)
OUTSIDE_LIMIT = SAY_FROM
# The most of a predicted step FSDP's collectives may take within the validated range: at the held-out points they
# take at most 2.4% (bf16's step or the candidate's: their first units', the compute hiding the rest), and of what
# the compute does not hide past those, none (tests/test_predict_points.py); the second limit is a margin that keeps
# a step at the edge in
DATA_PARALLEL_LIMIT = 0.025
UNHIDDEN_LIMIT = 0.01
# a regime's layout: with --tp or without, or an MoE (grouped experts doing OUTSIDE_LIMIT of the matmul work), its
# experts in bf16 or lowered (--experts): the points of the two err on different sides
LAYOUTS = {
    "dp": "data-parallel",
    "tp": "tensor-parallel",
    "tp-async": "asynchronous tensor-parallel",
    "moe": "MoE",
    "moe-experts": "MoE with its experts lowered",
}
BANDS: Mapping[tuple[int, str, str], tuple[float, int]] = {
    (1024, "fp8-rowwise", "dp"): (0.08, 1),
    (1024, "fp8-tensorwise", "dp"): (0.01, 1),
    (2048, "fp8-rowwise", "dp"): (0.07, 8),
    (2048, "fp8-rowwise", "tp"): (0.04, 3),
    (2048, "fp8-rowwise", "tp-async"): (0.09, 2),
    (2048, "fp8-tensorwise", "dp"): (0.15, 6),
    (2048, "fp8-tensorwise", "tp"): (0.07, 2),
    (2048, "fp8-tensorwise", "tp-async"): (0.11, 2),
    (2048, "mxfp8", "dp"): (0.08, 3),
    (2048, "mxfp8", "moe-experts"): (0.12, 2),
    (2048, "nvfp4", "dp"): (0.05, 2),
}


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """One nn.Linear of a step: `tokens` the rows its calls took per training step (M), `in_features` K, `out_features` N."""

    name: str
    in_features: int
    out_features: int
    tokens: float
    # the Linear whose input this one's is (the same tensor: q, k and v read one): compiled, its casts are made once
    reads: str | None = None
    # its input and output gradient are written by other kernels of the step, which compute a tensorwise amax as
    # they write them (inductor fuses the reduction into its producer); False where they are given (a benchmark's
    # leaf tensors): each amax is then a pass of its own
    produced: bool = True


@dataclasses.dataclass(frozen=True)
class GroupedShape:
    """One grouped GEMM call of a step's forward (torch._grouped_mm of 2-D tokens and 3-D expert weights: an MoE's
    experts): `rows` the tokens it took (every group's together), `in_features` K, `out_features` N, `groups` the
    experts it ran, `layer` which MoE layer of the forward it belongs to (the calls that share one offsets tensor)."""

    rows: float
    in_features: int
    out_features: int
    groups: int
    layer: int = 0


@dataclasses.dataclass(frozen=True)
class Step:
    """A training step's shapes: its Linears, and the rest that precision does not speed up. `other_flops`: the
    FLOPs of matmuls outside any Linear per step, forward and backward (attention's, experts', convolutions'); `other_bytes`: the bytes the
    other ops read and write per step, forward and backward, activations in bf16; `params`: the parameters the
    optimizer updates; `shards`: the data-parallel ranks the optimizer's work is split over (FSDP); `micro_steps`: the
    micro-batches of one optimizer step (gradient accumulation), each running all but the optimizer."""

    linears: tuple[LinearShape, ...]
    other_flops: float = 0.0
    other_bytes: float = 0.0
    params: float = 0.0
    shards: int = 1
    micro_steps: int = 1
    # Megatron-style tensor parallelism with sequence parallelism over this many ranks (tp_roles: which Linears are
    # column- and row-parallel); each rank prices its shard, plus the collectives of each residual branch
    tensor_parallel: int = 1
    checkpointing: bool = False  # full activation checkpointing: the forward runs again in the backward
    # asynchronous tensor parallelism (torch's micro-pipeline TP): collectives fused with their GEMMs where torch
    # fuses them (tp_communication_ms)
    async_tp: bool = False
    forward_other_flops: float | None = None  # other_flops' forward share (None: a third, a matmul's)
    grouped_flops: float = 0.0  # grouped GEMMs' (torch._grouped_mm: an MoE's experts), forward and backward
    modules: tuple[str, ...] = ()  # every module's name (named_modules), where the step was traced from a model
    grouped: tuple[GroupedShape, ...] = ()  # each grouped GEMM call of the forward (the experts' shapes)
    # expert parallelism over this many ranks: each MoE layer's tokens go to their experts' ranks and back in
    # all-to-alls (ep_communication_ms); the experts' GEMMs per rank are as many as without it (balanced routing)
    expert_parallel: int = 1
    # data-parallel replicas beside the shards (HSDP): each shard's gradients all-reduced over them
    replicas: int = 1
    # torchao's float8 all-gather (enable_fsdp_float8_all_gather): the weight of a Linear whose format FSDP2 can
    # gather in fp8 (its family's fsdp_fp8_all_gather: torchao's tensorwise recipes) gathered in fp8
    fp8_all_gather: bool = False
    # the shards' and replicas' collectives priced as FSDP2 runs them (dp_communication_ms); False: not priced (a
    # framework whose data parallelism predict does not model: Megatron's DDP)
    fsdp: bool = True

    @property
    def tokens(self) -> float:
        """The most rows any Linear took per step: the tokens of the step."""
        return max((s.tokens for s in self.linears), default=0.0)

    def scaled(self, tokens: float) -> Step:
        """The same model at `tokens` per step: every per-token count scaled (more sequences of the same length)."""
        k = tokens / self.tokens if self.tokens else 1.0
        linears = tuple(dataclasses.replace(s, tokens=s.tokens * k) for s in self.linears)
        forward = None if self.forward_other_flops is None else self.forward_other_flops * k
        return dataclasses.replace(
            self,
            linears=linears,
            other_flops=self.other_flops * k,
            other_bytes=self.other_bytes * k,
            forward_other_flops=forward,
            grouped_flops=self.grouped_flops * k,
            grouped=tuple(dataclasses.replace(g, rows=g.rows * k) for g in self.grouped),
        )


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted step time (ms) on a target, by part: gemms, casts, conversions, other_matmuls, elementwise,
    optimizer (and a layout's: communication, all_to_all, data_parallel); `unhidden_ms`: the part of data_parallel
    the compute does not hide past the first units' collectives (dp_collectives), which no held-out point has."""

    target: str
    parts: Mapping[str, float]
    unhidden_ms: float = 0.0

    @property
    def ms(self) -> float:
        return sum(self.parts.values())


# ---- the parts --------------------------------------------------------------------------------------------------


def efficiency(kernel: str, m: float, n: float, k: float, cal: Calibration = CALIBRATION) -> float:
    """The fraction of its precision's peak a GEMM (m x n, contracting k) reaches in `kernel`: its share at large
    shapes, less where its output has few tiles to spread over the SMs or its contraction is short."""
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
    # a kernel the calibration does not know (a registered family's own) runs at bf16's share of its peak
    share = cal.gemm.get(kernel, cal.gemm[BASELINE])
    return share * tiles / (tiles + cal.tiles) * k / (k + cal.contraction)


def gemm_ms(
    precision: str,
    kernel: str,
    m: float,
    n: float,
    k: float,
    operand_bytes: tuple[float, float],
    out_bytes: float,
    target: Target,
    cal: Calibration = CALIBRATION,
) -> float:
    """One GEMM's time: the slower of its compute and its memory traffic, plus a launch. `operand_bytes`: bytes per
    element of operand a (m x k) and b (n x k); `out_bytes`: of the output (m x n)."""
    flops = 2.0 * m * n * k
    compute = flops / (target.tflops[precision] * 1e12 * efficiency(kernel, m, n, k, cal))
    moved = m * k * operand_bytes[0] + n * k * operand_bytes[1] + m * n * out_bytes
    return 1e3 * max(compute, moved / _bandwidth(target, cal)) + target.launch_us * 1e-3


def _bandwidth(target: Target, cal: Calibration, share: float | None = None) -> float:
    return target.bandwidth_tbs * 1e12 * (cal.memory if share is None else share)


def _pass_ms(nbytes: float, target: Target, cal: Calibration, share: float | None = None) -> float:
    """One memory-bound kernel moving `nbytes`, at `share` of the bandwidth (Calibration.memory by default)."""
    return 1e3 * nbytes / _bandwidth(target, cal, share) + target.launch_us * 1e-3


def cast_kind(cast: OperandCast) -> str:
    """A cast's kind, as Calibration.casts prices its passes: one scale a tensor, one a row, or one a block."""
    return "tensorwise" if cast.block == 0 else ("rowwise" if cast.block < 0 else "block")


def cast_ms(
    uses: Sequence[tuple[OperandCast, str]],
    elements: float,
    rows: float,
    cols: float,
    high: float,
    target: Target,
    cal: Calibration,
    produced: bool = False,
) -> float:
    """The passes that cast one tensor (`rows` x `cols`, `high` bytes an element) for its low-precision `uses` (each
    an OperandCast and the orientation a GEMM reads it in), under the fusion the module's docstring states;
    `produced`: the tensor's amax comes with the kernel that writes it."""
    total = 0.0
    read = elements * high
    kinds = {cast_kind(c) for c, _ in uses}
    if len(kinds) != 1:  # a scale per tensor and per row on one tensor: no fusion this prices
        raise ValueError(f"one tensor cast with scales of kinds {sorted(kinds)}: cast_ms prices one kind a tensor")
    share = cal.casts.get(kinds.pop(), cal.memory)
    if not produced and any(c.tensor_amax and not c.rht for c, _ in uses):
        total += _pass_ms(read, target, cal, share)
    if any(c.tensor_amax and c.rht for c, _ in uses):
        total += _pass_ms(read, target, cal, share)
    passes: dict[tuple[OperandCast, str], set[str]] = {}
    for cast, orientation in uses:
        # one pass per cast serves every orientation where the scale does not depend on it (one per tensor, square
        # tiles); a row or block scale runs along the contraction, so each orientation is a pass of its own
        key = (cast, "any") if cast.block == 0 or cast.tile else (cast, orientation)
        passes.setdefault(key, set()).add(orientation)
    for (cast, _), orientations in passes.items():
        written = 0.0
        for orientation in orientations:
            along = cols if orientation == "row" else rows  # the contraction runs along it
            block = along if cast.block < 0 else (elements if cast.block == 0 else cast.block)
            written += elements * (cast.bits / 8 + cast.scale_bytes / block)
        total += _pass_ms(read + written, target, cal, share)
    return total


def linear_parts(
    shape: LinearShape,
    fmt: Format,
    outer: str | None,
    target: Target,
    cal: Calibration = CALIBRATION,
    done: set[tuple[Any, ...]] | None = None,
    only: Collection[str] = GEMMS,
) -> dict[str, float]:
    """One Linear's predicted ms in `fmt` called under the autocast `outer` (None: an fp32 caller), by part: gemms,
    casts, conversions. `done`: the casts of shared inputs already priced (predict's, across Linears: a compiled
    step computes the same cast of one tensor once); this Linear's input casts are added to it. KeyError names a GEMM
    precision the target does not run."""
    m, k, n = shape.tokens, float(shape.in_features), float(shape.out_features)
    if m <= 0:
        return {"gemms": 0.0, "casts": 0.0, "conversions": 0.0}
    high = ELEMENT_BYTES[outer or "fp32"]  # what the caller holds the layer's tensors in
    dims = {"x": (m, k), "w": (n, k), "dy": (m, n)}
    precisions = fmt.family.gemm_precisions(fmt, outer)
    casts: tuple[GemmCast | None, ...] = fmt.family.gemm_casts(fmt)
    sizes = {"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}
    gemms = conversions = 0.0
    uses: dict[str, list[tuple[OperandCast, str]]] = {}
    converted: set[tuple[str, str]] = set()
    for gemm, precision, cast in zip(GEMMS, precisions, casts):
        if gemm not in only:  # a recomputed forward runs fprop alone
            continue
        gm, gn, gk = sizes[gemm]
        if cast is not None:
            for (tensor, orientation), op in zip(OPERANDS[gemm], (cast.a, cast.b)):
                uses.setdefault(tensor, []).append((op, orientation))
            # a scaled GEMM writes its output in the caller's precision
            gemms += gemm_ms(precision, cast.kernel, gm, gn, gk, (cast.a.bits / 8, cast.b.bits / 8), high, target, cal)
            continue
        own = ELEMENT_BYTES[precision]
        gemms += gemm_ms(precision, precision, gm, gn, gk, (own, own), own, target, cal)
        if own < high:  # a narrower layer than its caller: its operands converted in, its output out
            for tensor, _ in OPERANDS[gemm]:
                if (tensor, precision) not in converted:
                    converted.add((tensor, precision))
                    rows, cols = dims[tensor]
                    conversions += _pass_ms(rows * cols * (high + own), target, cal)
            conversions += _pass_ms(gm * gn * (high + own), target, cal)
    if done is not None and "x" in uses:  # the input's casts, once per tensor and cast
        key = (shape.reads or shape.name, high, tuple(sorted(set(uses["x"]), key=repr)))
        if key in done:
            del uses["x"]
        done.add(key)
    cast_total = sum(
        cast_ms(u, dims[t][0] * dims[t][1], *dims[t], high, target, cal, produced=shape.produced and t != "w")
        for t, u in uses.items()
    )
    return {"gemms": gemms, "casts": cast_total, "conversions": conversions}


def lacking(formats: Collection[Format], target: Target) -> dict[str, list[str]]:
    """The formats among `formats` whose GEMMs need an element format `target` does not run, with those."""
    out: dict[str, list[str]] = {}
    for fmt in formats:
        missing = sorted({p for p in fmt.family.gemm_precisions(fmt, None) if p not in target.tflops}, key=str)
        if missing:
            out[fmt.value] = missing
    return out


def format_of(name: str, layers: Mapping[str, Format]) -> Format:
    """The format layer `name` runs in under a policy's `layers`: its own, else its nearest listed ancestor's, else
    the root's (fp32 where the policy lists no root)."""
    parts = name.split(".") if name else []
    for i in range(len(parts), 0, -1):
        found = layers.get(".".join(parts[:i]))
        if found is not None:
            return found
    return layers.get(ROOT, Format.FP32)


def outer_autocast(name: str, layers: Mapping[str, Format]) -> str | None:
    """The autocast layer `name` is called under: that of its nearest listed ancestor whose format sets one (fp32 turns
    it off; an fp8 or block-scaled layer's leaves the caller's), else the root's: "bf16", "fp16", or None."""
    from autoprec.formats import autocast_name

    parts = name.split(".") if name else []
    for i in range(len(parts) - 1, 0, -1):
        around = layers.get(".".join(parts[:i]))
        if around is not None and (around is Format.FP32 or around.family.autocast_dtype(around) is not None):
            return autocast_name(around.family.autocast_dtype(around))
    root = layers.get(ROOT, Format.FP32)
    return autocast_name(root.family.autocast_dtype(root))


def predict(
    step: Step, policy: Policy, target: Target, cal: Calibration = CALIBRATION, *, experts: Format | None = None
) -> Prediction:
    """The predicted step time of `step` under `policy` on `target`, by part; `experts`: the format an MoE's grouped
    GEMMs run in (None: bf16; grouped_kernel says which it prices). KeyError names a GEMM precision the target does
    not run (the caller refuses those first: lacking). A policy with phases: each phase priced alone, the parts
    averaged by the phases' shares of the run (the step time of the run as a whole)."""
    if policy.phases:
        each = [predict(step, policy.in_phase(i), target, cal, experts=experts) for i in range(len(policy.phases) + 1)]
        shares = policy.phase_shares()
        parts = {k: sum(w * p.parts[k] for w, p in zip(shares, each)) for k in each[0].parts}
        return Prediction(target.name, parts, sum(w * p.unhidden_ms for w, p in zip(shares, each)))
    tp = max(step.tensor_parallel, 1)
    roles = tp_roles(step) if tp > 1 else {}
    parts = dict.fromkeys(("gemms", "casts", "conversions"), 0.0)
    done: set[tuple[Any, ...]] = set()
    for shape in step.linears:
        fmt, outer = format_of(shape.name, policy.layers), outer_autocast(shape.name, policy.layers)
        mine = _shard(shape, roles[shape.name], tp) if tp > 1 else shape
        got = linear_parts(mine, fmt, outer, target, cal, done)
        if step.checkpointing:  # the forward again: fprop and its casts (the shared input's too: the saved cast is gone)
            again = linear_parts(mine, fmt, outer, target, cal, None, only=("fprop",))
            got = {part: ms + again[part] for part, ms in got.items()}
        for part, ms in got.items():
            parts[part] += ms
    peak = target.tflops[BASELINE] * 1e12
    forward = step.other_flops / 3 if step.forward_other_flops is None else step.forward_other_flops
    recompute = 1.0 if step.checkpointing else 0.0
    # attention's heads and the elementwise work's tokens (sequence parallelism) are split over the tensor-parallel ranks
    grouped = step.grouped_flops * (1 + recompute / 3)
    parts["other_matmuls"] = 1e3 * (step.other_flops + recompute * forward) / (peak * cal.gemm[BASELINE]) / tp
    if step.grouped_flops:  # an MoE's experts, at a grouped GEMM's measured share of its precision's peak
        precision, kernel = grouped_kernel(experts or Format(BASELINE))
        parts["experts"] = 1e3 * grouped / (target.tflops[precision] * 1e12 * cal.grouped[kernel]) / tp
    parts["elementwise"] = 1e3 * step.other_bytes * (1 + recompute / 3) * cal.fusion / tp / _bandwidth(target, cal)
    if tp > 1:
        parts["communication"] = tp_communication_ms(step, policy, target, cal, roles)
    if step.expert_parallel > 1 and step.grouped:
        parts["all_to_all"] = ep_communication_ms(step, target, cal)
    unhidden = 0.0
    if step.fsdp and (step.shards > 1 or step.replicas > 1) and prices_data_parallel(target):
        compute = sum(ms for part, ms in parts.items() if part not in ("communication", "all_to_all"))
        ends, unhidden = dp_collectives(step, policy, target, cal, compute)
        parts["data_parallel"] = ends + unhidden
    for part in parts:  # every micro-batch runs these; the optimizer, once a step
        parts[part] *= max(step.micro_steps, 1)
    parts["optimizer"] = 1e3 * optimizer_params(step) * OPTIMIZER_BYTES / _bandwidth(target, cal)
    return Prediction(target.name, parts, unhidden * max(step.micro_steps, 1))


def expert_params(step: Step) -> float:
    """The parameters of an MoE's grouped experts: each grouped GEMM call's 3-D weight (experts x K x N)."""
    return float(sum(g.groups * g.in_features * g.out_features for g in step.grouped))


def optimizer_params(step: Step) -> float:
    """The parameters one rank's optimizer updates: the others split over the data-parallel shards times the
    tensor-parallel ranks, the experts' over those or over the expert-parallel ranks, whichever are more (torchtitan's
    FSDP shards an expert-parallel rank's experts further over the ranks it leaves; without a sharded optimizer each
    rank updates its own experts). Expert tensor parallelism is taken as 1 (torchtitan's default)."""
    tp, shards = max(step.tensor_parallel, 1), max(step.shards, 1)
    experts = min(expert_params(step), step.params)
    return (step.params - experts) / (shards * tp) + experts / max(shards * tp, step.expert_parallel)


def grouped_kernel(fmt: Format) -> tuple[str, str]:
    """(precision, kernel) of an MoE's grouped GEMMs in `fmt`: one of GROUPED's kernels, the same for the three GEMMs.
    ValueError naming the formats that have one."""
    casts = fmt.family.gemm_casts(fmt)
    precisions = fmt.family.gemm_precisions(fmt, BASELINE)
    kernels = {c.kernel if c is not None else p for c, p in zip(casts, precisions)}
    if len(kernels) != 1 or len(set(precisions)) != 1 or next(iter(kernels)) not in GROUPED:
        raise ValueError(
            f"no grouped GEMM timing of {fmt.value} is known: the experts can be priced in "
            f"{' or '.join(GROUPED)} (their measured grouped GEMMs, published_points.md B33-B40)"
        )
    return precisions[0], next(iter(kernels))


def tp_roles(step: Step) -> dict[str, str]:
    """Each Linear's tensor-parallel role, as Megatron and torchtitan shard a transformer: "column" (out_features
    split) for a Linear that shares its input with another (q, k and v; gate and up) or does not return to the
    model's width (an up-projection, the output layer); "row" (in_features split) for one that returns to the width
    alone (the attention's output, the down-projection), which closes a residual branch."""
    shared = {s.reads for s in step.linears if s.reads}
    dim = width(step)
    return {s.name: "column" if (s.reads or s.name in shared or s.out_features != dim) else "row" for s in step.linears}


def _shard(shape: LinearShape, role: str, tp: int) -> LinearShape:
    if role == "row":
        return dataclasses.replace(shape, in_features=max(1, shape.in_features // tp))
    return dataclasses.replace(shape, out_features=max(1, shape.out_features // tp))


def tp_branches(step: Step, roles: Mapping[str, str]) -> list[tuple[tuple[LinearShape, ...], LinearShape]]:
    """Each residual branch of a tensor-parallel step: the column-parallel Linears called since the previous
    row-parallel one (in the forward's order: q, k and v; gate and up) and the row-parallel Linear that closes it
    (the attention's output, the down-projection). Column-parallel Linears no row-parallel one follows (the output
    layer) close no branch."""
    branches: list[tuple[tuple[LinearShape, ...], LinearShape]] = []
    columns: list[LinearShape] = []
    for shape in step.linears:
        if roles.get(shape.name) == "row":
            branches.append((tuple(columns), shape))
            columns = []
        else:
            columns.append(shape)
    return branches


# the scaled GEMM kernels torch's micro-pipeline TP fuses with a collective (its fused ops take a scale per tensor or
# per row; MX and NVFP4 block scales, and NVFP4's scaled_mm, are not matched: pytorch/pytorch#194518, #183509)
_FUSED_SCALED = frozenset(("fp8-tensorwise", "fp8-rowwise"))


def _gathered_bytes(cast: GemmCast | None) -> float:
    """The bytes an element of a collective moves for a GEMM operand cast by `cast`: fp8 where it is a tensorwise fp8
    cast, which torchao's float8 tensor parallelism makes before the collective; bf16 otherwise."""
    return ELEMENT_BYTES["fp8"] if cast is not None and cast.kernel == "fp8-tensorwise" else ELEMENT_BYTES[BASELINE]


def _reads_gathered(fmt: Format, gemm: int, gathered: float) -> bool:
    """Whether GEMM `gemm` (0 fprop, 1 dgrad) of a Linear in `fmt` reads its gathered operand as the collective
    leaves it (bf16 with no cast, or fp8 cast before the gather), which torch's micro-pipeline TP needs to fuse the
    two: an all-gather whose consumer is a cast first is not fused."""
    cast = fmt.family.gemm_casts(fmt)[gemm]
    if cast is None:
        return fmt.family.gemm_precisions(fmt, BASELINE)[gemm] == BASELINE and gathered == ELEMENT_BYTES[BASELINE]
    return cast.kernel == "fp8-tensorwise" and gathered == ELEMENT_BYTES["fp8"]


def _writes_scattered(fmt: Format) -> bool:
    """Whether the fprop of a Linear in `fmt` is a matmul torch's micro-pipeline TP fuses with the reduce-scatter of
    its output: a plain bf16 one, or a scaled one of _FUSED_SCALED."""
    cast = fmt.family.gemm_casts(fmt)[0]
    if cast is None:
        return fmt.family.gemm_precisions(fmt, BASELINE)[0] == BASELINE
    return cast.kernel in _FUSED_SCALED


def tp_communication_ms(step: Step, policy: Policy, target: Target, cal: Calibration, roles: Mapping[str, str]) -> float:
    """Sequence-parallel tensor parallelism's collectives: each residual branch (tp_branches) all-gathers its input
    and reduce-scatters its output in the forward and the reverse in the backward (the forward's again under
    checkpointing), each of the branch's tokens x the model's width, in a ring at half the NVLink bandwidth (one
    direction) times Calibration.memory. In bf16, but where torchao's float8 tensor parallelism casts to tensorwise
    fp8 before it gathers: the forward's input where every column-parallel Linear of the branch runs a tensorwise fp8
    fprop (torchtitan's float8 TP styles take no other), the output's gradient where the row-parallel Linear runs a
    tensorwise fp8 dgrad.

    Vanilla TP (Step.async_tp False): no collective overlapped. Asynchronous TP (torch's micro-pipeline TP, as
    torchtitan enables it): a collective fused with the GEMMs next to it runs in pipelined chunks, the pair taking
    max(collective, GEMMs) + min(collective, GEMMs) / tp rather than their sum (the chunked GEMMs' own loss of
    efficiency is not priced); fused are the forward's all-gather with the column-parallel fprops that read it uncast
    (_reads_gathered: torch fuses an all-gather into the matmuls that consume it directly, whatever its other users),
    the forward's reduce-scatter with the row-parallel fprop that writes it where torch matches that matmul
    (_writes_scattered), and the backward's all-gather with the row-parallel dgrad where it reads it uncast. The
    backward's reduce-scatter sums the column-parallel dgrads first, so it is not fused. Returns the time the
    collectives add to the step."""
    tp, dim = max(step.tensor_parallel, 1), width(step)
    per_direction = _one_way(target.link_gbs / 2, cal)
    passes = 3 if step.checkpointing else 2  # forward, backward, and the forward again
    high = ELEMENT_BYTES[BASELINE]

    def collective(nbytes: float) -> float:
        return 1e3 * (tp - 1) / tp * nbytes / per_direction + target.launch_us * 1e-3

    def added(comm: float, gemms: float, fused: bool) -> float:
        return max(comm, gemms) + min(comm, gemms) / tp - gemms if fused and step.async_tp else comm

    def gemm(shape: LinearShape, which: str) -> float:
        fmt, outer = format_of(shape.name, policy.layers), outer_autocast(shape.name, policy.layers)
        return linear_parts(_shard(shape, roles[shape.name], tp), fmt, outer, target, cal, None, only=(which,))["gemms"]

    total = 0.0
    for columns, row in tp_branches(step, roles):
        fmt = format_of(row.name, policy.layers)
        formats = [format_of(c.name, policy.layers) for c in columns]
        fprops = {_gathered_bytes(f.family.gemm_casts(f)[0]) for f in formats}
        gathered = fprops.pop() if len(fprops) == 1 else high  # a mixed branch gathers in bf16
        grad_gathered = _gathered_bytes(fmt.family.gemm_casts(fmt)[1])
        elements = row.tokens * dim
        readers = [c for c, f in zip(columns, formats) if _reads_gathered(f, 0, gathered)]
        gather = added(collective(elements * gathered), sum(gemm(c, "fprop") for c in readers), bool(readers))
        scatter = added(collective(elements * high), gemm(row, "fprop"), _writes_scattered(fmt))
        grad_gather = added(collective(elements * grad_gathered), gemm(row, "dgrad"), _reads_gathered(fmt, 1, grad_gathered))
        total += (passes - 1) * (gather + scatter) + grad_gather + collective(elements * high)
    return total


def _one_way(gbs: float, cal: Calibration) -> float:
    """The bytes a second a collective moves each way over a link of `gbs` GB/s one way: Calibration.memory's share
    of it, as every collective here is priced."""
    return gbs * 1e9 * cal.memory


def prices_data_parallel(target: Target) -> bool:
    """Whether `target` says the bandwidths a data-parallel collective runs at: its NVLink's and its NICs'."""
    return target.link_gbs > 0 and target.nic_gbs > 0


def ring_ms(nbytes: float, ranks: int, stride: int, target: Target, cal: Calibration = CALIBRATION) -> float:
    """A ring all-gather or reduce-scatter of `nbytes` (the whole, gathered tensor) over `ranks` ranks placed `stride`
    apart (the ranks of the parallelisms inside theirs: tensor parallelism's): (ranks - 1) / ranks of it through each
    rank, at half the NVLink bandwidth (one direction) where the ranks share an NVLink domain, else at the slower of
    that and the NICs of the group's ranks in one domain together (NCCL's rings, a NIC each, leave a domain through
    their own NIC), times Calibration.memory, plus a launch."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    members = max(1, min(ranks, target.domain // max(stride, 1)))  # the group's ranks in one domain
    link = target.link_gbs / 2
    gbs = link if ranks <= members else min(link, members * target.nic_gbs)
    if gbs <= 0:
        raise ValueError(f"target {target.name!r} gives no NVLink or NIC bandwidth for a ring over {ranks} ranks")
    return 1e3 * (ranks - 1) / ranks * nbytes / _one_way(gbs, cal) + target.launch_us * 1e-3


def fsdp_unit(name: str) -> str:
    """The FSDP unit a Linear is in, as torchtitan shards a transformer: its block (its name up to the first numeric
    part: layers.3), else itself (the output layer, which torchtitan shards with the final norm)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def dp_communication_ms(step: Step, policy: Policy, target: Target, cal: Calibration, compute_ms: float) -> float:
    """The time FSDP2's collectives add to one micro-batch (dp_collectives' two parts together)."""
    return sum(dp_collectives(step, policy, target, cal, compute_ms))


def dp_collectives(step: Step, policy: Policy, target: Target, cal: Calibration, compute_ms: float) -> tuple[float, float]:
    """The time FSDP2's collectives add to one micro-batch, in two parts: the first units' and what the compute does
    not hide of the rest. As torchtitan shards a model: a unit per block (fsdp_unit), the parameters no Linear holds
    (the embeddings) a unit before them, each all-gathered in bf16 (fp8 under Step.fp8_all_gather for a Linear whose
    format FSDP2 gathers so) in the forward and again in the backward (a unit outside the blocks, the output layer's,
    is kept from the forward), its gradient reduce-scattered in fp32 (torchtitan's reduce dtype) and all-reduced over
    the replicas, every micro-batch; an MoE's grouped experts over their own ranks (the shards x TP over EP,
    torchtitan's), gathered in bf16. Each collective is a ring (ring_ms) over ranks placed TP ranks apart, on the TP
    shard of the weights. FSDP2 gathers the next unit while this one computes and reduces the last one's gradient
    while the next computes: the first two units' gathers and reductions are exposed, the rest only where the
    forward's collectives outlast the forward's third (a quarter under checkpointing) of `compute_ms` (the
    micro-batch's parts but the other collectives), or the backward's the rest."""
    tp, shards, replicas = max(step.tensor_parallel, 1), max(step.shards, 1), max(step.replicas, 1)

    def reduce(nbytes: float, ranks: int, stride: int) -> float:  # reduce-scatter, then the shard's all-reduce
        over_replicas = 2 * ring_ms(nbytes / ranks, replicas, stride * ranks, target, cal) if replicas > 1 else 0.0
        return ring_ms(nbytes, ranks, stride, target, cal) + over_replicas

    gathered: dict[str, float] = {}  # bytes an element, over the unit's elements, per unit in the forward's order
    weights: dict[str, float] = {}
    for shape in step.linears:
        fmt = format_of(shape.name, policy.layers)
        fp8 = step.fp8_all_gather and fmt.family.fsdp_fp8_all_gather(fmt)  # as apply_policy gathers it
        elements = shape.in_features * shape.out_features / tp
        unit = fsdp_unit(shape.name)
        gathered[unit] = gathered.get(unit, 0.0) + elements * ELEMENT_BYTES["fp8" if fp8 else BASELINE]
        weights[unit] = weights.get(unit, 0.0) + elements
    rest = max(0.0, step.params - expert_params(step) - tp * sum(weights.values())) / tp
    units = ([("", rest * ELEMENT_BYTES[BASELINE], rest)] if rest > 0 else []) + [(u, gathered[u], weights[u]) for u in gathered]
    gather = [ring_ms(nbytes, shards, tp, target, cal) for _, nbytes, _ in units]
    reduced = [reduce(elements * 4.0, shards, tp) for _, _, elements in units]
    # resharded after the forward, so gathered again in the backward: the embeddings' unit and the blocks'
    again = [g for (u, _, _), g in zip(units, gather) if u == "" or any(p.isdigit() for p in u.split("."))]
    experts = expert_params(step)
    if experts:
        ep = max(step.expert_parallel, 1)
        ranks, stride = (max(1, shards * tp // ep), ep) if ep > 1 else (shards, tp)
        mine = experts / (ep if ep > 1 else tp)
        expert_gather = ring_ms(mine * ELEMENT_BYTES[BASELINE], ranks, stride, target, cal)
        expert_reduce = reduce(mine * 4.0, ranks, stride)
    else:
        expert_gather = expert_reduce = 0.0
    ends = sum(gather[:2]) + sum(reduced[:2])  # nothing computes before the first gathers or after the last reductions
    share = 0.25 if step.checkpointing else 1 / 3
    forward = sum(gather[2:]) + expert_gather
    backward = sum(again) + sum(reduced[2:]) + expert_gather + expert_reduce
    return ends, max(0.0, forward - share * compute_ms) + max(0.0, backward - (1 - share) * compute_ms)


def moe_layers(step: Step) -> list[tuple[GroupedShape, GroupedShape]]:
    """Each MoE layer's first and last grouped GEMM call, in the forward's order: the first takes the routed tokens
    (its K, the width they arrive in), the last gives them back (its N, the width they leave in)."""
    layers: dict[int, list[GroupedShape]] = {}
    for g in step.grouped:
        layers.setdefault(g.layer, []).append(g)
    return [(calls[0], calls[-1]) for calls in layers.values()]


def routed_tokens(step: Step) -> float:
    """The tokens an MoE's experts take per step, all its MoE layers together (top-k counts a token k times): the
    rows of each layer's first grouped GEMM."""
    return sum(first.rows for first, _ in moe_layers(step))


def ep_communication_ms(step: Step, target: Target, cal: Calibration = CALIBRATION) -> float:
    """Expert parallelism's all-to-alls, not overlapped: each MoE layer sends its routed tokens to their experts' ranks
    and back (dispatch and combine) in the forward, and their gradients the same ways in the backward (the forward's
    again under checkpointing), each the layer's routed tokens x the width they travel in (the first grouped GEMM's K
    going, the last one's N coming back; moe_layers) in bf16, of which (ep - 1) / ep
    leaves the rank, at half the NVLink bandwidth (one direction) times Calibration.memory, as tp_communication_ms
    prices a collective. Balanced routing: every rank sends and receives as many tokens (a busier rank waits longer);
    a top-k token is sent once per expert it goes to (no per-rank deduplication)."""
    ep = max(step.expert_parallel, 1)
    per_direction = _one_way(target.link_gbs / 2, cal)
    passes = 3 if step.checkpointing else 2  # forward, backward, and the forward again
    layers = moe_layers(step)
    # each layer's dispatch (the routed tokens at the first GEMM's K) and combine (at the last GEMM's N)
    elements = sum(first.rows * first.in_features + last.rows * last.out_features for first, last in layers)
    nbytes = elements * ELEMENT_BYTES[BASELINE] * (ep - 1) / ep
    return passes * (1e3 * nbytes / per_direction + 2 * len(layers) * target.launch_us * 1e-3)


def uniform(fmt: Format | str, step: Step, *, keep: Collection[str] = ()) -> Policy:
    """Every Linear of `step` in `fmt` but those in `keep` (which `fmt` cannot run), the rest (the model root) in bf16:
    `autoprec predict --format`."""
    fmt = Format(fmt)
    layers: dict[str, Format] = {ROOT: Format(BASELINE)}
    for shape in step.linears:
        if shape.name != ROOT and shape.name not in keep:
            layers[shape.name] = fmt
    return Policy(layers=layers)


def baseline() -> Policy:
    """Uniform bf16: the model root in bf16, every layer in it."""
    return Policy(layers={ROOT: Format(BASELINE)})


def speedup(
    step: Step, policy: Policy, target: Target, cal: Calibration = CALIBRATION, *, experts: Format | None = None
) -> float:
    """Uniform bf16's predicted step time over `policy`'s (1.0: as fast); `experts` as predict's."""
    ms = predict(step, policy, target, cal, experts=experts).ms
    return predict(step, baseline(), target, cal).ms / ms if ms > 0 else 1.0


def band() -> str:
    """The predictor's error band over every held-out point, in words."""
    return f"error +-{100 * ERROR:.0f}% over {VALIDATION_POINTS} validation points"


def width(step: Step) -> int:
    """A model's width as the regimes count it: the smaller dimension of its Linears, their median weighted by FLOPs
    (a transformer's d_model; 0 with no Linear)."""
    pairs = sorted((min(s.in_features, s.out_features), s.tokens * s.in_features * s.out_features) for s in step.linears)
    half, acc = sum(w for _, w in pairs) / 2, 0.0
    for dim, weight in pairs:
        acc += weight
        if acc >= half:
            return dim
    return 0


def kernels(step: Step, policy: Policy) -> set[str]:
    """The low-precision GEMM kernels `policy` runs `step`'s Linears in (FormatFamily.gemm_casts)."""
    found: set[str] = set()
    for shape in step.linears:
        found |= format_kernels(format_of(shape.name, policy.layers))
    return found


@dataclasses.dataclass(frozen=True)
class Band:
    """A prediction's error band: its regime's largest held-out |error| and how many held-out points are in it, in
    words; `error` None where the prediction is outside the validated range (`text` says why)."""

    text: str
    error: float | None = None
    points: int = 0


def regime_band(
    step: Step,
    policy: Policy,
    *,
    outside_share: float = 0.0,
    experts: Format | None = None,
    data_parallel: float = 0.0,
    unhidden: float = 0.0,
) -> Band:
    """The band of `policy`'s prediction on `step`: its regime's (the width of the Linears it lowers, else of all, the
    kernels it runs them and the experts in, the layout: MoE where grouped experts do OUTSIDE_LIMIT of the matmul
    work, else tensor- or data-parallel; the largest band over its kernels), or why it is outside the validated range.
    `outside_share`: the step's matmul FLOPs in weighted modules outside the Linears (Coverage); `experts`: the format
    the grouped experts are priced in (predict's experts); `data_parallel`: the largest share of a predicted step
    (bf16's or the policy's) FSDP's collectives take, past DATA_PARALLEL_LIMIT outside the validated range, and
    `unhidden` the largest share the part the compute does not hide takes (Prediction.unhidden_ms), past
    UNHIDDEN_LIMIT. A policy with phases: the widest band of its phases that
    run a low-precision GEMM (a phase of bf16 and fp32 only is priced as the baseline is), outside where one is."""
    if policy.phases:
        phases = [policy.in_phase(i) for i in range(len(policy.phases) + 1)]

        def band_of(phase: Policy) -> Band:
            return regime_band(
                step, phase, outside_share=outside_share, experts=experts, data_parallel=data_parallel, unhidden=unhidden
            )

        bands = [band_of(p) for p in phases if kernels(step, p)]
        if not bands:
            return band_of(phases[0])
        return next((b for b in bands if b.error is None), max(bands, key=lambda b: b.error or 0.0))
    lowered = Step(tuple(s for s in step.linears if format_kernels(format_of(s.name, policy.layers))))
    dim = width(lowered) or width(step)
    experts_kernel = grouped_kernel(experts)[1] if experts is not None else BASELINE
    used = sorted(kernels(step, policy) | ({experts_kernel} - {BASELINE}))
    total = step.grouped_flops + step.other_flops + linear_flops(step)
    grouped_share = step.grouped_flops / total if total else 0.0
    moe = step.grouped_flops > 0 and grouped_share >= OUTSIDE_LIMIT
    parallel = ("tp-async" if step.async_tp else "tp") if step.tensor_parallel > 1 else "dp"
    layout = ("moe-experts" if experts_kernel != BASELINE else "moe") if moe else parallel
    low = next((lo for lo, hi in WIDTH_CLASSES if lo <= dim <= hi), None)
    ranges = ", ".join(f"{lo}-{hi}" for lo, hi in WIDTH_CLASSES)
    outside = "outside the validated range: "
    if not used:
        return Band(outside + "no held-out point prices a policy without a low-precision GEMM")
    if moe and step.tensor_parallel > 1:
        return Band(outside + "no held-out point is an MoE trained with tensor parallelism")
    if outside_share - grouped_share >= OUTSIDE_LIMIT:
        return Band(
            outside + f"{outside_share - grouped_share:.0%} of the step's matmul FLOPs run outside the Linears and the "
            "grouped experts (convolutions, experts of no grouped GEMM), which no held-out point tests"
        )
    if unhidden > UNHIDDEN_LIMIT:
        return Band(
            outside + f"FSDP's collectives the compute does not hide take {unhidden:.1%} of the step, where it hides "
            "all but the first units' at every held-out point"
        )
    if data_parallel > DATA_PARALLEL_LIMIT:
        return Band(
            outside + f"FSDP's collectives take {data_parallel:.1%} of the step, more than the "
            f"{DATA_PARALLEL_LIMIT:.1%} they take at most at a held-out point"
        )
    if low is None:
        return Band(outside + f"the lowered Linears are {dim} wide, where held-out points are {ranges} wide")
    missing = [k for k in used if (low, k, layout) not in BANDS]
    if missing:
        return Band(outside + f"no held-out point runs {', '.join(missing)} at {dim} wide {LAYOUTS[layout]}")
    error = max(BANDS[low, k, layout][0] for k in used)
    points = sum(BANDS[low, k, layout][1] for k in used)
    hi = dict(WIDTH_CLASSES)[low]
    text = f"error +-{100 * error:.0f}% over {points} held-out points {low}-{hi} wide {LAYOUTS[layout]} in {', '.join(used)}"
    return Band(text, error, points)


def linear_flops(step: Step) -> float:
    """The FLOPs of the step's Linears, forward and backward."""
    return sum(6.0 * s.tokens * s.in_features * s.out_features for s in step.linears)


def format_kernels(fmt: Format) -> set[str]:
    """The low-precision GEMM kernels `fmt` runs a Linear's GEMMs in (FormatFamily.gemm_casts)."""
    return {c.kernel for c in fmt.family.gemm_casts(fmt) if c is not None}


def describe(value: float, target: Target, band_text: str | None = None) -> str:
    """A predicted speedup in words, as every report shows it: never a measurement. `band_text`: the regime's band
    (regime_band), else the band over every held-out point."""
    return (
        f"{value:.2f}x uniform {BASELINE}, predicted for {target.name.upper()} by autoprec's step-time predictor "
        f"({band_text or band()})"
    )
