"""`model.fit` trains the rewritten model exactly as the original."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.rewriter import rewrite_helpers as h
from tfremat.rewriter import rewrite_model


def _fit(model: keras.Model, x, y, jit_compile: bool) -> list[float]:
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                  jit_compile=jit_compile)
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"]


@pytest.mark.parametrize("build, jit_compile", [
    (h.residual_cnn, False), (h.residual_cnn, True),
    (h.transformer_block, False), (h.transformer_block, True),
    (h.rnn_stack, False),
])
def test_fit_gives_the_same_losses(build, jit_compile):
    keras.utils.set_random_seed(5)
    model = build()
    x = h.batch_for(model, batch=16)
    y = np.random.default_rng(1).standard_normal((16, *model.outputs[0].shape[1:]))
    rewritten = rewrite_model(model, h.plan_for(model, h.sqrt_segments(model)))
    start = h.snapshot(model)
    losses = _fit(model, x, y, jit_compile)
    trained = h.snapshot(model)
    h.restore(model, start)
    rewritten_losses = _fit(rewritten, x, y, jit_compile)
    np.testing.assert_allclose(rewritten_losses, losses, rtol=1e-5)
    # Global relative error: a conv bias before BatchNorm has a ~0 gradient,
    # so its own trajectory is float rounding noise (docs/how-it-works.md, "Rewriting").
    weights = [i for i, v in enumerate(model.variables) if v.dtype.startswith("float")]
    assert h.rel_error([trained[i] for i in weights],
                       [h.snapshot(model)[i] for i in weights]) <= h.REL_TOL
