"""The ReversibleEmbedding rule (lookup and tied output projection) and the KerasHub language models, against the
one-example loop: per-example gradients, norms (with the lookup/projection cross term) and clipped sums.

Then KerasHub layers with closed forms of their own (every registered RMS normalization, DeBERTa's
RelativeEmbedding, the ViT and DeiT patch embeddings, T5's attention with its relative bias), each in a small
model, against the loop.

Gemma runs with ``method="layerwise"`` only (``tf.vectorized_map`` over a whole Gemma crashes on some CPUs).
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_clipped_sums_close, assert_norms_close, reference_norms, rule_against_loop, sparse_ce
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params, randomize_lora
from per_example_grads.apps import zoo
from per_example_grads.engines.capture import plan_watches
from per_example_grads.rules.dense import DenseLoraRule
from per_example_grads.rules.einsum_dense import EinsumDenseLoraRule
from per_example_grads.rules.hub_layers import RMS_NORMALIZATIONS
from per_example_grads.rules.local import LocalRule
from per_example_grads.rules.reversible_embedding import REVERSIBLE_EMBEDDING_RULE
from per_example_grads.rules.rule import rule_for
from tolerances import EPS32, norm_rtol

ZOO_B = 3


def _reversible(model):
    return next(l for l in model._flatten_layers() if isinstance(l, keras.layers.ReversibleEmbedding))


def _clipped_sums_against_loop(model, x, y, expected, clip):
    """Clipped sums and their norms against the loop's; a tied table's sum is dense, an untied lookup's rows sparse."""
    norms = reference_norms(expected)
    factors = clip / np.maximum(norms, clip)
    got, got_norms = peg.clipped_gradients(
        model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True, method="layerwise"
    )
    assert_norms_close(got_norms, expected)
    assert_clipped_sums_close(got, expected, factors)
    return got


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["reversible_embedding"])))
def test_rule_matches_loop(name):
    model, x, y = layer_case(name)
    table = _reversible(model)
    assert rule_for(table) is REVERSIBLE_EMBEDDING_RULE
    assert any(u.rule is REVERSIBLE_EMBEDDING_RULE for u in plan_watches(model, model.trainable_variables))
    expected = rule_against_loop(model, x, y)
    # One global norm: the table's cross term is inside it as well.
    assert_clipped_sums_close(
        peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.05, method="layerwise"),
        expected,
        0.05 / np.maximum(reference_norms(expected), 0.05),
    )


@pytest.mark.parametrize("name", ["reversible_tied", "reversible_untied"])
def test_clipped_sums_rows_stay_sparse_only_without_the_projection(name):
    model, x, y = layer_case(name)
    table = _reversible(model)
    got = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.3, method="layerwise")
    by_var = {id(v): g for v, g in zip(model.trainable_variables, got)}
    # Tied: rows plus the dense projection part; untied: the lookup's rows alone, as tape.gradient gives.
    assert isinstance(by_var[id(table.embeddings)], tf.IndexedSlices) == (not table.tie_weights)


def test_the_cross_term_matters_in_the_test_case():
    """Without the cross term 2 <S, P> the tied case's norms would be off by far more than the tolerance."""
    from per_example_grads._core.batch import make_batch
    from per_example_grads._core.problem import make_problem
    from per_example_grads.engines import layerwise as engine

    model, x, y = layer_case("reversible_tied")
    table = _reversible(model)
    problem = make_problem(model, sparse_ce, None, False, False)
    captured = engine.capture(problem, make_batch(model, x, y, None))
    calls = [(r.saved, g) for r, g in zip(captured.records, captured.grads) if r.watch.layer is table]
    assert [s[0] for s, _ in calls] == ["lookup", "reverse"]
    rule = REVERSIBLE_EMBEDDING_RULE
    together = rule.shared_squared_norms(table, calls)[0].numpy()
    apart = sum(rule.squared_norms(table, s, g)[0].numpy() for s, g in calls)
    dense = sum(np.asarray(tf.convert_to_tensor(rule.per_example(table, s, g)[0]), np.float64) for s, g in calls)
    want = np.sum(dense.reshape(len(dense), -1) ** 2, axis=1)
    # Same captured a and g, closed form against the dense tables: a squared norm doubles a norm's rounding.
    np.testing.assert_allclose(together, want, rtol=2 * norm_rtol(dense[0].size))
    assert np.max(np.abs(apart - want) / want) > 100 * norm_rtol(dense[0].size)


