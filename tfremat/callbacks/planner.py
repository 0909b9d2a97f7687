"""`tfremat.Planner`: plan, apply and verify a memory budget inside `model.fit`."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfremat import api
from tfremat.errors import BudgetError
from tfremat.export import export_dot, summary
from tfremat.graph.extract import extract
from tfremat.memory import device_name
from tfremat.planners.plan import Plan
from tfremat.simulate import simulate

logger = logging.getLogger("tfremat")
MIB = 2**20


class Planner(keras.callbacks.Callback):
    """Makes each training step of `fit` fit a device memory budget.

    At the start of training the callback traces one step with the real batch
    shape (taken from the first batch), plans what to recompute under the budget,
    and makes THIS `fit` call train with the plan: while training, the model's
    `call` runs a rewritten graph sharing the same layers and weights. The model
    object keeps its identity, weights, optimizer, loss and metrics, and behaves
    as before once `fit` returns (predict, evaluate, save).

    At each epoch end it adds `peak_memory_mb` (measured device peak of the epoch,
    `GPU:0` when a GPU exists, else `CPU:0`) and `predicted_peak_mb` to `logs`, so
    History, CSVLogger and TensorBoard record them. If the measured peak of the
    first steps exceeds the budget, it plans again with the measured excess taken
    off the budget (at most `max_replans` times) and warns if the budget still
    cannot be met; it never exceeds the budget silently.

    Args:
        budget_mb: Device memory budget in MiB (2**20 bytes) for a whole training
            step, weights and optimizer state included.
        planner: Planner name (see `tfremat.plan`), `"auto"` by default.
        strategy: `"time"` or `"memory"` for the DP planners.
        offload: Whether `"auto"` may offload activations to host memory:
            True, False or `"auto"` (when a GPU exists). Offload needs the step
            outside XLA: compile with `jit_compile=False` to use it.
        verbose: 1 prints the plan summary at the start of training.
        export: Path of a plan picture to write (`.png`, `.svg` or `.dot`).
        log_memory: Add `peak_memory_mb` and `predicted_peak_mb` to the logs.
        log_batches: Also add them to the logs of every batch.
        replan: Re-plan when the measured peak exceeds the budget.
        max_replans: How many times to re-plan at most.

    Attributes:
        plan: The plan applied (None before the first step).
        epoch_peaks_mb: Measured device peak of each epoch, MiB.

    Example:

    ```python
    model.fit(x, y, epochs=10, callbacks=[tfremat.Planner(budget_mb=6000)])
    history.history["peak_memory_mb"]
    ```
    """

    def __init__(self, budget_mb: float, *, planner: str = "auto", strategy: str = "time",
                 offload: bool | str = "auto", verbose: int = 1, export: str | None = None,
                 log_memory: bool = True,
                 log_batches: bool = False, replan: bool = True, max_replans: int = 2) -> None:
        super().__init__()
        if budget_mb <= 0:
            raise ValueError(f"budget_mb must be positive, got {budget_mb}.")
        self.budget_mb = float(budget_mb)
        self.planner = planner
        self.strategy = strategy
        self.offload = offload
        self.verbose = verbose
        self.export = export
        self.log_memory = log_memory
        self.log_batches = log_batches
        self.replan = replan
        self.max_replans = max_replans
        self.plan: Plan | None = None
        self.device = device_name()

    # -- state ---------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.plan = None
        self.graph = None
        self._jit_compile: bool | str | None = None
        self.epoch_peaks_mb: list[float] = []
        self.replans = 0
        self._measuring = False
        self.model.train_function = self._first_step

    def on_train_end(self, logs: dict | None = None) -> None:
        self._restore_call()
        if self._jit_compile is not None:
            self.model.jit_compile = self._jit_compile
            self._jit_compile = None
        self.model.train_function = None  # the next fit traces the plain model

    # -- planning and applying -------------------------------------------------

    def _first_step(self, iterator: Any) -> Any:
        """Replaces the first call of the train function: plans, then runs."""
        model = self.model
        steps = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        batches = [iterator.get_next()]
        for _ in range(steps - 1):
            nxt = iterator.get_next_as_optional()
            if not nxt.has_value():
                break
            batches.append(nxt.get_value())
        batches = [self._global_batch(b) for b in batches]
        x, y = self._split(batches[0])
        try:
            self.graph = extract(model, sample=(x, y))
            self._apply(self._make_plan(self.budget_mb))
        except Exception:
            # fit does not call on_train_end when a step raises: undo here.
            self.on_train_end()
            raise
        return model.train_function(self._iterator_of(batches))

    def _global_batch(self, batch: Any) -> Any:
        """A batch as one tensor per leaf (replica parts joined, in order)."""
        local = self.model.distribute_strategy.experimental_local_results

        def join(v: Any) -> Any:
            if isinstance(v, tf.distribute.DistributedValues):
                return tf.concat(local(v), axis=0)
            return v

        return tf.nest.map_structure(join, batch)

    def _iterator_of(self, batches: list[Any]) -> Any:
        """An iterator giving `batches` again, distributed as fit's was."""
        size = int(tf.nest.flatten(batches[0])[0].shape[0])
        joined = tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *batches)
        dataset = tf.data.Dataset.from_tensor_slices(joined).batch(size)
        strategy = self.model.distribute_strategy
        if strategy.num_replicas_in_sync > 1:
            dataset = strategy.experimental_distribute_dataset(dataset)
        return iter(dataset)

    def _split(self, data: Any) -> tuple[Any, Any]:
        """Zero arrays shaped like one device's share of the batch."""
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        replicas = self.model.distribute_strategy.num_replicas_in_sync

        def zeros(t: tf.Tensor) -> np.ndarray:
            shape = t.shape.as_list()
            shape[0] //= replicas
            return np.zeros(shape, t.dtype.as_numpy_dtype)

        return tf.nest.map_structure(zeros, x), tf.nest.map_structure(zeros, y)

    def _make_plan(self, budget_mb: float) -> Plan:
        try:
            return api.plan(self.model, budget_mb, graph=self.graph, planner=self.planner,
                            strategy=self.strategy, offload=self.offload,
                            verbose=self.verbose)
        except BudgetError as e:
            raise BudgetError(self.budget_mb, e.min_budget_mb, e.planner,
                              "Raise budget_mb, lower the batch size, or use a "
                              "smaller model.") from e

    def _apply(self, plan: Plan) -> None:
        self._restore_call()
        self.plan = plan
        self.predicted_peak_bytes = simulate(self.graph, plan).peak_bytes
        if not plan.is_empty:
            rewritten = api.rewrite(self.model, plan)
            self.model.call = rewritten.call
        if plan.offloaded and self.model.jit_compile:
            # XLA ignores tf.device: the host copies would stay on the device.
            warnings.warn("tfremat: the plan offloads activations to host memory, which "
                          "XLA cannot do; this fit runs the step without XLA.",
                          RuntimeWarning, stacklevel=2)
            self._jit_compile = self.model.jit_compile
            self.model.jit_compile = False
        self.model.make_train_function(force=True)
        self._report(plan)
        tf.config.experimental.reset_memory_stats(self.device)
        self._measuring = True

    def _restore_call(self) -> None:
        if "call" in vars(self.model):
            del self.model.call

    def _report(self, plan: Plan) -> None:
        if self.verbose:
            if plan.is_empty:
                print(f"tfremat: the step fits {self.budget_mb:.0f} MiB without "
                      f"rewriting (predicted {self.predicted_peak_bytes / MIB:.1f} MiB "
                      f"on {self.device}).")
            else:
                print(summary(self.graph, plan))
                print(f"Device measured: {self.device}")
        if self.export:
            export_dot(plan, self.export)

    # -- measuring ---------------------------------------------------------------

    def _peak_mb(self) -> float:
        return tf.config.experimental.get_memory_info(self.device)["peak"] / MIB

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.plan is not None:
            tf.config.experimental.reset_memory_stats(self.device)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.plan is None:
            return
        peak = self._peak_mb()
        if self.log_batches and logs is not None:
            logs["peak_memory_mb"] = peak
            logs["predicted_peak_mb"] = self.predicted_peak_bytes / MIB
        if peak > self.budget_mb and self._measuring:
            self._over_budget(peak)

    def _over_budget(self, peak_mb: float) -> None:
        if not self.replan or self.replans >= self.max_replans:
            self._measuring = False
            warnings.warn(
                f"tfremat: the measured peak {peak_mb:.1f} MiB on {self.device} exceeds the "
                f"budget of {self.budget_mb:.1f} MiB after {self.replans} re-plan(s). "
                "Lower the batch size or raise the budget.", RuntimeWarning, stacklevel=2)
            return
        self.replans += 1
        excess = peak_mb - self.predicted_peak_bytes / MIB
        target = self.budget_mb - max(excess, 0.05 * self.budget_mb)
        logger.warning("Measured %.1f MiB > budget %.1f MiB: re-planning for %.1f MiB.",
                       peak_mb, self.budget_mb, target)
        try:
            plan = api.plan(self.model, target, graph=self.graph, planner=self.planner,
                            strategy=self.strategy, offload=self.offload)
        except BudgetError as e:
            # Best effort: the plan with the lowest predicted peak.
            plan = api.plan(self.model, e.min_budget_mb, graph=self.graph,
                            planner=self.planner, strategy="memory", offload=self.offload)
            warnings.warn(
                f"tfremat: the measured peak {peak_mb:.1f} MiB exceeds the budget of "
                f"{self.budget_mb:.1f} MiB. Absorbing the measured excess needs a plan "
                f"predicted at {target:.1f} MiB, but the lowest reachable prediction is "
                f"{e.min_budget_mb:.1f} MiB: re-planned with that; the budget may still be "
                "exceeded. Lower the batch size or raise the budget.",
                RuntimeWarning, stacklevel=2)
        self._apply(plan)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.plan is None:
            return
        self.epoch_peaks_mb.append(self._peak_mb())
        if self.log_memory and logs is not None:
            logs["peak_memory_mb"] = self.epoch_peaks_mb[-1]
            logs["predicted_peak_mb"] = self.predicted_peak_bytes / MIB
