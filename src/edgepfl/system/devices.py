"""Per-client compute: a speed in FLOP/s (local training time = counted FLOPs / speed), or,
under ``wen_table2``, a CPU frequency (local training time = epochs x cycles per bit x
data bits / frequency, the usual wireless-FL computation model)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgepfl.federation.rng import derive_seed
from edgepfl.federation.topology import assign_tiers
from edgepfl.system_config import SystemConfig


@dataclass
class Devices:
    flops_per_s: np.ndarray  # [N] sustained training speed of each client (NaN: cycles model)
    tier: list[str | None]  # tier name per client (None without tiers)
    cpu_hz: np.ndarray | None = None  # [N] CPU frequency f_k under wen_table2, else None


def draw_devices(cfg: SystemConfig, num_clients: int, seed: int) -> Devices:
    """Seeded device speeds, from a stream of their own (changing the channel settings
    does not change the devices, and vice versa)."""
    (cpu_lo, cpu_hi), (flops_lo, flops_hi) = cfg.cpu_ghz, cfg.device_flops
    if cfg.profile == "wen_table2":
        # the CPU frequency prices training; there is no FLOP/s figure
        cpu = np.array([np.random.default_rng(derive_seed(seed, "system", "cpu", cid))
                        .uniform(cpu_lo, cpu_hi) * 1e9 for cid in range(num_clients)])
        return Devices(np.full(num_clients, np.nan), [None] * num_clients, cpu)
    if cfg.devices == "tiers":
        # the federation's own assignment, so the tier that prices a client's compute is
        # the tier whose architecture it runs
        assigned = assign_tiers(cfg.tiers, num_clients, seed)
        return Devices(np.array([t.flops for t in assigned], dtype=np.float64),
                       [t.name for t in assigned])
    speeds = np.array([np.random.default_rng(derive_seed(seed, "system", "device", cid))
                       .uniform(flops_lo, flops_hi) for cid in range(num_clients)])
    return Devices(speeds, [None] * num_clients)
