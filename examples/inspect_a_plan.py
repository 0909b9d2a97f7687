"""Inspect a plan without training: summary, pictures, memory timeline, JSON.

Nothing here needs Graphviz: the plan picture is written as `.dot` source
(render it with `dot -Tpng plan.dot -o plan.png` where Graphviz exists, or paste
it into any online Graphviz viewer), and the memory timeline is drawn with
matplotlib.

    python examples/inspect_a_plan.py           # MobileNetV2, 96 px, batch 16
    python examples/inspect_a_plan.py --smoke   # a small CNN, seconds

The full size takes about 30 seconds on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfremat  # noqa: E402
from tfremat.planners import min_feasible_budget  # noqa: E402


def small_cnn() -> keras.Model:
    inp = keras.Input((32, 32, 3))
    x = inp
    for i, filters in enumerate((16, 16, 32, 32)):
        x = keras.layers.Conv2D(filters, 3, padding="same", name=f"conv{i}")(x)
        x = keras.layers.BatchNormalization(name=f"bn{i}")(x)
        x = keras.layers.ReLU(name=f"relu{i}")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(10, activation="softmax")(x), name="small_cnn")



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--out", default=None, help="folder for the files (default: a temp dir)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="tfremat_inspect_")
    os.makedirs(out, exist_ok=True)

    if args.smoke:
        model, batch = small_cnn(), 8
    else:
        model, batch = keras.applications.MobileNetV2(
            weights=None, input_shape=(96, 96, 3), classes=10), 16
    model.compile(optimizer="sgd", loss="categorical_crossentropy")

    # 1. The PlanGraph: one node per layer call, with sizes and costs.
    graph = tfremat.extract(model, batch_size=batch)
    plain = tfremat.simulate(graph)
    print(f"{model.name}: {len(graph)} layer calls; plain step predicted "
          f"{plain.peak_mb:.1f} MiB ({plain.persistent_bytes / 2**20:.1f} MiB persistent), "
          f"peak at '{plain.peak_step}'")

    # 2. A plan under a budget below the plain step's peak: halfway down to the
    #    lowest peak chen-sqrt reaches.
    budget = (plain.peak_bytes + min_feasible_budget(graph, "chen-sqrt")) / 2 / 2**20
    plan = tfremat.plan(model, budget, graph=graph)
    plan.summary()

    # 3. Pictures: the layer graph (.dot, no Graphviz needed) and the memory timeline.
    dot = tfremat.export_dot(plan, os.path.join(out, "plan.dot"))
    png = plan.plot_timeline(os.path.join(out, "memory.png"))
    print(f"plan picture: {dot}\nmemory timeline: {png}")

    # 4. JSON round trip: a plan read back has no graph; give it the graph again.
    path = os.path.join(out, "plan.json")
    plan.to_json(path)
    loaded = tfremat.Plan.from_json(path)
    loaded.validate(graph)  # raises PlanMismatchError for another model
    again = tfremat.simulate(graph, loaded)
    assert loaded.segments == plan.segments and again.peak_bytes == plan.peak_bytes
    print(f"JSON round trip: {path}, {len(loaded.segments)} segments, predicted "
          f"{again.peak_mb:.1f} MiB (budget {budget:.1f} MiB)")


if __name__ == "__main__":
    main()
