"""The Flower runtime: records round-trip, the same run as the simulation, clear errors."""

import json
import math
import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from edgepfl.algorithms import get_algorithm  # noqa: E402
from edgepfl.config import build_config  # noqa: E402
from edgepfl.engine import flower, flower_client, flower_local  # noqa: E402
from edgepfl.engine.flower import client_app  # noqa: E402
from edgepfl.engine.flower_local import LocalGrid, _server_identity, run_local  # noqa: E402
from edgepfl.engine.flower_wire import (  # noqa: E402
    COLUMNS,
    META,
    STATE,
    STATS,
    TENSORS,
    config_from_run,
    from_content,
    partition_id,
    to_content,
)
from edgepfl.engine.simulation import METRIC_COLUMNS, Simulation  # noqa: E402
from edgepfl.engine.transport import TooFewReplies  # noqa: E402
from edgepfl.errors import ConfigError, EdgepflError  # noqa: E402
from edgepfl.federation.messages import Message, MessageError  # noqa: E402

from .conftest import fast_config, without_wall  # noqa: E402

BASE = {"dataset.name": "synthetic", "partition.clients": 3, "train.rounds": 2,
        "train.batch_size": 32, "train.local_epochs": 1, "train.lr": 0.05,
        "output.plots": False, "system.count_flops": False}


def run_config(**settings):
    return {**BASE, **{k.replace("__", "."): v for k, v in settings.items()}}


def test_message_round_trips_through_flower_wire_format():
    msg = Message({"w": torch.randn(3, 4), "idx": torch.arange(5), "mask": torch.tensor([True, False]),
                   "scalar": torch.tensor(2.5)},
                  {"round": 3, "name": "kapc", "ok": True, "lr": 0.01, "layers": [1, 2, 4]})
    with _server_identity():
        wired = LocalGrid._wire(FlowerMessage(to_content(msg), 7, "train", group_id="1"))
    back = from_content(wired.content)
    assert back.meta == msg.meta
    assert set(back.tensors) == set(msg.tensors)
    for name, value in msg.tensors.items():
        assert back.tensors[name].dtype == value.dtype
        assert torch.equal(back.tensors[name], value)
    assert back.nbytes == msg.nbytes  # so a deployment reports the simulation's bytes
    # "nothing to send" stays distinct from an empty message
    assert from_content(to_content(None), optional=True) is None
    assert from_content(to_content(Message()), optional=True) == Message()


def test_malformed_records_are_message_errors():
    with pytest.raises(MessageError, match="lacks the records"):
        from_content(RecordDict())
    with pytest.raises(MessageError, match="lacks the records"):
        from_content(RecordDict({TENSORS: ArrayRecord()}))
    with pytest.raises(MessageError, match="ArrayRecord / ConfigRecord"):
        from_content(RecordDict({TENSORS: ConfigRecord({"a": 1}), META: ConfigRecord()}))
    with pytest.raises(MessageError, match="bytes"):
        from_content(RecordDict({TENSORS: ArrayRecord(), META: ConfigRecord({"b": b"\x00"})}))
    # Flower's lists hold one type; edgepfl's may mix, and such a message cannot travel
    with pytest.raises(MessageError, match="cannot travel as a Flower ConfigRecord"):
        to_content(Message({}, {"mixed": [1, 2.5]}))


def test_run_config_is_the_dotted_edgepfl_config():
    cfg = config_from_run({"algorithm.name": "fedprox", "algorithm.mu": 0.1, "train.rounds": 7,
                           "out": "runs/x"})
    assert (cfg.algorithm.name, cfg.algorithm.hyperparameters()["mu"], cfg.train.rounds) == \
        ("fedprox", 0.1, 7)
    with pytest.raises(ConfigError, match="train.rounds"):
        config_from_run({"train.rounds": 0})
    with pytest.raises(ConfigError, match="unknown algorithm|nosuch"):
        config_from_run({"algorithm.name": "nosuch"})


