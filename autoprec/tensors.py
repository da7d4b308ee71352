"""Walking the tensors inside nested outputs and batches: what the runtime and the tuner both need."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply `fn` to every tensor inside a (nested) tensor, tuple, namedtuple, list, dict or dataclass, keeping
    each container's type: a model's output object (a dataclass, or a dict subclass such as Hugging Face's
    ModelOutput, which is both) comes back as the same type with its fields mapped. A container in which
    nothing changed is returned as it is (the same object: state a layer updates in place stays shared); one
    that changed is a shallow copy with the new values set, its constructor and __post_init__ not run again."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is dict:
        mapped = {k: map_tensors(v, fn) for k, v in obj.items()}
        return obj if all(mapped[k] is v for k, v in obj.items()) else mapped
    is_dataclass = dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    if isinstance(obj, Mapping) or is_dataclass:
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if hasattr(obj, f.name)} if is_dataclass else {}
        items = dict(obj.items()) if isinstance(obj, Mapping) else {}
        new_fields = {k: map_tensors(v, fn) for k, v in fields.items()}
        new_items = {k: map_tensors(v, fn) for k, v in items.items()}
        changed = any(new_fields[k] is not v for k, v in fields.items()) or any(new_items[k] is not v for k, v in items.items())
        if not changed:
            return obj
        try:
            new = copy.copy(obj)
            for k, v in new_fields.items():
                object.__setattr__(new, k, v)
            for k, v in new_items.items():
                new[k] = v
        except (TypeError, AttributeError):  # a frozen or read-only mapping: a plain dict keeps the values
            return new_items if isinstance(obj, Mapping) else obj
        return new
    if isinstance(obj, (list, tuple)):
        values = [map_tensors(v, fn) for v in obj]
        if all(new is old for new, old in zip(values, obj)):
            return obj  # the same list: a layer's appends to it reach its caller
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    return obj
