"""One private epoch against one plain Keras epoch, side by side in one process.

    .venv/bin/python benchmarks/bench_dp_fit.py                      # all models, expected batch 256 and 1024
    .venv/bin/python benchmarks/bench_dp_fit.py --models mlp --expected-batch-sizes 256 --repeats 3
    .venv/bin/python benchmarks/bench_dp_fit.py --models mobilenet_v2,gpt2_lm --expected-batch-sizes 256 --repeats 3

For each model of the shared zoo (``per_example_grads.apps.zoo``; the
larger ones at the sizes of ``LARGER``) and each expected batch size ``b``
(``N = 12,000`` synthetic examples, fewer for the larger models, SGD (``--optimizer adam``: Adam), sparse
categorical cross-entropy):

- ``plain``: ``keras.Model.fit(x, y, batch_size=b)``, one epoch of ``ceil(N / b)`` steps;
- ``dp``: ``peg.keras.DPModel.fit`` on ``peg.dp.poisson_batches(x, y, q=b/N)``,
  one epoch of ``round(N / b)`` Poisson steps, without physical chunks and
  with chunks of 64 and 128 rows.

Each configuration trains its own copy of the model (same initial weights).
Epochs are timed round-robin (one epoch of every configuration, then the
next round), so machine load hits all alike; the first epoch of each (tracing)
is not timed. An epoch is timed from Keras's ``on_epoch_begin`` to its
``on_epoch_end``, so what ``fit`` does once per call is left out: its
teardown took 0.1-0.3 s at random (more with ``DPModel``), after the last
step, as long as a whole epoch here, and a user pays it once per ``fit``
call, not per epoch. Reported: the median epoch time, its ratio to the plain epoch,
and the milliseconds the private step adds to a plain step
(``dp epoch / dp steps - plain epoch / plain steps``), and the first step of
the untimed first epoch, which traces the train step (a user pays it at the
first ``fit`` call of a model, and again whenever a ``fit`` retraces). Two more rows time the
input pipelines alone, one pass each with nothing trained: Keras's own for
arrays (``ArrayDataAdapter``, what ``fit(x, y)`` uses) and ``poisson_batches``
(both prefetch, so in ``fit`` this time overlaps the steps).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

N = 12_000
# Models of the KerasHub and vision issues: (examples per epoch, zoo settings). MobileNetV2 on 32x32
# images (a model's BatchNormalization becomes GroupNormalization, peg.dp.fix_model, for both the plain
# and the private runs); a small GPT-2 (2 layers, d=128, T=32, vocabulary 4096), next-token prediction.
LARGER = {
    "mobilenet_v2": (4096, {}),
    "gpt2_lm": (4096, dict(num_layers=2, hidden_dim=128, intermediate_dim=512, vocabulary_size=4096, seq_len=32)),
}


def configurations(name: str, b: int, optimizer: str = "sgd"):
    """``{label: (fit_one_epoch, steps per epoch)}``, each on its own copy of the model."""
    import keras

    import per_example_grads as peg
    from per_example_grads.apps import zoo

    n, config = LARGER.get(name, (N, {}))
    _, x, y = zoo.build(name, n, **config)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    q = b / n
    out = {}

    def copy():  # the same initial weights (the zoo seeds them), built anew: KerasHub models do not clone
        m = zoo.build_model(name, **config)
        batch_norm = any(isinstance(layer, keras.layers.BatchNormalization) for layer in m.layers)
        return peg.dp.fix_model(m) if batch_norm else m  # BatchNormalization -> GroupNormalization, as DP needs

    plain = copy()
    make_optimizer = {"sgd": lambda: keras.optimizers.SGD(0.01), "adam": lambda: keras.optimizers.Adam(1e-3)}[optimizer]
    plain.compile(optimizer=make_optimizer(), loss=loss)
    out["plain"] = (lambda: _timed_epoch(plain, x, y, batch_size=b), math.ceil(n / b))
    for chunk in (None, 64, 128):
        if chunk is not None and chunk >= b:
            continue
        dp = peg.keras.DPModel(copy(), l2_norm_clip=1.0, noise_multiplier=1.0, physical_batch_size=chunk)
        dp.compile(optimizer=make_optimizer(), loss=loss)
        data = peg.dp.poisson_batches(x, y, sampling_probability=q, seed=0)
        label = "dp" if chunk is None else f"dp, chunks of {chunk}"
        out[label] = ((lambda dp, data: lambda: _timed_epoch(dp, data))(dp, data), data.pegrad_sampling.steps)
    # The input pipelines alone: one pass over each, nothing trained (what each epoch spends on input
    # when it is not overlapped with the step).
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    keras_input = ArrayDataAdapter(x, y, batch_size=b, shuffle=True).get_tf_dataset()
    poisson_input = peg.dp.poisson_batches(x, y, sampling_probability=q, seed=1)
    out["input only: keras arrays"] = ((lambda: _drain(keras_input)), math.ceil(n / b))
    out["input only: poisson_batches"] = ((lambda: _drain(poisson_input)), poisson_input.pegrad_sampling.steps)
    return out


def _timed_epoch(model, x, y=None, **kwargs) -> tuple[float, float]:
    """Seconds of one epoch of ``model.fit`` (``on_epoch_begin`` to ``on_epoch_end``) and of its first step."""
    import keras

    marks = {}

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            marks["begin"] = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            marks.setdefault("first begin", time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            marks.setdefault("first end", time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            marks["end"] = time.perf_counter()

    model.fit(x, y, epochs=1, verbose=0, callbacks=[Clock()], **kwargs)
    return marks["end"] - marks["begin"], marks["first end"] - marks["first begin"]


def _drain(dataset) -> tuple[float, None]:
    start = time.perf_counter()
    for batch in dataset:
        del batch
    return time.perf_counter() - start, None


def run(models, sizes, repeats, optimizer="sgd"):
    print(
        f"N = {N} ({', '.join(f'{k} {v[0]}' for k, v in LARGER.items())}); median of {repeats} epochs after one untimed epoch; `python {' '.join(sys.argv)}`\n"
    )
    print(
        "| model | expected batch | configuration | steps/epoch | epoch s | / plain epoch | ms added per step | first step s (tracing) |"
    )
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for name in models:
        for b in sizes:
            configs = configurations(name, b, optimizer)
            times = {k: [] for k in configs}
            first_step = {}
            for round_ in range(repeats + 1):
                for label, (fit, _) in configs.items():
                    seconds, first = fit()
                    if round_:
                        times[label].append(seconds)
                    else:
                        first_step[label] = "" if first is None else f"{first:.2f}"
            plain_epoch = statistics.median(times["plain"])
            plain_step = plain_epoch / configs["plain"][1]
            for label, (_, steps) in configs.items():
                epoch = statistics.median(times[label])
                added = (
                    ""
                    if label == "plain" or label.startswith("input")
                    else f"{(epoch / steps - plain_step) * 1e3:+.1f}"
                )
                print(
                    f"| {name} | {b} | {label} | {steps} | {epoch:.2f} | {epoch / plain_epoch:.2f} | {added} | {first_step[label]} |",
                    flush=True,
                )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,transformer,embedding_bag")
    parser.add_argument("--expected-batch-sizes", default="256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--optimizer",
        choices=("sgd", "adam"),
        default="sgd",
        help="adam has slot variables: their creation while tracing made Keras trace a step twice",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    run(args.models.split(","), [int(s) for s in args.expected_batch_sizes.split(",")], args.repeats, args.optimizer)


if __name__ == "__main__":
    main()