def test_partition_id_names_the_node_config():
    ctx = Context(run_id=1, node_id=42, node_config={"partition-id": 5}, state=RecordDict(),
                  run_config={})
    with pytest.raises(ConfigError, match=r"42 has node config partition-id=5.*0\.\.2"):
        partition_id(ctx, 3)
    ctx.node_config = {}
    with pytest.raises(ConfigError, match="partition-id=None"):
        partition_id(ctx, 3)
    ctx.node_config = {"partition-id": 2}
    assert partition_id(ctx, 3) == 2


class ReversedGrid(LocalGrid):
    """Replies come back last-sent first, as a real SuperLink may return them in any order."""

    def pull_messages(self, message_ids):
        return list(reversed(super().pull_messages(message_ids)))


@pytest.mark.parametrize("algorithm,extra,grid", [
    ("kapc_bls", {}, LocalGrid),  # relation cube, client personal model, ages down
    ("moon", {}, LocalGrid),                              # previous local model on the client
    ("pfedla", {"train.participation": 0.67}, LocalGrid),  # hypernetworks, sampled clients
    ("fedavg", {"partition.clients": 4}, ReversedGrid),    # replies out of order
    ("hierfavg", {"partition.clients": 5, "topology.edges": 2,  # edges in the ServerApp
                  "topology.edge_rounds": 2}, ReversedGrid),
    ("fedavg", {"partition.clients": 5, "system.devices": "tiers",  # two architectures
                "model.tiers.weak": "cnn_small_narrow"}, LocalGrid),
    ("hierbayes", {"partition.clients": 4, "topology.edges": 2}, ReversedGrid),  # MC figures
    ("fedavg", {"partition.clients": 4, "eval.validation": 0.25}, LocalGrid),  # val_* figures
    ("feddyn", {"train.participation": 0.67}, ReversedGrid),  # grad_i on the node, h
    ("lgfedavg", {"train.participation": 0.67}, LocalGrid),  # the local body on the node
    ("fedrod", {"train.participation": 0.67}, LocalGrid),  # the personal head on the node
    ("fedala", {}, ReversedGrid),  # theta_i and W_i on the node, ALA in round 2
])
def test_flower_run_equals_the_simulation(algorithm, extra, grid, monkeypatch):
    """The same algorithm objects, seeds and data: every round's figures are identical,
    whatever order the replies arrive in."""
    monkeypatch.setattr(flower_local, "LocalGrid", grid)
    rc = {**run_config(algorithm__name=algorithm), **extra}
    sets = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in rc.items()]
    sim = Simulation(fast_config(*sets), progress=False).run()
    result = run_local(rc)
    assert len(result.metrics) == len(sim.metrics) == 2
    algorithm_figures = set(sim.metrics[-1]) - set(METRIC_COLUMNS)  # incl. acc_global_*
    assert set(result.metrics[-1]) == set(COLUMNS) | algorithm_figures
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss",
                    "bytes_up", "bytes_down", "clients", "bytes_up_client", "bytes_down_client",
                    "bytes_up_edge", "bytes_down_edge", *algorithm_figures):
            assert ours[key] == theirs[key], (algorithm, ours["round"], key)
    for key in ("acc_clients_final", "acc_mean_best", "bytes_up_per_client",
                "bytes_down_per_client", "bytes_up_per_edge", "bytes_down_per_edge",
                "server_state_bytes", "model_params", "layers", "architectures"):
        assert result.summary[key] == sim.summary[key], key


