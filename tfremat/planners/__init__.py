"""Planners: functions `(PlanGraph, budget_bytes, **settings) -> Plan`."""

from tfremat.planners.plan import Offload, Plan, Segment
from tfremat.planners.chen import chen_drop_cheap, chen_greedy, chen_recursive, chen_sqrt
from tfremat.planners.dp import DPTimeout, approx_dp, exact_dp
from tfremat.planners.registry import PLANNERS, make_plan, min_feasible_budget
from tfremat.planners.swap import swap, swap_combined

__all__ = [
    "DPTimeout", "Offload", "PLANNERS", "Plan", "Segment", "approx_dp", "chen_drop_cheap",
    "chen_greedy", "chen_recursive", "chen_sqrt", "exact_dp", "make_plan",
    "min_feasible_budget", "swap", "swap_combined",
]
