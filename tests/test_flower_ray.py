"""``edgepfl run --runtime ray`` on a Ray cluster of this machine: a head and one worker
node, each a ``ray start`` of its own with one CPU, so that the clients' actors run on
both; the run's figures equal the in-process simulation's. Ports 8300-8399."""

import csv
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="needs Ray: pip install 'edgepfl[cluster]'")

from click.testing import CliRunner  # noqa: E402

from edgepfl.cli import main  # noqa: E402
from edgepfl.config import build_config  # noqa: E402
from edgepfl.engine.simulation import Simulation  # noqa: E402

SETS = ["dataset.name=synthetic", "partition.clients=3", "train.rounds=2", "train.lr=0.05",
        "output.plots=false", "system.count_flops=false"]
RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> list[int]:
    found = []
    for port in range(8300, 8400):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        found.append(port)
    if len(found) < n:
        pytest.skip(f"needs {n} free ports in 8300-8399, has {len(found)}")
    return found[:n]


def ray_start(log: Path, ports: list[int], *args: str) -> subprocess.Popen:
    """A blocking ``ray start`` in its own process group (so that the test stops this
    node and nothing else: ``ray stop`` would stop every Ray of the machine)."""
    names = ["node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"]
    flags = [f"--{name}={port}" for name, port in zip(names, ports, strict=False)]
    flags.append("--worker-port-list=" + ",".join(map(str, ports[len(names):])))
    return subprocess.Popen([RAY, "start", "--block", "--num-cpus=1", "--disable-usage-stats",
                             "--node-ip-address=127.0.0.1", *flags, *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def wait_started(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 90
    while "will now block" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.fixture
def cluster():
    """The head's address; the head and the worker node stopped after the test, whatever
    happened."""
    temp = Path(tempfile.mkdtemp(prefix="epr", dir="/tmp"))  # short: Ray's socket paths
    port, client, *rest = free_ports(30)
    procs: list[subprocess.Popen] = []
    try:
        procs.append(ray_start(temp / "head.log", rest[:14], "--head", f"--port={port}",
                               f"--ray-client-server-port={client}", f"--temp-dir={temp}",
                               "--include-dashboard=false"))
        wait_started(procs[0], temp / "head.log")
        procs.append(ray_start(temp / "worker.log", rest[14:], f"--address=127.0.0.1:{port}"))
        wait_started(procs[1], temp / "worker.log")
        yield f"127.0.0.1:{port}"
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(temp)], check=False)


def test_a_run_on_a_ray_cluster_equals_the_simulation(cluster, tmp_path):
    out = tmp_path / "run"
    args = ["run", "--runtime", "ray", "--ray-address", cluster, "--client-cpus", "1",
            "--quiet", "--out", str(out), *(a for s in SETS for a in ("--set", s))]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    sim = Simulation(build_config({}, SETS), progress=False).run()
    assert len(rows) == len(sim.metrics) == 2
    for ours, theirs in zip(rows, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss",
                    "bytes_up", "bytes_down", "clients"):
            assert float(ours[key]) == theirs[key], (ours["round"], key)  # equal, not close
    assert (out / "summary.json").exists()


def test_an_address_without_a_cluster_is_named():
    port = free_ports(1)[0]
    res = CliRunner().invoke(main, ["run", "--runtime", "ray", "--ray-address",
                                    f"127.0.0.1:{port}", "--set", "dataset.name=synthetic"])
    assert res.exit_code == 2
    assert f"no Ray cluster reachable at --ray-address 127.0.0.1:{port}" in res.output


def test_the_ray_options_need_the_ray_runtime():
    res = CliRunner().invoke(main, ["run", "--client-cpus", "2"])
    assert res.exit_code == 2
    assert "are for --runtime ray" in res.output
