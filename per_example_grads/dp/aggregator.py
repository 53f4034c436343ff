"""The DP-SGD step (clip, noise, divide, count), written once.

Every DP path takes its steps through this module, in two phases:

1. the *contribution*: ``clipped_sum`` (the sum of the clipped per-example
   gradients of one batch, with their norms);
2. the *release*: a privatizer (``per_example_grads.dp.privatizers``: the
   noise, drawn once, and the divisor; sparse embedding noise, adaptive
   clipping and an audit's canaries are privatizers too), plus
   ``add_regularization``.

``DPAggregator.step`` is both phases on one batch, with the step counter
and the ledger (``DPModel``);
``GradientAccumulator`` (DP mode) adds the contributions of its
micro-batches and calls ``DPAggregator.release`` once per logical batch;
``private_gradients``, one-shot and stateless, calls ``clipped_sum``,
``batch_divisor``, ``privatizers.noised_average`` and ``add_regularization``
themselves. So all three compute:

    g_tilde_t = ( sum_{i in batch} clip_C(g_i) + N(0, (sigma C)^2 I) ) / D  (+ grad R)

- ``clip_C(g) = g * min(1, C / ||g||)`` (per example; 0 for an example whose
  gradient is NaN or Inf), flat, per layer or adaptive;
- the noise is drawn **once per logical step** ``t`` and is fresh at every
  step whatever the seed (``per_example_grads.dp.noise``): an integer seed is
  folded with the step counter ``t``, which is saved with the weights;
- the divisor ``D`` never depends on the data: the expected batch size, given
  or ``q N`` from the sampling, or the number of rows the batch was *padded
  or cut* to (a constant of the input pipeline), never the realized count;
- ``grad R`` is the gradient of the model's weight regularizers, which do not
  depend on the data and so need neither clipping nor noise;
- one counter, ``steps``, counts every release (noisy gradient) before it is
  applied, and the ledger beside it records the smallest noise multiplier,
  the largest sampling probability and whether every step was Poisson
  sampled, for the accountant.

The aggregator is a Keras layer holding only non-trainable variables, so the
counter and the ledger are saved with ``save_weights``, ``tf.train.Checkpoint``
and ``BackupAndRestore`` wherever the model that owns it is.

Inside ``strategy.run`` each replica clips its own shard and adds its share
of the noise, ``N(0, (sigma C)^2 / R)``; the optimizer's all-reduce sums the
shares into one noised gradient (``per_example_grads._core.replicas``).

The step's functions are marked ``do_not_convert`` (as
``per_example_grads.clipping``'s): ``DPModel.train_step`` is converted by
Keras's ``tf.function``, and AutoGraph would otherwise re-parse all of the
library below it at every trace.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from per_example_grads._core import replicas
from per_example_grads._core.arguments import check_delta, check_dp_arguments, check_positive_int, total_clip
from per_example_grads._core.batch import make_batch
from per_example_grads._core.example_ops import in_dtype
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.clipping import clipped_sums_and_predictions
from per_example_grads.dp import adaptive as adaptive_clipping
from per_example_grads.dp import composition, ledger, privatizers
from per_example_grads.dp.accounting import (
    PrivacyAccountant,
    adaptive_clipping_noise_multiplier,
    truncated_poisson_event,
    user_level_event,
)
from per_example_grads.dp.budget import PrivacyBudget
from per_example_grads.dp.mechanisms import NoiseMechanism, check_mechanism, fingerprint, fingerprint_name
from per_example_grads.dp.monte_carlo import MonteCarloEpsilon, monte_carlo_epsilon
from per_example_grads.dp.noise import NoiseSeed, noise_source
from per_example_grads.dp.sampling import partition_scheme, real_rows, split_into_chunks
from per_example_grads.engines import grouped
from per_example_grads.engines.selection import check_method


@dataclasses.dataclass
class ClippedSum:
    """What one batch (or physical chunk) contributes to a DP step.

    Attributes:
      sums: ``sum_i clip_C(g_i)``, one ``[*var.shape]`` per variable (an
        embedding table's may be ``tf.IndexedSlices``).
      norms: ``[B]`` norms before clipping (over all clipping groups).
      real: ``[B]`` float, 1 for rows with a non-zero sample weight.
      predictions: the model's outputs from the pass that computed
        ``sums``, on the rows ``rows`` of the batch (all rows when ``rows``
        is None), or what ``clipped_sum``'s ``outputs`` made of them;
        ``()`` when that pass gave none (an engine that runs no forward
        pass of the batch).
      rows: ``[b]`` int64 indices of the rows that were computed, or None.
      selection: with sparse embedding noise, the ``(keys, counts)`` of the
        batch's row contributions (``SparseSelection.contribution_counts``).
    """

    sums: list
    norms: tf.Tensor
    real: tf.Tensor
    predictions: Any = ()
    rows: tf.Tensor | None = None
    selection: Any = None

    @property
    def nonfinite(self) -> tf.Tensor:
        """Scalar float: real examples whose gradient was NaN or Inf (left out of ``sums``)."""
        return tf.reduce_sum(tf.cast(~tf.math.is_finite(self.norms), tf.float32) * self.real)


@dataclasses.dataclass
class DPStep:
    """What ``DPAggregator.step`` did: the release and what the training loop reports of it.

    Attributes:
      gradients: the noisy average (plus the regularizers' gradient), one
        ``[*var.shape]`` per variable, for ``optimizer.apply_gradients``.
      clipped: the batch's ``ClippedSum`` (norms, predictions, rows).
      clipped_count, counted: scalar float32, over all replicas: the real
        examples whose norm exceeded the clip norm in force *before* the
        release (an adaptive one moves in it), and the real examples.
    """

    gradients: list
    clipped: ClippedSum
    clipped_count: tf.Tensor
    counted: tf.Tensor

    @property
    def clipped_fraction(self) -> tf.Tensor:
        """``clipped_count / counted``, 0 for a step without real examples."""
        return tf.math.divide_no_nan(self.clipped_count, self.counted)


def batch_divisor(rows) -> tf.Tensor:
    """The divisor when no ``expected_batch_size`` is given: the rows of the (global) batch, at least 1.

    ``rows`` counts the rows the batch was padded or cut to, a constant of
    the input pipeline, never its realized (real-row) count, which the
    noise's scale would reveal. Inside ``strategy.run``, summed over replicas.
    """
    return tf.maximum(replicas.global_sum(tf.cast(rows, tf.float32)), 1.0)


def add_regularization(grads: Sequence, regularization: Sequence | None) -> list:
    """``grads[k] + regularization[k]`` (cast to the gradient's dtype); ``grads`` when there is none.

    A ``tf.IndexedSlices`` entry (a table under sparse embedding noise, which
    ``SparseEmbeddings.bind`` allows only without a regularizer, so its entry
    is zeros) is kept as it is: adding a dense tensor would make it dense.
    """
    if regularization is None:
        return list(grads)
    return [g if isinstance(g, tf.IndexedSlices) else g + tf.cast(r, g.dtype) for g, r in zip(grads, regularization)]


@tf.autograph.experimental.do_not_convert
def clipped_sum(
    model,
    loss_fn,
    x,
    y=None,
    sample_weight=None,
    *,
    l2_norm_clip,
    method: str = "auto",
    training: bool = True,
    variables: Sequence | None = None,
    physical_batch_size: int | None = None,
    unit_ids=None,
    num_units: int | None = None,
    rows_per_unit: int | None = None,
    outputs: Callable[[dict, Any], Any] | None = None,
) -> ClippedSum:
    """``sum_i clip_C(g_i)`` over the batch (in physical chunks if given), with the ``[B]`` norms.

    With ``unit_ids``, each unit's summed gradient is clipped instead
    (``_unit_clipped_sum``), and ``norms`` / ``real`` are per unit.

    ``outputs(rows, predictions)``, when given, is what is kept of the
    pass's predictions (a training loop's per-row losses, its metrics'
    updates): ``rows`` is ``{"x", "y" (if given), "sample_weight"}`` of
    the rows that pass computed, ``predictions`` the model's outputs on
    them, and it returns a structure of ``[rows, ...]`` tensors, kept as
    ``ClippedSum.predictions`` in their place. It is called once on every
    computed row (not on rows of weight 0 that were not computed): in
    physical chunks, once a chunk, so the loop keeps what it returns and
    not a language model's ``[B, T, V]`` logits (for units, and under XLA
    when ``physical_batch_size`` does not divide the rows, once on all the
    rows after the loop, which keeps the predictions: ``_chunked``). Never
    called when the engine gives no predictions.

    ``l2_norm_clip`` is checked already (``check_clip``). Rows of weight 0
    (a Poisson batch's padding) contribute exactly nothing, so outside XLA
    most of them are not computed: the real rows are gathered first, padded
    with zero-weight rows to a multiple of a bucket size
    (``_bucketed_real_rows``), and physical chunks cover only them. The
    result is the same; the *time* a step takes then grows with the realized
    batch size, which an observer of the timing could learn (as with
    Opacus's Poisson sampling). Under XLA, which needs static shapes, every
    row is computed.

    Raises:
      TypeError, ValueError: the inputs, as ``make_batch`` checks them.
    """
    batch = make_batch(model, x, y, sample_weight)
    if unit_ids is not None:
        args = dict(l2_norm_clip=l2_norm_clip, method=method, training=training, variables=variables)
        return _unit_clipped_sum(
            model,
            loss_fn,
            batch["x"],
            batch.get("y"),
            batch.get("sample_weight"),
            unit_ids,
            num_units,
            args,
            physical_batch_size,
            rows_per_unit,
            outputs,
        )
    grouped.units_or_none(None, num_units, batch)  # num_units without unit_ids is refused, not ignored
    args = dict(l2_norm_clip=l2_norm_clip, method=method, training=training, variables=variables)
    x, y, sample_weight = batch["x"], batch.get("y"), batch.get("sample_weight")
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    data = {"x": x} | ({} if y is None else {"y": y})
    if sample_weight is None:
        real, keep = tf.ones([rows]), None
    else:
        real = tf.cast(tf.not_equal(sample_weight, 0), tf.float32)
        data["sample_weight"] = sample_weight
        keep = None if in_xla_context() else _bucketed_real_rows(real)
    if keep is not None:
        data = tf.nest.map_structure(lambda t: tf.gather(t, keep), data)
    if physical_batch_size is None:
        static = tf.nest.flatten(x)[0].shape[0]  # the computed rows are never 0 when the batch's are not
        sums, norms, predictions = clipped_sums_and_predictions(
            model,
            loss_fn,
            data["x"],
            data.get("y"),
            sample_weight=data.get("sample_weight"),
            nonempty=bool(static),
            **args,
        )
        predictions = _kept(outputs, {"sample_weight": tf.ones([rows])} | data, predictions)
    else:
        sums, norms, predictions = _chunked(model, loss_fn, data, args, physical_batch_size, outputs)
    if isinstance(norms, dict):
        norms = tf.sqrt(tf.add_n([tf.square(tf.cast(n, tf.float32)) for n in norms.values()]))
    norms = tf.cast(norms, tf.float32)
    if keep is not None:  # back to the batch's rows; padding has norm 0
        norms = tf.scatter_nd(keep[:, None], norms, [rows])
    return ClippedSum(sums, norms, real, predictions, keep)


def regularization_gradients(model: Any, variables: Sequence) -> list | None:
    """The gradient of the sum of ``model``'s weight regularizers w.r.t. ``variables``, or None if it has none.

    Inside ``strategy.run``, this replica's share (``1 / R`` of it).

    Raises:
      ValueError: the model has an activity regularizer, a data-dependent
        loss that DP-SGD would have to clip and noise per example.
    """
    if not isinstance(model, keras.layers.Layer):
        return None
    layers = list(model._flatten_layers(include_self=True))
    active = [l.name for l in layers if getattr(l, "activity_regularizer", None) is not None]
    if active:
        raise ValueError(
            f"layers {active} have an activity_regularizer: a loss computed from each batch's "
            "activations, which private training cannot add without clipping it per example. "
            "Remove it, or add the penalty to loss_fn per example."
        )
    terms = [(v, v.regularizer) for v in variables if getattr(v, "regularizer", None) is not None]
    if not terms:
        return None
    with tf.GradientTape() as tape:
        total = tf.add_n([tf.cast(r(v), tf.float32) for v, r in terms])
    grads = tape.gradient(total, list(variables))
    share = 1.0 / replicas.num_replicas()  # each replica adds its share; the all-reduce sums them
    return [tf.zeros(v.shape, v.dtype) if g is None else tf.cast(g * share, v.dtype) for g, v in zip(grads, variables)]


def _ledger_variable(value, dtype, name):
    return keras.Variable(value, dtype=dtype, trainable=False, name=name, aggregation="only_first_replica")


class DPAggregator(keras.layers.Layer):
    """The clip settings, noise source, divisor, step counter and privacy ledger of a DP-SGD run.

    Args:
      l2_norm_clip: ``C > 0``, or per-layer ``{layer_name: C_l}`` (see
        ``peg.clipped_gradients``). Ignored when ``adaptive_clipping`` is set.
      noise_multiplier: ``sigma >= 0``, the one the accountant uses.
      expected_batch_size: the divisor (``q N`` under Poisson sampling); None
        divides by the rows of each batch (a constant of the pipeline).
      seed: see ``per_example_grads.dp.noise``; None for real runs.
      adaptive_clipping: ``peg.dp.AdaptiveClipping`` settings, or None.
      physical_batch_size: process each batch in chunks of this many rows
        (flat clipping only).
      method, training: passed to ``clipped_gradients``.
      mechanism: the ``peg.dp.NoiseMechanism`` that turns each step's fresh
        draw into its noise (``per_example_grads.dp.mechanisms``); None is
        ``GaussianNoise()``, DP-SGD. A stateful one (``BandMF``, ``BLT``) is
        given its state by ``attach``, and is this aggregator's alone.

    Attributes:
      steps: int64 variable, the releases so far (the step index ``t`` of the
        next noise draw).
      min_noise_multiplier, max_sampling_probability: float64 ledger variables.
      poisson: int64 variable, 1 while every recorded step was Poisson sampled.
      segments: float64 ``[SEGMENTS, COLUMNS]`` variable, the steps as segments
        of identical releases (``per_example_grads.dp.ledger``).
      partition: int64 ``[5]`` variable, a cyclic run's partition
        (``PoissonSampling.partition``), recorded by the owner; zeros when
        none is recorded.
      mechanism_fingerprint: int64 ``[4]`` variable, the ``fingerprint`` of
        the mechanism that took the ledger's steps (``check_ledger``).
      canaries: None, or a privacy audit's gradient canaries
        (``peg.dp.audit.GradientCanaries``, set by its ``attach``), which
        ``privatizer`` wraps around the noise (``privatizers.CanaryInsertion``).
        None (the default) leaves every release exactly as without it.
      sparse: None, or the ``SparseSelection`` of sparse embedding noise
        (``per_example_grads.dp.sparse_embeddings``, set by the owner from its
        ``sparse_embeddings``): ``clipped_sum`` then also counts the rows each
        example looks up, and ``privatizer`` is ``privatizers.SparseNoise``.
        None (the default) leaves every step as without it.
    """

    def __init__(
        self,
        *,
        l2_norm_clip: Any = 1.0,
        noise_multiplier: Any,
        expected_batch_size: Any = None,
        seed: NoiseSeed = None,
        adaptive_clipping: adaptive_clipping.AdaptiveClipping | None = None,
        physical_batch_size: int | None = None,
        method: str = "auto",
        training: bool = True,
        mechanism: NoiseMechanism | None = None,
        name: str = "dp_aggregator",
    ):
        super().__init__(name=name)
        self.mechanism = check_mechanism(mechanism)
        composition.check(
            composition.Parts(
                "DPAggregator",
                mechanism=self.mechanism,
                adaptive=adaptive_clipping is not None,
                per_layer=composition.per_layer(l2_norm_clip),
                chunks=physical_batch_size,
            )
        )
        if adaptive_clipping is not None:
            l2_norm_clip = adaptive_clipping.initial_l2_norm_clip
        clip, sigma, self.expected_batch_size = check_dp_arguments(l2_norm_clip, noise_multiplier, expected_batch_size)
        self.noise_multiplier = sigma
        check_method(method)
        self.method, self.training = method, training
        if physical_batch_size is not None:
            physical_batch_size = check_positive_int("physical_batch_size", physical_batch_size)
        self.physical_batch_size = physical_batch_size
        self.adaptive = adaptive_clipping
        if adaptive_clipping is not None:
            self._gradient_noise_multiplier = (
                adaptive_clipping_noise_multiplier(
                    sigma, adaptive_clipping.clipped_count_stddev, self.expected_batch_size or 1
                )
                if sigma > 0
                else 0.0
            )
            # every replica computes the same next C from the all-reduced noisy count
            self.l2_norm_clip = _ledger_variable(clip, "float32", "l2_norm_clip")
        else:
            self._gradient_noise_multiplier = sigma
            self.l2_norm_clip = clip
        self.steps = _ledger_variable(0, "int64", "steps")
        self.min_noise_multiplier = _ledger_variable(float("inf"), "float64", "min_noise_multiplier")
        self.max_sampling_probability = _ledger_variable(0.0, "float64", "max_sampling_probability")
        self.poisson = _ledger_variable(1, "int64", "poisson")
        self.partition = _ledger_variable(np.zeros(5, np.int64), "int64", "partition")
        self.mechanism_fingerprint = _ledger_variable(fingerprint(self.mechanism), "int64", "mechanism")
        self.segments = _ledger_variable(ledger.empty(), "float64", "segments")
        self._noise = noise_source(seed)
        self.canaries = None  # a privacy audit's hook (see ``release``); not a weight, never saved
        self.sparse = None  # sparse embedding noise (see ``release``); set by the owner
        self.built = True

    def load_own_variables(self, store) -> None:
        """Keras's; a file saved before the ledger had its newer variables loads without them.

        Before ``segments``: the run is accounted by its worst case (``ledger``).
        Before ``partition`` and ``mechanism_fingerprint`` too: the partition
        is not recorded, and the steps are taken for this mechanism's. A
        table saved before truncated sampling had its columns is widened
        (``ledger.upgraded``).
        """
        own = self._trainable_variables + self._non_trainable_variables
        newer = [self.partition, self.mechanism_fingerprint, self.segments]
        missing = len(own) - len(store.keys())
        if missing < 0 or (missing and not (own[-3:] == newer and missing in (1, 3))):
            return super().load_own_variables(store)  # Keras's error names what does not match
        for i, v in enumerate(own[: len(own) - missing]):
            v.assign(ledger.upgraded(store[f"{i}"]) if v is self.segments else store[f"{i}"])

    def check_ledger(self) -> None:
        """Raises ``ValueError`` if the restored ledger's steps were taken by another mechanism than this one's.

        Those steps would be accounted as this mechanism's: a DP-SGD run's
        as BandMF's reports about half its epsilon. Restored state of the
        mechanism itself is checked by ``NoiseMechanism.check_state``.
        """
        self.mechanism.check_state()
        steps, saved = int(self.steps.numpy()), self.mechanism_fingerprint.numpy()
        if steps == 0:  # no step to account: the run begins with this mechanism
            self.mechanism_fingerprint.assign(fingerprint(self.mechanism))
            return
        self.check_saved_ledger(steps, saved)

    def check_saved_ledger(self, steps: int, saved: np.ndarray) -> None:
        """``check_ledger`` for a saved ledger's ``steps`` and mechanism ``fingerprint`` (``saved``)."""
        if steps == 0 or np.array_equal(saved, fingerprint(self.mechanism)):
            return
        other = fingerprint_name(saved)
        mine = type(self.mechanism).__name__
        raise ValueError(
            f"the restored ledger's {steps} step(s) were taken with a {other} mechanism"
            f"{' with other parameters' if other == mine else ''}, and this DPModel's is a {mine}: they would be "
            f"accounted as {mine}'s steps, which they were not. Restore the run into a DPModel with the mechanism "
            f"that took them ({other}, as it was constructed), or begin a new run."
        )

    # -- the step --------------------------------------------------------

    def attach(self, variables: Sequence) -> None:
        """Gives the mechanism its state for noise shaped like ``variables`` (once, at the owner's construction)."""
        self.mechanism.build_state(list(variables))

    def clip(self):
        """The clip norm in force: a number or dict, or (adaptive) the variable's current value."""
        return (
            tf.convert_to_tensor(self.l2_norm_clip)
            if isinstance(self.l2_norm_clip, keras.Variable)
            else self.l2_norm_clip
        )

    @tf.autograph.experimental.do_not_convert
    def clipped_sum(
        self,
        model,
        loss_fn,
        x,
        y=None,
        sample_weight=None,
        *,
        variables=None,
        unit_ids=None,
        rows_per_unit=None,
        outputs=None,
    ) -> ClippedSum:
        """The module's ``clipped_sum`` at this aggregator's clip norm, engine and physical batch size.

        With sparse embedding noise (``sparse``), also the contributions of
        the rows each real example looks up, over the whole logical batch
        (``ClippedSum.selection``). ``unit_ids``: a unit-level Poisson
        batch's (``[B]``, each unit's rows consecutive, padding ``-1``;
        ``_unit_clipped_sum``), not with sparse embedding noise.
        """
        if unit_ids is not None:
            composition.check(
                composition.Parts(
                    "DPAggregator", units=True, adaptive=self.adaptive is not None, sparse=self.sparse is not None
                )
            )
        clipped = clipped_sum(
            model,
            loss_fn,
            x,
            y,
            sample_weight,
            l2_norm_clip=self.clip(),
            method=self.method,
            training=self.training,
            variables=variables,
            physical_batch_size=self.physical_batch_size,
            unit_ids=unit_ids,
            rows_per_unit=rows_per_unit,
            outputs=outputs,
        )
        if self.sparse is not None:
            self.sparse.check_context()
            clipped.selection = self.sparse.contribution_counts(x, clipped.real)
        return clipped

    @tf.autograph.experimental.do_not_convert
    def step(
        self,
        model,
        loss_fn,
        x,
        y=None,
        sample_weight=None,
        *,
        variables: Sequence | None = None,
        divisor=None,
        sampling_probability=None,
        poisson: bool = True,
        truncation=(0, 0),
        unit_ids=None,
        rows_per_unit=None,
        outputs: Callable[[dict, Any], Any] | None = None,
    ) -> DPStep:
        """One whole DP step on one batch: its clipped sum, then one ``release`` of it.

        Args:
          variables: what the gradients are of (default
            ``model.trainable_variables``); the regularizers' gradient is
            taken w.r.t. them.
          divisor: default ``divisor(rows)``.
          sampling_probability, poisson, truncation: for the ledger, as in ``release``.
          unit_ids, rows_per_unit: a unit-level Poisson batch's units
            (``clipped_sum``); ``clipped_count`` and ``counted`` then count units.
          outputs: what is kept of the predictions (``clipped_sum``).

        Returns:
          a ``DPStep``; its ``clipped_count`` is measured against the clip
          norm the step clipped with (before an adaptive one moves).
        """
        clipped = self.clipped_sum(
            model,
            loss_fn,
            x,
            y,
            sample_weight,
            variables=variables,
            unit_ids=unit_ids,
            rows_per_unit=rows_per_unit,
            outputs=outputs,
        )
        if divisor is None:
            divisor = self.divisor(tf.shape(tf.nest.flatten(x)[0])[0])  # the rows (clipped.real may be per unit)
        clipped_count, counted = self.clipped_fraction(clipped)
        regularization = regularization_gradients(model, model.trainable_variables if variables is None else variables)
        grads = self.release(
            clipped,
            divisor,
            sampling_probability=sampling_probability,
            poisson=poisson,
            truncation=truncation,
            regularization=regularization,
        )
        return DPStep(grads, clipped, clipped_count, counted)

    def divisor(self, rows):
        """``expected_batch_size``, else the rows of the (global) batch (a constant of the pipeline), at least 1."""
        if self.expected_batch_size is not None:
            return self.expected_batch_size
        return batch_divisor(rows)

    @property
    def privatizer(self) -> privatizers.Privatizer:
        """How a step is released: the mechanism's noise (or ``sparse``), inside ``canaries``, inside adaptive clipping.

        Composed from this aggregator's parts at each release
        (``privatizers.compose``), so that an audit's canaries, attached and
        detached between steps, are in the releases they were attached for.
        """
        return privatizers.compose(
            mechanism=self.mechanism,
            noise_multiplier=self._gradient_noise_multiplier,
            noise=self._noise,
            sparse=self.sparse,
            canaries=self.canaries,
            adaptive=self.adaptive,
            clip_norm=self.l2_norm_clip,
        )

    @tf.autograph.experimental.do_not_convert
    def release(
        self,
        clipped: ClippedSum | Sequence,
        divisor,
        *,
        sampling_probability=None,
        poisson: bool = True,
        truncation=(0, 0),
        regularization: Sequence | None = None,
    ) -> list[tf.Tensor]:
        """The noisy average of ``clipped`` (plus ``regularization``), counted as one step.

        ``privatizer`` releases the sums with the noise of step ``t =
        steps`` (and moves an adaptive clip norm); the step is recorded in
        the ledger before returning, so a crash between this and the
        optimizer's update can only over-count.

        Args:
          clipped: the batch's ``ClippedSum``, or only its sums (one
            ``[*var.shape]`` per variable, ``sum_i clip_C(g_i)`` at this
            aggregator's clip norm: a ``GradientAccumulator``'s, added over
            micro-batches). Adaptive clipping and sparse embedding noise
            need a ``ClippedSum``.
          sampling_probability: ``q`` this step was sampled with (None: 1,
            the worst case).
          poisson: whether the batch was Poisson sampled.
          truncation: ``(B, N)`` of a truncated Poisson batch
            (``per_example_grads.dp.truncated``), ``(0, 0)`` otherwise.
          regularization: the regularizers' gradient, added after the noise
            (``add_regularization``).

        Raises:
          ValueError: adaptive clipping or sparse embedding noise given the sums alone.
        """
        given = clipped if isinstance(clipped, ClippedSum) else None
        sums = given.sums if given is not None else list(clipped)
        context = privatizers.ReleaseContext(
            given, self.clip(), divisor, tf.convert_to_tensor(self.steps), sampling_probability
        )
        grads = add_regularization(self.privatizer.release(sums, context), regularization)
        self.record_step(sampling_probability, poisson, truncation)
        return grads

    def record_step(self, sampling_probability=None, poisson: bool = True, truncation=(0, 0)) -> None:
        """Adds one step to the counter and the ledger."""
        q = 1.0 if sampling_probability is None else sampling_probability
        self.steps.assign_add(1)
        self.min_noise_multiplier.assign(
            tf.minimum(self.min_noise_multiplier, tf.constant(self.noise_multiplier, tf.float64))
        )
        self.max_sampling_probability.assign(tf.maximum(self.max_sampling_probability, in_dtype(q, tf.float64)))
        if not poisson:
            self.poisson.assign(0)
        self.segments.assign(
            ledger.recorded(self.segments, self.noise_multiplier, in_dtype(q, tf.float64), poisson, truncation)
        )

    # -- the ledger, accounted ---------------------------------------------

    def composable_segments(self) -> list[ledger.Segment] | None:
        """The ledger's segments, where each is accounted on its own and composed; None where the worst case is.

        That is a mechanism whose noise is independent across steps, and a
        table that adds up to the ``steps`` taken (``per_example_grads.dp.ledger``).
        """
        steps = int(self.steps.numpy())
        if not steps or self.mechanism.correlated or self.mechanism.cycle_length != 1:
            return None
        return ledger.events(self.segments.numpy(), steps)

    def _worst_case(self, sigma: float = math.inf, q: float = 0.0, truncated: bool = False) -> tuple[float, float]:
        """``(sigma, q)`` that every recorded step, and a further one at ``(sigma, q)``, is accounted at in the worst case.

        The smallest noise multiplier and the largest sampling probability;
        half that noise multiplier if a step was or will be (``truncated``)
        truncated Poisson sampled: its dominating event
        (``accounting.truncated_dominating_event``).
        """
        sigma = min(sigma, float(self.min_noise_multiplier.numpy()))
        q = max(q, float(self.max_sampling_probability.numpy()))
        if truncated or self.truncated_steps():
            sigma /= 2.0
        return sigma, q

    def truncated_steps(self) -> bool:
        """Whether the ledger holds truncated Poisson steps (``per_example_grads.dp.truncated``), merged or not."""
        return ledger.holds_truncated(self.segments.numpy())

    def accountant(
        self, *, accountant: str = "pld", sampling_probability: float | None = None, rows_per_user: int | None = None
    ) -> PrivacyAccountant:
        """A ``PrivacyAccountant`` holding the ledger: ``steps`` releases, as ``privatizer`` accounts them.

        With a mechanism whose noise is independent across steps
        (``GaussianNoise``, the default), the steps are the ledger's segments
        (``per_example_grads.dp.ledger``), each run of steps at its own noise
        multiplier and sampling probability, accounted as the privatizer
        says and composed. Otherwise (a correlated mechanism, or a ledger
        restored from a file older than its segments) every step is taken at
        the smallest noise multiplier and the largest sampling probability
        any recorded step used (exactly the run's own when they never
        changed; half that noise multiplier if any step was truncated
        Poisson sampled, its dominating event), so its epsilon never
        under-reports; the privatizer turns
        them into the equivalent ledger (for ``BandMF`` ``ceil(steps / b)``
        steps, for ``BLT`` one Gaussian release). When some step was not
        Poisson sampled, the accountant is a ``sampling="shuffle"`` one,
        which warns that the number is a heuristic.

        Args:
          accountant: ``"pld"`` or ``"rdp"``.
          sampling_probability: ``q`` of the steps to come; read only before
            the first step, which it is then required for.
          rows_per_user: account each segment per user of at most this many
            rows instead (``accounting.user_level_event``); the pairings it
            needs (DP-SGD's noise, per-example clipping) are checked by the owner.
        """
        steps = int(self.steps.numpy())
        sampling = "poisson" if int(self.poisson.numpy()) else "shuffle"
        segments = self.composable_segments()
        if not segments:
            sigma, q = self._worst_case() if steps else (self.noise_multiplier, sampling_probability)
            if q is None:
                raise ValueError(
                    "accounting before the first step needs the sampling probability of the steps to come."
                )
            segments = [ledger.Segment(steps, sigma, q, sampling == "poisson")]
        first = segments[0]  # the accountant's defaults for step(): the run's first noise multiplier and q
        accounted = PrivacyAccountant(
            first.noise_multiplier, first.sampling_probability, accountant=accountant, sampling=sampling
        )
        for s in segments:
            if s.truncated:  # DP-SGD's noise only (composition)
                event = truncated_poisson_event(
                    s.noise_multiplier, s.sampling_probability, s.truncated_batch_size, s.dataset_size, s.steps
                )
            elif rows_per_user is None:
                event = self.privatizer.dp_event(s.noise_multiplier, s.sampling_probability, s.steps)
            else:
                event = user_level_event(s.noise_multiplier, s.sampling_probability, rows_per_user, s.steps)
            accounted.record_event(event)
        return accounted

    def monte_carlo_epsilon(
        self, delta: float, *, samples: int | None = None, seed: int | None = 0, progress: bool = False
    ) -> MonteCarloEpsilon:
        """The ledger's steps accounted by Monte Carlo, each example's part random (``dp.monte_carlo``).

        The ledger must hold one run at one ``(sigma, q)``, every step from
        ``poisson_batches`` (with its partition recorded, for a cycle):
        the dominating pair of ``monte_carlo`` is that run's. The owner
        checks the pairings (``composition``: adaptive clipping and sparse
        noise release more than the mechanism's sum; truncated steps are not
        the pair's sampling).

        Raises:
          ValueError: the steps changed ``sigma`` or ``q``, or were not all
            drawn by ``poisson_batches``, or no partition is recorded, or the
            ledger predates its segments.
        """
        delta, steps = check_delta(delta), int(self.steps.numpy())
        if not steps:
            return MonteCarloEpsilon(epsilon=0.0, delta=delta, base_delta=delta, samples=0, seed=seed)
        segments = ledger.events(self.segments.numpy(), steps)
        refusal = None
        if segments is None:
            refusal = "its ledger was saved before it recorded its segments"
        elif len(segments) > 1:
            refusal = (
                f"its {steps} steps ran at {len(segments)} settings (noise multiplier, sampling probability or "
                "sampler changed), and the Monte-Carlo pair is that of one run at one setting"
            )
        elif not segments[0].poisson:
            refusal = "its steps were not all drawn by poisson_batches (fixed-size or unknown batches)"
        elif self.mechanism.cycle_length > 1:
            partition = self.partition.numpy()
            if int(partition[0]) != self.mechanism.cycle_length:
                what = (
                    "b-min-sep sampled" if partition_scheme(partition) == "min_sep" else "without a recorded partition"
                )
                refusal = f"its steps were {what}, not cyclic Poisson sampled with random parts"
        if refusal is not None:
            raise ValueError(
                f"Monte-Carlo accounting needs a run of poisson_batches steps at one setting, but {refusal}. "
                "Use epsilon() (the ledger's accounting), which covers any run."
            )
        (run,) = segments
        return monte_carlo_epsilon(
            self.mechanism,
            run.noise_multiplier,
            steps,
            delta=delta,
            sampling_probability=run.sampling_probability,
            samples=samples,
            seed=seed,
            progress=progress,
        )

    def max_steps(
        self, budget: PrivacyBudget, sampling_probability: float, poisson: bool = True, truncation=(0, 0)
    ) -> int:
        """The most steps ``budget`` allows this ledger, the next ones sampled at ``sampling_probability``.

        Accounted as ``accountant`` accounts the ledger: the steps taken as
        its segments, then further steps at this aggregator's noise
        multiplier and ``q``, composed; where the worst case is taken (a
        correlated mechanism, a ledger older than its segments), every step
        at the smallest noise multiplier and the largest sampling
        probability used or to be used.
        """
        if budget.steps is not None:
            return int(budget.steps)
        sigma, q = self.noise_multiplier, float(sampling_probability)
        segments = self.composable_segments()
        if segments:  # the ledger as accountant() will account it after more steps at (sigma, q)
            *kept, growing = ledger.projection(segments, sigma, q, poisson, truncation)
            return budget.max_steps(
                noise_multiplier=growing.noise_multiplier,
                sampling_probability=growing.sampling_probability,
                mechanism=self.mechanism,
                taken=[
                    (g.steps, g.noise_multiplier, g.sampling_probability, g.truncated_batch_size, g.dataset_size)
                    for g in (*kept, growing)
                ],
                truncation=(max(growing.truncated_batch_size, 0), growing.dataset_size),
            )
        if int(self.steps.numpy()):
            sigma, q = self._worst_case(sigma, q, truncated=truncation[0] > 0)
            truncation = (0, 0)  # in the worst case, already
        return budget.max_steps(
            noise_multiplier=sigma, sampling_probability=q, mechanism=self.mechanism, truncation=truncation
        )

    def clipped_fraction(self, clipped: ClippedSum) -> tuple[tf.Tensor, tf.Tensor]:
        """``(clipped, counted)``: real examples over the clip norm, and real examples, over all replicas."""
        over = tf.cast(clipped.norms > tf.cast(total_clip(self.clip()), tf.float32), tf.float32)
        return tuple(replicas.global_sum([tf.reduce_sum(over * clipped.real), tf.reduce_sum(clipped.real)]))


def _chunked(model, loss_fn, data, args, p, outputs=None):
    """Clipped sums, norms and predictions of ``data``'s rows, ``p`` (the physical batch size) at a time, in a loop.

    Outside XLA the chunks are the rows ``[i P, (i + 1) P)``, the last
    one shorter: no padding is computed beyond the bucket that
    ``clipped_sum`` rounded the real rows up to, so the last chunk takes
    one of a few sizes (multiples of that bucket) and TensorFlow's
    per-shape kernel set-up is reused (``_bucketed_real_rows``). Padded
    to whole chunks, the last chunk computed ``P / 2`` padding rows per
    step on average. Under XLA, which needs static shapes, every chunk
    has ``P`` rows, the last zero-padded (weight 0).

    The predictions of every chunk's pass are kept (``()`` when its
    engine gives none), so a training step needs no extra forward pass
    for its loss and metrics; with ``outputs`` (``clipped_sum``), what it
    makes of each chunk's rows and predictions is kept instead, in the
    loop, so the logical batch's predictions (a language model's
    ``[B, T, V]`` logits) are never held at once. Under XLA, where every
    chunk has ``P`` rows, that holds when ``P`` divides the rows; otherwise
    it is called once after the loop, on the rows without the last chunk's
    zero padding (which unweighted metrics would count). An
    embedding table's ``tf.IndexedSlices`` sums are kept as rows, made
    dense once (with the noise), not per chunk. One chunk's step is
    traced once, as a function, so that the loop knows the structure of
    its outputs before it starts.
    """
    n = tf.shape(tf.nest.flatten(data)[0])[0]
    # Every row weighs 1 unless weighted; zero padding then weighs 0.
    rows = {"sample_weight": tf.ones([n])} | data
    fixed = in_xla_context()
    static = tf.nest.flatten(data)[0].shape[0]
    per_chunk = not fixed or (static is not None and static % p == 0)  # outputs never see zero padding
    if fixed:
        chunks, count = split_into_chunks(rows, p)
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), chunks)
        take = lambda i: tf.nest.map_structure(lambda t: t[i], chunks)  # noqa: E731
    else:
        count = tf.maximum(1, (n + p - 1) // p)
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), rows)
        take = lambda i: tf.nest.map_structure(lambda t: t[i * p : (i + 1) * p], rows)  # noqa: E731
    variables = args["variables"] if args["variables"] is not None else model.trainable_variables

    def one_chunk(part):
        units = {"unit_ids": part["unit_ids"]} if "unit_ids" in part else {}  # whole units (_unit_clipped_sum)
        s, m, pred = clipped_sums_and_predictions(
            model, loss_fn, part["x"], part.get("y"), sample_weight=part["sample_weight"], **args, **units
        )
        return s, tf.cast(m, tf.float32), _kept(outputs, part, pred) if per_chunk else pred

    step = tf.function(one_chunk, autograph=False).get_concrete_function(spec)
    sums_spec, _, predictions_spec = step.structured_outputs
    sliced = [isinstance(t, tf.IndexedSlices) for t in sums_spec]

    def array(t, rows_vary=not fixed):
        return tf.TensorArray(
            t.dtype, size=count, element_shape=None if rows_vary else t.shape, infer_shape=not rows_vary
        )

    def start(t, is_sliced):  # a dense running sum, or the rows (values, indices) of every chunk
        return (array(t.values, True), array(t.indices, True)) if is_sliced else tf.zeros(t.shape, t.dtype)

    def add(i, total, t, is_sliced):
        return (total[0].write(i, t.values), total[1].write(i, t.indices)) if is_sliced else total + t

    def body(i, sums, norms, predictions):
        s, m, pred = step(take(i))
        written = tf.nest.map_structure(lambda a, t: a.write(i, t), predictions, pred)
        return i + 1, [add(i, a, b, k) for a, b, k in zip(sums, s, sliced)], norms.write(i, m), written

    _, sums, norms, predictions = tf.while_loop(
        lambda i, *_: i < count,
        body,
        (
            tf.constant(0),
            [start(t, k) for t, k in zip(sums_spec, sliced)],
            array(tf.TensorSpec([None])),
            tf.nest.map_structure(array, predictions_spec),
        ),
        parallel_iterations=1,  # one chunk at a time: the default 10 let chunks overlap, holding up to 10 chunks' memory
    )

    def rows_of(a, t):  # the n rows: chunks concatenated, or [C, P, ...] stacked and the padding cut
        if fixed:
            stacked = a.stack()
            return tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], 0))[:n]
        out = a.concat()
        out.set_shape(t.shape)  # [None, ...] as one chunk's
        return out

    sums = [
        tf.IndexedSlices(total[0].concat(), total[1].concat(), tf.constant([int(d) for d in v.shape], tf.int64))
        if k
        else total
        for total, k, v in zip(sums, sliced, variables)
    ]
    predictions = tf.nest.map_structure(rows_of, predictions, predictions_spec)
    return sums, rows_of(norms, tf.TensorSpec([None])), predictions if per_chunk else _kept(outputs, rows, predictions)


