"""Our layer-wise engine as one more peer: ``per_example_grads`` on TensorFlow / Keras.

Runs from the project's own virtualenv (it imports ``per_example_grads`` and
the Keras models of ``benchmarks/bench_layerwise.py``; the library never
imports this file)::

    .venv/bin/python benchmarks/peers/peer_tf.py --quick
    .venv/bin/python benchmarks/peers/peer_tf.py --models cnn --out /tmp/tf.md

(``--serve`` makes it a worker of ``benchmarks/bench_vs_peers.py``.)

Models: ``bench_layerwise.build``'s Keras models (``embbag`` is its
``embedding_bag``), fed the peers' data (``_common.make_data``). Quantities,
each ``bench_layerwise.quantity_fn``'s ``tf.function`` with an unknown batch
dimension, called on tensors made once:

- ``tf`` (a): ``tape.gradient`` of the mean loss (the baseline);
- ``per_example_grads`` (b): ``per_example_gradients(method="layerwise")``;
- ``per_example_grads`` (c): ``clipped_gradients(l2_norm_clip=1.0, method="layerwise")``,
  the sum over the batch of the clipped per-example gradients;
- ``per_example_grads, sparse_embeddings=True`` (b), on models with an
  embedding table: the same per-example gradients, each table's as
  ``PerExampleSlices`` (each example's ids and rows) instead of a dense
  ``[B, vocab, dim]`` tensor, which the issue allows; the peers all build it dense;
- ``..., jit_compile=True`` (b), (c): the same ``tf.function`` compiled by XLA
  (the default of Keras's ``fit`` on GPUs), as the JAX peer always is.

A call is waited for by reading one element of each output tensor through
``memoryview`` (``bench_layerwise.wait_for``), which copies nothing, as JAX's
``block_until_ready`` copies nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(1, REPO)  # per_example_grads and benchmarks.bench_layerwise
import _common as C  # noqa: E402  (stdlib-only harness next to this file)

PEERS = ("per_example_grads",)
KERAS_MODEL = {"embbag": "embedding_bag"}  # the peers' model names -> bench_layerwise.build's
QUANTITY_FN = {"a": "batch_grad", "b": "grads_layerwise", "c": "clipped_layerwise"}  # -> quantity_fn's
PEER_OF = {"a": "tf", "b": "per_example_grads", "c": "per_example_grads"}


def small_cnn():
    """``_common``'s ``small_cnn`` in Keras (seeded: every call has the same initial weights)."""
    import keras

    L = keras.layers
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            L.Conv2D(16, 5, strides=2, activation="relu"),
            L.Conv2D(32, 3, strides=2, activation="relu"),
            L.Flatten(),
            L.Dense(64, activation="relu"),
            L.Dense(10),
        ],
        name="small_cnn",
    )


def keras_model(model_name: str, b: int):
    """A fresh Keras model ``model_name`` (the zoo's, or ``small_cnn``), the same initial weights every call."""
    from benchmarks import bench_layerwise as BL

    return small_cnn() if model_name == "small_cnn" else BL.build(KERAS_MODEL.get(model_name, model_name), b)[0]


def epoch_tasks(model_name: str) -> list:
    """(e): one epoch of ``DPModel.fit`` on ``peg.dp.poisson_batches`` and one of plain ``keras.Model.fit``.

    Each trains its own copy of the model (same initial weights), SGD; each
    call times one epoch from Keras's ``on_epoch_begin`` to ``on_epoch_end``
    (``bench_dp_fit._timed_epoch``: what ``fit`` does once per call, its
    setup and teardown, is left out, as the torch peer's epoch is a bare loop).
    """
    import keras

    import per_example_grads as peg
    from benchmarks import bench_dp_fit as DF

    x, y = C.make_data(model_name, C.EPOCH_N)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = keras_model(model_name, C.EPOCH_BATCH)
    plain.compile(optimizer=keras.optimizers.SGD(C.EPOCH_LR), loss=loss)
    dp = peg.keras.DPModel(
        keras_model(model_name, C.EPOCH_BATCH), l2_norm_clip=C.CLIP_NORM, noise_multiplier=C.EPOCH_SIGMA
    )
    dp.compile(optimizer=keras.optimizers.SGD(C.EPOCH_LR), loss=loss)
    data = peg.dp.poisson_batches(x, y, sampling_probability=C.EPOCH_BATCH / C.EPOCH_N, seed=0)
    return [
        C.Task(
            "keras fit (not private)", "e", lambda: C.Seconds(DF._timed_epoch(plain, x, y, batch_size=C.EPOCH_BATCH)[0])
        ),
        C.Task("DPModel.fit", "e", lambda: C.Seconds(DF._timed_epoch(dp, data)[0])),
    ]


