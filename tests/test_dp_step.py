"""The DP step in every path: fresh noise whatever the seed, data-independent divisors,
sampling bound to accounting, mixed precision, saving, loss shapes, non-finite
examples, argument checks, regularization (issue: "One DP step, correct in every path")."""

import dataclasses
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_close, gradient_scale, reference_gradients
from per_example_grads.dp.aggregator import ClippedSum, DPAggregator
from tolerances import ELEMENTWISE_RTOL, EPS32, clipped_sum_rtol, sgd_steps_atol

sparse_ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _net(seed=0, **dense_kwargs):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3, **dense_kwargs)]
    )


def _data(n=24, seed=0):
    rng = np.random.RandomState(seed)
    return rng.normal(size=(n, 6)).astype("float32"), (np.arange(n) % 3).astype("int32")


def _assert_sums_close(got, want, n, scale):
    """Two evaluations of a sum of ``n`` clipped examples whose entries are at most ``scale`` each."""
    p = sum(int(np.prod(np.shape(w))) for w in want)
    rtol = clipped_sum_rtol(p, n)
    for g, w in zip(got, want):
        assert_close(tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(w).numpy(), rtol=rtol, atol=rtol * n * scale)


def _pure_noise(aggregator, shape=(4000,)):
    """One release of an all-zero clipped sum: the noise of the aggregator's next step."""
    zero = ClippedSum([tf.zeros(shape)], tf.zeros([0]), tf.zeros([0]))
    return aggregator.release(zero, 1.0)[0].numpy()


def _max_abs_correlation(a, b, shifts=8):
    """Largest |Pearson r| between a and b shifted by 0..shifts entries either way."""
    out = 0.0
    for k in range(-shifts, shifts + 1):
        u, v = (a[k:], b[: len(b) - k]) if k >= 0 else (a[:k], b[-k:])
        out = max(out, abs(np.corrcoef(u, v)[0, 1]))
    return out


# Under independence, r of n pairs has std 1/sqrt(n): 6 std is a bound that a
# true independent pair exceeds with probability ~1e-9 per comparison.
def _independence_bound(n):
    return 6 / np.sqrt(n)


@pytest.mark.parametrize("seed", [0, (3, 4), None])
def test_every_step_gets_fresh_noise(seed):
    agg = DPAggregator(l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed)
    first, second = _pure_noise(agg), _pure_noise(agg)
    assert int(agg.steps.numpy()) == 2
    assert _max_abs_correlation(first, second) < _independence_bound(first.size)
    assert abs(first.std() - 1.0) < 6 / np.sqrt(2 * first.size)


def test_neighbouring_int_seeds_give_unrelated_streams_and_the_same_seed_repeats():
    a, b = (_pure_noise(DPAggregator(l2_norm_clip=1.0, noise_multiplier=1.0, seed=s)) for s in (0, 1))
    assert _max_abs_correlation(a, b) < _independence_bound(a.size)
    again = _pure_noise(DPAggregator(l2_norm_clip=1.0, noise_multiplier=1.0, seed=0))
    np.testing.assert_array_equal(a, again)


def test_accumulator_with_a_pair_seed_adds_fresh_noise_to_every_logical_batch():
    model = _net()
    acc = peg.GradientAccumulator(
        model, sparse_ce, l2_norm_clip=1.0, noise_multiplier=1.0, seed=(5, 6), expected_batch_size=1.0
    )
    x, y = _data()
    releases = []
    for _ in range(2):
        acc.accumulate(x, y)
        releases.append(np.concatenate([g.numpy().ravel() for g in acc.result()]))
        acc.reset()
    assert int(acc.steps.numpy()) == 2  # each result() is a release and is counted
    difference = releases[0] - releases[1]  # the clipped sums cancel; the noise must not
    assert difference.std() > 1.0  # two independent N(0, 1): std sqrt(2)


def test_accumulator_refuses_dp_without_a_data_independent_divisor():
    with pytest.raises(ValueError, match="expected_batch_size is required"):
        peg.GradientAccumulator(_net(), sparse_ce, l2_norm_clip=1.0, noise_multiplier=1.0)


def _noise_model():
    """A model whose loss has zero gradient: a DP step's update is exactly -lr * noise / divisor."""
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(400, use_bias=False)])
    return net, (lambda y, p: 0.0 * tf.reduce_sum(p, axis=-1))


