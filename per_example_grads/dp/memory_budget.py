"""The physical batch size that keeps a DP step's peak memory under a budget, measured on the device.

A logical batch of ``B`` rows is computed in chunks of ``P`` rows
(``physical_batch_size``); ``physical_batch_size_for_memory`` chooses the
largest ``P`` whose measured peak fits ``memory_budget_mib``. It runs what a
``DPModel`` step runs, in a ``DPAggregator`` of its own (its ledger and
noise are never the run's): the clipped sum over the logical batch in chunks
of ``P`` rows and its release (noise, average), then an SGD update's
temporaries (each weight minus its gradient, not assigned) and the loss of
the predictions, and reads the device allocator's peak (TensorFlow's
``get_memory_info``). The search, as an affine model of the peak:

    peak(P) ~ a + b P        (P rows a chunk, over a logical batch of B rows)

It holds as far as the loop keeps nothing per row of the logical batch but
a norm and a loss: the step's loss and metrics are taken chunk by chunk
(``clipped_sum``'s ``outputs``), not from the whole batch's predictions (a
language model's ``[B, T, V]`` logits). ``b``, one chunk row's
activations, per-example work and norms, and ``a`` come from two probes of
two chunks each, ``(P, rows) = (1, 2)`` and ``(2, 4)`` (the loop's running
sums are held from a second chunk on). The largest ``P <= B`` the model
puts under the budget is then *measured* over a whole logical batch (one
step's compute), and moved along the line through the largest ``P`` that
fitted and the smallest that did not (or through ``a`` and the one
measured), between the two (at most five such measurements). So the answer's
peak was measured over a logical batch and is within the budget less its
``headroom`` (10% by default, for what the probes do not run); it is the
largest such ``P`` as far as the peak is affine in ``P``, as it is for every
engine here (a chunk holds ``P`` rows of everything). A peak is the largest of
three calls, but it is not a constant: on a CPU it moves with the order
independent ops happen to run in (up to 15% between traces of a 50 MiB step
under load here, ``tests/test_dp_memory_budget.py``), which the headroom
is for too.

What counts. The absolute peak of the device's allocator during the call:
what the process holds there already (the weights, an optimizer's slots once
built, anything else) plus the step's work. Not counted: an optimizer's
update beyond SGD's (Adam's slots are allocated at its first step, and its
update makes more temporaries), metrics, and XLA: the probes run without
``jit_compile``, as a ``DPModel`` compiled with ``jit_compile=True`` does not,
so under XLA the answer is an estimate. On a CPU TensorFlow's default
allocator keeps no statistics (it reports 0 bytes; some installs, with CUDA
libraries, keep them); its BFC allocator, chosen by
``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts, does. Without
them the call raises instead of guessing.

Privacy is untouched: ``P`` decides how the rows are grouped, never what a
row contributes (the chunked sum is the same sum) nor the noise (drawn once
per logical step by the run's aggregator; the probes' aggregator and draws
are thrown away).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from per_example_grads._core.arguments import check_number, check_positive_int
from per_example_grads.dp.aggregator import DPAggregator
from per_example_grads.dp.sampling import sampled_inputs

_MIB = 2**20
_VERIFICATIONS = 5
_CALLS = 3  # measured calls a probe, the largest peak kept: on a CPU the peak moves with the order ops run in


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """What ``physical_batch_size_for_memory`` chose and measured.

    Attributes:
      physical_batch_size: ``P``, for ``DPModel``'s or ``DPAggregator``'s
        ``physical_batch_size``.
      peak_mib: the peak measured at ``P`` over a whole logical batch, at
        most ``(1 - headroom) * memory_budget_mib``.
      memory_budget_mib, headroom, logical_batch_size: as given (``B``).
      probes: every measurement, ``(P, R, peak MiB)``, in the order taken.
      affine: ``(a, b)`` in MiB, the peak's affine model, from the first two probes.
      device: where it was measured.
    """

    physical_batch_size: int
    peak_mib: float
    memory_budget_mib: float
    headroom: float
    logical_batch_size: int
    probes: tuple[tuple[int, int, float], ...]
    affine: tuple[float, float]
    device: str


def physical_batch_size_for_memory(
    model: Any,
    loss_fn: Callable,
    x: Any,
    y: Any = None,
    *,
    memory_budget_mib: float,
    logical_batch_size: int | None = None,
    headroom: float = 0.1,
    method: str = "auto",
    training: bool = True,
    variables: Sequence | None = None,
    device: str | None = None,
    progress: bool = True,
) -> MemoryFit:
    """The largest physical batch size whose DP step's measured peak memory fits ``memory_budget_mib``.

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
      headroom: the fraction of the budget kept free, in ``[0, 1)``: the
        measured peak must fit ``(1 - headroom) * memory_budget_mib``. It is
        for what the probes do not run (module docstring; on GPT-2 base a
        ``DPModel``'s ``train_on_batch`` peaked within 3% of them,
        benchmarks/RESULTS.md) and for the peak's variation between traces.
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
    given = check_number("memory_budget_mib", memory_budget_mib, minimum=0.0)
    kept_free = check_number("headroom", headroom, minimum=0.0, inclusive=True)
    if kept_free >= 1:
        raise ValueError(f"headroom={headroom!r} must be below 1: it is the fraction of the budget kept free.")
    budget = given * (1 - kept_free)
    data, n = sampled_inputs(x, y)
    b = n if logical_batch_size is None else check_positive_int("logical_batch_size", logical_batch_size)
    device = device or ("GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0")
    args = dict(method=method, training=training, variables=variables)
    bar = _bar(progress)

    def measure(p: int, r: int) -> float:
        peak = _step_peak_mib(model, loss_fn, _repeated(data, n, r), p, device, **args)
        probes.append((p, r, peak))
        bar.update(1)
        bar.set_postfix_str(f"P={p}, {r} rows: {peak:.0f} MiB")
        return peak

    probes: list[tuple[int, int, float]] = []
    try:
        r1, r2 = min(b, 2), min(b, 4)  # two chunks where there are rows for them: the loop's running sums count
        f1 = measure(1, r1)
        slope = 0.0 if b == 1 else max(measure(2, r2) - f1, 0.0)
        affine = (f1 - slope, slope)
        label = f"memory_budget_mib={given:g} less headroom={kept_free:g} ({budget:.0f} MiB)"
        p, peak = _search(measure, affine, budget, b, label)
    finally:
        bar.close()
    return MemoryFit(p, peak, given, kept_free, b, tuple(probes), affine, device)