def test_client_state_stays_on_its_node(monkeypatch):
    """KAPC keeps the personal model on the client: it lives in the node's Context.state
    and no train reply carries it."""
    contexts, seen = {}, []
    real_init = LocalGrid.__init__

    def spy_init(self, app, num_nodes, rc):
        real_init(self, app, num_nodes, rc)
        contexts.update(self.contexts)

    real_wire = LocalGrid._wire
    monkeypatch.setattr(LocalGrid, "__init__", spy_init)
    monkeypatch.setattr(LocalGrid, "_wire", staticmethod(
        lambda m: seen.append(m) or real_wire(m)))
    run_local(run_config(algorithm__name="kapc"))
    states = [ctx.state[STATE] for ctx in contexts.values()]
    assert len(states) == 3 and all(any(k.startswith("model.") for k in s) for s in states)
    replies = [m for m in seen if m.metadata.reply_to_message_id and m.has_content()]
    train = [m for m in replies if m.metadata.message_type == "train"]
    assert len(train) == 6  # 3 clients, 2 rounds
    # a reply holds the protocol's records and nothing else ...
    assert all(set(m.content) <= {TENSORS, META, STATS} for m in replies)
    # ... and its tensors are what the simulation's client sends, not the kept state
    sim = Simulation(fast_config(*[f"{k}={v}" for k, v in run_config(algorithm__name="kapc").items()]),
                     progress=False)
    sent_in_simulation = {}
    real_aggregate = sim.server.aggregate

    def spy_aggregate(rnd, up):
        sent_in_simulation.update({cid: set(m.tensors) for cid, m in up.items()})
        return real_aggregate(rnd, up)

    sim.server.aggregate = spy_aggregate
    sim.step()
    for m in train[:3]:  # round 1
        cid = contexts[m.metadata.src_node_id].node_config["partition-id"]
        assert set(m.content[TENSORS]) == sent_in_simulation[cid]


def test_run_directory_from_out(tmp_path):
    run = tmp_path / "run"
    result = run_local(run_config(algorithm__name="kapc", out=str(run)))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["runtime"] == "flower"
    assert json.loads((run / "config.json").read_text())["algorithm"]["name"] == "kapc"
    rows = (run / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and rows[0].startswith("round,acc_mean")
    assert "layers_up_mean" in rows[0].split(",")  # the algorithm's own figures
    assert (run / "relation_cube.safetensors").exists()  # and its artifacts
    best = max(r["acc_mean"] for r in result.metrics)
    assert summary["acc_mean_best"] == best
    assert summary["acc_mean_final"] == result.metrics[-1]["acc_mean"]
    assert summary["bytes_up_total"] == sum(r["bytes_up"] for r in result.metrics) > 0
    # a second run into the same folder is refused before it writes anything
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(EdgepflError, match="already holds a run"):
        run_local(run_config(algorithm__name="fedavg", out=str(run)))
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.parametrize("key,value", [("wait", "soon"), ("timeout", -1), ("timeout", True)])
def test_bad_server_settings_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=rf"{key}={value!r}: it must be a number of seconds"):
        run_local(run_config(algorithm__name="fedavg", **{key: value}))


def test_diverging_client_shows_as_nan_train_loss(monkeypatch):
    """As in the simulation, one client's NaN loss makes the round's train loss NaN rather
    than the average of the others."""
    client_class = get_algorithm("fedavg").client
    real_update = client_class.update

    def update(self, cid, msg, state, data, gen):
        result = real_update(self, cid, msg, state, data, gen)
        if cid == 2:
            result.stats["train_loss"] = float("nan")
        return result

    monkeypatch.setattr(client_class, "update", update)
    flower_client._node.cache_clear()
    result = run_local(run_config(algorithm__name="fedavg"))
    flower_client._node.cache_clear()
    assert all(math.isnan(r["train_loss"]) for r in result.metrics)


def test_missing_or_duplicate_nodes_are_refused():
    with pytest.raises(ConfigError, match=r"no node serves clients \[2\]"):
        run_local(run_config(algorithm__name="fedavg"), num_nodes=2)

    def twin(message, context):  # every node claims client 0
        context.node_config = {"partition-id": 0}
        return client_app(message, context)

    with pytest.raises(ConfigError, match="both say partition-id=0"):
        run_local(run_config(algorithm__name="fedavg"), app=twin)


