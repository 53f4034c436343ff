"""Process set-up and fixtures only; the shared helpers are in ``tests/helpers.py``."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two logical CPU devices for the MirroredStrategy tests (tests/test_distribute_mirrored.py).
# Must happen before TensorFlow initializes its devices; every other test runs on /cpu:0.
# If it cannot (something initialized TensorFlow first), those tests skip locally and fail in CI.
try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # devices already initialized by whoever imported TensorFlow first
    pass


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
