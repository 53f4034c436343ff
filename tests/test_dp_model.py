"""DPModel: it learns and saves, keeps its ledger over restarts, chunks physical batches, and takes sparse clipped sums."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_close,
    assert_norms_close,
    digits_split,
    hand_dp_step,
    mlp,
    reference_gradients,
    reference_norms,
    sparse_ce,
)
from tolerances import (
    ACCOUNTING_COMPOSED_RTOL,
    ACCOUNTING_SAME_RTOL,
    EPS32,
    clipped_sum_rtol,
    rounding_rtol,
)

rng = np.random.default_rng(11)


@pytest.mark.slow
def test_dp_model_learns_and_saves(tmp_path):
    x, y, xt, yt = digits_split()
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    dp = peg.keras.DPModel(
        net, l2_norm_clip=1.0, noise_multiplier=0.5, expected_batch_size=50, num_examples=len(x), seed=0
    )
    dp.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = dp.fit(x, y, batch_size=50, epochs=4, verbose=0)
    assert int(dp.dp_steps.numpy()) == 4 * 12
    assert {"loss", "accuracy", "clipped_fraction"} <= set(history.history)
    acc = dp.evaluate(xt, yt, verbose=0, return_dict=True)["accuracy"]
    assert acc > 0.5, acc  # chance is 0.1
    assert 0 < dp.epsilon(1e-5) < float("inf")
    # The wrapped network saves and loads as a plain Keras model.
    net.save(tmp_path / "net.keras")
    loaded = keras.models.load_model(tmp_path / "net.keras")
    # Same weights; the two graphs may still fuse ops differently: the forward path (a 64-term and a 32-term
    # sum, two bias additions), relative to the logits' magnitude.
    forward_rtol = rounding_rtol(64 + 32 + 2)
    want = net.predict(xt, verbose=0)
    np.testing.assert_allclose(
        loaded.predict(xt, verbose=0), want, rtol=forward_rtol, atol=forward_rtol * np.abs(want).max()
    )
    # DPModel weights (including the privacy step counter) round-trip.
    dp.save_weights(tmp_path / "dp.weights.h5")
    fresh = peg.keras.DPModel(keras.models.clone_model(net), l2_norm_clip=1.0, noise_multiplier=0.5, seed=1)
    fresh(xt[:1])  # build before loading
    fresh.load_weights(tmp_path / "dp.weights.h5")
    assert int(fresh.dp_steps.numpy()) == 48
    want = dp.predict(xt, verbose=0)
    np.testing.assert_allclose(
        fresh.predict(xt, verbose=0), want, rtol=forward_rtol, atol=forward_rtol * np.abs(want).max()
    )


@pytest.mark.slow
def test_dp_model_ledger_survives_a_restart_with_other_settings(tmp_path):
    """The saved ledger keeps the worst sigma and q seen, so epsilon can only over-report."""
    x, y, _, _ = digits_split(n_train=200)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def run(sigma, batch, weights=None):
        net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        dp = peg.keras.DPModel(
            net, l2_norm_clip=1.0, noise_multiplier=sigma, expected_batch_size=batch, num_examples=200, seed=0
        )
        dp.compile(optimizer="sgd", loss=loss)
        dp(x[:1])
        if weights:
            dp.load_weights(weights)
        dp.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        return dp

    first = run(1.1, 50)  # 4 steps at q = 0.25
    first.save_weights(tmp_path / "a.weights.h5")
    assert first.epsilon(1e-5) == pytest.approx(
        peg.dp.compute_epsilon(200, 50, None, 1.1, 1e-5, steps=4), rel=ACCOUNTING_SAME_RTOL
    )
    second = run(2.0, 40, tmp_path / "a.weights.h5")  # 5 more steps at q = 0.2, larger sigma
    assert int(second.dp_steps.numpy()) == 9
    ledger = second.accountant()
    assert (ledger.noise_multiplier, ledger.sampling_probability, ledger.steps) == (1.1, 0.25, 9)
    exact = peg.dp.PrivacyAccountant(1.1, 0.25)
    exact.step(4)
    exact.step(5, noise_multiplier=2.0, sampling_probability=0.2)
    assert second.epsilon(1e-5) >= exact.epsilon(1e-5)


@pytest.mark.slow
def test_dp_model_physical_chunks_equal_one_big_batch():
    """A logical batch of 24 in chunks of 5 gives the same noiseless step as one pass."""
    x, y, _, _ = digits_split(24)
    steps = []
    for physical in (None, 5):
        keras.utils.set_random_seed(3)
        net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(10)])
        dp = peg.keras.DPModel(
            net, l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=24.0, physical_batch_size=physical
        )
        dp.compile(
            optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        before = [v.numpy().copy() for v in net.trainable_variables]
        ref, factors = hand_dp_step(net, x, y, clip=0.5)
        dp.fit(x, y, batch_size=24, epochs=1, verbose=0, shuffle=False)
        steps.append([b - v.numpy() for b, v in zip(before, net.trainable_variables)])
    # Two float32 computations of the clipped mean (one pass, or chunks of 5): clipped_sum_rtol and the division;
    # plus each step's rounding relative to the weights (EPS32 |w| on each side).
    p = sum(int(np.prod(v.shape)) for v in net.trainable_variables)
    rtol = clipped_sum_rtol(p, len(x)) + EPS32
    scale = max(float(np.max(np.tensordot(factors, np.abs(r), axes=1))) for r in ref) / 24.0
    for a, b, w in zip(*steps, before):
        assert_close(a, b, rtol=rtol, atol=rtol * scale + 2 * EPS32 * np.abs(w))
    with pytest.raises(ValueError, match="physical_batch_size"):
        peg.keras.DPModel(mlp(), l2_norm_clip=1.0, noise_multiplier=1.0, physical_batch_size=0)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("real", [0, 5, 8])
def test_physical_chunks_of_a_padded_batch_equal_the_loop(real, graph):
    """Chunks of 3 over a Poisson-style batch (``real`` rows of 10 weigh 1, the rest 0: none, a short last chunk,
    whole chunks) give the loop's clipped sum and norms; padding rows get norm 0, eagerly and in a graph."""
    from per_example_grads.dp.aggregator import DPAggregator

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    x = np.random.default_rng(1).normal(size=(10, 4)).astype("float32")
    y = np.random.default_rng(2).integers(0, 3, 10).astype("int32")
    weights = (np.arange(10) < real).astype("float32")
    aggregator = DPAggregator(l2_norm_clip=0.3, noise_multiplier=0.0, physical_batch_size=3)
    losses = lambda rows, predictions: sparse_ce(rows["y"], predictions)  # noqa: E731
    clipped = lambda x, y, w: (lambda c: (c.sums, c.norms, c.predictions, c.rows))(
        aggregator.clipped_sum(net, sparse_ce, x, y, sample_weight=w, outputs=losses)
    )  # noqa: E731
    sums, norms, kept, rows = (tf.function(clipped) if graph else clipped)(x, y, weights)
    # ``outputs`` is kept per computed row (the real ones, then padding up to a bucket), in the rows' order
    logits = net(tf.gather(x, rows)).numpy()
    assert_close(
        kept.numpy(),
        sparse_ce(tf.gather(y, rows), logits).numpy(),
        atol=rounding_rtol(4 + 1 + 1 + 5 + 1 + 3) * (1 + np.abs(logits).max()),
    )
    expected = (
        reference_gradients(net, sparse_ce, x[:real], y[:real])
        if real
        else [np.zeros((0, *v.shape)) for v in net.trainable_variables]
    )
    want_norms = reference_norms(expected) if real else np.zeros(0)
    np.testing.assert_array_equal(norms.numpy()[real:], 0.0)
    if real:
        assert_clipped_sums_close(sums, expected, 0.3 / np.maximum(want_norms, 0.3))
        assert_norms_close(norms.numpy()[:real], expected)
    else:
        for s in sums:
            np.testing.assert_array_equal(tf.convert_to_tensor(s).numpy(), 0.0)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("physical", [None, 3, 5])