def _updates(dp, x, y, steps):
    out = []
    for _ in range(steps):
        before = dp.model.get_weights()[0]
        dp.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
        out.append((dp.model.get_weights()[0] - before).ravel())
    return out


@pytest.mark.slow
def test_a_seeded_dp_model_restored_from_a_checkpoint_never_replays_earlier_noise(tmp_path):
    warnings.simplefilter("ignore", UserWarning)
    x, y = np.ones((4, 2), "float32"), np.zeros((4,), "float32")
    net, loss = _noise_model()
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=1.0, seed=7)
    dp.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    first = _updates(dp, x, y, 3)
    dp.save_weights(tmp_path / "dp.weights.h5")
    step4 = _updates(dp, x, y, 1)[0]

    net2, _ = _noise_model()
    restored = peg.keras.DPModel(net2, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=1.0, seed=7)
    restored.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    restored.load_weights(tmp_path / "dp.weights.h5")
    assert int(restored.dp_steps.numpy()) == 3
    again = _updates(restored, x, y, 1)[0]
    # step 4 is step 4: the same noise on the same weights, a few roundings apart at most
    assert_close(again, step4, rtol=ELEMENTWISE_RTOL, atol=ELEMENTWISE_RTOL * np.abs(step4).max())
    for earlier in first:
        assert _max_abs_correlation(again, earlier) < _independence_bound(again.size)


def test_poisson_batches_seeds_are_unrelated_and_a_rebuilt_dataset_resumes():
    x = np.arange(200, dtype="float32")[:, None]
    masks = lambda ds: [m.numpy() for _, _, m in ds]
    a = masks(peg.dp.poisson_batches(x, sampling_probability=0.1, steps=12, seed=5, max_batch_size=60))
    b = masks(peg.dp.poisson_batches(x, sampling_probability=0.1, steps=12, seed=6, max_batch_size=60))
    rows = lambda ds: [tuple(xb[:, 0].numpy()[m.numpy() > 0]) for xb, _, m in ds]
    ra = rows(peg.dp.poisson_batches(x, sampling_probability=0.1, steps=12, seed=5, max_batch_size=60))
    rb = rows(peg.dp.poisson_batches(x, sampling_probability=0.1, steps=12, seed=6, max_batch_size=60))
    assert not set(ra) & set(rb)  # no batch of one seed appears in the other (shifted or not)
    assert len(a) == len(b) == 12
    # Two passes of one dataset continue; a rebuilt one with first_step=12 continues the same run.
    ds = peg.dp.poisson_batches(x, sampling_probability=0.1, steps=6, seed=5, max_batch_size=60)
    two_passes = rows(ds) + rows(ds)
    assert two_passes == ra
    resumed = rows(
        peg.dp.poisson_batches(x, sampling_probability=0.1, steps=6, seed=5, max_batch_size=60, first_step=6)
    )
    assert resumed == ra[6:]
    assert ds.pegrad_sampling.sampling_probability == 0.1 and ds.pegrad_sampling.num_examples == 200


@pytest.mark.slow
def test_dp_model_fit_resumes_a_poisson_dataset_at_its_ledger(tmp_path):
    x, y = _data(60)
    dp = peg.keras.DPModel(_net(), l2_norm_clip=1.0, noise_multiplier=0.5, seed=0)
    dp.compile(optimizer="sgd", loss=sparse_ce)
    ds = peg.dp.poisson_batches(x, y, sampling_probability=0.2, seed=3)
    dp.fit(ds, epochs=1, verbose=0)
    assert int(dp.dp_steps.numpy()) == 5
    assert int(ds.pegrad_sampling.next_step.numpy()) == 5
    rebuilt = peg.dp.poisson_batches(x, y, sampling_probability=0.2, seed=3)
    dp.fit(rebuilt, epochs=1, verbose=0)
    assert int(rebuilt.pegrad_sampling.next_step.numpy()) == 10  # steps 5..9, not 0..4 again


