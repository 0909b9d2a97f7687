"""tfremat: train Keras models larger than accelerator memory.

A planner chooses what to recompute (and what to offload to host memory) under a
memory budget; the rewriter applies the plan to a Keras model that shares the
original's weights.

Parts that need TensorFlow load on first use, so `tfremat.simulate`, the
planners and `PlanGraph` work without it, and importing tfremat does not import
TensorFlow. Once Keras is imported (before or after tfremat), tfremat registers
its Keras layers with it, so saved rewritten models load.

Importing tfremat sets `TF_CPU_ALLOCATOR_USE_BFC=1` unless it is set already:
on CPUs where TensorFlow runs without oneDNN, its default CPU allocator keeps
no statistics, and tfremat could then predict memory but never measure it.
It takes effect when TensorFlow has not run an operation yet.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import wrapt

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")

from tfremat.core import (BackendError, BudgetError, Node, Offload, Plan, PlanEstimate,
                          PlanGraph, PlanMismatchError, PlanValidationError, Segment,
                          TensorInfo, TfrematError, UnsupportedModelError)
from tfremat.export import export_dot, summary
from tfremat.plots import plot_memory
from tfremat.simulation import Estimate, simulate

__version__ = "0.1.0"

# Public names living in modules that import TensorFlow: loaded on first access.
_LAZY = {
    "plan": "tfremat.api",
    "rewrite": "tfremat.api",
    "RecomputeSegment": "tfremat.rewriter",
    "Planner": "tfremat.callbacks",
    "extract": "tfremat.graph",
    "measure_peak": "tfremat.memory",
    "MeasuredPeak": "tfremat.memory",
    "measure_step": "tfremat.memory",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tfremat' has no attribute {name!r}")
    from tfremat.backend import require_tensorflow

    require_tensorflow()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def _register_keras_layers(keras: Any) -> None:
    """Registers tfremat's layers (`RecomputeSegment`, `UpdateUnit`) with
    `keras`, so saved rewritten models load, when TensorFlow is usable too."""
    try:
        importlib.import_module("tfremat.rewriter.segment_layer")
    except (ImportError, BackendError):
        pass  # tfremat's TensorFlow parts say what is missing when used


# Now if Keras is imported already, else as soon as it is: importing tfremat
# itself stays free of TensorFlow (the `tfremat` command starts in a second).
wrapt.register_post_import_hook(_register_keras_layers, "keras")

__all__ = [
    "BackendError", "BudgetError", "Estimate", "Node", "Offload", "Plan", "PlanEstimate",
    "PlanGraph", "PlanMismatchError", "PlanValidationError", "Segment",
    "TensorInfo", "TfrematError", "UnsupportedModelError", "export_dot", "plot_memory",
    "simulate", "summary",
    *_LAZY,
]
