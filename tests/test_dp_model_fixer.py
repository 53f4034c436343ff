"""peg.dp.fix_model: BatchNormalization replaced (or frozen) so that examples do not mix, weights kept.

Every ``keras.applications`` builder (its smallest size variant) is fixed and checked in one child
process (``python tests/test_dp_model_fixer.py --applications``: sixteen models'
graphs are built twice, which must not pile up in pytest's process); a few
representative ones are also trained-through here: their fixed versions run,
keep the weights, and their clipped gradients equal the one-example loop's.
"""

from __future__ import annotations

import collections
import gc
import inspect
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_close,
    assert_grads_close,
    gradient_scale,
    reference_gradients,
    reference_norms,
    sparse_ce,
)
from per_example_grads.dp import validation
from tolerances import ELEMENTWISE_RTOL, EPS32, norm_rtol, rounding_rtol, weighted_sum_rtol


def _bn_model():
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(8, 3, name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    inner = keras.Sequential(
        [keras.Input((4, 4, 8)), keras.layers.BatchNormalization(name="inner_bn"), keras.layers.Flatten()], name="inner"
    )
    out = keras.layers.Dense(3, name="head")(inner(keras.layers.ReLU()(h)))
    model = keras.Model(inp, out)
    rng = np.random.default_rng(0)
    for layer in (model.get_layer("bn"), inner.get_layer("inner_bn")):  # weights that are not the initial ones
        layer.set_weights(
            [
                rng.normal(size=w.shape).astype("float32") if i < 2 else rng.uniform(0.5, 2, w.shape).astype("float32")
                for i, w in enumerate(layer.get_weights())
            ]
        )
    return model, rng.normal(size=(4, 6, 6, 3)).astype("float32"), np.array([0, 1, 2, 1], "int32")


def test_group_norm_replaces_every_batch_norm_and_keeps_the_weights_it_can():
    model, x, y = _bn_model()
    fixed, changes = peg.dp.fix_model(model, groups=4, return_changes=True)
    layers = list(fixed._flatten_layers(include_self=False))
    assert not any(isinstance(l, keras.layers.BatchNormalization) for l in layers)
    norms = {l.name: l for l in layers if isinstance(l, keras.layers.GroupNormalization)}
    assert set(norms) == {"bn", "inner_bn"} and all(n.groups == 4 for n in norms.values())
    assert len(changes) == 2 and all("GroupNormalization(groups=4" in c for c in changes)
    old_bn = model.get_layer("bn")
    np.testing.assert_array_equal(norms["bn"].gamma.numpy(), old_bn.gamma.numpy())
    np.testing.assert_array_equal(norms["bn"].beta.numpy(), old_bn.beta.numpy())
    for name in ("conv", "head"):
        for a, b in zip(fixed.get_layer(name).get_weights(), model.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
    assert validation.validate(fixed).errors == [] and validation.validate(model).errors != []
    # The original is untouched, and the fixed model isolates examples: the library's
    # per-example gradients in training mode equal the one-example loop's.
    assert any(isinstance(l, keras.layers.BatchNormalization) for l in model._flatten_layers())
    got = peg.per_example_gradients(fixed, sparse_ce, x, y, training=True)
    assert_grads_close(got, reference_gradients(fixed, sparse_ce, x, y, training=True))


def test_groups_divide_the_channels():
    model = keras.Sequential(
        [keras.Input((4, 6)), keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    fixed = peg.dp.fix_model(model)  # 6 channels, at most 32 groups: the largest divisor of 6 up to 32
    assert fixed.layers[0].groups == 6


def test_freeze_keeps_every_weight_and_runs_inference_mode():
    model, x, y = _bn_model()
    fixed, changes = peg.dp.fix_model(model, batch_norm="freeze", return_changes=True)
    assert len(changes) == 2 and all("frozen" in c for c in changes)
    for a, b in zip(fixed.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert validation.validate(fixed).errors == []
    # training=True now runs the original's inference-mode ops: equal up to the rounding of a few
    # elementwise operations, should a kernel round differently (relative to the outputs' scale).
    expected = model(x, training=False).numpy()
    np.testing.assert_allclose(
        fixed(x, training=True), expected, rtol=ELEMENTWISE_RTOL, atol=ELEMENTWISE_RTOL * np.abs(expected).max()
    )
    assert all(not v.path.endswith(("gamma", "beta")) for v in fixed.trainable_variables)


def test_refusals_name_the_argument():
    model, _, _ = _bn_model()
    with pytest.raises(ValueError, match="batch_norm must be one of"):
        peg.dp.fix_model(model, batch_norm="layer_norm")
    with pytest.raises(ValueError, match="groups must be a positive int"):
        peg.dp.fix_model(model, groups=0)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    with pytest.raises(ValueError, match="subclassed"):
        peg.dp.fix_model(Sub())


def test_raw_operations_in_the_graph_are_rebuilt():
    # x + 3.0 and x * (1 / 6) in a Functional graph are keras.ops operations, not layers (MobileNetV3's hard-swish).
    inp = keras.Input((5, 5, 2))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Conv2D(4, 3, name="conv")(inp))
    h = h * keras.layers.ReLU(6.0)(h + 3.0) * (1.0 / 6.0)
    model = keras.Model(inp, keras.layers.Dense(3, name="head")(keras.layers.Flatten()(h)))
    bn = model.get_layer("bn")
    bn.set_weights(
        [
            np.full(4, 1.5, "float32"),
            np.full(4, 0.25, "float32"),
            np.full(4, 0.5, "float32"),
            np.full(4, 2.0, "float32"),
        ]
    )
    x = np.random.default_rng(1).normal(size=(3, 5, 5, 2)).astype("float32")
    for batch_norm in ("group_norm", "freeze"):
        fixed = peg.dp.fix_model(model, batch_norm=batch_norm)
        raw = [op for op in fixed.operations if not isinstance(op, keras.layers.Layer)]
        assert sorted(type(op).__name__ for op in raw) == ["Add", "Multiply", "Multiply"]
        assert not {id(op) for op in raw} & {id(op) for op in model.operations}  # rebuilt, the original's left alone
    # Frozen, in inference mode, it computes what the original does: same kernels, same weights (up to a kernel's rounding).
    expected = model(x, training=False).numpy()
    np.testing.assert_allclose(
        fixed(x, training=False), expected, rtol=ELEMENTWISE_RTOL, atol=ELEMENTWISE_RTOL * np.abs(expected).max()
    )


# ------------------------------------------------------------ keras.applications


def application_constructors() -> list[str]:
    """Every ``keras.applications`` constructor that takes ``weights`` (``None``: random), read from the module."""
    names = []
    for name in dir(keras.applications):
        make = getattr(keras.applications, name)
        if inspect.isfunction(make) and {"weights", "input_shape", "classes"} <= set(
            inspect.signature(make).parameters
        ):
            names.append(name)
    return sorted(names)


# Constructors that are one Keras builder at other sizes (depths, widths, input defaults): the same layer and
# operation types, so the same fix_model and check_model code paths. Only each family's smallest is checked.
SIZE_VARIANTS = {
    r"ConvNeXt(Tiny|Small|Base|Large|XLarge)": "ConvNeXtTiny",
    r"DenseNet\d+": "DenseNet121",
    r"EfficientNetB\d": "EfficientNetB0",
    r"EfficientNetV2(B\d|S|M|L)": "EfficientNetV2B0",
    r"NASNet(Mobile|Large)": "NASNetMobile",
    r"ResNet\d+": "ResNet50",
    r"ResNet\d+V2": "ResNet50V2",
}


def checked_constructors() -> list[str]:
    """``application_constructors()`` less the larger size variants (``SIZE_VARIANTS``): one per builder."""
    names = application_constructors()
    for pattern, keep in SIZE_VARIANTS.items():
        family = [n for n in names if re.fullmatch(pattern, n)]
        assert keep in family and len(family) >= 2, (pattern, family)  # a renamed family is noticed, not skipped
        names = [n for n in names if n == keep or n not in family]
    return names


# Seconds to build and fix the constructors far from the others' ~1 s (2-core CPU): the children's shares of the
# constructors are balanced by them (``_share``), so that neither child ends long after the other.
SLOW_CONSTRUCTORS = {"NASNetMobile": 4.0, "InceptionResNetV2": 4.0, "DenseNet121": 2.0, "InceptionV3": 1.5}


def _share(names: list[str], part: int, parts: int) -> list[str]:
    """Child ``part``'s share of ``names``: the slowest first, each to the least loaded child (each child computes
    every share the same way, so the shares cover ``names`` once)."""
    loads, shares = [0.0] * parts, [[] for _ in range(parts)]
    for name in sorted(names, key=lambda n: (-SLOW_CONSTRUCTORS.get(n, 1.0), n)):
        least = loads.index(min(loads))
        shares[least].append(name)
        loads[least] += SLOW_CONSTRUCTORS.get(name, 1.0)
    return shares[part]


def smallest_input_size(make) -> int:
    """The smallest square image ``make`` accepts, from its own refusal of a 1x1 one ("at least 32x32")."""
    try:
        make(weights=None, input_shape=(1, 1, 3), classes=2)
    except ValueError as err:
        found = re.search(r"at least (\d+)x(\d+)", str(err))
        if found is None:
            raise
        return max(int(found.group(1)), int(found.group(2)))
    return 1


def _application(name: str, classes: int = 2) -> tuple[keras.Model, int]:
    make = getattr(keras.applications, name)
    size = smallest_input_size(make)
    return make(weights=None, input_shape=(size, size, 3), classes=classes, classifier_activation=None), size


def _check_fixed_structure(model: keras.Model, fixed: keras.Model, changes: list[str]) -> None:
    """What ``fix_model`` promises about the graph, on any model: see ``test_fix_model_on_every_application``."""
    # Input layers are rebuilt by clone_model under their tensor's name: compared by the outputs' shapes only.
    layers = [l for l in model._flatten_layers(include_self=False) if not isinstance(l, keras.layers.InputLayer)]
    bn = {l.name: l for l in layers if isinstance(l, keras.layers.BatchNormalization)}
    new = {l.name: l for l in fixed._flatten_layers(include_self=False)}
    assert not any(isinstance(l, keras.layers.BatchNormalization) for l in new.values())
    assert len(changes) == len(bn) and {
        n for n, l in new.items() if isinstance(l, keras.layers.GroupNormalization)
    } >= set(bn)
    for l in layers:  # same layers by name; the same weights' shapes, less BatchNormalization's moving statistics
        shapes = [tuple(w.shape) for w in l.weights]
        if l.name in bn:
            shapes = [tuple(w.shape) for w in (l.gamma, l.beta) if w is not None]  # None without scale or center
        assert [tuple(w.shape) for w in new[l.name].weights] == shapes, l.name
    # The same operations, raw ones (x + 3.0) included, each rebuilt, not shared with the original.
    census = lambda m: collections.Counter(  # noqa: E731
        "GroupNormalization" if isinstance(op, keras.layers.BatchNormalization) else type(op).__name__
        for op in m.operations
    )
    assert census(fixed) == census(model)
    assert not {id(op) for op in fixed.operations} & {id(op) for op in model.operations}
    assert fixed.output.shape == model.output.shape
    assert (validation.validate(model).errors != []) == bool(bn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-path notes (layer-local fallbacks) are not this test's concern
        peg.dp.check_model(fixed)  # raises on any layer that couples examples


def _fix_every_application(part: int, parts: int) -> None:
    """The child: fixes and checks its share of the constructors (``_share``), one JSON line per model.

    ``START name`` is printed before each, so the parent can name the model a crash happened in.

    The weights' values play no part in what is checked here (the graph, the
    layers, the weights' shapes, ``check_model``), so every Keras initializer
    draws zeros instead of random numbers: building the models twice is
    dominated by Keras's graph construction, and random draws add a third.
    The values ``fix_model`` copies are checked by the representative tests.
    """
    for name in dir(keras.initializers):
        cls = getattr(keras.initializers, name)
        if inspect.isclass(cls) and issubclass(cls, keras.initializers.Initializer):
            cls.__call__ = lambda self, shape, dtype=None, **kwargs: keras.ops.zeros(shape, dtype=dtype)
    # What the imports made lives as long as the child: out of the collector's sight, so that clear_session's full
    # collection after each model goes over that model's objects only (3 s of CPU less over the sixteen).
    gc.freeze()
    for name in _share(checked_constructors(), part, parts):
        print(f"START {name}", flush=True)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            model, size = _application(name)
            fixed, changes = peg.dp.fix_model(model, return_changes=True)
            _check_fixed_structure(model, fixed, changes)
        except Exception as err:  # noqa: BLE001 - reported, and fails the parent's test
            result = {"name": name, "status": "error", "message": f"{type(err).__name__}: {err}"[:800]}
        else:
            result = {"name": name, "status": "ok", "size": size, "batch_norms": len(changes)}
        result.update(seconds=round(time.perf_counter() - start, 1), cpu_seconds=round(time.process_time() - cpu, 1))
        print(json.dumps(result), flush=True)
        model = fixed = None
        keras.backend.clear_session(free_memory=True)


@pytest.mark.slow
def test_fix_model_on_every_application(tmp_path):
    """Each ``keras.applications`` builder (its smallest size variant) at its smallest input, 2 classes: fixed,
    then ``check_model`` passes.

    Also checked: no BatchNormalization is left and each became a
    GroupNormalization of its name; every other layer and every operation
    (raw ``keras.ops`` ones too, such as MobileNetV3's ``x + 3.0``) is there
    again, rebuilt rather than shared, with weights of the same shapes.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="2"
    )
    # Keras's graph construction is single-threaded Python: two children take the CPU time of one on two cores.
    parts = 2 if (os.cpu_count() or 1) >= 2 else 1
    logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(parts)]
    children = []
    try:
        for i, (out, err) in enumerate(logs):
            with open(out, "w") as o, open(err, "w") as e:
                children.append(
                    subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), "--applications", str(i), str(parts)],
                        stdout=o,
                        stderr=e,
                        env=env,
                        cwd=root,
                    )
                )
        codes = [child.wait(timeout=900) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    results = {}
    for code, (out, err) in zip(codes, logs):
        lines = out.read_text().splitlines()
        results.update((r["name"], r) for r in (json.loads(l) for l in lines if l.startswith("{")))
        if code != 0:
            started = [l.split()[1] for l in lines if l.startswith("START ")]
            pytest.fail(f"a child died with return code {code} in {started[-1:]}:\n{err.read_text()[-3000:]}")
    expected = application_constructors()
    assert len(expected) >= 30 and "MobileNetV3Small" in expected and "EfficientNetV2B0" in expected
    assert sorted(results) == checked_constructors()
    failed = {n: r["message"] for n, r in results.items() if r["status"] != "ok"}
    assert not failed, failed
    assert results["MobileNetV3Small"]["batch_norms"] > 0 and results["ConvNeXtTiny"]["batch_norms"] == 0


def _rounded_path(model: keras.Model) -> int:
    """Rounded operations on a CNN's longest path forward and back, bounded by their count over all its layers.

    Per layer with kernels: each kernel's fan-in (the forward sums) and
    fan-out (the input gradient's) plus the output positions its gradient
    sums over (a depthwise kernel's fan-in is its window); a normalization:
    its group's size, four times (mean and variance, forward and back); a
    pooling: its input's positions, twice; anything else (activations, adds,
    a raw ``keras.ops`` operation): 8. As in tests/tolerances.py, errors add
    along the path to first order.
    """
    n = 0
    for op in model.operations:
        if not isinstance(op, keras.layers.Layer):
            n += 8
            continue
        kernels = [w for w in op.weights if len(w.shape) >= 2]
        if kernels:
            positions = math.prod(op.output.shape[1:-1])
            for w in kernels:
                depthwise = isinstance(op, keras.layers.DepthwiseConv2D) or "depthwise" in w.path
                fan_in = math.prod(w.shape[:2]) if depthwise else math.prod(w.shape[:-1])
                n += fan_in + math.prod(w.shape[:-2]) * w.shape[-1] + positions
        elif isinstance(op, keras.layers.GroupNormalization):
            n += 4 * math.prod(op.input.shape[1:]) // op.groups + 8
        elif isinstance(op, (keras.layers.LayerNormalization, keras.layers.BatchNormalization)):
            n += 4 * op.input.shape[-1] + 8
        elif "Pooling" in type(op).__name__:
            n += 2 * math.prod(op.input.shape[1:-1])
        else:
            n += 8
    return n


def _randomize_batch_norms(model: keras.Model, rng: np.random.Generator) -> None:
    """Gamma, beta and moving statistics that are not their initial 1, 0, 0, 1 (so copying them is seen)."""
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.set_weights(
                [
                    rng.uniform(0.5, 1.5, w.shape).astype("float32")
                    if "gamma" in w.path or "variance" in w.path
                    else rng.normal(0, 0.1, w.shape).astype("float32")
                    for w in layer.weights
                ]
            )


# Graphs fix_model must rebuild: raw keras.ops in hard-swish and squeeze-excite
# (MobileNetV3), fused MBConv blocks (EfficientNetV2), a Normalization preprocessing
# layer whose non-trainable statistics are weights to copy (EfficientNet).
REPRESENTATIVE = ["MobileNetV3Small", "EfficientNetV2B0", "EfficientNetB0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_fixed_application_runs_keeps_weights_and_clips_like_the_loop(name):
    rng = np.random.default_rng(0)
    model, size = _application(name, classes=3)
    _randomize_batch_norms(model, rng)
    x = rng.uniform(0, 255, (2, size, size, 3)).astype("float32")
    y = np.array([0, 2], "int32")
    frozen = peg.dp.fix_model(model, batch_norm="freeze")
    expected = model(x, training=False).numpy()  # the same kernels on the same weights: equal up to a kernel's rounding
    forward_rtol = rounding_rtol(_rounded_path(model))
    np.testing.assert_allclose(
        frozen(x, training=False), expected, rtol=forward_rtol, atol=forward_rtol * np.abs(expected).max()
    )

    fixed, changes = peg.dp.fix_model(model, return_changes=True)
    assert changes
    path_rtol = rounding_rtol(_rounded_path(fixed))  # the model the gradients run through
    for old in model._flatten_layers(include_self=False):
        if isinstance(old, keras.layers.InputLayer):
            continue
        new = fixed.get_layer(old.name)
        bn = isinstance(old, keras.layers.BatchNormalization)
        kept = [w for w in (old.gamma, old.beta) if w is not None] if bn else old.weights
        for a, b in zip(new.weights, kept, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{old.name}: {b.path}")
    assert np.all(np.isfinite(fixed(x, training=True)))

    # Its per-example gradients are separable: the clipped sum equals the one-example loop's (inference mode:
    # GroupNormalization computes the same in both, and the dropout of training would draw differently).
    reference = reference_gradients(fixed, sparse_ce, x, y)
    norms = reference_norms(reference)
    clip = float(np.min(norms))  # one example clipped, one at the clip norm
    factors = clip / np.maximum(norms, clip)
    got, got_norms = peg.clipped_gradients(fixed, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True)
    p = sum(int(np.prod(r.shape[1:])) for r in reference)
    assert_close(
        got_norms,
        norms,
        rtol=norm_rtol(p, path_rtol),
        atol=path_rtol * gradient_scale(reference) * math.sqrt(p),
        err_msg="norms",
    )
    assert_clipped_sums_close(
        got, reference, factors, rtol=weighted_sum_rtol(2, path_rtol + norm_rtol(p, path_rtol) + EPS32)
    )


if __name__ == "__main__" and sys.argv[1:2] == ["--applications"]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _fix_every_application(int(sys.argv[2]), int(sys.argv[3]))
