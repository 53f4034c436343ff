"""Materialized per-example gradients: ``per_example_gradients`` against ``tf.vectorized_map`` of a per-example tape.

    python benchmarks/bench_materialized.py                          # zoo mlp, cnn, transformer, embedding_bag; B=64,256
    python benchmarks/bench_materialized.py --models mlp --batch-sizes 256 --repeats 15

For each (model, B), in one process, round-robin (every round calls each
function once, the first rotating), medians of ``--repeats`` rounds after two
untimed calls; every function is a ``tf.function`` with an unknown batch
dimension, its result fetched (``bench_layerwise.wait_for``):

- ``per_example_gradients`` (the library's default, ``method="auto"``);
- ``tf.vectorized_map`` of a ``GradientTape`` of one example's loss
  (what a user would write without the library);
- the batch gradient, for scale.

Written bandwidth: ``B x P`` float32 values over the time of each; the
machine's copy bandwidth is that of ``2 x`` on a tensor of ``B x P``
floats held in a variable (read and written once), and ``write floor`` is its time: what
writing the result alone costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import per_example_grads as peg  # noqa: E402
from benchmarks.bench_layerwise import wait_for  # noqa: E402
from per_example_grads.apps import zoo  # noqa: E402


def round_robin(fns: dict, args: tuple, repeats: int) -> dict[str, float]:
    names = list(fns)
    for f in fns.values():
        for _ in range(2):
            wait_for(f(*args))
    times = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            wait_for(fns[n](*args))
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(v) for n, v in times.items()}


def cell(name: str, b: int, repeats: int) -> list[str]:
    model, x, y = zoo.build(name, b)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    x, y = tf.constant(x), tf.constant(y)
    signature = [tf.TensorSpec([None, *x.shape[1:]], x.dtype), tf.TensorSpec([None, *y.shape[1:]], y.dtype)]
    variables = model.trainable_variables
    p = sum(int(np.prod(v.shape)) for v in variables)

    def one(args):
        xi, yi = args
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss(yi[None], model(xi[None])))
        return tape.gradient(value, variables)

    def batch(x, y):
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss(y, model(x)))
        return tape.gradient(value, variables)

    flat = tf.Variable(tf.zeros([b * p]))  # a variable, so that the copy is not folded into a constant
    fns = {
        "per_example_gradients": tf.function(
            lambda x, y: peg.per_example_gradients(model, loss, x, y), input_signature=signature
        ),
        "tf.vectorized_map": tf.function(lambda x, y: tf.vectorized_map(one, (x, y)), input_signature=signature),
        "batch gradient": tf.function(batch, input_signature=signature),
        "write floor (2 x of B x P)": tf.function(lambda x, y: flat * 2.0, input_signature=signature),
    }
    medians = round_robin(fns, (x, y), repeats)
    gb = b * p * 4 / 1e9
    ours, theirs, floor = (
        medians["per_example_gradients"],
        medians["tf.vectorized_map"],
        medians["write floor (2 x of B x P)"],
    )
    return [
        f"| {name} | {b} | {p:,} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | **{ours / theirs:.2f}** | "
        f"{medians['batch gradient'] * 1e3:.2f} | {gb / ours:.1f} | {gb / floor:.1f} | {ours / floor:.2f} |"
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,cnn,transformer,embedding_bag")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    lines = [
        "# Materialized per-example gradients against tf.vectorized_map",
        "",
        f"- command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`",
        f"- TensorFlow {tf.__version__}, Keras {keras.__version__}, os.cpu_count()={os.cpu_count()}, {a.repeats} rounds",
        "",
        "| model | B | P | per_example_gradients ms | vectorized_map ms | ours / vectorized_map | batch gradient ms "
        "| ours GB/s written | copy GB/s (2 x) | ours / write floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in a.models.split(","):
        for b in [int(s) for s in a.batch_sizes.split(",")]:
            lines += cell(name, b, a.repeats)
            print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
