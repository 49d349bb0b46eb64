#!/usr/bin/env python3
"""The key material of a Flower deployment with TLS and SuperNode authentication.

    python examples/flower/make_certs.py [FOLDER] [--nodes N] [--san 127.0.0.1 --san host]

writes into FOLDER (default runs/flower-certs):

* ``ca.crt``, ``ca.key``: a private certificate authority; SuperNodes and the ``flwr`` CLI
  trust the SuperLink through ``ca.crt`` (``--root-certificates``, ``root-certificates``);
* ``server.crt``, ``server.key``: the SuperLink's TLS certificate, signed by the CA, for the
  names in ``--san`` (default 127.0.0.1 and localhost): ``--ssl-certfile``,
  ``--ssl-keyfile``, ``--ssl-ca-certfile``;
* ``node<K>.key``, ``node<K>.pub`` for K = 0..N-1: a SuperNode's authentication key pair,
  EC P-384 in OpenSSH format (what ``flower-supernode --auth-supernode-private-key`` and
  ``flwr supernode register`` read); ``--enable-supernode-auth`` admits only the nodes
  whose ``.pub`` was registered.

What exists is kept and only what is missing is made, so the command can run before every
deployment; a server certificate whose names differ from ``--san`` is reissued, ``--force``
remakes everything. Private keys are written unencrypted and readable by the owner only.
A folder inside this repository is refused unless git ignores it: keys must never be
committed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SANS = ["127.0.0.1", "localhost"]
# Flower's guide uses P-384 for node keys; any NIST curve passes `flwr supernode register`
CURVE = ec.SECP384R1()
DAYS = 365


def _repository(folder: Path) -> Path | None:
    """The git work tree that holds ``folder`` (made or not yet), None if none does; the
    script may have been copied anywhere, so it asks git rather than guessing. Without
    git: this checkout, if the folder is in it."""
    start = folder.resolve()
    while not start.exists():
        start = start.parent
    try:
        done = subprocess.run(["git", "-C", str(start), "rev-parse", "--show-toplevel"],
                              capture_output=True, text=True)
    except OSError:  # no git
        return REPO if start.is_relative_to(REPO) else None
    return Path(done.stdout.strip()).resolve() if done.returncode == 0 else None


def _check_folder(folder: Path) -> None:
    repo = _repository(folder)
    if repo is None:  # not in a repository: nothing there can be committed
        return
    probe = folder.resolve() / "ca.key"
    try:
        code = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", str(probe)],
                              capture_output=True).returncode
    except OSError:  # no git: only the folder that .gitignore names is known to be safe
        code = 0 if probe.relative_to(repo).parts[:1] == ("runs",) else 1
    if code == 0:
        return
    if code == 1:
        sys.exit(f"make_certs: {folder} is inside the repository {repo} and not ignored by "
                 "git; keys must never be committed (use runs/..., or a folder outside)")
    sys.exit(f"make_certs: git could not tell whether {folder} is ignored in {repo} (git "
             f"check-ignore exit {code}); keys must never be committed: choose a folder "
             "outside the repository, or one its .gitignore names")


def _write(path: Path, data: bytes, private: bool) -> None:
    # a private key must never exist, even briefly, with wider permissions
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=DAYS))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def make_ca(folder: Path) -> None:
    key = ec.generate_private_key(CURVE)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgepfl Flower CA")])
    cert = (_builder("edgepfl Flower CA", name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA384()))
    _write(folder / "ca.key", _pem_key(key), private=True)
    _write(folder / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)


def make_server(folder: Path, sans: list[str]) -> None:
    ca_key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    key = ec.generate_private_key(CURVE)
    cert = (_builder(sans[0], ca.subject, key.public_key())
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(_san(sans), critical=False)
            .sign(ca_key, hashes.SHA384()))
    _write(folder / "server.key", _pem_key(key), private=True)
    _write(folder / "server.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)


def server_sans(folder: Path) -> list[str] | None:
    """The names the existing server certificate is valid for (None: no certificate)."""
    path = folder / "server.crt"
    if not path.exists() or not (folder / "server.key").exists():
        return None
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in san.get_values_for_type(x509.IPAddress)] + \
        san.get_values_for_type(x509.DNSName)


def make_node(folder: Path, k: int) -> None:
    key = ec.generate_private_key(CURVE)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    _write(folder / f"node{k}.key", private, private=True)
    _write(folder / f"node{k}.pub", public + f" edgepfl-node{k}\n".encode(), private=False)


def make_certs(folder: Path, nodes: int, sans: list[str] | None = None,
               force: bool = False) -> list[str]:
    """Make what is missing in ``folder``; returns the names of the files written."""
    sans = list(dict.fromkeys(sans or DEFAULT_SANS))
    _check_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    written = []
    new_ca = force or not ((folder / "ca.key").exists() and (folder / "ca.crt").exists())
    if new_ca:
        make_ca(folder)
        written += ["ca.crt", "ca.key"]
    current = server_sans(folder)
    if new_ca or current is None or sorted(current) != sorted(sans):
        make_server(folder, sans)
        written += ["server.crt", "server.key"]
    for k in range(nodes):
        if force or not ((folder / f"node{k}.key").exists() and (folder / f"node{k}.pub").exists()):
            make_node(folder, k)
            written += [f"node{k}.key", f"node{k}.pub"]
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default="runs/flower-certs", type=Path)
    parser.add_argument("--nodes", type=int, default=2, help="SuperNode key pairs (default 2)")
    parser.add_argument("--san", action="append", metavar="NAME",
                        help="an IP address or DNS name of the SuperLink, repeatable "
                             f"(default {' and '.join(DEFAULT_SANS)})")
    parser.add_argument("--force", action="store_true", help="remake everything")
    args = parser.parse_args(argv)
    if args.nodes < 0:
        parser.error("--nodes must be >= 0")
    written = make_certs(args.folder, args.nodes, args.san, args.force)
    print(f"make_certs: {args.folder}: " + (", ".join(written) if written else "nothing missing"))


if __name__ == "__main__":
    main()
