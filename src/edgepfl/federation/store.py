"""Per-client state held as stacked tensors ``[N, *shape]``.

One tensor per state entry with a leading client dimension, instead of N module copies:
FedAvg becomes a weighted sum over dim 0, KAPC's regularizers one batched matrix product
per layer, and N clients cost N rows of memory rather than N Python objects. Entries are
keyed by name and only rows of clients that have the entry are valid, so clients with
different architectures (HMPL) fit the same store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


class StackedStore:
    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self.tensors: dict[str, torch.Tensor] = {}
        self.present: dict[str, torch.Tensor] = {}

    def _ensure(self, name: str, like: torch.Tensor) -> torch.Tensor:
        stack = self.tensors.get(name)
        if stack is None:
            stack = torch.zeros((self.num_clients, *like.shape), dtype=like.dtype)
            self.tensors[name] = stack
            self.present[name] = torch.zeros(self.num_clients, dtype=torch.bool)
        elif stack.shape[1:] != like.shape or stack.dtype != like.dtype:
            raise ValueError(
                f"state {name!r}: row of shape {tuple(like.shape)} {like.dtype} does not fit "
                f"the stack {tuple(stack.shape[1:])} {stack.dtype}"
            )
        return stack

    def set_row(self, cid: int, values: Mapping[str, torch.Tensor]) -> None:
        for name, value in values.items():
            self._ensure(name, value)[cid].copy_(value)
            self.present[name][cid] = True

    def row(self, cid: int, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Views of client ``cid``'s entries (no copy: write through them deliberately)."""
        names = self.tensors.keys() if names is None else names
        return {n: self.tensors[n][cid] for n in names if self.present[n][cid]}

    def stack(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {}
        for name, stack in self.tensors.items():
            out[f"{prefix}{name}"] = stack
            out[f"{prefix}{name}.__present__"] = self.present[name]
        return out

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.tensors.clear()
        self.present.clear()
        for key, value in tensors.items():
            if not key.startswith(prefix) or key.endswith(".__present__"):
                continue
            name = key[len(prefix):]
            if value.shape[0] != self.num_clients:
                raise ValueError(f"checkpoint entry {key!r} has {value.shape[0]} rows, expected {self.num_clients}")
            self.tensors[name] = value.clone()
            self.present[name] = tensors[f"{key}.__present__"].clone().bool()
