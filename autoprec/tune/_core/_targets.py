"""Named target devices for planning a policy where the formats' kernels are not on this machine (the FLOP goal,
_flops.py): each one's nominal dense throughput per GEMM element format, in TFLOP/s, from the vendor's datasheet.

Nominal means the datasheet's peak: real GEMMs reach a share of it that depends on their shapes, and a training step
is more than its GEMMs, so what is computed from this table is an estimate from FLOP counts, never a speed. The
datasheets print the tensor-core figures with 2:4 structured sparsity; the dense figure (half of it) is the one a
training GEMM gets and the one listed here. "fp32" is the non-tensor (CUDA-core) rate: autoprec's fp32 layers run in
strict fp32, without TF32 (trainer.matmul_precision); "tf32" is listed as the datasheet gives it, for reference.
A format whose GEMMs need an element format a target does not list is refused for that target (_flops.py), not
counted at another format's speed.

The step-time predictor (_predict.py) also reads each target's memory bandwidth (the datasheet's HBM figure), its
NVLink bandwidth, NVLink domain and scale-out NIC (the system's datasheet: the collectives of a parallel layout) and
the cost of one kernel launch. The launch cost is on no datasheet: LAUNCH_US is a stated assumption, not a measurement,
and moves no validation point of the predictor by more than 4% when set to 0 or doubled (docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from autoprec.formats import GEMM_PRECISIONS
from autoprec.registry import Registry

# The cost of one kernel launch on the device, in microseconds: an assumption, not a datasheet's or a measured figure.
# Under torch.compile (CUDA graphs aside) a kernel costs a few microseconds to issue; the predictor adds it per GEMM
# and per cast pass, which matters only for small layers.
LAUNCH_US = 4.0


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to plan for: `tflops` maps a GEMM element format (formats.GEMM_PRECISIONS, and "tf32") to its
    nominal dense throughput in TFLOP/s, bf16 (the baseline every plan is compared with) included; `bandwidth_tbs`
    is its memory bandwidth in TB/s; `launch_us` the cost of one kernel launch in microseconds; `source` cites where
    the numbers come from."""

    name: str  # --target's value
    device: str  # the device in words
    tflops: Mapping[str, float]
    source: str
    bandwidth_tbs: float
    launch_us: float = LAUNCH_US
    # the GPU's NVLink bandwidth, both directions together (the datasheet's figure), in GB/s: tensor parallelism's
    # collectives run at half of it each way; 0 where the datasheet gives none
    link_gbs: float = 0.0
    # the GPUs one NVLink domain joins (a server's 8, an NVL72 rack's 72): a collective over more leaves it through
    # the scale-out NICs
    domain: int = 1
    # each GPU's scale-out NIC, one direction, in GB/s (a 400 Gb/s ConnectX-7: 50); 0 where the datasheet gives none
    nic_gbs: float = 0.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tflops) - {*GEMM_PRECISIONS, "tf32"}, key=str)
        bad = [k for k, v in self.tflops.items() if not _positive(v)]
        fix = f"tflops maps {', '.join(GEMM_PRECISIONS)} (and tf32) to finite numbers > 0, bf16 (the baseline) among them"
        if unknown:
            raise ValueError(f"target {self.name!r}: tflops has {', '.join(map(repr, unknown))}; {fix}")
        if bad:
            raise ValueError(f"target {self.name!r}: tflops[{bad[0]!r}] is {self.tflops[bad[0]]!r}; {fix}")
        if "bf16" not in self.tflops:
            raise ValueError(f"target {self.name!r}: tflops has no 'bf16', the baseline every plan is priced against; {fix}")
        if not _positive(self.bandwidth_tbs):
            raise ValueError(
                f"target {self.name!r}: bandwidth_tbs is {self.bandwidth_tbs!r}; give the memory bandwidth in TB/s, a "
                "finite number > 0 (the datasheet's HBM figure)"
            )
        if isinstance(self.domain, bool) or not isinstance(self.domain, int) or self.domain < 1:
            raise ValueError(
                f"target {self.name!r}: domain is {self.domain!r}; give the GPUs one NVLink domain joins, a whole "
                "number >= 1 (8 for an 8-GPU server)"
            )
        for field, what in (
            ("link_gbs", "the NVLink bandwidth in GB/s (both directions), a finite number >= 0 (0: none)"),
            ("nic_gbs", "each GPU's scale-out NIC bandwidth in GB/s (one direction), a finite number >= 0 (0: none)"),
            ("launch_us", f"one kernel launch's cost in microseconds, a finite number >= 0 (default {LAUNCH_US:g})"),
        ):
            value = getattr(self, field)
            if not (_positive(value) or value == 0):
                raise ValueError(f"target {self.name!r}: {field} is {value!r}; give {what}")

    @property
    def runs(self) -> tuple[str, ...]:
        """The GEMM element formats it runs, in GEMM_PRECISIONS order."""
        return tuple(p for p in GEMM_PRECISIONS if p in self.tflops)


