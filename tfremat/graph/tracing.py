"""Tracing one training step of a Keras model into a TensorFlow graph.

The step is the model's own `train_step` when the model is compiled (forward,
compiled loss, `tape.gradient`, optimizer update), otherwise a plain step with
a mean-square loss and SGD. While tracing, each call site's `call` is wrapped to
record the range of graph operations it creates (Keras name scopes are not
layer names: docs/how-it-works.md, "Tracing"), and `tf.GradientTape.gradient` is wrapped to find
where the backward pass starts and ends. The record describes the graph
`tf.function` keeps, also when it traces the step twice to create variables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from typing import Any, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfremat.backend import replicas_in_scope
from tfremat.core import UnsupportedModelError, check_count, warn
from tfremat.graph import costs
from tfremat.graph.keras_graph import CallSite, is_subclassed, walk_with_outputs
from tfremat.graph.training_state import forgetting_custom_gradients, stand_ins


@dataclasses.dataclass
class TracedStep:
    """A traced training step and where each layer call sits in it.

    Attributes:
        ops: Every operation of the step's graph, in creation order.
        sites: Call sites in execution order.
        ranges: For each call site id, `(start, end)` indices into `ops`: the
            operations it made, plus glue made just before it (casts, etc.).
        call_outputs: For each call site id, the graph tensors it returned.
        output_refs: References of the model's outputs.
        forward_end: Index of the first op after the last call (the loss starts).
        backward_start: Index of the first op of `tape.gradient`.
        backward_end: Index of the first op after `tape.gradient` (the update).
        input_specs: Specs of `(x, y)` the step was traced with.
        seconds: Time the trace took.
        replicas: `num_replicas_in_sync` of the `tf.distribute` strategy the
            step was traced through (1 outside a strategy's scope).
        optimizer_bytes: Bytes of the variables of the optimizer the step
            updates with, built (slots included); 0 when the model is not
            compiled.
    """

    ops: list[tf.Operation]
    sites: list[CallSite]
    ranges: dict[str, tuple[int, int]]
    call_outputs: dict[str, list[tf.Tensor]]
    output_refs: list[str]
    forward_end: int
    backward_start: int
    backward_end: int
    input_specs: Any
    seconds: float
    replicas: int = 1
    optimizer_bytes: int = 0


def batch_specs(model: keras.Model, *, batch_size: int | None = None,
                sample: Any = None) -> tuple[Any, Any]:
    """Static `(x_spec, y_spec)` of one training batch.

    Args:
        model: The Keras model.
        batch_size: Batch size, when shapes come from `model.inputs`; for a
            dataset whose batch dimension is unknown (`.batch(n)` without
            `drop_remainder`), the size of its first batch when None.
        sample: A batch `(x, y)` (arrays or tensors, nested structures allowed),
            an `x` alone, or a `tf.data.Dataset` of batches.

    Returns:
        Nested `tf.TensorSpec`s with a fully known batch dimension; y is None
        when it must be inferred from the model's outputs.

    Raises:
        TypeError: `batch_size` is not an integer.
        ValueError: `batch_size` is not positive, or the batch shape is unknown
            (an empty dataset).
    """
    if batch_size is not None:
        check_count(batch_size, "batch_size")
    if isinstance(sample, tf.data.Dataset):
        spec = sample.element_spec
        x_spec, y_spec = (spec[0], spec[1]) if isinstance(spec, tuple) and len(spec) >= 2 \
            else (spec, None)
        if batch_size is None and _unknown_batch(spec):
            batch_size = _first_batch_size(sample)
        return (_keys_sorted(_fix_batch(x_spec, batch_size, "the dataset's element_spec")),
                _fix_batch(y_spec, batch_size, "the dataset's element_spec"))
    if sample is not None:
        x, y = (sample[0], sample[1]) if isinstance(sample, tuple) and len(sample) >= 2 \
            else (sample, None)
        to_spec = lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(  # noqa: E731
            a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype))
        return (_keys_sorted(tf.nest.map_structure(to_spec, x)),
                None if y is None else tf.nest.map_structure(to_spec, y))
    if getattr(model, "inputs", None) is None:
        raise UnsupportedModelError(
            f"Model {model.name!r} has no known inputs (Keras records no input "
            "tensors for a subclassed model), so batch_size alone does not give the "
            "step's shapes. Pass sample=(x, y) with one training batch.")
    if batch_size is None:
        raise ValueError("Pass batch_size=... or sample=(x, y) to say the batch shape.")
    x_spec = [tf.TensorSpec((batch_size, *t.shape[1:]), t.dtype) for t in model.inputs]
    for spec, t in zip(x_spec, model.inputs):
        if not spec.shape.is_fully_defined():
            raise UnsupportedModelError(
                f"Input {t.name!r} has shape {t.shape}: tfremat needs static shapes. "
                "Pass sample=(x, y) with a real batch.")
    # A functional model given its inputs as a dict is called with a dict
    # (`model.inputs` lists them in the dict's flattened order).
    structure = getattr(getattr(model, "_functional", model), "_inputs_struct", None)
    if isinstance(structure, dict):
        return _keys_sorted(tf.nest.pack_sequence_as(structure, x_spec)), None
    return (x_spec[0] if len(x_spec) == 1 else x_spec), None


def _keys_sorted(structure: Any) -> Any:
    """`structure` with each dict's keys in sorted order: TensorFlow makes a
    traced step's placeholders in a dict's insertion order, and Keras lists
    `model.inputs` (and `tf.nest` flattens) in sorted order, so the graph pairs
    the model's inputs with the step's placeholders only when the two agree."""
    if isinstance(structure, dict):
        return {k: _keys_sorted(structure[k]) for k in sorted(structure)}
    if isinstance(structure, list):
        return [_keys_sorted(s) for s in structure]
    return structure


def _unknown_batch(spec: Any) -> bool:
    """Whether a tensor of a dataset's element spec has an unknown batch dimension."""
    return any(s.shape.rank and s.shape[0] is None for s in tf.nest.flatten(spec)
               if isinstance(s, tf.TensorSpec))


def _first_batch_size(dataset: tf.data.Dataset) -> int:
    """The batch dimension of a dataset's first element (a new iterator reads
    it: the caller's iteration is not advanced)."""
    for element in dataset.take(1):
        sizes = [int(t.shape[0]) for t in tf.nest.flatten(element)
                 if isinstance(t, tf.Tensor) and t.shape.rank]
        if sizes:
            return max(sizes)
    raise ValueError("The dataset gave no batch to learn the batch size from: pass "
                     "batch_size=...")


def _fix_batch(spec: Any, batch_size: int | None, where: str) -> Any:
    if spec is None:
        return None

    def fix(s: tf.TensorSpec) -> tf.TensorSpec:
        shape = s.shape.as_list()
        if shape and shape[0] is None:
            if batch_size is None:
                raise ValueError(f"The batch size is unknown in {where}: pass batch_size=...")
            shape[0] = batch_size
        if any(d is None for d in shape):
            raise UnsupportedModelError(
                f"A tensor of shape {s.shape} in {where} has unknown dimensions; "
                "tfremat needs static shapes.")
        return tf.TensorSpec(shape, s.dtype)

    return tf.nest.map_structure(fix, spec)


#: What tracing a step with the wrong target spec raises.
TRACE_ERRORS = (ValueError, TypeError, tf.errors.InvalidArgumentError)


def unbuilt_layers(model: keras.Model) -> list[str]:
    """Names of the model's layers not built yet (taken before a step is traced:
    the trace builds them)."""
    return [layer.name for layer in model._flatten_layers(include_self=False)
            if not layer.built]


def untraceable(model: keras.Model, errors: list[Exception],
                unbuilt: Sequence[str] = ()) -> UnsupportedModelError:
    """The error for a step no target spec traces with; `errors`, the error of
    each spec tried, in order (see `target_candidates`); `unbuilt`, the
    layers not built before (`unbuilt_layers`). An error that is not about
    shapes (the step's own, whatever its targets) is given alone; when every
    kind of target failed on shapes, each kind's error is listed with a hint
    to pass real targets."""
    own = [e for e in errors if not _about_shapes(e)]
    if own or len(errors) == 1:
        first = (own or errors)[0]
        hint = (f" Layers {', '.join(unbuilt[:5])}{', ...' if len(unbuilt) > 5 else ''} "
                "are not built (Keras's `model.build(shape)` builds no sublayers of a "
                "model without its own `build()`): call the model on a batch first, "
                "e.g. `model(x[:1])`." if unbuilt and "Unknown variable" in str(first)
                else "")
        return UnsupportedModelError(
            f"Could not trace a training step of {model.name!r}: {first}{hint}")
    hint = "Pass sample=(x, y) with a real batch so the targets' shape is known."
    tried = "\n".join(f"- with {kind} targets: {e}" for kind, e in zip(_TARGET_KINDS, errors))
    return UnsupportedModelError(
        f"Could not trace a training step of {model.name!r} with any kind of target "
        f"tried:\n{tried}\n{hint}")


def _about_shapes(error: Exception) -> bool:
    """Whether `error` (its last line: errors raised in a traced step carry the
    step's source lines first) is about the shapes of tensors."""
    lines = str(error).strip().splitlines()
    return bool(lines) and re.search(r"shape|[Dd]imension|rank", lines[-1]) is not None


#: What each spec of `target_candidates` is, in its order.
_TARGET_KINDS = ("output-shaped float", "sparse integer")


def target_candidates(model: keras.Model, x_spec: Any) -> list[Any]:
    """Target specs to try, in order, when the batch gives none: shaped like the
    model's outputs (float), then sparse labels (int32, the last axis dropped)."""
    return [_output_like_targets(model, x_spec), _sparse_targets(model, x_spec)]


def _output_like_targets(model: keras.Model, x_spec: Any) -> Any:
    out = model.compute_output_spec(
        tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype.name), x_spec))
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, "float32"), out)


