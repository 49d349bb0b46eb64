"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma and Guan, *FedALA: Adaptive Local Aggregation for
Personalized Federated Learning*, AAAI 2023), Algorithm 1 as PFLlib's ALA module runs it.

FedAvg's server; before its local training each client i starts, instead of from the
received global model Theta, from its adaptive local aggregation with its own previous
local model theta_i:

    theta_hat_i = theta_i + (Theta - theta_i) * W_i     on the top ``layer_idx`` layers,
    theta_hat_i = Theta                                  on the layers below them,

W_i element-wise weights in [0, 1] (one per entry of the top layers, starting at 1) that
the client learns on a random ``rand_percent`` share of its data with the lower layers
frozen:  W_i <- clip_[0,1]( W_i - eta * grad_theta_hat L(theta_hat_i) * (Theta - theta_i) ),
one step per mini-batch; in the client's first aggregation until the loss settles (the
standard deviation of the last ``num_pre_loss`` epochs' losses under ``threshold``, at most
``start_epochs`` epochs), afterwards one epoch. Then ``train.local_epochs`` of SGD from
theta_hat_i; the client sends the trained model (FedAvg's reply) and keeps its top layers
(theta_i) and W_i.

A "layer" is one of ``LayerSpec``'s: a module with parameters, weight and bias together
(PFLlib counts parameter tensors: its default layer_idx = 2 is our 1, the classifier). The
aggregation is computed as Theta + (theta_i - Theta) * (1 - W_i), so W_i = 1 gives Theta
exactly: with ``eta = 0`` W_i never leaves 1 and every figure is FedAvg's bit for bit
(tested). A client that has not trained yet has no theta_i and starts from Theta (PFLlib's
"ALA deactivated" first round). A client predicts with its aggregation of the latest global
model under the W_i it holds. See docs/algorithms.md.
"""

from __future__ import annotations

import statistics
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    IntRange,
    LogUniform,
    PrivacySupport,
    SearchRange,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import received_model, sgd_request
from edgepfl.errors import ConfigError
from edgepfl.federation.accounting import counted_once, counter_aside
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.rng import generator
from edgepfl.models.layers import LayerSpec
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import host, to_device
from edgepfl.training.sgd import FitRequest

WEIGHTS = "ala_w."  # W_i, of the top layers' shapes, 1 until first learned
# The phases are entries that appear in a client's state, not values that flip, so that
# each has a work signature of its own and the engine's FLOP cache never reuses one
# phase's count for another (FedMD's TRANSFERRED): theta_i is present once the client
# trained (before: no aggregation), STARTED once it ran the start phase (after: one epoch)
LOCAL = "local."  # theta_i: the client's latest local model, top layers
STARTED = "fedala.started"


class FedALAHyperparameters(Hyperparameters):
    # the paper's sensitivity studies: eta, the data share s and the layers p
    search_space: ClassVar[dict[str, SearchRange]] = {"eta": LogUniform(0.1, 10.0),
                                                      "rand_percent": IntRange(5, 100),
                                                      "layer_idx": IntRange(1, 2)}
    eta: float = Field(1.0, ge=0, description="step size of the aggregation weights W's "
                       "gradient steps, >= 0 (the paper and PFLlib: 1.0); 0: W stays 1, "
                       "every client starts from the global model (FedAvg)")
    rand_percent: int = Field(80, ge=1, le=100, description="share s in percent of the "
                              "client's training samples, drawn at random each round, that W "
                              "is learned on (the paper and PFLlib: 80)")
    layer_idx: int = Field(1, ge=1, description="top layers p adaptively aggregated: the "
                           "last layer_idx parameterised layers as LayerSpec counts them "
                           "(weight and bias together); 1 = the classifier (PFLlib's "
                           "layer_idx = 2, which counts tensors); the layers below take "
                           "the global model as is")
    threshold: float = Field(0.1, gt=0, description="the start phase ends when the standard "
                             "deviation of the last num_pre_loss epochs' losses is below this "
                             "(PFLlib: 0.1)")
    num_pre_loss: int = Field(10, ge=2, description="epochs whose losses the start phase's "
                              "stopping rule looks at (PFLlib: 10)")
    start_epochs: int = Field(100, ge=1, description="at most this many epochs of W's "
                              "training in the start phase (PFLlib: no bound)")


def top_names(layers: LayerSpec, count: int) -> list[str]:
    """Parameters of the last ``count`` layers, refused beyond the model's layers."""
    total = len(layers)
    if not 1 <= count <= total:
        raise ConfigError(f"algorithm.layer_idx = {count}: the model has {total} layers "
                          f"({', '.join(layers.names)}); valid: 1 to {total}")
    return layers.params_of(list(range(total - count, total)))


def aggregated(glob: State, local: State, weights: State) -> State:
    """theta + (Theta - theta) * W as Theta + (theta - Theta) * (1 - W), on ``weights``'
    entries (W = 1 gives Theta exactly); every other entry is Theta's."""
    out = dict(glob)
    out.update({n: glob[n] + (local[n] - glob[n]) * (1 - w) for n, w in weights.items()})
    return out


class FedALAServer(FedAvgServer):
    """FedAvg's server: the global model, sample-weighted averaging of the replies."""

    def __init__(self, ctx: ServerContext, hp: FedALAHyperparameters):
        super().__init__(ctx, hp)
        top_names(ctx.layers, hp.layer_idx)  # refused here, before any client runs


class FedALAClient(Client):
    batchable = True  # the aggregation, then one plain fit: run_update of the two below

    def __init__(self, ctx: ClientContext, hp: FedALAHyperparameters):
        super().__init__(ctx, hp)
        self.top = top_names(ctx.layers, hp.layer_idx)
        # W_i learned by a fit_request until its finish (the engine may batch fits between)
        self._learned: dict[int, State] = {}

    def init_state(self, cid: int, init_model: State) -> State:
        return {WEIGHTS + n: torch.ones_like(init_model[n]) for n in self.top}

    def _global(self, msg: Message | None) -> State:
        if msg is None:
            raise MessageError("FedALA clients aggregate the global model with their own, but "
                               "no global model was given")
        return received_model(self, msg, "FedALA")

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        glob = self._global(msg)
        weights = {n: state[WEIGHTS + n] for n in self.top}
        if LOCAL + self.top[0] not in state:  # no local model yet: the global model as is
            start = glob
        else:
            local = {n: state[LOCAL + n] for n in self.top}
            weights = self.learn_weights(glob, local, weights, data, gen, STARTED not in state)
            start = aggregated(glob, local, weights)
        self._learned[cid] = weights
        return sgd_request(self, start, data, gen)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        weights = self._learned.pop(cid)
        kept = {LOCAL + n: trained[n] for n in self.top}
        kept.update({WEIGHTS + n: w for n, w in weights.items()})
        if LOCAL + self.top[0] in state:  # this update aggregated: the start phase is done
            kept[STARTED] = torch.ones(1)
        return UpdateResult(Message(trained, {"num_samples": data.n}), kept, stats)

    def learn_weights(self, glob: State, local: State, weights: State, data: ClientData,
                      gen: torch.Generator, start_phase: bool) -> State:
        """W_i after ALA's training on a random ``rand_percent`` share of ``data``: one
        epoch, or in the start phase until its losses settle. Its random numbers come from a
        stream of its own derived from ``gen``'s seed, which it leaves untouched."""
        tr, hp = self.trainer, self.hp
        dev = tr.device
        fixed = {n: to_device(glob[n], dev) for n in tr.state_names if n not in local}
        g = [to_device(glob[n], dev) for n in self.top]
        diff = [a - to_device(local[n], dev) for a, n in zip(g, self.top, strict=True)]
        w = [to_device(weights[n], dev).clone() for n in self.top]
        subset, order = self._subset(data, generator(gen.initial_seed(), "fedala"))
        # evaluation mode: BatchNorm normalises with the received statistics and leaves
        # them as they are, dropout draws nothing
        tr.model.eval()
        losses: list[float] = []
        key = object()  # this aggregation's steps: the first of each batch shape is counted
        with counter_aside():
            while True:
                for xb, yb in subset.batches(self.ctx.train.batch_size, order()):
                    with counted_once((key, tuple(xb.shape))):
                        xb, yb = tr.layout(xb), to_device(yb, dev)
                        # theta_hat = Theta - (Theta - theta) * (1 - W)
                        top = [(a - d * (1 - c)).requires_grad_()
                               for a, d, c in zip(g, diff, w, strict=True)]
                        out = functional_call(tr.model, {**fixed, **dict(zip(self.top, top,
                                                                            strict=True))},
                                              (xb,))
                        loss = F.cross_entropy(out, yb)
                        grads = torch.autograd.grad(loss, top)
                        with torch.no_grad():
                            w = [torch.clamp(c - hp.eta * (gr * d), 0, 1)
                                 for c, gr, d in zip(w, grads, diff, strict=True)]
                losses.append(float(loss.detach()))  # the epoch's last batch, as PFLlib records it
                if not start_phase or len(losses) >= hp.start_epochs:
                    break
                recent = losses[-hp.num_pre_loss:]
                if len(losses) > hp.num_pre_loss and statistics.pstdev(recent) < hp.threshold:
                    break
        tr.forget()
        return {n: host(c) for n, c in zip(self.top, w, strict=True)}

    def _subset(self, data: ClientData, gen: torch.Generator):
        """A random ``rand_percent`` share of ``data`` (at least one sample), and a function
        giving the one batch order it is read in every epoch (PFLlib's unshuffled loader)."""
        keep = max(1, data.n * self.hp.rand_percent // 100)
        pos = torch.randperm(data.n, generator=gen)[:keep]
        boxes = None if data.boxes is None else data.boxes[pos]
        subset = ClientData(data.x, data.y, data.idx[pos], boxes, data.norm)
        state = gen.get_state()

        def order() -> torch.Generator:
            again = torch.Generator()
            again.set_state(state)
            return again

        return subset, order

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        glob = self._global(eval_msg)
        if LOCAL + self.top[0] not in state:  # never trained: the global model as is
            return glob
        return aggregated(glob, {n: state[LOCAL + n] for n in self.top},
                          {n: state[WEIGHTS + n] for n in self.top})


ALGORITHM = Algorithm(
    name="fedala",
    summary="FedALA: FedAvg whose clients start each round from an element-wise learned mix "
            "of the global model and their own on the top layer_idx layers",
    hyperparameters=FedALAHyperparameters,
    server=FedALAServer,
    client=FedALAClient,
    paper="Zhang, Hua, Wang, Song, Xue, Ma and Guan, FedALA: Adaptive Local Aggregation for "
          "Personalized Federated Learning, AAAI 2023",
    privacy=PrivacySupport(
        client="mean", refused="sample level: the aggregation weights W are learned by "
        "gradient steps on the client's data outside the trainer's DP-SGD, and they shape the "
        "model the client trains and sends, so their per-sample contributions are neither "
        "clipped nor noised"),
)
