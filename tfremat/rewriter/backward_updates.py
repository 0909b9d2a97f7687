"""Optimizer updates inside the backward pass.

Plain Keras keeps every weight gradient until `optimizer.apply` runs after the
whole backward pass: at the end of backward, all the model's gradients are alive
at once. With updates in the backward pass, each unit of the rewritten model (a
layer call, or a recompute segment) applies the optimizer's per-variable update
in its own gradient function, as soon as its weight gradients are complete, and
hands no gradient on for those weights: each gradient is freed right after its
update, before the backward pass goes on.

The maths are `optimizer.apply`'s: the per-variable part of `apply`
(`apply_to_variables`: loss-scale factor, per-variable `clipnorm`/`clipvalue`,
weight decay, `update_step`, constraints) runs in the backward pass, reading the
learning rate (schedules included) and `iterations` before the step's
increment. The optimizer's `apply` is patched (`BackwardUpdates.patch`) so that
after the backward pass it updates only the remaining variables (shared weights,
whose gradient is complete only there; weights with a regularizer, whose loss
is computed outside their unit; under EMA, weights with a constraint, which
`apply` averages before constraining), then advances `iterations` once and
updates EMA as `apply` does. A variable is updated in the backward pass only when it
belongs to exactly one unit.

`fallback_reason` says when this cannot be exact (the update needs every
gradient, or the training step or optimizer are not Keras's own); the plan
then runs updates after the backward pass, as plain Keras does.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator, Sequence

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.optimizers.base_optimizer import BaseOptimizer

from tfremat.backend import xla_compiled
from tfremat.core import Plan, PlanGraph, interrupts_deferred, warn
from tfremat.graph import is_subclassed
from tfremat.simulation import simulate

#: Optimizer methods whose code decides what an update does. An optimizer
#: overriding any of them (Nadam's per-step product, Muon, ...) updates in ways
#: the split into per-unit and remaining updates cannot know.
UPDATE_METHODS = ("apply", "apply_gradients", "stateless_apply", "_backend_apply_gradients",
                  "_backend_update_step", "_distributed_tf_update_step", "_clip_gradients",
                  "_apply_weight_decay", "_filter_empty_gradients",
                  "_overwrite_variables_directly_with_gradients",
                  "_update_model_variables_moving_average")

_KERAS_OPTIMIZERS = (BaseOptimizer, TFOptimizer, keras.optimizers.Optimizer)


def optimizer_fallback_reason(optimizer: Any) -> str | None:
    """Why `optimizer`'s updates cannot run in the backward pass, or None.

    Args:
        optimizer: A Keras optimizer, or None.

    Returns:
        A sentence saying why, or None when they can.
    """
    if optimizer is None:
        return "the model has no optimizer (compile it first)"
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return ("LossScaleOptimizer (mixed_float16) checks every gradient for inf/NaN "
                "before any update")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return f"{type(optimizer).__name__} is not a Keras optimizer"
    if optimizer.global_clipnorm:
        return "global_clipnorm needs the norm of every gradient before any update"
    if optimizer.gradient_accumulation_steps:
        return "gradient_accumulation_steps accumulates gradients across steps"
    for name in UPDATE_METHODS:
        owner = next(c for c in type(optimizer).__mro__ if name in vars(c))
        if owner not in _KERAS_OPTIMIZERS:
            return (f"{type(optimizer).__name__} overrides {name}, so its update may "
                    "need every gradient")
    return None


def fallback_reason(model: keras.Model) -> str | None:
    """Why `model`'s optimizer updates cannot run in the backward pass, or None.

    They run there only when doing so gives exactly the update of
    `optimizer.apply` after the full backward pass: a functional or Sequential
    model with Keras's own `train_step`, no `tf.distribute` strategy (its
    all-reduce needs all gradients) and an optimizer that updates each variable
    from its own gradient (see `optimizer_fallback_reason`).

    Args:
        model: A Keras model.

    Returns:
        A sentence saying why not, or None when they can.

    Example:

    ```python
    reason = fallback_reason(model)
    if reason:
        print("updates stay after the backward pass:", reason)
    ```
    """
    if type(model).train_step is not TensorFlowTrainer.train_step:
        return (f"{type(model).__name__} has its own train_step, which may change the "
                "gradients before the update")
    if getattr(model, "_distribute_strategy", None) is not None or tf.distribute.has_strategy():
        return "a tf.distribute strategy all-reduces every gradient before the update"
    if is_subclassed(model):
        return ("subclassed models are rewritten block by block; updates in the backward "
                "pass apply to functional and Sequential models")
    return optimizer_fallback_reason(getattr(model, "optimizer", None))


#: Why `choose_updates("auto")` leaves the updates after the backward pass of a
#: model compiled by XLA. Measured on CPU (`benchmarks/results/rewrite_memory.md`):
#: compiled whole, XLA's temporary allocation of ResNet50's and DenseNet121's
#: steps was the same to 0.1 MiB either way; with the segments compiled on their
#: own, the peaks moved by -0.9% (ResNet50) and +1.0% (DenseNet121).
UNDER_XLA = ("under XLA (jit_compile=True) they lowered no peak in tfremat's benchmarks "
             "(ResNet50, DenseNet121): a step XLA compiles whole writes the variables at "
             "the end of its program, and with each recompute segment compiled on its own "
             "the peak was a segment's XLA temporaries")


def choose_updates(model: keras.Model, graph: PlanGraph, budget_bytes: int,
                   setting: bool | str) -> tuple[bool, str]:
    """Whether a plan for `model` runs its updates in the backward pass.

    Args:
        model: The model planned for.
        graph: Its PlanGraph.
        budget_bytes: The budget planned for.
        setting: True (when the optimizer allows it; a warning says why not
            otherwise), False, or `"auto"`: on when the optimizer allows it,
            the step does not fit the budget as it is and the model is not
            compiled by XLA (`UNDER_XLA`). Not only where they lower the plain
            step's peak: a plan moves the peak to where the weight gradients
            are live, and the updates pin the backward pass's order (a GPT's
            plan for 124.1 MiB, two fresh processes of 8 steps: medians 122.5
            and 133.7 MiB, largest step 146.9, without them; 127.6 and 127.6,
            largest 129.6, with them).

    Returns:
        The decision, and the note a plan carries when it is False ("" when
        updates in the backward pass were not asked for).

    """
    if setting is False:
        return False, ""
    reason = fallback_reason(model)
    if reason is not None:
        if setting is True:
            warn(f"tfremat: updates in the backward pass were asked for, but they "
                 f"stay after it: {reason}.", RuntimeWarning)
        return False, reason
    if setting == "auto":
        # XLA first: its step is measured, not predicted, so "predicted to fit"
        # would not be why a plan chosen by measurement keeps its updates after.
        if xla_compiled(model):
            return False, UNDER_XLA
        if simulate(graph).peak_bytes <= budget_bytes:
            return False, ("not needed: the step without a plan is predicted to fit the "
                           "budget")
    return True, ""


def apply_to_variables(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    """The per-variable part of `optimizer.apply` for some of its variables.

    Everything `apply` does for a variable, in its order: the loss-scale
    factor, per-variable clipping, weight decay, `update_step` (reading the
    current learning rate and `iterations`), the variable's constraint. What
    `apply` does once per step (advance `iterations`, EMA) is left to the
    patched `apply` after the backward pass.

    Args:
        optimizer: A built Keras optimizer that `optimizer_fallback_reason`
            accepts.
        grads: The complete gradient of each variable.
        variables: Keras variables the optimizer was built with.
    """
    with keras.name_scope(optimizer.name, caller=optimizer):
        scale = optimizer.loss_scale_factor
        if scale is not None:
            grads = [g / scale for g in grads]
        grads = optimizer._clip_gradients(list(grads))
        optimizer._apply_weight_decay(list(variables))
        optimizer._backend_update_step(grads, list(variables), optimizer.learning_rate)
        for variable in variables:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))


class _Eager:
    """The key of updates made outside any `tf.function` (weak-referenceable)."""


_EAGER = _Eager()


def _trace_key() -> Any:
    """What the updates of one step are kept under: the graph being traced,
    or one key for eager steps."""
    if tf.executing_eagerly():
        return _EAGER
    return tf.compat.v1.get_default_graph()


class BackwardUpdates:
    """What the update units of one rewritten model share.

    The units update only inside the model's own training step (`fit`,
    `train_on_batch`: its `train_step`, entered through `training_step`).
    Any other gradient through them (a custom training loop, a saliency map,
    an adversarial example) gets every gradient and updates nothing.

    Attributes:
        model: The model whose optimizer updates (the rewritten model, or the
            user's model while a plan is installed in it); None: no updates.
        shared: Ids of the variables that belong to more than one unit (or
            have a regularizer): updated after the backward pass
            (`set_units`).

    Example:

    ```python
    updates = BackwardUpdates()
    updates.set_units([[conv1], [bn1], [dense, tied_output]])
    updates.bind(model)
    with updates.training_step():
        model.train_step(data)   # units call updates.after_grads in their gradients
    updates.release()   # gives the optimizer its own apply back
    ```
    """

    def __init__(self) -> None:
        self.shared: set[int] = set()
        self.model: keras.Model | None = None
        self._warned: set[str] = set()
        self._done: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._patched: list[Any] = []
        self._steps = 0  # training steps being run (or traced) now

    @contextlib.contextmanager
    def training_step(self) -> Iterator[None]:
        """While it is open, gradients through the units update the weights:
        wraps the model's own training step (its trace, under `tf.function`)."""
        self._steps += 1
        try:
            yield
        finally:
            self._steps -= 1

    def set_units(self, units: Iterable[Sequence[Any]]) -> None:
        """Records the layers of each unit of the model (see `shared_variables`)."""
        self.shared = shared_variables(units)

    def bind(self, model: keras.Model) -> None:
        """Updates with `model.optimizer` from now on."""
        self.model = model

    def optimizer(self) -> Any:
        """The optimizer to update with now, or None: updates stay after the
        backward pass, and a warning (once per reason) says why (none outside
        a training step, where nothing is updated)."""
        if self.model is None or not self._steps:
            return None  # not bound (yet), or not a training step: no updates
        reason = fallback_reason(self.model)
        if reason is None:
            return self.model.optimizer
        if reason not in self._warned:
            self._warned.add(reason)
            warn(f"tfremat: optimizer updates of {self.model.name!r} run after "
                 f"the backward pass, not in it: {reason}.", RuntimeWarning)
        return None

    def after_grads(self, input_grads: list[Any], variables: list[Any],
                    var_grads: list[Any]) -> tuple[list[Any], list[Any]]:
        """Updates the unit's own variables from their complete gradients.

        Called by a unit's gradient function once its input and weight
        gradients exist. The update waits for the input gradients (so the
        weights' forward values are no longer read when they are assigned),
        and the input gradients handed on wait for the update (so the
        backward pass goes on only once the weight gradients are freed).

        Args:
            input_grads: Gradients of the unit's inputs.
            variables: The `tf.Variable`s the unit read.
            var_grads: Their gradients (None where unconnected).

        Returns:
            The input gradients, and the variables' gradients with None for
            each variable updated here.
        """
        optimizer = self.optimizer()
        if optimizer is None:
            return input_grads, var_grads
        if not optimizer.built:
            # Keras builds it in its first `apply`, on the first trace of the
            # train step, with the model's trainable variables: this unit's
            # update comes first, so it builds it here, as `apply` would, but
            # eagerly: variables made in a trace are initialised at its first
            # run, so a trace stopped by Ctrl-C or an error would leave the
            # slots uninitialised for every later fit. Ctrl-C waits for the
            # build to finish (halfway, the optimizer is marked built without
            # all its slots).
            with interrupts_deferred(), tf.init_scope(), \
                    keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(self.model.trainable_variables)
        # The tf.Variable under each Keras variable (`value` may be an autocast).
        # With EMA, `apply` averages a weight before its constraint applies: a
        # constrained weight is left to `apply`.
        known = {id(v._value): v for v in self.model.trainable_variables
                 if id(v) not in self.shared and v.regularizer is None
                 and not v.overwrite_with_gradient
                 and not (optimizer.use_ema and v.constraint is not None)}
        chosen = [k for k, (v, g) in enumerate(zip(variables, var_grads))
                  if g is not None and id(v) in known]
        if not chosen:
            return input_grads, var_grads
        done = [known[id(variables[k])] for k in chosen]
        waits = [_dense(g) for g in [*input_grads, *var_grads] if g is not None]
        with tf.control_dependencies(waits):
            apply_to_variables(optimizer, [var_grads[k] for k in chosen], done)
            # Reads after the assignments (automatic control dependencies order them).
            after = [tf.identity(v.value) for v in done]
        with tf.control_dependencies(after):
            input_grads = [None if g is None else tf.identity(g) for g in input_grads]
        self._done.setdefault(_trace_key(), set()).update(id(v) for v in done)
        self.patch(optimizer)
        var_grads = list(var_grads)
        for k in chosen:
            var_grads[k] = None
        return input_grads, var_grads

    def patch(self, optimizer: Any) -> None:
        """Makes `optimizer.apply` leave out the variables updated in this
        step's backward pass (once per optimizer; `release` undoes it).

        The patched `apply` behaves as the optimizer's own when no variable was
        updated in the backward pass of the step (or trace) calling it.
        """
        if any(o is optimizer for o in self._patched):
            return
        own = vars(optimizer).get("apply")
        original = optimizer.apply
        done = self._done

        def apply(grads: Iterable[Any], trainable_variables: Any = None) -> None:
            updated = done.pop(_trace_key(), None)
            grads = list(grads)
            if not updated:
                return original(grads, trainable_variables)
            variables = (list(trainable_variables) if trainable_variables is not None
                         else list(optimizer._trainable_variables))
            rest = [(g, v) for g, v in zip(grads, variables) if id(v) not in updated]
            if any(g is not None for g, _ in rest):
                return original([g for g, _ in rest], [v for _, v in rest])
            _finish_step(optimizer)

        apply.__tfremat_own__ = own  # what `release` puts back
        optimizer.apply = apply
        self._patched.append(optimizer)

    def release(self) -> None:
        """Gives each patched optimizer its own `apply` back."""
        for optimizer in self._patched:
            own = optimizer.apply.__tfremat_own__
            if own is None:
                del optimizer.apply
            else:
                optimizer.apply = own
        self._patched = []
        self._done = weakref.WeakKeyDictionary()


class BackwardOrder(BackwardUpdates):
    """Pins the backward pass to the simulator's order, updating nothing.

    Shared like `BackwardUpdates` by the units of a rewritten model
    (`Plan.pin_order`): each unit's gradient function hands its input
    gradients on only once its weight gradients are complete. The executor
    then cannot start the next unit's backward beside a weight-gradient
    kernel (on CPU, a 3x3 `Conv2DBackpropFilter` holds ~3x its input in
    scratch). On some models that makes the peak steady; on others it rose
    (docs/how-it-works.md, "Pinning the order"). The optimizer's `apply`
    runs after the backward pass as usual, but each variable's update waits
    for its unit's input gradients, as in the backward pass: TensorFlow runs
    an update as soon as its gradient exists, and one that ran while the
    input gradient's kernel still read the weights copied the variable into
    a new chunk of up to twice its size, so the bytes held before each step
    grew (ResNet152's chen-greedy plan, pinned: 238.3 -> 270.8 MiB over six
    steps; with the wait, 238.3 before every one).
    """

    def after_grads(self, input_grads: list[Any], variables: list[Any],
                    var_grads: list[Any]) -> tuple[list[Any], list[Any]]:
        """The input gradients, each waiting for the unit's weight gradients;
        the weight gradients, each waiting for the unit's input gradients."""
        waits = [_dense(g) for g in var_grads if g is not None]
        if not waits:
            return input_grads, var_grads
        reads = [_dense(g) for g in input_grads if g is not None]
        with tf.control_dependencies(reads):
            held = [None if g is None else tf.identity(g) for g in var_grads]
        with tf.control_dependencies(waits):
            input_grads = [None if g is None else tf.identity(g) for g in input_grads]
        return input_grads, held


def _dense(grad: Any) -> Any:
    """The tensor of a gradient's values (an `IndexedSlices`' values)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def update_in_training_steps(model: keras.Model, updates: BackwardUpdates) -> None:
    """Makes `model`'s own training step (a model `rewrite_model` made) the
    one in which `updates` update the weights (`BackwardUpdates.training_step`).

    Args:
        model: The rewritten model, bound to `updates`.
        updates: What its units share.
    """
    own = model.train_step

    def train_step(data: Any) -> Any:
        try:
            with updates.training_step():
                return own(data)
        finally:
            # The patched `apply` was called in the step (or its trace): holding
            # it would hold the optimizer, as a stand-in `measure_peak` built
            # and dropped (its slots stayed on the device, one per call).
            updates.release()

    model.train_step = train_step


def for_plan(plan: Plan) -> BackwardUpdates | None:
    """What the units of a model rewritten for `plan` share in the backward pass.

    Args:
        plan: A `tfremat.Plan`.

    Returns:
        A `BackwardUpdates` when the plan updates in the backward pass, a
        `BackwardOrder` when it only pins the order, else None.
    """
    if plan.update_in_backward:
        return BackwardUpdates()
    return BackwardOrder() if plan.pin_order else None


def _finish_step(optimizer: Any) -> None:
    """What `apply` does once per step when every gradient was applied in the
    backward pass: EMA (as `_backend_apply_gradients`), then `iterations`."""
    with keras.name_scope(optimizer.name, caller=optimizer):
        if optimizer.use_ema:
            optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
            if optimizer.ema_overwrite_frequency:
                overwrite = (optimizer.iterations + 1) % optimizer.ema_overwrite_frequency == 0
                keras.ops.cond(
                    overwrite,
                    lambda: optimizer._overwrite_model_variables_with_average_value(
                        optimizer._trainable_variables),
                    lambda: None)
    optimizer._iterations.assign_add(1)


def shared_variables(units: Iterable[Sequence[Any]]) -> set[int]:
    """Ids of the trainable variables that cannot be updated in one unit.

    Args:
        units: For each unit of a rewritten model, the layers it calls.

    Returns:
        The ids of variables read by more than one unit (shared layers, tied
        weights), and of those with a regularizer (its loss is computed after
        the forward pass, outside any unit).
    """
    owners: dict[int, int] = {}
    out: set[int] = set()
    for layers in units:
        seen = {id(v): v for layer in layers
                for v in getattr(layer, "trainable_variables", [])}
        for key, v in seen.items():
            owners[key] = owners.get(key, 0) + 1
            if v.regularizer is not None:
                out.add(key)
    return out | {key for key, n in owners.items() if n > 1}

