"""Data sets of one's own, read from ``dataset.path``: ``npz`` arrays, an ``imagefolder`` of
PNG/JPEG files, a Hugging Face ``hf`` folder written by ``save_to_disk``.

All three end in the loaders' common form (``data.raw.Raw``): inputs ``[n, C, H, W]`` and
integer labels, with each sample's client where the data names one (natural splits).
Choices, and why:

* Feature vectors ``[n, d]`` are stored as ``[n, d, 1, 1]``: d channels of a 1x1 image.
  Everything downstream (``Dataset.input_shape``, per-channel normalisation, batches,
  ``build_model(name, (C, H, W), classes)``) then takes them unchanged, the per-channel
  mean and std standardise each feature, and the ``mlp`` (whose first layer flattens
  C x H x W) is the model for them; a convolution over a 1x1 input is refused when the
  model is built.
* Images of several sizes are kept at their size: each sits at the top left of a canvas
  of the largest height and width, and its own size is recorded beside it. A client's
  view then carries each image's box, the form ``dataset.aspect_ratios`` crops take, so
  batches hold one size each and nothing is padded into a model's input. Only models for
  any input size take them (``models.zoo.VARIABLE_SIZE_MODELS``); ``dataset.resize``
  makes them one size for the others.
* Mean and std are the training split's, per channel, over the images' own pixels (not
  the canvas's padding). 8-bit images stay 8-bit and are normalised per batch, as the
  built-in image sets are.
* Without a test split of its own, a seeded share (``dataset.test_fraction``) is held out:
  of each client's samples when the data names clients (every client then tests on its
  own data), else of each class's. The draw's seed is fixed, not the run's, so every run
  seed tests on the same samples (as ``digits`` does).
* Nothing is unpickled: ``np.load(allow_pickle=False)``, Pillow for images, Arrow files for
  ``hf``.
"""

from __future__ import annotations

import io
import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from edgepfl.data.raw import Raw
from edgepfl.errors import ConfigError, DataError

log = logging.getLogger("edgepfl")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
NPZ_ARRAYS = ("x", "y", "x_test", "y_test", "client", "client_test", "classes")
_HOLDOUT_SEED = (0x4F57_4E44, 0x5445_5354)  # fixed: the test split is the data's, not a run's
_MAX_SIDE = np.iinfo(np.int16).max  # image sizes are kept as int16 beside the canvas


@dataclass(frozen=True)
class Source:
    """The settings a data set of one's own is read with (``dataset.*``)."""

    path: str | os.PathLike | None
    test_fraction: float = 0.2
    resize: int | None = None
    image_column: str = "image"
    label_column: str = "label"
    client_column: str | None = None


@dataclass
class _Split:
    """One split as read: inputs (an array ``[n, ...]`` or one ``[C, h, w]`` uint8 array per
    image), labels and clients as the source writes them (integers or names)."""

    x: np.ndarray | list[np.ndarray]
    y: np.ndarray
    client: np.ndarray | None
    where: str  # what the error messages call this split
    files: list[str] | None = None  # each image's file (or row), for error messages

    def take(self, keep: np.ndarray) -> _Split:
        rows = np.flatnonzero(keep).tolist()
        x = [self.x[i] for i in rows] if isinstance(self.x, list) else self.x[keep]
        client = None if self.client is None else self.client[keep]
        files = None if self.files is None else [self.files[i] for i in rows]
        return _Split(x, self.y[keep], client, self.where, files)


