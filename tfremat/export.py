"""Pictures and text of a plan: the layer graph coloured by keep / recompute / offload.

No TensorFlow here; pydot builds the graph and Graphviz's `dot` renders PNG/SVG.
`Plan.summary()` and `Plan.to_pydot()` call this module's functions (it
registers itself with `tfremat.core.set_plan_views` when imported).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from typing import Any

import pydot

from tfremat.core import MIB, Plan, PlanGraph, Segment, set_plan_views, warn
from tfremat.simulation import simulate

_SEGMENT_COLOURS = ["#cfe8ff", "#d9f2d0", "#ffe8c2", "#ead9ff", "#ffd6e0", "#d6f5f5"]
_KEEP = "#ffffff"
_INPUT = "#e8e8e8"
_OFFLOAD = "#ffb347"

_NO_GRAPHVIZ = (
    "Rendering {fmt} needs Graphviz's `dot` program, which was not found on PATH. "
    "Install it (Debian/Ubuntu: `apt-get install graphviz`; macOS: `brew install graphviz`; "
    "conda: `conda install graphviz`), or export to .dot, which needs no Graphviz."
)


def _mib(nbytes: float) -> str:
    """`nbytes` in MiB, KiB below 0.1 MiB, bytes below 1 KiB (a lone
    BatchNormalization segment keeps a few hundred bytes of statistics out of
    memory: "0 KiB" read as nothing)."""
    if nbytes >= MIB / 10:
        return f"{nbytes / MIB:.1f} MiB"
    return f"{nbytes / 1024:.0f} KiB" if nbytes >= 1024 else f"{nbytes:.0f} B"


def to_pydot(graph: PlanGraph, plan: Plan | None = None, *,
             show_sizes: bool = True, rankdir: str = "TB") -> pydot.Dot:
    """The layer graph as a `pydot.Dot`, coloured by the plan.

    Kept layers are white, each recompute segment is a coloured cluster (nested
    segments are clusters inside it), offloaded outputs are orange, inputs grey.

    Args:
        graph: The PlanGraph.
        plan: A Plan for `graph`, or None for the plain graph.
        show_sizes: Put output shapes and sizes on nodes.
        rankdir: Graphviz layout direction, `"TB"` or `"LR"`.

    Returns:
        A `pydot.Dot`.
    """
    if plan is not None:
        plan = plan.for_graph(graph)
        plan.validate(graph)
    dot = pydot.Dot(graph_type="digraph", rankdir=rankdir, fontname="Helvetica",
                    label=_title(graph, plan), labelloc="t")
    offloaded = {o.tensor.rsplit(":", 1)[0] for o in plan.offloaded} if plan else set()
    placed: set[str] = set()

    def add_node(container: pydot.Dot | pydot.Cluster, node_id: str, fill: str) -> None:
        node = graph.node(node_id)
        label = f"{node.id}\\n{node.class_name}"
        if show_sizes and node.outputs:
            out = node.outputs[0]
            label += f"\\n{tuple(out.shape)}  {_mib(node.output_bytes)}"
        if node_id in offloaded:
            fill, label = _OFFLOAD, label + "\\noffloaded"
        container.add_node(pydot.Node(_quote(node_id), label=label, shape="box",
                                      style="filled,rounded", fillcolor=fill,
                                      fontname="Helvetica", fontsize="10"))
        placed.add(node_id)

    def add_segment(container: pydot.Dot | pydot.Cluster, seg: Segment, path: str,
                    colour: str) -> None:
        dropped = graph.dropped_bytes(seg.nodes)
        cluster = pydot.Cluster(
            f"segment_{path}", label=f"recompute segment {path}: {len(seg.nodes)} layers, "
            f"{_mib(dropped)} not kept", style="filled,dashed", fillcolor=colour,
            fontname="Helvetica", fontsize="10")
        for k, child in enumerate(seg.children):
            add_segment(cluster, child, f"{path}.{k}", _SEGMENT_COLOURS[
                (len(path) + k + 1) % len(_SEGMENT_COLOURS)])
        for node_id in seg.nodes:
            if node_id not in placed:
                add_node(cluster, node_id, colour)
        container.add_subgraph(cluster)

    for i, seg in enumerate(plan.segments if plan else []):
        add_segment(dot, seg, str(i), _SEGMENT_COLOURS[i % len(_SEGMENT_COLOURS)])
    for node in graph:
        if node.id not in placed:
            add_node(dot, node.id, _INPUT if node.is_input else _KEEP)
    for node in graph:
        for ref in dict.fromkeys(node.inputs):
            producer, _ = ref.rsplit(":", 1)
            dot.add_edge(pydot.Edge(_quote(producer), _quote(node.id)))
    return dot


def _quote(node_id: str) -> str:
    return '"' + node_id.replace('"', '\\"') + '"'


def _title(graph: PlanGraph, plan: Plan | None) -> str:
    if plan is None:
        return f"{graph.name}: {len(graph)} layer calls"
    est = simulate(graph, plan, validate=False)  # validated by to_pydot
    budget = f", budget {_mib(plan.budget_bytes)}" if plan.budget_bytes else ""
    return (f"{graph.name}: plan by {plan.planner}{budget}; predicted peak "
            f"{_mib(est.peak_bytes)}, +{est.overhead:.0%} compute")


def export_dot(plan: Plan, path: str | os.PathLike, *, graph: PlanGraph | None = None,
               **kwargs: Any) -> str:
    """Writes the plan picture to `path`: `.dot` always, `.png`/`.svg`/`.pdf`
    through Graphviz.

    Args:
        plan: The Plan.
        path: Output file; its extension picks the format.
        graph: The PlanGraph, when the plan does not carry one.
        **kwargs: Passed to `to_pydot`.

    Returns:
        `path`.

    Raises:
        RuntimeError: Graphviz's `dot` is missing for a rendered format; the
            message says how to install it.
        ValueError: unknown extension.

    Example:

    >>> tfremat.export_dot(tfremat.plan(model, budget_mb=600, batch_size=32), "plan.png")
    """
    path = os.fspath(path)
    fmt = picture_format(path)
    dot = to_pydot(plan.graph_or(graph), plan, **kwargs)
    if fmt in ("dot", "gv"):
        with open(path, "w") as f:
            f.write(dot.to_string())
        return path
    if not has_graphviz():
        raise RuntimeError(_NO_GRAPHVIZ.format(fmt=fmt.upper()))
    dot.write(path, format=fmt)
    return path


def write_picture(plan: Plan, path: str | os.PathLike, *,
                  graph: PlanGraph | None = None) -> str:
    """Writes what it can of the plan picture; never raises for a missing Graphviz.

    Where training must not stop for a picture (the `Planner` callback, the
    demo): without Graphviz's `dot`, a `.png`/`.svg`/`.pdf` request writes the
    `.dot` source beside it instead and warns with the fix.

    Args:
        plan: The Plan.
        path: Output file; its extension picks the format.
        graph: The PlanGraph, when the plan does not carry one.

    Returns:
        The path written.
    """
    path = os.fspath(path)
    if picture_format(path) in ("dot", "gv") or has_graphviz():
        return export_dot(plan, path, graph=graph)
    fallback = os.path.splitext(path)[0] + ".dot"
    export_dot(plan, fallback, graph=graph)
    warn(f"tfremat: wrote {fallback} instead of {path}: "
         + _NO_GRAPHVIZ.format(fmt=picture_format(path).upper()), RuntimeWarning)
    return fallback


def has_graphviz() -> bool:
    """Whether Graphviz's `dot` program is on PATH (needed for PNG/SVG/PDF)."""
    return shutil.which("dot") is not None


