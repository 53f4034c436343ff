"""Poisson-sampled logical batches with a fixed padded shape, and physical chunks.

Why Poisson sampling
--------------------
The privacy accountants used for DP-SGD (RDP / PLD accounting of the
subsampled Gaussian mechanism) assume that at every step each of the ``N``
training examples joins the batch independently with probability ``q``. The
batch size is then random, ``Binomial(N, q)``, with mean ``q * N``. Shuffling
and cutting the data into equal batches is a different sampling scheme, and
the usual accountants' numbers do not apply to it.

Shapes and the padding / mask contract
--------------------------------------
``tf.function`` retraces when a shape changes, so a random batch size would
retrace at almost every step. Each *logical* batch is therefore padded to a
fixed ``max_batch_size = M`` rows and comes with a mask:

* ``x_batch``: same structure as ``x``, every leaf ``[M, ...]``;
* ``y_batch``: same structure as ``y``, every leaf ``[M, ...]`` (``None``
  when no ``y`` was given);
* ``mask``: ``float32 [M]``, ``1.0`` for a sampled example, ``0.0`` for
  padding.

The ``b`` sampled examples fill rows ``0 .. b-1`` (in increasing index order);
rows ``b .. M-1`` are all zeros. Pass ``mask`` as ``sample_weight``: it
multiplies each example's loss, so a padded row has a zero loss and exactly
zero gradient. ``b = 0`` happens (with probability ``(1-q)^N``) and gives an
all-zero mask; such a step is valid and must still be taken (DP-SGD then
adds noise only). Note that DP-SGD normalizes the noisy sum by the
*expected* batch size ``q * N``, not by ``b`` nor by ``M``.

No example is ever dropped: if a step samples more than ``M`` examples,
iteration stops with ``tf.errors.InvalidArgumentError`` whose message names
``max_batch_size``. The default ``M`` (``default_max_batch_size``) is the
smallest size whose per-step overflow probability is at most ``1e-12``
(computed from the exact binomial tail), so in practice that error is only
seen when ``max_batch_size`` is set by hand too small.

Physical chunks
---------------
A logical batch may be too large to compute per-example gradients for at
once. ``physical_chunks`` (a Python generator, eager) and
``physical_chunks_dataset`` (a ``tf.data`` transformation) split it into
chunks of a fixed ``physical_batch_size = P`` rows holding only the real rows:
``max(1, ceil(b / P))`` chunks, the last padded with mask ``0``, each flagged
``is_last`` on the final chunk of its logical batch. Accumulate the clipped
gradient sums over the chunks and apply the noisy update when ``is_last``.
An empty logical batch gives one all-masked chunk, so the optimizer still
steps.

Examples:
  >>> import numpy as np
  >>> x = np.arange(100, dtype="float32")[:, None]          # [N=100, 1]
  >>> y = np.arange(100) % 2                                 # [N]
  >>> ds = poisson_batches(x, y, sampling_probability=0.1, seed=0)
  >>> xb, yb, mask = next(iter(ds))
  >>> xb.shape, yb.shape, mask.shape                         # M = 36 here
  (TensorShape([36, 1]), TensorShape([36]), TensorShape([36]))
  >>> chunks = list(physical_chunks(xb, yb, mask, physical_batch_size=8))
  >>> [c.is_last for c in chunks][-1], chunks[0].x.shape
  (True, TensorShape([8, 1]))
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import tensorflow as tf

from per_example_grads._core.arguments import check_positive_int, check_sampling_probability
from per_example_grads._core.batch import _check_leading_dims, _to_tensors
from per_example_grads._core.datasets import repeats
from per_example_grads.dp import composition
from per_example_grads.dp.noise import hashed_key

__all__ = [
    "FixedSizeSampling",
    "PhysicalChunk",
    "PoissonSampling",
    "default_max_batch_size",
    "physical_chunks",
    "physical_chunks_dataset",
    "poisson_batches",
    "poisson_batches_from_dataset",
]

#: Per-step probability that a batch overflows the default ``max_batch_size``.
DEFAULT_OVERFLOW_PROBABILITY = 1e-12


class PhysicalChunk(NamedTuple):
    """One fixed-shape piece of a logical batch.

    Attributes:
      x: structure of ``x``, each leaf ``[P, ...]``.
      y: structure of ``y``, each leaf ``[P, ...]``, or ``None``.
      mask: ``float32 [P]``; the logical batch's mask values for real rows,
        ``0.0`` for padding.
      is_last: ``True`` on the final chunk of its logical batch (a Python
        bool from ``physical_chunks``, a scalar ``tf.bool`` tensor from
        ``physical_chunks_dataset``).
    """

    x: Any
    y: Any
    mask: tf.Tensor
    is_last: Any


@dataclasses.dataclass
class PoissonSampling:
    """How a ``poisson_batches`` dataset samples; it is the dataset's ``pegrad_sampling`` attribute.

    ``DPModel.fit`` reads it to account the sampling actually used, to
    resume the dataset where its ledger stopped, and to keep a cyclic run on
    one partition (``partition``).

    Attributes:
      sampling_probability: ``q``, the probability that an example of the
        part in turn joins a batch.
      num_examples: ``N``.
      max_batch_size: ``M``, the padded rows of every batch.
      steps: batches per pass.
      next_step: int64 variable, the global index of the first step of the
        next pass (each pass advances it by ``steps``). Batch ``t`` depends
        only on the seed and ``t``, so setting it to the number of steps a
        restored run has taken continues that run's batches instead of
        replaying them.
      cycle_length: ``b``, the number of parts the examples are assigned to;
        step ``t`` samples part ``t mod b`` only (1: every step samples
        from all ``N``).
      privacy_unit: ``"example"`` (each row is sampled) or ``"unit"`` (a
        ``poisson_batches(..., unit_ids=...)`` dataset: units are sampled,
        and ``num_examples`` is then ``U``, the number of units, the count the
        accountant needs).
      num_rows: the rows the dataset holds (``N`` for example-level sampling).
      rows_per_unit: unit-level sampling: the most rows one unit brings to a
        batch, ``min(rows_per_unit, largest unit)``; None for example-level.
      partition_key: cyclic sampling: ``[2]`` int64, the key every
        example's (unit's) part is drawn from (``poisson_batches``, Cyclic
        Poisson sampling); None for ``b = 1``.
      parts: cyclic sampling: ``[N]`` (``[U]``) int64 variable, every
        example's (unit's) part, drawn from ``partition_key``; every step
        reads it, so a run's partition can be given to a new dataset of the
        same rows (``take_partition``). None for ``b = 1``.
      rows_digest: cyclic sampling: ``[2]`` int64, a digest of the rows (and
        unit ids) in their order, which with the key fixes every example's
        part; None for ``b = 1``.
    """

    sampling_probability: float
    num_examples: int
    max_batch_size: int
    steps: int
    next_step: tf.Variable
    cycle_length: int = 1
    scheme = "poisson"  # a sampler's name for the composition table (``per_example_grads.dp.min_sep``'s is "min_sep")
    poisson = True
    truncation = (0, 0)  # (B, N) of truncated Poisson sampling (``per_example_grads.dp.truncated``), for the ledger
    privacy_unit: str = "example"
    num_rows: int | None = None
    rows_per_unit: int | None = None
    partition_key: np.ndarray | None = None
    parts: tf.Variable | None = None
    rows_digest: np.ndarray | None = None

    @property
    def expected_batch_size(self) -> float:
        """``q N / b``: the mean number of sampled examples (units, for unit-level sampling) of a batch."""
        return self.sampling_probability * self.num_examples / self.cycle_length

    @property
    def partition(self) -> np.ndarray | None:
        """``int64 [5]`` ``[b, key, digest]``: what fixes every example's part in a cyclic run; None for ``b = 1``.

        A ledger saves it; two datasets with the same ``partition`` put every
        example (unit) in the same part.
        """
        if self.partition_key is None:
            return None
        return np.concatenate([[self.cycle_length], self.partition_key, self.rows_digest]).astype(np.int64)

    def declared(self) -> composition.Sampling:
        """What ``composition`` checks of this sampling: Poisson, its scheme, cycle and units."""
        return composition.Sampling(
            poisson=True,
            cycle_length=self.cycle_length,
            scheme=self.scheme,
            units=self.privacy_unit == "unit",
            rows_per_unit=self.rows_per_unit,
        )

    def take_partition(self, partition: np.ndarray) -> None:
        """Makes this dataset's partition ``partition`` (a run's, as ``partition`` gave it), if it holds the same rows.

        Raises:
          ValueError: the run's steps were drawn by another sampler
            (``check_partition_scheme``), or the cycle or the rows (their
            digest: other rows, or the same rows in another order) are not
            those ``partition`` was made for, so no key can give every
            example the part it had.
        """
        partition = check_partition_scheme(partition, self.scheme)
        own = self.partition
        if own is None or own[0] != partition[0] or not np.array_equal(own[3:], partition[3:]):
            what = "unit" if self.privacy_unit == "unit" else "example"
            raise ValueError(
                f"the run's earlier steps were cyclic-sampled with cycle_length={int(partition[0])} from other "
                f"rows than this dataset's (cycle_length={self.cycle_length}; other rows, or the same rows in "
                f"another order): every {what} must stay in the part it had, or it could be sampled again "
                "sooner than cycle_length steps after its last turn, which the accounting excludes. Build the "
                "dataset from the same rows, in the same order, with the same cycle_length."
            )
        self.partition_key = partition[1:3].copy()
        self.parts.assign(_cyclic_parts(int(self.parts.shape[0]), self.cycle_length, self.partition_key))


# A partition's first entry says which sampler drew the run: the cycle b of cyclic Poisson sampling (as
# every version has recorded it), -b for b-min-sep (recorded so since the two could continue each other).
_SAMPLERS = {
    "poisson": ("cyclic Poisson sampling", "poisson_batches"),
    "min_sep": ("b-min-sep sampling", "min_sep_batches"),
}


def partition_scheme(partition: Any) -> str:
    """The sampler that recorded ``partition``: ``"min_sep"`` (``-b`` first) or ``"poisson"`` (``b`` first)."""
    return "min_sep" if int(np.asarray(partition)[0]) < 0 else "poisson"


def check_partition_scheme(partition: Any, scheme: str) -> np.ndarray:
    """``int64 [5]`` ``partition``, if a run recorded it under sampling ``scheme``; ValueError naming both otherwise.

    Cyclic Poisson and b-min-sep runs both keep ``b`` steps between an
    example's turns, but by different rules: continuing one with the other
    can put an example in a step fewer than ``b`` after its last one (its
    part's turn right after a b-min-sep step), which no mechanism's
    accounting covers.
    """
    partition = np.asarray(partition, np.int64)
    recorded = partition_scheme(partition)
    if recorded != scheme:
        (was, _), (now, _) = _SAMPLERS[recorded], _SAMPLERS[scheme]
        raise ValueError(
            f"the run's earlier steps were drawn by {was} (b = {abs(int(partition[0]))}) and this dataset by "
            f"{now}: switching can put an example in a step fewer than b steps after its last one, which the "
            f"accounting excludes. Continue the run on {_SAMPLERS[recorded][1]}(...) of the same rows, or "
            "begin a new run (a new DPModel)."
        )
    return partition


@dataclasses.dataclass(frozen=True)
class FixedSizeSampling:
    """Batches of a fixed number of rows that this package did not draw: the sampling of everything but its samplers.

    Arrays given to ``fit`` with ``batch_size``, a ``tf.data`` dataset not
    made by ``poisson_batches`` (typically ``shuffle(...).batch(B)``),
    ``train_on_batch`` and a custom loop over ``train_step``. How their rows
    were chosen is unknown; each step is accounted *as if* it were Poisson
    sampled at ``q = rows / N`` (a batch's rows, the largest known one
    before the step), the widespread heuristic for shuffled batches. It is
    an approximation, not a bound: the true epsilon of fixed-size shuffled
    batches can be larger (Chua et al., "How Private are DP-SGD
    Implementations?", ICML 2024). The ledger records such steps as not
    Poisson sampled, and every epsilon of a run that has one warns
    (``accounting.SHUFFLE_WARNING``). A correlated or cyclic mechanism,
    whose accounting needs each example's participations, refuses them
    (``composition``).

    Attributes:
      largest_batch: the most rows a step takes, where known before the step
        (a static batch size); None otherwise.
      rows_per_unit: unit-level batches: the most rows one unit brings (the
        last Poisson fit's), or None.
    """

    largest_batch: int | None = None
    rows_per_unit: int | None = None
    scheme = "fixed_size"
    poisson = False
    truncation = (0, 0)
    sampling_probability = None  # per step: the batch's rows / N (class docstring)

    def largest_sampling_probability(self, num_examples: int | None) -> float | None:
        """``min(1, largest_batch / N)``, the largest ``q`` a step can be accounted at; None where either is unknown."""
        if num_examples is None or self.largest_batch is None:
            return None
        return min(1.0, self.largest_batch / num_examples)

    def declared(self, units: bool = False) -> composition.Sampling:
        """What ``composition`` checks of this sampling: not Poisson (``units``: the batches carry unit ids)."""
        return composition.Sampling(poisson=False, scheme=self.scheme, units=units)


# --------------------------------------------------------------------------
# Argument checking
# --------------------------------------------------------------------------


def _sampling_key(seed: int | None) -> tf.Tensor:
    """``[2]`` int64 key of the sampling stream: hashed from ``seed``, or from OS entropy."""
    if seed is None:
        return tf.constant(hashed_key(np.random.SeedSequence().entropy), tf.int64)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be None or a non-negative integer; got {seed!r}.")
    return tf.constant(hashed_key(seed), tf.int64)


# --------------------------------------------------------------------------
# Default padded size: an upper quantile of Binomial(N, q)
# --------------------------------------------------------------------------


def default_max_batch_size(
    num_examples: int,
    sampling_probability: float,
    overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
) -> int:
    """Smallest ``M`` with ``P(Binomial(N, q) > M) <= overflow_probability``.

    Computed from the exact binomial probabilities (not a normal
    approximation, which is far too optimistic when ``q * N`` is small).
    The result is at least 1 and at most ``N``.

    Args:
      num_examples: ``N``, the dataset size.
      sampling_probability: ``q`` in ``(0, 1]``.
      overflow_probability: the tolerated per-step chance that a Poisson
        batch is larger than ``M``; in ``(0, 1)``.

    Returns:
      ``M``, a Python int.

    Examples:
      >>> default_max_batch_size(60_000, 256 / 60_000)
      376
    """
    n = check_positive_int("num_examples", num_examples)
    q = check_sampling_probability(sampling_probability)
    if not (0.0 < overflow_probability < 1.0):
        raise ValueError(f"overflow_probability must be in (0, 1); got {overflow_probability}.")
    if q == 1.0:
        return n
    mean = n * q
    std = math.sqrt(n * q * (1.0 - q))
    start = min(n, int(math.floor(mean)))
    # Beyond start + 40 std + 40 the binomial tail is far below 1e-25 (by
    # Bernstein's inequality), so truncating the sum there changes nothing.
    stop = min(n, start + int(math.ceil(40.0 * std)) + 40)
    ks = np.arange(start, stop + 1, dtype=np.float64)
    log_pmf_start = (
        math.lgamma(n + 1)
        - math.lgamma(start + 1)
        - math.lgamma(n - start + 1)
        + start * math.log(q)
        + (n - start) * math.log1p(-q)
    )
    # log pmf(k+1) - log pmf(k) = log((n-k)/(k+1)) + log(q/(1-q))
    steps = np.log(n - ks[:-1]) - np.log(ks[:-1] + 1.0) + (math.log(q) - math.log1p(-q))
    pmf = np.exp(log_pmf_start + np.concatenate([[0.0], np.cumsum(steps)]))
    # survival[i] = P(B > ks[i]), summed from the small end for accuracy.
    survival = np.concatenate([np.cumsum(pmf[::-1])[::-1][1:], [0.0]])
    first_ok = int(np.argmax(survival <= overflow_probability))
    return max(1, min(n, int(ks[first_ok])))


# --------------------------------------------------------------------------
# Poisson batches
# --------------------------------------------------------------------------


# Folded into the sampling key for the partition of cyclic Poisson sampling,
# so that it shares no key with any step's draw.
_PARTITION_TAG = 0x7061727473  # "parts"
# Folded into a step's key for the rows a unit brings (unit-level sampling).
_ROWS_TAG = 0x726F7773  # "rows"


def _rows_digest(*trees: Any) -> np.ndarray:
    """``int64 [2]``: a digest of every leaf of ``trees`` (shapes, dtypes and values, in row order)."""
    digest = hashlib.blake2b(digest_size=16)
    for leaf in tf.nest.flatten(trees):
        values = np.ascontiguousarray(leaf.numpy() if tf.is_tensor(leaf) else leaf)
        digest.update(f"{values.dtype.str}{values.shape}".encode())
        if values.dtype == object:  # strings
            for item in values.reshape(-1):
                digest.update(len(item).to_bytes(8, "little") + bytes(item))
        else:
            digest.update(values.view(np.uint8).reshape(-1))
    return np.frombuffer(digest.digest(), np.int64).copy()


def _partition(n: int, cycle: int, key: tf.Tensor, *rows: Any) -> dict:
    """``PoissonSampling``'s ``partition_key``, ``parts`` and ``rows_digest`` for ``n`` examples (units); all None for 1.

    ``rows``: the data (and unit ids) whose order fixes which example each
    part entry belongs to.
    """
    if cycle == 1:
        return {}
    with tf.init_scope():
        partition_key = tf.random.experimental.stateless_fold_in(key, _PARTITION_TAG).numpy()
        parts = tf.Variable(_cyclic_parts(n, cycle, partition_key), trainable=False, name="parts")
    return {"partition_key": partition_key, "parts": parts, "rows_digest": _rows_digest(*rows)}


def _cyclic_parts(n: int, cycle: int, partition_key: np.ndarray) -> tf.Tensor:
    """``[n]`` int64 part of every example (unit): each drawn independently and uniformly from ``0 .. cycle - 1``.

    Independent, not an equal split: adding or removing one example then
    leaves every other example's part as it was (``poisson_batches``, Cyclic
    Poisson sampling, for why that matters).
    """
    return tf.random.stateless_uniform([n], seed=partition_key, minval=0, maxval=cycle, dtype=tf.int64)


def sampled_inputs(x: Any, y: Any) -> tuple[dict, int]:
    """``({"x": x[, "y": y]}, N)``: a sampler's rows as tensors, every leaf ``[N, ...]`` with one ``N >= 1``.

    Raises ``TypeError`` / ``ValueError`` naming ``x`` or ``y``.
    """
    inputs = {"x": _to_tensors("x", x)}
    if y is not None:
        inputs["y"] = _to_tensors("y", y)
    _check_leading_dims(inputs)
    n = tf.nest.flatten(inputs["x"])[0].shape[0]
    if n is None or n == 0:
        raise ValueError(f"x must hold at least one example (leading dimension N >= 1); got N={n}.")
    return inputs, n


def _steps_and_key(steps: int | None, cycle: int, q: float, seed: int | None, first_step: Any) -> tuple[int, tf.Tensor]:
    """``(steps, key)`` of a Poisson sampler: ``steps`` checked (default one pass, ``round(cycle / q)``), the seed's key.

    Raises ``ValueError`` for a ``first_step`` that is not a non-negative integer.
    """
    if steps is None:
        steps = max(1, int(math.floor(cycle / q + 0.5)))
    steps = check_positive_int("steps", steps)
    key = _sampling_key(seed)
    if isinstance(first_step, bool) or not isinstance(first_step, (int, np.integer)) or first_step < 0:
        raise ValueError(f"first_step must be a non-negative integer; got {first_step!r}.")
    return steps, key


def _padded_batch(inputs: dict, chosen: tf.Tensor, m: int, what: str, overflow_message: str) -> tuple:
    """``(x, y, mask, b)``: the rows ``chosen`` (``[b]`` indices) of ``inputs["x"]``/``["y"]`` padded to ``m`` rows.

    ``mask`` is ``[m]`` float32, 1 for the ``b`` real rows; ``y`` is None when
    ``inputs`` has none. A batch of more than ``m`` rows fails with ``what``
    and ``overflow_message`` (``tf.debugging.Assert``).
    """
    b = tf.size(chosen)
    check = tf.debugging.Assert(b <= m, [what, b, overflow_message])
    with tf.control_dependencies([check]):
        b = tf.identity(b)

    def take(leaf):
        rows = _pad_rows(tf.gather(leaf, chosen), b, m)
        return tf.ensure_shape(rows, [m] + leaf.shape[1:].as_list())

    # tf.data reads a list a map function returns as one stacked tensor: lists become tuples.
    xb = _lists_as_tuples(tf.nest.map_structure(take, inputs["x"]))
    yb = _lists_as_tuples(tf.nest.map_structure(take, inputs["y"])) if "y" in inputs else None
    return xb, yb, tf.cast(tf.range(m) < b, tf.float32), b


def _step_batches(sample, steps: int, sampling: PoissonSampling) -> tf.data.Dataset:
    """The dataset of ``steps`` batches a pass: ``sample(t)`` for the step indices ``t`` the pass claims.

    A pass claims its indices at its start, all at once (``sampling.next_step``
    advances by ``steps``): how far a prefetching iterator ran ahead cannot
    change the next pass. They are then produced one by one, so a pass of
    billions of steps (a tiny ``q``) is never held whole. No function here
    is AutoGraph-converted: none has Python control flow on tensors, so
    converting them would only add to the first call's time in a process.
    """
    unconverted = tf.autograph.experimental.do_not_convert
    next_step = sampling.next_step

    def pass_start(_):
        return next_step.assign_add(steps) - steps

    def pass_steps(start):
        return tf.data.Dataset.range(steps).map(unconverted(lambda i: start + i))

    ds = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).map(unconverted(pass_start))
    ds = ds.flat_map(unconverted(pass_steps))
    ds = ds.apply(tf.data.experimental.assert_cardinality(steps))
    ds = ds.map(unconverted(sample), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    ds.pegrad_sampling = sampling
    return ds


def _pad_rows(rows: tf.Tensor, num_rows: tf.Tensor, target: Any) -> tf.Tensor:
    """``rows [num_rows, ...]`` -> ``[target, ...]`` with zero rows appended."""
    paddings = tf.concat([[[0, target - num_rows]], tf.zeros([tf.rank(rows) - 1, 2], tf.int32)], axis=0)
    return tf.pad(rows, paddings)


def poisson_batches(
    x: Any,
    y: Any = None,
    *,
    sampling_probability: float,
    max_batch_size: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    first_step: int = 0,
    cycle_length: int = 1,
    unit_ids: Any = None,
    rows_per_unit: int | None = None,
) -> tf.data.Dataset:
    """A dataset of ``steps`` Poisson-sampled batches, each padded to ``M`` rows.

    At every step each example ``i`` in ``0 .. N-1`` is included
    independently with probability ``q = sampling_probability``.

    **Cyclic Poisson sampling** (``cycle_length = b > 1``, for the
    correlated-noise mechanisms of ``per_example_grads.dp.mechanisms``): every
    example is assigned once to one of ``b`` parts, each example's part drawn
    independently and uniformly (from ``seed``, never from the data), and
    step ``t`` Poisson-samples, at rate ``q``, only part ``t mod b``. An
    example can then join a batch only every ``b`` steps, at most
    ``ceil(T / b)`` times in ``T`` steps, which is what the accounting of
    ``BandMF`` and ``BLT`` relies on. The expected batch size is ``q N / b``
    (parts have ``N / b`` examples on average, not exactly).

    The guarantee, for **add/remove-one** neighbours (``D' = D + z``):
    adding ``z`` leaves the law of every other example's part unchanged,
    because parts are drawn independently per example. Conditioned on
    ``z``'s part ``p`` and on all the others', the run is the mechanism with
    ``z`` taking part only in the steps of ``p``, which the accounting bounds
    for every ``p``; the release under ``D'`` is the mixture over ``p``, and
    the hockey-stick divergence is jointly convex, so the bound holds for the
    mixture, both ways. An equal split (``N / b`` examples per part, from a
    permutation) is not sound for add/remove: adding ``z`` moves *other*
    examples into other parts, and on small ``N`` the exact ``delta`` of such
    a pair exceeds the accounted one several times over
    (``tests/test_dp_sampling_partition.py``); jax_privacy allows its equal
    split only for zero-out and replace-one adjacency. A run must keep its
    partition: ``DPModel`` saves it in its ledger and gives it
    to every later dataset of the run, or refuses one of other rows
    (``PoissonSampling.partition``).

    Each element is ``(x_batch, y_batch, mask)``:

    * ``x_batch``: structure of ``x``, leaves ``[M, ...]``;
    * ``y_batch``: structure of ``y``, leaves ``[M, ...]``, or ``None``
      if ``y`` is ``None``;
    * ``mask``: ``float32 [M]``; ``1.0`` on rows ``0 .. b-1`` (the ``b``
      sampled examples, in increasing index order), ``0.0`` after.

    Padded rows are exactly zero. All elements have the same static shapes,
    so a ``tf.function`` taking them traces once. The element layout is the
    Keras ``(x, y, sample_weight)`` one, with the mask as the sample weight.

    Padding costs compute: every batch has ``M`` rows, about
    ``q N + 7.5 sqrt(q N)`` for the default ``M`` (126 rows for an expected 64,
    375 for an expected 256 at ``N = 12,000``), and the padded rows are
    computed and then weighted 0. Pass ``max_batch_size`` to trade a higher
    overflow probability for less padding.

    Randomness: batch ``t`` (counted over all passes, from ``first_step``)
    is drawn from a key derived from ``seed`` by hashing, folded with ``t``:
    each pass over the dataset (each ``iter(...)``, e.g. each Keras epoch)
    continues with fresh, independent batches, as Poisson sampling requires;
    different seeds give unrelated batches; the global TensorFlow seed plays
    no part. Two datasets built with the same ``seed`` and ``first_step``
    produce the same sequence of batches, so a run restored after ``k`` steps
    continues with ``first_step=k`` instead of replaying its first batches
    (``DPModel.fit`` does this by itself, through the dataset's
    ``pegrad_sampling`` attribute, a ``PoissonSampling``). Iterate one pass at
    a time: concurrent iterators over one dataset share its step counter.

    The arrays are held in memory and gathered from with ``tf.gather``.

    **Unit-level sampling** (``unit_ids`` given, for user-level DP): the
    rows belong to ``U`` privacy units (users, say), row ``i`` to unit
    ``unit_ids[i]``, and at every step each *unit* joins independently with
    probability ``q`` (in part ``t mod b`` only, with ``cycle_length = b``:
    each unit is assigned a part, never its rows). A sampled unit
    brings its rows, at most ``k = rows_per_unit`` of them: a unit with more
    than ``k`` rows brings ``k`` of them drawn uniformly without replacement,
    afresh at every step (from the sampling key; so over a run every row of
    it is used), the others all their rows. Which rows a unit brings depends
    only on that unit's rows and the seed, and what the step computes from
    them is clipped per unit, so the per-step guarantee is that of the
    Poisson-subsampled Gaussian over the ``U`` units, whatever rows were
    chosen (the choice is randomness independent of the other units, and the
    hockey-stick divergence is jointly convex over it). The elements are then
    ``(x_batch, y_batch, mask, batch_unit_ids)``: the rows of one unit are
    consecutive (units in increasing id order), ``batch_unit_ids`` is
    ``int64 [M]``, each real row's unit id (as given), ``-1`` on padding.
    ``M`` defaults to the rows of the ``m`` largest units (each counted at
    most ``k`` rows), ``m = default_max_batch_size(U, q / b)``: more
    than ``M`` rows needs more than ``m`` units, which happens with
    probability at most 1e-12 per step. ``steps`` defaults to ``round(b / q)``
    (each unit seen once per pass in expectation). ``pegrad_sampling`` then
    has ``privacy_unit="unit"`` and ``num_examples = U``: the epsilon of a
    ``DPModel(privacy_unit="unit")`` trained on it is per unit.

    Args:
      x: array, tensor, or nested structure (dict, tuple, list) of them,
        every leaf ``[N, ...]`` with the same ``N >= 1``.
      y: ``None`` or the same kind of structure, leaves ``[N, ...]``.
      sampling_probability: ``q`` in ``(0, 1]``.
      max_batch_size: ``M``, the padded number of rows. Defaults to
        ``default_max_batch_size(N, q)`` (overflow chance at most 1e-12 per
        step). A step that samples more than ``M`` examples stops iteration
        with ``tf.errors.InvalidArgumentError`` naming ``max_batch_size``;
        examples are never dropped silently.
      steps: batches per pass. Defaults to ``round(1 / q)``, one epoch in
        expectation.
      seed: non-negative int for reproducible batches; ``None`` seeds from
        OS entropy.
      first_step: the global index of the first batch (see Randomness).
      cycle_length: ``b >= 1`` parts, ``b <= N`` (see Cyclic Poisson
        sampling). The default ``M`` and ``steps`` then follow a step's
        rate ``q / b``: ``default_max_batch_size(N, q / b)`` and
        ``round(b / q)`` (one epoch in expectation).
      unit_ids: None (each row is its own unit), or ``[N]`` integers, the
        privacy unit of every row (any integer values; rows of one unit need
        not be adjacent). Must be concrete (an array or eager tensor).
      rows_per_unit: with ``unit_ids``, the most rows a unit brings to a
        batch (``k >= 1``); None brings every row of every unit.

    Returns:
      A ``tf.data.Dataset`` of known cardinality ``steps``, with attribute
      ``pegrad_sampling`` (a ``PoissonSampling``).

    Raises:
      ValueError: ``sampling_probability`` outside ``(0, 1]``, mismatched
        leading dimensions, ``N == 0``, or a non-positive ``steps`` /
        ``max_batch_size``.
      TypeError: non-numeric inputs or arguments of the wrong type.

    Examples:
      >>> import numpy as np
      >>> x = {"ids": np.arange(20)[:, None]}
      >>> ds = poisson_batches(x, sampling_probability=0.5, max_batch_size=20, seed=1)
      >>> for xb, yb, mask in ds.take(1):
      ...     print(xb["ids"].shape, yb, mask.shape, mask.dtype.name)
      (20, 1) None (20,) float32

    Units (three users with 1, 2 and 3 rows; at most 2 rows each per batch):
      >>> ds = poisson_batches(np.arange(6.0)[:, None], unit_ids=[7, 8, 8, 9, 9, 9],
      ...                      rows_per_unit=2, sampling_probability=1.0, seed=0)
      >>> xb, yb, mask, ids = next(iter(ds))
      >>> ids.numpy().tolist(), mask.numpy().tolist()
      ([7, 8, 8, 9, 9], [1.0, 1.0, 1.0, 1.0, 1.0])
      >>> ds.pegrad_sampling.num_examples, ds.pegrad_sampling.privacy_unit
      (3, 'unit')
    """
    if unit_ids is None and rows_per_unit is not None:
        raise ValueError(f"rows_per_unit={rows_per_unit!r} needs unit_ids: without them every row is its own unit.")
    q = check_sampling_probability(sampling_probability)
    inputs, n = sampled_inputs(x, y)
    cycle = check_positive_int("cycle_length", cycle_length)
    if unit_ids is not None:
        return _unit_batches(
            inputs, n, q, _check_unit_ids(unit_ids, n), rows_per_unit, max_batch_size, steps, seed, first_step, cycle
        )
    if cycle > n:
        raise ValueError(f"cycle_length ({cycle}) must be at most the number of examples N={n}: every part needs one.")
    if max_batch_size is None:  # a step's batch is Binomial(N, q / b), the partition drawn too
        max_batch_size = default_max_batch_size(n, q / cycle)
    m = check_positive_int("max_batch_size", max_batch_size)
    steps, key = _steps_and_key(steps, cycle, q, seed, first_step)
    with tf.init_scope():
        next_step = tf.Variable(int(first_step), dtype=tf.int64, trainable=False, name="next_step")
    sampling = PoissonSampling(q, n, m, steps, next_step, cycle, **_partition(n, cycle, key, inputs))
    parts = sampling.parts
    overflow_message = (
        f"examples, more than max_batch_size={m} (N={n}, sampling_probability={q}"
        f"{f', cycle_length={cycle}' if cycle > 1 else ''}). "
        f"Dropping the extra examples would invalidate the privacy analysis; pass a "
        f"larger max_batch_size (default_max_batch_size(N, q) overflows with "
        f"probability <= {DEFAULT_OVERFLOW_PROBABILITY:g} per step)."
    )

    def sample(step):
        step_seed = tf.random.experimental.stateless_fold_in(key, step)
        u = tf.random.stateless_uniform([n], seed=step_seed, dtype=tf.float64)
        eligible = u < q
        if parts is not None:
            eligible &= tf.equal(parts, step % cycle)
        chosen = tf.where(eligible)[:, 0]  # sorted example indices
        xb, yb, mask, _ = _padded_batch(inputs, chosen, m, "A Poisson batch sampled", overflow_message)
        return xb, yb, mask

    return _step_batches(sample, steps, sampling)


def _check_unit_ids(unit_ids: Any, n: int) -> np.ndarray:
    """``unit_ids`` as an ``int64 [N]`` NumPy array, or an error naming it."""
    if tf.is_tensor(unit_ids) and not hasattr(unit_ids, "numpy"):
        raise TypeError("unit_ids must be concrete (a NumPy array, list or eager tensor), not a symbolic tensor.")
    ids = np.asarray(unit_ids.numpy() if tf.is_tensor(unit_ids) else unit_ids)
    if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"unit_ids must be integers, one per row; got dtype {ids.dtype}.")
    if ids.shape != (n,):
        raise ValueError(
            f"unit_ids must have shape [N] = [{n}] (one unit id per row of x); got shape {list(ids.shape)}."
        )
    return ids.astype(np.int64)


def _unit_batches(inputs, n, q, ids, rows_per_unit, max_batch_size, steps, seed, first_step, cycle):
    """``poisson_batches`` with ``unit_ids``: units Poisson-sampled, each bringing at most ``k`` rows (its docstring)."""
    units, unit_of_row = np.unique(ids, return_inverse=True)  # dense unit index of every row
    u = len(units)
    sizes = np.bincount(unit_of_row, minlength=u)
    k = (
        int(sizes.max())
        if rows_per_unit is None
        else min(check_positive_int("rows_per_unit", rows_per_unit), int(sizes.max()))
    )
    if cycle > u:
        raise ValueError(f"cycle_length ({cycle}) must be at most the number of units U={u}: every part needs one.")
    brought = np.minimum(sizes, k)  # rows each unit brings when sampled
    if max_batch_size is None:  # a step samples Binomial(U, q / b) units, the partition drawn too
        most_units = default_max_batch_size(u, q / cycle)
        max_batch_size = int(np.sort(brought)[::-1][:most_units].sum())
    m = check_positive_int("max_batch_size", max_batch_size)
    steps, key = _steps_and_key(steps, cycle, q, seed, first_step)
    by_unit = np.argsort(unit_of_row, kind="stable")  # rows grouped by unit, in row order within one
    unit_sorted = unit_of_row[by_unit]
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # first position of each unit in by_unit
    select = k < int(sizes.max())
    with tf.init_scope():
        next_step = tf.Variable(int(first_step), dtype=tf.int64, trainable=False, name="next_step")
        by_unit_t = tf.constant(by_unit, tf.int64)
        unit_sorted_t = tf.constant(unit_sorted, tf.int64)
        start_t = tf.constant(start, tf.int64)
        ids_t = tf.constant(ids, tf.int64)
    sampling = PoissonSampling(q, u, m, steps, next_step, cycle, "unit", n, k, **_partition(u, cycle, key, inputs, ids))
    parts = sampling.parts
    overflow_message = (
        f"rows, more than max_batch_size={m} (U={u} units, sampling_probability={q}, rows_per_unit={k}"
        f"{f', cycle_length={cycle}' if cycle > 1 else ''}). Dropping rows would invalidate the privacy "
        f"analysis; pass a larger max_batch_size (the default overflows with probability <= "
        f"{DEFAULT_OVERFLOW_PROBABILITY:g} per step)."
    )

    def sample(step):
        step_seed = tf.random.experimental.stateless_fold_in(key, step)
        unit_in = tf.random.stateless_uniform([u], seed=step_seed, dtype=tf.float64) < q  # [U]
        if parts is not None:
            unit_in &= tf.equal(parts, step % cycle)
        order = tf.range(n, dtype=tf.int64)  # positions in by_unit
        if select:  # k random rows of each larger unit: rank the unit's rows by a fresh uniform key
            row_seed = tf.random.experimental.stateless_fold_in(step_seed, _ROWS_TAG)
            keys = tf.random.stateless_uniform([n], seed=row_seed, dtype=tf.float64)
            order = tf.argsort(tf.cast(unit_sorted_t, tf.float64) + keys, stable=True)  # still grouped by unit
            order = tf.cast(order, tf.int64)
            rank = tf.range(n, dtype=tf.int64) - tf.gather(start_t, tf.gather(unit_sorted_t, order))
            keep = (rank < k) & tf.gather(unit_in, tf.gather(unit_sorted_t, order))
        else:
            keep = tf.gather(unit_in, unit_sorted_t)
        chosen = tf.gather(by_unit_t, tf.boolean_mask(order, keep))  # row indices, grouped by unit
        xb, yb, mask, b = _padded_batch(inputs, chosen, m, "A Poisson batch of units sampled", overflow_message)
        batch_ids = tf.ensure_shape(tf.concat([tf.gather(ids_t, chosen), -tf.ones([m - b], tf.int64)], axis=0), [m])
        return xb, yb, mask, batch_ids

    return _step_batches(sample, steps, sampling)


def _lists_as_tuples(tree: Any) -> Any:
    if isinstance(tree, list):
        return tuple(_lists_as_tuples(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _lists_as_tuples(v) for k, v in tree.items()}
    return tree


def _unpack_element(element: Any) -> tuple[Any, Any]:
    """Keras convention: ``(x, y)``, ``(x,)`` or a bare ``x``."""
    if isinstance(element, tuple) and not hasattr(element, "_fields"):
        if len(element) == 1:
            return element[0], None
        if len(element) == 2:
            return element
        raise ValueError(
            f"dataset elements must be (x, y), (x,) or x; got a tuple of {len(element)}. "
            "Per-example sample weights are not supported: the padding mask is the "
            "sample weight of a Poisson batch."
        )
    return element, None


def poisson_batches_from_dataset(
    dataset: tf.data.Dataset,
    num_examples: int | None = None,
    *,
    sampling_probability: float,
    max_batch_size: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    progress: bool = False,
    unit_ids: str | Callable[..., Any] | None = None,
    rows_per_unit: int | None = None,
    cycle_length: int = 1,
    first_step: int = 0,
) -> tf.data.Dataset:
    """``poisson_batches`` for a finite dataset of single (unbatched) examples.

    The dataset is read once and its examples stacked into arrays in memory
    (with a ``tqdm`` progress bar if ``progress``), then sampled exactly as
    ``poisson_batches`` does, with the same element structure and fixed
    shapes. Streaming alternatives were rejected: a per-element Bernoulli
    filter must read all ``N`` examples for every step, that is ``N / q``
    reads per epoch. Data that does not fit in memory needs an indexable
    store (gather by index) instead.

    Elements follow the Keras convention: ``(x, y)``, ``(x,)`` or a bare
    ``x`` (a dict or a single tensor); multi-input ``x`` must be nested,
    e.g. ``((x1, x2), y)``. All examples must have the same shapes.

    **Units** (``unit_ids`` given, for user-level DP): each element's unit
    id is read *from the element itself*, as it is read, so ids and rows
    cannot fall out of step (an array of ids beside a dataset could: a
    shuffled dataset reorders on every pass, and that cannot be checked,
    so an array is refused). ``unit_ids`` is the name of a feature of a
    dict ``x`` (that feature is taken out of ``x``: the model does not see
    it), or a function of an element, called as ``Dataset.map`` calls one
    (a tuple element's parts as positional arguments), returning a scalar
    integer. The rows are then sampled exactly as ``poisson_batches(x, y,
    unit_ids=ids, rows_per_unit=rows_per_unit)`` samples them: units
    Poisson-sampled, at most ``rows_per_unit`` rows each, elements
    ``(x_batch, y_batch, mask, batch_unit_ids)``, ``pegrad_sampling`` over
    the ``U`` units. ``num_examples`` still counts rows (elements).

    Args:
      dataset: a finite ``tf.data.Dataset`` of single examples.
      num_examples: ``N``, if known. When given, the dataset must hold
        exactly ``N`` examples (checked; at most ``N + 1`` are read, so an
        accidentally repeated dataset fails fast).
      sampling_probability, max_batch_size, steps, seed, cycle_length,
        first_step: as in ``poisson_batches`` (``cycle_length``: cyclic
        Poisson sampling, for correlated noise; the partition follows the
        order the dataset gives its examples, so a dataset that reshuffles
        on every pass gives another partition each time it is read, which
        a ``DPModel`` run then refuses).
      progress: show a progress bar while reading the dataset.
      unit_ids: None (each row is its own unit), a feature name of a dict
        ``x``, or a function of an element giving its scalar integer unit
        id (see Units).
      rows_per_unit: with ``unit_ids``, as in ``poisson_batches``.

    Returns:
      A ``tf.data.Dataset`` of ``(x_batch, y_batch, mask)`` (with
      ``unit_ids``: ``(x_batch, y_batch, mask, batch_unit_ids)``), as in
      ``poisson_batches``.

    Raises:
      ValueError: an infinite or repeated dataset, a count different from
        ``num_examples``, an empty dataset, elements that are 3-tuples, a
        ``unit_ids`` feature that ``x`` does not have, a ``unit_ids`` that
        is not one scalar per element, or any error ``poisson_batches`` raises.
      TypeError: ``unit_ids`` an array, or giving non-integer ids.

    Examples:
      >>> import numpy as np
      >>> ds = tf.data.Dataset.from_tensor_slices((np.ones([50, 3], "float32"), np.arange(50)))
      >>> batches = poisson_batches_from_dataset(ds, 50, sampling_probability=0.2, seed=0)
      >>> xb, yb, mask = next(iter(batches))
      >>> xb.shape[1:], yb.shape == mask.shape
      (TensorShape([3]), True)
    """
    check_sampling_probability(sampling_probability)
    if unit_ids is None and rows_per_unit is not None:
        raise ValueError(f"rows_per_unit={rows_per_unit!r} needs unit_ids: without them every row is its own unit.")
    x, y, ids = read_examples(dataset, num_examples, progress=progress, unit_ids=unit_ids)
    return poisson_batches(
        x,
        y,
        sampling_probability=sampling_probability,
        max_batch_size=max_batch_size,
        steps=steps,
        seed=seed,
        unit_ids=ids,
        rows_per_unit=rows_per_unit,
        cycle_length=cycle_length,
        first_step=first_step,
    )


def read_examples(
    dataset: tf.data.Dataset, num_examples: int | None = None, *, progress: bool = False, unit_ids: Any = None
) -> tuple[Any, Any, np.ndarray | None]:
    """``(x, y, ids)``: a finite dataset of single examples read once and stacked into arrays (leaves ``[N, ...]``).

    The reading ``poisson_batches_from_dataset`` documents (its checks and
    errors; ``ids`` the unit ids read from each element, or None without
    ``unit_ids``).
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"dataset must be a tf.data.Dataset; got {type(dataset).__name__}.")
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError("dataset is infinite; Poisson sampling needs a finite set of N examples.")
    if repeats(dataset):
        raise ValueError(
            "dataset repeats its elements (Dataset.repeat): every example would be read, and counted in N, once "
            "per repetition, so epsilon() would be computed for a larger N than the data has. Give the dataset "
            "without repeat: Poisson sampling makes its own passes over it."
        )
    limit = None
    if num_examples is not None:
        num_examples = check_positive_int("num_examples", num_examples)
        if cardinality >= 0 and cardinality != num_examples:
            raise ValueError(f"num_examples={num_examples} but the dataset has {cardinality} elements.")
        limit = num_examples + 1
    with_ids = unit_ids is not None
    if with_ids:
        dataset = _with_unit_ids(dataset, unit_ids)  # elements (element, id)
    x_spec, y_spec = _unpack_element(dataset.element_spec[0] if with_ids else dataset.element_spec)
    source = dataset if limit is None else dataset.take(limit)
    id_parts: list[np.ndarray] = []
    x_parts: list[list[np.ndarray]] = [[] for _ in tf.nest.flatten(x_spec)]
    y_parts: list[list[np.ndarray]] = [[] for _ in tf.nest.flatten(y_spec)]
    total = None if cardinality < 0 else cardinality
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="Reading examples", unit="ex")
    count = 0
    try:
        for chunk in source.batch(4096):
            if with_ids:
                chunk, ids = chunk
                id_parts.append(np.asarray(ids))
            xc, yc = _unpack_element(chunk)
            for parts, leaf in zip(x_parts, tf.nest.flatten(xc)):
                parts.append(np.asarray(leaf))
            for parts, leaf in zip(y_parts, tf.nest.flatten(yc)):
                parts.append(np.asarray(leaf))
            got = int(tf.nest.flatten(xc)[0].shape[0])
            count += got
            if bar is not None:
                bar.update(got)
    except tf.errors.InvalidArgumentError as e:
        raise ValueError(
            f"Could not stack the dataset's examples; they must all have the same shapes. ({e.message})"
        ) from None
    finally:
        if bar is not None:
            bar.close()
    if num_examples is not None and count != num_examples:
        raise ValueError(
            f"num_examples={num_examples} but the dataset has {'more' if count > num_examples else count} elements."
        )
    if count == 0:
        raise ValueError("dataset is empty; Poisson sampling needs at least one example.")
    x = tf.nest.pack_sequence_as(x_spec, [np.concatenate(p) for p in x_parts])
    y = None if y_spec is None else tf.nest.pack_sequence_as(y_spec, [np.concatenate(p) for p in y_parts])
    return x, y, (np.concatenate(id_parts) if with_ids else None)


def _with_unit_ids(dataset: tf.data.Dataset, unit_ids: Any) -> tf.data.Dataset:
    """``dataset``'s elements as ``(element, id)``, the id read from each element (``poisson_batches_from_dataset``)."""
    spec = dataset.element_spec
    if isinstance(unit_ids, str):
        x_spec, y_spec = _unpack_element(spec)
        if not isinstance(x_spec, dict) or unit_ids not in x_spec:
            have = sorted(x_spec) if isinstance(x_spec, dict) else f"not a dict ({type(x_spec).__name__})"
            raise ValueError(f"unit_ids={unit_ids!r} names no feature of the dataset's x; its features: {have}.")

        def split(*element):
            x, y = _unpack_element(element[0] if len(element) == 1 else element)
            x = dict(x)
            ids = x.pop(unit_ids)
            return (x if y_spec is None else (x, y)), ids

    elif callable(unit_ids):

        def split(*element):
            return (element[0] if len(element) == 1 else element), unit_ids(*element)

    else:
        raise TypeError(
            f"unit_ids must be a feature name of x or a function of an element, read from each element as it is "
            f"read; got {type(unit_ids).__name__}. An array of ids beside a dataset cannot be checked to follow "
            "its order (a shuffled dataset reorders on every pass)."
        )
    out = dataset.map(split)
    id_spec = out.element_spec[1]
    if not isinstance(id_spec, tf.TensorSpec) or not id_spec.dtype.is_integer or id_spec.dtype == tf.bool:
        raise TypeError(f"unit_ids must give each element one integer id; got {id_spec}.")
    if id_spec.shape.rank != 0:
        raise ValueError(f"unit_ids must give each element one scalar id (shape []); got shape {id_spec.shape}.")
    return out


# --------------------------------------------------------------------------
# Physical chunks
# --------------------------------------------------------------------------


def real_rows(mask: tf.Tensor) -> tf.Tensor:
    """``[b]`` int64 indices of the rows with a non-zero mask value, in order."""
    return tf.where(tf.not_equal(mask, 0))[:, 0]


def split_into_chunks(tree: Any, p: int):
    """Every ``[n, ...]`` leaf of ``tree`` as ``[C, P, ...]`` (zero-padded), ``C = max(1, ceil(n / P))``.

    Works eagerly, in graphs and under XLA (static ``n`` gives static
    shapes). Returns ``(stacked tree, C)``.
    """
    n = tf.shape(tf.nest.flatten(tree)[0])[0]
    num_chunks = tf.maximum(1, (n + p - 1) // p)

    def split(leaf):
        padded = _pad_rows(leaf, n, num_chunks * p)
        stacked = tf.reshape(padded, tf.concat([[num_chunks, p], tf.shape(leaf)[1:]], axis=0))
        stacked.set_shape(tf.TensorShape([None, p]).concatenate(leaf.shape[1:]))
        return stacked

    return tf.nest.map_structure(split, tree), num_chunks


def _stack_chunks(x: Any, y: Any, mask: tf.Tensor, p: int):
    """Real rows of one logical batch as ``[C, P, ...]`` stacks, ``C >= 1``.

    Works eagerly and in graphs. Returns ``(x_stack, y_stack, mask_stack
    [C, P], is_last [C], C)``.
    """
    keep = real_rows(mask)
    tree = {"x": x, "mask": mask} | ({} if y is None else {"y": y})
    stacks, num_chunks = split_into_chunks(tf.nest.map_structure(lambda t: tf.gather(t, keep), tree), p)
    is_last = tf.equal(tf.range(num_chunks), num_chunks - 1)
    return stacks["x"], stacks.get("y"), stacks["mask"], is_last, num_chunks


def _check_chunk_inputs(x: Any, y: Any, mask: Any, physical_batch_size: Any):
    p = check_positive_int("physical_batch_size", physical_batch_size)
    mask = tf.convert_to_tensor(mask)
    if mask.shape.rank != 1:
        raise ValueError(f"mask must have shape [M]; got shape {mask.shape}.")
    mask = tf.cast(mask, tf.float32)
    xs = _to_tensors("x", x)
    ys = None if y is None else _to_tensors("y", y)
    for name, tree in (("x", xs), ("y", ys)):
        for leaf in [] if tree is None else tf.nest.flatten(tree):
            if leaf.shape[0] != mask.shape[0]:
                raise ValueError(
                    f"{name} and mask must share the leading dimension M: mask has "
                    f"M={mask.shape[0]} but {name} has a leaf of shape {leaf.shape}."
                )
    return xs, ys, mask, p


def physical_chunks(x_batch: Any, y_batch: Any, mask: Any, physical_batch_size: int) -> Iterator[PhysicalChunk]:
    """Splits one padded logical batch into fixed-shape chunks (eager only).

    Takes the rows where ``mask != 0`` (``b`` of them, in order) and yields
    ``max(1, ceil(b / P))`` ``PhysicalChunk(x, y, mask, is_last)`` with
    ``P = physical_batch_size``: ``x`` / ``y`` leaves ``[P, ...]``, ``mask``
    ``float32 [P]``, ``is_last`` a Python bool, ``True`` on the final chunk.
    Every real row appears in exactly one chunk; the last chunk is padded
    with zero rows and mask ``0``; an empty logical batch (all-zero mask)
    yields a single all-masked chunk. Mask values other than 1 are carried
    over unchanged.

    Every chunk has the same shapes, so a ``tf.function`` called per chunk
    traces once. The number of chunks depends on the mask's values, so this
    needs eager tensors or arrays; inside a ``tf.function`` use
    ``physical_chunks_dataset`` on the dataset instead.

    Args:
      x_batch: structure of ``[M, ...]`` leaves.
      y_batch: ``None`` or a structure of ``[M, ...]`` leaves.
      mask: ``[M]``, zero on padded rows.
      physical_batch_size: ``P >= 1``.

    Yields:
      ``PhysicalChunk`` tuples (tensors; ``y`` is ``None`` if ``y_batch`` is).

    Examples:
      >>> import numpy as np
      >>> x = np.arange(6, dtype="float32")[:, None]
      >>> mask = np.array([1, 1, 1, 0, 0, 0], "float32")
      >>> [(c.x[:, 0].numpy().tolist(), c.is_last) for c in physical_chunks(x, None, mask, 2)]
      [([0.0, 1.0], False), ([2.0, 0.0], True)]
    """
    if not tf.executing_eagerly():
        raise RuntimeError(
            "physical_chunks needs eager tensors (the number of chunks depends on the "
            "mask's values); inside tf.function use physical_chunks_dataset."
        )
    x, y, mask, p = _check_chunk_inputs(x_batch, y_batch, mask, physical_batch_size)
    xs, ys, ms, _, num_chunks = _stack_chunks(x, y, mask, p)
    num_chunks = int(num_chunks)
    for i in range(num_chunks):
        yield PhysicalChunk(
            x=tf.nest.map_structure(lambda t: t[i], xs),
            y=None if ys is None else tf.nest.map_structure(lambda t: t[i], ys),
            mask=ms[i],
            is_last=i == num_chunks - 1,
        )


def physical_chunks_dataset(dataset: tf.data.Dataset, physical_batch_size: int) -> tf.data.Dataset:
    """``physical_chunks`` as a ``tf.data`` transformation.

    Turns a dataset of logical batches ``(x_batch, y_batch, mask)`` (as from
    ``poisson_batches``) into a flat dataset of ``PhysicalChunk(x, y, mask,
    is_last)`` with ``x`` / ``y`` leaves ``[P, ...]``, ``mask`` ``float32
    [P]`` and ``is_last`` a scalar ``tf.bool``. The chunks of one logical
    batch are consecutive and the last has ``is_last == True``; a training
    loop accumulates until then and applies one update per logical batch.
    The number of chunks per logical batch varies, so the cardinality is
    unknown, but shapes are fixed.

    Args:
      dataset: elements ``(x_batch, y_batch, mask)``; ``y_batch`` may be
        ``None``.
      physical_batch_size: ``P >= 1``.

    Returns:
      A ``tf.data.Dataset`` of ``PhysicalChunk``.

    Examples:
      >>> import numpy as np
      >>> logical = poisson_batches(np.arange(30.0)[:, None], sampling_probability=0.3, seed=0)
      >>> chunks = physical_chunks_dataset(logical, 4)
      >>> chunks.element_spec.x.shape, chunks.element_spec.is_last.dtype.name
      (TensorShape([4, 1]), 'bool')
    """
    p = check_positive_int("physical_batch_size", physical_batch_size)
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 3):
        raise ValueError(f"physical_chunks_dataset expects elements (x_batch, y_batch, mask); got element_spec {spec}.")
    mask_spec = spec[2]
    if not isinstance(mask_spec, tf.TensorSpec) or mask_spec.shape.rank != 1:
        raise ValueError(f"mask must be a [M] tensor; got {mask_spec}.")

    def to_chunks(x, y, mask):
        xs, ys, ms, is_last, _ = _stack_chunks(x, y, tf.cast(mask, tf.float32), p)
        if ys is None:
            # from_tensor_slices cannot slice a None component.
            return tf.data.Dataset.from_tensor_slices((xs, ms, is_last)).map(
                lambda cx, cm, last: PhysicalChunk(cx, None, cm, last)
            )
        return tf.data.Dataset.from_tensor_slices(PhysicalChunk(xs, ys, ms, is_last))

    return dataset.flat_map(to_chunks)
