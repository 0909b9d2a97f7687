"""The DQN planner beside swap, auto and chen-sqrt: simulated peak vs overhead.

For ResNet50, VGG19, a U-Net, a Transformer encoder and a stacked LSTM,
budgets at 1.25x ... 3x less activation memory (peak minus weights, optimizer
state and batch) are planned by:

- dqn: `planner="dqn"` with the shipped weights (the agent's own plan; when it
  misses the budget, the planner falls back to auto, and the row says "miss");
- dqn fine-tuned: the same after `FINETUNE_EPISODES` episodes on the graph
  and budget;
- swap: offload only (`swap` on no plan);
- auto: `make_plan(..., offload=True)`: the DP and Chen planners, then offload
  on top of recompute plans;
- chen-sqrt: sqrt(n) segments, one plan whatever the budget.

Everything is simulated as in benchmarks/offload.py: FLOPs-based compute at
5e12 FLOP/s and two copy streams of 16 GB/s. Writes benchmarks/results/dqn.md,
dqn.json and the Pareto plot dqn.png.

    python benchmarks/dqn.py --cache /tmp/graphs    # reuse extracted graphs

`--measure` (alone, it keeps the simulated tables of dqn.json) MEASURES
recompute-only plans on the CPU instead, for smaller models at CPU-sized
inputs (`MEASURED_MODELS`): dqn with `offload=False` (the agent removes or
leaves calls, never swaps; "miss" when it fell back to auto), auto with
`offload=False` and chen-sqrt, at the budgets of `MEASURED_REDUCTIONS`. Each
(model, plan) runs in `--repeats` fresh subprocesses: the rewritten step's
allocator peak first (median of 3 steps, nothing else traced yet), then the
step time against the plain step's, alternately in the same process.

    python benchmarks/dqn.py --measure --repeats 2
    python benchmarks/dqn.py --measure --models ResNet50 --plans-cache /tmp/plans

`--models` measures some models and keeps the others' measured rows;
`--plans-cache` keeps each model's plans (fine-tuning the agent on ResNet50
takes minutes per budget); `--append` adds the new runs to a model's earlier
ones (made from the same cached plans), so that the table shows their spread.

    python benchmarks/dqn.py --measure --models LSTM --repeats 1 --append \
        --plans-cache /tmp/plans
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# NumPy's BLAS on one thread: the DQN's small matrices ran ~5x slower with two
# threads fighting over 2 cores (set before NumPy loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REDUCTIONS = (1.25, 1.5, 2.0, 2.5, 3.0)
FINETUNE_EPISODES = 20
ROWS = ("dqn", "dqn fine-tuned", "swap", "auto", "chen-sqrt")
MIB = 2**20


def lstm(layers: int = 4, seq: int = 256, width: int = 512, vocab: int = 8000) -> Any:
    """Stacked LSTMs over token embeddings, a softmax over the vocabulary per step."""
    import keras

    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, width)(tokens)
    for _ in range(layers):
        x = keras.layers.LSTM(width, return_sequences=True)(x)
    model = keras.Model(tokens, keras.layers.Dense(vocab)(x), name="lstm")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def unet() -> Any:
    """benchmarks/planners.py's U-Net at 256 px."""
    sys.path.insert(0, HERE)
    import planners

    model = planners.build_unet(256)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def models() -> list[tuple[str, Callable[[], Any], int]]:
    """(label, builder, batch size) of each model."""
    sys.path.insert(0, HERE)
    import offload

    return [("ResNet50 224px", offload.application("ResNet50"), 32),
            ("VGG19 224px", offload.application("VGG19"), 32),
            ("UNet 256px", unet, 8),
            ("Transformer encoder 8x512, seq 512", offload.transformer_encoder, 8),
            ("LSTM 4x512, seq 256", lstm, 16)]


