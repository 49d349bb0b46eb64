"""Images of arbitrary size (``dataset.aspect_ratios``, HMPL Sec. IV-B): crop geometry,
crops kept as boxes beside the shared image tensor, batches of one shape, seeded draws,
the capability checks, and runs of the algorithms that take them."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgepfl.algorithms import ALGORITHMS
from edgepfl.algorithms.heterofl import HeteroFLClient
from edgepfl.config import build_config
from edgepfl.data.aspect import PAPER_RATIOS, Crops, crop_size, cut, parse_ratios
from edgepfl.engine.parts import load_federation, resolve
from edgepfl.engine.simulation import CHECKPOINT, Simulation, client_split, start_run
from edgepfl.errors import ConfigError
from edgepfl.federation.rng import generator
from edgepfl.models import MODELS, zoo
from edgepfl.models import width as width_slicing
from edgepfl.training.client_data import ClientData
from edgepfl.training.trainer import Trainer
from tests.conftest import fast_config, without_wall

PAPER = 'dataset.aspect_ratios=["16:9", "4:3", "1:1", "3:4", "9:16"]'


class AnySize(nn.Module):
    """Tiny convolution + adaptive pooling: any input height and width (test-only)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(torch.relu(self.conv1(x)), 2)
        return torch.relu(self.fc1(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.features(x))


class NeedsRoom(AnySize):
    """Variable-size, but a 5x5 convolution and two 2x2 poolings need 8 rows and columns:
    the 5x8 crop of an 8x8 image at 16:9 is too small for it."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
        super().__init__(in_channels, num_classes, image_size)
        self.conv1 = nn.Conv2d(in_channels, 8, 5)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.max_pool2d(torch.relu(self.conv1(x)), 2), 2)
        return torch.relu(self.fc1(F.adaptive_avg_pool2d(x, 2).flatten(1)))


class AnySizeBN(AnySize):
    """AnySize with BatchNorm after its convolution: HeteroFL's static BatchNorm on crops."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
        nn.Module.__init__(self)  # layers registered in the order they run: a chain
        self.conv1 = nn.Conv2d(in_channels, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        return torch.relu(self.fc1(x.flatten(1)))


@pytest.fixture
def any_size(monkeypatch):
    """Register the test models as variable-size models, as the zoo's own are; AnySize and
    AnySizeBN are chains read channel-major after pooling, so they can be width-sliced."""
    monkeypatch.setitem(MODELS, "any_size", (AnySize, "test: conv + adaptive pooling"))
    monkeypatch.setitem(MODELS, "any_size_bn", (AnySizeBN, "test: any_size with BatchNorm"))
    monkeypatch.setitem(MODELS, "needs_room", (NeedsRoom, "test: too deep for small crops"))
    monkeypatch.setattr(zoo, "VARIABLE_SIZE_MODELS",
                        zoo.VARIABLE_SIZE_MODELS | {"any_size", "any_size_bn", "needs_room"})
    monkeypatch.setattr(width_slicing, "SLICEABLE",
                        width_slicing.SLICEABLE + ("any_size", "any_size_bn"))
    return "model.name=any_size"


def aspect_config(*overrides: str):
    return fast_config("model.name=any_size", PAPER, "partition.clients=4", "train.rounds=2",
                       *overrides)


def splits(cfg):
    cfg = resolve(cfg)
    dataset, partition = load_federation(cfg)
    return dataset, [client_split(dataset, partition, c, cfg) for c in range(partition.num_clients)]


# -- settings -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["16x9", "0:9", "16:0", "-4:3", "4:3:1", "a:b", "", "16:9.5"])
def test_a_bad_ratio_is_named_with_the_valid_form(bad):
    with pytest.raises(ConfigError, match=r"aspect_ratios.*is not an aspect ratio; write 'W:H' "
                                          r"with positive integers"):
        build_config({"dataset": {"aspect_ratios": ["4:3", bad]}})
    with pytest.raises(ConfigError, match="is not an aspect ratio"):
        build_config({"dataset": {"aspect_ratios": [16]}})


def test_ratio_lists_are_normalised_and_checked():
    cfg = build_config({}, ['dataset.aspect_ratios=[" 16 : 9", "1:1"]'])
    assert cfg.dataset.aspect_ratios == ["16:9", "1:1"]
    # a Flower run config holds scalars only: a comma-separated string is the same list
    assert build_config({}, ["dataset.aspect_ratios=16:9,1:1"]).dataset.aspect_ratios == \
        ["16:9", "1:1"]
    assert build_config({}).dataset.aspect_ratios == []
    with pytest.raises(ConfigError, match="'4:2' repeats a ratio"):
        build_config({}, ['dataset.aspect_ratios=["2:1", "4:2"]'])
    with pytest.raises(ConfigError, match="aspect_mode"):
        build_config({}, ["dataset.aspect_mode=device"])
    assert parse_ratios(PAPER_RATIOS) == ((16, 9), (4, 3), (1, 1), (3, 4), (9, 16))
    # distinct ratios, but one crop size on 8x8 images (4.5 and 4.8 rows round to 5)
    with pytest.raises(ConfigError, match="5:3 and 16:9 both crop 8x8 images to 5x8"):
        Crops(parse_ratios(["16:9", "5:3"]), 8, 8)


# -- geometry -------------------------------------------------------------------------------
def test_a_crop_is_the_largest_of_its_ratio_inside_the_image():
    assert crop_size((16, 9), 28, 28) == (16, 28)  # 28 * 9/16 = 15.75 rows
    assert crop_size((9, 16), 28, 28) == (28, 16)
    assert crop_size((4, 3), 28, 28) == (21, 28)
    assert crop_size((1, 1), 28, 28) == (28, 28)
    assert crop_size((16, 9), 8, 8) == (5, 8)  # 4.5 rounds half up
    for height, width in [(28, 28), (8, 8), (32, 32), (20, 30), (30, 20)]:
        for rw, rh in [(16, 9), (4, 3), (1, 1), (3, 4), (9, 16), (2, 1), (1, 3)]:
            h, w = crop_size((rw, rh), height, width)
            assert 1 <= h <= height and 1 <= w <= width
            assert h == height or w == width  # largest: it spans one side of the image
            # the ratio, to within rounding one side to whole pixels
            assert abs(w * rh - h * rw) <= max(rw, rh) / 2


def test_boxes_lie_inside_the_image_and_have_a_listed_ratio():
    crops = Crops(parse_ratios(PAPER_RATIOS), 28, 28)
    boxes = crops.draw(4000, torch.Generator().manual_seed(1))
    assert boxes.dtype == torch.int16 and boxes.shape == (4000, 4)
    top, left, h, w = boxes.long().unbind(1)
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= 28).all() and (left + w <= 28).all()
    sizes = {tuple(s) for s in crops.sizes.tolist()}
    assert {(int(a), int(b)) for a, b in zip(h, w, strict=True)} == sizes  # every ratio drawn
    wide = boxes[(h == 16).nonzero().flatten()]
    assert len(set(wide[:, 0].tolist())) == 13  # rows 0..12 all used as the top of a 16:9 crop
    assert crops.counts(boxes) == {r: int(((h == a) & (w == b)).sum())
                                   for r, (a, b) in zip(PAPER_RATIOS, crops.sizes.tolist(),
                                                        strict=True)}
    assert sum(crops.counts(boxes).values()) == 4000


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_crop_is_the_window_of_its_box(contiguous):
    x = torch.randn(6, 2, 9, 7)
    if not contiguous:  # the same values in another memory order: the indexed path
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    idx = torch.tensor([4, 1, 1])
    boxes = torch.tensor([[0, 0, 5, 3], [4, 2, 5, 3], [2, 4, 5, 3]], dtype=torch.int16)
    got = cut(x, idx, boxes)
    assert got.shape == (3, 2, 5, 3)
    for i, (t, left, h, w) in enumerate(boxes.tolist()):
        assert torch.equal(got[i], x[idx[i], :, t:t + h, left:left + w])


# -- batches --------------------------------------------------------------------------------
def _client(n=97, seed=0):
    """A client whose label is the sample's own index, so a batch says what it holds."""
    x = torch.randn(150, 1, 12, 12)
    idx = torch.randperm(150, generator=torch.Generator().manual_seed(5))[:n]
    crops = Crops(parse_ratios(["2:1", "1:1", "1:3"]), 12, 12)
    return ClientData(x, torch.arange(150), idx, crops.draw(n, torch.Generator().manual_seed(seed)))


def test_every_batch_has_one_shape_and_every_sample_comes_once_per_epoch():
    data = _client()
    box_of = {int(i): b for i, b in zip(data.idx, data.boxes.tolist(), strict=True)}
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # two epochs from one generator
        seen, shapes = [], []
        for xb, yb in data.batches(8, gen):
            assert 1 <= yb.numel() <= 8
            shapes.append(tuple(xb.shape[2:]))
            for img, i in zip(xb, yb.tolist(), strict=True):
                t, left, h, w = box_of[i]
                assert (h, w) == shapes[-1]
                assert torch.equal(img, data.x[i, :, t:t + h, left:left + w])
            seen += yb.tolist()
        assert sorted(seen) == sorted(data.idx.tolist())
        # the batches' order is shuffled: the shapes interleave instead of coming in 3 runs
        assert sum(a != b for a, b in zip(shapes, shapes[1:], strict=False)) > 2
    sizes = [yb.numel() for _, yb in data.batches(8, gen)]
    assert sum(1 for n in sizes if n < 8) <= 3  # at most one short batch per crop size


def test_batches_and_crops_follow_the_seed():
    def epoch(data, seed):
        return [yb.tolist() for _, yb in data.batches(8, torch.Generator().manual_seed(seed))]

    assert epoch(_client(), 3) == epoch(_client(), 3)
    assert epoch(_client(), 3) != epoch(_client(), 4)
    assert torch.equal(_client(seed=0).boxes, _client(seed=0).boxes)
    assert not torch.equal(_client(seed=0).boxes, _client(seed=1).boxes)


def test_whole_images_refuse_nothing_and_crops_refuse_gather():
    data = _client()
    with pytest.raises(ConfigError, match=r"crops of several sizes.*buckets\(\)"):
        data.gather()
    parts = list(data.buckets())
    assert len(parts) == 3 and sum(y.numel() for _, y in parts) == data.n
    assert sorted(torch.cat([y for _, y in parts]).tolist()) == sorted(data.idx.tolist())
    whole = ClientData(data.x, data.y, data.idx)
    (x, y), = whole.buckets()
    assert torch.equal(x, data.x[data.idx]) and torch.equal(y, data.idx)


# -- the run's crops ------------------------------------------------------------------------
def test_client_splits_keep_boxes_not_copies(any_size):
    dataset, parts = splits(aspect_config())
    for train, test in parts:
        # views of the one data set: the same storage, only small int16 boxes beside it
        assert train.x.data_ptr() == dataset.x_train.data_ptr()
        assert test.x.data_ptr() == dataset.x_test.data_ptr()
        assert train.boxes.dtype == torch.int16 and train.boxes.shape == (train.n, 4)
        assert test.boxes.shape == (test.n, 4)
    assert sum(t.boxes.nbytes + t.idx.nbytes for t, _ in parts) < dataset.x_train.nbytes / 10


def test_same_seed_same_crops_other_seed_other_crops(any_size):
    cfg = resolve(aspect_config())
    dataset, partition = load_federation(cfg)

    def boxes(seed):  # one data set and partition: only the crops' seed differs
        other = cfg.model_copy(update={"seed": seed})
        return torch.cat([torch.cat([t.boxes, v.boxes]) for t, v in
                          (client_split(dataset, partition, c, other) for c in range(4))])

    assert torch.equal(boxes(0), boxes(0))
    assert not torch.equal(boxes(0), boxes(1))
    assert not torch.equal(boxes(0)[:, 2:], boxes(1)[:, 2:])  # the ratios too, not only places


def test_image_mode_mixes_ratios_client_mode_gives_each_client_one(any_size):
    _, mixed = splits(aspect_config("partition.clients=10"))
    assert all(len({tuple(b) for b in t.boxes[:, 2:].tolist()}) > 1 for t, _ in mixed)
    _, per_client = splits(aspect_config("partition.clients=10", "dataset.aspect_mode=client"))
    shapes = []
    for train, test in per_client:
        own = {tuple(b) for b in torch.cat([train.boxes, test.boxes])[:, 2:].tolist()}
        assert len(own) == 1  # train and test: the device's one camera
        shapes += own
        if own != {(8, 8)}:  # a 1:1 crop is the whole image; the others still move
            assert len({tuple(b) for b in train.boxes[:, :2].tolist()}) > 1
    # 10 clients, 5 ratios: dealt evenly, two clients each
    assert sorted(shapes.count(s) for s in set(shapes)) == [2] * 5


def _recorded_part(recorded: dict, now: dict) -> dict:
    """``now`` with the keys ``recorded`` has, nested dicts too (keys added since allowed)."""
    return {k: _recorded_part(v, now[k]) if isinstance(v, dict) and isinstance(now[k], dict)
            else now[k] for k, v in recorded.items()}


def test_empty_ratio_list_is_the_run_from_before(any_size):
    """The golden fedavg case (recorded before crops existed) with the setting spelled out."""
    from tests.golden import GOLDEN, jsonable, machine, run_case

    recorded = json.loads(GOLDEN.read_text())
    if recorded["machine"] != machine():
        pytest.skip("golden floats are bit-exact only on the machine kind they were recorded on")
    case = recorded["cases"]["fedavg"]
    now = jsonable(run_case([*case["overrides"], "dataset.aspect_ratios=[]"]))
    # new columns and summary keys may be added since; every recorded one is unchanged
    assert [{k: row[k] for k in rec} for rec, row in
            zip(case["metrics"], now["metrics"], strict=True)] == case["metrics"]
    assert _recorded_part(case["summary"], now["summary"]) == case["summary"]
    sim = Simulation(fast_config("dataset.aspect_ratios=[]"), progress=False)
    assert isinstance(sim.test_data[0], tuple) and sim.train_data[0].boxes is None


# -- what can take them ---------------------------------------------------------------------
@pytest.mark.parametrize("model", [None, "mlp"])
def test_a_fixed_size_model_is_refused_naming_the_models_that_can(any_size, model):
    cfg = fast_config(PAPER, *([] if model is None else [f"model.name={model}"]))
    with pytest.raises(ConfigError) as err:
        Simulation(cfg, progress=False)
    text = str(err.value)
    assert f"model {model or 'cnn_small'!r} takes one input size only" in text
    can = [name for name in MODELS if name in zoo.VARIABLE_SIZE_MODELS]
    assert "any_size" in can
    assert text.endswith(f"models for images of any size: {', '.join(can)} (set model.name, "
                         "or dataset.aspect_ratios = [])")


def test_an_algorithm_that_needs_one_shape_is_refused(any_size, monkeypatch):
    # every algorithm of the registry takes crops; one that declares it cannot is refused
    fixed = dataclasses.replace(ALGORITHMS["fedavg"], name="one_shape", variable_size=False)
    monkeypatch.setitem(ALGORITHMS, "one_shape", fixed)
    with pytest.raises(ConfigError, match=r"'one_shape' needs images of one size.*"
                                          r"algorithms for images of any size: local, fedavg"):
        Simulation(aspect_config("algorithm.name=one_shape"), progress=False)


def test_a_crop_too_small_for_the_model_stops_the_run_before_round_one(any_size):
    with pytest.raises(ConfigError, match=r"'needs_room' cannot take the 5x8 crops"):
        Simulation(aspect_config("model.name=needs_room"), progress=False)
    Simulation(aspect_config("model.name=needs_room", 'dataset.aspect_ratios=["1:1"]'),
               progress=False)


# -- runs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["fedavg", "local", "fedprox", "fedproto", "dcpfl",
                                       "hypcluster", "l2sgd", "hierfavg", "perfedavg", "fedmd",
                                       "fedper", "pfedme", "heterofl"])