def _sparse_targets(model: keras.Model, x_spec: Any) -> Any:
    out = model.compute_output_spec(
        tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype.name), x_spec))
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[:-1], "int32"), out)


#: The name scope each recorded call runs in (made unique by TensorFlow).
CALL_SCOPE = "tfremat_call"


class _Recorder:
    """Records layer calls and `GradientTape.gradient` while a step is traced.

    `tf.function` may run the Python step more than once to build one graph: when
    the first run creates variables (metrics, a dict of losses, an optimizer not
    built yet, a model loaded from `.keras`), it traces again and keeps only the
    last graph. Every run starts a new record (`start_trace`), so what remains
    describes the graph that was kept, and only calls made directly in that graph
    (not in a nested loop or branch body) are recorded. Each call runs in a name
    scope of its own, so that its ops and their gradient ops
    (`gradient_tape/<scope>/...`) can be told from other calls' by name.

    Attributes:
        graph: The graph of the last run.
        log: `(site id, start, end, outputs)` per layer call, in call order.
        grad_marks: `(start, end)` op counts around each `tape.gradient`
            not called from inside another.
        extra_calls: Layers called more often than the model's graph calls
            them: `name -> (calls, calls in the graph)`.
    """

    def __init__(self, sites_by_op: dict[int, list[str]], ops_of: dict[int, Any]) -> None:
        self._sites_by_op = sites_by_op
        self._ops_of = ops_of
        self._counters: dict[int, int] = {}
        self.graph: tf.Graph | None = None
        self.log: list[tuple[str, int, int, Any]] = []
        self.grad_marks: list[tuple[int, int]] = []
        self.extra_calls: dict[str, tuple[int, int]] = {}
        self._batch: int | None = None

    def start_trace(self, x: Any) -> None:
        """Forgets what an earlier run of the step recorded; `x` is the step's
        input in the new graph."""
        self.graph = tf.compat.v1.get_default_graph()
        first = next(iter(tf.nest.flatten(x)), None)
        self._batch = (first.shape[0] if isinstance(first, tf.Tensor) and first.shape.rank
                       else None)
        self._counters = {k: 0 for k in self._sites_by_op}
        self.log, self.grad_marks, self.extra_calls = [], [], {}

    def _op_count(self) -> int | None:
        """Ops in the traced graph so far; None inside a nested graph."""
        graph = tf.compat.v1.get_default_graph()
        return len(graph.get_operations()) if graph is self.graph else None

    def _record(self, key: int, start: int | None, out: Any) -> None:
        end = self._op_count()
        if start is None or end is None:
            return
        self._restore_batch(out)
        ids = self._sites_by_op[key]
        k = self._counters[key]
        self._counters[key] = k + 1
        if ids and k >= len(ids):
            self.extra_calls[self._ops_of[key].name] = (k + 1, len(ids))
            return
        self.log.append((ids[k] if ids else str(key), start, end, out))

    def _restore_batch(self, out: Any) -> None:
        """Gives a call's outputs back the batch's static size where the call lost
        it (ragged ops inside `TextVectorization`). A Keras layer's output leads
        with the batch; without its size, every tensor computed from the output,
        a recurrent layer's loop buffers included, would have no static size, so
        no bytes to plan. Only the traced graph's static shapes change."""
        if self._batch is None:
            return
        for t in tf.nest.flatten(out):
            if isinstance(t, tf.Tensor) and t.shape.rank and t.shape[0] is None:
                t.set_shape([self._batch] + t.shape.as_list()[1:])

    def check_one_forward_pass(self, model: keras.Model) -> None:
        """Raises if the step called a layer more often than the model's graph.

        Raises:
            UnsupportedModelError: a custom `train_step` ran the model (or some
                of its layers) more than once.
        """
        if not self.extra_calls:
            return
        name, (calls, in_graph) = next(iter(self.extra_calls.items()))
        raise UnsupportedModelError(
            f"The training step of {model.name!r} calls layer {name!r} {calls} times, "
            f"but the model's graph calls it {in_graph} time(s): the step runs the "
            "model (or some of its layers) more than once, as a custom train_step "
            "calling the model twice does. tfremat plans and rewrites one forward "
            "pass per step and cannot predict this step's memory.")

    def _wrap(self, key: int, original: Any) -> Any:
        """`original` (a bound `call`), recording each call it makes."""

        def call(*args, **kwargs):
            start = self._op_count()
            # A scope of its own names the call's gradient ops after it too;
            # a bare keras.ops call has no Keras scope.
            with tf.name_scope(CALL_SCOPE):
                out = original(*args, **kwargs)
            self._record(key, start, out)
            return out

        return call

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wraps the call sites' `call` and `GradientTape.gradient`."""
        for key, op in self._ops_of.items():
            op.call = self._wrap(key, op.call)
        original_gradient = tf.GradientTape.gradient

        depth = 0

        def gradient(tape, *args, **kwargs):
            # A gradient taken while computing another (the recompute of a
            # `keras.remat` or `tf.recompute_grad` inside the model) is part
            # of the outer one's range, not a backward pass of its own.
            nonlocal depth
            start = self._op_count()
            depth += 1
            try:
                result = original_gradient(tape, *args, **kwargs)
            finally:
                depth -= 1
            if start is not None and depth == 0:
                self.grad_marks.append((start, self._op_count()))
            return result

        tf.GradientTape.gradient = gradient
        try:
            yield
        finally:
            tf.GradientTape.gradient = original_gradient
            for op in self._ops_of.values():
                # Remove the instance attribute so the class's `call` shows through.
                if "call" in vars(op):
                    del op.call


