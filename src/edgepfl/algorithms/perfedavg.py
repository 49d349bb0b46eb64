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

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from edgepfl.algorithms.base import (
    Algorithm,
    Client,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    SearchRange,
    State,
    UpdateResult,
)
from edgepfl.algorithms.client_data import ClientData
from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError


class PerFedAvgHyperparameters(Hyperparameters):
    # the inner (adaptation) step; the outer one is train.lr unless beta is set
    search_space: ClassVar[dict[str, SearchRange]] = {"alpha": LogUniform(0.001, 0.1)}
    alpha: float = Field(0.01, gt=0, description="inner (adaptation) step size alpha; Per-FedAvg "
                                                 "Sec. 6 uses a small fixed alpha (our choice: 0.01)")
    beta: float | None = Field(None, gt=0, description="outer step size beta (Algorithm 1); "
                                                       "None = train.lr")
    delta: float = Field(0.001, gt=0, description="finite-difference step of the HF Hessian-vector "
                                                  "product (Per-FedAvg Sec. 5, delta)")


class PerFedAvgClient(Client):
    hessian_free = False

    def _grads(self, params, x, y) -> list[torch.Tensor]:
        trainer = self.trainer
        loss = F.cross_entropy(trainer.model(trainer.layout(x)), y.to(trainer.device))
        return list(torch.autograd.grad(loss, params, allow_unused=True))

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        hp, t = self.hp, self.ctx.train
        beta = hp.beta if hp.beta is not None else t.lr
        if t.momentum or t.weight_decay:
            # Algorithm 1 is plain SGD on the MAML objective; quietly dropping them would
            # make a run differ from its config
            raise ConfigError(f"Per-FedAvg takes plain SGD steps (Algorithm 1): "
                              f"train.momentum={t.momentum} and train.weight_decay="
                              f"{t.weight_decay} must be 0")
        self.trainer.load(msg.tensors)
        model = self.trainer.model
        model.train()
        params = [self.trainer.params[n] for n in self.trainer.param_names]
        need = 3 if self.hessian_free else 2
        loss_sum, seen, steps = 0.0, 0, 0
        for _ in range(t.local_epochs if data.n else 0):
            # an epoch is half as many steps as the client has batches (FO's D and D' cover
            # the data once), at least one, so that a client with fewer samples than two
            # batches still trains; HF takes as many steps as FO (the paper compares them at
            # equal tau) and draws its D'' from further shuffles of the data
            batches = list(data.batches(t.batch_size, gen))
            n_steps = max(1, len(batches) // 2)
            while len(batches) < need * n_steps:
                batches += list(data.batches(t.batch_size, gen))
            for k in range(0, need * n_steps, need):
                (x1, y1), (x2, y2) = batches[k], batches[k + 1]
                w = [p.detach().clone() for p in params]
                g1 = self._grads(params, x1, y1)
                with torch.no_grad():
                    for p, g in zip(params, g1, strict=True):
                        if g is not None:
                            p.sub_(hp.alpha * g)
                out = model(self.trainer.layout(x2))
                loss2 = F.cross_entropy(out, y2.to(self.trainer.device))
                g2 = [g if g is not None else torch.zeros_like(p) for p, g in
                      zip(params, torch.autograd.grad(loss2, params, allow_unused=True), strict=True)]
                with torch.no_grad():
                    for p, w0 in zip(params, w, strict=True):
                        p.copy_(w0)
                step = g2
                if self.hessian_free:
                    x3, y3 = batches[k + 2]
                    hv = self._hvp(params, w, g2, x3, y3)
                    step = [g - hp.alpha * h for g, h in zip(g2, hv, strict=True)]
                with torch.no_grad():
                    for p, s in zip(params, step, strict=True):
                        p.sub_(beta * s)
                loss_sum += float(loss2.detach()) * y2.numel()
                seen += y2.numel()
                steps += 1
        adapt = self._adapt_batch(data, gen)
        reply = Message(self.trainer.export(), {"num_samples": data.n})
        stats = {"train_loss": loss_sum / max(seen, 1), "steps": float(steps)}
        return UpdateResult(reply, adapt, stats)

    def _hvp(self, params, w, v, x, y) -> list[torch.Tensor]:
        """Finite-difference Hessian-vector product at w along v (Per-FedAvg's HF variant)."""
        d = self.hp.delta
        out = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for p, w0, vi in zip(params, w, v, strict=True):
                    p.copy_(w0 + sign * d * vi)
            out.append([g if g is not None else torch.zeros_like(p)
                        for p, g in zip(params, self._grads(params, x, y), strict=True)])
        with torch.no_grad():
            for p, w0 in zip(params, w, strict=True):
                p.copy_(w0)
        return [(a - b) / (2 * d) for a, b in zip(out[0], out[1], strict=True)]

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

ALGORITHMS = (
    Algorithm(name="perfedavg",
              summary="Per-FedAvg (FO): first-order MAML local steps, FedAvg server, one "
                      "adaptation step before evaluation",
              hyperparameters=PerFedAvgHyperparameters, server=FedAvgServer,
              client=PerFedAvgClient, paper=_PAPER,
              privacy=PrivacySupport(
                  client="mean", refused="sample level: its meta-gradient steps train "
                  "outside the engine's DP-SGD trainer")),
    Algorithm(name="perfedavg_hf",
              summary="Per-FedAvg (HF): Hessian-free MAML local steps (finite-difference "
                      "Hessian-vector product), one adaptation step before evaluation",
              hyperparameters=PerFedAvgHyperparameters, server=FedAvgServer,
              client=PerFedAvgHFClient, paper=_PAPER,
              privacy=PrivacySupport(
                  client="mean", refused="sample level: its meta-gradient steps train "
                  "outside the engine's DP-SGD trainer")),
)
