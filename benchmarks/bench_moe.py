"""Mixture-of-experts blocks: the layer-wise engine's clipped sum and norms against the plain batch step.

    python benchmarks/bench_moe.py                      # tiny Mixtral, B in {8, 16}
    python benchmarks/bench_moe.py --batch-sizes 16 --repeats 9 --hidden 64

One process builds a tiny KerasHub ``MixtralCausalLM`` (from its class, no
download) and wraps every quantity in a ``tf.function`` with an unknown batch
dimension, then times them round-robin (``bench_layerwise.time_round_robin``:
two warm-up calls each, then ``--repeats`` rounds, the starting quantity
rotating, so machine noise hits all alike). Reported: the median seconds per
call and the ratio to the plain batch step's median.

Quantities:
  batch_grad          plain step: ``tape.gradient`` of the mean loss, the baseline
  clipped_layerwise   ``peg.clipped_gradients(method="layerwise")``: the MoE blocks'
                      closed form (``rules.moe``)
  norms_layerwise     ``peg.per_example_norms(method="layerwise")``
  clipped_stand_in    the same clipped sum with the MoE rule unregistered, traced
                      with a static batch (the only case the stand-in can be
                      decided in): each block is a layer-local unit, the
                      per-example VJP of its call (``engines.capture``)
  clipped_weight_copies  ``method="weight_copies"``: what ``auto`` ran on these
                      models before
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

QUANTITIES = ("batch_grad", "clipped_layerwise", "norms_layerwise", "clipped_stand_in", "clipped_weight_copies")


def build(b: int, seq_len: int, hidden: int, experts: int, layers: int):
    import keras
    import keras_hub
    import numpy as np

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=256,
        num_layers=layers,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
        num_experts=experts,
        top_k=2,
    )
    model = keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (b, seq_len)).astype("int32")
    return (
        model,
        {"token_ids": ids, "padding_mask": np.ones_like(ids)},
        rng.integers(0, 256, (b, seq_len)).astype("int32"),
    )


def quantity_fns(model, x, y) -> dict:
    import keras
    import tensorflow as tf

    import per_example_grads as peg
    from per_example_grads.rules import moe
    from per_example_grads.rules.rule import RULES

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = model.trainable_variables
    t = x["token_ids"].shape[1]

    def batch_grad(x, y):
        with tf.GradientTape() as tape:
            l = tf.reduce_mean(loss(y, model(x)))
        return tape.gradient(l, variables)

    clipped = lambda method: lambda x, y: peg.clipped_gradients(model, loss, x, y, l2_norm_clip=1.0, method=method)  # noqa: E731
    fns = {
        "batch_grad": batch_grad,
        "clipped_layerwise": clipped("layerwise"),
        "norms_layerwise": lambda x, y: peg.per_example_norms(model, loss, x, y, method="layerwise"),
        "clipped_weight_copies": clipped("weight_copies"),
    }
    spec = [{k: tf.TensorSpec([None, t], tf.int32) for k in x}, tf.TensorSpec([None, t], tf.int32)]
    out = {q: tf.function(f, input_signature=spec) for q, f in fns.items()}
    # The stand-in is decided from static shapes: trace it on this batch's, with the MoE rule removed.
    static = [{k: tf.TensorSpec(v.shape, tf.int32) for k, v in x.items()}, tf.TensorSpec(y.shape, tf.int32)]
    stand_in = tf.function(clipped("layerwise"), input_signature=static)
    removed = {n: RULES.pop(n) for n in moe.MOE_BLOCKS}
    try:
        stand_in.get_concrete_function(*static)
    finally:
        RULES.update(removed)
    out["clipped_stand_in"] = stand_in
    return {q: out[q] for q in QUANTITIES}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="8,16")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    import tensorflow as tf
    from bench_layerwise import time_round_robin

    print(
        f"tiny Mixtral: {args.layers} layers, hidden {args.hidden}, intermediate {2 * args.hidden}, "
        f"{args.experts} experts (top 2), T={args.seq_len}; tf {tf.__version__}, {os.cpu_count()} CPUs; "
        f"median of {args.repeats} rounds of 3 calls"
    )
    print(f"| B | {' | '.join(QUANTITIES)} |")
    print("|---|" + "---|" * len(QUANTITIES))
    for b in [int(s) for s in args.batch_sizes.split(",")]:
        model, x, y = build(b, args.seq_len, args.hidden, args.experts, args.layers)
        med = time_round_robin(quantity_fns(model, x, y), x, y, args.repeats)
        base = med["batch_grad"]
        cells = [f"{1e3 * med[q]:.1f} ms ({med[q] / base:.2f}x)" for q in QUANTITIES]
        print(f"| {b} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