def test_the_step_logs_the_loss_and_metrics_of_its_clipped_pass(physical, jit):
    """The logged loss and metrics are the clipped pass's (the weights before the update, its real rows), in one
    pass or chunk by chunk: the chunks keep a loss per row and update the metrics, not the logical batch's
    predictions (#53). Under XLA chunks of 5 do the same; chunks of 3 pad the last one, so there the loss and
    metrics are taken once after the loop, on the 10 rows."""
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    x = np.random.default_rng(1).normal(size=(10, 4)).astype("float32")
    y = np.random.default_rng(2).integers(0, 3, 10)
    weights = (np.arange(10) < 7).astype("float32")  # 7 real rows, 3 of padding
    dp = peg.keras.DPModel(
        net, l2_norm_clip=0.3, noise_multiplier=0.0, expected_batch_size=10, physical_batch_size=physical
    )
    dp.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
        metrics=[keras.metrics.SparseCategoricalCrossentropy("unweighted_ce", from_logits=True)],
        jit_compile=jit,
    )
    logits = net(x).numpy()  # the weights the step clips with
    losses = sparse_ce(y, logits).numpy()
    # two float32 forward passes (4 + 1 and 5 + 1 terms, a tanh) and log-sum-exp of 3, relative to the logits;
    # then a mean of at most 10
    tol = rounding_rtol(4 + 1 + 1 + 5 + 1 + 3 + 10) * (1 + float(np.abs(logits).max()))
    logs = dp.train_on_batch(x, y, sample_weight=weights, return_dict=True)
    assert logs["loss"] == pytest.approx(np.sum(losses * weights) / 7, abs=tol)
    assert logs["accuracy"] == pytest.approx(np.mean(logits[:7].argmax(1) == y[:7]), abs=1e-6)
    assert not np.allclose(net(x).numpy(), logits)  # the step did update the weights
    dp.reset_metrics()
    logits = net(x).numpy()
    logs = dp.train_on_batch(x, y, return_dict=True)  # every row real: the unweighted metric sees all 10
    assert logs["unweighted_ce"] == pytest.approx(np.mean(sparse_ce(y, logits).numpy()), abs=tol)
    assert logs["loss"] == pytest.approx(logs["unweighted_ce"], abs=2 * tol)


