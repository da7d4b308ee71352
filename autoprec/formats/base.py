"""What every format family shares: the `Format` value, its `FormatSpec` facts, the `FormatFamily` a format belongs
to, and the two registries (families by name, formats by name).

A format family is the runtime of a kind of format (torch.autocast's dtypes, torchao's float8 linears): it knows how
to put one of its formats on the listed modules of a model, whether a device and a module can run it and why not,
its numeric limits, and what an export calls it. Callers ask the family (`fmt.family`) and branch on none by name.
`register_family` adds one, `register_format` a format of it; docs/policy-file.md, "Adding a format family", says
what a family implements.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import torch

from autoprec.registry import Registry
from autoprec.tensors import map_tensors

_LOW = (torch.float16, torch.bfloat16)
# The element formats a GEMM can run in (FormatFamily.gemm_precisions): what a target's throughput table is keyed by.
GEMM_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4")
# An nn.Linear's three GEMMs: fprop (the output), dgrad (the input's gradient), wgrad (the weight's gradient).
GEMMS = ("fprop", "dgrad", "wgrad")
# The largest finite e4m3 value (448): fp8's forward values, MXFP8's elements, NVFP4's block scales.
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
# What the profile records as the time of a format that only runs emulated on a device (FormatFamily.has_kernels).
NO_KERNEL = "no kernel on this device"


def _package() -> Any:
    """autoprec.formats, read at call time: tests stand in for a GPU by replacing its `_has_capability`."""
    return sys.modules["autoprec.formats"]


class _FormatType(type):
    """Iterating `Format` gives the registered formats, in registration order (as iterating the enum it was did)."""

    def __iter__(cls) -> Iterator[Format]:
        return iter([s.format for s in REGISTRY.values()])

    def __len__(cls) -> int:
        return len(REGISTRY)


class Format(str, metaclass=_FormatType):
    """A registered per-layer precision format: a string equal to its name ("bf16"), which is what policy files,
    journals and Optuna params hold. `Format("bf16")` is the registered one (the same object each time) and raises
    ValueError for a name not registered. Each built-in one is a class attribute, its name upper-cased with "_" for
    "-" (Format.BF16, Format.FP8_FWD_DGRAD, Format.NVFP4); a registered one also by name. What each one means
    is its `FormatSpec` (`fmt.spec`); how it runs is its family's (`fmt.family`)."""

    FP32: ClassVar[Format]
    BF16: ClassVar[Format]
    FP16: ClassVar[Format]
    FP8: ClassVar[Format]
    FP8_ROWWISE: ClassVar[Format]
    FP8_ROWWISE_GW_HP: ClassVar[Format]
    FP8_FWD: ClassVar[Format]
    FP8_FWD_DGRAD: ClassVar[Format]
    FP8_ROWWISE_FWD: ClassVar[Format]
    FP8_ROWWISE_FWD_DGRAD: ClassVar[Format]
    MXFP8: ClassVar[Format]
    MXFP8_FWD: ClassVar[Format]
    MXFP8_FWD_DGRAD: ClassVar[Format]
    NVFP4: ClassVar[Format]
    NVFP4_FWD: ClassVar[Format]
    NVFP4_FWD_DGRAD: ClassVar[Format]
    MXFP8_FWD_NVFP4_DGRAD: ClassVar[Format]

    def __new__(cls, value: object) -> Format:
        # by name, also for a Format: one unregistered since (or replaced by a re-registration) is not taken as is
        name = str.__str__(value) if isinstance(value, str) else None
        spec = REGISTRY.get(name) if name is not None else None
        if spec is None:
            raise ValueError(f"{name or value!r} is not a registered format; the registered ones: {', '.join(format_names())}")
        return spec.format

    @classmethod
    def _create(cls, name: str) -> Format:
        return str.__new__(cls, name)

    @property
    def value(self) -> str:
        return str.__str__(self)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"<Format {self.value!r}>"

    def __reduce__(self) -> Any:
        return Format, (self.value,)

    def __copy__(self) -> Format:
        return self

    def __deepcopy__(self, memo: dict) -> Format:
        return self

    @property
    def spec(self) -> FormatSpec:
        spec = REGISTRY.get(self)
        if spec is None or spec.format is not self:  # unregistered since, or replaced by a re-registration
            raise ValueError(f"format {self.value!r} is no longer registered as this object; use Format({self.value!r})")
        return spec

    @property
    def family(self) -> FormatFamily:
        """The family that runs it (apply, device and module checks, limits, export names)."""
        return _FAMILIES[self.spec.family]

    def fallbacks(self) -> Iterator[Format]:
        """The safer formats after this one, in order (fp16/fp8 -> bf16 -> fp32)."""
        current = self.spec.fallback
        while current is not None:
            yield current
            current = current.spec.fallback


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """Everything autoprec knows about one format; `register_format` makes one.

    `family`: the registered FormatFamily's name that runs it ("autocast", "float8", "blockscaled", or one
    registered from outside autoprec). What only its family needs of it (autocast's dtype, float8's GEMMs and their
    scaling, blockscaled's per-GEMM element formats) the family keeps (FormatFamily.add_format), and answers for.
    `loss_scale`: whether it needs a GradScaler (gradients that underflow without one).
    `max_value`: the largest finite value its forward's low-precision values can hold (None: fp32/bf16 range).
    `fallback`: the next safer format, when a layout or a variant must lower a layer less.
    `risky`: fewer mantissa bits or a narrow range: worth choosing only for a measured gain.
    `linear_only`: runs on nn.Linear only (torchao's float8 swaps Linears).
    `inside`: what the layer computes in, for the README and `autoprec show`.
    """

    format: Format
    inside: str
    family: str = "autocast"
    loss_scale: bool = False
    max_value: float | None = None
    fallback: Format | None = None
    risky: bool = False
    linear_only: bool = False

    @property
    def is_fp8(self) -> bool:
        """Whether its values are 8-bit floats with scales (its family's `fp8`): the fp8 reports read it."""
        return _FAMILIES[self.family].fp8

    def device_problem(self, device: torch.device | str) -> str | None:
        """Why this format cannot run on `device` at all, or None when it can (maybe emulated): its family's answer."""
        return _FAMILIES[self.family].device_problem(self.format, torch.device(device))


