"""Malformed client replies (a real peer on Flower may send anything): every algorithm's
``check_reply`` refuses what its ``aggregate`` would choke on or be corrupted by, and
changes nothing while it looks; every honest reply passes; a refused reply is a failed
client, and the run goes on exactly as if that reply had never come."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS
from edgepfl.engine.simulation import Simulation
from edgepfl.engine.transport import ClientFailure, ClientReply
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.topology import CLOUD
from tests.conftest import fast_config

# tiny runs on purpose: hypcluster warns its 2 rounds only choose hypotheses, dcpfl that
# a client that never replied was never measured against the others
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CAP = 1 << 22  # faults.max_message_bytes: above every honest reply of these runs
HIER = ["topology.edges=2", "topology.edge_rounds=2"]
DCPFL_PHASES = ["algorithm.t_start=2", "algorithm.s=2", "algorithm.t_obv=1", "algorithm.t_sp=1",
                "algorithm.tau=2", "algorithm.alpha=2", "dataset.fraction=0.4"]
ARCHS = ["system.devices=tiers", "model.tiers.weak=cnn_small_narrow"]

# (id, algorithm, overrides, rounds): every algorithm for 2 rounds at participation 1, and
# the phases and federations whose replies look otherwise
# HMPL's models are 27-30 MB whatever the data: its cap is above them, not above the rest
HMPL_CAP = [f"faults.max_message_bytes={1 << 26}"]
CASES = [(n, n, (HIER if a.edge else []) + (HMPL_CAP if n.startswith("hmpl") else []), 2)
         for n, a in sorted(ALGORITHMS.items())]
CASES += [
    # warm-up, normal rounds uploading some layers, a sync round and a split trial (round 8)
    ("dcpfl-phases", "dcpfl", DCPFL_PHASES, 8),
    # the k = 2 hypotheses are chosen in rounds 1-2 (losses on the first in round 2); in
    # round 3 each client names the one it joined
    ("hypcluster-joined", "hypcluster", [], 3),
    # warm-up rounds with empty replies, the clustering upload, ADMM, a late joiner
    ("clusterfl-late", "clusterfl", ["algorithm.warmup_rounds=2", "algorithm.num_clusters=2",
                                     "train.participation=0.67"], 4),
    ("fedavg-archs", "fedavg", ARCHS, 2),
    ("hierfavg-archs", "hierfavg", [*HIER, *ARCHS], 2),
    ("heterofl-rates", "heterofl", ["system.devices=tiers"], 2),
    # round 1 ranks the tiers; rounds 2-3 carry Com (no conv3), Ord and Sup (CP) replies
    ("hmpl-tiers", "hmpl", ["model.name=hmpl_tiers", *HMPL_CAP], 3),
]
IDS = [c[0] for c in CASES]
# the server's phase at each client step of those runs, which the cases above rely on
PHASES = {"dcpfl-phases": ("mode", [0, 0, 1, 1, 1, 1, 2, 3]),  # warm-up, normal, sync, trial
          "hypcluster-joined": ("centers", [0, 1, 2])}


@dataclass
class Step:
    """One client step as the aggregating parts saw it: the round (and edge round), the
    replies that arrived (private copies), the server and edges before aggregating."""

    rnd: int
    edge_round: int
    replies: dict[int, ClientReply]
    parts: tuple


@dataclass
class Run:
    sim: Simulation
    steps: list[Step]


_RUNS: dict[str, Run] = {}


def honest_run(case: tuple) -> Run:
    """The case's run, once per module: both tests below read it. One round more is
    configured than is run, so that no round evaluates (only replies matter here)."""
    key, name, overrides, rounds = case
    if key not in _RUNS:
        sim = Simulation(fast_config(f"algorithm.name={name}", f"train.rounds={rounds + 1}",
                                     f"faults.max_message_bytes={CAP}", "eval.every=100",
                                     *overrides), progress=False)
        steps: list[Step] = []
        train = sim.rounds.train

        def spy(record, step, down):
            delivery = train(record, step, down)
            replies = {c: ClientReply(r.message.delivered(), r.num_samples)
                       for c, r in delivery.arrived.items()}
            rnd = sim.rounds.round + 1
            steps.append(Step(rnd, step - (rnd - 1) * sim.federation.edge_rounds, replies,
                              copy.deepcopy((sim.rounds.server, sim.rounds.edges))))
            return delivery

        sim.rounds.train = spy
        for _ in range(rounds):
            sim.step()
        _RUNS[key] = Run(sim, steps)
    return _RUNS[key]


# -- mutations: a malformed copy of a message (None where it does not apply), of one of its
# tensors, of one of its metadata values, or of the whole -----------------------------------
def _with(msg: Message, tensors=None, meta=None) -> Message:
    return Message(dict(msg.tensors) if tensors is None else tensors,
                   dict(msg.meta) if meta is None else meta)


def _tensor(msg: Message, name: str, value: torch.Tensor | None) -> Message:
    tensors = {k: v for k, v in msg.tensors.items() if k != name}
    return _with(msg, tensors if value is None else {**tensors, name: value})


def _meta(msg: Message, key: str, value) -> Message:
    return _with(msg, meta={**msg.meta, key: value})


def drop_tensor(rng, msg, name):
    return _tensor(msg, name, None)


def reshape(rng, msg, name):
    v = msg.tensors[name]
    # flattened (what a broadcast might swallow) or one element longer
    if v.dim() > 1 and rng.random() < 0.5:
        return _tensor(msg, name, v.reshape(-1))
    return _tensor(msg, name, torch.zeros(v.numel() + 1, dtype=v.dtype))


def retype(rng, msg, name):
    v = msg.tensors[name]
    return _tensor(msg, name, v.to(torch.float64 if v.dtype != torch.float64 else torch.float32))


def nonfinite(rng, msg, name):
    v = msg.tensors[name].clone()
    if v.is_floating_point() and v.numel():
        v.view(-1)[rng.randrange(v.numel())] = rng.choice([float("nan"), float("inf")])
        return _tensor(msg, name, v)


def meta_type(rng, msg, key):
    """Text, a float for an integer, a list for a scalar, a scalar for a list."""
    v = msg.meta[key]
    if isinstance(v, list):
        return _meta(msg, key, rng.choice([str(v), len(v), [str(i) for i in v] or ["0"]]))
    return _meta(msg, key, rng.choice([str(v), [v], True] + ([v + 0.5] if isinstance(v, int) else [])))


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def meta_negative(rng, msg, key):
    """Every number a reply carries (samples, losses, indices, counts) is >= 0."""
    v = msg.meta[key]
    if isinstance(v, list):
        return _meta(msg, key, [*v, -1])
    if _number(v):
        return _meta(msg, key, -1 - v)


def meta_large(rng, msg, key):
    """Of the right type, far out of range: an index past its list, a class or a layer that
    does not exist (a large sample count is valid)."""
    v = msg.meta[key]
    if isinstance(v, list):
        return _meta(msg, key, [*v, max(v, default=0) + 1000])
    if _number(v):
        return _meta(msg, key, v + 1000)


def drop_meta(rng, msg, key):
    return _with(msg, meta={k: v for k, v in msg.meta.items() if k != key})


def drop_layer(rng, msg):
    """Every tensor of the last module: for KAPC-BLS a shorter prefix, still valid."""
    if msg.tensors:
        last = list(msg.tensors)[-1].rsplit(".", 1)[0]
        return _with(msg, {k: v for k, v in msg.tensors.items() if k.rsplit(".", 1)[0] != last})


def unknown_tensor(rng, msg):
    return _tensor(msg, rng.choice(["bogus.weight", "m2.fc.bias", "logits2"]), torch.zeros(3))


def unknown_meta(rng, msg):
    return _meta(msg, "bogus", rng.choice([1, "x", [2, 3]]))


def oversize(rng, msg, cap=CAP):
    return _tensor(msg, "pad", torch.zeros(cap // 4 + 1))


TENSOR_MUTATIONS = [drop_tensor, reshape, retype, nonfinite]
META_MUTATIONS = [meta_type, meta_negative, meta_large, drop_meta]
WHOLE_MUTATIONS = [drop_layer, unknown_tensor, unknown_meta, oversize]
# the only ones that can leave a valid reply (KAPC-BLS's shorter prefix, a large sample
# count); any other that passes check_reply is a hole in it
MAY_PASS = {"drop_tensor", "drop_layer", "meta_large"}


def malformed(rng: random.Random, msg: Message, cap: int = CAP):
    """(kind, malformed copy) of every kind: two of its tensors each, every metadata key;
    ``cap`` the run's faults.max_message_bytes, which ``oversize`` passes."""
    for mutate in WHOLE_MUTATIONS:
        yield mutate.__name__, mutate(rng, msg, cap) if mutate is oversize else mutate(rng, msg)
    for mutate in TENSOR_MUTATIONS:
        for name in rng.sample(sorted(msg.tensors), min(2, len(msg.tensors))):
            yield mutate.__name__, mutate(rng, msg, name)
    for mutate in META_MUTATIONS:
        for key in sorted(msg.meta):
            yield mutate.__name__, mutate(rng, msg, key)