@pytest.mark.slow
def test_dp_model_fit_takes_every_epoch_of_a_poisson_dataset_from_one_iterator(monkeypatch):
    """Keras makes a finite dataset's iterator twice an epoch; fit repeats the passes behind one."""
    x, y = _data(60)

    def trained(**fit_kwargs):
        dp = peg.keras.DPModel(_net(), l2_norm_clip=1.0, noise_multiplier=0.5, seed=0)
        dp.compile(optimizer=keras.optimizers.SGD(0.5), loss=sparse_ce)
        ds = peg.dp.poisson_batches(x, y, sampling_probability=0.2, seed=3)
        history = dp.fit(ds, epochs=3, verbose=0, **fit_kwargs)
        assert len(history.history["loss"]) == 3
        return dp, ds

    made = []
    make = tf.data.Dataset.__iter__
    monkeypatch.setattr(tf.data.Dataset, "__iter__", lambda self: made.append(self) or make(self))
    dp, ds = trained()
    monkeypatch.undo()
    assert len(made) == 1
    assert int(dp.dp_steps.numpy()) == 15
    assert int(ds.pegrad_sampling.next_step.numpy()) == 15  # what the iterator prefetched past the end is unclaimed
    # Keras's own reuse of an iterator (steps_per_epoch given) draws the same 15 batches, step noise and all.
    reference, _ = trained(steps_per_epoch=5)
    m, divisor = peg.dp.default_max_batch_size(60, 0.2), 0.2 * 60
    p = sum(w.size for w in reference.get_weights())
    for a, b in zip(reference.get_weights(), dp.get_weights()):
        assert_close(b, a, atol=sgd_steps_atol(15, 0.5, clipped_sum_rtol(p, m) + EPS32, m / divisor, np.abs(a).max()))


