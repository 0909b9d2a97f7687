"""The ground floor: tfremat's data and its rules, with no TensorFlow.

`PlanGraph` (one `Node` per layer call, its `TensorInfo` outputs), `Plan`
(recompute `Segment`s, `Offload`s, a `PlanEstimate`), the rules a plan must
follow on its graph (`validate_plan`), their JSON, tfremat's errors, Ctrl-C
held back while the user's state is put back (`interrupts_deferred`), and
warnings that name the user's line (`warn`).
Nothing here imports another part of tfremat; every other part builds on it.
"""

from tfremat.core.errors import (MIB, BackendError, BudgetError, PlanMismatchError,
                                 PlanValidationError, TfrematError, UnsupportedModelError)
from tfremat.core.graph import (Node, PlanGraph, TensorInfo, dtype_size, split_ref,
                                structure_fingerprint)
from tfremat.core.plan import (Offload, Plan, PlanEstimate, PlanPlots, PlanViews, Segment,
                               pins_order, recompute_units, set_plan_plots, set_plan_views,
                               updates_in_backward, with_pinned_order,
                               with_updates_in_backward)
from tfremat.core.arguments import budget_unit_hint, check_count
from tfremat.core.interrupts import interrupts_deferred
from tfremat.core.validation import is_convex, shared_layer_groups, validate_plan
from tfremat.core.warning import warn

__all__ = [
    "MIB", "BackendError", "BudgetError", "Node", "Offload", "Plan", "PlanEstimate",
    "PlanGraph", "PlanMismatchError", "PlanPlots", "PlanValidationError", "PlanViews",
    "Segment", "TensorInfo", "TfrematError", "UnsupportedModelError", "budget_unit_hint",
    "check_count", "dtype_size",
    "interrupts_deferred", "is_convex", "pins_order",
    "recompute_units", "set_plan_plots", "set_plan_views", "shared_layer_groups", "split_ref",
    "structure_fingerprint", "updates_in_backward", "validate_plan", "warn",
    "with_pinned_order", "with_updates_in_backward",
]
