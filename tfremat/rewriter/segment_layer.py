"""`RecomputeSegment`: a Keras layer running a sub-graph under recomputation."""

from __future__ import annotations

from typing import Any

import keras
from keras import tree

from tfremat.rewriter.exact_recompute import call_functional, recompute
from tfremat.rewriter.submodel_layer import SubmodelLayer


@keras.saving.register_keras_serializable(package="tfremat")
class RecomputeSegment(SubmodelLayer):
    """Runs a functional sub-model whose activations are recomputed in the
    backward pass instead of kept.

    The forward pass keeps only the segment's inputs; the backward pass runs
    the sub-model again to get the activations its gradients need. The
    recompute is exact: it sees the BatchNorm moving statistics and the
    `SeedGenerator` states (dropout masks) of the forward pass, and updates
    neither (see `tfremat.rewriter.exact_recompute`). `training` is passed to every
    sublayer explicitly, also in the recompute.

    Keras masks cross the segment at run time, as they cross a nested
    functional model in Keras: the sub-model's layers see the masks of the
    segment's inputs, and the outputs carry the masks made inside; the
    symbolic outputs carry none. Losses the sub-model's layers add
    (`add_loss`, `activity_regularizer`) stay in `model.losses`, with their
    gradient.

    The layer is built by `tfremat.rewriter.rewriting` and saves with the
    model: `keras.models.load_model` restores it once `tfremat.rewriter` is
    imported (importing registers the class).

    Args:
        submodel: A functional `keras.Model` taking a list of tensors and
            returning a list of tensors: the segment's layer calls. Nested
            segments appear inside it as `RecomputeSegment` layers.
        updates: With updates in the backward pass, what the model's update
            units share: the segment's gradient function then applies the
            optimizer's update to the segment's own weights
            (`tfremat.rewriter.backward_updates`). Not saved: a loaded model
            updates after the backward pass.
        **kwargs: Base `keras.layers.Layer` arguments (`name`, ...).

    Example:

    ```python
    x = keras.Input((16,))
    h = keras.layers.Dense(16, activation="relu")(x)
    segment = RecomputeSegment(keras.Model([x], [h]))
    y = segment([keras.Input((16,))])[0]
    ```
    """

    def call(self, inputs: list[Any], training: bool | None = None) -> list[Any]:
        def run(*xs: Any) -> list[Any]:
            return call_functional(self.submodel, list(xs), training)

        after = self.updates.after_grads if self.updates is not None else None
        outputs = recompute(run, list(inputs), [self.submodel], after)
        return tree.flatten(outputs)
