"""Per-client compute speed (FLOP/s): local training time = counted FLOPs / speed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgepfl.federation.rng import derive_seed
from edgepfl.federation.topology import assign_tiers
from edgepfl.system_config import SystemConfig


@dataclass
class Devices:
    flops_per_s: np.ndarray  # [N] sustained training speed of each client
    tier: list[str | None]  # tier name per client (None without tiers)


def draw_devices(cfg: SystemConfig, num_clients: int, seed: int) -> Devices:
    """Seeded device speeds, from a stream of their own (changing the channel settings
    does not change the devices, and vice versa)."""
    if cfg.devices == "tiers":
        # the federation's own assignment, so the tier that prices a client's compute is
        # the tier whose architecture it runs
        assigned = assign_tiers(cfg.tiers, num_clients, seed)
        return Devices(np.array([t.flops for t in assigned], dtype=np.float64),
                       [t.name for t in assigned])
    speeds = np.array([np.random.default_rng(derive_seed(seed, "system", "device", cid))
                       .uniform(*cfg.device_flops) for cid in range(num_clients)])
    return Devices(speeds, [None] * num_clients)
