"""FedProto (Tan et al., AAAI 2022): federated prototype learning.

Clients never share model weights. Each client uploads the mean feature vector
(prototype) of each class it holds; the server averages them into global prototypes and
sends those back; a client's local loss adds ``lamda * MSE(f(x), C_y)``, pulling the
features of a sample towards the global prototype of its class. As in the paper, a
client classifies by the nearest global prototype in feature space.

Nearest-prototype classification ``argmin_c ||f(x) - C_c||^2 = argmax_c 2 C_c.f(x) - ||C_c||^2``
is a linear layer on the features, so the personal model handed to the engine's
evaluation is the client's feature extractor with its classifier replaced by
``W = 2 C, b = -||C||^2`` (classes without a global prototype get a bias that can never
win). The engine's shared evaluation then measures exactly the paper's inference rule.
"""

from __future__ import annotations

from typing import ClassVar, Literal, cast

import torch
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    ClientContext,
    Hyperparameters,
    LogUniform,
    PersonalModelClient,
    PrivacySupport,
    SearchRange,
    Server,
    ServerContext,
    State,
    UpdateResult,
    model_from_state,
    model_to_state,
)
from edgepfl.contract.kit import fit
from edgepfl.federation.messages import (
    Message,
    MessageError,
    check_entries,
    check_meta,
    ints,
    like,
)
from edgepfl.models.layers import LayerSpec
from edgepfl.training.client_data import ClientData
from edgepfl.training.features import classifier_module, tap_features

ABSENT = -1e9  # logit bias of a class without a global prototype: never the nearest


class FedProtoHyperparameters(Hyperparameters):
    # the weight of the prototype regularizer, the method's one trade-off
    search_space: ClassVar[dict[str, SearchRange]] = {"lamda": LogUniform(0.1, 10.0)}
    lamda: float = Field(1.0, ge=0, description="weight of the prototype regularizer "
                         "(FedProto paper and code: 1)")
    predict: Literal["prototypes", "classifier"] = Field(
        "prototypes", description="inference rule: nearest global prototype (FedProto paper) "
        "or the client's own classifier")


def classifier_names(layers: LayerSpec, model: State) -> tuple[str, str]:
    """(weight, bias) of the model's last layer, the classifier on ``model.features``."""
    names = layers.params_of(len(layers) - 1)
    weight = [n for n in names if model[n].dim() == 2]
    bias = [n for n in names if model[n].dim() == 1]
    if len(weight) != 1 or len(bias) != 1:
        raise ValueError(f"FedProto needs a linear last layer with a bias, got {names}")
    return weight[0], bias[0]