def load(name: str, source: Source) -> Raw:
    """Read data set ``name`` (npz, imagefolder or hf) from ``source.path``."""
    if source.path is None or str(source.path) == "":
        what = {"npz": "an .npz file", "imagefolder": "a folder of class folders",
                "hf": "a folder written by Hugging Face datasets' save_to_disk"}[name]
        raise ConfigError(f"dataset.name = {name!r} reads {what} from dataset.path, which is "
                          f"not set; e.g. --set dataset.path=path/to/{_example(name)}")
    path = Path(source.path).expanduser().absolute()
    if not path.exists():
        what = {"npz": "the .npz file (numpy.savez)", "imagefolder": "the folder of class folders",
                "hf": "the folder written by Hugging Face datasets' save_to_disk"}[name]
        raise DataError(f"dataset.path = {str(path)!r} does not exist; dataset.name = {name!r} "
                        f"reads {what} at dataset.path")
    test_fraction = float(source.test_fraction)
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"dataset.test_fraction must be in (0, 1), got {source.test_fraction!r}")
    if source.resize is not None and (isinstance(source.resize, bool) or source.resize < 1):
        raise ConfigError(f"dataset.resize must be a whole number of pixels >= 1, or unset; got "
                          f"{source.resize!r}")
    if name == "npz":
        if source.resize is not None:
            raise ConfigError(f"dataset.resize = {source.resize} resizes image files "
                              f"(imagefolder, hf image columns); npz arrays are used at their "
                              f"size: unset dataset.resize, or resize the arrays")
        train, test, classes = _read_npz(path)
    elif name == "imagefolder":
        train, test, classes = _read_imagefolder(path, source.resize)
    else:
        train, test, classes = _read_hf(path, source)
    return _assemble(name, path, train, test, classes, test_fraction)


def _example(name: str) -> str:
    return {"npz": "data.npz", "imagefolder": "images/", "hf": "hf_dataset/"}[name]


# --------------------------------------------------------------------------- common form


def _assemble(name: str, path: Path, train: _Split, test: _Split | None,
              class_names: tuple[str, ...] | None, test_fraction: float) -> Raw:
    if len(train.y) == 0:
        raise DataError(f"{train.where} holds no samples")
    if isinstance(train.x, list):
        both = [train] + ([] if test is None else [test])
        _same_channels([image for s in both for image in s.x],
                       [name for s in both for name in s.files or []])
    ytr, yte, classes = _label_indices(train, test, class_names)
    train.y = ytr
    if test is not None:
        test.y = cast(np.ndarray, yte)  # a test split in, its labels out
        if test.client is not None and train.client is None:
            raise DataError(f"{test.where} names each sample's client but {train.where} does "
                            f"not; give the training samples their clients too, or neither")
    ctr, cte, clients = _client_indices(train, test)
    train.client = ctr
    if test is None:
        held = _holdout(ctr if ctr is not None else ytr, ctr is not None, test_fraction)
        if not held.any():
            raise DataError(f"dataset.test_fraction = {test_fraction} of the {len(ytr)} samples "
                            f"of {path} holds none out for testing; raise it, or give a test "
                            f"split of your own")
        train, test = train.take(~held), train.take(held)
        test.where = f"the held-out share (dataset.test_fraction) of {train.where}"
    else:
        test.client = cte
    x_train, x_test, size_train, size_test = _inputs(train, test)
    scale = 255.0 if x_train.dtype == np.uint8 else 1.0
    mean, std = _channel_stats(x_train, size_train, scale)
    return Raw(name, x_train, train.y, x_test, test.y, classes, mean, std, scale,
                client_train=train.client, client_test=test.client, clients=clients,
                size_train=size_train, size_test=size_test)


def _label_indices(train: _Split, test: _Split | None, names: tuple[str, ...] | None
                   ) -> tuple[np.ndarray, np.ndarray | None, tuple[str, ...]]:
    """Labels as class indices 0..K-1 and the class names: integer labels are indices
    (named by ``names`` or by their number), string labels are class names (sorted)."""
    parts = [(train.y, train.where)] + ([] if test is None else [(test.y, test.where)])
    _check_labels(parts, names, train.where)
    kinds = {"text" if y.dtype.kind in "US" else "int" for y, _ in parts if y.size}
    if len(kinds) > 1:
        raise DataError(f"{train.where} and {parts[1][1]}: labels are integers in one and "
                        f"names in the other; use one kind for both")
    if kinds == {"text"}:
        out, names = _named_labels(parts, names)
    else:
        out, names = _numbered_labels(parts, names, train.where)
    if not names:
        raise DataError(f"{train.where}: no labels")
    return out[0], (out[1] if len(out) > 1 else None), tuple(names)


