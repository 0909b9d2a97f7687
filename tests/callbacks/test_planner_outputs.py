"""What the Planner writes besides training: the memory timeline and TensorBoard."""

import pathlib

import keras
import pytest
import tensorflow as tf

import tfremat
from tests.callbacks.test_planner import BATCH, data, make_model
from tests.fresh import run_fresh
from tests.test_plots import PNG_MAGIC

pytest.importorskip("tensorboard", reason="keras.callbacks.TensorBoard needs the "
                    "tensorboard package (the test extra installs it)")


def events(run_dir: pathlib.Path) -> dict[str, list]:
    """tag -> [(step, value)] of every event file in a TensorBoard run directory."""
    found: dict[str, list] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value))
    return found


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One small fit under a budget below the plain peak, with TensorBoard."""
    tmp = tmp_path_factory.mktemp("fit")
    x, y = data(2)
    model = make_model()
    graph = tfremat.extract(model, batch_size=BATCH)
    with pytest.raises(tfremat.BudgetError) as lowest:
        tfremat.plan(model, 1, graph=graph)
    # Between the lowest plan and the step without recomputation (updates in
    # the backward pass lower it): binding, and reachable.
    bare = tfremat.Plan.from_segments(graph, [], update_in_backward=True, pin_order=True)
    budget = (tfremat.simulate(graph, bare).peak_mb + lowest.value.min_budget_mb) / 2
    planner = tfremat.Planner(budget, verbose=0, measure=False, plot=str(tmp / "memory.png"),
                              replan=False)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[
        planner, keras.callbacks.TensorBoard(str(tmp / "logs"))])
    return tmp, planner, history


def test_plot_writes_the_timeline_with_the_measured_peaks(fitted):
    tmp, planner, history = fitted
    assert planner.timeline == str(tmp / "memory.png")
    assert (tmp / "memory.png").read_bytes()[:8] == PNG_MAGIC
    assert not planner.plan.is_empty
    assert planner.epoch_peaks_mb == history.history["peak_memory_mb"]
    assert planner.epoch_held_mb == history.history["held_memory_mb"]


def test_tensorboard_gets_the_plan_the_timeline_and_the_peaks(fitted):
    tmp, planner, history = fitted
    found = events(tmp / "logs" / "train")
    assert {"tfremat/plan", "tfremat/memory_timeline", "tfremat/peak_memory_mb",
            "tfremat/held_memory_mb", "tfremat/predicted_peak_mb"} <= set(found), sorted(found)
    text = tf.make_ndarray(found["tfremat/plan"][0][1].tensor).item().decode()
    assert f'Plan for "{planner.graph.name}"' in text and "segment 0" in text
    peaks = [(step, tf.make_ndarray(v.tensor).item())
             for step, v in found["tfremat/peak_memory_mb"]]
    assert peaks == [(e, pytest.approx(p, rel=1e-6))
                     for e, p in enumerate(history.history["peak_memory_mb"])]
    held = [tf.make_ndarray(v.tensor).item() for _, v in found["tfremat/held_memory_mb"]]
    assert held == [pytest.approx(h, rel=1e-6) for h in history.history["held_memory_mb"]]
    predicted = tf.make_ndarray(found["tfremat/predicted_peak_mb"][-1][1].tensor).item()
    assert predicted == pytest.approx(planner.predicted_peak_mb, rel=1e-6)
    # An image summary holds width, height and the PNG itself.
    image = tf.make_ndarray(found["tfremat/memory_timeline"][-1][1].tensor)
    assert image[2][:8] == PNG_MAGIC and int(image[0]) > 100
    # Keras's own scalars went to the same run.
    assert "epoch_loss" in found


NO_STATS_FIT = """
import json, warnings
import keras, numpy as np, tensorflow as tf
import tfremat
x = np.random.default_rng(0).normal(size=(64, 32, 32, 3)).astype("float32")
y = np.zeros((64,), "int64")
inputs = keras.Input((32, 32, 3))
h = inputs
for _ in range(4):
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
model = keras.Model(inputs, outputs)
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
graph = tfremat.extract(model, batch_size=16)
planner = tfremat.Planner(0.85 * tfremat.simulate(graph).peak_mb, verbose=0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[planner])
print(json.dumps({"logs": sorted(history.history), "segments": len(planner.plan.segments),
                  "warnings": [str(w.message) for w in caught],
                  "peaks": planner.epoch_peaks_mb}))
"""


def test_without_allocator_statistics_it_trains_with_the_predicted_plan_and_says_so():
    # TensorFlow's default CPU allocator without oneDNN keeps no statistics.
    result = run_fresh(NO_STATS_FIT, TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="0")
    assert result["segments"] > 0
    assert "predicted_peak_mb" in result["logs"] and "peak_memory_mb" not in result["logs"]
    assert "held_memory_mb" not in result["logs"]
    assert result["peaks"] == []
    assert any("keeps no allocator statistics for CPU:0" in w
               and "TF_CPU_ALLOCATOR_USE_BFC=1" in w for w in result["warnings"])
