"""Warnings that name the user's line, not tfremat's."""

import warnings

import keras
import numpy as np

import tfremat
from tfremat.core import warn


def test_a_warning_raised_deep_inside_tfremat_names_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("tfremat: something", RuntimeWarning)  # this file is the user's
    assert caught[0].filename == __file__ and caught[0].category is RuntimeWarning


def test_a_planner_warning_during_fit_names_the_fit_call(tmp_path):
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Dense(16)(inp)))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((8, 8), "float32"), np.zeros((8, 2), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # A picture it cannot write: the Planner warns inside fit, and trains.
        model.fit(x, y, epochs=1, verbose=0, callbacks=[tfremat.Planner(
            1e4, verbose=0, export=str(tmp_path / "no-such-dir" / "plan.dot"))])
    ours = [w for w in caught if str(w.message).startswith("tfremat")]
    assert ours and all(w.filename == __file__ for w in ours), [
        (w.filename, str(w.message)[:80]) for w in ours]
