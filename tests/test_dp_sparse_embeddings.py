"""Sparse embedding noise (``per_example_grads.dp.sparse_embeddings``): selection, release, accounting.

Every check is against an independent reference: per-example contribution
vectors built with Python sets, the dense clipped sums of
``peg.clipped_gradients``, the Gaussian tail ``Phi((k - tau) / sigma_sel)``
and dp-accounting called directly on the composed Gaussian mechanism.
Statistical checks allow ``Z`` standard errors (``tests/tolerances.py``).
"""

from __future__ import annotations

import math
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting.rdp import RdpAccountant

import per_example_grads as peg
from helpers import sparse_ce
from per_example_grads.dp import sparse_embeddings as sparse_module
from per_example_grads.dp.sparse_embeddings import SparseEmbeddings, bernoulli_positions, noise_multipliers
from tolerances import ACCOUNTING_COMPOSED_RTOL, EPS32, Z, clipped_sum_rtol, sgd_steps_atol

B, T = 16, 6


def _bag(vocab=50, dim=4, mask_zero=False, classes=2):
    return keras.Sequential(
        [
            keras.Input((T,), dtype="int32"),
            keras.layers.Embedding(vocab, dim, mask_zero=mask_zero),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(classes),
        ]
    )


def _two_tables(v1=30, v2=40, dim=8):
    """A masked Embedding on input ``a`` and an untied ReversibleEmbedding (lookup and output projection) on ``b``."""
    a, b = keras.Input((T,), dtype="int32", name="a"), keras.Input((3,), dtype="int32", name="b")
    first = keras.layers.Embedding(v1, dim, mask_zero=True, name="first")
    second = keras.layers.ReversibleEmbedding(v2, dim, tie_weights=False, name="second")
    h = keras.layers.GlobalAveragePooling1D()(first(a)) + keras.layers.GlobalAveragePooling1D()(second(b))
    return keras.Model({"a": a, "b": b}, second(h, reverse=True)), first, second


def _ids(rng, vocab, rows=B, width=T):
    return rng.integers(0, vocab, (rows, width)).astype("int32")


def _bound(model, sigma=1.0, **settings):
    return SparseEmbeddings(**settings).bind(model, model.trainable_variables, noise_multiplier=sigma)


# -- accounting ----------------------------------------------------------------


def test_noise_split_composes_to_sigma_so_epsilon_is_dp_sgds():
    sigma, q, steps, delta = 1.3, 0.01, 300, 1e-5
    for share in (0.05, 0.1, 0.5, 0.9):
        s, g = noise_multipliers(sigma, share)
        assert math.isclose(1 / s**2 + 1 / g**2, 1 / sigma**2, rel_tol=1e-14)
    # The pair as one Gaussian mechanism on the rescaled concatenation: multiplier (s^-2 + g^-2)^-1/2.
    s, g = noise_multipliers(sigma, 0.1)
    composed = (s**-2 + g**-2) ** -0.5
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(composed)), steps
    )
    direct = (
        RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        .compose(event)
        .get_epsilon(delta)
    )
    dense = peg.dp.PrivacyAccountant(sigma, q, accountant="rdp")
    dense.step(steps)
    assert math.isclose(dense.epsilon(delta), direct, rel_tol=ACCOUNTING_COMPOSED_RTOL)


# -- contributions --------------------------------------------------------------


def _reference_contributions(a, b, real, offset_a, offset_b):
    """Per example, its vector of 1/sqrt(|U_n|) on its distinct keys (``offset + id``; id 0 of the masked table left out)."""
    out = []
    for n in range(len(a)):
        keys = ({offset_a + int(i) for i in a[n] if i != 0} | {offset_b + int(i) for i in b[n]}) if real[n] else set()
        out.append({k: 1 / math.sqrt(len(keys)) for k in keys})
    return out