def test_a_node_that_names_another_edge_than_the_federation_is_refused():
    rc = run_config(algorithm__name="hierfavg", topology__edges=2,
                    topology__assignment="contiguous")  # clients 0, 1 on edge 0; client 2 on 1

    def says_edge(edge_of):
        def app(message, context):
            context.node_config = {**context.node_config,
                                   "edge-id": edge_of(context.node_config["partition-id"])}
            return client_app(message, context)
        return app

    result = run_local(rc, app=says_edge(lambda cid: 0 if cid < 2 else 1))
    assert result.summary["bytes_up_per_edge"][1] > 0
    with pytest.raises(ConfigError, match="client 2.* says edge-id=0, but the federation puts "
                                          "client 2 on edge 1"):
        run_local(rc, app=says_edge(lambda cid: 0))


def app_with(**handlers):
    """A ClientApp that is edgepfl's except for the given message types."""
    app = ClientApp()
    for kind in ("query", "train", "evaluate"):
        getattr(app, kind)()(handlers.get(kind, client_app))
    return app


def test_a_failing_client_is_named_and_the_round_goes_on_without_it(tmp_path):
    def train(message, context):
        if context.node_config["partition-id"] == 1:
            raise RuntimeError("disk full")
        return client_app(message, context)

    app = app_with(train=train)
    result = run_local(run_config(algorithm__name="fedavg", out=str(tmp_path / "run")), app=app)
    assert result.summary["clients_failed_per_client"] == [0, 2, 0]
    assert [r["clients_failed"] for r in result.metrics] == [1, 1]
    failures = (tmp_path / "run" / "failures.csv").read_text()
    assert "RuntimeError: disk full" in failures and failures.count("\n") == 3
    # two of three replies crossed the uplink; all three downloads went out
    full = run_local(run_config(algorithm__name="fedavg"))
    assert [3 * r["bytes_up"] for r in result.metrics] == [2 * r["bytes_up"] for r in full.metrics]
    assert [r["bytes_down"] for r in result.metrics] == [r["bytes_down"] for r in full.metrics]


def test_below_min_replies_the_run_stops_naming_the_failed_clients():
    def train(message, context):
        if context.node_config["partition-id"] == 1:
            raise RuntimeError("disk full")
        return client_app(message, context)

    with pytest.raises(TooFewReplies, match=r"2 of the 3 .*min_replies = 1.0 needs 3 \(failed: \[1\]\)"):
        run_local(run_config(algorithm__name="fedavg", faults__min_replies=1.0),
                  app=app_with(train=train))


def test_a_malformed_reply_is_rejected_alone_and_never_aggregated():
    def train(message, context):
        reply = client_app(message, context)
        if context.node_config["partition-id"] == 2:
            arrays = reply.content[TENSORS]
            name = next(iter(arrays))
            arrays[name] = Array(np.full(arrays[name].numpy().shape, np.nan, dtype=np.float32))
        return reply

    corrupt = run_local(run_config(algorithm__name="fedavg"), app=app_with(train=train))
    assert corrupt.summary["clients_failed_per_client"] == [0, 0, 2]
    assert all(math.isfinite(r["acc_mean"]) for r in corrupt.metrics)


def _bad_train_figures(reply):
    reply.content[STATS]["train_loss"] = [1.0, 2.0]  # a MetricRecord may hold lists


def _empty_array(reply):
    arrays = reply.content[TENSORS]
    name = next(iter(arrays))
    arrays[name] = Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=b"")


@pytest.mark.parametrize("spoil", [_bad_train_figures, _empty_array])
def test_a_reply_the_server_cannot_read_fails_its_client_not_the_run(spoil):
    def train(message, context):
        reply = client_app(message, context)
        if context.node_config["partition-id"] == 2:
            spoil(reply)
        return reply

    result = run_local(run_config(algorithm__name="fedavg"), app=app_with(train=train))
    assert result.summary["clients_failed_per_client"] == [0, 0, 2]


def test_evaluation_figures_that_are_not_numbers_leave_the_client_out():
    def evaluate(message, context):
        reply = client_app(message, context)
        if context.node_config["partition-id"] == 0:
            reply.content[STATS]["loss"] = [0.5]
        return reply

    result = run_local(run_config(algorithm__name="fedavg"), app=app_with(evaluate=evaluate))
    final = result.summary["acc_clients_final"]
    assert math.isnan(final[0]) and all(0 <= a <= 1 for a in final[1:])


