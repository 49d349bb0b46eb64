"""The long-lived ClientApp process (``edgepfl.engine.flower_worker``): the SuperNode's tasks
of one app run in it one after another, the app loaded once; a task of another app gets a
``flwr-clientapp`` process of its own; an app that raises is answered with an error reply.
The Runtime API is faked here; examples/flower/deploy_local.sh and
bench/checks/flower_rounds.py run the worker against real SuperNodes."""

from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")

from flwr.app import Message, RecordDict  # noqa: E402
from flwr.common.constant import SubStatus  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from edgepfl.engine import flower_worker as fw  # noqa: E402


class _Stop(Exception):
    pass


class _Runtime:
    """A SuperNode's Runtime API that hands out ``tasks`` (fab hash, token), then stops."""

    def __init__(self, tasks):
        self.tasks = list(tasks)
        self.asked = 0

    def AcquireTask(self, request):  # noqa: N802 -- Flower's name
        assert list(request.supported_task_types) == ["flwr-clientapp"]
        self.asked += 1
        if self.asked % 2:  # every other call: no task yet
            return SimpleNamespace(HasField=lambda _: False, token="")
        if not self.tasks:
            raise _Stop
        fab, token = self.tasks.pop(0)
        task = SimpleNamespace(fab_hash=fab, task_id=1, run_id=1)
        return SimpleNamespace(HasField=lambda _: True, token=token, task=task)

    def close(self):
        pass


def _message() -> Message:
    return Message(RecordDict(), dst_node_id=1, message_type="train", group_id="1")


@pytest.fixture
def worker(monkeypatch):
    # a message is made inside a task, which flwr-clientapp's input names (pull_task_input)
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    runtime = _Runtime([("fab-a", "t1"), ("fab-a", "t2"), ("fab-b", "t3"), ("fab-a", "t4")])
    seen = SimpleNamespace(installed=[], loaded=0, calls=[], pushed=[], outputs=[], spawned=[],
                           runtime=runtime, raise_on=set())

    def client(address, certificates, insecure, component, token=None):
        return runtime if token is None else SimpleNamespace(token=token, close=lambda: None)

    def pull(client):
        fab = SimpleNamespace(hash_str="fab-a", content=b"fab")
        run = SimpleNamespace(fab_id="edgepfl/app", fab_version="0.1.0")
        return _message(), SimpleNamespace(token=client.token), run, fab

    def app(message, context):
        seen.calls.append(context.token)
        if context.token in seen.raise_on:
            raise RuntimeError("broken app")
        return Message(RecordDict(), reply_to=message)

    def load_fn(**_):
        def load(*_):
            seen.loaded += 1
            return app
        return load

    monkeypatch.setattr(fw, "_client", client)
    monkeypatch.setattr(fw, "pull_task_input", pull)
    monkeypatch.setattr(fw, "push_message", lambda c, reply, ctx: seen.pushed.append((c.token, reply)))
    monkeypatch.setattr(fw, "push_task_output",
                        lambda client, context, sub_status, details: seen.outputs.append(
                            (client.token, sub_status, details)))
    monkeypatch.setattr(fw, "install_from_fab", lambda content, skip_prompt: seen.installed.append(content))
    monkeypatch.setattr(fw, "get_load_client_app_fn", load_fn)
    monkeypatch.setattr(fw, "HeartbeatSender", lambda fn: SimpleNamespace(start=lambda: None,
                                                                         stop=lambda: None))
    monkeypatch.setattr(fw, "make_task_heartbeat_fn_http", lambda client: None)
    monkeypatch.setattr(fw.subprocess, "Popen", lambda args: seen.spawned.append(args))
    monkeypatch.setattr(fw.time, "sleep", lambda s: None)
    yield seen
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def test_one_apps_tasks_run_in_the_worker_and_another_apps_in_a_process_of_its_own(worker):
    with pytest.raises(_Stop):
        fw.serve("127.0.0.1:9094", insecure=True, root_certificates=None)
    assert worker.calls == ["t1", "t2", "t4"]  # in this process, one after another
    assert worker.installed == [b"fab"]  # the FAB installed once
    assert [t for t, _ in worker.pushed] == ["t1", "t2", "t4"]
    assert worker.outputs == [(t, SubStatus.COMPLETED, "") for t in ("t1", "t2", "t4")]
    assert worker.spawned == [["flwr-clientapp", "--runtime-api-address", "127.0.0.1:9094",
                               "--token", "t3", "--insecure"]]


def test_an_app_that_raises_is_answered_with_an_error_and_the_worker_goes_on(worker):
    worker.raise_on = {"t2"}
    with pytest.raises(_Stop):
        fw.serve("127.0.0.1:9094", insecure=True, root_certificates=None)
    assert worker.calls == ["t1", "t2", "t4"]
    replies = dict(worker.pushed)
    assert replies["t2"].has_error() and "broken app" in replies["t2"].error.reason
    assert not replies["t4"].has_error()
    status = {t: s for t, s, _ in worker.outputs}
    assert status == {"t1": SubStatus.COMPLETED, "t2": SubStatus.FAILED, "t4": SubStatus.COMPLETED}


def test_the_worker_wants_tls_or_an_explicit_insecure():
    with pytest.raises(SystemExit):
        fw.main(["--runtime-api-address", "127.0.0.1:9094"])


def test_preload_imports_the_module_before_taking_tasks(monkeypatch):
    imported = []
    monkeypatch.setattr(fw.importlib, "import_module", imported.append)
    monkeypatch.setattr(fw, "serve", lambda *args: imported.append("serve"))
    fw.main(["--insecure", "--preload", "edgepfl.engine.flower", "--preload", "json"])
    assert imported == ["edgepfl.engine.flower", "json", "serve"]

