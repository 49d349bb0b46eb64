"""Who registered each name, and what a plug-in data set's loader is given.

The registries themselves live with what they name (``algorithms.ALGORITHMS``,
``models.zoo.MODELS``, ``data.datasets.DATASETS``) and ``plugins`` fills them; this module
holds the little that those places ask back (whose a name is, the loader's argument), so
that none of them imports ``plugins`` and every import arrow points one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_origin: dict[tuple[str, str], str] = {}  # (kind, name) -> the plug-in that registered it


def origin(kind: str, name: str) -> str | None:
    """The plug-in that registered ``name`` (kind: algorithm, model, dataset), else None."""
    return _origin.get((kind, name))


@dataclass(frozen=True)
class DataSource:
    """What a plug-in data set's loader is given: the data directory (``dataset.root``,
    else ``$EDGEPFL_DATA``), ``dataset.path`` (None unless set) and the run seed."""

    root: Path
    path: str | None
    seed: int
