"""Every unit recomputed on its own: what `tf.recompute_grad` around every layer
(or every block of a subclassed model) and Keras's `RematScope(mode="full")` do.

Not a planner of the seed papers but the baseline users write by hand, and a
plan whose measured peak can be below the plans the simulator ranks lowest:
the `tests/setups` subclassed model's lowest plan (four of its six blocks) was
predicted at 155.5 MiB and measured 165.4, every block at 164.4 and 155.6; on
its masked BiLSTM + GRU model every recurrent layer on its own measured 19.4
MiB against 20.4-22.0 for the lowest plan. `tfremat.api.measured_choice`
measures it as a last resort, and "auto" tries it when no other plan fits.
"""

from __future__ import annotations

from tfremat.core import Plan, PlanGraph
from tfremat.planners import toolkit as seg


def every_unit_segments(graph: PlanGraph) -> list[list[str]]:
    """One segment per node that keeps tensors of its own for its backward
    pass (`Node.internal_saved_bytes`): recomputing any other node alone
    frees nothing.

    Args:
        graph: The PlanGraph.

    Returns:
        Valid segments (see `toolkit.valid_segments`), possibly none.
    """
    return seg.valid_segments(graph, [[n.id] for n in graph.nodes
                                      if not n.is_input and n.internal_saved_bytes])


def every_unit(graph: PlanGraph, budget_bytes: int | None = None) -> Plan:
    """Recomputes every node that keeps tensors of its own, each on its own.

    Args:
        graph: The PlanGraph.
        budget_bytes: Optional device budget; checked against the simulator.

    Returns:
        The Plan (empty when no node keeps tensors of its own), estimates
        from `simulate`.

    Raises:
        BudgetError: the plan's simulated peak exceeds `budget_bytes`.
    """
    plan = seg.finish_plan(graph, every_unit_segments(graph), planner="every-unit",
                           budget_bytes=budget_bytes, settings={})
    return seg.best_plan([plan], budget_bytes, "every-unit")
