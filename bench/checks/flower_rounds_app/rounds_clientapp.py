"""edgepfl's ClientApp with per-message timers, for ``bench/checks/flower_rounds.py``.

With ``FLOWER_ROUNDS_TIMING`` (a folder) in the SuperNode's environment, each message
appends one JSON line to ``$FLOWER_ROUNDS_TIMING/clientapp.jsonl``: when the process
started, when this module began and finished importing (torch and edgepfl), when the
message reached the app, when the client's data and algorithm parts were ready (built, or
found in the process's cache), and when the reply was made. The reply itself is
edgepfl's, unchanged."""

from __future__ import annotations

import time

MODULE_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from flwr.app import Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from edgepfl.engine import flower_client  # noqa: E402

MODULE_END = time.time()


def process_start() -> float:
    """When this process started (Unix time, from /proc; 0 where there is none)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat")
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return 0.0


class _Timed(ClientApp):
    def __call__(self, message: Message, context: Context) -> Message:
        folder = os.environ.get("FLOWER_ROUNDS_TIMING")
        call = time.time()
        if message.metadata.message_type.split(".")[0] in ("train", "evaluate"):
            flower_client._client(context)  # the node's data and parts (cached per process)
        data = time.time()
        reply = flower_client.client_app(message, context)
        done = time.time()
        if folder:
            line = {"app": "edgepfl", "pid": os.getpid(), "type": message.metadata.message_type,
                    "round": message.metadata.group_id,
                    "node": context.node_config.get("partition-id"),
                    "proc_start": process_start(), "module_start": MODULE_START,
                    "module_end": MODULE_END, "call": call, "data": data, "work": done,
                    "reply": done}
            with open(Path(folder) / "clientapp.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        return reply


client_app = _Timed()
