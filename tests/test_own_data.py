"""Data sets of one's own (npz, imagefolder, hf) read from files the tests write, natural
client splits, feature vectors, images of several sizes, and the errors for bad data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edgepfl.config import build_config
from edgepfl.data import dataset_of, load_dataset, partition_of
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError, DataError, EdgepflError

TINY = ["train.rounds=1", "train.local_epochs=1", "train.batch_size=8", "output.plots=false"]


def run_config(path, *overrides: str, name: str = "npz"):
    return build_config({}, [f"dataset.name={name}", f"dataset.path={path}", *TINY,
                             *overrides])


def id_images(n: int, size: int = 8, channels: int = 1) -> np.ndarray:
    """uint8 images whose first pixel is the sample's number: pixels are stored as they
    are, so a data set's row says which sample of the file it is."""
    rng = np.random.default_rng(n)
    x = rng.integers(0, 256, (n, channels, size, size), dtype=np.uint8)
    x[:, 0, 0, 0] = np.arange(n)
    return x


def sample_ids(x: torch.Tensor) -> list[int]:
    return x[:, 0, 0, 0].tolist()


def write_png(path, array: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


# --------------------------------------------------------------------------- natural splits


def test_natural_npz_split_gives_each_client_exactly_its_samples(tmp_path):
    rng = np.random.default_rng(0)
    n, n_test = 90, 30
    names = np.array(["ann", "bob", "cy"])
    client = names[rng.permutation(np.arange(n) % 3)]
    client_test = names[rng.permutation(np.arange(n_test) % 3)]
    x_test = id_images(n_test)
    x_test[:, 0, 0, 0] += 100  # test samples numbered 100..
    np.savez(tmp_path / "d.npz", x=id_images(n), y=rng.integers(0, 4, n), client=client,
             x_test=x_test, y_test=rng.integers(0, 4, n_test), client_test=client_test)
    cfg = run_config(tmp_path / "d.npz", "partition.scheme=natural", "partition.clients=3",
                     "model.name=mlp")
    sim = Simulation(cfg, tmp_path / "run", progress=False)
    assert sim.dataset.clients == ("ann", "bob", "cy")
    for i, who in enumerate(sim.dataset.clients):
        assert sorted(sample_ids(sim.dataset.x_train[sim.partition.train[i]])) == \
            np.flatnonzero(client == who).tolist()
        assert sorted(sample_ids(sim.dataset.x_test[sim.partition.test[i]])) == \
            (100 + np.flatnonzero(client_test == who)).tolist()
    result = sim.run()
    assert len(result.metrics) == 1
    written = json.loads((tmp_path / "run" / "partition.json").read_text())["clients"]
    assert [row["name"] for row in written] == ["ann", "bob", "cy"]
    assert [row["train_size"] for row in written] == [30, 30, 30]


def test_natural_split_takes_the_datas_count_unless_one_is_given(tmp_path):
    from click.testing import CliRunner

    from edgepfl.cli import main

    names = np.array(["a", "b", "c", "d", "e", "f"])
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "d.npz", x=id_images(60), y=rng.integers(0, 3, 60),
             client=names[np.arange(60) % 6])
    cfg = run_config(tmp_path / "d.npz", "partition.scheme=natural", "model.name=mlp")
    sim = Simulation(cfg, progress=False)
    assert sim.num_clients == 6 and sim.cfg.partition.clients == 6
    out = tmp_path / "run"
    args = ["run", "--quiet", "--out", str(out), "--set", f"dataset.path={tmp_path / 'd.npz'}",
            *[f"--set={o}" for o in [*TINY, "dataset.name=npz", "partition.scheme=natural",
                                      "model.name=mlp"]]]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["partition"]["clients"] == 6
    # compare builds its runs from the configuration's dump: the count is taken first
    cmp = CliRunner().invoke(main, ["compare", "--algorithms", "fedavg", "--seeds", "0",
                                    "--out", str(tmp_path / "cmp"), *args[4:]])
    assert cmp.exit_code == 0, cmp.output
    with pytest.raises(ConfigError, match="has 6 clients .* but partition.clients = 4"):
        Simulation(run_config(tmp_path / "d.npz", "partition.scheme=natural",
                              "partition.clients=4"), progress=False)


