"""DP-SGD: private_gradients, noise, DPModel, the validator, adaptive clipping."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_clipped_sums_close, assert_close, assert_norms_close, reference_gradients, reference_norms, sparse_ce
from tolerances import (
    ACCOUNTING_COMPOSED_RTOL,
    ACCOUNTING_SAME_RTOL,
    ELEMENTWISE_RTOL,
    EPS32,
    EPS64,
    Z,
    clipped_sum_rtol,
    norm_rtol,
    rounding_rtol,
)
from per_example_grads.dp import adaptive, noise, validation
from per_example_grads.dp.private import private_gradients

rng = np.random.default_rng(11)


def _mlp(d_in=6, hidden=8, n_classes=3):
    return keras.Sequential([keras.Input((d_in,)), keras.layers.Dense(hidden, activation="tanh"), keras.layers.Dense(n_classes)])


def _hand_dp_step(model, x, y, clip, sample_weight=None):
    """The reference per-example gradients, and each example's clip factor."""
    ref = reference_gradients(model, sparse_ce, x, y, sample_weight=sample_weight)
    return ref, np.minimum(1.0, clip / reference_norms(ref))


@pytest.mark.parametrize("method", ["layerwise", "vectorized"])
def test_noiseless_step_equals_hand_computation(method):
    model = _mlp()
    x, y = rng.normal(size=(6, 6)).astype("float32") * 5, rng.integers(0, 3, 6)
    ref, factors = _hand_dp_step(model, x, y, clip=0.3)
    got = private_gradients(model, sparse_ce, x, y, l2_norm_clip=0.3, noise_multiplier=0.0, expected_batch_size=10.0, method=method)
    assert_clipped_sums_close(got, ref, factors, divisor=10.0)
    # numpy's n * min(1, C / n): two float64 roundings.
    assert np.all(reference_norms(ref) * factors <= 0.3 * (1 + rounding_rtol(2, EPS64)))


def test_huge_gradients_are_clipped_to_c():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    x, y = rng.normal(size=(5, 6)).astype("float32") * 1e6, rng.integers(0, 3, 5)
    grads = peg.per_example_gradients(model, sparse_ce, x, y)
    clipped, norms = peg.clip_by_global_norm(grads, 0.5)
    assert norms.numpy().max() > 1e3
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # Entries scaled by a factor (a few roundings), then their norm taken again in float32.
    assert np.all(peg.global_norms(clipped).numpy() <= 0.5 * (1 + norm_rtol(p, ELEMENTWISE_RTOL)))
    sums, norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.5, return_norms=True)
    # Five contributions of norm C up to their factors' error (the library's own norms), summed in float32.
    assert np.sqrt(sum(np.sum(np.square(s)) for s in sums)) <= 5 * 0.5 * (1 + clipped_sum_rtol(p, 5))


def test_noise_statistics_and_seeding():
    """Noise alone: zero data contribution (sample weights 0), sigma * C = 3."""
    model = keras.Sequential([keras.Input((200,)), keras.layers.Dense(100)])
    x, y = rng.normal(size=(4, 200)).astype("float32"), rng.integers(0, 100, 4)
    kwargs = dict(l2_norm_clip=2.0, noise_multiplier=1.5, expected_batch_size=1.0, sample_weight=np.zeros(4, "float32"))
    grads = private_gradients(model, sparse_ce, x, y, seed=(7, 3), **kwargs)
    sample = np.concatenate([np.ravel(g) for g in grads])
    n, sd = sample.size, 3.0
    assert n == 200 * 100 + 100
    # Mean within Z standard errors; the sample std's std is sd / sqrt(2n).
    assert abs(sample.mean()) < Z * sd / np.sqrt(n)
    assert abs(sample.std() - sd) < Z * sd / np.sqrt(2 * n)
    again = private_gradients(model, sparse_ce, x, y, seed=(7, 3), **kwargs)
    other = private_gradients(model, sparse_ce, x, y, seed=(7, 4), **kwargs)
    np.testing.assert_array_equal(again[0], grads[0])
    assert not np.allclose(other[0], grads[0])
    gen_a, gen_b = tf.random.Generator.from_seed(5), tf.random.Generator.from_seed(5)
    a = private_gradients(model, sparse_ce, x, y, seed=gen_a, **kwargs)
    b = private_gradients(model, sparse_ce, x, y, seed=gen_b, **kwargs)
    np.testing.assert_array_equal(a[0], b[0])
    # OS entropy: two draws differ.
    c = private_gradients(model, sparse_ce, x, y, seed=None, **kwargs)
    d = private_gradients(model, sparse_ce, x, y, seed=None, **kwargs)
    assert not np.allclose(c[0], d[0])