def _default_step(model: keras.Model) -> Any:
    warn(f"tfremat: model {model.name!r} is not compiled, so its step is taken as a "
         "mean-square loss of its outputs with SGD (no optimizer slots); compile it "
         "with your loss and optimizer first to plan or measure your own step.")
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, "float32")))
                             for o in tf.nest.flatten(out)])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return step


def step_function(model: keras.Model) -> Any:
    """The Python training step tfremat traces and measures: `(x, y) -> logs`.

    The model's `train_step` when it is compiled with an optimizer, otherwise a
    mean-square loss of the outputs with SGD.
    """
    if getattr(model, "optimizer", None) is not None and model.compiled:
        if not model.optimizer.built:
            # Its slots are made where the weights were (a strategy's scope).
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        return lambda x, y: model.train_step((x, y))
    return _default_step(model)


def require_built(model: keras.Model, doing: str) -> None:
    """Refuses a model that has not made its variables yet.

    Built means the model's flag, or, for a subclassed model whose layers
    Keras's `fit` built without setting the model's flag, every layer's. The
    sublayers of a built layer are its own business: `TextVectorization`
    keeps a lookup layer it never builds.

    Raises:
        UnsupportedModelError: the model is not built.
    """
    layers = list(model._flatten_layers(include_self=False))
    if not (model.built or (layers and all(layer.built for layer in layers))):
        raise UnsupportedModelError(
            f"Model {model.name!r} is not built. Call it on a batch, or build it with "
            f"model.build(input_shape), before {doing}.")


