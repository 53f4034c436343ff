"""One engine interface for the three capabilities: per-example gradients, norms, clipped sums."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_close,
    assert_grads_close,
    assert_norms_close,
    reference_gradients,
    reference_norms,
    rule_against_loop,
    sparse_ce,
)
from model_zoo import ZOO
from per_example_grads._core.problem import make_problem
from per_example_grads.engines import capture as capture_module
from per_example_grads.engines import layerwise as layerwise_engine
from per_example_grads.engines import selection
from per_example_grads.engines.capture import capturing
from tolerances import EPS64, rounding_rtol


class Doubling(keras.layers.Layer):
    """A layer the test teaches the layer-wise engine with a rule that breaks while building."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w * 2.0


class BrokenRule(peg.LayerRule):
    def variables(self, layer):
        return [layer.w]

    def forward(self, layer, call, args, kwargs):
        raise RuntimeError("this rule cannot build")

    def per_example(self, layer, a, grads):
        raise AssertionError("never reached")


def _broken_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), Doubling(), keras.layers.Dense(3)])


def test_norms_and_clipped_sums_fall_back_like_per_example_gradients(monkeypatch):
    from per_example_grads.rules import rule as rule_module

    monkeypatch.setitem(rule_module.RULES, Doubling, BrokenRule())
    model = _broken_model()
    x = np.random.RandomState(0).normal(size=(6, 4)).astype("float32")
    y = np.arange(6) % 3
    reference = reference_gradients(model, sparse_ce, x, y)
    with pytest.warns(peg.EngineFallbackWarning, match="'layerwise' because it raised RuntimeError"):
        norms = peg.per_example_norms(model, sparse_ce, x, y)
    assert_norms_close(norms, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", peg.EngineFallbackWarning)
        sums = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.1)
    assert_clipped_sums_close(sums, reference, 0.1 / np.maximum(reference_norms(reference), 0.1))
    with pytest.raises(peg.EngineError, match="method='layerwise' could not handle this model"):
        peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.1, method="layerwise")


def test_engine_error_is_the_one_refusal_type_and_a_value_error():
    assert issubclass(peg.EngineError, ValueError)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(peg.EngineError, match="cannot run on this model"):
        peg.per_example_gradients(
            lambda x: model(x),
            "mse",
            np.ones((2, 4)),
            np.zeros((2, 2)),
            variables=model.trainable_variables,
            method="layerwise",
        )


def test_the_watch_plan_is_worked_out_once_per_call(monkeypatch):
    calls = []
    original = capture_module.plan_watches
    from per_example_grads.engines import layerwise as engine

    monkeypatch.setattr(engine, "plan_watches", lambda *a: calls.append(1) or original(*a))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x, y = np.ones((5, 4), "float32"), np.arange(5) % 3
    peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0)
    assert len(calls) == 1


def test_a_float64_model_with_an_embedding_gives_float64_norms_and_clipped_sums():
    keras.utils.set_random_seed(0)
    f64 = dict(dtype="float64")
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(20, 4, **f64),
            keras.layers.GlobalAveragePooling1D(**f64),
            keras.layers.Dense(3, **f64),
        ]
    )
    x = np.random.RandomState(1).randint(0, 20, (6, 5)).astype("int32")
    y = np.arange(6) % 3
    reference = reference_gradients(model, sparse_ce, x, y)
    flat = np.concatenate([r.reshape(6, -1) for r in reference], axis=1)
    norms = peg.per_example_norms(model, sparse_ce, x, y, method="layerwise")
    sums = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.05, method="layerwise")
    assert norms.dtype == tf.float64
    rtol = rounding_rtol(flat.shape[1] + 64, EPS64)  # float64 sums over the entries and the model's path
    assert_close(norms, np.linalg.norm(flat, axis=1), rtol=rtol)
    factors = 0.05 / np.maximum(np.linalg.norm(flat, axis=1), 0.05)
    for s, r in zip(sums, reference):
        assert_close(tf.convert_to_tensor(s), np.tensordot(factors, r, axes=1), rtol=rtol, atol=rtol * 0.05 * 6)


