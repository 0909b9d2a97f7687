"""The planners at their minimum feasible budgets, measured (Kusumoto et al. Table 1).

For each model: the vanilla step's measured peak; for each planner at its
minimum feasible budget (by the simulator) the measured peak of the rewritten
model, the predicted peak and the step-time ratio to vanilla; then, with the
sqrt(n) plan's measured peak as the budget, each planner's peak and step-time
ratio. Peaks: TensorFlow's allocator peak over one SGD training step (weights
and batch included), median of several steps, each variant in a fresh process
(see `fresh_peak_bytes`). Step times: vanilla and
rewritten steps run alternately in one process, median per model. Each model
runs in its own subprocess so no measurement sees another model's memory.

Usage:
    python benchmarks/planners.py [--models ResNet50,UNet] [--quick]

Writes benchmarks/results/planners.md and benchmarks/results/planners.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
MIB = 2**20

#: name -> (keras.applications builder or "unet", input size, batch size).
MODELS: dict[str, tuple[str, int, int]] = {
    "ResNet50": ("ResNet50", 96, 16),
    "ResNet152": ("ResNet152", 96, 16),
    "DenseNet121": ("DenseNet121", 96, 16),
    "VGG19": ("VGG19", 96, 16),
    "MobileNetV2": ("MobileNetV2", 96, 16),
    "InceptionV3": ("InceptionV3", 139, 16),
    "UNet": ("unet", 128, 8),
}

#: Row label -> (registry name, settings for `make_plan`).
PLANNERS: dict[str, tuple[str, dict[str, Any]]] = {
    "chen-sqrt": ("chen-sqrt", {}),
    "chen-greedy": ("chen-greedy", {}),
    "chen-drop-cheap": ("chen-drop-cheap", {}),
    "chen-recursive": ("chen-recursive", {}),
    "approx-dp (time)": ("approx-dp", {"objective": "time"}),
    "approx-dp (memory)": ("approx-dp", {"objective": "memory"}),
    "exact-dp (time)": ("exact-dp", {"objective": "time", "time_limit": 20.0}),
    "auto": ("auto", {"offload": False}),
    # Optimizer updates inside the backward pass (docs/updates-in-backward.md).
    "chen-sqrt + updates": ("chen-sqrt", {"update_in_backward": True}),
    "approx-dp (memory) + updates": ("approx-dp", {"objective": "memory",
                                                   "update_in_backward": True}),
    # What `tfremat.plan` and the `Planner` do by default under a binding budget.
    "auto + updates": ("auto", {"offload": False, "update_in_backward": True}),
    # Their default on a CPU where the updates cannot run in the backward pass
    # (a custom `train_step`, `global_clipnorm`, ...): the order pinned.
    "auto + pinned": ("auto", {"offload": False, "pin_order": True}),
}
QUICK_PLANNERS = ("chen-sqrt", "approx-dp (time)", "approx-dp (memory)",
                  "chen-sqrt + updates")


def build_unet(size: int, classes: int = 10, base: int = 32, depth: int = 4) -> Any:
    """A U-Net: conv-BN-ReLU pairs, max pooling down, transposed convs up,
    skip concatenations, per-pixel softmax over `classes`."""
    import keras
    from keras import layers

    def block(x: Any, filters: int) -> Any:
        for _ in range(2):
            x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = layers.BatchNormalization()(x)
            x = layers.ReLU()(x)
        return x

    inputs = keras.Input((size, size, 3))
    x, skips = inputs, []
    for d in range(depth):
        x = block(x, base * 2**d)
        skips.append(x)
        x = layers.MaxPooling2D()(x)
    x = block(x, base * 2**depth)
    for d in reversed(range(depth)):
        x = layers.Conv2DTranspose(base * 2**d, 2, strides=2)(x)
        x = layers.Concatenate()([x, skips[d]])
        x = block(x, base * 2**d)
    outputs = layers.Conv2D(classes, 1, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="unet")


def build_model(name: str) -> tuple[Any, int]:
    """The compiled model of `MODELS[name]` and its batch size."""
    import keras

    builder, size, batch = MODELS[name]
    keras.utils.set_random_seed(0)
    if builder == "unet":
        model = build_unet(size)
    else:
        model = getattr(keras.applications, builder)(
            weights=None, input_shape=(size, size, 3), classes=10)
    compile_like_original(model)
    return model, batch


def compile_like_original(model: Any) -> None:
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")


# -- the worker: one model, in its own process ----------------------------------


def synthetic_xy(model: Any, batch_size: int) -> tuple[Any, Any]:
    """A batch `(x, y)` of random floats (and zeros for integers) of the
    shapes of `model`'s inputs and targets.

    Tracing the step to find the targets' shape leaves its stand-in optimizer
    in reference cycles (`tfremat.graph.forgetting_custom_gradients`): with
    Adam on VGG19 its slots held 471 MiB until `gc.collect()`, and a step
    measured after them counted them."""
    from tfremat.graph import batch_specs, trace
    from tfremat.memory import synthetic_batch

    x_spec, y_spec = batch_specs(model, batch_size=batch_size)
    if y_spec is None:
        y_spec = trace(model, batch_size=batch_size).input_specs[1]
        gc.collect()
    return synthetic_batch(x_spec, 1), synthetic_batch(y_spec, 2)


class Runner:
    """A compiled training step of one model on a fixed batch: `data`, `(x, y)`
    arrays, or random floats (and zeros for integers) of the model's shapes."""

    def __init__(self, model: Any, batch_size: int, data: Any = None) -> None:
        import tensorflow as tf

        from tfremat.graph import step_function
        from tfremat.memory import allocator_copy

        if data is not None:
            self.x, self.y = allocator_copy(tuple(data))
        else:
            self.x, self.y = synthetic_xy(model, batch_size)
        self.step = tf.function(step_function(model))
        self()

    def __call__(self) -> None:
        import tensorflow as tf

        tf.nest.map_structure(lambda t: t.numpy(), self.step(self.x, self.y))

    def step_peaks(self, repeats: int) -> list[int]:
        """The allocator's peak during each of `repeats` steps."""
        import tensorflow as tf

        from tfremat.backend import device_name

        device, peaks = device_name(), []
        for _ in range(repeats):
            tf.config.experimental.reset_memory_stats(device)
            self()
            peaks.append(tf.config.experimental.get_memory_info(device)["peak"])
        return peaks

    def peak_bytes(self, repeats: int) -> int:
        """Median over `repeats` steps of the allocator's peak during the step."""
        return int(statistics.median(self.step_peaks(repeats)))


