"""Prediction: memory and time of one training step over a PlanGraph (no TensorFlow).

`simulate(graph, plan)` unrolls the step (`schedule.py`), plays its buffers'
lives (`simulator.py`) through TensorFlow's allocator (`allocator.py`) and its
host copies (`transfers.py`) and returns an `Estimate`. The planners build on the
schedule's facts too: which nodes a gradient flows into (`requires_grad`), a region's
order with segments contracted (`units`), and the weight-gradient lifetime.
"""

from tfremat.simulation.schedule import (GRADIENT_LIFETIME_STEPS, Lifetime, Schedule,
                                       build_schedule, gradient_lifetime, requires_grad,
                                       units, updates_follow_units, updates_overlap)
from tfremat.simulation.simulator import ALLOCATORS, SHARING_MODES, Estimate, simulate
from tfremat.simulation.transfers import BANDWIDTH_GBPS, DEVICE_FLOPS, node_seconds

__all__ = ["ALLOCATORS", "BANDWIDTH_GBPS", "DEVICE_FLOPS", "GRADIENT_LIFETIME_STEPS",
           "SHARING_MODES", "Estimate", "Lifetime", "Schedule", "build_schedule",
           "gradient_lifetime", "node_seconds", "requires_grad", "simulate", "units",
           "updates_follow_units", "updates_overlap"]
