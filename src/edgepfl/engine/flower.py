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
  leaves it; with node config ``state-dir`` also on the node's disk, so that a restarted
  SuperNode continues where it was;
* the configuration is the Flower run config: every key an edgepfl setting in dotted form
  (``"train.rounds" = 50``), plus the ServerApp's own: ``out``, the folder where it
  writes ``config.json``, ``metrics.csv``, ``failures.csv``, ``summary.json``, the
  algorithm's artifacts and a checkpoint after every round (never over an earlier run
  unless ``resume`` = true, which continues it), ``wait``, how many seconds it waits for
  ``min-nodes`` (default: all) clients' SuperNodes to connect (default 300), and
  ``timeout``, how many seconds it waits for a round's replies (default 3600);
* a client that fails (no node, an error, no reply in time, a malformed reply) fails its
  round, as an injected fault does in the simulation (``Rounds``): the round goes on
  with the replies that arrived, down to ``faults.min_replies``.

Client seeds are derived exactly as in the simulation (run seed, round, client), and each
node loads the data set from its own ``dataset.root`` / ``EDGEPFL_DATA`` and takes its
client's share of the seeded partition, so a deployment reproduces the simulation round
for round (tested through ``LocalGrid``). The ServerApp loads the data set only for the
model's input shape and class count; it uses no sample.

Requires the optional dependency ``flwr`` (``pip install 'edgepfl[flower]'``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import torch

try:
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        MetricRecord,
        RecordDict,
    )
    from flwr.app import Message as FlowerMessage
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"edgepfl's Flower runtime needs flwr: pip install 'edgepfl[flower]' ({exc})") from exc

if TYPE_CHECKING:
    pass

from edgepfl.config import Config, build_config, set_dotted
from edgepfl.contract.algorithm import Client
from edgepfl.data.datasets import Dataset, dataset_of
from edgepfl.data.partition import Partition
from edgepfl.engine.client_step import ClientViews, client_step, client_views, evaluate_client
from edgepfl.engine.ledger import METRIC_COLUMNS
from edgepfl.engine.parts import Parts, load_federation, resolve
from edgepfl.engine.progress import configure_logging
from edgepfl.engine.rounds import Rounds
from edgepfl.engine.rundir import (
    CHECKPOINT,
    load_checkpoint,
    run_dir_lock,
    run_rounds,
    without_rounds,
)
from edgepfl.engine.transport import ClientFailure, ClientReply, Figures, Transport
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.topology import CLOUD
from edgepfl.io import read_tensors, write_json, write_tensors
from edgepfl.system import COST_COLUMNS
from edgepfl.training.client_data import sample_count

log = logging.getLogger("edgepfl")

TENSORS = "edgepfl.tensors"
META = "edgepfl.meta"
STATS = "edgepfl.stats"
STATE = "edgepfl.state"
STATE_PREV = "edgepfl.state.prev"  # the state before the last step (a resume may need it)
STATE_STEPS = "edgepfl.state.steps"  # the client steps the two states are from
PARTITION_ID = "partition-id"
EDGE_ID = "edge-id"
STATE_DIR = "state-dir"
OUT = "out"
WAIT = "wait"
TIMEOUT = "timeout"
# a client's reply statistics that come from its data without noise
UNNOISED_STATS = ("train_loss", "samples")
MIN_NODES = "min-nodes"
RESUME = "resume"
# the ServerApp's own, with defaults (min-nodes: every client's node)
SERVER_KEYS: dict[str, Any] = {OUT: None, WAIT: 300.0, TIMEOUT: 3600.0, MIN_NODES: None, RESUME: False}
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


@overload
def from_content(content: RecordDict, optional: Literal[False] = False) -> Message: ...
@overload
def from_content(content: RecordDict, optional: bool) -> Message | None: ...
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
        except Exception as exc:  # a peer's bytes: numpy may raise anything (EOFError, ...)
            raise MessageError(f"tensor {name!r} of a Flower message cannot be read: "
                               f"{type(exc).__name__}: {exc}") from None
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


def min_nodes(run_config: Mapping[str, Any], num_clients: int) -> int:
    """The ServerApp's ``min-nodes``: how many clients must have a node before round 1."""
    value = run_config.get(MIN_NODES)
    if value is None:
        return num_clients
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= num_clients:
        raise ConfigError(f"Flower run config {MIN_NODES}={value!r}: it must be a whole number "
                          f"of clients 1..{num_clients} (default: all {num_clients})")
    return value


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

    def split(self, cid: int) -> ClientViews:
        # the configuration's crops (dataset.aspect_ratios), drawn as the simulation draws them
        return client_views(self.dataset, self.partition, cid, self.parts.cfg)


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


