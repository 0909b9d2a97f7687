"""`SubmodelLayer`: what `RecomputeSegment` and `UpdateUnit` share, a Keras
layer running a functional sub-model whose `call` each defines."""

from __future__ import annotations

from typing import Any

import keras
from keras import tree

from tfremat.rewriter.backward_updates import BackwardUpdates


class SubmodelLayer(keras.layers.Layer):
    """A layer running `submodel` (lists of tensors in and out), saved with it.

    Subclasses define `call`. Masks cross it at run time (`call` attaches the
    forward pass's masks to the outputs); `updates` is not saved, so a loaded
    model updates after the backward pass.

    Args:
        submodel: A functional `keras.Model` taking and returning lists of tensors.
        updates: What the model's update units share, with updates in the
            backward pass; None without.
        **kwargs: Base `keras.layers.Layer` arguments (`name`, ...).
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
    def from_config(cls, config: dict[str, Any]) -> "SubmodelLayer":
        config = dict(config)
        submodel = keras.saving.deserialize_keras_object(config.pop("submodel"))
        return cls(submodel, **config)
