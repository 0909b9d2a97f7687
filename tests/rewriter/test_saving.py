"""Rewritten models save to `.keras` and load in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest

import tfremat
from tests.fresh import run_fresh
from tests.rewriter import rewrite_helpers as h
from tfremat.core import BudgetError, Segment
from tfremat.planners import min_feasible_budget
from tfremat.rewriter import rewrite_model, unit_layers, unwrapped
from tfremat.simulation import simulate

def _nested_plan(model: keras.Model):
    ids = h.body_ids(model)
    parent = h.contiguous_segments(model, [len(ids) // 2])[0]
    return h.plan_for(model, [Segment(parent, children=[Segment(parent[:2])])])


@pytest.mark.parametrize("build", [h.residual_cnn, h.shared_layer_model, h.nested_model])
def test_keras_file_round_trip_in_fresh_process(build, tmp_path):
    keras.utils.set_random_seed(8)
    model = build()
    rewritten = rewrite_model(model, _nested_plan(model))
    x = h.batch_for(model)
    path = tmp_path / "rewritten.keras"
    rewritten.save(path)
    expected = [np.asarray(o) for o in keras.tree.flatten(rewritten.predict(x, verbose=0))]
    np.savez(tmp_path / "io.npz", *keras.tree.flatten(x))
    np.savez(tmp_path / "expected.npz", *expected)
    script = textwrap.dedent(f"""
        import numpy as np
        import tfremat  # registers RecomputeSegment once Keras is imported
        import keras
        model = keras.models.load_model({str(path)!r})
        from tfremat.rewriter import RecomputeSegment
        assert any(isinstance(l, RecomputeSegment) for l in model.layers)
        x = list(np.load({str(tmp_path / 'io.npz')!r}).values())
        out = keras.tree.flatten(model.predict(x if len(x) > 1 else x[0], verbose=0))
        expected = list(np.load({str(tmp_path / 'expected.npz')!r}).values())
        for a, b in zip(out, expected):
            np.testing.assert_array_equal(a, b)
        model.compile(optimizer="sgd", loss="mse")
        y = [np.zeros_like(e) for e in expected]
        model.fit(x if len(x) > 1 else x[0], y if len(y) > 1 else y[0], verbose=0)
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")