def test_train_message_without_a_round_is_refused():
    rc = run_config(algorithm__name="fedavg")
    ctx = Context(run_id=1, node_id=9, node_config={"partition-id": 0}, state=RecordDict(),
                  run_config=rc)
    with _server_identity():
        msg = FlowerMessage(to_content(Message({"w": torch.zeros(1)})), 9, "train", group_id="x")
    msg.metadata.__dict__["_message_id"] = "m1"
    with pytest.raises(MessageError, match="group_id 'x' is not a round"):
        client_app(LocalGrid._wire(msg), ctx)


def test_a_client_without_its_evaluation_figures_is_left_out_of_them():
    def evaluate(message, context):  # a peer that answers with nothing
        if context.node_config["partition-id"] == 0:
            return FlowerMessage(RecordDict(), reply_to=message)
        return client_app(message, context)

    result = run_local(run_config(algorithm__name="fedavg"), app=app_with(evaluate=evaluate))
    final = result.summary["acc_clients_final"]
    assert math.isnan(final[0]) and all(0 <= a <= 1 for a in final[1:])
    assert result.summary["acc_mean_final"] == pytest.approx(sum(final[1:]) / 2)




class LateNodeGrid(LocalGrid):
    """Client 2's SuperNode connects only after the first round's train messages, and
    then under a new node id, as a restarted SuperNode does."""

    LATE = (2,)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hidden = {n: c for n, c in self.contexts.items()
                       if c.node_config["partition-id"] in self.LATE}
        for n in self.hidden:
            del self.contexts[n]
        self.trains = 0

    def push_messages(self, messages):
        messages = list(messages)
        self.trains += any(m.metadata.message_type == "train" for m in messages)
        if self.trains == 1 and self.hidden:
            for node, ctx in self.hidden.items():
                ctx.node_id = node + 1
                self.contexts[node + 1] = ctx
            self.hidden = {}
        return super().push_messages(messages)


def test_the_run_starts_with_min_nodes_and_a_late_node_takes_part_when_it_joins():
    rc = run_config(algorithm__name="fedavg", train__rounds=3, **{"min-nodes": 2})
    grid = LateNodeGrid(client_app, 3, {**rc, "wait": 0})
    with _server_identity():
        result = flower.run_server(grid, {**rc, "wait": 0})
    # round 1: client 2 had no node; rounds 2 and 3 it trained
    assert result.summary["clients_failed_per_client"] == [0, 0, 1]
    assert [r["clients_failed"] for r in result.metrics] == [1, 0, 0]
    with pytest.raises(ConfigError, match="min-nodes=3, but only 2 clients have a node"):
        with _server_identity():
            flower.run_server(LateNodeGrid(client_app, 3, {**rc, "wait": 0}),
                              {**rc, "wait": 0, "min-nodes": 3})


class Crash(Exception):
    pass


