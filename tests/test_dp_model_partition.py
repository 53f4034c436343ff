"""A cyclic run keeps one partition: ``DPModel``'s ledger records it, and every later dataset takes it or is refused.

Across a second ``fit``, ``save_weights`` / ``load_weights``, a
``tf.train.Checkpoint``, a new process, unit-level sampling and a file saved
before the ledger had the record. Each example's part is read from ``q = 1``
batches: at ``q = 1`` step ``t`` holds exactly part ``t mod b``.
"""

from __future__ import annotations

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import CrashAtStep, run_here, run_in_new_process

N, CYCLE = 12, 2
X = np.arange(N, dtype="float32")[:, None] * np.ones((1, 3), "float32")  # row i holds i
Y = np.zeros((N, 2), "float32")


def _dp_model(mechanism=None, **kw):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    dp = peg.keras.DPModel(
        net,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        seed=0,
        mechanism=mechanism or peg.dp.BandMF(bands=2, num_steps=8),
        **kw,
    )
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return dp


def _batches(x=X, seed=None, **kw):
    return peg.dp.poisson_batches(x, Y, sampling_probability=1.0, cycle_length=CYCLE, steps=2 * CYCLE, seed=seed, **kw)


def _parts(ds) -> list[set]:
    """The rows (by value) of part 0, 1, ..., read from the dataset's next cycle of q = 1 batches."""
    sampling = ds.pegrad_sampling
    saved = int(sampling.next_step.numpy())
    parts = [set(xb.numpy()[mask.numpy() == 1, 0].astype(int).tolist()) for xb, _, mask, *_ in ds.take(CYCLE)]
    sampling.next_step.assign(saved)
    return [parts[(p - saved) % CYCLE] for p in range(CYCLE)]  # step t samples part t mod CYCLE


def test_a_second_fit_on_a_new_unseeded_dataset_keeps_the_runs_partition():
    dp = _dp_model()
    first = _batches()
    dp.fit(first, epochs=1, verbose=0)
    recorded = dp.aggregator.partition.numpy()
    np.testing.assert_array_equal(recorded, first.pegrad_sampling.partition)
    second = _batches()  # seed=None: another key from OS entropy
    assert not np.array_equal(second.pegrad_sampling.partition, recorded)
    dp.fit(second, epochs=1, verbose=0)
    np.testing.assert_array_equal(second.pegrad_sampling.partition, recorded)
    assert _parts(second) == _parts(first)
    assert int(dp.dp_steps.numpy()) == 4 * CYCLE


def test_a_dataset_of_other_rows_or_order_is_refused_after_a_step_and_recorded_before():
    dp = _dp_model()
    # Before any step the ledger takes the newest dataset's partition (a fit of no epoch takes no step).
    dp.fit(_batches(X[::-1].copy(), seed=1), epochs=0, verbose=0)
    np.testing.assert_array_equal(
        dp.aggregator.partition.numpy(), _batches(X[::-1].copy(), seed=1).pegrad_sampling.partition
    )
    dp.fit(_batches(seed=2), epochs=1, verbose=0)
    np.testing.assert_array_equal(dp.aggregator.partition.numpy(), _batches(seed=2).pegrad_sampling.partition)
    for other in (_batches(X[::-1].copy(), seed=2), _batches(X + 1, seed=2)):
        with pytest.raises(ValueError, match="same rows, in the same order, with the same cycle_length"):
            dp.fit(other, epochs=1, verbose=0)
    assert int(dp.dp_steps.numpy()) == 2 * CYCLE


@pytest.mark.parametrize("how", ["weights", "checkpoint"])
def test_a_restored_run_gives_its_partition_to_a_new_dataset(tmp_path, how):
    dp = _dp_model()
    first = _batches()
    dp.fit(first, epochs=1, verbose=0)
    if how == "weights":
        dp.save_weights(str(tmp_path / "run.weights.h5"))
    else:
        path = tf.train.Checkpoint(model=dp).write(str(tmp_path / "run"))
    restored = _dp_model()
    if how == "weights":
        restored.load_weights(str(tmp_path / "run.weights.h5"))
    else:
        tf.train.Checkpoint(model=restored).read(path).expect_partial()
    again = _batches()
    restored.fit(again, epochs=1, verbose=0)
    assert _parts(again) == _parts(first)
    np.testing.assert_array_equal(restored.aggregator.partition.numpy(), first.pegrad_sampling.partition)


