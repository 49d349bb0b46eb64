"""The ``system`` section of a run: wireless links, device speeds, round timing, backhaul.

Defaults are the KAPC journal paper's Table 4 (Shannon links of a mobile edge network);
``fixed_rate`` is DC-PFL's 2 Mbps per client; ``custom`` is the Shannon model with your
own parameters; ``wen_table2`` is Wen et al.'s Table 2 (1 MHz Shannon links, devices
priced by CPU cycles per bit of training data rather than by counted FLOPs). A setting
that the chosen profile would ignore is an error rather than a silent no-op, so the
profile name in a run's config always says what was simulated.
Units are in the field names (MHz, dBm, m, FLOP/s); docs/system.md has the equations.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edgepfl.errors import ConfigError

# Lists rather than tuples: a run's config is compared with its JSON copy on resume, and
# JSON gives lists back.
Range = Annotated[list[float], Field(min_length=2, max_length=2)]


class DeviceTier(BaseModel):
    """One class of devices (HMPL-style heterogeneity): a speed and a share of the clients."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)
    name: str = Field(description="tier label, recorded per client in system.json")
    flops: float = Field(gt=0, description="training speed of this tier's devices, FLOP/s")
    share: float = Field(gt=0, le=1, description="fraction of the clients in this tier")


# HMPL (Zhang et al., Sec. III-C and Table III) splits devices 3:4:3 into weak (Com
# model), ordinary (Ord) and superior (Sup). Its devices are server GPUs, so the speeds
# here are ours: phone-class training throughput around the ~7 GFLOP/s per client that
# KAPC's Tables 5-6 imply.
HMPL_TIERS: tuple[DeviceTier, ...] = (
    DeviceTier(name="weak", flops=2e9, share=0.3),
    DeviceTier(name="ordinary", flops=5e9, share=0.4),
    DeviceTier(name="superior", flops=1e10, share=0.3),
)

SHANNON_FIELDS = ("client_bandwidth_mhz", "client_power_dbm", "distance_m", "path_loss_db",
                  "reference_distance_m", "path_loss_exponent", "fading_gain", "noise_dbm_per_hz",
                  "up_interference_mean", "up_interference_std", "down_interference_mean",
                  "down_interference_std", "interference_unit", "server_bandwidth_mhz",
                  "server_power_dbm", "downlink_sharing")
FIXED_RATE_FIELDS = ("rate_mbps", "down_rate_mbps")
CYCLES_FIELDS = ("cpu_ghz", "cycles_per_bit", "data_mb")  # wen_table2's compute model
FLOPS_DEVICE_FIELDS = ("devices", "device_flops", "tiers")  # the FLOP/s compute model

# Wen et al. (Hierarchical asynchronous FL for edge computing networks), Table 2: B = 1 MHz,
# n_0 = "-125 dBm/Hz", p_k = "30 W". Read literally the links run at bit/s to kbit/s, under
# which Table 2's 5 MB block takes hours to days, not what a paper claiming communication
# savings simulated; read as -125 dBm of noise over the 1 MHz band (N0 = -185 dBm/Hz) with
# 30 dBm they run at 2.6-11.6 Mbit/s over 100-500 m. That is the default reading; the
# literal ones are kept by name (docs/system.md). Table 2 has no server power, distance or
# path loss: those are KAPC Table 4's (the class defaults). A wen_table2 config carries these
# values in its fields, so its record (and its JSON copy, compared on resume) states the
# channel that was simulated.
_WEN_COMMON: dict[str, Any] = {
    "client_bandwidth_mhz": [1.0, 1.0], "up_interference_mean": 0.0, "up_interference_std": 0.0,
    "down_interference_mean": 0.0, "down_interference_std": 0.0,
    "server_bandwidth_mhz": 1.0, "server_power_dbm": 30.0,
}
WEN_READINGS: dict[str, dict[str, Any]] = {
    # -125 dBm of noise (plus interference) over the 1 MHz band; 30 dBm
    "band_noise": {**_WEN_COMMON, "client_power_dbm": [30.0, 30.0], "noise_dbm_per_hz": -185.0},
    # -125 dBm/Hz as a density; "30 W" as 30 dBm (1 W)
    "density_dbm": {**_WEN_COMMON, "client_power_dbm": [30.0, 30.0], "noise_dbm_per_hz": -125.0},
    # -125 dBm/Hz as a density; 30 W as printed (44.77 dBm)
    "density_watts": {**_WEN_COMMON, "client_power_dbm": [44.77, 44.77],
                      "noise_dbm_per_hz": -125.0},
}


