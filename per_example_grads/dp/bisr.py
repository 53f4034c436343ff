"""BISR, the banded inverse square root: correlated noise from the last few draws alone.

Kalinin, McKenna, Upadhyay, Lampert (2025), "Back to square roots: an
optimal bound on the matrix factorization error for multi-epoch
differentially private SGD" (arXiv 2505.12128). The prefix-sum matrix ``A``
has the Toeplitz square root of coefficients ``(1 - z)^{-1/2}``; BISR keeps
its inverse's first ``p = bands`` coefficients,

    d_0 = 1,   d_k = d_{k-1} (2k - 3) / (2k):   1, -1/2, -1/8, -1/16, -5/128, ...

as the banded ``C^{-1}``, so the noise of step ``t`` is

    x_t = sum_{j < p} d_j z_{t-j}

(``z`` the fresh draws, zero before the first step): it keeps the last
``p - 1`` draws, ``(p - 1) x P`` floats, and is computed exactly, with no
solve. ``C`` itself, the series ``1 / d(z)``, is not banded, so BandMF's
amplified accounting does not apply.

Accounting (as for ``BLT``, ``per_example_grads.dp.mechanisms``): the run's
``T`` steps release ``C G + Z`` once, a Gaussian mechanism of noise
multiplier ``sigma / s_T``, ``s_T`` the L2 sensitivity of ``C G`` for
``ceil(T / cycle_length)`` participations at least ``cycle_length`` apart
(``mf_strategies.sensitivity``; its closed form applies because the
coefficients of ``1 / d(z)`` are non-negative and non-increasing from
``c_1`` on, which ``sensitivity`` checks before using it). No amplification
by sampling is claimed. ``tests/test_dp_bisr.py`` checks ``s_T`` and the
epsilon against jax_privacy's ``minsep_sensitivity_squared`` on a grid.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from per_example_grads._core.arguments import check_positive_int
from per_example_grads.dp.mechanisms import _BufferedMechanism, _strategies


def inverse_square_root_band(bands: int) -> np.ndarray:
    """The first ``bands`` coefficients of ``(1 - z)^{1/2}``, float64 ``[bands]``.

    Examples:
      >>> inverse_square_root_band(4)
      array([ 1.    , -0.5   , -0.125 , -0.0625])
    """
    k = np.arange(1, check_positive_int("bands", bands), dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((2 * k - 3) / (2 * k))])


class BISR(_BufferedMechanism):
    """Banded inverse square root: ``x_t = sum_{j < bands} d_j z_{t-j}`` (module docstring).

    Args:
      bands: ``p >= 1``, the non-zero diagonals of ``C^{-1}`` (1 is
        DP-SGD); the state is ``p - 1`` draws.
      num_steps: the planned number of steps (``coefficients`` and
        ``sensitivity()`` default to it; any number may be taken, each
        accounted).
      cycle_length: the ``poisson_batches`` cycle, the least number of steps
        between two participations of an example, ``<= num_steps``.

    Examples:
      >>> m = BISR(bands=4, num_steps=64, cycle_length=8)
      >>> m.coefficients[:4]
      array([1.    , 0.5   , 0.375 , 0.3125])
      >>> sigma, q, k = m.accounted_as(4.0, 0.25, 64)
      >>> (q, k), round(sigma * m.sensitivity(64), 12)
      ((1.0, 1), 4.0)
    """

    def __init__(self, bands: int, num_steps: int, *, cycle_length: int, name: str = "bisr"):
        bands = check_positive_int("bands", bands)
        num_steps = check_positive_int("num_steps", num_steps)
        cycle = check_positive_int("cycle_length", cycle_length)
        if cycle > num_steps:
            raise ValueError(f"cycle_length ({cycle}) must be at most num_steps ({num_steps}).")
        super().__init__(bands - 1, cycle, name)
        self.bands, self.num_steps = bands, num_steps
        self._d = inverse_square_root_band(bands)

    @property
    def coefficients(self) -> np.ndarray:
        """The first ``num_steps`` Toeplitz coefficients of ``C`` (float64)."""
        return self._coefficients_for(self.num_steps)

    def _coefficients_for(self, n: int) -> np.ndarray:
        return _strategies().inverse_coefficients(self._d, n)

    def build_state(self, variables) -> None:
        if self.bands == 1:  # x = z: nothing to keep
            super(_BufferedMechanism, self).build_state(variables)
            return
        super().build_state(variables)

    def correlate(self, fresh, step):
        if self.bands == 1:
            return list(fresh)
        return super().correlate(fresh, step)

    def _parameter_values(self) -> np.ndarray:
        return np.concatenate([[self.cycle_length], self._d])

    def _next(self, z, buffer):
        # buffer[j - 1] holds z_{t-j}; zeros before the first step.
        past = tf.convert_to_tensor(buffer)
        x = z + tf.tensordot(tf.constant(self._d[1:], tf.float32), past, axes=1)
        buffer.assign(tf.concat([z[None], past[:-1]], axis=0))
        return x

    def get_config(self) -> dict:
        return {"bands": self.bands, "num_steps": self.num_steps, "cycle_length": self.cycle_length, "name": self.name}


__all__ = ["BISR", "inverse_square_root_band"]