def picture_format(path: str) -> str:
    """The format a picture path asks for (`"dot"`, `"png"`, ...).

    Raises:
        ValueError: an extension tfremat cannot write.
    """
    fmt = os.path.splitext(path)[1].lstrip(".").lower()
    if fmt not in ("dot", "gv", "png", "svg", "pdf"):
        raise ValueError(f"Cannot export to {path!r}: use .dot, .png, .svg or .pdf.")
    return fmt


def summary(graph: PlanGraph | Plan, plan: Plan | None = None) -> str:
    """A `model.summary()`-like text of a plan: segments, offloads, estimates.

    Args:
        graph: The PlanGraph; or the Plan alone, when it carries its graph
            (`tfremat.summary(plan)`, the plan first as in `export_dot` and
            `plot_memory`).
        plan: A Plan for `graph`.

    Returns:
        The text `Plan.summary()` prints.

    Raises:
        PlanMismatchError: the plan was made for another graph.
        PlanValidationError: the plan is malformed for `graph`.
        TypeError: a graph without a plan.
        ValueError: a plan alone that carries no graph.

    Example:

    ```python
    plan = tfremat.plan(model, budget_mb=200, batch_size=16)
    text = tfremat.summary(plan)   # plan.summary() prints the same
    text = tfremat.summary(graph, plan)   # a plan read from JSON, with its graph
    ```
    """
    if plan is None:
        if not isinstance(graph, Plan):
            raise TypeError("tfremat.summary needs a plan: tfremat.summary(plan), or "
                            "tfremat.summary(graph, plan) for a plan that carries no graph.")
        graph, plan = graph.graph_or(None), graph
    plan = plan.for_graph(graph)
    plan.validate(graph)
    plain = simulate(graph)
    est = simulate(graph, plan, validate=False)
    shapes = graph.metadata.get("batch_shape") or [[None]]
    batch = f", batch {shapes[0][0]}" if shapes[0] and shapes[0][0] else ""
    lines = [f'Plan for "{graph.name}" by {plan.planner}{batch}', "=" * 72]
    if plan.budget_bytes:
        lines.append(f"Budget:          {_mib(plan.budget_bytes)} per device")
    details = plan.estimates.details if plan.estimates else {}
    replanned = details.get("replanned_for_bytes")
    if replanned:
        below = not plan.budget_bytes or replanned < plan.budget_bytes
        why = ("under the budget, to absorb what a training step measured above the "
               "plan's estimate" if below else
               "the lowest peak the planner predicts, above the budget: the measured "
               "peak decides")
        lines.append(f"Re-planned for:  {_mib(replanned)} ({why})")
    above = (" above the budget; chosen because it measured within it"
             if plan.budget_bytes and est.peak_bytes > plan.budget_bytes
             and details.get("measured_peak_bytes", math.inf) <= plan.budget_bytes else "")
    lines += [
        f"Predicted peak:  {_mib(est.peak_bytes)} (without plan {_mib(plain.peak_bytes)})"
        + above,
        f"Measured peak:   {_measured_line(plan)}",
        f"Extra compute:   +{est.overhead:.1%} of a step",
        f"Segments:        {len(plan.segments)}; offloaded tensors: {len(plan.offloaded)}",
        f"Updates:         {_updates_line(plan)}",
        "-" * 72,
    ]
    if plan.is_empty:
        lines.append("Nothing to recompute: the step fits as it is.")
    elif not (plan.segments or plan.offloaded):
        lines.append("Nothing to recompute or offload.")
    rows = [row for i, seg in enumerate(plan.segments)
            for row in _segment_rows(graph, seg, f"segment {i}")]
    if rows:
        width = max(12, *(len(label) + 2 for label, _ in rows))
        lines.append(f"{'recomputed':<{width}}{'layers':>6}  {'not kept':>11}  first .. last layer")
        lines += [f"{label:<{width}}{rest}" for label, rest in rows]
    if any(seg.children for seg in plan.segments):
        lines += ["(nested: recomputed again while the segment above it is recomputed,",
                  " so that one keeps fewer of its activations at once)"]
    for off in plan.offloaded:
        lines.append(f"offload     {off.tensor}  (prefetch after {off.prefetch_after})")
    lines.append("=" * 72)
    return "\n".join(lines)