def run_row(graph: Any, budget: int, row: str) -> dict[str, Any]:
    """Plans `graph` under `budget` the way `row` names; figures of the plan."""
    from tfremat.core import BudgetError
    from tfremat.planners import chen_sqrt, dqn, make_plan, swap
    from tfremat.simulation import simulate

    makers = {
        "dqn": lambda: dqn(graph, budget),
        "dqn fine-tuned": lambda: dqn(graph, budget, finetune_episodes=FINETUNE_EPISODES),
        "swap": lambda: swap(graph, budget),
        "auto": lambda: make_plan(graph, budget, offload=True),
        "chen-sqrt": lambda: chen_sqrt(graph),
    }
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = makers[row]()
    except BudgetError as err:
        return {"met": False, "seconds": time.perf_counter() - started,
                "peak": err.min_budget_bytes, "overhead": None}
    seconds = time.perf_counter() - started
    details = plan.estimates.details
    if "fallback" in details:  # the agent's own plan missed: report it
        return {"met": False, "seconds": seconds, "peak": details["agent_peak_bytes"],
                "overhead": details["agent_overhead"], "actions": details["actions"]}
    est = simulate(graph, plan)
    return {"met": est.peak_bytes <= budget, "seconds": seconds, "peak": est.peak_bytes,
            "overhead": est.step_seconds / est.baseline_seconds - 1,
            "segments": len(plan.segments), "offloaded": len(plan.offloaded),
            **({"actions": details["actions"]} if "actions" in details else {})}


def sweep(label: str, graph: Any) -> dict[str, Any]:
    """Every row at every budget of `REDUCTIONS`."""
    from tfremat.simulation import simulate

    plain = simulate(graph)
    activations = plain.peak_bytes - plain.persistent_bytes
    budgets = []
    for r in REDUCTIONS:
        budget = round(plain.persistent_bytes + activations / r)
        cells = {}
        for row in ROWS:
            cells[row] = run_row(graph, budget, row)
            cells[row]["reduction"] = activations / max(
                cells[row]["peak"] - plain.persistent_bytes, 1)
        budgets.append({"target": r, "budget": budget, "rows": cells})
        print(f"{label} {r}x: " + ", ".join(
            f"{row} {'met' if c['met'] else 'miss'} {c['seconds']:.1f}s"
            for row, c in cells.items()), flush=True)
    return {"model": label, "nodes": len(graph), "peak": plain.peak_bytes,
            "persistent": plain.persistent_bytes, "activations": activations,
            "step_seconds": plain.step_seconds, "budgets": budgets}


def cell(c: dict[str, Any]) -> str:
    if c["overhead"] is None:
        return f"miss (lowest {c['peak'] / MIB:.0f} MiB)"
    text = f"{c['peak'] / MIB:.0f} MiB, +{c['overhead']:.1%}, {c['seconds']:.1f} s"
    return text if c["met"] else f"miss: {text}"


def summary(results: list[dict[str, Any]]) -> list[str]:
    """Per row: budgets met, lowest overhead among the rows that met, times."""
    lines = ["| planner | budgets met | lowest overhead of all (of budgets some planner met) "
             "| median planning s | max planning s |", "|---|---:|---:|---:|---:|"]
    cells = [b["rows"] for m in results for b in m["budgets"]]
    some = [c for c in cells if any(x["met"] for x in c.values())]
    for row in ROWS:
        met = sum(c[row]["met"] for c in cells)
        best = sum(c[row]["met"] and c[row]["overhead"] <= min(
            x["overhead"] for x in c.values() if x["met"]) + 1e-9 for c in some)
        times = sorted(c[row]["seconds"] for c in cells)
        lines.append(f"| {row} | {met}/{len(cells)} | {best}/{len(some)} "
                     f"| {times[len(times) // 2]:.1f} | {times[-1]:.1f} |")
    return lines


