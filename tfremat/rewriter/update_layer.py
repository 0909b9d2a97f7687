"""`UpdateUnit`: a Keras layer whose gradient function applies the optimizer's
update to its own weights."""

from __future__ import annotations

from typing import Any

import keras
from keras import tree

from tfremat.rewriter.exact_recompute import call_functional, keep
from tfremat.rewriter.submodel_layer import SubmodelLayer


@keras.saving.register_keras_serializable(package="tfremat")
class UpdateUnit(SubmodelLayer):
    """Runs a functional sub-model (one layer call) as one unit of the backward
    pass, in which the optimizer updates the unit's own weights.

    The forward pass and the activations it keeps are those of the sub-model's
    layers. Its gradient function differentiates them; then, the weight
    gradients being complete, it applies the optimizer's per-variable update
    and hands on only the input gradients, so each weight gradient is freed
    before the backward pass goes on (`tfremat.rewriter.backward_updates`).
    Weights shared with another unit are left to the optimizer's `apply` after
    the backward pass. Masks and added losses cross the unit as they cross a
    `RecomputeSegment`.

    Args:
        submodel: A functional `keras.Model` taking and returning lists of
            tensors: the unit's layer call.
        updates: What the model's update units share. Not saved: a loaded
            model updates after the backward pass.
        **kwargs: Base `keras.layers.Layer` arguments (`name`, ...).

    Example:

    ```python
    x = keras.Input((16,))
    unit = UpdateUnit(keras.Model([x], [keras.layers.Dense(16)(x)]), updates)
    y = unit([keras.Input((16,))])[0]
    ```
    """

    def call(self, inputs: list[Any], training: bool | None = None) -> list[Any]:
        if self.updates is None:
            return tree.flatten(call_functional(self.submodel, list(inputs), training))

        def run(*xs: Any) -> list[Any]:
            return call_functional(self.submodel, list(xs), training)

        outputs = keep(run, list(inputs), [self.submodel], self.updates.after_grads)
        return tree.flatten(outputs)