def alone_peak_bytes(model: Any, batch_size: int, repeats: int) -> int:
    """The peak of `model`'s step with no other step function alive.

    Every traced step function keeps buffers of its own between calls (its batch,
    kernel caches: 10-25 MiB each on U-Net), and they count in the allocator's
    peak, so measuring with the other variants' runners alive inflates later
    variants' peaks by their sum. Each peak is therefore measured alone.
    """
    runner = Runner(model, batch_size)
    try:
        return runner.peak_bytes(repeats)
    finally:
        del runner
        gc.collect()


def fresh_peak_bytes(name: str, plan: Any, repeats: int) -> int:
    """The peak of model `name`'s step, rewritten with `plan` (None: plain), in a
    fresh process.

    A process that has run other variants first measures higher: the allocator's
    free chunks, split and merged by the earlier steps, are handed out whole
    (ResNet50's chen-sqrt plan with updates in the backward pass measured 197.6
    MiB first in a process, 222.5 after three other plans, 239.6 after the
    plain step too).
    """
    return peak_in_fresh_process(__file__, ["--peak", name], plan, repeats)


def peak_in_fresh_process(script: str, args: list[str], plan: Any, repeats: int) -> Any:
    """Runs `script *args --plan PATH --repeats N` (PATH empty without a plan, else
    the plan as JSON) in a fresh process; what it prints last, read as JSON (the
    bytes, or a list of them)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "plan.json") if plan is not None else ""
        if plan is not None:
            plan.to_json(path)
        return json_from_process([script, *args, "--plan", path, "--repeats", str(repeats)])


def plan_in_fresh_process(script: str, name: str, budget_mib: float) -> tuple[Any, dict]:
    """Runs `script --make-plan name --budget B --plan PATH` in a fresh process,
    whose worker plans with `measure=True` and writes the plan to PATH and
    prints `{}`, or prints its BudgetError as JSON: the plan, or None and that
    JSON."""
    from tfremat.core import Plan

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "plan.json")
        result = json_from_process([script, "--make-plan", name, "--budget",
                                    str(budget_mib), "--plan", path])
        return (Plan.from_json(path) if not result else None), result


def json_from_process(args: list[str], env: dict[str, str] | None = None) -> Any:
    """Runs `python *args` in a fresh process (with `env`, if given); the JSON it
    prints last."""
    proc = subprocess.run([sys.executable, *args], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_worker(name: str, plan_path: str, repeats: int) -> None:
    """`fresh_peak_bytes`'s process: prints the peak in bytes."""
    from tfremat.api import rewrite
    from tfremat.core import Plan

    model, batch = build_model(name)
    if plan_path:
        model = rewrite(model, Plan.from_json(plan_path))
        compile_like_original(model)
    print(Runner(model, batch).peak_bytes(repeats))