def report(results: list[dict[str, Any]], weights_meta: dict[str, Any]) -> str:
    lines = [
        "# The DQN planner: simulated device peak vs step-time overhead",
        "",
        "`python benchmarks/dqn.py` — all figures SIMULATED by `tfremat.simulate` as in "
        "`benchmarks/offload.py`: compute time is FLOPs / 5e12 FLOP/s, copies on two "
        "streams of 16 GB/s overlapping compute. Adam, keras.applications with "
        "weights=None. Budgets remove 1.25x ... 3x of the activation memory (peak minus "
        "weights, optimizer state and batch). Overhead = simulated step time / step time "
        "without a plan - 1 (recomputation plus stalls). Each cell: simulated peak, "
        "overhead, planning time; \"miss\" = over the budget (for dqn, the agent's own "
        "plan: the planner then falls back to `auto`).",
        "",
        f"Shipped weights: {weights_meta}. Fine-tuning: {FINETUNE_EPISODES} episodes on the "
        "graph and budget.",
        "",
    ] + summary(results) + [""]
    for m in results:
        lines += [f"## {m['model']}", "",
                  f"{m['nodes']} layer calls; peak without a plan {m['peak'] / MIB:.0f} MiB = "
                  f"{m['persistent'] / MIB:.0f} MiB persistent + "
                  f"{m['activations'] / MIB:.0f} MiB activations; simulated step "
                  f"{m['step_seconds'] * 1e3:.1f} ms.", "",
                  "| target | budget MiB | " + " | ".join(ROWS) + " |",
                  "|---:|---:|" + "---|" * len(ROWS)]
        for b in m["budgets"]:
            lines.append(f"| {b['target']:g}x | {b['budget'] / MIB:.0f} | "
                         + " | ".join(cell(b["rows"][r]) for r in ROWS) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8),
                             squeeze=False)
    styles = dict(zip(ROWS, ("o-", "D--", "s-", "^-", "v:")))
    for ax, m in zip(axes[0], results):
        for row in ROWS:
            points = sorted((b["rows"][row]["reduction"], 100 * b["rows"][row]["overhead"])
                            for b in m["budgets"] if b["rows"][row]["met"])
            if points:
                ax.plot(*zip(*points), styles[row], label=row, alpha=0.8)
        ax.set_title(m["model"], fontsize=9)
        ax.set_xlabel("activation memory reduction (x)")
        ax.set_ylabel("simulated overhead (%)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", help="directory to keep extracted PlanGraphs in")
    parser.add_argument("--models", help="comma-separated starts of the labels "
                        "(\"VGG19\" or \"VGG19 128px\")")
    parser.add_argument("--measure", action="store_true",
                        help="only measure recompute-only plans on the CPU (keeps the "
                             "simulated tables of dqn.json)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="fresh subprocesses per measured (model, plan)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps of each model per measuring subprocess")
    parser.add_argument("--plans-cache", help="with --measure: directory of the plans "
                        "made per model (used when there, written otherwise)")
    parser.add_argument("--append", action="store_true",
                        help="with --measure: add the runs to each model's earlier "
                             "measured runs (the plans must be the same: use "
                             "--plans-cache)")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite dqn.md from dqn.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker), args.out)
    if args.measure or args.render:
        path = os.path.join(RESULTS, "dqn.json")
        with open(path) as f:
            data = json.load(f)
        if args.measure:
            measure_all(data, args)
        text = render(data)
        print(text)
        return
    sys.path.insert(0, HERE)
    import offload

    from tfremat.planners.deepq import SHIPPED_WEIGHTS
    from tfremat.planners.deepq.network import load_weights

    wanted = args.models.split(",") if args.models else None
    results = []
    for label, build, batch in models():
        if wanted and not any(label.startswith(w) for w in wanted):
            continue
        graph = offload.load_graph(label, build, batch, args.cache)
        results.append(sweep(label, graph))
    _, meta = load_weights(SHIPPED_WEIGHTS)
    data = {"finetune_episodes": FINETUNE_EPISODES, "weights": meta, "models": results}
    old = os.path.join(RESULTS, "dqn.json")
    if os.path.exists(old):  # keep the measured section of an earlier --measure
        with open(old) as f:
            measured = json.load(f).get("measured")
        if measured:
            data["measured"] = measured
    print(render(data))
    plot(results, os.path.join(RESULTS, "dqn.png"))


def render(data: dict[str, Any]) -> str:
    """Writes dqn.json and dqn.md (simulated tables, then the measured section)."""
    text = report(data["models"], data["weights"])
    if data.get("measured"):
        text += "\n" + measured_report(data["measured"])
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "dqn.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(RESULTS, "dqn.json"), "w") as f:
        json.dump(data, f, indent=1)
    return text


# -- measured on the CPU: recompute-only plans ------------------------------------

#: Budgets of the measured part: activation memory (simulated) divided by these.
MEASURED_REDUCTIONS = (1.25, 1.5, 2.0)

#: Rows of the measured part, each planned without host offload.
MEASURED_ROWS = ("dqn", "dqn fine-tuned", "auto", "chen-sqrt")


