"""Walking the tensors inside nested outputs and batches: what the runtime and the tuner both need."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply `fn` to every tensor inside a (nested) tensor, tuple, namedtuple, list, dict or dataclass, keeping
    each container's type: a model's output object (a dataclass, or a dict subclass such as Hugging Face's
    ModelOutput, which is both) comes back as the same type with its fields mapped. A container in which
    nothing changed is returned as it is (the same object: state a layer updates in place stays shared); one
    that changed is a shallow copy with the new values set, its constructor and __post_init__ not run again."""
    return _mapped(obj, fn)[0]


def _mapped(obj: Any, fn: Callable[[torch.Tensor], Any]) -> tuple[Any, bool]:
    """map_tensors' walk: (the mapped object, whether any tensor in it changed). Whether a container changed is
    carried up from its tensors, never asked of the container by identity: torch.compile cannot trace `is` between
    two tuples."""
    if isinstance(obj, torch.Tensor):
        new = fn(obj)
        return new, new is not obj
    if type(obj) is dict:
        pairs = {k: _mapped(v, fn) for k, v in obj.items()}
        if not any(changed for _, changed in pairs.values()):
            return obj, False
        return {k: v for k, (v, _) in pairs.items()}, True
    is_dataclass = dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    if isinstance(obj, Mapping) or is_dataclass:
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if hasattr(obj, f.name)} if is_dataclass else {}
        items = dict(obj.items()) if isinstance(obj, Mapping) else {}
        new_fields = {k: _mapped(v, fn) for k, v in fields.items()}
        new_items = {k: _mapped(v, fn) for k, v in items.items()}
        if not any(changed for _, changed in (*new_fields.values(), *new_items.values())):
            return obj, False
        try:
            new = copy.copy(obj)
            for k, (v, _) in new_fields.items():
                object.__setattr__(new, k, v)
            for k, (v, _) in new_items.items():
                new[k] = v
        except (TypeError, AttributeError):  # a frozen or read-only mapping: a plain dict keeps the values
            return ({k: v for k, (v, _) in new_items.items()} if isinstance(obj, Mapping) else obj), True
        return new, True
    if isinstance(obj, (list, tuple)):
        pairs_ = [_mapped(v, fn) for v in obj]
        if not any(changed for _, changed in pairs_):
            return obj, False  # the same list: a layer's appends to it reach its caller
        values = [v for v, _ in pairs_]
        return (type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)), True
    return obj, False


def hash_tensor(h: hashlib._Hash, t: torch.Tensor, label: str = "") -> None:
    """Feed `t` into the hash `h`: `label`, its dtype and shape, then its bytes (on the CPU, contiguous), so two
    tensors of equal bytes but another dtype or shape hash apart."""
    data = t.detach().to("cpu").contiguous()
    h.update(f"{label}{data.dtype}:{tuple(data.shape)};".encode())
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
