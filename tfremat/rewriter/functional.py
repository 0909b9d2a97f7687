"""Rebuilding a functional or Sequential model with recompute segments.

Each Keras Node of the original model is replayed on its own layer object
(`node.arguments.fill_in`, as `Functional._run_through_graph` does), so the new
model shares every layer and weight with the original. The nodes of a segment
are replayed into a functional sub-model instead, wrapped in one
`RecomputeSegment` layer; nested segments are sub-models inside it. With
updates in the backward pass, each other call with trainable weights is
wrapped in an `UpdateUnit` the same way.

With host offload (`OffloadSettings`), each offloaded tensor gets a `HostCopy`
after the unit making it, each top-level unit reading it (a layer call or a
segment) becomes an `OffloadUnit` taking the host copy too, and each prefetch
trigger's inputs pass through a `GradientSignal`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import keras
from keras import tree

from tfremat.core import Segment, UnsupportedModelError
from tfremat.graph import CallSite, as_functional
from tfremat.rewriter.backward_updates import BackwardUpdates
from tfremat.rewriter.offload import GradientSignals
from tfremat.rewriter.offload_layers import GradientSignal, HostCopy, OffloadUnit
from tfremat.rewriter.segment_layer import RecomputeSegment
from tfremat.rewriter.update_layer import UpdateUnit


#: What a rewritten model's name adds to its original's.
REWRITTEN_SUFFIX = "_recompute"


@dataclasses.dataclass
class OffloadSettings:
    """What the rebuild offloads, and where.

    Attributes:
        prefetch_after: Prefetch trigger node id (or None) of each offloaded
            tensor reference.
        compute_device: Device of the model's compute, e.g. `"/GPU:0"`.
        host_device: Device of the host copies, e.g. `"/CPU:0"`.
        signals: The prefetch triggers' gradients, shared by the model's
            offload layers.
    """

    prefetch_after: dict[str, str | None]
    compute_device: str
    host_device: str
    signals: GradientSignals = dataclasses.field(default_factory=GradientSignals)


class _Rebuild:
    """State of one rebuild: the original call sites and who reads what."""

    def __init__(self, sites: Sequence[CallSite], output_refs: Sequence[str],
                 taken_names: set[str], offload: OffloadSettings | None,
                 updates: BackwardUpdates | None = None) -> None:
        self.sites = {s.id: s for s in sites}
        self.order = {s.id: i for i, s in enumerate(sites)}
        self.symbolic = {f"{s.id}:{i}": t
                         for s in sites for i, t in enumerate(s.output_tensors)}
        self.readers: dict[str, set[str]] = {}
        for s in sites:
            for ref in s.inputs:
                self.readers.setdefault(ref, set()).add(s.id)
        self.model_outputs = set(output_refs)
        self.taken_names = taken_names
        self.offload = offload or OffloadSettings({}, "", "")
        self.triggers = {t for t in self.offload.prefetch_after.values() if t is not None}
        self.host: dict[str, Any] = {}
        self.updates = updates

    def unique_name(self, name: str) -> str:
        """`name` made a valid Keras layer name (the ids of shared calls, such
        as `dense@1`, and references, `dense:0`, are not) and unique in the
        rewritten model."""
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        candidate, k = name, 1
        while candidate in self.taken_names:
            candidate, k = f"{name}_{k}", k + 1
        self.taken_names.add(candidate)
        return candidate

    def boundary(self, node_ids: set[str]) -> tuple[list[str], list[str]]:
        """The refs a node set reads from outside and those read after it."""
        ordered = sorted(node_ids, key=self.order.__getitem__)
        inputs = list(dict.fromkeys(
            ref for n in ordered for ref in self.sites[n].inputs
            if ref.rsplit(":", 1)[0] not in node_ids))
        outputs = [
            f"{n}:{i}" for n in ordered
            for i in range(len(self.sites[n].output_tensors))
            if f"{n}:{i}" in self.model_outputs
            or self.readers.get(f"{n}:{i}", set()) - node_ids
        ]
        return inputs, outputs

    def run(self, node_ids: list[str], segments: Sequence[Segment],
            env: dict[str, Any], prefix: str, top: bool = False) -> None:
        """Replays `node_ids` (segments as units) on the tensors in `env`;
        at the `top` level, units reading offloaded tensors become offload
        units and offloaded tensors get host copies."""
        if top:
            self.copy_to_host(env)
        in_segment = {n for seg in segments for n in seg.nodes}
        units: list[Any] = list(segments)
        units += [n for n in node_ids if n not in in_segment]
        node_sets = [set(u.nodes) if isinstance(u, Segment) else {u} for u in units]
        pending = sorted(range(len(units)),
                         key=lambda k: min(self.order[n] for n in node_sets[k]))
        while pending:
            for pos, k in enumerate(pending):
                needs, _ = self.boundary(node_sets[k])
                if all(ref in env for ref in needs):
                    break
            else:
                raise UnsupportedModelError(
                    f"Cannot order the layer calls {sorted(node_sets[pending[0]])}: "
                    "their inputs are never computed.")
            pending.pop(pos)
            unit = units[k]
            if top and any(ref in self.offload.prefetch_after for ref in needs):
                self.run_offload_unit(unit, env, f"offload_{prefix}_{k}")
            elif isinstance(unit, Segment):
                self.run_segment(unit, env, f"{prefix}_{k}", self.updates if top else None)
            elif (top and self.updates is not None and unit not in self.triggers
                  and getattr(self.sites[unit].operation, "trainable_variables", None)):
                self.run_update_unit(unit, env, f"update_{unit}")
            else:
                self.replay(self.sites[unit], env)
            if top:
                self.copy_to_host(env)

    def copy_to_host(self, env: dict[str, Any]) -> None:
        """Adds a `HostCopy` of each offloaded tensor of `env` not copied yet."""
        for ref in self.offload.prefetch_after:
            if ref in env and ref not in self.host:
                name = self.unique_name(f"host_copy_{ref}")
                self.host[ref] = HostCopy(self.offload.host_device, name=name)(env[ref])

    def replay(self, site: CallSite, env: dict[str, Any]) -> None:
        """Calls the site's layer on the tensors of `env`, as its node did."""
        values = {ref: env[ref] for ref in site.inputs}
        if site.id in self.triggers:
            name = self.unique_name(f"prefetch_trigger_{site.id}")
            signalled = GradientSignal(self.offload.signals, site.id, name=name)(
                list(values.values()))
            values = dict(zip(values, signalled))
        filled = {id(t): values[ref] for t, ref in zip(site.input_tensors, site.inputs)}
        args, kwargs = site.node.arguments.fill_in(filled)
        outputs = tree.flatten(site.operation(*args, **kwargs))
        for i, t in enumerate(outputs):
            env[f"{site.id}:{i}"] = t

    def run_segment(self, segment: Segment, env: dict[str, Any], name: str,
                    updates: BackwardUpdates | None = None) -> None:
        """Replays a segment as one `RecomputeSegment` call (updating its own
        weights in its gradient function when `updates` is given)."""
        name = self.unique_name(name)
        submodel, inputs, outputs = self.submodel(segment, name)
        layer = RecomputeSegment(submodel, updates, name=name)
        results = layer([env[ref] for ref in inputs])
        for ref, t in zip(outputs, results):
            env[ref] = t

    def run_update_unit(self, node_id: str, env: dict[str, Any], name: str) -> None:
        """Replays one call as an `UpdateUnit`, whose gradient function
        applies the optimizer's update to the call's own weights."""
        name = self.unique_name(name)
        submodel, inputs, outputs = self.submodel(Segment([node_id]), name)
        results = UpdateUnit(submodel, self.updates, name=name)([env[ref] for ref in inputs])
        for ref, t in zip(outputs, results):
            env[ref] = t

    def run_offload_unit(self, unit: Segment | str, env: dict[str, Any],
                         name: str) -> None:
        """Replays a segment or one call reading offloaded tensors as one
        `OffloadUnit` call, given the host copies of those tensors."""
        name = self.unique_name(name)
        segment = unit if isinstance(unit, Segment) else Segment([unit])
        submodel, inputs, outputs = self.submodel(segment, name)
        offloaded = [i for i, ref in enumerate(inputs) if ref in self.host]
        layer = OffloadUnit(
            submodel, offloaded,
            [self.offload.prefetch_after[inputs[i]] for i in offloaded],
            self.offload.compute_device, self.offload.signals, name=name)
        results = layer([env[ref] for ref in inputs]
                        + [self.host[inputs[i]] for i in offloaded])
        for ref, t in zip(outputs, results):
            env[ref] = t

    def submodel(self, segment: Segment,
                 name: str) -> tuple[keras.Model, list[str], list[str]]:
        """The segment's calls as a functional sub-model, with the references
        of its inputs and outputs."""
        node_ids = set(segment.nodes)
        inputs, outputs = self.boundary(node_ids)
        if not outputs:
            raise UnsupportedModelError(
                f"Segment {segment.nodes} computes nothing that the model uses.")
        local = {}
        for ref in inputs:
            spec = self.symbolic[ref]
            local[ref] = keras.Input(batch_shape=spec.shape, dtype=spec.dtype,
                                     sparse=spec.sparse,
                                     name=self.unique_name(f"{name}_input"))
        sub_inputs = [local[ref] for ref in inputs]
        ordered = sorted(node_ids, key=self.order.__getitem__)
        self.run(ordered, segment.children, local, name)
        submodel = keras.Model(sub_inputs, [local[ref] for ref in outputs],
                               name=f"{name}_graph")
        return submodel, inputs, outputs


