"""Invalid plans are rejected with messages naming the problem, and a failed
rewrite leaves the original model as it was."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.rewriter import rewrite_helpers as h
from tfremat.core import PlanMismatchError, PlanValidationError
from tfremat.core import Offload, Plan, Segment
from tfremat.graph.keras_graph import structure_graph
from tfremat.rewriter import rewrite_model
from tfremat.rewriter import functional as functional_rebuild


def test_non_convex_segment_is_rejected():
    # In the U-Net the first conv feeds the encoder and the last Concatenate:
    # a segment of just those two is left and re-entered by the path between.
    model = h.unet()
    ids = h.body_ids(model)
    last_concat = [i for i in ids if i.startswith("concatenate")][-1]
    with pytest.raises(PlanValidationError, match="not convex"):
        rewrite_model(model, h.plan_for(model, [[ids[0], last_concat]]))


def test_unknown_node_id_is_named():
    model = h.deep_mlp()
    with pytest.raises(PlanValidationError, match="no_such_layer"):
        rewrite_model(model, h.plan_for(model, [["dense", "no_such_layer"]]))


def test_plan_for_another_graph_names_both_fingerprints():
    model, other = h.deep_mlp(), h.residual_cnn()
    plan = h.plan_for(other, [h.body_ids(other)[:3]])
    with pytest.raises(PlanMismatchError) as info:
        rewrite_model(model, plan)
    assert plan.graph_fingerprint in str(info.value)
    assert h.plan_for(model, []).graph_fingerprint in str(info.value)


def test_a_plan_applies_to_the_same_model_built_after_another():
    """Keras numbers unnamed layers per process: the same architecture built
    second has other names, so another fingerprint. A plan records its graph's
    node ids, so it is renamed by position and recomputes the same layers of
    the second model. (The autouse `_clear_keras_session` fixture starts the
    test with fresh counters.)"""
    def build() -> keras.Model:
        inp = keras.Input((4,))
        return keras.Model(inp, keras.layers.Dense(2)(keras.layers.Dense(3)(inp)))

    first = build()
    plan = Plan.from_segments(structure_graph(first), [h.body_ids(first)[:1]])
    second = build()
    assert h.body_ids(second) != h.body_ids(first)
    rewritten = rewrite_model(second, plan)
    segments = [layer for layer in rewritten.layers
                if isinstance(layer, functional_rebuild.RecomputeSegment)]
    assert len(segments) == 1
    inner = [layer for layer in segments[0].submodel.layers
             if not isinstance(layer, keras.layers.InputLayer)]
    assert inner == [second.layers[1]] and inner[0] is not first.layers[1]
    # Through JSON, as a plan saved in another process arrives.
    again = rewrite_model(second, Plan.from_json(plan.to_json()))
    assert [type(layer) for layer in again.layers] == [type(layer) for layer in rewritten.layers]


def test_a_hand_made_plan_for_other_names_is_refused_with_the_way_out():
    """A plan without node ids (made by hand from a fingerprint) cannot be
    renamed: the error says what gives a fresh process's names again, and
    that works."""
    def build() -> keras.Model:
        inp = keras.Input((4,))
        return keras.Model(inp, keras.layers.Dense(2)(keras.layers.Dense(3)(inp)))

    first = build()
    plan = h.plan_for(first, [h.body_ids(first)[:1]])
    with pytest.raises(PlanMismatchError, match=r"keras\.backend\.clear_session\(\)"):
        rewrite_model(build(), plan)
    keras.backend.clear_session()
    rewritten = rewrite_model(build(), plan)
    assert any(isinstance(layer, functional_rebuild.RecomputeSegment)
               for layer in rewritten.layers)


def test_a_plan_for_another_structure_is_not_renamed():
    """Renaming is by position, only for the same classes, edges and order:
    one more layer, or another class at a position, is still refused."""
    def build(width: int, head: keras.layers.Layer | None = None) -> keras.Model:
        inp = keras.Input((4,))
        x = inp
        for _ in range(width):
            x = keras.layers.Dense(3)(x)
        return keras.Model(inp, (head or keras.layers.Dense(2))(x))

    first = build(2)
    plan = Plan.from_segments(structure_graph(first), [h.body_ids(first)[:1]])
    for other in (build(3), build(2, keras.layers.Reshape((3,)))):
        with pytest.raises(PlanMismatchError, match="Plan again for this model"):
            rewrite_model(other, plan)


def test_input_layer_in_segment_is_rejected():
    model = h.deep_mlp()
    input_id = [s for s in h.walk(model) if s.is_input][0].id
    with pytest.raises(PlanValidationError, match="Input layer"):
        rewrite_model(model, h.plan_for(model, [[input_id, h.body_ids(model)[0]]]))


def test_overlapping_segments_are_rejected():
    model = h.deep_mlp()
    ids = h.body_ids(model)
    with pytest.raises(PlanValidationError, match=rf"\['{ids[2]}'\] are in two segments"):
        rewrite_model(model, h.plan_for(model, [ids[:3], ids[2:5]]))


def test_split_shared_layer_is_rejected():
    model = h.shared_layer_model()
    with pytest.raises(PlanValidationError, match="Shared layer 'shared'"):
        rewrite_model(model, h.plan_for(model, [["shared@0"]]))


def test_split_shared_layer_in_nested_segment_is_rejected():
    model = h.shared_layer_model()
    ids = h.body_ids(model)
    plan = h.plan_for(model, [Segment(ids[:4], children=[Segment(["shared@1"])])])
    with pytest.raises(PlanValidationError, match="nested segment"):
        rewrite_model(model, plan)


def test_offload_onto_the_compute_device_itself_is_refused():
    model = h.deep_mlp()
    plan = h.plan_for(model, [])
    plan.offloaded = [Offload(f"{h.body_ids(model)[0]}:0")]
    with pytest.raises(PlanValidationError, match="Offload needs two devices"):
        rewrite_model(model, plan, compute_device="/CPU:0", host_device="/CPU:0")


def _state(model: keras.Model, x) -> tuple:
    return ([w.copy() for w in model.get_weights()], list(model.layers),
            list(model.outputs), model.predict(x, verbose=0), model.get_config())


def _assert_unchanged(model: keras.Model, x, before: tuple) -> None:
    weights, layers, outputs, prediction, config = before
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert model.layers == layers
    assert all(a is b for a, b in zip(model.outputs, outputs))
    np.testing.assert_array_equal(model.predict(x, verbose=0), prediction)
    assert model.get_config() == config


def test_failed_validation_leaves_model_unchanged():
    model = h.residual_cnn()
    x = h.batch_for(model)
    before = _state(model, x)
    with pytest.raises(PlanValidationError):
        rewrite_model(model, h.plan_for(model, [["conv2d", "no_such_layer"]]))
    _assert_unchanged(model, x, before)


def test_exception_midway_leaves_model_unchanged(monkeypatch):
    model = h.residual_cnn()
    x = h.batch_for(model)
    before = _state(model, x)
    segments = h.sqrt_segments(model)
    assert len(segments) >= 2
    built = []
    original = functional_rebuild.RecomputeSegment

    def failing(*args, **kwargs):
        if built:
            raise RuntimeError("injected failure")
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(functional_rebuild, "RecomputeSegment", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        rewrite_model(model, h.plan_for(model, segments))
    _assert_unchanged(model, x, before)


def test_successful_rewrite_leaves_model_unchanged():
    model = h.nested_model()
    x = h.batch_for(model)
    before = _state(model, x)
    rewritten = rewrite_model(model, h.plan_for(model, h.sqrt_segments(model)))
    _assert_unchanged(model, x, before)
    np.testing.assert_allclose(rewritten.predict(x, verbose=0), before[3], rtol=1e-6)
