"""Policy and LossScale: the versioned, validated JSON file a search writes and a training script applies."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import UserError, shown
from autoprec.files import read_json, write_text
from autoprec.formats import Format, format_names, parse_format
from autoprec.tensors import hash_tensor

POLICY_VERSION = 1
# Where a phase starts in a run of N optimizer steps (Phase.start_step), said the same way wherever it is written for
# a person or a framework (the docs, an export's schedule list)
START_STEP_RULE = "ceil(round(from_fraction * total_steps, 6)), counting steps from 0"
ROOT = ""  # the model itself: its format covers every op not inside a listed layer
# A layer's name as torch's named_modules() gives it: attribute names, ModuleList indices and ModuleDict keys
# (letters, digits, _ and -) joined by dots. Nothing else: a name is printed, exported and matched, never code,
# and quotes, backslashes, spaces and control characters have no place in one.
MODULE_PATH = re.compile(r"[\w-]+(?:\.[\w-]+)*")
FLOAT32_MAX = 3.4028234663852886e38  # GradScaler keeps the scale in a float32 tensor
INT32_MAX = 2**31 - 1  # and counts clean steps in an int32 one


def check_layer_name(name: object) -> str:
    """`name` if it is the model root ("") or a module path (MODULE_PATH); else a ValueError naming it."""
    if not isinstance(name, str):
        raise ValueError(f"layers keys must be module names (str), got {shown(name)}")
    if name != ROOT and not MODULE_PATH.fullmatch(name):
        raise ValueError(
            f"layers key {shown(name)} is not a module path: names of letters, digits, _ and - joined by "
            'dots, as torch names modules (blocks.3.attn.qkv), or "" for the model root'
        )
    return name


@dataclasses.dataclass(frozen=True)
class LossScale:
    """torch.amp.GradScaler settings. `dynamic=False` keeps the scale at init_scale (steps with inf still skip)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    dynamic: bool = True

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                raise ValueError(f"loss_scale.{name} must be a finite number, but got {shown(value)}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise ValueError(f"loss_scale.growth_interval must be an integer, but got {shown(self.growth_interval)}")
        checks = (
            ("init_scale", self.init_scale, 0 < self.init_scale <= FLOAT32_MAX, f"> 0 and at most {FLOAT32_MAX:g} (float32)"),
            ("growth_factor", self.growth_factor, self.growth_factor > 1.0, "> 1"),
            ("backoff_factor", self.backoff_factor, 0.0 < self.backoff_factor < 1.0, "in (0, 1)"),
            ("growth_interval", self.growth_interval, 1 <= self.growth_interval <= INT32_MAX, f">= 1 and at most {INT32_MAX}"),
        )
        for name, value, ok, rule in checks:
            if not ok:
                raise ValueError(f"loss_scale.{name} must be {rule}, but got {shown(value)}")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"loss_scale.dynamic must be true or false, but got {self.dynamic!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object, *, where: str = "loss_scale") -> LossScale:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be an object with fields {', '.join(fields)}, got {type(data).__name__}")
        for key in data:
            if key not in fields:
                raise ValueError(f"{where}: unknown field {key!r}; allowed fields: {', '.join(fields)}")
        for key in fields:
            if key not in data:
                raise ValueError(f"{where}: missing field {key!r}")
        kinds = {"dynamic": ((bool,), "true or false"), "growth_interval": ((int,), "an integer")}
        for key, value in data.items():
            ok_types, what = kinds.get(key, ((int, float), "a number"))
            if not isinstance(value, ok_types) or (key != "dynamic" and isinstance(value, bool)):
                raise ValueError(f"{where}.{key} must be {what}, but got {shown(value)}")
        for key in ("init_scale", "growth_factor", "backoff_factor"):
            if not _finite(data[key]):  # an integer past float's range: float() would raise OverflowError
                raise ValueError(f"{where}.{key} must be a finite number, but got {shown(data[key])}")
        return cls(
            init_scale=float(data["init_scale"]),
            growth_factor=float(data["growth_factor"]),
            backoff_factor=float(data["backoff_factor"]),
            growth_interval=data["growth_interval"],
            dynamic=data["dynamic"],
        )


