"""Every formulation of a convolution's per-example maths against the one-example loop, and the cost chooser between them.

The paths (``rules/conv.py``, priced by ``rules/path_costs.py``): patches
copied three ways (``extract_patches``, slices, a one-hot convolution) then
one product; one product per kernel offset; Gram-form norms; the clipped sum
from kept kernels or from one kernel VJP of the batch convolution. Each must
give every example's kernel gradient (or its norm, or the weighted sum)
of a one-example ``GradientTape`` loop, on random configurations.
"""

import dataclasses
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import model_zoo
from helpers import layerwise_clipped_against_loop, layerwise_per_example_against_loop
from per_example_grads.rules import conv, path_costs
from tolerances import rounding_rtol


def _random_config(rng):
    """``(spec, input shape [B, *spatial, c_in], c_out)``: a Conv1D or Conv2D layer whose output is not empty."""
    while True:
        rank = int(rng.integers(1, 3))
        padding = str(rng.choice(["valid", "same", "causal"] if rank == 1 else ["valid", "same"]))
        kernel = tuple(int(k) for k in rng.integers(1, 6, rank))
        strides = tuple(int(s) for s in rng.integers(1, 4, rank))
        strided = any(s > 1 for s in strides)
        dilation = tuple(1 if strided else int(rng.integers(1, 3)) for _ in strides)  # TF takes not both
        spatial = tuple(int(n) for n in rng.integers(3, 13, rank))
        c_in, c_out = int(rng.choice([1, 2, 3, 5])), int(rng.choice([1, 2, 4, 7]))
        reach = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
        if padding == "valid" and any(n < r for n, r in zip(spatial, reach)):
            continue
        return conv.ConvSpec(rank, kernel, strides, dilation, padding), (3, *spatial, c_in), c_out


CONFIGS = [_random_config(np.random.default_rng(seed)) for seed in range(12)]
IDS = [
    f"{s.rank}d-k{s.kernel_size}-s{s.strides}-d{s.dilation_rate}-{s.padding}-{shape[1:]}-{k}" for s, shape, k in CONFIGS
]


def _operands(spec, shape, c_out, seed=0):
    """``(a, g, loop, magnitude)``: an input, an output gradient of the layer's shape, the loop's per-example kernels ``[B, *kernel]``.

    ``magnitude`` is the loop's kernels of ``|a|`` and ``|g|``: each entry's
    sum of the absolute values of its terms, the scale of its rounding.
    """
    a = tf.random.stateless_normal(shape, [seed, 1])
    kernel = tf.random.stateless_normal([*spec.kernel_size, shape[-1], c_out], [seed, 2])
    padded = conv._causal_pad(spec, a)
    forward = lambda x, w: tf.nn.convolution(  # noqa: E731
        x, w, strides=list(spec.strides), padding=conv._padding(spec), dilations=list(spec.dilation_rate)
    )
    g = tf.random.stateless_normal(forward(padded, kernel).shape, [seed, 3])

    def loop(x, dz):
        out = []
        for n in range(shape[0]):
            with tf.GradientTape() as tape:
                tape.watch(kernel)
                z = forward(x[n : n + 1], kernel)
            out.append(tape.gradient(z, kernel, output_gradients=dz[n : n + 1]))
        return tf.stack(out).numpy()

    return a, g, loop(padded, g), loop(tf.abs(padded), tf.abs(g))


def _close(got, want, magnitude, n):
    """``|got - want| <= rounding_rtol(n) magnitude`` elementwise: two evaluations of ``n``-step sums whose terms' absolute values sum to ``magnitude``."""
    got = np.asarray(got, np.float64).reshape(np.shape(want))
    bound = rounding_rtol(n) * np.asarray(magnitude, np.float64) + 1e-30
    worst = np.max(np.abs(got - want) / bound)
    assert worst <= 1.0, f"off by {worst:.2f} times the rounding bound"