def measured_models() -> dict[str, tuple[Callable[[], Any], int]]:
    """label -> (builder of the compiled model, batch size), sized for a CPU."""
    sys.path.insert(0, HERE)
    import offload
    import planners

    def resnet50() -> Any:
        import keras

        model = keras.applications.ResNet50(weights=None, input_shape=(96, 96, 3),
                                            classes=10)
        model.compile(optimizer="adam", loss="categorical_crossentropy")
        return model

    def vgg19(size: int) -> Callable[[], Any]:
        def build() -> Any:
            import keras

            model = keras.applications.VGG19(weights=None, input_shape=(size, size, 3),
                                             classes=10)
            model.compile(optimizer="adam", loss="categorical_crossentropy")
            return model

        return build

    def unet() -> Any:
        model = planners.build_unet(128)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    return {
        "UNet 128px": (unet, 8),
        "Transformer encoder 4x256, seq 256": (lambda: offload.transformer_encoder(
            blocks=4, seq=256, width=256, heads=4, ff=1024, vocab=4000), 8),
        "LSTM 4x256, seq 64": (lambda: lstm(layers=4, seq=64, width=256, vocab=4000), 16),
        "ResNet50 96px": (resnet50, 16),
        "VGG19 96px": (vgg19(96), 8),
        "VGG19 128px": (vgg19(128), 16),
    }


def build_measured(label: str) -> tuple[Any, int]:
    """The compiled model of `label`, built first in its process with seed 0
    (so that its layer names, and so its graph, are the same in every process)."""
    import keras

    build, batch = measured_models()[label]
    keras.utils.set_random_seed(0)
    return build(), batch


def plan_measured(label: str) -> dict[str, Any]:
    """Extracts `label`'s graph and makes every recompute-only plan of the
    measured part: plans as JSON, with the simulator's figures."""
    from tfremat.core import BudgetError
    from tfremat.graph import extract
    from tfremat.planners import chen_sqrt, dqn, make_plan
    from tfremat.simulation import simulate

    model, batch = build_measured(label)
    graph = extract(model, batch_size=batch)
    plain = simulate(graph)
    activations = plain.peak_bytes - plain.persistent_bytes
    record: dict[str, Any] = {
        "model": label, "batch": batch, "nodes": len(graph), "peak": plain.peak_bytes,
        "persistent": plain.persistent_bytes, "activations": activations,
        "kernel_workspaces": graph.metadata.get("kernel_workspaces"), "plans": []}
    makers = {"auto": lambda b: make_plan(graph, b, "auto", offload=False),
              "chen-sqrt": lambda b: chen_sqrt(graph)}
    for r in MEASURED_REDUCTIONS:
        budget = round(plain.persistent_bytes + activations / r)
        for row in MEASURED_ROWS:
            entry: dict[str, Any] = {"row": row, "target": r, "budget": budget}
            started = time.perf_counter()
            if row.startswith("dqn"):
                # The agent's own plan, measured also when it misses the budget
                # (dqn then returns auto's plan instead).
                episodes = FINETUNE_EPISODES if row == "dqn fine-tuned" else 0
                own, removed = agent_plan(graph, budget, episodes)
                entry["plan_s"] = time.perf_counter() - started
                est = simulate(graph, own)
                if not episodes:  # what the planner itself does with that walk
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            plan = dqn(graph, budget, offload=False)
                        fell_back = "fallback" in plan.estimates.details
                    except BudgetError:
                        fell_back = True
                    assert fell_back == (est.peak_bytes > budget)
                    assert fell_back or plan.segments == own.segments
                entry.update(met=est.peak_bytes <= budget, fallback=est.peak_bytes > budget,
                             predicted_peak=est.peak_bytes,
                             predicted_overhead=est.step_seconds / est.baseline_seconds - 1,
                             removed=removed, segments=len(own.segments),
                             plan=None if own.is_empty else own.to_json())
                record["plans"].append(entry)
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = makers[row](budget)
            except BudgetError as err:
                entry.update(met=False, predicted_peak=err.min_budget_bytes, plan=None)
                record["plans"].append(entry)
                continue
            entry["plan_s"] = time.perf_counter() - started
            assert not plan.offloaded, "a recompute-only plan offloads"
            est = simulate(graph, plan)
            entry.update(met=est.peak_bytes <= budget, predicted_peak=est.peak_bytes,
                         predicted_overhead=est.step_seconds / est.baseline_seconds - 1,
                         segments=len(plan.segments), plan=plan.to_json())
            record["plans"].append(entry)
    return record