@pytest.mark.slow
def test_epsilon_callback_follows_dp_model_steps():
    x, y, _, _ = digits_split(100)
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    dp = peg.keras.DPModel(
        net, l2_norm_clip=1.0, noise_multiplier=1.2, expected_batch_size=25, num_examples=100, seed=0
    )
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accountant = peg.dp.PrivacyAccountant(1.2, 0.25)
    callback = peg.keras.EpsilonCallback(accountant, delta=1e-3, count_steps=False)
    history = dp.fit(x, y, batch_size=25, epochs=2, verbose=0, callbacks=[callback])
    assert accountant.steps == int(dp.dp_steps.numpy()) == 8
    assert history.history["epsilon"][-1] == pytest.approx(dp.epsilon(1e-3), rel=ACCOUNTING_COMPOSED_RTOL)


@pytest.mark.parametrize("physical", [None, 3])
def test_dp_model_with_embedding_takes_sparse_clipped_sums_in_and_out_of_chunks(physical):
    """Noiseless DPModel step on an embedding model, whole batch or in chunks: SGD(1) moves by the clipped mean."""
    keras.utils.set_random_seed(5)
    net = keras.Sequential(
        [
            keras.Input((20,), dtype="int32"),
            keras.layers.Embedding(12, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    x, y = rng.integers(0, 12, (8, 20)).astype("int32"), rng.integers(0, 3, 8).astype("int32")
    expected = reference_gradients(net, sparse_ce, x, y)
    factors = 0.1 / np.maximum(reference_norms(expected), 0.1)
    dp = peg.keras.DPModel(
        net,
        l2_norm_clip=0.1,
        noise_multiplier=0.0,
        expected_batch_size=8.0,
        physical_batch_size=physical,
        method="layerwise",
    )
    dp.compile(optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy().copy() for v in net.trainable_variables]
    dp.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    # The step b - lr g rounds relative to the weights, not to g, and numpy's b - v once more: EPS32 |b|.
    moved = [b - v.numpy() for b, v in zip(before, net.trainable_variables)]
    assert_clipped_sums_close(moved, expected, factors, divisor=8, extra_atol=[EPS32 * np.abs(b) for b in before])
