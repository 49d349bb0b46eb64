"""Per-client state held as stacked tensors ``[N, *shape]``.

One tensor per state entry with a leading client dimension, instead of N module copies:
FedAvg becomes a weighted sum over dim 0, KAPC's regularizers one batched matrix product
per layer, and N clients cost N rows of memory rather than N Python objects. Entries are
keyed by name and only rows of clients that have the entry are valid.

Clients of different architectures may hold an entry of the same name with different
shapes (``fc1.weight`` of a narrow and a wide model): each shape gets a stack of its own
(``name``, then ``name#2``, ...), a client's row lives in the one that fits it, and
``row`` gives every client its entries under their own names.

Where the stacks live is a ``Stacks``: memory, or files mapped into memory
(``train.store = "disk"``) for federations whose per-client state is larger than the
machine's memory. A mapped stack is indexed, sliced and written like any tensor; the
kernel keeps the rows in use in its page cache and writes the rest back to the file.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from edgepfl.errors import ConfigError

VARIANT = "#"
PRESENT = ".__present__"


def available_memory_bytes() -> int | None:
    """Memory a process may still take without being killed: Linux's ``MemAvailable`` (free
    pages and the cache the kernel can drop) plus free swap; None where there is no
    ``/proc/meminfo``."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                      if line.split(":")[0] in ("MemAvailable", "SwapFree")}
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


class Stacks:
    """Allocates the per-client stacks of a run: in memory (``directory`` None), or each in
    a file of ``directory`` mapped into memory with ``MAP_SHARED``.

    A mapped stack's file is unlinked as soon as it is mapped: its disk space lasts as
    long as the tensor does and is freed when the process ends, however it ends, so a run
    never leaves gigabytes of scratch files behind. What a run must keep, its checkpoint,
    is written apart (``output.checkpoint_every``). ``directory`` must exist
    (``engine.parts.run_stacks`` makes it and says so when it cannot).
    """

    def __init__(self, directory: str | Path | None = None):
        self.directory = None if directory is None else Path(directory)

    @property
    def on_disk(self) -> bool:
        return self.directory is not None

    def __repr__(self) -> str:
        return "Stacks(memory)" if self.directory is None else f"Stacks({str(self.directory)!r})"

    def zeros(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        # bool masks and empty stacks are tiny; from_file maps nothing for them
        if self.directory is None or numel == 0 or dtype == torch.bool:
            if nbytes >= _CHECKED_FROM:
                self.refuse_beyond_memory(nbytes, f"a per-client stack {tuple(shape)}")
            return torch.zeros(tuple(shape), dtype=dtype)
        fd, name = tempfile.mkstemp(prefix="stack-", suffix=".bin", dir=self.directory)
        try:
            # the blocks reserved now (they read as zeros): a full disk is then this clear
            # error, not a SIGBUS when a page of a sparse file is first written rounds later
            reserve = getattr(os, "posix_fallocate", None)
            try:
                if reserve is None:  # macOS: a sparse file
                    os.ftruncate(fd, nbytes)
                else:
                    reserve(fd, 0, nbytes)
            except OSError as exc:
                size = f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
                raise ConfigError(
                    f"train.store = disk: {self.directory} cannot hold a per-client stack "
                    f"{tuple(shape)} of {size} ({exc.strerror}); free space "
                    f"there, or give train.store_dir a folder on a larger disk") from None
            flat = torch.from_file(name, shared=True, size=numel, dtype=dtype)
        finally:
            os.close(fd)
            os.unlink(name)
        _MAPPED.add(name)
        return flat.view(tuple(shape))

    def refuse_beyond_memory(self, nbytes: int, what: str) -> None:
        """A ``ConfigError`` naming ``train.store = disk`` when ``nbytes`` more in memory
        exceed what the machine has left: zeroing them would end in the kernel killing
        the run partway (a stack's pages are all written as it is made)."""
        if self.directory is not None:
            return
        available = available_memory_bytes()
        if available is None or nbytes <= available:
            return
        raise ConfigError(
            f"{what} needs {nbytes / 1e9:.1f} GB and this machine has {available / 1e9:.1f} GB "
            f"of memory available: set train.store = disk (files mapped into memory; docs/user-guide.md, "
            f"'Many clients'), or run fewer clients (partition.clients)")

    def copy(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of ``value`` allocated here."""
        if self.directory is None:
            return value.clone()
        out = self.zeros(value.shape, value.dtype)
        out.copy_(value)
        return out

    def hold(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` itself in memory, a copy of it on disk (for a tensor made for this)."""
        return value if self.directory is None else self.copy(value)

    def repeat(self, value: torch.Tensor, rows: int) -> torch.Tensor:
        """``rows`` copies of ``value`` stacked (``[rows, *value.shape]``), allocated here."""
        out = self.zeros((rows, *value.shape), value.dtype)
        out.copy_(value.unsqueeze(0).expand_as(out))
        return out

    @staticmethod
    def of(tensor: torch.Tensor) -> Stacks:
        """Where ``tensor`` lives: a copy made through this keeps it on disk if it was."""
        name = tensor.untyped_storage().filename
        # only stacks mapped here: a file anyone else mapped shared is not one of ours
        return Stacks(Path(name).parent) if name in _MAPPED else MEMORY


def sendable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as a worker process can receive them: a view of a mapped file is
    copied, since torch hands a worker a tensor's memory by its file descriptor and the
    stacks' files are closed (and unlinked) once mapped; others go as they are."""
    return {k: v.clone() if v.untyped_storage().filename is not None else v
            for k, v in tensors.items()}


MEMORY = Stacks()
_CHECKED_FROM = 1 << 26  # bytes: a smaller stack is not worth reading /proc/meminfo for
_MAPPED: set[str] = set()  # the files Stacks mapped (unlinked: names stay unique)


def _name(key: str) -> str:
    return key.split(VARIANT, 1)[0]


class StackedStore:
    def __init__(self, num_clients: int, stacks: Stacks = MEMORY):
        self.num_clients = num_clients
        self.stacks = stacks
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
        self.tensors[key] = self.stacks.zeros((self.num_clients, *like.shape), like.dtype)
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
            self.tensors[name] = self.stacks.copy(value)
            self.present[name] = tensors[f"{key}{PRESENT}"].clone().bool()
            self._variants.setdefault(_name(name), []).append(name)
