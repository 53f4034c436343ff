"""Privacy settings that cannot silently disagree with what ran: N from the data, one ledger per
network, a budget that holds, and no privacy argument accepted only to be ignored."""

import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import CrashAtStep
from per_example_grads.dp import ledger
from per_example_grads.dp.budget import PrivacyBudget

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
Y = np.arange(64) % 3


def _net():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])


def _dp(net=None, **kwargs):
    kwargs.setdefault("noise_multiplier", 1.0)
    dp = peg.keras.DPModel(net or _net(), **kwargs)
    dp.compile(optimizer="sgd", loss=LOSS)
    return dp


def _fit(dp, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the fixed-size-batches approximation note
        return dp.fit(*args, verbose=0, **kwargs)


# -- N comes from the data ---------------------------------------------------------


def test_arrays_refuse_a_larger_num_examples():
    # The case: 60,000 claimed, 64 rows trained on; epsilon was 0.0057 instead of 8.08.
    dp = _dp(num_examples=60_000, expected_batch_size=16)
    with pytest.raises(ValueError, match=r"num_examples=60000, but the arrays have 64 examples"):
        _fit(dp, X, Y, batch_size=16, epochs=1)
    assert int(dp.dp_steps.numpy()) == 0


def test_arrays_give_n_and_epsilon_matches_the_accountant():
    dp = _dp(expected_batch_size=16)
    _fit(dp, X, Y, batch_size=16, epochs=5)
    assert dp.num_examples == 64
    # 20 fixed-size batches of 16 of 64 rows, accounted (as a heuristic) at q = 16 / 64.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        expected = peg.dp.compute_epsilon(64, 16, None, 1.0, 1e-5, steps=20)
        assert dp.epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    assert expected > 5  # not the 0.0057 that N = 60,000 gave


def test_validation_split_counts_only_the_training_rows():
    dp = _dp(expected_batch_size=16)
    _fit(dp, X, Y, batch_size=16, epochs=1, validation_split=0.5)
    assert dp.num_examples == 32  # Keras trains on the first floor(64 * 0.5) rows
    dp = _dp(num_examples=64, expected_batch_size=16)
    with pytest.raises(ValueError, match=r"num_examples=64, but the arrays train on \(validation_split=0.5"):
        _fit(dp, X, Y, batch_size=16, epochs=1, validation_split=0.5)


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_dataset_of_known_cardinality_gives_n(drop_remainder):
    data = tf.data.Dataset.from_tensor_slices((X[:60], Y[:60])).batch(16, drop_remainder=drop_remainder)
    rows = 48 if drop_remainder else 60
    dp = _dp(num_examples=60_000, expected_batch_size=16)
    with pytest.raises(ValueError, match=rf"one pass of the dataset has {rows} examples"):
        _fit(dp, data, epochs=1)
    dp = _dp(expected_batch_size=16)
    _fit(dp, data, epochs=1)
    assert dp.num_examples == rows


def test_dataset_of_unknown_size_needs_num_examples():
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16).repeat()
    with pytest.raises(ValueError, match="repeats forever, whose number of examples is unknown"):
        _fit(_dp(expected_batch_size=16), data, epochs=1, steps_per_epoch=2)
    dp = _dp(expected_batch_size=16, num_examples=64)
    _fit(dp, data, epochs=1, steps_per_epoch=2)
    assert int(dp.dp_steps.numpy()) == 2


def test_every_fit_sees_the_same_n():
    dp = _dp(expected_batch_size=16)
    _fit(dp, X, Y, batch_size=16, epochs=1)
    with pytest.raises(ValueError, match="num_examples=64, but the arrays have 32"):
        _fit(dp, X[:32], Y[:32], batch_size=16, epochs=1)


