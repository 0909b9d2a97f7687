"""One worker of a 2-worker MultiWorkerMirroredStrategy run (tests/distribute).

Run as `python -m tests.distribute.mwms_worker --out DIR --worker I --ports P0,P1`
(started by examples/multi_worker.py's `run_workers`).
In the strategy's scope it builds an MLP whose activations dominate its memory,
plans it with `tfremat.plan` under 70% of its predicted plain peak, rewrites it
with `tfremat.rewrite`, and trains STEPS steps of a custom loop (`strategy.run`)
on its half of each global batch, measuring this process's CPU allocator peak.
Then it trains the plain model from the same initial weights on the same
batches, tries to make a `tfremat.Planner` for fit, and writes the results to
DIR/I.json.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GLOBAL_BATCH = 2048
STEPS = 3
FEATURES = 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--ports", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports.split(",")]},
        "task": {"type": "worker", "index": args.worker}})

    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat
    from tfremat.backend import inter_op_threads

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    per_worker = GLOBAL_BATCH // workers
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inp = keras.Input((FEATURES,))
        x = inp
        for i in range(16):
            x = keras.layers.Dense(FEATURES, activation="tanh", name=f"dense{i}")(x)
        model = keras.Model(inp, keras.layers.Dense(8, name="head")(x), name="mlp")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        graph = tfremat.extract(model, batch_size=per_worker)
        budget_mb = 0.7 * tfremat.simulate(graph).peak_mb
        # Nothing measures a plan in the scope: plan with room for the spread of a
        # plan's measured peak (docs/scaling.md).
        plan = tfremat.plan(model, budget_mb / 1.2, graph=graph)
        rewritten = tfremat.rewrite(model, plan)
        try:
            tfremat.plan(model, budget_mb, graph=graph, measure=True)
            measure_error = None
        except RuntimeError as e:
            measure_error = str(e)
    initial = [v.numpy() for v in model.weights]

    rng = np.random.default_rng(1)
    xs = rng.standard_normal((STEPS, GLOBAL_BATCH, FEATURES)).astype("float32")
    ys = rng.standard_normal((STEPS, GLOBAL_BATCH, 8)).astype("float32")
    mine = slice(args.worker * per_worker, (args.worker + 1) * per_worker)

    def train(net: keras.Model) -> tuple[list[np.ndarray], float]:
        """STEPS SGD steps of a custom loop; this worker's peak after the first."""
        with strategy.scope():
            optimizer = keras.optimizers.SGD(0.1)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(y, net(x, training=True))
                loss = tf.nn.compute_average_loss(per_example,
                                                  global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables))
            return loss

        @tf.function
        def step(x, y):
            return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)),
                                   axis=None)

        for v, w in zip(model.weights, initial):
            v.assign(w)
        peak = 0.0
        for i in range(STEPS):
            step(tf.constant(xs[i, mine]), tf.constant(ys[i, mine]))
            if i == 0:  # traced; measure the steps that follow
                tf.config.experimental.reset_memory_stats("CPU:0")
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
        return [v.numpy() for v in model.weights], peak

    planned_weights, planned_peak = train(rewritten)
    plain_weights, plain_peak = train(model)
    error = float(np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(planned_weights,
                                                                     plain_weights)))
                  / np.sqrt(sum(np.sum(b ** 2) for b in plain_weights)))
    try:
        with strategy.scope():
            tfremat.Planner(budget_mb)
        fit_error = None
    except RuntimeError as e:
        fit_error = str(e)
    moved = float(max(np.max(np.abs(a - b)) for a, b in zip(plain_weights, initial)))
    with open(os.path.join(args.out, f"{args.worker}.json"), "w") as f:
        json.dump({
            "workers": workers, "per_worker_batch": per_worker,
            "batch_shape": graph.metadata["batch_shape"],
            "fingerprint": graph.fingerprint(), "plan_fingerprint": plan.graph_fingerprint,
            "segments": [s.nodes for s in plan.segments], "pin_order": plan.pin_order,
            "replicas": graph.metadata["replicas"],
            "update_workspace_bytes": graph.update_workspace_bytes,
            "gradient_bytes": sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                                  for v in model.trainable_weights),
            "cpus": len(os.sched_getaffinity(0)),
            "inter_op_threads": inter_op_threads(),
            "budget_mb": budget_mb, "predicted_plain_mb": tfremat.simulate(graph).peak_mb,
            "predicted_mb": plan.estimates.peak_mb,
            "planned_peak_mb": planned_peak, "plain_peak_mb": plain_peak,
            "relative_error": error, "weights_moved": moved, "fit_error": fit_error,
            "measure_error": measure_error,
            "recompute_layers": sum(isinstance(layer, tfremat.RecomputeSegment)
                                    for layer in rewritten.layers),
        }, f)


if __name__ == "__main__":
    main()
