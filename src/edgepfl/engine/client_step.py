"""A client's side of a round, written once for every place a client runs: the
simulation's in-process transport, its worker processes and Flower's ClientApp.

Each client's work is seeded from the run seed, the client step and the client id alone,
so the same step of the same client draws the same numbers wherever it runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch

from edgepfl.config import Config
from edgepfl.contract.algorithm import Client, UpdateResult
from edgepfl.data.datasets import Dataset
from edgepfl.data.partition import Partition, validation_split
from edgepfl.engine.parts import image_crops
from edgepfl.engine.schedule import step_lr, training_rate
from edgepfl.engine.transport import Figures
from edgepfl.federation.messages import Message
from edgepfl.federation.rng import derive_seed, generator
from edgepfl.privacy.dpsgd import accounted
from edgepfl.training.client_data import ClientData, TestData, eval_parts, sample_count


class ClientViews(NamedTuple):
    """A client's data: its training view, its test samples and, with
    ``eval.validation``, its validation samples (held out of its training data)."""

    train: ClientData
    test: TestData
    val: TestData | None = None


def client_views(dataset: Dataset, partition: Partition, cid: int,
                 cfg: Config | None = None) -> ClientViews:
    """Client ``cid``'s training view and its test samples: ``(x, y)`` gathered, or with
    ``cfg.dataset.aspect_ratios`` a cropped view of the test set as the training view is
    of the training set (a ``ClientData`` whose ``buckets`` are its shapes); with
    ``cfg.eval.validation`` its validation samples, held out of its training split by a
    draw from the run seed and the client alone."""
    ds, idx = dataset, partition.test[cid]
    train_idx, val_idx = partition.train[cid], None
    if cfg is not None and cfg.eval.validation > 0:
        share = cfg.eval.validation
        rng = np.random.default_rng(derive_seed(cfg.seed, "validation", cid))
        train_idx, val_idx = validation_split(train_idx, ds.y_train, share, rng)
    crops = image_crops(cfg, dataset) if cfg is not None else None
    if crops is None and ds.variable_size:
        # images of several sizes, each seen whole: its box is its own extent on the canvas
        def whole(x, y, rows, split) -> ClientData:
            return ClientData(x, y, rows, ds.boxes(split, rows), ds.norm)

        return ClientViews(whole(ds.x_train, ds.y_train, train_idx, "train"),
                           whole(ds.x_test, ds.y_test, idx, "test"),
                           None if val_idx is None else whole(ds.x_train, ds.y_train, val_idx,
                                                              "train"))
    if crops is None:
        val = None if val_idx is None else (ds.images("train", val_idx),
                                            ds.y_train.index_select(0, val_idx))
        return ClientViews(ClientData(ds.x_train, ds.y_train, train_idx, norm=ds.norm),
                           (ds.images("test", idx), ds.y_test.index_select(0, idx)), val)
    assert cfg is not None  # crops come only from a configuration
    # Drawn per client from the run seed alone, so the simulation and a Flower node (which
    # builds only its own client's split) cut the same crops.
    ratio = None
    if cfg.dataset.aspect_mode == "client":
        table = crops.client_ratios(partition.num_clients, generator(cfg.seed, "aspect", "clients"))
        ratio = int(table[cid])

    def cropped(x, y, rows, *purpose) -> ClientData:
        return ClientData(x, y, rows, crops.draw(rows.numel(), generator(cfg.seed, "aspect",
                                                                         *purpose, cid), ratio),
                          ds.norm)

    return ClientViews(cropped(ds.x_train, ds.y_train, train_idx, "train"),
                       cropped(ds.x_test, ds.y_test, idx, "test"),
                       None if val_idx is None else cropped(ds.x_train, ds.y_train, val_idx, "val"))


def client_split(dataset: Dataset, partition: Partition, cid: int,
                 cfg: Config | None = None) -> tuple[ClientData, TestData]:
    """``client_views`` without the validation samples: (training view, test samples)."""
    views = client_views(dataset, partition, cid, cfg)
    return views.train, views.test


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
        # at privacy.level = sample, the DP-SGD steps it ran go back with its stats
        return accounted(part, lambda: part.update(cid, msg, state, data, gen))


def evaluate_client(client, trainer, cid: int, state, eval_msg: Message | None,
                    train: ClientData, test: TestData, val: TestData | None = None) -> Figures:
    """A client's named predictions (``Client.predictive``) on its test split (summed over
    its input shapes when images are cropped; whole images are one), and its personalized
    prediction on its validation split when it has one."""
    models = client.predictive(cid, state, eval_msg, train)
    personal = models.pop("")
    correct, loss = _score(trainer, personal, test)
    extra = {name: _score(trainer, states, test) for name, states in models.items()}
    validation = None
    if val is not None:
        count = sample_count(val)
        val_correct, val_loss = _score(trainer, personal, val) if count else (0, 0.0)
        validation = (val_correct, count, val_loss)
    return Figures(correct, sample_count(test), loss, extra, validation)


def _score(trainer, states, data: TestData) -> tuple[int, float]:
    """Correct predictions and summed loss of the predictive of ``states`` on ``data``."""
    figures = [trainer.evaluate_predictive(states, x, y) for x, y in eval_parts(data)]
    return sum(c for c, _ in figures), sum(loss for _, loss in figures)


def evaluate_new_client(cfg: Config, client, trainer, rnd: int, cid: int, state,
                        msg: Message | None, train: ClientData, test: TestData) -> Figures:
    """Held-out client ``cid`` (``eval.new_clients``) in evaluated round ``rnd``: served
    ``msg``, adapted from its initial ``state`` as its method would
    (``Client.new_client_model``, ``eval.new_client_epochs``) and scored on its test
    split. Seeded from (run seed, round, client) alone, the global RNG restored after it:
    nothing it does is kept, nor changes what the trained clients draw."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "torch", "new-client", rnd, cid))
        gen = generator(cfg.seed, "new-client", rnd, cid)
        models = client.new_client_model(cid, state, msg, train, cfg.eval.new_client_epochs,
                                         gen)
    trainer.forget()
    correct, loss = _score(trainer, models, test)
    return Figures(correct, sample_count(test), loss)
