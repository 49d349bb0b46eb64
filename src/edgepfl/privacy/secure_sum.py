"""Secure aggregation's arithmetic (``privacy.secure_aggregation``), apart from the protocol
that carries it (Flower's SecAgg+, ``engine.flower_secagg``): what a client puts into the
masked sum, and the replies an algorithm's aggregate is handed when its server learns only
that sum.

A client of an aggregation that sampled K clients puts into the sum

    w * u,  u = (its model - the model it was sent) over the floating-point entries

(SecAgg+ multiplies by w and sums w as well), with weight w = its samples / the largest client's share of the partition (every node
holds the seeded partition, so every node computes the same scale, which keeps w <= 1 as
SecAgg+'s quantization needs). The protocol hands the server sum(w u) / sum(w) only, the
sample-weighted mean update, and the aggregate is the model sent plus that mean: FedAvg's
step, without any one client's update leaving the protocol.

With client-level DP (``privacy.level = 'client'``) the clipping moves to the client and
so does the noise (distributed DP): w = 1 and u is replaced by clip(u, C) + N(0, (sigma C)^2 / t) with t
the SecAgg+ reconstruction threshold, the fewest clients whose vectors any unmasked sum
holds (a client's own SecAgg+ part refuses to hand out its unmasking shares with fewer
active neighbours, so no server can have a sum of fewer). A sum of m >= t vectors then
carries noise of std sigma C sqrt(m / t) >= sigma C, which is what the accountant counts
(the sum of the clipped updates has sensitivity C, as DP-FedAvg's); the aggregate is
DP-FedAvg's, sent + (sum of the m noised, clipped updates) / K.

What the server can no longer check per reply is checked on the client before anything is
masked: every entry finite, the reply's tensors those it was sent, |w u| within SecAgg+'s
clipping range (it would otherwise be clipped silently); the norm bound under DP is the
client's own clipping.
"""

from __future__ import annotations

import math

import torch

from edgepfl.errors import EdgepflError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.privacy.dp_fedavg import clip_factor, floats

#: SecAgg+ shares every client's keys with all the aggregation's clients (num_shares 1.0)
SHARES = 1.0


class SecureSumError(EdgepflError):
    """A client's reply cannot go into the masked sum as it is."""


def threshold(sampled: int, share: float) -> int:
    """SecAgg+'s reconstruction threshold for an aggregation of ``sampled`` clients with
    ``privacy.secagg_threshold = share``, computed as Flower's ``SecAggPlusWorkflow`` does
    with every client a neighbour of every other: the fewest active clients the protocol
    completes with."""
    return max(round(share * sampled), 2)


def client_vector(sent: Message, reply: Message, weight: float, clip: float | None,
                  noise_std: float, limit: float, gen: torch.Generator | None = None
                  ) -> list[torch.Tensor]:
    """What a client puts into the masked sum with SecAgg+ weight ``weight`` (which SecAgg+
    multiplies in): its update (``reply`` less ``sent`` over the floating-point entries of
    ``sent``), clipped to L2 ``clip`` and noised with N(0, ``noise_std``^2) per entry under
    DP (``clip`` None: no DP). Refused
    (``SecureSumError``): a reply whose tensors are not those it was sent, a non-finite
    entry, an entry beyond SecAgg+'s clipping range ``limit``."""
    names = floats(sent)
    extra = sorted(set(reply.tensors) - set(sent.tensors))
    missing = [k for k in names if k not in reply.tensors]
    if extra or missing:
        raise SecureSumError(f"the reply has {extra} it was not sent and lacks {missing} of what "
                             "it was: a masked sum adds the same entries of every client")
    update = [reply.tensors[k].to(sent.tensors[k].dtype) - sent.tensors[k] for k in names]
    for k, u in zip(names, update, strict=True):
        if u.shape != sent.tensors[k].shape:
            raise SecureSumError(f"the reply's {k!r} has shape {tuple(u.shape)}, it was sent "
                                 f"{tuple(sent.tensors[k].shape)}")
        if not bool(torch.isfinite(u).all()):
            raise SecureSumError(f"the reply's {k!r} holds NaN or Inf values; a masked sum "
                                 "would hide which client sent them")
    if clip is not None:
        factor = clip_factor(update, clip)
        update = [u * factor for u in update]
        if noise_std > 0:
            update = [u + torch.randn(u.shape, generator=gen, dtype=torch.float64)
                      .mul_(noise_std).to(u.dtype) for u in update]
    # SecAgg+ multiplies by the weight itself, then clips to the range and quantizes
    top = weight * max((float(u.abs().max()) for u in update if u.numel()), default=0.0)
    if top > limit:
        raise SecureSumError(f"an entry of the weighted update is {top:.4g}, beyond "
                             f"privacy.secagg_range = {limit:g}: SecAgg+ would clip it and the "
                             "sum would be wrong; raise privacy.secagg_range")
    return update


def noise_std(sigma: float, clip: float, least: int) -> float:
    """Each client's share of the noise: a sum of ``least`` or more carries std
    ``sigma * clip`` or more."""
    return sigma * clip / math.sqrt(least)


def summed_replies(sent: Message, mean: list[torch.Tensor], layouts: dict[int, list[str]],
                   scale: float = 1.0, weights: dict[int, int] | None = None
                   ) -> dict[int, Message]:
    """The replies an algorithm's own mean (``PrivacySupport(client='mean')``) turns into
    ``sent`` + ``scale`` x ``mean`` (the mean update over the floating-point entries of
    ``sent``, in their order), one per client in ``layouts`` (client -> the names of the
    tensors its reply held); the entries a sum does not carry are ``sent``'s. Each has
    weight ``num_samples`` its client's in ``weights`` (the replies are equal, so the mean
    is the same whatever the weights, and their total is what an aggregator passes on, an
    edge to its cloud), else 1, DP-FedAvg's equal weights."""
    names = floats(sent)
    if len(mean) != len(names) or any(m.shape != sent.tensors[k].shape
                                       for k, m in zip(names, mean, strict=True)):
        raise MessageError(f"the secure sum has {len(mean)} arrays of shapes "
                           f"{[tuple(m.shape) for m in mean][:4]}..., the model sent has "
                           f"{len(names)} floating-point entries")
    model = {k: sent.tensors[k] + (m * scale).to(sent.tensors[k].dtype)
             for k, m in zip(names, mean, strict=True)}
    out = {}
    for cid, layout in layouts.items():
        unknown = [k for k in layout if k not in sent.tensors]
        if unknown:
            raise MessageError(f"client {cid} says its reply held {unknown[:4]}, which it was "
                               "not sent")
        out[cid] = Message({k: model.get(k, sent.tensors[k]) for k in layout},
                           {"num_samples": 1 if weights is None else weights[cid]})
    return out
