"""How often a DP step is traced, and what ``auto`` remembers between traces.

A retrace costs as much as the first step (the whole model, its layer rules
and the noise traced again), so these count Python calls: ``train_step``
runs once per trace of Keras's train function, and the layer-wise capture
once per trace of the clipped pass. What ``auto`` remembers
(``engines.selection``: refusals and the engine used, per model and input
signature) must be re-planned whenever what it depends on changes; the
gradients are checked against the one-example loop each time.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_grads_close, reference_gradients, sparse_ce
from per_example_grads._core import pfor_limits
from per_example_grads.engines import layerwise, selection


def _counting(monkeypatch, owner, name) -> list:
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.slow
def test_fit_traces_once_per_batch_shape_and_not_per_fit(monkeypatch):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    traces = []
    original = dp.train_step
    dp.train_step = lambda data: (traces.append(1), original(data))[1]  # read by Keras when it builds the function
    captures = _counting(monkeypatch, layerwise, "capture")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 3, 64)

    def fit(q, seed):
        # Each dataset's batches have one padded shape; their realized sizes differ from step to step.
        dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=q, steps=2, seed=seed), epochs=1, verbose=0)

    fit(0.25, 0)
    assert len(traces) == 1
    fit(0.25, 1)  # a second fit, a new dataset of the same sampling: no retrace
    assert len(traces) == 1
    fit(0.5, 2)  # another q, another padded batch size: one trace
    assert len(traces) == 2
    fit(0.5, 3)
    assert len(traces) == 2
    # The clipped pass is traced once per step trace: not again for the non-finite check's recomputation,
    # nor for the engine choice.
    assert len(captures) == len(traces)
    assert int(dp.dp_steps.numpy()) == 8


@pytest.mark.slow
def test_a_per_token_loss_with_adam_traces_the_first_step_once():
    # Adam creates its moments on first use; DPModel creates them before the first trace (on symbolic
    # inputs), else TensorFlow traces the step a second time. The batch's [B] mask must not take part
    # in that build: against a language model's [B, T] loss it does not broadcast.
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(7, 4), keras.layers.Dense(7)])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)
    dp.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    traces = []
    original = dp.train_step
    dp.train_step = lambda data: (traces.append(1), original(data))[1]
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 7, (32, 5)).astype("int32"), rng.integers(0, 7, (32, 5))
    dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.25, steps=2, seed=0), epochs=1, verbose=0)
    assert len(traces) == 1
    assert dp.optimizer.iterations.numpy() == 2


def test_the_library_is_not_converted_by_autograph_under_a_users_function(monkeypatch):
    """Inside a user's tf.function (AutoGraph on), the entry points and the DP step run unconverted.

    Converting them re-parsed the source of the whole library below them at
    every trace; none of it branches on tensors in Python. The gradients are
    checked against the one-example loop.
    """
    from tensorflow.python.autograph.impl import api  # AutoGraph's one conversion entry point

    converted = []
    original = api._convert_actual

    def convert(entity, program_ctx):
        converted.append(getattr(entity, "__module__", "") or "")
        return original(entity, program_ctx)

    monkeypatch.setattr(api, "_convert_actual", convert)
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 4)).astype("float32"), rng.integers(0, 3, 6)

    @tf.function
    def user_step(x, y):
        clipped = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1e6)
        noised = peg.dp.private_gradients(
            model, sparse_ce, x, y, l2_norm_clip=1e6, noise_multiplier=0.0, expected_batch_size=6.0
        )
        return clipped, noised

    clipped, noised = user_step(x, y)
    want = reference_gradients(model, sparse_ce, x, y)
    summed = [w.sum(axis=0) for w in want]
    assert_grads_close(clipped, summed)
    assert_grads_close(noised, [w / 6.0 for w in summed])
    assert converted and not [name for name in converted if name.startswith("per_example_grads")]


def test_poisson_batches_are_sampled_without_autograph(monkeypatch):
    """The sampler's map functions run unconverted: converting them was most of a first call's time."""
    from tensorflow.python.autograph.impl import api

    called = []
    original = api.converted_call

    def converted_call(f, args, kwargs, caller_fn_scope=None, options=None):
        called.append(getattr(f, "__module__", "") or "")
        return original(f, args, kwargs, caller_fn_scope=caller_fn_scope, options=options)

    monkeypatch.setattr(api, "converted_call", converted_call)
    x, y = np.arange(40.0, dtype="float32").reshape(20, 2), np.arange(20) % 3
    for unit_ids in (None, np.arange(20) // 2):
        batch = next(iter(peg.dp.poisson_batches(x, y, sampling_probability=0.5, steps=1, seed=0, unit_ids=unit_ids)))
        rows = batch[0].numpy()[batch[2].numpy() > 0]
        assert len(rows) and set(rows[:, 0]) <= set(x[:, 0])  # real rows are rows of x
    assert not [name for name in called if name.startswith("per_example_grads")]
    next(iter(tf.data.Dataset.range(1).map(lambda i: i + 1)))  # a map function tf.data does convert
    assert called  # so the hook sees conversions: the check above is not vacuous


class _OwnScale(keras.Model):
    """A model that owns a variable itself, so ``auto`` passes the layer-wise engine for ``vectorized``."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def build(self, shape):
        self.dense.build(shape)
        self.scale = self.add_weight(shape=(3,), initializer="ones", name="scale")

    def call(self, x):
        return self.dense(x) * self.scale