def _check_labels(parts: list[tuple[np.ndarray, str]], names: tuple[str, ...] | None,
                  where: str) -> None:
    """Refuse labels no class index can come from, and class names that repeat (one index
    would then stand for two classes)."""
    for y, split in parts:
        if y.ndim != 1:
            raise DataError(f"{split}: labels must be one per sample (shape [n]), got shape "
                            f"{list(y.shape)}")
        if y.size and y.dtype.kind not in "iuUS":
            raise DataError(f"{split}: labels of type {y.dtype} (e.g. {y.flat[0]!r}) are not "
                            f"integers; labels must be integer class indices 0..K-1 or class "
                            f"names (strings), e.g. y.astype(np.int64)")
    if names is not None:
        repeated = sorted({n for n in names if list(names).count(n) > 1})
        if repeated:
            raise DataError(f"{where}: class names {repeated} appear more than once in "
                            f"the classes {list(names)}; each class needs a name of its own")


def _named_labels(parts: list[tuple[np.ndarray, str]], names: tuple[str, ...] | None
                  ) -> tuple[list[np.ndarray], tuple[str, ...]]:
    """String labels as indices into ``names``, else into the sorted names that occur."""
    if names is None:
        names = tuple(str(v) for v in np.unique(np.concatenate([y.astype(str) for y, _ in parts])))
    lookup = {n: i for i, n in enumerate(names)}
    out = []
    for y, where in parts:
        text = y.astype(str)
        unknown = sorted(set(np.unique(text).tolist()) - set(lookup))
        if unknown:
            raise DataError(f"{where}: label {unknown[0]!r} is not one of the classes "
                            f"{list(names)}")
        out.append(np.array([lookup[v] for v in text.tolist()], dtype=np.int64))
    return out, names


def _numbered_labels(parts: list[tuple[np.ndarray, str]], names: tuple[str, ...] | None,
                     where: str) -> tuple[list[np.ndarray], tuple[str, ...]]:
    """Integer labels as they are; without ``names``, each class is named by its number."""
    out = [y.astype(np.int64) for y, _ in parts]
    for y, split in zip(out, (w for _, w in parts), strict=True):
        if y.size and int(y.min()) < 0:
            raise DataError(f"{split}: label {int(y.min())} is negative; labels are class "
                            f"indices 0..K-1")
    top = max((int(y.max()) for y in out if y.size), default=-1)
    if names is None:
        present = np.unique(np.concatenate(out)).size if top >= 0 else 0
        absent = top + 1 - present
        if absent > max(present, 100):
            # ids such as 1000, 2000 or hashes: K = top + 1 classes would build a
            # classifier of that width (and run out of memory for a large id)
            raise DataError(f"{where}: labels go up to {top} but only {present} "
                            f"distinct values occur, so {absent} of the {top + 1} classes "
                            "0..K-1 would have no sample; map them to 0..K-1 (labels, y = "
                            "np.unique(y, return_inverse=True)) or give them as strings "
                            "(class names)")
        names = tuple(str(c) for c in range(top + 1))
    elif top >= len(names):
        bad = next(split for y, (_, split) in zip(out, parts, strict=True)
                   if y.size and int(y.max()) == top)
        raise DataError(f"{bad}: label {top} has no class name; valid labels are "
                        f"0..{len(names) - 1} ({len(names)} classes named)")
    return out, names


def _client_indices(train: _Split, test: _Split | None
                    ) -> tuple[np.ndarray | None, np.ndarray | None, tuple[str, ...]]:
    """Client ids (integers or names) as indices into the sorted names of all clients."""
    if train.client is None:
        return None, None, ()
    parts = [(train.client, train.where)]
    if test is not None and test.client is not None:
        parts.append((test.client, test.where))
    for c, where in parts:
        if c.ndim != 1 or (c.size and c.dtype.kind not in "iuUS"):
            raise DataError(f"{where}: client ids must be one integer or string per sample, got "
                            f"{c.dtype} of shape {list(c.shape)}")
    if all(c.dtype.kind in "iu" for c, _ in parts):
        values = [c.astype(np.int64) for c, _ in parts]
    else:
        values = [c.astype(str) for c, _ in parts]
    names, inverse = np.unique(np.concatenate(values), return_inverse=True)
    inverse = inverse.astype(np.int64)
    n = len(values[0])
    return inverse[:n], (inverse[n:] if len(parts) > 1 else None), tuple(map(str, names))