def test_keras_hub_class_and_lora_or_quantized_tables():
    hub = keras_hub.layers.ReversibleEmbedding(10, 4)
    hub.build()
    assert rule_for(hub) is REVERSIBLE_EMBEDDING_RULE
    model, x, y = layer_case("reversible_tied")
    table = _reversible(model)
    table.enable_lora(2)
    randomize_lora(model, np.random.default_rng(0))
    assert isinstance(
        {id(u.layer): u for u in plan_watches(model, model.trainable_variables)}[id(table)].rule, LocalRule
    )
    rule_against_loop(model, x, y)
    quantized = keras.layers.ReversibleEmbedding(10, 4)
    quantized.build()
    quantized.quantize("int8")
    assert REVERSIBLE_EMBEDDING_RULE.unsupported(quantized)


def _zoo_case(name, lora_rank):
    config = {"lora_rank": lora_rank} if lora_rank else {}
    if name == "llama_lm" and lora_rank:  # as bench_scale's Llama 1B: grouped K/V heads, tied embeddings
        config |= {"num_key_value_heads": 2, "tie_word_embeddings": True}
    model, x, y = zoo.build(name, ZOO_B, **config)
    if config.get("tie_word_embeddings"):
        assert model.backbone.token_embedding.tie_weights and model.backbone.num_key_value_heads == 2
    if lora_rank:
        randomize_lora(model, np.random.default_rng(1))
    return model, x, y


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [None, 4])
@pytest.mark.parametrize("name", ["gpt2_lm", "gemma_lm", "llama_lm"])
def test_keras_hub_language_models(name, lora_rank):
    model, x, y = _zoo_case(name, lora_rank)
    plan = plan_watches(model, model.trainable_variables)
    watches = {id(u.layer): u for u in plan}
    # The CausalLM lists the backbone's token embedding among its own layers too: still one watch, called twice.
    assert len(watches) == len(plan)
    table = model.backbone.token_embedding
    assert rule_for(table) is REVERSIBLE_EMBEDDING_RULE
    if lora_rank:  # enable_lora froze the table: nothing to watch there
        assert id(table) not in watches and not table.trainable_variables
    else:
        assert watches[id(table)].rule is REVERSIBLE_EMBEDDING_RULE
    lora_layers = [l for l in model._flatten_layers() if getattr(l, "lora_enabled", False)]
    assert bool(lora_layers) == bool(lora_rank)
    for layer in lora_layers:
        assert isinstance(watches[id(layer)].rule, (DenseLoraRule, EinsumDenseLoraRule)), layer.name
    expected = rule_against_loop(model, x, y, norms="global")
    got = _clipped_sums_against_loop(model, x, y, expected, clip=0.5 * float(np.median(reference_norms(expected))))
    assert len(got) == len(model.trainable_variables)


def _traced_shapes(fn, *args) -> set:
    """Static shapes of every tensor in ``tf.function(fn)``'s graph."""
    graph = tf.function(fn).get_concrete_function(*args).graph
    return {tuple(t.shape.as_list()) for op in graph.get_operations() for t in op.outputs if t.shape.rank is not None}


def test_norms_and_clipped_sums_never_build_per_example_tables():
    model, x, y = layer_case("reversible_tied")
    table = _reversible(model)
    per_example_table = (len(x), table.input_dim, table.output_dim)
    args = (tf.constant(x), tf.constant(y))
    # The per-example gradients are that tensor (so the check sees it where it is built)...
    assert per_example_table in _traced_shapes(
        lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), *args
    )
    # ...and the norms and clipped sums never build it.
    assert per_example_table not in _traced_shapes(
        lambda x, y: peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"), *args
    )
    assert per_example_table not in _traced_shapes(
        lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, method="layerwise"), *args
    )


@pytest.mark.slow
def test_keras_hub_bert_classifier_with_lora():
    model, x, y = _zoo_case("bert_classifier", 4)
    watches = {id(u.layer): u for u in plan_watches(model, model.trainable_variables)}
    lora_layers = [l for l in model._flatten_layers() if getattr(l, "lora_enabled", False)]
    assert lora_layers and all(isinstance(watches[id(l)].rule, EinsumDenseLoraRule) for l in lora_layers)
    expected = rule_against_loop(model, x, y)
    _clipped_sums_against_loop(model, x, y, expected, clip=0.5 * float(np.median(reference_norms(expected))))


