"""Memory simulation of a training step (no TensorFlow import)."""

from tfremat.simulate.simulator import STRATEGIES, Estimate, simulate

__all__ = ["STRATEGIES", "Estimate", "simulate"]