def _holdout(groups: np.ndarray, per_client: bool, fraction: float) -> np.ndarray:
    """Which samples form the test split: a seeded ``fraction`` of each group's, rounded
    half up; a client of two or more samples keeps one of each kind, so it can train and
    be evaluated, while a class may be too small to lend the test split any."""
    n = groups.size
    rng = np.random.default_rng(_HOLDOUT_SEED)
    order = np.lexsort((rng.random(n), groups))  # grouped, random within each group
    _, counts = np.unique(groups, return_counts=True)
    k = np.floor(fraction * counts + 0.5).astype(np.int64)
    if per_client:
        k = np.where(counts >= 2, np.clip(k, 1, counts - 1), 0)
    else:
        k = np.minimum(k, counts - 1)
    rank = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    held = np.zeros(n, dtype=bool)
    held[order] = rank < np.repeat(k, counts)
    return held


def _inputs(train: _Split, test: _Split
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Both splits' inputs as ``[n, C, H, W]`` arrays of one channel count (images of
    several sizes on one canvas, with their sizes)."""
    if isinstance(train.x, list):
        canvas, sizes = _pack(train.x + test.x,
                              (train.files or []) + (test.files or []))
        n = len(train.x)
        return (canvas[:n], canvas[n:], None if sizes is None else sizes[:n],
                None if sizes is None else sizes[n:])
    x_train, x_test = np.asarray(train.x), np.asarray(test.x)
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{test.where} has inputs of shape {list(x_test.shape[1:])} but "
                        f"{train.where} has {list(x_train.shape[1:])}; both splits need one shape")
    return np.ascontiguousarray(x_train), np.ascontiguousarray(x_test), None, None


def _same_channels(images: Sequence[np.ndarray], files: Sequence[str]) -> None:
    first: dict[int, int] = {}
    for i, image in enumerate(images):
        first.setdefault(int(image.shape[0]), i)
    if len(first) > 1:
        (a, i), (b, j) = list(first.items())[:2]
        raise DataError(f"images with different channel counts: {files[i]} has {a}, "
                        f"{files[j]} has {b}; convert them to one mode (e.g. all RGB, or all "
                        f"grayscale)")


# a canvas this many times the images' own bytes, and at least _CANVAS_FLOOR, is refused
_CANVAS_RATIO, _CANVAS_FLOOR = 4, 1 << 30


def _pack(images: list[np.ndarray], files: Sequence[str] = ()
          ) -> tuple[np.ndarray, np.ndarray | None]:
    """``[n, C, H, W]`` uint8: the images stacked, or, when they differ in size, each at the
    top left of a canvas of the largest height and width, with its own ``[n, 2]`` size. A
    canvas that a few large images would make many times the images' own size (one
    6000x6000 photo among small ones) is refused, naming the largest, before it is made."""
    hw = np.array([image.shape[1:] for image in images], dtype=np.int64).reshape(-1, 2)
    height, width = (int(v) for v in hw.max(0))
    if max(height, width) > _MAX_SIDE:
        raise DataError(f"an image of {height}x{width} pixels is larger than {_MAX_SIDE} on a "
                        f"side; set dataset.resize")
    channels = int(images[0].shape[0])
    if (hw == hw[0]).all():
        return np.stack([np.asarray(image) for image in images]), None
    canvas_bytes = len(images) * channels * height * width
    own = int(channels * hw.prod(1).sum())
    if canvas_bytes >= max(_CANVAS_RATIO * own, _CANVAS_FLOOR):
        big = int(np.argmax(hw.prod(1)))
        name = files[big] if big < len(files) else f"image {big}"
        raise DataError(
            f"the images differ in size, and {name} ({height}x{width} pixels) would make every "
            f"image's canvas that large: {canvas_bytes / 2**30:.2f} GiB for {len(images)} "
            f"images whose own pixels take {own / 2**20:.1f} MiB; set dataset.resize (e.g. "
            "dataset.resize = 64), or resize or leave out the largest images")
    canvas = np.zeros((len(images), channels, height, width), dtype=np.uint8)
    for i, image in enumerate(images):
        canvas[i, :, : image.shape[1], : image.shape[2]] = image
    return canvas, hw.astype(np.int16)


def _channel_stats(x: np.ndarray, sizes: np.ndarray | None, scale: float
                   ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of ``x / scale`` over the images' own pixels, in two passes
    of float64 chunks (no float copy of the whole set; no cancellation in the variance).
    A constant channel gets std 1, so it normalises to 0 rather than to NaN."""
    channels = x.shape[1]

    def pieces():
        if sizes is None:
            for start in range(0, len(x), 1024):
                yield x[start:start + 1024].astype(np.float64) / scale
        else:
            for image, (h, w) in zip(x, sizes.tolist(), strict=True):
                yield image[None, :, :h, :w].astype(np.float64) / scale

    total = np.zeros(channels)
    count = 0
    for piece in pieces():
        total += piece.sum((0, 2, 3))
        count += piece.shape[0] * piece.shape[2] * piece.shape[3]
    mean = total / max(count, 1)
    squares = np.zeros(channels)
    for piece in pieces():
        squares += ((piece - mean[None, :, None, None]) ** 2).sum((0, 2, 3))
    std = np.sqrt(squares / max(count, 1))
    std = np.where(std > 1e-12, std, 1.0)
    return tuple(map(float, mean)), tuple(map(float, std))


