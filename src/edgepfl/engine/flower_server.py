"""The ServerApp: the round loop (``engine.rounds``) over a Flower ``Grid``; a client is a
SuperNode found by its ``partition-id``, a round's messages go out and come back through
``FlowerTransport``, and the run directory is the simulation's (``engine.rundir``)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepfl.config import Config
from edgepfl.data.datasets import dataset_of
from edgepfl.engine.flower_secagg import secure_train
from edgepfl.engine.flower_wire import (
    COLUMNS,
    EDGE_ID,
    META,
    MIN_NODES,
    OUT,
    PARTITION_ID,
    RESUME,
    SERVER_KEYS,
    STATE_DIR,
    STATS,
    TIMEOUT,
    WAIT,
    ConfigRecord,
    Context,
    FlowerMessage,
    Grid,
    MetricRecord,
    RecordDict,
    ServerApp,
    config_from_run,
    from_content,
    min_nodes,
    seconds,
    send_and_receive,
    to_content,
)
from edgepfl.engine.parts import Parts
from edgepfl.engine.progress import configure_logging
from edgepfl.engine.rounds import Rounds
from edgepfl.engine.rundir import (
    CHECKPOINT,
    load_checkpoint,
    run_dir_lock,
    run_rounds,
)
from edgepfl.engine.transport import ClientFailure, ClientReply, Figures, Transport
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.topology import CLOUD
from edgepfl.io import write_json

log = logging.getLogger("edgepfl")


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
    got = send_and_receive(grid, list(sent.values()), timeout)
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
                 num_clients: int | None = None, parents: tuple[int, ...] | None = None,
                 cfg: Config | None = None):
        self.grid, self.nodes, self.timeout = grid, dict(nodes), timeout
        self.num_clients = len(self.nodes) if num_clients is None else num_clients
        self.parents = parents
        # privacy.secure_aggregation: train through SecAgg+, one sum per aggregator
        self.cfg = cfg
        self.secure_sum = cfg is not None and cfg.privacy.secure_aggregation

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
        if self.secure_sum:
            return self._secure_train(step, messages)
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

    def _secure_train(self, step: object, messages: dict[int, Message]
                      ) -> dict[int, ClientReply | ClientFailure]:
        """One SecAgg+ run per aggregator: the clients of each edge, or all of them."""
        assert self.cfg is not None
        groups: dict[int, dict[int, Message]] = {}
        for cid, msg in messages.items():
            parent = self.parents[cid] if self.parents is not None else CLOUD
            groups.setdefault(parent, {})[cid] = msg
        out: dict[int, ClientReply | ClientFailure] = {}
        for parent, group in groups.items():
            where = (f"client step {step}, "
                     f"{'the server' if parent == CLOUD else f'edge {parent}'}")
            out.update(secure_train(self.grid, self.nodes, group, step, self.timeout,
                                    self.cfg, where))
        return {c: out[c] for c in messages}

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
    transport = FlowerTransport(None, {}, timeout, n, parts.federation.parent, cfg)
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