# KerasHub layers with closed forms in rules/hub_layers.py and rules/patch_embedding.py ---------------------------

NB, NT, ND = 4, 5, 6


def _hub_class(full_name):
    import importlib

    module, _, name = full_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{full_name} is not in this KerasHub version")


def _rms_layer(full_name):
    """An instance of the RMS normalization class ``full_name`` for ``[.., ND]`` inputs, a non-default epsilon where it has one."""
    cls = _hub_class(full_name)
    if full_name.endswith("Gemma3nRMSNorm"):
        return cls(dim=ND, eps=1e-4)
    if full_name.endswith("layers.modeling.rms_normalization.RMSNormalization"):
        return cls(ND)
    return cls(epsilon=1e-4)


def _randomize(layer, seed):
    r = np.random.default_rng(seed)
    for v in layer.weights:
        v.assign(r.normal(size=v.shape).astype(v.dtype))


def _check_clipped(model, x, y, expected):
    clip = float(np.median(reference_norms(expected)))  # some examples clipped, some not
    _clipped_sums_against_loop(model, x, y, expected, clip)


def _rms_model(norm, x_shape):
    inp = keras.Input(x_shape[1:])
    h = norm(keras.layers.Dense(ND)(inp))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    _randomize(norm, 1)  # Gemma's scale starts at 0, others at 1: make every factor differ
    return model


@pytest.mark.parametrize("full_name", sorted(RMS_NORMALIZATIONS), ids=lambda n: n.removeprefix("keras_hub.src."))
def test_hub_rms_normalizations_match_the_loop(full_name):
    """Every registered RMS class, on [B, T, heads, D] (Qwen3's per-head query/key norms) and [B, T, D] inputs."""
    from per_example_grads.rules import hub_layers

    keras.utils.set_random_seed(0)
    norm = _rms_layer(full_name)
    x_shape = (NB, NT, 2, 3) if "qwen3" in full_name else (NB, NT, 3)
    model = _rms_model(norm, x_shape)
    assert rule_for(norm) is hub_layers.RMS_NORM_RULE and hub_layers.RMS_NORM_RULE.unsupported(norm) is None
    x = np.random.default_rng(2).normal(size=x_shape).astype("float32")
    y = np.array([0, 1, 2, 1])
    expected = rule_against_loop(model, x, y)
    scale = hub_layers.RMS_NORM_RULE.variables(norm)[0]
    k = [v.path for v in model.trainable_variables].index(scale.path)
    assert np.abs(expected[k]).max() > 0  # the scale's gradient is not trivially 0
    _check_clipped(model, x, y, expected)


@pytest.mark.parametrize("full_name", sorted(RMS_NORMALIZATIONS), ids=lambda n: n.removeprefix("keras_hub.src."))
def test_hub_rms_normalizations_rule_normalizes_as_the_layer(full_name):
    """The rule's ``xh`` times the scale (``c + s``) is the layer's output: its form (ops, epsilon, dtype) is the class's."""
    from per_example_grads.rules import hub_layers

    norm = _rms_layer(full_name)
    x = tf.random.stateless_normal((2, 3, ND), [3, 4]) * 2
    out = norm(x)
    _randomize(norm, 5)
    rule = hub_layers.RMS_NORM_RULE
    y, xh, taps = rule.forward(norm, norm.call, (x,), {})
    np.testing.assert_array_equal(y.numpy(), norm(x).numpy())  # the layer's own call
    scale = tf.cast(rule.variables(norm)[0], xh.dtype)
    shifted = "gemma." in full_name or "gemma3." in full_name or "qwen3_5" in full_name  # (1 + scale)
    np.testing.assert_allclose(xh * ((1.0 + scale) if shifted else scale), norm(x), rtol=4 * EPS32, atol=4 * EPS32)
    assert out.shape == y.shape


def test_rms_rule_declines_a_layer_without_a_scale_variable():
    from per_example_grads.rules import hub_layers

    norm = _rms_layer("keras_hub.src.models.gemma3n.rms_normalization.Gemma3nRMSNorm")
    unscaled = type(norm)(dim=ND, with_scale=False)
    unscaled.build((None, ND))
    assert "no scale variable" in hub_layers.RMS_NORM_RULE.unsupported(unscaled)


