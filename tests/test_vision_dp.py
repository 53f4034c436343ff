"""Private training of keras.applications models end to end: fix_model, DPModel.fit, epsilon."""

import keras
import numpy as np
import pytest

import per_example_grads as peg
from per_example_grads.apps import zoo
from per_example_grads.data import digits_as_images


@pytest.mark.slow
@pytest.mark.parametrize("name, config", [("mobilenet_v2", {"alpha": 0.35}), ("efficientnet_b0", {})])
def test_dp_model_trains_a_fixed_application_on_digit_images(name, config):
    x, y = digits_as_images(32)
    x, y = x[:48], y[:48]
    model, changes = peg.dp.fix_model(zoo.build_model(name, **config), return_changes=True)
    assert changes and all("GroupNormalization" in c for c in changes)
    before = [w.copy() for w in model.get_weights()]
    dp = peg.keras.DPModel(model, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=12, num_examples=48)
    dp.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=12 / 48, seed=0), epochs=1, verbose=0)
    assert int(dp.dp_steps.numpy()) == 4
    assert np.isfinite(history.history["loss"]).all()
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    # The ledger's 4 Poisson steps at q = 1/4, against the accountant called directly.
    assert dp.epsilon(1e-5) == pytest.approx(
        peg.dp.compute_epsilon(48, 12, 1, noise_multiplier=1.0, delta=1e-5), rel=1e-9
    )
