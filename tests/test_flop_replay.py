"""FLOPs of repeated training steps: ``Trainer.fit`` counts one step per batch shape and
runs the rest outside the counter (``counted_once``); the count must be exactly what
counting every step gives, for every algorithm, and results must not change."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import edgepfl.algorithms.training as training
from edgepfl.algorithms import ALGORITHMS
from edgepfl.algorithms.training import ClientData, Trainer
from edgepfl.engine.simulation import Simulation
from edgepfl.federation.accounting import counted_once, not_counted
from edgepfl.system.flops import FlopMeter
from tests.conftest import fast_config

EXTRA = {"hierfavg": ["topology.edges=2", "topology.edge_rounds=2"],
         "hierbayes": ["topology.edges=2", "topology.edge_rounds=2"],
         "fedmd": ["algorithm.public_epochs=1", "algorithm.public_size=200"],
         "fedbn": ["model.name=cnn2_bn", "dataset.name=fmnist", "dataset.fraction=0.01"],
         "hmpl": ["dataset.name=fmnist", "dataset.fraction=0.005", "train.batch_size=20"],
         "hmpl_s": ["dataset.name=fmnist", "dataset.fraction=0.005", "train.batch_size=20"],
         "hmpl-crops": ["dataset.name=fmnist", "dataset.fraction=0.005", "train.batch_size=20",
                        'dataset.aspect_ratios=["16:9", "4:3", "1:1", "3:4", "9:16"]']}


PLAIN_SGD = {"l2sgd", "perfedavg", "perfedavg_hf", "pfedbayes", "pfedme"}  # refuse momentum


@contextmanager
def count_everything(key):
    yield


def flops_by_round(name: str, replay: bool, monkeypatch) -> tuple[list, list]:
    with monkeypatch.context() as m:
        if not replay:
            m.setattr(training, "counted_once", count_everything)
        # momentum: the first step of a fit differs from the rest (its buffer is made)
        momentum = 0 if name in PLAIN_SGD else 0.5
        sim = Simulation(fast_config(f"algorithm.name={name.split('-')[0]}", "train.rounds=2",
                                     "system.cache_flops=false", f"train.momentum={momentum}",
                                     *EXTRA.get(name, [])), progress=False)
        sim.run()
    return ([r["flops_client"] for r in sim.metrics],
            [r.get("acc_mean") for r in sim.metrics])


@pytest.mark.parametrize("name", [*sorted(ALGORITHMS), "hmpl-crops"])
def test_replayed_steps_count_what_counting_every_step_counts(name, monkeypatch):
    replayed, acc_r = flops_by_round(name, True, monkeypatch)
    counted, acc_c = flops_by_round(name, False, monkeypatch)
    assert replayed == counted, name
    assert acc_r == acc_c
    assert replayed[0] > 0 or name == "local"  # something was counted


def _fit(meter: FlopMeter, data: ClientData, trainer: Trainer, epochs: int = 2) -> int:
    with meter.measure() as m:
        trainer.fit(data, epochs, 8, 0.1, torch.Generator().manual_seed(0))
    return m.flops


def test_a_fit_counts_each_batch_shape_once_and_the_repeats_outside_the_counter():
    torch.manual_seed(0)
    trainer = Trainer(nn.Linear(5, 3))
    data = ClientData(torch.randn(30, 5), torch.randint(0, 3, (30,)), torch.arange(30))
    under_counter = []
    real = training.counted_once

    @contextmanager
    def spy(key):
        with real(key):
            under_counter.append((key[1], _get_current_dispatch_mode() is not None))
            yield

    meter = FlopMeter(cache=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(training, "counted_once", spy)
        flops = _fit(meter, data, trainer)
    # 30 samples in batches of 8 for 2 epochs: six steps of 8 and two of 6, and only the
    # first of each shape ran under the counter
    assert len(under_counter) == 8
    assert sorted(k for k, counted in under_counter if counted) == [(6, 5), (8, 5)]
    # a linear layer without input gradient: forward 2*5*3 and weight gradient as much,
    # per sample, for 60 samples
    assert flops == 60 * 2 * (2 * 5 * 3)


def test_repeats_inside_not_counted_are_left_out_as_their_first_count_is():
    trainer = Trainer(nn.Linear(5, 3))
    data = ClientData(torch.randn(16, 5), torch.randint(0, 3, (16,)), torch.arange(16))
    meter = FlopMeter(cache=False)
    with meter.measure() as m:
        with not_counted():
            trainer.fit(data, 3, 8, 0.1, torch.Generator().manual_seed(0))
        trainer.fit(data, 1, 8, 0.1, torch.Generator().manual_seed(0))
    assert m.flops == 16 * 2 * 5 * 3 * 2  # only the counted epoch
    assert m.excluded == 3 * m.flops


def test_counted_once_outside_a_meter_just_runs():
    ran = []
    with counted_once(("k",)):
        ran.append(1)
    assert ran == [1]
