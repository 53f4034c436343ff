"""Noise mechanisms of a DP step: independent Gaussian noise (DP-SGD) and correlated noise (BandMF, BLT).

Every DP path (``DPModel``, ``GradientAccumulator``, through a
``DPAggregator``) adds to the clipped sum of step ``t`` the noise ``x_t`` its
mechanism makes from that step's fresh draw ``z_t ~ N(0, (sigma C)^2 I)``
(``per_example_grads.dp.noise``: fresh at every step, whatever the seed):

    released_t = sum_{i in batch_t} clip_C(g_i) + x_t,        x = C^{-1} z

for a lower-triangular Toeplitz matrix ``C`` with coefficients ``c_0, c_1,
...`` (``C[i, j] = c_{i-j}``). The optimizer thus sees ``G + C^{-1} Z``,
which is ``C^{-1}`` applied to the release ``C G + Z`` of a matrix
factorization mechanism (Choquette-Choo et al. 2023; Dvijotham, McMahan,
Pillutla, Steinke, Thakurta 2024): post-processing of a Gaussian mechanism
on ``C G``. Its noise is correlated across steps so that much of it cancels
in the prefix sums ``A G`` the model's trajectory follows.

``GaussianNoise`` (``C = I``, the default) is DP-SGD. The correlated ones
need **cyclic Poisson sampling**: ``poisson_batches(..., cycle_length=b)``
assigns every example to one of ``b`` parts, once for the run, and step
``t`` samples part ``t mod b`` at rate ``q``, so an example joins at most
``k = ceil(T / b)`` of ``T`` steps, any two at least ``b`` apart (its
docstring states for which neighbours, and why). Their accounting:

- ``BandMF(bands, ...)``: ``C`` has ``bands <= b`` non-zero diagonals and
  columns of norm at most 1. Two participations ``b >= bands`` steps apart
  touch disjoint rows of ``C G``, so conditioned on the other examples the
  release is ``k`` independent Poisson-subsampled Gaussian mechanisms on
  disjoint coordinates, each of sensitivity ``C`` (the clip norm) and noise
  ``sigma C``: exactly as private as ``k`` DP-SGD steps at rate ``q``
  (Choquette-Choo et al. 2023, amplified BandMF).
- ``BLT(buffers, ...)``: ``C`` is a buffered linear Toeplitz matrix, ``c_0 =
  1``, ``c_j = sum_i omega_i theta_i^(j-1)``. Its release is one Gaussian
  mechanism whose L2 sensitivity ``s`` (``mf_strategies.sensitivity``) covers
  all ``k`` participations, so ``T`` steps are one Gaussian mechanism with
  noise multiplier ``sigma / s``; no amplification by sampling is claimed.

State. ``BandMF`` keeps the last ``bands - 1`` noise vectors ``x`` and
``BLT`` keeps ``buffers`` running sums, each shaped like every trainable
variable (float32), as non-trainable variables of the mechanism, which the
aggregator (hence the ``DPModel``) owns: they are saved with its weights and
checkpoints, so a restored run continues the noise sequence of an
uninterrupted one exactly (with an integer seed; the draws ``z_t`` are keyed
by the saved step counter) and never replays or skips a draw. Under
``tf.distribute`` each replica keeps its own buffers (sync-on-read, summed
when read or saved) for its share ``z_t / sqrt(R)`` of the draw: the
recursion is linear, so the shares' sum is exactly the single-process noise.

A mechanism of your own: subclass ``NoiseMechanism`` and implement
``correlate`` (and ``build_state`` if it keeps state), and its accounting:
``accounted_as`` where its steps are as private as some Poisson-sampled
Gaussian steps, or else ``dp_event``, any ``dp_accounting`` event.
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

import dp_accounting
import keras
import numpy as np
import tensorflow as tf

from per_example_grads._core.arguments import check_positive_int
from per_example_grads.dp.accounting import sampled_gaussian_event


def _strategies():
    """``per_example_grads.dp.mf_strategies``, imported on first use (it loads tensorflow-probability)."""
    from per_example_grads.dp import mf_strategies

    return mf_strategies


class NoiseMechanism(keras.layers.Layer):
    """How a DP step turns its fresh Gaussian draw into the noise it adds, and how that is accounted.

    Attributes:
      cycle_length: the ``poisson_batches(cycle_length=...)`` sampling its
        accounting covers (1: ordinary Poisson sampling).
      correlated: whether the noise of a step depends on earlier draws.
      amplified: whether ``accounted_as`` counts on amplification by Poisson
        sampling (it then needs ``poisson_batches``; a mechanism accounted as
        one release of its sensitivity, whatever the sampling, is not).
    """

    cycle_length: int = 1
    correlated: bool = False
    amplified: bool = True

    def __init__(self, name: str | None = None):
        super().__init__(name=name)
        self._owned = False
        self.built = True

    def build_state(self, variables: Sequence) -> None:
        """Creates the state for noise shaped like ``variables`` (called once, by the aggregator's owner)."""
        if self._owned:
            raise ValueError(
                f"this {type(self).__name__} already makes the noise of another DP run: its state (the "
                "noise history) cannot be shared. Give every DPModel or GradientAccumulator its own."
            )
        self._owned = True

    def check_state(self) -> None:
        """Raises ``ValueError`` if restored state was made by another mechanism (nothing to check here)."""

    def correlate(self, fresh: list[tf.Tensor], step: tf.Tensor) -> list[tf.Tensor]:
        """The noise of step ``step`` from its fresh draws ``fresh`` (one per variable), updating the state."""
        raise NotImplementedError

    def accounted_as(
        self, noise_multiplier: float, sampling_probability: float, steps: int
    ) -> tuple[float, float, int]:
        """``(sigma', q', k)``: ``steps`` steps are as private as ``k`` Poisson-sampled Gaussian steps ``(q', sigma')``.

        ``sampling_probability`` is the rate at which the part in turn is
        sampled (``poisson_batches``'s ``q``); ``q' = 1`` means no sampling.
        """
        raise NotImplementedError

    def dp_event(self, noise_multiplier: float, sampling_probability: float, steps: int) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of ``steps`` steps at ``(sigma, q)``: what every epsilon of a run composes.

        By default ``accounted_as``'s ``k`` Poisson-sampled Gaussian steps
        (``accounting.sampled_gaussian_event``). A mechanism whose releases are
        no such steps overrides this instead, with any event ``dp_accounting``
        accounts (its PLD cost is then not estimated first).
        """
        return sampled_gaussian_event(*self.accounted_as(noise_multiplier, sampling_probability, steps))

    @property
    def coefficients(self) -> np.ndarray:
        """The Toeplitz coefficients of ``C``, ``c_0`` first (float64)."""
        raise NotImplementedError

    def _coefficients_for(self, n: int) -> np.ndarray:
        """The Toeplitz coefficients of ``C`` that ``n`` steps use (all of them, unless ``C`` has more)."""
        return self.coefficients


class GaussianNoise(NoiseMechanism):
    """Independent noise at every step (DP-SGD, ``C = I``): ``x_t = z_t``.

    Examples:
      >>> GaussianNoise().accounted_as(1.1, 0.01, 500)
      (1.1, 0.01, 500)
    """

    def correlate(self, fresh, step):
        return list(fresh)

    def accounted_as(self, noise_multiplier, sampling_probability, steps):
        return float(noise_multiplier), float(sampling_probability), int(steps)

    @property
    def coefficients(self) -> np.ndarray:
        return np.ones(1)

    def build_state(self, variables) -> None:
        return  # stateless: may serve several runs

    def get_config(self) -> dict:
        return {}


class _BufferedMechanism(NoiseMechanism):
    """A correlated mechanism with ``slots`` float32 noise vectors of ``P`` floats (all variables, flattened).

    One ``[slots, P]`` buffer, not one per variable: the recursion is then a
    few operations per step however many variables the model has.
    """

    correlated = True
    amplified = False  # accounted_as: one Gaussian release of its sensitivity

    def __init__(self, slots: int, cycle_length: int, name: str):
        super().__init__(name=name)
        self.cycle_length = cycle_length
        self._slots = slots
        self._sizes: list[int] = []
        self._sensitivities: dict[int, float] = {}

    def build_state(self, variables) -> None:
        super().build_state(variables)
        if not variables:
            raise ValueError(
                f"{type(self).__name__} keeps noise buffers shaped like the trainable variables, and there are "
                "none yet: build the model (call it once or give it an Input) before wrapping it."
            )
        # Saved with the buffers: a run restored into a mechanism with other
        # coefficients would mix two matrices C, whose columns' norms (hence
        # the sensitivity the accounting assumes) the mixture no longer bounds.
        self._parameters = keras.Variable(
            self._parameter_values(),
            dtype="float64",
            trainable=False,
            name="mechanism_parameters",
            aggregation="only_first_replica",
        )
        for v in variables:
            if any(d is None for d in tuple(v.shape)):
                raise ValueError(f"variable {v.name!r} has shape {v.shape}: noise buffers need static shapes.")
        self._shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self._sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self._shapes]
        self._buffer = keras.Variable(
            np.zeros((self._slots, sum(self._sizes)), np.float32),
            trainable=False,
            name="noise_buffer",
            synchronization="on_read",
            aggregation="sum",
        )

    def _parameter_values(self) -> np.ndarray:
        raise NotImplementedError

    def sensitivity(self, steps: int | None = None) -> float:
        """L2 sensitivity of ``C G`` (clip norm 1) over ``steps`` steps (default ``num_steps``).

        For ``ceil(steps / cycle_length)`` participations ``cycle_length``
        apart, the schema ``poisson_batches(cycle_length=...)`` guarantees
        (``mf_strategies.sensitivity``); ``sqrt(k)`` for BandMF with ``k``
        full columns.
        """
        n = self.num_steps if steps is None else int(steps)
        if n not in self._sensitivities:
            self._sensitivities[n] = float(
                _strategies().sensitivity(
                    self._coefficients_for(n),
                    n,
                    min_separation=self.cycle_length,
                    max_participations=-(-n // self.cycle_length),
                )
            )
        return self._sensitivities[n]

    def check_state(self) -> None:
        """Raises ``ValueError`` if the saved parameters (restored with the buffers) are not this mechanism's."""
        saved = getattr(self, "_parameters", None)
        if saved is None:
            return
        saved, own = np.asarray(saved.numpy()), self._parameter_values()
        if saved.shape != own.shape or not np.array_equal(saved, own):
            raise ValueError(
                f"the restored noise state was made by a {type(self).__name__} with other parameters "
                f"({saved.tolist()}) than this one's ({own.tolist()}): continuing would mix two "
                "factorizations, which the accounting does not cover. Construct the mechanism as the run did."
            )

    def correlate(self, fresh, step):
        known = [tuple(z.shape) if z.shape.is_fully_defined() else None for z in fresh]
        if len(fresh) != len(self._shapes) or any(k is not None and k != s for k, s in zip(known, self._shapes)):
            raise ValueError(
                f"{type(self).__name__} was built for variables of shapes {self._shapes}; the step's noise has "
                f"{[tuple(z.shape) for z in fresh]}."
            )
        z = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in fresh], axis=0)
        x = self._next(z, self._buffer)
        return [
            tf.cast(tf.reshape(part, shape), t.dtype)
            for part, shape, t in zip(tf.split(x, self._sizes), self._shapes, fresh)
        ]

    def _next(self, z: tf.Tensor, buffer) -> tf.Tensor:
        """The ``[P]`` noise from the ``[P]`` fresh draw, updating ``buffer`` (``[slots, P]``)."""
        raise NotImplementedError

    def accounted_as(self, noise_multiplier, sampling_probability, steps):
        """One Gaussian release of noise multiplier ``sigma / sensitivity(steps)``, no amplification claimed."""
        if steps == 0:
            return float(noise_multiplier), 1.0, 0
        return float(noise_multiplier) / self.sensitivity(steps), 1.0, 1

    @property
    def state_floats(self) -> int:
        """Floats of state: ``slots x P``."""
        return self._slots * sum(self._sizes)


