"""Flower deployments with TLS and SuperNode authentication: real SuperLink and SuperNode
processes on loopback (the certificates from examples/flower/make_certs.py), and nothing
a peer sends is unpickled or executed."""

import ast
import importlib.util
import io
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives.serialization import load_ssh_private_key  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402

from edgepfl.engine.flower import META, TENSORS, from_content  # noqa: E402
from edgepfl.engine.flower_local import LocalGrid, _server_identity  # noqa: E402
from edgepfl.federation.messages import MessageError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "edgepfl"


def _executable(name: str) -> str | None:
    # the venv's own first: pytest may run as .venv/bin/python without an activated PATH
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


EXE = {name: _executable(name) for name in ("flower-superlink", "flower-supernode", "flwr")}
needs_flower = pytest.mark.skipif(
    None in EXE.values(),
    reason=f"Flower executables not installed: {[k for k, v in EXE.items() if v is None]}")


def _load_make_certs():
    spec = importlib.util.spec_from_file_location("make_certs", REPO / "examples/flower/make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_certs = _load_make_certs()


# -- key material ---------------------------------------------------------------------------
def test_make_certs_writes_a_ca_a_server_certificate_and_node_keys(tmp_path):
    folder = tmp_path / "certs"
    written = make_certs.make_certs(folder, nodes=2,
                                    sans=["127.0.0.1", "localhost", "edge.example"])
    assert set(written) == {"ca.crt", "ca.key", "server.crt", "server.key",
                            "node0.key", "node0.pub", "node1.key", "node1.pub"}
    for key in ("ca.key", "server.key", "node0.key", "node1.key"):
        assert (folder / key).stat().st_mode & 0o077 == 0, key
    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((folder / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    assert sorted(make_certs.server_sans(folder)) == ["127.0.0.1", "edge.example", "localhost"]
    # the formats flower-supernode and `flwr supernode register` read
    assert load_ssh_private_key((folder / "node0.key").read_bytes(), None)
    assert (folder / "node0.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    # again: what exists is kept, the server certificate reissued for other names
    before = (folder / "node0.key").read_bytes()
    assert make_certs.make_certs(folder, nodes=3) == ["server.crt", "server.key", "node2.key", "node2.pub"]
    assert (folder / "node0.key").read_bytes() == before


def test_make_certs_refuses_a_folder_git_would_commit():
    folder = REPO / "examples" / "flower" / "certs-that-must-not-exist"
    with pytest.raises(SystemExit, match="not ignored by git"):
        make_certs.make_certs(folder, nodes=1)
    assert not folder.exists()


# -- real processes ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """A SuperLink with TLS and --enable-supernode-auth, and the SuperNodes started on it."""

    def __init__(self, root: Path, certs: Path):
        self.root, self.certs, self.port = root, certs, _free_port()
        self.procs: list[subprocess.Popen] = []
        home = root / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\nroot-certificates = "{certs / "ca.crt"}"\n')
        self.env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = self.root / f"{name}.log"
        with open(log, "wb") as out:
            # its own session, so that stopping it stops what it spawned (SuperExec)
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=self.root, start_new_session=True)
        self.procs.append(proc)
        return proc, log

    def start_superlink(self) -> Path:
        c = self.certs
        proc, log = self.start(
            "superlink", EXE["flower-superlink"], "--ssl-ca-certfile", str(c / "ca.crt"),
            "--ssl-certfile", str(c / "server.crt"), "--ssl-keyfile", str(c / "server.key"),
            "--enable-supernode-auth", "--disable-runtime-dependency-installation",
            "--port", str(self.port))
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return log
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the SuperLink did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)

    def start_supernode(self, name: str, *security: str) -> tuple[subprocess.Popen, Path]:
        # bounded retries: a node that is refused must end, not retry for ever
        return self.start(name, EXE["flower-supernode"], "--superlink", f"127.0.0.1:{self.port}",
                          "--port", str(_free_port()), "--max-retries", "2", "--max-wait-time", "10",
                          *security)

    def flwr(self, *args: str) -> dict:
        done = subprocess.run([EXE["flwr"], *args, "local", "--format", "json"], env=self.env,
                              capture_output=True, text=True, timeout=60, cwd=self.root)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout[done.stdout.index("{"):])

    def register(self, public_key: Path) -> int:
        return int(self.flwr("supernode", "register", str(public_key))["node-id"])

    def nodes(self) -> dict[int, str]:
        """Every node the SuperLink knows, with its status (registered, online, ...)."""
        return {int(n["node-id"]): n["status"] for n in self.flwr("supernode", "list")["nodes"]}

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("flower-tls")
    make_certs.make_certs(root / "certs", nodes=2)
    # an unrelated CA and a key pair the SuperLink was never told about
    make_certs.make_certs(root / "stranger", nodes=1)
    dep = Deployment(root, root / "certs")
    try:
        dep.superlink_log = dep.start_superlink()
        dep.node_ids = [dep.register(dep.certs / f"node{k}.pub") for k in range(2)]
        yield dep
    finally:
        dep.stop()


def _ended(proc: subprocess.Popen, log: Path, timeout: float = 30) -> str:
    """The log of a SuperNode that was expected to give up, once it has."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the SuperNode still runs after {timeout:g} s:\n{log.read_text()[-2000:]}")
    assert proc.returncode != 0
    return log.read_text()


@needs_flower
def test_a_registered_node_with_the_ca_connects(deployment):
    # the positive control: the refusals below are for the reasons they name
    certs = deployment.certs
    proc, log = deployment.start_supernode(
        "registered", "--root-certificates", str(certs / "ca.crt"),
        "--auth-supernode-private-key", str(certs / "node0.key"))
    node = deployment.node_ids[0]
    deadline = time.monotonic() + 30
    while deployment.nodes()[node] != "online":
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"node {node} never came online:\n{log.read_text()}"
        time.sleep(0.5)
    assert f"SuperNode ID: {node}" in log.read_text()
    assert f"Activated node_id={node}" in deployment.superlink_log.read_text()


@needs_flower
def test_a_node_whose_key_is_not_registered_is_refused(deployment):
    certs, stranger = deployment.certs, deployment.root / "stranger"
    ca = ("--root-certificates", str(certs / "ca.crt"))
    unregistered = deployment.start_supernode(
        "unregistered", *ca, "--auth-supernode-private-key", str(stranger / "node0.key"))
    keyless = deployment.start_supernode("keyless", *ca)  # asks to register itself
    assert "Failed to activate SuperNode" in _ended(*unregistered)
    assert "All SuperNodes must be registered" in _ended(*keyless)
    assert "No SuperNode found with the given public key" in deployment.superlink_log.read_text()
    # the SuperLink knows the registered nodes only: a ServerApp could never address these
    assert set(deployment.nodes()) == set(deployment.node_ids)


@needs_flower
def test_a_node_without_the_ca_fails_the_tls_handshake(deployment):
    certs, stranger = deployment.certs, deployment.root / "stranger"
    # a registered key, so that TLS is the only reason to refuse
    key = ("--auth-supernode-private-key", str(certs / "node1.key"))
    system_ca = deployment.start_supernode("system-ca", *key)
    other_ca = deployment.start_supernode("other-ca", *key,
                                          "--root-certificates", str(stranger / "ca.crt"))
    for proc, log in (system_ca, other_ca):
        assert "CERTIFICATE_VERIFY_FAILED" in _ended(proc, log)
    assert deployment.nodes()[deployment.node_ids[1]] == "registered"  # never online


# -- what a peer sends ------------------------------------------------------------------------
class _Canary:
    """Unpickling this creates a file: proof that a payload was executed."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def _object_array(canary: Path, dtype: str) -> Array:
    # what a hostile peer can put on the wire: a .npy holding a pickle, under any dtype label
    buffer = io.BytesIO()
    np.save(buffer, np.array([_Canary(canary), 1], dtype=object), allow_pickle=True)
    return Array(dtype=dtype, shape=(2,), stype="numpy.ndarray", data=buffer.getvalue())


@pytest.mark.parametrize("kind", ["object", "object labelled float32", "bytes", "str", "structured",
                                  "foreign stype"])
def test_records_that_are_not_plain_tensors_are_refused_unread(tmp_path, kind):
    canary = tmp_path / "executed"
    array = {
        "object": lambda: _object_array(canary, "object"),
        "object labelled float32": lambda: _object_array(canary, "float32"),
        "bytes": lambda: Array(np.array([b"\x80\x04", b"x"])),
        "str": lambda: Array(np.array(["__import__('os')"])),
        "structured": lambda: Array(np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f4")])),
        "foreign stype": lambda: Array(dtype="float32", shape=(1,), stype="torch.raw", data=bytes(4)),
    }[kind]()
    content = RecordDict({TENSORS: ArrayRecord({"w": array}), META: ConfigRecord({"round": 1})})
    with _server_identity():  # through Flower's wire format, as from a real peer
        wired = LocalGrid._wire(FlowerMessage(content, 7, "train", group_id="1")).content
    with pytest.raises(MessageError, match="tensor 'w' of a Flower message cannot be read"):
        from_content(wired)
    assert not canary.exists()


# modules that may read pickle: CIFAR's python batches from the local disk, through an
# unpickler that builds numpy arrays only (data/datasets.py, _NumpyOnlyUnpickler)
PICKLE_READERS = {"data/datasets.py"}
UNSAFE_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "jsonpickle"}


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_no_code_path_can_unpickle_or_execute_received_data():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""])
                if rel not in PICKLE_READERS and any(n.split(".")[0] in UNSAFE_MODULES for n in names):
                    found.append(f"{where} imports {names}")
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if func in ("eval", "exec", "compile", "__import__"):
                found.append(f"{where} calls {func}")
            if func.endswith("torch.load"):
                weights_only = _keyword(node, "weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where} torch.load without weights_only=True")
            allow = _keyword(node, "allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{where} {func}(allow_pickle=...)")
            if func in ("yaml.load", "yaml.unsafe_load"):
                found.append(f"{where} {func}")
    assert not found, "\n".join(found)
