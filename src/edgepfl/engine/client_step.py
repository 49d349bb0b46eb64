"""A client's side of a round, written once for every place a client runs: the
simulation's in-process transport, its worker processes and Flower's ClientApp.

Each client's work is seeded from the run seed, the client step and the client id alone,
so the same step of the same client draws the same numbers wherever it runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from edgepfl.algorithms.base import Client, UpdateResult
from edgepfl.algorithms.training import ClientData, TestData, eval_parts, sample_count
from edgepfl.config import Config
from edgepfl.data.datasets import Dataset
from edgepfl.data.partition import Partition
from edgepfl.engine.parts import image_crops
from edgepfl.engine.schedule import step_lr, training_rate
from edgepfl.engine.transport import Figures
from edgepfl.federation.messages import Message
from edgepfl.federation.rng import derive_seed, generator


def client_split(dataset: Dataset, partition: Partition, cid: int,
                 cfg: Config | None = None) -> tuple[ClientData, TestData]:
    """Client ``cid``'s training view and its test samples: ``(x, y)`` gathered, or with
    ``cfg.dataset.aspect_ratios`` a cropped view of the test set as the training view is
    of the training set (a ``ClientData`` whose ``buckets`` are its shapes)."""
    ds, idx = dataset, partition.test[cid]
    crops = image_crops(cfg, dataset) if cfg is not None else None
    if crops is None:
        return (ClientData(ds.x_train, ds.y_train, partition.train[cid], norm=ds.norm),
                (ds.images("test", idx), ds.y_test.index_select(0, idx)))
    # Drawn per client from the run seed alone, so the simulation and a Flower node (which
    # builds only its own client's split) cut the same crops.
    ratio = None
    if cfg.dataset.aspect_mode == "client":
        table = crops.client_ratios(partition.num_clients, generator(cfg.seed, "aspect", "clients"))
        ratio = int(table[cid])
    train_idx = partition.train[cid]
    return (ClientData(ds.x_train, ds.y_train, train_idx,
                       crops.draw(train_idx.numel(), generator(cfg.seed, "aspect", "train", cid), ratio),
                       ds.norm),
            ClientData(ds.x_test, ds.y_test, idx,
                       crops.draw(idx.numel(), generator(cfg.seed, "aspect", "test", cid), ratio),
                       ds.norm))


@contextmanager
def as_client(cfg: Config, part: Client, step: int, cid: int) -> Iterator[torch.Generator]:
    """Client ``cid``'s part in client ``step``: the global RNG seeded and the step's rate
    (``train.lr_decay``) lent to the part, with the client's batch generator."""
    torch.manual_seed(derive_seed(cfg.seed, "torch", step, cid))
    with training_rate(part, step_lr(cfg, step)):
        yield generator(cfg.seed, "client", step, cid)


def client_step(cfg: Config, part: Client, step: int, cid: int, msg: Message,
                state: dict[str, torch.Tensor], data: ClientData) -> UpdateResult:
    """One client's update in one client step (the round in a star; (round - 1) * k2 +
    edge round in a hierarchy)."""
    with as_client(cfg, part, step, cid) as gen:
        return part.update(cid, msg, state, data, gen)


def evaluate_client(client, trainer, cid: int, state, eval_msg: Message | None,
                    train: ClientData, test: TestData) -> Figures:
    """A client's named predictions (``Client.predictive``) on its test split (summed over
    its input shapes when images are cropped; whole images are one)."""
    models = client.predictive(cid, state, eval_msg, train)
    parts = eval_parts(test)

    def score(states) -> tuple[int, float]:
        figures = [trainer.evaluate_predictive(states, x, y) for x, y in parts]
        return sum(c for c, _ in figures), sum(loss for _, loss in figures)

    correct, loss = score(models.pop(""))
    extra = {name: score(states) for name, states in models.items()}
    return Figures(correct, sample_count(test), loss, extra)
