"""What TensorFlow's graph compilers may do to the ops the rewriter adds.

Grappler, the executor's graph optimiser, removes ops it finds redundant (an
`Identity` round trip, an `IdentityN` whose extra input nothing reads): an op
marked with `keep` stays. XLA (`jit_compile=True`, Keras's default with a GPU)
compiles the whole step and ignores both `tf.device` and such marks.

Compiled as one program, a step keeps little of a plan's saving: XLA's CPU
scheduler holds a new value (or an old copy) of every weight until the end of
the program, and the max-pool gradient's index arrays from its start
(docs/how-it-works.md, "XLA"). Within `units_compiled()` a recompute unit
compiles its forward pass, and its recompute with its gradients, as XLA
programs of their own, while the step between the units runs in TensorFlow's
executor, which frees each tensor after its last reader.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import control_flow_util

from tfremat.backend import TRACED_WITHIN
from tfremat.core import Plan

#: The attribute Grappler's optimisers leave an op alone for.
KEEP_ATTR = "_grappler_do_not_remove"


def keep(tensor: tf.Tensor) -> tf.Tensor:
    """Marks the op making `tensor` so that Grappler does not remove it.

    Args:
        tensor: A graph tensor (an eager one is returned as it is).

    Returns:
        `tensor`.
    """
    if not tf.executing_eagerly():
        tensor.op._set_attr(KEEP_ATTR, attr_value_pb2.AttrValue(b=True))
    return tensor


def in_xla() -> bool:
    """Whether the graph being built is compiled by XLA (`jit_compile=True`)."""
    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


_UNITS_COMPILED = contextvars.ContextVar("tfremat_units_compiled", default=False)


@contextlib.contextmanager
def units_compiled() -> Iterator[None]:
    """Within: recompute units traced outside XLA compile with XLA, each its
    forward pass and its recompute with its gradients.

    Compiled as one program (`jit_compile=True`), a rewritten step keeps less of
    its plan's saving: on CPU, XLA held every weight's new value, or a copy of
    its old one, to the end of the program (docs/how-it-works.md, "XLA").
    Traced within this context, with the step itself not compiled by XLA, each
    recompute segment is two XLA programs of its own and the step between them
    runs in TensorFlow's executor, which frees each tensor after its last
    reader. A segment whose outputs may carry Keras masks is not compiled, nor
    on a CPU one that draws random numbers (`exact_recompute.random_on_cpu`).
    The `Planner` (through `PlanInstallation`) runs a plan this way for a model
    compiled with `jit_compile=True`.

    Example:

    ```python
    smaller = tfremat.rewrite(model, budget_mb=6000, batch_size=64)
    smaller.compile(optimizer="adam", loss="mse", jit_compile=False)
    with tfremat.rewriter.units_compiled():  # where the step is traced
        smaller.fit(x, y)
    ```
    """
    token = _UNITS_COMPILED.set(True)
    try:
        yield
    finally:
        _UNITS_COMPILED.reset(token)


def compiling_units() -> bool:
    """Whether a recompute unit traced here compiles itself with XLA: within
    `units_compiled()`, in a graph that XLA does not compile already."""
    return _UNITS_COMPILED.get() and not tf.executing_eagerly() and not in_xla()


def compiles_segments(plan: Plan) -> bool:
    """Whether `plan`'s step, under XLA, compiles its recompute segments on
    their own (`units_compiled`): it has segments, and no host offload, whose
    step runs without XLA."""
    return bool(plan.segments) and not plan.offloaded


def train_units_compiled_under_xla(model: keras.Model) -> None:
    """Makes `model` (a model with recompute segments and no host offload)
    train as the `Planner` runs a plan under XLA, whenever it is compiled with
    `jit_compile=True`: its train function is made without XLA and runs within
    `units_compiled()`, so each segment compiles on its own and the step
    between the segments runs in TensorFlow's executor. Compiled otherwise, the
    model trains as Keras makes its step. `tfremat.measure_peak` measures the
    model's step the same way (`backend.TRACED_WITHIN`).

    Args:
        model: A model `tfremat.rewrite` made, compiled or not.
    """
    own: Callable[..., Any] = model.make_train_function

    def make_train_function(force: bool = False) -> Any:
        if model.jit_compile is not True:
            return own(force)
        if model.train_function is not None and not force:
            return model.train_function
        model.jit_compile = False
        try:
            own(force=True)
        finally:
            model.jit_compile = True
        step = model.train_function

        def train_function(iterator: Any) -> Any:
            with units_compiled():  # where the step is traced, at its first calls
                return step(iterator)

        model.train_function = train_function
        return train_function

    model.make_train_function = make_train_function
    setattr(model, TRACED_WITHIN, units_compiled)  # `tfremat.measure_peak` measures so too
