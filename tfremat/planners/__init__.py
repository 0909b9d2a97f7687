"""Planners: functions `(PlanGraph, budget_bytes, **settings) -> Plan` (no TensorFlow).

Chen et al. 2016 (`chen.py`), Kusumoto et al. 2019's exact and approximate
DPs (`dp.py`), host offload (`swapping.py`), the DQN paper's agent
(`deepq/`), every unit on its own (`per_unit.py`, the hand-written
baseline), and `make_plan`, which runs one by name or picks one ("auto",
`registry.py`). What they share (valid segments,
simulated estimates) is in `toolkit.py`.
"""

from tfremat.planners._progress import progress
from tfremat.planners.chen import chen_drop_cheap, chen_greedy, chen_recursive, chen_sqrt
from tfremat.planners.deepq import dqn
from tfremat.planners.dp import OBJECTIVES, DPTimeout, approx_dp, exact_dp
from tfremat.planners.per_unit import every_unit, every_unit_segments
from tfremat.planners.registry import PLANNERS, make_plan, min_feasible_budget
from tfremat.planners.swapping import swap, swap_combined

__all__ = [
    "DPTimeout", "OBJECTIVES", "PLANNERS", "approx_dp", "chen_drop_cheap", "chen_greedy",
    "chen_recursive", "chen_sqrt", "dqn", "every_unit", "every_unit_segments", "exact_dp",
    "make_plan", "min_feasible_budget", "progress", "swap", "swap_combined",
]