@pytest.mark.parametrize("spec, shape, c_out", CONFIGS, ids=IDS)
def test_every_path_equals_the_loop(spec, shape, c_out):
    """Per-example kernels by each builder and by offsets, Gram and materialized norms, both clipped sums."""
    a, g, loop, mag = _operands(spec, shape, c_out)
    b, kernel_shape = shape[0], loop.shape[1:]
    f = math.prod(spec.kernel_size) * shape[-1]
    g_rows = tf.reshape(g, [b, -1, c_out])
    t = g_rows.shape[1]
    mag_norms = (mag.reshape(b, -1) ** 2).sum(axis=1)  # bounds every Gram term's and every square's magnitude
    kernels = {
        builder: tf.matmul(conv.patches(spec, a, builder), g_rows, transpose_a=True)
        for builder in path_costs.PATCH_BUILDERS
    }
    kernels["offsets"] = conv._shifted_norms(spec, tuple(shape[1:-1]), a, g)[1]
    for name, got in kernels.items():
        assert got.shape == (b, f, c_out), name
        _close(tf.reshape(got, loop.shape), loop, mag, t + 1)
    want_norms = (loop.reshape(b, -1).astype(np.float64) ** 2).sum(axis=1)
    for builder in path_costs.PATCH_BUILDERS:
        gram, _ = conv._gram_part(conv.patches(spec, a, builder), g_rows)
        _close(gram, want_norms, mag_norms, 2 * t * t + f + c_out + 2)
        norms, built = conv._patch_norms(spec, a, g, t, f, builder)
        _close(norms, want_norms, mag_norms, 2 * (t + 1) + f * c_out)
        _close(tf.reshape(built, loop.shape), loop, mag, t + 1)
    weights = np.array([0.5, -1.25, 2.0], np.float32)
    want_sum = np.tensordot(weights.astype(np.float64), loop, axes=1)
    mag_sum = np.tensordot(np.abs(weights).astype(np.float64), mag, axes=1)
    _close(
        conv.weighted_kernel_sum(spec, tf.zeros(kernel_shape), a, g, tf.constant(weights)),
        want_sum,
        mag_sum,
        b * (t + 2),
    )
    _close(
        conv.kept_weighted_sum(kernels["offsets"], tf.constant(weights), kernel_shape), want_sum, mag_sum, b * (t + 2)
    )


@pytest.mark.parametrize("spec, shape, c_out", CONFIGS[:6], ids=IDS[:6])
def test_chosen_path_equals_the_loop(spec, shape, c_out):
    """``kernel_part`` and ``per_example_kernels`` as the chooser routes them (with and without a clipped sum)."""
    a, g, loop, mag = _operands(spec, shape, c_out, seed=1)
    b, t, f = shape[0], math.prod(g.shape[1:-1]), math.prod(spec.kernel_size) * shape[-1]
    want_norms = (loop.reshape(b, -1).astype(np.float64) ** 2).sum(axis=1)
    mag_norms = (mag.reshape(b, -1) ** 2).sum(axis=1)
    for keep in (False, True):
        norms, kept = conv.kernel_squared_norms(spec, a, g, keep)
        _close(norms, want_norms, mag_norms, 2 * t * t + f * c_out + f + c_out + 2)
        if kept is not None:
            _close(
                conv.kept_weighted_sum(kept, tf.ones([b]), loop.shape[1:]),
                loop.sum(axis=0),
                mag.sum(axis=0),
                b * (t + 2),
            )
    _close(tf.reshape(conv.per_example_kernels(spec, a, g), loop.shape), loop, mag, t + 1)


def _shape(b=64, spatial=(28, 28), out=(26, 26), kernel=(3, 3), strided=False, c_in=1, c_out=16):
    return path_costs.ConvShape(b, spatial, out, kernel, strided, c_in, c_out)


def test_chooser_takes_what_flop_counts_make_clear():
    m = path_costs.DEFAULT
    # One output position and a wide kernel: Gram's T^2 (f + k) = f + k against T f k = f k.
    one_position = _shape(spatial=(8, 8), out=(1, 1), kernel=(8, 8), c_in=64, c_out=64)
    assert path_costs.conv_norm_path(one_position, False, False, m).norms.startswith("gram:")
    # 676 positions of a 9-wide patch: Gram's 676^2 (9 + 16) against 676 9 16.
    many_positions = _shape()
    assert not path_costs.conv_norm_path(many_positions, False, False, m).norms.startswith("gram:")
    # The clipped sum after materialized kernels: kept (B f k) against a VJP of B T f k.
    choice = path_costs.conv_norm_path(many_positions, True, True, m)
    assert choice.keep and not choice.norms.startswith("gram:")
    # Not allowed to keep: the same norms and the VJP.
    assert not path_costs.conv_norm_path(many_positions, True, False, m).keep


