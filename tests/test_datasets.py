"""Data set loading: real MNIST/Fashion-MNIST, fake CIFAR files, built-in sets, errors."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import pickle
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from edgepfl.data import DATASETS, load_dataset, resolve_data_root
from edgepfl.data import datasets as ds
from edgepfl.errors import ConfigError, DataError
from edgepfl.registered import origin

REAL_DOWNLOAD = ds._download  # the autouse fixture below replaces it in every test
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_FILES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


def shared_data_root() -> Path:
    env = os.environ.get("EDGEPFL_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def real_root(folder: str) -> Path:
    root = shared_data_root()
    if not (root / folder / "raw").is_dir():
        pytest.skip(f"{root / folder / 'raw'} not found (set EDGEPFL_DATA to the shared data)")
    return root


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """No test may reach the network: any download attempt fails like an offline machine."""

    def offline(url, dest, md5, timeout=10.0):
        raise DataError(f"offline test: would fetch {url}")

    monkeypatch.setattr(ds, "_download", offline)
    monkeypatch.delenv("EDGEPFL_NO_DOWNLOAD", raising=False)


@pytest.fixture(scope="module")
def mnist() -> ds.Dataset:
    return load_dataset("mnist", root=real_root("MNIST"), download=False)


@pytest.fixture(scope="module")
def fmnist() -> ds.Dataset:
    return load_dataset("fmnist", root=real_root("FashionMNIST"), download=False)


# --------------------------------------------------------------------------- real files


def check_image_set(data: ds.Dataset, n_train: int, n_test: int, shape: tuple) -> None:
    assert data.x_train.shape == (n_train, *shape) and data.x_test.shape == (n_test, *shape)
    assert data.y_train.shape == (n_train,) and data.y_test.shape == (n_test,)
    # 8-bit files stay 8-bit in memory (the built-in sets are float); inputs are float32
    stored = torch.float32 if data.name in ("digits", "synthetic") else torch.uint8
    assert data.x_train.dtype == data.x_test.dtype == stored
    assert (data.norm is None) == (stored == torch.float32)
    assert data.images("test", torch.arange(2)).dtype == torch.float32
    assert data.y_train.dtype == data.y_test.dtype == torch.int64
    for t in (data.x_train, data.y_train, data.x_test, data.y_test):
        assert t.is_contiguous()
    assert data.input_shape == shape
    assert data.num_classes == len(data.classes)


def test_mnist_shapes_counts_and_normalisation(mnist):
    check_image_set(mnist, 60000, 10000, (1, 28, 28))
    assert torch.bincount(mnist.y_train).tolist() == MNIST_TRAIN_COUNTS
    assert int(torch.bincount(mnist.y_test).sum()) == 10000 and int(mnist.y_test.max()) == 9
    assert mnist.num_classes == 10 and mnist.classes[0] == "0"
    x = mnist.images("train")
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01
    # Background pixels are 0 in the file: (0 - 0.1307) / 0.3081.
    assert float(x.min()) == pytest.approx(-0.1307 / 0.3081, abs=1e-5)


def test_fmnist_shapes_counts_and_normalisation(fmnist):
    check_image_set(fmnist, 60000, 10000, (1, 28, 28))
    assert torch.bincount(fmnist.y_train).tolist() == [6000] * 10
    assert torch.bincount(fmnist.y_test).tolist() == [1000] * 10
    assert fmnist.classes[9] == "Ankle boot"
    assert abs(float(fmnist.images("train").mean())) < 0.01
    assert abs(float(fmnist.images("test").mean())) < 0.05


def test_batches_are_normalised_as_the_whole_array_would_be(mnist):
    """Pixels stay uint8 and each batch is normalised as it is cut, with the arithmetic of
    normalising the whole array at load time: the same values, bit for bit."""
    from edgepfl.training.client_data import ClientData

    assert mnist.x_train.element_size() == 1
    idx = torch.tensor([5, 0, 59999, 123])
    whole = mnist.x_train.to(torch.float32)
    mean, std = torch.tensor(0.1307).view(1, 1, 1, 1), torch.tensor(0.3081).view(1, 1, 1, 1)
    whole.mul_(1.0 / (255.0 * std)).sub_(mean / std)
    view = ClientData(mnist.x_train, mnist.y_train, idx, norm=mnist.norm)
    assert torch.equal(view.gather()[0], whole[idx])
    x, y = next(view.batches(4, torch.Generator().manual_seed(0)))
    assert x.dtype == torch.float32 and torch.equal(x, whole[view.idx[
        torch.randperm(4, generator=torch.Generator().manual_seed(0))]])
    assert torch.equal(mnist.images("train", idx), whole[idx])


def test_mnist_fraction_is_seeded(mnist):
    root = real_root("MNIST")
    a = load_dataset("mnist", root=root, fraction=0.1, seed=0, download=False)
    b = load_dataset("mnist", root=root, fraction=0.1, seed=0, download=False)
    c = load_dataset("mnist", root=root, fraction=0.1, seed=1, download=False)
    assert len(a.y_train) == 6000 and len(a.y_test) == 1000
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.y_train, c.y_train) and not torch.equal(a.y_test, c.y_test)
    # A subset of the full set, normalised the same way, roughly class balanced.
    assert bool((torch.isin(a.x_train[:, 0, 14, 14], mnist.x_train[:, 0, 14, 14])).all())
    assert torch.bincount(a.y_train).min() > 400


def test_mnist_loads_fast():
    root = real_root("MNIST")
    start = time.perf_counter()
    load_dataset("mnist", root=root, download=False)
    assert time.perf_counter() - start < 4.0  # the target is well under 2 s


def test_data_root_from_env(monkeypatch):
    root = real_root("MNIST")
    monkeypatch.setenv("EDGEPFL_DATA", str(root))
    data = load_dataset("mnist", fraction=0.01, download=False)
    assert len(data.y_train) == 600


# --------------------------------------------------------------------------- built-in sets


def test_digits_split_shapes_and_stratification():
    data = load_dataset("digits")
    check_image_set(data, 1347, 450, (1, 8, 8))
    assert len(data.y_train) + len(data.y_test) == 1797
    full = np.bincount(np.concatenate([data.y_train.numpy(), data.y_test.numpy()]))
    test = np.bincount(data.y_test.numpy())
    assert np.abs(test - 0.25 * full).max() <= 1
    assert abs(float(data.x_train.mean())) < 1e-4 and abs(float(data.x_train.std()) - 1) < 1e-3
    # The split does not depend on the run seed; the fraction subset does.
    assert torch.equal(load_dataset("digits", seed=5).x_test, data.x_test)
    a = load_dataset("digits", fraction=0.5, seed=1)
    assert len(a.y_train) == 674 and len(a.y_test) == 225
    assert not torch.equal(a.y_train, load_dataset("digits", fraction=0.5, seed=2).y_train)


def test_synthetic_is_deterministic_and_learnable_but_not_trivial():
    a = load_dataset("synthetic", seed=3)
    b = load_dataset("synthetic", seed=3)
    c = load_dataset("synthetic", seed=4)
    check_image_set(a, 2000, 500, (1, 8, 8))
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert torch.bincount(a.y_train).tolist() == [200] * 10
    assert abs(float(a.x_train.mean())) < 1e-4 and abs(float(a.x_train.std()) - 1) < 1e-3
    # Nearest class mean, a weak classifier: well above chance, far from perfect.
    means = torch.stack([a.x_train[a.y_train == k].mean(0) for k in range(10)]).flatten(1)
    pred = torch.cdist(a.x_test.flatten(1), means).argmin(1)
    accuracy = float((pred == a.y_test).float().mean())
    assert 0.6 < accuracy < 0.97


def test_fraction_keeps_at_least_one_sample():
    data = load_dataset("synthetic", fraction=1e-9)
    assert len(data.y_train) == 1 and len(data.y_test) == 1


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, float("nan"), "half"])
def test_bad_fraction_is_config_error(fraction):
    with pytest.raises(ConfigError) as err:
        load_dataset("synthetic", fraction=fraction)
    assert repr(fraction) in str(err.value) and "(0, 1]" in str(err.value)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        load_dataset("imagenet")
    assert "'imagenet'" in str(err.value)
    assert all(name in str(err.value) for name in DATASETS)
    built_in = {"mnist", "fmnist", "cifar10", "cifar100", "digits", "synthetic", "npz",
                "imagefolder", "hf"}
    # any other name is a plug-in's, registered by a test that ran before in this process
    assert built_in <= set(DATASETS)
    assert all(origin("dataset", name) for name in set(DATASETS) - built_in)


def test_resolve_data_root(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EDGEPFL_DATA", raising=False)
    assert resolve_data_root(None) == tmp_path / "data"
    monkeypatch.setenv("EDGEPFL_DATA", str(tmp_path / "env"))
    assert resolve_data_root(None) == tmp_path / "env"
    assert resolve_data_root("explicit") == tmp_path / "explicit"
    assert resolve_data_root(tmp_path / "p").is_absolute()


# --------------------------------------------------------------------------- IDX files


def idx_bytes(magic: int, array: np.ndarray) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_fake_mnist(directory: Path, gz: bool = True, n: int = 6) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", n), ("t10k", n // 2)):
        images = rng.integers(0, 256, (count, 28, 28))
        labels = np.arange(count) % 10
        for name, blob in (
            (f"{split}-images-idx3-ubyte", idx_bytes(2051, images)),
            (f"{split}-labels-idx1-ubyte", idx_bytes(2049, labels)),
        ):
            if gz:
                (directory / f"{name}.gz").write_bytes(gzip.compress(blob))
            else:
                (directory / name).write_bytes(blob)


@pytest.mark.parametrize("gz", [True, False])
def test_fake_idx_files_load_gzipped_or_not(tmp_path, gz):
    write_fake_mnist(tmp_path / "FashionMNIST" / "raw", gz=gz)
    data = load_dataset("fmnist", root=tmp_path)
    assert data.x_train.shape == (6, 1, 28, 28) and data.y_test.tolist() == [0, 1, 2]
    path = tmp_path / "FashionMNIST" / "raw" / "train-images-idx3-ubyte"
    raw = gzip.decompress(path.with_suffix(".gz").read_bytes()) if gz else path.read_bytes()
    first = np.frombuffer(raw, np.uint8, offset=16)[:784].reshape(28, 28).astype(np.float32)
    expected = (torch.from_numpy(first) / 255 - 0.2860) / 0.3530
    assert torch.allclose(data.images("train")[0, 0], expected, atol=1e-5)


def test_wrong_magic_names_the_file(tmp_path):
    directory = tmp_path / "MNIST" / "raw"
    write_fake_mnist(directory)
    bad = directory / "train-labels-idx1-ubyte.gz"
    bad.write_bytes(gzip.compress(idx_bytes(2051, np.zeros((6, 1, 1)))))
    with pytest.raises(DataError) as err:
        load_dataset("mnist", root=tmp_path)
    assert str(bad) in str(err.value) and "magic number 2051, expected 2049" in str(err.value)


def test_truncated_or_garbage_idx_is_data_error(tmp_path):
    directory = tmp_path / "MNIST" / "raw"
    write_fake_mnist(directory)
    images = directory / "t10k-images-idx3-ubyte.gz"
    images.write_bytes(gzip.compress(gzip.decompress(images.read_bytes())[:-5]))
    with pytest.raises(DataError, match="truncated"):
        load_dataset("mnist", root=tmp_path)
    images.write_bytes(b"not gzip at all")
    with pytest.raises(DataError) as err:
        load_dataset("mnist", root=tmp_path)
    assert str(images) in str(err.value)


def test_image_and_label_counts_must_agree(tmp_path):
    directory = tmp_path / "MNIST" / "raw"
    write_fake_mnist(directory)
    labels = directory / "train-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(idx_bytes(2049, np.zeros(5))))
    with pytest.raises(DataError, match="6 images but .* 5 labels"):
        load_dataset("mnist", root=tmp_path)


# --------------------------------------------------------------------------- missing files


def test_missing_mnist_names_every_file_and_the_settings(tmp_path, monkeypatch):
    calls = []

    def offline(url, dest, md5, timeout=10.0):
        calls.append((url, dest, md5))
        raise DataError("offline test: no route to host")

    monkeypatch.setattr(ds, "_download", offline)
    with pytest.raises(DataError) as err:
        load_dataset("mnist", root=tmp_path)
    message = str(err.value)
    for name in MNIST_FILES:
        assert str(tmp_path / "MNIST" / "raw" / f"{name}.gz") in message
    assert "dataset.root" in message and "EDGEPFL_DATA" in message
    assert "no route to host" in message
    assert [url for url, _, _ in calls] == [
        f"https://ossci-datasets.s3.amazonaws.com/mnist/{name}.gz" for name in MNIST_FILES
    ]
    assert calls[0][2] == "f68b3c2dcbeaaa9fbdd348bbdeb94873"
    assert calls[0][1] == tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte.gz"


def test_only_missing_files_are_named(tmp_path):
    directory = tmp_path / "FashionMNIST" / "raw"
    write_fake_mnist(directory)
    (directory / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as err:
        load_dataset("fmnist", root=tmp_path)
    message = str(err.value)
    assert str(directory / "t10k-labels-idx1-ubyte.gz") in message
    assert "1 file(s) missing" in message and "train-images" not in message
    assert "fashion-mnist.s3-website.eu-central-1.amazonaws.com" in message


@pytest.mark.parametrize("how", ["argument", "env"])
def test_download_can_be_switched_off(tmp_path, monkeypatch, how):
    calls = []
    monkeypatch.setattr(ds, "_download", lambda *args, **kwargs: calls.append(args))
    if how == "env":
        monkeypatch.setenv("EDGEPFL_NO_DOWNLOAD", "1")
    with pytest.raises(DataError) as err:
        load_dataset("mnist", root=tmp_path, download=how != "argument")
    assert calls == []
    assert "not attempted" in str(err.value)
    assert ("EDGEPFL_NO_DOWNLOAD" in str(err.value)) == (how == "env")


def test_downloaded_files_are_used(tmp_path, monkeypatch):
    source = tmp_path / "source"
    write_fake_mnist(source)

    def fake_download(url, dest, md5, timeout=10.0):
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((source / url.rsplit("/", 1)[1]).read_bytes())

    monkeypatch.setattr(ds, "_download", fake_download)
    data = load_dataset("mnist", root=tmp_path / "root")
    assert data.x_train.shape == (6, 1, 28, 28)
    assert (tmp_path / "root" / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").is_file()


def test_real_download_function_checks_md5_and_writes_atomically(tmp_path):
    # file:// exercises the real _download without any network.
    payload = b"some bytes" * 1000
    source = tmp_path / "payload.bin"
    source.write_bytes(payload)
    md5 = hashlib.md5(payload).hexdigest()
    dest = tmp_path / "out" / "file.bin"
    REAL_DOWNLOAD(source.as_uri(), dest, md5)
    assert dest.read_bytes() == payload
    bad = tmp_path / "out" / "bad.bin"
    with pytest.raises(DataError, match="md5"):
        REAL_DOWNLOAD(source.as_uri(), bad, "0" * 32)
    assert not bad.exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["file.bin"]  # no temp left over
    with pytest.raises(DataError, match="could not download"):
        REAL_DOWNLOAD((tmp_path / "absent").as_uri(), tmp_path / "out" / "x", md5)


# --------------------------------------------------------------------------- CIFAR


def cifar_arrays(n: int, num_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, num_classes, n)


def write_cifar10_bin(root: Path) -> tuple[np.ndarray, np.ndarray]:
    directory = root / "cifar-10-batches-bin"
    directory.mkdir(parents=True)
    xs, ys = [], []
    for i, name in enumerate([f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]):
        x, y = cifar_arrays(4 if i < 5 else 3, 10, i)
        records = np.concatenate([y[:, None].astype(np.uint8), x], axis=1)
        (directory / name).write_bytes(records.tobytes())
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def write_cifar_py(root: Path, hundred: bool, protocol: int = 4) -> list[np.ndarray]:
    folder, names, key = (
        ("cifar-100-python", ["train", "test"], b"fine_labels")
        if hundred
        else ("cifar-10-batches-py", [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"],
              b"labels")
    )  # fmt: skip
    directory = root / folder
    directory.mkdir(parents=True)
    out = []
    for i, name in enumerate(names):
        x, y = cifar_arrays(5, 100 if hundred else 10, 10 + i)
        batch = {b"data": x, key: [int(v) for v in y], b"batch_label": b"fake"}
        if hundred:
            batch[b"coarse_labels"] = [int(v) // 5 for v in y]
        with (directory / name).open("wb") as f:
            pickle.dump(batch, f, protocol=protocol)
        out += [x, y]
    return out


def denormalise(x: torch.Tensor, mean, std) -> np.ndarray:
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    return np.rint(((x * s + m) * 255).numpy()).astype(np.int64)


def test_cifar10_binary_round_trip(tmp_path):
    x, y = write_cifar10_bin(tmp_path)
    data = load_dataset("cifar10", root=tmp_path)
    check_image_set(data, 20, 3, (3, 32, 32))
    assert data.y_train.tolist() == y[:20].tolist() and data.y_test.tolist() == y[20:].tolist()
    pixels = denormalise(data.images("train"), ds._CIFAR10.mean, ds._CIFAR10.std)
    assert (pixels.reshape(20, -1) == x[:20]).all()
    assert (data.x_train.reshape(20, -1).numpy() == x[:20]).all()  # the stored pixels
    assert data.classes[0] == "airplane" and data.num_classes == 10


def test_cifar100_binary_uses_fine_labels(tmp_path):
    directory = tmp_path / "cifar-100-binary"
    directory.mkdir()
    arrays = {}
    for i, name in enumerate(["train.bin", "test.bin"]):
        x, fine = cifar_arrays(6, 100, i)
        coarse = fine // 5
        records = np.concatenate(
            [coarse[:, None].astype(np.uint8), fine[:, None].astype(np.uint8), x], axis=1
        )
        (directory / name).write_bytes(records.tobytes())
        arrays[name] = (x, fine)
    data = load_dataset("cifar100", root=tmp_path)
    assert data.y_train.tolist() == arrays["train.bin"][1].tolist()
    assert data.y_test.tolist() == arrays["test.bin"][1].tolist()
    pixels = denormalise(data.images("test"), ds._CIFAR100.mean, ds._CIFAR100.std)
    assert (pixels.reshape(6, -1) == arrays["test.bin"][0]).all()
    assert data.num_classes == 100 and data.classes[-1] == "worm"


@pytest.mark.parametrize("protocol", [4, 5])  # 5 stores arrays through _frombuffer
def test_cifar10_python_round_trip(tmp_path, protocol):
    arrays = write_cifar_py(tmp_path, hundred=False, protocol=protocol)
    data = load_dataset("cifar10", root=tmp_path)
    xs, ys = arrays[0::2], arrays[1::2]
    assert data.y_train.tolist() == np.concatenate(ys[:5]).tolist()
    assert data.y_test.tolist() == ys[5].tolist()
    pixels = denormalise(data.images("train"), ds._CIFAR10.mean, ds._CIFAR10.std)
    assert (pixels.reshape(25, -1) == np.concatenate(xs[:5])).all()


def test_cifar100_python_round_trip(tmp_path):
    x_train, y_train, x_test, y_test = write_cifar_py(tmp_path, hundred=True)
    data = load_dataset("cifar100", root=tmp_path)
    assert data.y_train.tolist() == y_train.tolist() and data.y_test.tolist() == y_test.tolist()
    pixels = denormalise(data.images("test"), ds._CIFAR100.mean, ds._CIFAR100.std)
    assert (pixels.reshape(5, -1) == x_test).all()


def test_binary_version_is_preferred(tmp_path):
    _, y = write_cifar10_bin(tmp_path)
    write_cifar_py(tmp_path, hundred=False)
    assert load_dataset("cifar10", root=tmp_path).y_train.tolist() == y[:20].tolist()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["os.system", "eval"])
def test_malicious_pickle_is_refused(tmp_path, payload):
    write_cifar_py(tmp_path, hundred=False)
    marker = tmp_path / "pwned"
    evil = _Evil(marker) if payload == "os.system" else _EvalPayload(marker)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(pickle.dumps({b"data": evil, b"labels": [0]}))
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", root=tmp_path)
    assert "refusing to unpickle" in str(err.value) and str(batch) in str(err.value)
    assert not marker.exists()


class _EvalPayload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


def test_python_batch_with_wrong_content_is_data_error(tmp_path):
    write_cifar_py(tmp_path, hundred=False)
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    batch.write_bytes(pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(DataError, match="not a cifar10 python batch"):
        load_dataset("cifar10", root=tmp_path)


def test_binary_batch_with_bad_size_is_data_error(tmp_path):
    write_cifar10_bin(tmp_path)
    (tmp_path / "cifar-10-batches-bin" / "data_batch_2.bin").write_bytes(b"\x00" * 3000)
    with pytest.raises(DataError, match="data_batch_2.bin"):
        load_dataset("cifar10", root=tmp_path)


def test_missing_cifar_names_files_and_alternatives(tmp_path, monkeypatch):
    calls = []

    def offline(url, dest, md5, timeout=10.0):
        calls.append((url, dest, md5))
        raise DataError("offline test: timed out")

    monkeypatch.setattr(ds, "_download", offline)
    with pytest.raises(DataError) as err:
        load_dataset("cifar100", root=tmp_path)
    message = str(err.value)
    for name in ("train.bin", "test.bin"):
        assert str(tmp_path / "cifar-100-binary" / name) in message
    assert str(tmp_path / "cifar-100-python") in message
    assert "EDGEPFL_DATA" in message and "dataset.root" in message and "timed out" in message
    assert calls == [
        (
            "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
            tmp_path / "cifar-100-binary.tar.gz",
            "03b5dce01913d631647c71ecec9e9cb8",
        )
    ]


def _cifar10_tarball(tmp_path: Path) -> tuple[bytes, np.ndarray]:
    staging = tmp_path / "staging"
    _, y = write_cifar10_bin(staging)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(staging / "cifar-10-batches-bin", arcname="cifar-10-batches-bin")
        evil = tarfile.TarInfo("../escaped.txt")
        evil.size = 4
        tar.addfile(evil, io.BytesIO(b"evil"))
    return buffer.getvalue(), y


def test_cifar_archive_is_downloaded_and_extracted_safely(tmp_path, monkeypatch):
    blob, y = _cifar10_tarball(tmp_path)
    root = tmp_path / "root"

    def fake_download(url, dest, md5, timeout=10.0):
        assert url.endswith("cifar-10-binary.tar.gz")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(blob)

    monkeypatch.setattr(ds, "_download", fake_download)
    data = load_dataset("cifar10", root=root)
    assert data.y_train.tolist() == y[:20].tolist()
    assert not (tmp_path / "escaped.txt").exists()


def test_cifar_archive_in_root_is_used_offline_only_if_md5_matches(tmp_path, monkeypatch):
    blob, y = _cifar10_tarball(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    (root / "cifar-10-binary.tar.gz").write_bytes(blob)
    with pytest.raises(DataError, match="md5"):
        load_dataset("cifar10", root=root, download=False)
    assert not (root / "cifar-10-batches-bin").exists()
    spec = dataclasses.replace(ds._CIFAR10, md5=hashlib.md5(blob).hexdigest())
    monkeypatch.setattr(ds, "_CIFAR10", spec)
    data = load_dataset("cifar10", root=root, download=False)
    assert data.y_test.tolist() == y[20:].tolist()