def _kept(outputs, rows: dict, predictions):
    """``outputs(rows, predictions)`` (``clipped_sum``), or the predictions when there is no ``outputs`` or none to give it."""
    if outputs is None or (isinstance(predictions, tuple) and not predictions):
        return predictions
    return outputs(rows, predictions)


def _unit_clipped_sum(
    model, loss_fn, x, y, sample_weight, unit_ids, num_units, args, physical_batch_size, rows_per_unit, outputs=None
) -> ClippedSum:
    """``sum_u clip_C(G_u)`` over the units of a unit-level Poisson batch, with the ``[U_b]`` unit norms.

    ``G_u`` is the sum of unit ``u``'s rows' weighted gradients (the engine's
    grouped clipped sums, ``clipped_gradients(..., unit_ids=...)``), so
    removing a unit changes the sum by at most ``C``. The batch's ids are
    made dense, ``0 .. U_b - 1`` in order of first appearance (a unit's
    rows need not be consecutive; padding rows, id ``-1`` as
    ``poisson_batches(..., unit_ids=...)`` gives them, form one more unit of
    weight 0, or join a real unit of id ``-1``, adding nothing to it). The
    result's ``norms`` and ``real`` are per dense unit (``real`` 1 for a
    unit with a real row); ``predictions`` and ``rows`` are per row, as
    without units.

    Physical chunks keep units whole: each chunk holds ``m = floor(P / k)``
    units in ``k = rows_per_unit`` slots each (``m k <= P`` rows, slots a
    unit does not fill are zero rows of weight 0), so a unit's gradient is
    summed before it is clipped, in one chunk. Every chunk has the same
    shape. Outside XLA only the real rows are laid out (as without units);
    under XLA every row of the batch, ``ceil(B / m)`` chunks.
    """
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    data = {"x": x} | ({} if y is None else {"y": y})
    data["sample_weight"] = tf.ones([rows]) if sample_weight is None else sample_weight
    real = tf.cast(tf.not_equal(data["sample_weight"], 0), tf.float32)
    data["ids"] = tf.cast(grouped.checked_unit_ids(unit_ids, x), tf.int64)
    keep = None if in_xla_context() else _bucketed_real_rows(real)
    if keep is not None:
        data = tf.nest.map_structure(lambda t: tf.gather(t, keep), data)
    ids = data.pop("ids")
    kept_real = tf.cast(tf.not_equal(data["sample_weight"], 0), tf.float32)
    # dense unit of each row, in order of first appearance (all the rows of one id are one unit)
    dense = tf.cast(ids, tf.int32) if num_units is not None else tf.unique(ids, out_idx=tf.int32).idx
    count = tf.reduce_max(tf.concat([dense, [-1]], 0)) + 1
    if physical_batch_size is None:
        sums, norms, predictions = clipped_sums_and_predictions(
            model,
            loss_fn,
            data["x"],
            data.get("y"),
            sample_weight=data["sample_weight"],
            unit_ids=dense,
            num_units=num_units,
            **args,
        )
    elif num_units is not None:
        raise ValueError("physical chunks of units need the ids of a unit-level Poisson batch, not num_units.")
    else:
        sums, norms, predictions = _whole_unit_chunks(
            model, loss_fn, data, dense, count, args, physical_batch_size, rows_per_unit
        )
    if isinstance(norms, dict):
        norms = tf.sqrt(tf.add_n([tf.square(tf.cast(v, tf.float32)) for v in norms.values()]))
    norms = tf.cast(norms, tf.float32)
    unit_real = tf.math.unsorted_segment_max(kept_real, dense, tf.shape(norms)[0])
    return ClippedSum(sums, norms, tf.maximum(unit_real, 0.0), _kept(outputs, data, predictions), keep)