def test_noised_average_noises_every_embedding_row_at_the_divided_scale():
    """An IndexedSlices sum (a row repeated) gets the noise of its dense form; every row is noised with std sigma C / D.

    (test_noise_statistics_and_seeding divides by 1: it cannot see the noise left undivided.)
    """
    from per_example_grads.dp.aggregator import noised_average

    rows = tf.constant([[1.0, -2.0], [3.0, 4.0], [5.0, 6.0]])
    sliced = tf.IndexedSlices(rows, tf.constant([7, 2, 7], tf.int64), tf.constant([6000, 2], tf.int64))
    dense = tf.convert_to_tensor(sliced)
    got = noised_average([sliced], 3.0, 4.0, seed=(1, 2), step=0)[0].numpy()
    want = noised_average([dense], 3.0, 4.0, seed=(1, 2), step=0)[0].numpy()
    # Each side: a few roundings (the two repeated rows' sum, the division, the addition), relative to the terms.
    np.testing.assert_allclose(got, want, rtol=0, atol=rounding_rtol(4) * (np.abs(want).max() + 12 / 4))
    sample, sd = np.ravel(got - dense.numpy() / 4), 3.0 / 4
    assert abs(sample.mean()) < Z * sd / np.sqrt(sample.size)
    assert abs(sample.std() - sd) < Z * sd / np.sqrt(2 * sample.size)


def test_private_gradients_in_tf_function_apply():
    model = _mlp()
    opt = keras.optimizers.SGD(0.1)
    gen = tf.random.Generator.from_seed(1)

    @tf.function(input_signature=[tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32)])
    def step(x, y):
        grads = private_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, noise_multiplier=1.0, seed=gen, expected_batch_size=8.0)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    before = [v.numpy().copy() for v in model.trainable_variables]
    for n in (8, 5, 0):  # an empty batch still steps (noise only)
        step(rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32"))
    assert step.experimental_get_tracing_count() == 1
    assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


def test_padded_rows_contribute_nothing():
    model = _mlp()
    x, y = rng.normal(size=(4, 6)).astype("float32"), rng.integers(0, 3, 4)
    padded_x = np.concatenate([x, np.zeros((3, 6), "float32")])
    padded_y = np.concatenate([y, np.zeros(3, int)])
    mask = np.array([1, 1, 1, 1, 0, 0, 0], "float32")
    a = private_gradients(model, sparse_ce, x, y, l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=4.0)
    b = private_gradients(model, sparse_ce, padded_x, padded_y, sample_weight=mask, l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=4.0)
    # The same four examples in a batch of 4 and of 7: per-example gradients from other kernels, clipped and summed.
    ref, factors = _hand_dp_step(model, x, y, clip=0.5)
    assert_clipped_sums_close(a, ref, factors, divisor=4.0)
    assert_clipped_sums_close(b, ref, factors, divisor=4.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
        (dict(l2_norm_clip=-1.0, noise_multiplier=1.0), "l2_norm_clip"),
        (dict(l2_norm_clip=1.0, noise_multiplier=-0.5), "noise_multiplier"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=0), "expected_batch_size"),
    ],
)
def test_bad_dp_arguments(kwargs, match):
    model = _mlp()
    with pytest.raises(ValueError, match=match):
        private_gradients(model, sparse_ce, np.ones((2, 6), "float32"), np.zeros(2, int), **kwargs)
    if "expected_batch_size" not in kwargs:
        with pytest.raises(ValueError, match=match):
            peg.keras.DPModel(model, **kwargs)