@dataclasses.dataclass(frozen=True)
class OperandCast:
    """How a low-precision GEMM's operand is made from the high-precision tensor it reads (FormatFamily.gemm_casts):
    what the step-time predictor (autoprec/tune/_measure/_predict.py) prices as bytes read and written. `block`: elements per
    scale along the GEMM's contraction dimension, 0 for one scale per tensor, -1 for one per row; `scale_bytes`: the
    bytes of each scale; `tensor_amax`: a pass over the whole tensor for its amax before the cast (a tensorwise scale,
    NVFP4's second-level scale); `tile`: square blocks (NVFP4's 16x16 weight tiles), so one cast serves both of the
    tensor's orientations; `rht`: the random Hadamard transform before the cast (NVFP4's wgrad operands)."""

    bits: float
    block: int = 0
    scale_bytes: float = 4.0
    tensor_amax: bool = False
    tile: bool = False
    rht: bool = False


@dataclasses.dataclass(frozen=True)
class GemmCast:
    """One low-precision GEMM of an nn.Linear: the kernel that runs it (a name the predictor's calibration knows:
    "fp8-tensorwise", "fp8-rowwise", "mxfp8", "nvfp4") and how each of its two operands is cast (`a`: the
    activation or output gradient, `b`: the weight or, in wgrad, the input)."""

    kernel: str
    a: OperandCast
    b: OperandCast


@dataclasses.dataclass(frozen=True)
class Converted:
    """What a family's `convert` did to the model: `backend`, recorded per layer in applied_summary (LayerRecord's
    fp8_backend: torchao's kernels or emulation); `undo` puts back what it changed, where a later step refuses;
    `replaced`: the model's modules it swapped out, by path (a family whose `replaces_modules`), which a schedule's
    switch puts back before the next phase is applied."""

    backend: Any = None
    undo: Callable[[], None] = lambda: None
    replaced: Mapping[str, torch.nn.Module] = dataclasses.field(default_factory=dict)