def test_natural_split_without_a_test_split_holds_out_each_clients_share(tmp_path):
    rng = np.random.default_rng(1)
    sizes = [20, 11, 5, 2]
    client = rng.permutation(np.repeat(np.arange(4) * 10, sizes))  # ids 0, 10, 20, 30
    np.savez(tmp_path / "d.npz", x=id_images(len(client)), y=rng.integers(0, 3, len(client)),
             client=client)
    data = load_dataset("npz", path=tmp_path / "d.npz", test_fraction=0.25)
    assert data.clients == ("0", "10", "20", "30")
    cfg = build_config({}, ["partition.scheme=natural", "partition.clients=4"])
    part = partition_of(cfg.partition, data, seed=3)
    for i, size in enumerate(sizes):
        train = sample_ids(data.x_train[part.train[i]])
        test = sample_ids(data.x_test[part.test[i]])
        assert sorted(train + test) == np.flatnonzero(client == 10 * i).tolist()
        # a quarter rounded half up, and every client of two or more keeps both kinds
        assert len(test) == min(size - 1, max(1, int(np.floor(0.25 * size + 0.5))))
    # the held-out samples are the data's, the same for every run seed
    again = load_dataset("npz", path=tmp_path / "d.npz", test_fraction=0.25, seed=9)
    assert torch.equal(again.x_test, data.x_test)


def test_natural_needs_the_clients_count_of_the_data_and_clients_in_it(tmp_path):
    np.savez(tmp_path / "d.npz", x=id_images(12), y=np.arange(12) % 2,
             client=np.arange(12) % 3)
    data = load_dataset("npz", path=tmp_path / "d.npz")
    cfg = build_config({}, ["partition.scheme=natural", "partition.clients=5"])
    with pytest.raises(ConfigError, match=r"has 3 clients \(0, 1, 2\), but partition.clients = "
                                          r"5; set partition.clients = 3"):
        partition_of(cfg.partition, data, 0)
    np.savez(tmp_path / "plain.npz", x=id_images(12), y=np.arange(12) % 2)
    plain = load_dataset("npz", path=tmp_path / "plain.npz")
    with pytest.raises(ConfigError, match="names none.*choose another scheme: iid"):
        partition_of(build_config({}, ["partition.scheme=natural"]).partition, plain, 0)
    # other schemes ignore the clients the data names
    iid = partition_of(build_config({}, ["partition.scheme=iid", "partition.clients=2"]).partition,
                       data, 0)
    assert iid.num_clients == 2


def test_natural_test_split_without_client_ids_follows_each_clients_labels(tmp_path):
    y = np.array([0] * 6 + [1] * 6)
    np.savez(tmp_path / "d.npz", x=id_images(12), y=y, client=np.repeat([0, 1], 6),
             x_test=id_images(8), y_test=np.array([0] * 4 + [1] * 4))
    data = load_dataset("npz", path=tmp_path / "d.npz")
    assert data.client_test is None
    part = partition_of(build_config({}, ["partition.scheme=natural",
                                          "partition.clients=2"]).partition, data, 0)
    assert data.y_test[part.test[0]].tolist() == [0] * 4
    assert data.y_test[part.test[1]].tolist() == [1] * 4


def test_image_folder_with_client_folders_is_a_natural_split(tmp_path):
    rng = np.random.default_rng(2)
    count = {}
    for who in ("dev_a", "dev_b"):
        for cls, k in (("cat", 3), ("dog", 2 if who == "dev_a" else 4)):
            for j in range(k):
                write_png(tmp_path / who / cls / f"{j}.png",
                          rng.integers(0, 256, (8, 8), dtype=np.uint8))
            count[who] = count.get(who, 0) + k
    data = load_dataset("imagefolder", path=tmp_path, test_fraction=0.2)
    assert data.clients == ("dev_a", "dev_b") and data.classes == ("cat", "dog")
    part = partition_of(build_config({}, ["partition.scheme=natural",
                                          "partition.clients=2"]).partition, data, 0)
    for i, who in enumerate(data.clients):
        assert len(part.train[i]) + len(part.test[i]) == count[who]
        assert len(part.test[i]) >= 1


# --------------------------------------------------------------------------- image folders