# -- state ----------------------------------------------------------------------------------
def state_of(part) -> tuple[dict, str]:
    tensors, meta = part.save_state()
    return {k: v.clone() for k, v in tensors.items()}, json.dumps(meta, sort_keys=True, default=str)


def assert_unchanged(before, part, what: str) -> None:
    tensors, meta = state_of(part)
    assert tensors.keys() == before[0].keys() and meta == before[1], what
    for k, v in tensors.items():
        assert torch.equal(v, before[0][k]), f"{what}: {k} changed"


def aggregated(step: Step, parents: tuple[int, ...], cid: int, reply: Message):
    """A fresh copy of the part that aggregates ``cid`` after aggregating its step's
    honest replies with ``reply`` in place of ``cid``'s."""
    server, edges = copy.deepcopy(step.parts)
    parent = parents[cid]
    replies = {c: r.message.delivered() for c, r in step.replies.items() if parents[c] == parent}
    replies[cid] = reply
    if parent == CLOUD:
        server.aggregate(step.rnd, replies)
        return server
    edges[parent].aggregate(step.rnd, step.edge_round, replies)
    return edges[parent]


def assert_sane(part, honest, what: str) -> None:
    """No NaN or Inf, and every entry of the state the honest replies give, alike."""
    got, want = part.state_dict(), honest.state_dict()
    assert got.keys() == want.keys(), what
    for k, v in got.items():
        assert (v.shape, v.dtype) == (want[k].shape, want[k].dtype), f"{what}: {k}"
        assert not v.is_floating_point() or bool(torch.isfinite(v).all()), f"{what}: {k} not finite"


