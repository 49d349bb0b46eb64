"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): FedAvg on the MAML objective
F_i(w) = f_i(w - alpha grad f_i(w)), evaluated after one local adaptation step.

Local step (Algorithm 1): on a batch D, w~ = w - alpha grad f(w; D); on a batch D',
* first-order (``perfedavg``, FO): w <- w - beta grad f(w~; D');
* Hessian-free (``perfedavg_hf``, HF): w <- w - beta (I - alpha H(w; D'')) grad f(w~; D'),
  with the Hessian-vector product H v = [grad f(w + delta v) - grad f(w - delta v)] / (2 delta)
  on a third batch D''.
The server averages as FedAvg. A client predicts with the global model after one SGD step
of size alpha on a batch of its own training data ("evaluated after one step of local
adaptation"), so each client keeps that batch in its state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import grad, grad_and_value

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    SearchRange,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest, LossFn


class PerFedAvgHyperparameters(Hyperparameters):
    # the inner (adaptation) step; the outer one is train.lr unless beta is set
    search_space: ClassVar[dict[str, SearchRange]] = {"alpha": LogUniform(0.001, 0.1)}
    alpha: float = Field(0.01, gt=0, description="inner (adaptation) step size alpha; Per-FedAvg "
                                                 "Sec. 6 uses a small fixed alpha (our choice: 0.01)")
    beta: float | None = Field(None, gt=0, description="outer step size beta (Algorithm 1); "
                                                       "None = train.lr")
    delta: float = Field(0.001, gt=0, description="finite-difference step of the HF Hessian-vector "
                                                  "product (Per-FedAvg Sec. 5, delta)")


@dataclass(frozen=True)
class MetaStep:
    """Algorithm 1's local step as a pure function of the weights w and its batches: on D,
    w~ = w - alpha grad f(w; D); the step's gradient is grad f(w~; D') (FO), or with HF
    (I - alpha H(w; D'')) grad f(w~; D'), H v by finite differences of size delta. The
    outer step w <- w - beta * gradient is the request's SGD (rate beta). One client's step
    (``Trainer.fit_steps``) and a vmapped step of many (``fit_many``) are this code."""

    alpha: float
    hessian_free: bool
    delta: float

    def __call__(self, loss: LossFn, w: State, x1, y1, x2, y2, x3=None, y3=None):
        g1 = grad(loss)(w, x1, y1)
        adapted = {n: w[n] - self.alpha * g1[n] for n in w}
        g2, loss2 = grad_and_value(loss)(adapted, x2, y2)
        if not self.hessian_free:
            return g2, loss2
        d = self.delta
        plus = grad(loss)({n: w[n] + d * g2[n] for n in w}, x3, y3)
        minus = grad(loss)({n: w[n] - d * g2[n] for n in w}, x3, y3)
        return {n: g2[n] - self.alpha * ((plus[n] - minus[n]) / (2 * d)) for n in w}, loss2


def meta_batches(need: int):
    """A request's groups of ``need`` batches (D, D'[, D'']) with the samples of D' that a
    step counts. An epoch is half as many steps as the client has batches (FO's D and D'
    cover the data once), at least one, so that a client with fewer samples than two
    batches still trains; HF takes as many steps as FO (the paper compares them at equal
    tau) and draws its D'' from further shuffles of the data."""
    def draw(r: FitRequest):
        for _ in range(r.epochs if r.data.n else 0):
            batches = list(r.data.batches(r.batch_size, r.gen))
            n_steps = max(1, len(batches) // 2)
            while len(batches) < need * n_steps:
                batches += list(r.data.batches(r.batch_size, r.gen))
            for k in range(0, need * n_steps, need):
                group = batches[k:k + need]
                yield tuple(t for batch in group for t in batch), int(group[1][1].numel())
    return draw


class PerFedAvgClient(Client):
    hessian_free = False
    batchable: ClassVar[bool] = True

    def __init__(self, ctx: ClientContext, hp: PerFedAvgHyperparameters):
        super().__init__(ctx, hp)
        self._gen: dict[int, torch.Generator] = {}  # a fit's generator, until its finish

    def _grads(self, params, x, y) -> list[torch.Tensor]:
        trainer = self.trainer
        loss = F.cross_entropy(trainer.model(trainer.layout(x)), y.to(trainer.device))
        return list(torch.autograd.grad(loss, params, allow_unused=True))

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        hp, t = self.hp, self.ctx.train
        self._gen[cid] = gen
        return FitRequest(msg.tensors, data, t.local_epochs, t.batch_size,
                          hp.beta if hp.beta is not None else t.lr, gen,
                          step=MetaStep(hp.alpha, self.hessian_free, hp.delta),
                          draw=meta_batches(3 if self.hessian_free else 2))

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        # the evaluation-time batch, drawn after training from the same generator
        adapt = self._adapt_batch(data, self._gen.pop(cid))
        return UpdateResult(Message(trained, {"num_samples": data.n}), adapt, stats)

    def _adapt_batch(self, data: ClientData, gen: torch.Generator) -> State:
        """A fixed-size batch of the client's own data for the evaluation-time step (drawn
        with replacement when the client has fewer samples than a batch).

        Crops (HMPL's Table IV runs Per-FedAvg on them through the SPP model): one forward
        pass takes one shape, so the batch is of one crop size, that of a sample drawn
        uniformly (each size as often as the client holds it), filled from that size's
        samples by the same rule."""
        b = self.ctx.train.batch_size
        if data.n == 0:
            return {}
        pool = torch.arange(data.n)
        if data.boxes is not None:
            size = data.boxes[int(torch.randint(data.n, (1,), generator=gen)), 2:]
            pool = torch.nonzero((data.boxes[:, 2:] == size).all(dim=1)).flatten()
        m = pool.numel()
        pick = torch.randint(m, (b,), generator=gen) if m < b else torch.randperm(
            m, generator=gen)[:b]
        x, y = data.select(pool[pick])
        return {"adapt.x": x, "adapt.y": y}

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError("Per-FedAvg clients adapt the global model, but none was given")
        if "adapt.x" not in state:
            return eval_msg.tensors
        self.trainer.load(eval_msg.tensors)
        self.trainer.model.train()
        params = [self.trainer.params[n] for n in self.trainer.param_names]
        with torch.enable_grad():
            grads = self._grads(params, state["adapt.x"], state["adapt.y"])
        model = dict(eval_msg.tensors)
        for n, g in zip(self.trainer.param_names, grads, strict=True):
            if g is not None:
                model[n] = eval_msg.tensors[n] - self.hp.alpha * g.cpu()
        return model


class PerFedAvgHFClient(PerFedAvgClient):
    hessian_free = True


_PAPER = "Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning with Theoretical Guarantees: " \
         "A Model-Agnostic Meta-Learning Approach, NeurIPS 2020"

def plain_sgd(train) -> None:
    """Algorithm 1 is plain SGD on the MAML objective; quietly dropping momentum or weight
    decay would make a run differ from its config."""
    if train.momentum or train.weight_decay:
        raise ConfigError(f"Per-FedAvg takes plain SGD steps (Algorithm 1): "
                          f"train.momentum={train.momentum} and train.weight_decay="
                          f"{train.weight_decay} must be 0")


class PerFedAvgServer(FedAvgServer):
    """FedAvg's server, refusing at set-up what the clients cannot run."""

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        plain_sgd(ctx.train)


ALGORITHMS = (
    Algorithm(name="perfedavg",
              summary="Per-FedAvg (FO): first-order MAML local steps, FedAvg server, one "
                      "adaptation step before evaluation",
              hyperparameters=PerFedAvgHyperparameters, server=PerFedAvgServer,
              client=PerFedAvgClient, paper=_PAPER,
              privacy=PrivacySupport(
                  client="mean", refused="sample level: its meta-gradient steps train "
                  "outside the engine's DP-SGD trainer")),
    Algorithm(name="perfedavg_hf",
              summary="Per-FedAvg (HF): Hessian-free MAML local steps (finite-difference "
                      "Hessian-vector product), one adaptation step before evaluation",
              hyperparameters=PerFedAvgHyperparameters, server=PerFedAvgServer,
              client=PerFedAvgHFClient, paper=_PAPER,
              privacy=PrivacySupport(
                  client="mean", refused="sample level: its meta-gradient steps train "
                  "outside the engine's DP-SGD trainer")),
)