def _relative_embedding_model(r):
    """Token features attend to DeBERTa's relative embedding table (``[B, 2K, D]``): every variable is reached."""
    from keras_hub.src.models.deberta_v3.relative_embedding import RelativeEmbedding

    rel = RelativeEmbedding(hidden_dim=ND, bucket_size=2, layer_norm_epsilon=1e-3)
    inp = keras.Input((NT, 3))
    h = keras.layers.Dense(ND)(inp)
    table = rel(h)  # [B, 4, D]
    scores = keras.layers.Dot(axes=(2, 2))([h, table])  # [B, T, 4]
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(keras.layers.Activation("tanh")(scores))))
    _randomize(rel, 3)
    x = r.normal(size=(NB, NT, 3)).astype("float32")
    return model, rel, x


def test_deberta_relative_embedding_matches_the_loop():
    from per_example_grads.rules import hub_layers

    model, rel, x = _relative_embedding_model(np.random.default_rng(4))
    assert (
        rule_for(rel) is hub_layers.RELATIVE_EMBEDDING_RULE
        and hub_layers.RELATIVE_EMBEDDING_RULE.unsupported(rel) is None
    )
    assert any(u.rule is hub_layers.RELATIVE_EMBEDDING_RULE for u in plan_watches(model, model.trainable_variables))
    y = np.array([0, 1, 2, 1])
    expected = rule_against_loop(model, x, y)
    _check_clipped(model, x, y, expected)


def test_deberta_relative_embedding_with_a_frozen_layer_norm():
    """Only the table is trainable: the rule returns its gradients alone."""
    model, rel, x = _relative_embedding_model(np.random.default_rng(5))
    rel.layer_norm.trainable = False
    y = np.array([2, 1, 0, 1])
    expected = rule_against_loop(model, x, y)
    _check_clipped(model, x, y, expected)


def _patch_model(layer, image=8):
    inp = keras.Input((image, image, 3))
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Activation("tanh")(layer(inp)))
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    _randomize(layer, 6)  # DeiT's tokens start at 0
    return model, np.random.default_rng(7).normal(size=(NB, image, image, 3)).astype("float32")


@pytest.mark.parametrize(
    "options", [{}, {"use_class_token": False, "use_patch_bias": False}], ids=["class_token", "bare"]
)
def test_vit_patch_embedding_matches_the_loop(options):
    from keras_hub.src.models.vit.vit_layers import ViTPatchingAndEmbedding

    from per_example_grads.rules import patch_embedding

    layer = ViTPatchingAndEmbedding(image_size=(8, 8), patch_size=(4, 2), hidden_dim=ND, **options)
    model, x = _patch_model(layer)
    assert any(u.rule is patch_embedding.PATCH_EMBEDDING_RULE for u in plan_watches(model, model.trainable_variables))
    y = np.array([0, 1, 2, 1])
    expected = rule_against_loop(model, x, y)
    _check_clipped(model, x, y, expected)


@pytest.mark.parametrize("dropout_rate", [0.0, 0.3])
def test_deit_embeddings_match_the_loop(dropout_rate):
    """Inference (the loop's reference runs the model with training=False): the dropout tap is its input."""
    from keras_hub.src.models.deit.deit_layers import DeiTEmbeddings

    from per_example_grads.rules import patch_embedding

    layer = DeiTEmbeddings(
        image_size=(8, 8), patch_size=(4, 4), hidden_dim=ND, use_mask_token=True, dropout_rate=dropout_rate
    )
    model, x = _patch_model(layer)
    assert any(u.rule is patch_embedding.DEIT_EMBEDDINGS_RULE for u in plan_watches(model, model.trainable_variables))
    y = np.array([0, 1, 2, 1])
    expected = rule_against_loop(model, x, y)
    mask_token = [v.path for v in model.trainable_variables].index(layer.mask_token.path)
    assert np.all(expected[mask_token] == 0)  # unused without bool_masked_pos
    _check_clipped(model, x, y, expected)


