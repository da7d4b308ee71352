"""An export target as a type, and the registry the command line reads its choices from.

A target is a subclass of ExportTarget with a name (`--to NAME`), the suffix of the file it writes, one line for
`--to`'s help, the command-line options it adds (Option), and `write`; `@register_export_target` puts one instance in the registry.
Nothing outside the target's own module names it: `autoprec export` offers, names and writes whatever is registered.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from autoprec.errors import UserError
from autoprec.policy import Policy
from autoprec.registry import Registry

_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
# names an option's value may not take: export()'s own arguments and the export verb's other arguments
RESERVED = frozenset({"policy", "target", "out", "source", "to", "check", "json", "quiet", "debug", "verb", "func", "help"})


@dataclasses.dataclass(frozen=True)
class Option:
    """A command-line option a target adds to `autoprec export`; its value reaches `write` as the keyword `dest`
    (`--num-layers` -> num_layers), only when given. `purpose` says what it is for, in the refusal of it for a
    target that does not take it: "--num-layers is for --to megatron (<purpose>), not --to torchao"."""

    flag: str
    help: str
    purpose: str
    type: Callable[[str], Any] = str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


class ExportTarget(abc.ABC):
    """One `--to` choice. Subclass it in a module of its own, set the class attributes, implement `write`, and
    decorate the class with `@register_export_target`."""

    name: ClassVar[str]  # the --to choice; the default file is <policy name>_<name><suffix>
    suffix: ClassVar[str]  # the written file's suffix, with its dot: ".py", ".json"
    summary: ClassVar[str]  # what the file is, for --to's help: "<name>: <summary>"
    options: ClassVar[tuple[Option, ...]] = ()  # the command-line options this target takes
    # How the target's framework goes from one phase's file to the next, for a policy with phases (a schedule):
    # the export writes one file per phase and says this. A framework that converts a model once, when it builds it,
    # switches by a restart from the run's checkpoint at the phase's first step (the checkpoint's keys are the same).
    switch: ClassVar[str] = (
        "at each phase's first step, save a checkpoint, build a fresh model converted with that phase's file, load "
        "the checkpoint and go on (the framework converts a model when it builds it)"
    )

    @abc.abstractmethod
    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: Any) -> list[str]:
        """Write `policy` to `out`; return what the target could not express, one line each (and say when the file
        converts nothing); a line starting "note: " is what the file needs to run as written (a framework's version,
        its environment), printed as such. `source` names the policy file, for the written file's comments; `options` are this
        target's Options that were given, by dest."""

    def resolve(self, exported: Path, module_names: list[str]) -> dict[str, Resolved]:
        """Each of `module_names` (a model's linears, by module path) -> what the target's framework runs it in
        under the file `exported`, by the framework's own matching rules, without running the file's code; and
        each entry of the file that names none of them (a mistyped name), by that name, which verify reports with
        its close matches. HIGH is the model's own dtype. `autoprec verify` asks this; a target that does not
        implement it cannot be verified."""
        raise UserError(f"--to {self.name}: autoprec cannot verify this target's files (it has no resolve())")

    def environment(self, exported: Path) -> dict[str, str | None]:
        """The environment the file `exported` records for its framework (Transformer Engine's NVTE_* variables that
        change what its recipes compute): each variable -> the value the framework must read, None where it must be
        unset; read as data, without running the file. `autoprec verify` checks the process's environment against it.
        A target whose framework reads no such variable records none: {}."""
        return {}


# What a linear's three GEMMs (fprop, dgrad, wgrad) run in, each a label ("fp8 tensorwise", "fp8 rowwise", "mxfp8",
# "nvfp4") or None for high precision: the one vocabulary the verifier compares an export and a policy in.
Gemms = tuple[str | None, str | None, str | None]
HIGH: Gemms = (None, None, None)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What the target's framework runs one linear in under an exported file: its GEMMs (None: the framework
    refuses the file for this layer, raising when it reads it, or the file says two things of it), and how it decided, in the framework's terms
    ("matcher 'layer_3_mxfp8'", "converter 2 (MXFP8, fqns ['layers.1.'])"). `fp8_all_gather`: the framework
    all-gathers its weight in fp8 under FSDP2 (False where the file says nothing of it)."""

    gemms: Gemms | None
    via: str = ""
    fp8_all_gather: bool = False


_REGISTRY: Registry[ExportTarget] = Registry("export target")  # name -> target, in registration order (--to's)
T = TypeVar("T", bound=type[ExportTarget])


def register_export_target(cls: T) -> T:
    """Class decorator: add an instance of `cls` to the registry. Refuses (ValueError) a name already taken, a name
    or suffix that cannot make a file name, and an option that would clash with another target's or the verb's."""
    suffix = getattr(cls, "suffix", None)
    # the name rule (registry.NAME) is every registry's: a `--to` choice and part of a file name
    name = _REGISTRY.check_name(getattr(cls, "name", None), cls.__qualname__)
    _REGISTRY.refuse_taken(
        name, f"unregister_export_target({name!r}) first to replace it, or give {cls.__qualname__} another name"
    )
    if not isinstance(suffix, str) or not re.fullmatch(r"\.[A-Za-z0-9]+", suffix):
        raise ValueError(f"export target {name!r}: suffix {suffix!r} must be a dot and letters or digits ('.py')")
    if not isinstance(getattr(cls, "summary", None), str):
        raise ValueError(f"export target {name!r}: summary must be a line for --to's help")
    for option in cls.options:
        if not _FLAG.fullmatch(option.flag) or option.dest in RESERVED:
            raise ValueError(
                f"export target {name!r}: option {option.flag!r} must be --lowercase-words, not one of "
                f"the verb's own ({', '.join(sorted(RESERVED))})"
            )
        for other in _REGISTRY.values():
            same = [o for o in other.options if o.dest == option.dest]
            if same and same[0] != option:
                raise ValueError(
                    f"export target {name!r}: option {option.flag} differs from the one export target "
                    f"{other.name!r} takes; share one Option or rename it"
                )
    _REGISTRY[name] = cls()
    return cls


def unregister_export_target(name: str) -> ExportTarget:
    """Remove the target `name` and return it (KeyError if none is registered)."""
    return _REGISTRY.pop(name)


def export_targets() -> tuple[ExportTarget, ...]:
    """The registered targets, in registration order."""
    return tuple(_REGISTRY.values())


def export_target_named(name: str) -> ExportTarget:
    """The target `name`; ValueError listing the registered ones when there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"--to {name!r}: one of {', '.join(_REGISTRY)}") from None


def options() -> dict[Option, tuple[str, ...]]:
    """Every registered target's options -> the names of the targets that take it, in registration order."""
    found: dict[Option, tuple[str, ...]] = {}
    for target in _REGISTRY.values():
        for option in target.options:
            found[option] = (*found.get(option, ()), target.name)
    return found
