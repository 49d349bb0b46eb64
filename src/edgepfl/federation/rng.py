"""Derived seeds: one user seed, independent streams for every (round, client, purpose).

Deriving instead of carrying RNG state means a resumed run draws exactly what an
uninterrupted run would have drawn, and every algorithm in a comparison sees the same
client sequence, because sampling never consumes randomness an algorithm also uses.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, *parts: object) -> int:
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def generator(seed: int, *parts: object) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *parts))
    return g


def select_clients(seed: int, rnd: int, num_clients: int, participation: float) -> list[int]:
    """The clients of round ``rnd``: a seeded sample of round(participation * N), at least 1."""
    count = max(1, min(num_clients, round(participation * num_clients)))
    if count == num_clients:
        return list(range(num_clients))
    perm = torch.randperm(num_clients, generator=generator(seed, "sample", rnd))
    return sorted(perm[:count].tolist())