def _segment_rows(graph: PlanGraph, seg: Segment, label: str,
                  depth: int = 0) -> list[tuple[str, str]]:
    """The summary's rows (label, the rest) of a segment, then of the segments
    nested in it (recomputed again while it is), indented."""
    dropped = graph.dropped_bytes(seg.nodes)
    nested = f", {len(seg.children)} nested" if seg.children else ""
    rows = [(label, f"{len(seg.nodes):>6}  {_mib(dropped):>11}"
                    f"  {seg.nodes[0]} .. {seg.nodes[-1]}{nested}")]
    for child in seg.children:
        rows += _segment_rows(graph, child, "  " * (depth + 1) + "nested", depth + 1)
    return rows


def _measured_line(plan: Plan) -> str:
    """What was measured of the plan before it was returned, if anything."""
    details = plan.estimates.details if plan.estimates else {}
    if "measured_peak_bytes" not in details:
        if "unmeasured" in details:
            return f"not measured ({details['unmeasured']})"
        return ("not measured (measure=True in tfremat.plan, --measure on the command "
                "line, measures it on the device)")
    tried = len(details.get("trials", []))
    return (f"{_mib(details['measured_peak_bytes'])} on the device"
            + (f" (chosen after {tried} measurements)" if tried > 1 else ""))


def _updates_line(plan: Plan) -> str:
    """Where the plan's optimizer updates run, and why not earlier if not, and
    whether the backward pass's order is pinned."""
    if plan.update_in_backward:
        return "in the backward pass (weight gradients freed as they are used)"
    line = "after the backward pass" + (f" ({plan.update_note})" if plan.update_note else "")
    if plan.pin_order:
        line += "; backward order pinned (each unit's weight gradients first)"
    return line


# `Plan.summary()` and `Plan.to_pydot()` draw with this module.
set_plan_views(sys.modules[__name__])
