"""Grouped (per-unit) clipped sums and norms vs the example-level ones vs the plain batch step.

    python benchmarks/bench_units.py                       # zoo models and a tiny GPT-2, B in {64, 256}
    python benchmarks/bench_units.py --models mlp gpt2_lm --batch 64 --repeats 5

Units of ``--rows`` rows each (default 4: ``unit_ids = range(B) // 4``,
``num_units = B / 4``). For every (model, B) one process builds the model and
wraps each quantity in a ``tf.function`` with an unknown batch dimension,
then times them round-robin (``bench_layerwise.time_round_robin``: the order
rotates every repeat, medians), so machine load hits all alike. Reported:
the median seconds, each quantity's ratio to the plain batch step, and the
grouped-to-example ratio of the clipped sums and of the norms (the issue's
goal: the grouped clipped sum at most 1.3x the example-level one).

Quantities (all on the layer-wise engine):
  batch_grad       tape.gradient of the mean loss, the baseline
  clipped_examples peg.clipped_gradients, example-level
  clipped_units    peg.clipped_gradients(unit_ids=...), per-unit clipping
  norms_examples   peg.per_example_norms
  norms_units      peg.per_example_norms(unit_ids=...)

With ``--before``, also ``clipped_units_before`` and ``norms_units_before``:
the same traced with ``rules.grouped.NATIVE_FORMS = False`` (convolutions and
ReversibleEmbedding on the exact per-layer fallback, nothing kept for the
clipped sum), timed in the same round-robin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_layerwise import time_round_robin  # noqa: E402  (the shared round-robin timer)

MODELS = ("mlp", "cnn", "transformer", "embedding_bag", "gpt2_lm")
QUANTITIES = ("batch_grad", "clipped_examples", "clipped_units", "norms_examples", "norms_units")
BEFORE = ("clipped_units_before", "norms_units_before")
HUB_CONFIG = dict(vocabulary_size=1000, num_layers=2, hidden_dim=64, intermediate_dim=128, seq_len=32)


def build(name: str, b: int):
    from per_example_grads.apps import zoo

    return zoo.build(name, b, **(HUB_CONFIG if name.endswith("_lm") else {}))


def quantity_fns(model, x, b: int, rows: int) -> dict:
    """``{quantity: f(x, y)}``, each a ``tf.function`` with an unknown batch dimension; the unit ids fixed per cell."""
    import keras
    import numpy as np
    import tensorflow as tf

    import per_example_grads as peg

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = model.trainable_variables
    ids = tf.constant(np.arange(b) // rows, tf.int32)
    units = dict(unit_ids=ids, num_units=-(-b // rows))

    def batch_grad(x, y):
        with tf.GradientTape() as tape:
            total = tf.reduce_mean(loss(y, model(x)))
        return tape.gradient(total, variables)

    fns = {
        "batch_grad": batch_grad,
        "clipped_examples": lambda x, y: peg.clipped_gradients(model, loss, x, y, l2_norm_clip=1.0, method="layerwise"),
        "clipped_units": lambda x, y: peg.clipped_gradients(
            model, loss, x, y, l2_norm_clip=1.0, method="layerwise", **units
        ),
        "norms_examples": lambda x, y: peg.per_example_norms(model, loss, x, y, method="layerwise"),
        "norms_units": lambda x, y: peg.per_example_norms(model, loss, x, y, method="layerwise", **units),
    }

    def before(fn):
        """``fn`` traced with the grouped forms of ``rules.grouped.NATIVE_FORMS = False`` (the flag is read when traced)."""
        from per_example_grads.rules import grouped as grouped_rules

        def traced(x, y):
            grouped_rules.NATIVE_FORMS = False
            try:
                return fn(x, y)
            finally:
                grouped_rules.NATIVE_FORMS = True

        return traced

    fns["clipped_units_before"] = before(fns["clipped_units"])
    fns["norms_units_before"] = before(fns["norms_units"])
    spec = lambda t: tf.TensorSpec([None, *np.shape(t)[1:]], tf.as_dtype(np.asarray(t).dtype))  # noqa: E731
    return fns, spec


def time_cell(name: str, b: int, rows: int, repeats: int, with_before: bool = False) -> dict:
    import tensorflow as tf

    model, x, y = build(name, b)
    fns, spec = quantity_fns(model, x, b, rows)
    signature = [tf.nest.map_structure(spec, x), spec(y)]
    quantities = QUANTITIES + (BEFORE if with_before else ())
    traced = {q: tf.function(fns[q], input_signature=signature, autograph=False) for q in quantities}
    # The unit ids are fixed at B rows: every call gets exactly B rows.
    times = time_round_robin(traced, x, y, repeats)
    out = {q: round(t * 1e3, 2) for q, t in times.items()}
    base = times["batch_grad"]
    out.update({f"{q}_vs_batch": round(times[q] / base, 2) for q in quantities if q != "batch_grad"})
    for q in ("clipped", "norms"):
        for suffix in ("", "_before") if with_before else ("",):
            out[f"{q}_units{suffix}_vs_examples"] = round(times[f"{q}_units{suffix}"] / times[f"{q}_examples"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--rows", type=int, default=4, help="rows per unit")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--before", action="store_true", help="also time the grouped quantities without the native forms"
    )
    args = parser.parse_args()
    print("times in ms (median); ratios to batch_grad, and grouped / example-level", flush=True)
    for name in args.models:
        for b in args.batch:
            result = {
                "model": name,
                "B": b,
                "rows_per_unit": args.rows,
                **time_cell(name, b, args.rows, args.repeats, args.before),
            }
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