def _state_file(context: Context, cfg: Config, cid: int) -> Path | None:
    """Where node config ``state-dir`` keeps client ``cid``'s state of this run (the run is
    its configuration less the settings a resumed run may change: ``train.rounds``, where
    it executes, its trackers; ``rundir.without_rounds``; and the ServerApp's ``out``)."""
    root = context.node_config.get(STATE_DIR)
    if root is None:
        return None
    if not isinstance(root, str) or not root:
        raise ConfigError(f"SuperNode {context.node_id} has node config {STATE_DIR}={root!r}; "
                          "it must be a folder path")
    # the run: its settings and its folder (a new run of one configuration into another
    # out does not take up the last one's state; a resume, into the same out, does)
    settings = {**without_rounds(cfg.model_dump()), OUT: context.run_config.get(OUT)}
    run = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / run / f"client-{cid}.safetensors"


def _versions(context: Context, node: _Node, cid: int, cfg: Config
              ) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """The client's kept states with the client steps they are from: in the node's memory,
    else (a restarted SuperNode) in its ``state-dir``, else its initial state (step 0)."""
    versions: list[tuple[int, dict[str, torch.Tensor]]] = []
    if STATE in context.state:
        steps = context.state[STATE_STEPS] if STATE_STEPS in context.state else {}
        for key, name in ((STATE, "cur"), (STATE_PREV, "prev")):
            if key in context.state:
                versions.append((int(steps.get(name, 0)), {
                    k: torch.from_numpy(np.array(a.numpy(), copy=True))
                    for k, a in context.state[key].items()}))
    else:
        path = _state_file(context, cfg, cid)
        for file in ((path, path.with_suffix(".prev.safetensors")) if path is not None else ()):
            if file.exists():
                tensors, meta = read_tensors(file)
                versions.append((int(meta.get("round", 0)), tensors))
    if not versions:
        arch = node.parts.architectures[node.parts.federation.arch[cid]]
        versions.append((0, node.client(cid).init_state(cid, arch.init_model)))
    return versions


def _before(versions: list[tuple[int, dict[str, torch.Tensor]]], cid: int, before: int
            ) -> tuple[int, dict[str, torch.Tensor]]:
    """The newest kept state from a step before client step ``before``. A client keeps
    two: its last step's, and the one at the last cloud round's end (in a star, the step
    before), so that a ServerApp resumed from the checkpoint of the round before one its
    clients had already trained in hands them the state they had then, not the one after
    (which would train that round twice)."""
    usable = [v for v in versions if v[0] < before]
    if not usable:
        raise MessageError(
            f"client {cid}'s state is from step {min(s for s, _ in versions)} or later, but "
            f"the server asks for step {before}: the ServerApp resumed from a checkpoint "
            "older than the round its clients kept (output.checkpoint_every above 1?), or a "
            "new run found an earlier run's state-dir (give it another out, or the nodes "
            "another state-dir)")
    return max(usable, key=lambda v: v[0])


def _client_steps(cfg: Config) -> int:
    """Client steps a round: k2 in a hierarchy, 1 in a star."""
    return cfg.topology.edge_rounds if cfg.topology.edges else 1