def test_chooser_is_a_pure_function_of_shapes_and_rates():
    rng = np.random.default_rng(0)
    for _ in range(200):
        s = _shape(
            b=int(rng.integers(1, 512)),
            out=tuple(int(x) for x in rng.integers(1, 40, 2)),
            kernel=tuple(int(x) for x in rng.integers(1, 8, 2)),
            strided=bool(rng.integers(2)),
            c_in=int(rng.integers(1, 257)),
            c_out=int(rng.integers(1, 257)),
        )
        rates = {
            f.name: getattr(path_costs.DEFAULT, f.name) * float(rng.uniform(0.2, 5))
            for f in dataclasses.fields(path_costs.Machine)
        }
        m = path_costs.Machine(**rates)
        for for_sum, may_keep in [(False, False), (True, False), (True, True)]:
            choice = path_costs.conv_norm_path(s, for_sum, may_keep, m)
            assert choice == path_costs.conv_norm_path(s, for_sum, may_keep, m)
            # Never priced above materializing (then clip and sum the kept kernels, where allowed).
            _, built = path_costs.materialized_cost(s, m)
            bound = built + (path_costs.kept_sum_cost(s, m) if may_keep else path_costs.vjp_sum_cost(s, m)) * for_sum
            assert min(c for _, c in choice.costs) <= bound * (1 + 1e-12)


def test_machine_rejects_bad_rates():
    with pytest.raises(ValueError, match="Machine.flops"):
        path_costs.Machine(flops=0)


@pytest.mark.parametrize("builder", [None, "offsets", *path_costs.PATCH_BUILDERS])
def test_model_with_each_forced_path_matches_the_loop(builder, monkeypatch):
    """The reference CNN's shape (a 1-channel 8x8 strided 'same' conv, then a 4x4 strided one) through the engine, each path forced."""
    if builder is not None:
        monkeypatch.setattr(
            path_costs,
            "materialized_cost",
            lambda s, m=None, builders=None: ("offsets" if builder == "offsets" else f"patches:{builder}", 0.0),
        )
        monkeypatch.setattr(
            path_costs,
            "conv_norm_path",
            lambda s, for_sum, may_keep, m=None: path_costs.ConvChoice(
                "offsets" if builder == "offsets" else f"patches:{builder}", may_keep, ()
            ),
        )
    L = keras.layers
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            L.Conv2D(4, 5, strides=2, padding="same", activation="relu"),
            L.MaxPooling2D(2, 1),
            L.Conv2D(6, 3, strides=2, padding="valid", activation="relu"),
            L.Flatten(),
            L.Dense(3),
        ]
    )
    r = np.random.default_rng(0)
    x, y = r.normal(size=(3, 12, 12, 1)).astype("float32"), r.integers(0, 3, 3)
    layerwise_per_example_against_loop(model, x, y)
    layerwise_clipped_against_loop(model, x, y)


def test_conv3d_clipped_sum_runs_eagerly():
    """The zoo's ``conv3d_few_positions_gram`` (Gram norms, then the kernel VJP) eagerly: a Conv3D recorded without a data format had a gradient TensorFlow could not take."""
    model, x, y = model_zoo.layer_case("conv3d_few_positions_gram")
    layerwise_clipped_against_loop(model, x, y)


def test_calibration_cache_round_trip(tmp_path, monkeypatch):
    """``save_rates`` then ``machine()`` gives the saved rates; no cache, a corrupt one or another CPU's: ``DEFAULT``."""
    path = tmp_path / "costs" / "path_costs.json"
    monkeypatch.setenv("PEG_PATH_COSTS", str(path))
    path_costs.machine.cache_clear()
    try:
        assert path_costs.machine() is path_costs.DEFAULT  # absent
        rates = dataclasses.replace(path_costs.DEFAULT, flops=1.5e9, op_s=3e-6)
        assert path_costs.save_rates(rates) == str(path)
        assert path_costs.machine() == rates
        monkeypatch.setattr(path_costs, "_machine_key", lambda: "another cpu")
        path_costs.machine.cache_clear()
        assert path_costs.machine() is path_costs.DEFAULT
        path.write_text("[not a table")
        path_costs.machine.cache_clear()
        assert path_costs.machine() is path_costs.DEFAULT
    finally:
        monkeypatch.undo()
        path_costs.machine.cache_clear()