class CrashingGrid(LocalGrid):
    """The ServerApp's process dies when it sends round ``at``'s train messages."""

    def __init__(self, *args, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.at = at

    def push_messages(self, messages):
        messages = list(messages)
        if any(m.metadata.message_type == "train" and m.metadata.group_id == str(self.at)
               for m in messages) and self.at:
            self.at = 0
            raise Crash
        return super().push_messages(messages)


def _serve(grid, rc):
    with _server_identity():
        return flower.run_server(grid, {**rc, "wait": 0})


def test_a_stopped_server_app_resumes_from_its_checkpoint_to_the_same_figures(tmp_path):
    rc = run_config(algorithm__name="kapc", train__rounds=3)
    straight = _serve(LocalGrid(client_app, 3, rc), rc)
    grid = CrashingGrid(client_app, 3, rc, at=3)
    with pytest.raises(Crash):
        _serve(grid, {**rc, "out": str(tmp_path)})
    with pytest.raises(EdgepflError, match="resume=true"):
        _serve(grid, {**rc, "out": str(tmp_path)})
    resumed = _serve(grid, {**rc, "out": str(tmp_path), "resume": True})
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    with pytest.raises(EdgepflError, match="different configuration"):
        _serve(LocalGrid(client_app, 3, rc), {**rc, "train.lr": 0.01, "out": str(tmp_path),
                                              "resume": True})


def test_a_restarted_supernode_continues_from_its_state_dir(tmp_path):
    rc = run_config(algorithm__name="local", train__rounds=3)
    straight = _serve(LocalGrid(client_app, 3, rc), rc)

    class Restart(LocalGrid):  # every node loses its memory after round 1's train
        def __init__(self, *args, state_dir=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.trains = 0
            for ctx in self.contexts.values():
                if state_dir is not None:
                    ctx.node_config["state-dir"] = str(state_dir)

        def push_messages(self, messages):
            messages = list(messages)
            if any(m.metadata.message_type == "train" for m in messages):
                self.trains += 1
                if self.trains == 2:
                    for ctx in self.contexts.values():
                        ctx.state = RecordDict()
            return super().push_messages(messages)

    kept = _serve(Restart(client_app, 3, rc, state_dir=tmp_path), rc)
    lost = _serve(Restart(client_app, 3, rc), rc)
    assert without_wall(kept.metrics) == without_wall(straight.metrics)
    assert without_wall(lost.metrics) != without_wall(straight.metrics)
    files = sorted(p.name for p in tmp_path.rglob("*.safetensors"))
    assert files == sorted(f"client-{c}{kind}.safetensors" for c in range(3)
                           for kind in ("", ".prev"))


class CrashAfterTrain(LocalGrid):
    """The clients train round ``at``; the ServerApp dies before it reads their replies,
    so its checkpoint is of the round before."""

    def __init__(self, *args, at, **kwargs):
        super().__init__(*args, **kwargs)
        self.at = at

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        if self.at and any(m.metadata.message_type == "train"
                           and m.metadata.group_id == str(self.at) for m in messages):
            self.at = -1  # the clients have trained: the next ask for their replies dies
        return ids

    def pull_messages(self, message_ids):
        if self.at == -1:
            self.at = 0
            raise Crash
        return super().pull_messages(message_ids)


@pytest.mark.parametrize("state_dir", [False, True])
@pytest.mark.parametrize("algorithm,hierarchy,at", [
    ("kapc", {}, 3),
    # two edge rounds a cloud round: steps 5 and 6 both trained before round 2's checkpoint
    ("hierfavg", {"topology.edges": 2, "topology.edge_rounds": 2}, 6)])
def test_a_resume_after_the_clients_trained_does_not_train_that_round_twice(
        tmp_path, state_dir, algorithm, hierarchy, at):
    # the clients kept round 3's state before the server's checkpoint of round 2: the
    # resumed round 3 must start from the state they had after round 2
    rc = {**run_config(algorithm__name=algorithm, train__rounds=3), **hierarchy}
    straight = _serve(LocalGrid(client_app, 3, rc), rc)
    grid = CrashAfterTrain(client_app, 3, rc, at=at)
    for ctx in grid.contexts.values():
        if state_dir:
            ctx.node_config["state-dir"] = str(tmp_path / "state")
    with pytest.raises(Crash):
        _serve(grid, {**rc, "out": str(tmp_path / "run")})
    if state_dir:  # restarted nodes: only their state-dir remembers
        for ctx in grid.contexts.values():
            ctx.state = RecordDict()
    resumed = _serve(grid, {**rc, "out": str(tmp_path / "run"), "resume": True})
    assert [r["clients_failed"] for r in resumed.metrics] == [0, 0, 0]
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


class OfflineNodeGrid(LocalGrid):
    """Client 1's node stops answering after the first query: Flower's SuperLink then
    answers its messages itself, with a "Node Unavailable" error from the SuperLink's own
    node id (what it does for a node that missed its heartbeats)."""

    def push_messages(self, messages):
        from flwr.server.superlink.linkstate.utils import (
            create_message_error_unavailable_res_message,
        )

        ids = []
        for message in messages:
            ctx = self.contexts[message.metadata.dst_node_id]
            if message.metadata.message_type == "query" or ctx.node_config["partition-id"] != 1:
                ids += super().push_messages([message])
                continue
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            error = create_message_error_unavailable_res_message(self._wire(message).metadata,
                                                                 "node_unavail")
            self._replies[message.metadata.message_id] = self._wire(error)
            ids.append(message.metadata.message_id)
        return ids


def test_a_node_the_superlink_reports_unavailable_fails_for_that_reason(tmp_path):
    # the SuperLink's reply comes from node 1, not from the client's node: matched by the
    # message it answers, it is the client's failure, not a reply "lost" to a timeout
    rc = run_config(algorithm__name="fedavg", out=str(tmp_path / "run"))
    result = _serve(OfflineNodeGrid(client_app, 3, rc), rc)
    assert [r["clients_failed"] for r in result.metrics] == [1, 1]
    failures = (tmp_path / "run" / "failures.csv").read_text()
    assert failures.count("Node Unavailable") == 2, failures
    assert "the SuperLink (node 1), for node 20014," in failures
    assert "no train reply within" not in failures
    assert math.isnan(result.summary["acc_clients_final"][1])


def test_a_newcomer_that_fails_its_query_does_not_keep_the_others_out():
    class TwoLate(LateNodeGrid):
        LATE = (2, 3)

    def query(message, context):  # client 3's node crashes whenever it is asked
        if context.node_config["partition-id"] == 3:
            raise RuntimeError("crashed while starting")
        return client_app(message, context)

    rc = run_config(algorithm__name="fedavg", partition__clients=4, train__rounds=3,
                    **{"min-nodes": 2})
    result = _serve(TwoLate(app_with(query=query), 4, rc), rc)
    # client 2 joins with client 3's failing node beside it and trains from round 2
    assert result.summary["clients_failed_per_client"] == [0, 0, 1, 3]


def test_neither_runtime_resumes_the_others_run_and_the_folder_is_left_as_it_was(tmp_path):
    from edgepfl.engine.simulation import resume_run, start_run

    # a Flower run keeps its clients' state on the nodes: the simulation has none to go on
    flower_run = tmp_path / "flower"
    run_local(run_config(algorithm__name="local", out=str(flower_run)))
    before = {p.name: p.read_bytes() for p in flower_run.iterdir()}
    with pytest.raises(EdgepflError, match="flower run's checkpoint"):
        resume_run(flower_run, overrides=["train.rounds=3"], progress=False)
    assert {p.name: p.read_bytes() for p in flower_run.iterdir()} == before
    # a simulation run keeps them in its checkpoint: Flower's nodes do not hold them
    sim_run = tmp_path / "sim"
    start_run(build_config(None, [f"{k}={v}" for k, v in run_config(algorithm__name="local")
                                  .items()]), sim_run, progress=False)
    with pytest.raises(EdgepflError, match="simulation run's checkpoint"):
        run_local(run_config(algorithm__name="local", out=str(sim_run), resume=True,
                             train__rounds=3))


def test_two_runs_of_one_configuration_into_other_folders_do_not_share_client_state(tmp_path):
    rc = run_config(algorithm__name="local")

    def run(out):  # one run config for the ServerApp and its ClientApps, as flwr run gives
        config = {**rc, "out": str(tmp_path / out)}
        grid = LocalGrid(client_app, 3, config)
        for ctx in grid.contexts.values():
            ctx.node_config["state-dir"] = str(tmp_path / "state")
        return _serve(grid, config)

    first, second = run("a"), run("b")
    assert without_wall(second.metrics) == without_wall(first.metrics)


def test_a_resume_warns_that_client_state_needs_a_state_dir(tmp_path, caplog):
    rc = run_config(algorithm__name="local", train__rounds=3)
    grid = CrashingGrid(client_app, 3, rc, at=3)
    with pytest.raises(Crash):
        _serve(grid, {**rc, "out": str(tmp_path)})
    with caplog.at_level("WARNING", logger="edgepfl"):
        _serve(grid, {**rc, "out": str(tmp_path), "resume": True})
    assert "state-dir" in caplog.text
