"""``train.compile``: a plain fit whose forward, loss and backward run as one graph that
torch.compile made ends where the eager fit does, within float tolerance, with hooks,
momentum, weight decay and frozen parameters as eagerly."""

import pytest
import torch

from edgepfl.config import build_config
from edgepfl.contract.kit import proximal_hook
from edgepfl.errors import ConfigError
from edgepfl.models import build_model
from edgepfl.training.client_data import ClientData
from edgepfl.training.trainer import Trainer


def _data(n: int = 47) -> ClientData:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return ClientData(x, y, torch.arange(n))


def _fit(mode: str, model: str = "cnn_small", **kw
         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    torch.manual_seed(1)
    trainer = Trainer(build_model(model, (1, 8, 8), 10), compile=mode)
    start = trainer.export()
    if kw.pop("hook", False):
        kw["grad_hook"] = proximal_hook(0.1, [start[n] for n in trainer.param_names])
    # the last batch is short (47 = 4 x 10 + 7): a second batch shape
    stats = trainer.fit(_data(), 2, 10, 0.05, torch.Generator().manual_seed(3), **kw)
    return trainer.export(), stats


@pytest.mark.parametrize("settings", [
    {},
    {"momentum": 0.9, "weight_decay": 1e-3, "hook": True},
    {"trainable": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]},
])
def test_compiled_fit_equals_eager(settings):
    eager, eager_stats = _fit("off", **dict(settings))
    compiled, stats = _fit("default", **dict(settings))
    assert stats["steps"] == eager_stats["steps"] and stats["samples"] == eager_stats["samples"]
    assert stats["train_loss"] == pytest.approx(eager_stats["train_loss"], rel=1e-5)
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_models_with_batchnorm_train_eagerly():
    """BatchNorm updates its running statistics in place, which a compiled
    ``torch.func.grad`` refuses: such a model's fit stays eager, with eager's results."""
    trainer = Trainer(build_model("cnn_small_bn", (1, 8, 8), 10), compile="default")
    assert trainer._passes(trainer.param_names) is None
    eager, _ = _fit("off", model="cnn_small_bn")
    same, _ = _fit("default", model="cnn_small_bn")
    for name, value in eager.items():
        assert torch.equal(same[name], value), name


def test_compile_setting_is_checked():
    assert build_config({}, []).train.compile == "off"
    assert build_config({}, ["train.compile=default"]).train.compile == "default"
    with pytest.raises(ConfigError, match="train.compile"):
        build_config({}, ["train.compile=fast"])
    with pytest.raises(ValueError, match="valid: off"):
        Trainer(build_model("cnn_small", (1, 8, 8), 10), compile="fast")


def test_the_engine_hands_train_compile_to_its_trainers():
    from edgepfl.engine.simulation import Simulation
    from tests.conftest import fast_config

    sim = Simulation(fast_config("train.compile=default", "train.rounds=1"), progress=False)
    assert sim.trainer.compile == "default"
    hetero = Simulation(fast_config("algorithm.name=heterofl", "train.compile=default",
                                    "train.rounds=1"), progress=False)
    assert hetero.client.trainer_at(0.5).compile == "default"
    tiers = Simulation(fast_config("algorithm.name=hmpl", "model.name=hmpl_tiers",
                                   "system.devices=tiers", "train.compile=default",
                                   "train.rounds=1"), progress=False)
    assert tiers.client.trainer_at(0).compile == "default"
    with pytest.raises(ConfigError, match="train.compile"):
        Simulation(fast_config("train.compile=default", "privacy.level=sample",
                               "privacy.noise_multiplier=1.0"), progress=False)
