"""The engine interface and registry.

An engine has three capabilities, all aligned with ``problem.variables``:

- ``compute(problem, batch)``: per-example gradients, entry k of shape
  ``[B, *variables[k].shape]``, entry ``i`` the gradient of example i's own
  (weighted) loss; zeros for variables the loss does not reach;
- ``norms(problem, batch, by_variable)``: ``[B]`` norms of each example's
  whole gradient, or with ``by_variable`` a ``[B]`` per variable;
- ``clipped_sums(problem, batch, clip)``: ``(sums, norms, predictions)`` with
  ``sums[k] = sum_i c_i grads[k][i]``, ``c_i = C_g / max(n_ig, C_g)`` for the
  clipping group ``g`` of variable ``k`` (``clip``, a ``ClipGroups``),
  ``norms`` the ``[B]`` norms ``n_ig`` per group, and ``predictions`` the
  model's outputs on the batch when the engine ran it on the whole batch
  (else None), so a training step needs no second forward pass;
- ``moments(problem, batch, reference)``: per-variable sums and sums of
  squares over the batch, per-example squared norms, and dot products with
  ``reference``; ``features(problem, batch)``: what dot products between two
  batches' per-example gradients need (both float64, ``engines.moments``);
- ``sparse_compute(problem, batch)``: ``compute`` with embedding tables'
  entries as ``PerExampleSlices``, for the engines that have it
  (``supports_sparse``);
- ``slow_layers(problem)``: the layers the engine covers by an exact but
  slower fallback of its own (none by default).

The grouped capabilities (per-unit gradients, norms and clipped sums, a unit
being a group of rows such as a user's) are in ``engines.grouped``; an engine
may give its own (``native_unit_squared_norms``, ``native_unit_clipped_sums``).

An engine that only computes per-example gradients gets norms, clipped sums,
moments and features by materializing them (``B x P`` memory); the
layer-wise engine has its own, which never build ``B x P`` where its rules
have closed forms. Callers go through ``selection.run``, which picks the
engine (``method="auto"``, with its fallbacks) the same way for every
capability.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import tensorflow as tf

from per_example_grads import transforms
from per_example_grads._core.batch import Batch
from per_example_grads._core.example_ops import weighted_example_sum
from per_example_grads._core.problem import Problem
from per_example_grads._core.tape import dense_or_zeros, watch_variables
from per_example_grads.engines.moments import GradientFeatures, moments_of

EngineFn = Callable[[Problem, Batch], list]


class FiniteSums(list):
    """Clipped sums that already leave out every example (or unit) whose norm is not finite.

    An engine's ``clipped_sums`` returns its sums as this where it left such
    examples out itself, in the same pass (the layer-wise engine,
    ``layerwise.clipped_sums``), and as a plain list otherwise;
    ``per_example_grads.clipping`` leaves them out of a plain list by
    recomputing the batch, and of these only warns. Where the guarantee is
    stated: ``clipping._without_nonfinite_examples``.
    """


@dataclasses.dataclass(frozen=True)
class ClipGroups:
    """Which variables are clipped together, and to what.

    Attributes:
      groups: per group, the indices of its variables in ``problem.variables``.
      clips: per group, its clip norm ``C_g`` (a number or scalar tensor).
    """

    groups: list
    clips: list

    def clip_and_sum(self, grads: list) -> tuple[list, list]:
        """``(sums, norms)`` of materialized gradients ``[N, *var.shape]`` per variable (``N`` examples or units).

        ``sums[k] = sum_n c_ng grads[k][n]`` for variable ``k`` of group ``g``,
        ``norms`` the ``[N]`` norms per group, ``c_ng = C_g / max(n_ng, C_g)``
        (``transforms.clip_factors``).
        """
        squared = [tf.square(n) for n in transforms.per_variable_norms(grads)]
        norms = [
            _rescaled(tf.sqrt(tf.add_n([squared[i] for i in idx])), [grads[i] for i in idx]) for idx in self.groups
        ]
        factors = [transforms.clip_factors(n, c) for n, c in zip(norms, self.clips)]
        sums = [None] * len(grads)
        for idx, f in zip(self.groups, factors):
            for i in idx:
                sums[i] = weighted_example_sum(f, grads[i])
        return sums, norms


def finite_examples(norms: list) -> tf.Tensor:
    """``[B]`` bool: examples whose gradient norm (each ``[B]``) is finite in every clipping group (one node for one)."""
    if len(norms) == 1:
        return tf.math.is_finite(norms[0])
    return tf.reduce_all(tf.stack([tf.math.is_finite(n) for n in norms]), axis=0)  # groups' dtypes may differ


def _rescaled(norms: tf.Tensor, grads: list) -> tf.Tensor:
    """``[N]`` ``norms`` of ``grads``, with those that are not finite taken again by ``transforms.global_norms``.

    Squares overflow float32 for gradient entries beyond about 1.8e19, and
    so does the norm's sum of squares, though the gradient and its norm are
    finite; ``global_norms`` scales by the largest entry first. It runs only
    for a batch with such a norm (a ``tf.cond``); a NaN or Inf gradient's
    norm stays non-finite, and its clip factor 0 (``transforms.clip_factors``).
    """
    finite = tf.math.is_finite(norms)

    def rescaled():
        return tf.where(finite, norms, tf.cast(transforms.global_norms(grads), norms.dtype))

    return tf.cond(tf.reduce_all(finite), lambda: norms, rescaled)


@dataclasses.dataclass(frozen=True)
class Engine:
    """A registered way of computing per-example gradients, norms and clipped sums.

    Attributes:
      name: the ``method=`` string.
      compute: ``(problem, batch) -> list of [B, *var.shape]``.
      isolates_examples: True if a NaN/Inf in one example can never reach
        another example's gradient.
      why_not: ``problem -> str | None``: why the engine must not run on this
        problem (it would crash or be wrong), or None.
      why_not_batch: ``(problem, batch) -> str | None``: as ``why_not``, for
        reasons that depend on the batch's shapes (an op whose rank under
        ``tf.vectorized_map`` exceeds its CPU kernel's limit,
        ``per_example_grads._core.pfor_limits``), or None for no such check.
      native_squared_norms: the engine's own ``(problem, batch) -> [B]``
        squared norms per variable, or None to materialize the gradients.
      native_clipped_sums: the engine's own ``clipped_sums`` (module
        docstring), or None to materialize the gradients.
      native_unit_squared_norms: ``(problem, batch, units) -> [U]`` squared
        norms of each unit's gradient per variable, or None to segment-sum
        the materialized gradients (``engines.grouped``).
      native_unit_clipped_sums: ``(problem, batch, clip, units) ->
        (sums, [U] norms per group, predictions)``, or None (``engines.grouped``).
      native_moments: the engine's own ``(problem, batch, reference) ->
        moments dict`` (``engines.moments``), or None to materialize.
      native_features: the engine's own ``(problem, batch) ->
        GradientFeatures``, or None to materialize.
      native_sparse_compute: ``compute`` with embedding tables' entries as
        ``PerExampleSlices``, or None when the engine has no such form.
      native_slow_layers: ``problem -> list of layers`` the engine covers by
        a slower fallback of its own, or None for none.
    """

    name: str
    compute: EngineFn
    isolates_examples: bool
    why_not: Callable[[Problem], str | None] = lambda problem: None
    why_not_batch: Callable[[Problem, Batch], str | None] | None = None
    native_squared_norms: Callable[[Problem, Batch], list] | None = None
    native_clipped_sums: Callable[[Problem, Batch, ClipGroups], tuple] | None = None
    native_unit_squared_norms: Callable[..., list] | None = None
    native_unit_clipped_sums: Callable[..., tuple] | None = None
    native_moments: Callable[[Problem, Batch, list], dict] | None = None
    native_features: Callable[[Problem, Batch], GradientFeatures] | None = None
    native_sparse_compute: EngineFn | None = None
    native_slow_layers: Callable[[Problem], list] | None = None

    def refusal(self, problem: Problem, batch: Batch | None = None) -> str | None:
        """``why_not(problem)``, else (given the batch) ``why_not_batch(problem, batch)``."""
        reason = self.why_not(problem)
        if reason is None and batch is not None and self.why_not_batch is not None:
            reason = self.why_not_batch(problem, batch)
        return reason

    def norms(self, problem: Problem, batch: Batch, by_variable: bool = False):
        """``[B]`` global norms, or a list of ``[B]`` per variable."""
        if self.native_squared_norms is not None:
            squared = self.native_squared_norms(problem, batch)
            return [tf.sqrt(s) for s in squared] if by_variable else tf.sqrt(tf.add_n(squared))
        grads = self.compute(problem, batch)
        return transforms.per_variable_norms(grads) if by_variable else transforms.global_norms(grads)

    def clipped_sums(self, problem: Problem, batch: Batch, clip: ClipGroups) -> tuple[list, list, Any]:
        """``(sums per variable, [B] norms per group, predictions or None)``."""
        if self.native_clipped_sums is not None:
            return self.native_clipped_sums(problem, batch, clip)
        sums, norms = clip.clip_and_sum(self.compute(problem, batch))
        return sums, norms, None

    def moments(self, problem: Problem, batch: Batch, reference: list) -> dict:
        """``{"sum", "sumsq": lists of [*var.shape], "sqnorms": [n_vars, B], "dots": [B]}``, float64 (``engines.moments``).

        ``reference``: one ``[*var.shape]`` tensor per variable, the other
        side of ``dots``.
        """
        if self.native_moments is not None:
            return self.native_moments(problem, batch, reference)
        return moments_of(problem.variables, self.compute(problem, batch), reference)

    def features(self, problem: Problem, batch: Batch, factored: bool = True) -> GradientFeatures:
        """The batch's ``GradientFeatures``: factors where the engine has them and ``factored``, else materialized."""
        if factored and self.native_features is not None:
            return self.native_features(problem, batch)
        return GradientFeatures.of(self.compute(problem, batch))

    @property
    def supports_sparse(self) -> bool:
        """Whether ``sparse_compute`` is available."""
        return self.native_sparse_compute is not None

    def sparse_compute(self, problem: Problem, batch: Batch) -> list:
        """Per-example gradients with embedding tables' entries as ``PerExampleSlices`` (``supports_sparse`` engines only)."""
        if self.native_sparse_compute is None:
            raise NotImplementedError(f"the {self.name!r} engine has no sparse per-example gradients.")
        return self.native_sparse_compute(problem, batch)

    def slow_layers(self, problem: Problem) -> list:
        """The layers of a problem the engine covers (``why_not`` is None) that it runs by a slower fallback of its own."""
        return [] if self.native_slow_layers is None else self.native_slow_layers(problem)


ENGINES: dict[str, Engine] = {}


def register_engine(**properties) -> Callable[[EngineFn], EngineFn]:
    """Decorator: ``@register_engine(name=..., isolates_examples=..., why_not=..., native_...=...)``."""

    def wrap(fn: EngineFn) -> EngineFn:
        ENGINES[properties["name"]] = Engine(compute=fn, **properties)
        return fn

    return wrap


@tf.autograph.experimental.do_not_convert  # plain Python; nothing for AutoGraph to convert
def example_gradient(problem: Problem, example: Batch) -> list:
    """Gradients of one example's loss: ``list of [*var.shape]``."""
    with tf.GradientTape() as tape:
        watch_variables(tape, problem.variables)
        loss = problem.example_loss(example)
    return dense_or_zeros(tape.gradient(loss, problem.variables), problem.variables)
