"""FedBABU (Oh et al., ICLR 2022): federate the body only, with the head frozen at its
random initialisation; personalize by fine-tuning.

Training a shared head on non-IID clients pulls its class vectors towards each client's
labels and degrades the shared representation; freezing the head at one common random
initialisation during federated training makes the body learn features for a fixed,
client-independent classifier. Each client then fine-tunes the whole network on its own
data for ``finetune_epochs`` and predicts with that personal model.

Federated rounds train the body alone (a ``trainable`` subset). The fine-tuning is the
paper's test-time protocol: at each evaluation every client fine-tunes the current global
body with the common head (``predictive``, which gets the client's own training data), so
the personal model is always that of the latest global body, and fine-tuning is
evaluation work, not a cost of the rounds.
"""

from __future__ import annotations

import torch
from pydantic import Field

from edgepfl.algorithms.fedavg import FedAvgServer, finetuned
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    PrivacySupport,
    ServerContext,
    State,
    UpdateResult,
    fine_tuned,
)
from edgepfl.federation.messages import Message, MessageError
from edgepfl.models.layers import LayerSpec
from edgepfl.training.client_data import ClientData


class FedBABUHyperparameters(Hyperparameters):
    finetune_epochs: int = Field(
        5, ge=0, description="epochs of whole-model fine-tuning for the personal model "
        "(FedBABU paper: tau = 5 in its main personalization results)")


def head_names(layers: LayerSpec) -> list[str]:
    """The head is the last layer (the classifier), as in the paper."""
    return layers.params_of(len(layers) - 1)


class FedBABUServer(FedAvgServer):
    """FedAvg over the body; the head is never sent, so it is not part of server state.
    A client is evaluated from the global body (``eval_message``, FedAvg's)."""

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        head = set(head_names(ctx.layers))
        self.global_model = {k: v for k, v in self.global_model.items() if k not in head}


class FedBABUClient(Client):
    def __init__(self, ctx: ClientContext, hp):
        super().__init__(ctx, hp)
        self.head = head_names(ctx.layers)
        self.body_params = [n for n in self.trainer.param_names if n not in set(self.head)]
        self.body_names = [n for n in self.trainer.state_names if n not in set(self.head)]

    def init_state(self, cid: int, init_model: State) -> State:
        # the head every client shares: the model's random initialisation, never trained
        # during federated rounds
        return {f"head.{n}": init_model[n].clone() for n in self.head}

    def _global(self, msg: Message, state: State) -> State:
        missing = set(self.body_names) - set(msg.tensors)
        if missing:
            raise MessageError(f"FedBABU body lacks {sorted(missing)}")
        model = {n: msg.tensors[n] for n in self.body_names}
        model.update({n: state[f"head.{n}"] for n in self.head})
        return model

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        t = self.ctx.train
        # federated training: the body only, the head stays at its initialisation
        self.trainer.load(self._global(msg, state))
        stats = self.trainer.fit(data, t.local_epochs, t.batch_size, t.lr, gen,
                                 momentum=t.momentum, weight_decay=t.weight_decay,
                                 trainable=self.body_params)
        reply = Message(self.trainer.export(self.body_names), {"num_samples": data.n})
        return UpdateResult(reply, state, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        """The global body with the common head: the model fine-tuning starts from."""
        if eval_msg is None:
            raise MessageError("FedBABU clients start from the global body, but none was given")
        return self._global(eval_msg, state)

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        start = self.personal_model(state, eval_msg)
        if not self.hp.finetune_epochs:
            return {"": [start]}
        # personalization: the whole network, body and head, fine-tuned on the client's data
        return {"": [finetuned(self, start, data, self.hp.finetune_epochs, cid,
                               "fedbabu-finetune")]}

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """A newcomer is personalized as every client is, the whole network fine-tuned,
        for ``epochs`` (``eval.new_client_epochs`` in place of ``finetune_epochs``)."""
        return [fine_tuned(self, self.personal_model(state, msg), data, epochs, gen)]


def finetune_unaccounted(hp: FedBABUHyperparameters) -> str | None:
    """The test-time fine-tuning trains on each client's data outside the accounting."""
    if not hp.finetune_epochs:
        return None
    return (f"algorithm.finetune_epochs = {hp.finetune_epochs}: FedBABU's test-time "
            "fine-tuning trains on each client's data outside the accounting; set "
            "algorithm.finetune_epochs = 0 (the global body with the common head)")


ALGORITHM = Algorithm(
    name="fedbabu",
    summary="FedBABU: body averaged with the head frozen at random init; per-client fine-tuning",
    hyperparameters=FedBABUHyperparameters,
    server=FedBABUServer,
    client=FedBABUClient,
    paper="Oh, Kim and Yun, FedBABU: Toward Enhanced Representation for Federated Image "
          "Classification, ICLR 2022",
    privacy=PrivacySupport(client="mean", sample=True, unaccounted=finetune_unaccounted),
)
