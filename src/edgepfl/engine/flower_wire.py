"""What the Flower apps share: how an edgepfl ``Message`` travels as a Flower ``RecordDict``,
the run config's keys, and the Flower names the apps use (one place that says a missing
``flwr`` is an optional dependency). The apps: ``flower_client`` (ClientApp) and
``flower_server`` (ServerApp); ``engine.flower`` names both for Flower's loader.

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

import logging
import math
import time
from collections.abc import Mapping
from typing import Any, Literal, overload

import numpy as np
import torch

# the Flower names the apps use, imported here once (flower_client and flower_server take
# them from this module), so that a missing flwr is said as the optional dependency it is
try:
    from flwr.app import (  # noqa: F401
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        MetricRecord,
        RecordDict,
    )
    from flwr.app import Message as FlowerMessage  # noqa: F401
    from flwr.clientapp import ClientApp  # noqa: F401
    from flwr.serverapp import Grid, ServerApp  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"edgepfl's Flower runtime needs flwr: pip install 'edgepfl[flower]' ({exc})") from exc


from edgepfl.config import Config, build_config, set_dotted
from edgepfl.engine.ledger import METRIC_COLUMNS
from edgepfl.engine.parts import resolve
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.system import COST_COLUMNS

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


# -- sending ------------------------------------------------------------------------------
REPLY_POLL_S = 0.25


def send_and_receive(grid: Grid, messages: list[FlowerMessage], timeout: float | None
                     ) -> list[FlowerMessage]:
    """``grid.send_and_receive``, asking for the replies every ``REPLY_POLL_S`` seconds
    where Flower's deployment grid asks every 3 (flwr 1.42's ``HttpGrid``): a reply that
    arrives just after an ask would wait up to 3 s, at every exchange of a round (train,
    evaluate, SecAgg+'s four). ``timeout`` None: until every reply is in."""
    waiting = set(grid.push_messages(messages))  # pushing gives each message its id
    end = None if timeout is None else time.monotonic() + timeout
    got: list[FlowerMessage] = []
    while waiting:
        replies = list(grid.pull_messages(waiting))
        got.extend(replies)
        waiting.difference_update(r.metadata.reply_to_message_id for r in replies)
        if not waiting or (end is not None and time.monotonic() >= end):
            break
        time.sleep(REPLY_POLL_S)
    return got


class Polled:
    """A grid whose ``send_and_receive`` is the one above, for Flower's own workflows
    (SecAgg+'s) that call it themselves; everything else is the grid's."""

    def __init__(self, grid: Grid):
        self.grid = grid

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[FlowerMessage]:
        return send_and_receive(self.grid, list(messages), timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)


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