def test_algorithms_train_and_evaluate_on_crops(any_size, monkeypatch, algorithm):
    extra = {"hierfavg": ["topology.edges=2"], "hypcluster": ["train.rounds=3"],
             # public digits (8x8, whole) as FedMD's public set: a shape the crops have too
             "fedmd": ["algorithm.public_pool=64", "algorithm.public_size=32"],
             # static BatchNorm's statistics queried over crops too, at three widths
             "heterofl": ["model.name=any_size_bn", "system.devices=tiers"]}
    sim = Simulation(aspect_config(f"algorithm.name={algorithm}", *extra.get(algorithm, [])),
                     progress=False)
    seen: set[tuple[int, int]] = set()
    real_layout, real_buckets = Trainer.layout, ClientData.buckets
    whole_train: list[bool] = []  # per call of buckets() on training data: every sample?

    def layout(self, x):
        seen.add(tuple(x.shape[2:]))
        return real_layout(self, x)

    def buckets(self):
        parts = list(real_buckets(self))
        if self.x is sim.dataset.x_train:
            whole_train.append(sum(y.numel() for _, y in parts) == self.n)
        yield from parts

    real_statistics = HeteroFLClient.statistics
    queried: set[tuple[int, int]] = set()  # the input shapes of sBN's query passes

    def statistics(self, sub, rate, data):
        nonlocal seen
        outside, seen = seen, queried
        try:
            return real_statistics(self, sub, rate, data)
        finally:
            seen = outside

    monkeypatch.setattr(Trainer, "layout", layout)
    monkeypatch.setattr(ClientData, "buckets", buckets)
    monkeypatch.setattr(HeteroFLClient, "statistics", statistics)
    result = sim.run()
    # the algorithms that read all their training data at once do it shape by shape
    assert bool(whole_train) == (algorithm in ("fedproto", "dcpfl", "hypcluster", "heterofl"))
    assert all(whole_train)
    crops = {tuple(s) for s in torch.cat([t.boxes for t in sim.train_data])[:, 2:].tolist()}
    assert seen == crops == {(5, 8), (6, 8), (8, 8), (8, 6), (8, 5)}  # never a whole 8x8 only
    # sBN's query pass (HeteroFL on a BatchNorm model) sees the client's crops alone
    assert queried == (crops if algorithm == "heterofl" else set())
    row = result.metrics[-1]
    assert 0 <= row["acc_mean"] <= 1 and row["loss"] == row["loss"]
    assert list(sim.test_sizes) == [t.n for t in sim.test_data]