@pytest.mark.slow
def test_dp_model_refuses_a_poisson_dataset_sampled_at_another_rate_and_accounts_the_real_one():
    x, y = _data(100)
    dp = peg.keras.DPModel(_net(), l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=5, num_examples=100)
    dp.compile(optimizer="sgd", loss=sparse_ce)
    with pytest.raises(ValueError, match="sampled at q=0.2"):
        dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.2, seed=0), epochs=1, verbose=0)
    free = peg.keras.DPModel(_net(), l2_norm_clip=1.0, noise_multiplier=1.0)
    free.compile(optimizer="sgd", loss=sparse_ce)
    free.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.2, seed=0), epochs=1, verbose=0)
    assert free.num_examples == 100
    assert float(free.dp_max_sampling_probability.numpy()) == pytest.approx(0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        free.epsilon(1e-5)  # Poisson all along: no heuristic warning


@pytest.mark.slow
def test_fixed_size_batches_warn_once_and_are_accounted_as_such():
    x, y = _data(40)
    dp = peg.keras.DPModel(_net(), l2_norm_clip=1.0, noise_multiplier=1.0, num_examples=40)
    dp.compile(optimizer="sgd", loss=sparse_ce)
    with pytest.warns(UserWarning, match="only an approximation"):
        dp.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert float(dp.dp_max_sampling_probability.numpy()) == pytest.approx(10 / 40)
    with pytest.warns(UserWarning, match="sampling='shuffle'"):
        dp.epsilon(1e-5)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_updates_carry_the_noise_unscaled(policy):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        net, loss = _noise_model()
        dp = peg.keras.DPModel(net, l2_norm_clip=2.0, noise_multiplier=1.5, expected_batch_size=4.0)
        dp.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            update = _updates(dp, np.ones((4, 2), "float32"), np.zeros((4,), "float32"), 1)[0]
    finally:
        keras.mixed_precision.set_global_policy(previous)
    expected = 1.5 * 2.0 / 4.0  # lr * sigma * C / expected_batch_size
    assert abs(update.std() / expected - 1) < 6 / np.sqrt(2 * update.size)


def test_save_weights_works_right_after_fit(tmp_path):
    x, y = _data(20)
    dp = peg.keras.DPModel(_net(), l2_norm_clip=1.0, noise_multiplier=0.5, seed=0)
    dp.compile(optimizer="sgd", loss=sparse_ce)
    dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.5, seed=0), epochs=1, verbose=0)
    dp.save_weights(tmp_path / "after_fit.weights.h5")
    fresh = peg.keras.DPModel(_net(1), l2_norm_clip=1.0, noise_multiplier=0.5)
    fresh.load_weights(tmp_path / "after_fit.weights.h5")
    assert int(fresh.dp_steps.numpy()) == int(dp.dp_steps.numpy()) == 2
    for a, b in zip(fresh.model.get_weights(), dp.model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", ["layerwise", "jacobian", "auto"])
def test_a_batch_reduced_loss_of_shape_one_is_refused(method):
    x, y = _data(8)
    reduced = lambda yt, yp: tf.reduce_mean(sparse_ce(yt, yp), keepdims=True)
    with pytest.raises(peg.InvalidLossError, match="one loss per example"):
        peg.per_example_gradients(_net(), reduced, x, y, method=method)


def test_an_example_with_a_nan_gradient_contributes_nothing():
    x, y = _data(8)
    model = _net()
    bad = x.copy()
    bad[3, 0] = np.nan
    keep = np.arange(8) != 3
    for method in ["layerwise", "vectorized"]:
        with pytest.warns(RuntimeWarning, match="non-finite"):
            got, norms = peg.clipped_gradients(
                model, sparse_ce, bad, y, l2_norm_clip=0.5, method=method, return_norms=True
            )
        want = peg.clipped_gradients(model, sparse_ce, x[keep], y[keep], l2_norm_clip=0.5, method=method)
        assert not np.isfinite(norms.numpy()[3])
        _assert_sums_close(got, want, n=7, scale=0.5)  # every clipped example's entries are at most C

    graph = tf.function(lambda a, b: peg.clipped_gradients(model, sparse_ce, a, b, l2_norm_clip=0.5))
    _assert_sums_close(
        graph(bad, y), peg.clipped_gradients(model, sparse_ce, x[keep], y[keep], l2_norm_clip=0.5), n=7, scale=0.5
    )


def test_a_dp_step_with_a_nan_example_keeps_the_weights_finite_and_reports_it():
    x, y = _data(16)
    x[5, :] = np.inf
    dp = peg.keras.DPModel(
        _net(), l2_norm_clip=1.0, noise_multiplier=0.1, expected_batch_size=16, num_examples=16, seed=0
    )
    dp.compile(optimizer="sgd", loss=sparse_ce)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = dp.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert history.history["nonfinite_examples"] == [1.0]
    assert any("NaN or Inf gradient" in str(w.message) for w in caught)
    assert all(np.isfinite(w).all() for w in dp.model.get_weights())


def _count_layerwise_passes(monkeypatch) -> list:
    """A list that grows by one at every trace (or eager call) of the layer-wise engine's clipped pass."""
    from per_example_grads.engines.base import ENGINES

    passes = []
    engine = ENGINES["layerwise"]
    monkeypatch.setitem(
        ENGINES,
        "layerwise",
        dataclasses.replace(
            engine, native_clipped_sums=lambda *args: passes.append(1) or engine.native_clipped_sums(*args)
        ),
    )
    return passes


@pytest.mark.parametrize("weighted", [True, False])
def test_clipped_gradients_in_a_graph_trace_the_pass_once_and_leave_out_a_nan_example(monkeypatch, weighted):
    passes = _count_layerwise_passes(monkeypatch)
    x, y = _data(8)
    bad = x.copy()
    bad[3, 0] = np.nan
    weights = np.array([1, 1, 0, 1, 1, 1, 0, 1], "float32") if weighted else np.ones(8, "float32")
    keep = (np.arange(8) != 3) & (weights > 0)
    model = _net()
    args = dict(l2_norm_clip=0.5, method="layerwise")
    if weighted:
        graph = tf.function(lambda a, b, w: peg.clipped_gradients(model, sparse_ce, a, b, sample_weight=w, **args))
        got = graph(bad, y, weights)
    else:
        got = tf.function(lambda a, b: peg.clipped_gradients(model, sparse_ce, a, b, **args))(bad, y)
    assert len(passes) == 1
    want = peg.clipped_gradients(model, sparse_ce, x[keep], y[keep], l2_norm_clip=0.5)
    _assert_sums_close(got, want, n=int(keep.sum()), scale=0.5)


def test_a_dp_fit_traces_its_step_and_its_clipped_pass_once(monkeypatch):
    """Twice, before: Keras made the optimizer's slots and the compiled metrics while tracing, so
    TensorFlow traced the step again, and the recomputation without non-finite examples traced the
    model and its rules a second time. A row of Inf in every step runs that recomputation."""
    steps, passes = [], _count_layerwise_passes(monkeypatch)

    class Counting(peg.keras.DPModel):
        def train_step(self, data):
            steps.append(1)
            return super().train_step(data)

    x, y = _data(16)
    x[5, :] = np.inf
    dp = Counting(_net(), l2_norm_clip=1.0, noise_multiplier=0.1, seed=0, method="layerwise")
    dp.compile(optimizer=keras.optimizers.Adam(1e-3), loss=sparse_ce, metrics=["accuracy"])
    data = peg.dp.poisson_batches(x, y, sampling_probability=1.0, seed=0)  # every row in every step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = dp.fit(data, epochs=2, verbose=0)
    assert (len(steps), len(passes)) == (1, 1)
    assert history.history["nonfinite_examples"] == [1.0, 1.0]
    assert all(np.isfinite(w).all() for w in dp.model.get_weights())


def test_numbers_of_every_kind_are_accepted_and_bad_ones_refused():
    x, y = _data(8)
    model = _net()
    grads = peg.dp.private_gradients(
        model,
        sparse_ce,
        x,
        y,
        l2_norm_clip=np.float32(1.0),
        noise_multiplier=np.float64(0.0),
        expected_batch_size=np.array(8),
        seed=(0, 0),
    )
    assert len(grads) == 4
    peg.dp.private_gradients(model, sparse_ce, x, y, l2_norm_clip=tf.constant(1.0), noise_multiplier=1.0, seed=(0, 0))
    for kwargs, match in [
        (dict(l2_norm_clip=1.0, noise_multiplier=np.float32("nan")), "noise_multiplier must be a finite number >= 0"),
        (
            dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=np.float32(0)),
            "expected_batch_size must be a finite number > 0",
        ),
        (dict(l2_norm_clip=float("inf"), noise_multiplier=1.0), "l2_norm_clip must be a finite number > 0"),
        # Noise of std 1e38 overflowed float32 to inf, and the weights to NaN, without a word.
        (dict(l2_norm_clip=1e37, noise_multiplier=10.0), "noise_multiplier \\* l2_norm_clip = 1e\\+38 is too large"),
        (dict(l2_norm_clip=[1e37, 1e37], noise_multiplier=5.0), "noise_multiplier \\* l2_norm_clip = 7.07107e\\+37"),
        (dict(l2_norm_clip=tf.constant(-1.0), noise_multiplier=1.0), "l2_norm_clip must be a finite number > 0"),
        (
            dict(l2_norm_clip={**{l.name: 1.0 for l in model.layers}, "densse": 1.0}, noise_multiplier=1.0),
            r"names \['densse'\]",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            peg.dp.private_gradients(model, sparse_ce, x, y, seed=(0, 0), **kwargs)
    step = tf.function(lambda c: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=c))
    with pytest.raises(tf.errors.InvalidArgumentError, match="l2_norm_clip must be a finite number > 0"):
        step(tf.constant(-1.0))
    with pytest.raises(ValueError, match="y is None, but loss_fn needs labels"):
        peg.per_example_gradients(model, sparse_ce, x, None)


def test_weight_regularizers_are_added_without_noise_and_activity_ones_refused():
    x, y = _data(8)
    model = _net(kernel_regularizer=keras.regularizers.L2(0.3))
    got = peg.dp.private_gradients(
        model, sparse_ce, x, y, l2_norm_clip=1e6, noise_multiplier=0.0, expected_batch_size=8
    )
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(sparse_ce(y, model(x))) + tf.add_n(model.losses)
    want = tape.gradient(loss, model.trainable_variables)
    # The mean of 8 unclipped examples plus the penalty's gradient: terms of the
    # size of the largest per-example entry, or of the penalty.
    scale = gradient_scale(reference_gradients(model, sparse_ce, x, y)) + max(float(np.abs(w).max()) for w in want)
    _assert_sums_close(got, want, n=8, scale=scale / 8)
    active = _net(activity_regularizer=keras.regularizers.L2(0.1))
    with pytest.raises(ValueError, match="activity_regularizer"):
        peg.dp.private_gradients(active, sparse_ce, x, y, l2_norm_clip=1.0, noise_multiplier=0.0)


def test_accumulator_training_flag_runs_dropout():
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((6,)), keras.layers.Dropout(0.5), keras.layers.Dense(3)])
    x, y = _data(8)
    results = []
    for training in (False, True):
        acc = peg.GradientAccumulator(net, sparse_ce, training=training)
        acc.accumulate(x, y)
        results.append(acc.result()[0].numpy())
    plain = peg.sum_examples(peg.per_example_gradients(net, sparse_ce, x, y))[0].numpy() / 8
    _assert_sums_close([results[0]], [plain], n=8, scale=gradient_scale(reference_gradients(net, sparse_ce, x, y)) / 8)
    assert not np.allclose(results[1], plain)