def prototype_classifier(protos: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of the linear layer whose argmax is the nearest prototype."""
    weight = torch.where(present[:, None], 2.0 * protos, torch.zeros_like(protos))
    bias = torch.where(present, -(protos * protos).sum(1), torch.full_like(protos[:, 0], ABSENT))
    return weight, bias


def prototype_loss(features: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                   present: torch.Tensor) -> torch.Tensor:
    """MSE between features and their class's global prototype, as FedProto's code computes
    it: mean over batch x feature entries, samples of classes without a prototype count 0."""
    mask = present[y]
    diff = (features - protos[y]) * mask[:, None].to(features.dtype)
    return diff.pow(2).sum() / features.numel()


class FedProtoServer(Server):
    state: ClassVar[tuple[str, ...]] = ("protos", "present")

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        weight, _ = classifier_names(ctx.layers, ctx.init_model)
        classes, dim = ctx.init_model[weight].shape
        self.protos = torch.zeros(classes, dim)
        self.present = torch.zeros(classes, dtype=torch.bool)

    def _message(self) -> Message:
        classes = self.present.nonzero().flatten()
        if classes.numel() == 0:
            return Message()
        return Message({"protos": self.protos[classes].clone()}, {"classes": classes.tolist()})

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        msg = self._message()
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        total = torch.zeros_like(self.protos, dtype=torch.float64)
        counts = torch.zeros(self.protos.shape[0], dtype=torch.float64)
        for reply in replies.values():
            idx = torch.tensor(reply.meta["classes"], dtype=torch.long)
            w = torch.tensor(reply.meta["counts"], dtype=torch.float64)
            total.index_add_(0, idx, reply.tensors["protos"].double() * w[:, None])
            counts.index_add_(0, idx, w)
        seen = counts > 0
        # classes reported this round get the sample-weighted mean of this round's
        # prototypes; the others keep theirs (partial participation)
        self.protos[seen] = (total[seen] / counts[seen, None]).to(self.protos.dtype)
        self.present |= seen

    def check_reply(self, cid: int, reply: Message) -> None:
        """One prototype row per class it names, each class once and with its sample count
        (>= 1: a class is reported because the client holds samples of it)."""
        who, (num_classes, dim) = f"client {cid}", self.protos.shape
        check_meta(who, reply.meta, {"classes": ints(0, num_classes, unique=True),
                                     "counts": ints(1)})
        # check_meta has held both to lists of integers
        classes = cast(list[int], reply.meta["classes"])
        counts = cast(list[int], reply.meta["counts"])
        rows = len(classes)
        if len(counts) != rows:
            raise MessageError(f"{who} sent {len(counts)} counts for {rows} classes")
        check_entries(who, reply.tensors, {"protos": like((rows, dim), self.protos.dtype)},
                      required=True, unknown=False)

    def eval_message(self, cid: int) -> Message | None:
        return self._message()


class FedProtoClient(PersonalModelClient):
    def __init__(self, ctx: ClientContext, hp):
        super().__init__(ctx, hp)
        self.weight, self.bias = classifier_names(ctx.layers, self.trainer.export())
        self.num_classes, self.dim = self.trainer.params[self.weight].shape

    def _global(self, msg: Message | None) -> tuple[torch.Tensor, torch.Tensor]:
        protos = torch.zeros(self.num_classes, self.dim)
        present = torch.zeros(self.num_classes, dtype=torch.bool)
        if msg is not None and not msg.is_empty():
            msg.require("protos", "classes")
            idx = torch.tensor(msg.meta["classes"], dtype=torch.long)
            protos[idx] = msg.tensors["protos"]
            present[idx] = True
        return protos, present

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        protos, present = self._global(msg)
        self.trainer.load(self._own(state))
        lamda = self.hp.lamda

        on_model = self.trainer.place([protos, present])  # where the features are

        with tap_features(self.trainer.model, classifier_module(self.ctx.layers)) as features:
            def loss_hook(model, logits, x, y):
                return lamda * prototype_loss(features.take(), y, *on_model)

            stats = fit(self, data, gen, loss_hook=loss_hook if present.any() else None)
        model = self.trainer.export()
        classes, local, counts = self.local_prototypes(data)
        reply = Message({"protos": local}, {"classes": classes, "counts": counts})
        return UpdateResult(reply, model_to_state(model), stats)

    @torch.no_grad()
    def local_prototypes(self, data: ClientData) -> tuple[list[int], torch.Tensor, list[int]]:
        """Per-class mean features of the trained local model on all local samples (eval mode)."""
        model = self.trainer.model
        model.eval()
        trainer = self.trainer
        sums = torch.zeros(self.num_classes, self.dim, device=trainer.device)
        counts = torch.zeros(self.num_classes, dtype=torch.int64)
        for x, y in data.buckets():  # one per input shape (dataset.aspect_ratios)
            for start in range(0, y.numel(), trainer.eval_batch_size):
                stop = start + trainer.eval_batch_size
                xb, yb = trainer.layout(x[start:stop]), y[start:stop].to(trainer.device)
                sums.index_add_(0, yb, model.features(xb))
            counts += torch.bincount(y, minlength=self.num_classes)
        sums = sums.cpu()
        classes = counts.nonzero().flatten()
        local = sums[classes] / counts[classes, None].to(sums.dtype)
        return classes.tolist(), local, counts[classes].tolist()

    @staticmethod
    def _own(state: State) -> State:
        return model_from_state(state)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        model = self._own(state)
        if self.hp.predict == "classifier":
            return model
        protos, present = self._global(eval_msg)
        if not present.any():
            return model  # no global prototype yet: nothing to compare with
        weight, bias = prototype_classifier(protos, present)
        model[self.weight], model[self.bias] = weight, bias
        return model


ALGORITHM = Algorithm(
    name="fedproto",
    summary="FedProto: class prototypes up and down, prototype regularizer, nearest-prototype inference",
    hyperparameters=FedProtoHyperparameters,
    server=FedProtoServer,
    client=FedProtoClient,
    paper="Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022",
    privacy=PrivacySupport(
        refused="client level: the server averages class prototypes, not model updates; sample "
        "level: prototypes computed from the training data are sent un-noised, and its prototype "
        "loss has no per-sample gradient"),
    no_new_clients="it shares class prototypes, not a model: a stranger would train its "
                   "own from scratch",
)