def whole_units_on_replicas(x, y, sample_weight, unit_ids) -> tuple:
    """``(x, y, sample_weight, unit_ids)`` of a unit-level batch as this replica clips it: each unit on one replica.

    Inside ``strategy.run`` with ``R > 1`` replicas each replica holds a
    shard of the batch's rows, and a unit's rows can straddle two shards;
    clipping each shard's part of it would let one unit move the all-reduced
    sum by up to ``R C``. So every replica all-gathers the global batch (its
    inputs, ids and weights, not gradients) and keeps the weights of the
    units whose dense index (order of first appearance in the global batch)
    is its replica id modulo ``R``, zero elsewhere (rows of weight 0 are not
    computed: ``clipped_sum``). Every unit is then clipped whole on exactly
    one replica, so the shares that the optimizer's all-reduce adds sum to
    the one-device ``sum_u clip_C(G_u)``, and removing a unit changes that
    sum by at most ``C``; each replica's noise share stays ``N(0, (sigma
    C)^2 / R)``. Outside a multi-replica ``strategy.run``, the arguments as
    they are. ``unit_ids`` are checked (``grouped.checked_unit_ids``) either way.
    """
    ids = grouped.checked_unit_ids(unit_ids, x)  # before the cast below, which would merge 1.2 and 1.7 silently
    r = replicas.num_replicas()
    if r == 1:
        return x, y, sample_weight, unit_ids
    ctx = tf.distribute.get_replica_context()
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    weight = tf.ones([rows]) if sample_weight is None else tf.cast(sample_weight, tf.float32)
    tree = {"x": x, "w": weight, "ids": tf.cast(ids, tf.int64)} | ({} if y is None else {"y": y})
    # all_gather keeps no static shape: the trailing dimensions are each leaf's own
    tree = tf.nest.map_structure(
        lambda g, t: tf.ensure_shape(g, [None, *t.shape[1:]]), ctx.all_gather(tree, axis=0), tree
    )
    dense = tf.unique(tree["ids"], out_idx=tf.int32).idx
    mine = tf.equal(dense % r, tf.cast(ctx.replica_id_in_sync_group, tf.int32))
    return tree["x"], tree.get("y"), tree["w"] * tf.cast(mine, tf.float32), tree["ids"]


