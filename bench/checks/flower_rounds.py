"""Flower round latency: edgepfl's Flower app against Flower's PyTorch quickstart, on one
local deployment (a SuperLink and three SuperNodes on loopback), in one run.

    python bench/checks/flower_rounds.py [--rounds 4] [--repeats 1]
                                         [--isolation subprocess process] [--tls]
                                         [--port 8100] [--out runs/flower-rounds]

The two apps do one task: FedAvg, ``cnn_small`` on 8x8 synthetic images, 2000 samples over
three clients, batch 32, lr 0.01, one local epoch, every client trains and evaluates every
round. ``flower_quickstart_app`` is Flower's quickstart structure (its FedAvg strategy,
a ClientApp that loads the arrays into a model and trains it; no edgepfl);
``flower_rounds_app`` is edgepfl's app (``examples/flower``) with per-message timers
around edgepfl's ClientApp. Each app runs on a fresh deployment, once per isolation
mode, the apps and modes interleaved (``--repeats`` times), so that what else the machine
does falls on both:

* ``subprocess``: Flower's default; the SuperNode's SuperExec starts a ``flwr-clientapp``
  process for every message;
* ``process``: ``flower-supernode --isolation process`` with one long-lived
  ``python -m edgepfl.engine.flower_worker`` per node, which runs the node's messages in
  itself (imports and data stay loaded).

Reported per (app, isolation): the first round and the median of the rounds after it
(the server's round times: edgepfl's ``metrics.csv`` ``wall_s``; the quickstart's
time between two of FedAvg's ``evaluate_fn`` calls), and the ClientApp's share of a
message (medians over messages): process start to the app's module (Python, Flower's
imports, pulling the message), importing the app (torch, edgepfl), data and parts,
training or evaluation; the rest of a round is Flower's (polling, the SuperLink,
serialisation) and waiting for the slowest node. Logs and runs go under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APPS = {"quickstart": REPO / "bench" / "checks" / "flower_quickstart_app",
        "edgepfl": REPO / "bench" / "checks" / "flower_rounds_app"}
BIN = Path(sys.executable).parent
NODES = 3


class Deployment:
    """A SuperLink and NODES SuperNodes on loopback (plain HTTP, or TLS and SuperNode
    authentication with ``tls``), and with ``isolation == "process"`` one
    ``flower_worker`` per node."""

    def __init__(self, root: Path, port: int, isolation: str, tls: bool):
        self.root, self.port, self.isolation, self.tls = root, port, isolation, tls
        self.home = root / "flwr-home"
        self.logs = root / "logs"
        self.timing = root / "timing"
        for d in (self.home, self.logs, self.timing):
            d.mkdir(parents=True, exist_ok=True)
        self.certs = root.parent / "certs"
        conn = (f'root-certificates = "{self.certs / "ca.crt"}"' if tls else "insecure = true")
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{port}"\n{conn}\n')
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1", "FLOWER_ROUNDS_TIMING": str(self.timing),
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=self.root, start_new_session=True)
        self.procs.append(proc)
        return proc

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env, cwd=self.root,
                              capture_output=True, text=True, timeout=timeout)

    def start(self) -> None:
        c = self.certs
        security = (["--ssl-ca-certfile", str(c / "ca.crt"), "--ssl-certfile", str(c / "server.crt"),
                     "--ssl-keyfile", str(c / "server.key"), "--enable-supernode-auth"]
                    if self.tls else ["--insecure"])
        self.spawn("superlink", str(BIN / "flower-superlink"), *security,
                   "--disable-runtime-dependency-installation", "--port", str(self.port))
        deadline = time.monotonic() + 90
        while self.flwr("supernode", "ls", "local", timeout=30).returncode:
            if time.monotonic() > deadline:
                raise SystemExit(f"the SuperLink did not start; see {self.logs}")
            time.sleep(0.5)
        for k in range(NODES):
            node_port = self.port + 1100 + k  # 8100 -> 9200..
            if self.tls:
                done = self.flwr("supernode", "register", str(c / f"node{k}.pub"), "local")
                if done.returncode:
                    raise SystemExit(f"flwr supernode register failed: {done.stderr}")
                security = ["--root-certificates", str(c / "ca.crt"),
                            "--auth-supernode-private-key", str(c / f"node{k}.key")]
            else:
                security = ["--insecure"]
            self.spawn(f"node{k}", str(BIN / "flower-supernode"), *security,
                       "--superlink", f"127.0.0.1:{self.port}", "--port", str(node_port),
                       "--isolation", self.isolation,
                       "--node-config", f"partition-id={k} num-partitions={NODES}")
            if self.isolation == "process":
                self.spawn(f"worker{k}", sys.executable, "-m", "edgepfl.engine.flower_worker",
                           "--runtime-api-address", f"127.0.0.1:{node_port}", "--insecure")
        deadline = time.monotonic() + 90
        while sum("SuperNode ID" in (self.logs / f"node{k}.log").read_text()
                  for k in range(NODES)) < NODES:
            if time.monotonic() > deadline:
                raise SystemExit(f"the SuperNodes did not connect; see {self.logs}")
            time.sleep(0.5)

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_once(app: str, isolation: str, rounds: int, root: Path, port: int, tls: bool) -> dict:
    dep = Deployment(root, port, isolation, tls)
    try:
        dep.start()
        if app == "quickstart":
            out = root / "server.json"
            config = f'num-server-rounds={rounds} out="{out}" min-nodes={NODES}'
        else:
            out = root / "run"
            config = f'train.rounds={rounds} out="{out}"'
        t0 = time.time()
        done = dep.flwr("run", str(APPS[app]), "local", "--stream", "--run-config", config,
                        timeout=60 * 30)
        total = time.time() - t0
        (dep.logs / "flwr-run.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            raise SystemExit(f"flwr run of {app} failed; see {dep.logs}/flwr-run.log")
        if app == "quickstart":
            walls = json.loads(out.read_text())["wall_s"]
        else:
            walls = [float(r["wall_s"]) for r in csv.DictReader(open(out / "metrics.csv"))]
        lines = (dep.timing / "clientapp.jsonl").read_text().splitlines()
        return {"app": app, "isolation": isolation, "tls": tls, "rounds": walls,
                "flwr_run_s": total, "messages": [json.loads(line) for line in lines]}
    finally:
        dep.stop()


def parts_of(messages: list[dict], fresh: bool) -> dict[str, float]:
    """Medians over the train and evaluate messages of the ClientApp's share, split: the
    process start (Python, Flower's imports, pulling the message; with ``fresh``
    processes only, one per message: a long-lived worker starts before the run) and the
    app's imports count in a process's first message only (a cold message); ``cold`` and
    ``warm`` are the ClientApp's whole time for a process's first message and for one
    that found it running (NaN where there was none)."""
    seen: set[int] = set()
    rows = []
    for m in sorted(messages, key=lambda m: m["call"]):
        kind = m["type"].split(".")[0]
        if kind not in ("train", "evaluate"):
            continue
        first = m["pid"] not in seen
        seen.add(m["pid"])
        start = m["module_start"] - m["proc_start"] if fresh and first and m["proc_start"] else 0.0
        imports = m["module_end"] - m["module_start"] if first else 0.0
        rows.append({"kind": kind, "first": first, "start_pull": start, "imports": imports,
                     "data": m["data"] - m["call"], "work": m["work"] - m["data"],
                     "clientapp": start + imports + (m["reply"] - m["call"])})
    if not rows:
        return {}

    def med(key: str, keep) -> float:
        values = [r[key] for r in rows if keep(r)]
        return statistics.median(values) if values else float("nan")

    return {"start_pull": med("start_pull", lambda r: r["first"]) if fresh else float("nan"),
            "imports": med("imports", lambda r: r["first"]),
            "data": med("data", lambda r: True),
            "train": med("work", lambda r: r["kind"] == "train"),
            "evaluate": med("work", lambda r: r["kind"] == "evaluate"),
            "cold": med("clientapp", lambda r: r["first"]),
            "warm": med("clientapp", lambda r: not r["first"])}


def summary(results: list[dict]) -> list[dict]:
    table = []
    for key in dict.fromkeys((r["app"], r["isolation"]) for r in results):
        runs = [r for r in results if (r["app"], r["isolation"]) == key]
        later = [w for r in runs for w in r["rounds"][1:]]
        table.append({"app": key[0], "isolation": key[1], "runs": len(runs),
                      "first_round_s": statistics.median(r["rounds"][0] for r in runs),
                      "round_s": statistics.median(later) if later else float("nan"),
                      **parts_of([m for r in runs for m in r["messages"]],
                                 fresh=key[1] == "subprocess")})
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--isolation", nargs="+", default=["subprocess", "process"],
                   choices=["subprocess", "process"])
    p.add_argument("--apps", nargs="+", default=["quickstart", "edgepfl"], choices=list(APPS))
    p.add_argument("--tls", action="store_true", help="TLS and SuperNode authentication")
    p.add_argument("--port", type=int, default=8100, help="the SuperLink's port; SuperNodes "
                   "use port + 1100 + k")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "flower-rounds")
    p.add_argument("--summarise", type=Path, metavar="RESULTS_JSON",
                   help="print the table of an earlier run's results.json, run nothing")
    args = p.parse_args()
    if args.summarise:
        report(json.loads(args.summarise.read_text()))
        return
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if args.tls:
        subprocess.run([sys.executable, str(REPO / "examples" / "flower" / "make_certs.py"),
                        str(out / "certs"), "--nodes", str(NODES)], check=True)
    results = []
    for rep in range(args.repeats):
        for isolation in args.isolation:
            for app in args.apps:
                root = out / f"{rep}-{isolation}-{app}"
                r = run_once(app, isolation, args.rounds, root, args.port, args.tls)
                print(f"{app:10} {isolation:10} rounds {' '.join(f'{w:.2f}' for w in r['rounds'])}"
                      f"  (flwr run {r['flwr_run_s']:.1f} s)", flush=True)
                results.append(r)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.json").write_text(json.dumps(report(results), indent=1))


def report(results: list[dict]) -> list[dict]:
    table = summary(results)
    cols = ["first_round_s", "round_s", "start_pull", "imports", "data", "train", "evaluate",
            "cold", "warm"]
    print("\nseconds; start_pull .. warm: the ClientApp's share of a message (medians)")
    print(f"{'app':10} {'isolation':10} {'runs':>4} " + " ".join(f"{c:>13}" for c in cols))
    for row in table:
        print(f"{row['app']:10} {row['isolation']:10} {row['runs']:>4} "
              + " ".join(f"{row.get(c, float('nan')):13.2f}" for c in cols))
    base = {r["isolation"]: r["round_s"] for r in table if r["app"] == "quickstart"}
    for row in table:
        if row["app"] == "edgepfl" and row["isolation"] in base:
            print(f"edgepfl / quickstart round, {row['isolation']}: "
                  f"{row['round_s'] / base[row['isolation']]:.2f}x")
    return table


if __name__ == "__main__":
    main()
