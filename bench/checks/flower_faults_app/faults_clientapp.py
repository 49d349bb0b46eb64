"""edgepfl's ClientApp behind a fault injector, for bench/checks/flower_faults.py.

Every message is handled by edgepfl's own ``client_app``; a train reply is then broken
on purpose for the (round, client) pairs that ``plan`` draws from the seed (node config
``fault-seed``) with probability ``fault-rate``, in one of ``KINDS``:

* ``nan``: one element of a float tensor set to NaN;
* ``shape``: a model tensor with its first row cut off;
* ``dtype``: a model tensor as float64;
* ``unknown``: an extra tensor no algorithm sends;
* ``meta``: metadata of the wrong type (every value turned into a string; a reply
  without metadata gets ``num_samples = "many"``);
* ``count``: the reported sample count set to -1;
* ``records``: the metadata record left out, so the reply is not edgepfl's records;
* ``oversize``: an extra tensor that takes the reply past ``faults.max_message_bytes``;
* ``raise``: the ClientApp raises before training (its node answers with an error).

Every call is logged, one JSON line per event in ``<fault-log>/client-<cid>.jsonl``:
``call`` (message type, round, where the client's state came from: ``memory``,
``disk`` with the state file's hash and round, or ``init``), ``trained`` (the state file
after training), ``inject`` (the kind) and ``reply``. The benchmark compares that log
with the run's failures.csv and with the state files of the nodes it killed.

The node's own settings travel as node config, so the run config stays edgepfl's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from edgepfl.engine import flower_client as efl
from edgepfl.engine import flower_wire as wire

KINDS = ("nan", "shape", "dtype", "unknown", "meta", "count", "records", "oversize", "raise")
FAULT_SEED, FAULT_RATE, FAULT_LOG = "fault-seed", "fault-rate", "fault-log"


def plan(seed: int, rate: float, clients: int, rounds: int) -> dict[tuple[int, int], str]:
    """(round, client) -> the fault injected there. Each pair is hit with probability
    ``rate``; the hits take the kinds in turn, in a seeded order, so that every kind is
    tried once there are as many hits as kinds."""
    rng = np.random.default_rng([int(seed), 0xFA017])
    draws = rng.random((rounds, clients))
    hits = [(r + 1, c) for r in range(rounds) for c in range(clients) if draws[r, c] < rate]
    order = rng.permutation(len(hits))
    return {hits[j]: KINDS[i % len(KINDS)] for i, j in enumerate(order)}


def state_header(path: Path) -> dict:
    """The edgepfl metadata of a state file (``client``, ``round``), from its header only."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return json.loads(header.get("__metadata__", {}).get("edgepfl", "{}"))


def file_state(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {"file": None}
    data = path.read_bytes()
    return {"file": hashlib.sha256(data).hexdigest(), "file_round": state_header(path).get("round")}


class Log:
    def __init__(self, context: Context, cid: int):
        root = context.node_config.get(FAULT_LOG)
        self.path = Path(str(root)) / f"client-{cid}.jsonl" if root else None
        self.base = {"client": cid, "node": context.node_id, "pid": os.getpid()}

    def __call__(self, event: str, **fields) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "t": time.time(), **self.base, **fields}) + "\n"
        # one write on an O_APPEND descriptor: a kill leaves whole lines
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _setup(message: FlowerMessage, context: Context):
    cfg = wire.config_from_run(context.run_config)
    cid = wire.partition_id(context, cfg.partition.clients)
    log = Log(context, cid)
    try:
        rnd = int(message.metadata.group_id)
    except ValueError:
        rnd = -1
    path = efl._state_file(context, cfg, cid)
    source = "memory" if wire.STATE in context.state else (
        "disk" if path is not None and path.exists() else "init")
    log("call", type=message.metadata.message_type, round=rnd, source=source, **file_state(path))
    return cfg, cid, rnd, path, log


def _float_name(arrays) -> str:
    return sorted(k for k, a in arrays.items() if np.issubdtype(np.dtype(a.dtype), np.floating))[0]


def corrupt(content: RecordDict, kind: str, cap: int | None) -> str:
    """Break a train reply in place; returns what was done, for the log."""
    arrays = content[wire.TENSORS]
    if kind in ("nan", "shape", "dtype"):
        name = _float_name(arrays)
        value = arrays[name].numpy().copy()
        if kind == "nan":
            value.reshape(-1)[value.size // 2] = np.nan
        elif kind == "shape":
            value = value[1:] if value.ndim and value.shape[0] > 1 else np.zeros(value.shape + (2,),
                                                                                   value.dtype)
        else:
            value = value.astype(np.float64)
        arrays[name] = Array(np.ascontiguousarray(value))
        return f"{kind} in {name!r}: {value.dtype} {value.shape}"
    if kind == "unknown":
        arrays["injected.unknown"] = Array(np.zeros(4, np.float32))
        return "tensor 'injected.unknown'"
    if kind == "oversize":
        arrays["injected.padding"] = Array(np.zeros((cap or 1 << 20) // 4 + 1, np.float32))
        return f"tensor 'injected.padding' of {arrays['injected.padding'].numpy().nbytes} bytes"
    if kind == "meta":
        meta = content[wire.META]
        keys = list(meta) or ["num_samples"]
        for key in keys:
            meta[key] = str(meta[key]) if key in meta else "many"
        return f"metadata {keys} as strings"
    if kind == "count":
        content[wire.STATS]["num_samples"] = -1
        return "num_samples = -1"
    if kind == "records":
        del content[wire.META]
        return f"records {sorted(content)} only"
    raise ValueError(kind)


client_app = ClientApp()


@client_app.query()
def _query(message: FlowerMessage, context: Context) -> FlowerMessage:
    _setup(message, context)  # a (re)started node's first call: where its state comes from
    return efl.client_app(message, context)


@client_app.train()
def _train(message: FlowerMessage, context: Context) -> FlowerMessage:
    cfg, cid, rnd, path, log = _setup(message, context)
    seed = int(context.node_config.get(FAULT_SEED, 0))
    rate = float(context.node_config.get(FAULT_RATE, 0.0))
    kind = plan(seed, rate, cfg.partition.clients, cfg.train.rounds).get((rnd, cid))
    if kind == "raise":
        log("inject", round=rnd, kind=kind, what="raised before training")
        raise RuntimeError(f"injected fault: client {cid} round {rnd}")
    reply = efl.client_app(message, context)
    log("trained", round=rnd, **file_state(path))
    if kind is not None:
        what = corrupt(reply.content, kind, cfg.faults.max_message_bytes)
        log("inject", round=rnd, kind=kind, what=what)
    log("reply", type="train", round=rnd)
    return reply


@client_app.evaluate()
def _evaluate(message: FlowerMessage, context: Context) -> FlowerMessage:
    _, _, rnd, _, log = _setup(message, context)
    reply = efl.client_app(message, context)
    log("reply", type="evaluate", round=rnd)
    return reply