class Reversible(keras.layers.Embedding):
    """An Embedding that is also its model's output projection (as KerasHub's ReversibleEmbedding)."""

    def call(self, inputs, reverse=False):
        if reverse:
            return keras.ops.matmul(inputs, keras.ops.transpose(self.embeddings))
        return super().call(inputs)


class TiedLM(keras.Model):
    def __init__(self):
        super().__init__()
        self.table = Reversible(12, 4)
        self.mix = keras.layers.Dense(4, activation="tanh")

    def call(self, ids):
        h = self.mix(keras.ops.mean(self.table(ids), axis=1))
        return self.table(h, reverse=True)  # [B, vocab] logits


def test_a_subclass_that_overrides_call_is_never_run_by_its_base_class_rule():
    keras.utils.set_random_seed(0)
    model = TiedLM()
    ids = np.random.RandomState(0).randint(0, 12, (5, 3)).astype("int32")
    y = np.arange(5) % 12
    plain = model(ids)
    from per_example_grads.rules.local import LocalRule
    from per_example_grads.rules.rule import rule_for

    assert isinstance(rule_for(model.table), LocalRule) or rule_for(model.table) is None
    reference = reference_gradients(model, sparse_ce, ids, y)
    for method in ["layerwise", "auto"]:
        assert_grads_close(peg.per_example_gradients(model, sparse_ce, ids, y, method=method), reference)
    assert_norms_close(peg.per_example_norms(model, sparse_ce, ids, y, method="layerwise"), reference)
    assert_close(model(ids), plain, rtol=0)  # capturing left the model as it was


def _outputs_plain_and_watched(model, x):
    """``(plain, watched, watches)``: the model's flat outputs unwatched and under capture, or None if not covered."""
    problem = make_problem(model, sparse_ce, None, False, False)
    if layerwise_engine.why_not(problem) is not None:
        return None
    watches = layerwise_engine.watches_of(problem)
    plain = tf.nest.flatten(model(x))
    with capturing(watches):
        watched = tf.nest.flatten(model(x))
    return plain, watched, watches


def _assert_bit_for_bit(watched, plain):
    """Rules compute what the layers compute, to the last bit: one rounding moved can flip a ReLU or max-pool kink."""
    assert len(watched) == len(plain)
    for k, (a, b) in enumerate(zip(watched, plain)):
        a, b = np.asarray(a), np.asarray(b)
        differ = a.shape != b.shape or not np.array_equal(a, b, equal_nan=True)
        assert not differ, f"output {k} changed under capture (largest difference {np.max(np.abs(a - b)):.3g})"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_capturing_leaves_every_zoo_model_computing_what_it_computes(name):
    """Rules replace each layer's call while the engine watches: the model's outputs must not change, bit for bit."""
    case = ZOO[name]()
    found = _outputs_plain_and_watched(case.model, case.x)
    if found is None:
        pytest.skip("the layer-wise engine does not cover it")
    _assert_bit_for_bit(found[1], found[0])


# One case per rule (by rule class), on layers wide enough that a rule
# computing the layer's maths by other ops (a matrix product for a 1x1
# convolution, a normalization's terms in another order) rounds differently:
# oneDNN picks its blockings by shape, and small layers often agree by luck.
# Rules that call the layer agree by construction; their cases are small.
def _wide(layers, shape, dtype="float32"):
    r = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input(shape[1:], dtype=dtype)] + layers + [keras.layers.Flatten(), keras.layers.Dense(3)]
    )
    x = r.integers(0, 50, shape).astype("int32") if dtype == "int32" else r.normal(size=shape).astype("float32")
    return model, x


def _wide_lora(layer, shape):
    model, x = _wide([layer], shape)
    layer.enable_lora(rank=4)
    r = np.random.default_rng(1)
    for v in model.weights:
        if v.name.startswith("lora_") and v.name.endswith("_b"):
            v.assign(r.normal(size=v.shape).astype(v.dtype))
    return model, x


