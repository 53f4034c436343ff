"""Convolution paths: the one the cost model chooses against every alternative and against materialize-clip-sum.

    python benchmarks/bench_conv_paths.py                      # reference CNN + 24 random layers, B=64, 15 rounds
    python benchmarks/bench_conv_paths.py --configs 8 --repeats 7 --out /tmp/conv_paths.md
    python benchmarks/bench_conv_paths.py --calibrate          # measure this machine's rates first (cached)

Two parts, each timed round-robin in one process (every round calls each
function once, the starting one rotating), medians reported:

1. The reference CNN (Conv 16@8x8 stride 2 'same' on 28x28x1, MaxPool 2
   stride 1, Conv 32@4x4 stride 2 'valid', MaxPool 2 stride 1, Dense 32,
   Dense 10): the batch gradient, ``clipped_gradients``, ``per_example_norms``,
   ``per_example_gradients`` and materialize-clip-sum, with the paths chosen
   by cost (``conv.CHOOSE_BY_COST = True``) and by the fixed rules
   (``False``), each traced once under its setting.
2. Random Conv1D/Conv2D layers (seeded: kernel sizes, strides, paddings,
   dilations, image sizes, channels): one layer's clipped sum (norms, clip
   factors, weighted sum) from its input and output gradient by every path
   (``gram:<builder>`` with the kernel VJP, ``patches:<builder>`` and
   ``offsets`` with the kept kernels), by the chosen path, and by
   materialize-clip-sum (``per_example_kernels``, their norms, their weighted
   sum). The chosen path is the one of these the cost model picks (the same
   function, so that the ratios measure the choice alone). Reported: the
   chosen path's time over the fastest path's, and over
   materialize-clip-sum's.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import per_example_grads as peg  # noqa: E402
from per_example_grads import transforms  # noqa: E402
from per_example_grads.rules import conv, path_costs  # noqa: E402


def round_robin(fns: dict, args: tuple, repeats: int) -> dict[str, float]:
    """Median seconds of each ``fns[name](*args)`` (results fetched), called once per round, the first rotating."""
    names = list(fns)
    for f in fns.values():
        for _ in range(2):
            tf.nest.map_structure(np.asarray, f(*args))
    times = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            tf.nest.map_structure(np.asarray, fns[n](*args))
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(v) for n, v in times.items()}


def reference_cnn() -> keras.Model:
    L = keras.layers
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            L.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
            L.MaxPooling2D(2, 1),
            L.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
            L.MaxPooling2D(2, 1),
            L.Flatten(),
            L.Dense(32, activation="relu"),
            L.Dense(10),
        ],
        name="reference_cnn",
    )


def materialize_clip_sum(grads: list, clip: float) -> list:
    """``sum_n min(1, clip / ||g_n||) g_n`` from materialized ``[B, ...]`` gradients."""
    factors = transforms.clip_factors(transforms.global_norms(grads), clip)
    return [tf.tensordot(factors, g, axes=1) for g in grads]


def reference_cell(b: int, repeats: int) -> list[str]:
    model = reference_cnn()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(b, 28, 28, 1)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, b).astype("int32"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    signature = [tf.TensorSpec([None, 28, 28, 1]), tf.TensorSpec([None], tf.int32)]

    def batch(x, y):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(loss(y, model(x)))
        return tape.gradient(total, model.trainable_variables)

    quantities = {
        "clipped sum": lambda x, y: peg.clipped_gradients(model, loss, x, y, l2_norm_clip=1.0),
        "norms": lambda x, y: peg.per_example_norms(model, loss, x, y),
        "materialized": lambda x, y: peg.per_example_gradients(model, loss, x, y),
        "materialize-clip-sum": lambda x, y: materialize_clip_sum(peg.per_example_gradients(model, loss, x, y), 1.0),
    }
    fns = {"batch step": tf.function(batch, input_signature=signature)}
    for by_cost in (False, True):
        conv.CHOOSE_BY_COST = by_cost
        for name, fn in quantities.items():
            f = tf.function(fn, input_signature=signature)
            f(x, y)  # traced under this setting
            fns[f"{name} [{'by cost' if by_cost else 'fixed rules'}]"] = f
    conv.CHOOSE_BY_COST = True
    medians = round_robin(fns, (x, y), repeats)
    base = medians["batch step"]
    lines = [f"## Reference CNN, B={b}", "", "| quantity | median ms | / batch step |", "|---|---|---|"]
    lines += [f"| {n} | {t * 1e3:.2f} | {t / base:.2f} |" for n, t in medians.items()]
    return lines


def random_config(rng) -> tuple[conv.ConvSpec, tuple, int]:
    """A Conv1D/Conv2D layer ``(spec, input shape without batch, c_out)`` with a non-empty output."""
    while True:
        rank = int(rng.choice([1, 2, 2, 2]))
        padding = str(rng.choice(["valid", "same", "causal"] if rank == 1 else ["valid", "same"]))
        kernel = tuple(int(k) for k in rng.integers(1, 9, rank))
        strides = tuple(int(s) for s in rng.integers(1, 4, rank))
        strided = any(s > 1 for s in strides)
        dilation = tuple(1 if strided else int(rng.choice([1, 1, 2])) for _ in strides)
        spatial = tuple(int(n) for n in rng.integers(6, 65 if rank == 1 else 33, rank))
        c_in, c_out = int(rng.choice([1, 3, 8, 16, 32, 64])), int(rng.choice([8, 16, 32, 64]))
        reach = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
        if padding == "valid" and any(n < r for n, r in zip(spatial, reach)):
            continue
        return conv.ConvSpec(rank, kernel, strides, dilation, padding), (*spatial, c_in), c_out


def layer_paths(spec: conv.ConvSpec, a: tf.Tensor, g: tf.Tensor, kernel_shape, chosen: str) -> dict:
    """Every path's clipped sum (clip 1) of one layer, as functions of ``(a, g)``; names as ``path_costs``'."""
    f = math.prod(spec.kernel_size) * a.shape[-1]
    t = math.prod(g.shape[1:-1])
    spatial = tuple(a.shape[1:-1])
    zeros = tf.zeros(kernel_shape)

    def factors(squared):
        return transforms.clip_factors(tf.sqrt(tf.cast(squared, tf.float32)), 1.0)

    def gram(builder):
        def fn(a, g):
            squared, _ = conv._gram_part(conv.patches(spec, a, builder), tf.reshape(g, [-1, t, g.shape[-1]]))
            return conv.weighted_kernel_sum(spec, zeros, a, g, factors(squared))

        return fn

    def kept(builder, vjp=False):
        def fn(a, g):
            if builder == "offsets":
                squared, kernels = conv._shifted_norms(spec, spatial, a, g)
            else:
                squared, kernels = conv._patch_norms(spec, a, g, t, f, builder)
            if vjp:
                return conv.weighted_kernel_sum(spec, zeros, a, g, factors(squared))
            return conv.kept_weighted_sum(kernels, factors(squared), kernel_shape)

        return fn

    def materialized(a, g):
        kernels = conv.per_example_kernels(spec, a, g)
        return tf.tensordot(factors(tf.reduce_sum(tf.square(kernels), axis=[1, 2])), kernels, axes=1)

    paths = {f"gram:{b}": gram(b) for b in path_costs.PATCH_BUILDERS}
    paths.update({f"patches:{b}+kept": kept(b) for b in path_costs.PATCH_BUILDERS})
    paths["offsets+kept"] = kept("offsets")
    if chosen not in paths:  # materialized norms, then the VJP
        paths[chosen] = kept(chosen.partition(":")[2] or chosen, vjp=True)
    return {"materialize-clip-sum": materialized, **paths}


def random_layers(count: int, b: int, repeats: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    rows, over_best, over_materialized = [], [], []
    for i in range(count):
        spec, shape, c_out = random_config(rng)
        a = tf.random.stateless_normal([b, *shape], [seed, i])
        kernel_shape = [*spec.kernel_size, shape[-1], c_out]
        z = tf.nn.convolution(
            conv._causal_pad(spec, a),
            tf.zeros(kernel_shape),
            strides=list(spec.strides),
            padding=conv._padding(spec),
            dilations=list(spec.dilation_rate),
        )
        g = tf.random.stateless_normal(z.shape, [seed, i + 10_000])
        choice = path_costs.conv_norm_path(conv.conv_shape(spec, a, g), True, True, path_costs.machine())
        chosen = choice.norms + ("+kept" if choice.keep else "")
        fns = {n: tf.function(fn) for n, fn in layer_paths(spec, a, g, kernel_shape, chosen).items()}
        medians = round_robin(fns, (a, g), repeats)
        alternatives = {n: t for n, t in medians.items() if n != "materialize-clip-sum"}
        best = min(alternatives, key=alternatives.get)
        over_best.append(alternatives[chosen] / alternatives[best])
        over_materialized.append(alternatives[chosen] / medians["materialize-clip-sum"])
        rows.append(
            f"| {spec.rank}-D k{spec.kernel_size} s{spec.strides} d{spec.dilation_rate} {spec.padding} | {shape} -> {c_out} "
            f"| {chosen} | {alternatives[chosen] * 1e3:.2f} | {best} | {alternatives[best] * 1e3:.2f} | {over_best[-1]:.2f} "
            f"| {medians['materialize-clip-sum'] * 1e3:.2f} | {over_materialized[-1]:.2f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    q = lambda v, p: float(np.quantile(v, p))  # noqa: E731
    lines = [
        f"## {count} random convolution layers, B={b}, one layer's clipped sum",
        "",
        f"- chosen / fastest path: median {q(over_best, 0.5):.2f}, 90th percentile {q(over_best, 0.9):.2f}, worst {max(over_best):.2f}; "
        f"within 10% of the fastest on {sum(r <= 1.1 for r in over_best)} of {count}",
        f"- chosen / materialize-clip-sum: median {q(over_materialized, 0.5):.2f}, worst {max(over_materialized):.2f}; "
        f"not slower (within 10%) on {sum(r <= 1.1 for r in over_materialized)} of {count}",
        "",
        "| layer | input -> c_out | chosen | ms | fastest path | ms | chosen / fastest | materialize-clip-sum ms | chosen / it |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--configs", type=int, default=24, help="random layers (0: none)")
    p.add_argument("--repeats", type=int, default=15, help="round-robin rounds (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reference", action="store_true", help="skip the reference CNN")
    p.add_argument("--calibrate", action="store_true", help="measure and cache this machine's rates first")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.calibrate:
        print(f"calibrated: {path_costs.calibrate(save=True)}", file=sys.stderr)
    lines = [
        "# Convolution paths by cost",
        "",
        f"- command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`",
        f"- rates: {path_costs.machine()}",
        f"- TensorFlow {tf.__version__}, os.cpu_count()={os.cpu_count()}",
        "",
    ]
    if not a.no_reference:
        lines += reference_cell(a.batch_size, a.repeats) + [""]
    if a.configs:
        lines += random_layers(a.configs, a.batch_size, a.repeats, a.seed)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