@pytest.mark.parametrize("dense_counts", [True, False], ids=["dense_vector", "hashed_keys"])
def test_counts_have_sensitivity_one_for_adversarial_examples(dense_counts, monkeypatch):
    """Both ways of summing the counts: one ``[total]`` vector (small tables) and ``tf.unique`` of the keys."""
    if not dense_counts:
        monkeypatch.setattr(sparse_module, "DENSE_COUNTS", 0)
    model, first, second = _two_tables()
    sel = _bound(model)
    rng = np.random.default_rng(0)
    a, b = _ids(rng, 30, 8), _ids(rng, 40, 8, 3)
    a[0], b[0] = 7, 7  # all the same id, in both tables (distinct keys: one per table)
    a[1], b[1] = np.arange(1, T + 1), [0, 1, 2]  # all distinct
    a[2], b[2] = 0, 5  # only padding in the masked table
    a[3, :3] = 0  # some padding
    real = np.array([1, 1, 1, 1, 1, 1, 0, 1], "float32")  # row 6: a Poisson batch's padding row
    offset = {layer.name: int(o) for layer, o in zip(sel.layers, sel.offsets)}
    want = _reference_contributions(a, b, real, offset["first"], offset["second"])
    keys, counts = sel.contribution_counts({"a": tf.constant(a), "b": tf.constant(b)}, tf.constant(real))
    got = dict(zip(keys.numpy().tolist(), counts.numpy().tolist()))
    total = {}
    for c in want:
        for k, w in c.items():
            total[k] = total.get(k, 0.0) + w
    assert set(got) == set(total)
    for k in total:
        assert math.isclose(got[k], total[k], rel_tol=8 * EPS32)
    # Each example's own vector (a batch of one), against its reference; its norm is 1 (0 for the padding row).
    for n in range(len(a)):
        k1, c1 = sel.contribution_counts(
            {"a": tf.constant(a[n : n + 1]), "b": tf.constant(b[n : n + 1])}, tf.constant(real[n : n + 1])
        )
        norm = float(np.linalg.norm(c1.numpy()))
        assert norm <= 1 + 4 * EPS32
        assert math.isclose(norm, 1.0 if real[n] else 0.0, abs_tol=4 * EPS32)
        assert dict(zip(k1.numpy().tolist(), c1.numpy().tolist())).keys() == want[n].keys()


# -- selection ------------------------------------------------------------------


def test_selection_frequency_matches_the_gaussian_tail():
    vocab = 200_000
    model = keras.Sequential(
        [keras.Input((1,), dtype="int32"), keras.layers.Embedding(vocab, 1), keras.layers.Flatten()]
    )
    sel = _bound(model, sigma=1.0, selection_share=0.5, false_positive_rate=0.01)
    s, tau = sel.selection_noise_multiplier, sel.threshold
    assert math.isclose(0.5 * math.erfc(tau / s / math.sqrt(2)), 0.01, rel_tol=1e-9)
    n = 3000
    keys = tf.range(2 * n, dtype=tf.int64)
    counts = tf.concat([tf.fill([n], 3.0), tf.fill([n], 5.0)], 0)
    chosen = set(sel.selected_rows(keys, counts, tf.constant([1, 2], tf.int64), 0)[0].numpy().tolist())
    untouched = vocab - 2 * n
    for k, rows in ((3.0, range(n)), (5.0, range(n, 2 * n)), (0.0, None)):
        p = 0.5 * math.erfc((tau - k) / s / math.sqrt(2))  # Phi((k - tau) / sigma_sel)
        trials = n if rows is not None else untouched
        hits = sum(r in chosen for r in rows) if rows is not None else sum(r >= 2 * n for r in chosen)
        assert abs(hits - trials * p) <= Z * math.sqrt(trials * p * (1 - p)), (k, hits, trials * p)


