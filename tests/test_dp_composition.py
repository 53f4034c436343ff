"""Every refused pairing of DP parts comes from one table (``per_example_grads.dp.composition``), at every front door.

Each case builds the smallest configuration that holds a pairing at one front
door and expects the table's message, ``"{owner}: {first} cannot be combined
with {second}"``; every pairing of the table is reached by some case; no other
module words a refusal of its own; and a refused configuration builds nothing
that a retry would trip over.
"""

from __future__ import annotations

import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import mirrored_strategy
from per_example_grads.dp import composition
from per_example_grads.dp.audit import GradientCanaries, InputCanaries
from per_example_grads.dp.sparse_embeddings import SparseEmbeddings

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, T = 16, 3
X = np.random.default_rng(0).normal(size=(N, 4)).astype("float32")
Y = (np.arange(N) % 3).astype("int64")
IDS = np.random.default_rng(1).integers(0, 20, size=(N, T)).astype("int32")
UNITS = np.arange(N) // 2


def _net():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="head")])


def _bag():
    inputs = keras.Input((T,), dtype="int32")
    pooled = keras.ops.mean(keras.layers.Embedding(20, 4)(inputs), axis=1)
    return keras.Model(inputs, keras.layers.Dense(3)(pooled))


def _band():
    return peg.dp.BandMF(bands=2, num_steps=8)


def _dp(net=None, *, jit_compile=False, **kw):
    kw.setdefault("noise_multiplier", 1.0)
    dp = peg.keras.DPModel(net or _net(), **kw)
    dp.compile(optimizer="sgd", loss=LOSS, jit_compile=jit_compile)
    return dp


def _acc(net=None, **kw):
    net = net or _net()
    return peg.dp.GradientAccumulator(net, LOSS, **kw)


def _private(**kw):
    return dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4.0, **kw)


def _fit(dp, data):
    dp.fit(data, verbose=0)


def _units(x=X, y=Y, unit_ids=UNITS, **kw):
    return peg.dp.poisson_batches(x, y, unit_ids=unit_ids, sampling_probability=0.5, seed=0, **kw)


def _rows(x=X, y=Y, **kw):
    return peg.dp.poisson_batches(x, y, sampling_probability=0.5, seed=0, **kw)


def _truncated(x=X, y=Y):
    return peg.dp.truncated_poisson_batches(x, y, sampling_probability=0.5, truncated_batch_size=10, seed=0)


def _after_truncated_steps(dp):
    """``dp`` after one pass of truncated Poisson steps: its ledger holds them."""
    _fit(dp, _truncated())
    return dp


def _under_replicas(build):
    with mirrored_strategy().scope():
        return build()


def _sparse_step_under_xla():
    net = _bag()
    acc = _acc(net, **_private(sparse_embeddings=SparseEmbeddings()))
    tf.function(acc.accumulate, jit_compile=True)(IDS[:4], Y[:4])


def _custom_loop_units_under_xla():
    dp = _dp(privacy_unit="unit", physical_batch_size=4)  # the chunked path passes num_units: the engine had no check
    batch = next(iter(_units()))
    tf.function(dp.train_step, jit_compile=True)(batch)


def _gradient_canaries_by_hand_with_sparse():
    dp = _dp(_bag(), sparse_embeddings=SparseEmbeddings(), num_examples=N, expected_batch_size=4.0)
    GradientCanaries(4, seed=0).attach(dp.aggregator, dp.model.trainable_variables)
    dp.fit(IDS, Y, batch_size=4, verbose=0)


def _audit(dp, canaries):
    x, y = (IDS, Y) if dp._parts.sparse else (X, Y)
    peg.dp.audit.audit(dp, x, y, canaries=canaries, sampling_probability=0.5, delta=1e-3, steps=2)


