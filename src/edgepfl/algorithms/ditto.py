"""Ditto (Li, Hu, Beirami and Smith, *Ditto: Fair and Robust Federated Learning Through
Personalization*, ICML 2021), Algorithm 1.

A global model w is trained as FedAvg; beside it each client k keeps a personal model v_k
that minimises its own loss regularised towards the global model,

    h_k(v_k; w) = F_k(v_k) + lambda/2 ||v_k - w||^2.

Each round:

* server: send w^t to the selected clients; w^{t+1} <- sample-weighted mean of the replies
  (FedAvg's AGGREGATE);
* client k: w_k^t <- FedAvg's local training from w^t (``train.local_epochs`` epochs,
  UPDATE_GLOBAL); v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t)) for
  ``personal_epochs`` epochs (the paper's s local iterations), the pull towards the model
  it received; send w_k^t, keep v_k.

A client predicts with v_k. The two sub-problems read the same batches in the same order:
the personal training draws from a copy of the round's batch generator taken before the
global training, so lambda = 0 gives every client exactly Local's model while the global
model is exactly FedAvg's (both tested bit for bit). The pull is a gradient hook, so
lambda = 0 adds an exact zero. See docs/algorithms.md.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    ClientContext,
    Hyperparameters,
    LogUniform,
    PersonalModelClient,
    PrivacySupport,
    SearchRange,
    ServerContext,
    State,
    UpdateResult,
    model_from_state,
    model_to_state,
)
from edgepfl.contract.kit import fit, proximal_hook, received_model
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.training.client_data import ClientData


class DittoHyperparameters(Hyperparameters):
    # lambda is the method's one knob (the paper tunes it per data set and shows accuracy,
    # fairness and robustness trade off along it); bounded so that train.lr * lambda < 2
    # at the common rates
    search_space: ClassVar[dict[str, SearchRange]] = {"lamda": LogUniform(0.01, 2.0)}
    lamda: float = Field(0.1, ge=0, description="lambda of the personal objective F_k(v) + "
                         "lambda/2 ||v - w||^2, >= 0 with train.lr * lambda < 2: 0 = each "
                         "personal model trains as Local's, large = personal models stay at "
                         "the received global model")
    personal_epochs: int | None = Field(
        None, ge=1, description="epochs of the personal model's training each round (the "
        "paper's s local iterations), >= 1; None: train.local_epochs, as the global model's")


def personal_epochs(train, hp: DittoHyperparameters) -> int:
    return train.local_epochs if hp.personal_epochs is None else hp.personal_epochs


class DittoServer(FedAvgServer):
    """FedAvg's server: the global model w, sample-weighted averaging of the replies."""

    def __init__(self, ctx: ServerContext, hp: DittoHyperparameters):
        super().__init__(ctx, hp)
        if ctx.train.lr * hp.lamda >= 2:
            # the pull alone has curvature lambda: gradient steps on it oscillate for ever
            # or diverge once lr * lambda reaches 2
            raise ConfigError(f"algorithm.lamda = {hp.lamda} with train.lr = {ctx.train.lr}: "
                              f"lr * lambda = {ctx.train.lr * hp.lamda:.4g} makes the personal "
                              f"steps diverge; valid: lamda < 2 / lr = {2 / ctx.train.lr:.4g}")

    def eval_message(self, cid: int) -> Message | None:
        return None  # a client predicts with its personal model alone

    def new_client_message(self, cid: int) -> Message | None:
        return FedAvgServer.eval_message(self, cid)  # a newcomer starts from the global w


def copy_of(gen: torch.Generator) -> torch.Generator:
    """A generator that will draw what ``gen`` draws next."""
    other = torch.Generator(device=gen.device)
    other.set_state(gen.get_state())
    return other


class DittoClient(PersonalModelClient):
    """Algorithm 1's client: UPDATE_GLOBAL from w^t, then s epochs on h_k(v_k; w^t)."""

    def __init__(self, ctx: ClientContext, hp: DittoHyperparameters):
        super().__init__(ctx, hp)
        self.epochs = personal_epochs(ctx.train, hp)

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        tr = self.trainer
        w = received_model(self, msg, "Ditto")
        personal_gen = copy_of(gen)  # the same batches as the global training
        # w_k^t: FedAvg's local training from the received global model
        tr.load(w)
        stats = fit(self, data, gen)
        reply = Message(tr.export(), {"num_samples": data.n})
        # v_k: its own objective, pulled towards w^t (the model received, not w_k^t)
        tr.load(model_from_state(state))
        anchor = tr.place([w[n] for n in tr.param_names])
        personal = fit(self, data, personal_gen, epochs=self.epochs,
                       grad_hook=proximal_hook(self.hp.lamda, anchor))
        kept = model_to_state(tr.export())
        tr.forget()
        # train_loss is the global model's (FedAvg's figure); steps count both trainings
        return UpdateResult(reply, kept, {**stats, "steps": stats["steps"] + personal["steps"]})

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """A newcomer's personal model v: from the global model w, ``epochs`` on its own
        objective h(v; w), pulled towards w by lambda (Algorithm 1's personal step)."""
        tr = self.trainer
        if msg is None or any(n not in msg.tensors for n in tr.state_names):
            raise MessageError("a new Ditto client adapts the global model, but none was given")
        w = {n: msg.tensors[n] for n in tr.state_names}
        if epochs == 0:
            return [w]
        tr.load(w)
        fit(self, data, gen, epochs=epochs, grad_hook=proximal_hook(
            self.hp.lamda, tr.place([w[n] for n in tr.param_names])))
        v = tr.export()
        tr.forget()
        return [v]


ALGORITHM = Algorithm(
    name="ditto",
    summary="Ditto: FedAvg's global model plus a personal model per client, regularised by "
            "lambda/2 ||v - w||^2 towards the global one",
    hyperparameters=DittoHyperparameters,
    server=DittoServer,
    client=DittoClient,
    paper="Li, Hu, Beirami and Smith, Ditto: Fair and Robust Federated Learning Through "
          "Personalization, ICML 2021",
    privacy=PrivacySupport(client="mean", sample=True,
                           epochs=lambda train, hp: train.local_epochs + personal_epochs(train, hp)),
)
