"""`tfremat.Planner`: plan, apply and verify a memory budget inside `model.fit`."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils import io_utils  # print_msg: Keras has no public equivalent

from tfremat import api
from tfremat.core import (MIB, BudgetError, Plan, PlanGraph, UnsupportedModelError,
                          budget_unit_hint, check_count, interrupts_deferred, warn)
from tfremat.export import picture_format, summary, write_picture
from tfremat.graph import built_from_sample, extract
from tfremat.backend import NO_STATS_HINT, device_name, memory_stats_available, xla_compiled
from tfremat.planners import progress
from tfremat.plots import memory_png, plot_memory
from tfremat.rewriter import PlanInstallation, makes_masks, random_on_cpu, unwrapped
from tfremat.simulation import simulate


#: Said when a step with updates in the backward pass raises from TensorFlow.
PARTIAL_STEP = (
    "tfremat: the training step failed with its optimizer updates inside the backward "
    "pass: the layers whose update ran before the error keep this step's update, and "
    "the optimizer's step counter may differ from what Keras leaves after a failed step "
    "(plain Keras updates no weight in a failed step). To go on training from a model "
    "left as plain Keras leaves it, use Planner(update_in_backward=False).")


#: What is in use beside the model on CPU: the end of the `Planner`'s notes on it.
HELD = ("than the model's weights, optimizer slots and batch are in use: on CPU, tensors "
        "the program keeps elsewhere and the input pipeline's share the allocator (NumPy "
        "arrays given to fit, or to from_tensor_slices, are mostly held there whole; a "
        "dataset read from files or a generator holds the batches in flight: "
        "docs/troubleshooting.md)")


class Planner(keras.callbacks.Callback):
    """Makes each training step of `fit` fit a device memory budget.

    At the first batch the callback traces one step with the real batch shape,
    plans what to recompute under the budget, measures the plan's step (and
    lower plans while it measures over the budget; `measure`), and makes THIS
    `fit` train with the fastest plan that fits: the model's train function runs
    a rewritten graph sharing the same layers and weights. The model object
    keeps its identity, weights, optimizer, loss and metrics, and is exactly the
    model you had once `fit` returns, also when a step raises or you press
    Ctrl-C (predict, evaluate, save and a plain `fit` then behave as if it never
    saw the callback).

    At each epoch end it adds `peak_memory_mb` (measured device peak of the
    epoch's training steps: not validation, nor what other callbacks do between
    steps; `GPU:0` when a GPU exists, else
    `CPU:0`), `held_memory_mb` (what was in use on the device before that step
    beyond the model's weights, optimizer slots and batch: on a CPU, the NumPy
    arrays given to `fit` or to `from_tensor_slices` are mostly held there) and
    `predicted_peak_mb` (the model's step alone, so comparable to
    `peak_memory_mb` less `held_memory_mb`) to `logs`, so History records
    them, and so do CSVLogger and TensorBoard when the Planner comes before
    them in `callbacks`. If the measured peak of the
    first steps exceeds the budget, it plans again with the measured excess taken
    off the budget, measures that plan (and lower ones) the same way before it
    trains with it (at most `max_replans` times), and warns if the budget still
    cannot be met; it never exceeds the budget silently. Where TensorFlow keeps
    no allocator statistics (a CPU without oneDNN, TensorFlow started before
    `tfremat` was imported), it warns, trains with the predicted plan and logs
    only `predicted_peak_mb`.

    A later `fit` with the same callback traces the step again; when nothing a
    plan depends on changed (the layers, shapes, trainable weights, optimizer
    settings other than the learning rate, `jit_compile`, this callback's
    budget and planning settings), it trains with the plan the last fit ended
    with, re-planned or not, without measuring candidates again; and when that
    fit found no lower plan for the budget, a step over it is not re-planned
    again but warned about once.

    With `plot="memory.png"` it draws the predicted device memory over one step,
    without and with the plan, the budget and the measured epoch peaks
    (`tfremat.plot_memory`), updated at each epoch end. When the fit also has a
    `keras.callbacks.TensorBoard`, the callback writes into that log directory's
    `train` run: the plan summary as text (`tfremat/plan`), the memory timeline
    as an image (`tfremat/memory_timeline`) and each epoch's measured and
    predicted peaks as scalars (`tfremat/peak_memory_mb`,
    `tfremat/held_memory_mb`, `tfremat/predicted_peak_mb`).

    Under `tf.distribute.MirroredStrategy` the plan is made for one replica's
    share of the batch, and the budget holds for each device.
    `MultiWorkerMirroredStrategy` needs a custom training loop with
    `tfremat.plan` and `tfremat.rewrite` (Keras 3's fit does not run under it):
    constructing the callback in its scope raises a RuntimeError saying so.

    Args:
        budget_mb: Memory budget of ONE device in MiB (2**20 bytes) for a whole
            training step, weights and optimizer state included.
        planner: Planner name (see `tfremat.plan`), `"auto"` by default.
        objective: `"time"` or `"memory"` for the DP planners.
        offload: Whether `"auto"` may offload activations to host memory (and
            `"dqn"` swap outputs out):
            True, False or `"auto"` (when a GPU exists). Offload runs the step
            outside XLA for this fit (a warning says so).
        verbose: 1 prints the plan summary at the start of training, and shows
            what planning is doing when it takes more than two seconds.
        export: Path of a plan picture to write (`.png`, `.svg` or `.dot`).
            Without Graphviz, a `.dot` file is written instead, with a warning.
        plot: Path of the memory timeline image (`.png`, `.svg`, `.pdf`); needs
            matplotlib only.
        log_memory: Add `peak_memory_mb`, `held_memory_mb` and
            `predicted_peak_mb` to the logs.
        log_batches: Also add them to the logs of every batch.
        replan: Re-plan when the measured peak exceeds the budget.
        max_replans: How many times to re-plan at most.
        measure: Measure, then choose (`tfremat.plan(..., measure=True)`):
            before training, run the planned step on the first batch (one
            device's share of it), and plans for lower budgets while it measures over
            the budget, every variable restored after each; train with the
            fastest plan that measured within the budget (when none did, the
            one that measured lowest, with a warning). Not done under a
            `tf.distribute` strategy with several replicas.
        max_trials: Most plans measured before training.
        measure_time_limit: Seconds measuring may take, each time the
            callback plans (300 by default; None for no limit): once passed,
            it trains with the best plan measured so far and says so. It is
            checked before each measurement, and one begun in time runs to its
            end (slow steps, such as mixed float16 on a CPU, can take it well
            past: 375 s in one new user's run). Under XLA every
            plan measured is compiled first.
        strategy: Deprecated name of `objective`.
        update_in_backward: Run each optimizer update inside the backward pass
            (see `tfremat.plan`): `"auto"` (the default: under a binding
            budget, when the optimizer allows it and the step is not compiled
            by XLA), True or False. The plan summary says whether it does, and
            why not.
        pin_order: Pin the backward pass to the simulator's order (see
            `tfremat.plan`): True, False or `"auto"` (the default: pinned on a
            CPU, where peaks were steadier and no higher pinned, and on one
            inter-op thread an unpinned plan saves almost nothing; not on a
            GPU nor for a step XLA compiles). On CPU the step took 0.86x to
            1.07x the unpinned step
            (docs/how-it-works.md, "Pinning the order").

    Attributes:
        plan: The plan applied (None before the first step).
        graph: The PlanGraph traced at the first step.
        epoch_peaks_mb: Measured device peak of each epoch, MiB.
        epoch_held_mb: MiB held on the device beside the model before the
            step of each epoch's peak (`held_memory_mb`).
        predicted_peak_mb: The simulator's peak for `plan`, MiB.
        replans: How often the measurement made it plan again.
        picture: The plan picture written (`export`, or its `.dot` fallback).
        plan_peak_mb: Measured peak of the steps run with `plan`, its first step
            (tracing, first-use allocations) left out; None before such a step.
        timeline: The memory timeline written (`plot`), or None.
        planning_s: Seconds this fit spent planning (tracing, measuring
            candidates, the plan's first step) and re-planning, by epoch:
            `{epoch: seconds}`. Keras times them as part of the steps that
            planned (with `verbose=1` the callback says so when it happens).

    Example:

    ```python
    history = model.fit(x, y, epochs=10, callbacks=[
        tfremat.Planner(budget_mb=6000, plot="memory.png"),
        keras.callbacks.TensorBoard("logs")])
    history.history["peak_memory_mb"]
    ```
    """

    def __init__(self, budget_mb: float, *, planner: str = "auto", objective: str = "time",
                 offload: bool | str = "auto", verbose: int = 1, export: str | None = None,
                 plot: str | None = None, log_memory: bool = True, log_batches: bool = False,
                 replan: bool = True, max_replans: int = 2, measure: bool = True,
                 max_trials: int = 3,
                 measure_time_limit: float | None = api.MEASURE_TIME_LIMIT,
                 strategy: str | None = None,
                 update_in_backward: bool | str = "auto",
                 pin_order: bool | str = "auto") -> None:
        super().__init__()
        if isinstance(tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy):
            # Keras's fit fails before any callback runs (in its symbolic build),
            # with "Attempt to convert a value (PerReplica...)": say it here.
            raise RuntimeError(
                "Keras 3's model.fit does not run under MultiWorkerMirroredStrategy "
                "(keras-team/keras#20585), so tfremat.Planner cannot either. Train "
                "with a custom loop (strategy.run): call tfremat.plan and "
                "tfremat.rewrite inside strategy.scope() on every worker, as "
                "examples/multi_worker.py does.")
        objective = api.deprecated_strategy(strategy, objective)
        self.budget_mb = api.check_budget_mb(budget_mb)
        api.check_planner(planner, objective, offload, update_in_backward, pin_order)
        self.planner = planner
        self.objective = objective
        self.offload = offload
        self.verbose = api.check_verbose(verbose)
        if export is not None:
            picture_format(export)  # an unknown extension is refused here, not mid-fit
        self.export = export
        self.plot = plot
        self.log_memory = log_memory
        self.log_batches = log_batches
        self.replan = replan
        self.max_replans = check_count(max_replans, "max_replans", minimum=0)
        self.measure = measure
        self.max_trials = check_count(max_trials, "max_trials")
        self.measure_time_limit = (None if measure_time_limit is None else api.check_positive(
            measure_time_limit, "measure_time_limit", "seconds"))
        self.update_in_backward = update_in_backward
        self.pin_order = pin_order
        self.device = device_name()
        # What the last completed fit's step was, the plan it ended with and,
        # when that fit found out, why no re-plan lowers that plan.
        self._last: tuple[tuple, Plan, str | None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.plan: Plan | None = None
        self.graph: PlanGraph | None = None
        self.predicted_peak_mb: float | None = None
        self.plan_peak_mb: float | None = None
        self.picture: str | None = None
        self.timeline: str | None = None
        self.epoch_peaks_mb: list[float] = []
        self.epoch_held_mb: list[float] = []
        self.replans = 0
        self.planning_s: dict[int, float] = {}
        self._installation: PlanInstallation | None = None
        self._fit: Any = None  # the fit this callback is part of
        self._own_train_function: Any = None
        self._measuring = False
        self._stats = True  # the device's allocator statistics can be read
        self._warming_up = False  # the step just run is the first of a new plan
        self._epoch = 0
        self._epoch_peak_mb = 0.0  # the largest step peak this epoch
        self._epoch_held_mb = 0.0  # held beside the model before that step
        self._step_peak_mb = 0.0  # the peak of the last train function run
        self._step_held_mb = 0.0  # held beside the model before it
        self._sample: Any = None  # one device's share of the first batch, for measuring
        self._lowest_measured: Plan | None = None  # the best effort of a measured BudgetError
        self._settled: str | None = None  # why no re-plan lowers the plan in use
        self._summary_writer: Any = None  # a TensorBoard callback's train run
        self._sharing = 1  # replicas whose steps the measured allocator holds
        self._step_key: tuple | None = None  # what this fit's plan depends on

    # -- wiring fit's events ---------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        other = getattr(self.model.train_function, "__self__", None)
        if isinstance(other, Planner):
            if other is not self and other._fit is self.model.history:
                raise ValueError("Two tfremat.Planner callbacks in one fit: pass one.")
            # Left over from a fit interrupted between steps (a callback raised
            # or Ctrl-C came outside the step), this callback's own included.
            other._restore()
        self._reset()
        self._stats = memory_stats_available(self.device)
        if not self._stats:
            warn(
                f"tfremat: TensorFlow keeps no allocator statistics for {self.device}: "
                "this fit trains with the predicted plan, unmeasured (no peak_memory_mb "
                f"in the logs, no re-planning). {NO_STATS_HINT}",
                RuntimeWarning)
        self._fit = self.model.history  # Keras makes a History for each fit
        self._sharing = _replicas_sharing(self.model.distribute_strategy, self.device)
        self._own_train_function = self.model.train_function
        self.model.train_function = self._train_step
        board = next((c for c in self._fit_callbacks()
                      if isinstance(c, keras.callbacks.TensorBoard)), None)
        if board is not None:
            self._summary_writer = tf.summary.create_file_writer(
                os.path.join(board.log_dir, "train"))

    def _fit_callbacks(self) -> list[keras.callbacks.Callback]:
        """The callbacks of the fit calling `on_train_begin`.

        Keras gives a callback no handle on its siblings; the `CallbackList`
        calling this one is found among the callers' frames.
        """
        frame = sys._getframe(1)
        for _ in range(8):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.callbacks.CallbackList) and any(
                    c is self for c in owner.callbacks):
                return list(owner.callbacks)
            frame = frame.f_back
        return []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.plan is None:
            return
        if not self._stats:
            if self.log_batches and logs is not None:
                logs["predicted_peak_mb"] = self.predicted_peak_mb
            return
        peak = self._step_peak_mb
        if self.log_batches and logs is not None:
            logs["peak_memory_mb"] = peak
            logs["held_memory_mb"] = self._step_held_mb
            logs["predicted_peak_mb"] = self.predicted_peak_mb
        if self._warming_up:
            # The first step after installing a plan traces its train function and
            # makes first-use allocations: it counts in the epoch's peak, but the
            # plan is judged on the steps after it.
            self._warming_up = False
            return
        self.plan_peak_mb = max(self.plan_peak_mb or 0.0, peak)
        # Replicas sharing the allocator measure together: when their sum is over
        # their budgets' sum, one of them is over its own.
        if peak > self.budget_mb * self._sharing and self._measuring:
            started, replans = time.perf_counter(), self.replans
            self._over_budget(peak)
            if self.replans != replans:
                self._planned_for(time.perf_counter() - started, "re-planning")

    def _planned_for(self, seconds: float, what: str) -> None:
        """Records `seconds` of planning in this epoch and, when verbose, says
        so: Keras counts them in the step that planned (`fit(verbose=2)` then
        reads seconds per step for the epoch)."""
        self.planning_s[self._epoch] = self.planning_s.get(self._epoch, 0.0) + seconds
        if self.verbose:
            io_utils.print_msg(f"tfremat: {what} took {seconds:.1f} s, which Keras counts "
                               f"in the step time of epoch {self._epoch + 1}.")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._epoch_peak_mb = self._epoch_held_mb = 0.0

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.plan is None:
            return
        if self._stats:
            self.epoch_peaks_mb.append(self._epoch_peak_mb)
            self.epoch_held_mb.append(self._epoch_held_mb)
        if self.log_memory and logs is not None:
            if self._stats:
                logs["peak_memory_mb"] = self.epoch_peaks_mb[-1]
                logs["held_memory_mb"] = self.epoch_held_mb[-1]
            logs["predicted_peak_mb"] = self.predicted_peak_mb
        if self.plot:
            self._draw_timeline(self.epoch_peaks_mb)
        if self._summary_writer is not None:
            png = memory_png(self.graph, self.plan, measured_mb=self.epoch_peaks_mb,
                             budget_mb=self.budget_mb)
            with self._summary_writer.as_default(step=epoch):
                if self._stats:
                    tf.summary.scalar("tfremat/peak_memory_mb", self.epoch_peaks_mb[-1])
                    tf.summary.scalar("tfremat/held_memory_mb", self.epoch_held_mb[-1])
                tf.summary.scalar("tfremat/predicted_peak_mb", self.predicted_peak_mb)
                tf.summary.image("tfremat/memory_timeline", tf.io.decode_png(png)[None])
            self._summary_writer.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.plan is not None and self._step_key is not None:
            settled = ("it measured lowest of the plans tried when planning"
                       if self.plan is self._lowest_measured else self._settled)
            self._last = (self._step_key, self.plan, settled)
        self._restore()

    def _restore(self) -> None:
        """Gives the model back as it was before this fit."""
        with interrupts_deferred():
            if self._installation is not None:
                self._installation.restore()
                self._installation = None
            if self._fit is not None:
                self.model.train_function = self._own_train_function
                self._fit = self._own_train_function = None
            if self._summary_writer is not None:
                self._summary_writer.close()
                self._summary_writer = None

    def _train_step(self, iterator: Any) -> Any:
        """The model's train function during this fit: plans at the first call,
        then runs the planned step. Any exception (Ctrl-C included) but the end
        of the data restores the model before it propagates."""
        if self.model.history is not self._fit:
            # Called by a fit this callback is not part of: an earlier fit with
            # it was interrupted between steps. Give the model back and go on.
            self._restore()
            self.model.make_train_function()
            return self.model.train_function(iterator)
        stepping = False
        try:
            started = None
            if self._installation is None:
                started = time.perf_counter()
                iterator = self._plan_first_batch(iterator)
                if self._installation is None:  # nothing to plan: Keras's own step
                    own = self._own_train_function
                    self._restore()
                    return own(iterator)
            stepping = True
            if not self._stats:
                logs = self._installation.run(iterator)
            else:
                # The step's peak alone: not the planning before it, nor what other
                # callbacks, fit's validation or the user do between steps.
                tf.config.experimental.reset_memory_stats(self.device)
                self._step_held_mb = max(0.0, self._beside_model_mb())
                logs = self._installation.run(iterator)
                self._step_peak_mb = self._peak_mb()
                if self._step_peak_mb >= self._epoch_peak_mb:
                    self._epoch_peak_mb = self._step_peak_mb
                    self._epoch_held_mb = self._step_held_mb
            if started is not None:
                # Planning, measuring and the plan's first step (its trace).
                self._planned_for(time.perf_counter() - started,
                                  "planning (with the plan's first step)")
            return logs
        except (StopIteration, tf.errors.OutOfRangeError):
            # The data ran out (a dataset of unknown length): Keras ends the
            # epoch, and the next one trains with the plan too.
            raise
        except BaseException as error:
            if stepping and isinstance(error, tf.errors.OpError) and self.plan.update_in_backward:
                warn(PARTIAL_STEP, RuntimeWarning)
            self._restore()
            raise

    # -- planning ----------------------------------------------------------------

    def _plan_first_batch(self, iterator: Any) -> Any:
        """Plans on the shapes of the first batches and installs the plan (none
        for a model without trainable weights).

        Returns:
            An iterator giving the batches taken from `iterator` again.
        """
        model = self.model
        steps = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        static = _static_batch(iterator)
        batches = [iterator.get_next()]
        for _ in range(steps - 1):
            nxt = iterator.get_next_as_optional()
            if not nxt.has_value():
                break
            batches.append(nxt.get_value())
        batches = [self._global_batch(b) for b in batches]
        sample = self._sample = self._replica_batch(batches[0])
        # Without a distribution strategy, Keras's TensorFlow trainer builds an
        # unbuilt model while tracing the first step; planning needs it built
        # first, so build it as Keras does on its other backends. (Also a model
        # marked built whose layers are not: `model.build(shape)` on a
        # subclassed model without its own `build()`.)
        built_from_sample(model, sample)
        if not model.trainable_weights:
            warn(f"tfremat: {model.name!r} has no trainable weights, so its training step "
                 "has no backward pass and nothing to recompute: this fit trains without "
                 "a plan.", RuntimeWarning)
            return self._iterator_of(batches, static)
        with progress(self.verbose) as track:
            traced = track(f"tfremat: tracing a training step of {model.name}", 1) \
                if track else None
            # A model rewritten before is planned as the model it was made from.
            self.graph = extract(unwrapped(model, compiled=True), sample=sample)
            if traced:
                traced(1)
            held = self._held_mb()
            if held is not None:
                warn(f"tfremat: before the first step {held:.1f} MiB more {HELD}; every "
                     "step's peak counts them, so the plans are measured and chosen with "
                     "them in.", RuntimeWarning)
            # The plan also depends on this callback's settings, which a user may
            # change between fits.
            self._step_key = (_step_key(model, self.graph), self.budget_mb, self.planner,
                              self.objective, self.offload, self.update_in_backward,
                              self.pin_order)
            if self._last is not None and self._last[0] == self._step_key:
                _, plan, self._settled = self._last
            else:
                plan = self._plan(self.budget_mb, sample=sample)
        self._install(plan)
        return self._iterator_of(batches, static)

    def _plan(self, budget_mb: float, sample: Any = None, why: str = "") -> Plan:
        """A plan for `budget_mb`; measured, then chosen, when `sample` (one
        device's share of the first batch) is given and the callback measures.
        `why`: what a warning says of `budget_mb` when it is not the budget."""
        replicated = self.model.distribute_strategy.num_replicas_in_sync > 1
        measure = self.measure and self._stats and sample is not None and not replicated

        def plan(measure: bool) -> Plan:
            made = api.plan(self.model, budget_mb, graph=self.graph, planner=self.planner,
                            objective=self.objective, offload=self.offload,
                            verbose=self.verbose, sample=sample if measure else None,
                            measure=measure, max_trials=self.max_trials,
                            measure_time_limit=self.measure_time_limit,
                            update_in_backward=self.update_in_backward,
                            pin_order=self.pin_order)
            if replicated and self.measure and made.estimates is not None:
                made.estimates = dataclasses.replace(made.estimates, details={
                    **made.estimates.details, "unmeasured": "the Planner measures no "
                    "plan under a strategy with several replicas"})
            return made

        try:
            return plan(measure)
        except (tf.errors.OpError, UnsupportedModelError) as e:
            if not measure:
                raise
            # A measurement must never cost the training run (its data
            # may not suit the model, a trial may run out of memory).
            warn(f"tfremat: could not measure the candidate plans ({e}); this "
                 "fit plans by the prediction alone.", RuntimeWarning)
            return plan(False)
        except BudgetError as e:
            if e.measured_plan is None:
                if not self.measure:  # the message's hint names the API's switch
                    e.args = (str(e).replace(BudgetError.MEASURE_HINT, "Planner(..., "
                                             "measure=True) measures plans on the device"),)
                raise
            # The prediction fits but no plan measured within the budget: train
            # with the lowest, and say so (and do not re-plan: see `_over_budget`).
            # Planned for less than the budget (a re-plan), say where that plan
            # stands against the budget itself: a new user read "cannot be met"
            # of a re-plan's target, then saw the epochs within the budget.
            details = e.measured_plan.estimates.details if e.measured_plan.estimates else {}
            measured = details.get("measured_peak_bytes")
            verdict = ""
            if why and measured is not None:
                verdict = (f" It measured {measured / MIB:.1f} MiB, "
                           + ("within" if measured <= self.budget_mb * MIB else "over")
                           + f" the budget of {self.budget_mb:.1f} MiB.")
            warn(f"tfremat: {why}{e}\nThis fit trains with the plan that measured "
                 f"lowest{NEAR_LOWEST}.{verdict}", RuntimeWarning)
            self._lowest_measured = e.measured_plan
            return e.measured_plan

    def _install(self, plan: Plan) -> None:
        jit_compile = None
        if plan.offloaded and xla_compiled(self.model):
            # XLA ignores tf.device: the host copies would stay on the device.
            warn("tfremat: the plan offloads activations to host memory, which "
                 "XLA cannot do; this fit runs the step without XLA.",
                 RuntimeWarning)
            jit_compile = False
        installation = PlanInstallation(self.model, plan, jit_compile=jit_compile)
        if self._installation is not None:
            self._installation.restore()
        installation.install()
        self.model.train_function = self._train_step  # keep this callback in the loop
        self._installation = installation
        self.plan = plan
        self.predicted_peak_mb = simulate(self.graph, plan).peak_bytes / MIB
        self._report(plan)
        self._measuring = self._stats
        self._warming_up = True
        self.plan_peak_mb = None

    def _report(self, plan: Plan) -> None:
        if self.verbose:
            if plan.is_empty and plan.planner == "none":
                io_utils.print_msg(
                    f"tfremat: no plan measured more than {api.MEASURED_SPREAD:.0%} below "
                    f"the step without one; training without rewriting (predicted "
                    f"{self.predicted_peak_mb:.1f} MiB on {self.device}).")
            elif plan.is_empty and plan is self._lowest_measured:
                io_utils.print_msg(
                    f"tfremat: training without rewriting, which measured lowest of the "
                    f"plans tried{NEAR_LOWEST}, over the budget of {self.budget_mb:.1f} MiB "
                    f"(see the warning above; predicted {self.predicted_peak_mb:.1f} MiB on "
                    f"{self.device}).")
            elif plan.is_empty:
                measured = (plan.estimates.details.get("measured_peak_bytes")
                            if plan.estimates else None)
                how = (f"predicted {self.predicted_peak_mb:.1f} MiB" if measured is None else
                       f"measured {measured / MIB:.1f} MiB, predicted "
                       f"{self.predicted_peak_mb:.1f}")
                io_utils.print_msg(
                    f"tfremat: the step fits {self.budget_mb:.0f} MiB without rewriting "
                    f"({how} on {self.device})" + budget_unit_hint(self.budget_mb * MIB) + ".")
            else:
                io_utils.print_msg(summary(self.graph, plan))
                io_utils.print_msg(f"Device measured: {self.device}")
            details = plan.estimates.details if plan.estimates else {}
            if self._installation is not None and self._installation.units_compiled:
                io_utils.print_msg(self._units_compiled_line(plan, details))
            if self._last is not None and plan is self._last[1]:
                io_utils.print_msg(
                    "tfremat: the step is the one the last fit with this callback "
                    "trained; this fit starts with the plan that fit ended with"
                    + (" (the measurements above are that fit's)"
                       if "measured_peak_bytes" in details else "")
                    + ", without measuring plans again.")
            # A plan that measured lowest over the budget came with a warning
            # that lists the trials already.
            elif details.get("trials") and plan is not self._lowest_measured:
                io_utils.print_msg(
                    "tfremat: measured before training: "
                    + "; ".join(api.trial_text(t) for t in details["trials"])
                    + f" (budget {self.budget_mb:.1f} MiB); training "
                    + ("without rewriting, " if plan.is_empty else "with the plan ")
                    + f"measured at {details['measured_peak_bytes'] / MIB:.1f} MiB"
                    + (f", the best measured when measuring stopped at its time limit of "
                       f"{details['measure_stopped_s']:g} s (measure_time_limit)."
                       if "measure_stopped_s" in details else ".")
                    + _without_room(details["trials"], self.budget_mb * MIB,
                                    plan.estimates.overhead))
        if self.export:
            try:
                self.picture = write_picture(plan, self.export, graph=self.graph)
            except OSError as e:  # a picture must never cost the training run
                warn(f"tfremat: could not write the plan picture {self.export}: "
                     f"{e}", RuntimeWarning)
        if self.plot:
            self._draw_timeline(None)
        if self._summary_writer is not None:
            text = summary(self.graph, plan) if not plan.is_empty else (
                f"The step fits {self.budget_mb:.0f} MiB without rewriting.")
            with self._summary_writer.as_default(step=self._epoch):
                # Markdown: indent four spaces so TensorBoard keeps the columns.
                tf.summary.text("tfremat/plan", "\n".join("    " + ln
                                                         for ln in text.splitlines()))
            self._summary_writer.flush()

    def _draw_timeline(self, measured_mb: list[float] | None) -> None:
        try:
            self.timeline = plot_memory(self.plan, self.plot, graph=self.graph,
                                        measured_mb=measured_mb, budget_mb=self.budget_mb)
        except OSError as e:  # a picture must never cost the training run
            warn(f"tfremat: could not write the memory timeline {self.plot}: {e}",
                 RuntimeWarning)

    def _global_batch(self, batch: Any) -> Any:
        """A batch as one tensor per leaf (replica parts joined, in order)."""
        local = self.model.distribute_strategy.experimental_local_results

        def join(v: Any) -> Any:
            if isinstance(v, tf.distribute.DistributedValues):
                return tf.concat(local(v), axis=0)
            return v

        return tf.nest.map_structure(join, batch)

    def _iterator_of(self, batches: list[Any], static: bool) -> Any:
        """An iterator giving `batches` again, distributed as fit's was.

        Its element spec is the one of fit's iterator (`static`: a known batch
        dimension), so the train function is not traced again for it: a second
        trace may compile other kernels and round differently.
        """
        size = int(tf.nest.flatten(batches[0])[0].shape[0])
        joined = tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *batches)
        dataset = tf.data.Dataset.from_tensor_slices(joined).batch(size,
                                                                   drop_remainder=static)
        strategy = self.model.distribute_strategy
        if strategy.num_replicas_in_sync > 1:
            dataset = strategy.experimental_distribute_dataset(dataset)
        return iter(dataset)

    def _replica_batch(self, data: Any) -> tuple[Any, Any]:
        """One device's share of the batch `(x, y)` as arrays: its first rows.

        Tracing and measuring run on these values, not on zeros or noise: token
        ids and masks decide what a step computes (all-zero ids under
        `mask_zero=True` mask every step and make the loss NaN).
        """
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        replicas = self.model.distribute_strategy.num_replicas_in_sync

        def share(t: tf.Tensor) -> np.ndarray:
            return np.asarray(t)[:t.shape[0] // replicas]

        return tf.nest.map_structure(share, x), tf.nest.map_structure(share, y)

    # -- measuring -----------------------------------------------------------------

    def _units_compiled_line(self, plan: Plan, details: dict) -> str:
        """What runs with XLA when the plan's segments compile on their own."""
        by_name = {layer.name: layer for layer in self.model._flatten_layers()}
        random = sum(1 for seg in plan.segments if random_on_cpu(
            [by_name[name] for name in {self.graph.node(n).layer for n in seg.nodes}
             if name in by_name]))
        text = ("tfremat: under XLA (jit_compile) the step runs in TensorFlow's executor, "
                "which frees each tensor after its last reader, and each recompute "
                "segment of the plan compiles on its own, its forward pass and its "
                "recompute with its gradients; compiled whole, the step keeps less of "
                "the plan's saving (docs/how-it-works.md, \"XLA\").")
        if random:
            one = random == 1
            text += (f" On a CPU, {random} of its {len(plan.segments)} segments "
                     f"{'draws' if one else 'draw'} random numbers (dropout), which XLA "
                     "draws slowly in a program of its own: "
                     f"{'it runs' if one else 'they run'} without XLA too.")
        if makes_masks([self.model]):
            text += " A segment whose outputs carry Keras masks runs without XLA."
        return text + (" The predicted peaks are of the step without XLA, whose programs "
                       "the simulator does not model" +
                       ("; the measured ones are of this step." if "measured_peak_bytes"
                        in details else " (measure=True measures this step)."))

    def _peak_mb(self) -> float:
        return tf.config.experimental.get_memory_info(self.device)["peak"] / MIB

    def _over_budget(self, peak_mb: float) -> None:
        # Enough digits that the peak reads above the budget (20.003 over 20.0).
        d = 1 if f"{peak_mb:.1f}" != f"{self.budget_mb * self._sharing:.1f}" else 3
        budget = (f"{self.budget_mb:.{d}f} MiB" if self._sharing == 1 else
                  f"{self._sharing} x {self.budget_mb:.{d}f} MiB (its allocator holds "
                  f"{self._sharing} replicas)")
        over = (f"the measured peak {peak_mb:.{d}f} MiB on {self.device} exceeds the "
                f"budget of {budget}")
        if self._settled is not None and self.plan is not None:
            # Found out by the last fit with this callback, on the same step.
            self._measuring = False
            warn(f"tfremat: {over}; the last fit with this callback found no lower "
                 f"plan for this step ({self._settled}): training goes on with it. "
                 f"{self._advice()}", RuntimeWarning)
            return
        if self.plan is not None and self.plan is self._lowest_measured:
            # Planning again would measure the same candidates (a lower target
            # ends in the same lowest plans): a small CNN's fit took 86 s, not 35.
            self._measuring = False
            warn(
                f"tfremat: {over}; the plan in use measured lowest of the plans tried "
                f"when planning{NEAR_LOWEST} (see the warning then): training goes on with "
                f"it. {self._advice()}", RuntimeWarning)
            return
        if not self.replan or self.replans >= self.max_replans:
            self._measuring = False
            tried = (f"after {self.replans} re-plan(s)" if self.replan else
                     "(re-planning is off: Planner(replan=False))")
            warn(
                f"tfremat: {over} {tried}. {self._advice()}", RuntimeWarning)
            return
        # What the step measured above the plan's estimate: its measurement
        # before training when it has one (the re-plan's candidates are measured
        # too, so what they are held to is the steps' spread above a trial; above
        # the prediction, an under-prediction would count twice), else the
        # prediction.
        excess = peak_mb / self._sharing - (_trial_mb(self.plan) or self.predicted_peak_mb)
        # An excess above the budget itself leaves no budget to plan for: ask for
        # 1% of it, which ends in the best-effort plan below.
        target = max(self.budget_mb - max(excess, 0.05 * self.budget_mb),
                     0.01 * self.budget_mb)
        floor_mb = None
        try:
            plan = self._plan(target, sample=self._sample, why=(
                f"re-planning for {target:.1f} MiB (the budget of {self.budget_mb:.1f} "
                "MiB less what a training step measured above the plan's estimate): "))
        except BudgetError:
            # Best effort: the plan of lowest predicted peak, measured too. (The
            # error's minimum is measured: planning at it may rewrite nothing.)
            floor_mb = self._predicted_floor_mb()
            plan = self._plan(floor_mb, sample=self._sample, why=(
                f"re-planning for {floor_mb:.1f} MiB, the lowest peak the planner "
                f"predicts (the budget of {self.budget_mb:.1f} MiB less what a training "
                "step measured above the plan's estimate is out of its reach): "))
        if _same_rewrite(plan, self.plan):
            self._measuring = False
            self._settled = "it is the lowest the planner reaches"
            warn(
                f"tfremat: {over}, and the plan in use is already the "
                f"lowest the planner reaches: training goes on with it. {self._advice()}",
                RuntimeWarning)
            return
        if floor_mb is not None and not _lower(plan, self.plan, peak_mb / self._sharing):
            # The floor is a prediction: on a model the simulator over-predicts,
            # the plan in use (a measured last resort) can be lower than any plan
            # made for it, and one that recomputes less would be a step back.
            self._measuring = False
            self._settled = "no plan made for the lowest predicted peak is lower"
            warn(
                f"tfremat: {over}. The lowest peak the planner predicts is "
                f"{floor_mb:.1f} MiB, and the plan made for it is no lower than the plan "
                f"in use: training goes on with the plan in use. {self._advice()}",
                RuntimeWarning)
            return
        if floor_mb is not None:
            warn(
                f"tfremat: {over}. Absorbing the measured excess needs a plan "
                f"predicted at {target:.1f} MiB, but the lowest reachable prediction is "
                f"{floor_mb:.1f} MiB: re-planned with that; the budget may still be "
                f"exceeded. {self._advice()}", RuntimeWarning)
        else:
            # An epoch over the budget is not to be missed, verbose or not.
            warn(f"tfremat: {over}: re-planned for {target:.1f} MiB (the budget less "
                 "what the step measured above the plan's estimate); the epoch's peak "
                 "keeps the steps before.", RuntimeWarning)
        self.replans += 1
        self._install(_replanned(plan, self.budget_mb))

    def _advice(self) -> str:
        """What to do when the budget is not met, with what is held between
        steps beside the model on CPU (`_held_mb`)."""
        advice = "Lower the batch size or raise the budget."
        held = self._held_mb()
        if held is None:
            return advice
        return f"{advice} Between steps {held:.1f} MiB more {HELD}."

    def _held_mb(self) -> float | None:
        """MiB in use on a CPU device beyond the model's weights, optimizer slots
        and batch, when that is a tenth of the budget or more, and 1 MiB or
        more; else None. Fit on NumPy arrays holds them in the step's
        allocator: a CNN's steps peaked at 258-295 MiB so, 242-244 fed from a
        generator. (A new user asking for 0.01 MiB was told of 0.4 MiB held,
        beside the warning that mattered.)"""
        if not self._stats or not self.device.startswith("CPU") or self.graph is None:
            return None
        held = self._beside_model_mb()
        return held if held >= max(0.1 * self._sharing * self.budget_mb, 1.0) else None

    def _beside_model_mb(self) -> float:
        """MiB in use on the device now beyond the persistent bytes (weights,
        optimizer slots, batch) of the replicas whose steps it holds, as
        `api.held_bytes` counts a trial's."""
        return (tf.config.experimental.get_memory_info(self.device)["current"] / MIB
                - self._sharing * self.graph.total_persistent_bytes / MIB)

    def _predicted_floor_mb(self) -> float:
        """The lowest peak the planner predicts for a plan: the minimum it states
        (another objective's minimum may be out of its reach), unmeasured."""
        try:
            return self._plan(1 / MIB).peak_bytes / MIB  # a budget of one byte
        except BudgetError as e:
            return e.min_budget_mb


def _step_key(model: keras.Model, graph: PlanGraph) -> tuple:
    """What a plan for `model`'s step depends on: the layer calls and their
    shapes (the inputs' too, so the batch size), the persistent bytes, which
    calls have trainable weights, the optimizer's settings (the learning rate
    aside, which callbacks change between fits) and XLA."""
    optimizer = getattr(model, "optimizer", None)
    config = dict(optimizer.get_config()) if optimizer is not None else {}
    config.pop("learning_rate", None)
    return (graph.fingerprint(), tuple(sorted(graph.persistent_bytes.items())),
            tuple((n.param_bytes, tuple(t.bytes for t in n.outputs)) for n in graph),
            type(optimizer).__name__, repr(sorted(config.items())),
            getattr(model, "jit_compile", None),
            model.distribute_strategy.num_replicas_in_sync)


def _replicas_sharing(strategy: tf.distribute.Strategy, device: str) -> int:
    """How many of `strategy`'s local replicas run on `device`'s allocator: the
    replicas on CPUs when `device` is a CPU (logical CPU devices share the
    process's allocator), else 1 (each GPU has its own)."""
    if not device.startswith("CPU") or strategy.num_replicas_in_sync == 1:
        return 1
    devices = strategy.extended.worker_devices
    return max(1, sum(1 for d in devices if tf.DeviceSpec.from_string(d).device_type == "CPU"))


#: What a plan chosen when none fits measured, beside "lowest" (`api._best_effort`).
NEAR_LOWEST = f" (or within {api.MEASURED_SPREAD:.0%} of it at less compute)"


def _without_room(trials: list[dict[str, Any]], budget: float, overhead: float) -> str:
    """Why a trial within the budget was not the plan trained, when one of less
    compute than the plan trained (its `overhead`) measured so (else ""): a new
    user read this sentence under a plan measured 21% below the budget, where
    no such trial was passed over for it."""
    room = api.largest_with_room(budget)
    if not any(room < t["measured_bytes"] <= budget and t.get("overhead", 0.0) < overhead
               for t in trials):
        return ""
    return (f" A plan within the budget by less than {api.MEASURED_SPREAD:.0%} is kept "
            "only when no plan measures further below it: a later step can measure "
            "that much higher.")


def _replanned(plan: Plan, budget_mb: float) -> Plan:
    """`plan`, made for less than the user's budget to absorb a measured
    excess, stated against the user's `budget_mb` (its summary and the
    callback's messages say what it was made for)."""
    budget = int(budget_mb * MIB)
    if plan.budget_bytes != budget and plan.estimates is not None:
        plan.estimates = dataclasses.replace(plan.estimates, details={
            **plan.estimates.details, "replanned_for_bytes": plan.budget_bytes})
    plan.budget_bytes = budget
    return plan


def _trial_mb(plan: Plan | None) -> float | None:
    """What `plan` measured before training (its largest trial step), in MiB,
    or None when it was not measured."""
    details = plan.estimates.details if plan is not None and plan.estimates else {}
    found = details.get("measured_peak_bytes")
    return None if found is None else found / MIB


def _lower(new: Plan, old: Plan | None, step_mb: float) -> bool:
    """Whether `new` may be lower than the plan in use, `old`, whose training
    steps measured up to `step_mb`: by their measurements before training when
    both have one, else by `new`'s measurement against the steps, else by
    their predictions (when `old` has one)."""
    if old is None:
        return True
    new_trial, old_trial = _trial_mb(new), _trial_mb(old)
    if new_trial is not None:
        return new_trial < (old_trial if old_trial is not None else step_mb)
    if new.estimates is None or old.estimates is None:
        return True
    return new.peak_bytes <= old.peak_bytes


def _same_rewrite(a: Plan, b: Plan | None) -> bool:
    """Whether two plans rewrite the step alike (the same segments, offloads,
    placement of the updates and order), whatever their budgets and estimates."""
    return b is not None and (a.segments, a.offloaded, a.update_in_backward, a.pin_order) == (
        b.segments, b.offloaded, b.update_in_backward, b.pin_order)


def _static_batch(iterator: Any) -> bool:
    """Whether the batches of fit's iterator have a known batch dimension."""
    spec = getattr(iterator, "element_spec", None)
    if spec is None:
        return False
    shapes = [s.shape for s in tf.nest.flatten(spec) if isinstance(s, tf.TensorSpec)]
    return bool(shapes) and all(s.rank and s[0] is not None for s in shapes)
