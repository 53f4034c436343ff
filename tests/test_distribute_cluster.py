"""Multi-process strategies on loopback: MultiWorkerMirrored, ParameterServer, kill and resume.

Every process is started by the test (``tests/cluster.py``), bounded in time,
and killed on the way out. Results are compared with one device here.
"""

from __future__ import annotations

import json
import time

import keras
import numpy as np
import pytest

import per_example_grads as peg
from cluster import Cluster, free_ports, tf_config
from cluster_jobs import CLIP, load, loss_fn, net
from helpers import (
    assert_clipped_sums_close,
    assert_grads_close,
    assert_norms_close,
    reference_gradients,
    reference_norms,
)
from tolerances import ACCOUNTING_SAME_RTOL, EPS32, TRAJECTORY_LOSS_RTOL, clipped_sum_rtol, sgd_steps_atol

# Worker processes on loopback, each starting TensorFlow: seconds per test.
pytestmark = [pytest.mark.multi_process, pytest.mark.slow]

B, D, K, N = 16, 6, 3, 64
START_TIMEOUT = 240  # seconds per job, TensorFlow's start-up included, on a loaded 2-core machine


@pytest.fixture
def inputs(tmp_path):
    rng = np.random.RandomState(0)
    x = (3 * rng.randn(N, D)).astype("float32")
    y = (np.arange(N) % K).astype("int32")
    model = net(D, K)
    weights = model.get_weights()
    np.savez(tmp_path / "inputs.npz", x=x, y=y, n_weights=len(weights), **{f"w{i}": w for i, w in enumerate(weights)})
    return tmp_path, x, y, model


def _fit_one_device(model, x, y, epochs=3, **dp_args):
    dp = peg.keras.DPModel(model, **dp_args)
    dp.compile(optimizer=keras.optimizers.SGD(0.2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = dp.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    return dp, history


def test_multi_worker_mirrored_equals_one_device(inputs):
    out, x, y, model = inputs
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    with Cluster(out) as c:
        workers = [c.start(f"worker{i}", ["mwms", str(out)], tf_config(cluster, "worker", i)) for i in range(2)]
        for i, w in enumerate(workers):
            assert c.wait(w, START_TIMEOUT) == 0, c.log(f"worker{i}")
    results = [load(out / f"mwms-{i}.pkl") for i in range(2)]

    ref = reference_gradients(model, loss_fn, x[:B], y[:B])
    assert_grads_close(
        [np.concatenate([results[0]["per_example"][k], results[1]["per_example"][k]]) for k in range(4)], ref
    )
    factors = np.minimum(1, CLIP / reference_norms(ref))
    for r in results:  # all-reduced: every worker holds the global sums
        assert_clipped_sums_close(r["clipped"], ref, factors)
        assert_clipped_sums_close(r["accumulated"], ref, factors, divisor=B)
        assert_norms_close(r["norms"], ref)

    dp, history = _fit_one_device(
        model, x, y, l2_norm_clip=CLIP, noise_multiplier=0.0, num_examples=N, expected_batch_size=B
    )
    # 3 N / B SGD(0.2) steps of clipped means of B examples over B.
    steps, p, update_scale = 3 * N // B, sum(int(np.prod(w.shape)) for w in model.get_weights()), B * CLIP / B
    for r in results:
        assert int(r["dp_steps"]) == int(dp.dp_steps.numpy()) == steps
        for got, want in zip(r["fitted"], model.get_weights()):
            atol = sgd_steps_atol(
                steps, 0.2, clipped_sum_rtol(p, B), update_scale, np.abs(want) + steps * 0.2 * update_scale
            )
            np.testing.assert_allclose(got, want, rtol=0, atol=float(np.max(atol)))
        np.testing.assert_allclose(r["loss"], history.history["loss"], rtol=TRAJECTORY_LOSS_RTOL)


def test_parameter_server_applies_worker_gradients_and_counts_steps(inputs):
    out, x, y, model = inputs
    ports = free_ports(4)
    cluster = {
        "chief": [f"localhost:{ports[0]}"],
        "worker": [f"localhost:{ports[1]}", f"localhost:{ports[2]}"],
        "ps": [f"localhost:{ports[3]}"],
    }
    with Cluster(out) as c:
        for kind, i in (("ps", 0), ("worker", 0), ("worker", 1)):
            c.start(f"{kind}{i}", ["server"], tf_config(cluster, kind, i))
        chief = c.start("chief", ["ps_chief", str(out)], tf_config(cluster, "chief", 0))
        assert c.wait(chief, START_TIMEOUT) == 0, c.log("chief")
    r = load(out / "ps_chief.pkl")
    assert all("/job:ps" in d for d in r["devices"]), r["devices"]  # the variables and the counter live on the PS
    # The first step, alone, equals one device's step: a worker's private gradient without noise (the clipped
    # sum over B), times 0.2, applied on the PS; and the step's rounding relative to the weights (EPS32 |w|).
    ref = reference_gradients(model, loss_fn, x[:B], y[:B])
    before = model.get_weights()
    moved = [w - a for w, a in zip(before, r["after_one"])]
    assert_clipped_sums_close(
        moved,
        ref,
        0.2 * np.minimum(1, CLIP / reference_norms(ref)),
        divisor=B,
        extra_atol=[EPS32 * np.abs(w) for w in before],
    )
    # The noised steps moved the weights and kept them finite.
    assert all(np.isfinite(w).all() for w in r["final"])
    assert not np.allclose(r["final"][0], r["after_one"][0])
    # Every scheduled step was applied and counted once; the accountant saw them all.
    assert int(r["applied"]) == int(r["accountant_steps"]) == int(r["scheduled"]) == 12
    # Keras's optimizer.iterations is a read-then-write on the PS: concurrent
    # workers can lose increments (11 of 12 seen here), so it may only under-count.
    assert int(r["iterations"]) <= 12


def test_killed_dp_run_resumes_and_reports_the_uninterrupted_epsilon(inputs):
    out, x, y, model = inputs
    with Cluster(out) as c:
        first = c.start("first", ["dp_fit", str(out), "--slow"])
        deadline = time.monotonic() + START_TIMEOUT
        steps = 0
        while steps < 10:  # past the epoch-2 backup (8 steps), inside epoch 3
            assert first.poll() is None, c.log("first")
            assert time.monotonic() < deadline, "the first run made no progress"
            time.sleep(0.1)
            try:
                steps = json.loads((out / "progress.json").read_text())["dp_steps"]
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        c.kill(first)  # SIGKILL mid-epoch: nothing is flushed
        assert not (out / "dp_fit.pkl").exists()
        second = c.start("second", ["dp_fit", str(out)])
        assert c.wait(second, START_TIMEOUT) == 0, c.log("second")
    r = load(out / "dp_fit.pkl")
    assert int(r["resumed_from"]) in (8, 12)  # restored from the last epoch backup, not from zero
    uninterrupted, _ = _fit_one_device(
        net(D, K), x, y, epochs=6, l2_norm_clip=CLIP, noise_multiplier=1.1, num_examples=N, expected_batch_size=B
    )
    assert int(r["dp_steps"]) == int(uninterrupted.dp_steps.numpy()) == 24  # six epochs of four steps
    assert float(r["epsilon"]) == pytest.approx(uninterrupted.epsilon(1e-5), rel=ACCOUNTING_SAME_RTOL)
