"""Scoped silencing of known, harmless log messages that the library's own calls provoke.

Nothing here changes a logger's level or the process's settings for good: each
helper drops only the messages it names, only while its ``with`` block runs,
and puts everything back afterwards.

* ``quiet_vectorization()``, around the library's ``tf.vectorized_map`` and
  pfor-``jacobian`` calls: TensorFlow's pfor converter logs
  "Conv2DBackpropFilter uses a while_loop. Fix that!" (a note to its own
  developers) whenever it vectorizes a convolution's weight gradient.
* ``quiet_accounting()``, around the privacy accountant's calls:
  ``dp_accounting``'s RDP accountant logs "_compute_log_a_frac failed to
  converge ... Excluding this order" for fractional orders near 1 at some
  (q, sigma). Excluding an order can only make the reported epsilon larger
  (epsilon is a minimum over the orders), so the bound stays valid.
* ``import_tensorflow_filtered()``, for the ``pegrad`` command only: imports
  TensorFlow with file descriptor 2 captured, and passes on everything its C++
  start-up printed except the notices listed in ``STARTUP_NOTICES``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Iterator

PFOR_NOTES = ("Conv2DBackpropFilter uses a while_loop. Fix that!",)
ACCOUNTING_NOTES = ("_compute_log_a_frac failed to converge",)

# Printed by TensorFlow's C++ start-up on every import (absl prints them before
# TensorFlow reads TF_CPP_MIN_LOG_LEVEL, so that setting cannot hide them), and
# the cuInit failure of a CUDA-enabled build on a machine without a usable GPU.
STARTUP_NOTICES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine, GPU will not be used",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions:",
    "failed call to cuInit",
)


class _DropMessages(logging.Filter):
    """Drops the records whose formatted message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge
            return True
        return not message.startswith(self.prefixes)


@contextlib.contextmanager
def dropped_messages(logger_name: str, prefixes: tuple[str, ...]) -> Iterator[None]:
    """Drops the named logger's records that start with ``prefixes``, inside the block only.

    A filter on the logger itself (not a level change), so every other message
    of that logger, and every other logger, is untouched; records that child
    loggers propagate to it are untouched too.
    """
    logger = logging.getLogger(logger_name)
    drop = _DropMessages(prefixes)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def quiet_vectorization() -> contextlib.AbstractContextManager:
    """Around the library's ``tf.vectorized_map`` (and pfor) calls: see the module docstring."""
    return dropped_messages("tensorflow", PFOR_NOTES)


def quiet_accounting() -> contextlib.AbstractContextManager:
    """Around ``dp_accounting`` calls: see the module docstring."""
    return dropped_messages("absl", ACCOUNTING_NOTES)


def import_tensorflow_filtered(notices: tuple[str, ...] = STARTUP_NOTICES):
    """``import tensorflow`` and look for GPUs, without TensorFlow's start-up notices.

    For the ``pegrad`` command, which owns its process's stderr: file
    descriptor 2 is redirected to a temporary file while TensorFlow loads and
    initializes CUDA; then it is restored and every captured line that does
    not contain one of ``notices`` is written back to stderr, so an unexpected
    message still shows. If the import fails, everything captured is passed on.

    Returns:
      ``(tensorflow module, list of physical GPU devices)``.
    """
    if "tensorflow" in sys.modules:  # loaded already: nothing more will be printed
        tf = sys.modules["tensorflow"]
        return tf, tf.config.list_physical_devices("GPU")
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no usable descriptor 2: import as usual
        import tensorflow as tf

        return tf, tf.config.list_physical_devices("GPU")
    failed = True
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            gpus = tf.config.list_physical_devices("GPU")
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", "replace")
            kept = text if failed else without_notices(text, notices)
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
    return tf, gpus


def without_notices(text: str, notices: tuple[str, ...] = STARTUP_NOTICES) -> str:
    """``text`` without the lines that contain one of ``notices``."""
    return "".join(line for line in text.splitlines(keepends=True) if not any(n in line for n in notices))
