"""FedRoD (Chen and Chao, *On Bridging Generic and Personalized Federated Learning for Image
Classification*, ICLR 2022), its linear personalized head without a hypernetwork.

The model is a shared body and a generic head (the classifier), both trained as FedAvg's
model; beside them each client i keeps a personal head h_i of the classifier's shape that
never leaves it. Each round:

* server: send the model (body and generic head) to the selected clients; the new model
  is the sample-weighted mean of the replies (FedAvg's step);
* client i, for each mini-batch (x, y) of ``train.local_epochs`` epochs, one forward pass
  giving the features z (the classifier's input) and the generic logits g:
    model <- model - eta grad BSM_i(g, y),  BSM_i = cross-entropy of g + log pi_i
             (the balanced softmax: pi_i[c] = n_c / n the client's class prior; with
             ``balanced`` false, plain cross-entropy, FedAvg's step)
    h_i   <- h_i - eta_h grad CE(g.detach() + h_i(z.detach()), y)
  send the model, keep h_i.

The client predicts with g + h_i(z) (the paper's personalized model) and also reports the
generic model alone (``acc_global_*``, the paper's generic accuracy). Both heads are linear
maps of the same features, so g + h_i(z) is the model whose classifier is the sum of the two
heads: that is the personal model evaluated. With ``balanced`` false the model's steps are
FedAvg's bit for bit, whatever h_i does (tested). See docs/algorithms.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.func import functional_call

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.algorithms.fedper import personal_names
from edgepfl.contract.algorithm import (
    Algorithm,
    Choice,
    Client,
    ClientContext,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    SearchRange,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import received_model
from edgepfl.errors import ConfigError
from edgepfl.federation.accounting import counted_once, counter_aside
from edgepfl.federation.messages import Message, MessageError
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import host, to_device
from edgepfl.training.features import classifier_module, tap_features
from edgepfl.training.sgd import fit_stats, sgd_step, sgd_update

PERSONAL_HEAD = "personal_head."
# the class prior of a class the client has no sample of: log(1e-8) = -18.4 makes it a
# practically impossible prediction under the balanced softmax, where log(0) would be -inf
ABSENT_PRIOR = 1e-8


class FedRoDHyperparameters(Hyperparameters):
    # the generic loss and the personal head's rate are the knobs FedRoD adds to FedAvg
    search_space: ClassVar[dict[str, SearchRange]] = {"balanced": Choice((True, False)),
                                                      "head_lr": LogUniform(0.005, 0.5)}
    balanced: bool = Field(True, description="train the body and the generic head with the "
                           "balanced softmax, cross-entropy on the logits plus the log of the "
                           "client's class prior n_c / n (the paper's BSM); false: plain "
                           "cross-entropy, the model trains as FedAvg's")
    head_lr: float | None = Field(None, ge=0, description="step size of the personal head, "
                                  ">= 0; None: train.lr (PFLlib's one rate); 0: the personal "
                                  "head stays at its start")
    personal_init: Literal["generic", "zero"] = Field(
        "generic", description="each personal head's start: a copy of the initial model's "
        "classifier (generic, PFLlib's deepcopy) or zero (the personalized model then starts "
        "as the generic one)")


def log_prior(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """log(n_c / n) of the labels' classes, float32; ``ABSENT_PRIOR`` for an absent class."""
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    return torch.log((counts / counts.sum()).clamp_min(ABSENT_PRIOR)).to(torch.float32)


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor,
                          prior: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy of ``logits + prior`` (the balanced softmax); plain with None."""
    return F.cross_entropy(logits if prior is None else logits + prior, y)


class FedRoDServer(FedAvgServer):
    """FedAvg's server: the body and the generic head; it never holds a personal head."""


