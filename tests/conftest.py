"""Test setup shared by all tests.

Two logical CPU devices are configured before TensorFlow starts, so that
`tf.distribute.MirroredStrategy` and host-offload tests have a second device.
They share one allocator (docs/how-it-works.md, "What was measured and what was
only reasoned"), so memory measurements are unaffected.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# As importing tfremat does (TensorFlow starts below, before tfremat is imported):
# allocator statistics on CPUs where oneDNN is off.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")

import pytest  # noqa: E402


def _configure_logical_cpus() -> None:
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:  # TensorFlow already initialised its devices
        pass


_configure_logical_cpus()


@pytest.fixture(autouse=True)
def _clear_keras_session():
    import keras

    keras.backend.clear_session()
    yield
