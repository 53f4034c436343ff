"""Privatizers: how a DP step releases its clipped sum, and how that release is accounted.

A privatizer is given a batch's clipped sums ``S = sum_{i in batch}
clip_C(g_i)`` (one ``[*var.shape]`` tensor per variable) and what the step
knows beside them (``ReleaseContext``), and returns what the optimizer sees,

    release(S) = (S + x_t) / D,

with the noise ``x_t`` of step ``t`` added once. It also states what its
releases cost: ``dp_event(sigma, q, T)`` is the ``dp_accounting`` event of
``T`` of its releases at noise multiplier ``sigma``, each on a Poisson
sample at ``q`` (what the ledger's accountant composes,
``per_example_grads.dp.accounting``).

The parts, each one concept (``DPAggregator.privatizer`` composes them):

- ``DenseNoise``: a ``NoiseMechanism``'s noise ``x_t = C^{-1} z_t`` on every
  coordinate (DP-SGD, BandMF, BLT, BISR), accounted as the mechanism says.
- ``SparseNoise``: sparse embedding noise (DP-AdaFEST), accounted as DP-SGD
  at ``sigma``; why is stated in ``per_example_grads.dp.sparse_embeddings``.
- ``CanaryInsertion``: a privacy audit's gradient canaries around another
  privatizer; the release and its accounting are the inner one's.
- ``ClipUpdate``: adaptive clipping around another privatizer; after the
  release it moves the clip norm from the batch's noisy clipped count, a
  second Gaussian release that the noise multipliers are split for
  (``per_example_grads.dp.adaptive``).

The release's building block, ``noised_average``, is here too: one-shot
``private_gradients`` calls it directly.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import dp_accounting
import tensorflow as tf

from per_example_grads._core import replicas
from per_example_grads._core.arguments import total_clip
from per_example_grads.clipping import dense_sums
from per_example_grads.dp import adaptive as adaptive_clipping
from per_example_grads.dp import composition
from per_example_grads.dp.mechanisms import GaussianNoise, NoiseMechanism
from per_example_grads.dp.noise import NoiseSeed, gaussian_like

if TYPE_CHECKING:
    from per_example_grads.dp.aggregator import ClippedSum
    from per_example_grads.dp.audit.canaries import GradientCanaries
    from per_example_grads.dp.sparse_embeddings import SparseSelection


@tf.autograph.experimental.do_not_convert
def noised_average(
    sums: Sequence, stddev, divisor, seed: NoiseSeed = None, *, step=None, mechanism: NoiseMechanism | None = None
) -> list[tf.Tensor]:
    """``(sums[k] + x[k]) / divisor`` for every k: the noise is added once.

    ``x = mechanism.correlate(z, step)`` for this step's fresh draw ``z ~
    N(0, stddev^2)`` (``x = z`` without a mechanism). Inside
    ``strategy.run`` the draw's std is ``stddev / sqrt(R)`` on each of the
    ``R`` replicas, so the sum of the replicas' results has it once. Where
    ``x = z`` (DP-SGD) the noise is drawn and added one draw group at a
    time (``gaussian_like``'s ``combine``): a model's worth of noise is
    never alive at once.
    """
    sums = dense_sums(sums)  # the noise is dense: every row of an embedding table gets some
    # One cast (or constant) per dtype: a comprehension over the sums made one per variable, all but the last unused.
    divisors = {dtype: tf.cast(divisor, dtype) for dtype in dict.fromkeys(s.dtype for s in sums)}
    average = lambda s, n: (s + n) / divisors[s.dtype]  # noqa: E731
    std = replicas.noise_share(stddev)
    if mechanism is None or type(mechanism).correlate is GaussianNoise.correlate:  # the draw is the noise
        return gaussian_like(sums, std, seed, step=step, combine=average)
    noise = mechanism.correlate(gaussian_like(sums, std, seed, step=step), step)
    return [average(s, n) for s, n in zip(sums, noise)]


@dataclasses.dataclass(frozen=True)
class ReleaseContext:
    """What one release is given beside the sums.

    Attributes:
      clipped: the batch's ``ClippedSum`` (its norms ``[B]``, real-row
        weights ``[B]`` and sparse selection), or None when the release was
        given the sums alone (a ``GradientAccumulator``'s, over micro-batches).
      clip: the clip norm the sums were clipped with (a number, a per-layer
        dict, or an adaptive clip norm's current value).
      divisor: ``D``, never a function of the data.
      step: int64 scalar, the step index ``t`` of the noise draw.
      sampling_probability: ``q`` of this step, or None (no sampling claimed).
    """

    clipped: ClippedSum | None
    clip: Any
    divisor: Any
    step: tf.Tensor
    sampling_probability: Any = None


class Privatizer:
    """Releases a step's clipped sums and states what its releases cost (see the module docstring)."""

    def release(self, sums: list, context: ReleaseContext) -> list[tf.Tensor]:
        """``(sums + x_t) / D``: one ``[*var.shape]`` tensor (or ``tf.IndexedSlices``) per variable."""
        raise NotImplementedError

    def dp_event(self, noise_multiplier: float, sampling_probability: float, steps: int) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of ``steps`` releases at ``(sigma, q)``."""
        raise NotImplementedError


class DenseNoise(Privatizer):
    """``(S + C^{-1} z_t) / D`` on every coordinate, ``z_t ~ N(0, (sigma C)^2 I)``, accounted as ``mechanism`` says.

    Args:
      mechanism: the ``NoiseMechanism`` that turns the draw into the noise.
      noise_multiplier: ``sigma`` of the draw (under adaptive clipping, the
        gradient's share of the run's noise multiplier).
      noise: the run's noise source (``per_example_grads.dp.noise``).
    """

    def __init__(self, mechanism: NoiseMechanism, noise_multiplier: float, noise):
        self.mechanism, self.noise_multiplier, self.noise = mechanism, noise_multiplier, noise

    def release(self, sums, context):
        return noised_average(
            sums,
            self.noise_multiplier * total_clip(context.clip),
            context.divisor,
            self.noise,
            step=context.step,
            mechanism=self.mechanism,
        )

    def dp_event(self, noise_multiplier, sampling_probability, steps):
        return self.mechanism.dp_event(noise_multiplier, sampling_probability, steps)


class SparseNoise(Privatizer):
    """Sparse embedding noise: the selected rows of the covered tables, independent noise on every other variable.

    The split of the noise multiplier between the selection and the
    gradient, and why the step is as private as a DP-SGD step at ``sigma``,
    are stated in ``per_example_grads.dp.sparse_embeddings``; the mechanism
    is DP-SGD's (``composition`` refuses a correlated one).

    Args:
      selection: the ``SparseSelection`` bound to the model.
      mechanism: the run's (``GaussianNoise``), whose accounting this is.
      noise: the run's noise source.
    """

    def __init__(self, selection: SparseSelection, mechanism: NoiseMechanism, noise):
        self.selection, self.mechanism, self.noise = selection, mechanism, noise

    def release(self, sums, context):
        clipped = context.clipped
        if clipped is None or clipped.selection is None:
            raise ValueError(
                "sparse embedding noise needs the rows each example looked up, which DPAggregator.clipped_sum "
                "counts (in a DPModel step or a GradientAccumulator(sparse_embeddings=...)): release got bare sums."
            )
        clip, step = total_clip(context.clip), context.step
        selected = self.selection.selected_rows(*clipped.selection, self.noise, step)
        rows = self.selection.release(sums, selected, clip, context.divisor, self.noise, step)
        others = [i for i in range(len(sums)) if i not in rows]
        dense = noised_average(
            [sums[i] for i in others],
            self.selection.gradient_noise_multiplier * clip,
            context.divisor,
            self.noise,
            step=step,
        )
        grads = dict(zip(others, dense)) | rows
        return [grads[i] for i in range(len(sums))]

    def dp_event(self, noise_multiplier, sampling_probability, steps):
        return self.mechanism.dp_event(noise_multiplier, sampling_probability, steps)


class CanaryInsertion(Privatizer):
    """A privacy audit's gradient canaries (``peg.dp.audit.GradientCanaries``) around ``inner``.

    The canaries that join step ``t`` (each included in the audit's run with
    probability 1/2, then sampled like an example at ``q``) add their
    clipped gradients, of norm ``total_clip(C)`` each, to the sums before
    ``inner`` releases them; then ``canaries.observe`` reads the release for
    their scores. The noise, divisor and accounting are ``inner``'s: the
    audit measures the claim of the privatizer it wraps.
    """

    def __init__(self, inner: Privatizer, canaries: GradientCanaries):
        self.inner, self.canaries = inner, canaries

    def release(self, sums, context):
        with_canaries = self.canaries.insert(
            sums,
            step=context.step,
            l2_norm_clip=total_clip(context.clip),
            sampling_probability=context.sampling_probability,
        )
        grads = self.inner.release(with_canaries, context)
        self.canaries.observe(grads, sums, context.divisor, step=context.step)
        return grads

    def dp_event(self, noise_multiplier, sampling_probability, steps):
        return self.inner.dp_event(noise_multiplier, sampling_probability, steps)


class ClipUpdate(Privatizer):
    """Adaptive clipping around ``inner``: after its release, the clip norm moves from the batch's noisy count.

    The count is a second Gaussian release of the batch; ``inner``'s noise
    multiplier is the gradient's share ``sigma_g`` of the run's ``sigma``, so
    that ``T`` steps are accounted as ``inner``'s at ``sigma``. The split,
    and why it holds, are stated in ``per_example_grads.dp.adaptive``.

    Args:
      inner: the privatizer of the gradient (its noise at ``sigma_g``).
      settings: the ``AdaptiveClipping`` settings.
      clip_norm: the float32 variable that holds the clip norm in force.
      noise: the run's noise source; the count draws from an independent stream.
    """

    def __init__(self, inner: Privatizer, settings: adaptive_clipping.AdaptiveClipping, clip_norm, noise):
        self.inner, self.settings, self.clip_norm, self.noise = inner, settings, clip_norm, noise

    def release(self, sums, context):
        clipped = context.clipped
        if clipped is None:
            raise ValueError(
                "adaptive clipping moves its clip norm from the batch's norms: release needs the "
                "ClippedSum of clipped_sum, not the sums alone."
            )
        grads = self.inner.release(sums, context)
        self.clip_norm.assign(
            adaptive_clipping.updated_clip(
                self.settings,
                context.clip,
                clipped.norms,
                clipped.real,
                context.divisor,
                count_source(self.noise),
                step=context.step,
            )
        )
        return grads

    def dp_event(self, noise_multiplier, sampling_probability, steps):
        return self.inner.dp_event(noise_multiplier, sampling_probability, steps)


def compose(
    *,
    mechanism: NoiseMechanism,
    noise_multiplier: float,
    noise,
    sparse: SparseSelection | None = None,
    canaries: GradientCanaries | None = None,
    adaptive: adaptive_clipping.AdaptiveClipping | None = None,
    clip_norm=None,
) -> Privatizer:
    """The privatizer of a step with these parts: the noise, inside an audit's canaries, inside adaptive clipping.

    ``noise_multiplier`` is the gradient's (``sigma_g`` under adaptive
    clipping). Pairings that cannot be composed are refused by
    ``composition`` (sparse noise with canaries or adaptive clipping).
    """
    composition.check(
        composition.Parts(
            "DPAggregator",
            mechanism=mechanism,
            sparse=sparse is not None,
            audit="gradient" if canaries is not None else None,
            adaptive=adaptive is not None,
        )
    )
    if sparse is not None:
        privatizer = SparseNoise(sparse, mechanism, noise)
    else:
        privatizer = DenseNoise(mechanism, noise_multiplier, noise)
    if canaries is not None:
        privatizer = CanaryInsertion(privatizer, canaries)
    if adaptive is not None:
        privatizer = ClipUpdate(privatizer, adaptive, clip_norm, noise)
    return privatizer


def count_source(source):
    """An independent stream for adaptive clipping's count: the same generator, or the key folded with a tag."""
    if isinstance(source, tf.random.Generator):
        return source
    return tf.random.experimental.stateless_fold_in(source, 0x636F756E74)
