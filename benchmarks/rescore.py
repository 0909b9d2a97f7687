"""The simulator scored against the peaks `planners.py` measured, without measuring again.

`planners.py` takes about an hour; a change to the simulator's memory model can be
scored in a few minutes against the peaks it recorded
(`benchmarks/results/planners.json`), as long as the plans are the ones it measured.
So, in two steps:

1. `--save DIR`, at the commit that measured them: extracts each model's graph and
   makes each measured row's plan again, as `planners.py` did, and saves graph and
   plans in DIR (a row whose plan predicts otherwise than recorded is reported:
   extraction is not bit-for-bit repeatable on every model). A row that
   `planners.py` measured as an earlier row's plan (its `runner`: `auto` choosing
   chen-recursive's segments, say) is scored with that row's plan, not with the
   plan its planner makes now, which may be another.
2. `--load DIR`, at any commit: simulates the saved plans with this checkout's
   simulator and prints, per model and over all rows, the error of the prediction
   against the measured peak (issue #12's measure: within 10% and 5%, the median
   and the worst).

A change to the extraction is scored the same way: `--save` again with it into
another directory, then `--load` the measured plans with `--graphs` that
directory (the plans name layer calls, which stay the same).

Usage:
    python benchmarks/rescore.py --save /tmp/plans [--models ResNet50,UNet]
    python benchmarks/rescore.py --load /tmp/plans [--rows] [--graphs /tmp/plans2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planners import MIB, MODELS, RESULTS, build_model, model_names, plan_at, \
    plan_at_minimum  # noqa: E402


def save(directory: str, names: list[str]) -> None:
    """Saves each model's graph and the plans of its measured rows."""
    from tfremat.core import BudgetError
    from tfremat.graph import extract

    with open(os.path.join(RESULTS, "planners.json")) as f:
        records = json.load(f)["records"]
    for record in records:
        if record["model"] not in names:
            continue
        model, batch = build_model(record["model"])
        graph = extract(model, batch_size=batch)
        here = os.path.join(directory, record["model"])
        os.makedirs(here, exist_ok=True)
        graph.to_json(os.path.join(here, "graph.json"))
        rows = []
        made: dict[str, str] = {}  # runner -> plan file
        for i, row in enumerate(record["rows"]):
            if "measured_mib" not in row:
                continue
            if row["runner"] in made:  # measured as another row's plan, the same segments
                rows.append({"plan": made[row["runner"]], "planner": row["planner"],
                             "budget": row["budget"], "measured_mib": row["measured_mib"]})
                continue
            try:
                plan = (plan_at_minimum(graph, row["planner"]) if row["budget"] == "min" else
                        plan_at(graph, row["planner"], round(record["sqrt_budget_mib"] * MIB)))
            except BudgetError as e:  # the graph extracted now predicts more than then
                print(f"{record['model']} {row['planner']} @ {row['budget']}: not saved, {e}",
                      flush=True)
                continue
            plan.to_json(os.path.join(here, f"plan{i}.json"))
            made[row["runner"]] = f"plan{i}.json"
            rows.append({"plan": f"plan{i}.json", "planner": row["planner"],
                         "budget": row["budget"], "measured_mib": row["measured_mib"]})
            if abs(plan.peak_bytes / MIB - row["predicted_mib"]) >= 0.05:
                print(f"{record['model']} {row['planner']} @ {row['budget']}: predicted "
                      f"{plan.peak_bytes / MIB:.1f} MiB now, {row['predicted_mib']:.1f} "
                      "when measured", flush=True)
        with open(os.path.join(here, "rows.json"), "w") as f:
            json.dump({"vanilla_measured_mib": record["vanilla"]["measured_mib"],
                       "rows": rows}, f)
        print(f"{record['model']}: {len(rows)} plans saved", flush=True)


def load(directory: str, show_rows: bool, graphs: str | None = None) -> list[float]:
    """Prints the prediction errors of the saved plans, simulated on the graphs
    saved with them or in `graphs`; returns them."""
    from tfremat.core import Plan, PlanGraph
    from tfremat.simulation import simulate

    errors: list[float] = []
    for name in sorted(os.listdir(directory)):
        here = os.path.join(directory, name)
        graph = PlanGraph.from_json(os.path.join(graphs or directory, name, "graph.json"))
        with open(os.path.join(here, "rows.json")) as f:
            saved = json.load(f)
        plain = simulate(graph).peak_bytes / MIB
        mine = []
        for row in saved["rows"]:
            plan = Plan.from_json(os.path.join(here, row["plan"]))
            predicted = simulate(graph, plan).peak_bytes / MIB
            mine.append(predicted / row["measured_mib"] - 1)
            if show_rows:
                print(f"  {row['planner']:30s} {row['budget']:4s} predicted {predicted:6.1f}"
                      f" measured {row['measured_mib']:6.1f} {mine[-1]:+.1%}")
        errors += mine
        print(f"{name}: plain predicted {plain:.1f} measured "
              f"{saved['vanilla_measured_mib']:.1f} MiB; plans: {summary(mine)}")
    print(f"all: {summary(errors)}")
    return errors


def summary(errors: list[float]) -> str:
    """Within 10% and 5%, median and worst of prediction errors."""
    size = [abs(e) for e in errors]
    within = {b: sum(s <= b for s in size) for b in (0.10, 0.05)}
    return (f"{len(size)} rows, {within[0.10]} within 10% ({within[0.10] / len(size):.1%}), "
            f"{within[0.05]} within 5% ({within[0.05] / len(size):.1%}), median "
            f"{statistics.median(size):.1%}, worst {max(errors, key=abs):+.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--save", metavar="DIR", help="Make and save the measured plans.")
    where.add_argument("--load", metavar="DIR", help="Score this simulator on saved plans.")
    parser.add_argument("--models", default=",".join(MODELS),
                        help="With --save: comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--rows", action="store_true", help="With --load: every row.")
    parser.add_argument("--graphs", metavar="DIR",
                        help="With --load: simulate on the graphs another --save put in DIR.")
    args = parser.parse_args()
    if args.save:
        save(args.save, model_names(parser, args.models, MODELS))
    else:
        load(args.load, args.rows, args.graphs)


if __name__ == "__main__":
    main()
