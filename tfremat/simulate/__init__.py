"""Memory and time simulation of a training step (no TensorFlow import)."""

from tfremat.simulate.schedule import Lifetime, Schedule, build_schedule
from tfremat.simulate.simulator import STRATEGIES, Estimate, simulate
from tfremat.simulate.transfers import BANDWIDTH_GBPS, DEVICE_FLOPS, node_seconds

__all__ = ["BANDWIDTH_GBPS", "DEVICE_FLOPS", "STRATEGIES", "Estimate", "Lifetime",
           "Schedule", "build_schedule", "node_seconds", "simulate"]