def _wide_reversible(tie_weights=True, logit_soft_cap=None):
    keras.utils.set_random_seed(0)
    emb = keras.layers.ReversibleEmbedding(1000, 512, tie_weights=tie_weights, logit_soft_cap=logit_soft_cap)
    inp = keras.Input((6,), dtype="int32")
    h = keras.layers.Dense(512, activation="tanh")(emb(inp))
    return keras.Model(inp, emb(h, reverse=True)), np.random.default_rng(0).integers(0, 1000, (2, 6)).astype("int32")


def _wide_mha():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 512))
    return keras.Model(inp, keras.layers.MultiHeadAttention(4, 128)(inp, inp)), np.random.default_rng(0).normal(
        size=(2, 6, 512)
    ).astype("float32")


def _layer_scale():
    from keras.src.applications.convnext import LayerScale

    return _wide([keras.layers.Dense(600), LayerScale(0.5, 600)], (2, 4, 700))


def _hub(build):
    def case():
        keras_hub = pytest.importorskip("keras_hub")
        return build(keras_hub)

    return case


def _hub_rms(keras_hub):
    from keras_hub.src.models.gemma.rms_normalization import RMSNormalization

    return _wide(
        [keras.layers.Dense(1024), RMSNormalization(epsilon=1e-6), keras_hub.layers.RMSNormalization(1024)], (2, 4, 64)
    )


def _hub_position(keras_hub):
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 512))
    h = keras.layers.Dense(512)(inp)
    out = h + keras_hub.layers.PositionEmbedding(sequence_length=9)(h, start_index=2)
    return keras.Model(inp, out), np.random.default_rng(0).normal(size=(2, 6, 512)).astype("float32")


def _from_hub_zoo(name):
    """Case ``name`` of ``tests/hub_zoo.py`` (tiny KerasHub backbones), two examples."""

    def case():
        pytest.importorskip("keras_hub")
        hub_zoo = pytest.importorskip("hub_zoo")
        model, x, _ = hub_zoo.CASES[name](2)
        return model, x

    return case


