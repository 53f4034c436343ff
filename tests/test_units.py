"""Grouped capabilities (``unit_ids=``): per-unit gradients, norms and clipped sums against an independent loop.

The reference: every row's gradient from its own one-example ``tf.GradientTape``
(``helpers.reference_gradients``), summed per unit in float64 with numpy,
then normed and clipped in numpy. Tolerances (``tests/tolerances.py``):

- a unit's gradient ``G_u`` sums ``k_u`` rows, each entry agreeing to
  ``GRADIENT_RTOL`` of its terms, so ``G_u`` agrees to ``GRADIENT_RTOL``
  of ``sum_{n in u} |g_n|`` plus ``rounding_rtol(k_u)`` for the sum;
- its squared norm to ``delta_u = eps_u S_u^2``, with ``S_u = sum_{n in u} ||g_n||``
  (every term of ``||G_u||^2``, a product of two rows' parts, is at most
  that in magnitude) and ``eps_u = 2 norm_rtol(p) + rounding_rtol(m_u)``
  (the entries' error, doubled by the square, and the sum of the ``m_u``
  pair terms of the Gram form over the unit's ``k_u T`` rows and positions);
  so the norm to ``min(delta_u / ||G_u||, sqrt(delta_u))``;
- the clipped sum ``sum_u c_u G_u`` to ``clipped_sum_rtol(p, B)`` of
  ``sum_n c_{u(n)} |g_n|`` plus each factor's error (the norm's, relative)
  times ``c_u |G_u|``.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_close, reference_gradients, sparse_ce
from model_zoo import LAYER_CASES, ZOO
from per_example_grads.apps import zoo as apps_zoo
from per_example_grads.rules import grouped as grouped_rules
from tolerances import EPS32, GRADIENT_RTOL, clipped_sum_rtol, norm_rtol, rounding_rtol

B = 16
# Units of 1, 2 and up to 8 rows, uneven and interleaved, one id (5) with no rows.
IDS = np.array([3, 0, 1, 1, 3, 2, 3, 3, 4, 3, 3, 6, 3, 2, 2, 0], np.int32)  # unit 3: 8 rows; 4, 6: one
NUM_UNITS = 7


def _resampled(case_x, n, rng):
    """``n`` rows drawn from a zoo case's rows, float leaves perturbed so rows of one unit differ."""
    leaves = tf.nest.flatten(case_x)
    idx = rng.integers(0, np.shape(leaves[0])[0], n)
    out = []
    for t in leaves:
        t = np.asarray(t)[idx]
        out.append(t + 0.3 * rng.normal(size=t.shape).astype(t.dtype) if t.dtype.kind == "f" else t)
    return tf.nest.pack_sequence_as(case_x, out)


def _reference(model, loss_fn, x, y, ids, num_units, sample_weight=None):
    """``(rows, units, scale)``: float64 per-row gradients, their per-unit sums ``[U, ...]`` and ``S_u``."""
    rows = [np.asarray(r, np.float64) for r in reference_gradients(model, loss_fn, x, y, sample_weight)]
    units = [np.stack([r[ids == u].sum(axis=0) for u in range(num_units)]) for r in rows]
    row_norms = np.sqrt(sum(np.sum(r.reshape(len(ids), -1) ** 2, axis=1) for r in rows))
    scale = np.array([row_norms[ids == u].sum() for u in range(num_units)])
    return rows, units, scale


def _norm_atol(units, scale, ids, positions):
    """``[U]`` norm tolerances (module docstring)."""
    p = sum(int(np.prod(u.shape[1:])) for u in units)
    k = np.bincount(ids, minlength=len(scale))
    eps = 2 * norm_rtol(p) + np.array([rounding_rtol(max(1, (int(ku) * positions) ** 2)) for ku in k])
    delta = eps * scale**2
    norms = np.sqrt(sum(np.sum(u.reshape(len(scale), -1) ** 2, axis=1) for u in units))
    return norms, np.minimum(delta / np.maximum(norms, 1e-300), np.sqrt(delta))