def test_image_folder_of_three_sizes_runs_with_cnn2_spp(tmp_path):
    rng = np.random.default_rng(3)
    sizes = [(20, 20), (24, 16), (16, 28)]
    for cls in ("a", "b"):
        for j in range(6):
            h, w = sizes[j % 3]
            write_png(tmp_path / "train" / cls / f"{j}.png",
                      rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for j in range(3):
            h, w = sizes[j]
            write_png(tmp_path / "test" / cls / f"{j}.jpg",
                      rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    data = load_dataset("imagefolder", path=tmp_path)
    assert data.variable_size and data.sizes == sorted(sizes)
    assert data.input_shape == (3, 24, 28)  # the canvas
    assert (len(data.y_train), len(data.y_test)) == (12, 6)
    cfg = run_config(tmp_path, "model.name=cnn2_spp", "partition.scheme=iid",
                     "partition.clients=2", name="imagefolder")
    sim = Simulation(cfg, progress=False)
    boxes = sim.train_data[0].boxes
    assert boxes is not None and {tuple(b) for b in boxes[:, 2:].tolist()} <= set(sizes)
    batch_shapes = {tuple(x.shape[2:]) for x, _ in sim.train_data[0].batches(4, torch.Generator())}
    assert batch_shapes <= set(sizes)
    result = sim.run()
    assert 0.0 <= result.metrics[-1]["acc_mean"] <= 1.0
    # a model of one input size is refused, naming those for any size and dataset.resize
    with pytest.raises(ConfigError, match=r"come in 3 sizes.*'mlp' takes one input size only"
                                          r".*cnn2_spp.*dataset.resize"):
        Simulation(run_config(tmp_path, "model.name=mlp", "partition.scheme=iid",
                              "partition.clients=2", name="imagefolder"), progress=False)
    # resized, they are one size: any model for that size takes them
    resized = dataset_of(cfg.dataset.model_copy(update={"resize": 12}), 0)
    assert not resized.variable_size and resized.input_shape == (3, 12, 12)
    with pytest.raises(ConfigError, match="aspect_ratios.*come in 3 sizes.*dataset.resize"):
        dataset_of(cfg.dataset.model_copy(update={"aspect_ratios": ["1:1", "4:3"]}), 0)


def test_image_folder_normalises_with_its_own_statistics(tmp_path):
    write_png(tmp_path / "train" / "a" / "0.png", np.full((4, 4), 50, dtype=np.uint8))
    write_png(tmp_path / "train" / "a" / "1.png", np.full((4, 4), 150, dtype=np.uint8))
    write_png(tmp_path / "train" / "b" / "0.png", np.full((4, 4), 100, dtype=np.uint8))
    write_png(tmp_path / "train" / "b" / "1.png", np.full((4, 4), 110, dtype=np.uint8))
    write_png(tmp_path / "test" / "b" / "0.png", np.full((4, 4), 255, dtype=np.uint8))
    data = load_dataset("imagefolder", path=tmp_path)
    assert data.x_train.dtype == torch.uint8 and data.classes == ("a", "b")
    x = data.images("train")
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std(unbiased=False)) - 1) < 1e-5


# --------------------------------------------------------------------------- feature vectors


def test_feature_vectors_are_channels_of_1x1_and_run_with_the_mlp(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.normal([5.0, -3.0, 100.0, 0.0, 1.0], [1.0, 2.0, 10.0, 0.1, 3.0], (40, 5))
    y = (x[:, 0] > 5).astype(np.int64)
    np.savez(tmp_path / "f.npz", x=x, y=y)
    data = load_dataset("npz", path=tmp_path / "f.npz")
    assert data.input_shape == (5, 1, 1) and data.x_train.dtype == torch.float32
    # each feature standardised with the training split's mean and std
    flat = data.x_train.flatten(1)
    torch.testing.assert_close(flat.mean(0), torch.zeros(5), atol=1e-5, rtol=0)
    torch.testing.assert_close(flat.std(0, unbiased=False), torch.ones(5), atol=1e-4, rtol=0)
    cfg = run_config(tmp_path / "f.npz", "partition.scheme=iid", "partition.clients=2")
    sim = Simulation(cfg, progress=False)
    assert sim.cfg.model.name == "mlp"  # the default for data of one's own
    assert sim.layers.names == ["fc1", "fc2", "fc3"]
    assert sim.trainer.model.fc1.in_features == 5
    sim.run()
    with pytest.raises(ConfigError, match=r"'cnn2' does not fit inputs of shape \(5, 1, 1\).*"
                                          r"feature vectors of 5 values.*'mlp' takes"):
        Simulation(run_config(tmp_path / "f.npz", "model.name=cnn2", "partition.scheme=iid",
                              "partition.clients=2"), progress=False)


def test_string_labels_and_class_names(tmp_path):
    np.savez(tmp_path / "s.npz", x=id_images(6), y=np.array(["b", "a", "c", "a", "b", "c"]))
    data = load_dataset("npz", path=tmp_path / "s.npz", test_fraction=0.4)
    assert data.classes == ("a", "b", "c") and data.num_classes == 3
    np.savez(tmp_path / "n.npz", x=id_images(6), y=np.arange(6) % 2,
             classes=np.array(["no", "yes", "maybe"]))
    data = load_dataset("npz", path=tmp_path / "n.npz")
    assert data.classes == ("no", "yes", "maybe")
    np.savez(tmp_path / "bad.npz", x=id_images(6), y=np.arange(6) % 4,
             classes=np.array(["no", "yes"]))
    with pytest.raises(DataError, match=r"label 3 has no class name; valid labels are 0..1"):
        load_dataset("npz", path=tmp_path / "bad.npz")


# --------------------------------------------------------------------------- errors


def test_missing_path_is_named(tmp_path):
    with pytest.raises(ConfigError, match="reads an .npz file from dataset.path, which is not set"):
        load_dataset("npz")
    missing = tmp_path / "nowhere.npz"
    with pytest.raises(DataError, match=f"dataset.path = '{missing}' does not exist"):
        load_dataset("npz", path=missing)
    with pytest.raises(DataError, match=f"dataset.path = '{tmp_path}' is a folder"):
        load_dataset("npz", path=tmp_path)
    with pytest.raises(ConfigError, match="dataset.path = .* is read by the data sets of your own "
                                          r"\(npz, imagefolder, hf\), not by 'digits'"):
        load_dataset("digits", path=tmp_path)


def test_empty_class_folder_is_named(tmp_path):
    write_png(tmp_path / "a" / "0.png", np.zeros((4, 4), dtype=np.uint8))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match=f"class folder {tmp_path / 'b'} holds no PNG or JPEG"):
        load_dataset("imagefolder", path=tmp_path)


