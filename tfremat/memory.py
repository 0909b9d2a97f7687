"""Measured peak memory of a training step, as TensorFlow's allocator reports it."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from typing import Any, Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from tfremat.backend import (NO_STATS_HINT, device_name, replicas_in_scope, require_tensorflow,
                             step_compilation)
from tfremat.core import UnsupportedModelError, interrupts_deferred
from tfremat.graph import (TRACE_ERRORS, batch_specs, forgetting_custom_gradients,
                           require_built, stand_ins, step_function, target_candidates,
                           unbuilt_layers, untraceable)

logger = logging.getLogger("tfremat")


@dataclasses.dataclass(frozen=True)
class MeasuredPeak:
    """A measured training-step peak.

    Attributes:
        device: The device measured, `"GPU:0"` or `"CPU:0"`.
        peak_bytes: `get_memory_info(device)["peak"]` over the measured steps:
            everything allocated on the device, weights and optimizer included.
        start_bytes: Bytes in use just before the step ran.

    Example:

    >>> result = tfremat.measure_peak(model, batch_size=32, return_details=True)
    >>> print(f"{result.peak_mb:.0f} MiB on {result.device}, "
    ...       f"{result.step_bytes / 2**20:.0f} MiB added by the step")
    """

    device: str
    peak_bytes: int
    start_bytes: int

    @property
    def step_bytes(self) -> int:
        """What the step itself added on top of what was already allocated."""
        return self.peak_bytes - self.start_bytes

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20


def _memory_info(device: str) -> dict[str, int]:
    try:
        return tf.config.experimental.get_memory_info(device)
    except ValueError as e:
        raise RuntimeError(
            f"TensorFlow keeps no allocator statistics for {device} ({e}), so its "
            f"memory cannot be measured. {NO_STATS_HINT}") from e


def measure_step(run: Callable[[], Any], *, device: str | None = None,
                 repeats: int = 2) -> MeasuredPeak:
    """Measures the peak memory of `run()`, a function running one step.

    `run` is called once first (tracing and first-use allocations), then
    `repeats` times, each after `reset_memory_stats`; the largest peak counts.

    Args:
        run: Runs one training step.
        device: Device to read; default `device_name()`.
        repeats: Measured runs after the warm-up.

    Returns:
        A `MeasuredPeak`.

    Example:

    >>> step = tf.function(lambda: model.train_on_batch(x, y))
    >>> tfremat.measure_step(step).peak_mb
    """
    device = device or device_name()
    run()
    peak, start = 0, 0
    for _ in range(max(1, repeats)):
        current = _memory_info(device)["current"]
        tf.config.experimental.reset_memory_stats(device)
        run()
        info = _memory_info(device)
        if info["peak"] >= peak:
            peak, start = info["peak"], current
    return MeasuredPeak(device=device, peak_bytes=int(peak), start_bytes=int(start))


def synthetic_batch(spec: Any, seed: int = 0) -> Any:
    """A batch of random tensors matching a nest of `tf.TensorSpec`s.

    The tensors are made by TensorFlow ops, so they live in TensorFlow's
    allocator and count in its peak, as a real batch does. (A tensor made from
    a NumPy array may share the array's memory instead, depending on its
    alignment, and then does not count.)
    """

    def make(s: tf.TensorSpec) -> tf.Tensor:
        if s.dtype.is_floating:
            return tf.random.stateless_normal(s.shape, seed=(seed, 0), dtype=s.dtype)
        return tf.zeros(s.shape, dtype=s.dtype)

    return tf.nest.map_structure(make, spec)


def allocator_copy(arrays: Any) -> Any:
    """A nest of arrays copied by a TensorFlow op, so that the copies live in
    TensorFlow's allocator and count in its peak, as a real batch does (a
    tensor converted from a NumPy array may share the array's memory instead).
    """
    return tf.nest.map_structure(
        lambda a: tf.raw_ops.DeepCopy(x=tf.convert_to_tensor(a)), arrays)


def _given_batch(sample: Any) -> tuple[Any, Any] | None:
    """The `(x, y)` arrays of a concrete sample batch, `allocator_copy`'d;
    None for a dataset, a missing sample or one without targets."""
    if sample is None or isinstance(sample, tf.data.Dataset) or not (
            isinstance(sample, tuple) and len(sample) >= 2 and sample[1] is not None):
        return None
    return allocator_copy(sample[0]), allocator_copy(sample[1])


@contextlib.contextmanager
def _creating_no_variables(model: keras.Model) -> Iterator[None]:
    """Makes creating a variable an error: the step must find all its state built.

    Raises:
        UnsupportedModelError: something in the block created a variable
            (whatever TensorFlow or Keras wrapped the refusal in on its way out).
    """
    refused: list[str] = []

    def error() -> UnsupportedModelError:
        return UnsupportedModelError(
            f"The training step of {model.name!r} creates a variable ({refused[0]}) "
            "when it runs, and measure_peak never builds anything on a model. Build "
            "that state first (call the model on a batch, or train one step).")

    def refuse(next_creator: Callable[..., tf.Variable], **kwargs: Any) -> tf.Variable:
        refused.append(kwargs.get("name") or "unnamed")
        raise error()

    try:
        with tf.variable_creator_scope(refuse):
            yield
    except Exception as e:
        if refused and not isinstance(e, UnsupportedModelError):
            raise error() from e
        raise


def _step_variables(model: keras.Model, concrete: Any) -> list[tf.Variable]:
    """Every variable the traced step can read or write.

    TensorFlow records each variable a function's graph accesses, whether Keras
    tracks it or not (a plain `tf.Variable` on a layer counts). A captured
    variable handle that no recorded variable owns (used through raw ops) could
    not be restored, so it is refused before anything runs.
    """
    variables = {id(v): v for v in concrete.graph.variables}
    owned = {id(v.handle) for v in variables.values()}
    unknown = [h for h in concrete.captured_inputs
               if h.dtype == tf.resource and id(h) not in owned
               and bool(tf.raw_ops.VarIsInitializedOp(resource=h))]
    if unknown:
        raise UnsupportedModelError(
            f"The training step of {model.name!r} uses {len(unknown)} variable(s) through "
            "raw handles that TensorFlow does not record as accessed variables, so "
            "measure_peak could not restore them; it ran nothing. Use the tf.Variable "
            "itself (read_value/assign) in the step.")
    return list(variables.values())


class _Values:
    """Exact copies (in host memory, outside TensorFlow's allocator) of variables."""

    def __init__(self, variables: list[tf.Variable]) -> None:
        self.pairs = [(v, np.array(v.numpy(), copy=True)) for v in variables]

    def restore(self) -> None:
        # From an allocator copy: a variable assigned a NumPy array can keep the
        # array's memory, outside the allocator's statistics (on CPU, 3.5 of
        # DenseNet121's 26.9 MiB of weights no longer counted after one
        # measurement, 8.6 after three). A GPU copies it into its own
        # allocator either way.
        with interrupts_deferred():  # every one, even when Ctrl-C comes halfway
            for v, value in self.pairs:
                v.assign(allocator_copy(value))


def _measure_traced(step: Any, concrete: Any, model: keras.Model, x: Any, y: Any,
                    repeats: int) -> MeasuredPeak:
    """Measures `step(x, y)` and gives back every variable it touched, even on error."""
    values = _Values(_step_variables(model, concrete))
    try:
        return measure_step(lambda: step(x, y), repeats=repeats)
    finally:
        values.restore()


def require_measurable_scope(what: str = "tfremat.measure_peak") -> None:
    """Raises RuntimeError inside the scope of a `tf.distribute` strategy with
    several replicas: a measured step runs outside `strategy.run`, where the
    strategy's distributed variables cannot be updated (TensorFlow's error
    would be "DistributedVariable.handle is not available outside the replica
    context")."""
    replicas = replicas_in_scope()
    if replicas > 1:
        raise RuntimeError(
            f"{what} runs training steps outside strategy.run, so it cannot measure "
            f"inside the scope of a tf.distribute strategy with {replicas} replicas, "
            "whose variables are distributed. Measure a model built outside the "
            f"scope, with the per-replica batch (global batch // {replicas}); under "
            "MultiWorkerMirroredStrategy plan by prediction (measure=False), as "
            "examples/multi_worker.py does.")


def measure_peak(model: keras.Model, *, batch_size: int | None = None,
                 sample: Any = None, repeats: int = 2,
                 return_details: bool = False) -> int | MeasuredPeak:
    """Runs training steps of `model` and returns the device's measured peak.

    The measurement has no effect on the model: every variable the traced step
    touches (weights, BatchNorm statistics, dropout seeds, optimizer slots and
    iterations, metric variables, and `tf.Variable`s Keras does not track) is
    restored bit for bit afterwards, also when a step raises or is interrupted.
    Nothing is built or left behind either: an optimizer or compiled loss and
    metrics that a first `fit` would build are replaced, for the measurement,
    by fresh copies that are built and then dropped (the peak includes them, as
    it would in `fit`), so a later `fit` trains exactly as if `measure_peak` had
    never run. The device (`"GPU:0"` if present, else `"CPU:0"`) is logged on
    the `"tfremat"` logger.

    Args:
        model: A built Keras model; compiled models run their own `train_step`.
        batch_size: Batch size, when shapes come from `model.inputs`.
        sample: One batch `(x, y)`, whose values the measured steps use (token
            ids and masks change what a step computes), or a `tf.data.Dataset`
            or an `x` alone, for whose shapes random data is made.
        repeats: Measured steps after a warm-up step.
        return_details: Return a `MeasuredPeak` instead of bytes.

    Returns:
        Peak bytes of the device during a step, or a `MeasuredPeak`.

    Raises:
        UnsupportedModelError: the model is not built; its step cannot be traced
            with any target shape tried; or its step would create variables or
            uses variables that could not be restored (then nothing ran).
        RuntimeError: called in the scope of a `tf.distribute` strategy with
            several replicas.

    Example:

    >>> tfremat.measure_peak(model, batch_size=32) / 2**20   # MiB
    """
    require_tensorflow()
    require_measurable_scope()
    require_built(model, "measuring")
    x_spec, y_spec = batch_specs(model, batch_size=batch_size, sample=sample)
    candidates = [y_spec] if y_spec is not None else target_candidates(model, x_spec)
    # As the model's own train step compiles (a model `tfremat.rewrite` made
    # compiles its segments on their own under XLA).
    jit, traced_within = step_compilation(model)
    given = _given_batch(sample)
    x = given[0] if given else synthetic_batch(x_spec, 1)
    try:
        with forgetting_custom_gradients(), traced_within:
            result = _trace_and_measure(model, x, x_spec, given, candidates, jit, repeats)
    finally:
        gc.collect()  # the measured step's graph and its stand-ins, in reference cycles
    logger.info("Measured peak of %s on %s: %.1f MiB (the step added %.1f MiB).",
                model.name, result.device, result.peak_mb, result.step_bytes / 2**20)
    return result if return_details else result.peak_bytes


def _trace_and_measure(model: keras.Model, x: Any, x_spec: Any, given: Any,
                       candidates: list[Any], jit: bool, repeats: int) -> MeasuredPeak:
    """Traces the step for the first target spec that works and measures it."""
    errors: list[Exception] = []
    unbuilt = unbuilt_layers(model)
    for y_spec in candidates:
        y = given[1] if given else synthetic_batch(y_spec, 2)
        # Each target spec gets its own copies and tf.function: a failed trace
        # leaves nothing half-built for the next one.
        with stand_ins(model) as replaced:
            try:
                if replaced:  # as fit builds them, in the model's strategy's scope
                    with model.distribute_strategy.scope():
                        model._symbolic_build(data_batch=(x, y))
                step = tf.function(step_function(model), jit_compile=jit)
                with _creating_no_variables(model):
                    concrete = step.get_concrete_function(x_spec, y_spec)
            except UnsupportedModelError:
                raise
            except TRACE_ERRORS as e:
                errors.append(e)
                continue
            with _creating_no_variables(model):
                return _measure_traced(step, concrete, model, x, y, repeats)
    raise untraceable(model, errors, unbuilt) from errors[-1]