# (front door, builder, the pairing's first and second parts as the message names them)
CASES = [
    # DP mode
    ("GradientAccumulator", lambda: _acc(privacy_unit="unit"), "privacy_unit='unit'", "plain mode (no l2_norm_clip)"),
    (
        "GradientAccumulator",
        lambda: _acc(_bag(), sparse_embeddings=SparseEmbeddings()),
        "sparse_embeddings",
        "plain mode (no l2_norm_clip)",
    ),
    # noise
    (
        "DPModel",
        lambda: _dp(mechanism=_band(), adaptive_clipping=peg.dp.AdaptiveClipping()),
        "adaptive_clipping",
        "a correlated mechanism (BandMF)",
    ),
    (
        "DPAggregator",
        lambda: peg.dp.DPAggregator(
            noise_multiplier=1.0, mechanism=_band(), adaptive_clipping=peg.dp.AdaptiveClipping()
        ),
        "adaptive_clipping",
        "a correlated mechanism (BandMF)",
    ),
    (
        "DPModel",
        lambda: _dp(_bag(), mechanism=_band(), sparse_embeddings=SparseEmbeddings()),
        "sparse_embeddings",
        "a correlated mechanism (BandMF)",
    ),
    (
        "GradientAccumulator",
        lambda: _acc(_bag(), **_private(mechanism=_band(), sparse_embeddings=SparseEmbeddings())),
        "sparse_embeddings",
        "a correlated mechanism (BandMF)",
    ),
    (
        "DPModel",
        lambda: _dp(_bag(), adaptive_clipping=peg.dp.AdaptiveClipping(), sparse_embeddings=SparseEmbeddings()),
        "sparse_embeddings",
        "adaptive_clipping",
    ),
    (
        "DPAggregator",
        lambda: peg.dp.DPAggregator(noise_multiplier=1.0, adaptive_clipping=peg.dp.AdaptiveClipping()).step(
            _net(), LOSS, X[:4], Y[:4], unit_ids=np.array([0, 0, 1, 1])
        ),
        "privacy_unit='unit'",
        "adaptive_clipping",
    ),
    (
        "GradientAccumulator",
        lambda: _acc(**_private(mechanism=_band(), budget=peg.dp.PrivacyBudget(steps=2))),
        "budget",
        "a correlated mechanism (BandMF)",
    ),
    # clipping
    (
        "DPModel",
        lambda: _dp(l2_norm_clip={"head": 1.0}, adaptive_clipping=peg.dp.AdaptiveClipping()),
        "adaptive_clipping",
        "a per-layer l2_norm_clip",
    ),
    (
        "DPAggregator",
        lambda: peg.dp.DPAggregator(
            l2_norm_clip={"head": 1.0}, noise_multiplier=1.0, adaptive_clipping=peg.dp.AdaptiveClipping()
        ),
        "adaptive_clipping",
        "a per-layer l2_norm_clip",
    ),
    (
        "DPModel",
        lambda: _dp(l2_norm_clip={"head": 1.0}, physical_batch_size=4),
        "physical_batch_size",
        "a per-layer l2_norm_clip",
    ),
    (
        "DPAggregator",
        lambda: peg.dp.DPAggregator(l2_norm_clip={"head": 1.0}, noise_multiplier=1.0, physical_batch_size=4),
        "physical_batch_size",
        "a per-layer l2_norm_clip",
    ),
    (
        "DPModel",
        lambda: _dp(privacy_unit="unit", adaptive_clipping=peg.dp.AdaptiveClipping()),
        "privacy_unit='unit'",
        "adaptive_clipping",
    ),
    (
        "DPModel",
        lambda: _dp(_bag(), privacy_unit="unit", sparse_embeddings=SparseEmbeddings()),
        "sparse_embeddings",
        "privacy_unit='unit'",
    ),
    (
        "GradientAccumulator",
        lambda: _acc(_bag(), **_private(privacy_unit="unit", sparse_embeddings=SparseEmbeddings())),
        "sparse_embeddings",
        "privacy_unit='unit'",
    ),
    # where it runs
    (
        "GradientAccumulator",
        lambda: _under_replicas(lambda: _acc(**_private(privacy_unit="unit"))),
        "privacy_unit='unit'",
        "2 replicas",
    ),
    (
        "GradientAccumulator",
        lambda: _under_replicas(lambda: _acc(_bag(), **_private(sparse_embeddings=SparseEmbeddings()))),
        "sparse_embeddings",
        "2 replicas",
    ),
    (
        "DPModel",
        lambda: _fit(_dp(privacy_unit="unit", jit_compile=True), _units()),
        "privacy_unit='unit'",
        "XLA (jit_compile=True)",
    ),
    (
        "DPModel.train_step (a custom loop)",
        _custom_loop_units_under_xla,
        "privacy_unit='unit'",
        "XLA (jit_compile=True)",
    ),
    (
        "DPModel",
        lambda: _fit(_dp(_bag(), sparse_embeddings=SparseEmbeddings(), jit_compile=True), _rows(IDS)),
        "sparse_embeddings",
        "XLA (jit_compile=True)",
    ),
    ("the DP step", _sparse_step_under_xla, "sparse_embeddings", "XLA (jit_compile=True)"),
    # per-user accounting of example-level sampling
    (
        "DPModel.epsilon",
        lambda: _dp(privacy_unit="unit").epsilon(1e-5, rows_per_user=2),
        "rows_per_user",
        "privacy_unit='unit'",
    ),
    (
        "DPModel.epsilon",
        lambda: _dp(mechanism=_band()).epsilon(1e-5, rows_per_user=2),
        "rows_per_user",
        "a correlated mechanism (BandMF)",
    ),
    (
        "DPModel.epsilon",
        lambda: _dp(adaptive_clipping=peg.dp.AdaptiveClipping()).epsilon(1e-5, rows_per_user=2),
        "rows_per_user",
        "adaptive_clipping",
    ),
    (
        "DPModel.epsilon",
        lambda: _dp(_bag(), sparse_embeddings=SparseEmbeddings()).epsilon(1e-5, rows_per_user=2),
        "rows_per_user",
        "sparse_embeddings",
    ),
    # Monte-Carlo accounting of a run
    (
        "DPModel.monte_carlo_epsilon",
        lambda: _dp(adaptive_clipping=peg.dp.AdaptiveClipping()).monte_carlo_epsilon(1e-5),
        "monte_carlo_epsilon",
        "adaptive_clipping",
    ),
    (
        "DPModel.monte_carlo_epsilon",
        lambda: _dp(_bag(), sparse_embeddings=SparseEmbeddings()).monte_carlo_epsilon(1e-5),
        "monte_carlo_epsilon",
        "sparse_embeddings",
    ),
    # truncated Poisson sampling
    (
        "DPModel",
        lambda: _fit(_dp(mechanism=_band()), _truncated()),
        "truncated Poisson sampling",
        "the BandMF mechanism",
    ),
    (
        "DPModel",
        lambda: _fit(_dp(adaptive_clipping=peg.dp.AdaptiveClipping()), _truncated()),
        "truncated Poisson sampling",
        "adaptive_clipping",
    ),
    (
        "DPModel",
        lambda: _fit(_dp(_bag(), sparse_embeddings=SparseEmbeddings()), _truncated(IDS)),
        "truncated Poisson sampling",
        "sparse_embeddings",
    ),
    (
        "DPModel.epsilon",
        lambda: _after_truncated_steps(_dp()).epsilon(1e-5, rows_per_user=2),
        "rows_per_user",
        "truncated Poisson sampling",
    ),
    (
        "DPModel.monte_carlo_epsilon",
        lambda: _after_truncated_steps(_dp()).monte_carlo_epsilon(1e-5),
        "monte_carlo_epsilon",
        "truncated Poisson sampling",
    ),
    ("DPModel", lambda: _fit(_dp(privacy_unit="unit"), _truncated()), "privacy_unit='unit'", "data without unit ids"),
    # audit
    (
        "audit",
        lambda: _audit(_dp(privacy_unit="unit"), InputCanaries(X[:4], Y[:4], seed=0)),
        "input canaries",
        "privacy_unit='unit'",
    ),
    (
        "audit",
        lambda: _audit(_dp(_bag(), sparse_embeddings=SparseEmbeddings()), GradientCanaries(4, seed=0)),
        "gradient canaries",
        "sparse_embeddings",
    ),
    ("DPAggregator", _gradient_canaries_by_hand_with_sparse, "gradient canaries", "sparse_embeddings"),
    (
        "audit",
        lambda: _audit(_under_replicas(_dp), GradientCanaries(4, seed=0)),
        "gradient canaries",
        "2 replicas",
    ),
    # sampling
    (
        "DPModel",
        lambda: _fit(_dp(mechanism=_band()), tf.data.Dataset.from_tensor_slices((X, Y)).batch(4)),
        "the BandMF mechanism",
        "data not sampled by peg.dp.poisson_batches",
    ),
    (
        "DPModel",
        lambda: _fit(_dp(), peg.dp.min_sep_batches(X, Y, sampling_probability=0.5, min_separation=2, seed=0)),
        "the GaussianNoise mechanism (accounted with amplification by Poisson sampling)",
        "b-min-sep sampling (a min_sep_batches dataset)",
    ),
    (
        "DPModel",
        lambda: _fit(_dp(mechanism=_band()), _rows()),
        "the BandMF mechanism (accounted for cycle_length=2)",
        "a poisson_batches dataset of cycle_length=1",
    ),
    (
        "DPModel",
        lambda: _fit(_dp(), _units()),
        "privacy_unit='example'",
        "a poisson_batches dataset of units (given unit_ids)",
    ),
    ("DPModel", lambda: _fit(_dp(privacy_unit="unit"), _rows()), "privacy_unit='unit'", "data without unit ids"),
    (
        "DPModel",
        lambda: _fit(
            _dp(privacy_unit="unit", physical_batch_size=2), _units(unit_ids=np.arange(N) // 4, rows_per_unit=3)
        ),
        "physical_batch_size=2",
        "units of up to rows_per_unit=3 rows",
    ),
]


@pytest.mark.parametrize("owner, build, first, second", CASES, ids=[f"{c[0]}:{c[2]}x{c[3]}" for c in CASES])
def test_a_refused_pairing_says_both_parts_why_and_what_instead(owner, build, first, second):
    with pytest.raises(ValueError) as refused:
        build()
    message = str(refused.value)
    prefix = f"{owner}: {first} cannot be combined with {second}: "
    assert prefix in message, message
    why_and_instead = message.split(prefix, 1)[1].strip()
    assert re.fullmatch(r"[^.].*\. \S.*\.", why_and_instead, re.DOTALL), why_and_instead


def test_every_pairing_of_the_table_is_reached_by_a_case(monkeypatch):
    reached = set()
    message = composition.Pairing.message

    def recording(self, parts):
        reached.add(composition.PAIRINGS.index(self))
        return message(self, parts)

    monkeypatch.setattr(composition.Pairing, "message", recording)
    for _, build, _, _ in CASES:
        with pytest.raises(ValueError):
            build()
    assert reached == set(range(len(composition.PAIRINGS)))


def test_no_other_dp_module_words_a_refused_pairing():
    # The DP front doors' modules (dp/, keras/); per_example_gradients' own options are not DP parts.
    package = pathlib.Path(peg.__file__).parent
    words = re.compile(
        r"cannot be combined with|is not available with|does not run under a strategy with|supports a single"
    )
    found = [
        str(path.relative_to(package))
        for path in [*package.joinpath("dp").rglob("*.py"), *package.joinpath("keras").rglob("*.py")]
        if path.name != "composition.py" and words.search(path.read_text())
    ]
    assert found == []


def test_a_refused_dpmodel_leaves_its_mechanism_free_for_the_retry():
    # The mechanism was attached (and so owned) before sparse_embeddings were refused: the retry said "cannot be shared".
    mechanism = _band()
    with pytest.raises(ValueError, match="cannot be combined"):
        _dp(_bag(), mechanism=mechanism, sparse_embeddings=SparseEmbeddings())
    _dp(_bag(), mechanism=mechanism)


def test_parts_that_do_not_compile_with_xla_default_to_no_xla_and_sound_pairings_combine():
    for dp in (_dp(privacy_unit="unit"), _dp(_bag(), sparse_embeddings=SparseEmbeddings())):
        dp.compile(optimizer="sgd", loss=LOSS)  # jit_compile="auto"
        assert dp.jit_compile is False
    # Pairings the table allows: a correlated mechanism per unit, adaptive clipping in chunks, units in chunks.
    _fit(_dp(mechanism=_band(), privacy_unit="unit"), _units(cycle_length=2))
    _fit(_dp(adaptive_clipping=peg.dp.AdaptiveClipping(), physical_batch_size=4), _rows())
    _fit(_dp(privacy_unit="unit", physical_batch_size=4), _units(rows_per_unit=2))