def test_files_that_are_not_read_are_said(tmp_path, caplog):
    for cls in ("a", "b"):
        for k in range(2):
            write_png(tmp_path / cls / f"{k}.png", np.full((4, 4), k, dtype=np.uint8))
    (tmp_path / "a" / "x.bmp").write_bytes(b"BM")
    (tmp_path / "a" / ".hidden").write_text("")
    with caplog.at_level("WARNING", logger="edgepfl"):
        data = load_dataset("imagefolder", path=tmp_path, test_fraction=0.5)
    assert len(data.y_train) + len(data.y_test) == 4
    assert "1 file(s) that are not PNG or JPEG" in caplog.text and "a/x.bmp" in caplog.text


def test_mixed_channel_counts_are_named(tmp_path):
    write_png(tmp_path / "a" / "0.png", np.zeros((4, 4), dtype=np.uint8))
    write_png(tmp_path / "b" / "0.png", np.zeros((4, 4, 3), dtype=np.uint8))
    with pytest.raises(DataError, match=f"different channel counts: {tmp_path / 'a' / '0.png'} "
                                        f"has 1, {tmp_path / 'b' / '0.png'} has 3"):
        load_dataset("imagefolder", path=tmp_path)


def test_a_file_that_does_not_decode_is_named(tmp_path):
    write_png(tmp_path / "a" / "0.png", np.zeros((4, 4), dtype=np.uint8))
    broken = tmp_path / "a" / "1.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(DataError, match=f"{broken} does not decode as an image"):
        load_dataset("imagefolder", path=tmp_path)


@pytest.mark.parametrize("y,needle", [
    (np.linspace(0, 1, 6), "labels of type float64 .* are not integers"),
    (np.array([True, False] * 3), "labels of type bool"),
    (np.array([0, 1, -1, 0, 1, 0]), "label -1 is negative"),
    (np.zeros((6, 2), dtype=np.int64), r"'y' has shape \[6, 2\].*one value per sample"),
    # ids, not indices: 1,000,001 classes (a huge classifier) for two labels
    (np.array([0, 1_000_000] * 3), r"up to 1000000 but only 2 distinct.*np.unique"),
    (np.array([2**40] * 6), r"up to 1099511627776 but only 1 distinct"),
])
def test_labels_that_are_not_class_indices_are_refused(tmp_path, y, needle):
    np.savez(tmp_path / "d.npz", x=id_images(6), y=y)
    with pytest.raises(DataError, match=needle):
        load_dataset("npz", path=tmp_path / "d.npz")