def test_a_run_restored_by_backup_and_restore_keeps_its_partition_on_a_new_dataset(tmp_path):
    # BackupAndRestore restores the ledger in on_train_begin, after fit has read the dataset's partition.
    backup = str(tmp_path / "backup")
    first = _batches()
    with pytest.raises(RuntimeError, match="killed"):
        _dp_model().fit(
            first,
            epochs=3,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2), CrashAtStep(5)],
        )
    restored, again = _dp_model(), _batches()  # another unseeded dataset, as after a restart
    restored.fit(again, epochs=3, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2)])
    assert _parts(again) == _parts(first)
    np.testing.assert_array_equal(restored.aggregator.partition.numpy(), first.pegrad_sampling.partition)
    assert int(restored.dp_steps.numpy()) > 5  # continued from the backup


@pytest.mark.parametrize("physical_batch_size", [None, 4])
def test_unit_level_cyclic_sampling_keeps_each_units_part(physical_batch_size):
    ids = np.repeat(np.arange(6) + 100, 2)
    dp = _dp_model(privacy_unit="unit", physical_batch_size=physical_batch_size)
    first = _batches(unit_ids=ids)
    dp.fit(first, epochs=1, verbose=0)
    again = _batches(unit_ids=ids)
    dp.fit(again, epochs=1, verbose=0)
    assert _parts(again) == _parts(first)
    with pytest.raises(ValueError, match="same rows, in the same order"):
        dp.fit(_batches(unit_ids=ids[::-1].copy()), epochs=1, verbose=0)


def test_a_file_saved_before_the_partition_was_recorded_loads_and_refuses_cyclic_steps(tmp_path):
    # Such a file is this one without the ledger's last three variables (the aggregator's vars/4 to 6)
    # and without the copy of the ledger the network's files carry (network_ledger, newer still).
    for mechanism, cycle in ((peg.dp.BandMF(bands=2, num_steps=8), CYCLE), (peg.dp.GaussianNoise(), 1)):
        dp = _dp_model(mechanism)
        data = lambda: peg.dp.poisson_batches(X, Y, sampling_probability=0.5, cycle_length=cycle, steps=4)  # noqa: E731
        dp.fit(data(), epochs=1, verbose=0)
        path = str(tmp_path / f"old{cycle}.weights.h5")
        dp.save_weights(path)
        with h5py.File(path, "a") as f:
            assert f["aggregator/vars/4"].shape == (5,) and f["aggregator/vars/5"].shape == (4,)
            del (
                f["aggregator/vars/4"],
                f["aggregator/vars/5"],
                f["aggregator/vars/6"],
                f["layers/sequential/_dp_ledger"],
            )
        old = _dp_model(type(mechanism)(**mechanism.get_config()))
        old.load_weights(path)
        assert int(old.dp_steps.numpy()) == 4 and not old.aggregator.partition.numpy().any()
        assert old.epsilon(1e-5) == pytest.approx(dp.epsilon(1e-5), rel=1e-12)
        if cycle == 1:
            old.fit(data(), epochs=1, verbose=0)  # nothing to keep without a cycle
            assert int(old.dp_steps.numpy()) == 8
        else:
            with pytest.raises(ValueError, match="no record of the partition"):
                old.fit(data(), epochs=1, verbose=0)


_PROCESS = """
import sys
import keras, numpy as np
import per_example_grads as peg

x = np.arange(12, dtype="float32")[:, None] * np.ones((1, 3), "float32")
y = np.zeros((12, 2), "float32")
keras.utils.set_random_seed(0)
net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, mechanism=peg.dp.BandMF(bands=2, num_steps=8))
dp.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
if sys.argv[2] == "load":
    dp.load_weights(sys.argv[1])
ds = peg.dp.poisson_batches(x, y, sampling_probability=1.0, cycle_length=2, steps=4)  # seed=None
dp.fit(ds, epochs=1, verbose=0)
dp.save_weights(sys.argv[1])
print("PARTS", [sorted(xb.numpy()[m.numpy() == 1, 0].astype(int).tolist()) for xb, _, m in ds.take(2)])
"""


@pytest.mark.slow
def test_a_new_process_with_an_unseeded_dataset_keeps_the_partition(tmp_path):
    """The run starts in this process and continues in a new one, whose unseeded dataset would draw another
    partition from its own OS entropy: it must take the file's. (Only the second run needs a new process.)"""
    path = str(tmp_path / "run.weights.h5")

    def parts(out):
        return [line for line in out.splitlines() if line.startswith("PARTS")][0]

    first = parts(run_here(_PROCESS, path, "new"))
    assert parts(run_in_new_process(_PROCESS, path, "load")) == first  # each step of the next cycle: the same rows
