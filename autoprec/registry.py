"""The registries of what varies (devices, goals, export targets, formats, format families, targets): one kind of
table, one rule for a name, one way to refuse a name taken."""

from __future__ import annotations

import re
from typing import TypeVar

V = TypeVar("V")

# A registered name is what a policy, a space file or the command line gives, looked up stripped and lower-cased:
# only a name already in that form can ever be chosen, and ASCII only, so no Unicode case folding makes two alike.
NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
NAME_RULE = "lowercase letters, digits, '-' and '_', starting with a letter or digit"


class Registry(dict[str, V]):
    """Name -> member, in registration order (the order the command line lists them). `kind` names a member in
    messages ("goal", "device type", "export target"). Every name put in must follow NAME (check_name)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def __setitem__(self, name: str, member: V) -> None:
        self.check_name(name)
        super().__setitem__(name, member)

    def check_name(self, name: object, owner: str | None = None) -> str:
        """`name`, if it follows NAME; else ValueError naming the value, the rule, and the fix (the name lookups
        would find, or that that name is taken). `owner` (a class's name) is said beside the kind."""
        if isinstance(name, str) and NAME.fullmatch(str.__str__(name)):
            return name
        what = f"{self.kind} {owner}: name" if owner else f"{self.kind} name"
        rule = f"{what} {name!r} must be {NAME_RULE}: lookups strip and lower-case a name, so no other can be chosen"
        canonical = name.strip().lower() if isinstance(name, str) else None
        if canonical is not None and canonical in self:
            taken = type(self[canonical])
            raise ValueError(
                f"{rule}; as {canonical!r} it is the registered {self.kind} {canonical!r} (by {taken.__module__}."
                f"{taken.__qualname__}): give it another name"
            )
        if canonical is not None and NAME.fullmatch(canonical):
            raise ValueError(f"{rule}; register it as {canonical!r}")
        raise ValueError(f"{rule}; give it such a name")

    def refuse_taken(self, name: str, fix: str) -> None:
        """ValueError where `name` breaks the rule (check_name) or is registered already, naming the class that holds
        it and `fix` (what to do)."""
        self.check_name(name)
        if name in self:
            taken = type(self[name])
            raise ValueError(f"{self.kind} {name!r} is already registered (by {taken.__module__}.{taken.__qualname__}); {fix}")
