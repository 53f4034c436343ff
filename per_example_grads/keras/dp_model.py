"""``DPModel``: DP-SGD through the ordinary Keras ``compile`` / ``fit`` workflow."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from per_example_grads._core import replicas
from per_example_grads._core.arguments import check_choice, check_positive_int
from per_example_grads._core.losses import as_per_example_loss
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.dp import adaptive as adaptive_clipping
from per_example_grads.dp import composition, validation
from per_example_grads.dp.accounting import PrivacyAccountant, check_run_delta
from per_example_grads.dp.aggregator import DPAggregator, whole_units_on_replicas
from per_example_grads.dp.budget import PrivacyBudget
from per_example_grads.dp.mechanisms import NoiseMechanism
from per_example_grads.dp.monte_carlo import MonteCarloEpsilon
from per_example_grads.dp.sampling import FixedSizeSampling, PoissonSampling
from per_example_grads.dp.sparse_embeddings import SparseEmbeddings, check_sparse_embeddings
from per_example_grads.keras import network_guard, network_ledger
from per_example_grads.keras.training_data import rows_of_fit_data

_NO_LIMIT = 2**62  # the step limit without a budget: more steps than any run takes


@dataclasses.dataclass(frozen=True)
class _FitSampling:
    """The sampler of one ``fit`` call's batches (or of batches no ``fit`` drew), and the step's divisor."""

    sampler: PoissonSampling | FixedSizeSampling
    divisor: float | None = None  # None: the aggregator's (expected_batch_size, else the rows of each batch)

    @property
    def source(self) -> PoissonSampling | None:
        """The ``poisson_batches`` (or ``min_sep_batches``) dataset's sampling, which ``fit`` resumes; else None."""
        return self.sampler if self.sampler.poisson else None

    def traced_as(self) -> tuple:
        """What the traced train step depends on (the dataset object itself is not)."""
        s = self.sampler
        return s.poisson, s.sampling_probability, self.divisor, s.rows_per_unit, s.truncation


