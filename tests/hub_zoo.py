"""Tiny KerasHub backbones (one per family) and keras.applications models for tests/test_hub_zoo.py.

``CASES[name](b)`` returns ``(model, x, y)``: a freshly initialized model
(``keras.utils.set_random_seed(0)`` first) that returns logits, and one
batch of ``b`` examples with integer labels (``[b]``, or ``[b, T]`` per
token). KerasHub models are built from their classes with tiny
configurations (nothing is downloaded), keras.applications with
``weights=None``. Per family:

- decoder LMs: ``gemma3_lm`` (token embedding tied to the head; Gemma 3's
  ``RMSNormalization``, query-key norms), ``qwen3_lm`` (untied head;
  ``Qwen3LayerNorm``, also on heads), ``smollm3_lm`` (untied;
  ``keras.layers.RMSNormalization``);
- encoders: ``deberta_v3_classifier`` (``RelativeEmbedding``),
  ``roformer_v2_encoder`` (``RoformerNorm``);
- encoder-decoders: ``t5`` (two layers: ``T5LayerNorm``, the first
  ``T5MultiHeadAttention``'s relative attention bias, reused by the second), ``bart``, with a dense head on the decoder's output;
- vision transformers: ``vit`` (``ViTPatchingAndEmbedding``), ``deit``
  (``DeiTEmbeddings``), average-pooled into a dense head;
- mixture of experts: ``mixtral_lm`` (``MixtralLayerNormalization``, the
  sparse MoE block);
- keras.applications families that no other test runs against the
  one-example loop: ``app_mobilenet_v3_small`` (raw operations in its graph,
  hard-swish), ``app_efficientnet_v2_b0`` (the two the test runs: seconds
  each), ``app_densenet121``, ``app_resnet50_v2``, ``app_nasnet_mobile``
  (exact too, at tens of seconds each on two CPUs), on 32x32 images,
  BatchNormalization in inference (the zoo's models are called with
  ``training=False``).
"""

from __future__ import annotations

import keras
import numpy as np

V = 32  # vocabulary
T = 6  # tokens per sequence
D = 16  # hidden size
F = 32  # feed-forward size


def _ids(rng, b, t=T):
    return rng.integers(1, V, size=(b, t)).astype("int32")


def _mask(b, t=T):
    mask = np.ones((b, t), bool)
    mask[0, -1] = False  # one padded token: masks reach the closed forms' taps
    return mask


def _decoder(backbone, lm_class, b, rng):
    model = lm_class(backbone=backbone, preprocessor=None)
    x = {"token_ids": _ids(rng, b), "padding_mask": _mask(b)}
    return model, x, _ids(rng, b)


def gemma3_lm(b):
    import keras_hub

    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=V,
        image_size=16,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=D,
        intermediate_dim=F,
        head_dim=8,
        use_post_ffw_norm=True,
        use_post_attention_norm=True,
        vision_encoder=None,
    )
    return _decoder(backbone, keras_hub.models.Gemma3CausalLM, b, np.random.default_rng(1))


def qwen3_lm(b):
    import keras_hub

    backbone = keras_hub.models.Qwen3Backbone(
        vocabulary_size=V,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        hidden_dim=D,
        intermediate_dim=F,
        tie_word_embeddings=False,
    )
    return _decoder(backbone, keras_hub.models.Qwen3CausalLM, b, np.random.default_rng(2))


def smollm3_lm(b):
    import keras_hub

    backbone = keras_hub.models.SmolLM3Backbone(
        vocabulary_size=V,
        hidden_dim=D,
        intermediate_dim=F,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_bias=False,
        attention_dropout=0.0,
        rope_layer_enabled_list=[True],
        layer_types=["attention"],
        mlp_bias=False,
        layer_norm_epsilon=1e-6,
        max_position_embeddings=32,
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
    )
    return _decoder(backbone, keras_hub.models.SmolLM3CausalLM, b, np.random.default_rng(3))


def mixtral_lm(b):
    import keras_hub

    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=V,
        num_layers=1,
        num_query_heads=2,
        hidden_dim=D,
        intermediate_dim=F,
        num_key_value_heads=1,
        num_experts=2,
        top_k=2,
    )
    return _decoder(backbone, keras_hub.models.MixtralCausalLM, b, np.random.default_rng(4))


def _pooled_head(backbone, inputs, output, classes=3):
    """``backbone``'s ``output`` (a ``[B, T, D]`` sequence) average-pooled into a dense head."""
    h = keras.layers.GlobalAveragePooling1D()(output)
    return keras.Model(inputs, keras.layers.Dense(classes, name="head")(h))


def deberta_v3_classifier(b):
    import keras_hub

    backbone = keras_hub.models.DebertaV3Backbone(
        vocabulary_size=V,
        num_layers=1,
        num_heads=2,
        hidden_dim=D,
        intermediate_dim=F,
        dropout=0.0,
        max_sequence_length=T,
        bucket_size=4,
    )
    model = keras_hub.models.DebertaV3TextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
    rng = np.random.default_rng(5)
    x = {"token_ids": _ids(rng, b), "padding_mask": _mask(b)}
    return model, x, rng.integers(0, 3, size=b)