# --------------------------------------------------------------------------- npz


def _read_npz(path: Path) -> tuple[_Split, _Split | None, tuple[str, ...] | None]:
    if path.is_dir():
        raise DataError(f"dataset.path = {str(path)!r} is a folder; dataset.name = 'npz' reads "
                        f"one .npz file (np.savez(path, x=..., y=...))")
    try:
        with path.open("rb") as f:
            magic = f.read(6)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if magic == b"\x93NUMPY":
        raise DataError(f"{path} is a single .npy array, not an .npz archive of named arrays; "
                        f"save with np.savez(path, x=..., y=...)")
    if not magic.startswith(b"PK"):  # anything else np.load would take for a pickle
        raise DataError(f"{path} is not a readable .npz file (an .npz is a zip of arrays, as "
                        f"np.savez writes it)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = list(archive.files)
            unknown = [n for n in names if n not in NPZ_ARRAYS]
            if unknown:
                raise DataError(f"{path} has array(s) {', '.join(map(repr, unknown))}; the "
                                f"arrays read are {', '.join(NPZ_ARRAYS)} (x and y required)")
            arrays = {n: archive[n] for n in names}
    except DataError:
        raise
    except ValueError as exc:  # object arrays: numpy refuses them without pickle
        raise DataError(f"{path}: {exc}; edgepfl never unpickles data, so store numeric or "
                        f"string arrays (no dtype=object)") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} is not a readable .npz file: {exc}") from None
    return _split_arrays(path, arrays)


def from_arrays(name: str, arrays: Mapping[str, np.ndarray], where: str,
                test_fraction: float = 0.2) -> Raw:
    """A data set from named arrays, as an npz file holds them (``NPZ_ARRAYS``: x and y,
    optionally x_test, y_test, client, client_test, classes): what a plug-in's data set
    loader returns. ``where`` names the source in errors."""
    if not isinstance(arrays, Mapping):
        raise DataError(f"{where} returned {type(arrays).__name__}; a loader returns a mapping "
                        f"of array names to arrays ({', '.join(NPZ_ARRAYS)}; x and y required)")
    unknown = [n for n in arrays if n not in NPZ_ARRAYS]
    if unknown:
        raise DataError(f"{where} gave array(s) {', '.join(map(repr, unknown))}; the arrays "
                        f"read are {', '.join(NPZ_ARRAYS)} (x and y required)")
    train, test, classes = _split_arrays(where, {k: np.asarray(v) for k, v in arrays.items()})
    return _assemble(name, Path(where), train, test, classes, test_fraction)


