"""The helpers algorithms share; with the contract in ``contract.algorithm``, what writing one takes.

* Local training with the run's SGD settings (``train.*``): ``fit`` trains the weights
  loaded in the client's trainer; ``sgd_request`` states the same training as a
  ``FitRequest``, for a client whose update is its ``fit_request`` and ``finish``
  (``Client.batchable``). ``proximal_hook`` pulls the weights towards an anchor.
* FedAvg-style replies (a model and its sample count): ``check_model_reply`` checks
  one, ``num_samples`` reads its weight, ``average_models`` averages them.
* The asynchronous hierarchy's edge reports: how stale an edge's model is
  (``STALENESS``, ``staleness``).

The training machinery they call lives in ``trainer`` (``Trainer``: load, ``fit``,
export), ``client_data`` (``ClientData``), ``sgd`` (``FitRequest``, ``sgd_step``),
``pulls``, ``features`` (``tap_features``), ``devices`` (``host``, ``to_device``).
"""

from __future__ import annotations

import torch

from edgepfl.contract.algorithm import Client, ServerContext, State
from edgepfl.federation.aggregate import ParamIndex, weighted_average
from edgepfl.federation.messages import COUNT, Message, MessageError, check_message
from edgepfl.training.client_data import ClientData
from edgepfl.training.pulls import Pull
from edgepfl.training.sgd import FitRequest, GradHook

STALENESS = "staleness"


# -- local training ---------------------------------------------------------------------
def fit(client: Client, data: ClientData, gen: torch.Generator, epochs: int | None = None,
        **hooks) -> dict[str, float]:
    """The run's SGD settings applied to the trainer's loaded weights."""
    t = client.ctx.train
    return client.trainer.fit(data, t.local_epochs if epochs is None else epochs, t.batch_size,
                              t.lr, gen, momentum=t.momentum, weight_decay=t.weight_decay, **hooks)


def sgd_request(client: Client, weights: State, data: ClientData, gen: torch.Generator,
                epochs: int | None = None, grad_hook: GradHook | None = None) -> FitRequest:
    """``fit``'s training from ``weights`` as a ``FitRequest``."""
    t = client.ctx.train
    return FitRequest(weights, data, t.local_epochs if epochs is None else epochs,
                      t.batch_size, t.lr, gen, t.momentum, t.weight_decay, grad_hook)


def received_model(client: Client, msg: Message, method: str) -> State:
    """The whole model (every parameter and buffer of the client's skeleton) from the
    server's message; a message that lacks an entry is refused naming them."""
    names = client.trainer.state_names
    missing = [n for n in names if n not in msg.tensors]
    if missing:
        raise MessageError(f"{method} global model lacks {missing}")
    return {n: msg.tensors[n] for n in names}


def proximal_hook(mu: float, anchor: list[torch.Tensor]) -> Pull:
    """Gradient of mu/2 ||w - anchor||^2 added in place."""
    return Pull(mu, anchor)


# -- FedAvg-style replies ---------------------------------------------------------------
def num_samples(cid: int, reply: Message) -> int:
    """A reply's sample count, checked (it weights the client's model in every average)."""
    reply.require("num_samples")
    n = reply.meta["num_samples"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise MessageError(f"client {cid} sent num_samples = {n!r}; expected an integer >= 0")
    return n


def average_models(ctx: ServerContext, index: ParamIndex | None, previous: State,
                   replies: dict[int, Message]) -> State:
    """FedAvg's step: the sample-weighted mean of the replies' models (checked by
    ``check_model_reply``), each parameter over the clients that hold it; ``previous``
    when no reply carries weight."""
    weights = {cid: num_samples(cid, reply) for cid, reply in replies.items()}
    if not replies or sum(weights.values()) == 0:
        return previous
    if index is None:  # one architecture: every client holds every parameter
        return weighted_average([r.tensors for r in replies.values()], list(weights.values()))
    return index.average_over_holders({c: r.tensors for c, r in replies.items()}, weights,
                                      ctx.arch_of, previous)


def check_model_reply(cid: int, reply: Message, model: State) -> None:
    """A FedAvg-style reply: exactly the tensors of ``model`` and the sample count."""
    check_message(f"client {cid}", reply, model, {"num_samples": COUNT})


# -- the asynchronous hierarchy ---------------------------------------------------------
def staleness(edge: int, report: Message) -> int:
    """Cloud periods since the edge's model was last refreshed by its clients (0 if absent)."""
    s = report.meta.get(STALENESS, 0)
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        raise MessageError(f"edge {edge} sent {STALENESS} = {s!r}; expected an integer >= 0")
    return s