class FedRoDClient(Client):
    """The model's step on the balanced softmax and the personal head's on the detached
    features, from one forward pass per mini-batch."""

    def __init__(self, ctx: ClientContext, hp: FedRoDHyperparameters):
        super().__init__(ctx, hp)
        self.classifier = classifier_module(ctx.layers)
        # the head FedPer would keep with personal_layers = 1: the classifier's tensors
        self.head = personal_names(ctx.layers, 1)
        module = self.trainer.model.get_submodule(self.classifier)
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"algorithm.name = fedrod: the model's last layer {self.classifier!r} is a "
                f"{type(module).__name__}; FedRoD's personal head is a second linear "
                "classifier on the features, which needs a model that ends in a linear layer")

    def init_state(self, cid: int, init_model: State) -> State:
        if self.hp.personal_init == "zero":
            return {PERSONAL_HEAD + n: torch.zeros_like(init_model[n]) for n in self.head}
        return {PERSONAL_HEAD + n: init_model[n].clone() for n in self.head}

    def _model(self, msg: Message | None) -> State:
        if msg is None:
            raise MessageError("FedRoD clients predict with the global model and their head, "
                               "but no global model was given")
        return received_model(self, msg, "FedRoD")

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        tr, t, hp = self.trainer, self.ctx.train, self.hp
        tr.load(self._model(msg))
        tr.model.train()
        params = [tr.params[n] for n in tr.param_names]
        head = [to_device(state[PERSONAL_HEAD + n], tr.device).clone() for n in self.head]
        prior = None
        if hp.balanced:
            labels = data.y.index_select(0, data.idx)
            prior = to_device(log_prior(labels, self.ctx.num_classes), tr.device)
        head_lr = t.lr if hp.head_lr is None else hp.head_lr
        classifier = tr.model.get_submodule(self.classifier)
        local = [n.rsplit(".", 1)[1] for n in self.head]  # "weight", "bias"
        bufs = head_bufs = None
        loss_sum = torch.zeros((), device=tr.device)
        seen = steps = 0
        key = object()  # this update's steps: the first of each batch shape is counted
        with counter_aside(), tap_features(tr.model, self.classifier) as tap:
            for _ in range(t.local_epochs):
                for xb, yb in data.batches(t.batch_size, gen):
                    # momentum: a fit's first step makes the buffers, the rest update them
                    with counted_once((key, tuple(xb.shape), bufs is None)):
                        xb, yb = tr.layout(xb), to_device(yb, tr.device)
                        logits = tr.model(xb)
                        features = tap.take().detach()
                        loss = balanced_softmax_loss(logits, yb, prior)
                        for p in params:
                            p.grad = None
                        loss.backward()
                        bufs = sgd_step(params, t.lr, t.momentum, t.weight_decay, bufs)
                        if head_lr:  # the personal head on the step's generic logits
                            weights = [h.detach().requires_grad_() for h in head]
                            out = functional_call(classifier, dict(zip(local, weights,
                                                                       strict=True)),
                                                  (features,))
                            grads = torch.autograd.grad(
                                F.cross_entropy(logits.detach() + out, yb), weights)
                            head_bufs = sgd_update(head, list(grads), head_lr, t.momentum,
                                                   t.weight_decay, head_bufs)
                    loss_sum += loss.detach() * yb.numel()
                    seen += yb.numel()
                    steps += 1
        for p in params:
            p.grad = None
        trained = tr.export()
        tr.forget()
        kept = {PERSONAL_HEAD + n: host(h) for n, h in zip(self.head, head, strict=True)}
        reply = Message(trained, {"num_samples": data.n})
        return UpdateResult(reply, kept, fit_stats(float(loss_sum), seen, steps))

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        # g + h_i(z) = (W_g + W_i) z + (b_g + b_i): the classifier of the two heads' sum
        model = self._model(eval_msg)
        model.update({n: model[n] + state[PERSONAL_HEAD + n] for n in self.head})
        return model

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        """The personalized model, and the generic one (the paper's G-FL accuracy)."""
        return {"": [self.personal_model(state, eval_msg)], "global": [self._model(eval_msg)]}


ALGORITHM = Algorithm(
    name="fedrod",
    summary="FedRoD: body and generic head averaged, trained with the balanced softmax; a "
            "personal linear head per client on the detached features, predicting with the "
            "sum of both heads' logits",
    hyperparameters=FedRoDHyperparameters,
    server=FedRoDServer,
    client=FedRoDClient,
    paper="Chen and Chao, On Bridging Generic and Personalized Federated Learning for Image "
          "Classification, ICLR 2022",
    privacy=PrivacySupport(
        client="mean", refused="sample level: the balanced softmax reads the client's label "
        "counts, and the model's and the personal head's steps are FedRoD's own, outside the "
        "trainer's DP-SGD, so their per-sample contributions are neither clipped nor noised"),
)
