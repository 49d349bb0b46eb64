"""Messages: the only thing the server and client parts of an algorithm exchange.

A message is a mapping of names to tensors plus small scalar metadata, the shape of a
Flower ``ArrayRecord`` + ``ConfigRecord``. Its size is what a real link would carry:
tensor payload bytes plus the metadata encoded as JSON. Nothing else crosses, so the
byte counts the engine reports are honest by construction.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from edgepfl.errors import EdgepflError

Scalar = int | float | str | bool
# a list of one kind is a list of scalars too (list is invariant: list[int] is not list[Scalar])
MetaValue = Scalar | list[Scalar] | list[int] | list[float] | list[str] | list[bool]


class MessageError(EdgepflError):
    """A message is malformed (a peer sent something the protocol does not allow)."""


@dataclass
class Message:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.tensors.items():
            if not isinstance(value, torch.Tensor):
                raise MessageError(f"message tensor {name!r} is a {type(value).__name__}, not a tensor")
        for name, value in self.meta.items():
            items = value if isinstance(value, list) else [value]
            for item in items:
                if not isinstance(item, int | float | str | bool):
                    raise MessageError(
                        f"message metadata {name!r} has type {type(item).__name__}; "
                        "allowed: int, float, str, bool or a list of them"
                    )
                if isinstance(item, float) and not math.isfinite(item):
                    raise MessageError(f"message metadata {name!r} is not finite: {item}")

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def meta_bytes(self) -> int:
        return len(json.dumps(self.meta, separators=(",", ":")).encode()) if self.meta else 0

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: tensor payload plus JSON metadata (empty message: 0)."""
        return self.payload_bytes + self.meta_bytes

    def is_empty(self) -> bool:
        return not self.tensors and not self.meta

    def delivered(self) -> Message:
        """A private copy, as the receiver of a real transfer would hold.

        Cloning on delivery is what keeps the simulated server and client from sharing
        memory: a client that edits a received tensor in place cannot reach server state.
        """
        return Message(
            {k: v.detach().clone() for k, v in self.tensors.items()},
            json.loads(json.dumps(self.meta)),
        )

    def require(self, *names: str) -> None:
        missing = [n for n in names if n not in self.tensors and n not in self.meta]
        if missing:
            raise MessageError(f"message lacks {missing}; it has {sorted(self.tensors) + sorted(self.meta)}")


def subset(tensors: Mapping[str, torch.Tensor], names: list[str] | tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {n: tensors[n] for n in names}


def check_entries(who: str, tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                  *, required: bool = False, unknown: bool = True) -> None:
    """A peer's tensors against what they must look like: each name of ``expected`` that
    it sent with the same shape and dtype; with ``required`` all of them; without
    ``unknown`` no other name. Raises ``MessageError`` naming the first thing wrong."""
    for name, value in tensors.items():
        like = expected.get(name)
        if like is None:
            if not unknown:
                raise MessageError(f"{who} sent an unknown tensor {name!r}; expected names like "
                                   f"{sorted(expected)[:4]}")
            continue
        if value.shape != like.shape or value.dtype != like.dtype:
            raise MessageError(f"{who} sent {name!r} as {value.dtype} {tuple(value.shape)}; "
                               f"expected {like.dtype} {tuple(like.shape)}")
    if required:
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise MessageError(f"{who}'s reply lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")


def like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` that holds no data (device "meta"): what a
    computed entry of ``check_entries``' ``expected`` looks like."""
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclass(frozen=True)
class MetaForm:
    """What a metadata value must be: ``what`` says it in an error, ``ok`` tests it."""

    what: str
    ok: Callable[[Any], bool]


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python


COUNT = MetaForm("an integer >= 0", lambda v: _int(v) and v >= 0)
NONNEGATIVE = MetaForm("a number >= 0", lambda v: (_int(v) or isinstance(v, float)) and v >= 0)


def int_in(lo: int, hi: int) -> MetaForm:
    return MetaForm(f"an integer in {lo}..{hi - 1}", lambda v: _int(v) and lo <= v < hi)


def ints(lo: int, hi: int | None = None, unique: bool = False) -> MetaForm:
    """A list of integers >= ``lo`` (and < ``hi``), without repeats if ``unique``."""
    def ok(v: Any) -> bool:
        return (isinstance(v, list) and all(_int(i) and i >= lo and (hi is None or i < hi)
                                            for i in v)
                and (not unique or len(set(v)) == len(v)))
    what = f"a list of{' distinct' if unique else ''} integers >= {lo}"
    return MetaForm(what + (f" and < {hi}" if hi is not None else ""), ok)


def exactly(value: Any) -> MetaForm:
    """``value`` itself, of the same JSON types (1.0 is not 1, true is not 1)."""
    text = json.dumps(value)
    return MetaForm(text, lambda v: json.dumps(v) == text)


def check_meta(who: str, meta: Mapping[str, Any], forms: Mapping[str, MetaForm]) -> None:
    """A peer's metadata: exactly the keys of ``forms``, each value of its form. Raises
    ``MessageError`` naming the first thing wrong."""
    unknown = sorted(set(meta) - set(forms))
    if unknown:
        raise MessageError(f"{who} sent unknown metadata {unknown[:4]}; expected {sorted(forms)}")
    for key, form in forms.items():
        if key not in meta:
            raise MessageError(f"{who} sent no metadata {key!r}")
        if not form.ok(meta[key]):
            # a peer's value may be long: the failure log gets its start
            raise MessageError(f"{who} sent {key} = {repr(meta[key])[:80]}; expected {form.what}")


def check_message(who: str, msg: Message, tensors: Mapping[str, torch.Tensor],
                  meta: Mapping[str, MetaForm] | None = None) -> None:
    """A reply of exactly this schema: the tensors of ``tensors``, of their shapes and
    dtypes, and no other (``check_entries``); the metadata of ``meta`` (``check_meta``)."""
    check_entries(who, msg.tensors, tensors, required=True, unknown=False)
    check_meta(who, msg.meta, meta or {})


class NonFiniteError(MessageError):
    """A message's tensor holds NaN or Inf values (``check_finite``)."""


def check_finite(who: str, msg: Message) -> None:
    """NaN or Inf in a floating tensor is never a model, a statistic or a logit."""
    for name, value in msg.tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise NonFiniteError(f"{who} sent {name!r} with NaN or Inf values")

