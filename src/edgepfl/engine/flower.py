"""Flower deployment: an algorithm's Server and Client parts inside a Flower ServerApp and
ClientApp, the same objects the simulation drives. Flower loads the apps from here
(``serverapp = "edgepfl.engine.flower:server_app"``, ``clientapp =
"edgepfl.engine.flower:client_app"``); they live in ``flower_server`` and
``flower_client``, what both share (messages, the run config's keys) in ``flower_wire``,
and the in-process grid that tests and local runs use in ``flower_local``.

Requires the optional dependency ``flwr`` (``pip install 'edgepfl[flower]'``).
"""

from edgepfl.engine.flower_client import client_app
from edgepfl.engine.flower_server import (
    FlowerResult,
    FlowerTransport,
    ask_nodes,
    discover,
    run_server,
    server_app,
)
from edgepfl.engine.flower_wire import (
    META,
    PARTITION_ID,
    SERVER_KEYS,
    STATE_DIR,
    TENSORS,
    config_from_run,
    from_content,
    to_content,
)

__all__ = ["META", "PARTITION_ID", "SERVER_KEYS", "STATE_DIR", "TENSORS", "FlowerResult",
           "FlowerTransport", "ask_nodes", "client_app", "config_from_run", "discover",
           "from_content", "run_server", "server_app", "to_content"]
