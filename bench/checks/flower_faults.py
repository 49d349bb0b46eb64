"""Flower under faults: a real deployment on loopback that loses nodes and
receives broken replies, and what edgepfl's ServerApp makes of it.

    python bench/checks/flower_faults.py [--nodes 20] [--rounds 10] [--algorithms kapc fedavg]
                                  [--kill-share 0.333] [--fault-rate 0.15] [--seed 0]
                                  [--min-replies 0.3] [--eval-every 5] [--timeout 240]
                                  [--out runs/flower-faults] [--analyse]

For each algorithm: a SuperLink with TLS and ``--enable-supernode-auth``, every node's
public key registered with ``flwr supernode register``, one SuperNode per client with
``--root-certificates``, its own key and its own ``state-dir``, and ``flwr run`` of
``bench/checks/flower_faults_app`` (edgepfl's ServerApp; edgepfl's ClientApp behind the fault
injector ``faults_clientapp.py``). During the run:

* a third of the nodes (``--kill-share``, seeded) are killed with SIGKILL, process group
  and ClientApp included, at a seeded moment of a seeded round (2 .. rounds - 2) and
  restarted after a seeded downtime (5-45 s); a restart the SuperLink refuses is tried
  again every 5 s;
* every (round, client) train reply is broken with probability ``--fault-rate`` (seeded;
  NaN, wrong shape, wrong dtype, unknown tensor, wrong-typed metadata, bad sample count,
  missing records, above ``faults.max_message_bytes``, or the ClientApp raises).

Afterwards it checks, and prints: the run completed; every injected fault is a failed
client of that round in failures.csv, rejected for the reason its kind calls for (or the
node was killed in that round); every failure is explained by an injection or a kill;
per round ``clients_failed`` >= the faults injected; the final server state (checkpoint)
and figures are finite; each restarted node's first call after its restart loaded its
state from its state-dir, the file it had when it was killed (hash and round); and a
replay in one process (``LocalGrid``), in which exactly the clients of failures.csv fail
benignly, ends with the same server state, bit for bit, and the same train losses: no
broken reply reached the server. Keys, logs and runs go under ``--out`` (git-ignored).
"""

from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "bench" / "checks" / "flower_faults_app"
sys.path.insert(0, str(APP))
import faults_clientapp as fa  # noqa: E402

