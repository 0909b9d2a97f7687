"""Checks that TensorFlow is installed and that Keras runs on it; names the
device whose memory tfremat budgets, says whether its allocator can be read,
how many operations TensorFlow's executor runs at once, whether XLA compiles
the step and what `tf.distribute` scope is open."""

from __future__ import annotations

import contextlib
import os

from tfremat.core import BackendError

_INSTALL_HINT = (
    "Install TensorFlow with one of: pip install 'tfremat[cpu]' (tensorflow-cpu), "
    "pip install 'tfremat[gpu]' (tensorflow[and-cuda]) or pip install 'tfremat[tf]'."
)


def require_tensorflow() -> None:
    """Raises `BackendError` unless TensorFlow imports and Keras uses it.

    Called by every part of tfremat that touches TensorFlow; the simulator and
    the planners run without it.
    """
    backend = os.environ.get("KERAS_BACKEND")
    if backend and backend != "tensorflow":
        raise BackendError(
            f"tfremat rewrites TensorFlow training steps, but KERAS_BACKEND={backend!r}. "
            "Set KERAS_BACKEND=tensorflow before importing Keras "
            "(or set \"backend\": \"tensorflow\" in ~/.keras/keras.json).")
    try:
        import tensorflow  # noqa: F401
    except ImportError as e:
        raise BackendError(f"tfremat needs TensorFlow, which is not importable ({e}). "
                           + _INSTALL_HINT) from e
    import keras

    if keras.backend.backend() != "tensorflow":
        raise BackendError(
            f"tfremat rewrites TensorFlow training steps, but Keras runs on the "
            f"{keras.backend.backend()!r} backend. Set KERAS_BACKEND=tensorflow before "
            "importing Keras (or set \"backend\": \"tensorflow\" in ~/.keras/keras.json).")


def device_name() -> str:
    """The device tfremat budgets: `"GPU:0"` when a GPU exists, else `"CPU:0"`."""
    require_tensorflow()
    import tensorflow as tf

    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


#: Why a device may keep no allocator statistics, and how to get them.
NO_STATS_HINT = (
    "On CPU, TensorFlow keeps them only with oneDNN on (its default on some Intel "
    "CPUs only) or with TensorFlow's BFC allocator: set TF_CPU_ALLOCATOR_USE_BFC=1 "
    "before TensorFlow runs its first operation (importing tfremat first does).")


def memory_stats_available(device: str) -> bool:
    """Whether TensorFlow keeps allocator statistics (`get_memory_info`) for `device`.

    GPUs always do. CPUs do with oneDNN on or `TF_CPU_ALLOCATOR_USE_BFC=1`
    (`NO_STATS_HINT`); without them nothing can be measured, only predicted.
    """
    require_tensorflow()
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info(device)
    except ValueError:
        return False
    return True


def device_allocator(device: str) -> str | None:
    """How `device`'s allocator counts the bytes of a request in its statistics
    (`tfremat.simulation.ALLOCATORS`).

    `"bfc"`: TensorFlow's BFC allocator, whose chunks may hold up to twice the
    request, taking regions from the system as it grows, each twice the last:
    a CPU's once `TF_CPU_ALLOCATOR_USE_BFC=1` (importing tfremat sets it; a CPU
    keeping statistics without it, through oneDNN's allocator, is taken to
    count alike, not measured), and a GPU's with memory growth on
    (`gpu_memory_grows`). `"bfc-one-region"`: the same allocator on a GPU
    without memory growth, TensorFlow's default, which takes one region of all
    the memory it may use at its first allocation. None: the request itself,
    as a GPU under `TF_GPU_ALLOCATOR=cuda_malloc_async` counts
    (`GpuCudaMallocAsyncAllocator` adds the bytes asked for), or a CPU keeping
    no statistics (`memory_stats_available`), where nothing is measured.

    Example:

    >>> device_allocator("CPU:0")
    'bfc'
    """
    if device.startswith("GPU"):
        if os.environ.get("TF_GPU_ALLOCATOR") == "cuda_malloc_async":
            return None
        return "bfc" if gpu_memory_grows() else "bfc-one-region"
    return "bfc" if memory_stats_available(device) else None


def gpu_memory_grows() -> bool:
    """Whether TensorFlow's GPU allocator takes memory as it needs it.

    `TF_FORCE_GPU_ALLOW_GROWTH` decides when it is `"true"` or `"false"` (as
    TensorFlow reads it); otherwise `tf.config.experimental.set_memory_growth`
    does (TensorFlow requires the same setting on every GPU). Off by default:
    the allocator then takes all the memory it may use at once.
    """
    forced = os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH")
    if forced in ("true", "false"):
        return forced == "true"
    require_tensorflow()
    import tensorflow as tf

    return any(tf.config.experimental.get_memory_growth(gpu)
               for gpu in tf.config.list_physical_devices("GPU"))


def xla_compiled(model: object) -> bool:
    """Whether Keras compiles `model`'s train step with XLA (`jit_compile`,
    which `compile` resolves to True or False; its "auto" is True with a GPU)."""
    return getattr(model, "jit_compile", False) is True


#: The attribute of a model whose train step, under `jit_compile=True`, is made
#: without XLA and traced within a context where parts of it compile with XLA
#: on their own: a function returning that context
#: (`tfremat.rewriter.train_units_compiled_under_xla` sets it).
TRACED_WITHIN = "_tfremat_traced_within"


def step_compilation(model: object) -> tuple[bool, contextlib.AbstractContextManager]:
    """How `model`'s train step compiles: whether XLA compiles it whole, and the
    context its step is traced in (see `TRACED_WITHIN`)."""
    traced_within = getattr(model, TRACED_WITHIN, None)
    if xla_compiled(model) and traced_within is not None:
        return False, traced_within()
    return xla_compiled(model), contextlib.nullcontext()


def kernels_at_once(device: str) -> int:
    """How many kernels TensorFlow runs at once on `device`: its executor's
    inter-op threads on a CPU (`inter_op_threads`), one on a GPU, whose
    kernels run one after the other on its compute stream."""
    return inter_op_threads() if device.startswith("CPU") else 1


def inter_op_threads() -> int:
    """How many inter-op threads TensorFlow's executor runs a step's ready
    operations on: the number set with
    `tf.config.threading.set_inter_op_parallelism_threads`, else the
    `TF_NUM_INTEROP_THREADS` environment variable, else (TensorFlow's default)
    the number of CPUs this process may run on.
    """
    require_tensorflow()
    import tensorflow as tf

    configured = tf.config.threading.get_inter_op_parallelism_threads()
    if configured > 0:
        return configured
    try:
        from_env = int(os.environ.get("TF_NUM_INTEROP_THREADS", "0"))
    except ValueError:
        from_env = 0
    if from_env > 0:
        return from_env
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def replicas_in_scope() -> int:
    """Replicas of the `tf.distribute` strategy whose scope is open (1 outside
    any scope, and inside one replica's function)."""
    require_tensorflow()
    import tensorflow as tf

    if not tf.distribute.in_cross_replica_context():
        return 1
    return tf.distribute.get_strategy().num_replicas_in_sync


def multi_worker() -> bool:
    """Whether the open `tf.distribute` scope spans several workers
    (`MultiWorkerMirroredStrategy` on more than one)."""
    require_tensorflow()
    import tensorflow as tf

    if not tf.distribute.in_cross_replica_context():
        return False
    strategy = tf.distribute.get_strategy()
    return strategy.num_replicas_in_sync != len(strategy.extended.worker_devices)