def _split_arrays(path: Path | str, arrays: dict[str, np.ndarray]
                  ) -> tuple[_Split, _Split | None, tuple[str, ...] | None]:
    missing = [n for n in ("x", "y") if n not in arrays]
    if missing:
        raise DataError(f"{path} has no array {missing[0]!r}; it needs x (inputs) and y "
                        f"(labels); it has {', '.join(arrays) or 'none'}")
    for a, b in (("x_test", "y_test"), ("y_test", "x_test"), ("client_test", "x_test"),
                 ("client_test", "client")):
        if a in arrays and b not in arrays:
            raise DataError(f"{path} has {a} but no {b}; a test split is x_test with y_test, "
                            f"and its clients (client_test) go with the training clients "
                            f"(client)")
    classes = None
    if "classes" in arrays:
        names = arrays["classes"]
        if names.ndim != 1 or names.dtype.kind not in "US" or not names.size:
            raise DataError(f"{path}: 'classes' must be a 1-D array of class names (strings), "
                            f"got {names.dtype} of shape {list(names.shape)}")
        classes = tuple(str(v) for v in names)
    train = _npz_split(path, arrays, "x", "y", "client")
    test = _npz_split(path, arrays, "x_test", "y_test", "client_test") if "x_test" in arrays else None
    return train, test, classes


def _npz_split(path: Path | str, arrays: dict[str, np.ndarray], xk: str, yk: str, ck: str
               ) -> _Split:
    where = f"{path} (arrays {xk}, {yk})"
    x, y = arrays[xk], arrays[yk]
    client = arrays.get(ck)
    x = _npz_inputs(x, f"{path}, array {xk!r}")
    for key, a in ((yk, y), (ck, client)):
        if a is not None and (a.ndim != 1 or len(a) != len(x)):
            raise DataError(f"{path}: {key!r} has shape {list(a.shape)} but {xk!r} has "
                            f"{len(x)} samples; give one value per sample")
    return _Split(x, y, client, where)


def _npz_inputs(x: np.ndarray, where: str) -> np.ndarray:
    """``[n, C, H, W]``: feature vectors ``[n, d]`` as ``[n, d, 1, 1]``, grayscale
    ``[n, H, W]`` as ``[n, 1, H, W]``; uint8 kept as pixels, other numbers as float32."""
    if x.dtype.kind not in "uif" or x.dtype == np.bool_:
        raise DataError(f"{where}: inputs of type {x.dtype}; give numbers (uint8 pixels, or "
                        f"integers or floats)")
    if x.ndim == 2:
        x = x[:, :, None, None]
    elif x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4:
        if x.shape[3] in (1, 3, 4) and x.shape[1] > 4:
            raise DataError(f"{where} has shape {list(x.shape)}, which looks channels-last "
                            f"[n, H, W, C]; inputs are [n, C, H, W]: np.moveaxis(x, -1, 1)")
    else:
        raise DataError(f"{where} has shape {list(x.shape)}; inputs are feature vectors "
                        f"[n, d], images [n, H, W] or [n, C, H, W]")
    if not len(x):
        raise DataError(f"{where} holds no samples (shape {list(x.shape)}); a data set needs "
                        "at least one sample per client")
    if x.dtype != np.uint8:
        x = x.astype(np.float32)
        bad = ~np.isfinite(x.reshape(len(x), -1)).all(1)
        if bad.any():
            raise DataError(f"{where}: sample {int(np.flatnonzero(bad)[0])} holds NaN or "
                            f"infinity ({int(bad.sum())} such samples)")
    if 0 in x.shape[1:]:
        raise DataError(f"{where} has shape {list(x.shape)}: no values per sample")
    return x


# --------------------------------------------------------------------------- image folders


