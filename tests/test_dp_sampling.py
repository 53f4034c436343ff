"""Poisson batches and physical chunks: distribution, shapes, padding, seeds, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

from helpers import assert_close
from per_example_grads.dp.sampling import (
    PhysicalChunk,
    default_max_batch_size,
    physical_chunks,
    physical_chunks_dataset,
    poisson_batches,
    poisson_batches_from_dataset,
)
from tolerances import Z_EACH, Z, rounding_rtol


def _ids_data(n):
    """x = example ids 1..N (0 marks padding), in a nested structure; y derived from ids."""
    ids = np.arange(1, n + 1)
    x = {"ids": ids.astype("int64")[:, None], "feat": np.stack([ids, -ids], 1).astype("float32")}
    y = (ids.astype("float32") * 2.0, ids.astype("int32") % 7)
    return x, y


def _numpy(element):
    return tf.nest.map_structure(lambda t: None if t is None else np.asarray(t), element)


def _sizes(ds):
    return np.array([float(np.sum(m)) for _, _, m in ds])


def _exact_binomial_sf(m, n, q):
    """P(Binomial(n, q) > m), summed term by term with exact binomial coefficients."""
    return sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(m + 1, n + 1))


# --------------------------------------------------------------------------
# Distribution of batch sizes
# --------------------------------------------------------------------------


def test_batch_size_mean_and_variance_match_binomial():
    n, q, steps = 1000, 0.05, 400
    sizes = _sizes(poisson_batches(np.arange(n), sampling_probability=q, steps=steps, seed=7))
    assert sizes.shape == (steps,)
    var = n * q * (1 - q)  # per-step Binomial variance
    # Mean of `steps` i.i.d. sizes: standard error sqrt(var / steps).
    assert abs(sizes.mean() - n * q) <= Z * math.sqrt(var / steps)
    # Sample variance: standard error ~ var * sqrt(2 / (steps - 1)) (normal
    # approximation; Binomial(1000, 0.05) is close to normal). This catches
    # fixed-size batches, whose variance is 0.
    assert abs(sizes.var(ddof=1) - var) <= Z * var * math.sqrt(2 / (steps - 1))


def test_every_example_is_sampled_at_rate_q():
    n, q, steps = 50, 0.2, 300
    counts = np.zeros(n + 1)
    for xb, _, mask in poisson_batches({"ids": np.arange(1, n + 1)}, sampling_probability=q, steps=steps, seed=3):
        counts[np.asarray(xb["ids"])[np.asarray(mask) == 1]] += 1
    counts = counts[1:]
    total_q = counts.sum() / (n * steps)
    assert abs(total_q - q) <= Z * math.sqrt(q * (1 - q) / (n * steps))
    # Each example: Binomial(steps, q) inclusions; none far outside Z_EACH std.
    assert np.all(np.abs(counts - steps * q) <= Z_EACH * math.sqrt(steps * q * (1 - q)))


def test_default_steps_is_one_epoch_in_expectation():
    x = np.arange(10)
    for q, want in [(0.3, 3), (0.4, 3), (0.01, 100), (1.0, 1)]:
        ds = poisson_batches(x, sampling_probability=q, seed=0)
        assert int(ds.cardinality()) == want
        assert len(list(ds)) == want


def test_q_equal_one_takes_everything():
    x, y = _ids_data(9)
    for xb, _yb, mask in poisson_batches(x, y, sampling_probability=1.0, steps=3, seed=0):
        np.testing.assert_array_equal(mask, np.ones(9, "float32"))
        np.testing.assert_array_equal(xb["ids"][:, 0], np.arange(1, 10))


@pytest.mark.parametrize("n,q", [(20, 0.02), (200, 0.1), (500, 0.3), (7, 0.9)])
def test_default_max_batch_size_is_the_exact_binomial_quantile(n, q):
    m = default_max_batch_size(n, q)
    assert 1 <= m <= n
    assert _exact_binomial_sf(m, n, q) <= 1e-12
    if m > 1:
        assert _exact_binomial_sf(m - 1, n, q) > 1e-12


def test_default_max_batch_size_edge_cases():
    assert default_max_batch_size(13, 1.0) == 13
    assert default_max_batch_size(1, 0.5) == 1
    assert default_max_batch_size(10**6, 1e-12) == 1
    # A larger tolerated overflow gives less padding, but never below the mean.
    loose, strict = default_max_batch_size(10_000, 0.01, 1e-3), default_max_batch_size(10_000, 0.01)
    assert 100 < loose < strict


# --------------------------------------------------------------------------
# Shapes, padding, membership
# --------------------------------------------------------------------------


def test_fixed_shapes_trace_once():
    x, y = _ids_data(40)
    ds = poisson_batches(x, y, sampling_probability=0.1, max_batch_size=25, steps=30, seed=1)
    for spec in tf.nest.flatten(ds.element_spec):
        assert spec.shape.is_fully_defined() and spec.shape[0] == 25
    assert ds.element_spec[2] == tf.TensorSpec([25], tf.float32)

    @tf.function
    def step(xb, yb, mask):
        return tf.reduce_sum(xb["feat"] * mask[:, None]) + tf.reduce_sum(yb[0] * mask)

    sizes = set()
    for xb, yb, mask in ds:
        step(xb, yb, mask)
        sizes.add(float(tf.reduce_sum(mask)))
    assert len(sizes) > 1  # batch sizes did vary...
    assert step.experimental_get_tracing_count() == 1  # ...without retracing


def test_padding_is_zero_and_real_rows_are_distinct_examples():
    n = 60
    x, y = _ids_data(n)
    seen_sizes = []
    for xb, yb, mask in _numpy(list(poisson_batches(x, y, sampling_probability=0.15, steps=40, seed=2))):
        b = int(mask.sum())
        seen_sizes.append(b)
        assert mask.dtype == np.float32
        np.testing.assert_array_equal(mask, (np.arange(len(mask)) < b).astype("float32"))
        for leaf in tf.nest.flatten((xb, yb)):
            assert np.all(leaf[b:] == 0), "padded rows must be exactly zero"
        ids = xb["ids"][:b, 0]
        assert np.all((ids >= 1) & (ids <= n))
        assert len(np.unique(ids)) == b, "no example may repeat within a batch"
        # Every leaf of a real row comes from the same original example.
        np.testing.assert_array_equal(xb["feat"][:b], np.stack([ids, -ids], 1))
        np.testing.assert_array_equal(yb[0][:b], ids * 2.0)
        np.testing.assert_array_equal(yb[1][:b], ids % 7)
    assert max(seen_sizes) > 0


def test_padded_rows_have_zero_gradient_as_sample_weight():
    x = np.random.default_rng(0).normal(size=(30, 3)).astype("float32")
    y = np.ones(30, "float32")
    w = tf.Variable(tf.ones([3]))
    for xb, yb, mask in poisson_batches(x, y, sampling_probability=0.2, steps=5, seed=0):
        with tf.GradientTape() as tape:
            per_example = tf.square(tf.linalg.matvec(xb, w) - yb + 1.0)  # nonzero even on zero rows
            loss = tf.reduce_sum(per_example * mask)
        b = int(tf.reduce_sum(mask))
        with tf.GradientTape() as tape_real:
            real = tf.reduce_sum(tf.square(tf.linalg.matvec(xb[:b], w) - yb[:b] + 1.0))
        # The padded rows add exact zeros; the b real terms 2 r_i x_i (r_i: a 3-term dot, two additions, one
        # product) are summed in two orders: rounding_rtol(b + 6) relative to their magnitudes.
        xr, yr = np.asarray(xb[:b], np.float64), np.asarray(yb[:b], np.float64)
        magnitude = np.sum(2 * (np.abs(xr).sum(axis=1) + np.abs(yr) + 1.0)[:, None] * np.abs(xr), axis=0)
        assert_close(tape.gradient(loss, w), tape_real.gradient(real, w), atol=rounding_rtol(b + 6) * magnitude)


def test_without_y_the_element_is_x_none_mask():
    ds = poisson_batches(np.arange(10.0)[:, None], sampling_probability=0.5, steps=2, seed=0)
    xb, yb, mask = next(iter(ds))
    assert yb is None and xb.shape[1:] == [1] and mask.shape.rank == 1


def test_empty_batches_are_valid_elements():
    n, q, steps = 20, 0.02, 200
    x, y = _ids_data(n)
    ds = poisson_batches(x, y, sampling_probability=q, steps=steps, seed=4)
    elements = _numpy(list(ds))
    empty = [e for e in elements if e[2].sum() == 0]
    # P(empty) = 0.98^20 = 0.67, so ~134 of 200 expected; Z = 5 std below is ~101.
    p_empty = (1 - q) ** n
    assert len(empty) >= steps * p_empty - Z * math.sqrt(steps * p_empty * (1 - p_empty))
    m = default_max_batch_size(n, q)
    for xb, yb, mask in empty:
        assert mask.shape == (m,)
        for leaf in tf.nest.flatten((xb, yb)):
            assert leaf.shape[0] == m and np.all(leaf == 0)


# --------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------


def _pass(ds):
    return [np.asarray(xb)[np.asarray(m) == 1].tolist() for xb, _, m in ds]


def test_same_seed_same_batches_different_seed_different():
    x = np.arange(100)

    def make(seed):
        return poisson_batches(x, sampling_probability=0.1, steps=10, seed=seed)

    assert _pass(make(5)) == _pass(make(5))
    assert _pass(make(5)) != _pass(make(6))
    assert _pass(make(None)) != _pass(make(None))


def test_each_pass_is_fresh_and_the_sequence_of_passes_is_reproducible():
    x = np.arange(100)
    a = poisson_batches(x, sampling_probability=0.1, steps=10, seed=9)
    b = poisson_batches(x, sampling_probability=0.1, steps=10, seed=9)
    a1, a2 = _pass(a), _pass(a)
    assert a1 != a2, "a second pass must not reuse the first pass's batches"
    # A partly consumed, prefetching pass still counts as exactly one pass.
    next(iter(b))
    assert _pass(b) == a2


def test_global_tf_seed_does_not_matter():
    x = np.arange(100)
    tf.random.set_seed(1)
    first = _pass(poisson_batches(x, sampling_probability=0.1, steps=5, seed=3))
    tf.random.set_seed(2)
    assert _pass(poisson_batches(x, sampling_probability=0.1, steps=5, seed=3)) == first


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def test_overflowing_batch_raises_naming_max_batch_size():
    ds = poisson_batches(np.arange(100), sampling_probability=0.5, max_batch_size=10, steps=3, seed=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_batch_size=10"):
        list(ds)


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_bad_sampling_probability(q):
    with pytest.raises(ValueError, match="sampling_probability"):
        poisson_batches(np.arange(10), sampling_probability=q)
    with pytest.raises(ValueError, match="sampling_probability"):
        default_max_batch_size(10, q)


def test_bad_inputs():
    with pytest.raises(TypeError, match="sampling_probability"):
        poisson_batches(np.arange(10), sampling_probability="0.1")
    with pytest.raises(ValueError, match="leading batch dimension"):
        poisson_batches(np.arange(10), np.arange(9), sampling_probability=0.1)
    with pytest.raises(ValueError, match="leading batch dimension"):
        poisson_batches({"a": np.zeros([5, 2]), "b": np.zeros([4])}, sampling_probability=0.1)
    with pytest.raises(ValueError, match="at least one example"):
        poisson_batches(np.zeros([0, 3]), sampling_probability=0.1)
    with pytest.raises(ValueError, match="steps"):
        poisson_batches(np.arange(10), sampling_probability=0.1, steps=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        poisson_batches(np.arange(10), sampling_probability=0.1, max_batch_size=0)
    with pytest.raises(ValueError, match="seed"):
        poisson_batches(np.arange(10), sampling_probability=0.1, seed=-1)
    with pytest.raises(TypeError):
        poisson_batches(np.array(["a", "b"]), sampling_probability=0.1)


# --------------------------------------------------------------------------
# Physical chunks
# --------------------------------------------------------------------------


def _logical(ids, m):
    """A padded logical batch holding `ids` (ids >= 1), with a nested y."""
    b = len(ids)
    x = np.zeros([m, 2], "float32")
    x[:b, 0], x[:b, 1] = ids, -np.asarray(ids)
    y = {"label": np.zeros([m], "int32")}
    y["label"][:b] = np.asarray(ids) * 10
    mask = (np.arange(m) < b).astype("float32")
    return x, y, mask


def _check_chunks(chunks, ids, p):
    b = len(ids)
    assert len(chunks) == max(1, math.ceil(b / p))
    assert [bool(c.is_last) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    got = []
    for c in chunks:
        x, y, mask = np.asarray(c.x), np.asarray(c.y["label"]), np.asarray(c.mask)
        assert x.shape == (p, 2) and y.shape == (p,) and mask.shape == (p,)
        real = mask == 1
        assert np.all((mask == 0) | real)
        assert np.all(x[~real] == 0) and np.all(y[~real] == 0)
        np.testing.assert_array_equal(x[real, 1], -x[real, 0])
        np.testing.assert_array_equal(y[real], x[real, 0] * 10)
        got.extend(x[real, 0].tolist())
    assert sorted(got) == sorted(float(i) for i in ids), "each real row exactly once"
    last_real = b - p * (len(chunks) - 1)
    np.testing.assert_array_equal(np.asarray(chunks[-1].mask), (np.arange(p) < last_real).astype("float32"))


@pytest.mark.parametrize("b", [0, 1, 3, 4, 8, 11, 20])
def test_physical_chunks_cover_real_rows_once(b):
    ids = list(range(1, b + 1))
    x, y, mask = _logical(ids, 20)
    chunks = list(physical_chunks(x, y, mask, 4))
    assert all(isinstance(c, PhysicalChunk) and isinstance(c.is_last, bool) for c in chunks)
    _check_chunks(chunks, ids, 4)


def test_physical_chunks_empty_batch_gives_one_masked_chunk():
    x, y, mask = _logical([], 6)
    (chunk,) = physical_chunks(x, y, mask, 4)
    assert chunk.is_last
    np.testing.assert_array_equal(chunk.mask, np.zeros(4, "float32"))
    assert np.all(np.asarray(chunk.x) == 0)


def test_physical_chunks_with_scattered_mask_and_weights():
    x = np.arange(1, 8, dtype="float32")[:, None]
    mask = np.array([0, 1, 0, 0.5, 1, 0, 1], "float32")
    chunks = list(physical_chunks(x, None, mask, 3))
    assert len(chunks) == 2 and chunks[0].y is None
    np.testing.assert_array_equal(chunks[0].x[:, 0], [2, 4, 5])
    np.testing.assert_array_equal(chunks[0].mask, [1, 0.5, 1])
    np.testing.assert_array_equal(chunks[1].x[:, 0], [7, 0, 0])
    np.testing.assert_array_equal(chunks[1].mask, [1, 0, 0])


def test_physical_chunks_dataset_matches_generator_and_traces_once():
    x, y = _ids_data(50)
    logical = poisson_batches(x, y, sampling_probability=0.2, max_batch_size=30, steps=12, seed=8)
    elements = list(logical)  # one pass, reused for both versions
    chunked = physical_chunks_dataset(
        tf.data.Dataset.from_tensor_slices(tf.nest.map_structure(lambda *t: tf.stack(t), *elements)), 4
    )
    assert chunked.element_spec.x["ids"].shape == [4, 1]
    assert chunked.element_spec.is_last == tf.TensorSpec([], tf.bool)

    @tf.function
    def accumulate(chunk):
        return tf.reduce_sum(chunk.x["feat"] * chunk.mask[:, None])

    from_dataset = list(chunked)
    from_generator = [c for xb, yb, m in elements for c in physical_chunks(xb, yb, m, 4)]
    assert len(from_dataset) == len(from_generator)
    for a, b in zip(from_dataset, from_generator):
        accumulate(a)
        assert bool(a.is_last) == b.is_last
        for u, v in zip(tf.nest.flatten((a.x, a.y, a.mask)), tf.nest.flatten((b.x, b.y, b.mask))):
            np.testing.assert_array_equal(u, v)
    assert accumulate.experimental_get_tracing_count() == 1
    # One is_last per logical batch, empty ones included.
    assert sum(bool(c.is_last) for c in from_dataset) == len(elements)


def test_physical_chunks_dataset_without_y():
    logical = poisson_batches(np.arange(1.0, 21.0)[:, None], sampling_probability=0.5, steps=3, seed=0)
    chunks = list(physical_chunks_dataset(logical, 6))
    assert all(c.y is None for c in chunks)
    assert sum(bool(c.is_last) for c in chunks) == 3


def test_physical_chunks_bad_inputs():
    x, y, mask = _logical([1, 2], 5)
    with pytest.raises(ValueError, match="physical_batch_size"):
        list(physical_chunks(x, y, mask, 0))
    with pytest.raises(ValueError, match="leading dimension"):
        list(physical_chunks(x[:4], y, mask, 2))
    with pytest.raises(ValueError, match="mask"):
        list(physical_chunks(x, y, mask[:, None], 2))
    with pytest.raises(ValueError, match="x_batch, y_batch, mask"):
        physical_chunks_dataset(tf.data.Dataset.from_tensor_slices((x, mask)), 2)


# --------------------------------------------------------------------------
# From a tf.data.Dataset
# --------------------------------------------------------------------------


def test_from_dataset_equals_from_arrays():
    x, y = _ids_data(30)
    source = tf.data.Dataset.from_tensor_slices((x, y))
    from_ds = poisson_batches_from_dataset(source, 30, sampling_probability=0.2, steps=6, seed=11)
    from_arrays = poisson_batches(x, y, sampling_probability=0.2, steps=6, seed=11)
    assert from_ds.element_spec == from_arrays.element_spec
    for a, b in zip(from_ds, from_arrays):
        for u, v in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
            np.testing.assert_array_equal(u, v)


def test_from_dataset_with_a_cycle_and_units_equals_from_arrays():
    """cycle_length and first_step reach poisson_batches: the same parts, batches and partition as from the arrays."""
    x, y = _ids_data(30)
    units = np.arange(30) // 2
    source = tf.data.Dataset.from_tensor_slices(({"x": x, "unit": units}, y))
    common = dict(sampling_probability=0.5, steps=6, seed=11, cycle_length=3, first_step=2)
    from_ds = poisson_batches_from_dataset(source, 30, unit_ids="unit", **common)
    from_arrays = poisson_batches({"x": x}, y, unit_ids=units, **common)
    assert from_ds.pegrad_sampling.cycle_length == 3
    np.testing.assert_array_equal(from_ds.pegrad_sampling.partition, from_arrays.pegrad_sampling.partition)
    for a, b in zip(from_ds, from_arrays):
        for u, v in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
            np.testing.assert_array_equal(u, v)


def test_from_dataset_x_only_and_unknown_cardinality():
    source = tf.data.Dataset.range(1, 41).filter(lambda i: i % 2 == 0)  # 20 examples, unknown count
    ds = poisson_batches_from_dataset(source, sampling_probability=0.25, steps=4, seed=0, progress=False)
    for xb, yb, mask in ds:
        assert yb is None
        b = int(tf.reduce_sum(mask))
        assert np.all(np.asarray(xb)[:b] % 2 == 0) and np.all(np.asarray(xb)[b:] == 0)


def test_from_dataset_errors():
    source = tf.data.Dataset.from_tensor_slices(np.arange(10))
    with pytest.raises(ValueError, match="num_examples"):
        poisson_batches_from_dataset(source, 9, sampling_probability=0.1)
    with pytest.raises(ValueError, match="num_examples"):  # unknown cardinality, counted
        poisson_batches_from_dataset(source.filter(lambda v: True), 12, sampling_probability=0.1)
    with pytest.raises(ValueError, match="infinite"):
        poisson_batches_from_dataset(source.repeat(), sampling_probability=0.1)
    with pytest.raises(ValueError, match="sample weight"):
        poisson_batches_from_dataset(
            tf.data.Dataset.from_tensor_slices((np.arange(4), np.arange(4), np.ones(4))), sampling_probability=0.5
        )
    with pytest.raises(ValueError, match="sampling_probability"):
        poisson_batches_from_dataset(source, 10, sampling_probability=0.0)


def test_poisson_batches_of_a_list_of_arrays_keep_one_leaf_per_array():
    import per_example_grads as peg

    """tf.data would stack a returned list into one tensor; each array stays its own leaf (as a tuple)."""
    a, b = (
        np.arange(10, dtype="float32")[:, None],
        np.arange(10, dtype="float32")[:, None] * 2 + np.zeros((10, 3), "float32"),
    )
    xb, _, mask = next(iter(peg.dp.poisson_batches([a, b], sampling_probability=1.0, seed=0)))
    assert isinstance(xb, tuple) and xb[0].shape == (10, 1) and xb[1].shape == (10, 3)
    np.testing.assert_array_equal(xb[1].numpy()[:, 0], 2 * xb[0].numpy()[:, 0])


def test_a_pass_of_billions_of_steps_is_not_held_whole():
    # round(b / q) = 4e9 steps a pass: their indices were a [4e9] tensor (32 GB) before the first batch.
    ds = poisson_batches(np.ones((8, 2), "float32"), sampling_probability=1e-9, cycle_length=4, seed=0)
    assert int(ds.cardinality()) == 4_000_000_000
    xb, _, mask = next(iter(ds))
    assert xb.shape == (mask.shape[0], 2) and int(ds.pegrad_sampling.next_step.numpy()) == 4_000_000_000


def test_a_repeated_dataset_is_refused_not_counted_twice():
    ds = tf.data.Dataset.from_tensor_slices((np.ones((10, 2), "float32"), np.arange(10))).repeat(2)
    with pytest.raises(ValueError, match=r"repeats its elements \(Dataset.repeat\).*larger N"):
        poisson_batches_from_dataset(ds, sampling_probability=0.5)


# -- the sampler classes: what each declares to the composition table ------------------------


def test_poisson_sampling_declares_its_scheme_cycle_and_units():
    from per_example_grads.dp.composition import Sampling

    x = np.arange(24, dtype="float32")[:, None]
    plain = poisson_batches(x, None, sampling_probability=0.25, seed=0).pegrad_sampling
    assert plain.declared() == Sampling(poisson=True, cycle_length=1, scheme="poisson")
    cyclic = poisson_batches(x, None, sampling_probability=0.5, seed=0, cycle_length=2).pegrad_sampling
    assert cyclic.declared() == Sampling(poisson=True, cycle_length=2, scheme="poisson")
    units = poisson_batches(x, None, sampling_probability=0.5, seed=0, unit_ids=np.arange(24) // 3)
    declared = units.pegrad_sampling.declared()
    assert (declared.poisson, declared.units, declared.rows_per_unit) == (True, True, 3)


def test_fixed_size_sampling_is_accounted_at_its_largest_batch_and_refused_by_correlated_noise():
    from per_example_grads.dp import composition
    from per_example_grads.dp.mechanisms import BandMF
    from per_example_grads.dp.sampling import FixedSizeSampling

    sampler = FixedSizeSampling(largest_batch=32)
    assert not sampler.poisson and sampler.sampling_probability is None  # q is per step: its rows / N
    assert sampler.largest_sampling_probability(256) == 32 / 256
    assert sampler.largest_sampling_probability(16) == 1.0
    assert sampler.largest_sampling_probability(None) is None
    assert FixedSizeSampling().largest_sampling_probability(256) is None
    assert sampler.declared(units=True) == composition.Sampling(poisson=False, scheme="fixed_size", units=True)
    parts = composition.Parts("DPModel", mechanism=BandMF(bands=2, num_steps=8), sampling=sampler.declared())
    with pytest.raises(ValueError, match="BandMF"):
        composition.check(parts)
    composition.check(composition.Parts("DPModel", sampling=sampler.declared()))  # DP-SGD takes it, with a warning
