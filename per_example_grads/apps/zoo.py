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
- ``conv_decoder``: an encoder-decoder on 32x32x3 images (two stride-2
  convolutions down, two stride-2 transposed convolutions up, a 1x1
  convolution to 10 channels, average pooling);
- ``digits_mlp`` and ``digits_dp_mlp``: the demos' MLPs on the bundled 8x8
  digits (``[B, 64]`` pixels, 64 hidden units, 10 classes; ReLU, and tanh for
  the private demo: its bounded activations suit clipped, noisy updates,
  Papernot et al., AAAI 2021);
- ``gpt2_lm``, ``gemma_lm``, ``llama_lm`` (KerasHub causal language models,
  token embedding tied to the output head) and ``bert_classifier``, built from
  their classes with tiny configurations (needs ``pip install ".[hub]"``);
- ``vit_classifier``: KerasHub's ``ViTImageClassifier`` (class-token head, 10
  classes) on a ``ViTBackbone``, tiny by default (32x32x3 images, 8x8 patches,
  2 layers of 32; ``lora_rank`` as above); ``image_size=224, patch_size=16, num_layers=12,
  hidden_dim=768, intermediate_dim=3072`` is ViT-B/16 (needs ``.[hub]``);
- ``mobilenet_v2``, ``efficientnet_b0``, ``convnext_tiny``, ``resnet50``,
  ``xception``: ``keras.applications`` on 32x32x3 images (Xception needs
  at least 71x71: ``image_size=71``), 10 classes, ``weights=None``,
  BatchNormalization as shipped. Every model returns logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import numpy as np

from per_example_grads.data import N_CLASSES, N_FEATURES

DIGITS_HIDDEN_UNITS = 64


def _mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="mlp",
    )


def _cnn() -> keras.Model:
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            L.Conv2D(16, 3, activation="relu"),
            L.MaxPooling2D(),
            L.Conv2D(32, 3, activation="relu"),
            L.MaxPooling2D(),
            L.Flatten(),
            L.Dense(64, activation="relu"),
            L.Dense(10),
        ],
        name="cnn",
    )


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
    return keras.Sequential(
        [
            keras.Input((64,), dtype="int32"),
            keras.layers.Embedding(20000, 32),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ],
        name="embedding_bag",
    )


def _conv_decoder() -> keras.Model:
    """An encoder-decoder on 32x32x3 images: two strided convolutions down, two transposed convolutions up."""
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            L.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
            L.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
            L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu"),
            L.Conv2DTranspose(16, 3, strides=2, padding="same", activation="relu"),
            L.Conv2D(10, 1),
            L.GlobalAveragePooling2D(),
        ],
        name="conv_decoder",
    )


def _digits_mlp(activation: str = "relu", name: str = "digits_mlp") -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((N_FEATURES,)),
            keras.layers.Dense(DIGITS_HIDDEN_UNITS, activation=activation),
            keras.layers.Dense(N_CLASSES),
        ],
        name=name,
    )


def _images(shape: tuple[int, ...]) -> Callable:
    return lambda rng, b: rng.normal(size=(b, *shape)).astype("float32")


def _ids(shape: tuple[int, ...], vocabulary: int) -> Callable:
    return lambda rng, b: rng.integers(0, vocabulary, (b, *shape)).astype("int32")