# -- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_honest_reply_passes(case):
    run = honest_run(case)
    assert [r["clients_failed"] for r in run.sim.metrics] == [0] * case[3]
    assert run.sim.rounds.ledger.failure_log == []
    assert run.steps and all(s.replies for s in run.steps)
    if case[0] in PHASES:
        attr, phases = PHASES[case[0]]
        assert [getattr(s.parts[0], attr) for s in run.steps] == phases


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_malformed_replies_are_refused_or_harmless(case):
    run = honest_run(case)
    rounds = copy.copy(run.sim.rounds)
    parent = rounds.federation.parent
    accepted = refused = 0
    for i, step in enumerate(run.steps):
        rounds.server, rounds.edges = copy.deepcopy(step.parts)
        before = [state_of(p) for p in (rounds.server, *rounds.edges)]
        for seed in range(2):
            rng = random.Random(f"{case[0]}/{i}/{seed}")
            cid = rng.choice(sorted(step.replies))
            honest = step.replies[cid]
            for kind, bad in malformed(rng, honest.message, rounds.cfg.faults.max_message_bytes):
                if bad is None:
                    continue
                what = f"{case[0]} step {i}: {kind} of client {cid}'s reply (meta {bad.meta})"
                try:
                    rounds.check_reply(cid, ClientReply(bad, honest.num_samples))
                except MessageError as exc:
                    refused += 1
                    if kind == "oversize":
                        assert "max_message_bytes" in str(exc), what
                    continue
                accepted += 1
                assert kind in MAY_PASS, f"{what} was accepted"
                assert_sane(aggregated(step, parent, cid, bad),
                            aggregated(step, parent, cid, honest.message), what)
        for part, state in zip((rounds.server, *rounds.edges), before, strict=True):
            assert_unchanged(state, part, f"{case[0]}: check_reply changed {type(part).__name__}")
    assert refused > 0
    if case[1] == "kapc_bls":  # the valid path is taken: a shorter prefix aggregates
        assert accepted > 0


