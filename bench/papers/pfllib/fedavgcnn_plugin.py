"""edgepfl plug-in: PFLlib's FedAvgCNN for MNIST (system/flcore/trainmodel/models.py).

conv 5x5 32 (no padding) + ReLU + max-pool 2, conv 5x5 64 + ReLU + max-pool 2, FC 1024 ->
512 + ReLU, FC 512 -> classes: PFLlib's ``FedAvgCNN(in_features=1, num_classes=10,
dim=1024)``, written out again here (edgepfl does not import PFLlib). The module names are
PFLlib's, so the last parameterised layer (``fc``) is the head both projects personalise
in FedPer and FedRep; PFLlib's FedALA layer_idx counts tensors (weight and bias), so its
default 2 is ``fc`` alone, edgepfl's algorithm.layer_idx = 1.
"""
from __future__ import annotations

import torch
from torch import nn

from edgepfl.plugins import register_model


class FedAvgCNN(nn.Module):
    def __init__(self, channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2
        self.conv1 = nn.Sequential(nn.Conv2d(channels, 32, 5), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Linear(64 * side * side, 512), nn.ReLU(inplace=True))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc1(torch.flatten(self.conv2(self.conv1(x)), 1)))


register_model("pfllib_fedavgcnn", FedAvgCNN,
               "PFLlib's FedAvgCNN: 2 conv 5x5 (32, 64) unpadded + max-pool, FC 512, classifier")
