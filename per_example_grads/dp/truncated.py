"""Truncated Poisson sampling: Poisson batches of a fixed physical size, an overflowing one cut at random.

At every step each of the ``N`` examples joins independently with
probability ``q``, as in ``poisson_batches``; a batch of more than ``B``
examples (``truncated_batch_size``) keeps ``B`` of them, chosen uniformly at
random, and every batch is padded to ``B`` rows. So every step has the same
static shape, as accelerators and XLA want, and no step ever fails on an
overflow, without the heuristic accounting of fixed-size shuffled batches:
the run is accounted by dp_accounting's ``TruncatedSubsampledGaussianDpEvent``
(``accounting.truncated_poisson_event``; arXiv 2508.15089, which
dp_accounting cites for it). It is the sampling VaultGemma was trained with.

The price is in epsilon, not in the data: when truncation can happen, an
added example can displace another, which doubles the step's sensitivity in
those cases. With ``B`` a few standard deviations above the mean ``q N`` the
price is small; close to the mean it is large. At ``N = 10,000``, ``q N =
100``, ``sigma = 1``, 1,000 steps, ``delta = 1e-6`` (PLD): epsilon 2.12
untruncated; ``B = 175`` 2.12, ``150`` 2.14, ``140`` 3.13, ``130`` 4.92, ``110``
9.21 (``tests/test_dp_truncated.py`` checks the accounting; plan ``B`` with
``compute_epsilon(..., truncated_batch_size=B)`` or ``pegrad epsilon
--truncated-batch-size B``).

The law. An example's chance to be in a step's batch is ``q E[min(1, B / (1 +
K))]`` with ``K ~ Binomial(N - 1, q)`` the others that joined
(``inclusion_probability``); the batch has ``min(Binomial(N, q), B)`` real
rows. Which examples a truncated batch keeps is drawn from the step's key
(folded with a tag), so it is as reproducible and as independent of the
data as the Poisson draw itself.

What it pairs with is checked in ``per_example_grads.dp.composition``:
DP-SGD's independent noise on examples, with or without physical chunks,
budgets, replicas and restores; not the correlated mechanisms, adaptive
clipping, sparse embedding noise, per-user accounting or Monte-Carlo
accounting, whose accounting assumes untruncated sampling. An audit
(``peg.dp.audit``) draws its own ``poisson_batches``: it measures those steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf
from scipy import stats

from per_example_grads._core.arguments import check_positive_int, check_sampling_probability
from per_example_grads.dp import composition
from per_example_grads.dp.sampling import (
    PoissonSampling,
    _padded_batch,
    _step_batches,
    _steps_and_key,
    read_examples,
    sampled_inputs,
)

# Folded into a step's key for the order that truncation keeps the first B of, so it shares no key with the draw.
_TRUNCATION_TAG = 0x7472756E63  # "trunc"


@dataclasses.dataclass
class TruncatedPoissonSampling(PoissonSampling):
    """A ``truncated_poisson_batches`` dataset's sampling (its ``pegrad_sampling``): ``PoissonSampling``'s fields.

    ``max_batch_size`` is the truncated batch size ``B``; there is no cycle
    and no units (``cycle_length = 1``, ``privacy_unit = "example"``).
    """

    scheme = "truncated_poisson"

    @property
    def truncation(self) -> tuple[int, int]:
        """``(B, N)``: what the ledger records of every step, for its event (``accounting.truncated_poisson_event``)."""
        return self.max_batch_size, self.num_examples

    def declared(self) -> composition.Sampling:
        """What ``composition`` checks of this sampling: Poisson, truncated."""
        return composition.Sampling(poisson=True, scheme=self.scheme)


def inclusion_probability(num_examples: int, sampling_probability: float, truncated_batch_size: int) -> float:
    """``P(example i is in a step's batch) = q E[min(1, B / (1 + K))]``, ``K ~ Binomial(N - 1, q)``.

    Examples:
      >>> round(inclusion_probability(100, 0.1, 100), 12)  # B = N: never truncated, q
      0.1
      >>> round(inclusion_probability(100, 0.5, 10), 4)  # about B / N when truncation is certain
      0.1
    """
    n = check_positive_int("num_examples", num_examples)
    q = check_sampling_probability(sampling_probability)
    b = check_positive_int("truncated_batch_size", truncated_batch_size)
    others = np.arange(n)  # K = 0 .. N - 1
    kept = np.minimum(1.0, b / (1.0 + others))
    return float(q * np.dot(stats.binom.pmf(others, n - 1, q), kept))


def truncated_poisson_batches(
    x: Any,
    y: Any = None,
    *,
    sampling_probability: float,
    truncated_batch_size: int,
    steps: int | None = None,
    seed: int | None = None,
    first_step: int = 0,
) -> tf.data.Dataset:
    """A dataset of ``steps`` truncated Poisson batches (module docstring), each ``B`` rows, as ``(x, y, mask)``.

    Every element is as ``poisson_batches`` gives it (``x_batch`` leaves
    ``[B, ...]``, ``y_batch`` or None, ``mask`` ``float32 [B]``, ``1.0`` on the
    real rows, in increasing index order, then ``0.0`` on zero padding), with
    ``B = truncated_batch_size``; a step that samples more than ``B``
    examples keeps ``B`` of them, uniformly at random. Randomness, passes and
    restarts are ``poisson_batches``'s (batch ``t`` depends only on ``seed``
    and ``t``; ``DPModel.fit`` resumes the run's steps). ``DPModel.fit``
    records each step's ``(B, N)`` in its ledger and accounts the run by its
    own event.

    Args:
      x, y: as for ``poisson_batches`` (leaves ``[N, ...]``).
      sampling_probability: ``q`` in ``(0, 1]``.
      truncated_batch_size: ``B >= 1``, the rows of every batch. Choose it a
        few standard deviations above ``q N`` (module docstring for what
        each costs in epsilon).
      steps: batches per pass; default ``round(1 / q)``.
      seed, first_step: as for ``poisson_batches``.

    Returns:
      A ``tf.data.Dataset`` of cardinality ``steps``, with attribute
      ``pegrad_sampling`` (a ``TruncatedPoissonSampling``).

    Raises:
      ValueError, TypeError: as ``poisson_batches``, naming the argument.

    Examples:
      >>> ds = truncated_poisson_batches(np.arange(10.0)[:, None], sampling_probability=1.0,
      ...                                truncated_batch_size=4, seed=0)
      >>> xb, yb, mask = next(iter(ds))
      >>> xb.shape, mask.numpy().tolist()  # 10 sampled, 4 kept
      (TensorShape([4, 1]), [1.0, 1.0, 1.0, 1.0])
      >>> ds.pegrad_sampling.truncation
      (4, 10)
    """
    q = check_sampling_probability(sampling_probability)
    inputs, n = sampled_inputs(x, y)
    b = check_positive_int("truncated_batch_size", truncated_batch_size)
    steps, key = _steps_and_key(steps, 1, q, seed, first_step)
    with tf.init_scope():
        next_step = tf.Variable(int(first_step), dtype=tf.int64, trainable=False, name="next_step")
    sampling = TruncatedPoissonSampling(q, n, b, steps, next_step)
    kept = min(b, n)

    def sample(step):
        step_seed = tf.random.experimental.stateless_fold_in(key, step)
        joined = tf.random.stateless_uniform([n], seed=step_seed, dtype=tf.float64) < q
        order_seed = tf.random.experimental.stateless_fold_in(step_seed, _TRUNCATION_TAG)
        order = tf.random.stateless_uniform([n], seed=order_seed, dtype=tf.float64)
        # The B joined examples first in a uniformly random order (2 puts the others after all of them).
        _, first = tf.math.top_k(-tf.where(joined, order, 2.0), k=kept)
        chosen = tf.sort(tf.boolean_mask(first, tf.gather(joined, first)))
        xb, yb, mask, _ = _padded_batch(
            inputs, tf.cast(chosen, tf.int64), b, "A truncated batch kept", "rows, more than B."
        )
        return xb, yb, mask

    return _step_batches(sample, steps, sampling)


def truncated_poisson_batches_from_dataset(
    dataset: tf.data.Dataset,
    num_examples: int | None = None,
    *,
    sampling_probability: float,
    truncated_batch_size: int,
    steps: int | None = None,
    seed: int | None = None,
    progress: bool = False,
    first_step: int = 0,
) -> tf.data.Dataset:
    """``truncated_poisson_batches`` for a finite dataset of single (unbatched) examples.

    The dataset is read once into memory, checked and stacked as
    ``poisson_batches_from_dataset`` reads one (its docstring: the element
    conventions, a repeated or infinite dataset refused, ``num_examples``
    checked), then sampled exactly as ``truncated_poisson_batches`` samples
    the stacked arrays: the same batches for the same seed.

    Args:
      dataset: a finite ``tf.data.Dataset`` of single examples.
      num_examples: ``N``, if known (checked against the dataset).
      sampling_probability, truncated_batch_size, steps, seed, first_step:
        as in ``truncated_poisson_batches``.
      progress: show a progress bar while reading the dataset.

    Returns:
      ``truncated_poisson_batches``'s dataset, with its ``pegrad_sampling``.

    Raises:
      ValueError, TypeError: as ``poisson_batches_from_dataset`` and
        ``truncated_poisson_batches``, naming the argument.

    Examples:
      >>> ds = tf.data.Dataset.from_tensor_slices((np.ones([50, 3], "float32"), np.arange(50)))
      >>> batches = truncated_poisson_batches_from_dataset(ds, 50, sampling_probability=0.2,
      ...                                                  truncated_batch_size=16, seed=0)
      >>> [t.shape[0] for t in next(iter(batches))], batches.pegrad_sampling.truncation
      ([16, 16, 16], (16, 50))
    """
    check_sampling_probability(sampling_probability)
    check_positive_int("truncated_batch_size", truncated_batch_size)
    x, y, _ = read_examples(dataset, num_examples, progress=progress)
    return truncated_poisson_batches(
        x,
        y,
        sampling_probability=sampling_probability,
        truncated_batch_size=truncated_batch_size,
        steps=steps,
        seed=seed,
        first_step=first_step,
    )


__all__ = [
    "TruncatedPoissonSampling",
    "inclusion_probability",
    "truncated_poisson_batches",
    "truncated_poisson_batches_from_dataset",
]
