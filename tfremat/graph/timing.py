"""Measured forward and backward time of each layer call, for cost models."""

from __future__ import annotations

import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfremat.core import PlanGraph, interrupts_deferred
from tfremat.graph.keras_graph import CallSite, walk


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()  # trace and warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def _random_inputs(graph: PlanGraph, site: CallSite, rng: np.random.Generator) -> dict:
    """Random tensors for the call's inputs, keyed by `id(KerasTensor)`."""
    values = {}
    for kt, ref in zip(site.input_tensors, site.inputs):
        info = graph.tensor(ref)
        if info.differentiable:
            value = tf.constant(rng.standard_normal(info.shape), dtype=info.dtype)
        else:
            value = tf.zeros(info.shape, dtype=info.dtype)
        values[id(kt)] = value
    return values


def measure_layer_times(model: keras.Model, graph: PlanGraph, *, repeats: int = 5) -> None:
    """Fills `seconds_forward` and `seconds_backward` of the graph's nodes.

    Each layer call runs alone, compiled with `tf.function`, on random inputs of
    its traced shapes, in training mode; backward time is the time of forward
    plus gradients (inputs and weights) minus the forward time. The layers'
    variables (BatchNorm statistics, dropout seeds) are restored afterwards.

    Args:
        model: The functional or Sequential model `graph` was extracted from.
        graph: Its PlanGraph; nodes of calls that cannot run alone keep None.
        repeats: Timed runs per call after a warm-up; the median counts.
    """
    rng = np.random.default_rng(0)
    for site in walk(model):
        if site.is_input or site.id not in graph:
            continue
        node = graph.node(site.id)
        layer = site.operation
        variables = list(getattr(layer, "variables", []))
        saved = [np.array(v.numpy()) for v in variables]
        inputs = _random_inputs(graph, site, rng)
        args, kwargs = site.node.arguments.fill_in(inputs)
        if getattr(layer, "_call_has_training_arg", False):
            kwargs = {**kwargs, "training": True}
        sources = [t for t in inputs.values() if t.dtype.is_floating]

        @tf.function
        def forward():
            return layer(*args, **kwargs)

        @tf.function
        def forward_backward():
            with tf.GradientTape() as tape:
                tape.watch(sources)
                out = layer(*args, **kwargs)
                total = tf.add_n([tf.reduce_sum(tf.cast(o, "float32"))
                                  for o in tf.nest.flatten(out)])
            return tape.gradient(total, sources + list(layer.trainable_weights))

        try:
            fwd = _median_seconds(forward, repeats)
            both = _median_seconds(forward_backward, repeats)
        except (TypeError, ValueError, tf.errors.OpError):
            continue  # a call that cannot run alone keeps its FLOP estimate
        finally:
            with interrupts_deferred():
                for v, value in zip(variables, saved):
                    v.assign(value)
        node.seconds_forward = fwd
        node.seconds_backward = max(both - fwd, 0.0)

