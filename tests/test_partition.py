"""Defining properties of every partition scheme, checked on label vectors alone."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from edgepfl.data import SCHEMES, Partition, make_partition
from edgepfl.data.partition import _test_counts
from edgepfl.errors import ConfigError, DataError

# MNIST's real class sizes: uneven pools are what makes primary_secondary hard to fit.
MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def shuffled_labels(counts: list[int], seed: int) -> torch.Tensor:
    labels = np.repeat(np.arange(len(counts)), counts)
    return torch.from_numpy(np.random.default_rng(seed).permutation(labels))


@pytest.fixture(scope="module")
def small() -> tuple[torch.Tensor, torch.Tensor]:
    """2,000 train / 500 test labels over 10 classes, like the synthetic data set."""
    return shuffled_labels([200] * 10, 1), shuffled_labels([50] * 10, 2)


@pytest.fixture(scope="module")
def mnist_like() -> tuple[torch.Tensor, torch.Tensor]:
    return shuffled_labels(MNIST_TRAIN, 3), shuffled_labels(MNIST_TEST, 4)


def check_structure(part: Partition, n_train: int, n_test: int, clients: int) -> None:
    assert part.num_clients == clients == len(part.test)
    for parts, n in ((part.train, n_train), (part.test, n_test)):
        for idx in parts:
            assert idx.dtype == torch.int64 and idx.ndim == 1
            if idx.numel():
                assert int(idx.min()) >= 0 and int(idx.max()) < n
                assert bool((idx[1:] > idx[:-1]).all()), "indices must be sorted and unique"
        joined = torch.cat(parts)
        assert joined.numel() == torch.unique(joined).numel(), "an index is used twice"


SCHEME_ARGS = {
    "iid": {},
    "dirichlet": {"alpha": 0.3, "min_size": 10},
    "pathological": {"classes_per_client": 2},
    "primary_secondary": {},
    "hierarchical": {"alpha": 1.0, "edge_alpha": 0.3, "min_size": 10, "edges": 3},
}
# the schemes drawn from labels; natural takes the clients the data names (tested below)
LABEL_SCHEMES = [s for s in SCHEMES if s != "natural"]


@pytest.mark.parametrize("scheme", LABEL_SCHEMES)
def test_every_scheme_gives_disjoint_sorted_in_range_indices(scheme, small):
    y_train, y_test = small
    part = make_partition(y_train, y_test, 10, scheme, 10, seed=0, **SCHEME_ARGS[scheme])
    check_structure(part, len(y_train), len(y_test), 10)
    assert part.scheme == scheme and part.num_classes == 10
    train_used = sum(idx.numel() for idx in part.train)
    test_used = sum(idx.numel() for idx in part.test)
    if scheme == "primary_secondary":
        assert train_used == 10 * (len(y_train) // 10)
    else:
        # These schemes give away every sample, and the test split follows suit.
        assert train_used == len(y_train)
        assert test_used == len(y_test)
    assert all(idx.numel() > 0 for idx in part.train + part.test)


@pytest.mark.parametrize("scheme", LABEL_SCHEMES)
def test_same_seed_same_partition_other_seed_different(scheme, small):
    y_train, y_test = small
    args = SCHEME_ARGS[scheme]
    a = make_partition(y_train, y_test, 10, scheme, 10, seed=7, **args)
    b = make_partition(y_train, y_test, 10, scheme, 10, seed=7, **args)
    c = make_partition(y_train, y_test, 10, scheme, 10, seed=8, **args)
    assert all(torch.equal(x, y) for x, y in zip(a.train + a.test, b.train + b.test, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.train, c.train, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.test, c.test, strict=True))


@pytest.mark.parametrize("scheme", LABEL_SCHEMES)
def test_train_split_does_not_depend_on_test_labels(scheme, small):
    y_train, y_test = small
    a = make_partition(y_train, y_test, 10, scheme, 10, seed=3, **SCHEME_ARGS[scheme])
    b = make_partition(y_train, y_test[:100], 10, scheme, 10, seed=3, **SCHEME_ARGS[scheme])
    assert all(torch.equal(x, y) for x, y in zip(a.train, b.train, strict=True))


def test_iid_sizes_are_near_equal(small):
    y_train, y_test = small
    part = make_partition(y_train, y_test, 10, "iid", 7, seed=0)
    sizes = [idx.numel() for idx in part.train]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(y_train)


def test_dirichlet_respects_min_size(small):
    y_train, y_test = small
    for seed in range(3):
        part = make_partition(y_train, y_test, 10, "dirichlet", 40, seed, alpha=0.5, min_size=25)
        assert min(idx.numel() for idx in part.train) >= 25
        # The bound binds: the first draw, taken when any size is fine, has a smaller client.
        free = make_partition(y_train, y_test, 10, "dirichlet", 40, seed, alpha=0.5, min_size=1)
        assert min(idx.numel() for idx in free.train) < 25


def mean_max_share(counts: np.ndarray) -> float:
    return float((counts.max(1) / counts.sum(1)).mean())


def test_dirichlet_lower_alpha_is_more_skewed(small):
    y_train, y_test = small
    skew = {}
    for alpha in (0.1, 100.0):
        part = make_partition(y_train, y_test, 10, "dirichlet", 10, 0, alpha=alpha, min_size=1)
        skew[alpha] = mean_max_share(part.class_counts(y_train, y_test)[0])
    assert skew[0.1] > 0.5 > 0.2 > skew[100.0]


def test_dirichlet_impossible_min_size_is_a_data_error(small):
    y_train, y_test = small
    with pytest.raises(DataError, match="min_size"):
        make_partition(y_train, y_test, 10, "dirichlet", 100, 0, alpha=0.3, min_size=21)
    with pytest.raises(DataError, match="raise partition.alpha"):
        make_partition(y_train, y_test, 10, "dirichlet", 100, 0, alpha=0.001, min_size=19)


@pytest.mark.parametrize("k", [1, 2, 3, 10])
def test_pathological_each_client_has_exactly_k_classes(k, small):
    y_train, y_test = small
    part = make_partition(y_train, y_test, 10, "pathological", 20, 0, classes_per_client=k)
    train_counts, test_counts = part.class_counts(y_train, y_test)
    assert ((train_counts > 0).sum(1) == k).all()
    expected = [{(i * k + j) % 10 for j in range(k)} for i in range(20)]
    assert [set(np.flatnonzero(row).tolist()) for row in train_counts] == expected
    holders = (train_counts > 0).sum(0)
    assert holders.max() - holders.min() <= 1
    # Each class is split evenly among its holders.
    for c in range(10):
        held = train_counts[:, c][train_counts[:, c] > 0]
        assert held.max() - held.min() <= 1
    assert ((test_counts > 0) <= (train_counts > 0)).all()


@pytest.mark.parametrize("clients", [10, 20, 100])
def test_primary_secondary_shares(clients, mnist_like):
    y_train, y_test = mnist_like
    part = make_partition(y_train, y_test, 10, "primary_secondary", clients, seed=clients)
    train_counts, _ = part.class_counts(y_train, y_test)
    per = len(y_train) // clients
    assert (train_counts.sum(1) == per).all()
    shares = -np.sort(-train_counts, axis=1) / per
    slack = 0.5 / per + 1e-12  # rounding to whole samples
    assert (shares[:, 0] >= 0.4 - slack).all() and (shares[:, 0] <= 0.6 + slack).all()
    assert (shares[:, 1] >= 0.2 - slack).all() and (shares[:, 1] <= 0.4 + slack).all()
    assert (train_counts.argmax(1) == np.arange(clients) % 10).all()
    # The third class onward shares what is left (never more than 40%), spread out.
    assert (shares[:, 2:].sum(1) <= 0.4 + 2 * slack).all()
    assert ((train_counts > 0).sum(1) >= 9).all()


def test_primary_secondary_shares_are_random_across_clients(mnist_like):
    y_train, y_test = mnist_like
    part = make_partition(y_train, y_test, 10, "primary_secondary", 100, seed=0)
    train_counts, _ = part.class_counts(y_train, y_test)
    ordered = -np.sort(-train_counts, axis=1)
    assert ordered[:, 0].std() > 20 and ordered[:, 1].std() > 20  # U(0.4,0.6)*600 has sd 35
    secondary = np.argsort(-train_counts, axis=1)[:, 1]
    assert len(set(secondary.tolist())) == 10


def test_primary_secondary_with_too_few_clients_says_what_helps(mnist_like):
    y_train, y_test = mnist_like
    with pytest.raises(DataError) as err:
        make_partition(y_train, y_test, 10, "primary_secondary", 2, seed=0)
    message = str(err.value)
    assert "at least as many clients as classes (10)" in message
    assert "fraction does not help" in message


@pytest.mark.parametrize("scheme", LABEL_SCHEMES)
def test_test_split_follows_train_distribution(scheme, mnist_like):
    y_train, y_test = mnist_like
    part = make_partition(y_train, y_test, 10, scheme, 10, seed=1, **SCHEME_ARGS[scheme])
    train_counts, test_counts = part.class_counts(y_train, y_test)
    assert ((test_counts > 0) <= (train_counts > 0)).all(), "test class the client never saw"
    p_train = train_counts / train_counts.sum(1, keepdims=True)
    p_test = test_counts / test_counts.sum(1, keepdims=True)
    total_variation = 0.5 * np.abs(p_train - p_test).sum(1)
    assert total_variation.max() < 0.05
    # Test sizes are proportional to train sizes.
    ratio = test_counts.sum(1) / train_counts.sum(1)
    assert np.allclose(ratio, len(y_test) / len(y_train), rtol=0.05)


def test_client_with_train_data_gets_a_test_sample_when_possible():
    # Client 1 holds 10% of class 0: 0.5 of the 5 test samples rounds to 0 or 1.
    train_counts = np.array([[90, 0], [10, 0]])
    for seed in range(10):
        counts = _test_counts(
            train_counts, np.array([100, 0]), np.array([5, 0]), np.random.default_rng(seed)
        )
        assert counts[:, 0].tolist() == [4, 1]


def test_zero_test_samples_stays_zero_without_a_donor():
    train_counts = np.array([[5, 0], [0, 5]])
    counts = _test_counts(
        train_counts, np.array([5, 5]), np.array([1, 0]), np.random.default_rng(0)
    )
    assert counts.tolist() == [[1, 0], [0, 0]]


def test_class_counts_and_json(small):
    y_train, y_test = small
    part = make_partition(y_train, y_test, 10, "dirichlet", 5, seed=0)
    train_counts, test_counts = part.class_counts(y_train, y_test)
    assert train_counts.shape == test_counts.shape == (5, 10)
    assert train_counts.dtype == np.int64
    assert train_counts.sum(0).tolist() == torch.bincount(y_train, minlength=10).tolist()
    doc = json.loads(json.dumps(part.to_json(y_train, y_test)))
    assert doc["scheme"] == "dirichlet" and doc["num_clients"] == 5 and doc["num_classes"] == 10
    assert [c["train_size"] for c in doc["clients"]] == [idx.numel() for idx in part.train]
    assert [c["test_size"] for c in doc["clients"]] == [idx.numel() for idx in part.test]
    assert [c["train_class_counts"] for c in doc["clients"]] == train_counts.tolist()
    assert [c["test_class_counts"] for c in doc["clients"]] == test_counts.tolist()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"scheme": "dirichlet", "alpha": -0.5}, "-0.5"),
        ({"scheme": "dirichlet", "alpha": 0.0}, "alpha must be > 0"),
        ({"scheme": "dirichlet", "alpha": float("nan")}, "nan"),
        ({"scheme": "iid", "clients": 2001}, "2001"),
        ({"scheme": "iid", "clients": 0}, "partition.clients=0"),
        ({"scheme": "pathological", "classes_per_client": 0}, "classes_per_client=0"),
        ({"scheme": "pathological", "classes_per_client": 11}, "classes_per_client=11"),
        ({"scheme": "shards"}, "'shards'"),
    ],
)
def test_bad_inputs_raise_config_error_naming_the_value(kwargs, needle, small):
    y_train, y_test = small
    args = {"clients": 10, "seed": 0, **kwargs}
    with pytest.raises(ConfigError) as err:
        make_partition(y_train, y_test, 10, **args)
    assert needle in str(err.value)


def test_error_messages_list_choices_and_limits(small):
    y_train, y_test = small
    with pytest.raises(ConfigError) as err:
        make_partition(y_train, y_test, 10, "shards", 10, 0)
    assert all(name in str(err.value) for name in SCHEMES)
    with pytest.raises(ConfigError, match=r"\[1, 2000\]"):
        make_partition(y_train, y_test, 10, "iid", 5000, 0)
    with pytest.raises(ConfigError, match=r"\[1, 10\]"):
        make_partition(y_train, y_test, 10, "pathological", 5, 0, classes_per_client=12)


def test_labels_out_of_range_are_a_data_error(small):
    y_train, y_test = small
    with pytest.raises(DataError, match="label 9"):
        make_partition(y_train, y_test, 9, "iid", 10, 0)


@pytest.mark.parametrize("scheme", LABEL_SCHEMES)
def test_fast_for_60000_labels_and_100_clients(scheme, mnist_like):
    y_train, y_test = mnist_like
    start = time.perf_counter()
    part = make_partition(y_train, y_test, 10, scheme, 100, seed=0, **SCHEME_ARGS[scheme])
    elapsed = time.perf_counter() - start
    assert part.num_clients == 100
    assert elapsed < 1.0, f"{scheme} took {elapsed:.2f} s"


def test_natural_gives_each_client_the_samples_the_data_names(small):
    y_train, y_test = small
    rng = np.random.default_rng(0)
    owners = torch.from_numpy(rng.integers(0, 7, len(y_train)))
    test_owners = torch.from_numpy(rng.integers(0, 7, len(y_test)))
    part = make_partition(y_train, y_test, 10, "natural", 7, seed=0, train_clients=owners,
                          test_clients=test_owners)
    check_structure(part, len(y_train), len(y_test), 7)
    for i in range(7):
        assert torch.equal(part.train[i], torch.nonzero(owners == i).flatten())
        assert torch.equal(part.test[i], torch.nonzero(test_owners == i).flatten())
    # the seed draws nothing when the data names every sample's client
    again = make_partition(y_train, y_test, 10, "natural", 7, seed=5, train_clients=owners,
                           test_clients=test_owners)
    assert all(torch.equal(a, b) for a, b in zip(part.train + part.test,
                                                 again.train + again.test, strict=True))


def test_natural_without_test_ids_gives_test_samples_by_label_share(small):
    y_train, y_test = small
    owners = y_train % 2  # client 0 holds the even classes, client 1 the odd
    part = make_partition(y_train, y_test, 10, "natural", 2, seed=0, train_clients=owners)
    assert bool((y_test[part.test[0]] % 2 == 0).all()) and bool((y_test[part.test[1]] % 2).all())
    assert sum(len(t) for t in part.test) == len(y_test)


def test_natural_refuses_missing_or_out_of_range_client_ids(small):
    y_train, y_test = small
    with pytest.raises(ConfigError, match="names none"):
        make_partition(y_train, y_test, 10, "natural", 3, seed=0)
    with pytest.raises(DataError, match=r"train sample of client 3, but partition.clients = 3 "
                                        r"\(valid ids 0..2\)"):
        make_partition(y_train, y_test, 10, "natural", 3, seed=0,
                       train_clients=torch.arange(len(y_train)) % 4)
    with pytest.raises(DataError, match="client 2 .* has no train samples"):
        make_partition(y_train, y_test, 10, "natural", 3, seed=0,
                       train_clients=torch.arange(len(y_train)) % 2)
