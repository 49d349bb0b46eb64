"""Atomic files: a run directory never holds a half-written file.

Everything is written to a temporary file in the same directory and renamed over the
target, so a crash (or Ctrl-C) leaves either the old or the new version, never a mix.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from edgepfl.errors import EdgepflError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates its file 0600; the renamed file should be what open() would have made
_FILE_MODE = 0o666 & ~_umask()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data))


def _clean(value):
    """JSON has no NaN/inf: write them as null rather than as invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(_clean(obj), indent=2) + "\n").encode())


def write_json_exclusive(path: Path, obj) -> bool:
    """``write_json`` that creates ``path`` only if it does not exist (whole, as an atomic
    write does: a temporary file linked to its name); False, writing nothing, if it
    exists."""
    path = Path(path)
    data = (json.dumps(_clean(obj), indent=2) + "\n").encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if path exists, whoever made it
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return True
    finally:
        Path(tmp).unlink(missing_ok=True)


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise EdgepflError(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:  # ValueError: undecodable bytes, bad JSON
        raise EdgepflError(f"{path} is not readable JSON: {exc}") from None


def write_csv(path: Path, columns: list[str], rows: Iterable[Mapping]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _fmt(row.get(k)) for k in columns})
    write_bytes_atomic(path, buf.getvalue().encode())


def _fmt(value) -> str:
    if isinstance(value, float | np.floating):
        value = float(value)
        if math.isnan(value):
            return ""
        # the shortest text that reads back as the same float: a figure recomputed from
        # metrics.csv (a best round, a paired difference) equals the run's own
        return repr(value)
    if value is None:
        return ""
    return str(value)


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


# a file's hash and the tensors that held NaN or Inf when it was written, in its header
HASH_KEY, NONFINITE_KEY = "edgepfl_sha256", "edgepfl_nonfinite"
_PLACEHOLDER = "0" * 64


def _hash_slot(head: bytes, digest: str) -> int:
    """Where in a header the hex digest of ``HASH_KEY`` starts (-1: not there). A JSON
    string value cannot hold this byte sequence (its quotes would be escaped)."""
    key = f'"{HASH_KEY}":"'.encode()
    at = head.find(key + digest.encode() + b'"')
    return -1 if at < 0 else at + len(key)


def _nonfinite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Whether a floating tensor holds NaN or Inf (read in chunks: no second copy)."""
    if not t.is_floating_point() or not t.numel():
        return False
    flat = t.detach().reshape(-1)
    return any(not bool(torch.isfinite(flat[i:i + chunk]).all())
               for i in range(0, flat.numel(), chunk))


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
    """Tensors and their JSON metadata in one safetensors file, atomically. The file is
    streamed one tensor at a time, so writing a checkpoint needs no second copy of the
    state in memory (a federation's whole state can be most of the machine's memory).

    Its header also holds the SHA-256 of the whole file (taken with the digest's own
    place zeroed) and the names of the tensors that hold NaN or Inf, so that
    ``read_tensors`` refuses a file changed since (a flipped bit, a value written in)."""
    order = sorted(tensors)
    nonfinite = [name for name in order if _nonfinite(tensors[name])]
    header: dict = {"__metadata__": {"edgepfl": json.dumps(_clean(meta)),
                                     NONFINITE_KEY: json.dumps(nonfinite),
                                     HASH_KEY: _PLACEHOLDER}}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise EdgepflError(f"tensor {name!r} has dtype {t.dtype}, which a checkpoint cannot hold")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    slot = _hash_slot(head, _PLACEHOLDER)

    def write(f) -> None:
        digest = hashlib.sha256()

        def put(data) -> None:
            f.write(data)
            digest.update(data)

        put(len(head).to_bytes(8, "little"))
        put(head)
        for name in order:
            t = tensors[name].detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            if t.numel():
                put(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.seek(8 + slot)
        f.write(digest.hexdigest().encode())
        f.seek(0, os.SEEK_END)

    write_atomic(path, write)


def write_atomic(path: Path, write) -> None:
    """``write(f)`` into a temporary file beside ``path``, synced, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A file of ``write_tensors``: its tensors (read through a memory map, without a
    second copy of the file in memory) and its JSON metadata. A file whose bytes do not
    match the hash written with them, or a tensor that holds NaN or Inf it did not hold
    when written, is refused naming the file. A file written before files carried a hash
    is read unverified, with a warning."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            meta = json.loads(header.get("edgepfl", "{}"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except OSError as exc:
        raise EdgepflError(f"cannot read {path}: {exc}") from None
    except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
        raise EdgepflError(f"{path} is not a valid edgepfl checkpoint: {exc}") from None
    if HASH_KEY not in header:
        # written before files carried a hash (or by another tool): read, but unverified,
        # and none of its tensors may hold NaN or Inf, since nothing tells which did
        logging.getLogger("edgepfl").warning(
            "%s carries no hash of its contents (written before edgepfl checked them, or "
            "by another program): it is read unverified", path)
        allowed: set = set()
    else:
        _check_hash(Path(path), header[HASH_KEY])
        try:
            allowed = set(json.loads(header.get(NONFINITE_KEY, "[]")))
        except (ValueError, TypeError):
            raise EdgepflError(f"{path} is not a valid edgepfl checkpoint: its list of "
                               "non-finite tensors is malformed") from None
    for name, t in tensors.items():
        if name not in allowed and _nonfinite(t):
            raise EdgepflError(
                f"{path} is damaged: its tensor {name!r} holds NaN or Inf values, which it "
                + ("did not when the file was written" if HASH_KEY in header else
                   "carries no hash to tell from damage (a file written before edgepfl "
                   "hashed them)")
                + "; it is not loaded (go on from a copy of the run, or start a new run)")
    return tensors, meta


def _check_hash(path: Path, stored: object, chunk: int = 1 << 24) -> None:
    """Refuse ``path`` unless its SHA-256, its digest's place zeroed, is ``stored``."""
    damaged = (f"{path} is damaged: its contents do not match the SHA-256 written with them "
               "(a changed byte, a flipped bit); it is not loaded (go on from a copy of the "
               "run, or start a new run)")
    if not isinstance(stored, str) or len(stored) != 64 or \
            any(c not in "0123456789abcdef" for c in stored):
        raise EdgepflError(damaged)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            size = f.read(8)
            head = f.read(int.from_bytes(size, "little"))
            slot = _hash_slot(head, stored)
            if slot < 0:
                raise EdgepflError(damaged)
            digest.update(size)
            digest.update(head[:slot] + _PLACEHOLDER.encode() + head[slot + 64:])
            while block := f.read(chunk):
                digest.update(block)
    except OSError as exc:
        raise EdgepflError(f"cannot read {path}: {exc}") from None
    if digest.hexdigest() != stored:
        raise EdgepflError(damaged)
