"""Multi-worker data parallelism under a per-device budget: a custom training loop.

Keras 3's `model.fit` does not run under `tf.distribute.MultiWorkerMirroredStrategy`
(keras-team/keras#20585), so multi-worker Keras 3 training is a custom loop
around `strategy.run`. Inside `strategy.scope()`, on every worker:

    plan = tfremat.plan(model, budget_mb / 1.2, batch_size=per_worker_batch)
    model_to_train = tfremat.rewrite(model, plan)

`tfremat.plan` traces this worker's step through the strategy and every
worker applies the chief's plan. `budget_mb` is per device. Nothing measures
the plan here (the `Planner` is for `fit`), so in this scope `tfremat.plan`
pins its order: the workers' peaks then do not ride on which ready operation
a thread runs first; a plan's measured peak still spreads (here up to 26% above
its prediction on two CPUs, 39-49% with the workers on one CPU, 57% in one CI
run: docs/scaling.md), so the plan is made for a sixth less than the device
holds, which covered every run on two CPUs, not on one.

This script starts 2 worker processes on localhost (TF_CONFIG with free ports),
each trains a few steps and reports its plan and its own measured peak (each
process has its own allocator).

    python examples/multi_worker.py           # global batch 4096, 20 steps
    python examples/multi_worker.py --smoke   # global batch 2048, 3 steps

The full size takes about 20 seconds on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_workers(command: list[str], n: int = 2, timeout: float = 600,
                **popen_kwargs) -> list[tuple[int, str]]:
    """Runs `n` worker processes of one cluster on localhost and waits for them.

    Worker i runs `command + ["--worker", str(i), "--ports", ports]`, `ports`
    being n free localhost ports, one per worker in TF_CONFIG's order. Workers
    still running when this returns or fails (a timeout) are killed.
    `tests/distribute/test_multi_worker.py` starts its workers with it too.

    Returns:
        Each worker's exit code and standard output.
    """
    ports = ",".join(map(str, free_ports(n)))
    procs = [subprocess.Popen(command + ["--worker", str(i), "--ports", ports],
                              stdout=subprocess.PIPE, text=True, **popen_kwargs)
             for i in range(n)]
    results = []
    try:
        for p in procs:
            out = p.communicate(timeout=timeout)[0]
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def launch(smoke: bool) -> None:
    """Starts the workers, waits for them and prints what each reported."""
    reports = []
    for code, out in run_workers([sys.executable, __file__] + (["--smoke"] if smoke else [])):
        if code != 0:
            sys.exit(f"a worker failed (exit code {code})")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for r in reports:
        print(f"worker {r['worker']}: plan {r['fingerprint']} with {r['segments']} "
              f"segments; measured peak {r['peak_mb']:.1f} MiB, budget "
              f"{r['budget_mb']:.1f} MiB per device; loss {r['loss']:.4f}")
    same = all(r["plan"] == reports[0]["plan"] for r in reports)
    print(f"{len(reports)} workers applied {'the same' if same else 'DIFFERENT'} plan")


def work(index: int, ports: str, smoke: bool) -> None:
    """One worker: plan and rewrite in the strategy's scope, train a custom loop."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports.split(",")]},
        "task": {"type": "worker", "index": index}})
    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat

    global_batch, steps = (2048, 3) if smoke else (4096, 20)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    per_worker = global_batch // strategy.num_replicas_in_sync
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inp = keras.Input((128,))
        x = inp
        for i in range(16):
            x = keras.layers.Dense(128, activation="tanh", name=f"dense{i}")(x)
        model = keras.Model(inp, keras.layers.Dense(8, name="head")(x), name="mlp")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        graph = tfremat.extract(model, batch_size=per_worker)
        budget_mb = 0.7 * tfremat.simulate(graph).peak_mb  # per device
        # Nothing measures a plan in the scope: plan with room for the spread of a
        # plan's measured peak (docs/scaling.md).
        plan = tfremat.plan(model, budget_mb / 1.2, graph=graph)
        smaller = tfremat.rewrite(model, plan)
        optimizer = keras.optimizers.SGD(0.1)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(y, smaller(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, smaller.trainable_variables)
        optimizer.apply_gradients(zip(grads, smaller.trainable_variables))
        return loss

    @tf.function
    def step(x, y):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    rng = np.random.default_rng(index)  # each worker reads its own shard
    for i in range(steps):
        x = rng.standard_normal((per_worker, 128)).astype("float32")
        y = rng.standard_normal((per_worker, 8)).astype("float32")
        loss = step(tf.constant(x), tf.constant(y))
        if i == 0:  # the first step traces; measure the ones after it
            tf.config.experimental.reset_memory_stats("CPU:0")
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    print(json.dumps({"worker": index, "fingerprint": plan.graph_fingerprint,
                      "segments": len(plan.segments),
                      "plan": [s.nodes for s in plan.segments], "peak_mb": peak,
                      "budget_mb": budget_mb, "loss": float(loss)}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny run, seconds")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        launch(args.smoke)
    else:
        work(args.worker, args.ports, args.smoke)


if __name__ == "__main__":
    main()
