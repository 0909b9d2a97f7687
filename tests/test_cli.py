"""The `tfremat` command."""

import re
import warnings

import keras
import pytest

import tfremat
from tfremat import cli
from tfremat.planners import PLANNERS


def tiny_model_file(tmp_path, *, compiled: bool = True) -> str:
    """A small CNN named "tiny" saved as `.keras`, compiled or not."""
    inp = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, keras.layers.Dense(10, activation="softmax")(x), name="tiny")
    if compiled:
        model.compile(optimizer="sgd", loss="categorical_crossentropy")
    path = str(tmp_path / "tiny.keras")
    model.save(path)
    return path


def test_estimate_on_a_saved_model(tmp_path, capsys):
    path = tiny_model_file(tmp_path)
    assert cli.main(["estimate", path, "--batch-size", "4", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "tiny: one training step, batch 4" in out and "measured on CPU:0" in out
    for sharing in ("none", "inplace", "sharing"):
        assert sharing in out
    assert "measured (MiB)" in out


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["estimate", "no-such-net"]) == 2
    assert "Unknown model 'no-such-net'" in capsys.readouterr().err


def test_plan_writes_the_memory_timeline(tmp_path, capsys):
    path = tiny_model_file(tmp_path, compiled=False)
    plot = tmp_path / "memory.png"
    assert cli.main(["plan", path, "--budget-mb", "1000", "--batch-size", "4",
                     "--plot", str(plot)]) == 0
    assert f"Memory timeline written to {plot}" in capsys.readouterr().out.replace("\n", "")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_graphviz_the_picture_warning_is_its_message_alone(tmp_path, monkeypatch,
                                                                    capsys):
    """A warning is attributed to the user's line; run from the console script,
    that line was `sys.exit(main())`, printed under the message."""
    path = tiny_model_file(tmp_path, compiled=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot`
    assert cli.main(["plan", path, "--budget-mb", "1000", "--batch-size", "4",
                     "--export", str(tmp_path / "plan.png")]) == 0
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if line.startswith("tfremat: wrote ")]
    assert said and "needs Graphviz's `dot` program" in said[0], err
    assert not any("Warning" in line or "main(" in line for line in err), err
    assert (tmp_path / "plan.dot").exists()


def test_plan_measure_measures_the_plans_it_chooses_from(tmp_path, capsys):
    path = tiny_model_file(tmp_path)
    assert cli.main(["plan", path, "--budget-mb", "1000", "--batch-size", "4",
                     "--measure"]) == 0
    out = capsys.readouterr().out
    measured = next(line for line in out.splitlines() if line.startswith("Measured peak:"))
    # The tiny step can measure under 1 MiB, which the summary gives in KiB.
    assert re.fullmatch(r"Measured peak:\s+[\d.]+ [KM]iB on the device.*", measured), measured
    assert "not measured" not in out


def test_version_is_printed(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tfremat {tfremat.__version__}"


@pytest.mark.parametrize("shape", ["64x64", "96,96,3,1", "a,b,c", "0,96,3"])
def test_an_input_shape_that_is_not_three_numbers_is_a_usage_error(shape, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["estimate", "resnet50", "--input-shape", shape])
    assert exit_info.value.code == 2
    assert f"--input-shape wants three numbers like 96,96,3, got {shape!r}" in \
        capsys.readouterr().err


def test_a_budget_too_small_is_an_error_naming_the_batch_size(tmp_path, capsys):
    path = tiny_model_file(tmp_path)
    assert cli.main(["plan", path, "--budget-mb", "0.01", "--batch-size", "4"]) == 2
    err = capsys.readouterr().err
    # The batch size is said with the figure, before any list that follows it.
    assert re.search(r"smallest feasible budget is [\d.]+ MiB \(\d+ bytes\) at batch size 4 "
                     r"\(--batch-size\),", err), err
    # The command's own option, not the Python API's.
    assert "not measured: --measure measures plans on the device" in err
    assert "tfremat.plan(" not in err


def test_help_gives_the_default_batch_size(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: 16)" in shown
    for name in PLANNERS:  # argparse may wrap a name at its hyphen
        assert name in shown.replace("- ", "-")


def test_an_unknown_planner_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "resnet50", "--budget-mb", "100", "--planner", "chen"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'chen'" in err and "chen-sqrt" in err


def test_classes_reach_the_keras_applications_model(monkeypatch, tmp_path, capsys):
    built = {}
    real = cli.load_model

    def spy(name, **kwargs):
        built.update(kwargs)
        return real(tiny_model_file(tmp_path), **kwargs)

    monkeypatch.setattr(cli, "load_model", spy)
    assert cli.main(["estimate", "mobilenetv2", "--batch-size", "2", "--classes", "1000"]) == 0
    assert built["classes"] == 1000
    assert cli.main(["estimate", "mobilenetv2", "--batch-size", "2"]) == 0
    assert built["classes"] == 10  # the default, said in --help
    assert real("mobilenetv2", input_shape=(32, 32, 3), classes=3).output.shape == (None, 3)


@pytest.mark.parametrize("value", ["0", "-3", "ten"])
def test_classes_must_be_a_positive_number(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "resnet50", "--budget-mb", "100", "--classes", value])
    assert exit_info.value.code == 2
    assert f"wants a positive whole number, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("flags, pin_order", [([], "auto"), (["--pin-order"], True),
                                              (["--no-pin-order"], False)])
def test_the_order_flags_reach_the_plan(flags, pin_order):
    args = cli.build_parser().parse_args(["plan", "resnet50", "--budget-mb", "100", *flags])
    assert args.pin_order == pin_order


@pytest.mark.parametrize("flag, value", [
    ("--steps", "0"), ("--epochs", "0"), ("--batch-size", "x"), ("--steps", "-1"),
    ("--budget-fraction", "-1"), ("--budget-fraction", "nan")])
def test_demo_refuses_a_bad_number_naming_its_flag_before_any_work(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: wants a positive" in capsys.readouterr().err


@pytest.mark.parametrize("name, value, error", [
    ("steps", 0, ValueError), ("epochs", 1.5, TypeError), ("batch_size", -2, ValueError),
    ("budget_fraction", 0.0, ValueError), ("budget_fraction", "0.5", TypeError)])
def test_run_demo_refuses_a_bad_number_naming_its_argument(name, value, error):
    from tfremat.demo import run_demo

    with pytest.raises(error, match=f"{name} must be"):
        run_demo(**{name: value}, export=None, plot=None, verbose=0)


def test_a_rewritten_model_file_is_estimated_and_planned_as_its_original(tmp_path, capsys):
    inp = keras.Input((16, 16, 3))
    x = inp
    for _ in range(4):
        x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, keras.layers.Dense(10, activation="softmax")(x), name="deep")
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    calls = len(tfremat.extract(model, batch_size=4))
    convs = [layer.name for layer in model.layers if "conv" in layer.name]
    plan = tfremat.Plan.from_segments(tfremat.extract(model, batch_size=4),
                                      [tfremat.Segment(convs[1:3])])
    path = str(tmp_path / "deep_rewritten.keras")
    tfremat.rewrite(model, plan).save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["estimate", path, "--batch-size", "4"]) == 0
        assert cli.main(["plan", path, "--budget-mb", "1000", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert f"deep: one training step, batch 4, {calls} layer calls" in out
    assert 'Plan for "deep"' in out
    assert not [w for w in caught if "units" in str(w.message)]