BIN = Path(sys.executable).parent
KILL_ROUND_MIN = 2  # a node killed in round 1 has no state file yet
DOWNTIME = (5.0, 45.0)
RETRY_S = 5.0
# the failures.csv reason each injected kind must produce
EXPECTED = {
    "nan": r"with NaN or Inf values",
    "shape": r"sent '[^']+' as torch\.float32 \(.*\); expected torch\.float32",
    "dtype": r"sent '[^']+' as torch\.float64 .*; expected torch\.float32",
    "unknown": r"unknown tensor 'injected\.unknown'|it sent \[.*'injected\.unknown'",
    "meta": r"sent num_samples = '|unknown metadata \['num_samples'\]",
    "count": r"reported num_samples = -1",
    "records": r"malformed reply: Flower message lacks the records",
    "oversize": r"above faults\.max_message_bytes",
    "raise": r"answered with an error: .*injected fault",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Victim:
    cid: int
    kill_round: int
    delay: float  # share of a round's length after the round's start
    downtime: float
    killed_at: float | None = None
    killed_in_round: int | None = None
    state_at_kill: dict = field(default_factory=dict)
    restart_at: float | None = None
    attempts: list[float] = field(default_factory=list)
    refused: int = 0
    up_at: float | None = None
    pending: bool = False  # a start is under way
    ids_before: int = 0


class Deployment:
    """A SuperLink with TLS and SuperNode authentication, and one SuperNode per client."""

    def __init__(self, root: Path, certs: Path, n: int, node_config: dict):
        self.root, self.certs, self.n, self.port = root, certs, n, free_port()
        self.home = root / "flwr-home"
        self.home.mkdir(parents=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\nroot-certificates = "{certs / "ca.crt"}"\n')
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.node_config = node_config
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[int, int] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.root / "logs" / f"{name}.log", "ab")
        # its own session: killing the group kills what it spawned (SuperExec, ClientApps)
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.root, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start_superlink(self) -> None:
        c = self.certs
        proc = self.start("superlink", str(BIN / "flower-superlink"),
                          "--ssl-ca-certfile", str(c / "ca.crt"), "--ssl-certfile",
                          str(c / "server.crt"), "--ssl-keyfile", str(c / "server.key"),
                          "--enable-supernode-auth", "--disable-runtime-dependency-installation",
                          "--port", str(self.port))
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the SuperLink did not start; see {self.root}/logs") from None
                time.sleep(0.3)

    def flwr(self, *args: str) -> dict:
        done = subprocess.run([str(BIN / "flwr"), *args, "local", "--format", "json"],
                              env=self.env, capture_output=True, text=True, timeout=120,
                              cwd=self.root)
        if done.returncode:
            raise SystemExit(f"flwr {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return json.loads(done.stdout[done.stdout.index("{"):])

    def register(self, k: int) -> int:
        return int(self.flwr("supernode", "register", str(self.certs / f"node{k}.pub"))["node-id"])

    def start_node(self, k: int) -> subprocess.Popen:
        self.starts[k] = self.starts.get(k, 0) + 1
        config = " ".join(f"{key}={json.dumps(v)}" for key, v in
                          {"partition-id": k, "num-partitions": self.n,
                           "state-dir": str(self.root / "state" / f"node{k}"),
                           **self.node_config}.items())
        return self.start(f"node{k}", str(BIN / "flower-supernode"),
                          "--root-certificates", str(self.certs / "ca.crt"),
                          "--auth-supernode-private-key", str(self.certs / f"node{k}.key"),
                          "--superlink", f"127.0.0.1:{self.port}",
                          "--port", str(free_port()), "--node-config", config)

    def kill(self, name: str) -> None:
        """SIGKILL the process group (a device that loses power), and wait until it is gone."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        for _ in range(100):  # children reparented to init die a moment later
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill(name)


def state_file(root: Path, cid: int) -> Path | None:
    found = glob.glob(str(root / "state" / f"node{cid}" / "*" / f"client-{cid}.safetensors"))
    return Path(found[0]) if found else None


def activations(root: Path, cid: int) -> int:
    """How often node ``cid`` has been activated by the SuperLink (its log says its id)."""
    path = root / "logs" / f"node{cid}.log"
    return path.read_text(errors="replace").count("SuperNode ID:") if path.exists() else 0


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def read_events(root: Path) -> list[dict]:
    events = []
    for path in sorted((root / "faults").glob("client-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t"])


# -- one run ----------------------------------------------------------------------------------
def run_config(args, algorithm: str, out: Path, cap: int) -> dict:
    return {"algorithm.name": algorithm, "dataset.name": "synthetic",
            "partition.clients": args.nodes, "train.rounds": args.rounds,
            "train.local_epochs": 1, "eval.every": args.eval_every, "seed": args.seed,
            "output.plots": False, "system.count_flops": False,
            "faults.min_replies": args.min_replies, "faults.max_message_bytes": cap,
            "out": str(out), "wait": 300.0, "timeout": float(args.timeout),
            "min-nodes": args.nodes}


def reply_cap(rc: dict) -> int:
    """faults.max_message_bytes: twice the largest honest reply (the whole model)."""
    from edgepfl.engine.flower import config_from_run
    from edgepfl.engine.parts import Parts, load_federation

    cfg = config_from_run({k: v for k, v in rc.items() if k not in ("out", "faults.max_message_bytes")})
    dataset, partition = load_federation(cfg)
    parts = Parts.build(cfg, dataset, partition.num_clients)
    return 2 * 4 * parts.layers.numel


def toml_value(v) -> str:
    return json.dumps(v) if not isinstance(v, bool) else str(v).lower()


def deploy(args, algorithm: str, root: Path) -> dict:
    """Run the federation, kill and restart nodes; returns what the driver did."""
    if root.exists():
        shutil.rmtree(root)
    (root / "logs").mkdir(parents=True)
    (root / "faults").mkdir()
    out = root / "run"
    rc = run_config(args, algorithm, out, 0)
    rc["faults.max_message_bytes"] = cap = reply_cap(rc)
    overrides = root / "run-config.toml"
    overrides.write_text("".join(f'"{k}" = {toml_value(v)}\n' for k, v in rc.items()))
    certs = Path(args.out).resolve() / "certs"
    sys.path.insert(0, str(REPO / "examples" / "flower"))
    import make_certs
    make_certs.make_certs(certs, nodes=args.nodes)
    dep = Deployment(root, certs, args.nodes, {fa.FAULT_SEED: args.seed,
                                               fa.FAULT_RATE: args.fault_rate,
                                               fa.FAULT_LOG: str(root / "faults")})
    rng = np.random.default_rng([args.seed, 0x4B111])
    count = round(args.nodes * args.kill_share)
    last = max(KILL_ROUND_MIN, args.rounds - 2)  # a restarted node has a round to rejoin in
    victims = [Victim(int(c), int(rng.integers(KILL_ROUND_MIN, last + 1)), float(rng.random()),
                      float(rng.uniform(*DOWNTIME)))
               for c in sorted(rng.choice(args.nodes, size=count, replace=False))]
    t0 = time.time()
    try:
        dep.start_superlink()
        node_ids = {k: dep.register(k) for k in range(args.nodes)}
        for k in range(args.nodes):
            dep.start_node(k)
        started = time.time()
        run = dep.start("flwr-run", str(BIN / "flwr"), "run", str(APP), "local", "--stream",
                        "--run-config", str(overrides))
        round_start = {1: started}
        done = 0
        while run.poll() is None:
            now = time.time()
            if now - t0 > args.max_minutes * 60:
                print(f"  stopped after --max-minutes {args.max_minutes}", flush=True)
                break
            rows = len(read_csv(out / "metrics.csv"))
            if rows > done:
                for r in range(done + 1, rows + 1):
                    round_start[r + 1] = now
                done = rows
                print(f"  round {done}/{args.rounds} at {now - started:.0f} s", flush=True)
            lengths = [round_start[r + 1] - round_start[r] for r in range(2, done + 1)]
            typical = float(np.median(lengths)) if lengths else 60.0
            for v in victims:
                if v.killed_at is None and done >= v.kill_round - 1 and \
                        now >= round_start[v.kill_round] + v.delay * typical:
                    dep.kill(f"node{v.cid}")
                    v.killed_at, v.killed_in_round = time.time(), done + 1
                    path = state_file(root, v.cid)
                    v.state_at_kill = fa.file_state(path)
                    v.restart_at = v.killed_at + v.downtime
                    print(f"  killed node {v.cid} in round {done + 1}; restart in "
                          f"{v.downtime:.0f} s", flush=True)
                elif v.restart_at is not None and now >= v.restart_at and not v.pending:
                    if v.attempts:  # what is left of the refused start (its SuperExec)
                        dep.kill(f"node{v.cid}")
                    v.ids_before = activations(root, v.cid)
                    dep.start_node(v.cid)
                    v.attempts.append(time.time())
                    v.pending = True
                if v.pending:
                    if activations(root, v.cid) > v.ids_before:
                        v.up_at, v.pending, v.restart_at = time.time(), False, None
                        print(f"  node {v.cid} is back after {v.up_at - v.killed_at:.0f} s "
                              f"({v.refused} restarts refused)", flush=True)
                    elif dep.procs[f"node{v.cid}"].poll() is not None:
                        # the SuperLink still counts the dead node as online and refuses
                        # to activate it again until its heartbeats have lapsed
                        v.refused += 1
                        v.pending, v.restart_at = False, time.time() + RETRY_S
            time.sleep(0.25)
    finally:
        wall = time.time() - t0
        dep.stop()
    d = {"algorithm": algorithm, "root": root, "out": out, "rc": rc, "cap": cap,
         "node_ids": node_ids, "victims": victims, "wall_s": wall, "flwr_rc": run.returncode}
    # what only the driver saw (kill times, state files at the kill), for --analyse
    (root / "driver.json").write_text(json.dumps(
        {**d, "victims": [asdict(v) for v in victims]}, indent=1, default=str))
    return d


def load_driver(root: Path) -> dict:
    d = json.loads((root / "driver.json").read_text())
    return {**d, "root": root, "out": Path(d["out"]), "victims": [Victim(**v) for v in d["victims"]]}


# -- what the run shows -----------------------------------------------------------------------
def analyse(args, d: dict) -> dict:
    root, out = d["root"], d["out"]
    metrics = read_csv(out / "metrics.csv")
    failures = read_csv(out / "failures.csv")
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    events = read_events(root)
    server_log = (root / "logs" / "flwr-run.log").read_text(errors="replace")
    victims: list[Victim] = d["victims"]
    killed = {(v.killed_in_round, v.cid) for v in victims if v.killed_at is not None}
    # a killed node fails every round from its kill until the first train it is sent again
    first_call, down_rounds = {}, set()
    for v in victims:
        if v.killed_at is None:
            continue
        after = [e for e in events if e["client"] == v.cid and e["event"] == "call"
                 and e["t"] > v.killed_at]
        first_call[v.cid] = after[0] if after else None
        back = next((e["round"] for e in after if e["type"] == "train"), args.rounds + 1)
        down_rounds |= {(r, v.cid) for r in range(v.killed_in_round, back)}
    injected = [e for e in events if e["event"] == "inject"]
    failed = {(int(f["round"]), int(f["client"])): f["reason"] for f in failures}
    matched, by_kill, missing, wrong = [], [], [], []
    for e in injected:
        key = (e["round"], e["client"])
        if key not in failed:
            missing.append(e)
        elif re.search(EXPECTED[e["kind"]], failed[key]):
            matched.append(e)
        elif key in down_rounds:
            by_kill.append(e)
        else:
            wrong.append({**e, "reason": failed[key]})
    inj_keys = {(e["round"], e["client"]) for e in injected}
    unexplained = [{"round": r, "client": c, "reason": why} for (r, c), why in failed.items()
                   if (r, c) not in inj_keys and (r, c) not in down_rounds]
    per_round = {r: sum(1 for e in injected if e["round"] == r) for r in range(1, args.rounds + 1)}
    short = [r for r in metrics if int(r["clients_failed"]) < per_round[int(r["round"])]]
    kinds = {k: sum(1 for e in injected if e["kind"] == k) for k in fa.KINDS}
    planned = fa.plan(args.seed, args.fault_rate, args.nodes, args.rounds)
    # the server's state and figures after the last round
    from edgepfl.io import read_tensors
    tensors, _ = read_tensors(out / "checkpoint.safetensors") if (out / "checkpoint.safetensors").exists() else ({}, {})
    nonfinite = [k for k, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    evaluated = [r for r in metrics if r["acc_mean"] not in ("", "nan")]
    figures_finite = all(math.isfinite(float(r[k])) for r in evaluated
                         for k in ("acc_mean", "acc_min", "loss")) and \
        all(math.isfinite(float(r["train_loss"])) for r in metrics)
    # restarted clients: the first call after the restart loaded the state file as killed
    restarts = []
    for v in victims:
        back = first_call.get(v.cid)
        trained_after = [e for e in events if e["client"] == v.cid and e["event"] == "trained"
                         and v.killed_at and e["t"] > v.killed_at]
        at_kill = v.state_at_kill
        ok = back is not None and (
            (back["source"] == "disk" and back["file"] == at_kill.get("file")
             and back["file_round"] == at_kill.get("file_round"))
            or (at_kill.get("file") is None and back["source"] == "init"))
        restarts.append({"client": v.cid, "kill_round": v.killed_in_round,
                         "down_s": round(v.up_at - v.killed_at, 1) if v.up_at else None,
                         "refused_restarts": v.refused,
                         "state_round_at_kill": at_kill.get("file_round"),
                         "sha_at_kill": (at_kill.get("file") or "")[:12],
                         "first_call_after": None if back is None else
                         {"type": back["type"], "round": back["round"], "source": back["source"],
                          "sha": (back.get("file") or "")[:12], "file_round": back.get("file_round")},
                         "trained_again_in": trained_after[0]["round"] if trained_after else None,
                         "resumed_from_state_dir": ok})
    state_files = {c: state_file(root, c) is not None for c in range(args.nodes)}
    # messages: what the ServerApp sent and got back, and what the ClientApps handled
    not_sent = sum(1 for f in failures if reason_kind(f["reason"]) == "no node")
    unavailable = sum(1 for f in failures if reason_kind(f["reason"]) in LOST)
    train_sent = sum(int(r["clients"]) for r in metrics) - not_sent
    eval_rounds = len(evaluated)
    not_evaluated = re.findall(r"round (\d+): client (\d+) was not evaluated: (.*)", server_log)
    eval_not_sent = sum(1 for *_, why in not_evaluated if reason_kind(why) == "no node")
    eval_lost = sum(1 for *_, why in not_evaluated if reason_kind(why) in LOST)
    calls = {t: sum(1 for e in events if e["event"] == "call" and e["type"] == t)
             for t in ("query", "train", "evaluate")}
    replies = {t: sum(1 for e in events if e["event"] == "reply" and e["type"] == t)
               for t in ("train", "evaluate")}
    return {
        "algorithm": d["algorithm"], "completed": bool(summary) and summary.get("rounds") == args.rounds,
        "flwr_rc": d["flwr_rc"], "wall_s": round(d["wall_s"], 1),
        "nodes": args.nodes, "rounds": len(metrics), "cap_bytes": d["cap"],
        "messages": {"train_sent": train_sent, "train_replies": train_sent - unavailable,
                     "evaluate_sent": eval_rounds * args.nodes - eval_not_sent,
                     "evaluate_replies": eval_rounds * args.nodes - eval_not_sent - eval_lost,
                     "clientapp_calls": calls, "clientapp_replies": replies,
                     "rejoin_queries": calls["query"] - args.nodes,
                     "bytes_up": summary.get("bytes_up_total"),
                     "bytes_down": summary.get("bytes_down_total")},
        "kills": sum(1 for v in victims if v.killed_at), "restarts": sum(1 for v in victims if v.up_at),
        "refused_restarts": sum(v.refused for v in victims),
        "injected": len(injected), "planned": len(planned), "by_kind": kinds,
        "failures_csv_rows": len(failures), "clients_failed_total": summary.get("clients_failed_total"),
        "failure_reasons": _reasons(failures),
        "injections_rejected_for_their_kind": len(matched),
        "injections_failed_by_a_kill": len(by_kill),
        "injections_missing_from_failures_csv": missing,
        "injections_with_another_reason": wrong,
        "failures_unexplained": unexplained,
        "rounds_with_clients_failed_below_injected": [int(r["round"]) for r in short],
        "clients_failed_per_round": [int(r["clients_failed"]) for r in metrics],
        "injected_per_round": list(per_round.values()),
        "server_state_tensors": len(tensors), "server_state_nonfinite": nonfinite,
        "figures_finite": figures_finite,
        "acc_mean_final": summary.get("acc_mean_final"), "acc_mean_best": summary.get("acc_mean_best"),
        "restarted": restarts, "state_files_present": sum(state_files.values()),
        "killed": sorted(killed),
    }


LOST = {"node unavailable (SuperLink)": "Node Unavailable",
        "reply upload cut off (SuperLink)": "objects are unavailable",
        "timeout": "reply within"}


def reason_kind(why: str) -> str:
    for kind, text in LOST.items():
        if text in why:
            return kind
    return ("no node" if "no SuperNode serves" in why else
            "error reply (ClientApp raised)" if "answered with an error" in why else
            "malformed records" if "malformed reply" in why else
            "rejected by check_reply" if why.startswith("rejected") else why[:60])


def _reasons(failures: list[dict]) -> dict:
    out: dict[str, int] = {}
    for f in failures:
        key = reason_kind(f["reason"])
        out[key] = out.get(key, 0) + 1
    return out


def replay(args, d: dict) -> dict:
    """The same run in one process, where exactly the clients that failed on Flower fail
    by raising: after training where the Flower client trained (its reply was then broken
    or lost), before it where it did not. Equal server state means the broken replies
    changed nothing."""
    import torch
    from flwr.app import Context

    from edgepfl.engine import flower as efl
    from edgepfl.engine import flower_local

    torch.set_num_threads(1)
    logging.getLogger("edgepfl").setLevel(logging.ERROR)  # its failures are the ones replayed
    root, out = d["root"], d["out"]
    failed = {(int(f["round"]), int(f["client"])) for f in read_csv(out / "failures.csv")}
    events = read_events(root)
    trained = {(e["round"], e["client"]) for e in events if e["event"] == "trained"}
    trained |= {(e["file_round"], e["client"]) for e in events
                if e["event"] in ("call", "trained") and e.get("file_round")}

    def app(message, context: Context):
        if message.metadata.message_type == "train":
            key = (int(message.metadata.group_id), context.node_config[efl.PARTITION_ID])
            if key in failed:
                if key in trained:
                    efl.client_app(message, context)
                raise RuntimeError("replayed failure")
        return efl.client_app(message, context)

    rc = {**d["rc"], "out": str(root / "replay"), "wait": 0}
    shutil.rmtree(root / "replay", ignore_errors=True)
    with flower_local._server_identity():
        result = efl.run_server(flower_local.LocalGrid(app, args.nodes, rc), rc)
    from edgepfl.io import read_tensors
    real, meta = read_tensors(out / "checkpoint.safetensors")
    again, _ = read_tensors(root / "replay" / "checkpoint.safetensors")
    server = [k for k in real if k.startswith("server/")]
    same = set(real) == set(again) and all(torch.equal(real[k], again[k]) for k in real)
    rows = meta["metrics"]  # full precision (metrics.csv rounds to 6 digits)
    losses_equal = len(rows) == len(result.metrics) and all(
        _same(a["train_loss"], b["train_loss"]) for a, b in zip(rows, result.metrics, strict=True))
    failed_equal = [r["clients_failed"] for r in rows] == [r["clients_failed"] for r in result.metrics]
    return {"server_tensors": len(server), "server_state_equal": same,
            "train_loss_equal": losses_equal, "clients_failed_equal": failed_equal}


def _same(a, b) -> bool:
    """Equal floats, NaN equal to NaN (a checkpoint stores NaN as null)."""
    a, b = (math.nan if v is None else float(v) for v in (a, b))
    return a == b or (math.isnan(a) and math.isnan(b))


def report(r: dict, rep: dict | None) -> list[str]:
    m = r["messages"]
    ok_restarts = sum(x["resumed_from_state_dir"] for x in r["restarted"])
    lines = [
        f"== {r['algorithm']}: {'completed' if r['completed'] else 'DID NOT COMPLETE'} "
        f"{r['rounds']}/{r['rounds'] if r['completed'] else '?'} rounds, {r['nodes']} SuperNodes "
        f"(TLS + node auth, state-dir), {r['wall_s']:.0f} s",
        f"   messages: train {m['train_sent']} sent / {m['train_replies']} replies; evaluate "
        f"{m['evaluate_sent']} / {m['evaluate_replies']}; rejoin queries {m['rejoin_queries']}; "
        f"ClientApp calls {m['clientapp_calls']}; bytes up {m['bytes_up']:,} down {m['bytes_down']:,}",
        f"   kills {r['kills']}, restarts {r['restarts']} (refused by the SuperLink first: "
        f"{r['refused_restarts']}); corruptions injected {r['injected']} (planned "
        f"{r['planned']}): {r['by_kind']}",
        f"   failures.csv: {r['failures_csv_rows']} rows {r['failure_reasons']}",
        f"   injections rejected for their kind {r['injections_rejected_for_their_kind']}, failed by "
        f"a kill {r['injections_failed_by_a_kill']}, missing {len(r['injections_missing_from_failures_csv'])}, "
        f"other reason {len(r['injections_with_another_reason'])}; unexplained failures "
        f"{len(r['failures_unexplained'])}",
        f"   clients_failed per round {r['clients_failed_per_round']} >= injected "
        f"{r['injected_per_round']}: {not r['rounds_with_clients_failed_below_injected']}",
        f"   server state: {r['server_state_tensors']} tensors, non-finite "
        f"{len(r['server_state_nonfinite'])}; figures finite {r['figures_finite']}; acc_mean "
        f"final {r['acc_mean_final']}, best {r['acc_mean_best']}",
        f"   restarted clients resumed from their state-dir (same file hash and round): "
        f"{ok_restarts}/{len(r['restarted'])}; state files present {r['state_files_present']}/{r['nodes']}",
    ]
    for x in r["restarted"]:
        f = x["first_call_after"] or {}
        lines.append(f"     client {x['client']:>2}: killed in round {x['kill_round']}, state round "
                     f"{x['state_round_at_kill']} sha {x['sha_at_kill']}; back after {x['down_s']} s "
                     f"({x['refused_restarts']} refused), first call {f.get('type')} round "
                     f"{f.get('round')} from {f.get('source')} round {f.get('file_round')} sha "
                     f"{f.get('sha')}; trained again in round {x['trained_again_in']}")
    if rep is not None:
        lines.append(f"   replay in one process with the same failures: server state equal "
                     f"{rep['server_state_equal']} ({rep['server_tensors']} tensors), train_loss equal "
                     f"{rep['train_loss_equal']}, clients_failed equal {rep['clients_failed_equal']}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--algorithms", nargs="+", default=["kapc", "fedavg"])
    p.add_argument("--kill-share", type=float, default=1 / 3)
    p.add_argument("--fault-rate", type=float, default=0.15)
    p.add_argument("--min-replies", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--timeout", type=float, default=240.0,
                   help="ServerApp's seconds to wait for a round's replies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=40.0, help="per algorithm")
    p.add_argument("--no-replay", action="store_true")
    p.add_argument("--out", default="runs/flower-faults")
    p.add_argument("--analyse", action="store_true",
                   help="check and report the runs already in --out, without running again")
    args = p.parse_args(argv)
    if args.rounds < 4:
        p.error("--rounds must be >= 4: nodes are killed in rounds 2 .. rounds - 2")
    base = Path(args.out).resolve()
    results = []
    for algorithm in args.algorithms:
        print(f"{algorithm}: {args.nodes} SuperNodes, {args.rounds} rounds", flush=True)
        d = load_driver(base / algorithm) if args.analyse else deploy(args, algorithm, base / algorithm)
        r = analyse(args, d)
        rep = None if args.no_replay or not r["completed"] else replay(args, d)
        r["replay"] = rep
        results.append(r)
        print("\n".join(report(r, rep)), flush=True)
    (base / "report.json").write_text(json.dumps(results, indent=1, default=str))
    good = all(r["completed"] and not r["injections_missing_from_failures_csv"]
               and not r["injections_with_another_reason"] and not r["failures_unexplained"]
               and not r["rounds_with_clients_failed_below_injected"]
               and not r["server_state_nonfinite"] and r["figures_finite"]
               and all(x["resumed_from_state_dir"] for x in r["restarted"])
               and (r["replay"] is None or (r["replay"]["server_state_equal"]
                                            and r["replay"]["train_loss_equal"]
                                            and r["replay"]["clients_failed_equal"]))
               for r in results)
    print(f"all checks passed: {good}  (report: {base / 'report.json'})")
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
