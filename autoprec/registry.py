"""The registries of what varies (devices, goals, export targets): one kind of table, one way to refuse a name taken."""

from __future__ import annotations

from typing import TypeVar

V = TypeVar("V")


class Registry(dict[str, V]):
    """Name -> member, in registration order (the order the command line lists them). `kind` names a member in
    messages ("goal", "device type", "export target")."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def refuse_taken(self, name: str, fix: str) -> None:
        """ValueError where `name` is registered already, naming the class that holds it and `fix` (what to do)."""
        if name in self:
            taken = type(self[name])
            raise ValueError(f"{self.kind} {name!r} is already registered (by {taken.__module__}.{taken.__qualname__}); {fix}")
