"""The `tfremat` command."""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from importlib import metadata
from typing import Any, Callable, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_DEFAULT_SHAPES = {"inceptionv3": (139, 139, 3)}


def load_model(name: str, *, input_shape: tuple[int, ...] | None = None,
               classes: int = 10) -> Any:
    """A model from a `.keras` file or a `keras.applications` name (weights=None,
    `classes` outputs: 10 unless given, not Keras's 1000).

    Raises:
        ValueError: the name is neither a file nor a known application.
    """
    import keras

    if name.endswith((".keras", ".h5")) or os.path.exists(name):
        if not os.path.exists(name):
            raise ValueError(f"No model file {name!r}.")
        return keras.models.load_model(name, compile=True)
    apps = {n.lower(): n for n in dir(keras.applications) if n[0].isupper()}
    key = name.lower()
    if key not in apps:
        known = ", ".join(sorted(apps.values())[:12])
        raise ValueError(f"Unknown model {name!r}: give a .keras file or a "
                         f"keras.applications name ({known}, ...).")
    shape = input_shape or _DEFAULT_SHAPES.get(key, (96, 96, 3))
    return getattr(keras.applications, apps[key])(
        weights=None, input_shape=shape, classes=classes)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.replace("x", ",").split(",") if d)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:  # height, width, channels
        raise argparse.ArgumentTypeError(
            f"--input-shape wants three numbers like 96,96,3, got {text!r}")
    return shape


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"wants a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"wants a positive whole number, got {text!r}")
    return value


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """The options that build the model (`_prepare`), for `estimate` and `plan`."""
    parser.add_argument("--input-shape", default=None, type=_parse_shape,
                        help="of a keras.applications model, e.g. 128,128,3 (default: "
                             "96,96,3; 139,139,3 for inceptionv3)")
    parser.add_argument("--classes", type=_positive_int, default=10,
                        help="outputs of a keras.applications model (default: 10, where "
                             "Keras's own default is 1000)")
    parser.add_argument("--optimizer", default="sgd", help="when the model is not compiled")


def _console() -> Any:
    """A rich console at least 100 columns wide, so tables keep their headers
    on one line when output goes to a file or a narrow terminal."""
    from rich.console import Console

    return Console(width=max(Console().width, 100))


def _prepare(args: argparse.Namespace) -> Any:
    model = load_model(args.model, input_shape=args.input_shape, classes=args.classes)
    if not model.compiled:
        model.compile(optimizer=args.optimizer, loss="categorical_crossentropy")
    return model


