"""The Plan: what to recompute and what to offload, for one PlanGraph.

No TensorFlow here: a Plan is data, made by planners, checked against its graph,
read by the simulator and the rewriter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfremat import jsonio
from tfremat.errors import PlanMismatchError, PlanValidationError
from tfremat.graph.plan_graph import PlanGraph

PLAN_VERSION = 1


@dataclasses.dataclass
class Segment:
    """A convex set of nodes run under recomputation as one unit.

    Attributes:
        nodes: Node ids of the segment, in the graph's topological order.
        children: Segments nested inside this one (Chen et al. Sec. 4.4): while the
            segment is recomputed in the backward pass, its children are
            recomputed again rather than kept.
    """

    nodes: list[str]
    children: list["Segment"] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nodes": list(self.nodes)}
        if self.children:
            out["children"] = [c.to_dict() for c in self.children]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Segment":
        return cls(list(data["nodes"]),
                   [cls.from_dict(c) for c in data.get("children", [])])


@dataclasses.dataclass
class Offload:
    """An activation kept on the host between its forward and backward use.

    Attributes:
        tensor: Reference `"node_id:index"` of the offloaded tensor.
        prefetch_after: Id of the node whose gradient triggers the copy back.
    """

    tensor: str
    prefetch_after: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "prefetch_after": self.prefetch_after}


@dataclasses.dataclass
class Plan:
    """A memory plan for one training step of one model.

    Attributes:
        graph_fingerprint: `PlanGraph.fingerprint()` of the graph planned for.
        budget_bytes: The device budget the plan was made for (None: no budget).
        planner: Name of the planner that made it.
        settings: The planner's settings.
        segments: Top-level recompute segments (disjoint).
        offloaded: Offloaded tensors.
        estimates: The planner's estimates, e.g. `"peak_bytes"`,
            `"host_peak_bytes"`, `"extra_compute"`.
        graph: The PlanGraph planned for, when known (set by `tfremat.plan`;
            not serialised: a plan read from JSON has none).
    """

    graph_fingerprint: str
    budget_bytes: int | None = None
    planner: str = "manual"
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    segments: list[Segment] = dataclasses.field(default_factory=list)
    offloaded: list[Offload] = dataclasses.field(default_factory=list)
    estimates: dict[str, Any] = dataclasses.field(default_factory=dict)
    graph: PlanGraph | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_segments(cls, graph: PlanGraph, segments: list[list[str]] | list[Segment],
                      **kwargs: Any) -> "Plan":
        """Makes a plan for `graph` from lists of node ids (or Segments)."""
        segs = [s if isinstance(s, Segment) else Segment(list(s)) for s in segments]
        return cls(graph_fingerprint=graph.fingerprint(), segments=segs, **kwargs)

    @property
    def is_empty(self) -> bool:
        return not self.segments and not self.offloaded

    def recomputed_nodes(self) -> set[str]:
        """Ids of all nodes inside a top-level segment."""
        return {n for s in self.segments for n in s.nodes}

    # -- presentation ----------------------------------------------------

    def _graph_or(self, graph: PlanGraph | None) -> PlanGraph:
        graph = graph if graph is not None else self.graph
        if graph is None:
            raise ValueError("This plan carries no PlanGraph (it was read from JSON or "
                             "built by hand): pass graph=tfremat.extract(model, ...).")
        return graph

    def summary(self, graph: PlanGraph | None = None, print_fn: Any = None) -> None:
        """Prints segments, offloads and estimates, like `model.summary()`.

        Args:
            graph: The PlanGraph, when the plan does not carry one.
            print_fn: Function printing the text (default `print`).
        """
        from tfremat.export import summary

        (print_fn or print)(summary(self._graph_or(graph), self))

    def to_pydot(self, graph: PlanGraph | None = None, **kwargs: Any) -> Any:
        """The layer graph as a `pydot.Dot` coloured by this plan
        (see `tfremat.export.to_pydot`)."""
        from tfremat.export import to_pydot

        return to_pydot(self._graph_or(graph), self, **kwargs)

    # -- checks ----------------------------------------------------------

    def check_graph(self, graph: PlanGraph) -> None:
        """Raises `PlanMismatchError` unless the plan was made for `graph`."""
        if self.graph_fingerprint != graph.fingerprint():
            raise PlanMismatchError(
                f"This plan was made for graph {self.graph_fingerprint}, not for "
                f"{graph.name!r} (fingerprint {graph.fingerprint()}). The model, its "
                "input shape or batch size changed: plan again for this model."
            )

    def validate(self, graph: PlanGraph) -> None:
        """Checks the plan against `graph`: right graph, known ids, disjoint
        convex segments, nested segments inside their parents, every call of a
        shared layer in one segment or none.

        Raises:
            PlanMismatchError: the plan names another graph.
            PlanValidationError: the plan is malformed for this graph.
        """
        self.check_graph(graph)
        _validate_segments(graph, self.segments, parent=None)
        refs = {n.output_ref(i) for n in graph for i in range(len(n.outputs))}
        for off in self.offloaded:
            if off.tensor not in refs:
                raise PlanValidationError(f"Offloaded tensor {off.tensor!r} is not in the graph.")
            if off.prefetch_after is not None and off.prefetch_after not in graph:
                raise PlanValidationError(
                    f"Prefetch trigger {off.prefetch_after!r} is not a node of the graph.")

    # -- JSON --------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "graph_fingerprint": self.graph_fingerprint,
            "budget_bytes": self.budget_bytes,
            "planner": self.planner,
            "settings": self.settings,
            "segments": [s.to_dict() for s in self.segments],
            "offloaded": [o.to_dict() for o in self.offloaded],
            "estimates": self.estimates,
        }

    def to_json(self, path: str | None = None, *, indent: int | None = 2) -> str:
        """Serialises the plan, also writing it to `path` if given."""
        return jsonio.dumps(self.to_dict(), path, indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        if data.get("version") != PLAN_VERSION:
            raise PlanValidationError(
                f"Plan version {data.get('version')!r} is not supported "
                f"(this tfremat reads version {PLAN_VERSION}).")
        return cls(
            graph_fingerprint=data["graph_fingerprint"],
            budget_bytes=data.get("budget_bytes"),
            planner=data.get("planner", "manual"),
            settings=dict(data.get("settings", {})),
            segments=[Segment.from_dict(s) for s in data.get("segments", [])],
            offloaded=[Offload(**o) for o in data.get("offloaded", [])],
            estimates=dict(data.get("estimates", {})),
        )

    @classmethod
    def from_json(cls, text_or_path: str) -> "Plan":
        """Reads a plan from a JSON string or a path to a JSON file."""
        return cls.from_dict(jsonio.loads(text_or_path))


def is_convex(graph: PlanGraph, node_ids: set[str],
              succ: dict[str, list[str]] | None = None) -> bool:
    """Whether no path leaves `node_ids` and comes back into it.

    `succ` may pass `graph.successors()` when checking many sets.
    """
    if not node_ids:
        return True
    succ = succ if succ is not None else graph.successors()
    hi = max(graph.index(n) for n in node_ids)
    # Nodes outside the set reachable from it, limited to the index window.
    frontier = [m for n in node_ids for m in succ[n] if m not in node_ids]
    seen: set[str] = set()
    while frontier:
        m = frontier.pop()
        if m in seen or graph.index(m) > hi:
            continue
        seen.add(m)
        for k in succ[m]:
            if k in node_ids:
                return False
            frontier.append(k)
    return True


def shared_layer_groups(graph: PlanGraph) -> dict[str, list[str]]:
    """Map from each layer called more than once to the ids of its calls."""
    groups: dict[str, list[str]] = {}
    for n in graph:
        groups.setdefault(n.layer, []).append(n.id)
    return {k: v for k, v in groups.items() if len(v) > 1}


def _validate_segments(graph: PlanGraph, segments: list[Segment],
                       parent: set[str] | None,
                       succ: dict[str, list[str]] | None = None) -> None:
    seen: set[str] = set()
    # A shared layer's calls must stay together at the top level only.
    shared = shared_layer_groups(graph) if parent is None else {}
    succ = succ if succ is not None else graph.successors()
    for seg in segments:
        if not seg.nodes:
            raise PlanValidationError("A recompute segment is empty.")
        ids = set(seg.nodes)
        unknown = [n for n in seg.nodes if n not in graph]
        if unknown:
            raise PlanValidationError(
                f"Segment names node(s) {unknown} that are not in graph {graph.name!r}.")
        inputs = [n for n in seg.nodes if graph.node(n).is_input]
        if inputs:
            raise PlanValidationError(f"Input layer(s) {inputs} cannot be recomputed.")
        overlap = ids & seen
        if overlap:
            raise PlanValidationError(f"Node(s) {sorted(overlap)} are in two segments.")
        seen |= ids
        if parent is not None and not ids <= parent:
            raise PlanValidationError(
                f"Nested segment {seg.nodes} is not inside its parent segment.")
        if not is_convex(graph, ids, succ):
            raise PlanValidationError(
                f"Segment {seg.nodes} is not convex: a path leaves it and re-enters, "
                "so it cannot run as one recomputed unit.")
        for layer, calls in shared.items():
            inside = [c for c in calls if c in ids]
            if inside and len(inside) != len(calls):
                raise PlanValidationError(
                    f"Shared layer {layer!r} is called by {calls}; segment {seg.nodes} "
                    f"holds only {inside}. Keep every call of a shared layer in one "
                    "segment or outside all segments.")
        _validate_segments(graph, seg.children, ids, succ)