def _whole_unit_chunks(model, loss_fn, data, dense, count, args, p, k):
    """Physical chunks of whole units (``_unit_clipped_sum``): sums, ``[C m]`` unit norms, per-row predictions."""
    if k is None or k > p:
        raise ValueError(
            f"physical chunks keep units whole: rows_per_unit ({k}) must be given and at most physical_batch_size ({p})."
        )
    m = p // k
    n = tf.shape(dense)[0]
    positions = tf.range(n)
    # each row's rank among its unit's rows (the rows of a unit need not be consecutive)
    order = tf.argsort(dense, stable=True)  # rows grouped by unit
    grouped = tf.gather(dense, order)
    first = tf.math.unsorted_segment_min(positions, grouped, tf.maximum(count, 1))
    within = tf.scatter_nd(order[:, None], positions - tf.gather(first, grouped), [n])
    placed = tf.not_equal(data["sample_weight"], 0)  # rows of weight 0 add nothing and get no slot
    check = tf.debugging.assert_less(
        tf.where(placed, within, 0), k, message=f"a unit has more than rows_per_unit={k} rows in the batch"
    )
    with tf.control_dependencies([check]):
        slot = tf.where(placed, dense * k + within, 0)  # [n]; unplaced rows read slot 0's predictions (weight 0)
    static = tf.nest.flatten(data["x"])[0].shape[0]
    if in_xla_context() and static is not None:
        chunks = max(1, -(-static // m))
    else:
        chunks = tf.maximum(1, (count + m - 1) // m)
    slots = chunks * m * k
    # source row of every slot, 0 for an empty one (a zero row of weight 0 put in front)
    source = tf.scatter_nd(
        tf.boolean_mask(slot, placed)[:, None], tf.boolean_mask(positions, placed) + 1, tf.reshape(slots, [1])
    )
    laid = tf.nest.map_structure(lambda t: tf.gather(tf.concat([tf.zeros_like(t[:1]), t], 0), source), data)
    laid["unit_ids"] = (tf.range(slots) // k) % m  # the unit's place within its chunk
    sums, norms, predictions = _chunked(model, loss_fn, laid, dict(args, num_units=m), m * k)
    predictions = tf.nest.map_structure(lambda t: tf.gather(t, slot), predictions)
    return sums, norms, predictions


def _bucketed_real_rows(real: tf.Tensor) -> tf.Tensor:
    """Indices of the real rows, then of zero-weight rows up to a multiple of a bucket size: ``[b']``.

    The row count of the computed batch then takes only a few values (one
    per bucket) instead of a new one at every step. It is at least one
    bucket (or every row, if fewer), even when no row is real: zero-weight
    rows contribute exactly nothing, and a batch with rows then never
    computes an empty one, so the step needs no branch for it
    (``unless_empty``'s ``nonempty``). TensorFlow's CPU kernels
    (oneDNN) set up each convolution and matrix product per input shape and
    cache that, so a new shape at every step is much slower than a repeated
    one (``benchmarks/RESULTS.md``). The bucket is the power of two
    nearest ``sqrt(rows)`` (16 for 375 rows: about 8 extra rows on average);
    physical chunks then have ``P`` rows but the last, a multiple of it (or
    a few sizes more when ``P`` is not).
    """
    rows = tf.size(real)
    static = real.shape[0]
    bucket = 2 ** round(math.log2(math.sqrt(static))) if static else 16
    keep = tf.concat([real_rows(real), tf.where(tf.equal(real, 0))[:, 0]], axis=0)
    b = tf.cast(tf.reduce_sum(real), tf.int32)
    target = tf.minimum(rows, tf.maximum(bucket, (b + bucket - 1) // bucket * bucket))
    return keep[:target]
