"""The physical batch size that keeps a DP gradient's peak memory under a budget, measured on the device.

A logical batch of ``B`` rows is computed in chunks of ``P`` rows
(``physical_batch_size``); ``physical_batch_size_for_memory`` chooses the
largest ``P`` whose measured peak fits ``memory_budget_mib``. It runs what a
DP step runs before its optimizer's update: ``clipped_sum`` over the logical
batch in chunks of ``P`` rows, the noise draw of each summed gradient's shape
and its addition, and reads the device allocator's peak (TensorFlow's
``get_memory_info``). The search, as an affine model of the peak:

    peak(P, R) ~ a + b P + c R        (P rows a chunk, R rows in all)

``c`` is what the chunk loop keeps per row: its predictions, for the loss and
metrics (a language model's ``[T, V]`` logits), in its array and once
stacked, so twice the bytes of one row of the model's outputs (counted, not
measured: on a small model it is below the allocator's noise). ``b``, one
chunk row's activations, per-example work and norms, and ``a`` come from two
probes of two chunks each, ``(P, R) = (1, 2)`` and ``(2, 4)`` (the loop's
running sums are held from a second chunk on). The largest ``P <= B`` the
model puts under the budget is then *measured* over a whole logical batch,
``R = B`` (one step's compute), and moved along the line through the largest
``P`` that fitted and the smallest that did not (or through ``a`` and the one
measured), between the two (at most five such measurements). So the answer's
peak was measured over a logical batch and is within the budget; it is the
largest such ``P`` as far as the peak is affine in ``P``, as it is for every
engine here (a chunk holds ``P`` rows of everything). A peak is the largest of
three calls, but it is not a constant: on a CPU it moves with the order
independent ops happen to run in (up to 11% between calls on a 50 MiB step
here, ``tests/test_dp_memory_budget.py``), so leave headroom.

What counts. The absolute peak of the device's allocator during the call:
what the process holds there already (the weights, an optimizer's slots once
built, anything else) plus the step's work. Not counted: the optimizer's
update after the gradient (the plain step's own cost; Adam's slots are
allocated at its first step), and XLA: the probes run without
``jit_compile``, as a ``DPModel`` compiled with ``jit_compile=True`` does not,
so under XLA the answer is an estimate. On a CPU TensorFlow keeps the
statistics only with its BFC allocator, chosen by
``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts; without them the
call raises instead of guessing.

Privacy is untouched: ``P`` decides how the rows are grouped, never what a
row contributes (the chunked sum is the same sum) nor the noise (drawn once
per logical step by the aggregator, not by these probes, whose draws are
thrown away).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from per_example_grads._core.arguments import check_number, check_positive_int
from per_example_grads.dp.aggregator import clipped_sum

_MIB = 2**20
_VERIFICATIONS = 5
_CALLS = 3  # measured calls a probe, the largest peak kept: on a CPU the peak moves with the order ops run in


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """What ``physical_batch_size_for_memory`` chose and measured.

    Attributes:
      physical_batch_size: ``P``, for ``DPModel``'s or ``DPAggregator``'s
        ``physical_batch_size``.
      peak_mib: the peak measured at ``P`` over a whole logical batch.
      memory_budget_mib, logical_batch_size: as given (``B``).
      probes: every measurement, ``(P, R, peak MiB)``, in the order taken.
      model: ``(a, b, c)`` in MiB, the affine model (``c`` counted, ``a, b`` from the first two probes).
      device: where it was measured.
    """

    physical_batch_size: int
    peak_mib: float
    memory_budget_mib: float
    logical_batch_size: int
    probes: tuple[tuple[int, int, float], ...]
    model: tuple[float, float, float]
    device: str


def physical_batch_size_for_memory(
    model: Any,
    loss_fn: Callable,
    x: Any,
    y: Any = None,
    *,
    memory_budget_mib: float,
    logical_batch_size: int | None = None,
    method: str = "auto",
    training: bool = True,
    variables: Sequence | None = None,
    device: str | None = None,
    progress: bool = True,
) -> MemoryFit:
    """The largest physical batch size whose DP gradient's measured peak memory fits ``memory_budget_mib``.

    Args:
      model, loss_fn, method, training, variables: as for ``DPModel`` /
        ``peg.clipped_gradients``. What is probed is example-level clipping
        (one ``l2_norm_clip``): a unit-level run's chunks hold whole units
        and their per-unit sums, which are not measured.
      x, y: example rows ``[n, ...]`` (``n >= 1``) of the data the run trains
        on, at its shapes (sequence length, image size); rows are repeated to
        make up a probe's rows, as memory depends on shapes, not values.
      memory_budget_mib: the most the device's allocator may hold at the
        step's peak, in MiB (everything on the device: weights included).
      logical_batch_size: ``B``, the rows of a logical batch as the step
        gets them (a Poisson batch's ``max_batch_size``); default ``n``.
      device: ``"GPU:0"``, ``"CPU:0"``, ...; default the first GPU, else the CPU.
      progress: a progress bar over the probes.

    Returns:
      A ``MemoryFit``: ``physical_batch_size`` and the measurements behind it.

    Raises:
      ValueError: a bad argument; or even one row a chunk does not fit
        (the message gives the peak measured at ``P = 1``).
      RuntimeError: the device keeps no allocator statistics (a CPU without
        ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow started).
    """
    budget = check_number("memory_budget_mib", memory_budget_mib, minimum=0.0)
    rows = _rows(x, y)
    b = rows["count"] if logical_batch_size is None else check_positive_int("logical_batch_size", logical_batch_size)
    device = device or ("GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0")
    data = rows["data"]
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), data)

    def gradient(p):
        def noisy_sum(part):
            out = clipped_sum(
                model,
                loss_fn,
                part["x"],
                part.get("y"),
                l2_norm_clip=1.0,
                method=method,
                training=training,
                variables=variables,
                physical_batch_size=p,
            )
            noisy = [tf.convert_to_tensor(s) + tf.random.normal(tf.shape(s), dtype=s.dtype) for s in out.sums]
            kept = tf.nest.flatten((noisy, out.norms, out.predictions))  # all read, so none is pruned
            return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in kept if t.dtype.is_floating])

        return tf.function(noisy_sum, input_signature=[spec], autograph=False)

    bar = _bar(progress)

    def measure(p: int, r: int) -> float:
        fn, part = gradient(p), _repeated(data, rows["count"], r)
        with tf.device(device):
            fn(part).numpy()  # traced (and the device's kernels set up) outside the measurement
            peaks = []
            for _ in range(_CALLS):
                tf.config.experimental.reset_memory_stats(device)
                fn(part).numpy()
                peaks.append(tf.config.experimental.get_memory_info(device)["peak"] / _MIB)
        del fn, part  # a traced function holds its constants: gone before the next probe is measured
        gc.collect()
        if not max(peaks):
            raise RuntimeError(
                f"TensorFlow keeps no memory statistics for {device}: on a CPU they need its BFC allocator, "
                "chosen by setting TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported."
            )
        probes.append((p, r, max(peaks)))
        bar.update(1)
        bar.set_postfix_str(f"P={p}, {r} rows: {max(peaks):.0f} MiB")
        return max(peaks)

    probes: list[tuple[int, int, float]] = []
    c = _kept_per_row_mib(model, data["x"])
    try:
        r1, r2 = min(b, 2), min(b, 4)  # two chunks where there are rows for them: the loop's running sums count
        f1 = measure(1, r1)
        slope = 0.0 if b == 1 else max(measure(2, r2) - f1 - c * (r2 - r1), 0.0)
        fit = (f1 - slope - c * r1, slope, c)
        p, peak = _search(measure, fit, budget, b)
    finally:
        bar.close()
    return MemoryFit(p, peak, budget, b, tuple(probes), fit, device)


def _search(measure: Callable[[int, int], float], fit: tuple, budget: float, b: int) -> tuple[int, float]:
    """``(P, peak)``: the largest measured ``P <= b`` whose peak over ``b`` rows fits ``budget``.

    Starts where ``fit`` puts the budget, then goes where the line through
    the largest ``P`` that fitted and the smallest that did not puts it
    (halfway from there to the other side after two measurements on one
    side: regula falsi's Illinois remedy), or the line through ``(0, a)``
    and the one side measured, kept between the two sides, for at most
    ``_VERIFICATIONS`` measurements; ``P = 1`` is measured last if nothing
    fitted.
    """
    a, slope, c = fit

    def under_budget(per_row: float) -> int:
        return b if per_row <= 0 else math.floor((budget - a - c * b) / per_row)

    seen = {}  # P -> its peak over b rows

    def peak_at(p: int) -> float:
        seen[p] = measure(p, b)
        return seen[p]

    p = max(1, min(b, under_budget(slope)))
    sides = []  # whether each measurement fitted
    for _ in range(_VERIFICATIONS):
        sides.append(peak_at(p) <= budget)
        fitted = max((q for q, v in seen.items() if v <= budget), default=0)
        failed = min((q for q, v in seen.items() if v > budget), default=b + 1)
        if fitted and failed in seen:  # along the line through the two sides
            step = (seen[failed] - seen[fitted]) / (failed - fitted)
            p = fitted + math.floor((budget - seen[fitted]) / step) if step > 0 else failed - 1
            if sides[-2:] in ([True, True], [False, False]):  # a curved peak keeps it on one side: halfway over
                p = (p + (failed if sides[-1] else fitted)) // 2
        else:  # along the line through (0, a) and the side measured
            q = fitted or failed
            p = under_budget((seen[q] - c * b - a) / q)
        p = min(max(p, fitted + 1), failed - 1)
        if p <= fitted:
            break
    fitted = max((q for q, v in seen.items() if v <= budget), default=0)
    if not fitted and 1 not in seen and peak_at(1) <= budget:
        fitted = 1
    if fitted:
        return fitted, seen[fitted]
    raise ValueError(
        f"memory_budget_mib={budget:g} is below the peak with one row a chunk over a logical batch of {b} rows, "
        f"{seen[1]:.0f} MiB. Give a larger memory_budget_mib, a smaller logical batch or shorter sequences."
    )


def _kept_per_row_mib(model, x) -> float:
    """Twice the MiB of one row of ``model``'s outputs (the chunk loop's predictions, in its array and stacked)."""
    out = model(tf.nest.map_structure(lambda t: t[:1], x), training=False)  # shapes only; no state changes
    return 2 * sum(t.shape.num_elements() * t.dtype.size for t in tf.nest.flatten(out)) / _MIB


def _rows(x, y) -> dict:
    data = {"x": x} | ({} if y is None else {"y": y})
    data = tf.nest.map_structure(tf.convert_to_tensor, data)
    firsts = {int(t.shape[0]) if t.shape.rank else 0 for t in tf.nest.flatten(data)}
    if len(firsts) != 1 or 0 in firsts:
        raise ValueError(
            f"x and y must be rows [n, ...] with the same n >= 1 (the data's shapes); got first dimensions {sorted(firsts)}."
        )
    return {"data": data, "count": firsts.pop()}


def _repeated(data, n: int, r: int):
    """``r`` rows made of ``data``'s ``n``, repeated in order."""
    at = tf.range(r) % n
    return tf.nest.map_structure(lambda t: tf.gather(t, at), data)


def _bar(progress: bool):
    from tqdm.auto import tqdm

    return tqdm(desc="Measuring the DP gradient's memory", unit="probe", disable=not progress)
