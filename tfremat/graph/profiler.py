"""TensorFlow's profiler, run quietly, and the events it recorded.

`profiled` runs a profiler session and reads what it recorded (an XSpace
protobuf) when it ends; `events` lists the recorded events with their stats by
name: the allocators' `MemoryAllocation` and `MemoryDeallocation` events (their
`addr`, `requested_bytes`, `allocation_bytes`, `bytes_allocated`,
`allocator_name`, `tf_op`, ...), ops, and `tf.profiler.experimental.Trace`
windows with their keyword arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import tensorflow as tf


@dataclasses.dataclass
class Session:
    """What a profiler session recorded (`space`, an XSpace), once stopped;
    None when it could not be read."""

    space: Any = None


@dataclasses.dataclass(frozen=True)
class Event:
    """One recorded event: its name, start and duration (picoseconds, on one
    clock for the whole session) and stats by name (numbers, or strings where
    a stat names a string or refers to another stat's name)."""

    name: str
    start_ps: int
    duration_ps: int
    stats: dict[str, Any]

    @property
    def end_ps(self) -> int:
        return self.start_ps + self.duration_ps


@contextlib.contextmanager
def profiled(host_tracer_level: int = 2) -> Iterator[Session | None]:
    """A profiler session of host events (the allocators' are host events; no
    device tracer, so no CUPTI), read when it ends; None when one cannot start
    (another is running, or TensorFlow's profiler protobufs are missing).
    TensorFlow logs the session's start and stop to stderr at INFO level: they
    are kept out of the user's terminal.

    Args:
        host_tracer_level: 2 records the allocators' events with their op;
            3 also their shapes and region types.
    """
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:
        yield None
        return
    directory = tempfile.mkdtemp(prefix="tfremat-profile-")
    try:
        with quiet_stderr():
            tf.profiler.experimental.start(directory, options=tf.profiler.experimental.
                                           ProfilerOptions(host_tracer_level=host_tracer_level,
                                                           python_tracer_level=0,
                                                           device_tracer_level=0))
    except (tf.errors.OpError, RuntimeError):
        shutil.rmtree(directory, ignore_errors=True)
        yield None
        return
    session = Session()
    try:
        yield session
    finally:
        try:
            with quiet_stderr():
                tf.profiler.experimental.stop()
            paths = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
            if paths:
                space = xplane_pb2.XSpace()
                with open(paths[0], "rb") as f:
                    space.ParseFromString(f.read())
                session.space = space
        except (tf.errors.OpError, OSError, ValueError):
            session.space = None
        finally:
            shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Sends what is written to the process's stderr (TensorFlow's C++ log
    lines) to nowhere, and back on exit."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a notebook's stream: C++ logs go elsewhere
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def events(space: Any, names: tuple[str, ...] | None = None) -> Iterator[Event]:
    """The events of an XSpace (`Session.space`), plane by plane and line by
    line (not in time order); only those named in `names` when given."""
    for plane in space.planes:
        event_names = {k: m.name for k, m in plane.event_metadata.items()}
        stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                name = event_names.get(event.metadata_id, "")
                if names is not None and name not in names:
                    continue
                stats = {stat_names.get(s.metadata_id, ""): _value(s, stat_names)
                         for s in event.stats}
                yield Event(name, base + event.offset_ps, event.duration_ps, stats)


def _value(stat: Any, stat_names: dict[int, str]) -> Any:
    """A stat's value; for a reference, the name it refers to."""
    kind = stat.WhichOneof("value")
    if kind is None:
        return None
    if kind == "ref_value":
        return stat_names.get(stat.ref_value, "")
    return getattr(stat, kind)
