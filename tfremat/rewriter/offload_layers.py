"""Keras layers placing the host-offload mechanism in a rebuilt model.

`rewrite_model` inserts them for a plan's `Offload`s: one `HostCopy` after
each offloaded tensor, one `OffloadUnit` around each call (or recompute
segment) reading it, one `GradientSignal` before each prefetch trigger. They
hold devices and Python state shared across the model, so a model with
offload is not saved with them: save the original model (same weights) and
rewrite it again after loading.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import tree

from tfremat.rewriter.exact_recompute import call_functional
from tfremat.rewriter.offload import GradientSignals, offload_call, signal_gradient, to_host


class HostCopy(keras.layers.Layer):
    """Copies its input to the host device (see `tfremat.rewriter.offload.to_host`).

    The copy keeps its input's Keras mask.

    Args:
        host_device: The host device, e.g. `"/CPU:0"`.
        **kwargs: Base `keras.layers.Layer` arguments.
    """

    def __init__(self, host_device: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host_device = host_device
        self._convert_input_args = False
        self.supports_masking = True
        self.built = True

    def call(self, inputs: Any) -> Any:
        return to_host(inputs, self.host_device)

    def compute_output_spec(self, inputs: Any) -> Any:
        return keras.KerasTensor(inputs.shape, inputs.dtype)


class GradientSignal(keras.layers.Layer):
    """Identity on a prefetch trigger's inputs, recording their gradient.

    Each output keeps its input's Keras mask.

    Args:
        signals: The model's `GradientSignals`.
        key: The trigger's node id.
        **kwargs: Base `keras.layers.Layer` arguments.
    """

    def __init__(self, signals: GradientSignals, key: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signals = signals
        self.key = key
        self._convert_input_args = False
        self.supports_masking = True
        self.built = True

    def call(self, inputs: list[Any]) -> list[Any]:
        return signal_gradient(inputs, self.signals, self.key)

    def compute_output_spec(self, inputs: list[Any]) -> list[Any]:
        return [keras.KerasTensor(x.shape, x.dtype, sparse=x.sparse) for x in inputs]


class OffloadUnit(keras.layers.Layer):
    """Runs a sub-model whose backward pass reads offloaded inputs from the host.

    The layer takes the sub-model's inputs followed by the host copies of the
    offloaded ones. A sub-model of one layer call is a pure offload for
    Conv2D/Dense (Grappler prunes the dead re-run); a sub-model of a recompute
    segment is recomputed from the prefetched inputs. See
    `tfremat.rewriter.offload.offload_call`. Keras masks and losses cross the
    unit as they cross a `RecomputeSegment`.

    Args:
        submodel: A functional `keras.Model` taking and returning lists.
        offloaded: Position, in the sub-model's inputs, of each host copy
            appended to the layer's inputs.
        triggers: Prefetch trigger node id (None: just in time) of each host
            copy, in the same order.
        compute_device: Device of the backward re-run.
        signals: The model's `GradientSignals`.
        **kwargs: Base `keras.layers.Layer` arguments.
    """

    def __init__(self, submodel: keras.Model, offloaded: list[int],
                 triggers: list[str | None], compute_device: str,
                 signals: GradientSignals, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.submodel = submodel
        self.offloaded = offloaded
        self.triggers = triggers
        self.compute_device = compute_device
        self.signals = signals
        self._convert_input_args = False
        self.supports_masking = True
        self.built = True

    def call(self, inputs: list[Any], training: bool | None = None) -> list[Any]:
        n = len(inputs) - len(self.offloaded)
        device_inputs, host = list(inputs[:n]), inputs[n:]

        def run(*xs: Any) -> list[Any]:
            return call_functional(self.submodel, list(xs), training)

        outputs = offload_call(
            run, device_inputs, dict(zip(self.offloaded, host)), [self.submodel],
            compute_device=self.compute_device, signals=self.signals,
            triggers=dict(zip(self.offloaded, self.triggers)))
        return tree.flatten(outputs)

    def compute_mask(self, inputs: list[Any], previous_mask: Any = None) -> None:
        # `call` attaches the masks of the forward pass to the outputs.
        return None

    def compute_output_spec(self, inputs: list[Any],
                            training: bool | None = None) -> list[Any]:
        n = len(inputs) - len(self.offloaded)
        return tree.flatten(self.submodel.compute_output_spec(list(inputs[:n])))
