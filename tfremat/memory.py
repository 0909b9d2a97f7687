"""Measured peak memory of a training step, as TensorFlow's allocator reports it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfremat.backend import require_tensorflow
from tfremat.graph import (TRACE_ERRORS, batch_specs, step_function,
                                 target_candidates, untraceable)

logger = logging.getLogger("tfremat")


@dataclasses.dataclass(frozen=True)
class MeasuredPeak:
    """A measured training-step peak.

    Attributes:
        device: The device measured, `"GPU:0"` or `"CPU:0"`.
        peak_bytes: `get_memory_info(device)["peak"]` over the measured steps:
            everything allocated on the device, weights and optimizer included.
        start_bytes: Bytes in use just before the step ran.
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


def device_name() -> str:
    """The device tfremat budgets: `"GPU:0"` when a GPU exists, else `"CPU:0"`."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def _memory_info(device: str) -> dict[str, int]:
    try:
        return tf.config.experimental.get_memory_info(device)
    except ValueError as e:
        raise RuntimeError(
            f"TensorFlow keeps no allocator statistics for {device} ({e}). On CPU they "
            "need oneDNN (do not set TF_ENABLE_ONEDNN_OPTS=0) or "
            "TF_CPU_ALLOCATOR_USE_BFC=1.") from e


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


class _StateSnapshot:
    """Values of a model's and its optimizer's variables, to undo measured steps."""

    def __init__(self, model: keras.Model) -> None:
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables)
        if optimizer is not None:
            variables += list(optimizer.variables)
        variables += [v for m in getattr(model, "metrics", []) for v in m.variables]
        self.pairs = [(v, np.array(v.numpy())) for v in variables]

    def restore(self) -> None:
        for v, value in self.pairs:
            v.assign(value)


def _traceable_targets(model: keras.Model, step: Any, x_spec: Any) -> Any:
    """The first of `target_candidates` the step traces with. The trace is the
    one the measurement runs, so inferring the targets costs no extra trace."""
    error: Exception | None = None
    for y_spec in target_candidates(model, x_spec):
        try:
            step.get_concrete_function(x_spec, y_spec)
            return y_spec
        except TRACE_ERRORS as e:
            error = e
    raise untraceable(model, error) from error


def measure_peak(model: keras.Model, *, batch_size: int | None = None,
                 sample: Any = None, repeats: int = 2,
                 return_details: bool = False) -> int | MeasuredPeak:
    """Runs training steps of `model` and returns the device's measured peak.

    The model's weights, optimizer state and metrics are restored afterwards: the
    measurement does not train the model. The device (`"GPU:0"` if present, else
    `"CPU:0"`) is logged on the `"tfremat"` logger.

    Args:
        model: A built Keras model; compiled models run their own `train_step`.
        batch_size: Batch size, when shapes come from `model.inputs`.
        sample: One batch `(x, y)` or a `tf.data.Dataset`; random data of its
            shapes is used.
        repeats: Measured steps after a warm-up step.
        return_details: Return a `MeasuredPeak` instead of bytes.

    Returns:
        Peak bytes of the device during a step, or a `MeasuredPeak`.

    Example:

    >>> tfremat.measure_peak(model, batch_size=32) / 2**20   # MiB
    """
    require_tensorflow()
    x_spec, y_spec = batch_specs(model, batch_size=batch_size, sample=sample)
    jit = getattr(model, "jit_compile", False) is True
    step = tf.function(step_function(model), jit_compile=jit)
    if y_spec is None:
        y_spec = _traceable_targets(model, step, x_spec)
    x, y = synthetic_batch(x_spec, 1), synthetic_batch(y_spec, 2)
    snapshot = _StateSnapshot(model)
    try:
        result = measure_step(lambda: step(x, y), repeats=repeats)
    finally:
        snapshot.restore()
    logger.info("Measured peak of %s on %s: %.1f MiB (the step added %.1f MiB).",
                model.name, result.device, result.peak_mb, result.step_bytes / 2**20)
    return result if return_details else result.peak_bytes
