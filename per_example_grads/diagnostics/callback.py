"""``GradientStatisticsCallback``: gradient statistics every N training steps, in TensorBoard."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from per_example_grads.diagnostics.report import GradientReport
from per_example_grads.diagnostics.statistics import GradientStatistics
from per_example_grads.diagnostics.streams import check_batch_size, iterate_batches, num_examples

SCALARS = ("noise_scale", "trace_covariance", "mean_gradient_norm", "per_example_norm_mean", "gsnr")
HISTOGRAMS = ("norm_histograms",)
DEFAULT_STATISTICS = ("noise_scale", "trace_covariance", "mean_gradient_norm", "norm_histograms")


class GradientStatisticsCallback(keras.callbacks.Callback):
    """Computes gradient statistics on held-out data every ``every_n_steps`` training steps.

    On a step whose count (1-based, over the whole ``fit``) is a multiple of
    ``every_n_steps``, it streams over ``data`` with the same machinery as
    ``gradient_statistics`` (one pass, no cosines) at the model's current
    weights, and writes with ``tf.summary`` under ``log_dir``, at that step:

    - scalars ``{prefix}/noise_scale`` (B_simple), ``{prefix}/trace_covariance``
      (tr(Σ)), ``{prefix}/mean_gradient_norm`` (||G||),
      ``{prefix}/per_example_norm_mean``, ``{prefix}/gsnr/<variable path>``;
    - histograms ``{prefix}/norms/<layer>`` of the per-example gradient norms
      restricted to each layer's variables (and ``{prefix}/norms/all``).

    On every other step ``on_train_batch_end`` only increments a Python
    counter: no graph work. The per-batch computation is one ``tf.function``
    built on first use and reused.

    Args:
      data: a batched ``tf.data.Dataset`` of ``(x, y)`` or a tuple ``(x, y)``
        of arrays or of the structures the model takes (dicts, lists,
        tuples, nested; every leaf with the same rows, checked here). Keep
        it small: it is processed in full each time.
      every_n_steps: how often, in training steps.
      log_dir: folder for the TensorBoard event files.
      loss_fn: per-example loss; default: the compiled ``model.loss``.
      statistics: which of ``SCALARS`` and ``"norm_histograms"`` to write.
      batch_size: batch size for array ``data``.
      method: engine, as in ``gradient_statistics``.
      prefix: tag prefix.

    Attributes:
      steps_computed: the steps at which statistics were computed.
      last_report: the latest ``GradientReport`` (or None).
    """

    def __init__(
        self,
        data: Any,
        every_n_steps: int = 100,
        log_dir: str = "logs/gradient_statistics",
        *,
        loss_fn: Callable | str | None = None,
        statistics: Sequence[str] = DEFAULT_STATISTICS,
        batch_size: int | None = None,
        method: str = "auto",
        prefix: str = "gradients",
    ):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1; got {every_n_steps}.")
        check_batch_size(batch_size)
        num_examples(data)  # array data's leaves must share N: checked now, not at the first log step
        unknown = set(statistics) - set(SCALARS) - set(HISTOGRAMS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; choose from {SCALARS + HISTOGRAMS}.")
        self.data = data
        self.every_n_steps = int(every_n_steps)
        self.log_dir = str(log_dir)
        self.loss_fn = loss_fn
        self.statistics = tuple(statistics)
        self.batch_size = batch_size
        self.method = method
        self.prefix = prefix
        self.steps_computed: list[int] = []
        self.last_report: GradientReport | None = None
        self._step = 0
        self._stats: GradientStatistics | None = None
        self._writer = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._step += 1
        if self._step % self.every_n_steps:
            return
        self.compute_and_log(self._step)

    def compute_and_log(self, step: int) -> GradientReport:
        """Computes the statistics now and writes them at ``step``."""
        if self._stats is None:
            loss = self.loss_fn if self.loss_fn is not None else getattr(self.model, "loss", None)
            if loss is None:
                raise ValueError("GradientStatisticsCallback needs loss_fn= or a compiled model with a loss.")
            self._stats = GradientStatistics(self.model, loss, method=self.method)
        self._stats.reset()
        for x, y in iterate_batches(self.data, self.batch_size):
            self._stats.update(x, y)
        report = self._stats.result()
        self._write(report, step)
        self.steps_computed.append(step)
        self.last_report = report
        return report

    def _write(self, report: GradientReport, step: int) -> None:
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        p = self.prefix
        with self._writer.as_default(step=step):
            for name in self.statistics:
                if name == "gsnr":
                    for path, value in report.gsnr().items():
                        if np.isfinite(value):
                            write_scalar(f"{p}/gsnr/{path}", value)
                elif name in SCALARS:
                    value = float(
                        getattr(report, name) if name != "per_example_norm_mean" else np.mean(report.per_example_norms)
                    )
                    if np.isfinite(value):
                        write_scalar(f"{p}/{name}", value)
            if "norm_histograms" in self.statistics:
                groups: dict[str, list[int]] = {}
                for k, path in enumerate(report.variable_paths):
                    groups.setdefault(path.rsplit("/", 1)[0], []).append(k)
                for layer, ks in groups.items():
                    norms = np.sqrt(np.sum(np.square(report.per_variable_norms[ks]), axis=0))
                    write_histogram(f"{p}/norms/{layer}", norms)
                write_histogram(f"{p}/norms/all", report.per_example_norms)
        self._writer.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._writer is not None:
            self._writer.flush()


# tf.summary.scalar / histogram live in the tensorboard package, which is not
# a dependency. These write the same records TensorBoard's own ops write (a
# tensor plus plugin metadata) through the core op tf.summary.write, so the
# event files read identically whether or not tensorboard is installed.


def _metadata(plugin: str, data_class: int) -> summary_pb2.SummaryMetadata:
    m = summary_pb2.SummaryMetadata()
    m.plugin_data.plugin_name = plugin
    m.data_class = data_class
    return m


def write_scalar(tag: str, value: float) -> None:
    """A TensorBoard scalar (plugin ``scalars``) at the default writer's step."""
    tf.summary.write(
        tag, tf.constant(float(value), tf.float32), metadata=_metadata("scalars", summary_pb2.DATA_CLASS_SCALAR)
    )


def write_histogram(tag: str, values: np.ndarray, bins: int = 30) -> None:
    """A TensorBoard histogram (plugin ``histograms``): ``[bins, 3]`` rows ``(left, right, count)``."""
    values = np.asarray(values, np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        table = np.zeros((0, 3))
    else:
        low, high = float(values.min()), float(values.max())
        if high <= low:
            low, high = low - 0.5, high + 0.5
        counts, edges = np.histogram(values, bins=bins, range=(low, high))
        table = np.stack([edges[:-1], edges[1:], counts.astype(np.float64)], axis=1)
    tf.summary.write(
        tag, tf.constant(table, tf.float64), metadata=_metadata("histograms", summary_pb2.DATA_CLASS_TENSOR)
    )