class DPModel(keras.Model):
    """A Keras model trained with DP-SGD.

    Each ``train_step`` releases, for the batch's examples ``i`` (or units,
    with ``privacy_unit="unit"``: the sum of a unit's rows' gradients):

        g_tilde = ( sum_i clip_C(w_i grad loss_i) + x_t ) / D  (+ grad R)

    with ``C = l2_norm_clip``, ``x_t`` the mechanism's noise of step ``t``
    (``N(0, (sigma C)^2 I)``, fresh, for the default DP-SGD), ``D =
    expected_batch_size`` (default ``q N`` of a ``poisson_batches`` dataset,
    else the rows of each batch; never a count taken from the data), and
    ``grad R`` the weight regularizers' gradient. The step is a
    ``peg.dp.DPAggregator``'s (``self.aggregator``), and applies with the
    compiled optimizer (the inner one under ``mixed_float16``).

    Contract (each item is enforced where it says; the guide
    ``docs/guides/private-training.md`` explains them):

    - **Sampling.** ``fit`` on a ``peg.dp.poisson_batches`` dataset is
      accounted as Poisson sampling at its ``q``; arrays, other datasets,
      ``train_on_batch`` and custom loops as fixed-size batches at ``q =
      rows / N`` (a heuristic: the ledger records it, ``epsilon()`` warns).
      A correlated or cyclic mechanism trains only through ``fit`` on
      ``poisson_batches(..., cycle_length=mechanism.cycle_length)``, whose
      partition the ledger records and every later dataset of the run keeps.
    - **N from the data.** ``fit`` takes ``N`` from the data where it says,
      and refuses a ``num_examples`` that disagrees.
    - **One ledger per network.** After the first step, weights changed
      outside this ``DPModel`` make ``fit`` and ``epsilon()`` raise
      (``per_example_grads.keras.network_guard``); ``accept_current_weights``
      declares a change made without private data.
    - **The ledger travels with the weights**: ``save_weights``,
      checkpoints, ``BackupAndRestore`` and the wrapped network's own files
      (``per_example_grads.keras.network_ledger``). A file whose steps
      another mechanism took is refused, naming both.
    - **A budget at every front door** (``budget``): ``fit`` stops before the
      step that would pass it, ``train_on_batch`` refuses it, a custom loop's
      step fails before its release (traced with XLA: refused).
    - **Parts that combine.** The pairings refused are the table of
      ``per_example_grads.dp.composition``.
    - **Per unit** (``privacy_unit="unit"``): sampling, clipping, the divisor
      (``q U``), ``epsilon()`` and the budget are per unit; units stay whole
      across physical chunks and replicas.
    - Metrics: ``loss`` and ``metrics`` are weighted by ``sample_weight`` (a
      Poisson batch's mask), from the pass that computed the clipped
      gradients; ``clipped_fraction``, ``step_clipped_fraction`` and
      ``nonfinite_examples`` come from private norms and are not accounted.

    Args:
      model: the Keras model to train privately.
      l2_norm_clip: ``C > 0``, or per-layer ``{layer_name: C_l}`` (see
        ``peg.clipped_gradients``). Ignored when ``adaptive_clipping`` is set.
      noise_multiplier: ``sigma >= 0``, the one the accountant uses.
      expected_batch_size: ``q * N`` under Poisson sampling; default ``q N``
        of a ``poisson_batches`` dataset, else the batch's number of rows.
      num_examples: ``N``, for ``epsilon()``; default, and checked against:
        the data ``fit`` is given. Needed only for data of unknown size.
      seed: None (OS entropy, for real use) or an int (reproducible noise,
        different at every step; see ``per_example_grads.dp.noise``).
      adaptive_clipping: ``peg.dp.AdaptiveClipping`` settings, or None.
      method: per-example gradient engine (``"auto"`` prefers layer-wise).
      physical_batch_size: process each (logical) batch in chunks of this many
        rows, summing their clipped gradients in a loop before the single
        noise draw, so ``fit`` can use logical batches far larger than fit in
        memory (e.g. Poisson batches of 4096 in chunks of 64). Flat clipping only.
        The loss and metrics are taken chunk by chunk, so the batch's
        predictions are not held at once (but for unit-level chunks, and
        under XLA when it does not divide the batch's rows: docs/sharp-edges.md).
        ``peg.dp.physical_batch_size_for_memory`` measures the largest that
        fits a memory budget.
      budget: a ``peg.dp.PrivacyBudget``, or None for no limit.
      mechanism: a ``peg.dp.NoiseMechanism`` (``GaussianNoise``, the
        default DP-SGD; ``BandMF``, ``BLT``), this DPModel's alone.
      privacy_unit: ``"example"`` (each row is protected) or ``"unit"``
        (all the rows of one unit; ``docs/guides/user-level-privacy.md``).
      sparse_embeddings: a ``per_example_grads.dp.sparse_embeddings.SparseEmbeddings``: embedding tables
        get noise only on the rows a noisy count of the batch's lookups
        selects, as a sparse update, at the same epsilon
        (``per_example_grads.dp.sparse_embeddings``); None: dense noise.

    Raises:
      ValueError: a pairing of parts the composition table refuses, a
        ``num_examples`` or ``expected_batch_size`` that disagrees with the
        data, a network changed outside this ``DPModel`` or wrapped by
        another, a restored ledger of another mechanism (each named).

    Examples:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
      >>> dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.1, seed=0)
      >>> dp.compile(optimizer="sgd",
      ...            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      >>> x, y = np.ones((16, 4), "float32"), np.arange(16) % 3
      >>> history = dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.5, seed=0),
      ...                  epochs=1, verbose=0)
      >>> int(dp.dp_steps.numpy())
      2
    """

    def __init__(
        self,
        model: keras.Model,
        *,
        l2_norm_clip: Any = 1.0,
        noise_multiplier: float,
        expected_batch_size: float | None = None,
        num_examples: int | None = None,
        seed: int | None = None,
        adaptive_clipping: adaptive_clipping.AdaptiveClipping | None = None,
        method: str = "auto",
        physical_batch_size: int | None = None,
        budget: PrivacyBudget | None = None,
        mechanism: NoiseMechanism | None = None,
        privacy_unit: str = "example",
        sparse_embeddings: SparseEmbeddings | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_choice("privacy_unit", privacy_unit, ("example", "unit"))
        check_sparse_embeddings(sparse_embeddings)
        self.privacy_unit = privacy_unit
        parts = composition.Parts(
            "DPModel",
            mechanism=mechanism,
            adaptive=adaptive_clipping is not None,
            per_layer=composition.per_layer(l2_norm_clip),
            units=privacy_unit == "unit",
            chunks=physical_batch_size,
            sparse=sparse_embeddings is not None,
        )
        composition.check(parts)  # before any part is built (a mechanism, once attached, is this run's)
        if budget is not None and not isinstance(budget, PrivacyBudget):
            raise TypeError(f"budget must be a peg.dp.PrivacyBudget or None; got {type(budget).__name__} {budget!r}.")
        self.budget = budget
        # The budget's step limit as the last front door (fit, train_on_batch) computed it, read by
        # train_step. Not a weight: it follows from the budget and the ledger, never saved.
        object.__setattr__(self, "_step_limit", tf.Variable(_NO_LIMIT, dtype=tf.int64, trainable=False))
        self._front_door = False  # True while fit or train_on_batch runs (their own budget checks run first)
        self.aggregator = DPAggregator(
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            adaptive_clipping=adaptive_clipping,
            physical_batch_size=physical_batch_size,
            method=method,
            training=True,
            mechanism=mechanism,
        )
        self._parts = dataclasses.replace(parts, mechanism=self.aggregator.mechanism)
        validation.check_model(model, training=True)
        self.aggregator.attach(model.trainable_variables)
        if sparse_embeddings is not None:
            self.aggregator.sparse = sparse_embeddings.bind(
                model, model.trainable_variables, noise_multiplier=self.aggregator.noise_multiplier
            )
        self.model = model
        self.num_examples = None if num_examples is None else check_positive_int("num_examples", num_examples)
        self._clipped_fraction = keras.metrics.Mean(name="clipped_fraction")
        self._nonfinite = keras.metrics.Sum(name="nonfinite_examples")
        self._fit_sampling = _FitSampling(FixedSizeSampling())
        self._warned_fixed_batches = False
        network_guard.claim(model, self, lambda other: int(other.dp_steps.numpy()))
        network_ledger.attach(model, self)
        self._network_fingerprint = keras.Variable(
            [0.0, 0.0],
            dtype="float64",
            trainable=False,
            name="network_fingerprint",
            aggregation="only_first_replica",
        )
        self._guard = network_guard.NetworkGuard(model, self._network_fingerprint)
        self._guard.refresh()
        # Built on construction: save_weights / checkpoints work before and right after fit.
        self.built = True

    # The configuration and the ledger live in the aggregator.
    noise_multiplier = property(lambda self: self.aggregator.noise_multiplier)
    expected_batch_size = property(lambda self: self.aggregator.expected_batch_size)
    l2_norm_clip = property(lambda self: self.aggregator.l2_norm_clip)
    adaptive = property(lambda self: self.aggregator.adaptive)
    mechanism = property(lambda self: self.aggregator.mechanism)
    dp_steps = property(lambda self: self.aggregator.steps)
    dp_min_noise_multiplier = property(lambda self: self.aggregator.min_noise_multiplier)
    dp_max_sampling_probability = property(lambda self: self.aggregator.max_sampling_probability)

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def metrics(self):
        return super().metrics + [self._clipped_fraction, self._nonfinite]

    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, metrics=None, weighted_metrics=None, **kwargs):
        """``keras.Model.compile``, with ``metrics`` computed as ``weighted_metrics``.

        Keras's plain metrics ignore ``sample_weight``; here it is the
        Poisson mask, so they would count the padded rows. Weighted by it,
        padding (weight 0) never counts, under XLA too.

        Raises:
          ValueError: ``loss`` is a list or dict, or ``loss_weights`` is
            given: the DP step clips one per-example loss.
        """
        if isinstance(loss, (list, tuple, dict)):
            raise ValueError(
                "DPModel supports one loss for one output; got a "
                f"{type(loss).__name__} of losses. Combine them into one per-example loss function."
            )
        if loss_weights is not None:
            raise ValueError(
                f"DPModel.compile does not take loss_weights (got {loss_weights!r}): the DP step clips "
                "one per-example loss. Scale the loss inside it instead."
            )
        if isinstance(metrics, (list, tuple)):
            weighted_metrics = list(weighted_metrics or []) + list(metrics)
            metrics = None
        if (self._parts.units or self._parts.sparse) and kwargs.get("jit_compile", "auto") == "auto":
            kwargs["jit_compile"] = False  # parts that do not compile with XLA (dp.composition)
        super().compile(
            optimizer=optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            **kwargs,
        )

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """``keras.Model.fit``, with the sampling of ``x`` checked against the accounting (class docstring).

        A ``poisson_batches`` dataset given without ``steps_per_epoch`` is
        read one pass per epoch from a single iterator for the whole call;
        afterwards its ``next_step`` is the ledger's ``dp_steps``.

        Raises:
          ValueError: ``num_examples`` disagrees with the data, the data's
            size is unknown and ``num_examples`` was not given, the network
            was trained outside this ``DPModel``, or a Poisson dataset's
            ``q`` disagrees with ``expected_batch_size / num_examples``.
        """
        self._check_ledger_covers_network()
        if args:  # Keras's positional order (epochs, verbose, callbacks, validation_split, ...), as keywords
            names = list(inspect.signature(keras.Model.fit).parameters)[4:]
            kwargs.update(zip(names, args))
        sampling = self._sampling_of(x, batch_size, kwargs.get("validation_split") or 0.0)
        if sampling.traced_as() != self._fit_sampling.traced_as():
            self.train_function = None  # retrace: the step uses this fit's sampling
        self._fit_sampling = sampling
        if isinstance(x, tf.data.Dataset):
            kwargs.setdefault("shuffle", False)  # a dataset is never shuffled by fit; say nothing about it
        source = self._fit_sampling.source
        replicas_in_sync = self.distribute_strategy.num_replicas_in_sync
        if source is not None and source.max_batch_size % replicas_in_sync:
            x = _padded_to_multiple(x, source.max_batch_size, replicas_in_sync)
        # First, so that the fingerprint is fresh for the user's epoch-end callbacks (checkpoints).
        callbacks = [_GuardNetwork(self._guard)] + list(kwargs.get("callbacks") or [])
        if source is not None:
            callbacks.append(_ResumeSampling(source, self.dp_steps))
        if self.budget is not None:
            limit = self._set_step_limit()
            if int(self.dp_steps.numpy()) + self._steps_per_call() > limit:
                _warn_budget(self, limit, stopped=False)
                return keras.callbacks.History()
            callbacks.append(_StopAtBudget(limit, self._steps_per_call()))
        kwargs["callbacks"] = callbacks
        self._build_before_tracing(x, y)
        if source is not None and kwargs.get("steps_per_epoch") is None and source.steps % self._steps_per_call() == 0:
            # Keras creates a finite dataset's iterator twice an epoch, and each
            # creation instantiates the sampler's functions again (tens of ms);
            # repeated passes behind steps_per_epoch = one pass need one iterator.
            x, kwargs["steps_per_epoch"] = x.repeat(), source.steps
        try:
            self._front_door = True
            history = super().fit(x, y, batch_size, **kwargs)
        finally:
            self._front_door = False
            self._guard.refresh()
            if source is not None:  # prefetching may have claimed a pass no step used
                source.next_step.assign(self.dp_steps)
        bad = history.history.get("nonfinite_examples", [])
        if bad and max(bad) > 0:
            warnings.warn(
                f"{int(max(bad))} {'unit' if self.privacy_unit == 'unit' else 'example'}(s) in an epoch had a "
                "NaN or Inf gradient; they contributed "
                "nothing to their steps (see the nonfinite_examples metric). Check their inputs and labels.",
                RuntimeWarning,
                stacklevel=2,
            )
        return history

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """``keras.Model.train_on_batch``: one DP step, within the budget, counted by the ledger.

        The batch's sampling is not known: it is accounted as a fixed-size
        batch, at ``q = rows / num_examples`` (the heuristic ``fit`` uses for
        arrays; the ledger records that the step was not Poisson sampled, and
        ``epsilon()`` warns), never as the last ``fit``'s Poisson sampling.

        Raises:
          RuntimeError: the step would take the ledger past ``budget``.
          ValueError: as ``fit``: the network was trained outside this
            ``DPModel``; a correlated or cyclic mechanism, whose accounting
            needs ``fit`` on ``poisson_batches``.
        """
        self._check_ledger_covers_network()
        composition.check(self._unknown_sampling_parts("DPModel.train_on_batch"))
        first = tf.nest.flatten(x)[0] if tf.nest.flatten(x) else None
        sampling = self._unknown_sampling(int(np.shape(first)[0]) if np.ndim(first) else None)
        if sampling.traced_as() != self._fit_sampling.traced_as():
            self.train_function = None  # retrace: the step uses this sampling
        self._fit_sampling = sampling
        if self.budget is not None:
            limit, steps = self._set_step_limit(), int(self.dp_steps.numpy())
            if steps + self._steps_per_call() > limit:
                raise RuntimeError(
                    f"DPModel.train_on_batch takes no step: the privacy budget ({self.budget.describe()}) allows "
                    f"{limit} steps, {steps} are taken, and the next would exceed it."
                )
        try:
            self._front_door = True
            return super().train_on_batch(x, y, sample_weight, class_weight, return_dict)
        finally:
            self._front_door = False
            self._guard.refresh()  # the weights as its own step left them

    def _build_before_tracing(self, x, y) -> None:
        """Creates the optimizer's and the compiled metrics' variables before the train step is traced.

        Keras does so only under a distribution strategy; otherwise they are
        created while the step is traced, and TensorFlow then traces the
        step a second time, without creating variables: a DP step's first
        call would trace the model, its layer rules and the noise twice. Built from a dataset's element spec or the arrays, on symbolic
        inputs: nothing is drawn from the data. Other inputs, and a model
        that cannot run on symbolic inputs, keep Keras's default; only the
        tracing time differs.
        """
        if self._distribute_strategy is not None:
            return
        if isinstance(x, tf.data.Dataset):
            batch = x.element_spec
        elif all(hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in tf.nest.flatten((x, y))):
            batch = (x, y)
        else:
            return
        try:
            self._symbolic_build(data_batch=batch)
        except Exception:  # noqa: BLE001 - an optimization only; the step builds what is left
            pass

    def _sampling_of(self, x, batch_size, validation_split: float) -> _FitSampling:
        source = getattr(x, "pegrad_sampling", None) if isinstance(x, tf.data.Dataset) else None
        composition.check(
            dataclasses.replace(
                self._parts,
                sampling=FixedSizeSampling().declared() if source is None else source.declared(),
                xla=bool(getattr(self, "jit_compile", False)),
                replicas=self.distribute_strategy.num_replicas_in_sync,
            )
        )
        if source is not None and source.privacy_unit == "unit":
            self._check_num_units(source)
        cycle = self.mechanism.cycle_length
        if source is None:
            rows = rows_of_fit_data(x, batch_size, validation_split)
            self._check_num_examples(rows.total, rows.what)
            if not self._warned_fixed_batches:
                self._warned_fixed_batches = True
                what = (
                    "a dataset not made by peg.dp.poisson_batches"
                    if isinstance(x, tf.data.Dataset)
                    else "fixed-size batches"
                )
                warnings.warn(
                    f"DPModel.fit was given {what}: epsilon() is then computed as if every batch were "
                    "Poisson-sampled at q = batch rows / num_examples, which for fixed-size shuffled "
                    "batches is only an approximation (the true epsilon can be larger). For a guarantee, "
                    "fit on peg.dp.poisson_batches(x, y, sampling_probability=q).",
                    UserWarning,
                    stacklevel=3,
                )
            return _FitSampling(FixedSizeSampling(rows.largest_batch))
        self._check_num_examples(source.num_examples, "the poisson_batches dataset samples from")
        if source.partition is not None:
            self._keep_partition(source)
        q = source.sampling_probability
        expected = source.expected_batch_size
        if self.expected_batch_size is not None and abs(self.expected_batch_size - expected) > 1e-9 * expected:
            per = f" / cycle_length {cycle}" if cycle > 1 else ""
            raise ValueError(
                f"the poisson_batches dataset is sampled at q={q:g}{f' (cycle_length={cycle})' if cycle > 1 else ''}, "
                f"an expected batch size of q * N{per} = {expected:g}, but DPModel has "
                f"expected_batch_size={self.expected_batch_size}: its epsilon would be wrong. Give "
                f"expected_batch_size={expected:g} (or leave it out) or resample at that q."
            )
        divisor = self.expected_batch_size if self.expected_batch_size is not None else expected
        return _FitSampling(source, divisor)

    def _check_num_units(self, source: PoissonSampling) -> None:
        """Refuses a ``num_examples`` other than the number of units a unit-level dataset samples."""
        if self.num_examples is not None and self.num_examples != source.num_examples:
            raise ValueError(
                f"DPModel(privacy_unit='unit') has num_examples={self.num_examples}, but the dataset samples "
                f"{source.num_examples} units (from {source.num_rows} rows): num_examples must be the number "
                "of units, over which epsilon() is accounted. Leave it out (it is taken from the data) or give "
                f"num_examples={source.num_examples}."
            )

    def _keep_partition(self, source: PoissonSampling) -> None:
        """Keeps a cyclic run on one partition: records the data's before the first step, else gives the data the run's.

        Raises:
          ValueError: the dataset holds other rows than the run's partition
            was made for, or the ledger has steps but no partition (saved
            before it was recorded).
        """
        recorded = self.aggregator.partition.numpy()
        if int(self.dp_steps.numpy()) == 0:
            self.aggregator.partition.assign(source.partition)
        elif not recorded.any():
            raise ValueError(
                f"this DPModel's ledger has {int(self.dp_steps.numpy())} cyclic-sampled step(s) but no record of "
                "the partition they used (it was saved by an earlier version of per_example_grads, whose "
                "partition was an equal split): a new partition could sample an example again sooner than "
                f"cycle_length={source.cycle_length} steps after its last turn, which the accounting excludes. "
                "Begin a new run (a new DPModel) instead."
            )
        else:
            source.take_partition(recorded)

    def _check_num_examples(self, rows: int | None, what: str) -> None:
        """``num_examples`` from the data's ``rows``, or a ``ValueError`` where they disagree or neither is known."""
        if rows is None:
            if self.num_examples is None:
                raise ValueError(
                    f"DPModel.fit was given {what}, whose number of examples is unknown, and DPModel has no "
                    "num_examples: epsilon() needs N. Give DPModel(num_examples=N), or fit on "
                    "peg.dp.poisson_batches(x, y, sampling_probability=q), which knows it."
                )
            return
        if rows == 0:
            raise ValueError(f"DPModel.fit was given no examples ({what} 0).")
        if self.num_examples is None:
            self.num_examples = int(rows)
        elif self.num_examples != rows:
            raise ValueError(
                f"DPModel has num_examples={self.num_examples}, but {what} {rows} examples: epsilon() "
                "would be computed for the wrong N (under-reported when num_examples is the larger). "
                f"Leave num_examples out (it is taken from the data) or give num_examples={rows}."
            )

    def _check_ledger_covers_network(self) -> None:
        """Raises if another DPModel took the network over, or (after a DP step) something else changed its weights.

        Also if the restored ledger or noise state belongs to another mechanism (``DPAggregator.check_ledger``).
        """
        self.aggregator.check_ledger()
        if not network_guard.owned_by(self.model, self):
            raise ValueError(
                f"the network {self.model.name!r} is now wrapped by another DPModel; this one's ledger no "
                "longer covers its training."
            )
        if not self._guard.changed():
            return
        if int(self.dp_steps.numpy()) == 0:
            self._guard.refresh()  # before any private step: loading or pre-training public weights
            return
        moved = self._guard.trainable_changed()
        if moved is not None:
            before, now = moved
            raise ValueError(
                f"the network {self.model.name!r} has other trainable variables than at its last DP step "
                f"({len(before)} then, {len(now)} now: a layer's trainable was changed; "
                f"{sorted(set(before) ^ set(now))[:4]}): the ledger and the noise were built for those. Set "
                "trainable back, or set it before wrapping the network in a DPModel (a new run)."
            )
        raise ValueError(
            f"the network {self.model.name!r} was changed outside this DPModel after its "
            f"{int(self.dp_steps.numpy())} DP step(s) (e.g. dp.model.fit, a custom training loop or "
            "set_weights): epsilon() counts only DPModel's own steps and would not cover that training. "
            "If the change used no private data, call dp.accept_current_weights() first."
        )

    def accept_current_weights(self) -> None:
        """Declares the wrapped network's current weights covered: a change made on purpose, without private data.

        After this, ``fit`` and ``epsilon()`` no longer refuse a change made
        to the weights outside this ``DPModel`` before now. Do not call it
        after training on private data without privacy: ``epsilon()`` would
        then under-report.
        """
        self._guard.refresh()

    def _steps_per_call(self) -> int:
        """DP steps one call of the train function takes (Keras's ``steps_per_execution``)."""
        return int(getattr(self, "steps_per_execution", 1) or 1)

    def max_steps(self) -> int | None:
        """The most DP steps ``budget`` allows this ledger, or None without a budget.

        For an ``(epsilon, delta)`` budget, the ledger's epsilon at that many
        steps is within the budget, accounted as ``epsilon()`` accounts it:
        the steps taken as the ledger's segments, then further steps at this
        run's noise multiplier and sampling probability, composed; where
        ``epsilon()`` takes the worst case (a correlated mechanism, a ledger
        older than its segments), every step at the smallest noise multiplier
        and the largest sampling probability used or to be used.

        Raises:
          ValueError: the sampling probability is not known yet (no
            ``num_examples``, or fixed-size batches of unknown size).
        """
        return self._max_steps_for(self._fit_sampling)

    def _max_steps_for(self, sampling: _FitSampling) -> int | None:
        """``max_steps`` for steps taken with ``sampling`` (the last ``fit``'s, or a custom loop's)."""
        if self.budget is None:
            return None
        if self.budget.steps is not None:
            return int(self.budget.steps)
        sampler = sampling.sampler
        q = sampler.sampling_probability if sampler.poisson else sampler.largest_sampling_probability(self.num_examples)
        if q is None:
            q = self.sampling_probability
        if q is None:
            raise ValueError(
                "a budget in epsilon needs the sampling probability before training: give DPModel "
                "num_examples and expected_batch_size, or fit on peg.dp.poisson_batches or on arrays "
                "with batch_size (a dataset's batches must then have a static size)."
            )
        return self.aggregator.max_steps(self.budget, q, sampler.poisson, sampler.truncation)

    def _unknown_sampling(self, largest_batch: int | None = None) -> _FitSampling:
        """The sampling of batches this ``DPModel`` did not draw (``train_on_batch``, a custom loop): fixed-size."""
        return _FitSampling(FixedSizeSampling(largest_batch, self._fit_sampling.sampler.rows_per_unit))

    def _unknown_sampling_parts(self, owner: str) -> composition.Parts:
        """``Parts`` of a step on such batches (their unit ids, if any, are checked by ``_unpack``)."""
        return dataclasses.replace(
            self._parts,
            owner=owner,
            sampling=FixedSizeSampling().declared(units=self._parts.units),
        )

    def _set_step_limit(self) -> int:
        """``max_steps()``, also given to the step's own check (``_budget_check``)."""
        limit = self.max_steps()
        self._step_limit.assign(min(limit, _NO_LIMIT))
        return limit

    def _budget_check(self, sampling: _FitSampling) -> list:
        """The step's own budget check: an op that fails when the ledger has reached the limit, or none.

        ``fit`` and ``train_on_batch`` stop before the limit themselves and
        set it (``_set_step_limit``); a custom loop's trace computes it now,
        from the ledger as it is and the traced batch (``q = global rows /
        N``; with a batch size unknown when traced, ``expected_batch_size /
        N``). The check runs before the release, so a
        step past the budget releases nothing and is not counted.

        Raises:
          ValueError: a custom loop compiled with XLA, which drops in-graph
            checks, on a DPModel with a budget.
        """
        if self.budget is None:
            return []
        limit = tf.convert_to_tensor(self._step_limit)
        if not self._front_door:
            if in_xla_context():
                raise ValueError(
                    f"DPModel.train_step was traced with XLA (jit_compile=True) outside fit and train_on_batch: "
                    f"XLA drops the step's own check of the privacy budget ({self.budget.describe()}), so a custom "
                    "loop could take steps past it. Trace the loop without jit_compile, or use fit."
                )
            with tf.init_scope():  # the ledger's numbers, read eagerly while the loop is traced
                now = min(self._max_steps_for(sampling), _NO_LIMIT)
            limit = tf.minimum(limit, now)
        return [
            tf.debugging.assert_less(
                self.aggregator.steps,
                limit,
                message=f"DPModel.train_step takes no step: the privacy budget ({self.budget.describe()}) allows "
                "no more steps than the ledger (dp_steps) has taken",
            )
        ]

    # Unconverted, as under Keras's fit (whose caller of train_step is keras code, which AutoGraph
    # never converts), also where a caller's own tf.function traces it.
    @tf.autograph.experimental.do_not_convert
    def train_step(self, data):
        custom = not self._front_door  # a custom loop's batches: their sampling is not known
        parts = self._unknown_sampling_parts("DPModel.train_step (a custom loop)") if custom else self._parts
        composition.check(dataclasses.replace(parts, xla=in_xla_context()))
        sampling = self._fit_sampling
        x, y, sample_weight, unit_ids = self._unpack(data)
        if custom:
            rows = tf.nest.flatten(x)[0].shape[0]  # static: the budget's q is the global batch's rows / N
            sampling = self._unknown_sampling(None if rows is None else rows * replicas.num_replicas())
        if unit_ids is not None:  # several replicas: every unit clipped whole on one of them
            x, y, sample_weight, unit_ids = whole_units_on_replicas(x, y, sample_weight, unit_ids)
        loss_fn = as_per_example_loss(self.loss)
        rows = tf.shape(tf.nest.flatten(x)[0])[0]
        sampler = sampling.sampler
        q = sampler.sampling_probability
        if q is None and self.num_examples is not None:
            q = tf.minimum(tf.cast(replicas.global_sum(rows), tf.float64) / self.num_examples, 1.0)
        with tf.control_dependencies(self._budget_check(sampling)):
            step = self.aggregator.step(
                self.model,
                loss_fn,
                x,
                y,
                sample_weight,
                divisor=sampling.divisor,
                sampling_probability=q,
                poisson=sampler.poisson,
                truncation=sampler.truncation,
                unit_ids=unit_ids,
                rows_per_unit=sampler.rows_per_unit,
                outputs=lambda rows, predictions: self._losses_and_metrics(loss_fn, rows, predictions),
            )
        clipped = step.clipped
        step_clipped_fraction = step.clipped_fraction
        # An empty Poisson step has no examples to be clipped: it is not a 0.
        self._clipped_fraction.update_state(step_clipped_fraction, sample_weight=tf.cast(step.counted > 0, tf.float32))
        self._nonfinite.update_state(replicas.global_sum(clipped.nonfinite) / replicas.num_replicas())
        # DP gradients are never loss-scaled: apply them with the loss-scale optimizer's inner one.
        optimizer = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        optimizer.apply_gradients(zip(step.gradients, self.model.trainable_variables))
        if not self._front_door:  # a custom loop: no front door refreshes the guard after the step
            self._guard.record_in_step()

        weights = tf.ones([rows]) if sample_weight is None else tf.cast(sample_weight, tf.float32)
        if isinstance(clipped.predictions, tuple) and not clipped.predictions:  # the engine ran no forward pass
            y_pred = self.model(x, training=False)
            losses = tf.cast(loss_fn(y, y_pred), tf.float32)
        else:  # the clipped pass's losses, on its rows; the metrics saw its predictions
            y_pred, losses = None, clipped.predictions
            if clipped.rows is not None:
                weights = tf.gather(weights, clipped.rows)
        weight = tf.reduce_sum(weights)
        loss = tf.math.divide_no_nan(tf.reduce_sum(losses * weights), weight)
        if self.model.losses:
            loss += tf.cast(tf.add_n(self.model.losses), tf.float32)
        self._loss_tracker.update_state(loss, sample_weight=weight)
        logs = (
            self.get_metrics_result() if y_pred is None else self.compute_metrics(x, y, y_pred, sample_weight=weights)
        )
        # This step's own value (the metric above is the epoch's running mean),
        # for callbacks that plot per-step clipping.
        logs["step_clipped_fraction"] = step_clipped_fraction
        return logs

    def _unpack(self, data):
        """``(x, y, sample_weight, unit_ids)`` of a batch; ``unit_ids`` None for example-level privacy."""
        if self.privacy_unit == "unit":
            if not (isinstance(data, tuple) and len(data) == 4):
                raise ValueError(
                    "DPModel(privacy_unit='unit') takes batches (x, y, mask, unit_ids), as "
                    "peg.dp.poisson_batches(..., unit_ids=...) gives them."
                )
            return data
        return (*keras.utils.unpack_x_y_sample_weight(data), None)

    def _symbolic_build(self, iterator=None, data_batch=None):
        """Keras's, on a batch's ``(x, y)`` only.

        The batch's mask (its sample weights) and a unit-level batch's
        ``unit_ids`` create no variables, and a ``[B]`` mask does not broadcast
        against a per-token loss (a language model's ``[B, T]``): Keras's
        symbolic loss failed there, and the optimizer's variables were then
        created in the first trace, which TensorFlow repeats.
        """
        if isinstance(data_batch, tuple) and len(data_batch) > 2:
            data_batch = data_batch[:2]
        return super()._symbolic_build(iterator=iterator, data_batch=data_batch)

    def test_step(self, data):
        """``keras.Model.test_step``; a unit-level batch's ``unit_ids`` play no part in evaluation."""
        if isinstance(data, tuple) and len(data) == 4:
            data = data[:3]
        return super().test_step(data)

    def _losses_and_metrics(self, loss_fn, rows: dict, predictions) -> tf.Tensor:
        """``[b]`` float32 losses of the clipped pass's rows (``aggregator.clipped_sum``'s ``outputs``), the metrics updated on them.

        The pass ran on the real rows only, in training mode, as Keras's own
        ``fit`` reports, and in physical chunks it calls this once a chunk:
        the metrics (streaming, as over an epoch's batches) are updated
        chunk by chunk, and the logical batch's predictions are never held
        at once.
        """
        weights = tf.cast(rows["sample_weight"], tf.float32)
        self.compute_metrics(rows["x"], rows.get("y"), predictions, sample_weight=weights)
        return tf.cast(loss_fn(rows.get("y"), predictions), tf.float32)

    @property
    def sampling_probability(self) -> float | None:
        """``q = cycle_length * expected_batch_size / num_examples``, or None when either is unknown."""
        if self.num_examples is None or self.expected_batch_size is None:
            return None
        return min(1.0, float(self.expected_batch_size) * self.mechanism.cycle_length / self.num_examples)

    def accountant(self, *, accountant: str = "pld", rows_per_user: int | None = None) -> PrivacyAccountant:
        """A ``PrivacyAccountant`` holding the saved ledger (``DPAggregator.accountant``): ``dp_steps`` steps.

        Before the first step, its sampling probability is this run's
        (``sampling_probability``). With ``rows_per_user=k`` (an
        example-level run of DP-SGD), the steps are accounted per user of at
        most ``k`` rows (``accounting.user_level_event``): the epsilon of a
        user, where the data holds no more than ``k`` rows of anyone.

        Raises:
          ValueError: no step yet and no ``num_examples`` and
            ``expected_batch_size``; the network changed outside this DPModel.
        """
        self._check_ledger_covers_network()
        self._check_rows_per_user(rows_per_user)
        if int(self.dp_steps.numpy()) == 0 and self.sampling_probability is None:
            raise ValueError(
                "accounting needs num_examples and expected_batch_size given to DPModel, or a fit on poisson_batches."
            )
        return self.aggregator.accountant(
            accountant=accountant, sampling_probability=self.sampling_probability, rows_per_user=rows_per_user
        )

    def epsilon(self, delta: float, *, accountant: str = "pld", rows_per_user: int | None = None) -> float:
        """ε spent so far: ``self.accountant(accountant=..., rows_per_user=...).epsilon(delta)``.

        ``rows_per_user=k``: per user of at most ``k`` rows (``accountant``).

        The steps counted are those taken, ``dp_steps``; a ``poisson_batches``
        epoch has ``round(1 / q)`` of them, so ``compute_epsilon(..., epochs)``,
        which counts ``ceil(epochs / q)``, can differ by a step.
        """
        if self.num_examples is not None:
            check_run_delta(delta, self.num_examples)
        if int(self.dp_steps.numpy()) == 0:  # nothing spent, whatever the sampling will be
            self._check_ledger_covers_network()
            self._check_rows_per_user(rows_per_user)
            return 0.0
        return self.accountant(accountant=accountant, rows_per_user=rows_per_user).epsilon(delta)

    def monte_carlo_epsilon(
        self, delta: float, *, samples: int | None = None, seed: int | None = 0, progress: bool = False
    ) -> MonteCarloEpsilon:
        """ε spent so far with each example's part random, by Monte Carlo (``peg.dp.monte_carlo_epsilon``).

        A tighter figure than ``epsilon()`` for a run on ``poisson_batches``
        at one noise multiplier and sampling probability, held with the
        probability its ``delta`` folds in; ``seed`` (0 by default) makes it
        reproducible. ``epsilon()``, budgets and the in-step stop keep the
        ledger's deterministic figure.

        Raises:
          ValueError: a pairing it does not account (``composition``), or a
            ledger that is not one such run (``DPAggregator.monte_carlo_epsilon``).
        """
        if self.num_examples is not None:
            check_run_delta(delta, self.num_examples)
        self._check_ledger_covers_network()
        self._check_accounting("DPModel.monte_carlo_epsilon", monte_carlo=True)
        return self.aggregator.monte_carlo_epsilon(delta, samples=samples, seed=seed, progress=progress)

    def _check_rows_per_user(self, rows_per_user: int | None) -> None:
        """Per-user accounting of example-level sampling: a positive int, and parts it accounts (``composition``)."""
        if rows_per_user is not None:
            check_positive_int("rows_per_user", rows_per_user)
            self._check_accounting("DPModel.epsilon", user_rows=rows_per_user)

    def _check_accounting(self, owner: str, **asked) -> None:
        """``composition.check`` of an accounting ``asked`` for (``composition.Parts``' fields) on this ledger's steps."""
        composition.check(
            dataclasses.replace(self._parts, owner=owner, truncated=self.aggregator.truncated_steps(), **asked)
        )

    def save_weights(self, filepath, *args, **kwargs):
        """``keras.Model.save_weights``, with the network's fingerprint as saved (``network_guard``)."""
        self._guard.refresh()
        return super().save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """``keras.Model.load_weights``; a file whose steps another noise mechanism took is refused, naming both.

        (Keras's own message for it is about a count of variables.) The
        wrapped network's own file (``dp.model.save`` / ``save_weights``) loads
        into the network, with the ledger it holds
        (``per_example_grads.keras.network_ledger``).
        """
        if network_ledger.holds_network(filepath):
            return self.model.load_weights(filepath, *args, **kwargs)
        try:
            loaded = super().load_weights(filepath, *args, **kwargs)
        except ValueError:
            saved = self._saved_ledger(filepath)
            if saved is not None:
                self.aggregator.check_saved_ledger(*saved)
            raise
        # Loaded whole, or with skip_mismatch=True past the mechanism's own variables.
        ledger = self.aggregator
        ledger.check_saved_ledger(int(ledger.steps.numpy()), ledger.mechanism_fingerprint.numpy())
        return loaded

    def _saved_ledger(self, filepath) -> tuple[int, Any] | None:
        """``(steps, mechanism fingerprint)`` of a ``.weights.h5`` file's ledger, or None where it has none to read."""
        if not str(filepath).endswith(".weights.h5"):
            return None
        import h5py  # Keras's own dependency for .weights.h5

        own = self.aggregator._trainable_variables + self.aggregator._non_trainable_variables
        index = {id(v): i for i, v in enumerate(own)}
        with h5py.File(filepath, "r") as f:
            saved = f.get("aggregator/vars")
            if saved is None or len(saved) != len(own):
                return None
            steps = saved[str(index[id(self.aggregator.steps)])][()]
            return int(steps), saved[str(index[id(self.aggregator.mechanism_fingerprint)])][()]

    def save(self, filepath, *args, **kwargs):
        """``keras.Model.save``, with the network's fingerprint as saved (``network_guard``)."""
        self._guard.refresh()
        return super().save(filepath, *args, **kwargs)


