"""Planners: functions `(PlanGraph, budget_bytes, **settings) -> Plan`."""

from tfremat.planners.plan import Offload, Plan, Segment

__all__ = ["Offload", "Plan", "Segment"]