def test_scalar_loss_is_rejected():
    model = _mlp()
    with pytest.raises(peg.InvalidLossError):
        private_gradients(model, lambda y, p: tf.reduce_mean(sparse_ce(y, p)), np.ones((2, 6), "float32"), np.zeros(2, int), l2_norm_clip=1.0, noise_multiplier=1.0)


def test_validator_names_offending_and_slow_layers():
    model = keras.Sequential([
        keras.Input((5, 4)), keras.layers.LSTM(3, return_sequences=True, name="rnn"),
        keras.layers.BatchNormalization(name="bn1"), keras.layers.Flatten(),
        keras.layers.BatchNormalization(name="bn2"), keras.layers.Dense(2),
    ])
    report = validation.validate(model)
    assert len(report.errors) == 2 and "'bn1'" in report.errors[0] and "'bn2'" in report.errors[1]
    assert "GroupNormalization" in str(report) and "peg.dp.fix_model(model)" in str(report)
    assert any("'rnn'" in s for s in report.slow)
    with pytest.raises(ValueError, match="(?s)bn1.*bn2"):
        peg.keras.DPModel(model, l2_norm_clip=1.0, noise_multiplier=1.0)
    assert validation.validate(model, training=False).errors == []


def _digits(n_train=600, seed=0):
    from per_example_grads.data import load_digits

    x, y = load_digits()
    idx = np.random.default_rng(seed).permutation(len(x))
    return x[idx[:n_train]], y[idx[:n_train]], x[idx[-300:]], y[idx[-300:]]


@pytest.mark.slow
def test_dp_model_learns_and_saves(tmp_path):
    x, y, xt, yt = _digits()
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=0.5, expected_batch_size=50, num_examples=len(x), seed=0)
    dp.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
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
    np.testing.assert_allclose(loaded.predict(xt, verbose=0), want, rtol=forward_rtol, atol=forward_rtol * np.abs(want).max())
    # DPModel weights (including the privacy step counter) round-trip.
    dp.save_weights(tmp_path / "dp.weights.h5")
    fresh = peg.keras.DPModel(keras.models.clone_model(net), l2_norm_clip=1.0, noise_multiplier=0.5, seed=1)
    fresh(xt[:1])  # build before loading
    fresh.load_weights(tmp_path / "dp.weights.h5")
    assert int(fresh.dp_steps.numpy()) == 48
    want = dp.predict(xt, verbose=0)
    np.testing.assert_allclose(fresh.predict(xt, verbose=0), want, rtol=forward_rtol, atol=forward_rtol * np.abs(want).max())


@pytest.mark.slow
def test_dp_model_ledger_survives_a_restart_with_other_settings(tmp_path):
    """The saved ledger keeps the worst sigma and q seen, so epsilon can only over-report."""
    x, y, _, _ = _digits(n_train=200)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def run(sigma, batch, weights=None):
        net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=sigma, expected_batch_size=batch, num_examples=200, seed=0)
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


def test_adaptive_clipping_tracks_the_quantile():
    norms = tf.constant(np.linspace(0.1, 2.0, 20), tf.float32)  # median about 1.05
    settings = adaptive.AdaptiveClipping(target_quantile=0.5, learning_rate=0.2, clipped_count_stddev=1e-3, initial_l2_norm_clip=5.0)
    clip = tf.constant(5.0)
    gen = tf.random.Generator.from_seed(0)
    for _ in range(200):
        clip = adaptive.updated_clip(settings, clip, norms, tf.ones([20]), 20.0, gen)
    assert 0.9 < float(clip) < 1.2
    # Padding rows (norm 0) are not counted as unclipped.
    padded = tf.concat([norms, tf.zeros([20])], 0)
    clip2 = tf.constant(5.0)
    for _ in range(200):
        clip2 = adaptive.updated_clip(settings, clip2, padded, tf.concat([tf.ones([20]), tf.zeros([20])], 0), 20.0, gen)
    assert 0.9 < float(clip2) < 1.2
    with pytest.raises(ValueError, match="target_quantile"):
        adaptive.AdaptiveClipping(target_quantile=1.5)