def _padded_to_multiple(dataset: tf.data.Dataset, m: int, r: int) -> tf.data.Dataset:
    """A ``poisson_batches`` dataset's ``M``-row batches with zero rows added up to a multiple of ``r`` replicas.

    A strategy splits each batch's rows between its replicas and needs the
    same number on each. The added rows have mask 0 (and unit id -1): no
    example, so the step, its noise and its accounting are those of the
    batch as it was.
    """
    extra = -m % r

    def rows(t, value=0):
        return tf.concat([t, tf.fill([extra, *t.shape[1:]], tf.cast(value, t.dtype))], axis=0)

    def pad(x, y, mask, *unit_ids):
        padded = (tf.nest.map_structure(rows, x), tf.nest.map_structure(rows, y), rows(mask))
        return padded + tuple(rows(ids, -1) for ids in unit_ids)

    out = dataset.map(tf.autograph.experimental.do_not_convert(pad))
    out.pegrad_sampling = dataset.pegrad_sampling
    return out


class _GuardNetwork(keras.callbacks.Callback):
    """Records the network's fingerprint after every epoch of a ``fit``, before the user's epoch-end callbacks."""

    def __init__(self, guard: network_guard.NetworkGuard):
        super().__init__()
        self._guard = guard

    def on_epoch_end(self, epoch, logs=None):
        self._guard.refresh()


