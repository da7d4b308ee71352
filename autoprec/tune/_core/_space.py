"""The search space file (YAML): formats offered per layer type, loss-scale ranges, pruning, sampler."""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import importlib.resources
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from autoprec.errors import UserError, shown
from autoprec.formats import Format, parse_format
from autoprec.policy import MODULE_PATH
from autoprec.tune._core._numbers import parse_option

SAMPLERS = ("tpe", "random")
_TOP_KEYS = ("default", "layers", "loss_scale", "prune", "sampler", "trials", "layout", "max_params", "exclude")


class Layout(str, enum.Enum):
    """How per-layer choices become study parameters (_choices.py says what each one does)."""

    AUTO = "auto"  # per_layer up to max_params searched layers, else grouped up to max_params groups, else ranked
    PER_LAYER = "per_layer"  # one categorical per layer
    GROUPED = "grouped"  # one categorical per role of a repeated block
    RANKED = "ranked"  # per format, how many of the least sensitive layers take it

    def __str__(self) -> str:
        return self.value


def parse_layout(value: object) -> Layout:
    return parse_option(Layout, value, "layout")


_LOSS_SCALE_KEYS = ("init_scale_log2", "growth_interval", "growth_factor", "backoff_factor", "dynamic")


@dataclasses.dataclass(frozen=True)
class LossScaleRange:
    """GradScaler settings the search may pick for a trial with fp16 layers. The profile's gradient
    ranges narrow `init_scale_log2` further (to its recommended range, where the two overlap)."""

    init_scale_log2: tuple[int, int] = (10, 24)
    growth_interval: tuple[int, ...] = (200, 500, 1000, 2000)
    growth_factor: tuple[float, ...] = (2.0,)
    backoff_factor: tuple[float, ...] = (0.5,)
    dynamic: tuple[bool, ...] = (True,)

    def __post_init__(self) -> None:
        bounds = self.init_scale_log2
        if (
            len(bounds) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) for b in bounds)
            or not 0 <= bounds[0] <= bounds[1] <= 32
        ):
            raise ValueError(
                f"loss_scale.init_scale_log2 must be [low, high] integers with 0 <= low <= high <= 32, got {list(bounds)}"
            )
        if not self.growth_interval or any(int(g) < 1 for g in self.growth_interval):
            raise ValueError(f"loss_scale.growth_interval must be a list of integers >= 1, got {list(self.growth_interval)}")
        _check_factors("growth_factor", self.growth_factor, lambda f: f > 1.0, "> 1")
        _check_factors("backoff_factor", self.backoff_factor, lambda f: 0.0 < f < 1.0, "in (0, 1)")
        if not self.dynamic or any(not isinstance(d, bool) for d in self.dynamic):
            raise ValueError(f"loss_scale.dynamic must be a list of true/false, got {list(self.dynamic)}")


