"""Image classification data sets as in-memory tensors.

Every data set is small enough to live in memory as one tensor, so a simulation indexes
it directly instead of going through a ``DataLoader``; that is what keeps a hundred
simulated clients fast. Images read from 8-bit files stay 8-bit (a quarter of float32's
memory, shared by forked worker processes) and are normalised per batch as it is cut
(``Normalise``), with the arithmetic the whole-array conversion would do, so values are
bit for bit the same. Files are read with plain numpy from their original
distribution formats, so no torchvision is needed, and nothing is executed from a data
file (the one pickle format is read with an allowlist, see ``_NumpyOnlyUnpickler``).
Data sets of one's own (``npz``, ``imagefolder``, ``hf``: ``data.own``) end in the same
form, feature vectors included (``[n, d]`` stored as ``[n, d, 1, 1]``).
"""

from __future__ import annotations

import gzip
import importlib
import math
import os
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import edgepfl.data.own as own
from edgepfl.config import DatasetConfig

# The loaders call the download by this module's name: the one seam tests replace to stay
# offline (and the loaders' ``download`` flag would shadow the plain name).
from edgepfl.data.downloads import download as _download
from edgepfl.data.downloads import extract_tarball, md5_matches
from edgepfl.data.raw import Raw
from edgepfl.errors import ConfigError, DataError, EdgepflError
from edgepfl.registered import DataSource, origin

DATA_ENV = "EDGEPFL_DATA"
NO_DOWNLOAD_ENV = "EDGEPFL_NO_DOWNLOAD"

DATASETS: dict[str, str] = {
    "mnist": "MNIST handwritten digits, 1x28x28, 10 classes, 60,000 train / 10,000 test",
    "fmnist": "Fashion-MNIST clothing, 1x28x28, 10 classes, 60,000 train / 10,000 test",
    "cifar10": "CIFAR-10 natural images, 3x32x32, 10 classes, 50,000 train / 10,000 test",
    "cifar100": "CIFAR-100 natural images, 3x32x32, 100 fine classes, 50,000 train / 10,000 test",
    "digits": "scikit-learn's bundled 8x8 digits, 1x8x8, 10 classes, 1,347 train / 450 test "
    "(no download)",
    "synthetic": "seeded Gaussian class patterns, 1x8x8, 10 classes, 2,000 train / 500 test "
    "(no files; for tests and quick runs)",
    "npz": "your own arrays at dataset.path: x (images [n, H, W] or [n, C, H, W], or feature "
    "vectors [n, d]), y; optionally x_test, y_test, client, client_test, classes",
    "imagefolder": "your own PNG/JPEG files at dataset.path: <class>/*.png, optionally under "
    "train/ and test/, or <client>/<class>/*.png for natural client splits",
    "hf": "a Hugging Face datasets folder (save_to_disk) at dataset.path, with "
    "dataset.image_column, label_column, client_column (pip install 'edgepfl[hf]')",
}

# Read from dataset.path, with the split and shape settings of the dataset section.
OWN_DATASETS = ("npz", "imagefolder", "hf")
# Data sets that plug-ins register (``edgepfl.plugins.register_dataset``): name -> loader.
PLUGIN_LOADERS: dict[str, Callable] = {}