def agent_plan(graph: Any, budget: int, finetune_episodes: int = 0) -> Any:
    """The DQN agent's own recompute-only plan under `budget`, from the shipped
    weights: what `dqn(graph, budget, offload=False, finetune_episodes=...)`
    returns when it does not fall back (the walk to its end when it never fits),
    and how many calls it removed."""
    import dataclasses

    import numpy as np

    from tfremat.planners.deepq import SHIPPED_WEIGHTS, network
    from tfremat.planners.deepq.agent import Agent
    from tfremat.planners.deepq.features import REMOVE, describe

    view = describe(graph)
    view = dataclasses.replace(view, can_swap=np.zeros_like(view.can_swap), offloads={})
    params, _ = network.load_weights(SHIPPED_WEIGHTS)
    agent = Agent(params, seed=0)
    if finetune_episodes:
        agent.train([(view, budget)], finetune_episodes)
    episode = agent.greedy(view, budget)
    return episode.plan, int(np.sum(episode.decisions == REMOVE))


def measure_plan(label: str, plan_json: str | None, steps: int) -> dict[str, Any]:
    """In a fresh process: the peak of the step of `label` rewritten by the plan
    (None: the plain model), then its step time over the plain step's."""
    import gc

    import tfremat  # sets TF_CPU_ALLOCATOR_USE_BFC before TensorFlow runs ops
    from tfremat.core import Plan

    sys.path.insert(0, HERE)
    from planners import Runner, step_seconds

    model, batch = build_measured(label)
    if plan_json is None:
        return {"peak": Runner(model, batch).peak_bytes(3)}
    rewritten = tfremat.rewrite(model, Plan.from_json(plan_json))
    rewritten.compile(optimizer=type(model.optimizer).__name__.lower(), loss=model.loss)
    runner = Runner(rewritten, batch)
    peak = runner.peak_bytes(3)
    runners = {"plain": Runner(model, batch), "plan": runner}
    seconds = step_seconds(runners, steps)
    del runners, runner
    gc.collect()
    return {"peak": peak, "step_s": seconds["plan"], "plain_step_s": seconds["plain"],
            "step_ratio": seconds["plan"] / seconds["plain"]}


def worker(job: dict[str, Any], out: str) -> None:
    if job["kind"] == "plan":
        result = plan_measured(job["model"])
    else:
        plan_json = None
        if job.get("plans"):
            with open(job["plans"]) as f:
                plan_json = json.load(f)["plan"]
        result = measure_plan(job["model"], plan_json, job["steps"])
    with open(out, "w") as f:
        json.dump(result, f)


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """Runs `job` in a fresh Python process; its JSON result."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                        json.dumps(job), "--out", tmp.name], check=True)
        with open(tmp.name) as f:
            return json.load(f)


def without_cache(argv: list[str]) -> list[str]:
    """`argv` without `--plans-cache` and its value (it changes no figure)."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith("--plans-cache="):
            skip = False
            continue
        if a == "--plans-cache":
            skip = True
            continue
        out.append(a)
    return out


