"""Flower deployment: an algorithm's Server and Client parts inside a Flower ServerApp and
ClientApp, the same objects the simulation drives.

What maps to what:

* an edgepfl ``Message`` is a Flower ``RecordDict`` with an ``ArrayRecord`` (the tensors)
  and a ``ConfigRecord`` (the metadata); the byte counts stay edgepfl's own
  (``Message.nbytes``), so a deployment reports what the simulation reports;
* a client id is a SuperNode whose node config names its partition (``partition-id``, as in
  Flower's examples); the ServerApp asks every node once and refuses a federation whose
  nodes do not cover clients 0..N-1 exactly once;
* a round is the Flower message's ``group_id``;
* what a client keeps between rounds lives in the node's ``Context.state`` and never
  leaves it;
* the configuration is the Flower run config: every key an edgepfl setting in dotted form
  (``"train.rounds" = 50``), plus three of the ServerApp's own: ``out``, the folder where
  it writes ``config.json``, ``metrics.csv``, ``summary.json`` and the algorithm's
  artifacts (never over an earlier run), ``wait``, how many seconds it waits for the
  SuperNodes to connect (default 300), and ``timeout``, how many seconds it waits for a
  round's replies (default 3600).

Client seeds are derived exactly as in the simulation (run seed, round, client), and each
node loads the data set from its own ``dataset.root`` / ``EDGEPFL_DATA`` and takes its
client's share of the seeded partition, so a deployment reproduces the simulation round
for round (tested through ``LocalGrid``). The ServerApp loads the data set only for the
model's input shape and class count; it uses no sample.

Requires the optional dependency ``flwr`` (``pip install 'edgepfl[flower]'``).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

try:
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        Error,
        MetricRecord,
        RecordDict,
    )
    from flwr.app import Message as FlowerMessage
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"edgepfl's Flower runtime needs flwr: pip install 'edgepfl[flower]' ({exc})") from exc

if TYPE_CHECKING:
    from flwr.supercore.run import Run

from edgepfl.algorithms.base import Client
from edgepfl.algorithms.training import ClientData
from edgepfl.config import Config, build_config, set_dotted
from edgepfl.data.datasets import Dataset, load_dataset
from edgepfl.data.partition import Partition
from edgepfl.engine.parts import Parts, load_federation, resolve
from edgepfl.engine.progress import RoundProgress
from edgepfl.engine.rounds import (
    METRIC_COLUMNS,
    ClientReply,
    Figures,
    Rounds,
    Transport,
    metric_columns,
)
from edgepfl.engine.simulation import client_split, evaluate_client, finish_run_dir
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.rng import derive_seed, generator
from edgepfl.federation.topology import CLOUD
from edgepfl.io import write_csv, write_json
from edgepfl.system import COST_COLUMNS

TENSORS = "edgepfl.tensors"
META = "edgepfl.meta"
STATS = "edgepfl.stats"
STATE = "edgepfl.state"
PARTITION_ID = "partition-id"
EDGE_ID = "edge-id"
OUT = "out"
WAIT = "wait"
TIMEOUT = "timeout"
SERVER_KEYS = {OUT: None, WAIT: 300.0, TIMEOUT: 3600.0}  # the ServerApp's own, with defaults
# a deployment's time is real: no simulated network or compute costs
COLUMNS = [c for c in METRIC_COLUMNS if c not in COST_COLUMNS]


# -- messages -----------------------------------------------------------------------------
def to_content(msg: Message | None) -> RecordDict:
    """An edgepfl message as Flower records (``None``, "nothing to send", as no records)."""
    if msg is None:
        return RecordDict()
    try:
        meta = ConfigRecord(dict(msg.meta))
    except (TypeError, ValueError) as exc:
        raise MessageError(f"message metadata cannot travel as a Flower ConfigRecord: {exc}") from None
    tensors = ArrayRecord()
    for name, value in msg.tensors.items():
        tensors[name] = Array(value.detach().cpu().contiguous().numpy())
    return RecordDict({TENSORS: tensors, META: meta})


def from_content(content: RecordDict, optional: bool = False) -> Message | None:
    """Flower records back into an edgepfl message; anything else is a ``MessageError``
    (the records come from a peer). ``optional``: no records at all means ``None``."""
    has = [k in content for k in (TENSORS, META)]
    if not any(has) and optional:
        return None
    if not all(has):
        raise MessageError(f"Flower message lacks the records {TENSORS!r} and {META!r}; it has "
                           f"{sorted(content)}")
    tensors, meta = content[TENSORS], content[META]
    if not isinstance(tensors, ArrayRecord) or not isinstance(meta, ConfigRecord):
        raise MessageError(f"Flower message records {TENSORS!r} / {META!r} are "
                           f"{type(tensors).__name__} / {type(meta).__name__}, expected "
                           "ArrayRecord / ConfigRecord")
    out: dict[str, torch.Tensor] = {}
    for name, array in tensors.items():
        try:
            out[name] = torch.from_numpy(np.array(array.numpy(), copy=True))
        except (TypeError, ValueError) as exc:
            raise MessageError(f"tensor {name!r} of a Flower message cannot be read: {exc}") from None
    values = {k: (list(v) if isinstance(v, list) else v) for k, v in meta.items()}
    if any(isinstance(v, bytes) or (isinstance(v, list) and any(isinstance(i, bytes) for i in v))
           for v in values.values()):
        raise MessageError("Flower message metadata holds bytes; edgepfl metadata is JSON scalars")
    return Message(out, values)


# -- configuration ------------------------------------------------------------------------
def config_from_run(run_config: Mapping[str, Any]) -> Config:
    """The edgepfl configuration in a Flower run config (flat dotted keys; ``out``,
    ``wait`` and ``timeout`` are the ServerApp's own)."""
    nested: dict[str, Any] = {}
    for key, value in run_config.items():
        if key not in SERVER_KEYS:
            set_dotted(nested, str(key), value, f"Flower run config key {key!r}")
    return resolve(build_config(nested))


def seconds(run_config: Mapping[str, Any], key: str) -> float:
    """The ServerApp's ``wait`` or ``timeout`` from the run config, checked."""
    value = run_config.get(key, SERVER_KEYS[key])
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(f"Flower run config {key}={value!r}: it must be a number of seconds "
                          f">= 0 (default {SERVER_KEYS[key]:g})")
    return float(value)


def partition_id(context: Context, num_clients: int) -> int:
    value = context.node_config.get(PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_clients:
        raise ConfigError(f"SuperNode {context.node_id} has node config {PARTITION_ID}={value!r}; "
                          f"it must be a client id 0..{num_clients - 1} "
                          f"(flower-supernode --node-config '{PARTITION_ID}=0')")
    return value


# -- the client side ----------------------------------------------------------------------
@dataclass
class _Node:
    """What a process serving clients builds once per configuration: the data, and one
    algorithm client part per architecture (it keeps no per-client memory, as in the
    simulation, so one serves every client of that architecture a process hosts)."""

    parts: Parts
    clients: dict[str, Client]
    dataset: Dataset
    partition: Partition

    def client(self, cid: int) -> Client:
        return self.clients[self.parts.federation.arch[cid]]

    def trainer(self, cid: int):
        return self.parts.trainers[self.parts.federation.arch[cid]]

    def split(self, cid: int) -> tuple[ClientData, tuple[torch.Tensor, torch.Tensor]]:
        return client_split(self.dataset, self.partition, cid)


@lru_cache(maxsize=2)
def _node(config_json: str) -> _Node:
    cfg = build_config(json.loads(config_json))
    dataset, partition = load_federation(cfg)
    parts = Parts.build(cfg, dataset, partition.num_clients)
    return _Node(parts, parts.clients(), dataset, partition)


def _client(context: Context) -> tuple[Config, int, _Node]:
    cfg = config_from_run(context.run_config)
    cid = partition_id(context, cfg.partition.clients)
    return cfg, cid, _node(json.dumps(cfg.model_dump(), sort_keys=True))


def _state(context: Context, node: _Node, cid: int) -> dict[str, torch.Tensor]:
    if STATE not in context.state:
        arch = node.parts.architectures[node.parts.federation.arch[cid]]
        return node.client(cid).init_state(cid, arch.init_model)
    return {k: torch.from_numpy(np.array(a.numpy(), copy=True))
            for k, a in context.state[STATE].items()}


def _round(message: FlowerMessage) -> int:
    """The message's group id: the client step of a train message (the round in a star;
    (round - 1) * k2 + edge round in a hierarchy), the round of an evaluate message."""
    try:
        rnd = int(message.metadata.group_id)
    except ValueError:
        rnd = 0
    if rnd < 1:
        raise MessageError(f"Flower message group_id {message.metadata.group_id!r} is not a round "
                           "number (1, 2, ...)")
    return rnd


client_app = ClientApp()


@client_app.query()
def _query(message: FlowerMessage, context: Context) -> FlowerMessage:
    cfg = config_from_run(context.run_config)
    cid = partition_id(context, cfg.partition.clients)
    said = {PARTITION_ID: cid}
    edge = context.node_config.get(EDGE_ID)
    if edge is not None:
        said[EDGE_ID] = edge
    return FlowerMessage(RecordDict({META: ConfigRecord(said)}), reply_to=message)


@client_app.train()
def _train(message: FlowerMessage, context: Context) -> FlowerMessage:
    cfg, cid, node = _client(context)
    rnd = _round(message)
    msg = from_content(message.content)
    state = _state(context, node, cid)
    torch.manual_seed(derive_seed(cfg.seed, "torch", rnd, cid))
    train, _ = node.split(cid)
    result = node.client(cid).update(cid, msg, state, train,
                                     generator(cfg.seed, "client", rnd, cid))
    # entries a client does not return keep their value, as in the simulation's store
    kept = {**state, **result.state}
    context.state[STATE] = ArrayRecord(
        {k: Array(v.detach().contiguous().numpy()) for k, v in kept.items()})
    content = to_content(result.reply)
    # a NaN loss travels as NaN, so that a diverging client shows, as in the simulation
    stats = {k: float(v) for k, v in result.stats.items()}
    content[STATS] = MetricRecord({**stats, "num_samples": train.n})
    return FlowerMessage(content, reply_to=message)


@client_app.evaluate()
def _evaluate(message: FlowerMessage, context: Context) -> FlowerMessage:
    _, cid, node = _client(context)
    eval_msg = from_content(message.content, optional=True)
    train, (x, y) = node.split(cid)
    figures: dict[str, int | float] = {"correct": 0, "count": int(y.numel()), "loss": 0.0}
    if y.numel():
        node.trainer(cid).forget()
        f = evaluate_client(node.client(cid), node.trainer(cid), cid, _state(context, node, cid),
                            eval_msg, train, x, y)
        figures.update(correct=int(f.correct), loss=float(f.loss))
        for name, (correct, loss) in f.extra.items():
            figures[f"correct.{name}"], figures[f"loss.{name}"] = int(correct), float(loss)
    return FlowerMessage(RecordDict({STATS: MetricRecord(figures)}), reply_to=message)


# -- the server side ----------------------------------------------------------------------
@dataclass
class FlowerResult:
    summary: dict
    metrics: list[dict]
    out_dir: Path | None


def _exchange(grid: Grid, nodes: Mapping[int, int], contents: Mapping[int, RecordDict],
              kind: str, group: str, timeout: float) -> dict[int, FlowerMessage]:
    """Send one message per client and collect exactly one good reply from each, in the
    order of ``contents`` whatever order they arrive in (the aggregate's floating-point sums
    follow it, so this is what keeps a deployment equal to the simulation)."""
    sent = [FlowerMessage(content, nodes[cid], kind, group_id=group)
            for cid, content in contents.items()]
    by_node = {node: cid for cid, node in nodes.items()}
    replies: dict[int, FlowerMessage] = {}
    for reply in grid.send_and_receive(sent, timeout=timeout):
        cid = by_node.get(reply.metadata.src_node_id)
        if cid is None or cid not in contents or cid in replies:
            raise MessageError(f"unexpected {kind} reply from node {reply.metadata.src_node_id}")
        if reply.has_error():
            raise EdgepflError(f"client {cid} (node {reply.metadata.src_node_id}) failed its "
                               f"{kind} message of round {group}: {reply.error.reason}")
        replies[cid] = reply
    missing = sorted(set(contents) - set(replies))
    if missing:
        raise EdgepflError(f"no {kind} reply in round {group} from clients {missing} within "
                           f"{TIMEOUT}={timeout:g} s")
    return {cid: replies[cid] for cid in contents}


def _figures(reply: FlowerMessage, cid: int, *keys: str) -> MetricRecord:
    """The figures a client reports beside its message, checked: a peer's reply."""
    record = reply.content.get(STATS) if reply.has_content() else None
    if not isinstance(record, MetricRecord) or any(k not in record for k in keys):
        raise MessageError(f"client {cid}'s {reply.metadata.message_type} reply lacks the "
                           f"MetricRecord {STATS!r} with {list(keys)}")
    return record


def discover(grid: Grid, num_clients: int, wait_s: float = 0.0,
             timeout: float = SERVER_KEYS[TIMEOUT],
             parents: tuple[int, ...] | None = None) -> dict[int, int]:
    """Client id -> node id, from every node's answer to a query, once ``num_clients``
    nodes are connected or ``wait_s`` seconds have passed (SuperNodes join when they start).
    A node that names its edge (node config ``edge-id``) must name the one the federation
    gives its client (``parents``), or the run is refused before round 1."""
    deadline = time.monotonic() + wait_s
    node_ids = sorted(grid.get_node_ids())
    while len(node_ids) < num_clients and time.monotonic() < deadline:
        time.sleep(1.0)
        node_ids = sorted(grid.get_node_ids())
    asked = [FlowerMessage(RecordDict(), node_id, "query", group_id="0") for node_id in node_ids]
    nodes: dict[int, int] = {}
    for reply in grid.send_and_receive(asked, timeout=timeout):
        if reply.has_error():
            raise EdgepflError(f"node {reply.metadata.src_node_id} failed to say its client id: "
                               f"{reply.error.reason}")
        said = reply.content.get(META) if reply.has_content() else None
        cid = said.get(PARTITION_ID) if isinstance(said, ConfigRecord) else None
        if isinstance(cid, bool) or not isinstance(cid, int):
            raise MessageError(f"node {reply.metadata.src_node_id} answered the query without "
                               f"an integer {PARTITION_ID}")
        if cid in nodes:
            raise ConfigError(f"nodes {nodes[cid]} and {reply.metadata.src_node_id} both say "
                              f"{PARTITION_ID}={cid}")
        edge = said.get(EDGE_ID)
        if edge is not None and parents is not None and 0 <= cid < len(parents):
            expected = "none (a star)" if parents[cid] == CLOUD else parents[cid]
            if isinstance(edge, bool) or not isinstance(edge, int) or edge != parents[cid]:
                raise ConfigError(f"node {reply.metadata.src_node_id} (client {cid}) says "
                                  f"{EDGE_ID}={edge!r}, but the federation puts client {cid} on "
                                  f"edge {expected} (topology.* settings; federation.json of a "
                                  "simulated run lists every client's edge)")
        nodes[int(cid)] = reply.metadata.src_node_id
    missing = sorted(set(range(num_clients)) - set(nodes))
    if missing:
        raise ConfigError(f"partition.clients={num_clients}, but no node serves clients {missing} "
                          f"({len(node_ids)} nodes answered)")
    return nodes


class FlowerTransport(Transport):
    """Client messages over a Flower ``Grid``: one SuperNode per client; its train and
    evaluate messages carry the client step or round as their ``group_id``."""

    def __init__(self, grid: Grid, nodes: Mapping[int, int], timeout: float):
        self.grid, self.nodes, self.timeout = grid, nodes, timeout

    def train(self, step: int, messages: dict[int, Message]) -> dict[int, ClientReply]:
        replies = _exchange(self.grid, self.nodes,
                            {cid: to_content(m) for cid, m in messages.items()},
                            "train", str(step), self.timeout)
        out = {}
        for cid, reply in replies.items():
            figures = _figures(reply, cid, "num_samples")
            stats = {k: float(v) for k, v in figures.items() if k != "num_samples"}
            out[cid] = ClientReply(from_content(reply.content), int(figures["num_samples"]), stats)
        return out

    def evaluate(self, rnd: int, messages: dict[int, Message | None]) -> dict[int, Figures]:
        replies = _exchange(self.grid, self.nodes,
                            {cid: to_content(m) for cid, m in messages.items()},
                            "evaluate", str(rnd), self.timeout)
        out = {}
        for cid, reply in replies.items():
            f = _figures(reply, cid, "correct", "count", "loss")
            extra = {k[len("correct."):]: (int(v), float(f.get(f"loss.{k[len('correct.'):]}", math.nan)))
                     for k, v in f.items() if k.startswith("correct.")}
            out[cid] = Figures(int(f["correct"]), int(f["count"]), float(f["loss"]), extra)
        return out


def run_server(grid: Grid, run_config: Mapping[str, Any], progress: bool | None = False) -> FlowerResult:
    """The ServerApp: the shared round protocol (``engine.rounds``) over the Flower Grid.
    Edge servers, if any, are parts of this process: their messages to and from the cloud
    are counted on the backhaul, their messages to clients cross the Grid."""
    cfg = config_from_run(run_config)
    wait, timeout = seconds(run_config, WAIT), seconds(run_config, TIMEOUT)
    out = Path(str(run_config[OUT])) if run_config.get(OUT) else None
    if out is not None and (out / "config.json").exists():
        raise EdgepflError(f"{out} already holds a run; give the run config another {OUT} "
                           f"(flwr run ... --run-config 'out=\"runs/other\"')")
    dataset = load_dataset(cfg.dataset.name, cfg.dataset.root, cfg.dataset.fraction, cfg.seed,
                           cfg.dataset.download)
    n = cfg.partition.clients
    parts = Parts.build(cfg, dataset, n)
    nodes = discover(grid, n, wait, timeout, parts.federation.parent)
    rounds = Rounds(parts, FlowerTransport(grid, nodes, timeout))
    if out is not None:
        write_json(out / "config.json", cfg.model_dump())
        write_json(out / "federation.json", parts.federation.to_json())
    bar = RoundProgress(cfg.train.rounds, 0, f"{cfg.algorithm.name} on Flower", progress)
    try:
        while rounds.round < cfg.train.rounds:
            row = rounds.step()
            if out is not None:
                write_csv(out / "metrics.csv", metric_columns(rounds.metrics, COLUMNS), rounds.metrics)
            bar.update(rounds.round, row)
    finally:
        bar.close()
    summary = rounds.summary(runtime="flower")
    if out is not None:
        finish_run_dir(out, cfg, summary, rounds.server, rounds.metrics)
    return FlowerResult(summary, rounds.metrics, out)


server_app = ServerApp()


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    run_server(grid, context.run_config, progress=None)


# -- one process --------------------------------------------------------------------------
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
