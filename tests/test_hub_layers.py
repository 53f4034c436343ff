"""KerasHub RMS normalizations and PositionEmbedding: the closed forms of rules/hub_layers.py against the one-example loop."""

import subprocess
import sys

import keras
import numpy as np
import pytest

import per_example_grads as peg
from helpers import assert_clipped_sums_close, reference_norms, rule_against_loop, sparse_ce
from per_example_grads.rules import hub_layers, rule_for

keras_hub = pytest.importorskip("keras_hub")

B, T, D = 4, 5, 6


def _rms_classes():
    from keras_hub.src.models.gemma.rms_normalization import RMSNormalization as Gemma
    from keras_hub.src.models.llama.llama_layernorm import LlamaLayerNorm
    from keras_hub.src.models.mistral.mistral_layer_norm import MistralLayerNormalization
    from keras_hub.src.models.phi3.phi3_layernorm import Phi3LayerNorm

    return {
        "gemma": lambda: Gemma(epsilon=1e-6),
        "llama": lambda: LlamaLayerNorm(epsilon=1e-5),
        "mistral": lambda: MistralLayerNormalization(),
        "phi3": lambda: Phi3LayerNorm(),
        "hub_rms": lambda: keras_hub.layers.RMSNormalization(D),
    }


def _random_weights(layer, seed):
    r = np.random.default_rng(seed)
    for v in layer.weights:
        v.assign(r.normal(size=v.shape).astype(v.dtype))


@pytest.mark.parametrize("name", sorted(_rms_classes()))
def test_rms_normalization_matches_loop(name):
    keras.utils.set_random_seed(0)
    norm = _rms_classes()[name]()
    inp = keras.Input((T, 3))
    h = norm(keras.layers.Dense(D)(inp))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    _random_weights(norm, 1)  # Gemma's scale starts at 0: make every factor (1 + scale) differ
    assert rule_for(norm) is hub_layers.RMS_NORM_RULE
    x = np.random.default_rng(2).normal(size=(B, T, 3)).astype("float32")
    y = np.array([0, 1, 2, 1])
    expected = rule_against_loop(model, x, y)
    assert np.abs(expected[2]).max() > 0  # the scale's gradient is not trivially 0
    _check_clipped_sums(model, x, y, expected)


@pytest.mark.parametrize("start_index", [0, 3])
def test_position_embedding_matches_loop(start_index):
    keras.utils.set_random_seed(0)
    position = keras_hub.layers.PositionEmbedding(sequence_length=T + 4)
    inp = keras.Input((T, D))
    h = keras.layers.Dense(D)(inp)
    h = keras.layers.Activation("tanh")(h + position(h, start_index=start_index))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    assert rule_for(position) is hub_layers.POSITION_EMBEDDING_RULE
    x = np.random.default_rng(3).normal(size=(B, T, D)).astype("float32")
    y = np.array([0, 1, 2, 1])
    expected = rule_against_loop(model, x, y)
    table = expected[[v.path for v in model.trainable_variables].index(position.position_embeddings.path)]
    # Only rows start .. start+T-1 are read: the others' gradients are exactly 0, these are not.
    rows = np.zeros(T + 4, bool)
    rows[start_index : start_index + T] = True
    assert np.all(table[:, ~rows] == 0) and np.all(np.abs(table[:, rows]).max(axis=-1) > 0)
    _check_clipped_sums(model, x, y, expected)


def _check_clipped_sums(model, x, y, expected):
    clip = float(np.median(reference_norms(expected)))  # some examples clipped, some not
    factors = clip / np.maximum(reference_norms(expected), clip)
    got, norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True, method="layerwise")
    np.testing.assert_array_less(0, np.asarray(norms))
    assert_clipped_sums_close(got, expected, factors)


def test_rules_are_registered_without_importing_keras_hub():
    code = "import sys, per_example_grads; assert 'keras_hub' not in sys.modules, 'keras_hub imported'"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)
