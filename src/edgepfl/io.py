"""Atomic files: a run directory never holds a half-written file.

Everything is written to a temporary file in the same directory and renamed over the
target, so a crash (or Ctrl-C) leaves either the old or the new version, never a mix.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edgepfl.errors import EdgepflError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates its file 0600; the renamed file should be what open() would have made
_FILE_MODE = 0o666 & ~_umask()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
    """Tensors and their JSON metadata in one safetensors file: one atomic rename."""
    data = {k: v.detach().contiguous() for k, v in tensors.items()}
    blob = st_save(data, metadata={"edgepfl": json.dumps(_clean(meta))})
    write_bytes_atomic(path, blob)


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    try:
        blob = Path(path).read_bytes()
    except OSError as exc:
        raise EdgepflError(f"cannot read {path}: {exc}") from None
    try:
        tensors = st_load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + header_len])
        meta = json.loads(header.get("__metadata__", {}).get("edgepfl", "{}"))
    except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
        raise EdgepflError(f"{path} is not a valid edgepfl checkpoint: {exc}") from None
    return tensors, meta