def make_tasks(model_name: str, b: int, log, quantities=("a", "b", "c")):
    """The (a), (b), (c) tasks of one (model, B) (and (e) if asked), the notes, and the correctness check."""
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks import bench_layerwise as BL
    from per_example_grads._core.model_inspection import iter_layers

    model = keras_model(model_name, b)
    x_np, y_np = C.make_data(model_name, b)
    x, y = tf.constant(x_np), tf.constant(y_np)
    fns = {q: BL.quantity_fn(name, model, x_np) for q, name in QUANTITY_FN.items()}
    variables = model.trainable_variables
    n_params = sum(int(np.prod(v.shape)) for v in variables)
    notes = [
        f"{model_name}: {n_params:,} parameters (keras model {'of benchmarks/peers/peer_tf.py' if model_name == 'small_cnn' else 'of benchmarks/bench_layerwise.py'})"
    ]
    tasks = [C.Task(PEER_OF[q], q, lambda fn=fn: BL.wait_for(fn(x, y))) for q, fn in fns.items()]
    if "e" in quantities:
        tasks += epoch_tasks(model_name)
    has_table = any(isinstance(layer, keras.layers.Embedding) for layer in iter_layers(model))
    per_example = (
        "grads_layerwise_sparse" if has_table else QUANTITY_FN["b"]
    )  # (b) under XLA: sparse where there is a table
    variants = {
        "b xla": ("b", per_example, True),
        "c xla": ("c", QUANTITY_FN["c"], True),
    }  # key -> (quantity, fn name, jit)
    if has_table:
        variants["b sparse"] = ("b", per_example, False)
    for key, (q, name, jit) in variants.items():
        fns[key] = BL.quantity_fn(name, model, x_np, jit_compile=jit)
        label = (
            PEER_OF[q]
            + (", sparse_embeddings=True" if "sparse" in name else "")
            + (", jit_compile=True" if jit else "")
        )
        tasks.append(C.Task(label, q, lambda fn=fns[key]: BL.wait_for(fn(x, y))))

    def check():
        """Per-example grads have shape [B, *var], average to the batch grad, and clip + sum to (c)."""
        ref = [tf.convert_to_tensor(g) for g in fns["a"](x, y)]
        per_ex = fns["b"](x, y)
        shapes_ok = all(tuple(g.shape) == (b, *v.shape) for g, v in zip(per_ex, variables))
        err = _max_rel_diff([tf.reduce_mean(g, axis=0) for g in per_ex], ref)
        err_c = _max_rel_diff([tf.convert_to_tensor(g) for g in fns["c"](x, y)], _clip_and_sum(per_ex))
        variant_errs = {
            key: _max_rel_diff(
                [tf.convert_to_tensor(g) for g in fns[key](x, y)],
                per_ex if key[0] == "b" else [tf.convert_to_tensor(g) for g in fns["c"](x, y)],
            )
            for key in variants
        }
        ok = shapes_ok and err < 1e-4 and err_c < 1e-4 and all(e < 1e-4 for e in variant_errs.values())
        line = (
            f"{model_name} B={b} per_example_grads: per-example grads [B, *shape] "
            f"{'ok' if shapes_ok else 'WRONG SHAPE'}; their mean vs the batch grad: "
            f"max abs diff / max abs grad = {err:.1e}; (c) vs clip + sum of (b): {err_c:.1e}; "
            + "; ".join(f"{key} vs {key[0]}: {e:.1e}" for key, e in variant_errs.items())
            + f" ({'ok' if ok else 'MISMATCH'})"
        )
        if not ok:
            log(f"  CHECK FAILED: {line}")
        return [line]

    return tasks, notes, check


def _max_rel_diff(got: list, want: list) -> float:
    """Largest ``|got - want|`` over all tensors, over the largest ``|want|``."""
    import tensorflow as tf

    scale = max(float(tf.reduce_max(tf.abs(w))) for w in want)
    return max(float(tf.reduce_max(tf.abs(g - w))) for g, w in zip(got, want)) / scale


def _clip_and_sum(per_example: list) -> list:
    """``sum_i g_i * C / max(||g_i||, C)`` with ``||g_i||`` the global norm over all tensors."""
    import tensorflow as tf

    sq = tf.add_n([tf.reduce_sum(tf.reshape(g * g, [tf.shape(g)[0], -1]), axis=1) for g in per_example])
    factors = C.CLIP_NORM / tf.maximum(tf.sqrt(sq), C.CLIP_NORM)
    return [tf.tensordot(factors, g, axes=1) for g in per_example]


def _git_revision() -> str:
    """``git describe --always --dirty`` of the checkout this file is in, or ``n/a``."""
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "n/a"
    return out.stdout.strip() or "n/a"


def main() -> int:
    args = C.parse_args(__doc__.splitlines()[0], PEERS)
    cpus = C.pin_cpus(args.threads)  # before TensorFlow sizes its thread pools
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy
    import tensorflow as tf

    import per_example_grads

    versions = {
        "python": sys.version.split()[0],
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": numpy.__version__,
        "per_example_grads": f"{getattr(per_example_grads, '__version__', '?')} (git {_git_revision()})",
        "CPUs": cpus,
    }
    general = [
        "tf (a) is `tape.gradient` of the mean loss; per_example_grads (b) is "
        '`per_example_gradients(method="layerwise")`, (c) `clipped_gradients(l2_norm_clip=1.0, '
        'method="layerwise")`; each a `tf.function` (benchmarks/bench_layerwise.quantity_fn) whose '
        "first call traces it, waited for by reading one element of each output through a zero-copy "
        "`memoryview`."
    ]
    return C.run(
        args,
        "Peer benchmark: per_example_grads layer-wise engine (TensorFlow)",
        versions,
        general,
        lambda m, b, **kw: make_tasks(m, b, C.log, **kw),
    )


if __name__ == "__main__":
    sys.exit(main())
