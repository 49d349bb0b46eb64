"""Per-client state held as stacked tensors ``[N, *shape]``.

One tensor per state entry with a leading client dimension, instead of N module copies:
FedAvg becomes a weighted sum over dim 0, KAPC's regularizers one batched matrix product
per layer, and N clients cost N rows of memory rather than N Python objects. Entries are
keyed by name and only rows of clients that have the entry are valid.

Clients of different architectures may hold an entry of the same name with different
shapes (``fc1.weight`` of a narrow and a wide model): each shape gets a stack of its own
(``name``, then ``name#2``, ...), a client's row lives in the one that fits it, and
``row`` gives every client its entries under their own names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

VARIANT = "#"
PRESENT = ".__present__"


def _name(key: str) -> str:
    return key.split(VARIANT, 1)[0]


class StackedStore:
    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self.tensors: dict[str, torch.Tensor] = {}
        self.present: dict[str, torch.Tensor] = {}
        self._variants: dict[str, list[str]] = {}  # name -> its stacks' keys

    def _keys(self, name: str) -> list[str]:
        return self._variants.get(name, [])

    def _ensure(self, name: str, like: torch.Tensor) -> str:
        keys = self._keys(name)
        for key in keys:
            stack = self.tensors[key]
            if stack.shape[1:] == like.shape and stack.dtype == like.dtype:
                return key
        key = name if not keys else f"{name}{VARIANT}{len(keys) + 1}"
        self.tensors[key] = torch.zeros((self.num_clients, *like.shape), dtype=like.dtype)
        self.present[key] = torch.zeros(self.num_clients, dtype=torch.bool)
        self._variants.setdefault(name, []).append(key)
        return key

    def set_row(self, cid: int, values: Mapping[str, torch.Tensor]) -> None:
        for name, value in values.items():
            key = self._ensure(name, value)
            keys = self._variants[name]
            if len(keys) > 1:  # a client holds one shape of an entry
                for other in keys:
                    if other != key:
                        self.present[other][cid] = False
            self.tensors[key][cid].copy_(value)
            self.present[key][cid] = True

    def row(self, cid: int, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Views of client ``cid``'s entries (no copy: write through them deliberately)."""
        wanted = None if names is None else set(names)
        out = {}
        for key, stack in self.tensors.items():
            name = _name(key)
            if (wanted is None or name in wanted) and self.present[key][cid]:
                out[name] = stack[cid]
        if names is not None:
            return {n: out[n] for n in names if n in out}
        return out

    def stack(self, name: str) -> torch.Tensor:
        """The stack of ``name`` (of its first shape, when clients hold several)."""
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {}
        for key, stack in self.tensors.items():
            out[f"{prefix}{key}"] = stack
            out[f"{prefix}{key}{PRESENT}"] = self.present[key]
        return out

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.tensors.clear()
        self.present.clear()
        self._variants.clear()
        for key, value in tensors.items():
            if not key.startswith(prefix) or key.endswith(PRESENT):
                continue
            name = key[len(prefix):]
            if value.shape[0] != self.num_clients:
                raise ValueError(f"checkpoint entry {key!r} has {value.shape[0]} rows, expected {self.num_clients}")
            self.tensors[name] = value.clone()
            self.present[name] = tensors[f"{key}{PRESENT}"].clone().bool()
            self._variants.setdefault(_name(name), []).append(name)
