"""FedRep (Collins, Hassani, Mokhtari and Shakkottai, *Exploiting Shared Representations
for Personalized Federated Learning*, ICML 2021), Algorithm 1.

The model is a shared representation (the body, phi) and a head h_i per client. Each
round:

* server: send the body phi^t to the selected clients; phi^{t+1} <- the sample-weighted
  mean of the bodies they send back (FedAvg over the body);
* client i: load phi^t beside its own head h_i;
    1. the head: ``head_epochs`` epochs of SGD on h_i with the body frozen,
    2. the body: ``body_epochs`` epochs of SGD on phi with the new head frozen;
  keep h_i, send phi_i and its sample count.

A client predicts with the latest body and its own head. ``personal_layers`` says what the
head is, counted as ``LayerSpec`` counts layers from the output end (FedPer's setting: 1 =
the classifier, the paper's linear head). With ``head_epochs = 0`` the head never moves
from the initial model's and FedRep is FedBABU's federated training (a test checks it bit
for bit). See docs/algorithms.md.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from edgepfl.algorithms.fedper import (
    PERSONAL,
    FedPerClient,
    FedPerHyperparameters,
    FedPerServer,
)
from edgepfl.contract.algorithm import (
    Algorithm,
    ClientContext,
    IntRange,
    PrivacySupport,
    SearchRange,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import fit
from edgepfl.federation.messages import Message
from edgepfl.training.client_data import ClientData


class FedRepHyperparameters(FedPerHyperparameters):
    # the head's epochs are the method's own knob (the paper's tau_h); the head's size as
    # FedPer's
    search_space: ClassVar[dict[str, SearchRange]] = {"head_epochs": IntRange(1, 10),
                                                      "personal_layers": IntRange(1, 2)}
    personal_layers: int = Field(
        1, ge=1, description="layers of the personal head: the last personal_layers "
        "parameterised layers (LayerSpec's, a BatchNorm module counts as one), >= 1 with at "
        "least one body layer left; 1 = the classifier, the paper's linear head")
    head_epochs: int = Field(
        10, ge=0, description="epochs of head-only training (body frozen) at the start of "
        "each round, >= 0 (the paper: 10; 0 = the head stays at its initialisation, "
        "FedBABU's federated training)")
    body_epochs: int | None = Field(
        None, ge=1, description="epochs of body-only training (head frozen) after the head's, "
        ">= 1; None: train.local_epochs (the paper: 1)")


def total_epochs(train, hp: FedRepHyperparameters) -> int:
    """Passes over its data a client makes each round: the head's and the body's."""
    return hp.head_epochs + (train.local_epochs if hp.body_epochs is None else hp.body_epochs)


class FedRepServer(FedPerServer):
    """FedAvg over the body; the server never holds a head."""


class FedRepClient(FedPerClient):
    """Algorithm 1's client: the head first with the body frozen, then the body with the
    head frozen; the body goes back, the head stays."""

    batchable = False  # two fits on different parameters

    def __init__(self, ctx: ClientContext, hp: FedRepHyperparameters):
        super().__init__(ctx, hp)
        personal = set(self.personal)
        self.head_params = [n for n in self.trainer.param_names if n in personal]
        self.body_params = [n for n in self.trainer.param_names if n not in personal]

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        tr = self.trainer
        tr.load(self.personal_model(state, msg))  # phi^t and h_i
        stats = {"train_loss": 0.0, "steps": 0.0, "samples": 0.0}
        if self.hp.head_epochs:
            head = fit(self, data, gen, epochs=self.hp.head_epochs, trainable=self.head_params)
            stats["steps"] += head["steps"]
        body = fit(self, data, gen, epochs=self.hp.body_epochs, trainable=self.body_params)
        # the loss reported is the body's, the federated part's (FedAvg's figure)
        stats.update(train_loss=body["train_loss"], samples=body["samples"],
                     steps=stats["steps"] + body["steps"])
        trained = tr.export()
        tr.forget()
        reply = Message({n: trained[n] for n in self.base}, {"num_samples": data.n})
        return UpdateResult(reply, {PERSONAL + n: trained[n] for n in self.personal}, stats)


ALGORITHM = Algorithm(
    name="fedrep",
    summary="FedRep: shared body averaged, personal head trained first each round with the "
            "body frozen",
    hyperparameters=FedRepHyperparameters,
    server=FedRepServer,
    client=FedRepClient,
    paper="Collins, Hassani, Mokhtari and Shakkottai, Exploiting Shared Representations for "
          "Personalized Federated Learning, ICML 2021",
    privacy=PrivacySupport(client="mean", sample=True, epochs=total_epochs),
)