_SEPARABLE = dict(filters=728, kernel_size=3, padding="same", activation="relu")
BIT_CASES = {  # rule class name -> cases
    "DenseRule": {
        "dense_wide_sequence": lambda: _wide([keras.layers.Dense(512, activation="relu")], (2, 8, 700)),
        "dense_wide": lambda: _wide([keras.layers.Dense(1000)], (3, 1000)),
    },
    "EinsumDenseRule": {
        "einsum_dense_wide": lambda: _wide(
            [keras.layers.EinsumDense("abc,cde->abde", (8, 8, 64), bias_axes="de")], (2, 8, 700)
        ),
        "multi_head_attention_wide": _wide_mha,
    },
    "_ConvRule": {"conv2d_wide": lambda: _wide([keras.layers.Conv2D(256, 3, padding="same")], (2, 8, 8, 256))},
    "ConvPatchesRule": {
        "conv1d_wide": lambda: _wide([keras.layers.Conv1D(256, 3, strides=2, activation="relu")], (2, 12, 256))
    },
    "GroupedConvRule": {"grouped_conv2d_wide": lambda: _wide([keras.layers.Conv2D(256, 3, groups=4)], (2, 6, 6, 256))},
    "ConvTransposeRule": {
        "conv2d_transpose_wide": lambda: _wide([keras.layers.Conv2DTranspose(256, 3, strides=2)], (2, 4, 4, 256))
    },
    "DepthwiseConvRule": {
        "depthwise_conv2d_wide": lambda: _wide(
            [keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2)], (2, 8, 8, 512)
        )
    },
    "SeparableConvRule": {
        "separable_conv2d_wide": lambda: _wide([keras.layers.SeparableConv2D(**_SEPARABLE)], (2, 5, 5, 728)),
        "separable_conv2d_wide_strided_dilated": lambda: _wide(
            [keras.layers.SeparableConv2D(**_SEPARABLE, strides=2, dilation_rate=2)], (2, 9, 9, 728)
        ),
        "separable_conv1d_wide_m2": lambda: _wide(
            [keras.layers.SeparableConv1D(**_SEPARABLE, depth_multiplier=2)], (2, 9, 364)
        ),
    },
    "EmbeddingRule": {
        "embedding_wide": lambda: _wide(
            [keras.layers.Embedding(50, 512, mask_zero=True), keras.layers.GlobalAveragePooling1D()], (2, 7), "int32"
        )
    },
    "ReversibleEmbeddingRule": {
        "reversible_tied_wide": _wide_reversible,
        "reversible_untied_soft_cap_wide": lambda: _wide_reversible(False, 30.0),
    },
    "LayerNormRule": {
        "layer_norm_wide": lambda: _wide([keras.layers.Dense(1024), keras.layers.LayerNormalization()], (2, 4, 64)),
        "layer_norm_two_axes_wide": lambda: _wide(
            [keras.layers.LayerNormalization(axis=[1, 3], epsilon=0.1)], (2, 3, 33, 100)
        ),
    },
    "GroupNormRule": {
        "group_norm_wide": lambda: _wide(
            [keras.layers.Conv2D(64, 1), keras.layers.GroupNormalization(groups=8)], (2, 16, 16, 8)
        )
    },
    "BatchNormRule": {
        "batch_norm_wide": lambda: _wide([keras.layers.Dense(1024), keras.layers.BatchNormalization()], (2, 4, 64))
    },
    "LocalRule": {
        "prelu_and_fallback": lambda: _wide(
            [keras.layers.Dense(600), keras.layers.PReLU(), keras.layers.LSTM(8)], (2, 3, 700)
        )
    },
    "LayerScaleRule": {"layer_scale_wide": _layer_scale},
    "DenseLoraRule": {"dense_lora_wide": lambda: _wide_lora(keras.layers.Dense(600), (2, 5, 700))},
    "EinsumDenseLoraRule": {
        "einsum_dense_lora_wide": lambda: _wide_lora(
            keras.layers.EinsumDense("abc,cd->abd", (5, 600), bias_axes="d"), (2, 5, 700)
        )
    },
    "RMSNormRule": {"hub_rms_norms_wide": _hub(_hub_rms)},
    "PositionEmbeddingRule": {"hub_position_embedding_wide": _hub(_hub_position)},
    "KerasRMSNormRule": {
        "keras_rms_norm_wide": lambda: _wide([keras.layers.Dense(1024), keras.layers.RMSNormalization()], (2, 4, 64))
    },
    "RelativeEmbeddingRule": {"hub_deberta_v3": _from_hub_zoo("deberta_v3_classifier")},
    "PatchEmbeddingRule": {"hub_vit": _from_hub_zoo("vit")},
    "DeiTEmbeddingsRule": {"hub_deit": _from_hub_zoo("deit")},
    "MoEBlockRule": {"hub_mixtral": _from_hub_zoo("mixtral_lm")},
    "T5AttentionRule": {"hub_t5": _from_hub_zoo("t5")},
}
SLOW_BIT_CASES = {
    "hub_rms_norms_wide",
    "hub_position_embedding_wide",
    "hub_deberta_v3",
    "hub_vit",
    "hub_deit",
    "hub_mixtral",
    "hub_t5",
}


def _every_rule() -> dict[str, object]:
    """Every built-in rule by class name: the registered ones and those they hand layers to (module-level instances)."""
    import importlib
    import pkgutil

    from per_example_grads import rules
    from per_example_grads.rules import rule as rule_module

    found = {
        type(r).__name__: r for r in rule_module.RULES.values() if type(r).__module__.startswith("per_example_grads.")
    }
    for info in pkgutil.iter_modules(rules.__path__):
        module = importlib.import_module(f"per_example_grads.rules.{info.name}")
        for value in vars(module).values():
            if isinstance(value, rule_module.LayerRule):
                found.setdefault(type(value).__name__, value)
    return found


def _consulted(units) -> set[str]:
    """Class names of the rules the plan used, and of those registered for its layers (a rule that hands layers on)."""
    from per_example_grads.rules import rule as rule_module

    names = {type(u.rule).__name__ for u in units}
    for u in units:
        for cls in type(u.layer).__mro__:
            registered = rule_module.RULES.get(cls) or rule_module.RULES.get(f"{cls.__module__}.{cls.__qualname__}")
            if registered is not None:
                names.add(type(registered).__name__)
                break
    return names