def _check(
    model,
    loss_fn,
    x,
    y,
    ids,
    num_units,
    *,
    clip,
    method="layerwise",
    positions=1,
    sample_weight=None,
    reference=None,
    jit_compile=False,
):
    """``jit_compile``: the norms and the clipped sum each under ``tf.function(jit_compile=True)`` (XLA)."""
    rows, units, scale = reference or _reference(model, loss_fn, x, y, ids, num_units, sample_weight)
    ref_norms, atol = _norm_atol(units, scale, ids, positions)
    kwargs = dict(method=method, unit_ids=ids, num_units=num_units, sample_weight=sample_weight)
    norms_fn, clipped_fn = peg.per_example_norms, peg.clipped_gradients
    if jit_compile:
        norms_fn = tf.function(peg.per_example_norms, jit_compile=True, autograph=False)
        clipped_fn = tf.function(peg.clipped_gradients, jit_compile=True, autograph=False)
    norms = norms_fn(model, loss_fn, x, y, **kwargs)
    assert norms.shape == (num_units,)
    assert_close(norms, ref_norms, atol=atol, err_msg="unit norms")
    assert np.all(np.asarray(norms)[np.bincount(ids, minlength=num_units) == 0] == 0), "a unit without rows has norm 0"

    sums, clipped_norms = clipped_fn(model, loss_fn, x, y, l2_norm_clip=clip, return_norms=True, **kwargs)
    assert_close(clipped_norms, ref_norms, atol=atol, err_msg="clipped norms")
    factors = clip / np.maximum(ref_norms, clip)
    factor_rtol = np.where(ref_norms > clip, atol / np.maximum(ref_norms, 1e-300), 0.0) + EPS32
    p = sum(int(np.prod(u.shape[1:])) for u in units)
    terms = [np.tensordot(factors[ids], np.abs(r), axes=1) for r in rows]
    largest = max(float(np.max(t)) for t in terms)  # entries that cancel to ~0 (an attention key bias's) err by this
    for k, (s, _r, u, t) in enumerate(zip(sums, rows, units, terms)):
        want = np.tensordot(factors, u, axes=1)
        entry_atol = clipped_sum_rtol(p, len(ids)) * (t + largest) + np.tensordot(
            factor_rtol * factors, np.abs(u), axes=1
        )
        s = np.asarray(tf.convert_to_tensor(s), np.float64)
        assert s.shape == want.shape
        np.testing.assert_array_less(np.abs(s - want), entry_atol + 1e-30, err_msg=f"clipped sum, variable {k}")
    return ref_norms


# name -> the most positions a grouped Gram form runs over (the norm tolerance's pair terms)
# (MultiHeadAttention's EinsumDense projections: through GPT-2 below, so transformer_block is left out for time.)
ZOO_CASES = {"mlp": 1, "cnn2d": 64, "embedding_mask_zero_pooled": 8, "shared_layer": 1}
SLOW_ZOO_CASES = {"mlp", "cnn2d", "embedding_mask_zero_pooled"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ZOO_CASES else n for n in ZOO_CASES]
)
def test_unit_norms_and_clipped_sums_match_the_loop_on_the_zoo(name):
    case = ZOO[name]()
    rng = np.random.default_rng(1)
    x = _resampled(case.x, B, rng)
    y = rng.integers(0, 3, B).astype("int32")
    _check(case.model, case.loss_fn, x, y, IDS, NUM_UNITS, clip=0.05, positions=ZOO_CASES[name])


