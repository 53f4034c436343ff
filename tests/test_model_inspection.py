"""Fails loudly if the Keras internals model_inspection relies on change."""

import keras

from per_example_grads._core import model_inspection


def test_flatten_layers_reaches_nested_and_subclassed_layers():
    inner = keras.Sequential([keras.layers.Dense(2, name="inner_dense")])

    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.proj = keras.layers.Dense(2, name="block_proj")
            self.drop = keras.layers.Dropout(0.1, name="block_drop")

        def call(self, x):
            return self.drop(self.proj(x))

    inp = keras.Input((3,))
    model = keras.Model(inp, Block()(inner(inp)))
    names = {l.name for l in model_inspection.iter_layers(model)}
    assert {"inner_dense", "block_proj", "block_drop"} <= names
    assert [l.name for l in model_inspection.random_layers(model)] == ["block_drop"]


def test_detectors():
    inp = keras.Input((4, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    model = keras.Model(inp, h)
    assert [l.name for l in model_inspection.batch_coupling_layers(model, training=True)] == ["bn"]
    assert model_inspection.batch_coupling_layers(model, training=False) == []
    model.get_layer("bn").trainable = False  # frozen BN runs in inference mode
    assert model_inspection.batch_coupling_layers(model, training=True) == []
    assert model_inspection.declared_input_dtypes(model) == ["float32"]
