"""`PlanInstallation`: train a model with a plan, undoably.

`rewrite_model` makes a new model. Inside `fit`, the model object must stay the
user's (its optimizer, metrics, callbacks and History belong to it), so a plan
is installed instead: the model's train function is replaced by one whose step
runs the rewritten graph, and the original comes back on `restore()`.

The model itself is touched only while a step runs: `model.call` is swapped for
the rewritten model's `call` around each call of the train function (that is
when TensorFlow traces it, also when it retraces for a smaller last batch) and
swapped back in a `finally`. Between steps, `predict`, `evaluate` and `save`
see the plain model, and an exception or Ctrl-C inside a step leaves nothing
patched but the train function, which `restore()` puts back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import keras

from tfremat.backend import xla_compiled
from tfremat.core import Plan, interrupts_deferred
from tfremat.memory import MeasuredPeak, measure_peak
from tfremat.rewriter.backward_updates import for_plan
from tfremat.rewriter.compilers import compiles_segments, units_compiled
from tfremat.rewriter.rewriting import rewrite_model
from tfremat.rewriter.unwrap import unit_layers


class PlanInstallation:
    """A plan applied to a compiled model's training step, undoably.

    Args:
        model: A compiled Keras model.
        plan: A plan for `model` (an empty plan installs the plain step).
        jit_compile: Whether the planned step runs under XLA; None keeps the
            model's setting. A plan with host offload needs False (XLA ignores
            device placement). The model's own `jit_compile` is not changed.
            Under XLA a plan with recompute segments compiles each segment on
            its own, its forward pass and its recompute with its gradients,
            and the step between them runs in TensorFlow's executor
            (`units_compiled`): compiled whole, the step keeps less of the
            plan's saving (docs/how-it-works.md, "XLA").

    Attributes:
        units_compiled: Whether the segments compile on their own as above.

    Example:

    ```python
    with PlanInstallation(model, plan) as installed:
        logs = model.train_function(iterator)   # the planned step
    # the model trains plainly again
    ```
    """

    def __init__(self, model: keras.Model, plan: Plan, *,
                 jit_compile: bool | None = None) -> None:
        self.model = model
        self.plan = plan
        xla = xla_compiled(model) if jit_compile is None else jit_compile
        self.units_compiled = xla and compiles_segments(plan)
        self.jit_compile = False if self.units_compiled else jit_compile
        # With updates in the backward pass, the units update with the model's
        # own optimizer, whose `apply` they patch until `restore()`; with a
        # pinned order, they only order the backward pass.
        self._updates = for_plan(plan)
        if self._updates is not None:
            self._updates.bind(model)
        # Rewriting first: if it fails, nothing of the model was touched.
        # An empty plan installs the plain step: nothing to swap, unless the
        # model was rewritten before (it then runs the model it was made from).
        self._call = None if plan.is_empty and not unit_layers(model) else rewrite_model(
            model, plan, updates=self._updates, keep_class=False).call
        self._original: Callable[..., Any] | None = None
        self._planned: Callable[..., Any] | None = None
        self.installed = False

    def install(self) -> None:
        """Makes `model.train_function` run the planned step."""
        if self.installed:
            return
        model = self.model
        self._original = model.train_function
        saved_jit = model.jit_compile
        try:
            if self.jit_compile is not None:
                model.jit_compile = self.jit_compile
            model.make_train_function(force=True)
            self._planned = model.train_function
        finally:
            model.jit_compile = saved_jit
        model.train_function = self.run
        self.installed = True

    def run(self, iterator: Any) -> Any:
        """Runs the planned train function on `iterator` (what Keras's `fit`
        calls once `install()` made it the model's train function)."""
        with self._patched_call():
            return self._planned(iterator)

    def measure_peak(self, *, batch_size: int | None = None, sample: Any = None,
                     repeats: int = 2, return_details: bool = False) -> int | MeasuredPeak:
        """Measures the device peak of the planned step, installed or not.

        `tfremat.measure_peak` runs the model's own training step (its loss,
        metrics and optimizer) with the rewritten call, and restores every
        variable the step touched: the model trains afterwards as if nothing
        had run.

        Args:
            batch_size: Batch size, when shapes come from `model.inputs`.
            sample: One batch `(x, y)`, whose values the steps use, or a
                `tf.data.Dataset`, for whose shapes random data is made.
            repeats: Measured steps after a warm-up step.
            return_details: Return a `MeasuredPeak` (with the bytes in use
                before the step) instead of bytes.

        Returns:
            Peak bytes of the device during a step, or a `MeasuredPeak`.
        """
        model = self.model
        saved_jit = model.jit_compile
        try:
            if self.jit_compile is not None:
                model.jit_compile = self.jit_compile
            with self._patched_call():
                return measure_peak(model, batch_size=batch_size, sample=sample,
                                    repeats=repeats, return_details=return_details)
        finally:
            model.jit_compile = saved_jit
            if not self.installed and self._updates is not None:
                self._updates.release()

    def restore(self) -> None:
        """Puts the model's own train function (and its optimizer's `apply`)
        back (safe to call twice)."""
        with interrupts_deferred():
            if self._updates is not None:
                self._updates.release()
            if not self.installed:
                return
            self.model.train_function = self._original
            self._original = self._planned = None
            self.installed = False

    @contextlib.contextmanager
    def _patched_call(self) -> Iterator[None]:
        if self._call is None:
            yield
            return
        own = vars(self.model)
        before = own.get("call")  # an instance attribute the user set, if any
        self.model.call = self._call
        # The step run here is the model's training step: its units update.
        steps = (self._updates.training_step() if self._updates is not None
                 else contextlib.nullcontext())
        try:
            with steps, units_compiled() if self.units_compiled else contextlib.nullcontext():
                yield
        finally:
            with interrupts_deferred():
                if before is None:
                    del self.model.call
                else:
                    self.model.call = before

    def __enter__(self) -> "PlanInstallation":
        self.install()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.restore()