def cmd_estimate(args: argparse.Namespace) -> int:
    """The MXNet note's memory cost estimation: predicted peak per strategy."""
    from rich.table import Table

    import tfremat
    from tfremat.planners import PLANNERS
    from tfremat.rewriter import unwrapped
    from tfremat.simulation import SHARING_MODES

    console = _console()
    with console.status(f"Tracing a training step of {args.model} ..."):
        # A model tfremat rewrote is estimated as the model it was rewritten from.
        model = unwrapped(_prepare(args), compiled=True)
        graph = tfremat.extract(model, batch_size=args.batch_size)
    rows = [(s, tfremat.simulate(graph, sharing=s)) for s in SHARING_MODES]
    # Chen et al.'s "drop bn-relu" and "sublinear plan" rows: sharing plus a plan.
    for label, name in (("drop-cheap-ops", "chen-drop-cheap"), ("sublinear (sqrt n)", "chen-sqrt")):
        rows.append((label, tfremat.simulate(graph, PLANNERS[name](graph))))
    measured = None
    if args.measure:
        with console.status("Measuring a real training step ..."):
            measured = tfremat.measure_peak(model, batch_size=args.batch_size,
                                            return_details=True)
    title = f"{model.name}: one training step, batch {args.batch_size}, {len(graph)} layer calls"
    if measured is not None:
        title += f", measured on {measured.device}"
    table = Table(title=title)
    table.add_column("memory sharing / plan")
    table.add_column("predicted peak (MiB)", justify="right")
    table.add_column("activations (MiB)", justify="right")
    table.add_column("extra compute", justify="right")
    if measured is not None:
        table.add_column("measured (MiB)", justify="right")
    for label, est in rows:
        cells = [label, f"{est.peak_mb:,.1f}", f"{est.activation_peak_bytes / 2**20:,.1f}",
                 f"+{est.overhead:.0%}" if est.overhead else ""]
        if measured is not None:
            cells.append(f"{measured.peak_mb:,.1f}" if label == "sharing" else "")
        table.add_row(*cells)
    console.print(table)
    console.print(f"Persistent: {graph.total_persistent_bytes / 2**20:,.1f} MiB "
                  "(weights, optimizer slots, batch). 'sharing' is what TensorFlow does.")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Plans a model under a budget: summary, optional picture, JSON and measurement."""
    import tfremat
    from tfremat.export import summary, write_picture
    from tfremat.rewriter import unwrapped

    console = _console()
    with console.status(f"Tracing a training step of {args.model} ..."):
        model = _prepare(args)
        # A model tfremat rewrote is planned as the model it was rewritten from.
        graph = tfremat.extract(unwrapped(model, compiled=True), batch_size=args.batch_size)
    plan = tfremat.plan(model, args.budget_mb, graph=graph, planner=args.planner,
                        objective=args.objective, verbose=1, measure=args.measure,
                        batch_size=args.batch_size,
                        update_in_backward=args.update_in_backward,
                        pin_order=args.pin_order)
    console.print(summary(graph, plan), highlight=False)
    if args.export:
        written = write_picture(plan, args.export, graph=graph)
        console.print(f"Plan picture written to {written}")
    if args.plot:
        tfremat.plot_memory(plan, args.plot, graph=graph)
        console.print(f"Memory timeline written to {args.plot}")
    if args.json:
        plan.to_json(args.json)
        console.print(f"Plan written to {args.json}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Trains a ResNet-style model under a budget its plain step exceeds."""
    from tfremat.demo import run_demo

    result = run_demo(batch_size=args.batch_size, steps=args.steps, epochs=args.epochs,
                      budget_fraction=args.budget_fraction, export=args.export or None,
                      plot=args.plot or None)
    # An epoch may run a plan that measured over the budget before the Planner
    # re-planned; the final plan's measured peak shows where training settled.
    settled = result["plan_peak_mb"]
    return 1 if settled is None or settled > result["budget_mb"] else 0


