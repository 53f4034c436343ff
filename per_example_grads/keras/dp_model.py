"""``DPModel``: DP-SGD through the ordinary Keras ``compile`` / ``fit`` workflow."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from per_example_grads import replicas
from per_example_grads.clipping import clipped_gradients, dense_sums
from per_example_grads.dp import adaptive as adaptive_clipping
from per_example_grads.dp import validation
from per_example_grads.dp.accounting import PrivacyAccountant, adaptive_clipping_noise_multiplier
from per_example_grads.dp.private import check_dp_arguments, noise_stddev, noised_average
from per_example_grads.losses import as_per_example_loss


class DPModel(keras.Model):
    """A Keras model trained with DP-SGD.

    Each ``train_step``:

    1. computes every example's gradient of its own loss (times its
       ``sample_weight``) and clips it to global L2 norm ``l2_norm_clip``;
    2. sums them and adds Gaussian noise of std ``noise_multiplier *
       l2_norm_clip`` once;
    3. divides by ``expected_batch_size`` (default: the rows in the batch) and
       applies the result with the compiled optimizer.

    ``compile``, ``fit``, ``evaluate``, ``predict``, callbacks and metrics work
    as usual. Supported losses: one loss (a ``keras.losses.Loss`` with any
    reduction, a loss function or name) whose per-example values the model
    takes itself; multi-output loss lists/dicts, ``loss_weights`` and
    regularization losses are not supported. ``sample_weight`` multiplies
    each example's loss *before* clipping, so every example's contribution
    stays bounded by the clip norm; a Poisson batch's mask is passed as
    ``sample_weight`` (padded rows then contribute nothing). The reported
    ``loss`` and metrics come from an inference-mode forward pass on the batch
    before the update. ``clipped_fraction`` (epoch running mean) and
    ``step_clipped_fraction`` (this step's) are logged as well; they are
    computed from the private gradient norms, so do not publish them without
    accounting for them.

    Saving: save the wrapped network, ``dp_model.model.save("m.keras")``, or
    use ``save_weights`` / checkpoints / ``keras.callbacks.BackupAndRestore``
    on the DPModel itself. Those include the privacy ledger, three
    non-trainable variables: ``dp_steps`` (steps applied), and the smallest
    noise multiplier and largest sampling probability any of them used. A
    restarted run restores and keeps counting them, so ``epsilon()`` after a
    restart equals that of an uninterrupted run with as many steps, and it can
    only over-report (never under-report) if a restart changed ``sigma`` or
    ``q``.

    Under ``tf.distribute`` (build and compile the DPModel inside
    ``strategy.scope()``): each replica clips the examples of its shard and
    adds ``N(0, (sigma C)^2 / R)``; Keras's optimizer all-reduces the ``R``
    shares (``P`` floats each) into one step with noise ``N(0, (sigma C)^2)``,
    divided by ``expected_batch_size`` (default: the rows of the *global*
    batch). See ``per_example_grads.replicas``.

    Args:
      model: the Keras model to train privately.
      l2_norm_clip: ``C > 0``, or per-layer ``{layer_name: C_l}`` (see
        ``peg.clipped_gradients``). Ignored when ``adaptive_clipping`` is set.
      noise_multiplier: ``sigma >= 0``, the one the accountant uses.
      expected_batch_size: ``q * N`` under Poisson sampling; default the
        batch's number of rows.
      num_examples: ``N``, for ``epsilon()``.
      seed: None (OS entropy, for real use) or an int (reproducible noise).
      adaptive_clipping: ``peg.dp.AdaptiveClipping`` settings, or None.
      method: per-example gradient engine (``"auto"`` prefers layer-wise).
      physical_batch_size: process each (logical) batch in chunks of this many
        rows, summing their clipped gradients in a loop before the single
        noise draw, so ``fit`` can use logical batches far larger than fit in
        memory (e.g. Poisson batches of 4096 in chunks of 64). Flat clipping only.

    Example:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
      >>> dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.1, seed=0)
      >>> dp.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
      >>> history = dp.fit(np.ones((16, 4), "float32"), np.arange(16) % 3, batch_size=8, verbose=0)
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
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_dp_arguments(l2_norm_clip, noise_multiplier, expected_batch_size)
        validation.check_model(model, training=True)
        self.model = model
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self.num_examples = num_examples
        self.method = method
        if physical_batch_size is not None:
            if not (isinstance(physical_batch_size, int) and physical_batch_size > 0):
                raise ValueError(f"physical_batch_size must be a positive int; got {physical_batch_size!r}.")
            if not isinstance(l2_norm_clip, (int, float)):
                raise ValueError("physical_batch_size supports a single (flat) l2_norm_clip.")
        self.physical_batch_size = physical_batch_size
        self.adaptive = adaptive_clipping
        if adaptive_clipping is not None:
            self._gradient_noise_multiplier = adaptive_clipping_noise_multiplier(
                noise_multiplier, adaptive_clipping.clipped_count_stddev, expected_batch_size or 1
            ) if noise_multiplier > 0 else 0.0
            self.l2_norm_clip = keras.Variable(
                adaptive_clipping.initial_l2_norm_clip, dtype="float32", trainable=False, name="l2_norm_clip",
                aggregation="only_first_replica",  # every replica computes the same next C
            )
        else:
            self._gradient_noise_multiplier = self.noise_multiplier
            self.l2_norm_clip = l2_norm_clip
        # The privacy ledger, saved with the weights (see the class docstring).
        ledger = dict(trainable=False, aggregation="only_first_replica")
        self.dp_steps = keras.Variable(0, dtype="int64", name="dp_steps", **ledger)
        self.dp_min_noise_multiplier = keras.Variable(float("inf"), dtype="float64", name="dp_min_noise_multiplier", **ledger)
        self.dp_max_sampling_probability = keras.Variable(0.0, dtype="float64", name="dp_max_sampling_probability", **ledger)
        with tf.init_scope():
            self._noise = (
                tf.random.Generator.from_non_deterministic_state() if seed is None
                else tf.random.Generator.from_seed(seed)
            )
        self._clipped_fraction = keras.metrics.Mean(name="clipped_fraction")

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def metrics(self):
        return super().metrics + [self._clipped_fraction]

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if isinstance(self.loss, (list, tuple, dict)):
            raise ValueError("DPModel supports one loss for one output; got a list or dict of losses.")
        loss_fn = as_per_example_loss(self.loss)
        y_pred = self.model(x, training=False)

        clip = tf.convert_to_tensor(self.l2_norm_clip) if isinstance(self.l2_norm_clip, keras.Variable) else self.l2_norm_clip
        sums, norms = self._clipped_sums(loss_fn, x, y, sample_weight, clip)
        rows = tf.shape(tf.nest.flatten(x)[0])[0]
        divisor = self.expected_batch_size if self.expected_batch_size is not None else tf.maximum(replicas.global_sum(rows), 1)
        real = tf.ones([rows]) if sample_weight is None else tf.cast(tf.not_equal(sample_weight, 0), tf.float32)
        global_norms = norms if not isinstance(norms, dict) else tf.sqrt(tf.add_n([tf.square(n) for n in norms.values()]))
        clip_total = noise_stddev(clip, 1.0)
        clipped, counted = replicas.global_sum(
            [tf.reduce_sum(tf.cast(global_norms > clip_total, tf.float32) * real), tf.reduce_sum(real)]
        )
        step_clipped_fraction = tf.math.divide_no_nan(clipped, counted)
        self._clipped_fraction.update_state(step_clipped_fraction)
        grads = noised_average(sums, noise_stddev(clip, self._gradient_noise_multiplier), divisor, self._noise)
        if self.adaptive is not None:
            self.l2_norm_clip.assign(
                adaptive_clipping.updated_clip(self.adaptive, clip, global_norms, real, divisor, self._noise)
            )
        # The ledger is updated before the step is applied: a crash in between
        # can only over-count.
        self._record_step()
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))

        # compute_loss divides by the replicas in sync (for Keras's own
        # gradient all-reduce); the tracker wants this replica's mean loss.
        loss = self.compute_loss(x, y, y_pred, sample_weight) * replicas.num_replicas()
        self._loss_tracker.update_state(loss, sample_weight=rows)
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        # This step's own value (the metric above is the epoch's running mean),
        # for callbacks that plot per-step clipping.
        logs["step_clipped_fraction"] = step_clipped_fraction
        return logs

    def _clipped_sums(self, loss_fn, x, y, sample_weight, clip):
        """Clipped-gradient sums and ``[rows]`` norms, in physical chunks if asked."""
        clip_args = dict(l2_norm_clip=clip, return_norms=True, method=self.method, training=True)
        if self.physical_batch_size is None:
            return clipped_gradients(self.model, loss_fn, x, y, sample_weight=sample_weight, **clip_args)
        p = self.physical_batch_size
        rows = tf.shape(tf.nest.flatten(x)[0])[0]
        chunks = (rows + p - 1) // p
        weights = tf.ones([rows]) if sample_weight is None else tf.cast(sample_weight, tf.float32)
        data = {"x": x, "sample_weight": weights} | ({} if y is None else {"y": y})

        def chunked(t):  # [rows, ...] -> [chunks, p, ...], zero-padded (weight 0)
            t = tf.convert_to_tensor(t)
            t = tf.pad(t, [[0, chunks * p - rows]] + [[0, 0]] * (t.shape.rank - 1))
            return tf.reshape(t, tf.concat([[chunks, p], tf.shape(t)[1:]], 0))

        data = tf.nest.map_structure(chunked, data)
        variables = self.model.trainable_variables

        def body(i, sums, norms):
            part = tf.nest.map_structure(lambda t: t[i], data)
            s, n = clipped_gradients(
                self.model, loss_fn, part["x"], part.get("y"), sample_weight=part["sample_weight"], **clip_args
            )
            return i + 1, [a + b for a, b in zip(sums, dense_sums(s))], norms.write(i, n)

        _, sums, norms = tf.while_loop(
            lambda i, *_: i < chunks,
            body,
            (tf.constant(0), [tf.zeros(v.shape, v.dtype) for v in variables], tf.TensorArray(tf.float32, size=chunks)),
        )
        return sums, tf.reshape(norms.stack(), [-1])[:rows]

    @property
    def sampling_probability(self) -> float | None:
        """``q = expected_batch_size / num_examples``, or None when either is unknown."""
        if self.num_examples is None or self.expected_batch_size is None:
            return None
        return min(1.0, float(self.expected_batch_size) / self.num_examples)

    def _record_step(self) -> None:
        """Adds this step to the ledger variables (an unknown ``q`` is recorded as 1, the worst case)."""
        q = self.sampling_probability
        self.dp_steps.assign_add(1)
        self.dp_min_noise_multiplier.assign(
            tf.minimum(self.dp_min_noise_multiplier, tf.constant(self.noise_multiplier, tf.float64))
        )
        self.dp_max_sampling_probability.assign(
            tf.maximum(self.dp_max_sampling_probability, tf.constant(1.0 if q is None else q, tf.float64))
        )

    def accountant(self, *, accountant: str = "pld") -> PrivacyAccountant:
        """A ``PrivacyAccountant`` holding the saved ledger: ``dp_steps`` Poisson-sampled steps.

        It uses the smallest noise multiplier and the largest sampling
        probability any recorded step used (exactly the run's own when they
        never changed), so its epsilon never under-reports.
        """
        if self.sampling_probability is None:
            raise ValueError("accounting needs num_examples and expected_batch_size given to DPModel.")
        steps = int(self.dp_steps.numpy())
        sigma = float(self.dp_min_noise_multiplier.numpy()) if steps else self.noise_multiplier
        q = float(self.dp_max_sampling_probability.numpy()) if steps else self.sampling_probability
        ledger = PrivacyAccountant(sigma, q, accountant=accountant)
        ledger.step(steps)
        return ledger

    def epsilon(self, delta: float, *, accountant: str = "pld") -> float:
        """ε spent so far: ``self.accountant(accountant=...).epsilon(delta)``."""
        return self.accountant(accountant=accountant).epsilon(delta)
