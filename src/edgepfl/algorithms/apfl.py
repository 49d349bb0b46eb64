"""APFL (Deng, Kamani and Mahdavi, *Adaptive Personalized Federated Learning*,
arXiv:2003.13461, 2020), Algorithm 1 with the adaptive mixing weight of its Section 3.

Each client i keeps a personal model v_i and a mixing weight alpha_i in [0, 1]; it predicts
with the mixed model  v_bar_i = alpha_i v_i + (1 - alpha_i) w.  The global model w is
trained as FedAvg. Each round:

* server: send w to the selected clients; w <- the sample-weighted mean of the replies
  (FedAvg's step, the paper's synchronisation every tau local steps);
* client i, for each mini-batch xi of ``train.local_epochs`` epochs, all gradients at the
  iterates before the step:
    w_i     <- w_i - eta grad f_i(w_i; xi)                                  (FedAvg's step)
    v_i     <- v_i - eta alpha_i grad f_i(v_bar_i; xi)        (grad of f_i(v_bar) in v_i)
    alpha_i <- clip_[0,1]( alpha_i - eta_alpha <v_i - w_i, grad f_i(v_bar_i; xi)> )
  (the last only when ``alpha_learned``); send w_i, keep v_i and alpha_i.

The client predicts with alpha_i v_i + (1 - alpha_i) w, w the latest global model (the
paper's output, v_bar after synchronisation). w's steps are those of FedAvg's fit, so
with alpha = 0 fixed every figure is FedAvg's bit for bit (tested). BatchNorm running
statistics: v_i keeps its own, updated by v_bar's forward passes, and the mixed model mixes
them as it mixes weights (integer counters are w's). See docs/algorithms.md.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    SearchRange,
    State,
    Uniform,
    UpdateResult,
    fine_tuned,
)
from edgepfl.contract.kit import received_model
from edgepfl.federation.accounting import counted_once, counter_aside
from edgepfl.federation.messages import Message, MessageError
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import host, to_device
from edgepfl.training.sgd import fit_stats, sgd_step, sgd_update

PERSONAL = "personal."
ALPHA = "alpha"


class APFLHyperparameters(Hyperparameters):
    # the initial mix and, when learned, alpha's step size: the two knobs APFL adds
    search_space: ClassVar[dict[str, SearchRange]] = {"alpha": Uniform(0.1, 0.9),
                                                      "alpha_lr": LogUniform(0.001, 0.1)}
    alpha: float = Field(0.25, ge=0, le=1, description="mixing weight alpha in [0, 1] of the "
                         "personal model in alpha v + (1 - alpha) w: every client's initial "
                         "value, or its value throughout when alpha_learned is false (0 = "
                         "FedAvg, 1 = the personal model alone)")
    alpha_learned: bool = Field(True, description="learn each client's alpha by gradient "
                                "steps on its own data (the paper's adaptive APFL), clipped to "
                                "[0, 1]; false: alpha stays fixed")
    alpha_lr: float | None = Field(None, gt=0, description="step size of alpha's gradient "
                                   "steps, > 0; None: train.lr (the paper's one eta)")


class APFLServer(FedAvgServer):
    """FedAvg's server; ``eval_message`` (the global model w) is what clients mix with."""


def mixed(alpha: float, v: State, w: State) -> State:
    """alpha v + (1 - alpha) w over the floating-point entries; integer buffers are w's."""
    return {n: alpha * v[n] + (1 - alpha) * t if t.is_floating_point() else t
            for n, t in w.items()}