def _read_imagefolder(path: Path, resize: int | None
                      ) -> tuple[_Split, _Split | None, tuple[str, ...] | None]:
    if not path.is_dir():
        raise DataError(f"dataset.path = {str(path)!r} is a file; dataset.name = 'imagefolder' "
                        f"reads a folder with one folder of images per class")
    top = {d.name for d in _folders(path)}
    if "train" in top and top <= {"train", "test"}:
        train = _scan(path / "train", resize)
        test = _scan(path / "test", resize) if "test" in top else None
    elif top == {"test"}:
        raise DataError(f"{path} has test/ but no train/; put the training images in "
                        f"{path / 'train'}, or the class folders directly in {path}")
    else:
        train, test = _scan(path, resize), None
    return train, test, None


def _folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir()
                  if p.is_file() and not p.name.startswith(".")
                  and p.suffix.lower() in IMAGE_SUFFIXES)


def _scan(root: Path, resize: int | None) -> _Split:
    """``root/<class>/*.png`` or ``root/<client>/<class>/*.png``, told apart by what the
    first level holds (images: classes; folders: clients); a mix is refused."""
    layout = f"{root}/<class>/<image>.png, or {root}/<client>/<class>/<image>.png"
    loose = _image_files(root)
    if loose:
        raise DataError(f"{loose[0]} lies directly in {root}; images go into one folder per "
                        f"class: {layout}")
    firsts = _folders(root)
    if not firsts:
        raise DataError(f"{root} holds no class folders; expected {layout}")
    kinds = {d: ("client" if _folders(d) else "class") for d in firsts}
    if len(set(kinds.values())) > 1:
        client = next(d for d, k in kinds.items() if k == "client")
        klass = next(d for d, k in kinds.items() if k == "class")
        raise DataError(f"{root} mixes class folders ({klass.name}/ holds images) and client "
                        f"folders ({client.name}/ holds folders); expected {layout}")
    files: list[Path] = []
    labels: list[str] = []
    skipped: list[Path] = []
    clients: list[str] | None = None if kinds[firsts[0]] == "class" else []
    for first in firsts:
        if clients is None:
            members = [(first, first.name)]
        else:
            members = [(d, d.name) for d in _folders(first)]
        for folder, label in members:
            if _folders(folder):
                raise DataError(f"{folder} holds folders; a class folder holds its images "
                                f"directly: {layout}")
            images = _image_files(folder)
            if not images:
                raise DataError(f"class folder {folder} holds no PNG or JPEG files "
                                f"({', '.join(IMAGE_SUFFIXES)}); add its images or remove it")
            skipped += sorted(p for p in folder.iterdir() if p.is_file()
                              and not p.name.startswith(".") and p not in images)
            files += images
            labels += [label] * len(images)
            if clients is not None:
                clients += [first.name] * len(images)
    if skipped:  # a .bmp or .webp sample left out of training is worth a word
        log.warning("%s: %d file(s) that are not PNG or JPEG (%s) are not read, e.g. %s",
                    root, len(skipped), ", ".join(IMAGE_SUFFIXES),
                    ", ".join(str(p.relative_to(root)) for p in skipped[:3]))
    x = [_decode(f, str(f), resize) for f in files]
    return _Split(x, np.array(labels), None if clients is None else np.array(clients), str(root),
                  [str(f) for f in files])


def _decode(source: Any, name: str, resize: int | None) -> np.ndarray:
    """One image file (a path, or its bytes) as ``[C, h, w]`` uint8; what Pillow cannot
    decode is a DataError naming the file."""
    from PIL import Image

    try:
        with Image.open(source) as image:
            image.load()
            if image.mode == "1":
                image = image.convert("L")
            elif image.mode in ("P", "PA", "CMYK", "YCbCr", "LAB", "HSV"):
                image = image.convert("RGBA" if "transparency" in image.info
                                      or image.mode == "PA" else "RGB")
            elif image.mode not in ("L", "LA", "RGB", "RGBA"):
                raise DataError(f"{name} is a {image.mode} image (more than 8 bits per value); "
                                f"save it as 8-bit grayscale or RGB")
            if resize is not None:
                image = image.resize((resize, resize), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.uint8)
    except DataError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise DataError(f"{name} does not decode as an image ({type(exc).__name__}: {exc}); "
                        f"replace or remove it") from None
    pixels = pixels[None] if pixels.ndim == 2 else np.moveaxis(pixels, -1, 0)
    return np.ascontiguousarray(pixels)