def test_deit_embeddings_tap_the_dropout_input():
    """The gradient at the dropout's input carries its mask; ``dL/dy`` at the layer's output would not."""
    from keras_hub.src.models.deit.deit_layers import DeiTEmbeddings

    layer = DeiTEmbeddings(image_size=(8, 8), patch_size=(4, 4), hidden_dim=ND, dropout_rate=0.5)
    model, x = _patch_model(layer)
    mask = np.random.default_rng(8).integers(0, 2, size=(1, 6, ND)).astype("float32") * 2
    # A fixed mask, the same for every example and call, so that the loop replays it (the instance's call, as Keras looks it up).
    object.__setattr__(layer.dropout, "call", lambda inputs, training=False: inputs * mask)
    y = np.array([1, 0, 2, 2])
    expected = rule_against_loop(model, x, y)
    _check_clipped(model, x, y, expected)


def test_deit_embeddings_with_masked_patches_take_the_layer_local_rule():
    """``bool_masked_pos`` goes to the exact layer-local VJP, whatever the layer then does with it."""
    from keras_hub.src.models.deit.deit_layers import DeiTEmbeddings

    from per_example_grads.engines.capture import capturing

    layer = DeiTEmbeddings(image_size=(8, 8), patch_size=(4, 4), hidden_dim=ND, use_mask_token=True)
    inp = keras.Input((8, 8, 3))
    masked = keras.Input((4,), dtype="bool")
    h = keras.layers.GlobalAveragePooling1D()(layer(inp, bool_masked_pos=masked))
    model = keras.Model([inp, masked], keras.layers.Dense(3)(h))
    _randomize(layer, 9)
    r = np.random.default_rng(10)
    x = [r.normal(size=(NB, 8, 8, 3)).astype("float32"), r.integers(0, 2, size=(NB, 4)).astype(bool)]
    watches = [u for u in plan_watches(model, model.trainable_variables) if u.layer is layer]
    with capturing(watches) as records:
        model(x)
    assert records[0].saved[0] == "local"
    rule_against_loop(model, x, np.array([0, 1, 2, 1]))


class _TwoT5Attentions(keras.Model):
    """Two T5 attention layers, the second reusing the first's position bias (as a T5 stack does), then a head."""

    def __init__(self):
        from keras_hub.src.models.t5.t5_multi_head_attention import T5MultiHeadAttention

        super().__init__()
        common = dict(is_decoder=False, hidden_dim=ND, key_value_dim=4, num_heads=2, dropout=0.0)
        self.first = T5MultiHeadAttention(use_relative_attention_bias=True, name="first", **common)
        self.second = T5MultiHeadAttention(name="second", **common)
        self.head = keras.layers.Dense(3)

    def call(self, inputs):
        h, mask = inputs
        h, bias, _ = self.first(h, mask=mask)
        h, _, _ = self.second(h, position_bias=bias)
        return self.head(keras.ops.reshape(h, (-1, NT * ND)))


def _t5_attention_model(r):
    model = _TwoT5Attentions()
    m = np.ones((NB, NT, NT), bool)
    m[0, :, -2:] = False  # padded keys of one example
    x = [r.normal(size=(NB, NT, ND)).astype("float32"), m]
    model(x)
    _randomize(model.first, 12)
    return model, model.first, x


@pytest.mark.slow
def test_t5_attention_with_relative_bias_matches_the_loop():
    """The bias table's gradient comes through the layer's own scores and the second layer's reuse of P."""
    from per_example_grads.rules import t5_attention

    model, first, x = _t5_attention_model(np.random.default_rng(13))
    watches = {id(u.layer): u for u in plan_watches(model, model.trainable_variables)}
    assert watches[id(first)].rule is t5_attention.T5_ATTENTION_RULE
    y = np.array([0, 1, 2, 1])
    expected = rule_against_loop(model, x, y)
    table = [v.path for v in model.trainable_variables].index(first.relative_attention_bias.path)
    assert np.abs(expected[table]).max() > 0
    _check_clipped(model, x, y, expected)


def test_t5_attention_outputs_are_the_layers_own_bit_for_bit():
    from per_example_grads.engines.capture import Watch, capturing
    from per_example_grads.rules import t5_attention

    model, first, (h, m) = _t5_attention_model(np.random.default_rng(14))
    plain = first(h, mask=m)
    with capturing([Watch(first, t5_attention.T5_ATTENTION_RULE)]) as records:
        watched = first(h, mask=m)
    assert records[0].saved[0] == "closed"
    for a, b in zip(plain[:2], watched[:2]):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with capturing([Watch(first, t5_attention.T5_ATTENTION_RULE)]) as records:
        first(h)  # no mask: the bias would stay [1, heads, Tq, Tk], so the layer-local rule
    assert records[0].saved[0] == "local"
