"""`UpdateUnit`: a Keras layer whose gradient function applies the optimizer's
update to its own weights."""

from __future__ import annotations

from typing import Any

import keras
from keras import tree

from tfremat.rewriter.backward_updates import BackwardUpdates
from tfremat.rewriter.exact_recompute import call_functional, keep


@keras.saving.register_keras_serializable(package="tfremat")
class UpdateUnit(keras.layers.Layer):
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

    def __init__(self, submodel: keras.Model, updates: BackwardUpdates | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.submodel = submodel
        self.updates = updates
        # The sub-model's layers cast their own inputs; keep dtypes as given.
        self._convert_input_args = False
        self.supports_masking = True
        self.built = True

    def call(self, inputs: list[Any], training: bool | None = None) -> list[Any]:
        if self.updates is None:
            return tree.flatten(call_functional(self.submodel, list(inputs), training))

        def run(*xs: Any) -> list[Any]:
            return call_functional(self.submodel, list(xs), training)

        outputs = keep(run, list(inputs), [self.submodel], self.updates.after_grads)
        return tree.flatten(outputs)

    def compute_mask(self, inputs: list[Any], previous_mask: Any = None) -> None:
        # `call` attaches the masks of the forward pass to the outputs.
        return None

    def compute_output_spec(self, inputs: list[Any],
                            training: bool | None = None) -> list[Any]:
        return tree.flatten(self.submodel.compute_output_spec(list(inputs)))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(),
                "submodel": keras.saving.serialize_keras_object(self.submodel)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "UpdateUnit":
        config = dict(config)
        submodel = keras.saving.deserialize_keras_object(config.pop("submodel"))
        return cls(submodel, **config)
