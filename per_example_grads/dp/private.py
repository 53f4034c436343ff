"""``private_gradients``: one DP-SGD gradient, ready for ``optimizer.apply_gradients``.

For a batch with per-example gradients ``g_i``:

    g_tilde = ( sum_i clip_C(g_i) + N(0, (sigma * C)^2 I) ) / expected_batch_size

with ``clip_C(g) = g * min(1, C / ||g||)``. Noise is added exactly once, to the
sum, and the division is by the *expected* batch size (``q * N`` under Poisson
sampling), not by the realized one, which would itself leak information.

Inside ``strategy.run`` each replica clips its own shard and adds its share
of the noise, ``N(0, (sigma C)^2 / R)``; the optimizer's all-reduce sums the
shares into one noised gradient (``per_example_grads._core.replicas``).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from per_example_grads._core import replicas
from per_example_grads._core.arguments import check_dp_arguments, total_clip
from per_example_grads._core.problem import resolve_variables
from per_example_grads.dp.aggregator import (
    add_regularization,
    batch_divisor,
    clipped_sum,
    regularization_gradients,
    whole_units_on_replicas,
)
from per_example_grads.dp.noise import NoiseSeed, RepeatedNoiseWarning, stateless_key
from per_example_grads.dp.privatizers import noised_average


@tf.autograph.experimental.do_not_convert
def private_gradients(
    model: Any,
    loss_fn: Any,
    x: Any,
    y: Any = None,
    *,
    l2_norm_clip,
    noise_multiplier: float,
    seed: NoiseSeed = None,
    expected_batch_size: float | None = None,
    sample_weight: Any = None,
    method: str = "auto",
    variables: Sequence | None = None,
    training: bool = False,
    unit_ids: Any = None,
    num_units: int | None = None,
) -> list[tf.Tensor]:
    """The noised, averaged clipped gradient of one DP-SGD step.

    Args:
      model, loss_fn, x, y, variables, training, method: as in
        ``per_example_gradients``.
      l2_norm_clip: ``C > 0``, or per-layer clip norms (see
        ``clipped_gradients``).
      noise_multiplier: ``sigma >= 0``; the noise std is ``sigma * C``.
      seed: where the noise comes from; see ``per_example_grads.dp.noise``.
        ``None`` seeds from the operating system's entropy. This function
        has no step counter: the same int or pair gives the same noise, so
        vary it every step (``seed=(run_seed, step)``), or use a
        ``tf.random.Generator``. Two releases with the same noise cancel it
        in their difference, so a ``RepeatedNoiseWarning`` fires (once per
        seed) when an int or pair seed is used a second time in one process,
        and when one is used inside a ``tf.function`` (each call of the
        traced function would draw the same noise).
      expected_batch_size: the divisor; pass ``q * N`` with Poisson sampling.
        Defaults to the number of rows ``B`` (of the global batch, inside
        ``strategy.run``): the padded size of a Poisson batch, never the
        count of its real rows, which the noise would then reveal.
      sample_weight: ``[B]``; a Poisson batch's mask goes here (padded rows
        weigh 0 and contribute exactly nothing).
      unit_ids, num_units: user-level DP (as in ``clipped_gradients``):
        ``[B]`` integers in ``[0, num_units)``, the privacy unit of each row.
        Each unit's summed gradient is clipped to ``C`` instead of each
        row's, so the release protects all the rows of a unit (accounted
        over the number of units, with units Poisson-sampled: see
        ``poisson_batches(..., unit_ids=...)``). ``expected_batch_size`` is
        then required, ``q U``: the number of units in a batch is data.
        Inside ``strategy.run`` a unit whose rows are on several replicas is
        clipped whole on one of them (``whole_units_on_replicas``).

    Returns:
      list of ``[*var.shape]`` tensors aligned with the variables (plus the
      gradient of the model's weight regularizers, which needs no noise), for
      ``optimizer.apply_gradients(zip(grads, variables))``. Inside
      ``strategy.run``, this replica's share: the shares sum (as the
      optimizer's all-reduce does) to the noised gradient of the global batch.

    Examples:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
      >>> grads = peg.dp.private_gradients(model, loss, np.ones((8, 3), "float32"),
      ...     np.arange(8) % 2, l2_norm_clip=1.0, noise_multiplier=1.1, seed=(0, 1))
      >>> [tuple(g.shape) for g in grads]
      [(3, 2), (2,)]
    """
    l2_norm_clip, noise_multiplier, expected_batch_size = check_dp_arguments(
        l2_norm_clip, noise_multiplier, expected_batch_size
    )
    if unit_ids is not None and expected_batch_size is None:
        raise ValueError(
            "private_gradients with unit_ids needs expected_batch_size = q U, the expected number of units of "
            "a batch (the divisor must not depend on how many units or rows the batch has)."
        )
    _warn_if_noise_repeats(seed)
    if unit_ids is not None:  # several replicas: every unit clipped whole on one of them (sensitivity C, not R C)
        x, y, sample_weight, unit_ids = whole_units_on_replicas(x, y, sample_weight, unit_ids)
    # The DP step's two phases (per_example_grads.dp.aggregator), without its counter and ledger.
    clipped = clipped_sum(
        model,
        loss_fn,
        x,
        y,
        sample_weight,
        l2_norm_clip=l2_norm_clip,
        method=method,
        training=training,
        variables=variables,
        unit_ids=unit_ids,
        num_units=num_units,
    )
    divisor = expected_batch_size if expected_batch_size is not None else batch_divisor(tf.shape(clipped.real)[0])
    grads = noised_average(clipped.sums, noise_multiplier * total_clip(l2_norm_clip), divisor, seed)
    return add_regularization(grads, regularization_gradients(model, resolve_variables(model, variables)))


_seeds_used: set = set()
_seeds_warned: set = set()


def _warn_if_noise_repeats(seed: NoiseSeed) -> None:
    """A ``RepeatedNoiseWarning`` when a fixed ``seed`` gives noise that a release already had (once per seed)."""
    key = _fixed_seed(seed)
    if key is None or replicas.num_replicas() > 1:  # fresh draws; replicas fold their id into the key
        return
    inside_function = not tf.executing_eagerly()
    if key in _seeds_warned or not (inside_function or key in _seeds_used):
        _seeds_used.add(key)
        return
    _seeds_warned.add(key)
    why = (
        "inside a tf.function: every call of the traced function draws the same noise"
        if inside_function
        else "a second time in this process: both releases have the same noise"
    )
    warnings.warn(
        f"private_gradients got seed={seed!r} {why}, and the difference of two such releases "
        "cancels it, revealing the difference of the clipped sums. Vary the seed at every step "
        "(seed=(run_seed, step) with step a tensor inside tf.function), pass a tf.random.Generator, "
        "or use seed=None.",
        RepeatedNoiseWarning,
        stacklevel=3,
    )


def _fixed_seed(seed: NoiseSeed) -> tuple | None:
    """An int or pair seed as a tuple of ints; None for seeds that give fresh noise or change at run time."""
    if seed is None or isinstance(seed, (tf.random.Generator, tf.Variable)):
        return None
    stateless_key(seed)  # a TypeError or ValueError naming seed, for what is no seed
    if tf.is_tensor(seed):
        seed = tf.get_static_value(seed)
        if seed is None:
            return None
    return tuple(int(k) for k in np.ravel(seed))