def test_fit_takes_keras_positional_arguments():
    dp = _dp(expected_batch_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dp.fit(X, Y, 16, 2, 0)  # batch_size, epochs, verbose
    assert int(dp.dp_steps.numpy()) == 8


# -- One ledger per network ----------------------------------------------------------


def test_training_the_network_outside_is_refused():
    net = _net()
    dp = _dp(net, expected_batch_size=16)
    _fit(dp, X, Y, batch_size=16, epochs=1)
    before = dp.epsilon(1e-3)
    net.compile(optimizer="sgd", loss=LOSS)
    net.fit(X, Y, verbose=0)  # the case: epsilon() was unchanged
    with pytest.raises(ValueError, match=r"changed outside this DPModel after its 4 DP step"):
        dp.epsilon(1e-3)
    with pytest.raises(ValueError, match="changed outside this DPModel"):
        _fit(dp, X, Y, batch_size=16, epochs=1)
    dp.accept_current_weights()
    assert dp.epsilon(1e-3) == before


def test_a_layer_made_untrainable_after_steps_is_named_not_taken_for_training_outside():
    net = _net()
    dp = _dp(net, expected_batch_size=16)
    _fit(dp, X, Y, batch_size=16, epochs=1)
    net.layers[0].trainable = False  # told before: "changed outside this DPModel ... set_weights"
    with pytest.raises(ValueError, match=r"other trainable variables than at its last DP step \(4 then, 2 now"):
        dp.epsilon(1e-3)
    net.layers[0].trainable = True
    assert dp.epsilon(1e-3) > 0


def test_epsilon_before_any_step_is_zero():
    # After a fit of no step on poisson_batches it asked for num_examples and expected_batch_size.
    dp = _dp()
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=0.25, seed=0), epochs=0, verbose=0)
    assert dp.epsilon(1e-5) == 0.0 and _dp().epsilon(1e-5) == 0.0


def test_changes_before_the_first_step_are_accepted():
    net = _net()
    dp = _dp(net, expected_batch_size=16)
    net.set_weights([w + 1.0 for w in net.get_weights()])  # e.g. public weights loaded by hand
    _fit(dp, X, Y, batch_size=16, epochs=1)
    assert int(dp.dp_steps.numpy()) == 4


def test_a_second_dp_model_cannot_take_over_a_trained_network():
    net = _net()
    first = _dp(net, expected_batch_size=16)
    _fit(first, X, Y, batch_size=16, epochs=1)
    with pytest.raises(ValueError, match="already wrapped by another DPModel, which has taken 4 DP step"):
        peg.keras.DPModel(net, noise_multiplier=1.0)


def test_the_guards_advice_for_a_second_dp_model_carries_the_ledger(tmp_path):
    # It advised clone_model, then set_weights: a new DPModel at 0 steps on privately trained weights.
    net = _net()
    first = _dp(net, expected_batch_size=16)
    _fit(first, X, Y, batch_size=16, epochs=1)
    with pytest.raises(ValueError, match="load that DPModel's save_weights file into it, which carries the ledger"):
        peg.keras.DPModel(net, noise_multiplier=1.0)
    first.save_weights(tmp_path / "run.weights.h5")
    second = _dp(keras.models.clone_model(net), expected_batch_size=16)
    second.load_weights(tmp_path / "run.weights.h5")
    assert int(second.dp_steps.numpy()) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the fixed-size-batches heuristic
        assert second.epsilon(1e-3) == first.epsilon(1e-3)


def test_an_untrained_owner_hands_over_and_then_refuses_to_train():
    net = _net()
    first = _dp(net, expected_batch_size=16)
    second = _dp(net, expected_batch_size=16)
    _fit(second, X, Y, batch_size=16, epochs=1)
    with pytest.raises(ValueError, match="now wrapped by another DPModel"):
        _fit(first, X, Y, batch_size=16, epochs=1)


def test_restored_weights_restore_their_fingerprint(tmp_path):
    net = _net()
    dp = _dp(net, expected_batch_size=16)
    _fit(dp, X, Y, batch_size=16, epochs=1)
    path = str(tmp_path / "dp.weights.h5")
    dp.save_weights(path)
    _fit(dp, X, Y, batch_size=16, epochs=1)
    dp.load_weights(path)  # weights, ledger and fingerprint of step 4
    assert int(dp.dp_steps.numpy()) == 4
    assert dp.epsilon(1e-3) > 0  # no false alarm
    restored = _dp(expected_batch_size=16)
    restored.load_weights(path)
    _fit(restored, X, Y, batch_size=16, epochs=1)
    assert int(restored.dp_steps.numpy()) == 8


