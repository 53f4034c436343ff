"""``GradientAccumulator``: large logical batches from micro-batches, plain or private.

Micro-batches of any sizes are added into non-trainable ``tf.Variable`` sums,
so accumulation works eagerly, inside one ``tf.function`` and in a Keras
``train_step``, and the state checkpoints with ``tf.train.Checkpoint``.

- Plain mode: ``sum`` holds ``sum_i w_i grad loss_i`` and ``count`` holds
  ``sum_i w_i`` (``w_i = 1`` without sample weights), so ``result()`` is the
  full-batch gradient of the (weighted) mean loss, however the batch was split.
- DP mode (``l2_norm_clip`` given): ``sum`` holds the clipped per-example
  gradients' sum; ``result()`` adds ``N(0, (sigma C)^2)`` noise *once* and
  divides by ``expected_batch_size``, which is required: a divisor counted
  from the data (the realized Poisson batch size) would be revealed by the
  noise std. Adding noise per micro-batch instead would multiply the noise
  by ``sqrt(k)``. The step (clip, noise, count) is a
  ``per_example_grads.dp.DPAggregator``'s, as in ``DPModel``: each
  ``accumulate`` adds the aggregator's ``clipped_sum`` of a micro-batch, and
  each ``result()`` is one ``release`` of the total, with fresh noise,
  counted in ``steps``.

Both modes add the gradient of the model's weight regularizers (Keras adds
them to the loss it trains on; they do not depend on the data, so they need
neither clipping nor noise).

It lives in ``dp/`` because DP mode is a ``DPAggregator``'s step (the
layering points API <- dp); ``peg.GradientAccumulator`` is the same class,
and the old module path ``per_example_grads.accumulation`` still imports it
(deprecated).

For non-private training, Keras 3 optimizers already accumulate with
``gradient_accumulation_steps=k`` (they average ``k`` consecutive batches'
gradients and apply every k-th step); use that with ``fit``. This class is for
custom loops, for unequal micro-batches, and for DP, where clipping and noise
must follow per-example rules across the micro-batches.

Under ``tf.distribute`` (create the accumulator inside ``strategy.scope()``
and call ``accumulate``/``apply`` inside ``strategy.run``): the sums and the
count are sync-on-read variables, so each replica adds its own micro-batches
locally with no communication. ``result()`` on a replica returns its share
(its sums over the global count, plus ``1/sqrt(R)`` of the DP noise); the
optimizer's all-reduce in ``apply`` adds the shares (``P`` floats each). Read
in cross-replica code, ``sums`` and ``count`` are the totals over replicas.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from per_example_grads._core import replicas
from per_example_grads._core.arguments import check_choice, check_sampling_probability
from per_example_grads._core.batch import batch_size, make_batch, unless_empty
from per_example_grads._core.problem import make_problem
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.dp import composition
from per_example_grads.dp.accounting import PrivacyAccountant
from per_example_grads.dp.aggregator import ClippedSum, DPAggregator, add_regularization, regularization_gradients
from per_example_grads.dp.applied_steps import AppliedSteps
from per_example_grads.dp.budget import PrivacyBudget
from per_example_grads.dp.noise import NoiseSeed
from per_example_grads.dp.sparse_embeddings import SparseEmbeddings, check_sparse_embeddings
from per_example_grads.engines.selection import check_method


class GradientAccumulator(tf.Module):
    """Accumulates micro-batch gradients and applies them once.

    Args:
      model: a Keras model (or callable with ``variables``).
      loss_fn: per-example loss, as in ``per_example_gradients``.
      variables: defaults to ``model.trainable_variables``.
      l2_norm_clip: enables DP mode: each example's gradient is clipped to it.
      noise_multiplier: DP noise multiplier ``sigma`` (DP mode only).
      seed: noise source (see ``per_example_grads.dp.noise``); an int or pair
        is folded with the step counter, so every logical batch gets fresh noise.
      expected_batch_size: DP mode's divisor (``q N`` for Poisson sampling);
        required in DP mode.
      method: per-example engine for DP mode.
      mechanism: DP mode's ``peg.dp.NoiseMechanism`` (default independent
        noise, DP-SGD). With a correlated one (``BandMF``, ``BLT``) each
        ``result()`` adds the noise of the next step of its sequence; sample
        the logical batches as its accounting needs (``poisson_batches(...,
        cycle_length=mechanism.cycle_length)``) and account them with
        ``compute_epsilon(..., mechanism=...)`` (``epsilon()`` refuses: the
        accumulator cannot see that sampling).
      sampling_probability: DP mode: ``q``, the rate at which each logical
        batch was Poisson sampled (``peg.dp.poisson_batches``), recorded in
        the ledger with every release for ``epsilon()``. None (the default)
        claims no sampling: each release is accounted as if every example
        took part (``q = 1``), which holds however the batches were drawn,
        provided no example appears twice in one logical batch. Batches of
        ``truncated_poisson_batches`` are not Poisson samples at ``q`` (a cut
        batch doubles a step's sensitivity): give them ``DPModel.fit``, which
        accounts their own event, or leave ``sampling_probability`` out here.
      budget: DP mode: a ``peg.dp.PrivacyBudget``; ``result()`` (hence
        ``apply``) then releases nothing past ``max_steps()``, counted from
        the ledger (a restored one included), and fails with
        ``tf.errors.InvalidArgumentError`` naming the budget instead.

      privacy_unit: ``"example"``, or ``"unit"`` (DP mode only): user-level
        DP, each ``accumulate`` given the micro-batch's ``unit_ids`` (``[b]``
        integers), and each unit's summed gradient clipped, as in
        ``DPModel(privacy_unit="unit")``. A unit's rows must all be in one
        micro-batch of a logical batch (its gradient is summed before it is
        clipped; split over two micro-batches it would be clipped twice,
        and could move the sum by ``2 C``): a unit id met again before
        ``reset`` (``apply`` resets) is refused with
        ``tf.errors.InvalidArgumentError`` naming ``unit_ids``. Split a
        unit-level Poisson batch so that no unit is cut (each of its units
        brings at most ``rows_per_unit`` rows). Not under a strategy with
        several replicas (use ``DPModel(privacy_unit="unit")``, which keeps
        units whole across replicas). ``count`` then counts units.

      sparse_embeddings: a ``per_example_grads.dp.sparse_embeddings.SparseEmbeddings``
        (DP mode, ``privacy_unit="example"``, one replica): each micro-batch's
        per-example distinct-row contributions are added up (``(keys,
        counts)``, keys in order of first lookup), and ``result()`` selects
        rows and adds noise once per logical batch with the release of
        ``DPModel(sparse_embeddings=...)`` (same epsilon; the guarantee is
        stated in ``per_example_grads.dp.sparse_embeddings``). The tables'
        results are ``tf.IndexedSlices`` on the selected rows.

    ``noise_multiplier``, ``expected_batch_size``, ``seed``, ``method`` and
    ``mechanism`` apply in DP mode only: without ``l2_norm_clip`` they raise ``ValueError``
    rather than being ignored.
      training: passed to the model (``True`` runs Dropout as ``fit`` does).

    Attributes:
      sums: list of non-trainable ``[*var.shape]`` variables.
      count: scalar float32 variable, examples (or summed weights) so far.
      steps: int64 variable: in DP mode the releases (``result()`` calls, what
        an accountant counts), else the logical batches applied.
      strategy: the ``tf.distribute`` strategy in scope when it was created.

    Examples:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> acc = peg.dp.GradientAccumulator(model, "mse")
      >>> acc.accumulate(np.ones((5, 3)), np.zeros((5, 2)))
      >>> acc.accumulate(np.ones((2, 3)), np.zeros((2, 2)))
      >>> float(acc.count.numpy())
      7.0
      >>> acc.apply(keras.optimizers.SGD(0.1))
    """

    def __init__(
        self,
        model: Any,
        loss_fn: Any,
        *,
        variables: Sequence | None = None,
        l2_norm_clip: Any = None,
        noise_multiplier: float | None = None,
        seed: NoiseSeed = None,
        expected_batch_size: float | None = None,
        method: str = "auto",
        training: bool = False,
        mechanism: Any = None,
        privacy_unit: str = "example",
        sparse_embeddings: SparseEmbeddings | None = None,
        sampling_probability: float | None = None,
        budget: PrivacyBudget | None = None,
    ):
        super().__init__(name="gradient_accumulator")
        check_choice("privacy_unit", privacy_unit, ("example", "unit"))
        self.privacy_unit = privacy_unit
        check_sparse_embeddings(sparse_embeddings)
        composition.check(
            composition.Parts(
                "GradientAccumulator",
                mechanism=mechanism,
                private=l2_norm_clip is not None,
                per_layer=composition.per_layer(l2_norm_clip),
                units=privacy_unit == "unit",
                sparse=sparse_embeddings is not None,
                budget=budget is not None,
                replicas=tf.distribute.get_strategy().num_replicas_in_sync,
            )
        )
        if budget is not None and not isinstance(budget, PrivacyBudget):
            raise TypeError(f"budget must be a peg.dp.PrivacyBudget or None; got {type(budget).__name__} {budget!r}.")
        self.budget = budget
        self._problem = make_problem(model, loss_fn, variables, training, False)
        self._model, self._loss_fn = model, loss_fn
        self.private = l2_norm_clip is not None
        self.variables_ = list(self._problem.variables)
        if self.private:
            if noise_multiplier is None:
                raise ValueError("noise_multiplier is required with l2_norm_clip (use 0.0 for no noise).")
            if expected_batch_size is None:
                raise ValueError(
                    "expected_batch_size is required with l2_norm_clip: the noisy sum is divided by it "
                    "(q * N for Poisson sampling, or the fixed batch size). Dividing by the number of "
                    "examples accumulated would reveal it through the noise."
                )
            self.aggregator = DPAggregator(
                l2_norm_clip=l2_norm_clip,
                noise_multiplier=noise_multiplier,
                expected_batch_size=expected_batch_size,
                seed=seed,
                method=method,
                training=training,
                mechanism=mechanism,
            )
            self.aggregator.attach(self.variables_)
            if sparse_embeddings is not None:
                self.aggregator.sparse = sparse_embeddings.bind(
                    model, self.variables_, noise_multiplier=self.aggregator.noise_multiplier
                )
            self.sampling_probability = (
                None if sampling_probability is None else check_sampling_probability(sampling_probability)
            )
        else:
            dp_only = dict(
                noise_multiplier=noise_multiplier,
                expected_batch_size=expected_batch_size,
                seed=seed,
                mechanism=mechanism,
                sampling_probability=sampling_probability,
                budget=budget,
            )
            given = [name for name, value in dp_only.items() if value is not None] + (
                ["method"] if method != "auto" else []
            )
            if given:
                raise ValueError(
                    f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} in DP mode, which l2_norm_clip enables; without it they "
                    "would be ignored (no clipping, no noise, the plain mean). Give l2_norm_clip, or leave "
                    f"{', '.join(given)} out."
                )
            check_method(method)
            self.applied = AppliedSteps(name="steps")
        self._regularization = lambda: regularization_gradients(model, self.variables_)
        local = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
        self.strategy = tf.distribute.get_strategy()  # the one the variables belong to
        with tf.init_scope():
            self.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), name="sum", **local) for v in self.variables_]
            self.count = tf.Variable(0.0, name="count", **local)
            if privacy_unit == "unit":
                # the units of this logical batch so far: one unit in two micro-batches is refused
                self._seen_units = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0, name="seen_units")
            if sparse_embeddings is not None:
                # the logical batch's (keys, counts) so far, keys in order of first lookup (saved with the sums)
                self.sparse_keys = tf.Variable(
                    tf.zeros([0], tf.int64), shape=tf.TensorShape([None]), trainable=False, name="sparse_keys"
                )
                self.sparse_counts = tf.Variable(
                    tf.zeros([0], tf.float32), shape=tf.TensorShape([None]), trainable=False, name="sparse_counts"
                )

    def accumulate(self, x: Any, y: Any = None, sample_weight: Any = None, unit_ids: Any = None) -> None:
        """Adds one micro-batch (``[b, ...]``, any ``b``, 0 included); ``unit_ids`` ``[b]`` with ``privacy_unit="unit"``."""
        _check_replica_context(self, "accumulate")
        batch = make_batch(self._model, x, y, sample_weight)
        if (unit_ids is None) != (self.privacy_unit == "example"):
            raise ValueError(
                "GradientAccumulator(privacy_unit='unit') needs the unit_ids of every micro-batch."
                if unit_ids is None
                else "unit_ids needs GradientAccumulator(..., privacy_unit='unit'): this one clips each example."
            )
        if unit_ids is not None:
            self._check_new_units(unit_ids, batch)
        if self.private:
            clipped = self.aggregator.clipped_sum(
                self._model, self._loss_fn, x, y, sample_weight, variables=self.variables_, unit_ids=unit_ids
            )
            contribution = clipped.sums
            if clipped.selection is not None:
                self._add_selection(*clipped.selection)
        else:
            contribution = unless_empty(batch, self._summed_gradient)
        for s, c in zip(self.sums, contribution):
            # An embedding table's clipped sum: add its rows only, except into a
            # sync-on-read variable (multi-replica strategy), which cannot scatter.
            if isinstance(c, tf.IndexedSlices) and not isinstance(s, tf.distribute.DistributedValues):
                s.scatter_add(tf.IndexedSlices(tf.cast(c.values, s.dtype), c.indices, c.dense_shape))
            else:
                s.assign_add(tf.cast(tf.convert_to_tensor(c), s.dtype))
        if unit_ids is not None:
            added = tf.reduce_sum(clipped.real)  # the units with a real row
        elif sample_weight is None:
            added = tf.cast(batch_size(batch), tf.float32)
        else:
            w = tf.cast(batch["sample_weight"], tf.float32)
            added = tf.reduce_sum(tf.cast(tf.not_equal(w, 0), tf.float32)) if self.private else tf.reduce_sum(w)
        self.count.assign_add(added)

    def _add_selection(self, keys: tf.Tensor, counts: tf.Tensor) -> None:
        """Merges a micro-batch's ``(keys, counts)``: the sum per key, the keys ascending (as ``selected_rows`` takes them)."""
        both = tf.concat([self.sparse_keys, keys], 0)
        unique, slot = tf.unique(both, out_idx=tf.int64)
        summed = tf.math.unsorted_segment_sum(
            tf.concat([self.sparse_counts, counts], 0), slot, tf.size(unique, out_type=tf.int64)
        )
        order = tf.argsort(unique)
        self.sparse_keys.assign(tf.gather(unique, order))
        self.sparse_counts.assign(tf.gather(summed, order))

    def _check_new_units(self, unit_ids: Any, batch) -> None:
        """Refuses a micro-batch with a real row of a unit an earlier micro-batch of this logical batch had."""
        ids = tf.convert_to_tensor(unit_ids)
        if not ids.dtype.is_integer or ids.shape.rank != 1:
            raise TypeError(f"unit_ids must be [b] integers, one per row; got {ids.dtype.name} of shape {ids.shape}.")
        ids = tf.cast(ids, tf.int64)
        if "sample_weight" in batch:  # rows of weight 0 (padding) belong to no unit
            ids = tf.boolean_mask(ids, tf.not_equal(batch["sample_weight"], 0))
        seen = tf.ensure_shape(self._seen_units.lookup(ids), ids.shape)
        again = tf.boolean_mask(ids, tf.not_equal(seen, 0))
        check = tf.debugging.Assert(
            tf.equal(tf.size(again), 0),
            [
                "unit_ids: units with rows in an earlier micro-batch of this logical batch (a unit's rows must all be "
                "in one micro-batch: its gradient is summed before it is clipped):",
                again,
            ],
        )
        with tf.control_dependencies([check]):
            self._seen_units.insert(ids, tf.ones_like(ids))

    def _summed_gradient(self, batch) -> list[tf.Tensor]:
        """``sum_i w_i grad loss_i``, ``[*var.shape]`` per variable (zeros where the loss does not reach)."""
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(self._problem.losses(batch))
        grads = tape.gradient(total, self.variables_)
        return [
            tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, self.variables_)
        ]

    def result(self) -> list[tf.Tensor]:
        """The gradient of the logical batch: ``[*var.shape]`` per variable.

        Plain: ``sum / count`` (zeros if nothing was added). DP: ``(sum +
        noise) / expected_batch_size``: a release, with fresh noise, counted
        in ``steps`` (call it once per logical batch; ``apply`` does).
        Both add the weight regularizers' gradient.
        Inside ``strategy.run``, this replica's share (see the module docstring).
        """
        # This replica's own values inside strategy.run. tf.identity: on TF 2.21 a
        # sync-on-read variable's value() cannot be all-reduced across workers directly.
        sums = [tf.identity(s.value()) for s in self.sums]
        regularization = self._regularization()
        if self.private:
            given = sums
            if self.aggregator.sparse is not None:  # the one release DPModel uses, on the whole logical batch
                none = tf.zeros([0], tf.float32)
                given = ClippedSum(
                    sums, none, none, selection=(tf.identity(self.sparse_keys), tf.identity(self.sparse_counts))
                )
            with tf.control_dependencies(self._budget_check()):
                return self.aggregator.release(
                    given,
                    self.aggregator.expected_batch_size,
                    sampling_probability=self.sampling_probability,
                    regularization=regularization,
                )
        count = replicas.global_sum(tf.identity(self.count.value()))
        mean = [tf.math.divide_no_nan(s, tf.cast(count, s.dtype)) for s in sums]
        return add_regularization(mean, regularization)

    def apply(self, optimizer) -> None:
        """``optimizer.apply_gradients(result())``, one step counted, then ``reset()``.

        The step is counted before it is applied, so a crash in between can
        only over-count what an accountant reads from ``steps``.
        """
        _check_replica_context(self, "apply")
        if not hasattr(optimizer, "apply_gradients"):
            raise TypeError(
                f"optimizer must be an optimizer object such as keras.optimizers.SGD(0.1); got "
                f"{type(optimizer).__name__} {optimizer!r}. (A name would make a new optimizer, and lose "
                "its state, at every call: keras.optimizers.get(name) once, then pass that.)"
            )
        if self.private:
            optimizer.apply_gradients(zip(self.result(), self.variables_))
        else:
            self.applied.apply_gradients(optimizer, zip(self.result(), self.variables_))
        self.reset()

    @property
    def steps(self) -> tf.Variable:
        return self.aggregator.steps if self.private else self.applied.count

    def max_steps(self) -> int | None:
        """The most releases ``budget`` allows, counted with those in the ledger; None without a budget."""
        if self.budget is None:
            return None
        return self.aggregator.max_steps(self.budget, self.sampling_probability or 1.0)

    def _budget_check(self) -> list:
        """An op that fails, before the release, when the ledger has reached ``max_steps()``; none without a budget.

        The limit counts all steps, so it stays right as the ledger grows
        by releases like the next: a ``tf.function`` holds the one it traced
        with, and eager releases reuse it until the ledger's history changes
        otherwise (a restore), instead of searching the budget again at
        every release.

        Raises:
          ValueError: a step compiled with XLA, which drops in-graph checks.
        """
        if self.budget is None:
            return []
        if in_xla_context():
            raise ValueError(
                f"GradientAccumulator.result was traced with XLA (jit_compile=True): XLA drops the check of "
                f"the privacy budget ({self.budget.describe()}), so releases could go past it. Trace without "
                "jit_compile."
            )
        with tf.init_scope():  # the ledger's numbers, read eagerly while a tf.function is traced
            history = self.aggregator.segments.numpy().copy()
            history[np.flatnonzero(history[:, 0])[-1:], 0] = 0  # all but the steps of the segment that grows
            key = (history.tobytes(), self.aggregator.min_noise_multiplier.numpy().item())
            if getattr(self, "_limit", (None,))[0] != key:
                self._limit = (key, min(self.max_steps(), 2**62))
            limit = self._limit[1]
        return [
            tf.debugging.assert_less(
                self.aggregator.steps,
                tf.constant(limit, tf.int64),
                message=f"GradientAccumulator.result releases nothing: the privacy budget "
                f"({self.budget.describe()}) allows no more releases than the ledger (steps) has taken",
            )
        ]

    def accountant(self, *, accountant: str = "pld") -> PrivacyAccountant:
        """A ``PrivacyAccountant`` holding the ledger of the releases so far (``DPAggregator.accountant``).

        Each release is accounted at ``sampling_probability`` (1 without
        it), composed over the ledger's segments, so an accumulator restored
        from a checkpoint, or given another ``sampling_probability`` when it
        is made again, accounts the run as a whole.

        Raises:
          ValueError: plain mode (nothing is private), or a mechanism other
            than ``GaussianNoise``, whose accounting assumes a sampling the
            accumulator cannot see.
        """
        if not self.private:
            raise ValueError(
                "this GradientAccumulator is in plain mode (no l2_norm_clip): its results are not private."
            )
        mechanism = self.aggregator.mechanism
        if mechanism.correlated or mechanism.cycle_length != 1:
            raise ValueError(
                f"a GradientAccumulator cannot account {type(mechanism).__name__}'s releases: that accounting "
                f"assumes each example joins at most one step in every {mechanism.cycle_length} (cyclic Poisson "
                "sampling), which the accumulator cannot see. Account the run with "
                "peg.dp.compute_epsilon(..., steps=int(accumulator.steps.numpy()), mechanism=...) for the "
                "sampling you used."
            )
        return self.aggregator.accountant(accountant=accountant, sampling_probability=self.sampling_probability or 1.0)

    def epsilon(self, delta: float, *, accountant: str = "pld") -> float:
        """ε of the releases so far: ``self.accountant(accountant=...).epsilon(delta)`` (0 before the first)."""
        accounted = self.accountant(accountant=accountant)
        return 0.0 if accounted.steps == 0 else float(accounted.epsilon(delta))

    def reset(self) -> None:
        """Zeros the sums and the count (not ``steps``)."""
        for s in self.sums:
            s.assign(tf.zeros_like(s))
        self.count.assign(0.0)
        if self.private and self.aggregator.sparse is not None:
            self.sparse_keys.assign(tf.zeros([0], tf.int64))
            self.sparse_counts.assign(tf.zeros([0], tf.float32))
        if self.privacy_unit == "unit":
            self._seen_units.remove(self._seen_units.export()[0])


def _check_replica_context(accumulator: GradientAccumulator, method: str) -> None:
    """The variables of an accumulator made under a multi-replica strategy change only inside its ``run``."""
    strategy = accumulator.strategy
    if strategy.num_replicas_in_sync > 1 and (
        tf.distribute.in_cross_replica_context() or tf.distribute.get_strategy() is not strategy
    ):
        raise ValueError(
            f"GradientAccumulator.{method} was called outside strategy.run of the "
            f"{strategy.num_replicas_in_sync}-replica strategy it was created under; call it inside "
            "strategy.run(...), so that each replica adds its own shard."
        )
