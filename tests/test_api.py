"""tfremat.plan, tfremat.rewrite and the Planner check their arguments at the door."""

import math

import keras
import pytest

import tfremat


def tiny() -> keras.Model:
    inp = keras.Input((8,))
    out = keras.layers.Dense(4, name="d2")(keras.layers.Dense(16, name="d1")(inp))
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("budget, error, message", [
    ("100", TypeError, "must be a number of MiB, got '100'"),
    (None, TypeError, "must be a number of MiB"),
    (True, TypeError, "must be a number of MiB"),
    (math.nan, ValueError, "positive, finite"),
    (math.inf, ValueError, "positive, finite"),
    (-5, ValueError, "positive, finite"),
    (0, ValueError, "positive, finite"),
])
def test_bad_budgets_are_refused_where_they_are_given(budget, error, message):
    with pytest.raises(error, match=message):
        tfremat.Planner(budget)
    with pytest.raises(error, match=message):
        tfremat.plan(tiny(), budget, batch_size=4)


@pytest.mark.parametrize("batch_size, error, message", [
    (0, ValueError, "batch_size must be a positive integer, got 0"),
    (-1, ValueError, "batch_size must be a positive integer, got -1"),
    ("8", TypeError, "batch_size must be an integer, got '8'"),
    (8.0, TypeError, "batch_size must be an integer, got 8.0"),
])
def test_bad_batch_sizes_are_refused_by_every_entry_point(batch_size, error, message):
    model = tiny()
    for call in (tfremat.extract, tfremat.measure_peak,
                 lambda m, batch_size: tfremat.plan(m, 100, batch_size=batch_size)):
        with pytest.raises(error, match=message):
            call(model, batch_size=batch_size)


@pytest.mark.parametrize("kwargs, message", [
    ({"planner": "chen-magic"}, "Unknown planner 'chen-magic'"),
    ({"objective": "fast"}, "Unknown objective 'fast'"),
    ({"offload": "yes"}, "offload must be True, False or 'auto'"),
])
def test_bad_names_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfremat.Planner(100, **kwargs)
    with pytest.raises(ValueError, match=message):
        tfremat.plan(tiny(), 100, batch_size=4, **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_trials": 0}, ValueError, "max_trials must be a positive integer, got 0"),
    ({"max_trials": -1}, ValueError, "max_trials must be a positive integer, got -1"),
    ({"max_trials": 2.5}, TypeError, "max_trials must be an integer, got 2.5"),
    ({"verbose": 5}, ValueError, "verbose must be 0, 1 or 2, got 5"),
    ({"verbose": "loud"}, ValueError, "verbose must be 0, 1 or 2, got 'loud'"),
])
def test_bad_counts_are_refused_where_they_are_given(kwargs, error, message):
    # max_trials=-1 used to measure without limit, 0 measured one plan anyway.
    with pytest.raises(error, match=message):
        tfremat.Planner(100, **kwargs)
    with pytest.raises(error, match=message):
        tfremat.plan(tiny(), 100, batch_size=4, measure=True, **kwargs)


@pytest.mark.parametrize("max_replans, error", [(-1, ValueError), ("2", TypeError)])
def test_a_bad_max_replans_is_refused(max_replans, error):
    with pytest.raises(error, match="max_replans must be"):
        tfremat.Planner(100, max_replans=max_replans)


def test_the_old_strategy_keyword_still_works_with_a_deprecation_warning():
    model = tiny()
    graph = tfremat.extract(model, batch_size=4)
    with pytest.deprecated_call(match="now called `objective=`"):
        plan = tfremat.plan(model, 100, graph=graph, strategy="memory")
    assert plan.is_empty  # the step fits: nothing to plan
    with pytest.deprecated_call():
        planner = tfremat.Planner(100, strategy="memory")
    assert planner.objective == "memory"


def test_rewrite_plans_by_prediction_or_by_measurement():
    """`rewrite(..., budget_mb=...)` plans by the prediction, unless asked to
    measure: then a budget out of reach is refused with a measured minimum, and
    the model is left as it was."""
    model = tiny()
    weights = [w.numpy().copy() for w in model.weights]
    with pytest.raises(tfremat.BudgetError) as predicted:
        tfremat.rewrite(model, budget_mb=0.001, batch_size=4)
    assert not predicted.value.measured
    with pytest.raises(tfremat.BudgetError, match="measured on the device") as measured:
        tfremat.rewrite(model, budget_mb=0.001, batch_size=4, measure=True)
    assert measured.value.measured
    assert all((w.numpy() == before).all() for w, before in zip(model.weights, weights))


def test_a_step_that_fits_is_rewritten_into_a_new_model_all_the_same():
    """The docs compile what `rewrite` returns: when the step already fits, that
    was the user's own model, whose optimizer (and its state) a compile
    replaced. It is a new model sharing the weights now."""
    model = tiny()
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    optimizer = model.optimizer
    smaller = tfremat.rewrite(model, budget_mb=1e6, batch_size=4)
    assert smaller is not model and not smaller.compiled
    assert {id(v) for v in smaller.weights} == {id(v) for v in model.weights}
    smaller.compile(optimizer="sgd", loss="mse")
    assert model.optimizer is optimizer


def test_rewrite_refuses_what_is_not_a_plan():
    with pytest.raises(TypeError, match="takes a tfremat.Plan, not dict"):
        tfremat.rewrite(tiny(), {"segments": []})


def test_a_picture_tfremat_cannot_write_is_refused_at_construction():
    with pytest.raises(ValueError, match="use .dot, .png, .svg or .pdf"):
        tfremat.Planner(100, export="plan.jpg")