def _shared_model():
    """A Dense called twice, a wide Dense (the masked Gram form), an Embedding called twice, a Dense on sequences."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((6,))
    shared = keras.layers.Dense(6, activation="tanh")
    wide = keras.layers.Dense(64, activation="tanh")
    emb_in = keras.Input((5,), dtype="int32")
    emb = keras.layers.Embedding(10, 6)
    seq = emb(emb_in) + emb(emb_in[:, ::-1])
    seq = keras.layers.Dense(6, activation="tanh")(seq)
    h = keras.layers.Dense(6)(wide(shared(shared(inp)))) + keras.layers.GlobalAveragePooling1D()(seq)
    model = keras.Model([inp, emb_in], keras.layers.Dense(3)(h))
    rng = np.random.default_rng(4)
    x = [rng.normal(size=(B, 6)).astype("float32"), rng.integers(0, 10, (B, 5)).astype("int32")]
    return model, x, rng.integers(0, 3, B).astype("int32")


@pytest.mark.slow
def test_shared_layers_and_embeddings():
    model, x, y = _shared_model()
    _check(model, sparse_ce, x, y, IDS, NUM_UNITS, clip=0.1, positions=10)


# Units of 2 rows, interleaved, one id (8) with none: U R = 18 <= 2 B, so an Embedding's grouped norms sort unit by unit.
EVEN_IDS = np.array([5, 0, 1, 1, 3, 2, 7, 3, 4, 0, 6, 6, 7, 2, 5, 4], np.int32)


@pytest.mark.slow
def test_shared_layers_and_embeddings_in_even_units():
    model, x, y = _shared_model()
    _check(model, sparse_ce, x, y, EVEN_IDS, 9, clip=0.1, positions=10)


@pytest.mark.slow
def test_shared_layers_and_embeddings_under_xla():
    """The forms XLA takes (static shapes): the masked Gram with its bias, the Embedding's one sort of all rows."""
    model, x, y = _shared_model()
    _check(model, sparse_ce, x, y, IDS, NUM_UNITS, clip=0.1, positions=10, jit_compile=True)


@pytest.mark.parametrize("ids", [EVEN_IDS, IDS, np.zeros(B, np.int32), np.arange(B, dtype=np.int32)])
def test_embedding_unit_norms_by_both_sorts(ids):
    """Both forms of an Embedding's ``||G_u||^2`` against a dictionary sum in float64.

    Ids from a vocabulary of 6 over 5 positions, so they repeat within
    examples and across a unit's examples. Tolerance: the float32 sums of
    the ``m_u`` rows of a unit (``rounding_rtol(m_u)`` of the sum of their
    absolute values per entry), doubled by the square, against
    ``(sum_r ||g_r||)^2``.
    """
    rng = np.random.default_rng(5)
    x = rng.integers(0, 6, (B, 5)).astype("int32")
    g = rng.normal(size=(B, 5, 3)).astype("float32")
    count = int(ids.max()) + 2  # one unit with no rows
    want, scale = np.zeros(count), np.zeros(count)
    for u in range(count):
        rows = [(v, r) for n in np.flatnonzero(ids == u) for v, r in zip(x[n], g[n].astype(np.float64))]
        sums = {}
        for v, r in rows:
            sums[v] = sums.get(v, 0.0) + r
        want[u] = sum(float(np.sum(s**2)) for s in sums.values())
        scale[u] = sum(float(np.linalg.norm(r)) for _, r in rows)
    atol = 2 * rounding_rtol(5 * B) * scale**2 + 1e-30
    t_ids = tf.constant(ids)
    by_unit = grouped_rules.unit_embedding_squared_norms(tf.constant(x), tf.constant(g), t_ids, count)
    by_one = grouped_rules.embedding_squared_norms(
        tf.reshape(x, [-1]), tf.reshape(g, [-1, 3]), tf.repeat(t_ids, 5), 6, count
    )
    for got in (by_unit, by_one):
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), atol)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reversible_tied", "reversible_untied", "reversible_two_lookups"])
def test_reversible_embeddings(name, monkeypatch):
    """KerasHub's tied lookup and output projection, by both forms: per-unit tables, and the rule's own form on each unit's rows as one example."""
    model, x, _ = LAYER_CASES[name](np.random.default_rng(8))
    rng = np.random.default_rng(9)
    x = _resampled(x, B, rng)
    y = rng.integers(0, 11, (B, 6)).astype("int32")
    reference = _reference(model, sparse_ce, x, y, IDS, NUM_UNITS)
    for form in ["tables", "gram"]:
        monkeypatch.setattr(grouped_rules, "REVERSIBLE_FORM", form)
        _check(model, sparse_ce, x, y, IDS, NUM_UNITS, clip=0.05, positions=12, reference=reference)


