"""User-level DP (issue 29, the DP side): sampling units, accounting per unit, training per unit.

The engine's grouped norms and clipped sums are tested against a one-row loop
in tests/test_units.py; here: the unit sampler, the ledger over the number of
units, the mismatches DPModel refuses, and training steps that clip each
unit's summed gradient.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from per_example_grads.dp.sampling import poisson_batches

# Uneven units: unit u has 1 + (u mod 5) rows, rows of units interleaved (not adjacent).
U = 120
SIZES = 1 + np.arange(U) % 5
IDS = np.random.default_rng(0).permutation(np.repeat(1000 + 3 * np.arange(U), SIZES))  # any integer ids
ROWS = len(IDS)


def _batches(q, steps, k=None, seed=0, **kwargs):
    x = np.arange(ROWS, dtype="float32")[:, None]  # each row's own index, to check which rows came
    ds = poisson_batches(x, unit_ids=IDS, rows_per_unit=k, sampling_probability=q, steps=steps, seed=seed, **kwargs)
    out = []
    for xb, _yb, mask, ids in ds:
        b = int(mask.numpy().sum())
        rows = xb.numpy()[:b, 0].astype(int)
        out.append((rows, ids.numpy(), mask.numpy(), xb.numpy()))
    return ds, out


@pytest.mark.slow
def test_unit_inclusion_frequency_matches_q():
    q, steps, k = 0.25, 80, 3
    _, batches = _batches(q, steps, k)
    included = np.zeros(U)
    for rows, *_ in batches:
        included[np.searchsorted(1000 + 3 * np.arange(U), np.unique(IDS[rows]))] += 1
    # Every (unit, step) is an independent Bernoulli(q): the total is Binomial(U T, q).
    total, n = included.sum(), U * steps
    assert abs(total - n * q) <= 5 * math.sqrt(n * q * (1 - q))
    # Per unit, Binomial(T, q): no unit is sampled far more or less often (5 sd, over 120 units).
    assert np.all(np.abs(included - steps * q) <= 5 * math.sqrt(steps * q * (1 - q)))
    # A unit's inclusion does not depend on its size (sizes 1..5 each cover 24 units).
    for size in range(1, 6):
        mine = included[SIZES == size].sum()
        m = (SIZES == size).sum() * steps
        assert abs(mine - m * q) <= 5 * math.sqrt(m * q * (1 - q))


def test_units_bring_at_most_rows_per_unit_rows_drawn_afresh_each_step():
    k = 3
    ds, batches = _batches(1.0, 60, k)
    sampling = ds.pegrad_sampling
    assert (sampling.privacy_unit, sampling.num_examples, sampling.num_rows, sampling.rows_per_unit) == (
        "unit",
        U,
        ROWS,
        k,
    )
    assert sampling.expected_batch_size == pytest.approx(U)
    seen = set()
    big = IDS == IDS[np.argmax(SIZES[np.searchsorted(1000 + 3 * np.arange(U), IDS)])]  # rows of a 5-row unit
    chosen_from_big = np.zeros(ROWS)
    for rows, ids, mask, xb in batches:
        b = len(rows)
        assert np.array_equal(ids[:b], IDS[rows])  # each row's id is its unit's
        assert np.all(ids[b:] == -1) and np.all(mask[b:] == 0) and np.all(xb[b:] == 0)  # padding
        assert np.all(np.diff(ids[:b]) >= 0)  # a unit's rows are consecutive, units in id order
        assert len(set(rows)) == b  # without replacement
        unit_counts = np.unique(ids[:b], return_counts=True)[1]
        assert np.array_equal(unit_counts, np.minimum(SIZES, k))  # q = 1: every unit, min(size, k) rows
        seen.update(rows.tolist())
        chosen_from_big[rows] += 1
    assert seen == set(range(ROWS))  # the rows of larger units change from step to step
    # A 5-row unit's rows are each chosen with probability 3/5 (60 steps, 5 sd).
    freq = chosen_from_big[big]
    assert np.all(np.abs(freq - 60 * 0.6) <= 5 * math.sqrt(60 * 0.6 * 0.4))


def test_default_max_batch_size_holds_the_largest_units():
    q, k = 0.1, 4
    ds, _ = _batches(q, 1, k)
    units = peg.dp.default_max_batch_size(U, q)
    assert ds.pegrad_sampling.max_batch_size == np.sort(np.minimum(SIZES, k))[::-1][:units].sum()


@pytest.mark.slow
def test_units_of_one_row_sample_as_examples():
    x = np.random.default_rng(1).normal(size=(40, 3)).astype("float32")
    rows = poisson_batches(x, sampling_probability=0.3, seed=5, steps=6)
    units = poisson_batches(x, unit_ids=np.arange(40), sampling_probability=0.3, seed=5, steps=6)
    for (xa, _, ma), (xb, _, mb, _ids) in zip(rows, units):
        np.testing.assert_array_equal(xa.numpy(), xb.numpy())
        np.testing.assert_array_equal(ma.numpy(), mb.numpy())
    assert units.pegrad_sampling.num_examples == rows.pegrad_sampling.num_examples == 40


def test_cyclic_unit_sampling_keeps_each_unit_in_one_part():
    b = 3
    _, batches = _batches(1.0, 9, 2, cycle_length=b)
    part_of = {}
    for t, (rows, ids, *_) in enumerate(batches):
        for unit in np.unique(ids[: len(rows)]):
            assert part_of.setdefault(unit, t % b) == t % b
    assert len(part_of) == U  # q = 1: every unit in its part's steps


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(unit_ids=np.arange(3)), ValueError, r"unit_ids must have shape \[N\] = \[6\]"),
        (dict(unit_ids=np.zeros(6, "float32")), TypeError, "unit_ids must be integers"),
        (dict(unit_ids=np.zeros(6, int), rows_per_unit=0), ValueError, "rows_per_unit must be a positive integer"),
        (dict(rows_per_unit=2), ValueError, "rows_per_unit=2 needs unit_ids"),
        (dict(unit_ids=np.zeros(6, int), cycle_length=2), ValueError, "at most the number of units U=1"),
    ],
)
def test_sampler_refuses_bad_unit_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        poisson_batches(np.ones((6, 2)), sampling_probability=0.5, **kwargs)


def test_too_small_max_batch_size_names_it():
    ds = poisson_batches(np.ones((6, 2)), unit_ids=[0, 0, 0, 1, 1, 1], sampling_probability=1.0, max_batch_size=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_batch_size=4"):
        next(iter(ds))


# ---------------------------------------------------------------------------
# Training per unit
# ---------------------------------------------------------------------------

import dp_accounting  # noqa: E402
import keras  # noqa: E402

from helpers import assert_close, reference_gradients, sparse_ce  # noqa: E402
from tolerances import ACCOUNTING_SAME_RTOL, EPS32, clipped_sum_rtol, norm_rtol, rounding_rtol, sgd_steps_atol  # noqa: E402

N_ROWS, Q, SIGMA, CLIP, LR = 40, 0.25, 1.0, 0.5, 0.1


def _net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])


def _xy(n=N_ROWS):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n)


def _fit(ids=None, k=None, epochs=1, **options):
    x, y = _xy()
    net = _net()
    unit = "unit" if ids is not None else "example"
    dp = peg.keras.DPModel(net, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=1, privacy_unit=unit, **options)
    dp.compile(optimizer=keras.optimizers.SGD(LR), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    units = {} if ids is None else dict(unit_ids=ids, rows_per_unit=k)
    data = poisson_batches(x, y, sampling_probability=Q, seed=2, steps=2, **units)
    history = dp.fit(data, epochs=epochs, verbose=0)
    return dp, net, history.history


@pytest.mark.slow
def test_units_of_one_row_train_as_examples():
    rows, rows_net, rows_history = _fit()
    units, units_net, units_history = _fit(ids=np.arange(N_ROWS) + 100)
    steps = int(rows.dp_steps.numpy())
    assert int(units.dp_steps.numpy()) == steps == 2
    # Same batches, noise and divisor (q N = q U): the updates agree to the clipped sums' rounding.
    update_rtol = clipped_sum_rtol(4 * 6 + 6 + 6 * 3 + 3, N_ROWS) / (Q * N_ROWS)
    for a, b in zip(units_net.trainable_variables, rows_net.trainable_variables):
        scale = N_ROWS * CLIP / (Q * N_ROWS) + SIGMA * CLIP * 6 / (Q * N_ROWS)  # clipped sum plus a 6-sd noise draw
        atol = sgd_steps_atol(steps, LR, update_rtol, scale, np.abs(b.numpy()) + 1)
        assert_close(a.numpy(), b.numpy(), atol=atol)
    assert units_history["clipped_fraction"] == pytest.approx(rows_history["clipped_fraction"])
    assert units.epsilon(1e-3) == rows.epsilon(1e-3)


def _dp_accounting_epsilon(kind, q, sigma, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    accountant = (
        dp_accounting.pld.PLDAccountant(relation)
        if kind == "pld"
        else dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    )
    return accountant.compose(event).get_epsilon(delta)


@pytest.mark.slow
def test_epsilon_is_per_unit_and_chunks_keep_units_whole():
    ids = np.arange(N_ROWS) // 3  # 14 units of 3 rows (the last of 1)
    dp, _, history = _fit(ids=ids, k=3, physical_batch_size=4)  # one unit per chunk
    steps = int(dp.dp_steps.numpy())
    assert dp.num_examples == 14 and steps == 2
    expected = _dp_accounting_epsilon("rdp", Q, SIGMA, steps, 1e-2)
    assert dp.epsilon(1e-2, accountant="rdp") == pytest.approx(expected, rel=ACCOUNTING_SAME_RTOL)
    with pytest.warns(UserWarning, match="1/num_examples"):  # delta is judged against 1/U, not 1/rows
        dp.epsilon(0.1, accountant="rdp")
    assert all(np.isfinite(history["loss"])) and history["nonfinite_examples"] == [0.0]


def _unit_dp(**options):
    return peg.keras.DPModel(_net(), l2_norm_clip=CLIP, noise_multiplier=SIGMA, privacy_unit="unit", **options)


@pytest.mark.parametrize(
    "make, data, match",
    [
        (
            lambda: _unit_dp(),
            lambda x, y: poisson_batches(x, y, sampling_probability=Q),
            "privacy_unit='unit' cannot be combined with data without unit ids",
        ),
        (lambda: _unit_dp(), lambda x, y: (x, y), "privacy_unit='unit' cannot be combined with data without unit ids"),
        (
            lambda: peg.keras.DPModel(_net(), l2_norm_clip=CLIP, noise_multiplier=SIGMA),
            lambda x, y: poisson_batches(x, y, unit_ids=np.arange(N_ROWS) // 4, sampling_probability=Q),
            "privacy_unit='example'",
        ),
        (
            lambda: _unit_dp(num_examples=N_ROWS),
            lambda x, y: poisson_batches(x, y, unit_ids=np.arange(N_ROWS) // 4, sampling_probability=Q),
            r"num_examples=40, but the dataset samples 10 units \(from 40 rows\)",
        ),
        (
            lambda: _unit_dp(physical_batch_size=2),
            lambda x, y: poisson_batches(
                x, y, unit_ids=np.arange(N_ROWS) // 4, rows_per_unit=3, sampling_probability=Q
            ),
            "physical_batch_size=2 cannot be combined with units of up to rows_per_unit=3 rows",
        ),
        (
            lambda: _unit_dp(mechanism=peg.dp.BandMF(bands=2, num_steps=2)),
            lambda x, y: poisson_batches(x, y, unit_ids=np.arange(N_ROWS) // 4, sampling_probability=Q),
            r"the BandMF mechanism \(accounted for cycle_length=2\) cannot be combined with a poisson_batches "
            "dataset of cycle_length=1",
        ),
    ],
)
def test_dp_model_refuses_unit_mismatches(make, data, match):
    dp = make()
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=match):
        dp.fit(data(*_xy()), verbose=0)


def test_dp_model_refuses_bad_privacy_unit_settings():
    with pytest.raises(ValueError, match="privacy_unit must be one of 'example', 'unit'; got 'user'"):
        peg.keras.DPModel(_net(), noise_multiplier=1.0, privacy_unit="user")
    with pytest.raises(ValueError, match="DPModel: privacy_unit='unit' cannot be combined with adaptive_clipping"):
        peg.keras.DPModel(
            _net(), noise_multiplier=1.0, privacy_unit="unit", adaptive_clipping=peg.dp.AdaptiveClipping()
        )


# Uneven units, rows of a unit consecutive (as the sampler gives them), then two padding rows (id -1, weight 0).
BATCH_IDS = np.array([4, 4, 4, 9, 11, 11, 12, 12, 12, 20, -1, -1])
BATCH_WEIGHTS = np.array([1.0] * 10 + [0.0, 0.0], "float32")


def _unit_reference(net, x, y, ids, weights):
    """float64 ``sum_u clip_C(G_u)`` from one-row tapes, and ``S_u``-weighted magnitudes for the tolerance."""
    rows = [np.asarray(r, np.float64) for r in reference_gradients(net, sparse_ce, x, y, weights)]
    total, magnitude = [np.zeros(r.shape[1:]) for r in rows], [np.zeros(r.shape[1:]) for r in rows]
    for u in np.unique(ids[weights > 0]):
        g = [r[ids == u].sum(axis=0) for r in rows]
        factor = min(1.0, CLIP / np.sqrt(sum(np.sum(t**2) for t in g)))
        for k, r in enumerate(rows):
            total[k] += factor * g[k]
            magnitude[k] += factor * np.abs(r[ids == u]).sum(axis=0)
    return total, magnitude


@pytest.mark.parametrize(
    "physical_batch_size", [None, pytest.param(3, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)]
)
def test_step_clips_each_units_summed_gradient(physical_batch_size):
    _assert_step_clips_each_unit_whole(BATCH_IDS, physical_batch_size)


def _assert_step_clips_each_unit_whole(unit_ids, physical_batch_size):
    """``DPAggregator.clipped_sum`` per unit against ``_unit_reference``; returns the ``ClippedSum``."""
    x, y = _xy(len(unit_ids))
    net = _net()
    aggregator = peg.dp.DPAggregator(l2_norm_clip=CLIP, noise_multiplier=0.0, physical_batch_size=physical_batch_size)
    losses = lambda rows, predictions: sparse_ce(rows["y"], predictions)  # noqa: E731
    clipped = aggregator.clipped_sum(
        net, sparse_ce, x, y, BATCH_WEIGHTS, unit_ids=unit_ids, rows_per_unit=3, outputs=losses
    )
    expected, magnitude = _unit_reference(net, x, y, unit_ids, BATCH_WEIGHTS)
    p = sum(int(np.prod(v.shape)) for v in net.trainable_variables)
    rtol = clipped_sum_rtol(p, len(unit_ids)) + 2 * norm_rtol(p) + rounding_rtol(3)  # the factor's norm sums 3 rows
    for got, want, mag in zip(clipped.sums, expected, magnitude):
        assert_close(tf.convert_to_tensor(got).numpy(), want, atol=rtol * mag + EPS32 * np.abs(want))
    # Per unit: 5 real units (the padding forms no real one), their norms before clipping.
    real = clipped.real.numpy()
    assert real.sum() == 5
    assert np.all(clipped.norms.numpy()[real > 0] > 0)
    # ``outputs`` (a training step's losses) kept per computed row, in the rows' order, chunked or not (a row of
    # weight 0 may read another row's predictions in chunks: ``_whole_unit_chunks``)
    rows = np.arange(len(unit_ids)) if clipped.rows is None else clipped.rows.numpy()
    real_rows = BATCH_WEIGHTS[rows] > 0
    logits = net(x[rows]).numpy()
    # two float32 forward passes (4 + 1 and 6 + 1 terms, a tanh) and log-sum-exp of 3, relative to the logits
    forward = rounding_rtol(4 + 1 + 1 + 6 + 1 + 3)
    want = sparse_ce(y[rows], logits).numpy()
    assert_close(clipped.predictions.numpy()[real_rows], want[real_rows], atol=forward * (1 + np.abs(logits).max()))
    return clipped


def test_removing_a_unit_changes_the_clipped_sum_by_at_most_c():
    x, y = _xy(len(BATCH_IDS))
    x[3] *= 50.0  # unit 9, one row with a large gradient
    net = _net()
    aggregator = peg.dp.DPAggregator(l2_norm_clip=CLIP, noise_multiplier=0.0)
    full = aggregator.clipped_sum(net, sparse_ce, x, y, BATCH_WEIGHTS, unit_ids=BATCH_IDS, rows_per_unit=3).sums
    p = sum(int(np.prod(v.shape)) for v in net.trainable_variables)
    for unit in (4, 9, 12):
        keep = BATCH_IDS != unit
        without = aggregator.clipped_sum(
            net, sparse_ce, x[keep], y[keep], BATCH_WEIGHTS[keep], unit_ids=BATCH_IDS[keep], rows_per_unit=3
        ).sums
        change = np.sqrt(
            sum(
                np.sum((tf.convert_to_tensor(a).numpy() - tf.convert_to_tensor(b).numpy()) ** 2)
                for a, b in zip(full, without)
            )
        )
        assert change <= CLIP * (1 + norm_rtol(p)) + clipped_sum_rtol(p, len(BATCH_IDS)) * 5 * CLIP


def test_private_gradients_with_units_is_the_clipped_unit_sum_over_q_u():
    x, y = _xy(len(BATCH_IDS))
    net = _net()
    dense = np.unique(BATCH_IDS, return_inverse=True)[1]
    grads = peg.dp.private_gradients(
        net,
        sparse_ce,
        x,
        y,
        l2_norm_clip=CLIP,
        noise_multiplier=0.0,
        sample_weight=BATCH_WEIGHTS,
        unit_ids=dense,
        expected_batch_size=2.5,
    )
    expected, magnitude = _unit_reference(net, x, y, BATCH_IDS, BATCH_WEIGHTS)
    p = sum(int(np.prod(v.shape)) for v in net.trainable_variables)
    rtol = clipped_sum_rtol(p, len(BATCH_IDS)) + 2 * norm_rtol(p) + rounding_rtol(3) + EPS32
    for got, want, mag in zip(grads, expected, magnitude):
        assert_close(got.numpy(), want / 2.5, atol=rtol * mag / 2.5 + EPS32 * np.abs(want))
    with pytest.raises(ValueError, match="unit_ids needs expected_batch_size"):
        peg.dp.private_gradients(net, sparse_ce, x, y, l2_norm_clip=CLIP, noise_multiplier=1.0, unit_ids=dense)


@pytest.mark.slow
def test_keras_hub_gpt2_trains_a_step_per_user():
    from per_example_grads.apps import zoo
    from per_example_grads.data.text import VOCABULARY_SIZE, byte_tokens, reviews

    t, users, per_user = 8, 6, 3
    texts, _ = reviews(users * per_user, seed=1)
    ids, mask = byte_tokens(texts, seq_len=t + 1)
    x, y = {"token_ids": ids[:, :t], "padding_mask": mask[:, :t]}, ids[:, 1:]
    author = np.repeat(np.arange(users), per_user)  # a user's texts are rows of one unit
    model = zoo.build_model(
        "gpt2_lm", vocabulary_size=VOCABULARY_SIZE, seq_len=t, num_layers=1, hidden_dim=16, intermediate_dim=32
    )
    before = [v.numpy().copy() for v in model.trainable_variables]
    dp = peg.keras.DPModel(model, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0, privacy_unit="unit")
    dp.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
    )
    data = poisson_batches(x, y, unit_ids=author, rows_per_unit=2, sampling_probability=0.5, steps=1, seed=0)
    history = dp.fit(data, verbose=0)
    assert int(dp.dp_steps.numpy()) == 1 and dp.num_examples == users
    assert np.isfinite(history.history["loss"]).all()
    assert all(not np.array_equal(v.numpy(), b) for v, b in zip(model.trainable_variables, before))
    assert dp.epsilon(1e-2, accountant="rdp") == pytest.approx(
        _dp_accounting_epsilon("rdp", 0.5, 1.0, 1, 1e-2), rel=ACCOUNTING_SAME_RTOL
    )


def test_dp_model_per_unit_refuses_xla():
    dp = _unit_dp()
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert dp.jit_compile is False  # "auto" resolves to no XLA per unit
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    x, y = _xy()
    with pytest.raises(ValueError, match=r"privacy_unit='unit' cannot be combined with XLA \(jit_compile=True\)"):
        dp.fit(poisson_batches(x, y, unit_ids=np.arange(N_ROWS) // 4, sampling_probability=Q), verbose=0)


# ---------------------------------------------------------------------------
# Units from a tf.data source, units kept whole however the rows are laid out
# ---------------------------------------------------------------------------

from per_example_grads.dp.sampling import poisson_batches_from_dataset  # noqa: E402


def _user_of(features, label):
    return features["user"]


@pytest.mark.slow
@pytest.mark.parametrize("unit_ids", ["user", _user_of])
def test_from_dataset_reads_each_rows_unit_from_the_row(unit_ids):
    x = np.arange(ROWS, dtype="float32")[:, None]  # each row's own index
    source = tf.data.Dataset.from_tensor_slices(({"row": x, "user": IDS}, np.arange(ROWS)))
    ds = poisson_batches_from_dataset(
        source, ROWS, unit_ids=unit_ids, rows_per_unit=3, sampling_probability=0.3, steps=4, seed=7
    )
    kept = {"row": x} if unit_ids == "user" else {"row": x, "user": IDS}  # a named feature is taken out of x
    same = poisson_batches(
        kept, np.arange(ROWS), unit_ids=IDS, rows_per_unit=3, sampling_probability=0.3, steps=4, seed=7
    )
    got, want = ds.pegrad_sampling, same.pegrad_sampling
    assert (got.num_examples, got.num_rows, got.rows_per_unit, got.max_batch_size, got.privacy_unit) == (
        U,
        ROWS,
        3,
        want.max_batch_size,
        "unit",
    )
    for (xb, yb, mask, ids), (xs, ys, ms, idss) in zip(ds, same):
        assert set(xb) == set(kept)
        b = int(mask.numpy().sum())
        rows = xb["row"].numpy()[:b, 0].astype(int)
        np.testing.assert_array_equal(ids.numpy()[:b], IDS[rows])  # each row's id is its own, read from it
        np.testing.assert_array_equal(yb.numpy()[:b], rows)
        assert np.all(np.unique(ids.numpy()[:b], return_counts=True)[1] <= 3)
        for a, c in zip(tf.nest.flatten((xb, yb, mask, ids)), tf.nest.flatten((xs, ys, ms, idss))):
            np.testing.assert_array_equal(a.numpy(), c.numpy())  # the in-memory sampler's batches


@pytest.mark.parametrize(
    "unit_ids, error, match",
    [
        (IDS[:6], TypeError, "An array of ids beside a dataset cannot be checked"),
        (
            "author",
            ValueError,
            r"unit_ids='author' names no feature of the dataset's x; its features: \['row', 'user'\]",
        ),
        (lambda f, _y: tf.cast(f["user"], tf.float32), TypeError, "unit_ids must give each element one integer id"),
        (lambda f, _y: f["user"][None], ValueError, r"one scalar id \(shape \[\]\); got shape \(1,\)"),
        (None, ValueError, "rows_per_unit=2 needs unit_ids"),
    ],
)
def test_from_dataset_refuses_unit_ids_it_cannot_read_per_row(unit_ids, error, match):
    source = tf.data.Dataset.from_tensor_slices(({"row": np.ones((6, 1), "float32"), "user": IDS[:6]}, np.arange(6)))
    with pytest.raises(error, match=match):
        poisson_batches_from_dataset(source, unit_ids=unit_ids, rows_per_unit=2, sampling_probability=0.5)


# The rows of units 4 and 12 interleaved with others: the ids of one unit need not be consecutive.
INTERLEAVED = np.array([4, 12, 9, 4, 11, 12, 4, 20, 11, 12, -1, -1])


@pytest.mark.parametrize("physical_batch_size", [None, pytest.param(3, marks=pytest.mark.slow)])
def test_units_whose_rows_are_not_consecutive_are_clipped_whole(physical_batch_size):
    clipped = _assert_step_clips_each_unit_whole(INTERLEAVED, physical_batch_size)
    assert clipped.real.numpy().sum() == 5  # 4, 12, 9, 11, 20: each one unit


def test_accumulator_per_unit_equals_the_one_unit_loop_and_refuses_a_cut_unit():
    x, y = _xy(len(BATCH_IDS))
    net = _net()
    acc = peg.dp.GradientAccumulator(
        net, sparse_ce, l2_norm_clip=CLIP, noise_multiplier=0.0, expected_batch_size=2.5, privacy_unit="unit"
    )
    for part in (slice(0, 4), slice(4, 9), slice(9, 12)):  # whole units: [4 4 4 9], [11 11 12 12 12], [20 -1 -1]
        acc.accumulate(x[part], y[part], BATCH_WEIGHTS[part], unit_ids=BATCH_IDS[part])
    assert float(acc.count.numpy()) == 5  # units
    expected, magnitude = _unit_reference(net, x, y, BATCH_IDS, BATCH_WEIGHTS)
    p = sum(int(np.prod(v.shape)) for v in net.trainable_variables)
    rtol = clipped_sum_rtol(p, len(BATCH_IDS)) + 2 * norm_rtol(p) + rounding_rtol(3) + EPS32
    for got, want, mag in zip(acc.result(), expected, magnitude):
        assert_close(got.numpy(), want / 2.5, atol=rtol * mag / 2.5 + EPS32 * np.abs(want))
    acc.reset()
    acc.accumulate(x[:2], y[:2], unit_ids=BATCH_IDS[:2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="unit_ids: units with rows in an earlier micro-batch"):
        acc.accumulate(x[2:4], y[2:4], unit_ids=BATCH_IDS[2:4])  # unit 4's third row: it would be clipped twice
    with pytest.raises(ValueError, match="needs the unit_ids of every micro-batch"):
        acc.accumulate(x, y)
    plain = peg.dp.GradientAccumulator(net, sparse_ce, l2_norm_clip=CLIP, noise_multiplier=0.0, expected_batch_size=1.0)
    with pytest.raises(ValueError, match=r"unit_ids needs GradientAccumulator\(..., privacy_unit='unit'\)"):
        plain.accumulate(x, y, unit_ids=BATCH_IDS)
    with pytest.raises(ValueError, match=r"privacy_unit='unit' cannot be combined with plain mode \(no l2_norm_clip\)"):
        peg.dp.GradientAccumulator(net, sparse_ce, privacy_unit="unit")


@pytest.mark.slow
def test_nonfinite_warning_counts_units():
    x, y = _xy()
    x[5] = np.nan
    dp = _unit_dp(seed=0)
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = poisson_batches(x, y, unit_ids=np.arange(N_ROWS) // 4, sampling_probability=1.0, steps=1, seed=0)
    with pytest.warns(RuntimeWarning, match=r"^1 unit\(s\) in an epoch had a NaN or Inf gradient"):
        history = dp.fit(data, verbose=0)
    assert history.history["nonfinite_examples"] == [1.0]  # one unit (rows 4..7), not its 4 rows


@pytest.mark.slow
def test_unit_ids_of_another_length_are_refused_when_shapes_are_known_only_when_run():
    net, aggregator = _net(), peg.dp.DPAggregator(l2_norm_clip=CLIP, noise_multiplier=0.0)
    specs = [tf.TensorSpec([None, 4]), tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)]
    step = tf.function(
        lambda x, y, ids: aggregator.clipped_sum(net, sparse_ce, x, y, unit_ids=ids).sums, autograph=False
    )
    step = step.get_concrete_function(*specs)
    x, y = _xy(3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"unit_ids must have shape \[B\]"):
        step(x, y, np.array([0, 1]))


# -- example-level sampling, accounted per user (accounting.user_level_event) ------------------------------


@pytest.mark.slow  # three mixture-of-Gaussians PLDs (seconds each)
def test_an_example_level_run_is_accounted_per_user_across_fits_and_a_restore(tmp_path):
    # Rows sampled and clipped one by one; users of at most 2 rows. The reference: dp_accounting's PLD of the
    # two fits' mixtures, built here from scipy's binomial law, composed.
    import dp_accounting
    import keras
    from dp_accounting.dp_event import MixtureOfGaussiansDpEvent
    from dp_accounting.pld import PLDAccountant
    from scipy import stats

    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 3, 200).astype("int64")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dp_model():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=2.0, seed=0)
        dp.compile(optimizer="sgd", loss=loss)
        return dp

    dp = dp_model()
    dp.fit(poisson_batches(x, y, sampling_probability=0.02, steps=3, seed=0), verbose=0)
    dp.save_weights(tmp_path / "run.weights.h5")
    restored = dp_model()  # a new process's DPModel, continuing the run at another q
    restored.load_weights(tmp_path / "run.weights.h5")
    restored.fit(poisson_batches(x, y, sampling_probability=0.01, steps=2, seed=1), verbose=0)

    def mixture(q, steps):
        law = stats.binom.pmf(np.arange(3), 2, q)
        return dp_accounting.SelfComposedDpEvent(MixtureOfGaussiansDpEvent(2.0, [0.0, 1.0, 2.0], list(law)), steps)

    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    both = dp_accounting.ComposedDpEvent([mixture(0.02, 3), mixture(0.01, 2)])
    expected = PLDAccountant(neighboring_relation=relation).compose(both).get_epsilon(1e-5)
    per_user = restored.epsilon(1e-5, rows_per_user=2)
    assert per_user == pytest.approx(expected, rel=1e-9)  # the binomial's weights rounded apart
    assert per_user > restored.epsilon(1e-5)  # two rows of one user cost more than one row
    # RDP: the dominating Poisson-sampled Gaussians, q' = 1 - (1 - q)^2 at sigma / 2, built here
    dominating = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(1 - (1 - q) ** 2, dp_accounting.GaussianDpEvent(1.0)), steps
            )
            for q, steps in ((0.02, 3), (0.01, 2))
        ]
    )
    rdp = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation).compose(dominating).get_epsilon(1e-5)
    assert restored.epsilon(1e-5, rows_per_user=2, accountant="rdp") == pytest.approx(rdp, rel=1e-9)
    with pytest.raises(ValueError, match="rows_per_user must be a positive integer"):
        restored.epsilon(1e-5, rows_per_user=0)
