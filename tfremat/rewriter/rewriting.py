"""`rewrite_model`: apply a Plan's recompute segments to a Keras model."""

from __future__ import annotations

from typing import Any

import keras

import tensorflow as tf

from tfremat.core import (Plan, PlanGraph, PlanMismatchError, PlanValidationError,
                          TfrematError, UnsupportedModelError, validate_plan, warn)
from tfremat.graph import is_subclassed, structure_graph, walk_with_outputs
from tfremat.rewriter.backward_updates import (BackwardUpdates, for_plan,
                                               update_in_training_steps)
from tfremat.rewriter.functional import OffloadSettings, rebuild
from tfremat.rewriter.unwrap import unit_layers, unwrapped


def rewrite_model(model: keras.Model, plan: Plan, *, compute_device: str | None = None,
                  host_device: str | None = None, sample: Any = None,
                  updates: BackwardUpdates | None = None,
                  keep_class: bool = True) -> keras.Model:
    """A model computing the same as `model`, recomputing the plan's segments
    and keeping its offloaded tensors on the host.

    The new model shares `model`'s layer objects and weights: training either
    trains both. Each top-level segment runs as one `RecomputeSegment` layer
    under tfremat's `recompute_grad` (`checkpoint.py`), its nested segments as
    recompute units inside it. Gradients and updates equal the original's (up
    to float rounding of the recompute): BatchNorm moving statistics are
    updated once per step and dropout replays its forward mask. `model` itself
    is not changed, also when the rewrite fails.

    Functional and Sequential models are rebuilt node by node (nested
    functional models are flattened), as a `keras.Model`, or of the model's
    own class when it has its own `train_step` (or `compute_loss`, ...:
    `functional.TRAINING_METHODS`) and takes `inputs`, `outputs` and `name`.
    Subclassed models get the block-level fallback of
    `tfremat.rewriter.subclassed.rewrite_subclassed`: a new object of the
    user's class sharing its sublayers, whose chosen sublayers run under
    recomputation.

    Host offload (`plan.offloaded`, functional and Sequential models): each
    offloaded tensor is copied to `host_device` after the call making it, and
    each call (or top-level segment) reading it runs as an `OffloadUnit` whose
    backward copies the tensor back to `compute_device` and differentiates the
    call from that copy, so the device copy is freed after its last forward
    use. The copy back starts after the backward of the layer named by
    `prefetch_after` (a later layer), or just in time when None. Gradients are
    bit-identical to the original's for calls whose gradient needs only their
    inputs (Conv2D, Dense, whose dead re-run Grappler prunes); a call whose
    gradient needs its own output (ReLU, BatchNorm) is re-run from the copy,
    and a segment reading an offloaded tensor is recomputed from it. On a GPU
    the host copies land in pinned memory (TensorFlow's `gpu_host_bfc`
    allocator, capped by `TF_GPU_HOST_MEM_LIMIT_IN_MB`). XLA ignores
    `tf.device`: compile the rewritten model with `jit_compile=False` (Keras's
    default "auto" means True on a GPU); offload units warn when traced under
    XLA. A model with offload does not save: save the original (it shares the
    weights) and rewrite it again.

    Keras masks cross segment and offload-unit borders at run time (the
    layers inside see the masks of the unit's inputs; its outputs carry the
    masks made inside), and the losses layers inside add (`add_loss`,
    `activity_regularizer`) stay in `model.losses` with their gradient
    (`tfremat.rewriter.exact_recompute`).

    Updates in the backward pass (`plan.update_in_backward`, functional and
    Sequential models): each top-level segment and each other call with
    trainable weights applies the optimizer's update to its own weights in its
    gradient function (`tfremat.rewriter.backward_updates`), with the
    optimizer of the rewritten model (or of the model `updates` is bound to).
    Weights shared between units, and weights with a regularizer, are updated
    after the backward pass. Training gives the weights and optimizer state of
    plain training; the weights updated in the backward pass get no gradient
    from `tape.gradient`.

    A pinned order (`plan.pin_order`) wraps the same units, whose gradient
    functions then update nothing but hand their input gradients on only once
    their weight gradients are complete (`BackwardOrder`); on a subclassed
    model, the recomputed sublayer calls.

    Limits: a tensor recomputed inside its segment, a model output, or any
    tensor of a subclassed model cannot be offloaded (`PlanValidationError`).
    A layer must add the same losses when recomputed as in the forward pass
    (`UnsupportedModelError` naming it otherwise).

    Saving: the rewritten functional model saves to `.keras` and loads with
    `keras.models.load_model` once `tfremat.rewriter` is imported. Its weight
    paths differ from the original's, so a `.weights.h5` file of the original
    does not load into it: load the weights into the original instead (the
    rewritten model shares them), or load the original and rewrite it again.

    Args:
        model: A built functional, Sequential or subclassed Keras model.
        plan: A plan made for this model's graph (`Plan.graph_fingerprint`
            must match; a plan made for the same model with other layer names
            is renamed, see `Plan.for_graph`).
        compute_device: The device the model computes on (offload only).
            Default: `"/GPU:0"` when a GPU exists.
        host_device: The device of the host copies (offload only). Default:
            `"/CPU:0"`.
        sample: Subclassed models only: one input batch, to find the order
            of the sublayer calls when the shapes the model was built with do
            not tell its input (several inputs, integer inputs).
        updates: With `plan.update_in_backward` (or `plan.pin_order`), the
            state the units share, when the caller binds it to another model (what
            `PlanInstallation` does); by default a new one bound to the
            rewritten model.
        keep_class: Whether a functional model with its own training methods
            is rebuilt of its own class (above); False makes a `keras.Model`,
            for a caller that runs only its `call` in the user's model (what
            `PlanInstallation` does).

    Returns:
        A new `keras.Model` (uncompiled for functional models: compile it as
        you compiled the original).

    Raises:
        PlanMismatchError: the plan was made for another model or graph.
        PlanValidationError: the plan's segments are malformed for this model
            (unknown ids, input layers, overlaps, non-convex segments, shared
            layers split across segments), or its offloads cannot be applied
            (see above), or there is no separate device to offload to.
        UnsupportedModelError: the model cannot be rewritten.

    Example:

    ```python
    sites = tfremat.graph.keras_graph.walk(model)
    plan = tfremat.Plan(tfremat.graph.keras_graph.fingerprint(sites),
                        segments=[tfremat.Segment(["dense_1", "dense_2"])])
    smaller = rewrite_model(model, plan)
    smaller.compile(optimizer="adam", loss="mse")
    smaller.fit(x, y)
    ```
    """
    if not isinstance(model, keras.Model):
        raise UnsupportedModelError(
            f"rewrite_model takes a keras.Model, not {type(model).__name__}.")
    if is_subclassed(model):
        from tfremat.rewriter.subclassed import rewrite_subclassed

        if plan.offloaded:
            raise PlanValidationError(
                f"Subclassed model {model.name!r}: host offload is applied to "
                "functional and Sequential models only. Plan without offload.")
        if plan.update_in_backward:
            warn(f"tfremat: subclassed model {model.name!r} updates its weights "
                 "after the backward pass: updates in the backward pass apply "
                 "to functional and Sequential models.", RuntimeWarning)
        return rewrite_subclassed(model, plan, sample)
    model, structure, plan = _planned_model(model, plan)
    sites, output_refs = walk_with_outputs(model)
    validate_plan(plan, structure)
    offload = None
    if plan.offloaded:
        offload = OffloadSettings({o.tensor: o.prefetch_after for o in plan.offloaded},
                                  *_offload_devices(compute_device, host_device))
    if plan.update_in_backward or plan.pin_order:
        if updates is None:
            updates = for_plan(plan)
        by_id = {s.id: s.operation for s in sites}
        inside = plan.recomputed_nodes()
        updates.set_units([[by_id[n] for n in seg.nodes] for seg in plan.segments]
                          + [[s.operation] for s in sites if s.id not in inside])
    else:
        updates = None
    try:
        rewritten = rebuild(model, sites, output_refs, plan.segments, offload, updates,
                            keep_class)
    except TfrematError:
        raise
    except ValueError as e:
        raise UnsupportedModelError(
            f"Could not rebuild {model.name!r} with the plan's segments: {e}") from e
    if updates is not None and updates.model is None:
        updates.bind(rewritten)
        update_in_training_steps(rewritten, updates)
    return rewritten


