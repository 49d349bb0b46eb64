"""Secure aggregation on Flower (``privacy.secure_aggregation``): a client step's train
messages go out, and the sums come back, through Flower's SecAgg+ (``SecAggPlusWorkflow``
on the server, ``secaggplus_mod`` on the clients), one protocol run per aggregator (the
server, or each edge in a hierarchy). The arithmetic of what a client puts into the sum and
of the replies the algorithm's aggregate is handed is ``privacy.secure_sum``'s; no
cryptography here is ours.

The ServerApp receives, per client, its public keys, the encrypted key shares it forwards
to its neighbours, its masked vector (uniform noise modulo 2^32 to anyone without the
shares of every other client) and the shares that unmask the sum; beside them its
figures (sample count, seconds trained, the loss where DP is off, the names of the tensors
its reply held) and its SecAgg+ weight. Never a tensor of its update.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import cast

import numpy as np
import torch

from edgepfl.config import Config
from edgepfl.engine.flower_wire import (
    ArrayRecord,
    ConfigRecord,
    Context,
    FlowerMessage,
    Grid,
    Polled,
    RecordDict,
    to_content,
)
from edgepfl.engine.transport import ClientFailure, ClientReply
from edgepfl.federation.messages import Message, MessageError
from edgepfl.privacy.dp_fedavg import same_model
from edgepfl.privacy.secure_sum import (
    SHARES,
    client_vector,
    noise_std,
    summed_replies,
)

try:
    from flwr.client.mod import secaggplus_mod
    from flwr.common import (
        Code,
        FitIns,
        FitRes,
        Status,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.common.secure_aggregation.secaggplus_constants import (
        RECORD_KEY_CONFIGS,
        RECORD_KEY_STATE,
    )
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.strategy import Strategy
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
except ImportError as exc:  # pragma: no cover - depends on the installed flwr
    raise ImportError(f"edgepfl's secure aggregation uses Flower's SecAgg+ components, which "
                      f"this flwr lacks (tested with flwr 1.41 and 1.42): {exc}") from exc

log = logging.getLogger("edgepfl")

NAMES = "edgepfl.names"  # the tensors a client's reply held, as a JSON list
WEIGHT = "edgepfl.weight"  # the num_samples its reply held (its weight in the mean)
NBYTES = "edgepfl.nbytes"  # its reply's size as edgepfl counts a message


# -- the client side ----------------------------------------------------------------------
def secure_mod(msg: FlowerMessage, context: Context, call_next):
    """Flower's ``secaggplus_mod`` for the train messages of a SecAgg+ run; every other
    message passes by (the ClientApp itself refuses a plain train message when its
    configuration asks for secure aggregation)."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def is_secure(message: FlowerMessage) -> bool:
    """Whether a train message is SecAgg+'s stage that asks for the client's vector."""
    return RECORD_KEY_CONFIGS in message.content.config_records


def secure_reply(cfg: Config, context: Context, sent: Message, reply: Message, n_ref: int,
                 stats: Mapping[str, float]) -> RecordDict:
    """The client's answer to SecAgg+'s masked-vector stage, before the mod masks it:
    its vector (``secure_sum.client_vector``) as a FitRes with its SecAgg+ weight, and its
    figures. Under DP its noise is drawn from the operating system's randomness: noise
    anyone could regenerate from the run's seed would protect nothing."""
    p = cfg.privacy
    dp = p.level == "client"
    n = reply.meta.get("num_samples", 0)
    if isinstance(n, bool) or not isinstance(n, int | float) or n < 0:
        raise MessageError(f"the reply's num_samples = {n!r} is not a count")
    weight = 1.0 if dp else float(n) / max(n_ref, 1)
    clip = std = None
    if dp:
        assert not isinstance(p.clip, str)  # adaptive clipping is refused with SecAgg+
        # the protocol's threshold, as this client's own SecAgg+ part holds it: it hands
        # out no unmasking share for a sum of fewer (secaggplus_mod's unmask stage)
        least = int(context.state.config_records[RECORD_KEY_STATE]["threshold"])
        clip, std = float(p.clip), noise_std(p.noise_multiplier, float(p.clip), least)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    vector = client_vector(sent, reply, weight, clip, std or 0.0, p.secagg_range, gen)
    arrays = [v.detach().double().numpy() for v in vector]
    metrics = {**{k: float(v) for k, v in stats.items()}, NAMES: json.dumps(list(reply.tensors)),
               WEIGHT: int(n), NBYTES: reply.nbytes}
    return fitres_to_recorddict(FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays),
                                       weight, metrics), keep_input=False)


