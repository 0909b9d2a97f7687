"""Rewritten models compute the original's gradients and state updates."""

from __future__ import annotations

import keras
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.rewriter import rewrite_helpers as h
from tfremat.core import Segment
from tfremat.rewriter import RecomputeSegment, rewrite_model
from tfremat.rewriter import exact_recompute

MODELS = {
    "deep_mlp": h.deep_mlp,
    "residual_cnn": h.residual_cnn,
    "unet": h.unet,
    "rnn_stack": h.rnn_stack,
    "transformer_block": h.transformer_block,
    "shared_layer_model": h.shared_layer_model,
    "nested_model": h.nested_model,
}


def _segmentations(model: keras.Model) -> dict[str, list]:
    ids = h.body_ids(model)
    half = len(ids) // 2
    parent = h.contiguous_segments(model, [half])[0]
    children = [s for s in h.contiguous_segments(model, [2, half - 1])
                if set(s) <= set(parent)]
    return {
        "sqrt": h.sqrt_segments(model),
        "everything": [ids],
        "nested": [Segment(parent, children=[Segment(s) for s in children])],
    }


def _segment_layers(model: keras.Model) -> list:
    return [layer for layer in model.layers if isinstance(layer, RecomputeSegment)]


@pytest.mark.parametrize("segmentation", ["sqrt", "everything", "nested"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_and_state_match_original(name, segmentation):
    keras.utils.set_random_seed(1)
    model = MODELS[name]()
    segments = _segmentations(model)[segmentation]
    rewritten = rewrite_model(model, h.plan_for(model, segments))
    assert len(_segment_layers(rewritten)) == len(segments)
    h.assert_same_step(model, rewritten, h.batch_for(model))


@pytest.mark.parametrize("mode", ["function", "xla"])
@pytest.mark.parametrize("name", ["residual_cnn", "transformer_block", "nested_model"])
def test_gradients_match_in_graph_mode(name, mode):
    keras.utils.set_random_seed(2)
    model = MODELS[name]()
    rewritten = rewrite_model(model, h.plan_for(model, _segmentations(model)["nested"]))
    h.assert_same_step(model, rewritten, h.batch_for(model), mode)


@pytest.mark.parametrize("name", ["residual_cnn", "transformer_block", "nested_model",
                                  "rnn_stack", "unet"])
def test_units_compiled_by_xla_match_the_step_xla_compiles_whole(name, monkeypatch):
    # One unit over every layer: each random draw (dropout) is made in an XLA
    # program, as in the step XLA compiles whole, and the recompute draws the
    # forward pass's masks. On a CPU a unit drawing random numbers runs in the
    # executor (`random_on_cpu`); here it compiles, as where XLA draws them fast.
    monkeypatch.setattr(exact_recompute, "random_on_cpu", lambda layers: False)
    keras.utils.set_random_seed(2)
    model = MODELS[name]()
    rewritten = rewrite_model(model, h.plan_for(model, _segmentations(model)["everything"]))
    h.assert_same_step(model, rewritten, h.batch_for(model), "units", original_mode="xla")


@pytest.mark.parametrize("name", ["residual_cnn", "transformer_block", "nested_model",
                                  "rnn_stack"])
def test_units_with_dropout_match_the_step_without_xla_on_a_cpu(name):
    # There a unit drawing random numbers runs in the executor, as the layers
    # between the units do: every mask is the executor's, as without XLA.
    keras.utils.set_random_seed(2)
    model = MODELS[name]()
    assert exact_recompute.random_on_cpu(model.layers)  # it has dropout
    rewritten = rewrite_model(model, h.plan_for(model, _segmentations(model)["sqrt"]))
    h.assert_same_step(model, rewritten, h.batch_for(model), "units", original_mode="function")


@pytest.mark.parametrize("segmentation", ["sqrt", "nested"])
@pytest.mark.parametrize("name", ["residual_cnn", "transformer_block", "nested_model",
                                  "rnn_stack", "unet", "deep_mlp", "shared_layer_model"])
def test_units_compiled_by_xla_match_the_step_without_xla(name, segmentation):
    # Between the units the step runs in TensorFlow's executor, whose kernels
    # draw other random numbers than XLA's from one seed: without dropout the
    # two steps compute the same.
    keras.utils.set_random_seed(2)
    model = MODELS[name]()
    for layer in model._flatten_layers():
        for attribute in ("rate", "dropout"):
            if isinstance(vars(layer).get(attribute), float):  # not an RNN's property
                setattr(layer, attribute, 0.0)
    rewritten = rewrite_model(model, h.plan_for(model, _segmentations(model)[segmentation]))
    h.assert_same_step(model, rewritten, h.batch_for(model), "units", original_mode="function")


def test_nested_segments_become_inner_recompute_layers():
    model = h.residual_cnn()
    ids = h.body_ids(model)
    plan = h.plan_for(model, [Segment(ids[:12], children=[Segment(ids[1:5]),
                                                           Segment(ids[6:9])])])
    outer = _segment_layers(rewrite_model(model, plan))
    assert len(outer) == 1
    inner = [layer for layer in outer[0].submodel.layers
             if isinstance(layer, RecomputeSegment)]
    assert len(inner) == 2
    assert [layer.name for layer in inner[0].submodel.layers[1:]] == ids[1:5]


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_contiguous_segmentations_match(data):
    name = data.draw(st.sampled_from(["residual_cnn", "shared_layer_model",
                                      "transformer_block", "nested_model"]))
    keras.utils.set_random_seed(3)
    model = MODELS[name]()
    n = len(h.body_ids(model))
    cuts = data.draw(st.lists(st.integers(1, n - 1), max_size=6))
    segments = h.contiguous_segments(model, cuts)
    chosen = data.draw(st.lists(st.sampled_from(range(len(segments))), min_size=1,
                                unique=True))
    plan = h.plan_for(model, [segments[i] for i in sorted(chosen)])
    h.assert_same_step(model, rewrite_model(model, plan), h.batch_for(model))


APPLICATIONS = {
    "ResNet50": keras.applications.ResNet50,
    "DenseNet121": keras.applications.DenseNet121,
    "MobileNetV2": keras.applications.MobileNetV2,
    "VGG19": keras.applications.VGG19,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(APPLICATIONS))
def test_applications_gradients_match(name):
    keras.utils.set_random_seed(4)
    model = APPLICATIONS[name](weights=None, input_shape=(32, 32, 3), classes=10)
    for segments in (h.sqrt_segments(model), [h.body_ids(model)]):
        rewritten = rewrite_model(model, h.plan_for(model, segments))
        h.assert_same_step(model, rewritten, h.batch_for(model), "function")