# -- A budget that holds ------------------------------------------------------------


def test_step_budget_stops_fit_and_later_fits():
    dp = _dp(expected_batch_size=16, budget=PrivacyBudget(steps=6))
    with pytest.warns(UserWarning, match=r"stopped after DP step 6: the privacy budget \(6 steps\) allows 6"):
        dp.fit(X, Y, batch_size=16, epochs=5, verbose=0)
    assert int(dp.dp_steps.numpy()) == 6
    weights = [w.copy() for w in dp.model.get_weights()]
    with pytest.warns(UserWarning, match=r"took no step \(6 taken before\)"):
        dp.fit(X, Y, batch_size=16, epochs=5, verbose=0)
    assert int(dp.dp_steps.numpy()) == 6
    assert all(np.array_equal(a, b) for a, b in zip(weights, dp.model.get_weights()))


def test_train_on_batch_keeps_to_the_budget_and_the_ledger():
    # It took steps past the budget without a word, and epsilon() then took its steps for training outside.
    dp = _dp(expected_batch_size=16, num_examples=64, budget=PrivacyBudget(steps=2))
    for _ in range(2):
        dp.train_on_batch(X[:16], Y[:16])
    weights = [w.copy() for w in dp.model.get_weights()]
    with pytest.raises(
        RuntimeError, match=r"takes no step: the privacy budget \(2 steps\) allows 2 steps, 2 are taken"
    ):
        dp.train_on_batch(X[:16], Y[:16])
    assert int(dp.dp_steps.numpy()) == 2
    assert all(np.array_equal(a, b) for a, b in zip(weights, dp.model.get_weights()))
    with pytest.warns(UserWarning, match="not a proven bound for fixed-size batches"):
        want = peg.dp.compute_epsilon(64, 16, None, 1.0, 1e-5, steps=2, sampling="shuffle")
        assert dp.epsilon(1e-5) == pytest.approx(want, rel=1e-12)


def _custom_loop(dp, steps, *, jit_compile=False):
    """``steps`` calls of ``dp.train_step`` in the user's own ``tf.function``, on batches of 16."""
    step = tf.function(dp.train_step, jit_compile=jit_compile)
    for i in range(steps):
        step((X[16 * (i % 4) : 16 * (i % 4) + 16], Y[16 * (i % 4) : 16 * (i % 4) + 16]))


@pytest.mark.parametrize(
    "budget", [PrivacyBudget(steps=3), PrivacyBudget(epsilon=4.0, delta=1e-3, accountant="rdp")], ids=["steps", "eps"]
)
def test_a_custom_loop_over_train_step_stops_at_the_budget(budget):
    # It took every step it was given: the budget was a fit callback.
    dp = _dp(expected_batch_size=16, num_examples=64, budget=budget)
    dp.optimizer.build(dp.model.trainable_variables)
    limit = dp.max_steps()
    assert 1 <= limit < 20
    _custom_loop(dp, limit)
    assert int(dp.dp_steps.numpy()) == limit
    weights = [w.copy() for w in dp.model.get_weights()]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"train_step takes no step: the privacy budget"):
        _custom_loop(dp, 1)
    assert int(dp.dp_steps.numpy()) == limit  # not counted, and nothing released
    assert all(np.array_equal(a, b) for a, b in zip(weights, dp.model.get_weights()))
    if budget.epsilon is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            assert dp.epsilon(1e-3, accountant="rdp") <= 4.0
    dp.model.layers[0].kernel.assign(dp.model.layers[0].kernel * 2.0)  # ... and still sees a change of its own
    with pytest.raises(ValueError, match="was changed outside this DPModel after its"):
        dp.epsilon(1e-3)