@pytest.mark.parametrize("first", ["keras", "tfremat"])
def test_tfremat_registers_its_layers_whichever_of_keras_and_tfremat_comes_first(first):
    second = {"keras": "tfremat", "tfremat": "keras"}[first]
    script = textwrap.dedent(f"""
        import {first}
        import {second}
        names = ["tfremat>RecomputeSegment", "tfremat>UpdateUnit"]
        print({{n: keras.saving.get_registered_object(n) is not None for n in names}})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                            text=True, timeout=300)
    assert result.stdout.strip().endswith(
        "{'tfremat>RecomputeSegment': True, 'tfremat>UpdateUnit': True}"), result.stderr[-3000:]


def test_a_plan_saved_where_other_models_were_built_applies_in_a_fresh_process(tmp_path):
    """The way a plan travels: planned in a notebook that built other models
    first (so Keras numbered this one's layers on), saved as JSON, applied in
    a fresh process to the model built from the same code."""
    import tfremat

    h.residual_cnn()  # another model first, with layers of the same classes
    model = h.residual_cnn()
    # The layers' graph: this tiny CNN's peak is nearly all convolution scratch
    # (sized by the CPU's cache), which no plan lowers; what travels is the plan.
    graph = tfremat.extract(model, batch_size=8, measure_kernels=False)
    plan = tfremat.plan(model, tfremat.simulate(graph).peak_mb * 0.8, graph=graph,
                        update_in_backward=False)
    assert plan.segments and h.body_ids(model)[0] != "conv2d"
    plan.to_json(tmp_path / "plan.json")
    script = textwrap.dedent(f"""
        import keras, numpy as np
        import tfremat
        from tests.rewriter import rewrite_helpers as h
        from tfremat.rewriter import RecomputeSegment
        keras.utils.set_random_seed(3)
        model = h.residual_cnn()
        assert h.body_ids(model)[0] == "conv2d"
        plan = tfremat.Plan.from_json({str(tmp_path / 'plan.json')!r})
        rewritten = tfremat.rewrite(model, plan)
        segments = [l for l in rewritten.layers if isinstance(l, RecomputeSegment)]
        h.assert_same_step(model, rewritten, h.batch_for(model), "function")
        print('{{"segments": %d}}' % len(segments))
    """)
    assert run_fresh(script) == {"segments": len(plan.segments)}


def test_original_weights_reach_the_rewritten_model_through_the_original(tmp_path):
    # A .weights.h5 file of the original does not match the rewritten model's
    # weight paths; load it into the original, whose weights the rewritten
    # model shares.
    keras.utils.set_random_seed(9)
    source = h.residual_cnn()
    path = str(tmp_path / "original.weights.h5")
    source.save_weights(path)
    model = h.residual_cnn()
    rewritten = rewrite_model(model, h.plan_for(model, h.sqrt_segments(model)))
    with pytest.raises(ValueError, match="could not be loaded"):
        rewritten.load_weights(path)
    model.load_weights(path)
    x = h.batch_for(model)
    np.testing.assert_allclose(rewritten.predict(x, verbose=0),
                               source.predict(x, verbose=0), rtol=1e-6)


def test_a_rewritten_model_that_trained_with_updates_in_backward_exports(tmp_path):
    """`export` saves the units' gradient functions, traced outside a training
    step: they must not capture the optimizer (a SavedModel cannot hold its
    learning rate: KeyError "... captures tensor ... not reachable from root")."""
    import tensorflow as tf

    keras.utils.set_random_seed(21)
    model = h.residual_cnn()
    plan = h.plan_for(model, h.sqrt_segments(model))
    plan.update_in_backward = True
    rewritten = rewrite_model(model, plan)
    rewritten.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = h.batch_for(model, batch=8)
    rewritten.fit(x, np.zeros((8, 5), "float32"), batch_size=8, verbose=0)
    rewritten.export(str(tmp_path / "served"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(served.serve(x).numpy(), model(x).numpy(), rtol=1e-5,
                               atol=1e-6)


def test_a_rewritten_model_saved_and_loaded_is_planned_as_the_model_it_was_rewritten_from(
        tmp_path):
    """Extracted as it is, each unit is one layer whose backward pass holds all
    it recomputes (predicted high); `tfremat.plan`, `tfremat.rewrite` and the
    `Planner` plan the model it was rewritten from, whose layers it holds.
    Extracting it once failed on a KeyError: a unit's gradient sums are made
    after the ops that read them (`summed_in_pairs`)."""
    keras.utils.set_random_seed(9)
    model = h.residual_cnn()
    model.compile(optimizer="sgd", loss="mse")
    rewritten = rewrite_model(model, _nested_plan(model))
    rewritten.save(tmp_path / "rewritten.keras")
    loaded = keras.models.load_model(tmp_path / "rewritten.keras")
    loaded.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).random((64, 16, 16, 3), "float32")
    y = np.zeros((64, 5), "float32")
    own = tfremat.extract(loaded, sample=(x, y), measure_kernels=False)
    assert {n.class_name for n in own} >= {"RecomputeSegment", "BatchNormalization"}
    with pytest.warns(UserWarning, match=r"graph given for 'residual_cnn\w*' holds its "
                      r"recompute.*Without graph=, tfremat.plan plans the model it was"), \
            pytest.raises(BudgetError):
        tfremat.plan(loaded, 1e-3, sample=(x, y), graph=own)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fits = tfremat.plan(loaded, 1e6, sample=(x, y))
    assert not [w for w in caught if "holds its recompute" in str(w.message)]
    original = tfremat.extract(model, sample=(x, y), measure_kernels=False)
    assert [(n.id, n.class_name) for n in fits.graph] == \
        [(n.id, n.class_name) for n in original]
    # 85% of the plain peak, or halfway from the lowest plan's peak where that
    # is higher (a filter gradient's scratch, ~30 MiB at any size with
    # TensorFlow's own CPU kernels, is most of this model's peak).
    plain = simulate(fits.graph).peak_bytes
    lowest = min_feasible_budget(fits.graph, offload=False, update_in_backward=False)
    budget = max(0.85 * plain, (lowest + plain) / 2) / 2**20
    plan = tfremat.plan(loaded, budget, graph=fits.graph)
    assert plan.segments and plan.peak_bytes <= budget * 2**20
    again = tfremat.rewrite(loaded, plan)
    old_units = {id(layer) for layer in loaded._flatten_layers()
                 if layer.name in unit_layers(loaded)}
    assert not old_units & {id(layer) for layer in again._flatten_layers()}
    h.assert_same_step(unwrapped(loaded), again, x[:4])

    planner = tfremat.Planner(budget, verbose=0)
    history = loaded.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[planner])
    assert np.isfinite(history.history["loss"][0])
    assert [n.id for n in planner.graph] == [n.id for n in original]
