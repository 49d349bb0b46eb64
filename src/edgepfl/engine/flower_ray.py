"""edgepfl's Flower apps on Flower's simulation runtime (Ray): one virtual SuperNode per
client (node config ``partition-id``), each client's ClientApp call run by a Ray actor
with the resources ``client_resources`` asks for, on a local Ray instance or on every
node of an existing Ray cluster (``address``). The ServerApp runs in this process, so
this process must be on a node of that cluster (the head, say). ``edgepfl run
--runtime ray`` drives it; docs/cluster.md says how to start a cluster and what it costs.

Each actor loads the data set from its own node's ``dataset.root`` / ``EDGEPFL_DATA``
(the environment ``ray start`` ran in), as a SuperNode does; the ServerApp aggregates in
the simulation's order, so the figures equal the in-process simulation's.

Requires Flower's simulation extra: ``pip install 'edgepfl[cluster]'`` (Ray).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import warnings
from collections.abc import Mapping
from typing import Any

from edgepfl.engine.flower_client import client_app
from edgepfl.engine.flower_server import FlowerResult, run_server
from edgepfl.engine.flower_wire import (
    WAIT,
    ClientApp,
    Context,
    FlowerMessage,
    Grid,
    ServerApp,
    config_from_run,
)
from edgepfl.errors import EdgepflError

EXTRA = "pip install 'edgepfl[cluster]' (Flower's simulation runtime, Ray)"


class ConfiguredClientApp(ClientApp):
    """edgepfl's ClientApp with the run config that ``flwr run`` would give it (Flower's
    ``run_simulation`` passes none). Ray pickles it to every actor by reference, so each
    node imports it from its own edgepfl."""

    def __init__(self, run_config: Mapping[str, Any]):
        super().__init__()
        self.run_config = dict(run_config)

    def __call__(self, message: FlowerMessage, context: Context) -> FlowerMessage:
        # a Context's run config is read-only; its state object is the node's, so what the
        # client keeps between rounds persists (the runtime keeps it for the node)
        configured = Context(run_id=context.run_id, node_id=context.node_id,
                             node_config=context.node_config, state=context.state,
                             run_config=dict(self.run_config))
        return client_app(message, configured)


def _ray() -> Any:
    if importlib.util.find_spec("ray") is None:
        raise EdgepflError(f"--runtime ray needs Ray: {EXTRA}")
    import ray

    return ray


def _reachable(address: str) -> None:
    """A cluster's head answers at ``address`` (HOST:PORT or ray://HOST:PORT; "auto" is
    Ray's to find), checked first: Ray itself retries an absent head for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise EdgepflError(f"no Ray cluster reachable at --ray-address {address} ({exc}); "
                           f"start its head there first: ray start --head --port {port}") from None


def _connect(ray: Any, address: str | None) -> bool:
    """Ray initialised: on the cluster at ``address``, else a new local instance with
    this machine's CPUs. True when this call started it (and must shut it down)."""
    if ray.is_initialized():
        return False
    args: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address:
        _reachable(address)
    try:
        with warnings.catch_warnings():
            # Ray's notice that a later release stops hiding GPUs from actors asking none
            warnings.simplefilter("ignore", FutureWarning)
            if address:
                ray.init(address=address, **args)
            else:  # "local": never join a cluster found on this machine by chance
                ray.init(address="local", num_cpus=os.cpu_count() or 1, **args)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"no Ray cluster reachable at --ray-address {address}" if address else \
            "Ray could not start on this machine"
        raise EdgepflError(f"{where}: {type(exc).__name__}: {exc}") from None
    return True


def _check_fits(ray: Any, cpus: float, gpus: float) -> None:
    """One node of the cluster at least holds one client's actor (Flower sizes its pool
    per node and would stop with an empty one)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n.get("Resources")]
    if not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        raise EdgepflError(f"--client-cpus {cpus:g} --client-gpus {gpus:g}: no node of the Ray "
                           f"cluster has that much (its nodes: "
                           f"{[{k: r.get(k, 0) for k in ('CPU', 'GPU')} for r in nodes]})")


def run_ray(run_config: Mapping[str, Any], address: str | None = None,
            client_cpus: float = 1.0, client_gpus: float = 0.0,
            progress: bool | None = False) -> FlowerResult:
    """Run the configuration in ``run_config`` (a Flower run config: dotted edgepfl
    settings plus the ServerApp's ``out`` ...) on Flower's simulation runtime, one
    virtual SuperNode per client, each ClientApp call in a Ray actor asking for
    ``client_cpus`` CPUs and ``client_gpus`` GPUs (Flower's ``client_resources``; as
    many actors as fit on the cluster's nodes run at once)."""
    ray = _ray()
    from flwr.simulation import run_simulation

    run_config = {WAIT: 0, **run_config}  # the virtual nodes are all there from the start
    clients = config_from_run(run_config).partition.clients
    started = _connect(ray, address)
    try:
        _check_fits(ray, client_cpus, client_gpus)
        result: dict[str, FlowerResult] = {}
        server = ServerApp()

        @server.main()
        def _main(grid: Grid, context: Context) -> None:
            result["run"] = run_server(grid, run_config, progress)

        run_simulation(server, ConfiguredClientApp(run_config), clients,
                       backend_config={"client_resources": {"num_cpus": client_cpus,
                                                            "num_gpus": client_gpus}})
        if "run" not in result:  # pragma: no cover - Flower re-raises the ServerApp's error
            raise EdgepflError("Flower's simulation runtime ended without a result")
        return result["run"]
    finally:
        if started:
            ray.shutdown()
