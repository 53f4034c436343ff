"""Gradient similarity between examples, and TracIn influence.

``gradient_similarity`` returns the ``[Ba, Bb]`` matrix ``K[i, j] = <g_i, h_j>``
of dot products between the per-example gradients ``g_i`` of batch a and
``h_j`` of batch b (or their cosines).

*Closed form.* When every watched layer's rule gives its gradients as outer
products (``LayerRule.outer_factors``: a Dense layer called once on a rank-2
input), example n's kernel gradient is the outer product ``a_n g_n^T`` of the
layer input ``a_n`` ``[i]`` and the pre-activation gradient ``g_n`` ``[j]``,
and its bias gradient is ``g_n``. So

    <a_n g_n^T, a'_m g'_m^T> = (a_n . a'_m) (g_n . g'_m)

and, per layer, ``K_layer = (A_a A_b^T) * (G_a G_b^T) + G_a G_b^T`` (``*``
elementwise; the second term for the bias), with ``A_a`` ``[Ba, i]`` and
``G_a`` ``[Ba, j]`` from one forward+backward pass per batch. Cost
``Ba Bb (i + j)`` per layer; nothing of size ``B x P`` is built.

*Fallback.* Otherwise both batches' per-example gradients are materialized,
flattened to ``[B, P]`` and multiplied.

Both are the engines' ``features`` capability (``Engine.features``,
``per_example_grads.engines.moments.GradientFeatures``: the layer-wise engine
gives factors, every engine can materialize), with the engine picked as for
every capability (``selection.run``: ``method="auto"`` with its fallbacks).

``tracin_scores`` (Pruthi et al., 2020, "Estimating Training Data Influence
by Tracing Gradient Descent", the TracInCP form) sums, over checkpoints ``c``
with learning rate ``eta_c``:

    TracIn(z_i, z'_j) = sum_c eta_c <grad loss(z_i; w_c), grad loss(z'_j; w_c)>

A positive score marks a *proponent* (a gradient step on ``z_i`` lowers the
loss of ``z'_j``: helpful), a negative one an *opponent* (harmful).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from per_example_grads._core.batch import common_rows, make_batch
from per_example_grads._core.problem import Problem, make_problem
from per_example_grads.engines import selection
from per_example_grads.engines.moments import GradientFeatures

F64 = tf.float64


def _features(problem: Problem, x: Any, y: Any, method: str, materialize: bool = False) -> GradientFeatures:
    batch = make_batch(problem.model, x, y)
    return selection.run(
        method, problem, lambda engine: engine.features(problem, batch, factored=not materialize), batch
    )


def _dots(fa: GradientFeatures, fb: GradientFeatures) -> tf.Tensor:
    """``[Ba, Bb]`` gradient dot products."""
    return fa.dots(fb)


def _cosine(k: tf.Tensor, fa: GradientFeatures, fb: GradientFeatures) -> tf.Tensor:
    na = tf.sqrt(fa.squared_norms())
    nb = tf.sqrt(fb.squared_norms())
    return tf.math.divide_no_nan(k, na[:, None] * nb[None, :])


def gradient_similarity(
    model: Any,
    loss_fn: Callable | str,
    xa: Any,
    ya: Any,
    xb: Any,
    yb: Any,
    *,
    cosine: bool = False,
    method: str = "auto",
) -> tf.Tensor:
    """``[Ba, Bb]`` dot products (or cosines) of per-example gradients.

    Args:
      model, loss_fn: as in ``per_example_gradients``.
      xa, ya: batch a, ``[Ba, ...]``; xb, yb: batch b, ``[Bb, ...]``: arrays,
        tensors or the structures the model takes (dicts, lists, tuples,
        nested), every leaf of a batch with the same rows (else ValueError
        naming two leaves).
      cosine: divide by both gradients' norms (0 where a norm is 0).
      method: ``"auto"`` uses the closed form when every watched layer is a
        Dense layer called once on a rank-2 input, else materializes with the
        engine ``"auto"`` picks; ``"layerwise"`` does the same without
        falling back to another engine, and every other engine name always
        materializes.

    Returns:
      ``K[i, j] = <g_i, h_j>`` (or ``cos``), float64 ``[Ba, Bb]``.
    """
    selection.check_method(method)
    common_rows({"xa": xa, "ya": ya}, "batch a", require_known=False)
    common_rows({"xb": xb, "yb": yb}, "batch b", require_known=False)
    problem = make_problem(model, loss_fn, None, False, False)
    fa = _features(problem, xa, ya, method)
    fb = _features(problem, xb, yb, method)
    if fa.factored != fb.factored:  # one batch fell back: both must
        fa = _features(problem, xa, ya, method, materialize=True)
        fb = _features(problem, xb, yb, method, materialize=True)
    k = _dots(fa, fb)
    return _cosine(k, fa, fb) if cosine else k


def _head(x: Any, y: Any, n: int = 2) -> tuple[Any, Any]:
    return tf.nest.map_structure(lambda t: t[:n], x), tf.nest.map_structure(lambda t: t[:n], y)


def uses_closed_form(model: Any, loss_fn: Callable | str, x: Any, y: Any) -> bool:
    """Whether ``gradient_similarity`` takes the Dense closed form on this model."""
    problem = make_problem(model, loss_fn, None, False, False)
    return _features(problem, x, y, "auto").factored


@dataclasses.dataclass
class TracInResult:
    """TracIn scores and the most influential training examples.

    Attributes:
      scores: ``[N_train, N_test]`` float64,
        ``sum_c eta_c <grad loss(train_i; w_c), grad loss(test_j; w_c)>``.
      helpful: ``[N_test, k]`` training indices with the largest scores
        (proponents), largest first.
      harmful: ``[N_test, k]`` training indices with the smallest (most
        negative) scores (opponents), most negative first.
    """

    scores: np.ndarray
    helpful: np.ndarray
    harmful: np.ndarray


def tracin_scores(
    checkpoints: Sequence[Any],
    model: Any,
    loss_fn: Callable | str,
    x_train: Any,
    y_train: Any,
    x_test: Any,
    y_test: Any,
    *,
    learning_rates: float | Sequence[float],
    top_k: int = 10,
    batch_size: int = 256,
    method: str = "auto",
) -> TracInResult:
    """TracIn influence of every training example on every test example.

    Args:
      checkpoints: weights at each checkpoint: lists of arrays as returned by
        ``model.get_weights()``, or paths to ``.weights.h5`` files for
        ``model.load_weights``. The model's own weights are restored after.
      model, loss_fn: as in ``per_example_gradients``.
      x_train, y_train: ``[N_train, ...]``; x_test, y_test: ``[N_test, ...]``:
        arrays or the structures the model takes (dicts, lists, tuples,
        nested), sliced leaf by leaf; every leaf of a pair needs the same
        rows (else ValueError naming two leaves).
      learning_rates: one learning rate for all checkpoints, or one per
        checkpoint.
      top_k: how many helpful / harmful indices per test example.
      batch_size: training (and test) examples per similarity block, so
        memory is ``O(batch_size^2)`` plus the scores.
      method: as in ``gradient_similarity``.

    Returns:
      A ``TracInResult``.
    """
    checkpoints = list(checkpoints)
    if not checkpoints:
        raise ValueError("checkpoints is empty.")
    if np.ndim(learning_rates) == 0:
        lrs = [float(learning_rates)] * len(checkpoints)
    else:
        lrs = [float(r) for r in learning_rates]
        if len(lrs) != len(checkpoints):
            raise ValueError(f"{len(lrs)} learning_rates for {len(checkpoints)} checkpoints.")
    n_train = common_rows({"x_train": x_train, "y_train": y_train}, "the training data")
    n_test = common_rows({"x_test": x_test, "y_test": y_test}, "the test data")
    scores = np.zeros((n_train, n_test), np.float64)
    selection.check_method(method)
    problem = make_problem(model, loss_fn, None, False, False)
    # One kind of features for every block (whether the closed form holds
    # depends on the model, not on the batch).
    materialize = not _features(problem, *_head(x_train, y_train), method).factored
    original = model.get_weights()

    def chunk(x, y, start):
        sl = slice(start, start + batch_size)
        return tf.nest.map_structure(lambda t: t[sl], x), tf.nest.map_structure(lambda t: t[sl], y)

    try:
        for checkpoint, lr in zip(checkpoints, lrs):
            if isinstance(checkpoint, (str, bytes)) or hasattr(checkpoint, "__fspath__"):
                model.load_weights(checkpoint)
            else:
                model.set_weights(checkpoint)
            test_features = [
                _features(problem, *chunk(x_test, y_test, t0), method, materialize)
                for t0 in range(0, n_test, batch_size)
            ]
            for s0 in range(0, n_train, batch_size):
                train_features = _features(problem, *chunk(x_train, y_train, s0), method, materialize)
                for t0, ft in zip(range(0, n_test, batch_size), test_features):
                    k = _dots(train_features, ft).numpy()
                    scores[s0 : s0 + k.shape[0], t0 : t0 + k.shape[1]] += lr * k
    finally:
        model.set_weights(original)
    k = min(top_k, n_train)
    order = np.argsort(-scores.T, axis=1, kind="stable")
    return TracInResult(scores=scores, helpful=order[:, :k], harmful=order[:, ::-1][:, :k])
