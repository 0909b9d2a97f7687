"""`unwrapped`: a rewritten model gives back the model it was rewritten from."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.rewriter import rewrite_helpers as h
from tests.rewriter.test_offload import DEVICES, OFFLOADS, _offload_plan
from tfremat.core import Plan, Segment
from tfremat.graph import structure_graph
from tfremat.rewriter import rewrite_model, unit_layers, unwrapped


def _nested_plan(model: keras.Model, updates: bool):
    ids = h.body_ids(model)
    parent = h.contiguous_segments(model, [len(ids) // 2])[0]
    plan = h.plan_for(model, [Segment(parent, children=[Segment(parent[:2])])])
    plan.update_in_backward = updates
    return plan


def _assert_is_the_original(model: keras.Model, rewritten: keras.Model) -> keras.Model:
    """`unwrapped(rewritten)` has `model`'s call sites (a nested model's
    flattened, as the rewrite flattened them: `inner/dense` is `dense`), output
    names and layer objects, and computes what `model` computes; a plan for
    `model` is a plan for it."""
    assert unit_layers(rewritten)
    original = unwrapped(rewritten)
    assert not unit_layers(original)

    def sites(m: keras.Model) -> list:
        def bare(ref: str) -> str:
            return ref.rsplit("/", 1)[-1]
        return [(bare(s.id), s.class_name, [bare(r) for r in s.inputs]) for s in h.walk(m)]

    assert sites(original) == sites(model)
    segments = [Segment(ids) for ids in h.contiguous_segments(model, [3])]
    plan = Plan.from_segments(structure_graph(model), segments)
    plan.for_graph(structure_graph(original))  # raises PlanMismatchError otherwise
    assert original.output_names == model.output_names
    assert {id(v) for v in original.weights} == {id(v) for v in model.weights}
    x = h.batch_for(model)
    for a, b in zip(keras.tree.flatten(original(x)), keras.tree.flatten(model(x)), strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    return original


@pytest.mark.parametrize("updates", [False, True], ids=["segments", "with-updates"])
@pytest.mark.parametrize("build", [h.residual_cnn, h.shared_layer_model, h.nested_model,
                                   h.transformer_block])
def test_a_rewritten_model_unwraps_to_the_model_it_was_rewritten_from(build, updates):
    # With updates in the backward pass the output layer runs in a unit, and
    # an Identity gives the output its name back: left out when unwrapped.
    keras.utils.set_random_seed(3)
    model = build()
    _assert_is_the_original(model, rewrite_model(model, _nested_plan(model, updates)))


def test_a_model_with_offload_units_unwraps_without_its_host_copies():
    keras.utils.set_random_seed(5)
    model = h.residual_cnn()
    plan = _offload_plan(model, OFFLOADS["residual_cnn"])
    original = _assert_is_the_original(model, rewrite_model(model, plan, **DEVICES))
    assert not [layer for layer in original.layers if "HostCopy" in type(layer).__name__]


def test_a_model_rewritten_twice_is_rewritten_from_the_first():
    keras.utils.set_random_seed(4)
    model = h.residual_cnn()
    once = rewrite_model(model, _nested_plan(model, True))
    plan = h.plan_for(model, h.contiguous_segments(model, [4, 9]))
    twice = rewrite_model(once, plan)
    # The plan's segments over the original layers, none of the first rewrite's units.
    first_units = {id(layer) for layer in once._flatten_layers() if layer.name in
                   unit_layers(once)}
    assert not first_units & {id(layer) for layer in twice._flatten_layers()}
    assert len(unit_layers(twice)) == len(plan.segments)
    h.assert_same_step(model, twice, h.batch_for(model))


def test_a_model_tfremat_did_not_rewrite_is_its_own_original():
    model = h.residual_cnn()
    assert unwrapped(model) is model


def test_compiled_it_trains_as_the_model_with_its_own_optimizer_and_a_custom_loss():
    """Compiled as the rewritten model is (to trace its step): the optimizer
    object itself, the loss and metrics made again, or as given when Keras
    cannot make them from their configuration (a loss it has no name for)."""
    keras.utils.set_random_seed(6)
    model = h.residual_cnn()

    def halved_mse(y_true, y_pred):  # not registered: its config does not load here
        return 0.5 * keras.ops.mean(keras.ops.square(y_true - y_pred))

    rewritten = rewrite_model(model, _nested_plan(model, False))
    rewritten.compile(optimizer=keras.optimizers.SGD(0.1), loss=halved_mse, metrics=["mae"])
    original = unwrapped(rewritten, compiled=True)
    assert original.compiled and original.optimizer is rewritten.optimizer
    x, y = h.batch_for(model), np.ones((2, 5), "float32")
    assert np.isclose(original.evaluate(x, y, verbose=0)[0],
                      rewritten.evaluate(x, y, verbose=0)[0])