def measure_all(data: dict[str, Any], args: argparse.Namespace) -> None:
    """Plans and measures every model of `measured_models()` (or `--models`),
    writing results after each model into `data["measured"]`."""
    import shlex
    import statistics
    import tempfile

    sys.path.insert(0, HERE)
    from planners import machine

    labels = list(measured_models())
    if args.models:
        wanted = args.models.split(",")
        labels = [m for m in labels if any(m.startswith(w) for w in wanted)]
    before = data.get("measured") or {}
    old = {m["model"]: {"command": before["command"], "steps": before["steps"], **m}
           for m in before.get("models", [])}
    data["measured"] = {
        "command": "python " + shlex.join(["benchmarks/dqn.py", *without_cache(sys.argv[1:])]),
        "machine": machine(),
        "repeats": args.repeats, "steps": args.steps, "reductions": MEASURED_REDUCTIONS,
        "models": []}
    for label in measured_models():
        if label not in labels:
            if label in old:
                data["measured"]["models"].append(old[label])
            continue
        cached = (os.path.join(args.plans_cache, label + ".json")
                  if args.plans_cache else None)
        if cached and os.path.exists(cached):
            with open(cached) as f:
                record = json.load(f)
        else:
            print(f"{label}: planning", flush=True)
            record = run_worker({"kind": "plan", "model": label})
            if cached:
                os.makedirs(args.plans_cache, exist_ok=True)
                with open(cached, "w") as f:
                    json.dump(record, f)
        record["command"] = data["measured"]["command"]
        record["steps"] = args.steps
        variants: dict[str | None, list[dict[str, Any]]] = {None: []}
        for entry in record["plans"]:
            if entry.get("plan") is not None:
                key = json.dumps(json.loads(entry["plan"])["segments"])
                variants.setdefault(key, []).append(entry)
        runs: dict[str | None, list[dict[str, Any]]] = {}
        for key, entries in variants.items():
            runs[key] = []
            with tempfile.NamedTemporaryFile("w", suffix=".json") as tmp:
                if entries:
                    json.dump({"plan": entries[0]["plan"]}, tmp)
                    tmp.flush()
                for k in range(args.repeats):
                    runs[key].append(run_worker({"kind": "measure", "model": label,
                                                 "steps": args.steps,
                                                 "plans": tmp.name if entries else None}))
                    name = (f"{entries[0]['row']} @ {entries[0]['target']}x"
                            if entries else "plain")
                    print(f"  {name} run {k + 1}: {runs[key][-1]['peak'] / MIB:.1f} MiB, "
                          f"{runs[key][-1].get('step_ratio', 1):.2f}x", flush=True)
        plain = [r["peak"] for r in runs[None]]
        record["measured_plain"] = {"peaks": plain, "median": statistics.median(plain)}
        for key, entries in variants.items():
            if key is None:
                continue
            peaks = [r["peak"] for r in runs[key]]
            ratios = [r["step_ratio"] for r in runs[key]]
            for entry in entries:
                entry["measured"] = {"peaks": peaks, "median": statistics.median(peaks),
                                     "step_ratios": ratios,
                                     "step_ratio": statistics.median(ratios),
                                     "plain_step_s": [r["plain_step_s"]
                                                      for r in runs[key]]}
        if args.append:
            if label not in old:
                raise SystemExit(f"--append: {label} has no earlier measured runs")
            append_runs(old[label], record)
        for entry in record["plans"]:
            entry.pop("plan", None)  # the JSON stays small; plans are deterministic
        data["measured"]["models"].append(record)
        render(data)  # partial results as models finish


def append_runs(earlier: dict[str, Any], record: dict[str, Any]) -> None:
    """Puts the measured runs of `earlier` (the same model's record from an
    earlier invocation) before those of `record`, in place.

    Raises:
        ValueError: when a plan or the number of timed steps differs between
            the two records.
    """
    import statistics

    if earlier["steps"] != record["steps"]:
        raise ValueError(f"--append: {earlier['steps']} timed steps before, "
                         f"{record['steps']} now")
    commands = earlier["command"]
    record["command"] = [*(commands if isinstance(commands, list) else [commands]),
                         record["command"]]
    plain = earlier["measured_plain"]["peaks"] + record["measured_plain"]["peaks"]
    record["measured_plain"] = {"peaks": plain, "median": statistics.median(plain)}
    before = {(e["row"], e["target"]): e for e in earlier["plans"]}
    for entry in record["plans"]:
        old = before[entry["row"], entry["target"]]
        if (old.get("segments"), old["predicted_peak"]) != (entry.get("segments"),
                                                             entry["predicted_peak"]):
            raise ValueError(f"--append: the plan of {entry['row']} at "
                             f"{entry['target']}x differs from the earlier one")
        if entry.get("measured") is None:
            continue
        new, was = entry["measured"], old["measured"]
        peaks = was["peaks"] + new["peaks"]
        ratios = was["step_ratios"] + new["step_ratios"]
        entry["measured"] = {"peaks": peaks, "median": statistics.median(peaks),
                             "step_ratios": ratios, "step_ratio": statistics.median(ratios),
                             "plain_step_s": was["plain_step_s"] + new["plain_step_s"]}


