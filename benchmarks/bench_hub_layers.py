"""KerasHub layers' closed forms (RMS norms, patch embeddings, T5 attention): clipped sum and norms against the plain batch step, before and after.

    python benchmarks/bench_hub_layers.py                       # ViT, T5, Qwen3; B in {16, 32}
    python benchmarks/bench_hub_layers.py --models vit --batch-sizes 64 --repeats 9

One process per run builds each tiny KerasHub model from its class (no
download) and wraps every quantity in a ``tf.function`` with an unknown batch
dimension, then times them round-robin (``bench_layerwise.time_round_robin``:
two warm-up calls each, then ``--repeats`` rounds of 3 calls, the starting
quantity rotating, so machine noise hits all alike). Reported: the median
milliseconds per call and the ratio to the plain batch step's median.

Models (``--hidden`` D, ``--layers``, ``--seq-len`` T):
  vit    ViTBackbone on 32x32x3 images, 4x4 patches (64 patches and a class
         token), mlp 2D, average-pooled into a 10-class head
  t5     T5Backbone (2 heads), a dense head over the vocabulary (256) on the
         decoder's T tokens; its first attention layers own the relative
         attention bias
  qwen3  Qwen3CausalLM (2 query heads, 1 key-value head, head_dim D/2,
         untied head): Qwen3LayerNorm on the residual stream and on every
         head's queries and keys

Quantities:
  batch_grad     plain step: ``tape.gradient`` of the mean loss, the baseline
  clipped_after  ``peg.clipped_gradients(method="layerwise")`` with this
                 project's closed forms
  norms_after    ``peg.per_example_norms(method="layerwise")``
  clipped_before, norms_before  the same, traced with the rules added for
                 issue #33 unregistered (``NEW_RULES``): those layers are
                 layer-local units, the per-example VJP of their call
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

QUANTITIES = ("batch_grad", "clipped_after", "norms_after", "clipped_before", "norms_before")
VOCABULARY = 256


def new_rules() -> list:
    """The registry keys of the rules issue #33 item 5 added (the RMS classes that had a rule before stay)."""
    import keras

    from per_example_grads.rules import hub_layers, patch_embedding, t5_attention

    had = {
        "keras_hub.src.models.gemma.rms_normalization.RMSNormalization",
        "keras_hub.src.models.llama.llama_layernorm.LlamaLayerNorm",
        "keras_hub.src.models.mistral.mistral_layer_norm.MistralLayerNormalization",
        "keras_hub.src.models.phi3.phi3_layernorm.Phi3LayerNorm",
        "keras_hub.src.layers.modeling.rms_normalization.RMSNormalization",
    }
    keys = [n for n in hub_layers.RMS_NORMALIZATIONS if n not in had]
    return keys + [
        hub_layers.RELATIVE_EMBEDDING,
        patch_embedding.VIT_PATCHING,
        patch_embedding.DEIT_EMBEDDINGS,
        t5_attention.T5_ATTENTION,
        keras.layers.RMSNormalization,
    ]