@pytest.mark.slow
def test_dp_model_epsilon_warns_for_a_large_delta_and_empty_steps_do_not_count_as_unclipped():
    x, y = _data(10)
    dp = peg.keras.DPModel(_net(), l2_norm_clip=1e-6, noise_multiplier=1.0, seed=0)
    dp.compile(optimizer="sgd", loss=sparse_ce)
    empty = tf.data.Dataset.from_tensors((x, y, np.zeros(10, "float32")))
    full = tf.data.Dataset.from_tensors((x, y, np.ones(10, "float32")))
    ds = peg.dp.poisson_batches(x, y, sampling_probability=0.5, seed=0)
    tiny = empty.concatenate(full)
    tiny.pegrad_sampling = ds.pegrad_sampling
    history = dp.fit(tiny, epochs=1, verbose=0)
    assert history.history["clipped_fraction"] == [1.0]  # the empty step is not averaged in as 0
    with pytest.warns(UserWarning, match="delta=0.5 is >= 1/num_examples"):
        dp.epsilon(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("physical_batch_size", [None, 3])
def test_dp_model_reports_loss_and_accuracy_over_real_rows_only(physical_batch_size):
    """From the clipped pass's predictions, in one piece or gathered from physical chunks."""
    x, y = _data(60)
    net = _net()
    net.compile(loss=sparse_ce, metrics=["accuracy"])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0, physical_batch_size=physical_batch_size)
    dp.compile(optimizer=keras.optimizers.SGD(0.0), loss=sparse_ce, metrics=["accuracy"])
    history = dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.1, seed=4), epochs=1, verbose=0)
    losses, hits = [], []
    for xb, yb, mask in peg.dp.poisson_batches(x, y, sampling_probability=0.1, seed=4):
        real = mask.numpy() > 0
        pred = net(xb).numpy()[real]
        losses += list(sparse_ce(yb.numpy()[real], pred).numpy())
        hits += list(pred.argmax(-1) == yb.numpy()[real])
    assert history.history["loss"][0] == pytest.approx(np.mean(losses), rel=1e-5)
    assert history.history["accuracy"][0] == pytest.approx(np.mean(hits), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("physical_batch_size", [None, 4])
def test_dp_model_under_xla_matches_the_uncompiled_step(physical_batch_size):
    x, y = _data(40)
    weights = []
    for jit in (False, True):
        dp = peg.keras.DPModel(_net(), l2_norm_clip=0.5, noise_multiplier=0.0, physical_batch_size=physical_batch_size)
        dp.compile(optimizer=keras.optimizers.SGD(0.5), loss=sparse_ce, metrics=["accuracy"], jit_compile=jit)
        history = dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.25, seed=1), epochs=1, verbose=0)
        weights.append(dp.model.get_weights())
        steps = int(dp.dp_steps.numpy())
        assert 0.0 <= history.history["accuracy"][0] <= 1.0
    # XLA fuses and reorders float32 sums; the SGD steps carry those differences along.
    # A step's update is a clipped sum over at most M rows divided by q N, entries at most M C / (q N).
    m, divisor = peg.dp.default_max_batch_size(40, 0.25), 0.25 * 40
    p = sum(w.size for w in weights[0])
    for a, b in zip(*weights):
        atol = sgd_steps_atol(steps, 0.5, clipped_sum_rtol(p, m) + EPS32, m * 0.5 / divisor, np.abs(a).max())
        assert_close(b, a, atol=atol)


@pytest.mark.slow
def test_dp_model_fits_an_embedding_model_on_poisson_batches():
    """Real rows gathered to a batch of unknown size: the table's sparse clipped sum must still build."""
    keras.utils.set_random_seed(0)
    net = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(30, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    x = np.random.RandomState(0).randint(0, 30, (40, 5)).astype("int32")
    y = (np.arange(40) % 3).astype("int32")
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0)
    dp.compile(optimizer="sgd", loss=sparse_ce, metrics=["accuracy"])
    history = dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.25, seed=0), epochs=1, verbose=0)
    assert int(dp.dp_steps.numpy()) == 4 and np.isfinite(history.history["loss"][0])