class SystemConfig(BaseModel):
    """Simulated mobile edge network and devices (KAPC Table 4 by default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              strict=True)

    profile: Literal["kapc_table4", "fixed_rate", "custom", "wen_table2"] = Field(
        "kapc_table4", description="kapc_table4 (Shannon links, KAPC Table 4), fixed_rate "
        "(DC-PFL: rate_mbps per client), custom (Shannon links with your parameters), "
        "wen_table2 (Wen et al. Table 2: 1 MHz Shannon links, compute = local epochs x "
        "cycles_per_bit x data bits / CPU frequency)")

    # -- Shannon links: r = B log2(1 + p h / (I + B N0)) ------------------------------------
    client_bandwidth_mhz: Range = Field(
        [10.0, 30.0], description="uplink bandwidth B of a client, MHz, uniform in [lo, hi]")
    client_power_dbm: Range = Field(
        [23.0, 30.0], description="client transmit power p, dBm, drawn uniformly in [lo, hi]")
    distance_m: Range = Field(
        [100.0, 500.0], description="client-server distance d, m, drawn uniformly in [lo, hi]")
    path_loss_db: float = Field(-40.0, description="path-loss constant g0 at distance d0, dB")
    reference_distance_m: float = Field(1.0, gt=0, description="reference distance d0 of g0, m")
    path_loss_exponent: float = Field(4.0, gt=0, description="large-scale path-loss exponent alpha")
    fading_gain: float = Field(1.0, gt=0, description="small-scale fading power gain (Table 4: 1)")
    noise_dbm_per_hz: float = Field(-174.0, description="noise power spectral density N0, dBm/Hz")
    up_interference_mean: float = Field(1.0, description="uplink co-channel interference: mean")
    up_interference_std: float = Field(
        2.0, ge=0, description="uplink interference: std (Table 4: N(1, 4), variance 4)")
    down_interference_mean: float = Field(1.0, description="downlink co-channel interference: mean")
    down_interference_std: float = Field(
        3.0, ge=0, description="downlink interference: std (Table 4: N(1, 9), variance 9)")
    interference_unit: Literal["noise", "W", "mW", "pW"] = Field(
        "noise", description="unit of the interference draws: 'noise' = multiples of the link's "
        "thermal noise power B*N0 (Table 4 gives no unit; see docs/system.md), or W, mW, pW")
    server_bandwidth_mhz: float = Field(50.0, gt=0, description="server (downlink) bandwidth, MHz")
    server_power_dbm: float = Field(30.0, description="server transmit power, dBm")
    downlink_sharing: Literal["full", "fdma"] = Field(
        "full", description="full: each receiving client gets the whole server band and power "
        "(matches KAPC Table 5); fdma: band and power split equally among the round's receivers")

    # -- fixed rate ---------------------------------------------------------------------------
    rate_mbps: float = Field(2.0, gt=0, description="fixed_rate: every client's uplink, Mbit/s")
    down_rate_mbps: float | None = Field(
        None, gt=0, description="fixed_rate: downlink rate, Mbit/s (default: rate_mbps)")

    # -- devices ------------------------------------------------------------------------------
    devices: Literal["uniform", "tiers"] = Field(
        "uniform", description="uniform: speed drawn in device_flops; tiers: HMPL-style classes")
    device_flops: Range = Field(
        [1e9, 1e10], description="uniform: client training speed, FLOP/s, uniform in [lo, hi]")
    tiers: list[DeviceTier] = Field(
        list(HMPL_TIERS), description="tiers: device classes (name, flops, share); shares sum to 1")
    server_flops: float = Field(1e11, gt=0, description="server compute speed, FLOP/s")

    # -- cycles-per-bit devices (profile wen_table2 only) --------------------------------
    wen_reading: Literal["band_noise", "density_dbm", "density_watts"] = Field(
        "band_noise", description="wen_table2: how Table 2's '-125 dBm/Hz' and '30 W' are read: "
        "band_noise (-125 dBm of noise over the 1 MHz band, 30 dBm: 2.6-11.6 Mbit/s), "
        "density_dbm (-125 dBm/Hz, 30 dBm: about 57 bit/s), density_watts (-125 dBm/Hz, "
        "30 W: about 1.7 kbit/s)")
    cpu_ghz: Range = Field(
        [0.5, 1.0], description="wen_table2: client CPU frequency f_k, GHz, uniform in [lo, hi] "
        "(Wen et al. Table 2: f_k^max 0.5-1.0 GHz)")
    cycles_per_bit: float = Field(
        15.0, gt=0, description="wen_table2: CPU cycles per bit of training data per local "
        "epoch, C_k (Table 2: 15)")
    data_mb: float = Field(
        2.0, gt=0, description="wen_table2: training data per client, MB (10^6 bytes), D "
        "(Table 2: 2 MB); local training takes local_epochs * cycles_per_bit * 8e6 * data_mb "
        "/ f_k seconds")

    # -- edge servers (topology.edges > 0) -------------------------------------------------
    backhaul_mbps: float = Field(
        100.0, gt=0, description="edge <-> cloud backhaul rate, Mbit/s, each direction (a wired "
        "link; clients keep their wireless access link to their edge)")
    edge_flops: float = Field(1e11, gt=0, description="edge server compute speed, FLOP/s")

    # -- timing and counting ------------------------------------------------------------------
    round_timing: Literal["phase", "chain"] = Field(
        "phase", description="phase: every phase waits for its slowest client (KAPC Table 5); "
        "chain: no barriers, the round lasts as long as the slowest client's whole chain")
    count_flops: bool = Field(
        True, description="count FLOPs with torch FlopCounterMode (off: no compute times)")
    cache_flops: bool = Field(
        True, description="count a client's local training once per work shape and reuse it")

    @field_validator("client_bandwidth_mhz", "distance_m", "device_flops", "cpu_ghz")
    @classmethod
    def _positive_range(cls, value: Range, info) -> Range:
        lo, hi = value
        if not 0 < lo <= hi:
            raise ValueError(f"{info.field_name} = [{lo}, {hi}] must satisfy 0 < lo <= hi")
        return value

    @field_validator("client_power_dbm")
    @classmethod
    def _ordered_range(cls, value: Range, info) -> Range:
        lo, hi = value
        if lo > hi:
            raise ValueError(f"{info.field_name} = [{lo}, {hi}] must satisfy lo <= hi")
        return value

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, value: list[DeviceTier]) -> list[DeviceTier]:
        if not value:
            raise ValueError("tiers is empty; give at least one {name, flops, share}")
        names = [t.name for t in value]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers has repeated names {names}; names must be unique")
        total = sum(t.share for t in value)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"tier shares sum to {total:g}; they must sum to 1")
        return value

    @model_validator(mode="before")
    @classmethod
    def _profile_values(cls, data: Any) -> Any:
        """``wen_table2`` fills its channel values into the keys the run did not set (a key
        it did set must equal the profile's value: see ``_no_ignored_settings``)."""
        if isinstance(data, Mapping) and data.get("profile") == "wen_table2":
            reading = data.get("wen_reading", "band_noise")
            if reading in WEN_READINGS:  # else the field's own check names the valid ones
                return {**copy.deepcopy(WEN_READINGS[reading]), **data}
        return data

    @model_validator(mode="after")
    def _no_ignored_settings(self) -> SystemConfig:
        """A value the chosen profile would ignore is a mistake, not a no-op."""
        defaults = type(self).model_fields

        def changed(names: tuple[str, ...], profile: Mapping[str, Any] | None = None) -> str:
            ref = {n: (profile[n] if profile and n in profile else defaults[n].default)
                   for n in names}
            label = "profile value" if profile else "default"
            return "; ".join(f"{n} = {_show(getattr(self, n))} ({label} {_show(ref[n])})"
                             for n in names if getattr(self, n) != ref[n])

        if self.profile == "kapc_table4" and (diff := changed(SHANNON_FIELDS)):
            raise ValueError(f"{diff}: profile 'kapc_table4' means KAPC Table 4 exactly; set "
                             "profile = 'custom' to simulate your own channel parameters")
        if self.profile == "wen_table2" and (
                diff := changed(SHANNON_FIELDS, WEN_READINGS[self.wen_reading])):
            raise ValueError(f"{diff}: profile 'wen_table2' means Wen et al. Table 2's channel "
                             f"exactly (read as {self.wen_reading!r}, with KAPC Table 4's "
                             "distances and path loss); set profile = 'custom' to simulate "
                             "your own channel parameters")
        if self.profile != "wen_table2" and self.wen_reading != "band_noise":
            raise ValueError(f"wen_reading = {self.wen_reading!r}: applies only to profile = "
                             f"'wen_table2', not to profile = {self.profile!r}")
        if self.profile == "fixed_rate" and (diff := changed(SHANNON_FIELDS)):
            raise ValueError(f"{diff}: applies only to the Shannon profiles 'kapc_table4', "
                             "'custom' and 'wen_table2', not to profile = 'fixed_rate'")
        if self.profile != "fixed_rate" and (diff := changed(FIXED_RATE_FIELDS)):
            raise ValueError(f"{diff}: applies only to profile = 'fixed_rate', "
                             f"not to profile = {self.profile!r}")
        if self.profile != "wen_table2" and (diff := changed(CYCLES_FIELDS)):
            raise ValueError(f"{diff}: applies only to profile = 'wen_table2' (local training "
                             "priced by CPU cycles per bit), not to profile = "
                             f"{self.profile!r}, which prices it by counted FLOPs / device_flops")
        if self.profile == "wen_table2" and (diff := changed(FLOPS_DEVICE_FIELDS)):
            raise ValueError(f"{diff}: profile 'wen_table2' prices local training by CPU "
                             "cycles (cpu_ghz, cycles_per_bit, data_mb), not by FLOP/s, so "
                             "devices, device_flops and tiers do not apply to it")
        if self.devices == "uniform" and changed(("tiers",)):
            raise ValueError("tiers apply only to devices = 'tiers', not to devices = 'uniform'")
        if self.devices == "tiers" and (diff := changed(("device_flops",))):
            raise ValueError(f"{diff}: applies only to devices = 'uniform', not to 'tiers'")
        return self


def _show(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    if isinstance(value, list) and all(isinstance(v, DeviceTier) for v in value):
        return "[" + ", ".join(f"{t.name}: {t.flops:g} FLOP/s x {t.share:g}" for t in value) + "]"
    return repr(value)


def build_system_config(data: Mapping[str, Any] | None = None) -> SystemConfig:
    """Validate a ``system`` section on its own; errors become ``ConfigError`` naming the key."""
    try:
        return SystemConfig.model_validate(dict(data or {}))
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = ".".join(["system", *(str(p) for p in err["loc"])])
            if err["type"] == "extra_forbidden":
                valid = ", ".join(SystemConfig.model_fields)
                lines.append(f"unknown setting {key!r}; valid keys here: {valid}")
            elif not err["loc"]:  # a whole-section check: its message names the keys
                lines.append(f"{key}: {err['msg'].removeprefix('Value error, ')}")
            else:
                lines.append(f"{key} = {err.get('input')!r}: {err['msg']}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
