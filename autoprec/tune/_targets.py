"""Named target devices for planning a policy where the formats' kernels are not on this machine (the FLOP goal,
_flops.py): each one's nominal dense throughput per GEMM element format, in TFLOP/s, from the vendor's datasheet.

Nominal means the datasheet's peak: real GEMMs reach a share of it that depends on their shapes, and a training step
is more than its GEMMs, so what is computed from this table is an estimate from FLOP counts, never a speed. The
datasheets print the tensor-core figures with 2:4 structured sparsity; the dense figure (half of it) is the one a
training GEMM gets and the one listed here. "fp32" is the non-tensor (CUDA-core) rate: autoprec's fp32 layers run in
strict fp32, without TF32 (trainer.matmul_precision); "tf32" is listed as the datasheet gives it, for reference.
A format whose GEMMs need an element format a target does not list is refused for that target (_flops.py), not
counted at another format's speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from autoprec.formats import GEMM_PRECISIONS
from autoprec.registry import Registry


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to plan for: `tflops` maps a GEMM element format (formats.GEMM_PRECISIONS, and "tf32") to its
    nominal dense throughput in TFLOP/s; `source` cites where the numbers come from."""

    name: str  # --target's value
    device: str  # the device in words
    tflops: Mapping[str, float]
    source: str

    def __post_init__(self) -> None:
        unknown = set(self.tflops) - {*GEMM_PRECISIONS, "tf32"}
        if unknown or not all(v > 0 for v in self.tflops.values()):
            raise ValueError(f"target {self.name!r}: tflops maps {', '.join(GEMM_PRECISIONS)} (and tf32) to numbers > 0")

    @property
    def runs(self) -> tuple[str, ...]:
        """The GEMM element formats it runs, in GEMM_PRECISIONS order."""
        return tuple(p for p in GEMM_PRECISIONS if p in self.tflops)


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
        "datasheet): FP4 Tensor 18 PFLOPS, FP8/FP6 9, FP16/BF16 4.5, TF32 2.2 (with sparsity), FP32 75 TFLOPS",
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
        "1,979, TF32 989 (with sparsity), FP32 67 TFLOPS",
    )
)