def test_a_custom_loop_after_a_fit_is_limited_at_its_own_batches_rate():
    # Its limit was computed at the last fit's q = 0.25; its batches of 32 are q = 0.5, and it overspent.
    budget = PrivacyBudget(epsilon=6.0, delta=1e-3, accountant="rdp", rtol=1e-6)
    dp = _dp(num_examples=64, budget=budget)
    dp.optimizer.build(dp.model.trainable_variables)
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=0.25, seed=0), epochs=1, verbose=0)
    step = tf.function(dp.train_step)
    with pytest.raises(tf.errors.InvalidArgumentError, match="takes no step"):
        for i in range(200):
            step((X[32 * (i % 2) : 32 * (i % 2) + 32], Y[32 * (i % 2) : 32 * (i % 2) + 32]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fixed-size batches: the heuristic
        assert dp.epsilon(1e-3, accountant="rdp") <= 6.0
    assert int(dp.dp_steps.numpy()) > 4  # the loop did take steps


def test_a_custom_loop_stops_eagerly_too_and_after_a_fit():
    dp = _dp(expected_batch_size=16, num_examples=64, budget=PrivacyBudget(steps=5))
    _fit(dp, X, Y, batch_size=16, epochs=1)  # 4 steps: within the budget
    dp.train_step((X[:16], Y[:16]))  # the fifth, eagerly
    with pytest.raises(tf.errors.InvalidArgumentError, match="takes no step"):
        dp.train_step((X[:16], Y[:16]))
    assert int(dp.dp_steps.numpy()) == 5


def test_a_custom_loop_under_a_strategy_stops_at_the_budget():
    from helpers import mirrored_strategy

    strategy = mirrored_strategy()
    with strategy.scope():
        dp = _dp(expected_batch_size=16, num_examples=64, budget=PrivacyBudget(steps=2))
        dp.optimizer.build(dp.model.trainable_variables)
    batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)))
    step = tf.function(lambda batch: strategy.run(dp.train_step, args=(batch,)))
    step(next(batches)), step(next(batches))
    with pytest.raises(tf.errors.InvalidArgumentError, match="takes no step"):
        step(next(batches))
    assert int(dp.dp_steps.numpy()) == 2
    # The segments add up under replicas too (one fixed-size segment of 2 steps at q = 16 / 64, the global batch).
    assert ledger.events(dp.aggregator.segments.numpy(), 2) == [ledger.Segment(2, 1.0, 0.25, False)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert dp.epsilon(1e-3) > 0  # the guard took the loop's own steps for the DPModel's


def test_a_custom_loop_under_xla_with_a_budget_is_refused_but_fit_under_xla_keeps_it():
    dp = _dp(expected_batch_size=16, num_examples=64, budget=PrivacyBudget(steps=2))
    with pytest.raises(ValueError, match=r"traced with XLA \(jit_compile=True\) outside fit and train_on_batch"):
        _custom_loop(dp, 1, jit_compile=True)
    assert int(dp.dp_steps.numpy()) == 0
    dp = peg.keras.DPModel(_net(), noise_multiplier=1.0, expected_batch_size=16, budget=PrivacyBudget(steps=2))
    dp.compile(optimizer="sgd", loss=LOSS, jit_compile=True)
    with pytest.warns(UserWarning, match="stopped after DP step 2"):
        dp.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    assert int(dp.dp_steps.numpy()) == 2


def test_train_on_batch_after_a_poisson_fit_is_accounted_as_a_fixed_size_batch():
    # Its batch was recorded as a Poisson sample at the last fit's q, which nothing guaranteed.
    dp = _dp()
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=0.25, seed=0), epochs=1, verbose=0)
    assert int(dp.aggregator.poisson.numpy()) == 1
    dp.train_on_batch(X[:16], Y[:16])
    assert int(dp.aggregator.poisson.numpy()) == 0 and int(dp.dp_steps.numpy()) == 5
    with pytest.warns(UserWarning, match="not a proven bound for fixed-size batches"):
        dp.epsilon(1e-5)


def test_a_correlated_mechanism_trains_only_through_fit():
    # train_on_batch and a custom loop took BandMF steps on batches no partition governed.
    dp = _dp(mechanism=peg.dp.BandMF(bands=2, num_steps=8))
    with pytest.raises(ValueError, match=r"DPModel.train_on_batch: the BandMF mechanism cannot be combined with data"):
        dp.train_on_batch(X[:16], Y[:16])
    with pytest.raises(ValueError, match=r"DPModel.train_step \(a custom loop\): the BandMF mechanism cannot"):
        tf.function(dp.train_step)((X[:16], Y[:16], np.ones(16, "float32")))
    assert int(dp.dp_steps.numpy()) == 0