@pytest.mark.parametrize("arrays,needle", [
    ({"x": id_images(4)}, "has no array 'y'"),
    ({"x": id_images(4), "y": np.zeros(4, int), "labels": np.zeros(4)}, "has array.*'labels'"),
    ({"x": id_images(4), "y": np.zeros(3, int)}, "'y' has shape \\[3\\] but 'x' has 4"),
    ({"x": np.zeros((4, 8, 8, 3), np.uint8), "y": np.zeros(4, int)}, "looks channels-last"),
    ({"x": np.zeros((4, 2, 2, 2, 2)), "y": np.zeros(4, int)}, "feature vectors"),
    ({"x": np.full((4, 2), np.nan), "y": np.zeros(4, int)}, "NaN or infinity"),
    ({"x": id_images(4), "y": np.zeros(4, int), "x_test": id_images(2)}, "x_test but no y_test"),
    ({"x": id_images(4), "y": np.zeros(4, int), "classes": np.array(["a", "a", "b"])},
     r"class names \['a'\] appear more than once"),
    ({"x": id_images(4), "y": np.zeros(4, int), "x_test": id_images(2, size=6),
      "y_test": np.zeros(2, int)}, "both splits need one shape"),
])
def test_malformed_npz_files_are_named(tmp_path, arrays, needle):
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(DataError, match=needle):
        load_dataset("npz", path=tmp_path / "d.npz")


