"""`rewrite_model`: apply a Plan's recompute segments to a Keras model."""

from __future__ import annotations

from typing import Any

import keras

from tfremat.errors import TfrematError, UnsupportedModelError
from tfremat.graph.keras_graph import is_subclassed, walk_with_outputs
from tfremat.planners.plan import Plan
from tfremat.rewriter.functional import rebuild
from tfremat.rewriter.validate import structure_graph, validate_plan


def rewrite_model(model: keras.Model, plan: Plan, *, sample: Any = None) -> keras.Model:
    """A model computing the same as `model`, recomputing the plan's segments.

    The new model shares `model`'s layer objects and weights: training either
    trains both. Each top-level segment runs as one `RecomputeSegment` layer
    under `tf.recompute_grad`, its nested segments as recompute units inside
    it. Gradients and updates equal the original's (up to float rounding of
    the recompute): BatchNorm moving statistics are updated once per step and
    dropout replays its forward mask. `model` itself is not changed, also when
    the rewrite fails.

    Functional and Sequential models are rebuilt node by node (nested
    functional models are flattened). Subclassed models get the block-level
    fallback of `tfremat.rewriter.subclassed.rewrite_subclassed`: a new object
    of the user's class sharing its sublayers, whose chosen sublayers run
    under recomputation.

    Limits: Keras masks must not cross a segment border, and a layer adding a
    loss from its activations (`add_loss`, `activity_regularizer`) must stay
    outside segments; both raise `UnsupportedModelError`. Host offload in the
    plan is refused (`PlanValidationError`).

    Saving: the rewritten functional model saves to `.keras` and loads with
    `keras.models.load_model` once `tfremat.rewriter` is imported. Its weight
    paths differ from the original's, so a `.weights.h5` file of the original
    does not load into it: load the weights into the original instead (the
    rewritten model shares them), or load the original and rewrite it again.

    Args:
        model: A built functional, Sequential or subclassed Keras model.
        plan: A plan made for this model's graph (`Plan.graph_fingerprint`
            must match); only recompute segments are applied.
        sample: Subclassed models only: one input batch, to find the order
            of the sublayer calls when the shapes the model was built with do
            not tell its input (several inputs, integer inputs).

    Returns:
        A new `keras.Model` (uncompiled for functional models: compile it as
        you compiled the original).

    Raises:
        PlanMismatchError: the plan was made for another model or graph.
        PlanValidationError: the plan's segments are malformed for this model
            (unknown ids, input layers, overlaps, non-convex segments, shared
            layers split across segments), or it asks for host offload.
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

        return rewrite_subclassed(model, plan, sample)
    sites, output_refs = walk_with_outputs(model)
    validate_plan(plan, structure_graph(sites, model.name))
    try:
        return rebuild(model, sites, output_refs, plan.segments)
    except TfrematError:
        raise
    except ValueError as e:
        raise UnsupportedModelError(
            f"Could not rebuild {model.name!r} with the plan's segments: {e}") from e
