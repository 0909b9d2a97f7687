"""Keras callbacks of tfremat."""

from tfremat.callbacks.planner import Planner

__all__ = ["Planner"]
