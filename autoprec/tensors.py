"""Walking the tensors inside nested outputs and batches: what the runtime and the tuner both need."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to every tensor inside a (nested) tensor, tuple, namedtuple, list, dict or dataclass, keeping
    each container's type: a model's output object (a dataclass, or a dict subclass such as Hugging Face's
    ModelOutput, which is both) comes back as the same type with its fields mapped."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        if dataclasses.is_dataclass(obj):  # ModelOutput: a dataclass whose fields are also its keys
            return type(obj)(**mapped)
        try:
            return type(obj)(mapped)
        except TypeError:  # a mapping type that cannot be built from a dict: a plain dict keeps the values
            return mapped
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj
