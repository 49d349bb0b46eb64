"""The ClientApp: a SuperNode's side of a deployment (``engine.flower_wire`` says what maps
to what). A node trains and evaluates its client with the same client part and seeded step
as the simulation (``engine.client_step``), and keeps the client's state in the node's
``Context.state`` (and under node config ``state-dir`` on its disk)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from edgepfl.config import Config, build_config
from edgepfl.contract.algorithm import Client
from edgepfl.data.datasets import Dataset
from edgepfl.data.partition import Partition
from edgepfl.engine.client_step import ClientViews, client_step, client_views, evaluate_client
from edgepfl.engine.flower_secagg import is_secure, secure_mod, secure_reply
from edgepfl.engine.flower_wire import (
    EDGE_ID,
    META,
    OUT,
    PARTITION_ID,
    STATE,
    STATE_DIR,
    STATE_PREV,
    STATE_STEPS,
    STATS,
    UNNOISED_STATS,
    Array,
    ArrayRecord,
    ClientApp,
    ConfigRecord,
    Context,
    FlowerMessage,
    MetricRecord,
    RecordDict,
    config_from_run,
    from_content,
    partition_id,
    to_content,
)
from edgepfl.engine.parts import Parts, load_federation
from edgepfl.engine.rundir import (
    without_rounds,
)
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import MessageError
from edgepfl.io import read_tensors, write_tensors
from edgepfl.training.client_data import sample_count

log = logging.getLogger("edgepfl")


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


@client_app.train(mods=[secure_mod])
def _train(message: FlowerMessage, context: Context) -> FlowerMessage:
    cfg, cid, node = _client(context)
    rnd = _round(message)
    secure = is_secure(message)
    if cfg.privacy.secure_aggregation and not secure:
        # the configuration promises the client that no server sees its update
        raise MessageError(f"client {cid} runs with privacy.secure_aggregation = true and "
                           "sends its update only into a SecAgg+ sum, but this train message "
                           "is not SecAgg+'s (a ServerApp without secure aggregation?)")
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
    # a NaN loss travels as NaN, so that a diverging client shows, as in the simulation
    stats = {k: float(v) for k, v in result.stats.items()}
    if cfg.privacy.level != "none":
        # the loss and the count of samples seen are computed from the data without noise:
        # under a privacy guarantee they stay on the device (docs/user-guide.md, "Outside
        # the guarantee"); the simulation keeps them as a measurement
        stats = {k: v for k, v in stats.items() if k not in UNNOISED_STATS}
    stats.update(num_samples=train.n, train_s=train_s)
    if secure:  # SecAgg+'s mod masks the vector before anything leaves the node
        largest = max(len(share) for share in node.partition.train)
        return FlowerMessage(secure_reply(cfg, context, msg, result.reply, largest, stats),
                             reply_to=message)
    content = to_content(result.reply)
    content[STATS] = MetricRecord(stats)
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