class FormatFamily(abc.ABC):
    """A kind of format and its runtime. Subclass it, set `name`, implement `forward` (and override what else
    differs), register an instance with `register_family`, then its formats with `register_format(..., family=name)`.
    """

    name: ClassVar[str]  # FormatSpec.family
    # convert replaces the listed modules by new objects (torchao's Float8Linear): the model itself cannot be one
    # (apply_policy works in place), and each such layer keeps its own wrapped forward
    replaces_modules: ClassVar[bool] = False
    fp8: ClassVar[bool] = False  # its values are 8-bit floats with scales (the fp8 reports: backend, gradient casts)
    # the SQNR (dB) against fp32 below which a GEMM result in one of its formats counts as broken (report.breaks)
    sqnr_floor_db: ClassVar[float] = 30.0
    # a GEMM measured below `sqnr_floor` rules the format out for that layer (the profile's ruled_out): its scaled
    # casts flushed or saturated, which a safer format (a per-GEMM mix keeping that GEMM in high precision) avoids.
    # False for autocast's: fp16's gradients are measured at loss scale 1, whose flushing a GradScaler lifts
    gemm_floor_rules_out: ClassVar[bool] = False
    # the format (a name) of the region a lone layer in one of its formats is timed inside, where the format has no
    # autocast dtype of its own: torchao and torchtitan run fp8 and MXFP8/NVFP4 layers in a bf16 model, so their
    # casts read bf16; None: the layer's own dtype (fp32 for autocast's fp32)
    timed_inside: ClassVar[str | None] = None

    def add_format(self, fmt: Format, **facts: Any) -> None:
        """Keep what this family alone needs of `fmt`, being registered with it: register_format's facts that are
        not FormatSpec's fields (autocast's `autocast` dtype, float8's `gemms`, blockscaled's `gemms`), read back by
        the family's own answers. The default takes none: a ValueError naming them. Raise to refuse the format (it is
        then not registered, and remove_format is called). `fmt` is not registered yet: read no `fmt.spec` here."""
        if facts:
            raise ValueError(
                f"format family {self.name!r} takes no {', '.join(sorted(facts))}: give register_format FormatSpec's "
                f"fields ({', '.join(SPEC_FACTS)}) and what the family's add_format takes"
            )

    def remove_format(self, fmt: Format) -> None:
        """Forget what add_format kept of `fmt` (unregister_format, and register_format where add_format refused it,
        so a format it kept nothing of too); the default keeps nothing."""
        return None

    def autocast_dtype(self, fmt: Format) -> torch.dtype | None:
        """The dtype `fmt`'s forward runs under torch.autocast (bf16, fp16), or None (the default): autocast's."""
        return None

    def fp8_gemms(self, fmt: Format) -> Any:
        """Where `fmt` runs torchao's float8 training, its GEMMs and their scaling (float8.Fp8Gemms: a recipe, or a
        per-GEMM mix), as the export targets write them; None (the default) for a family that does not."""
        return None

    def tensorwise_grad_dtype(self, fmt: Format) -> torch.dtype | None:
        """The fp8 dtype `fmt` casts its gradients to with one dynamic scale per tensor, whose underflow the gradient
        histograms can count; None (the default) for no such cast (rowwise scales per row: no histogram follows)."""
        return None

    def fsdp_fp8_all_gather(self, fmt: Format) -> bool:
        """Whether FSDP2 can all-gather `fmt`'s weights in fp8 (torchao's enable_fsdp_float8_all_gather: tensorwise
        scales only); False by default."""
        return False

    def device_problem(self, fmt: Format, device: torch.device) -> str | None:
        """Why `fmt` cannot run on `device` at all, or None (the default: it runs wherever torch does)."""
        return None

    def module_problem(self, fmt: Format, module: torch.nn.Module) -> str | None:
        """Why `module` cannot run in `fmt` (its type or shape), or None (the default)."""
        return None

    def root_problem(self, fmt: Format) -> str | None:
        """Why the model itself cannot be `fmt`, or None (the default)."""
        return None

    def has_kernels(self, fmt: Format, device: torch.device) -> bool:
        """Whether `fmt`'s time on `device` says anything about its speed (True, the default: what runs there is
        what trains there). False where it runs an emulation only: the profile records its time as "no kernel on
        this device" instead of measuring it, and a search that times its trials on this device rules it out (they
        would time the emulation); one whose goal does not time them (`--objective flops`, planning for another
        device: profile_data.SPEED_UNJUDGED) keeps it."""
        return True

    def sqnr_floor(self, fmt: Format) -> float:
        """The SQNR (dB) against fp32 below which a GEMM result in `fmt` counts as broken (report.breaks): the
        family's `sqnr_floor_db` unless its formats differ (one floor per element format)."""
        return self.sqnr_floor_db

    def overflow_limit(self, fmt: Format) -> float | None:
        """The value above which its forward saturates to inf (fp16's 65504), or None where nothing does (scaled
        casts, the fp32 range): the profile counts overflow against it."""
        return None

    def export_name(self, fmt: Format) -> str | None:
        """What the export targets call `fmt` (torchao's recipe name), or None where no export target runs it."""
        return None

    def block_scaled_gemms(self, fmt: Format) -> tuple[str | None, str | None, str | None] | None:
        """Where `fmt` quantises a GEMM in blocks (MXFP8, NVFP4), each GEMM's (fprop, dgrad, wgrad) block format
        ("mxfp8", "nvfp4") or None (high precision), as the export targets write them; None (the default) for a family
        that quantises in no blocks."""
        return None

    def recipe_name(self, fmt: Format) -> str | None:
        """What the training frameworks call `fmt`'s block-scaled recipe, where they have one; None by default."""
        return None

    def gemm_precisions(self, fmt: Format, outer: str | None = None) -> tuple[str, str, str]:
        """The element format each of an nn.Linear's three GEMMs runs in under `fmt`, as (fprop, dgrad, wgrad): each
        one of GEMM_PRECISIONS. The FLOP goal (autoprec/tune/_decide/_flops.py) weights a layer's GEMM work by a target's
        throughput in these. `outer`: the autocast the layer is called under ("bf16", "fp16": its parent's or the
        model root's format), None outside any (an fp32 root); a GEMM the format leaves in high precision may run in
        it. "fp32" is strict fp32 (no TF32). The default: its autocast dtype (autocast_dtype) for all three (bf16, fp16), else
        fp32 (autoprec's fp32 turns autocast off inside the layer)."""
        name = autocast_name(self.autocast_dtype(fmt)) or "fp32"
        return (name, name, name)

    def gemm_casts(self, fmt: Format) -> tuple[GemmCast | None, GemmCast | None, GemmCast | None]:
        """What each of an nn.Linear's three GEMMs (fprop, dgrad, wgrad) casts under `fmt` and which kernel runs it;
        None for a GEMM in high precision (its element format: gemm_precisions). The step-time predictor prices the
        casts' bytes and the kernel's efficiency from it. The default: every GEMM in high precision."""
        return (None, None, None)

    def convert(
        self,
        model: torch.nn.Module,
        listed: Mapping[str, Format],
        paths: Mapping[str, torch.nn.Module],
        names: Mapping[int, list[str]],
        device: torch.device,
        *,
        all_gather: frozenset[Format] = frozenset(),
        device_hint: bool = True,
    ) -> Converted:
        """Change the model for its layers `listed` (policy name -> format, all of this family), before apply_policy
        wraps their forwards: all or nothing (raise with the model as it was). `paths`: every module by name,
        `names`: every name of a module object. The default changes nothing: `forward` does the work."""
        return Converted()

    def after_optimizer_step(self, model: torch.nn.Module) -> None:
        """What `model`'s layers of this family need after each optimizer step where their weights are all-gathered
        in fp8 under FSDP2 (autoprec.apply.after_optimizer_step asks only then); the default: nothing."""
        return None

    @abc.abstractmethod
    def forward(
        self, fmt: Format, module: torch.nn.Module, inner: Callable[..., Any], device_type: str, args: tuple, kwargs: dict
    ) -> Any:
        """A listed layer's call in `fmt`: `inner(module, *args, **kwargs)` is its own forward. Outside any autocast
        the caller's code expects fp32 (`caller_precision`)."""

    def __repr__(self) -> str:
        return f"<format family {self.name!r}>"


