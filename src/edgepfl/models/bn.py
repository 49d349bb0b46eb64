"""BatchNorm variants of the zoo's CNNs, for FedBN (Li et al., ICLR 2021).

FedBN's models put BatchNorm layers into the feature extractor; these mirror ``CNNSmall`` and ``CNN2`` layer for layer with that
addition, so FedBN can be compared with the plain models' FedAvg on the same backbone.
BatchNorm follows the convolutions only: a BatchNorm1d after a hidden FC layer fails in
training mode on a batch of one sample (``build_model``'s shape probe, or a last
mini-batch of one), and the convolutional statistics are where FedBN's feature shift
lives. ``features`` is the input of the classifier, as in the zoo, so feature-based methods
(MOON, FedProto) also work on them. This module imports nothing from ``zoo`` so that
``zoo`` can import it without a cycle.
"""

from __future__ import annotations

import torch
from torch import nn


class CNNSmallBN(nn.Module):
    """``CNNSmall`` (8x8 inputs) with BatchNorm after both convolutions."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        side = image_size // 2
        self.fc1 = nn.Linear(32 * side * side, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return torch.relu(self.fc1(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.features(x))


class CNN2BN(nn.Module):
    """``CNN2`` (28x28 inputs) with BatchNorm after both convolutions."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 5)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.bn2 = nn.BatchNorm2d(64)
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(64 * side * side, 512)
        self.fc2 = nn.Linear(512, 128)
        self.fc3 = nn.Linear(128, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        return torch.relu(self.fc2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.features(x))
