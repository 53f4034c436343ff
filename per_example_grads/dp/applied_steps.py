"""``AppliedSteps``: count the DP-SGD steps that were actually applied, where the variables live.

Privacy accounting must count every update that reached the model. With
``tf.distribute.ParameterServerStrategy`` (DistBelief-style asynchronous
training) workers compute gradients and the parameter servers apply them, so
the count is a variable created under ``strategy.scope()``: it lives on a
parameter server next to the model's variables, and every worker's step
increments it **before** it applies its update. A step lost in a crash after
the increment is counted without having been applied, so the count can only
over-report, never under-report. ``update(accountant)`` then hands the
steps to a ``PrivacyAccountant``.

It is a ``tf.Module``: save it in the same ``tf.train.Checkpoint`` as the
model and the optimizer, and the count comes back with them after a restart.
"""

from __future__ import annotations

from typing import Iterable

import tensorflow as tf

from per_example_grads.dp.accounting import PrivacyAccountant


class AppliedSteps(tf.Module):
    """A step counter that is incremented before each optimizer update.

    Attributes:
      count: scalar int64 ``tf.Variable``, steps applied (or started) so far.

    Examples:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> opt, steps = keras.optimizers.SGD(0.1), peg.dp.AppliedSteps()
      >>> grads = peg.dp.private_gradients(net, "mse", np.ones((4, 3)), np.zeros((4, 1)),
      ...     l2_norm_clip=1.0, noise_multiplier=1.1, seed=(0, 0))
      >>> steps.apply_gradients(opt, zip(grads, net.trainable_variables))
      >>> accountant = steps.update(peg.dp.PrivacyAccountant(1.1, 4 / 100))
      >>> accountant.steps
      1
    """

    def __init__(self, name: str = "applied_steps"):
        super().__init__(name=name)
        with tf.init_scope():
            self.count = tf.Variable(
                0,
                dtype=tf.int64,
                trainable=False,
                name="count",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

    def apply_gradients(self, optimizer, grads_and_vars: Iterable) -> None:
        """Increments ``count``, then ``optimizer.apply_gradients(grads_and_vars)``."""
        with tf.control_dependencies([self.count.assign_add(1)]):
            optimizer.apply_gradients(list(grads_and_vars))

    def update(self, accountant: PrivacyAccountant) -> PrivacyAccountant:
        """Records in ``accountant`` the steps counted here that it has not seen; returns it.

        Raises:
          ValueError: if ``accountant`` already has more steps than were
            counted (it belongs to another run).
        """
        counted = int(self.count.numpy())
        if accountant.steps > counted:
            raise ValueError(
                f"accountant has {accountant.steps} steps but only {counted} were applied; it belongs to another run."
            )
        accountant.step(counted - accountant.steps)
        return accountant
