"""A data set as its loader reads it, before subsetting and normalisation: the one form
the built-in loaders (``data.datasets``) and the loaders of one's own files (``data.own``)
both end in, in a module of its own so that neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Raw:
    """Loader output before subsetting and normalisation (normalising last is cheaper)."""

    name: str
    x_train: np.ndarray  # uint8 or float, [n, C, H, W]
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: tuple[str, ...]
    mean: tuple[float, ...]  # per channel, in the units of x after dividing by `scale`
    std: tuple[float, ...]
    scale: float  # 255 for 8-bit images
    client_train: np.ndarray | None = None  # int64 [n], indices into `clients`
    client_test: np.ndarray | None = None
    clients: tuple[str, ...] = ()
    size_train: np.ndarray | None = None  # int16 [n, 2]: each image's own (height, width)
    size_test: np.ndarray | None = None