@pytest.mark.parametrize("mode", ["image", "client"])
def test_perfedavg_adapts_on_a_full_batch_of_one_crop_size(any_size, mode):
    """Per-FedAvg's evaluation-time step takes one batch: with crops it is batch_size
    samples of one of the client's crop sizes, cut from the client's own images."""
    from edgepfl.algorithms.perfedavg import PerFedAvgClient

    sim = Simulation(aspect_config("algorithm.name=perfedavg", "train.batch_size=8",
                                   f"dataset.aspect_mode={mode}"), progress=False)
    client = sim.client
    assert isinstance(client, PerFedAvgClient)
    sizes = set()
    for seed, data in enumerate(sim.train_data):
        state = client._adapt_batch(data, generator(seed))
        x, y = state["adapt.x"], state["adapt.y"]
        assert x.shape[0] == y.shape[0] == 8
        held = {tuple(s) for s in data.boxes[:, 2:].tolist()}
        assert tuple(x.shape[2:]) in held
        sizes.add(tuple(x.shape[2:]))
        # every sample is one of the client's crops of that size, with its label
        pos = [p for p in range(data.n) if tuple(data.boxes[p, 2:].tolist()) == x.shape[2:]]
        xs, ys = data.select(torch.tensor(pos))
        for xi, yi in zip(x, y, strict=True):
            k = next(i for i in range(len(pos)) if torch.equal(xs[i], xi))
            assert ys[k] == yi