@dataclass(frozen=True, eq=False)
class Normalise:
    """8-bit pixels to the model's input: ``(x / scale - mean) / std`` per channel."""

    mul: torch.Tensor  # [1, C, 1, 1] float32, 1 / (scale * std)
    sub: torch.Tensor  # [1, C, 1, 1] float32, mean / std

    @classmethod
    def of(cls, mean: tuple[float, ...], std: tuple[float, ...], scale: float) -> Normalise:
        m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        return cls(1.0 / (scale * s), m / s)

    def to(self, device: torch.device) -> Normalise:
        """The same normalisation for batches on ``device``."""
        return Normalise(self.mul.to(device), self.sub.to(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """A fresh float32 batch (one multiply and one subtract, in place on the copy)."""
        return x.to(torch.float32).mul_(self.mul).sub_(self.sub)


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value for ==
class Dataset:
    """A whole data set in memory; clients see it only through index tensors.

    ``x_train``/``x_test`` are what is stored: uint8 pixels with ``norm`` for data sets
    read from image files, float32 inputs (``norm`` None) for the others. Model inputs
    come from ``images`` (or a ``ClientData`` view, which applies ``norm`` per batch).
    """

    name: str
    x_train: torch.Tensor  # [n, C, H, W], contiguous: uint8 pixels, or float32 inputs
    y_train: torch.Tensor  # int64 [n]
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    classes: tuple[str, ...]
    norm: Normalise | None = None
    # Natural client splits: each sample's client (an index into ``clients``), from the data.
    client_train: torch.Tensor | None = None  # int64 [n]
    client_test: torch.Tensor | None = None  # None: the test split names no clients
    clients: tuple[str, ...] = ()
    # Images of several sizes, each at the top left of a [C, H, W] canvas of the largest
    # height and width: its own (height, width), int16 [n, 2]; None when all fill it.
    size_train: torch.Tensor | None = None
    size_test: torch.Tensor | None = None

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the stored inputs: a feature vector of d values is (d, 1, 1); images
        of several sizes give their canvas (``sizes`` lists their own)."""
        c, h, w = self.x_train.shape[1:]
        return int(c), int(h), int(w)

    @property
    def variable_size(self) -> bool:
        return self.size_train is not None

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """The distinct (height, width) of the images, sorted."""
        if self.size_train is None or self.size_test is None:
            return [self.input_shape[1:]]
        both = torch.cat([self.size_train, self.size_test]).to(torch.int64)
        return sorted(map(tuple, torch.unique(both, dim=0).tolist()))

    def boxes(self, split: str, idx: torch.Tensor) -> torch.Tensor | None:
        """``[k, 4]`` int16 boxes (top, left, height, width) of images ``idx`` of ``split``:
        each whole image inside the canvas, the form ``ClientData`` cuts crops in; None when
        every image fills the canvas."""
        sizes = self.size_train if split == "train" else self.size_test
        if sizes is None:
            return None
        hw = sizes.index_select(0, idx)
        return torch.cat([torch.zeros_like(hw), hw], 1)

    def images(self, split: str, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Model inputs (float32, normalised) of ``split`` ('train' or 'test'), all or
        ``idx``; a fresh tensor when the data set is stored as pixels."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        x = self.x_train if split == "train" else self.x_test
        x = x if idx is None else x.index_select(0, idx)
        return x if self.norm is None else self.norm(x)


def resolve_data_root(root: str | os.PathLike | None) -> Path:
    """Where data files live: the explicit setting, else ``$EDGEPFL_DATA``, else ``./data``.

    Absolute, so that error messages tell the user exactly where files were looked for.
    """
    if root is not None and str(root) != "":
        path = Path(root)
    elif os.environ.get(DATA_ENV):
        path = Path(os.environ[DATA_ENV])
    else:
        path = Path("data")
    return path.expanduser().absolute()


def load_dataset(
    name: str,
    root: str | os.PathLike | None = None,
    fraction: float = 1.0,
    seed: int = 0,
    download: bool = True,
    *,
    path: str | os.PathLike | None = None,
    test_fraction: float = 0.2,
    resize: int | None = None,
    image_column: str = "image",
    label_column: str = "label",
    client_column: str | None = None,
) -> Dataset:
    """Load a data set by name; ``fraction`` keeps a seeded random share of train and test.

    The keyword arguments are the settings of data sets of one's own (``npz``,
    ``imagefolder``, ``hf``), read from ``path``; the built-in sets refuse ``path`` and
    ``resize`` rather than ignore them.
    """
    key = str(name).strip().lower()
    if key not in DATASETS:
        raise ConfigError(f"unknown data set {name!r}; choose one of: {', '.join(DATASETS)}")
    try:
        share = float(fraction)
    except (TypeError, ValueError):
        share = math.nan
    if isinstance(fraction, bool) or not (0.0 < share <= 1.0):  # the comparison rejects NaN
        raise ConfigError(f"dataset fraction must be a number in (0, 1], got {fraction!r}")
    if key in OWN_DATASETS:
        raw = own.load(key, own.Source(path, test_fraction, resize, image_column, label_column,
                                       client_column))
        return _finish(raw, share, int(seed))
    if key in PLUGIN_LOADERS:
        where = f"data set {key!r} of plug-in {origin('dataset', key)!r}"
        try:
            arrays = PLUGIN_LOADERS[key](DataSource(resolve_data_root(root),
                                                    None if path is None else str(path), int(seed)))
        except EdgepflError:
            raise
        except Exception as exc:  # the plug-in's code: say whose it is (the cause is chained)
            raise DataError(f"{where}: its loader failed: {type(exc).__name__}: {exc}") from exc
        raw = own.from_arrays(key, arrays, where, test_fraction)
        return _finish(raw, share, int(seed))
    for setting, value in (("path", path), ("resize", resize)):
        if value is not None:
            raise ConfigError(
                f"dataset.{setting} = {value!r} is read by the data sets of your own "
                f"({', '.join(OWN_DATASETS)}), not by {key!r}, which is read from "
                f"dataset.root; unset it, or set dataset.name to one of them")
    loader = _LOADERS[key]
    allow_download = bool(download) and not _env_flag(NO_DOWNLOAD_ENV)
    raw = loader(resolve_data_root(root), allow_download, int(seed))
    return _finish(raw, share, int(seed))


def dataset_of(cfg: DatasetConfig, seed: int) -> Dataset:
    """The data set a run's ``dataset`` settings name (every runtime loads it this way)."""
    data = load_dataset(cfg.name, cfg.root, cfg.fraction, seed, cfg.download, path=cfg.path,
                        test_fraction=cfg.test_fraction, resize=cfg.resize,
                        image_column=cfg.image_column, label_column=cfg.label_column,
                        client_column=cfg.client_column)
    if cfg.aspect_ratios and data.variable_size:
        # a crop's size follows from its ratio and its image's size: one ratio would be
        # as many input sizes as there are image sizes
        raise ConfigError(
            f"dataset.aspect_ratios = {cfg.aspect_ratios} crops images of one size, but the "
            f"images at dataset.path = {cfg.path!r} come in {len(data.sizes)} sizes; set "
            f"dataset.resize (e.g. 32) to crop them, or unset aspect_ratios to see each whole")
    if cfg.aspect_ratios and data.input_shape[1:] == (1, 1):
        raise ConfigError(
            f"dataset.aspect_ratios = {cfg.aspect_ratios} crops images, but data set "
            f"{cfg.name!r} holds feature vectors (stored as {data.input_shape[0]} channels of "
            f"1x1); unset dataset.aspect_ratios")
    return data


# --------------------------------------------------------------------------- shared steps


def _finish(raw: Raw, fraction: float, seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(int(seed))
    train_idx = _subset(len(raw.y_train), fraction, gen)
    test_idx = _subset(len(raw.y_test), fraction, gen)
    pixels = raw.x_train.dtype == np.uint8
    norm = Normalise.of(raw.mean, raw.std, raw.scale) if pixels else None
    return Dataset(
        name=raw.name,
        x_train=_inputs(raw.x_train, train_idx, raw),
        y_train=_labels(raw.y_train, train_idx),
        x_test=_inputs(raw.x_test, test_idx, raw),
        y_test=_labels(raw.y_test, test_idx),
        num_classes=len(raw.classes),
        classes=raw.classes,
        norm=norm,
        client_train=_maybe(raw.client_train, train_idx, torch.int64),
        client_test=_maybe(raw.client_test, test_idx, torch.int64),
        clients=raw.clients,
        size_train=_maybe(raw.size_train, train_idx, torch.int16),
        size_test=_maybe(raw.size_test, test_idx, torch.int16),
    )


def _maybe(a: np.ndarray | None, idx: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
    if a is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(a if idx is None else a[idx])).to(dtype)


def _subset(n: int, fraction: float, gen: torch.Generator) -> np.ndarray | None:
    if fraction >= 1.0 or n == 0:
        return None
    keep = max(1, min(n, round(fraction * n)))
    # Sorted so the subset keeps the file order (and memory locality) of the original.
    return np.sort(torch.randperm(n, generator=gen)[:keep].numpy())


def _inputs(x: np.ndarray, idx: np.ndarray | None, raw: Raw) -> torch.Tensor:
    """8-bit pixels as they are (normalised per batch), anything else normalised here."""
    picked = np.ascontiguousarray(x if idx is None else x[idx])
    if picked.dtype == np.uint8:
        # a file's bytes are read-only; tensors are assumed writable
        return torch.from_numpy(picked if picked.flags.writeable else picked.copy())
    return Normalise.of(raw.mean, raw.std, raw.scale)(torch.from_numpy(picked)).contiguous()


def _labels(y: np.ndarray, idx: np.ndarray | None) -> torch.Tensor:
    picked = y if idx is None else y[idx]
    return torch.from_numpy(np.ascontiguousarray(picked, dtype=np.int64))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


# --------------------------------------------------------------------------- missing files


def _missing_error(
    title: str, missing: list[Path], root: Path, download: bool, failures: list[str], hint: str
) -> DataError:
    lines = [f"{title}: {len(missing)} file(s) missing:"]
    lines += [f"  {path}" for path in missing]
    if failures:
        lines.append("Download failed:")
        lines += [f"  {reason}" for reason in failures]
    elif not download:
        why = (
            f"{NO_DOWNLOAD_ENV} is set"
            if _env_flag(NO_DOWNLOAD_ENV)
            else "dataset.download is false"
        )
        lines.append(f"Download was not attempted ({why}).")
    if hint:
        lines.append(hint)
    lines.append(
        f"Put the files at the paths above, or point the data directory (now {root}) at a "
        f"folder that has them with the setting dataset.root or the environment variable "
        f"{DATA_ENV}."
    )
    return DataError("\n".join(lines))


# --------------------------------------------------------------------------- MNIST family

_IDX_IMAGES, _IDX_LABELS = 2051, 2049
_MNIST_FILES = {  # name -> md5 of the gzip file as distributed
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
_FMNIST_FILES = {
    "train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310",
}
_FMNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """One IDX file (gzip or not) as a read-only uint8 array, with its header checked."""
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {path}: {exc}; delete it and fetch it again") from exc
    kind = "images" if magic == _IDX_IMAGES else "labels"
    ndim = 3 if magic == _IDX_IMAGES else 1
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path} is not an IDX {kind} file: only {len(data)} bytes")
    got = int.from_bytes(data[:4], "big")
    if got != magic:
        raise DataError(
            f"{path} is not an IDX {kind} file: magic number {got}, expected {magic}; "
            f"the file is corrupt or not what its name says"
        )
    dims = [int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4)]
    if len(data) != header + math.prod(dims):
        raise DataError(
            f"{path} is truncated or corrupt: its header says {dims[0]} {kind} of shape "
            f"{dims[1:]} ({header + math.prod(dims)} bytes) but it has {len(data)} bytes"
        )
    return np.frombuffer(data, np.uint8, offset=header).reshape(dims)


def _find_or_fetch(
    directory: Path, names: dict[str, str], base_url: str, download: bool
) -> tuple[dict[str, Path], list[Path], list[str]]:
    """Locate ``name.gz`` or ``name`` for each file, downloading the missing ``.gz`` ones."""
    found: dict[str, Path] = {}
    failures: list[str] = []
    for name, md5 in names.items():
        candidates = (directory / f"{name}.gz", directory / name)
        path = next((p for p in candidates if p.is_file()), None)
        if path is None and download:
            try:
                _download(f"{base_url}{name}.gz", candidates[0], md5)
                path = candidates[0]
            except DataError as exc:
                failures.append(str(exc))
        if path is not None:
            found[name] = path
    missing = [directory / f"{name}.gz" for name in names if name not in found]
    return found, missing, failures


def _load_idx_set(
    name: str,
    root: Path,
    download: bool,
    folder: str,
    files: dict[str, str],
    base_url: str,
    classes: tuple[str, ...],
    mean: float,
    std: float,
) -> Raw:
    directory = root / folder / "raw"
    found, missing, failures = _find_or_fetch(directory, files, base_url, download)
    if missing:
        raise _missing_error(
            f"{name} is not in {directory}",
            missing,
            root,
            download,
            failures,
            "Each file may also be stored un-gzipped under the same name without '.gz'.",
        )
    arrays = {}
    for split in ("train", "t10k"):
        x = _read_idx(found[f"{split}-images-idx3-ubyte"], _IDX_IMAGES)
        y = _read_idx(found[f"{split}-labels-idx1-ubyte"], _IDX_LABELS)
        if len(x) != len(y):
            raise DataError(
                f"{found[f'{split}-images-idx3-ubyte']} has {len(x)} images but "
                f"{found[f'{split}-labels-idx1-ubyte']} has {len(y)} labels"
            )
        if y.size and int(y.max()) >= len(classes):
            raise DataError(
                f"{found[f'{split}-labels-idx1-ubyte']} has label {int(y.max())}, "
                f"valid labels are 0..{len(classes) - 1}"
            )
        arrays[split] = (x[:, None], y)
    return Raw(name, *arrays["train"], *arrays["t10k"], classes, (mean,), (std,), scale=255.0)


def _load_mnist(root: Path, download: bool, seed: int) -> Raw:
    return _load_idx_set(
        "mnist", root, download, "MNIST", _MNIST_FILES,
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        tuple(str(d) for d in range(10)), 0.1307, 0.3081,
    )  # fmt: skip


def _load_fmnist(root: Path, download: bool, seed: int) -> Raw:
    return _load_idx_set(
        "fmnist", root, download, "FashionMNIST", _FMNIST_FILES,
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        _FMNIST_CLASSES, 0.2860, 0.3530,
    )  # fmt: skip


# --------------------------------------------------------------------------- CIFAR

_CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
_CIFAR100_CLASSES = tuple(
    """apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus
    butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch
    crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo
    keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree motorcycle mountain mouse
    mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain plate poppy
    porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper
    snail snake spider squirrel streetcar sunflower sweet_pepper table tank telephone television
    tiger tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm""".split()
)
assert len(_CIFAR100_CLASSES) == 100

_PIXELS = 3 * 32 * 32


@dataclass(frozen=True)
class _CifarSpec:
    name: str
    classes: tuple[str, ...]
    label_bytes: int  # binary records: CIFAR-100 stores (coarse, fine) before the pixels
    bin_dir: str
    bin_train: tuple[str, ...]
    bin_test: str
    py_dir: str
    py_train: tuple[str, ...]
    py_test: str
    py_label_key: str
    url: str
    md5: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


_CIFAR10 = _CifarSpec(
    "cifar10", _CIFAR10_CLASSES, 1,
    "cifar-10-batches-bin", tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test_batch.bin",
    "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch",
    "labels",
    "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz", "c32a1d4ab5d03f1284b67883e8d87530",
    (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
)  # fmt: skip
_CIFAR100 = _CifarSpec(
    "cifar100", _CIFAR100_CLASSES, 2,
    "cifar-100-binary", ("train.bin",), "test.bin",
    "cifar-100-python", ("train",), "test",
    "fine_labels",
    "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz", "03b5dce01913d631647c71ecec9e9cb8",
    (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
)  # fmt: skip


def _import_attr(modules: tuple[str, ...], name: str) -> object:
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {modules} has {name}")


def _allowed_globals() -> dict[tuple[str, str], object]:
    # numpy 2 moved numpy.core to numpy._core; batches pickled by either name must load.
    reconstruct = _import_attr(("numpy._core.multiarray", "numpy.core.multiarray"), "_reconstruct")
    frombuffer = _import_attr(("numpy._core.numeric", "numpy.core.numeric"), "_frombuffer")
    allowed: dict[tuple[str, str], object] = {("numpy", "ndarray"): np.ndarray}
    allowed[("numpy", "dtype")] = np.dtype
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        allowed[(module, "_reconstruct")] = reconstruct
    for module in ("numpy._core.numeric", "numpy.core.numeric"):
        # Protocol-5 pickles of arrays (a batch re-saved by Python 3) use _frombuffer.
        allowed[(module, "_frombuffer")] = frombuffer
    return allowed


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler for CIFAR's python batches that can build numpy arrays and nothing else.

    Unpickling runs code only by calling globals that the stream names (``os.system``,
    ``builtins.eval``, ...), and every such lookup goes through ``find_class``. Allowing only
    numpy's array reconstructors, ``ndarray`` and ``dtype`` -- callables that build arrays
    from bytes and touch nothing outside them -- means a tampered file can at worst yield
    wrong data, which the checks after loading catch, never execute anything.
    """

    def __init__(self, file, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self._path = path
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Callable | type:
        try:
            return self._allowed[(module, name)]  # type: ignore[return-value]
        except KeyError:
            raise DataError(
                f"{self._path}: refusing to unpickle {module}.{name}; a CIFAR batch only "
                f"needs numpy arrays, so this file is corrupt or was tampered with"
            ) from None

    def persistent_load(self, pid: object) -> object:
        raise DataError(f"{self._path}: refusing a persistent id in the pickle stream")


def _get(batch: dict, key: str) -> object:
    # Original batches were pickled by Python 2 and load with bytes keys; re-saved ones may not.
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise KeyError(key)


def _read_cifar_py(path: Path, spec: _CifarSpec) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as f:
            batch = _NumpyOnlyUnpickler(f, path).load()
    except DataError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as exc:
        raise DataError(f"cannot read CIFAR batch {path}: {exc}") from exc
    try:
        if not isinstance(batch, dict):
            raise TypeError(f"expected a dict, got {type(batch).__name__}")
        data = _get(batch, "data")
        labels = np.asarray(_get(batch, spec.py_label_key))
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            raise TypeError("b'data' is not a uint8 array")
        data = data.reshape(len(data), -1)
        if data.shape[1] != _PIXELS or labels.shape != (len(data),):
            raise ValueError(f"data {data.shape} and labels {labels.shape} do not match")
        if labels.dtype.kind not in "iu":
            raise TypeError(f"labels of type {labels.dtype}")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path} is not a {spec.name} python batch: {exc}") from exc
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _read_cifar_bin(path: Path, spec: _CifarSpec) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as exc:
        raise DataError(f"cannot read CIFAR batch {path}: {exc}") from exc
    record = spec.label_bytes + _PIXELS
    if raw.size == 0 or raw.size % record:
        raise DataError(
            f"{path} is not a {spec.name} binary batch: {raw.size} bytes is not a multiple of "
            f"the {record}-byte record size"
        )
    rows = raw.reshape(-1, record)
    labels = rows[:, spec.label_bytes - 1].astype(np.int64)  # last label byte: the fine label
    return rows[:, spec.label_bytes :].reshape(-1, 3, 32, 32), labels


def _load_cifar(spec: _CifarSpec, root: Path, download: bool) -> Raw:
    bin_dir, py_dir = root / spec.bin_dir, root / spec.py_dir
    bin_files = [bin_dir / f for f in (*spec.bin_train, spec.bin_test)]
    py_files = [py_dir / f for f in (*spec.py_train, spec.py_test)]
    failures: list[str] = []
    if not all(p.is_file() for p in bin_files) and not all(p.is_file() for p in py_files):
        # An archive already in root (put there by hand, or a download whose extraction was
        # interrupted) is used without any network access.
        archive = root / spec.url.rsplit("/", 1)[1]
        try:
            verified = archive.is_file() and md5_matches(archive, spec.md5)
            if not verified and download:
                _download(spec.url, archive, spec.md5)
                verified = True
            if verified:
                extract_tarball(archive, root, spec.bin_dir)
            elif archive.is_file():
                failures.append(f"{archive} is there but its md5 is not {spec.md5}; ignored")
        except DataError as exc:
            failures.append(str(exc))
    if all(p.is_file() for p in bin_files):
        reader, files = _read_cifar_bin, bin_files
    elif all(p.is_file() for p in py_files):
        reader, files = _read_cifar_py, py_files
    else:
        raise _missing_error(
            f"{spec.name} is not in {root}",
            [p for p in bin_files if not p.is_file()],
            root,
            download,
            failures,
            f"The binary version is expected ({spec.url}, extracted into {root}); the python "
            f"version in {py_dir} ({', '.join(p.name for p in py_files)}) works too.",
        )
    parts = [reader(path, spec) for path in files]
    for path, (_, y) in zip(files, parts, strict=True):
        bad = y[(y < 0) | (y >= len(spec.classes))]
        if bad.size:
            raise DataError(
                f"{path} has label {int(bad[0])}, valid labels are 0..{len(spec.classes) - 1}"
            )
    train = parts[:-1]
    x_train = np.concatenate([x for x, _ in train]) if len(train) > 1 else train[0][0]
    y_train = np.concatenate([y for _, y in train]) if len(train) > 1 else train[0][1]
    x_test, y_test = parts[-1]
    return Raw(
        spec.name, x_train, y_train, x_test, y_test, spec.classes, spec.mean, spec.std, 255.0
    )


def _load_cifar10(root: Path, download: bool, seed: int) -> Raw:
    return _load_cifar(_CIFAR10, root, download)


def _load_cifar100(root: Path, download: bool, seed: int) -> Raw:
    return _load_cifar(_CIFAR100, root, download)


# --------------------------------------------------------------------------- built-in sets


def _load_digits(root: Path, download: bool, seed: int) -> Raw:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.images.astype(np.float32)[:, None] / 16.0
    y = bunch.target.astype(np.int64)
    # The split seed is fixed so every run, whatever its seed, evaluates on the same 25%.
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, stratify=y, random_state=0)
    mean, std = float(x_tr.mean()), float(x_tr.std())
    return Raw(
        "digits", x_tr, y_tr, x_te, y_te, tuple(str(d) for d in range(10)), (mean,), (std,), 1.0
    )


_SYN_CLASSES, _SYN_TRAIN, _SYN_TEST, _SYN_NOISE = 10, 2000, 500, 1.25


def _load_synthetic(root: Path, download: bool, seed: int) -> Raw:
    """Smooth random class patterns, randomly shifted and scaled, under Gaussian noise.

    The noise level (1.25 x the pattern's RMS) was chosen so a small CNN reaches roughly
    85-95% test accuracy: hard enough that algorithms differ, never a trivial 100%.
    """
    from scipy.ndimage import gaussian_filter

    rng = np.random.default_rng([int(seed) % 2**64, 0x5359_4E54])
    protos = gaussian_filter(
        rng.standard_normal((_SYN_CLASSES, 8, 8)), sigma=(0, 1, 1), mode="wrap"
    )
    protos /= protos.std(axis=(1, 2), keepdims=True)
    shifted = np.stack(
        [np.roll(protos, (dy, dx), axis=(1, 2)) for dy in (-1, 0, 1) for dx in (-1, 0, 1)], 1
    )

    def draw(per_class: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.permutation(np.repeat(np.arange(_SYN_CLASSES), per_class))
        shift = rng.integers(0, shifted.shape[1], y.size)
        amp = rng.uniform(0.6, 1.4, (y.size, 1, 1))
        x = amp * shifted[y, shift] + _SYN_NOISE * rng.standard_normal((y.size, 8, 8))
        return x[:, None].astype(np.float32), y.astype(np.int64)

    x_tr, y_tr = draw(_SYN_TRAIN // _SYN_CLASSES)
    x_te, y_te = draw(_SYN_TEST // _SYN_CLASSES)
    mean, std = float(x_tr.mean()), float(x_tr.std())
    classes = tuple(f"pattern_{c}" for c in range(_SYN_CLASSES))
    return Raw("synthetic", x_tr, y_tr, x_te, y_te, classes, (mean,), (std,), 1.0)


_LOADERS: dict[str, Callable[[Path, bool, int], Raw]] = {
    "mnist": _load_mnist,
    "fmnist": _load_fmnist,
    "cifar10": _load_cifar10,
    "cifar100": _load_cifar100,
    "digits": _load_digits,
    "synthetic": _load_synthetic,
}
assert set(_LOADERS) | set(OWN_DATASETS) == set(DATASETS)  # before any plug-in registers