def _keep(context: Context, cfg: Config, cid: int, step: int, state: dict[str, torch.Tensor],
          prev: tuple[int, dict[str, torch.Tensor]]) -> None:
    """Keep ``state`` as the client's state after ``step``, and ``prev`` beside it."""
    def record(tensors):
        return ArrayRecord({k: Array(v.detach().contiguous().numpy()) for k, v in tensors.items()})

    context.state[STATE] = record(state)
    context.state[STATE_PREV] = record(prev[1])
    context.state[STATE_STEPS] = ConfigRecord({"cur": step, "prev": prev[0]})
    path = _state_file(context, cfg, cid)
    if path is not None:  # before the reply: a node that dies after it keeps its state
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tensors(path.with_suffix(".prev.safetensors"), prev[1],
                      {"client": cid, "round": prev[0]})
        write_tensors(path, state, {"client": cid, "round": step})


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
    versions = _versions(context, node, cid, cfg)
    step, state = _before(versions, cid, rnd)
    train = node.split(cid).train
    started = time.perf_counter()
    result = client_step(cfg, node.client(cid), rnd, cid, msg, state, train)
    train_s = time.perf_counter() - started
    # beside the new state, the one at the last cloud round's end: a resumed ServerApp
    # goes on from a cloud round's checkpoint (k2 client steps a round in a hierarchy)
    k2 = _client_steps(cfg)
    boundary = (rnd - 1) // k2 * k2
    prev = (step, state) if step <= boundary else max(
        (v for v in versions if v[0] <= boundary), key=lambda v: v[0], default=(step, state))
    # entries a client does not return keep their value, as in the simulation's store
    _keep(context, cfg, cid, rnd, {**state, **result.state}, prev)
    content = to_content(result.reply)
    # a NaN loss travels as NaN, so that a diverging client shows, as in the simulation
    stats = {k: float(v) for k, v in result.stats.items()}
    if cfg.privacy.level != "none":
        # the loss and the count of samples seen are computed from the data without noise:
        # under a privacy guarantee they stay on the device (docs/user-guide.md, "Outside
        # the guarantee"); the simulation keeps them as a measurement
        stats = {k: v for k, v in stats.items() if k not in UNNOISED_STATS}
    content[STATS] = MetricRecord({**stats, "num_samples": train.n, "train_s": train_s})
    return FlowerMessage(content, reply_to=message)


@client_app.evaluate()
def _evaluate(message: FlowerMessage, context: Context) -> FlowerMessage:
    cfg, cid, node = _client(context)
    eval_msg = from_content(message.content, optional=True)
    train, test, val = node.split(cid)
    count = sample_count(test)
    figures: dict[str, int | float] = {"correct": 0, "count": count, "loss": 0.0}
    if count:
        node.trainer(cid).forget()
        # the state after the round's last client step: (round - 1) * k2 + k2
        _, state = _before(_versions(context, node, cid, cfg), cid,
                           _round(message) * _client_steps(cfg) + 1)
        f = evaluate_client(node.client(cid), node.trainer(cid), cid, state,
                            eval_msg, train, test, val)
        figures.update(correct=int(f.correct), loss=float(f.loss))
        for name, (correct, loss) in f.extra.items():
            figures[f"correct.{name}"], figures[f"loss.{name}"] = int(correct), float(loss)
        if f.val is not None:
            figures.update({"val.correct": f.val[0], "val.count": f.val[1],
                            "val.loss": float(f.val[2])})
    return FlowerMessage(RecordDict({STATS: MetricRecord(figures)}), reply_to=message)


# -- the server side ----------------------------------------------------------------------
@dataclass
class FlowerResult:
    summary: dict
    metrics: list[dict]
    out_dir: Path | None


def _exchange(grid: Grid, nodes: Mapping[int, int], contents: Mapping[int, RecordDict],
              kind: str, group: str, timeout: float) -> dict[int, FlowerMessage | ClientFailure]:
    """Send one message per client and collect one reply from each, in the order of
    ``contents`` whatever order they arrive in (the aggregate's floating-point sums follow
    it, so this is what keeps a deployment equal to the simulation). A client without a
    node, an error reply and no reply within ``timeout`` become a ``ClientFailure``."""
    out: dict[int, FlowerMessage | ClientFailure] = {}
    reachable = {cid: content for cid, content in contents.items() if cid in nodes}
    sent = {cid: FlowerMessage(content, nodes[cid], kind, group_id=group)
            for cid, content in reachable.items()}
    replies: dict[int, FlowerMessage | ClientFailure] = {}
    for reply, cid in _replies(grid, sent, timeout):
        if cid is None or cid in replies:
            log.warning("ignored an unexpected %s reply from node %s in round %s", kind,
                        reply.metadata.src_node_id, group)
            continue
        if reply.has_error():
            replies[cid] = ClientFailure(f"{_who(reply, nodes[cid])} answered with an error: "
                                         f"{reply.error.reason}")
        elif reply.metadata.src_node_id != nodes[cid]:
            replies[cid] = ClientFailure(f"a reply to node {nodes[cid]} came from node "
                                         f"{reply.metadata.src_node_id}")
        else:
            replies[cid] = reply
    for cid in contents:
        if cid not in nodes:
            out[cid] = ClientFailure("no SuperNode serves this client")
        elif cid not in replies:
            out[cid] = ClientFailure(f"no {kind} reply within {TIMEOUT}={timeout:g} s")
        else:
            out[cid] = replies[cid]
    return out