def _labels(classes: int) -> Callable:
    return lambda rng, b: rng.integers(0, classes, b).astype("int32")


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo entry: ``model(**config)`` builds it; ``data(rng, b, **config)`` draws ``(x, y)``."""

    model: Callable[..., keras.Model]
    data: Callable[..., tuple]
    needs: str | None = None  # the optional package it needs ("keras_hub"), if any


def _plain(builder: Callable[[], keras.Model], x: Callable, classes: int) -> ZooModel:
    return ZooModel(lambda: builder(), lambda rng, b: (x(rng, b), _labels(classes)(rng, b)))


# ---------------------------------------------------------------- KerasHub
# Tiny configurations by default; ``build(..., num_layers=4, hidden_dim=256,
# ...)`` gives the benchmarks' sizes. ``lora_rank`` enables LoRA on the backbone.

_HUB_DEFAULTS = dict(
    vocabulary_size=256,
    num_layers=2,
    hidden_dim=32,
    intermediate_dim=64,
    seq_len=8,
    lora_rank=None,
    num_key_value_heads=1,  # Gemma and Llama (grouped-query attention)
    tie_word_embeddings=False,  # Llama (Gemma's are tied, GPT-2's too)
)


def _hub_config(config: dict) -> dict:
    unknown = set(config) - set(_HUB_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown KerasHub zoo settings {sorted(unknown)}; choose from {sorted(_HUB_DEFAULTS)}")
    return {**_HUB_DEFAULTS, **config}


def _hub_backbone(family: str, c: dict):
    import keras_hub

    common = dict(
        vocabulary_size=c["vocabulary_size"],
        num_layers=c["num_layers"],
        hidden_dim=c["hidden_dim"],
        intermediate_dim=c["intermediate_dim"],
    )
    heads = max(2, c["hidden_dim"] // 64)
    if family == "gpt2":
        return keras_hub.models.GPT2Backbone(num_heads=heads, max_sequence_length=max(16, c["seq_len"]), **common)
    if family == "bert":
        return keras_hub.models.BertBackbone(num_heads=heads, max_sequence_length=max(16, c["seq_len"]), **common)
    grouped = dict(num_query_heads=heads, num_key_value_heads=c["num_key_value_heads"])
    if family == "gemma":
        return keras_hub.models.GemmaBackbone(head_dim=c["hidden_dim"] // heads, **grouped, **common)
    if family == "llama":
        return keras_hub.models.LlamaBackbone(tie_word_embeddings=c["tie_word_embeddings"], **grouped, **common)
    raise ValueError(family)


def _hub_model(family: str, **config) -> keras.Model:
    import keras_hub

    c = _hub_config(config)
    backbone = _hub_backbone(family, c)
    if c["lora_rank"]:
        backbone.enable_lora(rank=c["lora_rank"])
    if family == "bert":
        return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)
    head = {
        "gpt2": keras_hub.models.GPT2CausalLM,
        "gemma": keras_hub.models.GemmaCausalLM,
        "llama": keras_hub.models.LlamaCausalLM,
    }[family]
    return head(backbone=backbone, preprocessor=None)


def _hub_data(family: str) -> Callable:
    def data(rng, b, **config):
        c = _hub_config(config)
        ids = _ids((c["seq_len"],), c["vocabulary_size"])(rng, b)
        x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
        if family == "bert":
            x["segment_ids"] = np.zeros_like(ids)
            return x, _labels(2)(rng, b)
        return x, _ids((c["seq_len"],), c["vocabulary_size"])(rng, b)  # next tokens: [B, T]

    return data


def _hub(family: str) -> ZooModel:
    return ZooModel(lambda **config: _hub_model(family, **config), _hub_data(family), needs="keras_hub")


_VIT_DEFAULTS = dict(image_size=32, patch_size=8, num_layers=2, hidden_dim=32, intermediate_dim=64, lora_rank=None)


def _vit_model(**config) -> keras.Model:
    import keras_hub

    unknown = set(config) - set(_VIT_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown ViT zoo settings {sorted(unknown)}; choose from {sorted(_VIT_DEFAULTS)}")
    c = {**_VIT_DEFAULTS, **config}
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(c["image_size"], c["image_size"], 3),
        patch_size=c["patch_size"],
        num_layers=c["num_layers"],
        num_heads=max(2, c["hidden_dim"] // 64),
        hidden_dim=c["hidden_dim"],
        mlp_dim=c["intermediate_dim"],
    )
    if c["lora_rank"]:
        backbone.enable_lora(rank=c["lora_rank"])
    return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=10, preprocessor=None)


def _vit_data(rng, b, image_size: int = _VIT_DEFAULTS["image_size"], **config):
    return _images((image_size, image_size, 3))(rng, b), _labels(10)(rng, b)


# ------------------------------------------------------- keras.applications
# 32x32x3 inputs, 10 classes, random initialization (weights=None).


def _application(name: str) -> ZooModel:
    def model(image_size: int = 32, **config) -> keras.Model:
        make = getattr(keras.applications, name)
        return make(
            input_shape=(image_size, image_size, 3), weights=None, classes=10, classifier_activation=None, **config
        )  # logits, as every zoo model

    def data(rng, b, image_size: int = 32, **config):
        return _images((image_size, image_size, 3))(rng, b), _labels(10)(rng, b)

    return ZooModel(model, data)


MODELS: dict[str, ZooModel] = {
    "mlp": _plain(_mlp, _images((784,)), 10),
    "cnn": _plain(_cnn, _images((28, 28, 1)), 10),
    "transformer": _plain(_transformer, _ids((32,), 1000), 2),
    "embedding_bag": _plain(_embedding_bag, _ids((64,), 20000), 2),
    "conv_decoder": _plain(_conv_decoder, _images((32, 32, 3)), 10),
    "digits_mlp": _plain(_digits_mlp, _images((N_FEATURES,)), N_CLASSES),
    "digits_dp_mlp": _plain(lambda: _digits_mlp("tanh", "digits_dp_mlp"), _images((N_FEATURES,)), N_CLASSES),
    "gpt2_lm": _hub("gpt2"),
    "gemma_lm": _hub("gemma"),
    "llama_lm": _hub("llama"),
    "bert_classifier": _hub("bert"),
    "vit_classifier": ZooModel(_vit_model, _vit_data, needs="keras_hub"),
    "mobilenet_v2": _application("MobileNetV2"),
    "efficientnet_b0": _application("EfficientNetB0"),
    "convnext_tiny": _application("ConvNeXtTiny"),
    "resnet50": _application("ResNet50"),
    "xception": _application("Xception"),
}


def build_model(name: str, seed: int | None = 0, **config) -> keras.Model:
    """The zoo's model ``name``, initialized after ``keras.utils.set_random_seed(seed)`` (unless None).

    ``config``: the model's size settings (KerasHub: ``vocabulary_size``,
    ``num_layers``, ``hidden_dim``, ``intermediate_dim``, ``seq_len``,
    ``lora_rank``; keras.applications: ``image_size`` and the application's
    own arguments, such as ``alpha``).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    if seed is not None:
        keras.utils.set_random_seed(seed)
    return MODELS[name].model(**config)


def build(name: str, batch_size: int, seed: int = 0, **config) -> tuple[keras.Model, Any, np.ndarray]:
    """``(model, x, y)``: the model ``name`` and one synthetic batch of ``batch_size`` rows.

    ``x`` is an array, or a dict of arrays for the KerasHub models
    (``token_ids``, ``padding_mask``, and ``segment_ids`` for BERT); ``y`` is
    ``[batch_size]`` class ids, or ``[batch_size, seq_len]`` next-token ids for
    the causal language models.
    """
    model = build_model(name, seed, **config)
    data_config = {k: v for k, v in config.items() if k in ("image_size", *_HUB_DEFAULTS, *_VIT_DEFAULTS)}
    x, y = MODELS[name].data(np.random.default_rng(seed), batch_size, **data_config)
    return model, x, y
