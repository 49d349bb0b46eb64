import pytest
import torch

from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.rng import select_clients
from edgepfl.federation.store import StackedStore


def test_message_bytes_count_payload_and_metadata():
    msg = Message({"w": torch.zeros(10, 3), "b": torch.zeros(4, dtype=torch.float64)},
                  {"num_samples": 12})
    assert msg.payload_bytes == 10 * 3 * 4 + 4 * 8
    assert msg.meta_bytes == len('{"num_samples":12}')
    assert msg.nbytes == msg.payload_bytes + msg.meta_bytes
    assert Message().nbytes == 0


def test_delivery_copies_so_receiver_cannot_touch_sender_memory():
    sent = torch.ones(3)
    got = Message({"w": sent}).delivered()
    got.tensors["w"].add_(1)
    assert torch.equal(sent, torch.ones(3))


@pytest.mark.parametrize("meta", [{"x": object()}, {"x": float("nan")}, {"x": [1, {}]}])
def test_message_rejects_metadata_a_peer_should_not_send(meta):
    with pytest.raises(MessageError, match="x"):
        Message({}, meta)


def test_message_rejects_non_tensor_payload():
    with pytest.raises(MessageError, match="w"):
        Message({"w": [1.0, 2.0]})


def test_stacked_store_rows_and_checkpoint_round_trip():
    store = StackedStore(4)
    store.set_row(2, {"a": torch.arange(3.0)})
    assert store.stack("a").shape == (4, 3)
    assert torch.equal(store.row(2)["a"], torch.arange(3.0))
    assert store.row(0) == {}  # rows never set are absent, not zeros
    # another client's "a" of another shape (another architecture) gets a stack of its own
    store.set_row(1, {"a": torch.zeros(5)})
    assert store.row(1)["a"].shape == (5,) and store.row(2)["a"].shape == (3,)
    other = StackedStore(4)
    other.load_state_dict(store.state_dict("client/"), "client/")
    assert torch.equal(other.row(2)["a"], torch.arange(3.0))
    assert torch.equal(other.row(1)["a"], torch.zeros(5))
    assert other.row(0) == {}


def test_client_sampling_is_seeded_and_sized():
    a = [select_clients(7, r, 100, 0.1) for r in range(1, 6)]
    b = [select_clients(7, r, 100, 0.1) for r in range(1, 6)]
    assert a == b
    assert all(len(s) == 10 and len(set(s)) == 10 for s in a)
    assert len({tuple(s) for s in a}) > 1  # rounds differ
    assert select_clients(7, 1, 100, 0.1) != select_clients(8, 1, 100, 0.1)
    assert select_clients(0, 1, 10, 1.0) == list(range(10))
    assert len(select_clients(0, 1, 10, 0.01)) == 1