def step_seconds(runners: dict[str, Runner], repeats: int) -> dict[str, float]:
    """Median step time of each runner, steps run alternately."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(repeats):
        for key, run in runners.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def plan_at(graph: Any, label: str, budget: int) -> Any:
    """The plan of row `label` of `PLANNERS` for `budget` bytes."""
    from tfremat.planners import exact_dp, make_plan

    planner, settings = PLANNERS[label]
    if planner == "exact-dp":  # make_plan would fall back to approx-dp
        return exact_dp(graph, budget, **settings)
    return make_plan(graph, budget, planner, **settings)


def plan_at_minimum(graph: Any, label: str) -> Any:
    """The plan of row `label` at its minimum feasible budget."""
    from tfremat.core import BudgetError

    try:
        return plan_at(graph, label, 0)
    except BudgetError as err:
        return plan_at(graph, label, err.min_budget_bytes)


def run_model(name: str, planners: list[str], repeats: int, steps: int) -> dict[str, Any]:
    """Plans, rewrites, measures and times one model; returns the JSON record."""
    from tfremat.api import rewrite
    from tfremat.core import BudgetError
    from tfremat.graph import extract
    from tfremat.planners import DPTimeout
    from tfremat.simulation import simulate

    model, batch = build_model(name)
    graph, extract_s = timed(lambda: extract(model, batch_size=batch))
    models = {"vanilla": model}  # runner key -> model to step
    record: dict[str, Any] = {
        "model": name, "size": MODELS[name][1], "batch": batch, "nodes": len(graph),
        "extract_s": extract_s, "persistent_mib": graph.total_persistent_bytes / MIB,
        "weight_grad_mib": sum(n.param_bytes for n in graph) / MIB,
        "vanilla": {"predicted_mib": simulate(graph).peak_bytes / MIB,
                    "measured_mib": fresh_peak_bytes(name, None, repeats) / MIB},
        "rows": []}
    by_segments: dict[str, str] = {}  # plan segments -> runner key
    peaks: dict[str, float] = {}  # runner key -> measured peak MiB

    def measure(label: str, budget_kind: str, plan: Any, plan_s: float) -> dict[str, Any]:
        key = json.dumps([[s.to_dict() for s in plan.segments], plan.update_in_backward])
        if key not in by_segments:
            rewritten = rewrite(model, plan)
            if rewritten is not model:
                compile_like_original(rewritten)
            by_segments[key] = f"{label} @ {budget_kind}"
            models[by_segments[key]] = rewritten
            peaks[by_segments[key]] = fresh_peak_bytes(name, plan, repeats) / MIB
        row = {"planner": label, "budget": budget_kind, "runner": by_segments[key],
               "budget_mib": plan.budget_bytes / MIB, "plan_s": plan_s,
               "predicted_mib": plan.peak_bytes / MIB,
               "predicted_overhead": plan.estimates.overhead,
               "measured_mib": peaks[by_segments[key]],
               "segments": len(plan.segments)}
        print(f"  {label} @ {budget_kind}: {row['predicted_mib']:.1f} predicted, "
              f"{row['measured_mib']:.1f} measured MiB ({plan_s:.2f} s)", flush=True)
        return row

    for label in planners:
        try:
            plan, plan_s = timed(lambda: plan_at_minimum(graph, label))
        except DPTimeout as err:
            record["rows"].append({"planner": label, "budget": "min", "error": str(err)})
            continue
        record["rows"].append(measure(label, "min", plan, plan_s))
    sqrt_rows = [r for r in record["rows"] if r["planner"] == "chen-sqrt"]
    if sqrt_rows:
        budget = round(sqrt_rows[0]["measured_mib"] * MIB)
        record["sqrt_budget_mib"] = budget / MIB
        for label in planners:
            try:
                plan, plan_s = timed(lambda: plan_at(graph, label, budget))
            except (BudgetError, DPTimeout) as err:
                record["rows"].append({"planner": label, "budget": "sqrt",
                                       "error": type(err).__name__})
                continue
            record["rows"].append(measure(label, "sqrt", plan, plan_s))
    runners = {key: Runner(m, batch) for key, m in models.items()}
    seconds = step_seconds(runners, steps)
    record["vanilla"]["step_s"] = seconds["vanilla"]
    for row in record["rows"]:
        if "runner" in row:
            row["step_ratio"] = seconds[row["runner"]] / seconds["vanilla"]
    return record


# -- the driver -------------------------------------------------------------------


def planner_timings() -> dict[str, str]:
    """Wall time of the approximate DP on ResNet152's graph and the exact DP on
    ResNet50's, each in a fresh subprocess."""
    code = (
        "import sys, time, keras\n"
        "sys.path.insert(0, %r)\n"
        "from planners import build_model\n"
        "from tfremat.graph import extract\n"
        "from tfremat.planners import DPTimeout, approx_dp, exact_dp\n"
        "from tfremat.core import BudgetError\n"
        "model, batch = build_model(%r)\n"
        "g = extract(model, batch_size=batch)\n"
        "start = time.perf_counter()\n"
        "try:\n"
        "    %s\n"
        "    print('%%.2f s' %% (time.perf_counter() - start))\n"
        "except BudgetError:\n"
        "    print('%%.2f s' %% (time.perf_counter() - start))\n"
        "except DPTimeout as e:\n"
        "    print('gave up: %%s' %% e)\n")
    jobs = {
        "approx-dp (time), ResNet152, budget 0.8x vanilla":
            ("ResNet152", "from tfremat.simulation import simulate; "
             "approx_dp(g, int(simulate(g).peak_bytes * 0.8))"),
        "approx-dp (memory), ResNet152, minimum budget":
            ("ResNet152", "approx_dp(g, 0, objective='memory')"),
        "exact-dp (time), ResNet50, 60 s limit":
            ("ResNet50", "from tfremat.simulation import simulate; "
             "exact_dp(g, int(simulate(g).peak_bytes * 0.8), time_limit=60)"),
    }
    out = {}
    for label, (model, call) in jobs.items():
        proc = subprocess.run([sys.executable, "-c", code % (HERE, model, call)],
                              capture_output=True, text=True)
        out[label] = (proc.stdout.strip().splitlines() or [proc.stderr[-300:]])[-1]
    return out