def rebuild(model: keras.Model, sites: Sequence[CallSite],
            output_refs: Sequence[str], segments: Sequence[Segment],
            offload: OffloadSettings | None = None,
            updates: BackwardUpdates | None = None,
            keep_class: bool = True) -> keras.Model:
    """A new functional model sharing `model`'s layers, with recompute segments
    and host offload.

    Args:
        model: A functional or Sequential model.
        sites: Its call sites (`walk`), in execution order.
        output_refs: References of its outputs, in `model.outputs` order.
        segments: Validated top-level recompute segments.
        offload: The validated offloads, or None.
        updates: With updates in the backward pass: what the update units
            share. Each top-level segment and each other call with trainable
            weights (offload units and prefetch triggers aside) then updates
            its own weights in its gradient function.
        keep_class: Whether the new model is of `model`'s class when that
            class has its own training methods (`of_own_class`).

    Returns:
        A new `keras.Model` with the same inputs structure and outputs
        structure, the same layer objects and weights.
    """
    functional = as_functional(model)
    taken = {s.operation.name for s in sites} | {s.layer_key for s in sites}
    state = _Rebuild(sites, output_refs, taken, offload, updates)
    env: dict[str, Any] = {}
    for s in sites:
        if s.is_input:
            env[f"{s.id}:0"] = s.output_tensors[0]
    state.run([s.id for s in sites if not s.is_input], segments, env, "recompute",
              top=True)
    flat = [env[ref] for ref in output_refs]
    rewritten = keras.Model(functional._inputs_struct,
                            tree.pack_sequence_as(functional._outputs_struct, flat),
                            name=model.name + REWRITTEN_SUFFIX)
    renamed = _named_outputs(flat, rewritten, functional.output_names)
    if renamed is not None:
        rewritten = keras.Model(functional._inputs_struct,
                                tree.pack_sequence_as(functional._outputs_struct, renamed),
                                name=model.name + REWRITTEN_SUFFIX)
    return of_own_class(model, rewritten) if keep_class else rewritten