def _replies(grid: Grid, sent: Mapping[int, FlowerMessage], timeout: float
             ) -> list[tuple[FlowerMessage, int | None]]:
    """Send ``sent`` (key -> message) and pair each reply with the key of the message it
    answers (None: it answers none of them). A reply is matched by the message it
    replies to, not by its sender: the SuperLink itself answers for a node that went
    offline (Flower's "Node Unavailable" error, from the SuperLink's node id)."""
    if not sent:
        return []
    got = list(grid.send_and_receive(list(sent.values()), timeout=timeout))
    # pushing gave each sent message its id
    by_id = {m.metadata.message_id: key for key, m in sent.items()}
    return [(reply, by_id.get(reply.metadata.reply_to_message_id)) for reply in got]


def _who(reply: FlowerMessage, node: int) -> str:
    src = reply.metadata.src_node_id
    return f"node {node}" if src == node else f"the SuperLink (node {src}), for node {node},"


def _figures(reply: FlowerMessage, cid: int, *keys: str) -> MetricRecord:
    """The figures a client reports beside its message, checked: a peer's reply."""
    record = reply.content.get(STATS) if reply.has_content() else None
    if not isinstance(record, MetricRecord) or any(k not in record for k in keys):
        raise MessageError(f"client {cid}'s {reply.metadata.message_type} reply lacks the "
                           f"MetricRecord {STATS!r} with {list(keys)}")
    for key, value in record.items():  # a MetricRecord may hold lists; a figure is one number
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MessageError(f"client {cid} reported {key} = {repr(value)[:80]}; "
                               "expected a number")
    return record


def discover(grid: Grid, num_clients: int, wait_s: float = 0.0,
             timeout: float = SERVER_KEYS[TIMEOUT],
             parents: tuple[int, ...] | None = None, min_nodes: int | None = None) -> dict[int, int]:
    """Client id -> node id, from every node's answer to a query, once ``min_nodes``
    (default: every client's) nodes are connected or ``wait_s`` seconds have passed
    (SuperNodes join when they start). Fewer than ``min_nodes`` clients served is refused;
    the clients still without a node fail the rounds they are selected in until their
    node connects (``FlowerTransport.refresh``)."""
    need = num_clients if min_nodes is None else min_nodes
    deadline = time.monotonic() + wait_s
    node_ids = sorted(grid.get_node_ids())
    while len(node_ids) < need and time.monotonic() < deadline:
        time.sleep(1.0)
        node_ids = sorted(grid.get_node_ids())
    nodes = ask_nodes(grid, node_ids, num_clients, timeout, parents)
    missing = sorted(set(range(num_clients)) - set(nodes))
    if len(nodes) < need:
        raise ConfigError(f"partition.clients={num_clients}, {MIN_NODES}={need}, but only "
                          f"{len(nodes)} clients have a node after {WAIT}={wait_s:g} s "
                          f"(no node serves clients {missing[:20]}{' ...' if len(missing) > 20 else ''})")
    if missing:
        log.warning("starting with %d of %d clients connected; clients %s have no node yet",
                    len(nodes), num_clients, missing[:20])
    return nodes


def ask_nodes(grid: Grid, node_ids: list[int], num_clients: int, timeout: float,
              parents: tuple[int, ...] | None = None,
              refused: dict[int, str] | None = None) -> dict[int, int]:
    """Client id -> node id of the nodes ``node_ids``, each asked which client it serves.
    A node that names its edge (node config ``edge-id``) must name the one the federation
    gives its client (``parents``), or the run is refused. With ``refused`` (a running
    federation asking newcomers), a node that answers with an error or not as it must is
    put there with the reason and left out instead, so that it keeps no other node out."""
    asked = {node_id: FlowerMessage(RecordDict(), node_id, "query", group_id="0")
             for node_id in node_ids}
    nodes: dict[int, int] = {}
    for reply, node in _replies(grid, asked, timeout):
        if node is None or node in nodes.values():
            log.warning("ignored an unexpected query reply from node %s",
                        reply.metadata.src_node_id)
            continue
        try:
            cid = _client_of(reply, node, num_clients, parents, nodes)
        except EdgepflError as exc:
            if refused is None:
                raise
            refused[node] = str(exc)
            continue
        nodes[cid] = node
    return nodes


