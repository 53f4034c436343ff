"""MirroredStrategy on two logical CPU devices (set up in conftest).

Without them these tests skip, except in CI (``CI=true``), where they fail.

Every distributed result is compared with the same computation on one
device: without noise to the float32 tolerance of the suite, with noise by
its standard deviation (the noise of one step must be ``sigma C`` in total,
not ``sqrt(R)`` times that, nor ``1/sqrt(R)``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_grads_close,
    assert_norms_close,
    mirrored_strategy,
    reference_gradients,
    reference_norms,
    sparse_ce,
)
from per_example_grads.dp import ledger
from tolerances import (
    EPS32,
    GRADIENT_RTOL,
    TRAJECTORY_LOSS_RTOL,
    Z,
    clipped_sum_rtol,
    rounding_rtol,
    sgd_steps_atol,
    variance_atol,
    weighted_sum_rtol,
)

B, D, K = 16, 6, 3


def _data(seed=0):
    rng = np.random.RandomState(seed)
    x = (3 * rng.randn(B, D)).astype("float32")  # large inputs: most examples get clipped
    y = (np.arange(B) % K).astype("int32")
    return x, y


def _net():
    return keras.Sequential([keras.Input((D,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(K)])


def _twins(strategy):
    """The same network twice: one built under the strategy, one on a single device."""
    with strategy.scope():
        distributed = _net()
    single = _net()
    single.set_weights(distributed.get_weights())
    return distributed, single


def _distributed_batch(strategy, *arrays):
    ds = tf.data.Dataset.from_tensor_slices(arrays).batch(B)
    return next(iter(strategy.experimental_distribute_dataset(ds)))


def _local(strategy, value):
    return strategy.experimental_local_results(value)


def test_per_example_gradients_per_replica_shards_match_the_loop():
    strategy = mirrored_strategy()
    model, _ = _twins(strategy)
    x, y = _data()
    xb, yb = _distributed_batch(strategy, x, y)
    out = strategy.run(tf.function(lambda a, b: peg.per_example_gradients(model, sparse_ce, a, b)), args=(xb, yb))
    shards = _local(strategy, out)
    assert len(shards) == 2 and shards[0][0].shape[0] == B // 2
    joined = [np.concatenate([s[k] for s in shards]) for k in range(len(model.trainable_variables))]
    reference = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(joined, reference)
    with strategy.scope():  # cross-replica code under the scope: the whole batch on one device
        assert_grads_close([g.numpy() for g in peg.per_example_gradients(model, sparse_ce, x, y)], reference)


@pytest.mark.slow
def test_clipped_sums_all_reduced_equal_one_device():
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = _data()
    xb, yb = _distributed_batch(strategy, x, y)

    @tf.function
    def step(a, b):
        def replica(a, b):
            sums = peg.clipped_gradients(model, sparse_ce, a, b, l2_norm_clip=0.5)
            return tf.distribute.get_replica_context().all_reduce("SUM", sums)

        return strategy.run(replica, args=(a, b))

    total = _local(strategy, step(xb, yb))[0]
    ref = reference_gradients(single, sparse_ce, x, y)
    assert_clipped_sums_close([t.numpy() for t in total], ref, np.minimum(1, 0.5 / reference_norms(ref)))


def _private_step(strategy, model, seed, noise_multiplier):
    """One DP-SGD step's all-reduced gradient, as the optimizer would sum the replicas' shares."""
    x, y = _data()
    xb, yb = _distributed_batch(strategy, x, y)

    @tf.function
    def step(a, b):
        def replica(a, b):
            share = peg.dp.private_gradients(
                model, sparse_ce, a, b, l2_norm_clip=0.5, noise_multiplier=noise_multiplier, seed=seed
            )
            return tf.distribute.get_replica_context().all_reduce("SUM", share)

        return strategy.run(replica, args=(a, b))

    return step(xb, yb)


@pytest.mark.slow
@pytest.mark.parametrize("seed_kind", ["generator", "stateless"])
def test_private_gradients_have_noise_sigma_c_exactly_once(seed_kind):
    """4003 parameters: the sample std's relative standard error is 1/sqrt(2n) = 1.1%.

    Every replica adding all the noise would give sqrt(2) sigma C (+41%); one
    replica's share alone sigma C / sqrt(2) (-29%); the test allows 5 standard errors (5.6%).
    """
    strategy = mirrored_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(400), keras.layers.Dense(K)])
        seed = tf.random.Generator.from_seed(3) if seed_kind == "generator" else (3, 5)
    x, y = _data()
    sigma, clip = 1.5, 0.5
    noisy = _local(strategy, _private_step(strategy, model, seed, sigma))
    for a, b in zip(*noisy):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # every replica holds the same sum
    clean = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip)
    # The default divisor is the *global* batch, 16, not a replica's 8.
    noise = np.concatenate([(a.numpy() * B - c.numpy()).ravel() for a, c in zip(noisy[0], clean)])
    rel_se = 1 / np.sqrt(2 * noise.size)
    assert abs(noise.std() / (sigma * clip) - 1) < Z * rel_se, noise.std()
    assert abs(noise.mean()) < Z * sigma * clip / np.sqrt(noise.size)


@pytest.mark.slow
def test_accumulator_under_strategy_equals_one_device():
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = _data()
    with strategy.scope():
        plain = peg.GradientAccumulator(model, sparse_ce)
        private = peg.GradientAccumulator(
            model, sparse_ce, l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=B
        )
    halves = [
        _distributed_batch(strategy, x[i : i + 8], y[i : i + 8]) for i in (0, 8)
    ]  # 2 micro-batches, 4 rows per replica

    @tf.function
    def add(a, b):
        strategy.run(lambda a, b: (plain.accumulate(a, b), private.accumulate(a, b)), args=(a, b))

    for a, b in halves:
        add(a, b)
    assert float(plain.count.read_value()) == B  # cross-replica read: the total over replicas

    @tf.function
    def results():
        def replica():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce("SUM", plain.result()), ctx.all_reduce("SUM", private.result())

        return strategy.run(replica)

    mean, clipped = _local(strategy, results())[0]
    assert private.accountant().steps == 1  # one release in the ledger, not one per replica
    ref = reference_gradients(single, sparse_ce, x, y)
    assert_clipped_sums_close(
        [m.numpy() for m in mean], ref, np.ones(B), divisor=B, rtol=weighted_sum_rtol(B, GRADIENT_RTOL)
    )
    assert_clipped_sums_close([c.numpy() for c in clipped], ref, np.minimum(1, 0.5 / reference_norms(ref)), divisor=B)

    with pytest.raises(ValueError, match="inside strategy.run"):
        plain.accumulate(x, y)  # cross-replica code: each replica must add its own shard


def _accumulate_and_apply(strategy, acc, model):
    """A traced step in which every replica accumulates its shard of ``(a, b)`` into ``acc`` and applies it (SGD 0.1)."""
    with strategy.scope():
        opt = keras.optimizers.SGD(0.1)
        opt.build(model.trainable_variables)

    @tf.function
    def step(a, b):
        def replica(a, b):
            acc.accumulate(a, b)
            acc.apply(opt)

        strategy.run(replica, args=(a, b))

    return step


def test_accumulator_apply_under_strategy_counts_one_step():
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = _data()
    with strategy.scope():
        acc = peg.GradientAccumulator(model, sparse_ce)
    step = _accumulate_and_apply(strategy, acc, model)
    step(*_distributed_batch(strategy, x, y))
    assert int(acc.steps.numpy()) == 1 and float(acc.count.read_value()) == 0.0
    # One step of 0.1 times the mean gradient: a weighted sum over B examples, and the step's rounding (EPS32 |w|).
    before = single.get_weights()
    moved = [w - g for w, g in zip(before, model.get_weights())]
    assert_clipped_sums_close(
        moved,
        reference_gradients(single, sparse_ce, x, y),
        np.full(B, 0.1),
        divisor=B,
        rtol=weighted_sum_rtol(B, GRADIENT_RTOL),
        extra_atol=[EPS32 * np.abs(w) for w in before],
    )


def test_accumulator_budget_under_strategy_stops_every_replica_at_the_ledgers_limit():
    strategy = mirrored_strategy()
    model, _ = _twins(strategy)
    x, y = _data()
    with strategy.scope():
        acc = peg.GradientAccumulator(
            model,
            sparse_ce,
            l2_norm_clip=0.5,
            noise_multiplier=1.0,
            expected_batch_size=B,
            budget=peg.dp.PrivacyBudget(steps=1),
        )
    step = _accumulate_and_apply(strategy, acc, model)
    batch = _distributed_batch(strategy, x, y)
    step(*batch)
    before = model.get_weights()
    with pytest.raises(tf.errors.InvalidArgumentError, match="allows no more releases"):
        step(*batch)
    assert int(acc.steps.numpy()) == 1
    for w, v in zip(before, model.get_weights()):
        np.testing.assert_array_equal(w, v)  # no replica applied a second release


def _fit(model, x, y, **dp_args):
    dp = peg.keras.DPModel(model, **dp_args)
    dp.compile(
        optimizer=keras.optimizers.SGD(0.2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
    )
    history = dp.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0)
    return dp, history


@pytest.mark.slow
@pytest.mark.parametrize("divisor, physical", [(None, None), (16, 3)])
def test_dp_model_fit_without_noise_equals_one_device(divisor, physical):
    """Weights, loss and metrics; in chunks too, where each replica takes its loss and metrics chunk by chunk."""
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = np.concatenate([_data(0)[0], _data(1)[0]]), np.concatenate([_data(0)[1], _data(1)[1]])
    args = dict(l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=divisor, num_examples=2 * B, seed=1)
    args["physical_batch_size"] = physical
    with strategy.scope():
        dp, history = _fit(model, x, y, **args)
    ref, ref_history = _fit(single, x, y, **args)
    # Six SGD(0.2) steps of clipped means of B examples over B (divisor None: the global batch's B rows).
    p = sum(int(np.prod(v.shape)) for v in single.trainable_variables)
    update_scale = B * 0.5 / B
    for got, want in zip(model.get_weights(), single.get_weights()):
        atol = sgd_steps_atol(6, 0.2, clipped_sum_rtol(p, B), update_scale, np.abs(want) + 6 * 0.2 * update_scale)
        np.testing.assert_allclose(got, want, rtol=0, atol=float(np.max(atol)))
    assert int(dp.dp_steps.numpy()) == int(ref.dp_steps.numpy()) == 6  # counted once per step, not per replica
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=TRAJECTORY_LOSS_RTOL)
    # The epoch's running fraction of right predictions: the same counts (no example's two largest logits lie
    # within rounding of each other here)
    np.testing.assert_allclose(history.history["accuracy"], ref_history.history["accuracy"], rtol=rounding_rtol(1))
    # Fractions k / B of examples over C: equal counts (no norm lies within rounding of C here), one rounding each.
    np.testing.assert_allclose(
        history.history["clipped_fraction"], ref_history.history["clipped_fraction"], rtol=rounding_rtol(1)
    )


@pytest.mark.slow
def test_dp_model_adaptive_clipping_under_strategy_tracks_one_device():
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = _data()
    adaptive = peg.dp.AdaptiveClipping(target_quantile=0.5, learning_rate=0.3, clipped_count_stddev=1e-4)
    args = dict(noise_multiplier=0.0, adaptive_clipping=adaptive, expected_batch_size=B, seed=1)
    with strategy.scope():
        dp, _ = _fit(model, x, y, **args)
    ref, _ = _fit(single, x, y, **args)
    # The unclipped count is all-reduced: the same next C on every replica, equal to one device's
    # up to the 1e-4 count noise (a relative change of exp(0.3 * 1e-4 / 16 * ...) per step).
    assert float(dp.l2_norm_clip.numpy()) == pytest.approx(float(ref.l2_norm_clip.numpy()), rel=1e-4)
    assert float(dp.l2_norm_clip.numpy()) != pytest.approx(1.0, rel=1e-3)  # it did move


def test_gradient_statistics_under_scope_equal_one_device():
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = _data()
    with strategy.scope():
        report = peg.diagnostics.gradient_statistics(model, sparse_ce, (x, y), batch_size=8, progress=False)
    ref = peg.diagnostics.gradient_statistics(single, sparse_ce, (x, y), batch_size=8, progress=False)
    # Two float32 computations of the same per-example gradients (tests/tolerances.py), propagated.
    expected = reference_gradients(single, sparse_ce, x, y)
    assert_norms_close(report.per_example_norms, expected)
    flat = np.concatenate([e.reshape(B, -1) for e in expected], axis=1).astype(np.float64)
    err = GRADIENT_RTOL * np.abs(flat).max()
    assert report.trace_covariance == pytest.approx(ref.trace_covariance, abs=variance_atol(flat, err).sum())


@pytest.mark.slow
def test_embedding_model_sparse_sums_under_strategy_equal_one_device():
    """An embedding table's clipped sum is an IndexedSlices: all-reduced by the optimizer, scatter-added by the accumulator."""
    strategy = mirrored_strategy()

    def text_net():
        return keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(50, 4),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(K),
            ]
        )

    with strategy.scope():
        model = text_net()
    single = text_net()
    single.set_weights(model.get_weights())
    x = np.random.RandomState(0).randint(0, 50, (B, 5)).astype("int32")
    y = (np.arange(B) % K).astype("int32")
    with strategy.scope():
        acc = peg.GradientAccumulator(model, sparse_ce, l2_norm_clip=0.05, noise_multiplier=0.0, expected_batch_size=B)
    a, b = _distributed_batch(strategy, x, y)

    @tf.function
    def accumulated(a, b):
        def replica(a, b):
            acc.accumulate(a, b)
            return tf.distribute.get_replica_context().all_reduce("SUM", acc.result())

        return strategy.run(replica, args=(a, b))

    got = _local(strategy, accumulated(a, b))[0]
    ref = reference_gradients(single, sparse_ce, x, y)
    assert_clipped_sums_close([g.numpy() for g in got], ref, np.minimum(1, 0.05 / reference_norms(ref)), divisor=B)

    args = dict(l2_norm_clip=0.05, noise_multiplier=0.0, expected_batch_size=B, seed=1)
    with strategy.scope():
        _fit(model, x, y, **args)
    _fit(single, x, y, **args)
    # Three SGD(0.2) steps of clipped means of B examples over B.
    p = sum(int(np.prod(v.shape)) for v in single.trainable_variables)
    update_scale = B * 0.05 / B
    for got, want in zip(model.get_weights(), single.get_weights()):
        atol = sgd_steps_atol(3, 0.2, clipped_sum_rtol(p, B), update_scale, np.abs(want) + 3 * 0.2 * update_scale)
        np.testing.assert_allclose(got, want, rtol=0, atol=float(np.max(atol)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "make", [lambda: peg.dp.BandMF(bands=3, num_steps=6), lambda: peg.dp.BISR(bands=3, num_steps=6, cycle_length=2)]
)
def test_correlated_noise_under_strategy_is_c_inverse_of_the_summed_draws(make):
    """Each replica correlates its own share; the all-reduced noise is C^{-1} of the all-reduced fresh draws."""
    from per_example_grads.dp.aggregator import ClippedSum, DPAggregator

    strategy = mirrored_strategy()
    mechanism, n, size = make(), 6, 512
    with strategy.scope():
        aggregators = [
            DPAggregator(l2_norm_clip=1.0, noise_multiplier=1.0, seed=(3, 5), mechanism=m) for m in (None, mechanism)
        ]
        for a in aggregators:
            a.attach([tf.Variable(tf.zeros([size]))])

    @tf.function
    def step():
        def replica():
            ctx = tf.distribute.get_replica_context()
            zero = ClippedSum([tf.zeros([size])], tf.zeros([0]), tf.zeros([0]))
            return [ctx.all_reduce("SUM", a.release(zero, 1.0)[0]) for a in aggregators]

        return strategy.run(replica)

    fresh, noise = map(np.stack, zip(*[[t.numpy() for t in _local(strategy, step())[0]] for _ in range(n)]))
    c = mechanism.coefficients
    toeplitz = sum(ck * np.eye(n, k=-k) for k, ck in enumerate(c))
    want = np.linalg.solve(toeplitz, fresh.astype(np.float64))
    np.testing.assert_allclose(
        noise, want, rtol=0, atol=rounding_rtol(4 * n) * np.abs(np.linalg.inv(toeplitz)).sum() * np.abs(fresh).max()
    )
    assert abs(fresh.std() - 1.0) < Z / np.sqrt(2 * fresh.size)  # sigma C once in total, not per replica
    assert int(aggregators[1].steps.numpy()) == n


@pytest.mark.slow
def test_dp_model_per_unit_clips_a_unit_split_between_replicas_once():
    """A unit whose rows the pipeline puts on both replicas is clipped whole, once (sensitivity C, not 2C).

    Reference: one-row tapes on one device, summed per unit, clipped, SGD by hand.
    """
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    sizes = [3, 2, 4, 3, 2, 2]  # 16 rows, 8 per replica: unit 2 (rows 5..8) straddles the shards
    ids = np.repeat(np.arange(len(sizes)) + 10, sizes)
    x, y = _data()
    lr, clip, steps, u = 0.2, 0.5, 2, len(sizes)
    with strategy.scope():
        dp = peg.keras.DPModel(model, l2_norm_clip=clip, noise_multiplier=0.0, seed=1, privacy_unit="unit")
        dp.compile(
            optimizer=keras.optimizers.SGD(lr), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        data = peg.dp.poisson_batches(x, y, unit_ids=ids, sampling_probability=1.0, steps=steps, seed=0)
        history = dp.fit(data, verbose=0)
    assert int(dp.dp_steps.numpy()) == steps and dp.num_examples == u
    p = sum(int(np.prod(v.shape)) for v in single.trainable_variables)
    clipped_units, split_apart = 0, 0.0
    for _ in range(steps):  # q = 1: every unit, in id order, at every step
        rows = reference_gradients(single, sparse_ce, x, y)
        total = [np.zeros(r.shape[1:]) for r in rows]
        halves = [np.zeros(r.shape[1:]) for r in rows]  # what clipping each replica's part of a unit would give
        for unit in np.unique(ids):
            for members, out in [(ids == unit, total)] + [
                ((ids == unit) & (np.arange(B) // (B // 2) == r), halves) for r in (0, 1)
            ]:
                if not members.any():
                    continue
                g = [r[members].sum(axis=0).astype(np.float64) for r in rows]
                norm = np.sqrt(sum(np.sum(t**2) for t in g))
                if out is total:
                    clipped_units += norm > clip
                for k, t in enumerate(g):
                    out[k] += min(1.0, clip / norm) * t
        split_apart = max(split_apart, max(np.abs(a - b).max() for a, b in zip(total, halves)))
        single.set_weights([w - lr * t / u for w, t in zip(single.get_weights(), total)])
    atol = sgd_steps_atol(
        steps,
        lr,
        clipped_sum_rtol(p, B),
        B * clip / u,
        np.abs(np.concatenate([w.ravel() for w in single.get_weights()])).max() + steps * lr * B * clip / u,
    )
    for got, want in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    assert split_apart * lr / u > 100 * atol  # a unit clipped in two parts would fail the comparison above
    # Clipped units over units: one float32 fraction k / U per step, averaged over the epoch.
    assert history.history["clipped_fraction"][0] == pytest.approx(clipped_units / (steps * u), rel=rounding_rtol(2))


def test_whole_units_on_replicas_refuses_float_unit_ids():
    """Float ids are refused, naming unit_ids, before the all-gather's int64 cast could merge two units."""
    from per_example_grads.dp.aggregator import whole_units_on_replicas

    strategy = mirrored_strategy()
    x = tf.zeros([4, 3])
    with pytest.raises(TypeError, match="unit_ids must be integers"):
        strategy.run(lambda: whole_units_on_replicas(x, None, None, tf.constant([1.2, 1.7, 2.0, 3.0])))
    # integer ids on two replicas: each row kept (weight 1) on the replica that owns its unit only
    ids = tf.constant([5, 5, 7, 9])
    out = strategy.run(lambda: whole_units_on_replicas(x, None, None, ids))
    weights = [w.numpy() for w in strategy.experimental_local_results(out[2])]
    np.testing.assert_array_equal(np.sum(weights, axis=0), np.ones(8))  # the gathered 2 x 4 rows, each owned once


def test_private_gradients_clip_a_unit_split_between_replicas_once():
    """A unit whose rows are on both replicas moves the all-reduced release by C, as on one device (was up to R C).

    Reference: the single-device private_gradients of the whole batch, noise-free; the replicas' shares sum to it.
    """
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = _data()
    ids = np.repeat(np.arange(4) + 10, [3, 7, 4, 2])  # 16 rows, 8 per replica: unit 11 (rows 3..9) straddles them
    clip, expected = 0.5, 4.0
    step = tf.function(
        lambda a, b, u: peg.dp.private_gradients(
            model, sparse_ce, a, b, unit_ids=u, l2_norm_clip=clip, noise_multiplier=0.0, expected_batch_size=expected
        )
    )
    shares = _local(strategy, strategy.run(step, args=_distributed_batch(strategy, x, y, ids)))
    got = [sum(share[k].numpy() for share in shares) for k in range(len(model.trainable_variables))]
    want = peg.dp.private_gradients(
        single, sparse_ce, x, y, unit_ids=ids, l2_norm_clip=clip, noise_multiplier=0.0, expected_batch_size=expected
    )
    p = sum(int(np.prod(v.shape)) for v in single.trainable_variables)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=0, atol=clipped_sum_rtol(p, B) * 4 * clip / expected)
    # Each replica clipping its part of unit 11 would give another sum: the comparison can fail.
    halves = [
        peg.dp.private_gradients(
            single,
            sparse_ce,
            x[part],
            y[part],
            unit_ids=ids[part],
            l2_norm_clip=clip,
            noise_multiplier=0.0,
            expected_batch_size=expected,
        )
        for part in (slice(0, B // 2), slice(B // 2, B))
    ]
    split = [a.numpy() + b.numpy() for a, b in zip(*halves)]
    assert (
        max(np.abs(s - w.numpy()).max() for s, w in zip(split, want))
        > 100 * clipped_sum_rtol(p, B) * 4 * clip / expected
    )


@pytest.mark.slow
@pytest.mark.parametrize("privacy_unit", ["example", "unit"])
def test_dp_model_fits_poisson_batches_of_a_size_the_replicas_do_not_divide(privacy_unit):
    """Batches of M = 17 rows on 2 replicas failed in Keras's first build; padded with masked rows they train as on one device."""
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = _data()
    units = dict(unit_ids=np.repeat(np.arange(6) + 10, [3, 2, 4, 3, 2, 2])) if privacy_unit == "unit" else {}
    args = dict(l2_norm_clip=0.5, noise_multiplier=0.0, seed=1, privacy_unit=privacy_unit)

    def fit(net):
        dp = peg.keras.DPModel(net, **args)
        dp.compile(
            optimizer=keras.optimizers.SGD(0.2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        data = peg.dp.poisson_batches(x, y, sampling_probability=0.5, max_batch_size=17, steps=3, seed=0, **units)
        assert data.pegrad_sampling.max_batch_size % 2 == 1
        dp.fit(data, verbose=0)
        return dp

    with strategy.scope():
        dp = fit(model)
    ref = fit(single)
    assert int(dp.dp_steps.numpy()) == int(ref.dp_steps.numpy()) == 3
    p = sum(int(np.prod(v.shape)) for v in single.trainable_variables)
    update_scale = B * 0.5 / (0.5 * (6 if units else B))  # at most B rows of clip 0.5 over q N (units: q U)
    for got, want in zip(model.get_weights(), single.get_weights()):
        atol = sgd_steps_atol(3, 0.2, clipped_sum_rtol(p, B), update_scale, np.abs(want) + 3 * 0.2 * update_scale)
        np.testing.assert_allclose(got, want, rtol=0, atol=float(np.max(atol)))
    assert dp.epsilon(1e-5) == pytest.approx(ref.epsilon(1e-5), rel=1e-12)


@pytest.mark.slow
def test_dp_model_keeps_a_cyclic_partition_under_a_strategy_across_fits():
    """BandMF on cyclic batches of odd M under 2 replicas: the second, unseeded dataset takes the run's partition."""
    strategy = mirrored_strategy()
    model, _ = _twins(strategy)
    x, y = _data()
    x[:, 0] = np.arange(B)  # row i is recognisable by its first input
    with strategy.scope():
        dp = peg.keras.DPModel(model, noise_multiplier=1.0, mechanism=peg.dp.BandMF(bands=2, num_steps=8))
        dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=sparse_ce)
    parts = []
    for _ in range(2):
        data = peg.dp.poisson_batches(x, y, sampling_probability=1.0, cycle_length=2, max_batch_size=B + 1, steps=4)
        dp.fit(data, verbose=0)
        start = int(data.pegrad_sampling.next_step.numpy())
        batches = [xb.numpy()[mask.numpy() == 1, 0].astype(int) for xb, _, mask in data.take(2)]
        parts.append([set(batches[(p - start) % 2].tolist()) for p in range(2)])
    assert parts[0] == parts[1] and int(dp.dp_steps.numpy()) == 8
    assert sorted(parts[0][0] | parts[0][1]) == list(range(B))
    # Its Monte-Carlo epsilon reads the replicated ledger as one run: that of 8 steps of BandMF(2) on whole parts.
    expected = peg.dp.monte_carlo_epsilon(peg.dp.BandMF(bands=2, num_steps=8), 1.0, 8, delta=1e-2, seed=0)
    assert dp.monte_carlo_epsilon(1e-2, seed=0) == expected


@pytest.mark.slow
def test_dp_model_on_min_sep_batches_under_a_strategy_keeps_the_runs_key_across_fits():
    """BISR on b-min-sep batches of odd M under 2 replicas: the second, unseeded dataset goes on with the run's key."""
    strategy = mirrored_strategy()
    model, _ = _twins(strategy)
    x, y = _data()
    with strategy.scope():
        dp = peg.keras.DPModel(model, noise_multiplier=1.0, mechanism=peg.dp.BISR(bands=3, num_steps=8, cycle_length=2))
        dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=sparse_ce)
    keys = []
    for _ in range(2):
        data = peg.dp.min_sep_batches(x, y, sampling_probability=0.5, min_separation=2, max_batch_size=B + 1, steps=4)
        dp.fit(data, verbose=0)
        keys.append(data.pegrad_sampling.key.numpy().tolist())
    assert keys[0] == keys[1] and int(dp.dp_steps.numpy()) == 8
    with pytest.raises(ValueError, match="b-min-sep sampled, not cyclic Poisson sampled"):
        dp.monte_carlo_epsilon(1e-2)
    assert dp.epsilon(1e-5) == pytest.approx(
        peg.dp.compute_epsilon(
            B, 1, None, 1.0, 1e-5, steps=8, mechanism=peg.dp.BISR(bands=3, num_steps=8, cycle_length=2)
        ),
        rel=1e-12,
    )


@pytest.mark.slow
def test_dp_model_on_truncated_poisson_batches_under_a_strategy_trains_and_accounts_as_one_device():
    """Truncated batches of B = 9 rows (odd) on 2 replicas: the steps of one device, one truncated segment."""
    strategy = mirrored_strategy()
    model, single = _twins(strategy)
    x, y = _data()
    args = dict(l2_norm_clip=0.5, noise_multiplier=0.0, seed=1)

    def fit(net):
        dp = peg.keras.DPModel(net, **args)
        dp.compile(optimizer=keras.optimizers.SGD(0.2), loss=sparse_ce)
        dp.fit(
            peg.dp.truncated_poisson_batches(x, y, sampling_probability=0.75, truncated_batch_size=9, seed=0, steps=3),
            verbose=0,
        )
        return dp

    with strategy.scope():
        dp = fit(model)
    ref = fit(single)
    table = dp.aggregator.segments.numpy()
    assert ledger.events(table, 3) == [ledger.Segment(3, 0.0, 0.75, True, 9, B)]
    np.testing.assert_array_equal(table, ref.aggregator.segments.numpy())
    p = sum(int(np.prod(v.shape)) for v in single.trainable_variables)
    update_scale = 9 * 0.5 / (0.75 * B)  # at most 9 rows of clip 0.5 over q N
    for got, want in zip(model.get_weights(), single.get_weights()):
        atol = sgd_steps_atol(3, 0.2, clipped_sum_rtol(p, 9), update_scale, np.abs(want) + 3 * 0.2 * update_scale)
        np.testing.assert_allclose(got, want, rtol=0, atol=float(np.max(atol)))
