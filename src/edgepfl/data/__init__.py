"""Data sets (in-memory tensors) and their split over simulated clients."""

from edgepfl.data.datasets import DATASETS, Dataset, dataset_of, load_dataset, resolve_data_root
from edgepfl.data.partition import SCHEMES, Partition, make_partition, partition_of

__all__ = [
    "DATASETS",
    "SCHEMES",
    "Dataset",
    "Partition",
    "dataset_of",
    "load_dataset",
    "make_partition",
    "partition_of",
    "resolve_data_root",
]