def _positive(value: object) -> bool:
    """A finite real number > 0 (no bool, no inf or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


_TARGETS: Registry[Target] = Registry("target")


def register_target(target: Target) -> Target:
    """Make `target` a choice of --target and SearchConfig(target=...)."""
    _TARGETS.refuse_taken(target.name, f"unregister_target({target.name!r}) first to replace it, or give it another name")
    _TARGETS[target.name] = target
    return target


def unregister_target(name: str) -> Target:
    return _TARGETS.pop(name)


def targets() -> tuple[Target, ...]:
    return tuple(_TARGETS.values())


def target_named(value: object) -> Target:
    """The registered target of that name (any case; a Target as it is); ValueError naming the choices otherwise."""
    if isinstance(value, Target):
        return value
    found = _TARGETS.get(str(value).strip().lower()) if isinstance(value, str) else None
    if found is None:
        raise ValueError(f"target must be one of {', '.join(_TARGETS)}, but got {value!r}")
    return found


B200 = register_target(
    Target(
        name="b200",
        device="NVIDIA B200 (HGX B200, 1000 W)",
        # dense: the datasheet's sparse tensor figures halved (FP4 18 -> 9 PFLOPS, FP8/FP6 9 -> 4.5, FP16/BF16 4.5 -> 2.25,
        # TF32 2.2 -> 1.1); FP8 is the rate of MX fp8 too (the datasheet gives one FP8 figure), FP4 that of NVFP4
        tflops={"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "nvfp4": 9000.0},
        source="NVIDIA HGX B200 specifications, per GPU (https://www.nvidia.com/en-us/data-center/hgx/; NVIDIA Blackwell "
        "datasheet): FP4 Tensor 18 PFLOPS, FP8/FP6 9, FP16/BF16 4.5, TF32 2.2 (with sparsity), FP32 75 TFLOPS; HBM3e "
        "~8 TB/s; NVLink 1.8 TB/s. NVIDIA DGX B200 datasheet: 8 GPUs a server, 8x single-port ConnectX-7 400 Gb/s",
        bandwidth_tbs=8.0,
        link_gbs=1800.0,
        domain=8,
        nic_gbs=50.0,
    )
)
H100 = register_target(
    Target(
        name="h100",
        device="NVIDIA H100 SXM5",
        # dense: the datasheet's sparse figures halved; Hopper has no MX or NVFP4 tensor-core formats
        tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
        source="NVIDIA H100 Tensor Core GPU datasheet, SXM column "
        "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet): FP8 3,958 TFLOPS, BF16/FP16 "
        "1,979, TF32 989 (with sparsity), FP32 67 TFLOPS; HBM3 3.35 TB/s; NVLink 900 GB/s. NVIDIA DGX H100 datasheet: "
        "8 GPUs a server, 8x single-port ConnectX-7 400 Gb/s",
        bandwidth_tbs=3.35,
        link_gbs=900.0,
        domain=8,
        nic_gbs=50.0,
    )
)
H200 = register_target(
    Target(
        name="h200",
        device="NVIDIA H200 SXM",
        tflops=H100.tflops,  # H100's compute (the same dense rates), more and faster memory
        source="NVIDIA H200 Tensor Core GPU datasheet, SXM column: FP8 "
        "3,958 TFLOPS, BF16/FP16 1,979, TF32 989 (with sparsity), FP32 67 TFLOPS; HBM3e 4.8 TB/s; NVLink 900 GB/s. "
        "NVIDIA DGX H200 datasheet: 8 GPUs a server, 8x single-port ConnectX-7 400 Gb/s",
        bandwidth_tbs=4.8,
        link_gbs=900.0,
        domain=8,
        nic_gbs=50.0,
    )
)
GB200 = register_target(
    Target(
        name="gb200",
        device="NVIDIA B200 in a GB200 superchip (1200 W)",
        # dense: the datasheet's sparse figures halved, per GPU (FP4 20 -> 10 PFLOPS, FP8 10 -> 5, BF16 5 -> 2.5,
        # TF32 2.5 -> 1.25)
        tflops={"fp32": 80.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0, "nvfp4": 10000.0},
        source="NVIDIA GB200 NVL72 specifications, per GPU: FP4 "
        "Tensor 20 PFLOPS, FP8/FP6 10, FP16/BF16 5, TF32 2.5 (with sparsity), FP32 80 TFLOPS; HBM3e 8 TB/s; NVLink "
        "1.8 TB/s; 72 GPUs an NVLink domain. NVIDIA's multi-node NVLink tuning guide (GB200 NVL72 72x1): a compute "
        "tray's 4 GPUs with their ConnectX-7 (400 Gb/s each)",
        bandwidth_tbs=8.0,
        link_gbs=1800.0,
        domain=72,
        nic_gbs=50.0,
    )
)