def test_select_refuses_crops_of_several_sizes(any_size):
    _, clients = splits(aspect_config())
    data = clients[0][0]
    sizes = {tuple(s) for s in data.boxes[:, 2:].tolist()}
    assert len(sizes) > 1
    with pytest.raises(ValueError, match="crops of several sizes"):
        data.select(torch.arange(data.n))


def test_run_directory_records_crops_per_ratio_and_client(any_size, tmp_path):
    start_run(aspect_config("dataset.aspect_mode=client"), tmp_path / "run", progress=False)
    part = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert part["aspect"] == {"mode": "client", "ratios": list(PAPER_RATIOS),
                              "crop_sizes": {"16:9": [5, 8], "4:3": [6, 8], "1:1": [8, 8],
                                             "3:4": [8, 6], "9:16": [8, 5]}}
    for row in part["clients"]:
        assert sum(row["train_ratio_counts"].values()) == row["train_size"]
        assert sum(row["test_ratio_counts"].values()) == row["test_size"]
        assert sum(1 for v in row["train_ratio_counts"].values() if v) == 1  # client mode


def test_resume_draws_the_same_crops(any_size, tmp_path):
    overrides = ("model.name=any_size", PAPER, "train.rounds=3")
    straight = Simulation(fast_config(*overrides), progress=False)
    straight.run()
    first = Simulation(fast_config(*overrides), tmp_path, progress=False)
    first.step()
    first.save_checkpoint()
    resumed = Simulation(fast_config(*overrides), tmp_path, progress=False)
    resumed.load_checkpoint(tmp_path / CHECKPOINT)
    resumed.step()
    resumed.step()
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