def _client_of(reply: FlowerMessage, node: int, num_clients: int,
               parents: tuple[int, ...] | None, nodes: Mapping[int, int]) -> int:
    """The client id in ``node``'s answer to the query, checked."""
    if reply.has_error():
        raise EdgepflError(f"{_who(reply, node)} failed to say its client id: "
                           f"{reply.error.reason}")
    if reply.metadata.src_node_id != node:
        raise MessageError(f"the query to node {node} was answered by node "
                           f"{reply.metadata.src_node_id}")
    said = reply.content.get(META) if reply.has_content() else None
    if not isinstance(said, ConfigRecord):
        said = {}  # no PARTITION_ID: refused below
    cid = said.get(PARTITION_ID)
    if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid < num_clients:
        raise MessageError(f"node {node} answered the query without "
                           f"a {PARTITION_ID} in 0..{num_clients - 1} (it said {cid!r})")
    if cid in nodes:
        raise ConfigError(f"nodes {nodes[cid]} and {node} both say "
                          f"{PARTITION_ID}={cid}")
    edge = said.get(EDGE_ID)
    if edge is not None and parents is not None:
        expected = "none (a star)" if parents[cid] == CLOUD else parents[cid]
        if isinstance(edge, bool) or not isinstance(edge, int) or edge != parents[cid]:
            raise ConfigError(f"node {node} (client {cid}) says "
                              f"{EDGE_ID}={edge!r}, but the federation puts client {cid} on "
                              f"edge {expected} (topology.* settings; federation.json of a "
                              "simulated run lists every client's edge)")
    return int(cid)


class FlowerTransport(Transport):
    """Client messages over a Flower ``Grid``: one SuperNode per client; its train and
    evaluate messages carry the client step or round as their ``group_id``."""

    def __init__(self, grid: Grid, nodes: Mapping[int, int], timeout: float,
                 num_clients: int | None = None, parents: tuple[int, ...] | None = None):
        self.grid, self.nodes, self.timeout = grid, dict(nodes), timeout
        self.num_clients = len(self.nodes) if num_clients is None else num_clients
        self.parents = parents

    def refresh(self) -> None:
        """Follow the nodes that left and joined since the last round: a SuperNode that
        restarts comes back (under a new node id, or with SuperNode authentication under
        its registered one) and takes part again."""
        connected = set(self.grid.get_node_ids())
        self.nodes = {c: node for c, node in self.nodes.items() if node in connected}
        new = sorted(connected - set(self.nodes.values()))
        if not new:
            return
        refused: dict[int, str] = {}  # a bad newcomer must not stop the running federation
        joined = ask_nodes(self.grid, new, self.num_clients, self.timeout, self.parents, refused)
        for node, why in refused.items():
            log.warning("node %s could not join: %s", node, why)
        for cid, node in joined.items():
            if cid in self.nodes:
                log.warning("node %s says client %d, already served by node %s; ignored",
                            node, cid, self.nodes[cid])
                continue
            log.info("client %d is back on node %s", cid, node)
            self.nodes[cid] = node

    def train(self, step: object, messages: dict[int, Message]
              ) -> dict[int, ClientReply | ClientFailure]:
        self.refresh()
        replies = _exchange(self.grid, self.nodes,
                            {cid: to_content(m) for cid, m in messages.items()},
                            "train", str(step), self.timeout)
        out: dict[int, ClientReply | ClientFailure] = {}
        for cid, reply in replies.items():
            if isinstance(reply, ClientFailure):
                out[cid] = reply
                continue
            try:
                figures = _figures(reply, cid, "num_samples")
                n = figures["num_samples"]
                if isinstance(n, float) and n.is_integer():
                    n = int(n)  # a MetricRecord may carry a count as a float
                stats = {k: float(v) for k, v in figures.items() if k != "num_samples"}
                out[cid] = ClientReply(from_content(reply.content), n, stats)
            except MessageError as exc:
                out[cid] = ClientFailure(f"malformed reply: {exc}")
        return out

    def evaluate(self, rnd: int, messages: dict[int, Message | None]) -> dict[int, Figures]:
        self.refresh()
        replies = _exchange(self.grid, self.nodes,
                            {cid: to_content(m) for cid, m in messages.items()},
                            "evaluate", str(rnd), self.timeout)
        out = {}
        for cid, reply in replies.items():
            try:
                if isinstance(reply, ClientFailure):
                    raise reply
                out[cid] = _evaluation(reply, cid)
            except (ClientFailure, MessageError) as exc:
                # a client that cannot be evaluated this round is left out of its figures
                log.warning("round %d: client %d was not evaluated: %s", rnd, cid, exc)
                out[cid] = Figures(0, 0, math.nan)
        return out