# -- the server side ----------------------------------------------------------------------
class _Sum(Strategy):
    """The strategy SecAgg+'s workflow drives: its clients are the aggregator's, and what
    it aggregates is the unmasked weighted mean, which it keeps."""

    def __init__(self, proxies: list[GridClientProxy]):
        self.proxies = proxies
        self.results: list[tuple[GridClientProxy, FitRes]] = []
        self.mean: list[np.ndarray] | None = None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(p, FitIns(parameters, {})) for p in self.proxies]

    def aggregate_fit(self, server_round, results, failures):
        self.results = list(results)
        if results:  # every result carries the one unmasked mean
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def secure_train(grid: Grid, nodes: Mapping[int, int], messages: Mapping[int, Message],
                 step: object, timeout: float, cfg: Config, where: str
                 ) -> dict[int, ClientReply | ClientFailure]:
    """One aggregator's client step through SecAgg+: ``messages`` (client -> what it
    receives, one model for all) out, and for each client whose vector is in the unmasked
    sum a ``ClientReply`` holding the aggregate's share (``secure_sum.summed_replies``);
    a client that did not make it, its ``ClientFailure``."""
    out: dict[int, ClientReply | ClientFailure] = {
        c: ClientFailure("no SuperNode serves this client") for c in messages if c not in nodes}
    reach = {c: nodes[c] for c in messages if c in nodes}
    if not reach:
        return out
    sent = same_model(dict(messages), list(messages), where, "privacy.secure_aggregation = true",
                      "a masked sum adds the same entries of every client's update")
    strategy = _Sum([GridClientProxy(node, grid, 0) for node in reach.values()])
    why = _run_protocol(cast(Grid, Polled(grid)), strategy,
                        {n: messages[c] for c, n in reach.items()}, step, timeout, cfg)
    by_node = {node: cid for cid, node in reach.items()}
    results = {by_node[proxy.node_id]: res for proxy, res in strategy.results}
    if strategy.mean is None or why:
        results = {}
    else:
        try:
            mean = [torch.from_numpy(np.array(a, copy=True)) for a in strategy.mean]
            layouts = {cid: _names(cid, res) for cid, res in results.items()}
            weights = {cid: _count(cid, res, WEIGHT) for cid, res in results.items()}
            if cfg.privacy.level == "client":
                # DP-FedAvg's fixed denominator (the sum over the clients sampled) and its
                # equal weights
                replies = summed_replies(sent, mean, layouts, len(results) / len(messages))
            else:
                replies = summed_replies(sent, mean, layouts, weights=weights)
            for cid, res in results.items():
                out[cid] = ClientReply(replies[cid], _count(cid, res), _stats(cid, res),
                                       sent_bytes=_count(cid, res, NBYTES))
        except MessageError as exc:
            why, results = f"its sum could not be read: {exc}", {}
    why = why or "an error or no reply in one of its four stages"
    for cid in reach:
        if cid not in results:
            out[cid] = ClientFailure(f"{where}: not in the SecAgg+ sum ({why})")
    return {c: out[c] for c in messages}


def _run_protocol(grid: Grid, strategy: _Sum, contents: Mapping[int, Message], step: object,
                  timeout: float, cfg: Config) -> str:
    """SecAgg+'s four stages; the empty string, or why it stopped."""
    p = cfg.privacy
    workflow = SecAggPlusWorkflow(SHARES, p.secagg_threshold, max_weight=1.0,
                                  clipping_range=float(p.secagg_range), timeout=timeout)
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: step}),
                        MAIN_PARAMS_RECORD: ArrayRecord()})
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state,
                                    run_config={}), strategy=strategy)
    for proxy in strategy.proxies:  # so that Flower's log counts them
        context.client_manager.register(proxy)
    ws = WorkflowState()
    why = ""
    try:
        if not workflow.setup_stage(grid, context, ws):
            why = "too few clients answered its setup (privacy.secagg_threshold)"
        else:
            # the train messages go out with the masked-vector stage: the algorithm's own
            ws.nid_to_fitins = {node: to_content(msg) for node, msg in contents.items()}
            for stage in (workflow.share_keys_stage, workflow.collect_masked_vectors_stage,
                          workflow.unmask_stage):
                if not stage(grid, context, ws):
                    why = (f"fewer active clients than its threshold after "
                           f"{stage.__name__.removesuffix('_stage').replace('_', ' ')}")
                    break
    except Exception as exc:  # a peer's malformed answer must not stop the ServerApp
        why = f"the protocol failed: {type(exc).__name__}: {exc}"
    for failure in ws.failures:
        log.warning("client step %s: a client left SecAgg+: %s", step, failure)
    return why


def _names(cid: int, res: FitRes) -> list[str]:
    try:
        names = json.loads(str(res.metrics.get(NAMES)))
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise MessageError(f"client {cid}'s SecAgg+ answer lacks the names of its reply's tensors")
    return names


def _count(cid: int, res: FitRes, key: str = "num_samples") -> int:
    n = res.metrics.get(key)
    if isinstance(n, bool) or not isinstance(n, int | float) or not float(n).is_integer() or n < 0:
        raise MessageError(f"client {cid} reported {key} = {n!r}; expected a count")
    return int(n)


def _stats(cid: int, res: FitRes) -> dict[str, float]:
    stats = {}
    for key, value in res.metrics.items():
        if key in (NAMES, WEIGHT, NBYTES, "num_samples"):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MessageError(f"client {cid} reported {key} = {repr(value)[:80]}; expected a number")
        stats[key] = float(value)
    return stats

