"""Policy and LossScale: the versioned, validated JSON file a search writes and a training script applies."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import UserError, shown
from autoprec.files import read_json, write_text
from autoprec.formats import Format, format_names, parse_format
from autoprec.tensors import hash_tensor

POLICY_VERSION = 1
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

    Raises:
        ValueError: A layer name that is not a module path, an unknown format (the message lists the formats), a
            loss-scale setting out of range, another version, a field of the wrong type, or fsdp_fp8_all_gather
            true with no layer in a format FSDP2 can gather in fp8.

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

    @property
    def uses_fp16(self) -> bool:
        """Whether any layer's format needs loss scaling (fp16): then the GradScaler is on."""
        return any(f.spec.loss_scale for f in self.layers.values())

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
        if self.measured is not None:
            data["measured"] = dict(self.measured)
        return data

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, data: object) -> Policy:
        allowed = ("version", "layers", "loss_scale", "measured", "fsdp_fp8_all_gather")
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
        )


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