@pytest.mark.slow
def test_auto_remembers_per_signature_and_structure(monkeypatch):
    keras.utils.set_random_seed(1)
    model = _OwnScale()
    rng = np.random.default_rng(1)
    flat = rng.normal(size=(6, 4)).astype("float32"), rng.integers(0, 3, 6)
    sequence = rng.normal(size=(6, 2, 4)).astype("float32"), rng.integers(0, 3, (6, 2))
    model(flat[0])
    model.scale.assign([0.5, -1.0, 2.0])
    hazard_checks = _counting(monkeypatch, pfor_limits, "vectorization_hazards")
    monkeypatch.setattr(selection, "_warned", set())  # the fallback warns once per process

    def check(x, y):
        got = peg.per_example_gradients(model, sparse_ce, x, y)
        assert_grads_close(got, reference_gradients(model, sparse_ce, x, y))

    with pytest.warns(peg.EngineFallbackWarning):
        check(*flat)
    assert len(hazard_checks) == 1
    check(*flat)  # the same model and signature: the plan is reused, the one-example graph not traced again
    assert len(hazard_checks) == 1
    check(*sequence)  # another input signature: planned anew
    assert len(hazard_checks) == 2
    check(*sequence)
    assert len(hazard_checks) == 2
    model.dense.trainable = False  # other variables requested: planned anew
    check(*flat)
    assert len(hazard_checks) == 3
    model.dense.trainable = True
    check(*flat)  # back to the first structure: its remembered plan
    assert len(hazard_checks) == 3


def test_a_remembered_engine_that_fails_is_not_trusted(monkeypatch):
    """A remembered choice only says where to start: when that engine fails, the whole order is tried again."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(5, 4)).astype("float32"), rng.integers(0, 3, 5)
    want = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y), want)
    plans = selection._PLANS[model]
    assert [p["auto"][0] for p in plans.values() if "auto" in p] == ["layerwise"]

    def broken(problem, batch, sparse=False):
        raise tf.errors.InternalError(None, None, "the layer-wise engine failed")

    monkeypatch.setattr(layerwise, "per_example_gradients", broken)
    monkeypatch.setattr(selection, "_warned", set())
    with pytest.warns(peg.EngineFallbackWarning, match="layerwise"):
        assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y), want)
    assert [p["auto"][0] for p in plans.values() if "auto" in p] == ["vectorized"]


def test_a_poisson_step_builds_no_empty_batch_branch_and_an_empty_batch_changes_nothing(monkeypatch):
    """The real rows are gathered to a dynamic count that is at least one bucket of rows (zero-weight ones
    when none is real), so the clipped pass needs no ``tf.cond`` against an empty batch: its
    no-examples branch is never built. A batch with no real row then contributes exactly nothing:
    with no noise and plain SGD, the weights do not move."""
    from per_example_grads._core import batch as batch_module

    built = _counting(monkeypatch, batch_module, "_no_examples")
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.integers(0, 3, 16)
    sampling = peg.dp.poisson_batches(x, y, sampling_probability=0.5, seed=0).pegrad_sampling
    empty = tf.data.Dataset.from_tensors((x, y, np.zeros(16, "float32")))
    empty.pegrad_sampling = sampling
    before = [w.copy() for w in net.get_weights()]
    dp.fit(empty, epochs=1, verbose=0)
    for w, b in zip(net.get_weights(), before):
        np.testing.assert_array_equal(w, b)
    real = tf.data.Dataset.from_tensors((x, y, np.ones(16, "float32")))
    real.pegrad_sampling = sampling
    dp.fit(real, epochs=1, verbose=0)  # and a batch of real rows does move them (the test can fail)
    assert any(not np.array_equal(w, b) for w, b in zip(net.get_weights(), before))
    assert built == []


@pytest.mark.parametrize("method", ["auto", "loop"])
def test_the_remembered_plans_keep_no_model_alive(method):
    """A plan names the model's layers, variables and loss by id; it refers to them weakly, so a model (and its
    weights) is freed when the user drops it, even when the loss closes over it. It held them for ever."""
    import gc
    import weakref

    def run():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        x, y = np.zeros((5, 4), "float32"), np.zeros(5, "int64")

        def loss(labels, predictions):  # closes over the model, as a user's loss may
            assert model.built
            return sparse_ce(labels, predictions)

        peg.per_example_gradients(model, loss, x, y, method=method)
        assert selection._PLANS[model]  # remembered while the model lives
        return weakref.ref(model)

    model = run()
    gc.collect()
    assert model() is None


def test_layers_of_one_shape_share_their_slice_bounds_and_weight_columns():
    """A second convolution of the first one's shape adds no constant to the graph: its norms' slices reuse the
    bounds, its clipped sum the weights' column, so it adds only the ops that compute (fewer nodes to trace and
    optimize on a model's first step)."""
    from per_example_grads._core.example_ops import weighted_example_sum
    from per_example_grads.rules import conv

    spec = conv.ConvSpec(2, (3, 3), (1, 1), (1, 1), "same")
    with tf.Graph().as_default() as graph:
        a, g = tf.compat.v1.placeholder(tf.float32, [4, 8, 8, 3]), tf.compat.v1.placeholder(tf.float32, [4, 8, 8, 5])
        weights = tf.compat.v1.placeholder(tf.float32, [4])

        def layer(a, g) -> tuple[int, int]:
            """``(ops, Const ops)`` the norms and the clipped sum of one layer add."""
            before = graph.get_operations()
            conv._shifted_norms(spec, (8, 8), a, g)
            weighted_example_sum(weights, tf.reshape(g, [4, -1, 5]))
            added = graph.get_operations()[len(before) :]
            return len(added), sum(op.type == "Const" for op in added)

        first, first_consts = layer(a, g)
        second, second_consts = layer(tf.identity(a), tf.identity(g))
    assert first_consts >= 9  # each offset's slice bounds, made once
    assert second_consts == 1  # the second layer's own reshape target ([4, -1, 5] above), nothing else
    assert second - second_consts == first - first_consts - 1  # the same computing ops but the weights' column
