"""FedDyn (Acar, Zhao, Matas Navarro, Mattina, Whatmough and Saligrama, *Federated Learning
Based on Dynamic Regularization*, ICLR 2021), Algorithm 1.

A dynamic regulariser aligns each client's local optimum with the global one: client i
keeps a gradient-correction state grad_i (its last local gradient, zero at the start), the
server a state h (zero at the start). Each round t:

* server: send theta^{t-1} to the selected clients P;
* client i: from theta^{t-1}, minimise by the run's local SGD
    L_i(theta) - <grad_i, theta> + alpha/2 ||theta - theta^{t-1}||^2
  (the two extra terms' gradient, alpha (theta - theta^{t-1}) - grad_i, a gradient hook);
  then  grad_i <- grad_i - alpha (theta_i - theta^{t-1});  send theta_i, keep grad_i;
* server:  h <- h - alpha (1/m) sum_{i in P} (theta_i - theta^{t-1})   (m: all clients),
           theta^t <- mean_{i in P} theta_i - h / alpha.

The mean is sample-weighted by default, as edgepfl's FedAvg (``weighting = uniform``:
Algorithm 1's plain mean over P); h's sum is always Algorithm 1's 1/m over all clients,
so h stays the mean of every client's grad_i. alpha = 0 is defined as FedAvg: no hook,
no correction, and the new model is the mean itself (the server step's -h/alpha would be
0/0), so with alpha = 0 every figure is FedAvg's bit for bit (tested). h and grad_i cover
the parameters; buffers (BatchNorm statistics) are averaged as FedAvg's. Every client
predicts with theta. See docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    SearchRange,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import average_models, proximal_hook, received_model, sgd_request
from edgepfl.errors import ConfigError
from edgepfl.federation.aggregate import weighted_average
from edgepfl.federation.messages import Message, MessageError
from edgepfl.training.client_data import ClientData
from edgepfl.training.pulls import Pull
from edgepfl.training.sgd import FitRequest

GRAD = "grad."  # grad_i in the client's state


class FedDynHyperparameters(Hyperparameters):
    # alpha is the method's one knob (the paper tries 0.1, 0.01, 0.001)
    search_space: ClassVar[dict[str, SearchRange]] = {"alpha": LogUniform(0.001, 0.1)}
    alpha: float = Field(0.01, ge=0, description="alpha of the dynamic regulariser "
                         "-<grad_i, theta> + alpha/2 ||theta - theta_server||^2, >= 0 with "
                         "train.lr * alpha < 2; 0 = FedAvg (no regulariser, no correction)")
    weighting: Literal["samples", "uniform"] = Field(
        "samples", description="how the server averages the clients' models: samples = by "
        "sample count, as edgepfl's FedAvg; uniform = Algorithm 1's plain mean over the "
        "participants; h is always Algorithm 1's 1/m sum over all m clients")


def two_sums(hp: FedDynHyperparameters) -> str | None:
    """h sums every participant's drift with weight 1 beside the model's (by default
    sample-weighted) mean: two sums, where a secure aggregation hands the server one."""
    if not hp.alpha:
        return None
    return (f"algorithm.alpha = {hp.alpha:g}: FedDyn's h sums each participant's drift "
            "unweighted beside the mean of their models, two sums where the server learns "
            "one; set algorithm.alpha = 0 (FedAvg) or privacy.secure_aggregation = false")


@dataclass(frozen=True)
class DynamicRegulariser:
    """The gradient of FedDyn's two local terms, alpha (theta - theta_server) - grad_i,
    added in place: the pull of alpha/2 ||theta - theta_server||^2 and the linear term's
    constant -grad_i."""

    pull: Pull
    correction: Sequence[torch.Tensor]

    def __call__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        self.pull(params, grads)
        torch._foreach_sub_(list(grads), list(self.correction))


class FedDynServer(FedAvgServer):
    """FedAvg's messages and reply check; the server state adds h."""

    state = ("global_model", "h")

    def __init__(self, ctx: ServerContext, hp: FedDynHyperparameters):
        super().__init__(ctx, hp)
        if ctx.train.lr * hp.alpha >= 2:
            # the regulariser alone has curvature alpha: gradient steps on it oscillate
            # for ever or diverge once lr * alpha reaches 2
            raise ConfigError(f"algorithm.alpha = {hp.alpha} with train.lr = {ctx.train.lr}: "
                              f"lr * alpha = {ctx.train.lr * hp.alpha:.4g} makes the local "
                              f"steps diverge; valid: alpha < 2 / lr = {2 / ctx.train.lr:.4g}")
        # h = 1/m sum_i grad_i over all m clients, zero while every grad_i is
        self.h: State = {n: torch.zeros_like(ctx.init_model[n]) for n in ctx.layers.param_names}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        before = self.global_model
        if self.hp.weighting == "samples":  # FedAvg's step, the same call
            mean = average_models(self.ctx, self.index, before, replies)
        else:
            mean = weighted_average([r.tensors for r in replies.values()], [1] * len(replies))
        alpha = self.hp.alpha
        if alpha:
            m = self.ctx.num_clients
            for name, h in self.h.items():
                drift = torch.stack([r.tensors[name] - before[name]
                                     for r in replies.values()]).sum(0)
                self.h[name] = h - (alpha / m) * drift
                mean[name] = mean[name] - self.h[name] / alpha
        # alpha = 0: the mean itself, FedAvg's model
        self.global_model = mean


class FedDynClient(Client):
    batchable = True  # the update is one fit with a gradient hook: run_update

    def init_state(self, cid: int, init_model: State) -> State:
        return {GRAD + n: torch.zeros_like(init_model[n]) for n in self.trainer.param_names}

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        model, alpha = received_model(self, msg, "FedDyn"), self.hp.alpha
        hook = None
        if alpha:  # alpha = 0: FedAvg's fit, with no hook at all
            names = self.trainer.param_names
            pull = proximal_hook(alpha, self.trainer.place([model[n] for n in names]))
            hook = DynamicRegulariser(pull, self.trainer.place([state[GRAD + n] for n in names]))
        return sgd_request(self, model, data, gen, grad_hook=hook)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        alpha = self.hp.alpha
        kept = {}
        for n in self.trainer.param_names:
            grad = state[GRAD + n]
            # grad_i <- grad_i - alpha (theta_i - theta^{t-1})
            kept[GRAD + n] = grad - alpha * (trained[n] - msg.tensors[n]) if alpha else grad.clone()
        return UpdateResult(Message(trained, {"num_samples": data.n}), kept, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError("FedDyn clients predict with the global model, but none was given")
        return received_model(self, eval_msg, "FedDyn")


ALGORITHM = Algorithm(
    name="feddyn",
    summary="FedDyn: FedAvg with a dynamic regulariser (linear gradient correction and "
            "alpha/2 ||theta - theta_server||^2) on each client, server state h",
    hyperparameters=FedDynHyperparameters,
    server=FedDynServer,
    client=FedDynClient,
    paper="Acar, Zhao, Matas Navarro, Mattina, Whatmough and Saligrama, Federated Learning "
          "Based on Dynamic Regularization, ICLR 2021",
    # client level: the reply is the trained model it was sent, and the server reads the
    # replies only through their equal-weight mean under privacy (h's sum is the count
    # times it), so theta and h are post-processing of the noised mean; grad_i never leaves
    privacy=PrivacySupport(client="mean", sample=True, unsummed=two_sums),
)
