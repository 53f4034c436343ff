"""DPModel.fit fine-tunes KerasHub models, full and LoRA, on generated text (the README's GPT-2 example is test_readme)."""

import keras
import numpy as np
import pytest

import per_example_grads as peg
from per_example_grads.apps import zoo
from per_example_grads.data.text import VOCABULARY_SIZE, byte_tokens, reviews

N, B, T = 32, 8, 16


def _data(name):
    texts, labels = reviews(N, seed=1)
    ids, mask = byte_tokens(texts, seq_len=T + 1)
    if name == "bert_classifier":
        return {"token_ids": ids[:, :T], "padding_mask": mask[:, :T], "segment_ids": np.zeros_like(ids[:, :T])}, labels
    return {"token_ids": ids[:, :T], "padding_mask": mask[:, :T]}, ids[:, 1:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, lora_rank", [("gemma_lm", None), ("gemma_lm", 2), ("bert_classifier", None), ("bert_classifier", 2)]
)
def test_dp_model_fine_tunes_a_keras_hub_model(name, lora_rank):
    model = zoo.build_model(name, vocabulary_size=VOCABULARY_SIZE, seq_len=T, lora_rank=lora_rank)
    x, y = _data(name)
    # With LoRA the backbone trains only its adapters (and, in BERT, the adapted layers' biases).
    assert lora_rank is None or all(
        "lora" in v.path or v.path.endswith("bias") for v in model.backbone.trainable_variables
    )
    before = {v.path: v.numpy().copy() for v in model.trainable_variables}
    dp = peg.keras.DPModel(model, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=B, num_examples=N)
    dp.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=0 if name != "bert_classifier" else None
        ),
    )
    history = dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=B / N, seed=0), epochs=1, verbose=0)
    assert int(dp.dp_steps.numpy()) == N // B
    assert np.isfinite(history.history["loss"]).all()
    assert all(not np.array_equal(v.numpy(), before[v.path]) for v in model.trainable_variables)
    assert dp.epsilon(1e-3) == pytest.approx(
        peg.dp.compute_epsilon(N, B, 1, noise_multiplier=1.0, delta=1e-3), rel=1e-9
    )
