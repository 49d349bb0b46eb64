"""What a run costs on a mobile edge network: link and compute times, FLOPs, memory.

``SystemModel.build(cfg, num_clients, seed)`` draws every client's links and device speed
once; ``round_costs`` turns the engine's real byte counts and counted FLOPs into the
seconds of a synchronous round. See docs/system.md for the model and its sources.
"""

from edgepfl.federation.accounting import not_counted
from edgepfl.system.channel import channel_gain, dbm_to_watt, shannon_rate, transfer_time
from edgepfl.system.cost import COST_COLUMNS, TOTAL_KEYS, SystemModel, cost_totals, late_clients
from edgepfl.system.flops import FlopCount, FlopMeter, count_flops, work_signature
from edgepfl.system.memory import host_info, peak_rss_bytes, state_bytes
from edgepfl.system_config import HMPL_TIERS, DeviceTier, SystemConfig, build_system_config

__all__ = ["COST_COLUMNS", "HMPL_TIERS", "TOTAL_KEYS", "DeviceTier", "FlopCount", "FlopMeter",
           "SystemConfig", "SystemModel", "build_system_config", "channel_gain", "cost_totals",
           "count_flops", "dbm_to_watt", "host_info", "late_clients", "not_counted", "peak_rss_bytes", "shannon_rate", "state_bytes",
           "transfer_time", "work_signature"]
