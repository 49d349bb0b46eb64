"""Simulated seconds of a synchronous round from real byte counts and counted FLOPs.

Per selected client k: download d_k = 8 * bytes_down_k / r_down_k, local compute
c_k = flops_k / speed_k (under ``wen_table2``: c_k = epochs * cycles_per_bit * data_bits
/ f_k, whatever the FLOPs), upload u_k = 8 * bytes_up_k / r_up_k; server time
s = flops_server / server_speed. The round's figures (``round_timing``):

* ``phase`` (default, KAPC Table 5): every phase is a barrier, so each lasts as long as
  its slowest client: t_down = max d_k, t_compute = max c_k, t_up = max u_k, and
  t_round = t_down + t_compute + t_up + t_server. Table 5's four columns add up to its
  round time in exactly this way.
* ``chain``: no barriers; a client trains as soon as its download ends and uploads as
  soon as it has trained. The round lasts max_k (d_k + c_k + u_k) + t_server and the
  phase columns are the critical (slowest) client's, so they still add up to t_round.

``chain`` never exceeds ``phase``; both are decided by the slowest selected client.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgepfl.errors import ConfigError
from edgepfl.system.channel import Links, draw_links, transfer_time
from edgepfl.system.devices import Devices, draw_devices
from edgepfl.system_config import SystemConfig

# Per-round columns for metrics.csv, and the summary totals derived from them. A star's
# rounds have no backhaul and no edge compute: those two are 0 there.
COST_COLUMNS = ["t_down", "t_compute", "t_up", "t_server", "t_round", "flops_client",
                "flops_server", "t_backhaul", "t_edge", "t_wait"]
TOTAL_KEYS = {c: f"{c}_total" for c in COST_COLUMNS}


@dataclass
class EdgeStep:
    """One edge aggregation of one edge: its selected clients' bytes and FLOPs, and the
    FLOPs the edge spent configuring and aggregating."""

    selected: list[int]
    bytes_down: dict[int, int]
    bytes_up: dict[int, int]
    flops_client: dict[int, int] | None
    flops_edge: int | None
    slowdown: dict[int, float] = field(default_factory=dict)  # injected stragglers
    late: frozenset[int] = frozenset()  # missed the deadline: their replies were not taken
    deadline: float | None = None


class SystemModel:
    """Per-client links and device speeds of one federation, fixed by (config, N, seed)."""

    def __init__(self, cfg: SystemConfig, links: Links, devices: Devices,
                 epochs: int | None = None):
        self.cfg = cfg
        self.links = links
        self.devices = devices
        self.num_clients = len(devices.flops_per_s)
        self.epochs = epochs
        # wen_table2: each client's seconds of local training per (edge) round, fixed
        self.compute_s: np.ndarray | None = None
        if devices.cpu_hz is not None:
            if epochs is None or epochs < 1:
                raise ConfigError(
                    f"system.profile = {cfg.profile!r} prices local training as local epochs x "
                    "cycles_per_bit x data bits / CPU frequency and needs the number of local "
                    f"epochs (got {epochs!r}): build it with SystemModel.build(cfg.system, n, "
                    "cfg.seed, epochs=cfg.train.local_epochs)")
            self.compute_s = epochs * cfg.cycles_per_bit * self.data_bits / devices.cpu_hz

    @classmethod
    def build(cls, cfg: SystemConfig, num_clients: int, seed: int, *,
              epochs: int | None = None) -> SystemModel:
        """Draw every client's link and device. ``epochs`` (``train.local_epochs``) is
        needed by ``wen_table2`` only, whose compute time counts local epochs; the FLOP
        profiles ignore it, since counted FLOPs already include every epoch."""
        if num_clients < 1:
            raise ConfigError(f"the system model needs at least 1 client, got {num_clients}")
        return cls(cfg, draw_links(cfg, num_clients, seed), draw_devices(cfg, num_clients, seed),
                   epochs)

    @property
    def data_bits(self) -> float:
        """wen_table2: bits of training data per client, D (``data_mb``, MB = 10^6 bytes)."""
        return 8e6 * self.cfg.data_mb

    # -- per-client figures --------------------------------------------------------------
    @property
    def uplink_bps(self) -> np.ndarray:
        return self.links.uplink_bps

    @property
    def downlink_bps(self) -> np.ndarray:
        """Downlink rate with the whole server band (FDMA rounds split it: see below)."""
        return self.links.downlink_bps

    @property
    def flops_per_s(self) -> np.ndarray:
        return self.devices.flops_per_s

    def downlink_rates(self, receivers: list[int]) -> dict[int, float]:
        """Rates of a round's receivers under ``downlink_sharing`` (fdma: B/K, P/K each)."""
        return self.links.downlink_rates(receivers, self.cfg.downlink_sharing)

    def client_times(self, selected: list[int], bytes_down: Mapping[int, int],
                     bytes_up: Mapping[int, int],
                     flops_client: Mapping[int, int] | None,
                     slowdown: Mapping[int, float] | None = None,
                     ) -> dict[int, tuple[float, float, float]]:
        """(download, compute, upload) seconds per selected client; compute is NaN when
        FLOPs were not counted, except under wen_table2, whose compute does not come from
        FLOPs. A client absent from a byte mapping sent nothing. ``slowdown`` multiplies a
        client's compute time (an injected straggler)."""
        for cid in selected:
            if not 0 <= cid < self.num_clients:
                raise ValueError(f"client {cid} is outside the federation of {self.num_clients}")
        receivers = [cid for cid in selected if bytes_down.get(cid, 0) > 0]
        down_rates = self.downlink_rates(receivers)
        out = {}
        for cid in selected:
            d = transfer_time(int(bytes_down.get(cid, 0)), down_rates.get(cid, math.inf))
            u = transfer_time(int(bytes_up.get(cid, 0)), float(self.uplink_bps[cid]))
            if self.compute_s is not None:
                c = float(self.compute_s[cid])
            else:
                c = (math.nan if flops_client is None
                     else int(flops_client.get(cid, 0)) / float(self.flops_per_s[cid]))
            out[cid] = (d, c * (slowdown or {}).get(cid, 1.0), u)
        return out

    # -- one round -----------------------------------------------------------------------
    def round_costs(self, selected: list[int], bytes_down: Mapping[int, int],
                    bytes_up: Mapping[int, int], flops_client: Mapping[int, int] | None,
                    flops_server: int | None, slowdown: Mapping[int, float] | None = None,
                    late: frozenset[int] = frozenset(),
                    deadline: float | None = None) -> dict[str, float]:
        """The round's ``COST_COLUMNS``: seconds per phase, the round, and FLOPs.

        ``flops_client``/``flops_server`` None (counting off) make the compute and server
        times, and hence ``t_round``, NaN: a round time without its compute is not one.
        The phases are those of the clients whose replies were taken; with ``late`` ones the
        server waited until ``deadline`` (``t_wait``) before it stopped listening. Their
        FLOPs still count: the devices spent them.
        """
        on_time = [c for c in selected if c not in late]
        # the late clients received their model too: under fdma they shared the band
        times = {c: t for c, t in self.client_times(selected, bytes_down, bytes_up,
                                                       flops_client, slowdown).items()
                 if c not in late}
        t_server = math.nan if flops_server is None else flops_server / self.cfg.server_flops
        if not times:
            t_down = t_compute = t_up = 0.0
        elif self.cfg.round_timing == "phase":
            t_down, t_compute, t_up = phase_times(times.values())
        else:
            def chain(cid: int) -> float:
                d, c, u = times[cid]
                return d + u + (0.0 if math.isnan(c) else c)

            critical = max(sorted(on_time), key=chain)  # ties: the lowest id
            t_down, t_compute, t_up = times[critical]
        t_wait = 0.0
        if late and deadline is not None:
            t_wait = max(0.0, deadline - (t_down + t_compute + t_up))
        return {
            "t_down": t_down, "t_compute": t_compute, "t_up": t_up, "t_server": t_server,
            "t_round": t_down + t_compute + t_up + t_wait + t_server, "t_wait": t_wait,
            "flops_client": (math.nan if flops_client is None
                             else float(sum(int(flops_client.get(c, 0)) for c in selected))),
            "flops_server": math.nan if flops_server is None else float(flops_server),
            "t_backhaul": 0.0, "t_edge": 0.0,
        }

    def hierarchical_costs(self, steps: Mapping[int, list[EdgeStep]],
                           backhaul_down: Mapping[int, int], backhaul_up: Mapping[int, int],
                           flops_server: int | None) -> dict[str, float]:
        """A cloud round of a client -> edge -> cloud hierarchy.

        Edges work in parallel; edge k's round is its backhaul download, then its k2 edge
        rounds one after another (each priced like a star round of its own clients, with
        the edge's configure/aggregate FLOPs at ``edge_flops`` as its server time), then
        its backhaul upload, all over ``backhaul_mbps``. The cloud round waits for the
        slowest edge (the critical one, whose phases the columns report, so they add up
        to ``t_round``) and then aggregates (``t_server``)."""
        rate = self.cfg.backhaul_mbps * 1e6
        per_edge = {}
        for k, edge_steps in steps.items():
            parts = {"t_down": 0.0, "t_compute": 0.0, "t_up": 0.0, "t_edge": 0.0, "t_wait": 0.0,
                     "t_backhaul": (transfer_time(int(backhaul_down.get(k, 0)), rate)
                                    + transfer_time(int(backhaul_up.get(k, 0)), rate))}
            for st in edge_steps:
                c = self.round_costs(st.selected, st.bytes_down, st.bytes_up, st.flops_client,
                                     None if st.flops_edge is None else 0, st.slowdown,
                                     st.late, st.deadline)
                parts["t_down"] += c["t_down"]
                parts["t_wait"] += c["t_wait"]
                parts["t_compute"] += c["t_compute"]
                parts["t_up"] += c["t_up"]
                parts["t_edge"] += (math.nan if st.flops_edge is None
                                    else st.flops_edge / self.cfg.edge_flops)
            per_edge[k] = parts
        t_server = math.nan if flops_server is None else flops_server / self.cfg.server_flops

        def total(k: int) -> float:
            e = per_edge[k]
            return (e["t_backhaul"] + e["t_down"] + e["t_compute"] + e["t_up"] + e["t_wait"]
                    + e["t_edge"])

        critical = max(sorted(per_edge), key=lambda k: (math.inf if math.isnan(total(k))
                                                         else total(k)))
        e = per_edge[critical]
        counted = [st for edge_steps in steps.values() for st in edge_steps]
        client_flops = [(st.flops_client, st.selected) for st in counted
                        if st.flops_client is not None]
        edge_flops = [st.flops_edge for st in counted if st.flops_edge is not None]
        return {
            "t_down": e["t_down"], "t_compute": e["t_compute"], "t_up": e["t_up"],
            "t_server": t_server, "t_round": total(critical) + t_server,
            "flops_client": (math.nan if len(client_flops) < len(counted) else float(sum(
                int(flops.get(c, 0)) for flops, selected in client_flops for c in selected))),
            "flops_server": (math.nan if flops_server is None or len(edge_flops) < len(counted)
                             else float(flops_server + sum(edge_flops))),
            "t_backhaul": e["t_backhaul"], "t_edge": e["t_edge"], "t_wait": e["t_wait"],
        }

    # -- run files -----------------------------------------------------------------------
    def describe(self) -> dict:
        """JSON-able profile of every client, for the run directory's ``system.json``."""
        cfg = self.cfg
        units = {"bandwidth_hz": "Hz", "power_dbm": "dBm", "distance_m": "m",
                 "gain": "linear power gain", "up_interference": _unit(cfg),
                 "down_interference": _unit(cfg), "uplink_bps": "bit/s",
                 "downlink_bps": "bit/s with the whole server band (fdma rounds split it)",
                 "flops_per_s": "FLOP/s", "cpu_hz": "Hz",
                 "compute_s": "s of local training per round: epochs x cycles_per_bit x "
                              "data_bits / cpu_hz"}
        clients = []
        for cid in range(self.num_clients):
            row: dict = {"client": cid}
            for name, values in self.links.params.items():
                row[name] = float(values[cid])
            row["uplink_bps"] = float(self.uplink_bps[cid])
            row["downlink_bps"] = float(self.downlink_bps[cid])
            cpu_hz = self.devices.cpu_hz  # set where compute_s is
            if self.compute_s is not None and cpu_hz is not None:
                row["cpu_hz"] = float(cpu_hz[cid])
                row["compute_s"] = float(self.compute_s[cid])
            else:
                row["flops_per_s"] = float(self.flops_per_s[cid])
            if self.devices.tier[cid] is not None:
                row["tier"] = self.devices.tier[cid]
            clients.append(row)
        out: dict[str, Any] = {
            "profile": cfg.profile, "round_timing": cfg.round_timing,
            "devices": "cpu_cycles" if self.compute_s is not None else cfg.devices,
            "server_flops_per_s": cfg.server_flops,
            "units": {k: v for k, v in units.items() if k in clients[0]},
            "clients": clients,
        }
        if self.compute_s is not None:
            out.update(epochs=self.epochs, cycles_per_bit=cfg.cycles_per_bit,
                       data_bits=self.data_bits)
        if cfg.profile != "fixed_rate":
            out.update(downlink_sharing=cfg.downlink_sharing,
                       server_bandwidth_hz=self.links.server_bandwidth_hz,
                       server_power_w=self.links.server_power_w,
                       noise_w_per_hz=self.links.noise_w_per_hz)
        return out