def _step_peak_mib(
    model: Any,
    loss_fn: Callable,
    data: dict,
    physical_batch_size: int,
    device: str,
    *,
    method: str = "auto",
    training: bool = True,
    variables: Sequence | None = None,
) -> float:
    """The device allocator's peak, in MiB, over a DP step of ``data``'s rows in chunks of ``physical_batch_size``.

    The step is the module docstring's: the clipped sum, its noise, an SGD
    update's temporaries and the loss, traced for any number of rows (as
    ``_chunked`` traces a chunk). It is called once outside the measurement
    (the trace, the device's set-up), then ``_CALLS`` times; the largest peak
    is returned. ``data``: ``{"x": ..., "y": ...}`` (``y`` optional), leaves
    ``[R, ...]``.

    Raises:
      RuntimeError: the device keeps no allocator statistics.
    """
    weights = list(variables) if variables is not None else model.trainable_variables
    # A DP step of its own: its ledger, step count and noise are this probe's, never the run's.
    aggregator = DPAggregator(
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        physical_batch_size=physical_batch_size,
        method=method,
        training=training,
    )

    def step(part):
        done = aggregator.step(
            model,
            loss_fn,
            part["x"],
            part.get("y"),
            variables=variables,
            outputs=lambda rows, predictions: loss_fn(rows.get("y"), predictions),  # a DPModel's losses, per chunk
        )
        stepped = [tf.cast(w, g.dtype) - g for w, g in zip(weights, done.gradients)]  # an SGD update's temporaries
        kept = tf.nest.flatten((stepped, done.clipped.norms, done.clipped.predictions))  # all read, none pruned
        return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in kept if t.dtype.is_floating])

    spec = tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), data)
    fn = tf.function(step, input_signature=[spec], autograph=False)
    with tf.device(device):
        fn(data).numpy()
        peaks = []
        for _ in range(_CALLS):
            tf.config.experimental.reset_memory_stats(device)
            fn(data).numpy()
            peaks.append(tf.config.experimental.get_memory_info(device)["peak"] / _MIB)
    del fn  # a traced function holds its constants: gone before the next one is measured
    gc.collect()
    if not max(peaks):
        raise RuntimeError(
            f"TensorFlow keeps no memory statistics for {device}: on a CPU they need its BFC allocator, "
            "chosen by setting TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported."
        )
    return max(peaks)


