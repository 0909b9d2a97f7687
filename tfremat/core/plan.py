"""The Plan: what to recompute and what to offload, for one PlanGraph.

No TensorFlow here: a Plan is data, made by planners, checked against its graph
(`validation.py`), read by the simulator and the rewriter, written to JSON.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Protocol

from tfremat.core import jsonio
from tfremat.core.errors import MIB, PlanMismatchError, PlanValidationError
from tfremat.core.graph import PlanGraph, split_ref, structure_fingerprint
from tfremat.core.validation import validate_plan

PLAN_VERSION = 1


@dataclasses.dataclass
class Segment:
    """A convex set of nodes run under recomputation as one unit.

    Attributes:
        nodes: Node ids of the segment, in the graph's topological order.
        children: Segments nested inside this one (Chen et al. Sec. 4.4): while the
            segment is recomputed in the backward pass, its children are
            recomputed again rather than kept.

    Example:

    ```python
    outer = tfremat.Segment(["conv1", "bn1", "relu1", "conv2"],
                            children=[tfremat.Segment(["conv1", "bn1"])])
    plan = tfremat.Plan.from_segments(graph, [outer])
    ```
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

    Example:

    ```python
    plan = tfremat.Plan.from_segments(graph, [])
    plan.offloaded = [tfremat.Offload("conv1_relu:0", prefetch_after="conv2_block1_add")]
    print(tfremat.simulate(graph, plan).host_peak_bytes)
    ```
    """

    tensor: str
    prefetch_after: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "prefetch_after": self.prefetch_after}


@dataclasses.dataclass(frozen=True)
class PlanEstimate:
    """What the simulator predicts for a plan, as the planner recorded it.

    Attributes:
        peak_bytes: Predicted device peak of a training step, persistent bytes
            (weights, optimizer slots, batch) included.
        overhead: Extra compute (and copy stalls) as a fraction of a step.
        extra_compute: Cost of the recomputed forward calls (seconds when the
            graph has measured times, FLOPs otherwise).
        host_peak_bytes: Predicted host memory of offloaded tensors.
        step_seconds: Predicted step time, for plans with offload.
        baseline_seconds: Predicted step time without a plan, likewise.
        stall_seconds: Time compute waits for copies back, likewise.
        note: How the plan was chosen (planner "auto" says what it tried).
        details: The planner's own figures, e.g. the DP's Eq. (2) peak
            (`"model_peak_bytes"`) or whether segments were nested
            (`"refined"`).

    Example:

    ```python
    plan = tfremat.plan(model, budget_mb=200, batch_size=16)
    print(plan.estimates.peak_mb, plan.estimates.overhead, plan.estimates.note)
    ```
    """

    peak_bytes: int
    overhead: float = 0.0
    extra_compute: float = 0.0
    host_peak_bytes: int = 0
    step_seconds: float | None = None
    baseline_seconds: float | None = None
    stall_seconds: float | None = None
    note: str = ""
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / MIB

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "details" and getattr(self, f.name) not in (None, "")}
        return {**out, **self.details}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PlanEstimate":
        """Reads the flat dict `to_dict` writes (and tfremat 0.1 wrote)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"details"}
        if "peak_bytes" not in data:
            raise PlanValidationError("The plan's estimates have no 'peak_bytes'.")
        known = {k: v for k, v in data.items() if k in names}
        return cls(**known, details={k: v for k, v in data.items() if k not in names})


class PlanViews(Protocol):
    """The pictures and text of a plan (`tfremat.export` provides them)."""

    def summary(self, graph: PlanGraph, plan: "Plan") -> str: ...

    def to_pydot(self, graph: PlanGraph, plan: "Plan", **kwargs: Any) -> Any: ...


class PlanPlots(Protocol):
    """The memory timeline of a plan (`tfremat.plots` provides it)."""

    def plot_memory(self, plan: "Plan", path: str | os.PathLike, *,
                    graph: PlanGraph | None = None,
                    measured_mb: float | list[float] | None = None) -> str: ...


_views: PlanViews | None = None
_plots: PlanPlots | None = None