#: Methods by which a model's class decides how it trains, evaluates and predicts.
TRAINING_METHODS = ("train_step", "test_step", "predict_step", "compute_loss",
                    "compute_metrics")


def of_own_class(model: keras.Model, rewritten: keras.Model) -> keras.Model:
    """`rewritten` (a `keras.Model`), or its graph as an object of `model`'s
    class when that class has its own `TRAINING_METHODS` (a custom
    `train_step`, as Keras's guide to customizing `fit` makes them), so that
    the rewritten model trains as the user's does.

    Raises:
        UnsupportedModelError: the class has its own training methods and
            cannot be made from `inputs`, `outputs` and `name`.
    """
    cls = type(model)
    own = [m for m in TRAINING_METHODS
           if getattr(cls, m, None) is not getattr(keras.Model, m, None)]
    if not own:
        return rewritten
    if isinstance(model, keras.Sequential):
        raise UnsupportedModelError(
            f"{model.name!r} is a {cls.__name__}, whose own {', '.join(own)} the "
            "rewritten model must keep, but a rewritten model is functional, which a "
            "subclass of keras.Sequential cannot be. Use tfremat.Planner in fit, which "
            "runs the plan inside your model.")
    try:
        return cls(inputs=rewritten._inputs_struct, outputs=rewritten._outputs_struct,
                   name=rewritten.name)
    except Exception as e:  # its constructor takes other arguments
        raise UnsupportedModelError(
            f"{model.name!r} is a {cls.__name__}, whose own {', '.join(own)} the "
            f"rewritten model must keep, but {cls.__name__}(inputs=..., outputs=..., "
            f"name=...) failed ({type(e).__name__}: {e}). Give its constructor those "
            "arguments, or use tfremat.Planner in fit, which runs the plan inside your "
            "model.") from e


def _named_outputs(flat: list[Any], rewritten: keras.Model,
                   names: list[str]) -> list[Any] | None:
    """The rewritten model's outputs, each made by a layer of the original
    output's name, or None when they already are (or cannot be).

    Keras names a model's outputs (`output_names`: the keys of a dict of
    losses or metrics, the names in `History`) after the layers that make them,
    and a recompute segment or unit made the original layer's output inside
    it. An `Identity` layer (no copy) takes the original name back, unless two
    outputs share a name or the name is a layer of the rewritten model.
    """
    if rewritten.output_names == names or len(set(names)) < len(names):
        return None
    taken = {layer.name for layer in rewritten.layers}
    pairs = list(zip(flat, rewritten.output_names, names))
    if any(new != old and old in taken for _, new, old in pairs):
        return None
    return [t if new == old else keras.layers.Identity(name=old)(t) for t, new, old in pairs]
