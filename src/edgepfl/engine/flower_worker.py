"""A long-lived ClientApp process for a SuperNode (``flower-supernode --isolation process``).

Flower 1.42 runs every message a SuperNode receives in a fresh ``flwr-clientapp``
process (``--isolation subprocess``, the default: the SuperNode's SuperExec starts one per
message), so each message pays for Python's start, importing torch and edgepfl, and
building the client's data and algorithm parts. With ``--isolation process`` the
SuperNode starts nothing and waits for a process of the operator's to take its tasks:
this one. It takes them one at a time from the SuperNode's Runtime API and runs them in
itself, so that imports and ``flower_client``'s per-process cache (the data set and the
algorithm parts) outlive a message::

    flower-supernode --isolation process --port 9094 ... &
    python -m edgepfl.engine.flower_worker --runtime-api-address 127.0.0.1:9094 --insecure \
        --preload edgepfl.engine.flower

It serves one app: the first task's FAB (an app, by hash) runs here; a task of any other
FAB runs in a fresh ``flwr-clientapp`` process, as Flower would, so that two apps never
share a process. A task that raises is answered with Flower's error reply, as in
``flwr-clientapp``; one that kills the process (out of memory) ends it: run it under a
supervisor that restarts it (``examples/flower/deploy_local.sh`` does). Runtime
dependency installation is not done (the app's dependencies must be installed). What one
message leaves in the process (module globals, caches) the next one of the same app sees;
the client's own state still travels in the node's ``Context.state``, as before.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import time
from logging import DEBUG, ERROR, INFO

from flwr.app import Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.supercore import log
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output


def _client(address: str, certificates: bytes | None, insecure: bool, component: str,
            token: str | None = None) -> RuntimeHttpClient:
    interceptors = [RuntimeVersionHttpInterceptor(component_name=component)]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure, root_certificates=certificates,
        interceptors=interceptors, retry_invoker=make_simple_http_retry_invoker())


def run_task(address: str, certificates: bytes | None, insecure: bool, token: str,
             installed: set[str]) -> None:
    """Run the task of ``token`` in this process: what ``flwr-clientapp`` does for one
    message, without leaving; the FAB is installed once per hash (``installed``)."""
    client = _client(address, certificates, insecure, "flwr-clientapp", token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = reply = context = None
    status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        message, context, run, fab = pull_task_input(client)
        if fab.hash_str not in installed:
            install_from_fab(fab.content, skip_prompt=True)
            installed.add(fab.hash_str)
        load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        app = load(run.fab_id, run.fab_version, fab.hash_str)
        reply = app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as ex:  # noqa: BLE001 -- a failing app is answered, as flwr-clientapp does
        code = (ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(ex, LoadClientAppError)
                else ErrorCode.CLIENT_APP_RAISED_EXCEPTION)
        reason = f"{type(ex)}:<'{ex}'>"
        log(ERROR, "ClientApp raised an exception", exc_info=ex)
        details = reason
        if message is not None:
            reply = Message(Error(code=code, reason=reason), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception as ex:  # noqa: BLE001
            log(ERROR, "Failed to push reply message", exc_info=ex)
        push_task_output(client=client, context=context, sub_status=status, details=details)
        heartbeat.stop()
        client.close()


def serve(address: str, insecure: bool, root_certificates: str | None,
          poll_s: float = 0.1) -> None:
    """Take the SuperNode's ClientApp tasks and run them, until stopped."""
    certificates = validate_and_resolve_root_certificates(root_certificates, insecure)
    exec_client = _client(address, certificates, insecure, "SuperExec")
    warm: str | None = None
    installed: set[str] = set()
    log(INFO, "edgepfl ClientApp worker: taking tasks from %s", address)
    while True:
        res = exec_client.AcquireTask(AcquireTaskRequest(
            supported_task_types=[TaskType.CLIENT_APP.value]))
        if not (res.HasField("task") and res.token):
            time.sleep(poll_s)
            continue
        if warm is None:
            warm = res.task.fab_hash
        if res.task.fab_hash == warm:
            log(DEBUG, "task %d (run %d) in this process", res.task.task_id, res.task.run_id)
            run_task(address, certificates, insecure, res.token, installed)
        else:  # another app: a process of its own, as Flower's subprocess isolation does
            tls = ["--insecure"] if insecure else (
                ["--root-certificates", root_certificates] if root_certificates else [])
            subprocess.Popen(["flwr-clientapp", "--runtime-api-address", address,
                              "--token", res.token, *tls])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m edgepfl.engine.flower_worker",
        description="A long-lived ClientApp process for a SuperNode started with "
                    "--isolation process: runs its tasks one after another in this process.")
    parser.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                        help="the SuperNode's Runtime API (its --port; default %(default)s)")
    parser.add_argument("--insecure", action="store_true",
                        help="plain HTTP to the SuperNode's Runtime API")
    parser.add_argument("--root-certificates", default=None,
                        help="CA certificate (PEM) of the SuperNode's Runtime API TLS")
    parser.add_argument("--poll", type=float, default=0.1,
                        help="seconds between asking for a task when there is none")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="import MODULE before taking tasks (e.g. edgepfl.engine.flower), "
                             "so that the first message does not pay for it; repeatable")
    args = parser.parse_args(argv)
    if not args.insecure and args.root_certificates is None:
        parser.error("give --insecure or --root-certificates")
    for module in args.preload:
        importlib.import_module(module)
    try:
        serve(args.runtime_api_address, args.insecure, args.root_certificates, args.poll)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