def _planned_model(model: keras.Model, plan: Plan) -> tuple[keras.Model, PlanGraph, Plan]:
    """The model `plan` rewrites, its structure graph and `plan` in its node ids.

    A model rewritten before: a plan for the model it was rewritten from
    (`unwrapped`) rewrites that; a plan for its own graph (units as layers)
    rewrites it as it is.

    Raises:
        PlanMismatchError: the plan was made for neither.
    """
    if unit_layers(model):
        original = unwrapped(model)
        structure = structure_graph(original)
        try:
            return original, structure, plan.for_graph(structure)
        except PlanMismatchError:
            pass
    structure = structure_graph(model)
    return model, structure, plan.for_graph(structure)


def _offload_devices(compute_device: str | None,
                     host_device: str | None) -> tuple[str, str]:
    """The compute and host devices of an offload plan, defaults filled in."""
    if compute_device is None:
        if not tf.config.list_logical_devices("GPU"):
            raise PlanValidationError(
                "The plan offloads tensors to the host, but this machine has no GPU: "
                "there is no separate device to offload from. Plan without offload, "
                "or pass compute_device and host_device explicitly.")
        compute_device = "/GPU:0"
    host_device = host_device or "/CPU:0"
    if tf.DeviceSpec.from_string(compute_device) == tf.DeviceSpec.from_string(host_device):
        raise PlanValidationError(
            f"Offload needs two devices; compute_device and host_device are both "
            f"{compute_device!r}.")
    return compute_device, host_device
