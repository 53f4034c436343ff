"""The library's scoped silencing of TensorFlow's and dp_accounting's known notes."""

from __future__ import annotations

import contextlib
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dp_accounting  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import per_example_grads as peg  # noqa: E402
from per_example_grads._core import quiet as _quiet  # noqa: E402

PFOR_NOTE = "Conv2DBackpropFilter uses a while_loop"
ACCOUNTING_NOTE = "_compute_log_a_frac failed to converge"
# A run of the private demo (pegrad demo --dp --fast) where the RDP accountant
# fails to converge for orders 1.1 to 1.5.
Q, SIGMA, STEPS = 128 / 1438, 0.782552, 56
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


@pytest.fixture
def logger_state():
    """Sets both loggers to WARNING for the test and checks their state is untouched after."""
    loggers = [logging.getLogger(name) for name in ("tensorflow", "absl")]
    saved = [(lg.level, list(lg.filters)) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    yield loggers
    after = [(lg.level, list(lg.filters)) for lg in loggers]
    assert after == [(logging.WARNING, f) for _, f in saved]
    for lg, (level, _) in zip(loggers, saved):
        lg.setLevel(level)


def messages(caplog, logger_name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger_name]


def conv_model(groups: int = 1) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, groups=groups),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )


def conv_batch():
    rng = np.random.default_rng(0)
    return rng.random((4, 6, 6, 2), dtype=np.float32), np.array([0, 1, 0, 1])


def test_without_the_filter_the_vectorized_engine_logs_the_note(caplog, logger_state, monkeypatch):
    """The control: the same call with the filter switched off logs the note (else the tests below prove nothing)."""
    from per_example_grads.engines import vectorized

    monkeypatch.setattr(vectorized, "quiet_vectorization", contextlib.nullcontext)
    x, y = conv_batch()
    with caplog.at_level(logging.WARNING):
        peg.per_example_gradients(conv_model(), LOSS, x, y, method="vectorized")
    if not any(PFOR_NOTE in m for m in messages(caplog, "tensorflow")):
        pytest.skip("this TensorFlow no longer logs the Conv2DBackpropFilter note")


@pytest.mark.parametrize(
    "method, groups",
    [("vectorized", 1), ("jacobian", 1), ("layerwise", 2)],
    ids=["vectorized", "jacobian", "layerwise-grouped-conv"],
)
def test_per_example_gradients_of_a_conv_do_not_log_the_pfor_note(caplog, logger_state, method, groups):
    x, y = conv_batch()
    with caplog.at_level(logging.WARNING):
        grads = peg.per_example_gradients(conv_model(groups), LOSS, x, y, method=method)
    assert grads[0].shape[0] == 4
    assert not [m for m in messages(caplog, "tensorflow") if PFOR_NOTE in m]


def test_raw_rdp_accountant_logs_the_note_the_library_drops(caplog, logger_state):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), STEPS
    )
    with caplog.at_level(logging.WARNING):
        dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    if not any(ACCOUNTING_NOTE in m for m in messages(caplog, "absl")):
        pytest.skip("this dp_accounting no longer logs the convergence note here")


def test_accounting_does_not_log_the_convergence_note(caplog, logger_state):
    with caplog.at_level(logging.WARNING):
        eps = peg.dp.compute_epsilon(1438, 128, None, SIGMA, 1e-5, steps=STEPS, accountant="rdp")
        sigma = peg.dp.noise_multiplier_for_epsilon(eps, 1e-5, 1438, 128, None, steps=STEPS, accountant="rdp")
    assert 0 < eps < 20 and sigma > 0
    assert not [m for m in messages(caplog, "absl") if ACCOUNTING_NOTE in m]


def test_only_the_named_notes_are_dropped_and_only_inside_the_block(caplog, logger_state):
    tf_logger, absl_logger = logger_state
    with caplog.at_level(logging.WARNING):
        with _quiet.quiet_vectorization(), _quiet.quiet_accounting():
            tf_logger.warning("Conv2DBackpropFilter uses a while_loop. Fix that!")
            tf_logger.warning("something else from TensorFlow")
            absl_logger.warning("_compute_log_a_frac failed to converge after %d iterations", 1000)
            absl_logger.warning("Negative Renyi divergence of %s", -1.0)
            logging.getLogger("tensorflow.child").warning("Conv2DBackpropFilter uses a while_loop. Fix that!")
        tf_logger.warning("Conv2DBackpropFilter uses a while_loop. Fix that!")
        absl_logger.warning("_compute_log_a_frac failed to converge after %d iterations", 1000)
    assert messages(caplog, "tensorflow") == [
        "something else from TensorFlow",
        "Conv2DBackpropFilter uses a while_loop. Fix that!",  # after the block
    ]
    assert messages(caplog, "tensorflow.child") == ["Conv2DBackpropFilter uses a while_loop. Fix that!"]
    assert messages(caplog, "absl") == [
        "Negative Renyi divergence of -1.0",
        "_compute_log_a_frac failed to converge after 1000 iterations",
    ]


def test_the_filter_is_removed_when_the_block_raises(logger_state):
    tf_logger, _ = logger_state
    before = list(tf_logger.filters)
    with pytest.raises(RuntimeError):
        with _quiet.quiet_vectorization():
            assert len(tf_logger.filters) == len(before) + 1
            raise RuntimeError("boom")
    assert tf_logger.filters == before
    assert tf_logger.level == logging.WARNING


def test_user_level_is_kept(logger_state):
    """The helpers never touch levels: a user's DEBUG or ERROR setting stays as it is."""
    tf_logger, absl_logger = logger_state
    for level in (logging.DEBUG, logging.ERROR):
        tf_logger.setLevel(level)
        absl_logger.setLevel(level)
        x, y = conv_batch()
        peg.per_example_gradients(conv_model(), LOSS, x, y, method="vectorized")
        peg.dp.compute_epsilon(1438, 128, None, SIGMA, 1e-5, steps=STEPS, accountant="rdp")
        assert tf_logger.level == absl_logger.level == level
    tf_logger.setLevel(logging.WARNING)
    absl_logger.setLevel(logging.WARNING)


def test_startup_filter_keeps_unknown_lines():
    text = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1 2 port.cc:153] oneDNN custom operations are on. You may see ...\n"
        "I0000 00:00:1 2 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n"
        "E0000 00:00:1 2 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error\n"
        "E0000 00:00:1 2 some_other.cc:1] a real problem\n"
    )
    assert _quiet.without_notices(text) == "E0000 00:00:1 2 some_other.cc:1] a real problem\n"
    assert _quiet.without_notices(text, ()) == text
    # TensorFlow is loaded already here: nothing to capture, the devices come back.
    tf_module, gpus = _quiet.import_tensorflow_filtered()
    assert tf_module is tf and isinstance(gpus, list)