def test_every_built_in_rule_has_a_bit_for_bit_case():
    missing = sorted(set(_every_rule()) - set(BIT_CASES))
    assert not missing, f"rules without a case in BIT_CASES (tests/test_engine_interface.py): {missing}"


@pytest.mark.parametrize(
    "rule,name",
    [
        pytest.param(r, n, marks=[pytest.mark.slow] if n in SLOW_BIT_CASES else [])
        for r in sorted(BIT_CASES)
        for n in sorted(BIT_CASES[r])
    ],
)
def test_capturing_leaves_each_rule_computing_what_its_layer_computes(rule, name):
    if rule not in _every_rule():
        pytest.skip(f"no rule {rule} in this checkout")
    model, x = BIT_CASES[rule][name]()
    found = _outputs_plain_and_watched(model, x)
    assert found is not None, "the layer-wise engine must cover the case"
    plain, watched, units = found
    assert rule in _consulted(units), f"the case does not exercise {rule}: {sorted(_consulted(units))}"
    _assert_bit_for_bit(watched, plain)


def test_embedding_clipped_sums_in_a_graph_of_unknown_batch_size_keep_their_static_shape():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(20, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    x = np.random.RandomState(1).randint(0, 20, (6, 5)).astype("int32")
    y = np.arange(6) % 3
    graph = tf.function(
        lambda a, b: peg.clipped_gradients(model, sparse_ce, a, b, l2_norm_clip=0.05),
        input_signature=[tf.TensorSpec([None, 5], tf.int32), tf.TensorSpec([None], tf.int64)],
    )
    reference = reference_gradients(model, sparse_ce, x, y)
    assert_clipped_sums_close(graph(x, y), reference, 0.05 / np.maximum(reference_norms(reference), 0.05))


class _NamedScale(keras.layers.Layer):
    """A layer whose rule is registered by the class's full name (as for an optional package's class)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


class _NamedScaleRule(peg.LayerRule):
    def forward(self, layer, call, args, kwargs):
        out = args[0] * layer.w
        return out, args[0], [out]

    def per_example(self, layer, saved, grads):
        return [peg.rules.sum_to_shape(saved * grads[0], layer.w.shape)]


def test_a_rule_registered_by_full_class_name_applies_and_is_exact(monkeypatch):
    monkeypatch.setattr(peg.rules.rule, "RULES", dict(peg.rules.rule.RULES))
    name = f"{_NamedScale.__module__}.{_NamedScale.__qualname__}"
    peg.register_layer_rule(name, _NamedScaleRule())
    assert isinstance(peg.rules.rule_for(_NamedScale()), _NamedScaleRule)
    model = keras.Sequential([keras.Input((3,)), _NamedScale(), keras.layers.Dense(2)])
    x, y = np.random.default_rng(0).normal(size=(4, 3)).astype("float32"), np.array([0, 1, 1, 0], "int32")
    rule_against_loop(model, x, y)
    with pytest.raises(TypeError, match="full name"):
        peg.register_layer_rule("NamedScale", _NamedScaleRule())


def test_an_engine_registered_later_is_a_valid_method(monkeypatch):
    from per_example_grads import engines

    monkeypatch.setattr(engines.base, "ENGINES", dict(engines.base.ENGINES))
    monkeypatch.setattr(selection, "ENGINES", engines.base.ENGINES)
    loop = engines.ENGINES["loop"]
    engines.register_engine(name="my_loop", isolates_examples=True)(loop.compute)
    case = ZOO["mlp"]()
    got = peg.per_example_gradients(case.model, case.loss_fn, case.x, case.y, method="my_loop")
    assert_grads_close(got, reference_gradients(case.model, case.loss_fn, case.x, case.y))
    norms = peg.per_example_norms(case.model, case.loss_fn, case.x, case.y, method="my_loop")
    assert_norms_close(norms, reference_gradients(case.model, case.loss_fn, case.x, case.y), by_variable=False)
    with pytest.raises(ValueError, match="my_loop"):
        peg.per_example_gradients(case.model, case.loss_fn, case.x, case.y, method="nope")