def built_from_sample(model: keras.Model, batch: Any) -> None:
    """Builds an unbuilt model (or a subclassed one whose layers are not all
    built) from one batch `(x, y)`, arrays or specs, as Keras's `fit` builds
    it: its variables made in its strategy's scope, the compiled loss and
    metrics too. A built model is left alone."""
    if model.built and not (is_subclassed(model) and unbuilt_layers(model)):
        return
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=batch)


def trace(model: keras.Model, *, batch_size: int | None = None,
          sample: Any = None) -> TracedStep:
    """Traces one training step of `model` and locates its layer calls.

    Args:
        model: A built Keras model (functional, Sequential or subclassed), or
            one `sample` builds (a batch with targets), as `fit` would.
        batch_size: Batch size when shapes come from `model.inputs`.
        sample: One training batch `(x, y)`, or a `tf.data.Dataset`.

    Returns:
        A `TracedStep`.

    Raises:
        UnsupportedModelError: the model is not built, or cannot be traced.
    """
    if sample is not None:
        x_spec, y_spec = batch_specs(model, batch_size=batch_size, sample=sample)
        if y_spec is not None:
            built_from_sample(model, (x_spec, y_spec))
    require_built(model, "planning")
    if sample is None:
        x_spec, y_spec = batch_specs(model, batch_size=batch_size)
    subclassed = is_subclassed(model)
    if subclassed:
        # With no sublayers, the model's own call is the one unit: its step can
        # be predicted (and found to fit), though nothing can be recomputed.
        units = list(model._flatten_layers(include_self=False, recursive=False)) or [model]
        sites_by_op: dict[int, list[str]] = {id(u): [] for u in units}
        ops_of = {id(u): u for u in units}
        output_refs: list[str] = []
        sites: list[CallSite] = []
    else:
        sites, output_refs = walk_with_outputs(model)
        sites_by_op, ops_of = {}, {}
        for s in sites:
            if s.is_input:
                continue
            sites_by_op.setdefault(id(s.operation), []).append(s.id)
            ops_of[id(s.operation)] = s.operation
    replicas = replicas_in_scope()
    candidates = [y_spec] if y_spec is not None else target_candidates(model, x_spec)
    errors: list[Exception] = []
    unbuilt = unbuilt_layers(model)
    recorder = _Recorder(sites_by_op, ops_of)
    for y in candidates:
        started = time.perf_counter()
        # What the step would build (an unbuilt optimizer, the compiled loss
        # and metrics) are copies, built here as fit builds them: built in the
        # traced graph, which never runs, the user's loss and metrics would keep
        # uninitialised variables (a dict of losses' trackers), and a step that
        # builds traces twice; a built optimizer refuses variables it was not
        # built with (a layer unfrozen later). The traced step is only read.
        with forgetting_custom_gradients(), stand_ins(model) as replaced:
            trace_step = _in_replica_context(step_function(model))

            def recorded_step(x: Any, y: Any) -> Any:
                recorder.start_trace(x)
                return trace_step(x, y)

            try:
                if replaced:
                    model._symbolic_build(data_batch=(x_spec, y))
                with recorder.installed():
                    concrete = tf.function(recorded_step).get_concrete_function(x_spec, y)
            except UnsupportedModelError:
                raise
            except TRACE_ERRORS as e:
                errors.append(e)
                continue
            optimizer = getattr(model, "optimizer", None)
            optimizer_bytes = (costs.variable_bytes(optimizer.variables)
                               if optimizer is not None and model.compiled else 0)
        seconds = time.perf_counter() - started
        break
    else:
        raise untraceable(model, errors, unbuilt) from errors[-1]
    if recorder.graph is not concrete.graph:
        raise UnsupportedModelError(
            f"The traced step of {model.name!r} is not the graph its layer calls were "
            "recorded in; tfremat cannot map this model's layer calls to its graph.")
    recorder.check_one_forward_pass(model)
    if not recorder.grad_marks:
        raise UnsupportedModelError(
            f"The training step of {model.name!r} computes no gradients "
            "(tf.GradientTape.gradient was never called)"
            + (": the model has no trainable weights, so there is nothing to plan."
               if not model.trainable_weights else "."))
    log = recorder.log
    ops = concrete.graph.get_operations()
    if subclassed:
        sites, log = _name_dynamic_sites(ops_of, log)
    ranges, call_outputs = {}, {}
    previous_end = 0
    for site_id, start, end, out in log:
        ranges[site_id] = (min(previous_end, start), end)
        previous_end = end
        call_outputs[site_id] = [t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)]
    expected = [s.id for s in sites if not s.is_input]
    missing = [i for i in expected if i not in ranges]
    if missing:
        raise UnsupportedModelError(
            f"While tracing {model.name!r}, call sites {missing[:5]} did not run; "
            "tfremat cannot map this model's layer calls to its graph.")
    grad_start, grad_end = recorder.grad_marks[0]
    return TracedStep(
        ops=ops, sites=sites, ranges=ranges, call_outputs=call_outputs,
        output_refs=output_refs, forward_end=previous_end, backward_start=grad_start,
        backward_end=grad_end, input_specs=(x_spec, y), seconds=seconds,
        replicas=replicas, optimizer_bytes=optimizer_bytes)


