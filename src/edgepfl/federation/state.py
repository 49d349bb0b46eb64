"""Declared state: a server (or edge) part names the attributes it must resume with, and
the runtime checkpoints them, so no algorithm hand-writes ``state_dict`` code.

An attribute is saved by what it holds:

* a tensor -> one tensor entry ``name``;
* a mapping of names to tensors (a model) -> entries ``name.<key>``;
* a ``StackedStore`` -> its stacks and presence masks under ``name/``;
* anything JSON can hold exactly (numbers, booleans, strings, None and nested lists or
  string-keyed dicts of them; tuples come back as lists) -> the checkpoint's JSON header.

Only tensors count as the server's state bytes: numbers and lists in the header are
bookkeeping. Loading checks that each tensor entry is there and fits the attribute it
replaces (same dtype; same shape unless the attribute is still empty), so a checkpoint of
another configuration is refused rather than half loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from edgepfl.errors import EdgepflError
from edgepfl.federation.store import StackedStore, Stacks

State = dict[str, torch.Tensor]
FLOAT = "__float__"


class StateError(EdgepflError):
    """A checkpoint's state does not fit the part it is loaded into."""


def _is_model(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(
        isinstance(v, torch.Tensor) for v in value.values())


def _json(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            # JSON has no inf/nan: a marker that cannot be mistaken for a string value
            return {FLOAT: repr(value)}
        return value
    if isinstance(value, list | tuple):
        return [_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _json(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"declared state {where} holds a {type(value).__name__}; declare tensors, "
                    "mappings of tensors, StackedStores, or JSON values (numbers, lists, dicts)")


def _from_json(value: Any, like: Any) -> Any:
    if isinstance(value, dict) and set(value) == {FLOAT}:
        return float(value[FLOAT])
    if isinstance(value, dict):
        return {k: _from_json(v, like.get(k) if isinstance(like, dict) else None)
                for k, v in value.items()}
    if isinstance(value, list):
        sample = like[0] if isinstance(like, list | tuple) and like else None
        items = [_from_json(v, sample) for v in value]
        return tuple(items) if isinstance(like, tuple) else items
    return value


def save_state(obj: Any, names: tuple[str, ...],
               tensors_only: bool = False) -> tuple[State, dict[str, Any]]:
    """The declared attributes ``names`` of ``obj`` as (tensors, JSON values);
    ``tensors_only`` skips encoding the JSON values (for measuring state bytes)."""
    tensors: State = {}
    meta: dict[str, Any] = {}
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif isinstance(value, StackedStore):
            tensors.update(value.state_dict(f"{name}/"))
        elif _is_model(value):
            tensors.update({f"{name}.{k}": v for k, v in value.items()})
        elif not tensors_only:
            meta[name] = _json(value, f"{type(obj).__name__}.{name}")
    return tensors, meta


def _fit(key: str, saved: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    if saved.dtype != current.dtype or (current.numel() and saved.shape != current.shape):
        raise StateError(f"checkpoint state {key!r} is {tuple(saved.shape)} {saved.dtype}; this "
                         f"configuration's is {tuple(current.shape)} {current.dtype}")
    return Stacks.of(current).copy(saved)  # on disk again if the attribute was


def load_state(obj: Any, names: tuple[str, ...], tensors: Mapping[str, torch.Tensor],
               meta: Mapping[str, Any]) -> None:
    """Restore what ``save_state`` saved into the declared attributes of ``obj``: all of
    them or, when anything does not fit, none (``StateError`` names it)."""
    staged: dict[str, Any] = {}
    used: set[str] = set()
    for name in names:
        current = getattr(obj, name)
        if isinstance(current, torch.Tensor):
            if name not in tensors:
                raise StateError(f"checkpoint lacks the state tensor {name!r}")
            staged[name] = _fit(name, tensors[name], current)
            used.add(name)
        elif isinstance(current, StackedStore):
            store = StackedStore(current.num_clients, current.stacks)
            try:
                store.load_state_dict(tensors, f"{name}/")
            except (KeyError, ValueError) as exc:
                raise StateError(f"checkpoint state {name!r} does not fit: {exc}") from None
            staged[name] = store
            used.update(k for k in tensors if k.startswith(f"{name}/"))
        elif _is_model(current) or (isinstance(current, Mapping) and not current
                                    and name not in meta):
            # a model, or an empty mapping that a model filled before it was saved
            prefix = f"{name}."
            saved = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if not current:
                staged[name] = {k: v.clone() for k, v in saved.items()}
                used.update(f"{prefix}{k}" for k in saved)
                continue
            if set(saved) != set(current):
                raise StateError(f"checkpoint state {name!r} has entries {sorted(saved)}; this "
                                 f"configuration's are {sorted(current)}")
            staged[name] = {k: _fit(f"{prefix}{k}", saved[k], current[k]) for k in current}
            used.update(f"{prefix}{k}" for k in saved)
        else:
            if name not in meta:
                raise StateError(f"checkpoint lacks the state value {name!r}")
            staged[name] = _from_json(meta[name], current)
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise StateError(f"checkpoint holds state tensors {unknown[:5]} that "
                         f"{type(obj).__name__} does not declare")
    for name, value in staged.items():
        setattr(obj, name, value)


def state_meta_bytes(meta: Mapping[str, Any]) -> int:
    return len(json.dumps(meta, separators=(",", ":")).encode()) if meta else 0