def _search(
    measure: Callable[[int, int], float], affine: tuple, budget: float, b: int, label: str | None = None
) -> tuple[int, float]:
    """``(P, peak)``: the largest measured ``P <= b`` whose peak over ``b`` rows fits ``budget``.

    Starts where ``affine`` puts the budget, then goes where the line through
    the largest ``P`` that fitted and the smallest that did not puts it
    (halfway from there to the other side after two measurements on one
    side: regula falsi's Illinois remedy), or the line through ``(0, a)``
    and the one side measured, kept between the two sides, for at most
    ``_VERIFICATIONS`` measurements; ``P = 1`` is measured last if nothing
    fitted.
    """
    a, slope = affine

    def under_budget(per_row: float) -> int:
        return b if per_row <= 0 else math.floor((budget - a) / per_row)

    seen = {}  # P -> its peak over b rows

    def peak_at(p: int) -> float:
        seen[p] = measure(p, b)
        return seen[p]

    def sides() -> tuple[int, int]:  # the largest P that fitted (0: none), the smallest that did not (b + 1: none)
        fitted = max((q for q, v in seen.items() if v <= budget), default=0)
        return fitted, min((q for q, v in seen.items() if v > budget), default=b + 1)

    p = max(1, min(b, under_budget(slope)))
    fits = []  # whether each measurement fitted
    for _ in range(_VERIFICATIONS):
        fits.append(peak_at(p) <= budget)
        fitted, failed = sides()
        if fitted and failed in seen:  # along the line through the two sides
            step = (seen[failed] - seen[fitted]) / (failed - fitted)
            p = fitted + math.floor((budget - seen[fitted]) / step) if step > 0 else failed - 1
            if fits[-2:] in ([True, True], [False, False]):  # a curved peak keeps it on one side: halfway over
                p = (p + (failed if fits[-1] else fitted)) // 2
        else:  # along the line through (0, a) and the side measured
            q = fitted or failed
            p = under_budget((seen[q] - a) / q)
        p = min(max(p, fitted + 1), failed - 1)
        if p <= fitted:
            break
    fitted, _ = sides()
    if not fitted and 1 not in seen and peak_at(1) <= budget:
        fitted = 1
    if fitted:
        return fitted, seen[fitted]
    label = label or f"memory_budget_mib={budget:g}"
    raise ValueError(
        f"{label} is below the peak with one row a chunk over a logical batch of {b} rows, {seen[1]:.0f} MiB. "
        "Give a larger memory_budget_mib, a smaller logical batch or shorter sequences."
    )


def _repeated(data, n: int, r: int):
    """``r`` rows made of ``data``'s ``n``, repeated in order."""
    at = tf.range(r) % n
    return tf.nest.map_structure(lambda t: tf.gather(t, at), data)


def _bar(progress: bool):
    from tqdm.auto import tqdm

    return tqdm(desc="Measuring the DP step's memory", unit="probe", disable=not progress)
