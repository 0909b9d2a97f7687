"""Transformers: tfremat against each block wrapped in `keras.remat` by hand.

A GPT-style language model (issue #12's: Embedding 4000x256, 4 pre-norm blocks
of causal MultiHeadAttention with 4 heads + MLP 1024, 256 tokens, batch 8) and
a ViT (64 px images in 8 px patches, the same blocks without the causal mask,
batch 32), both trained with SGD. For each, in its own process: the plain step;
each block wrapped in `keras.remat` by hand (what an expert writes; exact here,
as the blocks have no BatchNorm or dropout); tfremat's plan for the hand
version's peak (the largest of its steps: the budget it meets) and its plan for
the minimum its BudgetError states when asked for 1 MiB (a measured minimum),
both chosen with `measure=True` as the `Planner` does, in a fresh process
holding the model only, as a user's would (in the process that measures every
variant, which holds the hand-wrapped model too, trials measured the plain GPT
step at 358-360 MiB, in fresh planning processes at 334-351); and
tfremat's `every-unit` plan. Peaks: the allocator's peak of one SGD step
(weights and batch included), median and largest of `--repeats` steps, each
variant in a fresh process (as `planners.py`'s `fresh_peak_bytes`: a process
that ran other variants first measures higher). Step times: every
variant's step run alternately in one process, median of `--steps`, as a ratio
to the plain step, in `ROUNDS` rounds (their median ratio and range).

Usage:
    python benchmarks/transformers.py [--models GPT,ViT] [--repeats 10] [--steps 6]

Writes benchmarks/results/transformers.md and transformers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planners import (RESULTS, Runner, model_names, peak_in_fresh_process,  # noqa: E402
                      plan_in_fresh_process, run_header, run_worker, step_seconds)

MIB = 2**20
#: Rounds of alternating timed steps: one round's ratio moved by 0.06 between runs.
ROUNDS = 5

#: name -> (tokens per example, batch size).
MODELS = {"GPT": (256, 8), "ViT": (64, 32)}
DIM, HEADS, MLP, BLOCKS, VOCAB, IMAGE, PATCH, CLASSES = 256, 4, 1024, 4, 4000, 64, 8, 10


def block_layers(name: str) -> dict[str, Any]:
    import keras

    return {"ln1": keras.layers.LayerNormalization(name=f"{name}_ln1"),
            "attn": keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name=f"{name}_attn"),
            "ln2": keras.layers.LayerNormalization(name=f"{name}_ln2"),
            "mlp1": keras.layers.Dense(MLP, activation="gelu", name=f"{name}_mlp1"),
            "mlp2": keras.layers.Dense(DIM, name=f"{name}_mlp2")}


def block(layers: dict[str, Any], x: Any, causal: bool) -> Any:
    """A pre-norm transformer block: attention, then MLP, each added to its input."""
    h = layers["ln1"](x)
    x = x + layers["attn"](h, h, use_causal_mask=causal)
    return x + layers["mlp2"](layers["mlp1"](layers["ln2"](x)))


def build(name: str, hand: bool) -> tuple[Any, int]:
    """The compiled model and its batch size: the blocks' layers inline, or with
    `hand` each block a layer whose call runs in `keras.remat`."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, causal: bool, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.causal = causal
            self.parts = block_layers(self.name)
            run = lambda x: block(self.parts, x, self.causal)  # noqa: E731
            self.run = keras.remat(run) if hand else run

        def call(self, x: Any) -> Any:
            return self.run(x)

    class Positions(keras.layers.Layer):
        def build(self, input_shape: Any) -> None:
            self.table = self.add_weight(shape=tuple(input_shape[1:]), name="table")

        def call(self, x: Any) -> Any:
            return x + self.table

    keras.utils.set_random_seed(0)
    tokens, batch = MODELS[name]
    if name == "GPT":
        inp = keras.Input((tokens,), dtype="int32", name="tokens")
        x = Positions(name="positions")(keras.layers.Embedding(VOCAB, DIM, name="embed")(inp))
    else:
        inp = keras.Input((IMAGE, IMAGE, 3), name="image")
        x = keras.layers.Conv2D(DIM, PATCH, strides=PATCH, name="patches")(inp)
        x = Positions(name="positions")(keras.layers.Reshape((tokens, DIM))(x))
    for b in range(BLOCKS):
        if hand:
            x = Block(name == "GPT", name=f"block{b}")(x)
        else:  # the layers inline, as tfremat sees them
            x = block(block_layers(f"block{b}"), x, name == "GPT")
    x = keras.layers.LayerNormalization(name="ln_out")(x)
    if name == "GPT":
        out = keras.layers.Dense(VOCAB, name="logits")(x)
    else:
        out = keras.layers.Dense(CLASSES, name="logits")(
            keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out, name=name.lower())
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, batch