def test_bernoulli_positions_are_distinct_in_range_and_binomial():
    n, p = 1_000_000, 1e-3
    got = bernoulli_positions(n, p, tf.constant([3, 4], tf.int64)).numpy()
    assert np.all(np.diff(got) > 0) and got.min() >= 0 and got.max() < n
    assert abs(len(got) - n * p) <= Z * math.sqrt(n * p * (1 - p))
    # Uniform over the range: the halves' counts are binomial(len, 1/2).
    half = int(np.sum(got < n // 2))
    assert abs(half - len(got) / 2) <= Z * math.sqrt(len(got) / 4)


# -- the release -----------------------------------------------------------------


def test_selected_rows_get_the_clipped_sum_plus_gradient_noise_and_others_nothing():
    rng = np.random.default_rng(1)
    vocab, dim, clip, sigma = 200, 64, 0.5, 1.0
    model = _bag(vocab, dim, classes=16)
    x, y = _ids(rng, 40), rng.integers(0, 16, B)  # ids below 40: the rest of the table is never looked up
    agg = peg.dp.DPAggregator(l2_norm_clip=clip, noise_multiplier=sigma, seed=3)
    agg.sparse = _bound(model, sigma, threshold=1.0)  # low: many rows selected, looked up or not
    clipped = agg.clipped_sum(model, sparse_ce, x, y)
    table, kernel, _ = agg.release(clipped, 1.0)
    ref_table, ref_kernel, _ = [
        tf.convert_to_tensor(g).numpy() for g in peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip)
    ]
    assert isinstance(table, tf.IndexedSlices)
    rows = table.indices.numpy()
    assert np.all(np.diff(rows) > 0)
    assert 40 < len(rows) < vocab  # false positives among the never-looked-up rows, but not every row
    std = agg.sparse.gradient_noise_multiplier * clip
    for noise in (table.values.numpy() - ref_table[rows], kernel.numpy() - ref_kernel):
        n = noise.size
        assert abs(noise.mean()) <= Z * std / math.sqrt(n)
        assert abs(noise.std() - std) <= Z * std / math.sqrt(2 * n)
    # Applied with plain SGD: the other rows are not written at all.
    before = model.layers[0].embeddings.numpy()
    keras.optimizers.SGD(1.0).apply_gradients([(table, model.layers[0].embeddings)])
    after = model.layers[0].embeddings.numpy()
    unselected = np.setdiff1d(np.arange(vocab), rows)
    np.testing.assert_array_equal(after[unselected], before[unselected])
    assert np.all(np.any(after[rows] != before[rows], axis=1))


def test_untied_reversible_embedding_rows_are_sparse_and_its_projection_dense():
    model, first, second = _two_tables()
    rng = np.random.default_rng(2)
    x = {"a": _ids(rng, 30), "b": _ids(rng, 40, width=3)}
    y = rng.integers(0, 40, B)
    agg = peg.dp.DPAggregator(l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
    agg.sparse = _bound(model, 0.0)
    grads = agg.release(agg.clipped_sum(model, sparse_ce, x, y), 1.0)
    ref = [tf.convert_to_tensor(g).numpy() for g in peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0)]
    by_var = {id(v): (g, r) for v, g, r in zip(model.trainable_variables, grads, ref)}
    for table, ids in ((first.embeddings, x["a"]), (second.embeddings, x["b"])):
        g, r = by_var[id(table)]
        assert isinstance(g, tf.IndexedSlices)
        looked_up = np.unique(ids[ids != 0]) if table is first.embeddings else np.unique(ids)
        np.testing.assert_array_equal(g.indices.numpy(), looked_up)  # without noise: exactly the rows looked up
        np.testing.assert_allclose(
            g.values.numpy(), r[looked_up], rtol=0, atol=clipped_sum_rtol(1, B) * np.abs(r).max() + 1e-30
        )
    g, r = by_var[id(second.reverse_embeddings)]
    assert not isinstance(g, tf.IndexedSlices)


# -- the DP step: chunks, Poisson padding, distribution, refusals -----------------


@pytest.mark.slow
def test_physical_chunks_and_poisson_padding_give_the_same_release():
    rng = np.random.default_rng(4)
    x, y = _ids(rng, 50, 24), rng.integers(0, 2, 24)
    weights = (rng.random(24) < 0.6).astype("float32")  # a padded Poisson batch: weight-0 rows
    model = _bag()
    sparse = _bound(model, 1.0, selection_share=0.5, threshold=1.5)  # low enough that some rows are selected
    out = []
    for chunk in (None, 4):
        agg = peg.dp.DPAggregator(l2_norm_clip=0.5, noise_multiplier=1.0, seed=5, physical_batch_size=chunk)
        agg.sparse = sparse
        out.append(agg.release(agg.clipped_sum(model, sparse_ce, x, y, weights), 8.0))
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    for one, chunked in zip(*out):
        if isinstance(one, tf.IndexedSlices):  # the same rows (the counts do not depend on chunks), the same noise
            np.testing.assert_array_equal(one.indices.numpy(), chunked.indices.numpy())
            one, chunked = one.values, chunked.values
        scale = 0.5 * 24 / 8 + 5 * 0.5 * 1.0 / 8  # the clipped sum's terms and the noise, over the divisor
        np.testing.assert_allclose(chunked.numpy(), one.numpy(), rtol=0, atol=clipped_sum_rtol(p, 24) * scale)
    # Padding rows look nothing up: the counts are those of the real rows alone.
    keys, counts = sparse.contribution_counts(tf.constant(x), tf.constant(weights))
    real_keys, real_counts = sparse.contribution_counts(tf.constant(x[weights > 0]), tf.ones([int(weights.sum())]))
    np.testing.assert_array_equal(np.sort(keys.numpy()), np.sort(real_keys.numpy()))


def test_epsilon_is_dense_dp_sgds_for_the_same_sigma_q_and_steps():
    dps = [
        peg.keras.DPModel(_bag(), noise_multiplier=1.1, num_examples=1000, expected_batch_size=50, sparse_embeddings=s)
        for s in (SparseEmbeddings(), None)
    ]
    for dp in dps:
        for _ in range(40):
            dp.aggregator.record_step(0.05)
    assert dps[0].epsilon(1e-5, accountant="rdp") == dps[1].epsilon(1e-5, accountant="rdp")


@pytest.mark.slow
def test_fit_under_mirrored_strategy_without_noise_is_the_clipped_mean_on_the_looked_up_rows():
    from helpers import mirrored_strategy

    strategy = mirrored_strategy()
    rng = np.random.default_rng(6)
    x, y = _ids(rng, 50, B), rng.integers(0, 2, B)
    with strategy.scope():
        model = _bag()
        start = model.get_weights()
        dp = peg.keras.DPModel(
            model,
            l2_norm_clip=0.5,
            noise_multiplier=0.0,
            seed=5,
            num_examples=B,
            expected_batch_size=B,
            sparse_embeddings=SparseEmbeddings(),
        )
        dp.compile(
            optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        with pytest.warns(UserWarning, match="fixed-size batches"):
            dp.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)  # one step, 8 rows per replica
    reference = _bag()
    reference.set_weights(start)
    ref = [tf.convert_to_tensor(g).numpy() for g in peg.clipped_gradients(reference, sparse_ce, x, y, l2_norm_clip=0.5)]
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    for got, w0, g in zip(model.get_weights(), start, ref):  # one SGD(0.5) step of the clipped sum over B
        atol = sgd_steps_atol(1, 0.5, clipped_sum_rtol(p, B), 0.5, np.abs(w0) + 1.0)
        np.testing.assert_allclose(got, w0 - 0.5 * g / B, rtol=0, atol=float(np.max(atol)))
    untouched = np.setdiff1d(np.arange(50), np.unique(x))
    np.testing.assert_array_equal(model.layers[0].embeddings.numpy()[untouched], start[0][untouched])


@pytest.mark.slow
def test_a_regularized_table_stays_dense_by_default_and_keeps_its_regularizer_gradient():
    # By default it was updated sparsely, and its regularizer's gradient (on every row) was dropped.
    def model():
        keras.utils.set_random_seed(0)
        a, b = keras.Input((T,), dtype="int32", name="a"), keras.Input((T,), dtype="int32", name="b")
        plain = keras.layers.Embedding(30, 4, name="plain")
        decayed = keras.layers.Embedding(30, 4, embeddings_regularizer=keras.regularizers.L2(0.5), name="decayed")
        h = keras.layers.GlobalAveragePooling1D()(plain(a)) + keras.layers.GlobalAveragePooling1D()(decayed(b))
        return keras.Model({"a": a, "b": b}, keras.layers.Dense(2)(h))

    rng = np.random.default_rng(0)
    x, y = {"a": _ids(rng, 30), "b": _ids(rng, 30)}, rng.integers(0, 2, B)
    assert [l.name for l in _bound(model()).layers] == ["plain"]
    net = model()
    with pytest.raises(ValueError, match="'decayed' has a regularizer"):
        SparseEmbeddings(tables=[net.get_layer("decayed")]).bind(net, net.trainable_variables, noise_multiplier=1.0)
    tables = []
    for sparse in (SparseEmbeddings(), None):
        net = model()
        dp = peg.keras.DPModel(net, noise_multiplier=0.0, num_examples=B, sparse_embeddings=sparse)
        dp.compile(
            optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # fixed-size batches
            dp.fit(x, y, batch_size=B, verbose=0)
        tables.append(net.get_layer("decayed").embeddings.numpy())
    # The same update as the dense step's: the clipped mean plus 2 * 0.5 * table on every row.
    np.testing.assert_allclose(tables[0], tables[1], rtol=0, atol=4 * EPS32 * np.abs(tables[1]).max())


def test_refused_combinations_say_why():
    model = _bag()
    make = lambda **kw: peg.keras.DPModel(model, noise_multiplier=1.0, sparse_embeddings=SparseEmbeddings(), **kw)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"sparse_embeddings cannot be combined with a correlated mechanism \(BandMF\)"
    ):
        make(mechanism=peg.dp.BandMF(bands=2, num_steps=8))
    with pytest.raises(ValueError, match="sparse_embeddings cannot be combined with adaptive_clipping"):
        make(adaptive_clipping=peg.dp.AdaptiveClipping())
    tied = keras.Sequential([keras.Input((T,), dtype="int32"), keras.layers.ReversibleEmbedding(20, 4)])
    with pytest.raises(ValueError, match="ties its table"):
        SparseEmbeddings(tables=[tied.layers[0]]).bind(tied, tied.trainable_variables, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="no Embedding"):
        SparseEmbeddings().bind(tied, tied.trainable_variables, noise_multiplier=1.0)

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.table, self.head = keras.layers.Embedding(20, 4), keras.layers.Dense(2)

        def call(self, x):
            return self.head(keras.ops.mean(self.table(x), axis=1))

    sub = Subclassed()
    sub(np.zeros((1, T), "int32"))
    with pytest.raises(ValueError, match="ids_fn"):
        SparseEmbeddings().bind(sub, sub.trainable_variables, noise_multiplier=1.0)
    SparseEmbeddings(ids_fn=lambda x: [x]).bind(sub, sub.trainable_variables, noise_multiplier=1.0)
    for bad in (
        dict(selection_share=0.0),
        dict(selection_share=1.0),
        dict(threshold=-1.0),
        dict(false_positive_rate=0.7),
    ):
        with pytest.raises(ValueError):
            SparseEmbeddings(**bad)
    with pytest.raises(TypeError, match="SparseEmbeddings"):
        peg.keras.DPModel(_bag(), noise_multiplier=1.0, sparse_embeddings={"threshold": 2})
    dp = peg.keras.DPModel(_bag(), noise_multiplier=1.0, sparse_embeddings=SparseEmbeddings(), num_examples=B)
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    with pytest.raises(ValueError, match=r"sparse_embeddings cannot be combined with XLA \(jit_compile=True\)"):
        dp.fit(np.zeros((B, T), "int32"), np.zeros(B), batch_size=B, verbose=0)


def test_defaults_split_the_budget_equally_and_select_untouched_rows_at_1e_3():
    sel = _bound(_bag(), sigma=1.3)
    assert math.isclose(sel.selection_noise_multiplier, 1.3 * math.sqrt(2), rel_tol=1e-12)
    assert math.isclose(sel.gradient_noise_multiplier, 1.3 * math.sqrt(2), rel_tol=1e-12)
    p0 = 0.5 * math.erfc(sel.threshold / sel.selection_noise_multiplier / math.sqrt(2))
    assert math.isclose(p0, 1e-3, rel_tol=1e-9) and math.isclose(sel.false_positive_rate, 1e-3, rel_tol=1e-9)


# -- GradientAccumulator -------------------------------------------------------


@pytest.mark.slow
def test_accumulated_release_over_micro_batches_equals_the_one_batch_release(tmp_path):
    rng = np.random.default_rng(7)
    x, y = _ids(rng, 10), rng.integers(0, 2, B)  # rows 0-9 of 50 looked up: most selected
    results, models = [], []
    for splits in ([B], [5, 6, 5]):
        keras.utils.set_random_seed(0)
        model = _bag()

        def make():
            return peg.dp.GradientAccumulator(
                model,
                sparse_ce,
                l2_norm_clip=0.5,
                noise_multiplier=0.5,
                expected_batch_size=B,
                seed=3,
                sparse_embeddings=SparseEmbeddings(),
            )

        acc = make()
        start = 0
        for k, n in enumerate(splits):
            if k == 2:  # the lookup counts so far are saved and restored with the sums
                path = tf.train.Checkpoint(acc=acc).write(str(tmp_path / "acc"))
                acc = make()
                tf.train.Checkpoint(acc=acc).read(path).assert_consumed()
            acc.accumulate(x[start : start + n], y[start : start + n])
            start += n
        results.append(acc.result())
        assert int(acc.steps.numpy()) == 1  # one release: the ledger, hence epsilon, is the one-batch one's
        assert acc.epsilon(1e-5) == peg.dp.compute_epsilon(B, B, None, 0.5, 1e-5, steps=1)  # DP-SGD's at sigma
        models.append(model)
    one, many = results
    assert isinstance(one[0], tf.IndexedSlices) and isinstance(many[0], tf.IndexedSlices)
    np.testing.assert_array_equal(one[0].indices.numpy(), many[0].indices.numpy())
    assert 0 < len(one[0].indices) < 50
    for a, b in zip(one, many):
        a, b = tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy()
        tol = clipped_sum_rtol(210, B)  # 210 parameters; the sums are at most B C / B = C
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * 0.5)
    # rows outside the selection get exactly nothing
    dense = tf.convert_to_tensor(many[0]).numpy()
    unselected = np.setdiff1d(np.arange(50), one[0].indices.numpy())
    assert np.all(dense[unselected] == 0)
    model = models[1]
    before = model.trainable_variables[0].numpy()
    keras.optimizers.SGD(0.1).apply_gradients(zip(many, model.trainable_variables))
    after = model.trainable_variables[0].numpy()
    np.testing.assert_array_equal(after[unselected], before[unselected])
    assert np.all(after[one[0].indices.numpy()] != before[one[0].indices.numpy()])


def test_accumulator_refuses_sparse_embeddings_it_cannot_run():
    model = _bag()
    with pytest.raises(ValueError, match="sparse_embeddings cannot be combined with privacy_unit='unit'"):
        peg.dp.GradientAccumulator(
            model,
            sparse_ce,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            expected_batch_size=B,
            privacy_unit="unit",
            sparse_embeddings=SparseEmbeddings(),
        )
    with pytest.raises(ValueError, match=r"sparse_embeddings cannot be combined with plain mode \(no l2_norm_clip\)"):
        peg.dp.GradientAccumulator(model, sparse_ce, sparse_embeddings=SparseEmbeddings())
    with pytest.raises(TypeError, match="SparseEmbeddings"):
        peg.dp.GradientAccumulator(
            model, sparse_ce, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=B, sparse_embeddings=True
        )
