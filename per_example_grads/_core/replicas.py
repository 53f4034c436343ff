"""How one logical step is shared between the replicas of a ``tf.distribute`` strategy.

Inside ``strategy.run`` every replica sees only its shard of the batch. The
library's rule for everything that sums over examples is the same as Keras's
for gradients: **each replica returns its share, and the shares add up**
(Keras optimizers all-reduce gradients with ``SUM`` before applying them).
So on replica ``r`` of ``R``, for a logical batch ``S = S_1 + ... + S_R``:

- a clipped-gradient sum is the sum over ``S_r`` (``P`` floats per replica:
  the all-reduce payload is one gradient, never ``B x P``);
- DP noise is split: each replica adds independent ``N(0, (sigma C)^2 / R)``,
  so the all-reduced sum carries ``N(0, (sigma C)^2)`` exactly once. Every
  replica draws from its own stream (a ``tf.random.Generator`` gives each
  replica a different stream; stateless seeds are folded with the replica id);
- divisors that default to "the rows in the batch" use the global count,
  all-reduced (one scalar).

Outside a replica context (no strategy, or cross-replica code under
``strategy.scope()``), ``R = 1`` and every function here is the identity.
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf


def _context():
    """The replica context of a multi-replica strategy, or None."""
    if not tf.distribute.has_strategy():
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return None
    return ctx


def num_replicas() -> int:
    """``R``: replicas in sync when called inside ``strategy.run``, else 1."""
    ctx = _context()
    return 1 if ctx is None else ctx.num_replicas_in_sync


def replica_id() -> tf.Tensor | int:
    """This replica's id in ``[0, R)`` (``0`` outside ``strategy.run``)."""
    ctx = _context()
    return 0 if ctx is None else ctx.replica_id_in_sync_group


def noise_share(stddev):
    """``stddev / sqrt(R)``: the std of this replica's part of one noise draw."""
    r = num_replicas()
    return stddev if r == 1 else stddev / math.sqrt(r)


def global_sum(values: tf.Tensor | Sequence[tf.Tensor]):
    """The sum over all replicas of ``values`` (a tensor or a list), all-reduced; identity when ``R = 1``."""
    ctx = _context()
    if ctx is None:
        return values
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, values)