def _conv_models():
    """Convolutions of several kernel sizes, strides, dilations and paddings, 1-D, 2-D and 3-D, with their kin."""
    keras.utils.set_random_seed(11)
    L = keras.layers
    image = keras.Input((9, 9, 3))
    h = L.Conv2D(4, 3, strides=2, padding="same", activation="tanh")(image)
    h = L.Conv2D(5, 2, padding="valid")(h)
    h = L.Conv2DTranspose(3, 3, strides=2, padding="same", activation="tanh")(h)
    h = L.DepthwiseConv2D(3)(h)
    h = L.SeparableConv2D(4, 3, padding="same")(h)
    h = L.Conv2D(6, 1, use_bias=False)(h)
    two_d = keras.Model(image, L.Dense(3)(L.Flatten()(h)))
    sequence = keras.Input((10, 2))
    s = L.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="tanh")(sequence)
    s = L.Conv1D(3, 4, strides=3)(s)
    volume = keras.Input((4, 5, 4, 2))
    v = L.Conv3D(3, 2, strides=(1, 2, 1), padding="same", activation="tanh")(volume)
    v = L.Conv3D(2, (2, 3, 2))(v)
    h = L.Concatenate()([L.Flatten()(s), L.Flatten()(v)])
    other = keras.Model([sequence, volume], L.Dense(3)(h))
    rng = np.random.default_rng(12)
    return [
        (two_d, rng.normal(size=(B, 9, 9, 3)).astype("float32"), 81),
        (
            other,
            [rng.normal(size=(B, 10, 2)).astype("float32"), rng.normal(size=(B, 4, 5, 4, 2)).astype("float32")],
            80,
        ),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1])
def test_convolutions_by_each_form(which, monkeypatch):
    """Per-unit kernels (kept for the clipped sum) and the Gram form over each unit's positions, and the cost's pick."""
    from per_example_grads.rules import grouped_conv

    model, x, positions = _conv_models()[which]
    y = np.random.default_rng(13).integers(0, 3, B).astype("int32")
    reference = _reference(model, sparse_ce, x, y, IDS, NUM_UNITS)
    for form in ["kernels", "gram", "auto"]:
        monkeypatch.setattr(grouped_conv, "CONV_FORM", form)
        _check(model, sparse_ce, x, y, IDS, NUM_UNITS, clip=0.05, positions=positions, reference=reference)


def test_the_conv_forms_costs_pick_the_gram_form_only_for_few_positions():
    """``grouped_conv.conv_costs``: a wide 3x3 layer on a 2x2 map takes the Gram form, the zoo CNN's layers the kernels."""
    from per_example_grads.rules import grouped_conv, path_costs

    few = path_costs.ConvShape(64, (4, 4), (2, 2), (3, 3), False, 512, 512)
    many = path_costs.ConvShape(64, (28, 28), (26, 26), (3, 3), False, 1, 16)
    kernels, gram = grouped_conv.conv_costs(few, 16, 4, True, False)
    assert gram < kernels
    kernels, gram = grouped_conv.conv_costs(many, 16, 4, True, True)
    assert kernels < gram


@pytest.mark.slow
def test_materialized_engines():
    """Engines without grouped forms segment-sum their per-example gradients (``loop`` takes the same path)."""
    model, x, y = _small_model()
    _check(model, sparse_ce, x, y, IDS, NUM_UNITS, clip=0.1, method="vectorized", positions=5)


