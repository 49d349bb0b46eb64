"""Model architectures used by the papers, built by name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from edgepfl.errors import ConfigError
from edgepfl.models.bn import CNN2BN, CNNSmallBN
from edgepfl.models.hmpl_nets import CNN2SPP, HMPLCom, HMPLFlat, HMPLOrd, HMPLSup
from edgepfl.models.hmpl_tiers import HMPLTiers
from edgepfl.models.resnet import ResNet18, ResNet18BN
from edgepfl.registered import origin


class ConvPoolFC3(nn.Module):
    """Two conv + max-pool stages and three fully connected layers: the forward pass that
    cnn2, lenet5 and cnn_cifar share (each sets conv1, conv2, fc1, fc2, fc3)."""

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        return torch.relu(self.fc2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.features(x))


class CNN2(ConvPoolFC3):
    """The KAPC paper's CNN for 28x28 inputs (Sec. 7.1).

    The paper fixes two 5x5 convolutions and fully connected layers of 512 and 128 units
    but not the channel counts; we take 32 and 64, the FedAvg paper's MNIST CNN, which
    the KAPC code base descends from (recorded in docs/algorithms.md).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(64 * side * side, 512)
        self.fc2 = nn.Linear(512, 128)
        self.fc3 = nn.Linear(128, num_classes)



class LeNet5(ConvPoolFC3):
    """LeNet-5: two 5x5 convolutions (6, 16 channels) and three fully connected layers
    (120, 84, classifier), 61,706 parameters on 28x28 inputs.

    DC-PFL (Sec. V-A) describes its model as "two convolutional layers and three
    fully-connected (FC) layers" without sizes; this is the classic network of that shape.
    The first convolution pads by 2, so a 28x28 image is seen as LeNet's 32x32 input and
    the first FC layer takes 16 x 5 x 5 features.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        side = (image_size // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)



class CNNCifar(ConvPoolFC3):
    """The FedAvg paper's CIFAR CNN: two 5x5 convolutions (64 channels), FC 384 and 192."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        side = image_size // 4
        self.fc1 = nn.Linear(64 * side * side, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)



class CNNSmall(nn.Module):
    """A small CNN for 8x8 inputs (digits, synthetic): cheap enough for CI and demos."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        side = image_size // 2
        self.fc1 = nn.Linear(32 * side * side, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return torch.relu(self.fc1(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.features(x))


class CNNSmallNarrow(CNNSmall):
    """cnn_small with a narrower fully connected layer (32 units): the same convolutions
    (the layers a two-architecture federation shares) and a cheaper head, for weak devices."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
        super().__init__(in_channels, num_classes, image_size)
        side = image_size // 2
        self.fc1 = nn.Linear(32 * side * side, 32)
        self.fc2 = nn.Linear(32, num_classes)


