"""Aggregation over clients whose models differ: which layers are "the same layer", and one
helper for "average each layer over the clients that hold it".

A layer's identity is its module path (what ``LayerSpec`` calls the layer's name). Two
architectures hold "the same layer" when the module path is the same and so is every
entry of it (parameter and buffer names, shapes, dtypes); its entries then have one key,
their own name, and are averaged over every client that holds them. A layer that differs
between architectures (a classifier over 32 features instead of 64: even its bias, of the
same shape, is not the same bias) is kept per architecture under ``"<arch>:<name>"``,
unless an algorithm aggregates width slices (``average_width_slices``, HeteroFL's channel
prefixes). With one architecture every key is the entry's name and the helpers are plain
FedAvg.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from edgepfl.federation.messages import MessageError

State = dict[str, torch.Tensor]


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]],
                     weights: Sequence[float] | torch.Tensor) -> State:
    """Sample-weighted mean of model states (integer buffers: taken from the first)."""
    if not states:
        raise ValueError("cannot average zero states")
    w = torch.as_tensor(weights, dtype=torch.float64)
    if (w < 0).any() or float(w.sum()) <= 0:
        raise ValueError(f"averaging weights must be non-negative with a positive sum, got {w.tolist()}")
    w = (w / w.sum()).tolist()
    out: State = {name: t.clone() for name, t in states[0].items() if not t.is_floating_point()}
    names = [name for name, t in states[0].items() if t.is_floating_point()]
    # running sum in place: stacking N models first costs an N-model copy and is ~10x
    # slower at 100 clients (bench/speed/README.md, server time)
    acc = torch._foreach_mul([states[0][n] for n in names], w[0])
    for state, wi in zip(states[1:], w[1:], strict=True):
        torch._foreach_add_(acc, [state[n] for n in names], alpha=wi)
    out.update(zip(names, acc, strict=True))
    return {name: out[name] for name in states[0]}


def _layer_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _layers(model: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
    out: dict[str, list] = {}
    for name, t in model.items():
        out.setdefault(_layer_of(name), []).append((name, tuple(t.shape), t.dtype))
    return {layer: tuple(entries) for layer, entries in out.items()}


class ParamIndex:
    """The identity of every parameter of every architecture of a federation."""

    def __init__(self, models: Mapping[str, Mapping[str, torch.Tensor]]):
        """``models``: architecture name -> its (initial) state, in the federation's order."""
        self.archs = list(models)
        seen: dict[str, set] = {}  # layer -> the signatures architectures give it
        for model in models.values():
            for layer, sig in _layers(model).items():
                seen.setdefault(layer, set()).add(sig)
        self._params = {a: list(m) for a, m in models.items()}
        self._key = {(a, p): (p if len(seen[_layer_of(p)]) == 1 else f"{a}:{p}")
                     for a, m in models.items() for p in m}
        self._shape = {self._key[a, p]: t.shape for a, m in models.items() for p, t in m.items()}

    @property
    def keys(self) -> list[str]:
        return list(dict.fromkeys(self._key[a, p] for a in self.archs for p in self._params[a]))

    def key(self, arch: str, param: str) -> str:
        return self._key[arch, param]

    def holders(self, key: str) -> list[str]:
        return [a for a in self.archs if any(self._key[a, p] == key for p in self._params[a])]

    def shared(self) -> list[str]:
        """Keys that more than one architecture holds."""
        return [k for k in self.keys if len(self.holders(k)) > 1]

    def union(self, models: Mapping[str, Mapping[str, torch.Tensor]]) -> State:
        """One state keyed by identity from per-architecture states (a shared parameter is
        taken from the first architecture that holds it)."""
        out: State = {}
        for arch, model in models.items():
            for p, t in model.items():
                out.setdefault(self._key[arch, p], t)
        return out

    def model(self, arch: str, union: Mapping[str, torch.Tensor]) -> State:
        """Architecture ``arch``'s state (its own parameter names) out of a union."""
        return {p: union[self._key[arch, p]] for p in self._params[arch]}

    def average_over_holders(self, replies: Mapping[int, Mapping[str, torch.Tensor]],
                             weights: Mapping[int, float], arch_of: Sequence[str],
                             previous: Mapping[str, torch.Tensor]) -> State:
        """Each parameter's sample-weighted mean over exactly the replying clients that hold
        it; a parameter no replying client holds keeps its ``previous`` value. Returns a
        union keyed by identity. With one architecture this is ``weighted_average`` of the
        replies in their order, bit for bit."""
        groups: dict[tuple[int, ...], list[str]] = {}
        for key in self.keys:
            holders = tuple(cid for cid in replies
                            if any(self._key.get((arch_of[cid], p)) == key
                                   for p in self._params[arch_of[cid]]))
            groups.setdefault(holders, []).append(key)
        out: State = {}
        for holders, keys in groups.items():
            if not holders or sum(weights[c] for c in holders) <= 0:
                out.update({k: previous[k] for k in keys})
                continue
            states = []
            for cid in holders:
                arch = arch_of[cid]
                names = {self._key[arch, p]: p for p in self._params[arch]}
                reply = replies[cid]
                missing = [names[k] for k in keys if names[k] not in reply]
                if missing:
                    raise MessageError(f"client {cid}'s model lacks {missing}")
                states.append({k: reply[names[k]] for k in keys})
            out.update(weighted_average(states, [weights[c] for c in holders]))
        return {k: out[k] for k in self.keys}


def average_width_slices(previous: Mapping[str, torch.Tensor],
                         models: Sequence[Mapping[str, torch.Tensor]],
                         weights: Sequence[float]) -> State:
    """HeteroFL's aggregation: a client's parameter of a smaller width is the leading slice
    (channel prefix, every dimension) of the full one. Each element of the full parameter
    becomes the weighted mean over the clients whose slice covers it; elements no client
    covers keep their ``previous`` value. A parameter every holder sends whole is
    ``weighted_average`` over them, so with no narrow client this is FedAvg bit for bit."""
    out: State = {}
    for name, full in previous.items():
        if not full.is_floating_point():
            out[name] = full.clone()
            continue
        held = [(m[name], w) for m, w in zip(models, weights, strict=True) if name in m]
        if held and sum(w for _, w in held) > 0 and all(t.shape == full.shape for t, _ in held):
            out[name] = weighted_average([{name: t} for t, _ in held], [w for _, w in held])[name]
            continue
        total = torch.zeros_like(full, dtype=torch.float64)
        count = torch.zeros_like(full, dtype=torch.float64)
        for model, w in zip(models, weights, strict=True):
            if name not in model:
                continue
            t = model[name]
            if t.dim() != full.dim() or any(s > f for s, f in zip(t.shape, full.shape, strict=True)):
                raise MessageError(f"parameter {name!r} of shape {tuple(t.shape)} is not a slice "
                                   f"of {tuple(full.shape)}")
            region = tuple(slice(0, s) for s in t.shape)
            total[region] += w * t.double()
            count[region] += w
        mean = torch.where(count > 0, total / count.clamp(min=1e-300), full.double())
        out[name] = mean.to(full.dtype)
    return out
