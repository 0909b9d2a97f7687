"""Test setup shared by all tests.

Two logical CPU devices are configured before TensorFlow starts, so that
`tf.distribute.MirroredStrategy` and host-offload tests have a second device.
They share one allocator (docs/how-it-works.md, "What was measured and what was
only reasoned"), so memory measurements are unaffected.
"""

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# As importing tfremat does (TensorFlow starts below, before tfremat is imported):
# allocator statistics on CPUs where oneDNN is off.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")

import pytest  # noqa: E402

try:
    import fcntl
except ImportError:  # Windows: tests marked `alone` run beside others there
    fcntl = None


def _configure_logical_cpus() -> None:
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:  # TensorFlow already initialised its devices
        pass


_configure_logical_cpus()


def _slow_node_ids() -> set[str]:
    """The node ids listed in tests/slow.txt (comments and blank lines left out)."""
    text = (pathlib.Path(__file__).parent / "slow.txt").read_text()
    return {line.strip() for line in text.splitlines()
            if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the tests of tests/slow.txt `slow` (before `-m` selects), and fails
    the collection when that list names a test of a collected module that no
    longer exists, so a renamed test does not fall back into the fast selection
    silently."""
    slow = _slow_node_ids()
    collected = {item.nodeid for item in items}
    # Modules are collected whole unless the command line names tests in them.
    modules = set() if any("::" in arg for arg in config.args) else {
        item.nodeid.split("::")[0] for item in items}
    stale = sorted(n for n in slow if n.split("::")[0] in modules and n not in collected)
    if stale:
        raise pytest.UsageError("tests/slow.txt names tests that do not exist: "
                                + ", ".join(stale))
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _clear_keras_session():
    import keras

    keras.backend.clear_session()
    yield


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C (SIGINT) raises KeyboardInterrupt, as in a user's Python: a
    pytest-xdist worker ignores it (its controller handles Ctrl-C)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _locked(root: pathlib.Path, alone: bool) -> Iterator[None]:
    """Holds the suite's readers-writer lock: shared for a test that may run
    beside others, exclusive for one that must run alone. Every test passes a
    turnstile first, so a waiting `alone` test stops new tests from starting."""
    with open(root / "alone.turnstile", "a") as turnstile, \
            open(root / "alone.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests marked `alone` compare memory peaks, which a test running beside
    them on the other xdist worker moves (the executor's order follows thread
    timing even on one inter-op thread: docs/how-it-works.md): each runs, its
    fixtures' setup and teardown included, with nothing of another worker
    beside it; the rest share. No lock in one process or without `fcntl`."""
    root = _lock_directory()
    if fcntl is None or root is None:
        return (yield)
    root.mkdir(exist_ok=True)
    with _locked(root, alone=item.get_closest_marker("alone") is not None):
        return (yield)


def pytest_sessionfinish(session, exitstatus):
    """Each worker removes the lock's directory when it is done: a worker still
    running makes it again for its next test, with no other worker left to
    wait for."""
    root = _lock_directory()
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def _lock_directory() -> pathlib.Path | None:
    """Where this xdist run keeps the lock's files; None outside xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return None if run is None else pathlib.Path(tempfile.gettempdir()) / f"tfremat-tests-{run}"