def roformer_v2_encoder(b):
    import keras_hub

    backbone = keras_hub.models.RoformerV2Backbone(
        vocabulary_size=V,
        num_layers=1,
        num_heads=2,
        hidden_dim=D,
        intermediate_dim=F,
        head_size=8,
        dropout=0.0,
    )
    inputs = {
        "token_ids": keras.Input((T,), dtype="int32", name="token_ids"),
        "segment_ids": keras.Input((T,), dtype="int32", name="segment_ids"),
    }
    model = _pooled_head(backbone, inputs, backbone(inputs))
    rng = np.random.default_rng(6)
    x = {"token_ids": _ids(rng, b), "segment_ids": rng.integers(0, 2, size=(b, T)).astype("int32")}
    return model, x, rng.integers(0, 3, size=b)


def _seq2seq(backbone, b, rng):
    """An encoder-decoder backbone with a dense head on each decoder token: per-token labels ``[b, T]``."""
    inputs = {
        name: keras.Input((T,), dtype="int32" if "ids" in name else "bool", name=name)
        for name in ("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask")
    }
    out = backbone(inputs)["decoder_sequence_output"]
    model = keras.Model(inputs, keras.layers.Dense(V, name="head")(out))
    x = {
        "encoder_token_ids": _ids(rng, b),
        "encoder_padding_mask": _mask(b),
        "decoder_token_ids": _ids(rng, b),
        "decoder_padding_mask": _mask(b),
    }
    return model, x, _ids(rng, b)


def t5(b):
    import keras_hub

    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=V,
        num_layers=2,
        num_heads=2,
        hidden_dim=D,
        intermediate_dim=F,
        key_value_dim=8,
        dropout=0.0,
    )
    return _seq2seq(backbone, b, np.random.default_rng(7))


def bart(b):
    import keras_hub

    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=V,
        num_layers=1,
        num_heads=2,
        hidden_dim=D,
        intermediate_dim=F,
        dropout=0.0,
        max_sequence_length=T,
    )
    return _seq2seq(backbone, b, np.random.default_rng(8))


IMAGE = 8  # vision transformers: 8x8x3 images, 4x4 patches


def _vision(backbone, b, rng):
    inputs = keras.Input((IMAGE, IMAGE, 3), name="images")
    model = _pooled_head(backbone, inputs, backbone(inputs))
    return model, rng.normal(size=(b, IMAGE, IMAGE, 3)).astype("float32"), rng.integers(0, 3, size=b)


def vit(b):
    import keras_hub

    backbone = keras_hub.models.ViTBackbone(
        image_shape=(IMAGE, IMAGE, 3),
        patch_size=4,
        num_layers=1,
        num_heads=2,
        hidden_dim=D,
        mlp_dim=F,
    )
    return _vision(backbone, b, np.random.default_rng(9))


def deit(b):
    import keras_hub

    backbone = keras_hub.models.DeiTBackbone(
        image_shape=(IMAGE, IMAGE, 3),
        patch_size=4,
        num_layers=1,
        num_heads=2,
        hidden_dim=D,
        intermediate_dim=F,
    )
    return _vision(backbone, b, np.random.default_rng(10))


def _application(name, size, **options):
    def build(b):
        make = getattr(keras.applications, name)
        model = make(input_shape=(size, size, 3), weights=None, classes=3, classifier_activation=None, **options)
        rng = np.random.default_rng(11)
        return model, rng.normal(size=(b, size, size, 3)).astype("float32"), rng.integers(0, 3, size=b)

    build.__name__ = name
    return build


HUB_CASES = {
    f.__name__: f
    for f in [
        gemma3_lm,
        qwen3_lm,
        smollm3_lm,
        deberta_v3_classifier,
        roformer_v2_encoder,
        t5,
        bart,
        vit,
        deit,
        mixtral_lm,
    ]
}
APPLICATION_CASES = {
    "app_mobilenet_v3_small": _application(
        "MobileNetV3Small", 32, minimalistic=False, alpha=0.75, include_preprocessing=False
    ),
    "app_densenet121": _application("DenseNet121", 32),
    "app_resnet50_v2": _application("ResNet50V2", 32),
    "app_nasnet_mobile": _application("NASNetMobile", 32),
    "app_efficientnet_v2_b0": _application("EfficientNetV2B0", 32, include_preprocessing=False),
}
CASES = {**HUB_CASES, **APPLICATION_CASES}


def build(name: str, b: int):
    """``(model, x, y)`` of case ``name`` with a batch of ``b``, after ``keras.utils.set_random_seed(0)``."""
    keras.utils.set_random_seed(0)
    return CASES[name](b)
