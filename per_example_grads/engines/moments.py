"""Moments and dot products of per-example gradients: what the diagnostics ask of an engine.

For a batch of ``B`` examples with per-example gradients ``g_i`` (``g_i[v]``
of shape ``[*var.shape]`` for variable ``v``) and a reference gradient ``r``
(same structure), ``Engine.moments`` returns, per variable ``v``:

- ``sum[v]   = sum_i g_i[v]``                      ``[*var.shape]`` float64
- ``sumsq[v] = sum_i g_i[v] ** 2`` (elementwise)    ``[*var.shape]`` float64
- ``sqnorms[v, i] = ||g_i[v]||^2``                  ``[n_vars, B]`` float64
- ``dots[i] = sum_v <g_i[v], r[v]>``               ``[B]`` float64

and ``Engine.features`` a ``GradientFeatures`` of the batch, whose ``dots``
with another batch's are the ``[Ba, Bb]`` matrix ``<g_i, h_j>``.

Every engine has both by materializing its per-example gradients
(``materialized_moments``, ``GradientFeatures.flat``). Gradients given as
outer products (``LayerRule.outer_factors``: example n's gradient
``A_n^T G_n``, or ``G_n`` for a bias) need only the factors:

    sum = A^T G,  sumsq = (A*A)^T (G*G),  ||.||^2 = ||A_n||^2 ||G_n||^2,
    <A_n^T G_n, R> = A_n^T R G_n,  <A_n^T G_n, A'_m^T G'_m> = (A_n . A'_m)(G_n . G'_m)

(``factored_moments``, ``GradientFeatures.factors``): nothing of size
``B x P`` is built. The layer-wise engine uses them where its rules give
factors.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

F64 = tf.float64


def materialized_moments(
    per_example: tf.Tensor, reference: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(sum, sumsq, sqnorms, dots)`` of one variable's ``[B, *shape]`` per-example gradients, float64."""
    pe = tf.cast(per_example, F64)
    flat = tf.reshape(pe, [tf.shape(pe)[0], -1])
    return (
        tf.reduce_sum(pe, axis=0),
        tf.reduce_sum(tf.square(pe), axis=0),
        tf.reduce_sum(tf.square(flat), axis=1),
        tf.linalg.matvec(flat, tf.reshape(tf.cast(reference, F64), [-1])),
    )


def factored_moments(a, g, reference) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(sum, sumsq, sqnorms, dots)`` of gradients ``a_n^T g_n`` (``g_n`` when ``a`` is None), float64."""
    g = tf.cast(g, F64)  # [B, j]
    ref = tf.cast(reference, F64)
    g2 = tf.square(g)
    if a is None:
        return tf.reduce_sum(g, axis=0), tf.reduce_sum(g2, axis=0), tf.reduce_sum(g2, axis=1), tf.linalg.matvec(g, ref)
    a = tf.cast(a, F64)  # [B, i]
    a2 = tf.square(a)
    return (
        tf.matmul(a, g, transpose_a=True),
        tf.matmul(a2, g2, transpose_a=True),
        tf.reduce_sum(a2, axis=1) * tf.reduce_sum(g2, axis=1),
        tf.reduce_sum(tf.matmul(a, ref) * g, axis=1),
    )


def assemble(variables: Sequence, found: dict, batch_size) -> dict:
    """The ``moments`` dict (module docstring) from ``found[id(v)] = (sum, sumsq, sqnorms, dots)``; zeros for the rest."""
    zeros_b = tf.zeros([batch_size], F64)
    stats = [found.get(id(v), (tf.zeros(v.shape, F64), tf.zeros(v.shape, F64), zeros_b, zeros_b)) for v in variables]
    return {
        "sum": [s[0] for s in stats],
        "sumsq": [s[1] for s in stats],
        "sqnorms": tf.stack([s[2] for s in stats]),
        "dots": tf.add_n([s[3] for s in stats]),
    }


def moments_of(variables: Sequence, per_example: Sequence[tf.Tensor], reference: Sequence[tf.Tensor]) -> dict:
    """The ``moments`` dict of materialized per-example gradients aligned with ``variables``."""
    found = {id(v): materialized_moments(pe, r) for v, pe, r in zip(variables, per_example, reference)}
    return assemble(variables, found, tf.shape(per_example[0])[0])


@dataclasses.dataclass
class GradientFeatures:
    """What the dot products of one batch's per-example gradients need.

    ``factors``: per variable ``(A [B, i] or None, G [B, j])``, float64, with
    example n's gradient ``A_n^T G_n`` (or ``G_n``); ``flat``: ``[B, P]``
    float64 materialized gradients. Exactly one is set.
    """

    factors: list[tuple[tf.Tensor | None, tf.Tensor]] | None = None
    flat: tf.Tensor | None = None

    @property
    def factored(self) -> bool:
        """Whether the features are factors (else materialized gradients)."""
        return self.flat is None

    @classmethod
    def of(cls, per_example: Sequence[tf.Tensor]) -> "GradientFeatures":
        """Features of materialized per-example gradients (a list of ``[B, *var.shape]``)."""
        b = tf.shape(per_example[0])[0]
        return cls(flat=tf.concat([tf.reshape(tf.cast(t, F64), [b, -1]) for t in per_example], axis=1))

    def squared_norms(self) -> tf.Tensor:
        """``[B]`` ``||g_n||^2``."""
        if self.flat is not None:
            return tf.reduce_sum(tf.square(self.flat), axis=1)
        total = 0.0
        for a, g in self.factors:
            g2 = tf.reduce_sum(tf.square(g), axis=1)
            total += g2 if a is None else tf.reduce_sum(tf.square(a), axis=1) * g2
        return total

    def dots(self, other: "GradientFeatures") -> tf.Tensor:
        """``[Ba, Bb]`` ``<g_i, h_j>`` with ``other``'s gradients ``h`` (both of one kind; ValueError if no variable is reached)."""
        if self.factored != other.factored:
            raise ValueError("both batches' features must be of one kind: factors, or materialized gradients.")
        if self.flat is not None:
            return tf.matmul(self.flat, other.flat, transpose_b=True)
        total = None
        for (aa, ga), (ab, gb) in zip(self.factors, other.factors):
            k = tf.matmul(ga, gb, transpose_b=True)
            if aa is not None:
                k = tf.matmul(aa, ab, transpose_b=True) * k
            total = k if total is None else total + k
        if total is None:
            raise ValueError("no requested variable is reached by the loss.")
        return total