def test_dp_model_with_adaptive_clipping_moves_the_clip():
    x, y, _, _ = _digits(200)
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    settings = adaptive.AdaptiveClipping(initial_l2_norm_clip=100.0, clipped_count_stddev=2.0)
    dp = peg.keras.DPModel(net, noise_multiplier=1.0, expected_batch_size=50, adaptive_clipping=settings, seed=0)
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.fit(x, y, batch_size=50, epochs=2, verbose=0)
    assert float(dp.l2_norm_clip.numpy()) < 100.0


@pytest.mark.slow
def test_dp_model_physical_chunks_equal_one_big_batch():
    """A logical batch of 24 in chunks of 5 gives the same noiseless step as one pass."""
    x, y, _, _ = _digits(24)
    steps = []
    for physical in (None, 5):
        keras.utils.set_random_seed(3)
        net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(10)])
        dp = peg.keras.DPModel(net, l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=24.0, physical_batch_size=physical)
        dp.compile(optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = [v.numpy().copy() for v in net.trainable_variables]
        ref, factors = _hand_dp_step(net, x, y, clip=0.5)
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
        peg.keras.DPModel(_mlp(), l2_norm_clip=1.0, noise_multiplier=1.0, physical_batch_size=0)


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
    clipped = lambda x, y, w: (lambda c: (c.sums, c.norms))(aggregator.clipped_sum(net, sparse_ce, x, y, sample_weight=w))  # noqa: E731
    sums, norms = (tf.function(clipped) if graph else clipped)(x, y, weights)
    expected = reference_gradients(net, sparse_ce, x[:real], y[:real]) if real else [np.zeros((0, *v.shape)) for v in net.trainable_variables]
    want_norms = reference_norms(expected) if real else np.zeros(0)
    np.testing.assert_array_equal(norms.numpy()[real:], 0.0)
    if real:
        assert_clipped_sums_close(sums, expected, 0.3 / np.maximum(want_norms, 0.3))
        assert_norms_close(norms.numpy()[:real], expected)
    else:
        for s in sums:
            np.testing.assert_array_equal(tf.convert_to_tensor(s).numpy(), 0.0)


@pytest.mark.slow
def test_epsilon_callback_follows_dp_model_steps():
    x, y, _, _ = _digits(100)
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.2, expected_batch_size=25, num_examples=100, seed=0)
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
    net = keras.Sequential([keras.Input((20,), dtype="int32"), keras.layers.Embedding(12, 4),
                            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    x, y = rng.integers(0, 12, (8, 20)).astype("int32"), rng.integers(0, 3, 8).astype("int32")
    expected = reference_gradients(net, sparse_ce, x, y)
    factors = 0.1 / np.maximum(reference_norms(expected), 0.1)
    dp = peg.keras.DPModel(net, l2_norm_clip=0.1, noise_multiplier=0.0, expected_batch_size=8.0,
                           physical_batch_size=physical, method="layerwise")
    dp.compile(optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy().copy() for v in net.trainable_variables]
    dp.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    # The step b - lr g rounds relative to the weights, not to g, and numpy's b - v once more: EPS32 |b|.
    moved = [b - v.numpy() for b, v in zip(before, net.trainable_variables)]
    assert_clipped_sums_close(moved, expected, factors, divisor=8, extra_atol=[EPS32 * np.abs(b) for b in before])


def test_validator_names_a_layer_called_twice_once():
    scale = keras.layers.PReLU(name="shared_prelu")  # layer-local fallback
    inp = keras.Input((4,))
    out = keras.layers.Dense(2)(scale(keras.layers.Dense(4)(scale(inp))))
    slow = validation.validate(keras.Model(inp, out)).slow
    assert sum("'shared_prelu'" in s for s in slow) == 1
