"""The wrapped network's own files carry the ledger (``per_example_grads.keras.network_ledger``).

The issue's case: ``dp.model.save("m.keras")``, loaded into a new ``DPModel``,
started at 0 steps (epsilon 11.28 reported for weights that had taken 80
steps, true 16.29). Here: the run continues from the network's ``.keras`` and
``.weights.h5`` files with its steps, its epsilon and (BandMF) its noise
state, also in a new process; another mechanism's file is refused, naming
both; a file without a ledger (public weights) still loads; and Keras alone
still reads the file as a plain network's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import per_example_grads as peg

N = 32
X = np.random.default_rng(0).normal(size=(N, 4)).astype("float32")
Y = (np.arange(N) % 3).astype("int64")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)])


def _dp(net=None, mechanism=None, **kw):
    dp = peg.keras.DPModel(net or _net(), noise_multiplier=1.0, seed=0, mechanism=mechanism, **kw)
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    return dp


def _batches(cycle_length=1, seed=0):
    return peg.dp.poisson_batches(X, Y, sampling_probability=0.5, seed=seed, cycle_length=cycle_length)


def _band():
    return peg.dp.BandMF(bands=2, num_steps=16)


@pytest.mark.parametrize("suffix", [".keras", ".weights.h5"])
def test_a_run_continues_from_the_networks_own_file_with_its_steps_and_epsilon(tmp_path, suffix):
    dp = _dp()
    dp.fit(_batches(), epochs=2, verbose=0)
    path = str(tmp_path / f"net{suffix}")
    (dp.model.save if suffix == ".keras" else dp.model.save_weights)(path)
    steps, eps = int(dp.dp_steps.numpy()), dp.epsilon(1e-5)
    assert steps > 0

    net = keras.models.load_model(path) if suffix == ".keras" else _net()
    resumed = _dp(net)
    assert int(resumed.dp_steps.numpy()) == 0  # Keras's load alone does not carry the ledger ...
    resumed.load_weights(path)  # ... the file does, loaded into the DPModel
    assert int(resumed.dp_steps.numpy()) == steps
    assert resumed.epsilon(1e-5) == pytest.approx(eps, rel=1e-12)
    assert all(np.array_equal(a, b) for a, b in zip(resumed.model.get_weights(), dp.model.get_weights()))
    resumed.fit(_batches(seed=1), epochs=1, verbose=0)  # the guard takes the loaded weights as the ledger's
    assert int(resumed.dp_steps.numpy()) > steps


def test_a_banded_run_from_the_networks_file_continues_its_noise_exactly(tmp_path):
    """Same steps, same updates: the partition and the noise buffers came with the file."""
    dp = _dp(mechanism=_band())
    data = _batches(cycle_length=2)
    dp.fit(data, epochs=1, verbose=0)
    path = str(tmp_path / "net.keras")
    dp.model.save(path)
    dp.fit(data, epochs=1, verbose=0)  # the uninterrupted run

    resumed = _dp(keras.models.load_model(path), mechanism=_band())
    resumed.load_weights(path)
    resumed.fit(_batches(cycle_length=2), epochs=1, verbose=0)  # a new dataset, resumed at the ledger's step
    assert int(resumed.dp_steps.numpy()) == int(dp.dp_steps.numpy())
    assert all(np.array_equal(a, b) for a, b in zip(resumed.model.get_weights(), dp.model.get_weights()))


def test_another_mechanisms_file_is_refused_naming_both(tmp_path):
    dp = _dp()
    dp.fit(_batches(), epochs=1, verbose=0)
    path = str(tmp_path / "net.weights.h5")
    dp.model.save_weights(path)
    banded = _dp(mechanism=_band())
    with pytest.raises(ValueError, match=r"taken with a GaussianNoise mechanism, and this DPModel's is a BandMF"):
        banded.load_weights(path)
    with pytest.raises(ValueError, match=r"GaussianNoise mechanism, and this DPModel's is a BandMF"):
        banded.model.load_weights(path)  # through the network itself too


def test_an_adaptive_runs_file_is_refused_by_a_fixed_clip_dpmodel(tmp_path):
    dp = _dp(adaptive_clipping=peg.dp.AdaptiveClipping(initial_l2_norm_clip=1.0))
    dp.fit(_batches(), epochs=1, verbose=0)
    path = str(tmp_path / "net.weights.h5")
    dp.model.save_weights(path)
    with pytest.raises(ValueError, match=r"entries \['l2_norm_clip'\] differ from this DPModel's"):
        _dp().load_weights(path)


def test_public_weights_load_without_a_ledger_and_keras_reads_the_file_alone(tmp_path):
    public = _net()
    public.layers[0].kernel.assign(public.layers[0].kernel * 3.0)
    plain = str(tmp_path / "public.weights.h5")
    public.save_weights(plain)
    dp = _dp()
    dp.load_weights(plain)
    assert int(dp.dp_steps.numpy()) == 0
    assert all(np.array_equal(a, b) for a, b in zip(dp.model.get_weights(), public.get_weights()))
    dp.fit(_batches(), epochs=1, verbose=0)

    saved = str(tmp_path / "private.keras")
    dp.model.save(saved)
    alone = keras.models.load_model(saved)  # a plain Keras network: the ledger is not a layer of it
    assert len(alone.weights) == len(dp.model.weights) == 4
    np.testing.assert_array_equal(alone.predict(X, verbose=0), dp.model.predict(X, verbose=0))
    unwrapped = _net()
    unwrapped.load_weights(saved)
    assert all(np.array_equal(a, b) for a, b in zip(unwrapped.get_weights(), dp.model.get_weights()))


def test_the_dpmodels_own_file_still_loads_and_says_what_it_did(tmp_path):
    dp = _dp()
    dp.fit(_batches(), epochs=1, verbose=0)
    path = str(tmp_path / "dp.weights.h5")
    dp.save_weights(path)
    other = _dp()
    other.load_weights(path)
    assert int(other.dp_steps.numpy()) == int(dp.dp_steps.numpy())
    assert other.epsilon(1e-5) == pytest.approx(dp.epsilon(1e-5), rel=1e-12)


def test_a_new_process_continues_from_the_networks_keras_file(tmp_path):
    dp = _dp()
    dp.fit(_batches(), epochs=2, verbose=0)
    path = tmp_path / "net.keras"
    dp.model.save(path)
    script = textwrap.dedent(
        f"""
        import keras, numpy as np
        import per_example_grads as peg
        net = keras.models.load_model({str(path)!r})
        dp = peg.keras.DPModel(net, noise_multiplier=1.0, seed=0)
        dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        dp.load_weights({str(path)!r})
        print(int(dp.dp_steps.numpy()), repr(dp.epsilon(1e-5)))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    steps, eps = out.stdout.split()[-2:]
    assert int(steps) == int(dp.dp_steps.numpy())
    assert float(eps) == pytest.approx(dp.epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize("kind", ["unit", "adaptive"])
def test_unit_level_and_adaptive_runs_continue_from_the_networks_file(tmp_path, kind):
    if kind == "unit":
        make = lambda net=None: _dp(net, privacy_unit="unit")  # noqa: E731
        data = lambda: peg.dp.poisson_batches(X, Y, unit_ids=np.arange(N) // 2, sampling_probability=0.5, seed=0)  # noqa: E731
    else:
        make = lambda net=None: _dp(net, adaptive_clipping=peg.dp.AdaptiveClipping(initial_l2_norm_clip=1.0))  # noqa: E731
        data = _batches
    dp = make()
    dp.fit(data(), epochs=1, verbose=0)
    path = str(tmp_path / "net.keras")
    dp.model.save(path)
    resumed = make(keras.models.load_model(path))
    resumed.load_weights(path)
    assert int(resumed.dp_steps.numpy()) == int(dp.dp_steps.numpy()) > 0
    assert resumed.epsilon(1e-5) == pytest.approx(dp.epsilon(1e-5), rel=1e-12)
    if kind == "adaptive":  # the clip norm the run had moved to, not the initial one
        assert float(resumed.aggregator.l2_norm_clip.numpy()) == float(dp.aggregator.l2_norm_clip.numpy()) != 1.0