@dataclasses.dataclass(frozen=True)
class Phase:
    """A later part of the training run: from `from_fraction` of its steps on, the `layers` listed run in these
    formats (the policy's other layers keep theirs). A schedule raises late the layers whose low precision harms
    only late (NVFP4's, fp8's damage shows over the run's last part), or lowers others once training has settled.

    Args:
        from_fraction: Where the phase starts, as a share of the run's optimizer steps: a number in (0, 1). A run of
            N steps enters it at step ceil(round(from_fraction * N, 6)) (`start_step`, START_STEP_RULE), counting
            from 0: the product rounded first, so that a fraction written as step / steps gives that step back.
        layers: Module name -> format, as `Policy.layers`: the layers whose format changes from here on; at least one.
    """

    from_fraction: float
    layers: Mapping[str, Format]

    def __post_init__(self) -> None:
        f = self.from_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not _finite(f) or not 0 < f < 1:
            raise ValueError(
                f"a phase's from_fraction must be a number between 0 and 1 (exclusive): the share of the run's steps "
                f"after which it starts, e.g. 0.8; got {shown(f)}"
            )
        if not isinstance(self.layers, Mapping) or not self.layers:
            raise ValueError(
                "a phase's layers must map at least one module name to a format (the layers that change from "
                f"from_fraction on), got {shown(self.layers) if isinstance(self.layers, Mapping) else type(self.layers).__name__}"
            )
        layers = {}
        for name, fmt in self.layers.items():
            check_layer_name(name)
            layers[name] = parse_format(fmt, field=f"the phase's layers[{name!r}]")
        object.__setattr__(self, "from_fraction", float(f))
        object.__setattr__(self, "layers", layers)

    def start_step(self, total_steps: int) -> int:
        """The first step (counted from 0) of a run of `total_steps` optimizer steps that this phase covers. The
        product is rounded to 6 decimals first, so a fraction written as step/steps (7/30) starts at that step."""
        return math.ceil(round(self.from_fraction * total_steps, 6))

    def to_dict(self) -> dict[str, Any]:
        return {"from_fraction": self.from_fraction, "layers": {name: fmt.value for name, fmt in self.layers.items()}}

    @classmethod
    def from_dict(cls, data: object, *, index: int = 0) -> Phase:
        where = f"phases[{index}]"
        if not isinstance(data, Mapping):
            raise ValueError(f'{where} must be an object {{"from_fraction": F, "layers": {{...}}}}, got {type(data).__name__}')
        for key in data:
            if key not in ("from_fraction", "layers"):
                raise ValueError(f"{where}: unknown field {key!r}; allowed fields: from_fraction, layers")
        for key in ("from_fraction", "layers"):
            if key not in data:
                raise ValueError(f"{where}: missing field {key!r}")
        try:
            return cls(from_fraction=data["from_fraction"], layers=data["layers"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Policy:
    """Per-layer formats (module name -> format), loss-scale settings, and what the search measured.

    The policy file a search writes (policy.json), as a frozen, validated value: the constructor and `from_dict`
    check every field, so a Policy that exists is a well-formed policy file (whether it fits a model is
    `autoprec.apply_policy`'s check). Layers not
    listed run in whatever precision surrounds them: the policy's root entry ("") when it has one, else the
    caller's (fp32 unless the caller uses autocast). Read one with `autoprec.load_policy(path)`; write one with
    `save(path)`; `to_dict()` and `from_dict(data)` are the file's JSON.

    Args:
        layers: Module name -> format. A name is "" (the model root) or a module path as torch's named_modules()
            gives it ("blocks.3.attn.qkv"); a format is a Format or its name ("fp32", "bf16", "fp16", "fp8",
            "fp8-rowwise", "fp8-fwd", ...: autoprec.Format lists them). Default {}: nothing lowered.
        loss_scale: The GradScaler settings (a LossScale, or a mapping with all of its fields), used only where a
            layer is fp16. Default LossScale(): init_scale 2**16, growth_factor 2, backoff_factor 0.5,
            growth_interval 2000, dynamic.
        measured: What the search measured (a mapping: metric, drop, speedup, device, the model's fingerprint,
            ...), kept as data; apply_policy reads only the fingerprint, to warn on another model. Default None.
        version: The policy file's format version; only the current one (1) is accepted. Default 1.
        fsdp_fp8_all_gather: Under FSDP2, all-gather the weights of the layers whose format FSDP2 can gather in fp8
            (torchao's tensorwise recipe: `fp8`, `fp8-fwd-dgrad`) in fp8, a quarter of fp32's traffic: a setting a
            sharded search measures beside the formats. apply_policy applies it (its own argument overrides it);
            the file has the field only where it is true. Default False.
        phases: A schedule: later parts of the run in which some layers change format (Phase, or a mapping
            {"from_fraction": F, "layers": {...}}), in order of from_fraction. Each phase lists only what changes;
            `layers` is the first part's. apply_policy puts the first part on the model and `autoprec.follow_schedule`
            switches it in place as the step counter passes each phase. Default (): one format per layer for the
            whole run; the file has the field only where there is a schedule.

    Raises:
        ValueError: A layer name that is not a module path, an unknown format (the message lists the formats), a
            loss-scale setting out of range, another version, a field of the wrong type, or fsdp_fp8_all_gather
            true with no layer in a format FSDP2 can gather in fp8, or with a schedule; phases out of order, or one
            that changes no layer's format.

    Example:
        >>> import autoprec
        >>> policy = autoprec.Policy(layers={"": "bf16", "head": "fp32", "blocks.0.mlp": "fp16"})
        >>> policy.uses_fp16
        True
        >>> policy.to_dict()["layers"]
        {'': 'bf16', 'head': 'fp32', 'blocks.0.mlp': 'fp16'}
        >>> autoprec.Policy.from_dict(policy.to_dict()) == policy
        True
    """

    layers: Mapping[str, Format] = dataclasses.field(default_factory=dict)
    loss_scale: LossScale = dataclasses.field(default_factory=LossScale)
    measured: Mapping[str, Any] | None = None
    version: int = POLICY_VERSION
    fsdp_fp8_all_gather: bool = False
    phases: Sequence[Phase] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.layers, Mapping):
            raise ValueError(f"layers must map module names to formats, got {type(self.layers).__name__}")
        layers = {}
        for name, fmt in self.layers.items():
            check_layer_name(name)
            layers[name] = parse_format(fmt, field=f"layers[{name!r}]")
        object.__setattr__(self, "layers", layers)
        if isinstance(self.loss_scale, Mapping):
            object.__setattr__(self, "loss_scale", LossScale.from_dict(self.loss_scale))
        if not isinstance(self.loss_scale, LossScale):
            raise ValueError(f"loss_scale must be a LossScale, got {type(self.loss_scale).__name__}")
        if self.version != POLICY_VERSION or isinstance(self.version, bool):
            raise ValueError(f"version must be {POLICY_VERSION}, but got {self.version!r}")
        if self.measured is not None and not isinstance(self.measured, Mapping):
            raise ValueError(f"measured must be an object, got {type(self.measured).__name__}")
        if not isinstance(self.fsdp_fp8_all_gather, bool):
            raise ValueError(f"fsdp_fp8_all_gather must be true or false, but got {shown(self.fsdp_fp8_all_gather)}")
        if self.fsdp_fp8_all_gather and not self.fp8_gatherable:
            raise ValueError(
                "fsdp_fp8_all_gather is true, but no layer runs in a format FSDP2 can all-gather in fp8 "
                f"({gatherable_text()}): set it false, or give a layer one of those"
            )
        self._check_phases()

    def _check_phases(self) -> None:
        if isinstance(self.phases, (str, bytes, Mapping)) or not isinstance(self.phases, Sequence):
            raise ValueError(
                f'phases must be a list of phases ({{"from_fraction": F, "layers": {{...}}}}), got {shown(self.phases)}'
            )
        phases = tuple(p if isinstance(p, Phase) else Phase.from_dict(p, index=i) for i, p in enumerate(self.phases))
        object.__setattr__(self, "phases", phases)
        if phases and self.fsdp_fp8_all_gather:
            raise ValueError(
                "fsdp_fp8_all_gather is true in a policy with phases: a phase switches layers' formats in place, and "
                "FSDP2's fp8 all-gather wraps the weights once, at fully_shard, so a switch could not follow it; set it "
                "false, or write one policy per phase"
            )
        current = dict(self.layers)
        for i, phase in enumerate(phases):
            if i and phase.from_fraction <= phases[i - 1].from_fraction:
                raise ValueError(
                    f"phases[{i}] starts at from_fraction {phase.from_fraction:g}, not after phases[{i - 1}] "
                    f"({phases[i - 1].from_fraction:g}): list the phases in the order they start"
                )
            changed = {name: fmt for name, fmt in phase.layers.items() if current.get(name) is not fmt}
            if not changed:
                raise ValueError(
                    f"phases[{i}] (from_fraction {phase.from_fraction:g}) changes no layer's format: each layer it "
                    "lists has that format already; drop the phase, or give a layer another format"
                )
            current.update(phase.layers)

    @property
    def scheduled(self) -> bool:
        """Whether some layers change format during the run (the policy has phases)."""
        return bool(self.phases)

    def phase_layers(self, index: int) -> dict[str, Format]:
        """Module name -> format in phase `index`: 0 is the run's first part (`layers`), i the one `phases[i - 1]`
        starts; each phase's changes on top of those before it."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= len(self.phases):
            raise ValueError(f"phase index must be a whole number from 0 to {len(self.phases)}, but got {shown(index)}")
        layers = dict(self.layers)
        for phase in self.phases[:index]:
            layers.update(phase.layers)
        return layers

    def in_phase(self, index: int) -> Policy:
        """Phase `index` as a policy of its own (no schedule): its layers, this policy's loss scale and record."""
        return dataclasses.replace(self, layers=self.phase_layers(index), phases=())

    @property
    def formats(self) -> frozenset[Format]:
        """Every format a layer has in some phase of the run (its first part's and each phase's)."""
        return frozenset(self.layers.values()) | frozenset(f for phase in self.phases for f in phase.layers.values())

    def phase_shares(self) -> tuple[float, ...]:
        """Each phase's share of the run (the first part's, then each phase's), summing to 1: what a run's time or
        cost averages the phases by."""
        edges = [0.0, *(p.from_fraction for p in self.phases), 1.0]
        return tuple(b - a for a, b in zip(edges, edges[1:]))

    def phase_at(self, step: int, total_steps: int) -> int:
        """The phase (0: the first part) that step `step` (from 0) of a run of `total_steps` optimizer steps is in."""
        for name, value, low in (("total_steps", total_steps, 1), ("step", step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be a whole number >= {low}, but got {shown(value)}")
        return sum(1 for phase in self.phases if step >= phase.start_step(total_steps))

    @property
    def uses_fp16(self) -> bool:
        """Whether any layer's format, in any phase, needs loss scaling (fp16): then the GradScaler is on (from the
        start: an fp16 phase later goes on with the scale the run has kept)."""
        return any(f.spec.loss_scale for f in self.formats)

    @property
    def fp8_gatherable(self) -> frozenset[Format]:
        """The policy's formats whose weights FSDP2 can all-gather in fp8 (their family's fsdp_fp8_all_gather)."""
        return frozenset(f for f in self.layers.values() if f.family.fsdp_fp8_all_gather(f))

    @property
    def fp8_all_gathered(self) -> frozenset[Format]:
        """The formats whose layers this policy all-gathers in fp8 under FSDP2: fp8_gatherable where
        fsdp_fp8_all_gather is on, else none."""
        return self.fp8_gatherable if self.fsdp_fp8_all_gather else frozenset()

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": self.version,
            "layers": {name: fmt.value for name, fmt in self.layers.items()},
            "loss_scale": self.loss_scale.to_dict(),
        }
        if self.fsdp_fp8_all_gather:  # only where set: a policy without it reads as before, in any version
            data["fsdp_fp8_all_gather"] = True
        if self.phases:  # only where there is a schedule: a policy without one reads as before
            data["phases"] = [phase.to_dict() for phase in self.phases]
        if self.measured is not None:
            data["measured"] = dict(self.measured)
        return data

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, data: object) -> Policy:
        allowed = ("version", "layers", "loss_scale", "measured", "fsdp_fp8_all_gather", "phases")
        if not isinstance(data, Mapping):
            raise ValueError(f"a policy must be a JSON object with fields {', '.join(allowed)}, got {type(data).__name__}")
        for key in data:
            if key not in allowed:
                raise ValueError(f"unknown field {key!r}; allowed fields: {', '.join(allowed)}")
        for key in allowed[:2]:
            if key not in data:
                example = {"version": POLICY_VERSION, "layers": {"": "bf16"}}
                raise ValueError(f"missing field {key!r}; a policy needs at least {json.dumps(example)}")
        version = data["version"]
        if version != POLICY_VERSION or isinstance(version, bool):
            raise ValueError(f"version must be {POLICY_VERSION}, but got {version!r}")
        layers = data["layers"]
        if not isinstance(layers, Mapping):
            raise ValueError(f"layers must map module names to one of {', '.join(format_names())}, got {type(layers).__name__}")
        return cls(
            layers=layers,
            # a hand-written policy without fp16 layers needs no GradScaler settings: GradScaler's defaults
            loss_scale=LossScale.from_dict(data["loss_scale"]) if "loss_scale" in data else LossScale(),
            measured=data.get("measured"),
            version=version,
            fsdp_fp8_all_gather=data.get("fsdp_fp8_all_gather", False),
            phases=_phase_list(data.get("phases", [])),
        )


def _phase_list(data: object) -> tuple[Phase, ...]:
    """The file's phases: a JSON list of phase objects, each read by Phase.from_dict."""
    if not isinstance(data, list):
        raise ValueError(f'phases must be a list of {{"from_fraction": F, "layers": {{...}}}} objects, got {type(data).__name__}')
    return tuple(Phase.from_dict(item, index=i) for i, item in enumerate(data))


def gatherable_text() -> str:
    """The registered formats whose weights FSDP2 can all-gather in fp8, as a message names them."""
    return ", ".join(str(f) for f in Format if f.family.fsdp_fp8_all_gather(f)) or "none registered"


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def as_policy(value: Policy | str | Path, *, caller: str) -> Policy:
    """A Policy given as itself or as a policy file's path; `caller` names the function in the error for a dict."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, Mapping):
        raise TypeError(f"{caller} takes a Policy or a policy file's path, not a dict; use Policy.from_dict(data)")
    return load_policy(value)


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; errors name the file, the field and the allowed values."""
    path = Path(path)
    if path.is_dir():
        inside = path / "policy.json"
        hint = f"; did you mean {inside}?" if inside.is_file() else "; give the path of a policy .json file"
        raise UserError(f"{path}: a folder, not a policy file{hint}")
    if not path.is_file():
        raise UserError(f"{path}: no such policy file")
    data = read_json(path)
    try:
        return Policy.from_dict(data)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None


def weights_digest(model: torch.nn.Module) -> str:
    """A short hash of the model's values (parameters and buffers, by name): two builds of one structure with other
    weights (retrained, another seed) differ, so a profile or study measured on one is not reused for the other."""
    h = hashlib.sha256()
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        hash_tensor(h, t, f"{name}:")
    return h.hexdigest()[:16]


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's structure (parameter names, shapes, module types), not its values."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__name__};".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:16]