def autocast_name(dtype: torch.dtype | None) -> str | None:
    """A GEMM precision's name for an autocast dtype ("bf16", "fp16"), None for none."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype) if dtype is not None else None


def to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW else t


def caller_precision(out: Any, outer_autocast: bool) -> Any:
    """A lowered layer's output as its caller expects it: as is inside autocast, else fp32 as before the policy."""
    return out if outer_autocast else map_tensors(out, to_fp32)


def other_half_to_fp32(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` with its tensors in a half-precision dtype other than `dtype` (fp16 where `dtype` is bf16, and the
    reverse) cast to fp32, exactly; the rest as it is. Autocast to `dtype` refuses to meet the other one in its
    promoting ops (torch.cat, torch.stack: "Unexpected floating ScalarType in at::autocast::prioritize"), and an op
    that mixes fp16 and bf16 computes in fp32 anyway, so the region's values stay what each layer computed."""
    return map_tensors(obj, lambda t: t.float() if t.dtype in _LOW and t.dtype != dtype else t)


# ---- the registries ----------------------------------------------------------------------------------------------

_FAMILIES: Registry[FormatFamily] = Registry("format family")  # name -> family
REGISTRY: Registry[FormatSpec] = Registry("format")  # Format -> its spec, in registration order
F = TypeVar("F", bound="FormatFamily | type[FormatFamily]")


def register_family(family: F) -> F:
    """Add a format family (an instance, or a class instantiated here; usable as a class decorator)."""
    instance = family() if isinstance(family, type) else family
    name = instance.name
    _FAMILIES.refuse_taken(name, f"unregister_family({name!r}) first to replace it, or give it another name")
    _FAMILIES[name] = instance
    return family


def unregister_family(name: str) -> FormatFamily:
    """Remove a family (its formats first: unregister_format)."""
    used = [s.format.value for s in REGISTRY.values() if s.family == name]
    if used:
        raise ValueError(f"format family {name!r} still has formats {', '.join(used)}; unregister_format them first")
    return _FAMILIES.pop(name)


def family_named(name: str) -> FormatFamily:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"format family must be one of {', '.join(_FAMILIES)}, but got {name!r}") from None


def families() -> tuple[FormatFamily, ...]:
    return tuple(_FAMILIES.values())


# register_format's facts that are FormatSpec's own fields; any other fact is its family's (FormatFamily.add_format)
SPEC_FACTS = tuple(f.name for f in dataclasses.fields(FormatSpec) if f.name not in ("format", "inside", "family"))


def register_format(name: str, *, family: str, inside: str, **facts: Any) -> Format:
    """Add a format of a registered family and return it (a Format equal to `name`). `facts`: FormatSpec's other
    fields (SPEC_FACTS; fallback: a registered Format), and what the family keeps of it (its add_format's keywords,
    such as autocast's `autocast=torch.bfloat16`). Nothing is registered where the family refuses it."""
    owner = family_named(family)
    REGISTRY.refuse_taken(name, f"unregister_format({name!r}) first to replace it, or give it another name")
    own = {k: facts.pop(k) for k in list(facts) if k not in SPEC_FACTS}
    if facts.get("fallback") is not None:
        facts["fallback"] = Format(facts["fallback"])
    fmt = Format._create(name)
    spec = FormatSpec(fmt, inside=inside, family=family, **facts)
    try:
        owner.add_format(fmt, **own)
    except BaseException:
        with contextlib.suppress(Exception):  # the family's refusal is the error to see, not its cleanup's
            owner.remove_format(fmt)  # what it kept before it refused: all or nothing
        raise
    REGISTRY[fmt] = spec
    return fmt


def unregister_format(name: str) -> FormatSpec:
    """Remove a registered format, and what its family kept of it; one that another format falls back to is refused."""
    fmt = Format(name)
    after = [s.format.value for s in REGISTRY.values() if s.fallback is fmt]
    if after:
        raise ValueError(f"format {name!r} is the fallback of {', '.join(after)}; unregister them first")
    fmt.family.remove_format(fmt)
    return REGISTRY.pop(fmt)


def format_names() -> tuple[str, ...]:
    """The registered formats' names, in registration order."""
    return tuple(s.format.value for s in REGISTRY.values())


def parse_format(value: object, *, field: str = "format") -> Format:
    """Return the registered Format for a string such as "bf16" (a Format too: the one registered by its name now);
    raise ValueError naming the choices."""
    try:
        return Format((str.__str__(value) if isinstance(value, str) else str(value)).strip().lower())
    except ValueError:
        raise ValueError(f"{field} must be one of {', '.join(format_names())}, but got {value!r}") from None