def test_epsilon_budget_is_met_and_one_more_step_would_exceed_it():
    target, delta = 3.0, 1e-3
    dp = _dp(budget=PrivacyBudget(epsilon=target, delta=delta, accountant="rdp", rtol=1e-6))
    data = peg.dp.poisson_batches(X, Y, sampling_probability=0.25, seed=0)
    with pytest.warns(UserWarning, match="stopped after DP step"):
        dp.fit(data, epochs=20, verbose=0)
    steps = int(dp.dp_steps.numpy())
    assert steps == dp.max_steps()
    assert dp.epsilon(delta, accountant="rdp") <= target
    # Independently: the accountant at one more step is over the target.
    assert peg.dp.compute_epsilon(64, 16, None, 1.0, delta, steps=steps + 1, accountant="rdp") > target


def test_pld_budget_search_is_within_rtol_of_the_largest():
    budget = PrivacyBudget(epsilon=2.0, delta=1e-5, rtol=0.01)
    steps = budget.max_steps(noise_multiplier=1.1, sampling_probability=0.01)
    eps = lambda t: peg.dp.compute_epsilon(10_000, 100, None, 1.1, 1e-5, steps=t)  # noqa: E731
    assert eps(steps) <= 2.0 < eps(int(steps * 1.01) + 1)


@pytest.mark.slow
def test_a_restored_run_stops_at_the_same_budget(tmp_path):
    """Kill after step 7 with a backup at step 6; the restored run stops at 10 steps, not 6 + a full epoch more."""
    backup = str(tmp_path / "backup")
    data = peg.dp.poisson_batches(X, Y, sampling_probability=0.25, seed=1)  # 4 steps an epoch
    args = dict(budget=PrivacyBudget(steps=10), seed=0)
    with pytest.raises(RuntimeError, match="killed"):
        _fit(
            _dp(**args),
            data,
            epochs=5,
            callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=3), CrashAtStep(7)],
        )
    restored = _dp(**args)
    _fit(restored, data, epochs=5, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=3)])
    assert int(restored.dp_steps.numpy()) == 10


def test_budget_arguments_are_checked():
    with pytest.raises(ValueError, match="either steps or"):
        PrivacyBudget(epsilon=1.0, delta=1e-5, steps=3)
    with pytest.raises(ValueError, match="needs epsilon and delta"):
        PrivacyBudget(epsilon=1.0)
    with pytest.raises(TypeError, match="budget must be a peg.dp.PrivacyBudget"):
        peg.keras.DPModel(_net(), noise_multiplier=1.0, budget=3.0)


# -- No ignored argument ---------------------------------------------------------------


def test_compile_refuses_loss_weights_and_loss_lists():
    dp = peg.keras.DPModel(_net(), noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"does not take loss_weights \(got \[2.0\]\)"):
        dp.compile(optimizer="sgd", loss=LOSS, loss_weights=[2.0])
    with pytest.raises(ValueError, match="one loss for one output; got a list"):
        dp.compile(optimizer="sgd", loss=[LOSS, LOSS])


@pytest.mark.parametrize("seed", ["a", 1.5, [1.0, 2.0]])
def test_a_seed_of_the_wrong_type_is_refused_at_construction(seed):
    with pytest.raises(TypeError, match="seed must be None, an int, a pair of ints"):
        peg.keras.DPModel(_net(), noise_multiplier=1.0, seed=seed)


def test_an_unknown_method_is_refused_at_construction():
    with pytest.raises(ValueError, match="method must be one of .*got 'bogus'"):
        peg.keras.DPModel(_net(), noise_multiplier=1.0, method="bogus")


@pytest.mark.parametrize("mode", ["mean", "sum", "per_example"])
def test_compute_gradients_refuses_a_clip_it_would_not_apply(mode):
    with pytest.raises(ValueError, match=f"l2_norm_clip is used only with mode='clipped_sum'; mode='{mode}'"):
        peg.compute_gradients(_net(), LOSS, X, Y, mode=mode, l2_norm_clip=1e-6)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(expected_batch_size=10), "expected_batch_size only applies"),
        (dict(noise_multiplier=1.0), "noise_multiplier only applies"),
        (dict(seed=0), "seed only applies"),
        (
            dict(method="loop", expected_batch_size=10),
            "expected_batch_size, seed|expected_batch_size, method only apply",
        ),
    ],
)
def test_accumulator_refuses_dp_arguments_without_dp(kwargs, named):
    with pytest.raises(ValueError, match=named):
        peg.GradientAccumulator(_net(), LOSS, **kwargs)