def _in_replica_context(step: Any) -> Any:
    """`step`, made traceable inside a `tf.distribute.Strategy.scope()`.

    Outside a scope the step is traced as it is. Inside one (the cross-replica
    context) a `DistributedVariable` has no handle, so the step is run through
    `strategy.run`, as a custom training loop runs it: the traced graph is one
    replica's step on its batch, with the strategy's gradient all-reduce. That
    needs one replica on this worker (`MultiWorkerMirroredStrategy` with one
    device per worker); with several, `strategy.run` would trace the step once
    per replica.

    Raises:
        UnsupportedModelError: the scope's strategy has several local replicas.
    """
    if not tf.distribute.in_cross_replica_context():
        return step
    strategy = tf.distribute.get_strategy()
    local = len(strategy.extended.worker_devices)
    if local != 1:
        raise UnsupportedModelError(
            f"tfremat traces one replica's training step, but this "
            f"{type(strategy).__name__} has {local} replicas on this worker. Plan "
            "outside `strategy.scope()` with the per-replica batch (global batch // "
            f"{strategy.num_replicas_in_sync}): `plan = tfremat.plan(model, budget_mb, "
            "batch_size=...)`, then rewrite and compile inside the scope: "
            "`tfremat.rewrite(model, plan)`; or use tfremat.Planner in fit.")
    return lambda x, y: strategy.run(step, args=(x, y))


def _name_dynamic_sites(ops_of: dict[int, Any],
                        log: list[tuple[str, int, int, Any]]
                        ) -> tuple[list[CallSite], list[tuple[str, int, int, Any]]]:
    """Call sites of a subclassed model, named from the order calls ran."""
    calls: dict[str, int] = {}
    for key, *_ in log:
        calls[key] = calls.get(key, 0) + 1
    seen: dict[str, int] = {}
    sites, named = [], []
    for key, start, end, out in log:
        layer = ops_of[int(key)]
        k = seen.get(key, 0)
        seen[key] = k + 1
        site_id = layer.name if calls[key] == 1 else f"{layer.name}@{k}"
        sites.append(CallSite(id=site_id, layer_key=layer.name, operation=layer))
        named.append((site_id, start, end, out))
    return sites, named
