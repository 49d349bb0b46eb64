"""FLOPs of repeated training steps: ``Trainer.fit`` counts one step per batch shape and
runs the rest outside the counter (``counted_once``); the count must be exactly what
counting every step gives, for every algorithm, and results must not change."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import edgepfl.training.trainer as training
from edgepfl.algorithms import ALGORITHMS
from edgepfl.engine.simulation import Simulation
from edgepfl.federation.accounting import counted_once, not_counted
from edgepfl.system.flops import FlopMeter
from edgepfl.training.client_data import ClientData
from edgepfl.training.trainer import Trainer
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
def count_everything(key, store=None):
    yield


@contextmanager
def count_everything_between():
    yield


def flops_by_round(name: str, replay: bool, monkeypatch) -> tuple[list, list]:
    with monkeypatch.context() as m:
        if not replay:
            m.setattr(training, "counted_once", count_everything)
            m.setattr(training, "counter_aside", count_everything_between)
        # momentum: the first step of a fit differs from the rest (its buffer is made)
        momentum = 0 if name in PLAIN_SGD else 0.5
        # four clients: what is replayed is a client's own repeated steps, which as many
        # clients show as six do (the suite's time: this file is a tenth of it)
        # and a quarter of the synthetic set: 125 samples a client on average, so a fit
        # still repeats its full batches and the clients still share batch shapes (the
        # data sets named in EXTRA keep their own fraction)
        sim = Simulation(fast_config(f"algorithm.name={name.split('-')[0]}", "train.rounds=2",
                                     "system.cache_flops=false", f"train.momentum={momentum}",
                                     "partition.clients=4", "dataset.fraction=0.25",
                                     *EXTRA.get(name, [])),
                         progress=False)
        sim.run()
    return ([r["flops_client"] for r in sim.metrics],
            [r.get("acc_mean") for r in sim.metrics])


@pytest.mark.parametrize("name", [*sorted(ALGORITHMS), "hmpl-crops"])
def test_replayed_steps_count_what_counting_every_step_counts(name, monkeypatch, request):
    if "dataset.name=fmnist" in EXTRA.get(name, []):
        request.getfixturevalue("shared_data")  # skipped, with the reason, without the files
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
    def spy(key, store=None):
        with real(key, store):
            if isinstance(key[1], tuple):  # a step's passes, keyed by batch shape
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


def test_plain_fits_share_step_counts_across_clients_and_a_hook_keeps_its_own():
    """The federation's first step of each shape is counted, every other client replays it;
    a fit with frozen parameters counts its own passes, and a gradient hook's work is
    counted in every fit that has one."""
    torch.manual_seed(0)
    trainer = Trainer(nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)))
    clients = [ClientData(torch.randn(n, 5), torch.randint(0, 3, (n,)), torch.arange(n))
               for n in (16, 16, 12)]
    passes, updates = [], []
    real = training.counted_once

    @contextmanager
    def spy(key, store=None):
        with real(key, store):
            counted = _get_current_dispatch_mode() is not None
            (passes if isinstance(key[1], tuple) else updates).append(counted)
            yield

    def fit(data, **kw):
        passes.clear()
        updates.clear()
        with FlopMeter(cache=False).measure() as m:
            trainer.fit(data, 1, 8, 0.1, torch.Generator().manual_seed(0), **kw)
        return m.flops, list(passes), list(updates)

    # per sample: forward 2*(5*4 + 4*3), backward the weight gradients of both layers and
    # the input gradient of the second (the first layer's input needs none)
    full = 2 * (5 * 4 + 4 * 3) + 2 * (5 * 4 + 4 * 3) + 2 * 4 * 3
    with pytest.MonkeyPatch.context() as m:
        m.setattr(training, "counted_once", spy)
        assert fit(clients[0]) == (16 * full, [True, False], [True, False])
        # another client: every step replayed
        assert fit(clients[1]) == (16 * full, [False, False], [False, False])
        assert fit(clients[2]) == (12 * full, [False, True], [False, False])  # 4 is new
        # only the last layer trained: forward as before, backward its weight gradient only
        head = ["2.weight", "2.bias"]
        assert fit(clients[0], trainable=head)[:2] == (
            16 * (2 * (5 * 4 + 4 * 3) + 2 * 4 * 3), [True, False])

        def hook(params, grads):
            grads[0].add_(torch.ones(4, 2) @ torch.ones(2, 5))  # 2*4*2*5 FLOPs per step

        # the passes are shared, the hook's update is counted once in each fit
        assert fit(clients[0], grad_hook=hook) == (16 * full + 2 * 80, [False, False],
                                                   [True, False])
        assert fit(clients[1], grad_hook=hook) == (16 * full + 2 * 80, [False, False],
                                                   [True, False])

        def extra(model, logits, x, y):
            return (x @ torch.ones(5, 1)).sum() * 0  # 2*5 FLOPs per sample, nothing to back
        # a loss hook's passes are its own: counted per shape in each fit
        with_loss = fit(clients[1], loss_hook=extra)
        assert with_loss[1:] == ([True, False], [False, False])
        assert with_loss[0] == 16 * full + 16 * 2 * 5


def test_a_fit_draws_its_batches_outside_the_counter():
    """Drawing a batch (index, normalise) has no FLOPs; under the counter each of its
    operators would be a dispatch through Python in every step of a counted update."""
    modes = []

    class Watched(ClientData):
        def batches(self, batch_size, gen):
            for batch in super().batches(batch_size, gen):
                modes.append(_get_current_dispatch_mode())
                yield batch

    trainer = Trainer(nn.Linear(5, 3))
    data = Watched(torch.randn(30, 5), torch.randint(0, 3, (30,)), torch.arange(30))
    assert _fit(FlopMeter(cache=False), data, trainer) == 60 * 2 * (2 * 5 * 3)
    assert len(modes) == 8 and all(m is None for m in modes)


def test_counted_once_blocks_nest_inside_the_loop_that_keeps_the_counter_aside():
    """A new block inside ``counter_aside`` counts what it runs, a block nested in it (new or
    seen) as it would outside the loop, and the glue between blocks counts nothing."""
    from edgepfl.federation.accounting import counter_aside

    a, b = torch.ones(4, 3), torch.ones(3, 2)  # one product: 2*4*3*2 = 48 FLOPs

    def block(key, inner=None):
        with counted_once(key):
            a @ b
            if inner is not None:
                with counted_once(inner):
                    a @ b

    with FlopMeter(cache=False).measure() as m:
        with counter_aside():
            for _ in range(3):
                a @ b  # glue: not counted
                block("outer", inner="inner")
            block("other", inner="inner")  # new outer, seen inner
    assert m.flops == 3 * 96 + 96
    with FlopMeter(cache=False).measure() as plain:
        for _ in range(3):
            block("outer", inner="inner")
        block("other", inner="inner")
    assert plain.flops == m.flops


def test_a_repeated_block_leaves_out_again_what_its_nested_not_counted_left_out():
    a, b = torch.ones(4, 3), torch.ones(3, 2)  # 48 FLOPs a product

    def block():
        with counted_once("step"):
            a @ b
            with not_counted():
                a @ b
                a @ b

    with FlopMeter(cache=False).measure() as m:
        for _ in range(3):
            block()
    assert (m.flops, m.excluded) == (3 * 48, 3 * 96)
    with FlopMeter(cache=False).measure() as m:
        with not_counted():
            for _ in range(3):
                block()
        block()
    assert (m.flops, m.excluded) == (48, 3 * 144 + 96)