def set_plan_views(views: PlanViews) -> None:
    """Registers what `Plan.summary` and `Plan.to_pydot` draw with.

    `tfremat.export` registers itself when imported (`import tfremat` does), so
    this floor never imports the floors above it.
    """
    global _views
    _views = views


def set_plan_plots(plots: PlanPlots) -> None:
    """Registers what `Plan.plot_timeline` draws with (`tfremat.plots`
    registers itself when imported, as `tfremat.export` does for the views)."""
    global _plots
    _plots = plots


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
        estimates: The planner's prediction (None for a plan made by hand).
        update_in_backward: Whether each layer's (or segment's) optimizer
            update runs inside the backward pass, as soon as its weight
            gradients are complete, freeing them before the backward pass goes
            on (see docs/updates-in-backward.md).
        update_note: Why updates do not run in the backward pass when they
            were asked for or considered (e.g. `global_clipnorm`), or "".
        pin_order: Whether the backward pass is pinned to the simulator's
            order: the backward of each layer call with weights (or of each
            segment; on a subclassed model, of each recomputed sublayer call)
            hands its input gradients on only once its weight
            gradients are complete, so the next one's kernels cannot run
            beside them, and its weight gradients only once its input
            gradients are, so the optimizer's updates write the weights in
            place instead of copying them (see docs/how-it-works.md,
            "Pinning the order").
            Implied by `update_in_backward` while the updates run. Predicted
            with each unit's update right after its backward pass, as with
            updates in the backward pass, on a functional model whose
            gradients do not wait for an all-reduce
            (`tfremat.simulation.updates_follow_units`); on a CPU's inter-op
            threads the update runs beside the next unit's backward, which
            does not wait for it (`tfremat.simulation.updates_overlap`).
        node_ids: The ids of the planned graph's nodes, in its order (set by
            `from_segments`). With them the plan applies to a model of the
            same structure whose layers are named otherwise (`for_graph`);
            without them, only to a graph with the same ids.
        graph: The PlanGraph planned for, when known (set by `tfremat.plan` and
            `make_plan`; not serialised: a plan read from JSON has none).

    Example:

    ```python
    plan = tfremat.plan(model, budget_mb=6000, batch_size=64)
    plan.summary()
    print(plan.estimates.peak_mb)
    plan.to_json("plan.json"); same = tfremat.Plan.from_json("plan.json")
    ```
    """

    graph_fingerprint: str
    budget_bytes: int | None = None
    planner: str = "manual"
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    segments: list[Segment] = dataclasses.field(default_factory=list)
    offloaded: list[Offload] = dataclasses.field(default_factory=list)
    estimates: PlanEstimate | None = None
    update_in_backward: bool = False
    update_note: str = ""
    pin_order: bool = False
    node_ids: list[str] = dataclasses.field(default_factory=list)
    graph: PlanGraph | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_segments(cls, graph: PlanGraph, segments: list[list[str]] | list[Segment],
                      **kwargs: Any) -> "Plan":
        """Makes a plan for `graph` from lists of node ids (or Segments).

        The plan runs updates in the backward pass when the graph was marked
        for them (`with_updates_in_backward`), unless `update_in_backward` is
        given, and pins the order when it was marked so (`with_pinned_order`),
        unless `pin_order` is given.
        """
        segs = [s if isinstance(s, Segment) else Segment(list(s)) for s in segments]
        kwargs.setdefault("update_in_backward", updates_in_backward(graph))
        kwargs.setdefault("pin_order", pins_order(graph))
        return cls(graph_fingerprint=graph.fingerprint(), segments=segs,
                   node_ids=[n.id for n in graph], **kwargs)

    @property
    def is_empty(self) -> bool:
        """Whether the plan changes nothing: no segments, offloads, updates
        in the backward pass or pinned order."""
        return not (self.segments or self.offloaded or self.update_in_backward
                    or self.pin_order)

    @property
    def peak_bytes(self) -> int:
        """The predicted device peak.

        Raises:
            ValueError: the plan carries no estimates (made by hand).
        """
        if self.estimates is None:
            raise ValueError("This plan carries no estimates (it was made by hand): "
                             "use tfremat.simulate(graph, plan).peak_bytes.")
        return self.estimates.peak_bytes

    def recomputed_nodes(self) -> set[str]:
        """Ids of all nodes inside a top-level segment."""
        return {n for s in self.segments for n in s.nodes}

    # -- presentation ----------------------------------------------------

    def __repr__(self) -> str:
        """One line, as Keras objects show themselves (`summary()` has the rest)."""
        parts = [f"planner={self.planner!r}"]
        if self.budget_bytes is not None:
            parts.append(f"budget={self.budget_bytes / MIB:,.1f} MiB")
        if self.estimates is not None:
            parts.append(f"predicted_peak={self.estimates.peak_mb:,.1f} MiB")
            parts.append(f"overhead={self.estimates.overhead:+.0%}")
        recomputed = len(self.recomputed_nodes())
        parts.append(f"segments={len(self.segments)} ({recomputed} layer calls)")
        parts.append(f"offloaded={len(self.offloaded)}")
        parts.append(f"update_in_backward={self.update_in_backward}")
        if self.pin_order:
            parts.append("pin_order=True")
        return f"<Plan {' '.join(parts)}>"

    def graph_or(self, graph: PlanGraph | None) -> PlanGraph:
        """`graph` when given, else the graph the plan carries.

        Raises:
            ValueError: neither is there.
        """
        graph = graph if graph is not None else self.graph
        if graph is None:
            raise ValueError("This plan carries no PlanGraph (it was read from JSON or "
                             "built by hand): pass graph=tfremat.extract(model, ...).")
        return graph

    def summary(self, graph: PlanGraph | None = None,
                print_fn: Callable[[str], Any] | None = None) -> None:
        """Prints segments, offloads and estimates, like `model.summary()`.

        Args:
            graph: The PlanGraph, when the plan does not carry one.
            print_fn: Function printing the text (default `print`).
        """
        (print_fn or print)(_require_views().summary(self.graph_or(graph), self))

    def to_pydot(self, graph: PlanGraph | None = None, **kwargs: Any) -> Any:
        """The layer graph as a `pydot.Dot` coloured by this plan (see
        `tfremat.export.to_pydot` for the keyword arguments)."""
        return _require_views().to_pydot(self.graph_or(graph), self, **kwargs)

    def plot_timeline(self, path: str | os.PathLike, graph: PlanGraph | None = None,
                      measured_mb: float | list[float] | None = None) -> str:
        """Writes the predicted device memory over one step, without and with
        this plan, to an image (see `tfremat.plot_memory`).

        Args:
            path: Image file; its extension picks the format (`.png`, `.svg`, ...).
            graph: The PlanGraph, when the plan does not carry one.
            measured_mb: Measured peaks in MiB to draw beside the prediction.

        Returns:
            `path`.

        Example:

        ```python
        plan = tfremat.plan(model, budget_mb=200, batch_size=16)
        plan.plot_timeline("memory.png")
        ```
        """
        if _plots is None:
            raise RuntimeError("Plan timelines come from tfremat.plots: import tfremat first.")
        return _plots.plot_memory(self, path, graph=graph, measured_mb=measured_mb)

    # -- checks ----------------------------------------------------------

    def check_graph(self, graph: PlanGraph) -> None:
        """Raises `PlanMismatchError` unless the plan was made for `graph`,
        ids included (`for_graph` renames a plan made for the same structure
        under other ids)."""
        if self.graph_fingerprint == graph.fingerprint():
            return
        self.for_graph(graph)  # raises when the structure differs
        raise PlanMismatchError(
            f"This plan names the nodes of {graph.name!r} by other ids (its layers "
            "are named otherwise than where it was planned): use "
            "plan.for_graph(graph), which renames them.")

    def for_graph(self, graph: PlanGraph) -> "Plan":
        """This plan in the node ids of `graph`.

        Keras names unnamed layers by a counter of the process: the same model
        built after another one has `dense_1` where a fresh process has
        `dense`. When `graph` has the structure the plan was made for (the
        same layer classes, connections and order) under other ids, the plan
        is returned with its ids renamed by position. `tfremat.rewrite`,
        `tfremat.simulate` and the pictures call it.

        Args:
            graph: The graph of the model the plan is applied to.

        Returns:
            `self` when made for `graph`, else a renamed copy (without
            `graph`).

        Raises:
            PlanMismatchError: `graph` has another structure, or other ids and
                the plan records no `node_ids` (made by hand).
        """
        if self.graph_fingerprint == graph.fingerprint():
            return self
        ids = [n.id for n in graph]
        if len(self.node_ids) == len(ids):
            old = dict(zip(ids, self.node_ids))
            if _renamed_fingerprint(graph, old) == self.graph_fingerprint:
                return self._renamed(dict(zip(self.node_ids, ids)), graph)
        hint = ("" if self.node_ids else
                " (This plan records no node ids, so layer names count too: Keras "
                "numbers unnamed layers per process. Call keras.backend.clear_session() "
                "before building the model, or load it from its .keras file.)")
        raise PlanMismatchError(
            f"This plan was made for graph {self.graph_fingerprint}, not for "
            f"{graph.name!r} (fingerprint {graph.fingerprint()}): the model's layers, "
            f"their connections or their order differ. Plan again for this model.{hint}")

    def _renamed(self, new: dict[str, str], graph: PlanGraph) -> "Plan":
        """A copy naming each node `n` of the plan `new[n]`, for `graph`. Ids
        the planned graph did not have stay, for `validate_plan` to name."""
        def segment(seg: Segment) -> Segment:
            return Segment([new.get(n, n) for n in seg.nodes],
                           [segment(c) for c in seg.children])

        return dataclasses.replace(
            self, graph_fingerprint=graph.fingerprint(), node_ids=[n.id for n in graph],
            segments=[segment(s) for s in self.segments],
            offloaded=[Offload(_renamed_ref(o.tensor, new), new.get(o.prefetch_after,
                                                                   o.prefetch_after))
                       for o in self.offloaded],
            graph=None)

    def validate(self, graph: PlanGraph) -> None:
        """Checks the plan against `graph` (see `tfremat.core.validate_plan`).

        Raises:
            PlanMismatchError: the plan names another graph.
            PlanValidationError: the plan is malformed for this graph.
        """
        validate_plan(self, graph)

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
            "estimates": self.estimates.to_dict() if self.estimates else {},
            "update_in_backward": self.update_in_backward,
            "update_note": self.update_note,
            "pin_order": self.pin_order,
            "node_ids": list(self.node_ids),
        }

    def to_json(self, path: str | os.PathLike | None = None, *,
                indent: int | None = 2) -> str:
        """Serialises the plan, also writing it to `path` if given."""
        return jsonio.dumps(self.to_dict(), path, indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Reads what `to_dict` writes.

        Raises:
            PlanValidationError: another version, or a field missing or malformed.
        """
        if data.get("version") != PLAN_VERSION:
            raise PlanValidationError(
                f"Plan version {data.get('version')!r} is not supported "
                f"(this tfremat reads version {PLAN_VERSION}).")
        if not isinstance(data.get("graph_fingerprint"), str):
            raise PlanValidationError(
                "The plan has no 'graph_fingerprint': it does not say which model "
                "it was made for.")
        try:
            estimates = data.get("estimates") or None
            return cls(
                graph_fingerprint=data["graph_fingerprint"],
                budget_bytes=data.get("budget_bytes"),
                planner=data.get("planner", "manual"),
                settings=dict(data.get("settings", {})),
                segments=[Segment.from_dict(s) for s in data.get("segments", [])],
                offloaded=[Offload(**o) for o in data.get("offloaded", [])],
                estimates=PlanEstimate.from_dict(estimates) if estimates else None,
                update_in_backward=bool(data.get("update_in_backward", False)),
                update_note=str(data.get("update_note", "")),
                pin_order=bool(data.get("pin_order", False)),
                node_ids=[str(n) for n in data.get("node_ids", [])],
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise PlanValidationError(f"The plan's segments or offloads are malformed "
                                      f"({type(e).__name__}: {e}).") from None

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "Plan":
        """Reads a plan from JSON text or a JSON file.

        Raises:
            ValueError: neither an existing file nor JSON text.
            PlanValidationError: the JSON is not a plan this tfremat reads.
        """
        return cls.from_dict(jsonio.loads(text_or_path, "plan"))


#: The `PlanGraph.metadata` key marking a graph planned with updates in the
#: backward pass (`with_updates_in_backward`).
UPDATES_KEY = "update_in_backward"

#: The `PlanGraph.metadata` key marking a graph planned with a pinned backward
#: order (`with_pinned_order`).
PIN_KEY = "pin_order"


def with_updates_in_backward(graph: PlanGraph, on: bool = True) -> PlanGraph:
    """`graph`, marked so that plans made for it (and simulations of it without
    a plan) run each optimizer update inside the backward pass.

    The planners make their plans with `Plan.from_segments`, which reads the
    mark: planning on the marked graph plans against the lower floor. The
    structure, and so the fingerprint, is unchanged.

    Args:
        graph: A PlanGraph.
        on: Mark (True) or unmark (False).

    Returns:
        A new PlanGraph with the same nodes; `graph` itself when it already
        carries that mark.
    """
    return _marked(graph, UPDATES_KEY, on)


def updates_in_backward(graph: PlanGraph) -> bool:
    """Whether `graph` is marked by `with_updates_in_backward`."""
    return bool(graph.metadata.get(UPDATES_KEY, False))


def with_pinned_order(graph: PlanGraph, on: bool = True) -> PlanGraph:
    """`graph`, marked so that plans made for it pin the backward pass's order
    (`Plan.pin_order`), and are simulated so.

    Like `with_updates_in_backward`: `Plan.from_segments` reads the mark, and
    the structure, and so the fingerprint, is unchanged.

    Args:
        graph: A PlanGraph.
        on: Mark (True) or unmark (False).

    Returns:
        A new PlanGraph with the same nodes; `graph` itself when it already
        carries that mark.
    """
    return _marked(graph, PIN_KEY, on)


def pins_order(graph: PlanGraph) -> bool:
    """Whether `graph` is marked by `with_pinned_order`."""
    return bool(graph.metadata.get(PIN_KEY, False))


def _marked(graph: PlanGraph, key: str, on: bool) -> PlanGraph:
    """`graph` with its metadata's `key` set to True (`on`) or absent."""
    if bool(graph.metadata.get(key, False)) == on:
        return graph
    metadata = {k: v for k, v in graph.metadata.items() if k != key}
    if on:
        metadata[key] = True
    return dataclasses.replace(graph, metadata=metadata)


def recompute_units(graph: PlanGraph, segments: list[Segment]) -> list[Segment]:
    """The units `segments` are recomputed as on `graph`'s model.

    A subclassed model (`graph.metadata["subclassed"]`) recomputes each call of
    a chosen sublayer as a unit of its own (`tfremat.rewriter.subclassed`: its
    `call` is Python, so consecutive calls cannot run as one unit): there every
    node of a segment is a unit, nested segments aside. Measured: three
    segments of three conv blocks each, run as nine units, peaked 37 MiB above
    their prediction as three units. Elsewhere the units are the segments.

    Args:
        graph: The PlanGraph.
        segments: A plan's segments.

    Returns:
        The recompute units, in order.
    """
    if not graph.metadata.get("subclassed", False):
        return list(segments)
    return [Segment([n]) for seg in segments for n in seg.nodes]


def _renamed_ref(ref: str, names: dict[str, str]) -> str:
    """The tensor reference `ref` with its node renamed by `names` (when
    named there; a malformed one as it is, for `validate_plan` to name)."""
    try:
        node_id, index = split_ref(ref)
    except ValueError:
        return ref
    return f"{names.get(node_id, node_id)}:{index}"


def _renamed_fingerprint(graph: PlanGraph, names: dict[str, str]) -> str:
    """`graph.fingerprint()` were its nodes renamed by `names`."""
    return structure_fingerprint((names[n.id], n.class_name,
                                  [_renamed_ref(r, names) for r in n.inputs]) for n in graph)


def _require_views() -> PlanViews:
    if _views is None:  # only when tfremat.core is used without `import tfremat`
        raise RuntimeError("Plan pictures and summaries come from tfremat.export: "
                           "import tfremat first.")
    return _views