def test_npz_is_never_unpickled(tmp_path):
    np.savez(tmp_path / "d.npz", x=id_images(2), y=np.array([0, {"a": 1}], dtype=object))
    with pytest.raises(DataError, match="never unpickles data"):
        load_dataset("npz", path=tmp_path / "d.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="junk.npz is not a readable .npz file"):
        load_dataset("npz", path=tmp_path / "junk.npz")


def test_resize_is_for_image_files(tmp_path):
    np.savez(tmp_path / "d.npz", x=id_images(4), y=np.zeros(4, int))
    with pytest.raises(ConfigError, match="dataset.resize = 8 resizes image files"):
        load_dataset("npz", path=tmp_path / "d.npz", resize=8)
    with pytest.raises(ConfigError, match="dataset.resize = 8 is read by the data sets"):
        load_dataset("synthetic", resize=8)


def test_image_folder_layout_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no class folders"):
        load_dataset("imagefolder", path=tmp_path / "empty")
    write_png(tmp_path / "mixed" / "cls" / "0.png", np.zeros((4, 4), dtype=np.uint8))
    write_png(tmp_path / "mixed" / "dev" / "cls" / "0.png", np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(DataError, match=r"mixes class folders \(cls/ holds images\) and client "
                                        r"folders \(dev/ holds folders\)"):
        load_dataset("imagefolder", path=tmp_path / "mixed")
    write_png(tmp_path / "onlytest" / "test" / "a" / "0.png", np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(DataError, match="has test/ but no train/"):
        load_dataset("imagefolder", path=tmp_path / "onlytest")


# --------------------------------------------------------------------------- Hugging Face


def test_hf_folder_with_images_labels_and_clients(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the hf extra (pip install 'edgepfl[hf]')")
    from PIL import Image

    rng = np.random.default_rng(5)

    def split(n: int) -> datasets.Dataset:
        features = datasets.Features({"img": datasets.Image(),
                                      "digit": datasets.ClassLabel(names=["zero", "one"]),
                                      "writer": datasets.Value("string")})
        images = [Image.fromarray(rng.integers(0, 256, (10, 10), dtype=np.uint8))
                  for _ in range(n)]
        return datasets.Dataset.from_dict(
            {"img": images, "digit": (np.arange(n) % 2).tolist(),
             "writer": [f"w{k % 3}" for k in range(n)]}, features=features)

    datasets.DatasetDict({"train": split(18), "test": split(6)}).save_to_disk(tmp_path / "hf")
    cfg = run_config(tmp_path / "hf", "dataset.image_column=img", "dataset.label_column=digit",
                     "dataset.client_column=writer", "partition.scheme=natural",
                     "partition.clients=3", "model.name=mlp", name="hf")
    data = dataset_of(cfg.dataset, 0)
    assert data.classes == ("zero", "one") and data.clients == ("w0", "w1", "w2")
    assert data.input_shape == (1, 10, 10) and data.x_train.dtype == torch.uint8
    sim = Simulation(cfg, progress=False)
    assert [len(t) for t in sim.partition.train] == [6, 6, 6]
    assert [len(t) for t in sim.partition.test] == [2, 2, 2]
    sim.run()
    with pytest.raises(DataError, match=r"dataset.label_column = 'label' is not a column of .*"
                                        r"its columns are img, digit, writer"):
        load_dataset("hf", path=tmp_path / "hf", image_column="img")


def test_hf_feature_vectors_without_a_test_split(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the hf extra (pip install 'edgepfl[hf]')")
    rng = np.random.default_rng(6)
    ds = datasets.Dataset.from_dict({"features": rng.normal(size=(30, 7)).tolist(),
                                     "label": (np.arange(30) % 3).tolist()})
    ds.save_to_disk(tmp_path / "hf")
    data = load_dataset("hf", path=tmp_path / "hf", image_column="features", test_fraction=0.2)
    assert data.input_shape == (7, 1, 1)
    assert (len(data.y_train), len(data.y_test)) == (24, 6)  # a fifth of each class
    assert data.classes == ("0", "1", "2")


def test_labels_with_a_few_classes_missing_are_still_classes(tmp_path):
    # 1-based labels, or a class absent from a small set, keep K = max + 1
    np.savez(tmp_path / "d.npz", x=id_images(10), y=np.array([1, 2, 3, 5, 1, 2, 3, 5, 1, 2]))
    assert load_dataset("npz", path=tmp_path / "d.npz").num_classes == 6


def test_a_resume_on_other_data_is_refused_and_changes_nothing(tmp_path):
    from edgepfl.engine.simulation import resume_run, start_run

    data = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=id_images(60), y=rng.integers(0, 3, 60))
    run = tmp_path / "run"
    start_run(run_config(data, "train.rounds=1", "model.name=mlp", "partition.clients=3",
                         "partition.scheme=iid"), run, progress=False)
    np.savez(data, x=id_images(80), y=rng.integers(0, 3, 80))  # replaced in place
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(EdgepflError, match=r"(?s)was run on other data.*client 0's train_size: run has 16, now 22"):
        resume_run(run, overrides=["train.rounds=2"], progress=False)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    np.savez(data, x=id_images(60), y=np.random.default_rng(0).integers(0, 3, 60))  # the original
    assert [r["round"] for r in resume_run(run, overrides=["train.rounds=2"], progress=False).metrics] == [1, 2]


def test_a_relative_dataset_path_is_stored_absolute_and_resumes_from_anywhere(tmp_path,
                                                                             monkeypatch):
    from edgepfl.engine.simulation import resume_run, start_run
    from edgepfl.io import read_json

    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    np.savez(home / "d.npz", x=id_images(60), y=np.random.default_rng(0).integers(0, 3, 60))
    over = ["model.name=mlp", "partition.clients=3", "partition.scheme=iid"]
    monkeypatch.chdir(home)
    run = tmp_path / "run"
    start_run(run_config("d.npz", *over), run, progress=False)
    assert read_json(run / "config.json")["dataset"]["path"] == str(home / "d.npz")
    monkeypatch.chdir(elsewhere)
    assert len(resume_run(run, overrides=["train.rounds=2"], progress=False).metrics) == 2
    # a path naming the same files, relative to this folder, is no change; another one is
    again = ["train.rounds=3", "dataset.path=../home/d.npz"]
    assert len(resume_run(run, overrides=again, progress=False).metrics) == 3
    assert read_json(run / "config.json")["dataset"]["path"] == str(home / "d.npz")
    np.savez(elsewhere / "d.npz", x=id_images(60), y=np.random.default_rng(0).integers(0, 3, 60))
    with pytest.raises(ConfigError, match="dataset.path: run has"):
        resume_run(run, overrides=["train.rounds=4", "dataset.path=d.npz"], progress=False)


def test_a_runs_old_relative_dataset_path_takes_a_given_one_from_another_folder(
        tmp_path, monkeypatch):
    from edgepfl.engine.simulation import resume_run
    from edgepfl.io import read_json

    np.savez(tmp_path / "d.npz", x=id_images(60), y=np.random.default_rng(0).integers(0, 3, 60))
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    # as a run from before config.json held absolute paths: relative there and in its checkpoint
    Simulation(run_config("d.npz", "model.name=mlp", "partition.clients=3",
                          "partition.scheme=iid"), run, progress=False).run()
    assert read_json(run / "config.json")["dataset"]["path"] == "d.npz"
    monkeypatch.chdir(run)
    given = ["train.rounds=2", f"dataset.path={tmp_path / 'd.npz'}"]
    assert len(resume_run(run, overrides=given, progress=False).metrics) == 2
    assert read_json(run / "config.json")["dataset"]["path"] == str(tmp_path / "d.npz")
