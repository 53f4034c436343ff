"""Adaptive clipping: the clip norm tracks the target quantile, alone and in DPModel."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import digits_split
from per_example_grads.dp import adaptive


def test_adaptive_clipping_tracks_the_quantile():
    norms = tf.constant(np.linspace(0.1, 2.0, 20), tf.float32)  # median about 1.05
    settings = adaptive.AdaptiveClipping(
        target_quantile=0.5, learning_rate=0.2, clipped_count_stddev=1e-3, initial_l2_norm_clip=5.0
    )
    clip = tf.constant(5.0)
    gen = tf.random.Generator.from_seed(0)
    for _ in range(200):
        clip = adaptive.updated_clip(settings, clip, norms, tf.ones([20]), 20.0, gen)
    assert 0.9 < float(clip) < 1.2
    # Padding rows (norm 0) are not counted as unclipped.
    padded = tf.concat([norms, tf.zeros([20])], 0)
    clip2 = tf.constant(5.0)
    for _ in range(200):
        clip2 = adaptive.updated_clip(settings, clip2, padded, tf.concat([tf.ones([20]), tf.zeros([20])], 0), 20.0, gen)
    assert 0.9 < float(clip2) < 1.2
    with pytest.raises(ValueError, match="target_quantile"):
        adaptive.AdaptiveClipping(target_quantile=1.5)


def test_dp_model_with_adaptive_clipping_moves_the_clip():
    x, y, _, _ = digits_split(200)
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    settings = adaptive.AdaptiveClipping(initial_l2_norm_clip=100.0, clipped_count_stddev=2.0)
    dp = peg.keras.DPModel(net, noise_multiplier=1.0, expected_batch_size=50, adaptive_clipping=settings, seed=0)
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.fit(x, y, batch_size=50, epochs=2, verbose=0)
    assert float(dp.l2_norm_clip.numpy()) < 100.0