@pytest.mark.slow
def test_units_of_one_row_are_the_examples():
    """ids = range(B): the materialized path gives today's example-level results bit for bit; layer-wise to rounding."""
    model, x, y = _small_model()
    ids = np.arange(B)
    grads = peg.per_example_gradients(model, sparse_ce, x, y, method="vectorized")
    units = peg.per_example_gradients(model, sparse_ce, x, y, method="vectorized", unit_ids=ids)
    for g, u in zip(grads, units):
        np.testing.assert_array_equal(u, g)
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rtol = 2 * norm_rtol(p) + rounding_rtol(25)  # layer-wise: other closed forms (a Gram form over 5 positions)
    for method in ["vectorized", "layerwise"]:
        sums, n = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.1, method=method, return_norms=True)
        usums, un = peg.clipped_gradients(
            model, sparse_ce, x, y, l2_norm_clip=0.1, method=method, return_norms=True, unit_ids=ids
        )
        sums, usums = (
            [np.asarray(tf.convert_to_tensor(t)) for t in sums],
            [np.asarray(tf.convert_to_tensor(t)) for t in usums],
        )
        if method == "vectorized":
            np.testing.assert_array_equal(un, n)
            for a, b in zip(usums, sums):
                np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(un, n, rtol=rtol)
            scale = max(float(np.max(np.abs(b))) for b in sums)
            for a, b in zip(usums, sums):
                np.testing.assert_allclose(
                    a, b, rtol=rtol + clipped_sum_rtol(p, B), atol=(rtol + clipped_sum_rtol(p, B)) * scale
                )


@pytest.mark.slow
def test_removing_a_unit_moves_the_clipped_sum_by_at_most_c():
    """The sensitivity bound: drop every row of one unit (others keep their ids); the sum moves by <= C."""
    model, x, y = _shared_model()
    clip = 0.05
    full = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, unit_ids=IDS, num_units=NUM_UNITS)
    full = np.concatenate([np.ravel(tf.convert_to_tensor(s)) for s in full])
    for unit in [3, 2, 4]:  # 8, 3 and 1 rows
        keep = IDS != unit
        rest = peg.clipped_gradients(
            model, sparse_ce, [t[keep] for t in x], y[keep], l2_norm_clip=clip, unit_ids=IDS[keep], num_units=NUM_UNITS
        )
        rest = np.concatenate([np.ravel(tf.convert_to_tensor(s)) for s in rest])
        # float32: each sum of <= B clipped terms of norm <= C rounds by rounding_rtol(B) of B C, on each side
        assert np.linalg.norm(full - rest) <= clip * (1 + 4 * EPS32) + 2 * rounding_rtol(B) * B * clip, unit