# (case, step, the step whose reply is replayed in it): a reply well formed for another
# phase of the protocol than the one the server is in
REPLAYS = [("clusterfl-late", 0, 1),   # an upload in a warm-up round that asked for none
           ("clusterfl-late", 1, 0),   # none where the clustering round asked for one
           ("dcpfl-phases", 2, 0),     # warm-up's full upload where no layer is due
           ("dcpfl-phases", 3, 2),     # nothing where the high-discrepancy layers are due
           ("dcpfl-phases", 7, 6),     # a sync round's upload in the split trial
           ("dcpfl-phases", 6, 7),     # the trial's two models in a sync round
           ("hypcluster-joined", 1, 0),  # no losses while they are asked for
           ("hypcluster-joined", 2, 1)]  # losses, but no hypothesis joined


@pytest.mark.parametrize(("key", "at", "of"), REPLAYS)
def test_a_reply_of_another_phase_is_refused(key, at, of):
    run = honest_run(next(c for c in CASES if c[0] == key))
    rounds = copy.copy(run.sim.rounds)
    rounds.server, rounds.edges = copy.deepcopy(run.steps[at].parts)
    both = sorted(set(run.steps[at].replies) & set(run.steps[of].replies))
    assert both
    for cid in both:
        with pytest.raises(MessageError):
            rounds.check_reply(cid, run.steps[of].replies[cid])


def corrupt(step, reply: ClientReply) -> ClientReply:
    """A different malformation each client step, of those never valid."""
    rng = random.Random(str(step))
    bad = rng.choice([m for kind, m in malformed(rng, reply.message)
                      if m is not None and kind not in MAY_PASS])
    return ClientReply(bad, reply.num_samples, reply.stats, reply.flops)


def remove(step, reply: ClientReply) -> ClientFailure:
    return ClientFailure("removed by the test")


E2E = [("fedavg", []), ("kapc", []), ("kapc_bls", []), ("dcpfl", DCPFL_PHASES),
       ("fedproto", []), ("hypcluster", []), ("hierfavg", HIER)]


def tampered_run(name: str, overrides: list[str], victim: int, change) -> Simulation:
    rounds = 8 if name == "dcpfl" else 3  # DC-PFL: through its split trial
    sim = Simulation(fast_config(f"algorithm.name={name}", f"train.rounds={rounds}",
                                 f"faults.max_message_bytes={CAP}", "eval.every=100", *overrides),
                     progress=False)
    train = sim.transport.train

    def spy(step, messages):
        got = train(step, messages)
        if victim in got:
            got[victim] = change(step, got[victim])
        return got

    sim.transport.train = spy
    sim.run()
    return sim


@pytest.mark.parametrize(("name", "overrides"), E2E, ids=[e[0] for e in E2E])
def test_a_client_corrupting_every_reply_fails_and_changes_nothing_else(name, overrides):
    victim = 2
    bad = tampered_run(name, overrides, victim, corrupt)
    gone = tampered_run(name, overrides, victim, remove)
    steps = len(bad.rounds.ledger.failure_log)
    assert steps == len(gone.rounds.ledger.failure_log) == bad.round * bad.federation.edge_rounds
    assert all(e["client"] == victim and e["reason"].startswith("rejected: ")
               for e in bad.rounds.ledger.failure_log)
    assert bad.rounds.ledger.failures.tolist() == gone.rounds.ledger.failures.tolist()
    assert bad.rounds.ledger.failures[victim] == steps
    assert [r["clients_failed"] for r in bad.metrics] == [r["clients_failed"] for r in gone.metrics]
    for a, b in zip((bad.server, *bad.edges), (gone.server, *gone.edges), strict=True):
        assert_unchanged(state_of(b), a, f"{name}: {type(a).__name__}")
    # the victim trained in both runs: every client's model, so every figure, is the same
    assert bad.metrics[-1]["acc_mean"] == gone.metrics[-1]["acc_mean"]
