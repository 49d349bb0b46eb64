"""Data sets (in-memory tensors) and their split over simulated clients."""

from edgepfl.data.datasets import DATASETS, Dataset, load_dataset, resolve_data_root
from edgepfl.data.partition import SCHEMES, Partition, make_partition

__all__ = [
    "DATASETS",
    "SCHEMES",
    "Dataset",
    "Partition",
    "load_dataset",
    "make_partition",
    "resolve_data_root",
]
