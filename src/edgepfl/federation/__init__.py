"""The federation contract: what algorithms and runtimes agree on.

Messages (the only thing that crosses a link), stacked per-client state, derived seeds,
the federation's description (clients, their tiers and architectures, their edge servers)
and the per-layer aggregation helpers. Algorithms import from here, runtimes drive it;
nothing here imports an algorithm or a runtime.
"""