def phase_times(times: Iterable[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The phases of a round whose every phase waits for its slowest client: the largest
    download, compute and upload; compute NaN when any client's is (not counted)."""
    times = list(times)
    compute = [c for _, c, _ in times]
    return (max(d for d, _, _ in times),
            math.nan if any(math.isnan(c) for c in compute) else max(compute),
            max(u for _, _, u in times))


def late_clients(times: Mapping[int, tuple[float, float, float]], deadline: float,
                 round_timing: str) -> frozenset[int]:
    """The clients whose replies miss ``deadline``, from their (download, compute, upload)
    seconds. ``chain``: a reply arrives after its client's own three. ``phase``: every
    phase waits for the slowest of the clients the server still waits for, so a reply
    arrives when the phases end; the server gives up on clients, the longest own chain
    first (ties: the highest id), until the phases of the rest end by the deadline. Either
    way the round priced from the on-time clients ends by the deadline."""
    def chain(cid: int) -> float:
        d, c, u = times[cid]
        return d + u + (0.0 if math.isnan(c) else c)

    late = {c for c in times if chain(c) > deadline}
    if round_timing == "phase":
        rest = sorted((c for c in times if c not in late), key=lambda c: (chain(c), c))
        while rest and sum(0.0 if math.isnan(t) else t
                           for t in phase_times(times[c] for c in rest)) > deadline:
            late.add(rest.pop())
    return frozenset(late)


def _unit(cfg: SystemConfig) -> str:
    if cfg.interference_unit == "noise":
        return "multiples of the link's thermal noise power B*N0 (clipped at 0)"
    return f"{cfg.interference_unit} (clipped at 0)"


def cost_totals(rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Summary totals (``t_down_total``, ..., ``flops_server_total``) of per-round rows.

    A plain sum: one NaN round (nothing counted) makes its total NaN (null in JSON)
    rather than a total that silently leaves rounds out.
    """
    rows = list(rows)
    return {TOTAL_KEYS[c]: float(sum(float(r.get(c, math.nan)) for r in rows))
            for c in COST_COLUMNS}
