"""One ledger per network: a ``DPModel`` notices training its ledger never saw.

A ``DPModel``'s privacy ledger counts the steps *it* takes. Two things would
make its ``epsilon()`` silently describe less than the network went through:

- **the network trained outside it** (``dp.model.fit(...)``, a custom loop
  on ``dp.model``): after the first DP step, the network's trainable weights
  must change only through ``DPModel``'s steps. ``NetworkGuard`` keeps a
  fingerprint of them (``fingerprint``: integer sums of their bits, plain
  and weighed by position), taken
  whenever ``DPModel`` has changed or saved them (after each ``fit`` epoch
  and call, before ``save_weights`` / ``save``, after ``load_weights``), and
  stored in a non-trainable variable saved with the weights, so a restored
  checkpoint restores the fingerprint of its own weights. A mismatch later
  means the weights were changed by something else; the fingerprint does
  not depend on the optimizer or on how the change was made.
- **two ``DPModel``\\ s wrapping one network**, each counting only its own
  steps: a network has one owner (``claim``). A second ``DPModel`` may take
  it over only while the first has taken no step.

Changes before the first DP step (loading or pre-training public weights)
are not private training and are accepted.
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

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
            "neither epsilon would cover the network. Keep training with that DPModel, or continue its run in "
            "another: wrap a copy (keras.models.clone_model(network)) in a DPModel built the same way and load "
            "that DPModel's save_weights file into it, which carries the ledger (set_weights alone would start "
            "the new ledger at 0 steps)."
        )
    object.__setattr__(network, _OWNER, weakref.ref(owner))  # not a tracked Keras attribute


def owned_by(network, owner) -> bool:
    """Whether ``owner`` is still the ``DPModel`` of ``network`` (``claim``)."""
    current = getattr(network, _OWNER, None)
    return current is not None and current() is owner


def fingerprint(variables) -> np.ndarray:
    """``[2]`` float64: ``(sum_j b_j, sum_j (2 j + 1) b_j) mod 2^32`` over the bits ``b_j`` of every entry.

    ``b_j`` is the ``j``-th entry's bit pattern as an unsigned integer,
    counted over all of ``variables`` in order (a 4-byte entry's 32 bits,
    each half of an 8-byte one, a narrower one's widened). The second sum
    weighs each entry by its position, so moving weights to other places (a
    permutation, two variables swapped) changes it. Unsigned sums wrap
    exactly and do not depend on the order of addition, so a fingerprint
    saved with a checkpoint matches on any machine and device. A variable of
    at most ``_ON_HOST`` entries is summed on the host, positions and all
    (a function launch per variable cost more than the copy); a larger one
    where it lives, in one call (``_sum_and_moment``: two reductions of its
    bits, no copy of a large table to the host and no ``[n]`` position
    vector); its share of the position-weighted sum follows on the host
    from its offset. Any change of a weight changes its bits; the two sums
    miss it only when the changes cancel in both.
    """
    total, moment, offset = 0, 0, 0
    for v in variables:
        rows = _bit_rows(v)
        n = int(rows.shape[0]) * int(rows.shape[1])
        if not n:
            continue
        if n <= _ON_HOST:  # uint64 products and sums stay below 2^64: k b_k < 2^16 2^32, at most 2^16 terms
            bits = rows.numpy().reshape(-1).astype(np.uint64)
            s, k = int(bits.sum()), int(np.arange(n, dtype=np.uint64) @ bits)
        else:
            s, k = (int(x) for x in _sum_and_moment(rows).numpy())
        # sum_k (2 (offset + k) + 1) b_k = 2 sum_k k b_k + (2 offset + 1) sum_k b_k
        total, moment = total + s, moment + 2 * k + (2 * offset + 1) * s
        offset += n
    return np.array([total % (1 << 32), moment % (1 << 32)], np.float64)


_ON_HOST = 1 << 16  # entries of a variable that ``fingerprint`` sums on the host


def graph_fingerprint(variables) -> tf.Tensor:
    """``fingerprint(variables)`` as a ``[2]`` float64 tensor, computed where the variables live (in a graph too).

    For a step that records its own weights (a custom loop's
    ``DPModel.train_step``); the same integers mod 2^32, so it equals the
    host's ``fingerprint`` exactly, and computed as it is: two reductions
    of each variable's bits (``_sum_and_moment``, one function call per
    variable, so the step's graph gains a few ops per variable, not the
    reductions' dozens), no position vector.
    """
    sums, starts, offset = [], [], 0
    for v in variables:
        rows = _bit_rows(v)
        n = rows.shape.num_elements()  # an 8-byte entry counts as two
        if not n:
            continue
        sums.append(_sum_and_moment(rows))
        starts.append((2 * offset + 1) % (1 << 32))
        offset += n
    if not sums:
        return tf.zeros([2], tf.float64)
    s, k = tf.unstack(tf.stack(sums), axis=1)
    # sum_k (2 (offset + k) + 1) b_k = 2 sum_k k b_k + (2 offset + 1) sum_k b_k, wrapping mod 2^32
    moment = tf.reduce_sum(tf.constant(2, tf.uint32) * k + tf.constant(starts, tf.uint32) * s)
    return tf.cast(tf.stack([tf.reduce_sum(s), moment]), tf.float64)


def bit_sums_fingerprint(variables) -> np.ndarray:
    """``[2]`` float64: ``(sum b, sum b^2) mod 2^32``, the fingerprint checkpoints of the versions before ``fingerprint``'s saved.

    Blind to a permutation of the entries; recognised in a restored
    checkpoint only.
    """
    total = np.zeros(2, np.uint64)
    for v in variables:
        b = _host_bits(v.numpy())
        total += (b.sum(dtype=np.uint64), (b * b).sum(dtype=np.uint64))  # b < 2^32: b^2 fits, sums wrap mod 2^64
    return (total % (1 << 32)).astype(np.float64)


_UNSIGNED = {1: tf.uint8, 2: tf.uint16, 4: tf.uint32}  # an entry's bits by its width (8 bytes: two uint32)


def _host_bits(w: np.ndarray) -> np.ndarray:
    """``[n]`` uint64: ``_bits`` of a numpy array."""
    w = np.ascontiguousarray(w)
    return w.reshape(-1).view(_UNSIGNED[min(w.dtype.itemsize, 4)].as_numpy_dtype).astype(np.uint64)


def _bit_rows(v) -> tf.Tensor:
    """``[m, w]`` uint32: the bits of ``v``'s entries (a narrower one widened), as rows of its last axis (both halves of an 8-byte entry in one row)."""
    w = tf.convert_to_tensor(v)
    width = (int(w.shape[-1]) if w.shape.rank else 1) * (2 if w.dtype.size == 8 else 1)
    bits = tf.cast(tf.bitcast(w, _UNSIGNED[min(w.dtype.size, 4)]), tf.uint32)
    return tf.reshape(bits, [-1, width]) if width else tf.zeros([0, 1], tf.uint32)


@tf.function(input_signature=[tf.TensorSpec([None, None], tf.uint32)], autograph=False)
def _sum_and_moment(rows: tf.Tensor) -> tf.Tensor:
    """``[2]`` uint32: ``(sum_k b_k, sum_k k b_k)`` mod 2^32 of ``rows [m, w]`` read row by row (``k = r w + c``).

    ``sum_k k b_k = w sum_r r R_r + sum_c c C_c`` from the row sums ``R`` and
    column sums ``C``: unsigned products and sums wrap mod 2^32 exactly, so
    it is the position-weighted sum, in two reductions over ``rows``. One
    call per variable, where it lives (``fingerprint``, ``graph_fingerprint``).
    """
    row, col = tf.reduce_sum(rows, axis=1), tf.reduce_sum(rows, axis=0)
    r = tf.cast(tf.range(tf.shape(rows, out_type=tf.int64)[0]), tf.uint32)  # wraps mod 2^32, as the sums do
    c = tf.cast(tf.range(tf.shape(rows, out_type=tf.int64)[1]), tf.uint32)
    width = tf.cast(tf.shape(rows, out_type=tf.int64)[1], tf.uint32)
    return tf.stack([tf.reduce_sum(row), width * tf.reduce_sum(r * row) + tf.reduce_sum(c * col)])


def legacy_fingerprint(variables) -> np.ndarray:
    """``[2]`` float64: ``(sum w, sum w^2)`` in float64, the fingerprint checkpoints of earlier versions saved.

    Each variable's sums are numpy's pairwise float64 sums of its entries
    (``_pairwise``: bit for bit what ``w.astype(float64).sum()`` gives).
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
        self._paths: list[str] = []

    def refresh(self) -> None:
        """Records the weights as they are now."""
        self._variable.assign(fingerprint(self._network.trainable_variables))
        self._paths = self.paths()

    def record_in_step(self) -> None:
        """``refresh``'s record, as ops of the step being built (after its update: they read the variables it wrote).

        For a step that no ``refresh`` follows (a custom loop's).
        """
        self._variable.assign(graph_fingerprint(self._network.trainable_variables))

    def paths(self) -> list[str]:
        """The paths of the network's trainable variables now."""
        return [getattr(v, "path", v.name) for v in self._network.trainable_variables]

    def trainable_changed(self) -> tuple[list[str], list[str]] | None:
        """``(before, now)`` trainable variable paths, where a layer's ``trainable`` changed since ``refresh``; else None."""
        now = self.paths()
        return None if now == self._paths else (self._paths, now)

    def changed(self) -> bool:
        """Whether the weights differ from the last ``refresh`` (or the restored fingerprint, of any kind)."""
        saved, weights = np.asarray(self._variable.numpy()), self._network.trainable_variables
        kinds = (fingerprint, bit_sums_fingerprint, legacy_fingerprint)  # the current one, then earlier versions'
        return not any(np.array_equal(kind(weights), saved) for kind in kinds)