def _evaluation(reply: FlowerMessage, cid: int) -> Figures:
    f = _figures(reply, cid, "correct", "count", "loss")
    counts = {k: f[k] for k in f if k == "correct" or k == "count" or k.startswith("correct.")}
    for k, v in counts.items():
        if not (isinstance(v, int | float) and float(v).is_integer() and 0 <= v <= f["count"]):
            raise MessageError(f"client {cid} reported {k} = {v!r}; expected a count 0..{f['count']}")
    extra = {k[len("correct."):]: (int(v), float(f.get(f"loss.{k[len('correct.'):]}", math.nan)))
             for k, v in f.items() if k.startswith("correct.")}
    val = None
    if "val.count" in f:
        correct, count = f.get("val.correct"), f["val.count"]
        if not all(isinstance(v, int | float) and float(v).is_integer() and v >= 0
                   for v in (correct, count)) or correct > count:
            raise MessageError(f"client {cid} reported val.correct = {correct!r} of val.count = "
                               f"{count!r}; expected counts with correct <= count")
        val = (int(correct), int(count), float(f.get("val.loss", math.nan)))
    return Figures(int(f["correct"]), int(f["count"]), float(f["loss"]), extra, val)


def run_server(grid: Grid, run_config: Mapping[str, Any], progress: bool | None = False) -> FlowerResult:
    """The ServerApp: the shared round protocol (``engine.rounds``) over the Flower Grid.
    Edge servers, if any, are parts of this process: their messages to and from the cloud
    are counted on the backhaul, their messages to clients cross the Grid."""
    cfg = config_from_run(run_config)
    wait, timeout = seconds(run_config, WAIT), seconds(run_config, TIMEOUT)
    out = Path(str(run_config[OUT])) if run_config.get(OUT) else None
    resume = run_config.get(RESUME, False)
    if not isinstance(resume, bool):
        raise ConfigError(f"Flower run config {RESUME}={resume!r}: it must be true or false")
    if out is None:
        return _run_server(grid, run_config, cfg, out, resume, wait, timeout, progress)
    with run_dir_lock(out):  # one writer: a second ServerApp on this out is refused
        return _run_server(grid, run_config, cfg, out, resume, wait, timeout, progress)


def _run_server(grid: Grid, run_config: Mapping[str, Any], cfg: Config, out: Path | None,
                resume: bool, wait: float, timeout: float,
                progress: bool | None) -> FlowerResult:
    if resume and (out is None or not (out / CHECKPOINT).exists()):
        raise EdgepflError(f"{RESUME}=true needs the run config's {OUT} to be a run directory "
                           f"with a {CHECKPOINT}; {out} has none")
    if not resume and out is not None and (out / "config.json").exists():
        raise EdgepflError(f"{out} already holds a run; give the run config another {OUT} "
                           f"(flwr run ... --run-config 'out=\"runs/other\"'), or continue it "
                           f"with --run-config '{RESUME}=true'")
    dataset = dataset_of(cfg.dataset, cfg.seed)
    n = cfg.partition.clients
    parts = Parts.build(cfg, dataset, n, out)
    transport = FlowerTransport(None, {}, timeout, n, parts.federation.parent)
    rounds = Rounds(parts, transport)
    if resume and out is not None:  # out is set where resume is (checked above)
        load_checkpoint(out / CHECKPOINT, rounds, runtime="flower")  # clients: on the nodes
        log.info("resuming %s after round %d", out, rounds.round)
        name = parts.federation.arch[0]
        if parts.client(name).init_state(0, parts.architectures[name].init_model):
            log.warning("%s's clients keep state between rounds, on their nodes: a resumed "
                        "run goes on from it only where every node has node config %s "
                        "(a new flwr run starts its nodes with empty memory); nodes without "
                        "it start their clients from their initial state", cfg.algorithm.name,
                        STATE_DIR)
    transport.grid = grid
    transport.nodes = discover(grid, n, wait, timeout, parts.federation.parent,
                                      min_nodes(run_config, n))
    if out is not None:
        write_json(out / "config.json", cfg.model_dump())
        write_json(out / "federation.json", parts.federation.to_json())
    summary = run_rounds(rounds, out, label=f"{cfg.algorithm.name} on Flower",
                         progress=progress, columns=COLUMNS,
                         extra=lambda: {"runtime": "flower"})
    return FlowerResult(summary, rounds.metrics, out)


server_app = ServerApp()


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    configure_logging("info")
    run_server(grid, context.run_config, progress=None)