# --------------------------------------------------------------------------- Hugging Face


def _read_hf(path: Path, source: Source
             ) -> tuple[_Split, _Split | None, tuple[str, ...] | None]:
    try:
        import datasets
    except ImportError:
        raise ConfigError("dataset.name = 'hf' reads a folder written by Hugging Face "
                          "datasets' save_to_disk and needs that package: "
                          "pip install 'edgepfl[hf]'") from None
    if not path.is_dir():
        raise DataError(f"dataset.path = {str(path)!r} is a file; dataset.name = 'hf' reads the "
                        f"folder that Dataset.save_to_disk or DatasetDict.save_to_disk wrote")
    try:
        data = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(f"{path} is not a folder written by Hugging Face datasets' save_to_disk "
                        f"({exc})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{path} holds the splits {', '.join(data)}; a 'train' split is read "
                            f"(and 'test' when there is one)")
        train, test = data["train"], data.get("test")
    else:
        train, test = data, None
    columns = (source.image_column, source.label_column, source.client_column)
    names = _hf_class_names(train.features.get(source.label_column))
    splits = [_hf_split(ds, path / split, columns, source.resize)
              for ds, split in ((train, "train"), (test, "test")) if ds is not None]
    return splits[0], (splits[1] if len(splits) > 1 else None), names


def _hf_class_names(feature: Any) -> tuple[str, ...] | None:
    names = getattr(feature, "names", None)  # a ClassLabel names its classes
    return tuple(map(str, names)) if names else None


def _hf_split(ds: Any, where: Path, columns: tuple[str, str, str | None],
              resize: int | None) -> _Split:
    import datasets

    image_col, label_col, client_col = columns
    settings = {image_col: "dataset.image_column", label_col: "dataset.label_column"}
    if client_col is not None:
        settings[client_col] = "dataset.client_column"
    for column, setting in settings.items():
        if column not in ds.column_names:
            raise DataError(f"{setting} = {column!r} is not a column of {where}; its columns "
                            f"are {', '.join(ds.column_names)}")
    files = None
    if isinstance(ds.features[image_col], datasets.Image):
        raw = ds.cast_column(image_col, datasets.Image(decode=False))[image_col]
        files = [_hf_name(item, f"{where}, row {i}") for i, item in enumerate(raw)]
        x: np.ndarray | list[np.ndarray] = [_hf_image(item, name, resize)
                                            for item, name in zip(raw, files, strict=True)]
    else:
        if resize is not None:
            raise ConfigError(f"dataset.resize = {resize} resizes image files, but column "
                              f"{image_col!r} of {where} holds arrays; unset dataset.resize")
        try:
            values = ds.with_format("numpy")[image_col]
            x = np.asarray(values)
        except (ValueError, TypeError) as exc:
            raise DataError(f"{where}: column {image_col!r} does not form one array ({exc}); "
                            f"its rows need one shape") from None
        if x.dtype == object:
            raise DataError(f"{where}: column {image_col!r} holds rows of different shapes or "
                            f"types; give every row one shape, or store images (datasets.Image)")
        x = _npz_inputs(x, f"{where}, column {image_col!r}")
    y = np.asarray(ds[label_col])
    client = None if client_col is None else np.asarray(ds[client_col])
    return _Split(x, y, client, str(where), files)


def _hf_name(item: Any, where: str) -> str:
    path = item.get("path") if isinstance(item, dict) else None
    return f"{where} ({path})" if path else where


def _hf_image(item: Any, name: str, resize: int | None) -> np.ndarray:
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            return _decode(io.BytesIO(item["bytes"]), name, resize)
        if item.get("path"):
            return _decode(item["path"], name, resize)
    raise DataError(f"{name}: no image (neither bytes nor a path)")