def _small_model():
    """An Embedding and a Dense: what the graph-mode test traces (tracing costs per layer)."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((5,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 6)(inp))
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    rng = np.random.default_rng(6)
    return model, [rng.integers(0, 10, (B, 5)).astype("int32")], rng.integers(0, 3, B).astype("int32")


@pytest.mark.slow
def test_zero_weight_rows_add_nothing_and_graph_mode_matches():
    model, x, y = _small_model()
    weight = np.ones(B, np.float32)
    weight[[0, 5, 9]] = 0.0  # padding rows, in units 3 and 2
    keep = weight > 0
    want = peg.clipped_gradients(
        model,
        sparse_ce,
        [t[keep] for t in x],
        y[keep],
        l2_norm_clip=0.1,
        unit_ids=IDS[keep],
        num_units=NUM_UNITS,
        return_norms=True,
    )

    @tf.function(autograph=False)  # AutoGraph would convert the library's Python too (seconds of tracing)
    def step(x, y, ids, weight):
        return peg.clipped_gradients(
            model, sparse_ce, x, y, l2_norm_clip=0.1, unit_ids=ids, sample_weight=weight, return_norms=True
        )  # num_units inferred inside the graph

    got = step([tf.constant(t) for t in x], tf.constant(y), tf.constant(IDS), tf.constant(weight))
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rtol = clipped_sum_rtol(p, B) + 2 * norm_rtol(p) + rounding_rtol(100)
    np.testing.assert_allclose(got[1], want[1], rtol=rtol, atol=1e-7)
    scale = max(float(np.max(np.abs(tf.convert_to_tensor(s)))) for s in want[0])
    for a, b in zip(got[0], want[0]):
        np.testing.assert_allclose(tf.convert_to_tensor(a), tf.convert_to_tensor(b), rtol=rtol, atol=rtol * scale)


@pytest.mark.slow
def test_a_unit_with_a_nonfinite_gradient_is_left_out():
    model, x, y = _shared_model()
    bad = [x[0].copy(), x[1]]
    bad[0][2] = np.nan  # a row of unit 1 (2 rows)
    keep = IDS != 1
    want = peg.clipped_gradients(
        model, sparse_ce, [t[keep] for t in x], y[keep], l2_norm_clip=0.1, unit_ids=IDS[keep], num_units=NUM_UNITS
    )
    with pytest.warns(RuntimeWarning, match="unit"):
        got, norms = peg.clipped_gradients(
            model, sparse_ce, bad, y, l2_norm_clip=0.1, unit_ids=IDS, num_units=NUM_UNITS, return_norms=True
        )
    assert not np.isfinite(norms[1]) and np.all(np.isfinite(np.delete(np.asarray(norms), 1)))
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rtol = clipped_sum_rtol(p, B)
    scale = max(float(np.max(np.abs(tf.convert_to_tensor(s)))) for s in want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(tf.convert_to_tensor(a), tf.convert_to_tensor(b), rtol=rtol, atol=rtol * scale)


HUGE = 1e20  # float32 squares overflow beyond about 1.8e19; the gradients themselves stay finite


def _huge_unit_case(sequence: bool):
    """A Dense network whose unit 3 (8 rows) has inputs scaled by ``HUGE``: its gradient is finite, its square is not.

    ``sequence``: inputs ``[B, 4, 6]``, so the Dense layers' grouped form is the Gram form over the unit's rows
    and positions.
    """
    rng = np.random.default_rng(3)
    shape = (B, 4, 6) if sequence else (B, 6)
    layers = [keras.layers.Dense(8), keras.layers.Dense(3)]
    if sequence:
        layers.insert(1, keras.layers.GlobalAveragePooling1D())
    model = keras.Sequential([keras.Input(shape[1:]), *layers])
    x = rng.normal(size=shape).astype("float32")
    x[IDS == 3] *= HUGE
    y = np.argmin(model(x).numpy(), axis=-1).astype("int32")  # each row's least likely class: gradients of ~1
    reference = _reference(model, sparse_ce, x, y, IDS, NUM_UNITS)
    assert all(np.isfinite(u).all() for u in reference[1]), "the reference unit gradients must be finite"
    norms = np.sqrt(sum(np.sum(u.reshape(NUM_UNITS, -1) ** 2, axis=1) for u in reference[1]))
    assert norms[3] ** 2 > np.finfo(np.float32).max, "float32 squared norms would not overflow"
    return model, x, y, reference


@pytest.mark.parametrize("sequence", [False, True], ids=["rows", "positions"])
@pytest.mark.parametrize("method", ["layerwise", "vectorized"])
def test_a_unit_with_a_huge_finite_gradient_is_clipped_not_left_out(method, sequence):
    # Before: the layer-wise Gram forms gave the unit a NaN norm, both engines' clipped sums dropped it and warned
    # that its gradient was non-finite (issue #51).
    model, x, y, reference = _huge_unit_case(sequence)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "non-finite gradient" warning: none is
        _check(
            model,
            sparse_ce,
            x,
            y,
            IDS,
            NUM_UNITS,
            clip=0.05,
            method=method,
            positions=4 if sequence else 1,
            reference=reference,
        )


@pytest.mark.slow
def test_a_unit_with_a_huge_finite_gradient_under_xla():
    model, x, y, reference = _huge_unit_case(sequence=True)
    _check(model, sparse_ce, x, y, IDS, NUM_UNITS, clip=0.05, positions=4, reference=reference, jit_compile=True)


def test_bad_unit_ids_are_refused():
    model, x, y = _shared_model()
    call = lambda **kw: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, **kw)  # noqa: E731
    with pytest.raises(TypeError, match="unit_ids must be integers"):
        call(unit_ids=IDS.astype("float32"))
    with pytest.raises(ValueError, match=r"unit_ids must have shape \[B\]"):
        call(unit_ids=IDS[:-1])
    with pytest.raises(ValueError, match=r"unit_ids must have shape \[B\]"):
        call(unit_ids=IDS[:, None])
    with pytest.raises(ValueError, match="unit_ids must be < num_units = 4"):
        call(unit_ids=IDS, num_units=4)
    with pytest.raises(ValueError, match="unit_ids must be >= 0"):
        call(unit_ids=IDS - 1)
    for entry in (call, peg.per_example_gradients, peg.dp.private_gradients):  # private_gradients ignored it
        kwargs = dict(l2_norm_clip=1.0, noise_multiplier=1.0) if entry is peg.dp.private_gradients else {}
        with pytest.raises(ValueError, match="num_units needs unit_ids"):
            (entry(num_units=3) if entry is call else entry(model, sparse_ce, x, y, num_units=3, **kwargs))
    with pytest.raises(TypeError, match="num_units must be an int"):
        call(unit_ids=IDS, num_units=7.0)
    with pytest.raises(ValueError, match="sparse_embeddings=True cannot be combined with unit_ids"):
        peg.per_example_gradients(model, sparse_ce, x, y, unit_ids=IDS, sparse_embeddings=True)


def test_unit_ids_of_another_length_are_refused_when_the_batch_size_is_known_only_when_run():
    # The same check as the DP front doors' (engines.grouped.checked_unit_ids); before, this path had none.
    model, x, y = _shared_model()
    specs = [
        [tf.TensorSpec([None, *t.shape[1:]], t.dtype) for t in map(tf.constant, x)],
        tf.TensorSpec([None], tf.int32),
    ]
    norms = tf.function(
        lambda x_, y_, ids: peg.per_example_norms(model, sparse_ce, x_, y_, unit_ids=ids, num_units=NUM_UNITS),
        input_signature=[*specs, tf.TensorSpec([None], tf.int32)],
        autograph=False,
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"unit_ids must have shape \[B\]"):
        norms(x, y, IDS[:-1])
    assert norms(x, y, IDS).shape == (NUM_UNITS,)


def test_per_unit_gradients_and_mean():
    model, x, y = _small_model()
    _, units, scale = _reference(model, sparse_ce, x, y, IDS, NUM_UNITS)
    got = peg.per_example_gradients(model, sparse_ce, x, y, unit_ids=IDS, num_units=NUM_UNITS)
    for g, u in zip(got, units):
        assert g.shape == u.shape
        np.testing.assert_allclose(g, u, rtol=0, atol=(GRADIENT_RTOL + rounding_rtol(8)) * np.max(scale) + 1e-30)
    total = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.1, unit_ids=IDS, num_units=NUM_UNITS)
    mean = peg.clipped_gradients(
        model, sparse_ce, x, y, l2_norm_clip=0.1, unit_ids=IDS, num_units=NUM_UNITS, reduction="mean"
    )
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rtol = clipped_sum_rtol(p, B)  # two runs of the sum (oneDNN may block them differently) and a division
    scale = max(float(np.max(np.abs(tf.convert_to_tensor(t)))) for t in total) / NUM_UNITS
    for t, m in zip(total, mean):
        np.testing.assert_allclose(
            tf.convert_to_tensor(m), tf.convert_to_tensor(t) / NUM_UNITS, rtol=rtol, atol=rtol * scale
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_lm"])  # BERT's layers (EinsumDense, Embedding, LayerNorm): all in GPT-2 too
def test_keras_hub_models(name):
    pytest.importorskip("keras_hub")
    model, x, y = apps_zoo.build(
        name, 8, vocabulary_size=32, num_layers=1, hidden_dim=16, intermediate_dim=16, seq_len=6
    )
    ids = np.array([0, 1, 1, 2, 2, 2, 0, 3], np.int32)  # 2, 2, 3 and 1 rows
    _check(model, sparse_ce, x, y, ids, 4, clip=0.05, positions=6)


def test_the_three_dense_forms_agree_with_numpy():
    """``rules.grouped``'s masked Gram, per-unit Gram and per-unit kernels, each against numpy, on uneven units and two calls."""
    rng = np.random.default_rng(7)
    pairs = [
        (rng.normal(size=(B, t, 5)).astype("float32"), rng.normal(size=(B, t, 3)).astype("float32")) for t in (1, 3)
    ]
    ids = tf.constant(IDS)

    def kernel(u):
        return sum(np.einsum("nti,ntj->ij", a[IDS == u].astype(np.float64), g[IDS == u]) for a, g in pairs)

    want = np.array([np.sum(kernel(u) ** 2) for u in range(NUM_UNITS)])
    want_bias = np.array(
        [np.sum(sum(g[IDS == u].astype(np.float64).sum(axis=(0, 1)) for _, g in pairs) ** 2) for u in range(NUM_UNITS)]
    )
    layout = grouped_rules._layout(ids, NUM_UNITS)
    tf_pairs = [(tf.constant(a), tf.constant(g)) for a, g in pairs]
    forms = {
        "masked_gram": grouped_rules._masked_gram(tf_pairs, ids, NUM_UNITS, bias=True),
        "unit_gram": grouped_rules._unit_gram(tf_pairs, ids, NUM_UNITS, layout, bias=True),
        "unit_kernels": grouped_rules._unit_kernels(tf_pairs, ids, NUM_UNITS, layout, bias=True),
        "picked": grouped_rules.kernel_squared_norms(tf_pairs, ids, NUM_UNITS, bias=True),
    }
    # sums of at most (8 rows x 4 positions)^2 pair terms, each at most |a_r||g_r||a_s||g_s| (|g_r||g_s| for the bias)
    terms = sum(np.sum(np.linalg.norm(a, axis=2) * np.linalg.norm(g, axis=2), axis=1) for a, g in pairs)
    bias_terms = sum(np.sum(np.linalg.norm(g, axis=2), axis=1) for _, g in pairs)
    scale = np.array([terms[IDS == u].sum() ** 2 for u in range(NUM_UNITS)])
    bias_scale = np.array([bias_terms[IDS == u].sum() ** 2 for u in range(NUM_UNITS)])
    for name, (got, got_bias) in forms.items():
        assert_close(got, want, atol=(rounding_rtol(32**2) + 2 * rounding_rtol(5)) * scale, err_msg=name)
        assert_close(got_bias, want_bias, atol=(rounding_rtol(32**2) + 2 * rounding_rtol(3)) * bias_scale, err_msg=name)


@pytest.mark.parametrize("num_units", [0, 3])
def test_empty_batch_of_units(num_units):
    """No rows: zero norms for every unit and zero sums, eagerly and traced (a Dense and an Embedding's grouped forms)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,), dtype="int32"), keras.layers.Embedding(10, 3), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    x, y = np.zeros((0, 4), "int32"), np.zeros((0,), "int32")
    kwargs = dict(unit_ids=np.zeros(0, np.int32), num_units=num_units, method="layerwise")
    assert np.array_equal(peg.per_example_norms(model, sparse_ce, x, y, **kwargs), np.zeros(num_units))
    traced = tf.function(
        lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, **kwargs), autograph=False
    )
    for s in traced(x, y):
        assert not np.any(np.asarray(tf.convert_to_tensor(s)))