def measured_cell(entry: dict[str, Any]) -> str:
    if entry.get("measured") is None:
        if entry.get("removed") == 0:  # the agent did nothing
            return (f"miss: no call removed ({entry['predicted_peak'] / MIB:.0f} MiB "
                    "predicted)")
        return f"miss (lowest {entry['predicted_peak'] / MIB:.0f} MiB predicted)"
    m = entry["measured"]
    peaks = m["peaks"]
    spread = (f" ({min(peaks) / MIB:.0f}–{max(peaks) / MIB:.0f})"
              if len(peaks) > 1 else "")
    ratios = m["step_ratios"]
    ratio_spread = (f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else "")
    over = "" if m["median"] <= entry["budget"] else " (over)"
    return (("" if entry["met"] else "miss: ")
            + f"{entry['predicted_peak'] / MIB:.0f} / {m['median'] / MIB:.0f}{spread} MiB"
            f"{over}; {m['step_ratio']:.2f}x{ratio_spread} "
            f"(sim. +{entry['predicted_overhead']:.0%}); {entry['segments']} seg.")


def measured_report(measured: dict[str, Any]) -> str:
    lines = [
        "## Measured on CPU (recompute-only plans)",
        "",
        f"Command: `{measured['command']}`",
        "",
        f"Machine: {measured['machine']}, shared with other jobs. Smaller models at "
        "CPU-sized inputs, Adam. Every row plans WITHOUT host offload (its savings cannot "
        "be measured on a CPU): dqn = `dqn(graph, budget, offload=False)` with the shipped "
        "weights (the agent only removes or leaves calls; \"miss\" when its own plan "
        "missed the budget — the planner then returns auto's plan — and the cell "
        "measures the agent's own plan, the walk to its end, anyway); dqn fine-tuned = the "
        f"same after {FINETUNE_EPISODES} episodes of fine-tuning on the graph and budget; "
        "auto = `make_plan(..., "
        "offload=False)`; chen-sqrt = sqrt(n) segments (one plan, the same at every "
        "budget). Budgets remove 1.25x, 1.5x and 2x of the SIMULATED activation memory. "
        "Each distinct plan ran in fresh subprocesses (how many: under each model): the "
        "rewritten step's allocator peak (`get_memory_info(\"CPU:0\")[\"peak\"]` after "
        "`reset_memory_stats`, median of 3 steps after a warm-up, weights, optimizer "
        "state and batch included) before anything else was traced in the process; then "
        "its step time over the plain step's, median of the timed steps run "
        "alternately in that process. Each cell: predicted / measured peak (min–max over "
        "the subprocesses), measured step-time ratio to the plain step (min–max), the "
        "simulator's overhead, segments; \"(over)\": measured above the budget. Step-time "
        "ratios from a few steps on a machine running other jobs are noisy (plans the "
        "simulator puts at +30% measured below 1.0x): the peaks are the point here.",
        "",
    ]
    for m in measured["models"]:
        plain = m["measured_plain"]
        peaks = plain["peaks"]
        command = m.get("command", measured["command"])
        if isinstance(command, list):  # runs appended by later invocations
            said = ["Commands, whose runs are pooled: "
                    + "; ".join(f"`{c}`" for c in command), ""]
        else:
            said = [f"Command: `{command}`", ""] if command != measured["command"] else []
        lines += [f"### {m['model']}, batch {m['batch']}", "", *said,
                  f"{m['nodes']} layer calls. Plain step: predicted "
                  f"{m['peak'] / MIB:.0f} MiB ({m['persistent'] / MIB:.0f} persistent + "
                  f"{m['activations'] / MIB:.0f} activations), measured "
                  f"{plain['median'] / MIB:.0f} MiB" + (
                      f" ({min(peaks) / MIB:.0f}–{max(peaks) / MIB:.0f})"
                      if len(peaks) > 1 else "") + f". {len(peaks)} fresh subprocess(es) "
                  f"per plan, {m.get('steps', measured['steps'])} timed steps each.", "",
                  "| target | budget MiB | " + " | ".join(MEASURED_ROWS) + " |",
                  "|---:|---:|" + "---|" * len(MEASURED_ROWS)]
        for r in measured["reductions"]:
            entries = {e["row"]: e for e in m["plans"] if e["target"] == r}
            budget = next(iter(entries.values()))["budget"]
            lines.append(f"| {r:g}x | {budget / MIB:.0f} | " + " | ".join(
                measured_cell(entries[row]) for row in MEASURED_ROWS) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
