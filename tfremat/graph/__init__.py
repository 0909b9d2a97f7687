"""From a Keras model to a PlanGraph."""

from tfremat.graph.plan_graph import Node, PlanGraph, TensorInfo

__all__ = ["Node", "PlanGraph", "TensorInfo"]
