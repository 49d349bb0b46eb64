"""Flower's ServerApp and ClientApp in one process, over a ``LocalGrid``: a check that a
configuration runs on Flower before it is deployed (``run_local``), and what the tests
and the Flower benchmarks drive the two apps with. Apart from the apps (``engine.flower``)
because only this part leans on Flower internals, so that a Flower release that moves
them breaks the one-process check alone, not a deployment.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Error, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from edgepfl.engine.flower_client import client_app
from edgepfl.engine.flower_server import FlowerResult, run_server
from edgepfl.engine.flower_wire import PARTITION_ID, WAIT, config_from_run

if TYPE_CHECKING:
    from flwr.supercore.run import Run


def _internals() -> SimpleNamespace:
    """Flower internals that only ``LocalGrid`` needs (its wire format, the run record,
    the process's task identity), imported here so that a Flower release that moves them
    breaks the one-process check alone, not a deployment's ServerApp and ClientApp."""
    try:
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.common.serde import message_from_proto, message_to_proto
        from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=E0611
        from flwr.supercore.run import Run
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError as exc:  # pragma: no cover - depends on the installed flwr
        raise ImportError(f"edgepfl's LocalGrid uses Flower internals that this flwr lacks "
                          f"(tested with flwr 1.41): {exc}") from exc
    return SimpleNamespace(SUPERLINK_NODE_ID=SUPERLINK_NODE_ID, ProtoMessage=ProtoMessage,
                           message_from_proto=message_from_proto,
                           message_to_proto=message_to_proto, Run=Run, TaskIdentity=TaskIdentity)


class LocalGrid(Grid):
    """A Flower ``Grid`` whose nodes are ClientApp calls in this process, each with its own
    persistent ``Context``. Every message is turned into Flower's wire format (protobuf
    bytes) and back on the way out and on the way in, as through a SuperLink, and a failing
    ClientApp becomes an error reply, as on a SuperNode. Node ids are not the client ids, so
    the server's node discovery is exercised too."""

    def __init__(self, app: ClientApp, num_nodes: int, run_config: Mapping[str, Any]):
        self.app = app
        self.contexts = {
            10_007 * (num_nodes - k): Context(run_id=1, node_id=10_007 * (num_nodes - k),
                                              node_config={PARTITION_ID: k,
                                                           "num-partitions": num_nodes},
                                              state=RecordDict(), run_config=dict(run_config))
            for k in range(num_nodes)}
        self._run = _internals().Run.create_empty(1)
        self._replies: dict[str, FlowerMessage] = {}

    @staticmethod
    def _wire(message: FlowerMessage) -> FlowerMessage:
        fl = _internals()
        wire = fl.message_to_proto(message).SerializeToString()
        return fl.message_from_proto(fl.ProtoMessage.FromString(wire))

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> FlowerMessage:
        return FlowerMessage(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[FlowerMessage]) -> Iterable[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            received = self._wire(message)
            context = self.contexts[received.metadata.dst_node_id]
            try:
                reply = self.app(received, context)
            except Exception as exc:  # a SuperNode turns a failing ClientApp into an error reply
                reply = FlowerMessage(Error(code=1, reason=f"{type(exc).__name__}: {exc}"),
                                      reply_to=received)
            self._replies[message.metadata.message_id] = self._wire(reply)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[FlowerMessage]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[FlowerMessage], *,
                         timeout: float | None = None) -> Iterable[FlowerMessage]:
        return self.pull_messages(self.push_messages(messages))


@contextmanager
def _server_identity() -> Iterator[None]:
    """Flower stamps new messages with the identity of the process's task, which its
    runtime sets for a real ServerApp; here this process plays the SuperLink's part."""
    fl = _internals()
    ident = fl.TaskIdentity
    saved = ident._run_id, ident._node_id, ident._task_id
    ident.run_id, ident.node_id, ident.task_id = 1, fl.SUPERLINK_NODE_ID, 0
    try:
        yield
    finally:
        ident._run_id, ident._node_id, ident._task_id = saved


def run_local(run_config: Mapping[str, Any], progress: bool | None = False,
              app: ClientApp | None = None, num_nodes: int | None = None) -> FlowerResult:
    """The Flower ServerApp and ClientApp in one process over a ``LocalGrid``, one node per
    client unless ``num_nodes`` says otherwise: a check that a configuration runs on Flower
    before deploying it. Its nodes are all there from the start, so ``wait`` defaults to 0."""
    run_config = {WAIT: 0, **run_config}
    cfg = config_from_run(run_config)
    nodes = cfg.partition.clients if num_nodes is None else num_nodes
    grid = LocalGrid(client_app if app is None else app, nodes, run_config)
    with _server_identity():
        return run_server(grid, run_config, progress)
