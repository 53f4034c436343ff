"""One ledger per network: a ``DPModel`` notices training its ledger never saw.

A ``DPModel``'s privacy ledger counts the steps *it* takes. Two things would
make its ``epsilon()`` silently describe less than the network went through:

- **the network trained outside it** (``dp.model.fit(...)``, a custom loop
  on ``dp.model``): after the first DP step, the network's trainable weights
  must change only through ``DPModel``'s steps. ``NetworkGuard`` keeps a
  fingerprint of them, ``(sum w, sum w^2)`` over every trainable variable in
  float64, taken whenever ``DPModel`` has changed or saved them (after each
  ``fit`` epoch and call, before ``save_weights`` / ``save``, after
  ``load_weights``), and stored in a non-trainable variable saved with the
  weights, so a restored checkpoint restores the fingerprint of its own
  weights. A mismatch later means the weights were changed by something
  else; the fingerprint does not depend on the optimizer or on how the
  change was made.
- **two ``DPModel``\\ s wrapping one network**, each counting only its own
  steps: a network has one owner (``claim``). A second ``DPModel`` may take
  it over only while the first has taken no step.

Changes before the first DP step (loading or pre-training public weights)
are not private training and are accepted.
"""

from __future__ import annotations

import weakref

import numpy as np

_OWNER = "_pegrad_dp_owner"


def claim(network, owner, steps_of) -> None:
    """Makes ``owner`` the one ``DPModel`` of ``network``.

    Args:
      steps_of: ``steps_of(dp_model) -> int``, the DP steps a previous owner took.

    Raises:
      ValueError: a live ``DPModel`` already owns ``network`` and has taken steps.
    """
    previous = getattr(network, _OWNER, None)
    previous = previous() if previous is not None else None
    if previous is not None and previous is not owner and steps_of(previous) > 0:
        raise ValueError(
            f"the network {network.name!r} is already wrapped by another DPModel, which has taken "
            f"{steps_of(previous)} DP step(s): two ledgers would each count only their own steps, and "
            "neither epsilon would cover the network. Keep training with that DPModel, or wrap a copy "
            "(keras.models.clone_model(network), then set_weights)."
        )
    object.__setattr__(network, _OWNER, weakref.ref(owner))  # not a tracked Keras attribute


def owned_by(network, owner) -> bool:
    """Whether ``owner`` is still the ``DPModel`` of ``network`` (``claim``)."""
    current = getattr(network, _OWNER, None)
    return current is not None and current() is owner


def fingerprint(variables) -> np.ndarray:
    """``[2]`` float64: ``(sum w, sum w^2)`` over every entry of ``variables``.

    Each variable's sums are numpy's pairwise float64 sums of its entries
    (``_pairwise``: bit for bit what ``w.astype(float64).sum()`` gives,
    without a float64 copy of a large table), so a fingerprint saved with a
    checkpoint matches on any machine.
    """
    total = np.zeros(2, np.float64)
    for v in variables:
        w = np.ravel(v.numpy())
        total += (_pairwise(w, lambda c: c), _pairwise(w, np.square))
    return total


_LEAF = 1 << 16  # entries cast to float64 at a time


def _pairwise(w: np.ndarray, f) -> float:
    """``f(w.astype(float64)).sum()`` for 1-D ``w``, in pieces of at most ``_LEAF`` entries.

    numpy sums a contiguous array pairwise, splitting ``n`` entries at
    ``n2 = n // 2 - (n // 2) % 8``; splitting at the same points and adding
    the halves in the same order gives the same float64 result bit for bit.
    """
    n = w.size
    if n <= _LEAF:
        return f(w.astype(np.float64)).sum()
    n2 = n // 2 - (n // 2) % 8
    return _pairwise(w[:n2], f) + _pairwise(w[n2:], f)


class NetworkGuard:
    """The fingerprint of a network's trainable weights, as the ledger last saw them.

    Args:
      network: the wrapped Keras model.
      variable: a ``[2]`` float64 non-trainable variable of the ``DPModel``,
        saved with its weights, that holds the fingerprint.
    """

    def __init__(self, network, variable):
        self._network, self._variable = network, variable

    def refresh(self) -> None:
        """Records the weights as they are now."""
        self._variable.assign(fingerprint(self._network.trainable_variables))

    def changed(self) -> bool:
        """Whether the weights differ from the last ``refresh`` (or the restored fingerprint)."""
        return not np.array_equal(fingerprint(self._network.trainable_variables), np.asarray(self._variable.numpy()))