def build(name: str, b: int, hidden: int, layers: int, t: int):
    """``(model, x, y, specs)``: the model, one batch, and the ``tf.function`` input signature."""
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name == "vit":
        backbone = keras_hub.models.ViTBackbone(
            image_shape=(32, 32, 3), patch_size=4, num_layers=layers, num_heads=2, hidden_dim=hidden, mlp_dim=2 * hidden
        )
        inp = keras.Input((32, 32, 3))
        model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(backbone(inp))))
        x = rng.normal(size=(b, 32, 32, 3)).astype("float32")
        y = rng.integers(0, 10, b).astype("int32")
        return model, x, y, [tf.TensorSpec([None, 32, 32, 3], tf.float32), tf.TensorSpec([None], tf.int32)]
    ids = lambda: rng.integers(1, VOCABULARY, (b, t)).astype("int32")  # noqa: E731
    if name == "t5":
        backbone = keras_hub.models.T5Backbone(
            vocabulary_size=VOCABULARY,
            num_layers=layers,
            num_heads=2,
            hidden_dim=hidden,
            intermediate_dim=2 * hidden,
            key_value_dim=hidden // 2,
            dropout=0.0,
        )
        names = ("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask")
        inputs = {n: keras.Input((t,), dtype="int32" if "ids" in n else "bool", name=n) for n in names}
        model = keras.Model(inputs, keras.layers.Dense(VOCABULARY)(backbone(inputs)["decoder_sequence_output"]))
        x = {n: ids() if "ids" in n else np.ones((b, t), bool) for n in names}
        spec = {n: tf.TensorSpec([None, t], tf.int32 if "ids" in n else tf.bool) for n in names}
        return model, x, ids(), [spec, tf.TensorSpec([None, t], tf.int32)]
    if name == "qwen3":
        backbone = keras_hub.models.Qwen3Backbone(
            vocabulary_size=VOCABULARY,
            num_layers=layers,
            num_query_heads=2,
            num_key_value_heads=1,
            head_dim=hidden // 2,
            hidden_dim=hidden,
            intermediate_dim=2 * hidden,
            tie_word_embeddings=False,
        )
        model = keras_hub.models.Qwen3CausalLM(backbone=backbone, preprocessor=None)
        x = {"token_ids": ids(), "padding_mask": np.ones((b, t), "int32")}
        spec = {k: tf.TensorSpec([None, t], tf.int32) for k in x}
        return model, x, ids(), [spec, tf.TensorSpec([None, t], tf.int32)]
    raise ValueError(f"unknown model {name!r}")


def quantity_fns(model, specs) -> dict:
    import keras
    import tensorflow as tf

    import per_example_grads as peg
    from per_example_grads.rules.rule import RULES

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = model.trainable_variables

    def batch_grad(x, y):
        with tf.GradientTape() as tape:
            l = tf.reduce_mean(loss(y, model(x)))
        return tape.gradient(l, variables)

    clipped = lambda x, y: peg.clipped_gradients(model, loss, x, y, l2_norm_clip=1.0, method="layerwise")  # noqa: E731
    norms = lambda x, y: peg.per_example_norms(model, loss, x, y, method="layerwise")  # noqa: E731
    out = {
        "batch_grad": tf.function(batch_grad, input_signature=specs),
        "clipped_after": tf.function(clipped, input_signature=specs),
        "norms_after": tf.function(norms, input_signature=specs),
    }
    for q, fn in [("clipped_before", clipped), ("norms_before", norms)]:
        out[q] = tf.function(fn, input_signature=specs)
        removed = {k: RULES.pop(k) for k in new_rules() if k in RULES}
        try:
            out[q].get_concrete_function(*specs)  # the plan is fixed when traced
        finally:
            RULES.update(removed)
    return {q: out[q] for q in QUANTITIES}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit,t5,qwen3")
    parser.add_argument("--batch-sizes", default="16,32")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    import tensorflow as tf
    from bench_layerwise import time_round_robin

    print(
        f"hidden {args.hidden}, {args.layers} layers, T={args.seq_len}; tf {tf.__version__}, {os.cpu_count()} CPUs; "
        f"median of {args.repeats} rounds of 3 calls"
    )
    print(f"| model | B | {' | '.join(QUANTITIES)} |")
    print("|---|---|" + "---|" * len(QUANTITIES))
    for name in args.models.split(","):
        for b in [int(s) for s in args.batch_sizes.split(",")]:
            model, x, y, specs = build(name, b, args.hidden, args.layers, args.seq_len)
            med = time_round_robin(quantity_fns(model, specs), x, y, args.repeats)
            base = med["batch_grad"]
            cells = [f"{1e3 * med[q]:.1f} ms ({med[q] / base:.2f}x)" for q in QUANTITIES]
            print(f"| {name} | {b} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
