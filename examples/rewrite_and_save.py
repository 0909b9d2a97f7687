"""Rewrite a model under a budget, train it, save it, and load it in a fresh process.

`tfremat.rewrite` returns a model sharing the original's layers and weights whose
training step the simulator predicts within the budget (it does not measure:
the `Planner` callback does, and re-plans). Its recompute segments are
registered Keras layers: the model saves to `.keras` and loads anywhere
`tfremat` is imported.

    python examples/rewrite_and_save.py           # ResNet50, 96 px, batch 16, 250 MiB
    python examples/rewrite_and_save.py --smoke   # a small CNN, seconds

The full size takes about 2 minutes on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfremat  # noqa: E402
from tfremat.planners import min_feasible_budget  # noqa: E402

LOAD_AND_PREDICT = """
import sys, numpy as np, keras
import tfremat  # registers tfremat's layers with Keras, so the model loads
model = keras.models.load_model(sys.argv[1])
np.save(sys.argv[3], model.predict(np.load(sys.argv[2]), verbose=0))
"""


def small_cnn(size: int) -> keras.Model:
    inp = keras.Input((size, size, 3))
    x = inp
    for i in range(4):
        x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name=f"conv{i}")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(10, activation="softmax")(x), name="small_cnn")



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    if args.smoke:
        size, batch, model = 32, 8, small_cnn(32)
    else:
        size, batch = 96, 16
        model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                            classes=10)
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * batch, size, size, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, 4 * batch), 10)

    graph = tfremat.extract(model, batch_size=batch)
    plain = tfremat.simulate(graph)
    # Tiny inputs: halfway between the plain step's predicted peak and the
    # lowest peak chen-sqrt reaches.
    budget = ((plain.peak_bytes + min_feasible_budget(graph, "chen-sqrt")) / 2 / 2**20
              if args.smoke else 250.0)
    plan = tfremat.plan(model, budget, graph=graph)
    smaller = tfremat.rewrite(model, plan)
    print(f"{model.name}: plain step predicted {plain.peak_mb:.1f} MiB; rewritten for "
          f"{budget:.1f} MiB with {sum(isinstance(l, tfremat.RecomputeSegment) for l in smaller.layers)} "
          f"recompute segments (plan by {plan.planner}, predicted {plan.peak_bytes / 2**20:.1f} MiB)")

    # The rewritten model trains like any Keras model (same weights as `model`).
    smaller.compile(optimizer="sgd", loss="categorical_crossentropy")
    loss = smaller.fit(x, y, batch_size=batch, epochs=1, verbose=0).history["loss"][-1]
    # `rewrite` plans on the simulator's prediction alone, which can be a few
    # percent off; the Planner callback measures in fit and re-plans.
    measured = tfremat.measure_peak(smaller, batch_size=batch) / 2**20
    print(f"trained one epoch: loss {loss:.3f}; measured step peak {measured:.1f} MiB, "
          f"{'within' if measured <= budget else 'OVER'} the budget")

    # Save, then load and predict in a fresh Python process.
    folder = tempfile.mkdtemp(prefix="tfremat_save_")
    path = os.path.join(folder, "smaller.keras")
    smaller.save(path)
    np.save(os.path.join(folder, "x.npy"), x[:4])
    subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, path,
                    os.path.join(folder, "x.npy"), os.path.join(folder, "pred.npy")],
                   check=True)
    loaded = np.load(os.path.join(folder, "pred.npy"))
    here = smaller.predict(x[:4], verbose=0)
    np.testing.assert_allclose(loaded, here, rtol=1e-4, atol=1e-6)
    print(f"saved to {path}; loaded in a fresh process: predictions match "
          f"(max difference {np.abs(loaded - here).max():.1e})")


if __name__ == "__main__":
    main()