def build_parser() -> argparse.ArgumentParser:
    from tfremat.planners import PLANNERS  # no TensorFlow: --help stays quick

    parser = argparse.ArgumentParser(
        prog="tfremat",
        description="Plan recomputation and offload so Keras training fits a memory budget.")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {metadata.version('tfremat')}")
    sub = parser.add_subparsers(dest="command", required=True)

    est = sub.add_parser("estimate", help="predicted peak memory per strategy")
    est.add_argument("model", help="keras.applications name (e.g. resnet50) or .keras file")
    est.add_argument("--batch-size", type=int, default=16,
                     help="batch size of the step (default: 16)")
    _add_model_options(est)
    est.add_argument("--measure", action="store_true",
                     help="also run real steps and report the measured peak")
    est.set_defaults(func=cmd_estimate)

    pl = sub.add_parser("plan", help="plan recomputation under a memory budget")
    pl.add_argument("model", help="keras.applications name or .keras file")
    pl.add_argument("--budget-mb", type=float, required=True,
                    help="device budget for a whole step, MiB, weights included")
    pl.add_argument("--batch-size", type=int, default=16,
                    help="batch size of the step planned (default: 16)")
    _add_model_options(pl)
    pl.add_argument("--planner", default="auto", choices=("auto", *PLANNERS),
                    metavar="PLANNER",
                    help="auto (the default: the cheapest plan that fits among several "
                         "planners, docs/choosing-a-planner.md) or one of: "
                         + ", ".join(PLANNERS))
    pl.add_argument("--objective", default="time", choices=("time", "memory"),
                    help="for the DP planners: least extra compute, or least memory")
    pl.add_argument("--strategy", dest="objective", choices=("time", "memory"),
                    help=argparse.SUPPRESS)  # the old name of --objective
    pl.add_argument("--export", default=None, help="plan picture: .png, .svg, .pdf or .dot")
    pl.add_argument("--plot", default=None,
                    help="memory timeline image (.png, .svg, .pdf): predicted memory over "
                         "one step, without and with the plan; needs no Graphviz")
    pl.add_argument("--json", default=None, help="write the plan as JSON")
    pl.add_argument("--no-update-in-backward", dest="update_in_backward",
                    action="store_const", const=False, default="auto",
                    help="keep optimizer updates after the backward pass (by default they "
                         "run inside it when the budget binds)")
    pl.add_argument("--update-in-backward", dest="update_in_backward",
                    action="store_const", const="auto",
                    help=argparse.SUPPRESS)  # now the default; kept for old scripts
    pl.add_argument("--pin-order", dest="pin_order", action="store_const", const=True,
                    default="auto",
                    help="run the backward pass in the planned order (steadier peaks; the "
                         "default on a CPU and in a multi-worker scope, not on a GPU)")
    pl.add_argument("--no-pin-order", dest="pin_order", action="store_const", const=False,
                    help="leave the backward pass's order to TensorFlow's executor")
    pl.add_argument("--measure", action="store_true",
                    help="measure candidate plans on the device and keep the fastest "
                         "that fits (tfremat.plan(..., measure=True))")
    pl.set_defaults(func=cmd_plan)

    demo = sub.add_parser("demo", help="train a ResNet-style model under a budget")
    demo.add_argument("--batch-size", type=_positive_int, default=32, help="(default: 32)")
    demo.add_argument("--steps", type=_positive_int, default=8,
                      help="steps per epoch (default: 8)")
    demo.add_argument("--epochs", type=_positive_int, default=2, help="(default: 2)")
    demo.add_argument("--budget-fraction", type=_positive_float, default=0.75,
                      help="budget as a fraction of the measured plain peak (default: 0.75)")
    demo.add_argument("--export", default="tfremat_plan.png",
                      help="plan picture (default: tfremat_plan.png; .dot without "
                           "Graphviz); '' for none")
    demo.add_argument("--plot", default="tfremat_memory.png",
                      help="memory timeline image (default: tfremat_memory.png); '' for none")
    demo.set_defaults(func=cmd_demo)
    return parser


def _plainly(show: Callable[..., None]) -> Callable[..., None]:
    """`warnings.showwarning` printing tfremat's warnings as the messages they
    are (attributed to the user's line, they would name this console script's
    `sys.exit(main())`), and others with `show`."""

    def shown(message: Warning | str, category: type[Warning], filename: str,
              lineno: int, file: Any = None, line: str | None = None) -> None:
        if str(message).startswith("tfremat:"):
            print(message, file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)

    return shown


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tfremat` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from tfremat.core import BudgetError, TfrematError

    try:
        with warnings.catch_warnings():
            warnings.showwarning = _plainly(warnings.showwarning)
            return args.func(args)
    except (TfrematError, ValueError) as e:
        text = str(e)
        if isinstance(e, BudgetError) and args.command != "demo":
            # Said with the figure, not after the list of measurements below it.
            stated = f"({e.min_budget_bytes} bytes)"
            text = text.replace(stated, f"{stated} at batch size {args.batch_size} "
                                        "(--batch-size)", 1)
        if hasattr(args, "measure"):  # the API's way to measure is this command's option
            text = text.replace(BudgetError.MEASURE_HINT, "--measure measures plans on the device")
        print(f"tfremat: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
