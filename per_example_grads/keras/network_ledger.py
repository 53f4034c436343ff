"""The privacy ledger in the wrapped network's own files.

A ``DPModel`` saves its ledger (``DPAggregator``'s steps, noise multiplier,
sampling probability, sampling kind, partition and mechanism, the
mechanism's noise state, and the network's fingerprint, ``network_guard``)
with its own weights and checkpoints. The network it wraps is saved on its
own too (``dp.model.save("m.keras")``, ``dp.model.save_weights``): for
deployment, and for a run continued from it. Its file then held weights
that had taken ``k`` private steps and no record of them, and a new
``DPModel`` continued from it counted from 0.

``attach`` gives the network a ``NetworkLedger`` (an attribute Keras's
saver walks, not a layer of the network: its ``layers``, ``weights`` and
``get_weights`` are unchanged): every ``.keras`` and ``.weights.h5`` file of
the network holds the ledger, under ``_dp_ledger``, by name. Keras's own
``load_model`` and ``load_weights`` of an unwrapped network ignore it (the
file stays a plain Keras file); loading the file into a network that a
``DPModel`` wraps (``dp.load_weights(path)``, or ``dp.model.load_weights``)
restores the ledger with the weights, and refuses one that another
mechanism's steps made (``DPAggregator.check_saved_ledger``). A file
without a ledger (public pre-trained weights) loads as before, ledger
untouched.

What stays outside: ``keras.models.load_model(path)`` builds a new network
from the file, without the ledger; wrap it and load the same file into the
``DPModel`` to continue the run.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import numpy as np

from per_example_grads.dp import ledger

ATTRIBUTE = "_dp_ledger"  # the network's attribute, and the file's group
_CORE = (
    "steps",
    "min_noise_multiplier",
    "max_sampling_probability",
    "poisson",
    "partition",
    "mechanism_fingerprint",
    "segments",
)


class NetworkLedger(keras.layers.Layer):
    """Saves and loads a ``DPModel``'s ledger where the network's files are written and read.

    Args:
      owner: the ``DPModel`` (held weakly: the network does not keep it alive).
    """

    def __init__(self, owner: Any):
        super().__init__(name="dp_ledger", trainable=False)
        object.__setattr__(self, "_owner", weakref.ref(owner))  # not a tracked child
        self.built = True

    def _entries(self) -> dict[str, Any]:
        """The owner's ledger variables by name: the aggregator's, its mechanism's, the network's fingerprint."""
        owner = self._owner()
        if owner is None:
            return {}
        aggregator = owner.aggregator
        entries = {name: getattr(aggregator, name) for name in _CORE}
        if isinstance(aggregator.l2_norm_clip, keras.Variable):  # adaptive clipping's clip norm
            entries["l2_norm_clip"] = aggregator.l2_norm_clip
        entries |= {f"mechanism_{i}": v for i, v in enumerate(aggregator.mechanism.variables)}
        entries["network_fingerprint"] = owner._network_fingerprint
        return entries

    def save_own_variables(self, store) -> None:
        for name, v in self._entries().items():
            store[name] = np.asarray(v.numpy())

    def load_own_variables(self, store) -> None:
        """Restores the ledger from a network's file; a file without one (no keys) leaves it as it is.

        Raises:
          ValueError: the file's ledger was made by another mechanism (named),
            or by a ``DPModel`` configured otherwise (its entries differ).
        """
        saved = set(store.keys())
        if not saved:
            return
        owner, entries = self._owner(), self._entries()
        if owner is None:
            return
        values = {name: np.asarray(store[name]) for name in saved}
        if "segments" in values:  # a table from before truncated sampling's columns
            values["segments"] = ledger.upgraded(values["segments"])
        owner.aggregator.check_saved_ledger(int(values["steps"]), values["mechanism_fingerprint"])
        mismatched = sorted(
            name
            for name in saved | set(entries)
            if name not in saved or name not in entries or values[name].shape != tuple(entries[name].shape)
        )
        if mismatched:
            raise ValueError(
                f"the network's file holds a DPModel ledger whose entries {mismatched} differ from this DPModel's "
                "(adaptive clipping, or the mechanism's noise state, configured otherwise): continuing it here "
                "would account steps that were not taken this way. Wrap the network in a DPModel configured as "
                "the one that saved it, or begin a new run."
            )
        for name, v in entries.items():
            v.assign(values[name])


def attach(network: keras.Model, owner: Any) -> None:
    """Gives ``network`` the ledger of ``owner`` (a ``DPModel``), saved with the network's own files."""
    object.__setattr__(network, ATTRIBUTE, NetworkLedger(owner))  # not a tracked layer of the network


def holds_network(filepath) -> bool:
    """Whether a ``.weights.h5`` or ``.keras`` file is a bare network's (not a ``DPModel``'s, which has an ``aggregator``)."""
    import zipfile

    import h5py  # Keras's own dependency for its weights files

    path = str(filepath)
    try:
        if path.endswith(".keras"):
            with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as raw, h5py.File(raw, "r") as f:
                return "aggregator" not in f
        if path.endswith(".weights.h5"):
            with h5py.File(path, "r") as f:
                return "aggregator" not in f
    except (OSError, KeyError, zipfile.BadZipFile):
        return False  # Keras's own loader reports what is wrong with the file
    return False
