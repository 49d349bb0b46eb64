"""Simulation engine: round loop, messages, stacked state, checkpoints.

Submodules are imported directly (``edgepfl.engine.simulation``); this package imports
nothing eagerly because algorithms import ``engine.messages`` and the simulation imports
the algorithms.
"""