class BandMF(_BufferedMechanism):
    """Banded matrix factorization: ``C`` lower-triangular banded Toeplitz, ``bands`` diagonals.

    ``x_t = (z_t - sum_{j=1}^{bands-1} c_j x_{t-j}) / c_0``: the last
    ``bands - 1`` noise vectors are kept, ``(bands - 1) x P`` floats. The
    coefficients minimize the prefix-sum error ``||A C^{-1}||_F`` for
    ``num_steps`` steps with ``||c||_2 = 1``
    (``_strategies().banded_coefficients``); any number of steps may be
    taken, the privacy holds for all (module docstring), only the error is
    optimal for ``num_steps``.

    Args:
      bands: ``b >= 1`` (1 is DP-SGD).
      num_steps: the planned number of steps.
      cycle_length: the ``poisson_batches`` cycle the run uses; at least
        ``bands`` (default ``bands``).

    Examples:
      >>> m = BandMF(bands=4, num_steps=64)
      >>> m.coefficients.shape, round(float(np.linalg.norm(m.coefficients)), 6)
      ((4,), 1.0)
      >>> m.accounted_as(1.0, 0.05, 10)   # 10 steps, cycle 4: 3 participations
      (1.0, 0.05, 3)
    """

    amplified = True  # accounted_as: ceil(T / b) Poisson-sampled DP-SGD steps

    def __init__(self, bands: int, num_steps: int, *, cycle_length: int | None = None, name: str = "band_mf"):
        bands = check_positive_int("bands", bands)
        num_steps = check_positive_int("num_steps", num_steps)
        cycle = bands if cycle_length is None else check_positive_int("cycle_length", cycle_length)
        if cycle < bands:
            raise ValueError(
                f"cycle_length ({cycle}) must be at least bands ({bands}): participations closer than the "
                "bands overlap in C G, and the amplified accounting no longer holds."
            )
        super().__init__(max(bands - 1, 0), cycle, name)
        self.bands, self.num_steps = bands, num_steps
        self._c = np.asarray(_strategies().banded_coefficients(num_steps, bands), np.float64)

    @property
    def coefficients(self) -> np.ndarray:
        return self._c.copy()

    def build_state(self, variables) -> None:
        if self.bands == 1:
            NoiseMechanism.build_state(self, variables)
            return
        super().build_state(variables)

    def correlate(self, fresh, step):
        if self.bands == 1:
            return [z / tf.cast(self._c[0], z.dtype) for z in fresh]
        return super().correlate(fresh, step)

    def _parameter_values(self) -> np.ndarray:
        return np.concatenate([[self.cycle_length], self._c])

    def _next(self, z, buffer):
        # buffer[j - 1] holds x_{t-j}; zeros before the first step.
        past = tf.convert_to_tensor(buffer)
        history = tf.tensordot(tf.constant(self._c[1:], tf.float32), past, axes=1)
        x = (z - history) / float(self._c[0])
        buffer.assign(tf.concat([x[None], past[:-1]], axis=0))
        return x

    def accounted_as(self, noise_multiplier, sampling_probability, steps):
        return float(noise_multiplier), float(sampling_probability), -(-int(steps) // self.cycle_length)

    def get_config(self) -> dict:
        return {"bands": self.bands, "num_steps": self.num_steps, "cycle_length": self.cycle_length, "name": self.name}


class BLT(_BufferedMechanism):
    """Buffered linear Toeplitz: ``c_0 = 1``, ``c_j = sum_i omega_i theta_i^(j-1)`` (``j >= 1``).

    ``x = C^{-1} z`` with ``buffers = d`` running sums ``S_i`` (``d x P``
    floats): ``x_t = z_t - sum_i omega_i S_{i,t}``, then ``S_{i,t+1} =
    theta_i S_{i,t} + x_t`` (``S_{i,0} = 0``), since ``sum_{j>=1} c_j
    x_{t-j} = sum_i omega_i sum_{j>=1} theta_i^(j-1) x_{t-j}``. The
    parameters minimize ``sensitivity^2 x prefix-sum error^2`` for
    ``num_steps`` steps with an example's participations ``cycle_length``
    apart (``mf_strategies.blt_parameters``), or are given.

    Accounting: ``T`` steps are one Gaussian mechanism with noise multiplier
    ``sigma / s_T``, ``s_T`` the sensitivity for ``ceil(T / cycle_length)``
    participations ``cycle_length`` apart in ``T`` steps; it grows with ``T``,
    so steps beyond ``num_steps`` are accounted, just not optimized for.

    Args:
      buffers: ``d >= 1``.
      num_steps: the planned number of steps.
      cycle_length: the ``poisson_batches`` cycle (the minimum separation of
        an example's participations), ``<= num_steps``.
      theta, omega: ``[d]`` parameters instead of optimizing (``theta`` in
        ``(0, 1)``, ``omega > 0``).
    """

    def __init__(
        self,
        buffers: int,
        num_steps: int,
        *,
        cycle_length: int,
        theta: Sequence[float] | None = None,
        omega: Sequence[float] | None = None,
        name: str = "blt",
    ):
        buffers = check_positive_int("buffers", buffers)
        num_steps = check_positive_int("num_steps", num_steps)
        cycle = check_positive_int("cycle_length", cycle_length)
        if cycle > num_steps:
            raise ValueError(f"cycle_length ({cycle}) must be at most num_steps ({num_steps}).")
        super().__init__(buffers, cycle, name)
        self.buffers, self.num_steps = buffers, num_steps
        if (theta is None) != (omega is None):
            raise ValueError("give both theta and omega, or neither (they are then optimized).")
        if theta is None:
            theta, omega = _strategies().blt_parameters(
                num_steps, buffers, min_separation=cycle, max_participations=-(-num_steps // cycle)
            )
        theta, omega = np.asarray(theta, np.float64), np.asarray(omega, np.float64)
        if theta.shape != (buffers,) or omega.shape != (buffers,):
            raise ValueError(f"theta and omega must have shape [{buffers}]; got {theta.shape} and {omega.shape}.")
        if not (np.all((theta > 0) & (theta < 1)) and np.all(omega > 0)):
            raise ValueError(f"theta must lie in (0, 1) and omega be > 0; got theta={theta}, omega={omega}.")
        self.theta, self.omega = theta, omega

    @property
    def coefficients(self) -> np.ndarray:
        """The first ``num_steps`` Toeplitz coefficients of ``C``."""
        return self._coefficients_for(self.num_steps)

    def _coefficients_for(self, n: int) -> np.ndarray:
        return _strategies().blt_coefficients(self.theta, self.omega, n)

    def _parameter_values(self) -> np.ndarray:
        return np.concatenate([[self.cycle_length], self.theta, self.omega])

    def _next(self, z, buffer):
        sums = tf.convert_to_tensor(buffer)
        x = z - tf.tensordot(tf.constant(self.omega, tf.float32), sums, axes=1)
        theta = tf.constant(self.theta[:, None], tf.float32)
        buffer.assign(theta * sums + x[None])
        return x

    def get_config(self) -> dict:
        return {
            "buffers": self.buffers,
            "num_steps": self.num_steps,
            "cycle_length": self.cycle_length,
            "theta": self.theta.tolist(),
            "omega": self.omega.tolist(),
            "name": self.name,
        }


def check_mechanism(mechanism) -> NoiseMechanism:
    """``mechanism``, or a ``GaussianNoise`` for None; a ``TypeError`` naming it otherwise.

    Every ``epsilon`` of a run with ``mechanism`` composes its ``dp_event``
    (by default from ``accounted_as``): a subclass that states neither is
    refused, never taken for DP-SGD.
    """
    if mechanism is None:
        return GaussianNoise()
    if not isinstance(mechanism, NoiseMechanism):
        raise TypeError(
            "mechanism must be a peg.dp.NoiseMechanism (GaussianNoise, BandMF, BLT) or None; got "
            f"{type(mechanism).__name__} {mechanism!r}."
        )
    kind = type(mechanism)
    if kind.accounted_as is NoiseMechanism.accounted_as and kind.dp_event is NoiseMechanism.dp_event:
        raise TypeError(
            f"the mechanism {kind.__name__} does not say how its steps are accounted: implement "
            "accounted_as(noise_multiplier, sampling_probability, steps), returning the (sigma', q', k) of the "
            "Poisson-sampled Gaussian steps it is as private as, or dp_event(noise_multiplier, "
            "sampling_probability, steps), returning its dp_accounting event. Without one no epsilon could be computed."
        )
    return mechanism


def fingerprint(mechanism: NoiseMechanism) -> np.ndarray:
    """``int64 [4]``: ``mechanism``'s class name (its first 16 bytes) and a digest of its configuration.

    What a ledger records of the mechanism that took its steps
    (``DPAggregator.check_ledger``); ``fingerprint_name`` reads the name back.
    """
    name = type(mechanism).__name__.encode()[:16].ljust(16, b"\0")
    try:
        config = {k: v for k, v in mechanism.get_config().items() if k not in ("name", "trainable", "dtype")}
    except NotImplementedError:
        config = {}
    digest = hashlib.blake2b(json.dumps(config, sort_keys=True, default=repr).encode(), digest_size=16).digest()
    return np.frombuffer(name + digest, np.int64).copy()


def fingerprint_name(record: np.ndarray) -> str:
    """The class name a ``fingerprint`` holds."""
    return np.asarray(record, np.int64)[:2].tobytes().rstrip(b"\0").decode(errors="replace")


def prefix_sum_error(mechanism: NoiseMechanism, steps: int) -> float:
    """``||A C^{-1}||_F / sqrt(steps)`` of ``mechanism``'s ``C``, per unit of noise std (``sqrt((n+1)/2)`` for DP-SGD)."""
    return float(_strategies().prefix_sum_error(mechanism._coefficients_for(steps), steps))


__all__ = [
    "BLT",
    "BandMF",
    "GaussianNoise",
    "NoiseMechanism",
    "check_mechanism",
    "fingerprint",
    "fingerprint_name",
    "prefix_sum_error",
]
