"""A rewritten model trains under tf.distribute.MirroredStrategy like the original.

Logical CPU devices must be set before TensorFlow initialises, so the training
runs in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    sys.path.insert(0, {here!r})
    from tests.rewriter import rewrite_helpers as h
    from tfremat.rewriter import rewrite_model

    keras.utils.set_random_seed(10)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = h.residual_cnn()
        rewritten = rewrite_model(model, h.plan_for(model, h.sqrt_segments(model)))
    x = h.batch_for(model, batch=16)
    y = np.random.default_rng(1).standard_normal((16, 5)).astype("float32")
    start = h.snapshot(model)
    losses = []
    for m in (model, rewritten):
        h.restore(model, start)
        with strategy.scope():
            m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        losses.append(m.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                            verbose=0).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    print("OK", losses)
""")


def test_mirrored_strategy_over_two_cpus_gives_the_same_losses():
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(here=HERE)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("OK")


def test_a_model_made_in_a_strategy_scope_is_planned_outside_it():
    """Inside the scope of a MirroredStrategy of two replicas tfremat says to plan
    outside it with the per-replica batch; that works with an optimizer not built
    yet (its stand-in is built in the model's scope: Keras refuses to make
    slots for mirrored weights outside it), and leaves the optimizer unbuilt."""
    import keras
    import tensorflow as tf

    import tfremat
    from tests.rewriter import rewrite_helpers as h

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = h.residual_cnn()
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with strategy.scope(), pytest.raises(tfremat.UnsupportedModelError,
                                         match="Plan outside `strategy.scope"):
        tfremat.plan(model, budget_mb=1000, batch_size=8)
    from tfremat.planners import min_feasible_budget

    graph = tfremat.extract(model, batch_size=8)
    # 90% of the plain peak, or halfway from the lowest plan's peak where that
    # is higher (a filter gradient's scratch, ~30 MiB at any size with
    # TensorFlow's own CPU kernels, is most of this model's peak).
    plain = tfremat.simulate(graph).peak_bytes
    lowest = min_feasible_budget(graph, offload=False, update_in_backward=False)
    budget = max(0.9 * plain, (lowest + plain) / 2) / 2**20
    plan = tfremat.plan(model, budget_mb=budget, graph=graph)
    assert plan.segments and plan.estimates.peak_mb <= budget
    assert not model.optimizer.built


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_measuring_in_a_strategy_scope_is_a_clear_error_and_outside_it_works(momentum):
    """A measured step runs outside `strategy.run`; in the scope TensorFlow's
    own error would be "DistributedVariable.handle is not available outside
    the replica context". Outside it, an optimizer with slots is built for the
    measurement in the model's scope, as `fit` builds it (a new user's SGD with
    momentum failed with "Need to be inside with strategy.scope()")."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat
    from tests.rewriter import rewrite_helpers as h

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = h.residual_cnn()
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=momentum), loss="mse")
    before = [v.numpy() for v in model.weights]
    says = "cannot measure inside the scope of a tf.distribute strategy with 2 replicas"
    with strategy.scope():
        with pytest.raises(RuntimeError, match=says):
            tfremat.measure_peak(model, batch_size=8)
        with pytest.raises(RuntimeError, match=r"tfremat.plan\(measure=True\) runs"):
            tfremat.plan(model, budget_mb=1000, batch_size=8, measure=True)
    for a, b in zip(before, [v.numpy() for v in model.weights]):
        np.testing.assert_array_equal(a, b)
    assert tfremat.measure_peak(model, batch_size=8) > 0
    for a, b in zip(before, [v.numpy() for v in model.weights]):
        np.testing.assert_array_equal(a, b)
    assert not model.optimizer.built  # its stand-in was built and dropped
