"""ResNet-18 (CIFAR stem, GroupNorm; resnet18_bn for FedBN): its layers as LayerSpec sees
them, any input size, and FedAvg rounds on a small 32x32 data set of one's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgepfl.algorithms.fedbn import batchnorm_names
from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation
from edgepfl.models import MODELS, VARIABLE_SIZE_MODELS, LayerSpec, build_model


def expected_layers() -> list[str]:
    names = ["conv1", "norm1"]
    for stage in range(1, 5):
        for block in range(2):
            prefix = f"layer{stage}.{block}"
            names += [f"{prefix}.conv1", f"{prefix}.norm1", f"{prefix}.conv2", f"{prefix}.norm2"]
            if stage > 1 and block == 0:  # stride 2 and more channels: a projected shortcut
                names += [f"{prefix}.shortcut.0", f"{prefix}.shortcut.1"]
    return names + ["fc"]


@pytest.mark.parametrize("name", ["resnet18", "resnet18_bn"])
def test_layer_spec_lists_every_convolution_norm_and_the_classifier(name):
    model = build_model(name, (3, 32, 32), 10)
    spec = LayerSpec.from_model(model)
    assert spec.names == expected_layers()
    assert sorted(spec.param_names) == sorted(n for n, _ in model.named_parameters())
    # the CIFAR ResNet-18's 11,173,962 parameters (norms: a weight and a bias per channel)
    assert spec.numel == 11_173_962
    assert spec.params_of("conv1") == ["conv1.weight"]  # convolutions without bias
    assert spec.params_of("fc") == ["fc.weight", "fc.bias"]
    stem = model.conv1
    assert (stem.kernel_size, stem.stride) == ((3, 3), (1, 1))
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())


def test_group_norm_by_default_batch_norm_for_fedbn():
    gn = build_model("resnet18", (3, 32, 32), 10)
    bn = build_model("resnet18_bn", (3, 32, 32), 10)
    assert LayerSpec.from_model(gn).buffers == ()
    assert isinstance(gn.norm1, torch.nn.GroupNorm) and isinstance(bn.norm1, torch.nn.BatchNorm2d)
    norms = [n for n in LayerSpec.from_model(bn).names if "norm" in n or n.endswith("shortcut.1")]
    local = batchnorm_names(LayerSpec.from_model(bn))
    assert {name.rsplit(".", 1)[0] for name in local} == set(norms)
    assert {"resnet18", "resnet18_bn"} <= set(MODELS) and "resnet18" in VARIABLE_SIZE_MODELS


def test_any_input_size_and_channel_count():
    model = build_model("resnet18", (1, 40, 24), 7).eval()
    for shape in [(1, 32, 32), (1, 40, 24), (1, 17, 50)]:
        assert model(torch.zeros(2, *shape)).shape == (2, 7)
    torch.manual_seed(0)
    x = torch.randn(3, 1, 32, 32)
    assert torch.equal(model.fc(model.features(x)), model(x))


def write_npz(path, n: int, n_test: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    x = rng.integers(0, 128, (n, 3, 32, 32), dtype=np.uint8)
    x[y == 1, 0] += 100  # a brighter red channel: learnable in two rounds
    y_test = np.arange(n_test) % 2
    x_test = rng.integers(0, 128, (n_test, 3, 32, 32), dtype=np.uint8)
    x_test[y_test == 1, 0] += 100
    np.savez(path, x=x, y=y, x_test=x_test, y_test=y_test)


def test_two_rounds_of_fedavg_on_a_32x32_npz_set(tmp_path):
    write_npz(tmp_path / "d.npz", 32, 8)
    cfg = build_config({}, [f"dataset.path={tmp_path / 'd.npz'}", "dataset.name=npz",
                            "model.name=resnet18", "algorithm.name=fedavg",
                            "partition.scheme=iid", "partition.clients=2", "train.rounds=2",
                            "train.local_epochs=1", "train.batch_size=8", "train.lr=0.05",
                            "output.plots=false", "system.count_flops=false"])
    sim = Simulation(cfg, progress=False)
    assert [len(t) for t in sim.partition.train] == [16, 16]
    start = {k: v.clone() for k, v in sim.server.global_model.items()}
    result = sim.run()
    assert [row["round"] for row in result.metrics] == [1, 2]
    moved = [k for k, v in sim.server.global_model.items() if not torch.equal(v, start[k])]
    assert set(moved) == set(start)  # every layer trained
    assert all(np.isfinite(row["acc_mean"]) for row in result.metrics)
