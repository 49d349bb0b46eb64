"""A client's samples as an index view into the one data-set tensor, and the test splits.

Peers re-wrap each client's data every round (a DataLoader per client); here a client's
data is a view of row indices, and its batches are gathered by index as they are drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from edgepfl.data.aspect import cut, shape_groups
from edgepfl.errors import ConfigError


@dataclass
class ClientData:
    """One client's samples: index view into the shared dataset tensors (no copy).

    With ``boxes`` (``dataset.aspect_ratios``: ``[n, 4]`` int16 top, left, height, width,
    aligned with ``idx``) a sample is its image's crop, cut when a batch is drawn. Samples
    then come in as many shapes as crop sizes and do not stack into one tensor: ``gather``
    refuses, ``buckets`` gives one ``(x, y)`` per shape, and every batch is of one shape.
    With ``norm`` (``x`` holds 8-bit pixels) every batch is normalised as it is cut, so
    a batch is the only float copy of the data there is.
    """

    x: torch.Tensor
    y: torch.Tensor
    idx: torch.Tensor
    boxes: torch.Tensor | None = None
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.boxes is not None and tuple(self.boxes.shape) != (self.n, 4):
            raise ValueError(f"boxes of shape {tuple(self.boxes.shape)} for {self.n} samples; "
                             f"expected ({self.n}, 4)")

    @property
    def n(self) -> int:
        return int(self.idx.numel())

    def work_shape(self) -> tuple:
        """What a client's local training cost depends on besides its messages: the sample
        count, the classes present (per-class work such as prototypes) and the number of
        samples per crop size (batch shapes). Clients alike in it cost the same FLOPs."""
        classes = tuple(torch.unique(self.y.index_select(0, self.idx)).tolist())
        if self.boxes is None:
            return self.n, classes
        sizes, counts = torch.unique(self.boxes[:, 2:].to(torch.int64), dim=0, return_counts=True)
        return self.n, classes, tuple(zip(map(tuple, sizes.tolist()), counts.tolist(), strict=True))

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.boxes is not None:
            raise ConfigError(
                "this client's images are crops of several sizes (dataset.aspect_ratios), "
                "which do not stack into one tensor, but the algorithm asked for all of its "
                "data as one; an algorithm for such data iterates ClientData.buckets() or "
                "batches(), or declares Algorithm(variable_size=False) to refuse them")
        return self.take(self.idx), self.y.index_select(0, self.idx)

    def take(self, idx: torch.Tensor) -> torch.Tensor:
        """Model inputs of data-set rows ``idx`` (whole images)."""
        x = self.x.index_select(0, idx)
        return x if self.norm is None else self.norm(x)

    def buckets(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every sample once, as one ``(x, y)`` per input shape in a fixed order (crop
        sizes sorted, samples in index order); whole images: ``gather()`` itself."""
        if self.boxes is None:
            yield self.gather()
            return
        for pos in shape_groups(self.boxes):
            yield self._cut(pos)

    def select(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Model inputs and labels of the client's samples at positions ``pos`` (into
        ``idx``); with crops they must all be of one size."""
        if self.boxes is None:
            idx = self.idx[pos]
            return self.take(idx), self.y.index_select(0, idx)
        if torch.unique(self.boxes[pos, 2:].to(torch.int64), dim=0).shape[0] > 1:
            raise ValueError("select(): the samples are crops of several sizes, which do not "
                             "stack into one batch")
        return self._cut(pos)

    def _cut(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.boxes is not None
        idx = self.idx[pos]
        x = cut(self.x, idx, self.boxes[pos])
        return x if self.norm is None else self.norm(x), self.y.index_select(0, idx)

    def order(self, gen: torch.Generator) -> torch.Tensor:
        """One epoch's shuffle of whole images, as data-set rows drawn with ``gen``:
        ``batches`` cuts it into consecutive runs of ``batch_size``."""
        return self.idx[torch.randperm(self.n, generator=gen)]

    def batches(self, batch_size: int, gen: torch.Generator):
        """One epoch of shuffled mini-batches drawn with ``gen``.

        Crops: the epoch's one shuffle is split by crop size (each size's samples keep their
        shuffled order), each size's run is cut into batches, and the batches' order is
        shuffled with ``gen`` too. Every sample comes once per epoch and every batch holds
        one shape, so nothing is padded or resized; a size's last batch may be short (one
        short batch per crop size and epoch, not one per epoch).
        """
        if self.boxes is None:
            order = self.order(gen)
            for start in range(0, self.n, batch_size):
                bidx = order[start:start + batch_size]
                yield self.take(bidx), self.y.index_select(0, bidx)
            return
        perm = torch.randperm(self.n, generator=gen)
        runs: list[torch.Tensor] = []
        for pos in shape_groups(self.boxes[perm]):
            runs += perm[pos].split(batch_size)
        for k in torch.randperm(len(runs), generator=gen).tolist():
            yield self._cut(runs[k])


TestData = tuple[torch.Tensor, torch.Tensor] | ClientData  # whole images: (x, y) gathered


def eval_parts(test: TestData) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A test split as ``(x, y)`` pieces of one input shape each."""
    return list(test.buckets()) if isinstance(test, ClientData) else [test]


def sample_count(test: TestData) -> int:
    return test.n if isinstance(test, ClientData) else int(test[1].numel())
