"""Per-client compute speed (FLOP/s): local training time = counted FLOPs / speed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgepfl.federation.rng import derive_seed
from edgepfl.system.config import DeviceTier, SystemConfig


@dataclass
class Devices:
    flops_per_s: np.ndarray  # [N] sustained training speed of each client
    tier: list[str | None]  # tier name per client (None without tiers)


def tier_counts(tiers: list[DeviceTier], num_clients: int) -> list[int]:
    """Clients per tier: shares times N, rounded by largest remainder so they add up to N.

    Exact counts rather than independent draws, so a 3:4:3 split of 10 clients is 3, 4, 3
    and not whatever a small sample happens to give.
    """
    raw = np.array([t.share for t in tiers]) * num_clients
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts), kind="stable")[: num_clients - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


def draw_devices(cfg: SystemConfig, num_clients: int, seed: int) -> Devices:
    """Seeded device speeds, from a stream of their own (changing the channel settings
    does not change the devices, and vice versa)."""
    if cfg.devices == "tiers":
        labels = [t for t, c in zip(cfg.tiers, tier_counts(cfg.tiers, num_clients), strict=True)
                  for _ in range(c)]
        order = np.random.default_rng(derive_seed(seed, "system", "tiers")).permutation(num_clients)
        assigned = [labels[i] for i in np.argsort(order)]
        return Devices(np.array([t.flops for t in assigned], dtype=np.float64),
                       [t.name for t in assigned])
    speeds = np.array([np.random.default_rng(derive_seed(seed, "system", "device", cid))
                       .uniform(*cfg.device_flops) for cid in range(num_clients)])
    return Devices(speeds, [None] * num_clients)
