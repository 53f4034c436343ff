"""Bad input gets a clear error naming the argument and what was expected."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import sparse_ce
from model_zoo import ZOO


@pytest.fixture
def case():
    return ZOO["mlp"]()


def test_mismatched_x_and_y(case):
    with pytest.raises(ValueError, match=r"x has B=5 but y has B=4"):
        peg.per_example_gradients(case.model, sparse_ce, case.x, case.y[:4])


def test_mismatch_inside_a_dict_names_the_keys():
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(keras.layers.Concatenate()([a, b])))
    x = {"a": np.ones((4, 3), "float32"), "b": np.ones((5, 2), "float32")}
    with pytest.raises(ValueError, match=r"x\['a'\] has B=4 but x\['b'\] has B=5"):
        peg.per_example_gradients(model, sparse_ce, x, np.zeros(4, "int32"))


def test_mismatched_sample_weight(case):
    with pytest.raises(ValueError, match=r"sample_weight has B=3"):
        peg.per_example_gradients(case.model, sparse_ce, case.x, case.y, sample_weight=np.ones(3))


def test_mismatch_inside_tf_function_is_caught_at_run_time(case):
    f = tf.function(
        lambda x, y: peg.per_example_gradients(case.model, sparse_ce, x, y),
        input_signature=[tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32)],
    )
    # The message names both inputs and their sizes (case.x has 5 rows).
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"leading batch dimension B: x has B =\] \[5\] \[but y has B =\] \[4\]"
    ):
        f(case.x, case.y[:4])


def test_run_time_mismatch_of_one_of_several_inputs_gives_every_size(case):
    f = tf.function(
        lambda x, y, w: peg.per_example_gradients(case.model, sparse_ce, x, y, sample_weight=w),
        input_signature=[tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32), tf.TensorSpec([None])],
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[but y, sample_weight have B =\] \[5 3\]"):
        f(case.x, case.y, np.ones(3, "float32"))
    assert f(case.x, case.y, np.ones(5, "float32"))[0].shape[0] == 5  # matching sizes pass the check


def test_sample_weight_must_be_vector(case):
    with pytest.raises(ValueError, match=r"sample_weight must have shape \[B\]"):
        peg.per_example_gradients(case.model, sparse_ce, case.x, case.y, sample_weight=np.ones((5, 2)))


def test_scalar_loss_is_explained(case):
    mean_loss = lambda y, p: tf.reduce_mean(sparse_ce(y, p))
    for method in ["auto", "vectorized", "loop", "jacobian", "weight_copies"]:
        with pytest.raises(peg.InvalidLossError, match="per-example"):
            peg.per_example_gradients(case.model, mean_loss, case.x, case.y, method=method)


def test_reducing_keras_loss_object_is_accepted(case):
    """A Loss with a batch-reducing reduction still gives per-example values."""
    reducing = keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # sum_over_batch_size
    unreduced = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    a = peg.per_example_gradients(case.model, reducing, case.x, case.y)
    b = peg.per_example_gradients(case.model, unreduced, case.x, case.y)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_model_without_trainable_variables(case):
    case.model.trainable = False
    with pytest.raises(ValueError, match="no trainable variables"):
        peg.per_example_gradients(case.model, sparse_ce, case.x, case.y)


def test_callable_without_variables():
    with pytest.raises(TypeError, match="variables="):
        peg.per_example_gradients(lambda x: x, sparse_ce, np.ones((2, 3)), np.zeros(2))


def test_integer_x_for_float_model(case):
    with pytest.raises(TypeError, match=r"x has dtype int64, but the model declares a float32 input"):
        peg.per_example_gradients(case.model, sparse_ce, np.ones((5, 6), "int64"), case.y)


def test_string_x(case):
    with pytest.raises(TypeError, match=r"x must be numeric"):
        peg.per_example_gradients(case.model, sparse_ce, np.array([["a"] * 6] * 5), case.y)


def test_scalar_x(case):
    with pytest.raises(ValueError, match=r"x must have a leading batch axis"):
        peg.per_example_gradients(case.model, sparse_ce, np.float32(1.0), case.y)


def test_unknown_method(case):
    with pytest.raises(ValueError, match=r"method must be one of .*'vectorized'.*got 'fastest'"):
        peg.per_example_gradients(case.model, sparse_ce, case.x, case.y, method="fastest")


def test_bad_loss_fn(case):
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        peg.per_example_gradients(case.model, 3, case.x, case.y)


def test_clip_norm_must_be_positive():
    with pytest.raises(ValueError, match="l2_norm_clip must be a finite number > 0"):
        peg.clip_by_global_norm([tf.ones([2, 3])], 0.0)
