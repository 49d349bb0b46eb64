# Temporary: goes once the engine and bench/feature_loss.py import the modules below.
"""The training names the engine imports from here, now held by modules of their own."""

from edgepfl.algorithms.client_data import ClientData, TestData, eval_parts, sample_count
from edgepfl.algorithms.devices import select_device
from edgepfl.algorithms.features import tap_features
from edgepfl.algorithms.trainer import Trainer

__all__ = ["ClientData", "TestData", "Trainer", "eval_parts", "sample_count", "select_device",
           "tap_features"]
