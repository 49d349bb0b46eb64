"""Wireless links: Shannon rates from drawn link parameters, transfer times from byte counts.

All quantities are SI inside this module (Hz, W, W/Hz, m, bit/s, s); the config speaks the
papers' units (MHz, dBm, dB) and is converted once here. Links are static for a run: the
small-scale fading gain is the constant of KAPC's Table 4, so a client's rate does not
change between rounds (docs/system.md lists what is and is not modelled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np

from edgepfl.federation.rng import derive_seed
from edgepfl.system_config import SystemConfig

# Watts per unit of the interference draws (Table 4 gives none; "noise" is handled apart
# because its scale depends on each link's bandwidth).
INTERFERENCE_UNIT_W = {"W": 1.0, "mW": 1e-3, "pW": 1e-12}


def dbm_to_watt(dbm: float | np.ndarray) -> float | np.ndarray:
    return 10.0 ** ((np.asarray(dbm, dtype=np.float64) - 30.0) / 10.0)


def db_to_ratio(db: float | np.ndarray) -> float | np.ndarray:
    return 10.0 ** (np.asarray(db, dtype=np.float64) / 10.0)


def channel_gain(distance_m: float | np.ndarray, path_loss_db: float, reference_distance_m: float,
                 exponent: float, fading_gain: float = 1.0) -> float | np.ndarray:
    """Power gain h = fading * g0 * (d / d0)^(-alpha) with g0 = 10^(path_loss_db / 10)."""
    d = np.asarray(distance_m, dtype=np.float64)
    return fading_gain * db_to_ratio(path_loss_db) * (d / reference_distance_m) ** (-exponent)


def shannon_rate(bandwidth_hz, power_w, gain, interference_w, noise_w_per_hz):
    """r = B log2(1 + p h / (I + B N0)), bit/s (element-wise on arrays)."""
    b = np.asarray(bandwidth_hz, dtype=np.float64)
    noise = np.asarray(interference_w) + b * noise_w_per_hz
    sinr = np.asarray(power_w) * np.asarray(gain) / noise
    return b * np.log2(1.0 + sinr)


def transfer_time(nbytes: int, rate_bps: float) -> float:
    """Seconds to move ``nbytes`` at ``rate_bps``; nothing to send takes no time."""
    if nbytes < 0:
        raise ValueError(f"byte count {nbytes} is negative")
    if nbytes == 0:
        return 0.0
    return 8.0 * nbytes / rate_bps if rate_bps > 0 else math.inf


@dataclass
class Links:
    """Per-client link parameters (arrays of length N) and the resulting rates.

    ``downlink_bps`` is the rate with the whole server band and power; under FDMA sharing
    the round's rates come from ``downlink_rates``.
    """

    uplink_bps: np.ndarray
    downlink_bps: np.ndarray
    params: dict[str, np.ndarray]
    server_bandwidth_hz: float = 0.0
    server_power_w: float = 0.0
    noise_w_per_hz: float = 0.0
    interference_unit_w: float | None = None  # None: multiples of the link's noise B*N0

    def downlink_rates(self, receivers: list[int], sharing: str) -> dict[int, float]:
        """Rate of each receiver when the server serves ``receivers`` at once."""
        if sharing == "full" or not receivers or "down_interference" not in self.params:
            return {cid: float(self.downlink_bps[cid]) for cid in receivers}
        k = len(receivers)
        b = self.server_bandwidth_hz / k
        p = self.server_power_w / k
        idx = np.asarray(receivers)
        interference = self.interference_w(self.params["down_interference"][idx], b)
        rates = shannon_rate(b, p, self.params["gain"][idx], interference, self.noise_w_per_hz)
        return {cid: float(r) for cid, r in zip(receivers, rates, strict=True)}

    def interference_w(self, draws: np.ndarray, bandwidth_hz) -> np.ndarray:
        """Interference power of draws received over ``bandwidth_hz``, W."""
        if self.interference_unit_w is None:
            return draws * bandwidth_hz * self.noise_w_per_hz
        return draws * self.interference_unit_w


def draw_links(cfg: SystemConfig, num_clients: int, seed: int) -> Links:
    """Seeded links; client ``cid`` draws from its own stream, so adding clients to a
    federation does not change the links of the clients already in it."""
    if cfg.profile == "fixed_rate":
        up = np.full(num_clients, cfg.rate_mbps * 1e6)
        down = np.full(num_clients, (cfg.down_rate_mbps or cfg.rate_mbps) * 1e6)
        return Links(up, down, {})
    n0 = float(dbm_to_watt(cfg.noise_dbm_per_hz))
    draws = np.empty((num_clients, 5))
    for cid in range(num_clients):
        rng = np.random.default_rng(derive_seed(seed, "system", "link", cid))
        (bw_lo, bw_hi), (p_lo, p_hi) = cfg.client_bandwidth_mhz, cfg.client_power_dbm
        d_lo, d_hi = cfg.distance_m
        draws[cid] = [rng.uniform(bw_lo, bw_hi), rng.uniform(p_lo, p_hi), rng.uniform(d_lo, d_hi),
                      rng.normal(cfg.up_interference_mean, cfg.up_interference_std),
                      rng.normal(cfg.down_interference_mean, cfg.down_interference_std)]
    bandwidth = draws[:, 0] * 1e6
    power = dbm_to_watt(draws[:, 1])
    # distances in, an array of gains out
    gain = cast(np.ndarray, channel_gain(draws[:, 2], cfg.path_loss_db, cfg.reference_distance_m,
                                         cfg.path_loss_exponent, cfg.fading_gain))
    # A Gaussian draw can be negative; an interference power cannot: clip at zero.
    up_i, down_i = np.clip(draws[:, 3], 0, None), np.clip(draws[:, 4], 0, None)
    unit = None if cfg.interference_unit == "noise" else INTERFERENCE_UNIT_W[cfg.interference_unit]
    params = {"bandwidth_hz": bandwidth, "power_dbm": draws[:, 1], "distance_m": draws[:, 2],
              "gain": gain, "up_interference": up_i, "down_interference": down_i}
    links = Links(np.empty(0), np.empty(0), params, cfg.server_bandwidth_mhz * 1e6,
                  float(dbm_to_watt(cfg.server_power_dbm)), n0, unit)
    links.uplink_bps = shannon_rate(bandwidth, power, gain,
                                    links.interference_w(up_i, bandwidth), n0)
    links.downlink_bps = shannon_rate(links.server_bandwidth_hz, links.server_power_w, gain,
                                      links.interference_w(down_i, links.server_bandwidth_hz), n0)
    return links
