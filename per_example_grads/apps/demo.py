"""The demo: what per-example gradient norms say about a trained classifier.

``run_demo`` trains a small MLP on the bundled digits, computes every training
example's gradient norm with ``peg.per_example_norms``, and reports:

* norm statistics per class (which digits the model still finds hard);
* the examples with the largest norms (often mislabeled or unusual digits);
* how long each engine takes on one batch, against the plain batch gradient;
* a histogram of the norms, saved as a PNG (written under a temporary name
  and moved into place, so never half-written).

``pegrad demo`` (``per_example_grads.apps.cli``) runs it from the command line.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf
from tqdm import tqdm

import per_example_grads as peg
from per_example_grads import plots
from per_example_grads.apps import zoo
from per_example_grads.apps.tables import check_output_folder, format_table, write_files
from per_example_grads.data import N_CLASSES, N_FEATURES, train_test_split_digits

DEFAULT_EPOCHS = 15
FAST_TRAIN_SIZE = 600
LEARNING_RATE = 3e-3
FAST_LEARNING_RATE = 1e-2  # bigger steps, so that fast mode's single epoch counts
TRAIN_BATCH_SIZE = 32
NORMS_BATCH_SIZE = 256
TIMING_BATCH_SIZE = 64
TIMING_REPEATS = 7
FAST_TIMING_REPEATS = 3
TOP_K = 10
_MIN_MEASUREMENT_S = 0.01
_MAX_CALLS_PER_MEASUREMENT = 64
BASELINE = "batch gradient"
HISTOGRAM_NAME = "norms_histogram.png"
DATA_NAME = "UCI handwritten digits (8x8)"

# What the printed tables mean, printed under each.
NORMS_LEGEND = (
    "  norm: the L2 norm of one example's own loss gradient over all {params:,} parameters\n"
    "  (cross-entropy in nats; the trained model, in inference mode). Large: the model has\n"
    "  not fitted the example; near 0: fitted with confidence. class: the true label;\n"
    "  count: training examples of that class; mean, median, max: of their norms; all: every class."
)
TOP_LEGEND = (
    "  index: row of per_example_grads.data.load_digits(); label: the true class;\n"
    "  predicted: the model's class, marked * when it differs from the label (misclassified)."
)
TIMINGS_LEGEND = (
    "  ms/batch: milliseconds per call of one traced tf.function returning all {batch}\n"
    "  per-example gradients, on this machine: the median of {repeats} measurements after a\n"
    "  warm-up call, each the mean of enough back-to-back calls to last 10 ms (at most 64).\n"
    "  vs batch grad: that time over the first row's, one tape.gradient of the mean loss\n"
    '  (which gives no per-example gradients). auto: what method="auto" runs, the first\n'
    "  of layerwise, vectorized, weight_copies, loop that handles the model."
)


def run_demo(
    out_dir: str | Path,
    *,
    epochs: int | None = None,
    fast: bool = False,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, Any]:
    """Trains a digits MLP and reports on its per-example gradient norms.

    Args:
      out_dir: folder for the histogram PNG; created if missing, and tried
        (``check_output_folder``) before any training.
      epochs: training epochs; default ``DEFAULT_EPOCHS``, or 1 with ``fast``.
      fast: train on a random ``FAST_TRAIN_SIZE`` of the training examples,
        with ``FAST_LEARNING_RATE``, and time with fewer repeats, for a run of
        a few seconds.
      seed: seeds the train/test split, the weights and the shuffling.
      verbose: print the progress bars and tables (the results are returned
        either way).

    Returns:
      A dict with
      ``test_accuracy`` (float), ``train_size``, ``test_size``, ``epochs``;
      ``norms``: ``[N_train]`` float32, each training example's global
      gradient norm (loss: sparse categorical cross-entropy, summed-loss
      convention, ``training=False``);
      ``train_index``: ``[N_train]`` rows of ``data.load_digits()`` behind
      ``norms``;
      ``norm_stats``: ``{class: {"count", "mean", "median", "max"}}`` for
      classes 0..9;
      ``top_examples``: the ``TOP_K`` largest norms, largest first, as dicts
      with ``index`` (row of ``load_digits()``), ``label``, ``predicted`` and
      ``norm``;
      ``timings``: ``{name: {"ms": ms per batch, "ratio": ms / batch-gradient
      ms}}`` for ``"batch gradient"`` and every name in ``peg.METHODS``;
      ``png_path`` (str) and ``seconds`` (wall time of the demo).

    Raises:
      InputError: ``out_dir`` cannot name a folder.
      OutputError: ``out_dir`` cannot be created or written (before
        training), or writing the PNG failed (then no PNG is left).
    """
    started = time.perf_counter()
    say = print if verbose else _silent
    out_dir = Path(out_dir)
    if epochs is None:
        epochs = 1 if fast else DEFAULT_EPOCHS
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1; got {epochs}.")
    check_output_folder(out_dir)

    split = train_test_split_digits(seed=seed)
    x_train, y_train, train_index = split.x_train, split.y_train, split.train_index
    if fast:
        rng = np.random.default_rng(seed)
        keep = np.sort(rng.permutation(len(x_train))[:FAST_TRAIN_SIZE])
        x_train, y_train, train_index = x_train[keep], y_train[keep], train_index[keep]

    say(
        f"Training a {N_FEATURES}-{zoo.DIGITS_HIDDEN_UNITS}-{N_CLASSES} MLP on "
        f"{len(x_train)} digits for {epochs} epoch(s)..."
    )
    model = zoo.build_model("digits_mlp", seed)
    model.compile(
        optimizer=keras.optimizers.Adam(FAST_LEARNING_RATE if fast else LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(
        x_train,
        y_train,
        epochs=epochs,
        batch_size=TRAIN_BATCH_SIZE,
        # A live progress bar on a terminal; one line per epoch in a log.
        verbose=(1 if sys.stdout.isatty() else 2) if verbose else 0,
    )
    test_accuracy = float(np.mean(predict_labels(model, split.x_test) == split.y_test))
    say(f"Test accuracy: {test_accuracy:.3f} on {len(split.x_test)} held-out digits.\n")

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    norms = training_set_norms(model, loss, x_train, y_train, progress=verbose)
    predicted = predict_labels(model, x_train)

    norm_stats = class_norm_stats(norms, y_train)
    say("Per-example gradient norms by class (training set):")
    say(format_norm_stats(norm_stats, norms))
    say(NORMS_LEGEND.format(params=model.count_params()) + "\n")

    top = top_examples(norms, y_train, predicted, train_index)
    say(f"The {len(top)} training examples with the largest gradient norms (often mislabeled or unusual digits):")
    say(format_top_examples(top))
    say(TOP_LEGEND + "\n")

    repeats = FAST_TIMING_REPEATS if fast else TIMING_REPEATS
    say(f"Time for one batch of {TIMING_BATCH_SIZE} examples, per method:")
    timings = time_methods(
        model,
        loss,
        x_train[:TIMING_BATCH_SIZE],
        y_train[:TIMING_BATCH_SIZE],
        repeats=repeats,
    )
    say(format_timings(timings))
    say(TIMINGS_LEGEND.format(batch=TIMING_BATCH_SIZE, repeats=repeats) + "\n")

    png_path = out_dir / HISTOGRAM_NAME
    title = (
        f"{model.name} ({model.count_params():,} parameters, {epochs} training "
        f"epoch{'' if epochs == 1 else 's'}) on {len(norms):,} {DATA_NAME} training examples"
    )
    write_files({png_path: lambda path: save_norms_histogram(norms, path, title=title)})
    say(f"Histogram of the norms: {png_path}")

    return {
        "test_accuracy": test_accuracy,
        "train_size": int(len(x_train)),
        "test_size": int(len(split.x_test)),
        "epochs": int(epochs),
        "norms": norms,
        "train_index": train_index,
        "norm_stats": norm_stats,
        "top_examples": top,
        "timings": timings,
        "png_path": str(png_path),
        "seconds": time.perf_counter() - started,
    }


def predict_labels(model: keras.Model, x: np.ndarray) -> np.ndarray:
    """``[N, 64]`` -> ``[N]`` int32 predicted classes."""
    logits = model(tf.constant(x), training=False)
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int32)


def training_set_norms(
    model: keras.Model,
    loss: Callable,
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int = NORMS_BATCH_SIZE,
    progress: bool = True,
) -> np.ndarray:
    """Every example's global gradient norm, computed batch by batch.

    Args:
      model, loss: as in ``peg.per_example_norms``.
      x: ``[N, 64]`` float32; y: ``[N]`` int32.
      batch_size: examples per call.
      progress: show a tqdm progress bar.

    Returns:
      ``[N]`` float32 norms.
    """
    norms_fn = tf.function(
        functools.partial(peg.per_example_norms, model, loss),
        input_signature=_batch_signature(x, y),
    )
    parts = []
    with tqdm(total=len(x), desc="per-example norms", unit="ex", disable=not progress) as bar:
        for start in range(0, len(x), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            parts.append(norms_fn(xb, yb).numpy())
            bar.update(len(xb))
    return np.concatenate(parts).astype(np.float32)


def class_norm_stats(norms: np.ndarray, labels: np.ndarray) -> dict[int, dict[str, float]]:
    """``{class: {"count", "mean", "median", "max"}}`` of ``[N]`` norms by ``[N]`` labels.

    Every class 0..9 is present; a class without examples gets count 0 and
    NaN statistics.
    """
    stats = {}
    for c in range(N_CLASSES):
        values = norms[labels == c]
        empty = len(values) == 0
        stats[c] = {
            "count": int(len(values)),
            "mean": float("nan") if empty else float(np.mean(values)),
            "median": float("nan") if empty else float(np.median(values)),
            "max": float("nan") if empty else float(np.max(values)),
        }
    return stats


def top_examples(
    norms: np.ndarray,
    labels: np.ndarray,
    predicted: np.ndarray,
    index: np.ndarray,
    k: int = TOP_K,
) -> list[dict[str, Any]]:
    """The ``k`` largest of ``[N]`` norms, largest first.

    Returns:
      dicts with ``index`` (``index[i]``, the example's row in the data set),
      ``label``, ``predicted`` and ``norm``.
    """
    order = np.argsort(-norms, kind="stable")[:k]
    return [
        {
            "index": int(index[i]),
            "label": int(labels[i]),
            "predicted": int(predicted[i]),
            "norm": float(norms[i]),
        }
        for i in order
    ]


def time_methods(
    model: keras.Model,
    loss: Callable,
    x: np.ndarray,
    y: np.ndarray,
    *,
    repeats: int = TIMING_REPEATS,
) -> dict[str, dict[str, float]]:
    """Milliseconds per batch for the batch gradient and every ``peg.METHODS`` entry.

    Each computation is one ``tf.function`` with an unknown batch size,
    called once to trace and warm up, then measured ``repeats`` times, in
    turn with the others (each measurement averaging enough calls to last
    10 ms); the median counts. The baseline is ``tape.gradient`` of the mean
    loss.

    Args:
      model, loss: as in ``peg.per_example_gradients``.
      x: ``[B, 64]`` float32; y: ``[B]`` int32: the batch to time.
      repeats: measurements per method.

    Returns:
      ``{name: {"ms": median ms, "ratio": ms / baseline ms}}``, the baseline
      (``"batch gradient"``) first, then the engines, then ``"auto"``.
    """
    x, y = tf.constant(x), tf.constant(y)
    # functools.partial rather than closures: TensorFlow counts traces per code
    # object, and several closures of one code object, each traced once, would
    # set off its "excessive retracing" warning.
    candidates = {BASELINE: functools.partial(_batch_gradient, model, loss)}
    for method in [m for m in peg.METHODS if m != "auto"] + ["auto"]:
        candidates[method] = functools.partial(_per_example_gradients, model, loss, method)
    signature = _batch_signature(x, y)
    functions = {name: tf.function(fn, input_signature=signature) for name, fn in candidates.items()}
    ms = _median_ms(functions, (x, y), repeats)
    return {name: {"ms": t, "ratio": t / ms[BASELINE]} for name, t in ms.items()}


def save_norms_histogram(
    norms: np.ndarray, path: str | Path, *, title: str | None = None, title_suffix: str = ""
) -> Path:
    """Writes ``per_example_grads.plots.norms_histogram_figure(norms, title=...)`` to ``path`` (PNG).

    ``title`` names the model and data; without it, ``title_suffix`` (the
    older argument) is appended to a generic title. It writes ``path``
    itself; ``run_demo`` and ``run_diagnose`` give it a temporary path of
    ``write_files``.
    """
    path = Path(path)
    if title is None:
        title = f"{len(norms)} examples" + (f", {title_suffix}" if title_suffix else "")
    fig = plots.norms_histogram_figure(norms, title=title)
    fig.savefig(path, format="png")
    return path


def format_norm_stats(stats: dict[int, dict[str, float]], norms: np.ndarray | None = None) -> str:
    """The per-class table of ``class_norm_stats``, with an ``all`` row if ``norms`` is given."""

    def row(name, count, mean, median, maximum):
        return [name, count, f"{mean:.3e}", f"{median:.3e}", f"{maximum:.3e}"]

    rows = [row(c, s["count"], s["mean"], s["median"], s["max"]) for c, s in stats.items()]
    if norms is not None and len(norms):
        rows.append(row("all", len(norms), np.mean(norms), np.median(norms), np.max(norms)))
    return format_table(["class", "count", "mean", "median", "max"], rows)


def format_top_examples(top: Sequence[dict[str, Any]]) -> str:
    """The table of ``top_examples``; misclassified examples are marked ``*``."""
    rows = [
        [
            rank,
            e["index"],
            e["label"],
            f"{e['predicted']}{' *' if e['predicted'] != e['label'] else '  '}",
            f"{e['norm']:.3e}",
        ]
        for rank, e in enumerate(top, start=1)
    ]
    return format_table(["rank", "index", "label", "predicted", "norm"], rows)


def format_timings(timings: dict[str, dict[str, float]]) -> str:
    """The table of ``time_methods``."""
    rows = [[name, f"{t['ms']:.2f}", f"{t['ratio']:.1f}x"] for name, t in timings.items()]
    return format_table(["method", "ms/batch", "vs batch grad"], rows)


def _batch_gradient(model: keras.Model, loss: Callable, x: tf.Tensor, y: tf.Tensor) -> list:
    """``tape.gradient`` of the mean loss: list of ``[*var.shape]``."""
    with tf.GradientTape() as tape:
        mean_loss = tf.reduce_mean(loss(y, model(x, training=False)))
    return tape.gradient(mean_loss, model.trainable_variables)


def _per_example_gradients(model: keras.Model, loss: Callable, method: str, x: tf.Tensor, y: tf.Tensor) -> list:
    """``peg.per_example_gradients`` with ``method``: list of ``[B, *var.shape]``."""
    return peg.per_example_gradients(model, loss, x, y, method=method)


def _batch_signature(x: Any, y: Any) -> tuple[tf.TensorSpec, tf.TensorSpec]:
    """Specs for ``([B, *x.shape[1:]], [B])`` batches with unknown ``B``."""
    return (
        tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(x.dtype)),
        tf.TensorSpec([None], tf.as_dtype(y.dtype)),
    )


def _median_ms(fns: dict[str, Callable], args: tuple, repeats: int) -> dict[str, float]:
    """Median milliseconds per call of each ``fn(*args)``.

    Every function is called once to trace and warm up. Each measurement
    times enough back-to-back calls to last at least ``_MIN_MEASUREMENT_S``,
    so sub-millisecond calls are not swamped by timer noise, and the
    measurements go round-robin over the functions, so a change in machine
    load biases none of them.
    """
    for fn in fns.values():
        fn(*args)
    numbers = {name: _calls_per_measurement(fn, args) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            samples[name].append(_seconds(fn, args, numbers[name]) / numbers[name])
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


def _calls_per_measurement(fn: Callable, args: tuple) -> int:
    number = 1
    while number < _MAX_CALLS_PER_MEASUREMENT:
        if _seconds(fn, args, number) >= _MIN_MEASUREMENT_S:
            break
        number *= 2
    return number


def _seconds(fn: Callable, args: tuple, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn(*args)
    return time.perf_counter() - start


def _silent(*args: Any, **kwargs: Any) -> None:
    pass
