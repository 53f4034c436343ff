"""The models the demos, the benchmarks and the tests share, with data to feed them.

``build(name, batch_size)`` returns ``(model, x, y)``: a freshly initialized
Keras model (``keras.utils.set_random_seed(seed)`` first, so two builds are
equal) and one synthetic batch, ``x`` of ``[batch_size, *input_shape]`` and
integer labels ``y`` of ``[batch_size]``. Nothing is downloaded.

    >>> model, x, y = build("mlp", 4)
    >>> model(x).shape, y.shape
    (TensorShape([4, 10]), (4,))

The models:

- ``mlp``: 784-512-512-10, ReLU (670k parameters);
- ``cnn``: two 3x3 convolutions with max pooling and two dense layers on 28x28x1;
- ``transformer``: token and learned position embeddings (vocabulary 1000,
  T=32, d=64), one block of 4-head attention and a 128-unit feed-forward,
  average pooling, 2 classes;
- ``embedding_bag``: a 20,000 x 32 embedding averaged over 64 tokens, 2 classes;
- ``digits_mlp`` and ``digits_dp_mlp``: the demos' MLPs on the bundled 8x8
  digits (``[B, 64]`` pixels, 64 hidden units, 10 classes; ReLU, and tanh for
  the private demo: its bounded activations suit clipped, noisy updates,
  Papernot et al., AAAI 2021).
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np

from per_example_grads.data import N_CLASSES, N_FEATURES

DIGITS_HIDDEN_UNITS = 64


def _mlp() -> keras.Model:
    return keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)], name="mlp")


def _cnn() -> keras.Model:
    L = keras.layers
    return keras.Sequential([
        keras.Input((28, 28, 1)), L.Conv2D(16, 3, activation="relu"), L.MaxPooling2D(),
        L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(), L.Flatten(),
        L.Dense(64, activation="relu"), L.Dense(10)], name="cnn")


def _transformer(t: int = 32, d: int = 64, vocabulary: int = 1000) -> keras.Model:
    L = keras.layers
    tokens = keras.Input((t,), dtype="int32")
    # Position ids 0..T-1 built from the input, so that the position table is
    # one of the model's weights (as in the peers' models).
    positions = keras.ops.zeros_like(tokens) + keras.ops.arange(t, dtype="int32")
    h = L.Embedding(vocabulary, d)(tokens) + L.Embedding(t, d)(positions)
    h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=4, key_dim=d // 4)(h, h))
    h = L.LayerNormalization()(h + L.Dense(d)(L.Dense(128, activation="relu")(h)))
    return keras.Model(tokens, L.Dense(2)(L.GlobalAveragePooling1D()(h)), name="transformer")


def _embedding_bag() -> keras.Model:
    return keras.Sequential([keras.Input((64,), dtype="int32"), keras.layers.Embedding(20000, 32),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)], name="embedding_bag")


def _digits_mlp(activation: str = "relu", name: str = "digits_mlp") -> keras.Model:
    return keras.Sequential([keras.Input((N_FEATURES,)), keras.layers.Dense(DIGITS_HIDDEN_UNITS, activation=activation),
                             keras.layers.Dense(N_CLASSES)], name=name)


# name -> (builder, input shape, input kind: "normal" or an exclusive integer bound, classes)
MODELS: dict[str, tuple[Callable[[], keras.Model], tuple[int, ...], str | int, int]] = {
    "mlp": (_mlp, (784,), "normal", 10),
    "cnn": (_cnn, (28, 28, 1), "normal", 10),
    "transformer": (_transformer, (32,), 1000, 2),
    "embedding_bag": (_embedding_bag, (64,), 20000, 2),
    "digits_mlp": (_digits_mlp, (N_FEATURES,), "normal", N_CLASSES),
    "digits_dp_mlp": (lambda: _digits_mlp("tanh", "digits_dp_mlp"), (N_FEATURES,), "normal", N_CLASSES),
}


def build_model(name: str, seed: int | None = 0) -> keras.Model:
    """The zoo's model ``name``, initialized after ``keras.utils.set_random_seed(seed)`` (unless None)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    if seed is not None:
        keras.utils.set_random_seed(seed)
    return MODELS[name][0]()


def build(name: str, batch_size: int, seed: int = 0) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """``(model, x, y)``: the model ``name`` and one synthetic batch of ``batch_size`` rows."""
    model = build_model(name, seed)
    _, shape, kind, classes = MODELS[name]
    rng = np.random.default_rng(seed or 0)
    if kind == "normal":
        x = rng.normal(size=(batch_size, *shape)).astype("float32")
    else:
        x = rng.integers(0, kind, (batch_size, *shape)).astype("int32")
    y = rng.integers(0, classes, batch_size).astype("int32")
    return model, x, y