def test_a_flower_node_cuts_the_simulations_crops(any_size):
    flower = pytest.importorskip("edgepfl.engine.flower_client")
    cfg = resolve(aspect_config("dataset.aspect_mode=client", "seed=3"))
    node = flower._node(json.dumps(cfg.model_dump(), sort_keys=True))
    _, ours = splits(cfg)
    for cid, (train, test) in enumerate(ours):
        theirs = node.split(cid)
        assert torch.equal(theirs[0].boxes, train.boxes)
        assert torch.equal(theirs[1].boxes, test.boxes)
    # and the same crops mean the same generator draws: two epochs, batch for batch
    a = [y.tolist() for _, y in ours[0][0].batches(16, generator(3, "t"))]
    b = [y.tolist() for _, y in node.split(0)[0].batches(16, generator(3, "t"))]
    assert a == b


def test_a_flower_run_on_crops_equals_the_simulation(any_size):
    """Over LocalGrid (Flower's wire format); the ratios travel as one string, since a
    Flower run config holds scalars only."""
    pytest.importorskip("flwr")
    from edgepfl.engine.flower_local import run_local

    rc = {"dataset.name": "synthetic", "partition.clients": 3, "train.rounds": 2,
          "train.batch_size": 32, "train.local_epochs": 1, "train.lr": 0.05,
          "output.plots": False, "system.count_flops": False, "model.name": "any_size",
          "dataset.aspect_ratios": ",".join(PAPER_RATIOS), "algorithm.name": "fedavg"}
    sim = Simulation(fast_config(*[f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                   for k, v in rc.items()]), progress=False).run()
    result = run_local(rc)
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "bytes_down"):
            assert ours[key] == theirs[key], (ours["round"], key)
