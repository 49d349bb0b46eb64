"""L2SGD (Hanzely, Richtarik, *Federated Learning of a Mixture of Global and Local Models*,
arXiv:2002.05516, 2020): loopless local gradient descent (the paper's L2GD, Algorithm 1)
with mini-batch gradients, on

    min_{x_1..x_n}  1/n sum_i f_i(x_i)  +  lamda * 1/(2n) sum_i ||x_i - x_bar||^2.

Every step flips a coin xi with P(xi = 1) = p:

* xi = 0, a local step on every device, no communication:
    x_i <- x_i - alpha / (n (1 - p)) * grad f_i(x_i; batch);
* xi = 1, an averaging step: the master forms x_bar = 1/n sum_i x_i and every device
    x_i <- x_i - (alpha lamda / (n p)) (x_i - x_bar).

The local step size alpha / (n (1 - p)) is ``train.lr`` (so alpha = n (1 - p) lr, and every
algorithm's local SGD step is the same), which makes the averaging weight
alpha lamda / (n p) = lr * lamda * (1 - p) / p.

Engine rounds are communication rounds: round r is the averaging step whose uploads ended
round r - 1 (its download x_bar), then the run of local steps the coins give before the
next averaging coin (Geometric(p) many, drawn by the server and sent as ``local_steps``),
then that averaging step's upload x_i. So the coin sequence is exactly L2GD's and bytes
cross only in averaging steps. Each client predicts with its own x_i. See
docs/algorithms.md for the defaults and the handling of missing clients.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    Hyperparameters,
    PersonalModelClient,
    PrivacySupport,
    Reporter,
    SearchRange,
    Server,
    ServerContext,
    State,
    Uniform,
    UpdateResult,
    model_from_state,
    model_to_state,
)
from edgepfl.contract.kit import fit
from edgepfl.errors import ConfigError
from edgepfl.federation.aggregate import weighted_average
from edgepfl.federation.messages import Message, MessageError, check_message
from edgepfl.federation.rng import generator
from edgepfl.training.client_data import ClientData

LOCAL_STEPS = "local_steps"


class L2SGDHyperparameters(Hyperparameters):
    # p, the paper's knob: the local steps between averaging steps ((1 - p) / p on average,
    # 1 to 9 here) and, through lamda's default, how far an averaging step pulls
    search_space: ClassVar[dict[str, SearchRange]] = {"p": Uniform(0.1, 0.5)}
    p: float = Field(0.2, gt=0, lt=1, description="probability that a step is an averaging "
                     "(communicating) step; a round averages (1-p)/p local steps (0.2: the "
                     "public L2SGD baseline of FedEM, Marfoq et al. 2021)")
    lamda: float | None = Field(None, ge=0, description="penalty lambda on the clients' spread; "
                                "None: p / (2 lr (1-p)), the averaging step goes half way to "
                                "the mean, the largest the paper's step-size bound allows; "
                                "0: local training")


def averaging_weight(hp: L2SGDHyperparameters, lr: float) -> float:
    """alpha lamda / (n p) of the averaging step, with alpha / (n (1 - p)) = lr."""
    if hp.lamda is None:
        return 0.5
    return lr * hp.lamda * (1 - hp.p) / hp.p


def floating(model: State) -> State:
    """The entries that are averaged (integer buffers such as BatchNorm's batch counter
    stay each client's own)."""
    return {k: v for k, v in model.items() if v.is_floating_point()}


class L2SGDServer(Server, Reporter):
    # x_bar of the latest round that had replies, and that round
    state = ("mean_model", "mean_round")

    def __init__(self, ctx: ServerContext, hp: L2SGDHyperparameters):
        super().__init__(ctx, hp)
        t = ctx.train
        if t.momentum:
            raise ConfigError(f"L2SGD takes plain gradient steps (L2GD, Algorithm 1): "
                              f"train.momentum = {t.momentum} must be 0")
        weight = averaging_weight(hp, t.lr)
        if weight > 1:
            # a weight above 1 throws every model past the mean (and diverges from 2 on)
            raise ConfigError(
                f"L2SGD: algorithm.lamda = {hp.lamda} with train.lr = {t.lr} and "
                f"algorithm.p = {hp.p} gives an averaging step of weight "
                f"lr * lamda * (1-p)/p = {weight:.4g}; valid: lamda <= p / (lr (1-p)) = "
                f"{hp.p / (t.lr * (1 - hp.p)):.4g}")
        self.mean_model: State = {}
        self.mean_round = 0
        self._steps = 0
        self._averaged = False

    def local_steps(self, rnd: int) -> int:
        """Round ``rnd``'s coin flips: the local steps before the first averaging coin."""
        coins = generator(self.ctx.seed, "l2sgd", rnd)
        steps = 0
        while float(torch.rand((), generator=coins)) >= self.hp.p:
            steps += 1
        return steps

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        self._steps = self.local_steps(rnd)
        # x_bar completes the averaging step whose uploads ended the previous round; after a
        # round nobody replied in (or in round 1) there is none to complete
        self._averaged = bool(self.mean_model) and self.mean_round == rnd - 1
        msg = Message(self.mean_model if self._averaged else {}, {LOCAL_STEPS: self._steps})
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        # the paper's x_bar is the plain mean over devices (psi weights them equally)
        self.mean_model = weighted_average([r.tensors for r in replies.values()],
                                           [1.0] * len(replies))
        self.mean_round = rnd

    def check_reply(self, cid: int, reply: Message) -> None:
        # integer buffers stay each client's own, so they never come up
        check_message(f"client {cid}", reply, floating(self.ctx.init_model))

    def round_metrics(self) -> dict[str, float]:
        return {"l2sgd_local_steps": float(self._steps), "l2sgd_averaged": float(self._averaged)}

    def summary_figures(self, metrics: list[dict]) -> dict[str, Any]:
        steps = [r["l2sgd_local_steps"] for r in metrics if "l2sgd_local_steps" in r]
        if not steps:
            return {}
        # every round holds one averaging coin after its local ones
        return {"l2sgd_averaging_share": len(steps) / (len(steps) + sum(steps)),
                "l2sgd_averaging_weight": averaging_weight(self.hp, self.ctx.train.lr)}


class _Steps(ClientData):
    """``steps`` mini-batches from consecutive shuffled epochs of ``data``, which
    ``Trainer.fit`` then takes as one epoch, in that order."""

    def __init__(self, data: ClientData, steps: int, batch_size: int, gen: torch.Generator):
        super().__init__(data.x, data.y, data.idx, data.boxes, data.norm)
        self._taken: list[tuple[torch.Tensor, torch.Tensor]] = []
        while len(self._taken) < steps:
            for batch in data.batches(batch_size, gen):
                self._taken.append(batch)
                if len(self._taken) == steps:
                    break

    def batches(self, batch_size: int, gen: torch.Generator):
        yield from self._taken


class L2SGDClient(PersonalModelClient):
    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        msg.require(LOCAL_STEPS)
        steps = msg.meta[LOCAL_STEPS]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise MessageError(f"L2SGD: {LOCAL_STEPS} = {steps!r}; expected an integer >= 0")
        x = model_from_state(state)
        if msg.tensors:  # the averaging step
            if set(msg.tensors) != set(floating(x)):
                raise MessageError(f"L2SGD: the mean model has {sorted(msg.tensors)}; expected "
                                   f"{sorted(floating(x))}")
            w = averaging_weight(self.hp, self.ctx.train.lr)
            x = {k: v - w * (v - msg.tensors[k]) if k in msg.tensors else v for k, v in x.items()}
        self.trainer.load(x)
        stats: dict[str, float] = {}
        if steps and data.n:
            stats = fit(self, _Steps(data, steps, self.ctx.train.batch_size, gen), gen, epochs=1)
        x = self.trainer.export()
        return UpdateResult(Message(floating(x)), model_to_state(x), stats)


ALGORITHM = Algorithm(
    name="l2sgd",
    summary="L2SGD: loopless local SGD on a mixture of global and local models; each step "
            "is a local step or, with probability p, a communicating averaging step",
    hyperparameters=L2SGDHyperparameters,
    server=L2SGDServer,
    client=L2SGDClient,
    paper="Hanzely, Richtarik, Federated Learning of a Mixture of Global and Local Models, "
          "arXiv:2002.05516, 2020",
    privacy=PrivacySupport(
        refused="client level: its averaging steps come at random, not once per sampled round; "
        "sample level: its steps come from a batch sampler of its own"),
    no_new_clients="each client predicts with its own x_i, and serving a newcomer from the "
                   "mean x_bar is not implemented",
)