def sample(model: Any, batch: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(1)
    if model.name == "gpt":
        tokens = rng.integers(0, VOCAB, (batch, MODELS["GPT"][0] + 1)).astype("int32")
        return tokens[:, :-1], tokens[:, 1:]
    x = rng.standard_normal((batch, IMAGE, IMAGE, 3)).astype("float32")
    return x, rng.integers(0, CLASSES, batch).astype("int32")


def fresh_peaks(name: str, variant: str, plan: Any, repeats: int) -> dict[str, float]:
    """The peaks of `repeats` steps of one variant (`"plain"`, `"hand"`, or
    `"plan"` with `plan`), in a fresh process: their median and the largest,
    in MiB. The steps of one process spread (a GPT plan: 117.7-150.7 MiB over
    four steps, as two inter-op threads run kernels side by side), and a budget
    is met only when the largest is under it."""
    peaks = peak_in_fresh_process(__file__, ["--peak", name, "--variant", variant], plan,
                                  repeats)
    return {"measured_mib": statistics.median(peaks) / MIB, "max_mib": max(peaks) / MIB}


def peak_worker(name: str, variant: str, plan_path: str, repeats: int) -> None:
    """`fresh_peaks`'s process: prints the peak of each step, in bytes, on the
    model's `sample` batch (as a user's tokens; all-zero tokens measured the plain
    GPT step 15 MiB lower)."""
    from tfremat.core import Plan

    model, batch = build(name, hand=variant == "hand")
    data = sample(model, batch)
    if variant == "plan":
        model = planned(model, Plan.from_json(plan_path))
    print(json.dumps(Runner(model, batch, data).step_peaks(repeats)))


def planned(model: Any, plan: Any) -> Any:
    """`model` rewritten with `plan`, compiled as `build` compiles it."""
    import tfremat

    rewritten = tfremat.rewrite(model, plan)
    rewritten.compile(optimizer=model.optimizer.__class__(0.01), loss=model.loss)
    return rewritten


def plan_worker(name: str, budget_mib: float, plan_path: str) -> None:
    """`fresh_plan`'s process: plans `name` for the budget with `measure=True`,
    as a user's process would, holding this model only; writes the plan to
    `plan_path` and prints `{}`, or prints the BudgetError as JSON."""
    import tfremat

    model, batch = build(name, hand=False)
    try:
        plan = tfremat.plan(model, budget_mib, sample=sample(model, batch), measure=True)
    except tfremat.BudgetError as e:
        print(json.dumps({"error": str(e), "min_budget_mb": e.min_budget_mb}))
        return
    plan.to_json(plan_path)
    print(json.dumps({}))


def fresh_plan(name: str, budget_mib: float) -> tuple[Any, dict[str, Any]]:
    """`tfremat.plan(..., measure=True)` for `name` in a fresh process: the plan,
    or None and the BudgetError's message and stated minimum."""
    return plan_in_fresh_process(__file__, name, budget_mib)


def run_model(name: str, repeats: int, steps: int) -> dict[str, Any]:
    """Measures the variants of one model; the JSON record."""
    import tfremat

    model, batch = build(name, hand=False)
    hand, _ = build(name, hand=True)
    graph = tfremat.extract(model, sample=sample(model, batch))
    rows: dict[str, dict[str, Any]] = {
        "plain": {"predicted_mib": tfremat.simulate(graph).peak_mb},
        "keras.remat per block (by hand)": {}}
    models = {"plain": model, "keras.remat per block (by hand)": hand}
    for key, variant in (("plain", "plain"), ("keras.remat per block (by hand)", "hand")):
        rows[key].update(fresh_peaks(name, variant, None, repeats))
    # The budget the hand version meets: its largest step's peak.
    hand_mib = rows["keras.remat per block (by hand)"]["max_mib"]

    def add(key: str, plan: Any, error: dict[str, Any]) -> None:
        if plan is None:
            rows[key] = {"error": error["error"]}
            return
        models[key] = planned(model, plan)
        rows[key] = {"predicted_mib": plan.peak_bytes / MIB, "planner": plan.planner,
                     "segments": len(plan.segments), "updates": plan.update_in_backward,
                     "trials": plan.estimates.details.get("trials", []),
                     **fresh_peaks(name, "plan", plan, repeats)}
        print(f"  {key}: {rows[key]}", flush=True)

    add("tfremat at the hand version's peak", *fresh_plan(name, hand_mib))
    # The user's way to the lowest: ask for too little, then for the (measured)
    # minimum the BudgetError states.
    stated = fresh_plan(name, 1.0)[1]["min_budget_mb"]
    add("tfremat at its stated minimum", *fresh_plan(name, stated))
    rows["tfremat at its stated minimum"]["stated_mib"] = stated
    add("tfremat every-unit", tfremat.plan(model, 1e6, graph=graph, planner="every-unit"),
        {})
    data = sample(model, batch)
    runners = {k: Runner(m, batch, data) for k, m in models.items()}
    rounds = [step_seconds(runners, steps) for _ in range(ROUNDS)]
    for key, row in rows.items():
        if key in runners:
            row["step_ratios"] = [r[key] / r["plain"] for r in rounds]
            row["step_ratio"] = statistics.median(row["step_ratios"])
    return {"model": name, "batch": batch, "tokens": MODELS[name][0], "nodes": len(graph),
            "plain_step_s": statistics.median(r["plain"] for r in rounds), "rows": rows}


def markdown(data: dict[str, Any]) -> str:
    lines = ["# Transformers: tfremat against each block wrapped in `keras.remat` by hand", "",
             f"Command: `{data['command']}`", "",
             f"Machine: {data['machine']}. Peaks: allocator peak of one SGD step (weights "
             f"and batch included), median and largest of {data['repeats']} steps, each "
             f"variant in a fresh process; tfremat's budget at the hand version's peak is "
             f"the hand version's largest. Step time: in each of {ROUNDS} rounds, the median of "
             f"{data['steps']} steps run alternately with every other variant in one "
             "process, as a ratio to plain; the median of the rounds' ratios, and their "
             "range. "
             "tfremat's plans are chosen with `measure=True` (as the `Planner` does), each "
             "in a fresh process holding the model only, as a user's would.", ""]
    for rec in data["records"]:
        lines += [f"## {rec['model']} ({rec['tokens']} tokens, batch {rec['batch']}, "
                  f"{rec['nodes']} layer calls)", "",
                  "| variant | measured peak MiB: median (largest) | predicted MiB "
                  "| step-time ratio | plan |",
                  "|---|---|---|---|---|"]
        for key, row in rec["rows"].items():
            if "error" in row:
                lines.append(f"| {key} | {row['error'][:160]} | | | |")
                continue
            predicted = f"{row['predicted_mib']:.1f}" if "predicted_mib" in row else ""
            ratio = (f"{row['step_ratio']:.2f}x ({min(row['step_ratios']):.2f}-"
                     f"{max(row['step_ratios']):.2f})" if "step_ratios" in row else "")
            plan = (f"{row['planner']}, {row['segments']} segments"
                    if "planner" in row else "")
            if row.get("updates"):
                plan += ", updates in the backward pass"
            if "stated_mib" in row:
                plan += f"; stated minimum {row['stated_mib']:.1f} MiB"
            lines.append(f"| {key} | {row['measured_mib']:.1f} ({row['max_mib']:.1f}) "
                         f"| {predicted} | {ratio} | "
                         f"{plan} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=10, help="Measured steps per peak.")
    parser.add_argument("--steps", type=int, default=6, help="Timed steps per variant.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--make-plan", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_plan:
        plan_worker(args.make_plan, args.budget, args.plan)
        return
    if args.peak:
        peak_worker(args.peak, args.variant, args.plan, args.repeats)
        return
    if args.worker:
        with open(args.out, "w") as f:
            json.dump(run_model(args.worker, args.repeats, args.steps), f)
        return
    data = run_header(__file__, args.repeats, args.steps)
    for name in model_names(parser, args.models, MODELS):
        data["records"].append(run_worker(__file__, name, args.repeats, args.steps, []))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "transformers.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    with open(os.path.join(RESULTS, "transformers.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