class APFLClient(Client):
    def init_state(self, cid: int, init_model: State) -> State:
        # v_i starts at the one initial model, alpha_i at the configured mix
        state = {PERSONAL + n: init_model[n].clone() for n in self.trainer.state_names}
        state[ALPHA] = torch.tensor(float(self.hp.alpha))
        return state

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        tr, t, hp = self.trainer, self.ctx.train, self.hp
        tr.load(received_model(self, msg, "APFL"))
        model, names = tr.model, tr.param_names
        model.train()
        w = [tr.params[n] for n in names]
        v = [to_device(state[PERSONAL + n], tr.device).clone() for n in names]
        v_buffers = {n: to_device(state[PERSONAL + n], tr.device).clone() for n in tr.buffers}
        alpha = float(state[ALPHA])
        alpha_lr = t.lr if hp.alpha_lr is None else hp.alpha_lr
        w_bufs = v_bufs = None
        loss_sum = torch.zeros((), device=tr.device)
        seen = steps = 0
        key = object()  # this update's steps: the first of each batch shape is counted
        with counter_aside():
            for _ in range(t.local_epochs):
                for xb, yb in data.batches(t.batch_size, gen):
                    with counted_once((key, tuple(xb.shape))):
                        xb, yb = tr.layout(xb), to_device(yb, tr.device)
                        # w: FedAvg's step, exactly as Trainer.fit takes it
                        loss = F.cross_entropy(model(xb), yb)
                        for p in w:
                            p.grad = None
                        loss.backward()
                        # v_bar = alpha v + (1 - alpha) w at the iterates before the step
                        v_bar = [(alpha * a + (1 - alpha) * b.detach()).requires_grad_()
                                 for a, b in zip(v, w, strict=True)]
                        mixed_loss = F.cross_entropy(
                            functional_call(model, (dict(zip(names, v_bar, strict=True)),
                                                    v_buffers), (xb,)), yb)
                        g = torch.autograd.grad(mixed_loss, v_bar)
                        with torch.no_grad():
                            grad_alpha = sum(((a - b) * c).sum()
                                             for a, b, c in zip(v, w, g, strict=True))
                        w_bufs = sgd_step(w, t.lr, t.momentum, t.weight_decay, w_bufs)
                        v_bufs = sgd_update(v, [alpha * c for c in g], t.lr, t.momentum,
                                            t.weight_decay, v_bufs)
                        if hp.alpha_learned:
                            alpha = min(1.0, max(0.0, alpha - alpha_lr * float(grad_alpha)))
                    loss_sum += loss.detach() * yb.numel()
                    seen += yb.numel()
                    steps += 1
        for p in w:
            p.grad = None
        trained = tr.export()
        tr.forget()
        kept = {PERSONAL + n: host(a) for n, a in zip(names, v, strict=True)}
        kept.update({PERSONAL + n: host(b) for n, b in v_buffers.items()})
        kept[ALPHA] = torch.tensor(alpha)
        reply = Message(trained, {"num_samples": data.n})
        return UpdateResult(reply, kept, fit_stats(float(loss_sum), seen, steps))

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError("APFL clients mix their personal model with the global one, "
                               "but none was given")
        w = {n: eval_msg.tensors[n] for n in self.trainer.state_names}
        v = {n: state[PERSONAL + n] for n in self.trainer.state_names}
        return mixed(float(state[ALPHA]), v, w)

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """A newcomer has no personal model v to mix: the global model w, fine-tuned."""
        if msg is None:
            raise MessageError("a new APFL client adapts the global model, but none was given")
        w = {n: msg.tensors[n] for n in self.trainer.state_names}
        return [fine_tuned(self, w, data, epochs, gen)]


ALGORITHM = Algorithm(
    name="apfl",
    summary="APFL: FedAvg's global model mixed with a personal model, alpha v + (1 - alpha) w, "
            "alpha learned per client",
    hyperparameters=APFLHyperparameters,
    server=APFLServer,
    client=APFLClient,
    paper="Deng, Kamani and Mahdavi, Adaptive Personalized Federated Learning, "
          "arXiv:2003.13461, 2020",
    privacy=PrivacySupport(
        client="mean", refused="sample level: the personal model's and alpha's gradients are "
        "taken on the mixed model in APFL's own step, outside the trainer's DP-SGD, so their "
        "per-sample contributions are neither clipped nor noised"),
)