def _check_factors(field: str, values: tuple, ok: Callable[[float], bool], rule: str) -> None:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
    if not values or not numbers or not all(ok(float(v)) for v in values):
        raise ValueError(f"loss_scale.{field} must be a non-empty list of numbers {rule}, got {list(values)}")


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What the search may choose. `layers` maps a torch.nn class name, or a module class's import path
    (transformers.pytorch_utils.Conv1D), to the formats offered for it."""

    layers: Mapping[str, tuple[Format, ...]]
    default: tuple[Format, ...] = (Format.FP32, Format.BF16)
    loss_scale: LossScaleRange = LossScaleRange()
    prune_slower_than: float = 1.25
    sampler: str = "tpe"
    trials: int = 30
    layout: Layout = Layout.AUTO  # how per-layer choices become study parameters
    max_params: int = 16  # auto: per_layer up to this many searched layers, grouped up to this many groups
    # Module-name patterns (fnmatch: `pooler`, `*.lm_head`, `encoder.layer.1[01].*`) kept out of the search, with
    # everything inside them: they run in the model root's format, as unlisted modules do.
    exclude: tuple[str, ...] = ()
    source: str = "<built-in>"

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, but got {self.sampler!r}")
        if self.trials < 1:
            raise ValueError(f"trials must be >= 1, but got {self.trials!r}")
        object.__setattr__(self, "layout", parse_layout(self.layout))
        if self.max_params < 1:
            raise ValueError(f"max_params must be >= 1, but got {self.max_params!r}")
        if not math.isfinite(self.prune_slower_than) or self.prune_slower_than < 1.0:
            raise ValueError(f"prune.slower_than must be >= 1.0, but got {self.prune_slower_than!r}")
        linear_only = [f.value for f in self.default if f.spec.linear_only]
        if linear_only:
            raise ValueError(f"default (the model root) cannot be {', '.join(linear_only)}: it applies to nn.Linear layers only")
        for type_name in self.layers:
            check_type_name(type_name)
        if any(not isinstance(p, str) or not p.strip() for p in self.exclude):
            raise ValueError(
                f"exclude must be a list of module-name patterns such as pooler or *.lm_head, got {list(self.exclude)}"
            )

    def lists(self) -> list[tuple[str, tuple[Format, ...]]]:
        """(field, formats) of every format list: `default` (the root's), then `layers.<type>`."""
        return [("default", self.default), *((f"layers.{k}", v) for k, v in self.layers.items())]

    def excluded(self, name: str) -> bool:
        """Whether a module, or a module it sits inside, matches an `exclude` pattern."""
        parts = name.split(".")
        return any(
            fnmatch.fnmatchcase(".".join(parts[:cut]), pattern) for cut in range(1, len(parts) + 1) for pattern in self.exclude
        )

    def with_excludes(self, patterns: Sequence[str], model: torch.nn.Module) -> SearchSpace:
        """This space with `patterns` (a --exclude option, the Python API's `exclude=`) excluded too. A pattern
        that matches no module of `model` is a typo that would exclude nothing: refused, naming some names. Patterns
        that exclude every layer the space would tune leave nothing to search: refused, saying how many they excluded
        (not "the model has no layer of the types the search space tunes", which blamed the model)."""
        names = [n for n, _ in model.named_modules() if n]
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ValueError(
                    f"exclude {pattern!r} matches no module of the model (its modules include "
                    f"{', '.join(names[:6])}); patterns are fnmatch, e.g. pooler or '*.lm_head'"
                )
        if not patterns:
            return self
        wider = dataclasses.replace(self, exclude=self.exclude + tuple(patterns))
        before = self._outermost(model)
        if before and not wider._outermost(model):
            given = " --exclude ".join(map(repr, patterns))
            raise ValueError(
                f"exclude {given} left no layer to tune: {'it' if len(patterns) == 1 else 'together they'} "
                f"excluded all {len(before)} layer{'s' if len(before) != 1 else ''} of the types the search "
                f"space tunes ({', '.join(self.layers)}); exclude fewer modules"
            )
        return wider

    def loss_scaled(self) -> list[str]:
        """The lists (`default`, `layers.<type>`) that offer a format needing a GradScaler (fp16)."""
        return [field for field, formats in self.lists() if any(f.spec.loss_scale for f in formats)]

    def without_loss_scaled(self) -> SearchSpace:
        """This space with every format that needs a GradScaler (fp16) taken out of each list."""

        def keep(formats: tuple[Format, ...]) -> tuple[Format, ...]:
            return tuple(f for f in formats if not f.spec.loss_scale)

        return dataclasses.replace(
            self, default=keep(self.default), layers={name: keep(formats) for name, formats in self.layers.items()}
        )

    def offered(self, module: torch.nn.Module) -> tuple[Format, ...] | None:
        """Formats offered for a module, or None when its type is not a tunable layer."""
        for type_name, formats in self.layers.items():
            if is_instance(module, type_name):
                return formats
        return None

    def tunable_layers(self, model: torch.nn.Module) -> dict[str, tuple[Format, ...]]:
        """Outermost modules of a listed type, by name; modules inside a tunable layer follow it."""
        found = self._outermost(model)
        for name in found:
            if not MODULE_PATH.fullmatch(name):  # torch takes any ModuleDict key; a policy file does not
                raise UserError(
                    f"module {shown(name)} of the model: a policy names layers by letters, digits, _ and - "
                    f"joined by dots; rename it, or leave it out of the search with --exclude {shown(name)}"
                )
        return found

    def _outermost(self, model: torch.nn.Module) -> dict[str, tuple[Format, ...]]:
        """tunable_layers without the check of their names."""
        found: dict[str, tuple[Format, ...]] = {}
        for name, module in model.named_modules():
            if not name or any(name.startswith(prefix + ".") for prefix in found) or self.excluded(name):
                continue
            formats = self.offered(module)
            if formats is not None:
                found[name] = formats
        return found


def check_type_name(type_name: str) -> None:
    """A torch.nn class name (Linear), or the import path of any module class
    (transformers.pytorch_utils.Conv1D). A path is not imported: a package that is not installed has no
    such layers in the model, so the entry matches nothing (one space file serves several environments)."""
    if "." in type_name:
        if not all(part.isidentifier() for part in type_name.split(".")):
            raise ValueError(f"layers: {type_name!r} is not an import path such as transformers.pytorch_utils.Conv1D")
        return
    cls = getattr(torch.nn, type_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ValueError(
            f"layers: unknown module type {type_name!r}; use torch.nn class names such as Linear, Conv2d, or the import "
            "path of another library's class, such as transformers.pytorch_utils.Conv1D"
        )


def is_instance(module: torch.nn.Module, type_name: str) -> bool:
    """Whether `module` is of the listed type or a subclass of it. An import path names the class where it is
    defined or re-exported (transformers.Conv1D, torch.nn.Linear): looked up in packages already imported (a
    model of that library has imported it), else matched against the classes' own module and name."""
    if "." not in type_name:
        return isinstance(module, getattr(torch.nn, type_name))
    cls = _loaded_class(type_name)
    if cls is not None:
        return isinstance(module, cls)
    return any(f"{c.__module__}.{c.__qualname__}" == type_name for c in type(module).__mro__)


def _loaded_class(path: str) -> type | None:
    """The class at `path` when its package is already imported (nothing is imported here), else None."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        owner = sys.modules.get(".".join(parts[:cut]))
        if owner is None:
            continue
        value: Any = owner
        for attr in parts[cut:]:
            value = getattr(value, attr, None)
        return value if isinstance(value, type) else None
    return None


def _formats(value: Any, field: str) -> tuple[Format, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field} must be a non-empty list of formats, got {value!r}")
    # the list's fallback (fp32; bf16 too for the FLOP goal) is the goal's to require: Goal.check_fallbacks, at
    # search time
    return tuple(parse_format(v, field=field) for v in value)


def _number(value: Any, field: str, kind: type) -> Any:
    # .inf and .nan are YAML numbers: refused here, before anything is profiled
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or (kind is int and value != int(value)):
        raise ValueError(f"{field} must be {'an integer' if kind is int else 'a finite number'}, but got {value!r}")
    return kind(value)


def _patterns(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or any(not isinstance(v, str) for v in value):
        raise ValueError(f"exclude must be a list of module-name patterns such as [pooler, '*.lm_head'], got {value!r}")
    return tuple(value)


def space_from_dict(data: Any, source: str = "<dict>") -> SearchSpace:
    if not isinstance(data, Mapping):
        raise ValueError(f"a search space must be a mapping with keys {', '.join(_TOP_KEYS)}")
    unknown = [k for k in data if k not in _TOP_KEYS]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(_TOP_KEYS)}")
    if not isinstance(data.get("layers"), Mapping) or not data["layers"]:
        raise ValueError("layers must map torch.nn class names (or import paths of module classes) to lists of formats")
    ls = data.get("loss_scale") or {}
    if not isinstance(ls, Mapping):
        raise ValueError(f"loss_scale must be a mapping with keys {', '.join(_LOSS_SCALE_KEYS)}, got {ls!r}")
    unknown_ls = [k for k in ls if k not in _LOSS_SCALE_KEYS]
    if unknown_ls:
        raise ValueError(f"loss_scale: unknown key {unknown_ls[0]!r}; allowed: {', '.join(_LOSS_SCALE_KEYS)}")
    for key in _LOSS_SCALE_KEYS:
        if key in ls and not isinstance(ls[key], list):
            raise ValueError(f"loss_scale.{key} must be a list, got {ls[key]!r}")
    prune = data.get("prune") or {}
    if any(k != "slower_than" for k in prune):
        raise ValueError(f"prune: unknown key in {sorted(prune)}; allowed: slower_than")
    defaults = LossScaleRange()
    return SearchSpace(
        layers={str(k): _formats(v, f"layers.{k}") for k, v in data["layers"].items()},
        default=_formats(data.get("default", ["fp32", "bf16"]), "default"),
        loss_scale=LossScaleRange(
            init_scale_log2=tuple(ls.get("init_scale_log2", defaults.init_scale_log2)),
            growth_interval=tuple(
                _number(g, "loss_scale.growth_interval", int) for g in ls.get("growth_interval", defaults.growth_interval)
            ),
            growth_factor=tuple(ls.get("growth_factor", defaults.growth_factor)),
            backoff_factor=tuple(ls.get("backoff_factor", defaults.backoff_factor)),
            dynamic=tuple(ls.get("dynamic", defaults.dynamic)),
        ),
        prune_slower_than=_number(prune.get("slower_than", 1.25), "prune.slower_than", float),
        sampler=str(data.get("sampler", "tpe")),
        trials=_number(data.get("trials", 30), "trials", int),
        layout=parse_layout(data.get("layout", "auto")),
        max_params=_number(data.get("max_params", 16), "max_params", int),
        exclude=_patterns(data.get("exclude", [])),
        source=source,
    )


# What a search-space file may be, far past any real one (default.yaml: 3 KiB, 3 levels, under a hundred values), so
# that a hostile file is one line: its size, its nesting (PyYAML composes nodes recursively: thousands of levels are
# a RecursionError), and what its aliases expand to (a "billion laughs" of aliases of aliases is a few lines that
# any walk over it, a message quoting it included, takes gigabytes and hours to go through).
MAX_SPACE_BYTES = 1 << 20
MAX_SPACE_DEPTH = 32
MAX_SPACE_VALUES = 100_000


def _check_bounds(text: str) -> None:
    """Refuse, from the YAML's event stream (read without recursion, nothing built), a document nested deeper than
    MAX_SPACE_DEPTH or holding more than MAX_SPACE_VALUES values once each alias stands for what it names."""
    sizes: dict[str, int] = {}  # anchor -> the values it stands for
    open_nodes: list[tuple[str | None, int]] = [(None, 0)]  # (its anchor, values so far) of each collection being read
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append((event.anchor, 1))
            if len(open_nodes) - 1 > MAX_SPACE_DEPTH:
                raise ValueError(
                    f"nested deeper than {MAX_SPACE_DEPTH} levels (line {event.start_mark.line + 1}); a search "
                    "space is three levels deep (see default.yaml): write it as one"
                )
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_nodes.pop()
        elif isinstance(event, yaml.AliasEvent):
            anchor, size = None, sizes.get(event.anchor or "", 0)
            if any(event.anchor == a for a, _ in open_nodes):
                raise ValueError(f"the alias *{event.anchor} is inside what it names (a loop); write the values out")
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        parent_anchor, so_far = open_nodes.pop()
        open_nodes.append((parent_anchor, so_far + size))
        if so_far + size > MAX_SPACE_VALUES:
            raise ValueError(
                f"more than {MAX_SPACE_VALUES} values once its aliases are expanded (aliases of aliases, a "
                "'billion laughs'?); a search space holds a few hundred: write its values out"
            )


def load_space(path: str | Path | None = None) -> SearchSpace:
    """Read a search-space YAML file; None reads the shipped default.yaml."""
    if path is None:
        try:
            resource = importlib.resources.files("autoprec.search_spaces") / "default.yaml"
        except ModuleNotFoundError:  # uninstalled, run from a checkout on PYTHONPATH: the package is its search_spaces/
            import autoprec  # noqa: PLC0415 (the checkout's root is the runtime package's parent)

            resource = Path(autoprec.__file__).resolve().parents[1] / "search_spaces" / "default.yaml"
        text, source = resource.read_text(encoding="utf-8"), "default.yaml"
    else:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: no such search-space file")
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_SPACE_BYTES + 1)  # no more: a file may be any size
            if len(data) > MAX_SPACE_BYTES:
                raise UserError(
                    f"{path}: over {MAX_SPACE_BYTES} bytes, too large for a search-space file (default.yaml is a few "
                    "KiB); give the search-space file itself"
                )
            text, source = data.decode("utf-8"), str(path)
        except UnicodeDecodeError:
            raise UserError(f"{path}: not a search-space YAML file: it is not UTF-8 text") from None
    try:
        _check_bounds(text)
        return space_from_dict(yaml.safe_load(text), source)
    except yaml.YAMLError as exc:
        raise UserError(f"{source}: not valid YAML{_yaml_problem(exc, text)}") from None
    except (ValueError, TypeError) as exc:
        raise UserError(f"{source}: {exc}") from None


def _yaml_problem(exc: yaml.YAMLError, text: str) -> str:
    """PyYAML's error as one line: where (line and column, counted from 1) and what, with what it was reading; its
    own text spans several lines and quotes the source as "<unicode string>"."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem is not None:
        context = getattr(exc, "context", None)
        return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
    if isinstance(exc, yaml.reader.ReaderError) and isinstance(exc.position, int):  # a character YAML refuses
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        shown = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        return f" at line {line}, column {column}: character {shown} ({exc.reason})"
    return f": {' '.join(str(exc).split())}"
