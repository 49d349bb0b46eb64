"""Client-level DP at an aggregator: DP-FedAvg's clipped, noised sum (McMahan, Ramage,
Talwar and Zhang, ICLR 2018), in front of an algorithm's own averaging.

An aggregator that sampled K clients gets replies from m <= K of them (a client may drop,
be late or be rejected). Each reply's update, its model minus the model the client was
sent, is clipped to ``clip`` in L2 over all its floating-point entries; the aggregate is

    sent + (sum of the m clipped updates + N(0, (noise_multiplier * clip)^2 I)) / K

K is the fixed denominator: it depends on the sampling alone, never on a client's data.
A sample-weighted mean divides by the replies' sample counts, which one client can make
as large as it likes, so its sensitivity has no bound (DP-FedAvg's reason for its
fixed-denominator estimator; ours is that estimator for fixed-size sampling, where the
expected number of clients is K itself).

The algorithm's aggregate is then called, unchanged, on replies rewritten so that its own
mean computes exactly that: reply i becomes sent + (m / K) clip(update_i) + noise / K with
weight ``num_samples = 1``, the same noise in every reply, so their equal-weight mean is
the expression above. The algorithm's code never sees a raw reply; everything else the
clients sent (metadata, integer buffers such as BatchNorm's batch counter) is replaced by
what the aggregator itself holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from edgepfl.errors import EdgepflError
from edgepfl.federation.messages import Message


class PrivacyError(EdgepflError):
    """A run could not keep the privacy it was configured with; it stops rather than go on
    without it."""


@dataclass
class Clipped:
    """What one aggregation's clipping did, for the metrics row: a measurement of the
    simulation, not a release covered by epsilon (a deployment would noise it too)."""

    replies: int = 0
    clipped: int = 0


def floats(msg: Message) -> list[str]:
    """The entries an update is measured over: the floating-point ones, in the message's
    order (integer buffers, a BatchNorm's batch counter, stay the aggregator's)."""
    return [k for k, t in msg.tensors.items() if t.is_floating_point()]


def clip_factor(update: list[torch.Tensor], clip: float) -> float:
    """What scales ``update`` to L2 norm ``clip`` over all its entries, 1 within it."""
    norm = math.sqrt(sum(float(u.double().pow(2).sum()) for u in update))
    return min(1.0, clip / norm) if norm > 0 else 1.0


def same_model(sent: dict[int, Message], cids: list[int], where: str,
               setting: str = "privacy.level = 'client'",
               because: str = "the noised sum of their updates would have a different "
                              "sensitivity per entry, which is not implemented") -> Message:
    """The one model every replying client was sent: the update of a client is measured
    from it, and the mean of the rewritten replies is taken around it. Else a
    ``PrivacyError`` naming ``setting`` and ``because``."""
    first = sent[cids[0]]
    for cid in cids[1:]:
        other = sent[cid]
        if other is first:
            continue
        if other.tensors.keys() != first.tensors.keys() or any(
                not torch.equal(other.tensors[k], first.tensors[k]) for k in first.tensors):
            raise PrivacyError(
                f"{where}: {setting} needs every client of an aggregation to be "
                f"sent the same model, but clients {cids[0]} and {cid} were sent different ones "
                f"(width slices, tiers of architectures): {because}")
    return first


def private_replies(replies: dict[int, Message], sent: dict[int, Message], expected: int,
                    clip: float, noise_multiplier: float, gen: torch.Generator,
                    where: str, counts: Clipped | None = None) -> dict[int, Message]:
    """The replies an algorithm's equal-weight mean turns into DP-FedAvg's aggregate of
    ``replies`` (client id -> reply) to ``sent`` (client id -> what it was sent), for an
    aggregator that sampled ``expected`` clients. Noise is drawn from ``gen``."""
    if not replies:
        return replies
    if expected < len(replies):
        raise ValueError(f"{where}: {len(replies)} replies from {expected} sampled clients")
    cids = list(replies)
    base = same_model(sent, cids, where)
    names = floats(base)
    share = len(replies) / expected
    clipped: dict[int, list[torch.Tensor]] = {}
    for cid in cids:
        tensors = replies[cid].tensors
        extra = [k for k in tensors if k not in base.tensors]
        if extra:
            raise PrivacyError(f"{where}: client {cid}'s reply has {extra}, which it was not "
                               "sent: privacy.level = 'client' measures an update from the "
                               "model sent, so the algorithm cannot be declared "
                               "PrivacySupport(client='mean')")
        missing = [k for k in names if k not in tensors]
        if missing:
            raise PrivacyError(f"{where}: client {cid}'s reply lacks {missing} of the model it "
                               "was sent; the clipped update is over the whole model")
        update = [tensors[k].to(base.tensors[k].dtype) - base.tensors[k] for k in names]
        factor = clip_factor(update, clip)
        if counts is not None:
            counts.replies += 1
            counts.clipped += factor < 1.0
        clipped[cid] = torch._foreach_mul(update, factor * share) if update else []
    std = noise_multiplier * clip / expected
    noise = [torch.randn(base.tensors[k].shape, generator=gen, dtype=torch.float64).mul_(std)
             .to(base.tensors[k].dtype) for k in names]
    out: dict[int, Message] = {}
    for cid in cids:
        values = torch._foreach_add(list(clipped[cid]), noise) if names else []
        private = {k: base.tensors[k] + v for k, v in zip(names, values, strict=True)}
        # the reply's own entries, in its order; what is not a float (a batch counter) is
        # the aggregator's
        out[cid] = Message({k: private.get(k, base.tensors[k]) for k in replies[cid].tensors},
                           {"num_samples": 1})
    return out
