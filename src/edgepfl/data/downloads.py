"""Fetching the built-in data sets' distribution files, verified and written atomically.

A loader reads whatever file sits at its path, so nothing may ever land there half
written or unverified: a download is checked against the md5 its set publishes before
it is renamed into place, and an archive yields only regular files under the one folder
the loader reads, each written beside its destination and renamed into place. An
interrupted run therefore leaves either the old state or the complete new file, never
something a later run would take for data.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import tarfile
import tempfile
import urllib.request
import zlib
from pathlib import Path, PurePosixPath

from edgepfl.errors import DataError

DOWNLOAD_TIMEOUT_S = 10.0


def download(url: str, dest: Path, md5: str, timeout: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Fetch ``url`` into ``dest`` if its md5 matches; raise DataError otherwise.

    Written to a temporary file beside ``dest`` and renamed into place, so an interrupted
    or corrupt download never leaves a half file that a later run would try to read.
    """
    tmp: str | None = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        digest = hashlib.md5(usedforsecurity=False)
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != md5:
            raise DataError(
                f"download of {url} has md5 {digest.hexdigest()}, expected {md5}; discarded"
            )
        os.replace(tmp, dest)
        tmp = None
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise DataError(f"could not download {url}: {exc}") from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def extract_tarball(archive: Path, root: Path, folder: str) -> None:
    """Extract the regular files under ``folder/`` only, each written atomically."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                # Refuse anything that could land outside root (absolute, '..', links).
                if not member.isfile() or not parts or parts[0] != folder or ".." in parts:
                    continue
                dest = root.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                if source is None:
                    continue
                fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
                try:
                    with os.fdopen(fd, "wb") as out:
                        while chunk := source.read(1 << 20):
                            out.write(chunk)
                    os.replace(tmp, dest)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
    except (OSError, tarfile.TarError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot extract {archive}: {exc}") from exc


def md5_matches(path: Path, md5: str) -> bool:
    digest = hashlib.md5(usedforsecurity=False)
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    return digest.hexdigest() == md5