def test_accumulator_apply_refuses_an_optimizer_name():
    acc = peg.GradientAccumulator(_net(), LOSS)
    acc.accumulate(X, Y)
    with pytest.raises(TypeError, match="optimizer must be an optimizer object .* got str 'sgd'"):
        acc.apply("sgd")


def test_a_repeated_seed_warns_once():
    net = _net()
    args = dict(l2_norm_clip=1.0, noise_multiplier=1.0, seed=(12345, 678))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = peg.dp.private_gradients(net, LOSS, X, Y, **args)
        assert not [w for w in caught if issubclass(w.category, peg.dp.RepeatedNoiseWarning)]
        second = peg.dp.private_gradients(net, LOSS, X, Y, **args)
        peg.dp.private_gradients(net, LOSS, X, Y, **args)
    repeated = [w for w in caught if issubclass(w.category, peg.dp.RepeatedNoiseWarning)]
    assert len(repeated) == 1 and "a second time in this process" in str(repeated[0].message)
    # What the warning is about: the noise is the same, so the difference cancels it exactly.
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_a_fixed_seed_inside_tf_function_warns():
    net = _net()
    step = tf.function(
        lambda x, y: peg.dp.private_gradients(net, LOSS, x, y, l2_norm_clip=1.0, noise_multiplier=1.0, seed=(999, 1))
    )
    with pytest.warns(peg.dp.RepeatedNoiseWarning, match="inside a tf.function"):
        step(X, Y)


def test_transforms_refuse_a_single_tensor():
    g = tf.ones([3, 2])
    for transform in (peg.sum_examples, peg.mean_examples, peg.global_norms, peg.per_variable_norms):
        with pytest.raises(TypeError, match=r"one \[B, \*var.shape\] entry per variable .* pass \[grads\]"):
            transform(g)
    assert peg.sum_examples([g])[0].numpy().tolist() == [3.0, 3.0]


# -- Gradients move between copies of a model ---------------------------------------------


def test_import_between_two_copies_of_a_model_by_position():
    worker, server = _net(), _net()
    pairs = peg.compute_gradients(worker, LOSS, X, Y)
    exported = peg.export_gradients(pairs)
    with pytest.raises(ValueError, match="import with match='position'"):
        peg.import_gradients(exported, server.trainable_variables)
    received = peg.import_gradients(exported, server.trainable_variables, match="position")
    assert [v.path for _, v in received] == [v.path for v in server.trainable_variables]
    for (g, _), (h, _) in zip(received, pairs):
        np.testing.assert_array_equal(g.numpy(), h.numpy())
    as_list = peg.import_gradients(list(exported.values()), server.trainable_variables)
    assert len(as_list) == 4


def test_export_of_private_gradients_says_to_pair_them_with_their_variables():
    net = _net()
    grads = peg.dp.private_gradients(net, LOSS, X, Y, l2_norm_clip=1.0, noise_multiplier=1.0, seed=(0, 0))
    with pytest.raises(TypeError, match=r"takes \(gradient, variable\) pairs.*zip\(grads, model.trainable_variables\)"):
        peg.export_gradients(grads)  # was "too many values to unpack"
    exported = peg.export_gradients(zip(grads, net.trainable_variables))
    assert list(exported) == [v.path for v in net.trainable_variables]


