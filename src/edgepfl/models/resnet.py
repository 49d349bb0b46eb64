"""ResNet-18 for 32x32-and-up images, written here (no torchvision).

The CIFAR form of He et al. (2016): a 3x3 stride-1 stem without max pooling (the ImageNet
stem's 7x7 stride 2 and pooling would leave a 32x32 image 8x8 before the first block),
four stages of two basic blocks (64, 128, 256, 512 channels, stride 2 from the second
stage on), global average pooling and one linear classifier. The pooling makes the output
independent of the input's height and width, so it takes images of any size.

Normalisation is GroupNorm (two groups) by default: BatchNorm's running statistics are
averages over each client's own batches, and averaged over non-IID clients they describe
no client's data (Hsieh et al., ICML 2020); FL work with ResNets uses GroupNorm instead
(Reddi et al., ICLR 2021, two groups as here). ``resnet18_bn`` keeps BatchNorm for FedBN,
which is the method that keeps those statistics local.

Every layer is a module that owns its parameters directly (convolutions without bias, a
norm after each), registered in the order the forward pass runs them, so ``LayerSpec``
derives one layer per convolution, norm and the classifier. ``features`` is the
classifier's input, as in the zoo's other models (MOON, FedProto read it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

GN_GROUPS = 2
STAGES = (64, 128, 256, 512)
BLOCKS_PER_STAGE = 2

Norm = Callable[[int], nn.Module]


def group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(GN_GROUPS, channels)


def batch_norm(channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection; a 1x1 projection on the shortcut
    where the block changes the size or the channel count."""

    def __init__(self, in_channels: int, channels: int, stride: int, norm: Norm):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.norm1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.norm2 = norm(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), norm(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18, CIFAR stem, GroupNorm (``norm=batch_norm``: BatchNorm)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32,
                 norm: Norm = group_norm):
        # image_size is the zoo's factory signature; the global pooling makes it irrelevant
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, STAGES[0], 3, 1, 1, bias=False)
        self.norm1 = norm(STAGES[0])
        stages = []
        width = STAGES[0]
        for k, channels in enumerate(STAGES):
            blocks = []
            for b in range(BLOCKS_PER_STAGE):
                stride = 2 if k > 0 and b == 0 else 1
                blocks.append(BasicBlock(width, channels, stride, norm))
                width = channels
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(STAGES[-1], num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class ResNet18BN(ResNet18):
    """ResNet-18 with BatchNorm (FedBN keeps its statistics and affine parameters local)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__(in_channels, num_classes, image_size, norm=batch_norm)