#: Issue #4's targets: the best planner's measured minimum-budget peak below the
#: sqrt(n) plan's by at least this fraction.
TARGETS = {"ResNet50": 0.15, "DenseNet121": 0.15, "MobileNetV2": 0.15, "VGG19": 0.15,
           "UNet": 0.30, "InceptionV3": 0.30}


def summary(records: list[dict[str, Any]]) -> list[str]:
    """The targets table: lowest measured minimum-budget peak against sqrt(n)'s,
    and the time-centric DP's overhead at the sqrt(n) plan's peak."""
    lines = ["| model | sqrt(n) peak MiB measured (predicted) | lowest measured peak "
             "MiB (planner) | below sqrt(n) measured | lowest predicted below sqrt(n) "
             "| target | step-time overhead at the sqrt(n) peak: approx-dp (time) vs "
             "sqrt(n) |", "|---|---|---|---|---|---|---|"]
    for rec in records:
        rows = {(r["planner"], r["budget"]): r for r in rec["rows"] if "error" not in r}
        sqrt = rows.get(("chen-sqrt", "min"))
        minima = [r for (_, b), r in rows.items() if b == "min"]
        if sqrt is None or not minima:
            continue
        best = min(minima, key=lambda r: r["measured_mib"])
        lowest_predicted = min(r["predicted_mib"] for r in minima)
        target = TARGETS.get(rec["model"])
        dp = rows.get(("approx-dp (time)", "sqrt"))
        overheads = (f"{dp['step_ratio'] - 1:+.0%} vs {sqrt['step_ratio'] - 1:+.0%}"
                     if dp else "does not fit")
        lines.append(
            f"| {rec['model']} | {sqrt['measured_mib']:.1f} ({sqrt['predicted_mib']:.1f}) "
            f"| {best['measured_mib']:.1f} ({best['planner']}) "
            f"| {1 - best['measured_mib'] / sqrt['measured_mib']:.1%} "
            f"| {1 - lowest_predicted / sqrt['predicted_mib']:.1%} "
            f"| {'—' if target is None else f'{target:.0%}'} | {overheads} |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    """The results page of one run (`data` as written to planners.json)."""
    records = data["records"]
    lines = [
        "# Planners at their minimum feasible budgets, measured",
        "",
        f"Command: `{data['command']}`",
        "",
        f"Machine: {data['machine']}. Peaks: allocator peak of one SGD step (weights, "
        f"gradients, batch included), median of {data['repeats']} steps, each variant "
        "in a fresh process (a process that ran other variants first measured up to 21% "
        "higher). Step time: "
        f"median of {data['steps']} steps run alternately with vanilla and every other "
        "rewritten model in one process. \"auto\" runs without host offload (its "
        "savings cannot be measured on CPU).",
        
        "Between two runs of this script, measured peaks of the same plan moved by up to "
        "5% and step-time ratios by up to 0.2 (2 inter-op threads; a shared machine). "
        "Plans of many small segments can measure above their prediction: TensorFlow's "
        "BFC allocator hands out a free chunk whole when it is less than twice the "
        "request (docs/how-it-works.md).",
        "",
        *summary(records),
        "",
    ]
    for rec in records:
        lines += [
            f"## {rec['model']} ({rec['size']}px, batch {rec['batch']}, {rec['nodes']} "
            f"layer calls)",
            "",
            f"Vanilla: measured {rec['vanilla']['measured_mib']:.1f} MiB, predicted "
            f"{rec['vanilla']['predicted_mib']:.1f} MiB, step "
            f"{rec['vanilla']['step_s']:.2f} s. Persistent (weights, batch) "
            f"{rec['persistent_mib']:.1f} MiB; weight gradients "
            f"{rec['weight_grad_mib']:.1f} MiB.",
            "",
            "| planner | budget | measured peak MiB | predicted MiB | vs sqrt (measured) "
            "| step-time ratio | predicted overhead | segments | plan s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        sqrt = next((r["measured_mib"] for r in rec["rows"]
                     if r["planner"] == "chen-sqrt" and r.get("budget") == "min"), None)
        for row in rec["rows"]:
            budget = ("minimum" if row["budget"] == "min"
                      else f"sqrt peak {rec.get('sqrt_budget_mib', 0):.1f}")
            if "error" in row:
                lines.append(f"| {row['planner']} | {budget} | {row['error'][:60]} "
                             "| | | | | | |")
                continue
            vs = f"{row['measured_mib'] / sqrt - 1:+.1%}" if sqrt else "—"
            lines.append(
                f"| {row['planner']} | {budget} | {row['measured_mib']:.1f} "
                f"| {row['predicted_mib']:.1f} | {vs} | {row['step_ratio']:.2f}x "
                f"| {row['predicted_overhead']:+.0%} | {row['segments']} "
                f"| {row['plan_s']:.2f} |")
        lines.append("")
    if data["timings"]:
        lines += ["## Planner timings", "",
                  f"Command: `{data.get('timings_command', data['command'])}`", "",
                  "| run | wall time |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in data["timings"].items()] + [""]
    return "\n".join(lines)


def pareto_plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(records), 4)
    rows = (len(records) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    labels = list(PLANNERS)
    colours = {k: plt.cm.tab10(i % 10) for i, k in enumerate(labels)}
    for ax, rec in zip(axes.flat, records):
        ax.scatter([1.0], [rec["vanilla"]["measured_mib"]], marker="*", s=120,
                   color="black", label="vanilla")
        for row in rec["rows"]:
            if "error" in row:
                continue
            ax.scatter([row["step_ratio"]], [row["measured_mib"]],
                       color=colours[row["planner"]],
                       marker="o" if row["budget"] == "min" else "^",
                       label=row["planner"])
        ax.set_title(f"{rec['model']} ({rec['size']}px, batch {rec['batch']})", fontsize=9)
        ax.set_xlabel("step time / vanilla")
        ax.set_ylabel("measured peak (MiB)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(records):]:
        ax.axis("off")
    handles, names = [], []
    for ax in axes.flat:
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    fig.legend(handles, names, loc="lower center", ncol=5, fontsize=8,
               bbox_to_anchor=(0.5, 0.04))
    fig.text(0.5, 0.005, "o: minimum feasible budget   ^: budget = sqrt(n) plan's "
             "measured peak", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=110)


def model_names(parser: argparse.ArgumentParser, text: str, known: Any) -> list[str]:
    """The comma-separated model names of `--models`, each one of `known`."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown:
        parser.error(f"Unknown model(s) {unknown}; choose from {list(known)}.")
    return names


def machine() -> str:
    """The machine a benchmark ran on: architecture, CPU model and its L3 cache,
    cores, Python.

    The CPU matters, not only its count: the scratch TensorFlow's CPU kernels
    allocate, and so the peaks measured and predicted, differ from one CPU to
    another and with oneDNN on or off (docs/how-it-works.md, "Another CPU,
    other peaks").
    """
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            size = f.read().strip()  # e.g. "32768K"
        model += f" (L3 {int(size.rstrip('K')) // 1024} MiB)"
    except (OSError, ValueError):
        pass
    return (f"{platform.machine()}, {model}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, TensorFlow CPU, oneDNN {onednn()}")


def onednn() -> str:
    """Whether TensorFlow runs oneDNN's CPU kernels in this process: on by
    default on CPUs with AVX512_VNNI, AVX512_BF16 or AMX, off elsewhere, and
    `TF_ENABLE_ONEDNN_OPTS` decides. Its convolutions allocate no scratch
    through TensorFlow's allocator; TensorFlow's own allocate up to the L3
    cache's size (docs/how-it-works.md, "Another CPU, other peaks")."""
    import importlib

    importlib.import_module("tfremat")  # before TensorFlow: it picks the CPU allocator
    from tensorflow.python.util import _pywrap_util_port  # no public API tells

    return "on" if _pywrap_util_port.IsMklEnabled() else "off"


def run_header(script: str, repeats: int, steps: int) -> dict[str, Any]:
    """The command, machine and settings a benchmark's results record."""
    return {
        "command": "python " + shlex.join(
            [f"benchmarks/{os.path.basename(script)}", *sys.argv[1:]]),
        "machine": machine(), "repeats": repeats, "steps": steps, "records": []}


def run_worker(script: str, name: str, repeats: int, steps: int,
               extra: list[str]) -> dict[str, Any]:
    """Runs `script --worker name` in a process of its own; its JSON record."""
    print(f"{name}:", flush=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        subprocess.run([sys.executable, script, "--worker", name, "--out", tmp.name,
                        "--repeats", str(repeats), "--steps", str(steps), *extra],
                       check=True)
        with open(tmp.name) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help="Comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--quick", action="store_true",
                        help=f"Only {', '.join(QUICK_PLANNERS)}; fewer steps; no timings.")
    parser.add_argument("--repeats", type=int, default=None,
                        help="Measured steps per peak (default 3, quick 1).")
    parser.add_argument("--steps", type=int, default=None,
                        help="Timed steps per model variant (default 5, quick 2).")
    parser.add_argument("--render", action="store_true",
                        help="Only rewrite planners.md and planners.png from planners.json.")
    parser.add_argument("--timings", action="store_true",
                        help="Only re-measure the planner timings into planners.json.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        peak_worker(args.peak, args.plan, args.repeats)
        return
    if args.render or args.timings:
        with open(os.path.join(RESULTS, "planners.json")) as f:
            data = json.load(f)
        if args.timings:
            data["timings"] = planner_timings()
            data["timings_command"] = "python benchmarks/planners.py --timings"
        print(write_results(data))
        return
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.steps = args.steps or (2 if args.quick else 5)
    planners = list(QUICK_PLANNERS if args.quick else PLANNERS)
    if args.worker:
        record = run_model(args.worker, planners, args.repeats, args.steps)
        with open(args.out, "w") as f:
            json.dump(record, f)
        return
    names = model_names(parser, args.models, MODELS)
    data = run_header(__file__, args.repeats, args.steps)
    data["timings"] = {}
    for name in names:
        data["records"].append(run_worker(__file__, name, args.repeats, args.steps,
                                          ["--quick"] if args.quick else []))
        write_results(data)  # partial results as models finish
    if not args.quick:
        data["timings"] = planner_timings()
    print(write_results(data))


def write_results(data: dict[str, Any]) -> str:
    """Writes planners.json, planners.md and planners.png; returns the markdown."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "planners.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    with open(os.path.join(RESULTS, "planners.md"), "w") as f:
        f.write(text)
    pareto_plot(data["records"], os.path.join(RESULTS, "planners.png"))
    return text


if __name__ == "__main__":
    main()