def test_import_by_position_refuses_a_dict_whose_keys_say_otherwise():
    # Two kernels of one shape: a re-ordered dict was paired by position without a word.
    def net():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(4)])

    worker = net()
    exported = peg.export_gradients(peg.compute_gradients(worker, "mse", X, np.zeros((64, 4), "float32")))
    paths = list(exported)
    swapped = {k: exported[k] for k in [paths[2], paths[1], paths[0], paths[3]]}  # the two kernels
    with pytest.raises(ValueError, match="its keys name these variables, in another order: import with match='path'"):
        peg.import_gradients(swapped, worker.trainable_variables, match="position")
    bias_first = {k: exported[k] for k in [paths[1], paths[0], paths[2], paths[3]]}
    with pytest.raises(ValueError, match="pairs a 'bias' gradient with a 'kernel' variable"):
        peg.import_gradients(bias_first, net().trainable_variables, match="position")
    assert len(peg.import_gradients(exported, net().trainable_variables, match="position")) == 4


def test_import_by_position_names_every_mismatch():
    server = _net()
    arrays = [np.zeros((4, 8), np.float64), np.zeros((7,), np.float32)]
    with pytest.raises(ValueError) as err:
        peg.import_gradients(arrays, server.trainable_variables)
    message = str(err.value)
    assert "2 gradients for 4 variables" in message
    assert "#0" in message and "dtype float64 != variable dtype float32" in message
    assert "#1" in message and "shape (7,) != variable shape (8,)" in message
    with pytest.raises(TypeError, match="arrays must be a dict"):
        peg.import_gradients(np.zeros(3), server.trainable_variables)


def test_a_repeated_dataset_is_of_unknown_size():
    # One pass of repeat(2) shows each of the 64 examples twice: N is not its 128 rows.
    data = tf.data.Dataset.from_tensor_slices((X, Y)).repeat(2).batch(16)
    with pytest.raises(
        ValueError, match=r"repeats its elements \(Dataset.repeat\), whose number of examples is unknown"
    ):
        _fit(_dp(expected_batch_size=16), data, epochs=1)


def test_fit_on_no_examples_is_refused():
    with pytest.raises(ValueError, match="DPModel.fit was given no examples"):
        _fit(_dp(expected_batch_size=16), X[:0], Y[:0], batch_size=16, epochs=1)


def test_private_gradients_names_a_string_seed():
    with pytest.raises(TypeError, match="seed must be None, an int, a pair of ints"):
        peg.dp.private_gradients(_net(), LOSS, X, Y, l2_norm_clip=1.0, noise_multiplier=1.0, seed="abc")


@pytest.mark.parametrize("check", [peg.dp.check_model, peg.dp.fix_model])
def test_model_checks_name_a_non_model(check):
    with pytest.raises(TypeError, match="model must be a .*Keras model.* got str"):
        check("not a model")


