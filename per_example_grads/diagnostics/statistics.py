"""Streaming statistics of per-example gradients over a data set.

Notation: ``N`` examples, per-example gradients ``g_i`` (the gradient of
example i's own loss, the library's convention), flattened to ``P``
parameters; ``G = E[g]`` is the gradient of the *mean* loss and
``Sigma = Cov[g]`` the per-example gradient covariance (``P x P``, never
built).

What ``gradient_statistics`` estimates, from the exact float64 sums
``S1_p = sum_i g_ip`` and ``S2_p = sum_i g_ip^2`` accumulated batch by batch
(memory ``O(P)`` for these, plus ``O(N * n_variables)`` for the per-example
norms):

- mean gradient ``m_p = S1_p / N``; ``mean_gradient_norm = ||m||``;
- per-parameter variance, unbiased: ``v_p = (S2_p - N m_p^2) / (N - 1)``;
- ``trace_covariance = tr(Sigma) ~ sum_p v_p`` (also per variable and layer);
- GSNR (gradient signal-to-noise ratio, Liu et al. 2020) of a variable (or
  layer) with parameter set ``P_v``:
  ``gsnr_v = mean_{p in P_v, v_p > 0} m_p^2 / v_p`` (parameters whose gradient
  never varies are left out; NaN if all are);
- per-example norms ``||g_i||`` (global and per variable): mean, quantiles,
  a histogram, and the ``top_k`` largest with their dataset index (the running
  position in the stream, 0-based);
- the simple gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` with the
  unbiased two-batch-size estimators of McCandlish et al. (2018, "An
  Empirical Model of Large-Batch Training", Appendix A). With ``G_B`` the
  mean gradient of a batch of size ``B``, ``E|G_B|^2 = |G|^2 + tr(Sigma)/B``,
  so for ``B_small < B_big``::

      |G|^2_est   = (B_big |G_Bbig|^2 - B_small |G_Bsmall|^2) / (B_big - B_small)
      tr(Sigma)_est = (|G_Bsmall|^2 - |G_Bbig|^2) / (1/B_small - 1/B_big)

  Here ``B_small = 1`` (``|G_Bsmall|^2`` is the batch mean of ``||g_i||^2``)
  and ``B_big = B`` (the batch). Each batch with ``B >= 2`` gives one pair of
  estimates; as McCandlish et al. advise, numerator and denominator are
  averaged separately (weighted by batch size) before the ratio:
  ``noise_scale = sum_b B_b tr_b / sum_b B_b |G|^2_b``. ``noise_scale_trace``
  is that ratio after each batch. These depend on how the data is batched
  (they are estimates from batches); ``noise_scale_full_data`` is the same
  estimator with ``B_big = N`` (``tr(Sigma) / (||m||^2 - tr(Sigma)/N)``),
  which does not;
- the cosine of each example's gradient to the mean gradient,
  ``cos_i = <g_i, m> / (||g_i|| ||m||)``: with ``cosine="final"`` (default) in
  a second streaming pass against the final ``m``; with ``cosine="running"``
  in the same pass against the mean of the *previous* batches (NaN for the
  first batch); with None not at all.

Per-example gradients are materialized one batch at a time, and for Dense
layers on rank-2 inputs not at all (closed forms, see ``moments``).

Non-finite examples: an example whose gradient has a NaN or Inf entry (its
squared norm is not finite) is left out of every statistic, and counted.
Its batch is computed again without it (per-example gradients do not mix
examples, so the others' gradients are unchanged), so ``N``, the sums, the
means and variances, the norms, the cosines and the per-batch noise-scale
estimates are all over the finite examples only, as if the data had not
held it; a dataset index (``top_examples``) still names the example's
position in the stream. ``result()`` warns once (``RuntimeWarning``) with
the count, and the report carries it (``GradientReport.num_nonfinite``).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from tqdm import tqdm

from per_example_grads._core.batch import make_batch
from per_example_grads._core.problem import make_problem
from per_example_grads.diagnostics.moments import batch_moments
from per_example_grads.diagnostics.report import GradientReport
from per_example_grads.diagnostics.streams import check_batch_size, check_count, iterate_batches, num_batches
from per_example_grads.engines import selection

COSINE_MODES = ("final", "running", None)


class GradientStatistics:
    """The streaming accumulator behind ``gradient_statistics``.

    Feed batches with ``update(x, y)``; ``result()`` returns the
    ``GradientReport``. The per-batch computation is one ``tf.function``
    (batch size free), traced once per input signature and reused across
    ``reset()`` calls (the callback relies on that).

    Args:
      model, loss_fn: as in ``per_example_gradients``.
      method: engine (``"auto"`` uses closed forms where it can).
      training: passed to the model.
      running_cosine: in ``update``, also take each example's cosine to the
        mean of the previous batches.
    """

    def __init__(
        self,
        model: Any,
        loss_fn: Callable | str,
        *,
        method: str = "auto",
        training: bool = False,
        running_cosine: bool = False,
    ):
        selection.check_method(method)
        self.model = model
        self.problem = make_problem(model, loss_fn, None, training, False)
        self.method = method
        self.training = training
        self.running_cosine = running_cosine
        self.variables = list(self.problem.variables)
        self._fn = tf.function(functools.partial(_moments, self.problem, method, training), reduce_retracing=True)
        self.reset()

    def reset(self) -> None:
        """Forgets every batch seen."""
        self.count = 0
        self.sum = [np.zeros(v.shape, np.float64) for v in self.variables]
        self.sumsq = [np.zeros(v.shape, np.float64) for v in self.variables]
        self._sqnorms: list[np.ndarray] = []  # [n_vars, B] per batch
        self._cosines: list[np.ndarray] = []
        self.batch_sizes: list[int] = []
        self.batch_trace: list[float] = []  # tr(Sigma)_est per batch (nan if B < 2)
        self.batch_g2: list[float] = []  # |G|^2_est per batch
        self.num_nonfinite = 0  # examples left out: a NaN or Inf in their gradient
        self._positions: list[np.ndarray] = []  # each kept example's position in the stream
        self._seen = 0  # examples fed to update(), kept or not

    def _run(self, x: Any, y: Any, reference: list[np.ndarray]) -> tuple[dict[str, Any] | None, np.ndarray, int]:
        """``(moments of the batch's finite examples or None if none, their rows in the batch, B)``.

        A batch with non-finite examples is computed again on the others'
        rows until every example left is finite (once, when the engine keeps
        examples apart; an engine that does not may spread a NaN).
        """
        batch = make_batch(self.model, x, y)
        x, y = batch["x"], batch.get("y")
        refs = [tf.constant(r, tf.float64) for r in reference]
        b = int(tf.shape(tf.nest.flatten(x)[0])[0])
        rows = np.arange(b)
        while len(rows):
            pick = (lambda t: tf.gather(t, rows)) if len(rows) < b else (lambda t: t)
            out = self._fn(tf.nest.map_structure(pick, x), None if y is None else tf.nest.map_structure(pick, y), refs)
            out = tf.nest.map_structure(lambda t: t.numpy(), out)
            finite = np.all(np.isfinite(out["sqnorms"]), axis=0) & np.isfinite(out["dots"])
            if finite.all():
                return out, rows, b
            rows = rows[finite]
        return None, rows, b

    def update(self, x: Any, y: Any) -> int:
        """Adds one ``[B, ...]`` batch; returns how many of its examples were kept (the finite ones)."""
        reference = self.mean() if (self.running_cosine and self.count) else [np.zeros(v.shape) for v in self.variables]
        out, rows, total = self._run(x, y, reference)
        self.num_nonfinite += total - len(rows)
        self._positions.append(self._seen + rows)
        self._seen += total
        b = len(rows)
        if b == 0:
            return 0
        sqnorms = np.asarray(out["sqnorms"], np.float64)
        for k in range(len(self.variables)):
            self.sum[k] += out["sum"][k]
            self.sumsq[k] += out["sumsq"][k]
        self._sqnorms.append(sqnorms)
        self.count += b
        self.batch_sizes.append(b)
        small = float(np.mean(np.sum(sqnorms, axis=0)))  # |G_1|^2: mean ||g_i||^2
        big = sum(float(np.sum(np.square(s))) for s in out["sum"]) / b**2  # |G_B|^2
        if b >= 2:
            self.batch_trace.append((small - big) / (1.0 - 1.0 / b))
            self.batch_g2.append((b * big - small) / (b - 1))
        else:
            self.batch_trace.append(math.nan)
            self.batch_g2.append(math.nan)
        if self.running_cosine:
            self._cosines.append(_cosines(out["dots"], sqnorms, reference) if self.count > b else np.full(b, np.nan))
        return b

    def cosines(self, x: Any, y: Any, reference: list[np.ndarray]) -> np.ndarray:
        """``[B']`` cosines of a batch's finite examples' gradients to ``reference`` (``update``'s examples)."""
        out, _, _ = self._run(x, y, reference)
        return np.zeros(0) if out is None else _cosines(out["dots"], np.asarray(out["sqnorms"]), reference)

    def mean(self) -> list[np.ndarray]:
        """The mean gradient ``m``, one ``[*var.shape]`` float64 array per variable."""
        n = max(self.count, 1)
        return [s / n for s in self.sum]

    def result(self, *, top_k: int = 10, cosines: np.ndarray | None = None) -> GradientReport:
        """The ``GradientReport`` of the batches seen so far; warns if examples were left out as non-finite."""
        if self.num_nonfinite:
            warnings.warn(
                f"{self.num_nonfinite} example(s) have a non-finite (NaN or Inf) gradient; they were left out of "
                f"the gradient statistics, which are over the other {self.count}. Check their inputs and labels.",
                RuntimeWarning,
                stacklevel=2,
            )
        n = self.count
        mean = self.mean()
        if n >= 2:
            variance = [np.maximum((s2 - n * m**2) / (n - 1), 0.0) for s2, m in zip(self.sumsq, mean)]
        else:
            variance = [np.full(m.shape, np.nan) for m in mean]
        sq = np.concatenate(self._sqnorms, axis=1) if self._sqnorms else np.zeros((len(self.variables), 0))
        if cosines is None and self.running_cosine and self._cosines:
            cosines = np.concatenate(self._cosines)
        return GradientReport(
            num_examples=n,
            variable_paths=[_path(v) for v in self.variables],
            mean=mean,
            variance=variance,
            per_variable_norms=np.sqrt(sq),
            cosines=cosines,
            batch_sizes=list(self.batch_sizes),
            batch_trace=list(self.batch_trace),
            batch_g2=list(self.batch_g2),
            top_k=top_k,
            num_nonfinite=self.num_nonfinite,
            example_indices=np.concatenate(self._positions) if self._positions else np.zeros(0, np.int64),
        )


def gradient_statistics(
    model: Any,
    loss_fn: Callable | str,
    data: Any,
    *,
    batch_size: int | None = None,
    top_k: int = 10,
    method: str = "auto",
    cosine: str | None = "final",
    training: bool = False,
    progress: bool = True,
) -> GradientReport:
    """Streams over ``data`` and summarizes its per-example gradients.

    See the module docstring for every statistic and its formula.

    Args:
      model, loss_fn: as in ``per_example_gradients`` (``loss_fn`` returns one
        loss per example).
      data: a batched ``tf.data.Dataset`` of ``(x, y)``, or a tuple ``(x, y)``
        of arrays with leading axis ``N``, each of ``x`` and ``y`` an array
        or the structure the model takes (a dict, list or tuple of arrays,
        nested or not: a KerasHub model's dict of ``token_ids`` and
        ``padding_mask``), every leaf with the same ``N`` (else ValueError
        naming two leaves, before any work).
      batch_size: batch size for array data: an integer ``>= 1``, or None
        (256).
      top_k: how many of the largest-norm examples to report (an integer ``>= 0``).
      method: engine: ``"auto"`` (closed forms for Dense layers, one layer's
        per-example gradients at a time for other covered layers, else
        ``per_example_gradients``) or any of ``peg.METHODS``.
      cosine: ``"final"`` (second pass against the final mean), ``"running"``
        (one pass, against the mean of previous batches) or None.
      training: passed to the model (a bool).
      progress: show tqdm progress bars (a bool).

    Returns:
      A ``GradientReport`` of the examples whose gradients are finite (the
      module docstring): a ``RuntimeWarning`` says how many were left out.

    Raises:
      ValueError, TypeError: for an argument out of its range or of the
        wrong type, before any work (``data`` when it is first read).
    """
    if cosine not in COSINE_MODES:
        raise ValueError(f"cosine must be one of {COSINE_MODES}; got {cosine!r}.")
    check_batch_size(batch_size)
    check_count("top_k", top_k, 0)
    for name, value in (("training", training), ("progress", progress)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False; got {value!r}.")
    stats = GradientStatistics(model, loss_fn, method=method, training=training, running_cosine=cosine == "running")
    total = num_batches(data, batch_size)
    with tqdm(total=total, desc="gradient statistics", unit="batch", disable=not progress) as bar:
        for x, y in iterate_batches(data, batch_size):
            stats.update(x, y)
            bar.update(1)
    cosines = None
    if cosine == "final" and stats.count:
        mean = stats.mean()
        parts = []
        with tqdm(total=total, desc="cosines to the mean", unit="batch", disable=not progress) as bar:
            for x, y in iterate_batches(data, batch_size):
                parts.append(stats.cosines(x, y, mean))
                bar.update(1)
        cosines = np.concatenate(parts)
        if len(cosines) != stats.count:
            raise ValueError(
                "data yielded a different number of examples on the second pass "
                f"({len(cosines)} vs {stats.count}); use a deterministic dataset or cosine='running'."
            )
    return stats.result(top_k=top_k, cosines=cosines)


@tf.autograph.experimental.do_not_convert
def _moments(problem, method, training, x, y, reference):
    batch = {"x": x} if y is None else {"x": x, "y": y}
    return batch_moments(problem, batch, reference, method=method, training=training)


def _cosines(dots: np.ndarray, sqnorms: np.ndarray, reference: list[np.ndarray]) -> np.ndarray:
    norms = np.sqrt(np.sum(sqnorms, axis=0))
    ref_norm = math.sqrt(sum(float(np.sum(np.square(r))) for r in reference))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(dots, np.float64) / (norms * ref_norm)


def _path(v: Any) -> str:
    return str(getattr(v, "path", None) or v.name)