class MLP(nn.Module):
    """Two hidden layers of 200 units (the FedAvg paper's 2NN) for inputs of one size:
    images of any height and width, and feature vectors of d values, which data sets store
    as d channels of 1x1 (``data.own``), so that C x H x W is d."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10,
                 image_size: int | tuple[int, int] = 28):
        super().__init__()
        height, width = image_size if isinstance(image_size, tuple) else (image_size, image_size)
        self.fc1 = nn.Linear(in_channels * height * width, 200)
        self.fc2 = nn.Linear(200, 200)
        self.fc3 = nn.Linear(200, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.features(x))


# (channels, num_classes, size): size is the side of a square image, or (height, width) for
# the RECTANGULAR_MODELS
ModelFactory = Callable[[int, int, Any], nn.Module]

MODELS: dict[str, tuple[ModelFactory, str]] = {
    "cnn2": (CNN2, "KAPC's CNN for 28x28 images: 2 conv 5x5 (32, 64), FC 512, 128, classifier"),
    "lenet5": (LeNet5, "LeNet-5 (DC-PFL's 2 conv + 3 FC CNN): 2 conv 5x5 (6, 16), FC 120, 84, "
               "classifier"),
    "cnn_cifar": (CNNCifar, "FedAvg's CIFAR CNN: 2 conv 5x5 (64, 64), FC 384, 192, classifier"),
    "cnn_small": (CNNSmall, "small CNN for 8x8 images (digits, synthetic): 2 conv 3x3, FC 64"),
    "cnn_small_narrow": (CNNSmallNarrow, "cnn_small with FC 32 instead of 64 (shares its convolutions)"),
    "mlp": (MLP, "2 hidden layers of 200 units, any image size (one per data set) and "
            "feature vectors"),
    "resnet18": (ResNet18, "ResNet-18, CIFAR stem (3x3 conv, no max-pool), GroupNorm; 32x32 "
                 "images and up, any size"),
    "cnn_small_bn": (CNNSmallBN, "cnn_small with BatchNorm after each conv (FedBN)"),
    "cnn2_bn": (CNN2BN, "cnn2 with BatchNorm after each conv (FedBN)"),
    "resnet18_bn": (ResNet18BN, "resnet18 with BatchNorm instead of GroupNorm (FedBN)"),
    "cnn2_spp": (CNN2SPP, "cnn2's convs + SPP (1x1, 2x2, 4x4) before FC 512, 128: any image size"),
    "hmpl_ord": (HMPLOrd, "HMPL's Ord model: 3 conv 3x3 (64, 128, 256) + pool, SPP, FC 1024, 1024"),
    "hmpl_flat": (HMPLFlat, "hmpl_ord with its last map flattened, no SPP (Sec. IV-D's plain "
                  "FedAvg): square images of one size"),
    "hmpl_com": (HMPLCom, "HMPL's Com model (weak devices): hmpl_ord without conv3, 1x1 IP conv"),
    "hmpl_sup": (HMPLSup, "HMPL's Sup model (strong devices), stage 1: hmpl_ord + FPN over L3/L2"),
    "hmpl_sup2": (partial(HMPLSup, depth=2), "HMPL's Sup model, stage 2: FPN over L3/L2/L1"),
    "hmpl_tiers": (HMPLTiers, "every HMPL tier in one module, a 'stage' buffer picks one (the "
                   "hmpl algorithm's model)"),
}

# Models whose output does not depend on the input's height and width (SPP or global
# average pooling before the FC layers): they take images of any size and aspect ratio.
VARIABLE_SIZE_MODELS = {"cnn2_spp", "hmpl_ord", "hmpl_com", "hmpl_sup", "hmpl_sup2",
                        "hmpl_tiers", "resnet18", "resnet18_bn"}  # plug-ins add theirs
# Models of one input size that need not be square: their factory takes (height, width).
RECTANGULAR_MODELS = frozenset({"mlp"})

DEFAULT_MODEL = {"mnist": "cnn2", "fmnist": "cnn2", "cifar10": "cnn_cifar",
                 "cifar100": "cnn_cifar", "digits": "cnn_small", "synthetic": "cnn_small"}


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Build a model by registry name for inputs of shape (C, H, W)."""
    if name not in MODELS:
        raise ConfigError(f"model.name = {name!r} is not a known model; valid: {', '.join(MODELS)}")
    channels, height, width = input_shape
    size: int | tuple[int, int] = height
    if height != width:
        if name in RECTANGULAR_MODELS:
            size = (height, width)
        elif name not in VARIABLE_SIZE_MODELS:
            valid = sorted(RECTANGULAR_MODELS | VARIABLE_SIZE_MODELS)
            raise ConfigError(f"model {name!r} needs square images, got {height}x{width}; "
                              f"models for images that are not square: {', '.join(valid)} "
                              f"(or set dataset.resize)")
    factory = MODELS[name][0]
    plugin = origin("model", name)
    if plugin is not None:
        return _plugin_model(name, plugin, factory, input_shape, num_classes, size)
    try:
        model = factory(channels, num_classes, size)
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    except RuntimeError as exc:
        hint = ""
        if (height, width) == (1, 1):
            hint = (f"; these are feature vectors of {channels} values (stored as {channels} "
                    f"channels of 1x1), which model.name = 'mlp' takes")
        raise ConfigError(
            f"model.name = {name!r} does not fit inputs of shape {input_shape}: {exc}{hint}"
        ) from exc
    return model


def _plugin_model(name: str, plugin: str, factory, input_shape: tuple[int, int, int],
                  num_classes: int, size: int | tuple[int, int]) -> nn.Module:
    """A plug-in's model, held to the contract before a run starts on it: an ``nn.Module``
    that maps a batch of ``input_shape`` inputs to ``num_classes`` logits."""
    where = f"model {name!r} of plug-in {plugin!r}"
    try:
        model = factory(input_shape[0], num_classes, size)
    except Exception as exc:
        raise ConfigError(f"{where}: factory(channels={input_shape[0]}, num_classes="
                          f"{num_classes}, image_size={size!r}) failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where}: its factory returned {type(model).__name__}, not a "
                          "torch.nn.Module")
    training = model.training
    try:  # in eval mode: the probe must not move a BatchNorm's running statistics
        with torch.no_grad():
            out = model.eval()(torch.zeros(2, *input_shape))
    except Exception as exc:
        raise ConfigError(f"{where} does not fit inputs of shape {input_shape}: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"{where} returned {got} for a batch of 2 inputs; a model returns "
                          f"logits of shape (batch, {num_classes}), one per class")
    return model.train(training)