def test_fingerprint_is_the_integer_sums_of_the_entries_bits_plain_and_by_position():
    """``(sum b_j, sum (2 j + 1) b_j) mod 2^32`` of every entry's bits, eagerly and in a graph alike.

    Exact equality matters: a checkpoint's saved fingerprint is compared with
    ``==``. The reference sums the bits as Python integers (no wrapping).
    """
    from per_example_grads.keras import network_guard

    rng = np.random.default_rng(0)
    piece = 2**20  # sizes about a million entries, where the sums of a 32-bit word wrap
    cases = [((3,), "float32"), ((129,), "float16"), ((piece,), "float32"), ((piece + 1,), "float32")]
    cases += [((3, piece // 2 + 5), "float32"), ((piece + 3,), "float16"), ((piece // 2 + 1,), "float64")]
    cases += [((piece + 1,), "float64")]  # each entry two uint32 halves
    cases += [((), "float32"), ((), "float64"), ((7, 5), "float64"), ((3, 5, 7), "float32"), ((11,), "bfloat16")]
    # on both sides of the size the eager fingerprint sums on the host
    cases += [((network_guard._ON_HOST,), "float32"), ((2, network_guard._ON_HOST // 2 + 1), "float32")]

    def bits_of(v):
        width = {2: np.uint16, 4: np.uint32, 8: np.uint32}[np.dtype(v.dtype.name).itemsize]
        return np.ascontiguousarray(v.numpy()).reshape(-1).view(width).tolist()

    def want(bits):
        return np.array([sum(bits) % 2**32, sum((2 * j + 1) * b for j, b in enumerate(bits)) % 2**32], np.float64)

    in_graph = tf.function(network_guard.graph_fingerprint, jit_compile=True)  # a custom loop's step, under XLA
    for shape, dtype in cases:
        v = tf.Variable(rng.normal(size=shape).astype(dtype) * 3)
        assert np.array_equal(network_guard.fingerprint([v]), want(bits_of(v))), (shape, dtype)
        assert np.array_equal(in_graph([v]).numpy(), want(bits_of(v))), (shape, dtype)
    both = [tf.Variable(rng.normal(size=s).astype("float32")) for s in [(5,), (piece + 7,), (6,)]]
    assert np.array_equal(network_guard.fingerprint(both), want(sum((bits_of(v) for v in both), [])))
    assert np.array_equal(network_guard.graph_fingerprint(both).numpy(), want(sum((bits_of(v) for v in both), [])))
    assert np.array_equal(in_graph(both).numpy(), want(sum((bits_of(v) for v in both), [])))


def test_a_custom_loops_fingerprint_adds_a_few_ops_per_variable():
    """Each variable's reductions are one call of a kept function: the step's graph gains about 6 ops per variable
    (its input, read, bitcast, reshape and the call), where the reductions traced inline added about 55 (a quarter
    of a ResNet-50 custom-loop step's ops, and of its first call's time)."""
    from per_example_grads.keras import network_guard

    variables = [tf.Variable(np.ones((4, 3), "float32")) for _ in range(20)]
    graph = tf.function(network_guard.graph_fingerprint).get_concrete_function(variables).graph
    assert len(graph.get_operations()) <= 8 * len(variables), len(graph.get_operations())


def test_the_fingerprint_sees_weights_moved_to_other_places():
    # (sum b, sum b^2), the earlier fingerprint, did not change under a permutation of the weights.
    from per_example_grads.keras import network_guard

    net = _net()
    before, blind = (
        kind(net.trainable_variables) for kind in (network_guard.fingerprint, network_guard.bit_sums_fingerprint)
    )
    kernel = net.trainable_variables[0]
    kernel.assign(kernel.numpy()[::-1])  # rows in reverse order
    assert np.array_equal(network_guard.bit_sums_fingerprint(net.trainable_variables), blind)
    assert not np.array_equal(network_guard.fingerprint(net.trainable_variables), before)
    dp = _dp(net, expected_batch_size=16)
    _fit(dp, X, Y, batch_size=16, epochs=1)
    kernel.assign(kernel.numpy()[::-1])
    with pytest.raises(ValueError, match="changed outside this DPModel"):
        dp.epsilon(1e-3)


def test_a_checkpoint_with_the_earlier_bit_sums_fingerprint_is_still_recognised():
    from per_example_grads.keras import network_guard

    net = _net()
    saved = tf.Variable(network_guard.bit_sums_fingerprint(net.trainable_variables), dtype=tf.float64)
    guard = network_guard.NetworkGuard(net, saved)
    assert not guard.changed()
    net.trainable_variables[-1].assign_add(tf.ones_like(net.trainable_variables[-1]))
    assert guard.changed()


def test_a_checkpoint_with_the_earlier_float_fingerprint_is_still_recognised():
    """Weights saved with ``legacy_fingerprint`` (earlier versions) are not taken for training outside the ledger."""
    from per_example_grads.keras import network_guard

    rng = np.random.default_rng(1)
    shapes = [(3,), (129,), (1 << 16,), ((1 << 16) + 1,), (1000, 257), (7, 3, 40_001)]
    weights = [tf.Variable(rng.normal(size=s).astype("float32") * 3) for s in shapes]
    for v in weights:  # legacy_fingerprint is numpy's pairwise float64 sums, bit for bit
        w = np.asarray(v.numpy(), np.float64)
        assert np.array_equal(network_guard.legacy_fingerprint([v]), [w.sum(), np.square(w).sum()]), v.shape
    saved = tf.Variable(network_guard.legacy_fingerprint(weights), dtype=tf.float64)
    guard = network_guard.NetworkGuard(types.SimpleNamespace(trainable_variables=weights), saved)
    assert not guard.changed()
    weights[-1][0, 0].assign(weights[-1][0, 0] + 1.0)
    assert guard.changed()
    guard.refresh()
    assert not guard.changed() and np.array_equal(saved.numpy(), network_guard.fingerprint(weights))
