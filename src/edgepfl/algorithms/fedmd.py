"""FedMD (Li and Wang, "FedMD: Heterogenous Federated Learning via Model Distillation",
NeurIPS 2019 Workshop on Federated Learning for Data Privacy and Confidentiality,
arXiv:1910.03581): parties of different architectures learn from each other through
their class scores on a public data set, never through weights.

The paper's algorithm, as this module runs it:

* transfer learning: each party trains its model on the public data, then on its private
  data (``public_epochs``, ``private_epochs``);
* then every round
    1. communicate: each party computes its class scores (logits) on a public subset the
       server picked for the round, and uploads them;
    2. aggregate: the server's consensus is their uniform average (the paper's
       ``f~(x) = 1/m sum_k f_k(x)``; the authors' code divides by the number of parties);
    3. distribute: the consensus goes down to the parties;
    4. digest: each party trains its model to approach the consensus on that subset (mean
       absolute error on the logits, as the authors' code compiles it);
    5. revisit: each party trains on its private data for a few epochs.

The engine's round is one configure / update / aggregate exchange, and FedMD needs a
server round trip between communicate and digest, so the two are pipelined: the message
of round r carries the consensus of the last aggregated round with that round's subset
(distribute) and the subset of round r; the client digests, revisits, then communicates
on the new subset, and the server aggregates that into the next consensus. A party's
sequence of steps is exactly the paper's; round 1 is transfer learning and the first
communicate, so its accuracy is the paper's "before collaboration" figure.

The public data set is public: every party loads it itself (``algorithm.public_dataset``,
from the run's data directory), so only the subset's indices and the logits travel.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    ClientContext,
    Hyperparameters,
    PersonalModelClient,
    PrivacySupport,
    Reporter,
    Server,
    ServerContext,
    State,
    UpdateResult,
    model_from_state,
    model_to_state,
)
from edgepfl.contract.kit import fit
from edgepfl.data.datasets import DATASETS, OWN_DATASETS, Dataset, load_dataset, resolve_data_root
from edgepfl.errors import ConfigError
from edgepfl.federation.accounting import counted_once, counter_aside
from edgepfl.federation.messages import Message, MessageError, check_message, like
from edgepfl.federation.rng import derive_seed, generator
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import to_device
from edgepfl.training.sgd import sgd_step

# the data sets a party can load by name alone (the own-data formats read dataset.path)
PUBLIC_SETS = tuple(n for n in DATASETS if n not in OWN_DATASETS)
PAPER_SUBSET = 5000  # public samples per round in the paper (and N_alignment in its code)

# Default public set for a private one: MNIST and Fashion-MNIST stand in for each other
# (the HMPL tables pair them), as do the two 8x8 sets; CIFAR-100's is CIFAR-10 as in the
# paper's second experiment. CIFAR-10 has none: CIFAR-100's 100 labels do not fit a
# 10-way head for the transfer learning on public data.
PUBLIC_FOR = {"mnist": "fmnist", "fmnist": "mnist", "digits": "synthetic",
              "synthetic": "digits", "cifar100": "cifar10"}
# image shape and classes of the built-in sets, to refuse a mismatch before loading any
# private data (the client checks the tensors themselves too)
IMAGES = {"mnist": ((1, 28, 28), 10), "fmnist": ((1, 28, 28), 10),
          "cifar10": ((3, 32, 32), 10), "cifar100": ((3, 32, 32), 100),
          "digits": ((1, 8, 8), 10), "synthetic": ((1, 8, 8), 10)}

# present in a client's state once it did transfer learning: an entry that appears,
# not a value that flips, so the transfer update has a work signature of its own and
# its FLOPs are never reused for the cheaper rounds after it
TRANSFERRED = "fedmd.transferred"


class FedMDHyperparameters(Hyperparameters):
    public_dataset: str | None = Field(
        None, description="public data set every party holds; default: the other of mnist and "
        "fmnist (the HMPL tables' pairing; paper: MNIST public, FEMNIST private), digits <-> "
        "synthetic, cifar10 for cifar100 (paper's CIFAR experiment)")
    public_root: str | None = Field(
        None, description="directory of the public data set; default dataset.root (else "
        "$EDGEPFL_DATA)")
    public_pool: int | None = Field(
        None, ge=1, description="public training samples the parties use (a seeded subset); "
        "default: all of them (paper: MNIST's 60,000)")
    public_size: int | None = Field(
        None, ge=1, description="public samples per round, drawn from the pool by the server "
        "(paper: 5000); default min(5000, public_pool)")
    public_epochs: int = Field(
        1, ge=0, description="transfer learning: epochs on the public pool before a party's "
        "first round (paper: to convergence; authors' code: up to 20 with early stopping)")
    public_batch_size: int = Field(128, ge=1, description="batch size on the public pool "
                                   "(authors' code: 128)")
    private_epochs: int | None = Field(
        None, ge=0, description="transfer learning: epochs on private data after the public "
        "ones (paper: to convergence; code: up to 25 with early stopping); default "
        "train.local_epochs")
    digest_epochs: int = Field(1, ge=0, description="epochs towards the consensus on the "
                               "round's public subset (authors' code: 1)")
    digest_batch_size: int = Field(256, ge=1, description="digest batch size (authors' code: 256)")
    digest_loss: Literal["l1", "mse"] = Field(
        "l1", description="distance to the consensus logits: l1 (mean absolute error, the "
        "authors' code) or mse")
    digest_lr: float | None = Field(None, gt=0, description="digest learning rate; default "
                                    "train.lr")
    revisit_epochs: int | None = Field(
        None, ge=0, description="epochs on private data after each digest (paper: 'a few'; "
        "code: 2 on FEMNIST); default train.local_epochs")


# -- the public data set, which every party may hold ----------------------------------------

_PUBLIC: dict[tuple, Dataset] = {}


def public_dataset(name: str, root: str | None, seed: int, download: bool = False) -> Dataset:
    """The public data set, loaded once per process (the server, the clients of every
    architecture and the config check share it); its seed is the run's, derived, so a
    seeded set (synthetic) is the same for every party and not the private one."""
    key = (name, str(resolve_data_root(root)), seed)
    if key not in _PUBLIC:
        _PUBLIC[key] = load_dataset(name, root, 1.0, derive_seed(seed, "fedmd", "public"),
                                    download)
    return _PUBLIC[key]


def public_pool(size: int, pool: int, seed: int) -> torch.Tensor:
    """Indices into the public training set of the pool every party derives alike."""
    if pool >= size:
        return torch.arange(size)
    return torch.randperm(size, generator=generator(seed, "fedmd", "pool"))[:pool].sort().values


def round_subset(seed: int, rnd: int, pool: int, size: int) -> torch.Tensor:
    """Positions in the pool of round ``rnd``'s public subset, as the server sends them
    (int32: 4 bytes each, enough for any pool)."""
    perm = torch.randperm(pool, generator=generator(seed, "fedmd", "subset", rnd))
    return perm[:size].sort().values.to(torch.int32)


def _settled(hp: FedMDHyperparameters) -> tuple[str, int, int]:
    if hp.public_dataset is None or hp.public_pool is None or hp.public_size is None:
        raise ConfigError("fedmd: public_dataset, public_pool and public_size are filled in "
                          "when the configuration is resolved (engine.parts.resolve)")
    return hp.public_dataset, hp.public_pool, hp.public_size


def _same_images(private: str, private_shape, public: str, public_shape) -> None:
    if tuple(private_shape) != tuple(public_shape):
        shape = "x".join(map(str, public_shape))
        raise ConfigError(
            f"algorithm.public_dataset = {public!r} has {shape} images but dataset.name = "
            f"{private!r} has {'x'.join(map(str, private_shape))}; FedMD's parties score the "
            f"public images with their private models, so both need one image shape "
            f"(mnist and fmnist, or digits and synthetic)")


def complete(cfg, hp: FedMDHyperparameters) -> FedMDHyperparameters:
    """The public data settings made explicit for the resolved config, or a ConfigError."""
    private = cfg.dataset.name.strip().lower()
    name = hp.public_dataset.strip().lower() if hp.public_dataset else PUBLIC_FOR.get(private)
    if name is None:
        raise ConfigError(f"fedmd needs a public data set: set algorithm.public_dataset (there "
                          f"is no default for dataset.name = {private!r}; valid: "
                          f"{', '.join(PUBLIC_SETS)}, with the private images' shape)")
    if name in OWN_DATASETS:
        raise ConfigError(f"algorithm.public_dataset = {name!r} reads dataset.path, which holds "
                          f"the clients' private data; valid public sets: {', '.join(PUBLIC_SETS)}")
    if name not in DATASETS:
        raise ConfigError(f"algorithm.public_dataset = {name!r} is not a known data set; valid: "
                          f"{', '.join(PUBLIC_SETS)}")
    if name == private:
        raise ConfigError(f"algorithm.public_dataset = {name!r} is dataset.name itself: its "
                          f"training set holds the clients' private samples, which cannot be "
                          f"public; choose another data set of the same image shape")
    if private in IMAGES and name in IMAGES:  # refused before anything is loaded
        _same_images(private, IMAGES[private][0], name, IMAGES[name][0])
    root = hp.public_root if hp.public_root is not None else cfg.dataset.root
    public = public_dataset(name, root, cfg.seed, cfg.dataset.download)
    if private in IMAGES:
        _same_images(private, IMAGES[private][0], name, public.input_shape)
        if public.num_classes > IMAGES[private][1]:
            raise ConfigError(
                f"algorithm.public_dataset = {name!r} has {public.num_classes} classes, more "
                f"than the {IMAGES[private][1]} outputs of a {private} model, so transfer "
                f"learning on it is impossible; choose a public set with at most as many")
    available = int(public.y_train.numel())
    pool = available if hp.public_pool is None else hp.public_pool
    if pool > available:
        raise ConfigError(f"algorithm.public_pool = {pool} is more than the {available} "
                          f"training samples of {name}")
    size = min(PAPER_SUBSET, pool) if hp.public_size is None else hp.public_size
    if size > pool:
        raise ConfigError(f"algorithm.public_size = {size} is more than the public pool of "
                          f"{pool} samples (algorithm.public_pool)")
    return FedMDHyperparameters.model_validate(
        {**hp.model_dump(), "public_dataset": name, "public_root": root,
         "public_pool": pool, "public_size": size})


# -- server ------------------------------------------------------------------------------

class FedMDServer(Server, Reporter):
    # the consensus logits and the round whose subset they score (0: none yet); the
    # subset itself is derived from the seed and that round
    state: ClassVar[tuple[str, ...]] = ("consensus", "consensus_round")

    def __init__(self, ctx: ServerContext, hp: FedMDHyperparameters):
        super().__init__(ctx, hp)
        _, self.pool, self.size = _settled(hp)
        # every party's logits: one row per public sample of the round, one column per
        # output of the (last layer of the) model, which all architectures share
        out = ctx.init_model[ctx.layers.params_of(len(ctx.layers) - 1)[0]]
        self.logits = like((self.size, out.shape[0]), out.dtype)
        self.consensus = torch.zeros(0)  # [public_size, classes] once a round is aggregated
        self.consensus_round = 0
        self._parties = 0
        self._agreement = math.nan

    def subset(self, rnd: int) -> torch.Tensor:
        return round_subset(self.ctx.seed, rnd, self.pool, self.size)

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        tensors = {"indices": self.subset(rnd)}
        if self.consensus_round:
            # the subset goes down with the consensus: a party absent in that round never
            # received it
            tensors["consensus"] = self.consensus
            tensors["consensus_indices"] = self.subset(self.consensus_round)
        msg = Message(tensors)
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        logits = [reply.tensors["logits"] for reply in replies.values()]
        self._parties = len(logits)
        if not logits:  # nobody answered: the last consensus stands, with its subset
            self._agreement = math.nan
            return
        stacked = torch.stack(logits).double()
        # uniform over the parties that replied, as the paper's 1/m sum_k
        consensus = stacked.mean(0)
        winners = consensus.argmax(1)
        self._agreement = float((stacked.argmax(2) == winners).double().mean())
        self.consensus = consensus.to(logits[0].dtype)
        self.consensus_round = rnd

    def check_reply(self, cid: int, reply: Message) -> None:
        check_message(f"client {cid}", reply, {"logits": self.logits})  # its logits alone

    def round_metrics(self) -> dict[str, float]:
        # md_agreement: share of (party, public sample) pairs whose top class is the
        # consensus' top class, i.e. how far the parties already agree
        return {"md_parties": float(self._parties), "md_agreement": self._agreement}


# -- client ------------------------------------------------------------------------------

class FedMDClient(PersonalModelClient):
    def __init__(self, ctx: ClientContext, hp: FedMDHyperparameters):
        super().__init__(ctx, hp)
        name, pool, _ = _settled(hp)
        self.public = public_dataset(name, hp.public_root, ctx.seed)
        if self.public.num_classes > ctx.num_classes:
            raise ConfigError(f"algorithm.public_dataset = {name!r} has {self.public.num_classes} "
                              f"classes, more than the model's {ctx.num_classes} outputs")
        if pool > self.public.y_train.numel():
            raise ConfigError(f"algorithm.public_pool = {pool} is more than the "
                              f"{self.public.y_train.numel()} training samples of {name}")
        self.pool = public_pool(int(self.public.y_train.numel()), pool, ctx.seed)

    def _public_x(self, positions: torch.Tensor, what: str) -> torch.Tensor:
        if positions.dim() != 1 or positions.dtype.is_floating_point or positions.numel() == 0:
            raise MessageError(f"fedmd: {what} must be a non-empty 1-D integer tensor")
        if int(positions.min()) < 0 or int(positions.max()) >= self.pool.numel():
            raise MessageError(f"fedmd: {what} reach outside the public pool of "
                               f"{self.pool.numel()} samples")
        return self.public.images("train", self.pool[positions.long()])

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        msg.require("indices")
        if tuple(data.x.shape[1:]) != tuple(self.public.x_train.shape[1:]):
            raise ConfigError(
                f"algorithm.public_dataset = {self.hp.public_dataset!r} has images of shape "
                f"{tuple(self.public.x_train.shape[1:])}, the private data "
                f"{tuple(data.x.shape[1:])}; FedMD's parties score public images with their "
                f"private models, so both need one shape")
        t, hp = self.ctx.train, self.hp
        self.trainer.load(model_from_state(state))
        stats: dict[str, float] = {}
        if TRANSFERRED not in state:
            if hp.public_epochs:
                public = ClientData(self.public.x_train, self.public.y_train, self.pool,
                                    norm=self.public.norm)
                stats["public_loss"] = self.trainer.fit(
                    public, hp.public_epochs, hp.public_batch_size, t.lr, gen,
                    momentum=t.momentum, weight_decay=t.weight_decay)["train_loss"]
            private = t.local_epochs if hp.private_epochs is None else hp.private_epochs
        else:
            if "consensus" in msg.tensors and hp.digest_epochs:
                msg.require("consensus_indices")
                x = self._public_x(msg.tensors["consensus_indices"], "consensus_indices")
                stats["digest_loss"] = self.digest(x, msg.tensors["consensus"], gen)
            private = t.local_epochs if hp.revisit_epochs is None else hp.revisit_epochs
        if private:
            stats.update(fit(self, data, gen, epochs=private))
        logits = self.scores(self._public_x(msg.tensors["indices"], "indices"))
        state = {**model_to_state(self.trainer.export()), TRANSFERRED: torch.ones(1)}
        return UpdateResult(Message({"logits": logits}), state, stats)

    def digest(self, x: torch.Tensor, target: torch.Tensor, gen: torch.Generator) -> float:
        """SGD towards the consensus logits ``target`` of the public images ``x``, with the
        run's momentum and weight decay (Trainer.fit always adds a label loss, which
        digest has none of); returns the mean distance over the samples seen."""
        hp, t = self.hp, self.ctx.train
        if target.shape != (x.shape[0], self.ctx.num_classes):
            raise MessageError(f"fedmd: consensus of shape {tuple(target.shape)} for "
                               f"{x.shape[0]} public samples and {self.ctx.num_classes} classes")
        distance = F.l1_loss if hp.digest_loss == "l1" else F.mse_loss
        lr = t.lr if hp.digest_lr is None else hp.digest_lr
        trainer = self.trainer
        model = trainer.model
        model.train()
        params = [trainer.params[n] for n in trainer.param_names]
        bufs: list[torch.Tensor] | None = None
        total, seen = 0.0, 0
        call = object()  # steps alike in shape: counted once (Trainer.fit's reasoning)
        try:
            with counter_aside():  # drawing batches counts no FLOPs: no dispatch through it
                for _ in range(hp.digest_epochs):
                    order = torch.randperm(x.shape[0], generator=gen)
                    for start in range(0, x.shape[0], hp.digest_batch_size):
                        batch = order[start:start + hp.digest_batch_size]
                        with counted_once((call, batch.numel(), bufs is None)):
                            loss = distance(model(trainer.layout(x[batch])),
                                            to_device(target[batch], trainer.device))
                            for p in params:
                                p.grad = None
                            loss.backward()
                            bufs = sgd_step(params, lr, t.momentum, t.weight_decay, bufs)
                        total += float(loss.detach()) * batch.numel()
                        seen += batch.numel()
        finally:
            for p in params:
                p.grad = None
            trainer.forget()
        return total / max(seen, 1)

    @torch.no_grad()
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """The model's logits (class scores before the softmax) on public images, in eval
        mode: what the party uploads."""
        model = self.trainer.model
        model.eval()
        size = self.trainer.eval_batch_size
        return torch.cat([model(self.trainer.layout(x[s:s + size]))
                          for s in range(0, x.shape[0], size)]).cpu().contiguous()


ALGORITHM = Algorithm(
    name="fedmd",
    summary="FedMD: transfer learning, then parties distil from the consensus of their logits "
    "on public data (no weights sent; any architectures)",
    hyperparameters=FedMDHyperparameters,
    server=FedMDServer,
    client=FedMDClient,
    heterogeneous=True,
    complete=complete,
    paper="Li and Wang, FedMD: Heterogenous Federated Learning via Model Distillation, "
    "NeurIPS 2019 Workshop on Federated Learning for Data Privacy and Confidentiality",
    privacy=PrivacySupport(
        refused="client level: the server averages scores on public data, not model updates; "
        "sample level: its public and private training phases are not accounted"),
    no_new_clients="each client keeps a model of its own, shaped by consensus rounds a "
                   "newcomer never took part in: no model for a stranger",
)
