"""The traced DP release of two versions side by side: op counts of clipped sum + release, per configuration.

A refactor of the release (``DPAggregator.release``, ``per_example_grads.dp.privatizers``)
that leaves these graphs op for op the same cannot change the DP step's time
or memory, so its benchmark ratios stand without a re-run. Set up "before"
as ``bench_before_after.py`` does (a renamed copy of the base commit)::

    git archive <base-commit> per_example_grads | tar -x -C /tmp/base
    mv /tmp/base/per_example_grads /tmp/base/per_example_grads_base
    grep -rl per_example_grads /tmp/base/per_example_grads_base | xargs sed -i 's/\\bper_example_grads\\b/per_example_grads_base/g'
    PYTHONPATH=.:/tmp/base python benchmarks/release_graph.py

Prints, per configuration (DP-SGD, BandMF, adaptive clipping, gradient
canaries, sparse embedding noise), the number of ops before and after
(functions in the graph's library included) and ``same`` or the op types
whose counts differ.
"""

import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import per_example_grads_base as before  # noqa: E402
import tensorflow as tf  # noqa: E402

import per_example_grads as after  # noqa: E402

CONFIGS = ("dp-sgd", "bandmf", "adaptive", "canaries", "sparse")


def _model(config: str) -> keras.Model:
    keras.utils.set_random_seed(1)
    if config == "sparse":
        layers = [keras.layers.Embedding(50, 4), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)]
        return keras.Sequential([keras.Input((6,), dtype="int32"), *layers])
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])


def op_counts(peg, config: str) -> collections.Counter:
    """Op types of the traced ``release(clipped_sum(...))`` of ``config`` with the library ``peg``."""
    rng = np.random.default_rng(0)
    model = _model(config)
    if config == "sparse":
        x, y = rng.integers(0, 50, (16, 6)), rng.integers(0, 2, 16)
    else:
        x, y = rng.normal(size=(16, 5)).astype("float32"), rng.integers(0, 3, 16)
    settings = {
        "bandmf": {"mechanism": peg.dp.BandMF(bands=2, num_steps=8, cycle_length=2)},
        "adaptive": {"adaptive_clipping": peg.dp.AdaptiveClipping(initial_l2_norm_clip=0.7)},
    }.get(config, {})
    aggregator = peg.dp.DPAggregator(l2_norm_clip=0.7, noise_multiplier=1.3, seed=11, **settings)
    aggregator.attach(model.trainable_variables)
    if config == "canaries":
        peg.dp.audit.GradientCanaries(6, seed=3).attach(aggregator, model.trainable_variables)
    if config == "sparse":
        aggregator.sparse = peg.dp.SparseEmbeddings().bind(model, model.trainable_variables, noise_multiplier=1.3)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    step = tf.function(
        lambda a, b: aggregator.release(aggregator.clipped_sum(model, loss, a, b), 8.0, sampling_probability=0.5)
    )
    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph.as_graph_def()
    counts = collections.Counter(node.op for node in graph.node)
    for function in graph.library.function:
        counts.update(node.op for node in function.node_def)
    return counts


def main() -> None:
    print("| configuration | ops before | ops after | difference |")
    print("|---|---:|---:|---|")
    for config in CONFIGS:
        old, new = op_counts(before, config), op_counts(after, config)
        differ = {op: (old[op], new[op]) for op in sorted(set(old) | set(new)) if old[op] != new[op]}
        print(f"| {config} | {sum(old.values())} | {sum(new.values())} | {differ or 'same'} |")


if __name__ == "__main__":
    main()