class _StopAtBudget(keras.callbacks.Callback):
    """Stops ``fit`` before the call of the train function that would take the ledger past ``limit`` steps."""

    def __init__(self, limit: int, steps_per_call: int):
        super().__init__()
        self._limit, self._per_call = limit, steps_per_call

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.dp_steps.numpy()) + self._per_call > self._limit and not self.model.stop_training:
            self.model.stop_training = True
            _warn_budget(self.model, self._limit, stopped=True)


def _warn_budget(model: DPModel, limit: int, *, stopped: bool) -> None:
    steps = int(model.dp_steps.numpy())
    what = f"stopped after DP step {steps}" if stopped else f"took no step ({steps} taken before)"
    warnings.warn(
        f"DPModel.fit {what}: the privacy budget ({model.budget.describe()}) allows {limit} steps, and "
        "the next would exceed it.",
        UserWarning,
        stacklevel=2,
    )


class _ResumeSampling(keras.callbacks.Callback):
    """Starts a ``poisson_batches`` dataset at the step the ledger reached, on the run's partition, after any restore.

    It runs after the user's callbacks' ``on_train_begin``, where
    ``BackupAndRestore`` restores the ledger.
    """

    def __init__(self, source: PoissonSampling, steps):
        super().__init__()
        self._source, self._steps = source, steps

    def on_train_begin(self, logs=None):
        if self._source.partition is not None:
            self.model._keep_partition(self._source)
        self._source.next_step.assign(self._steps)
