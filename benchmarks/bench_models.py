"""The DP quantities on the models users fine-tune: KerasHub language models and keras.applications.

    python benchmarks/bench_models.py                       # every preset, its batch sizes
    python benchmarks/bench_models.py --presets gpt2,bert --batch-sizes 8
    python benchmarks/bench_models.py --memory              # also peak TensorFlow allocations

For each (preset, B), one process builds the model from the shared zoo
(``per_example_grads.apps.zoo``, random weights, nothing downloaded) and
times, round-robin with medians over ``--repeats`` (``bench_layerwise``'s
``time_round_robin``), each quantity as a ``tf.function`` with an unknown
batch dimension:

  batch_grad  ``tape.gradient`` of the mean loss: the plain step, the baseline
  clipped     ``peg.clipped_gradients(l2_norm_clip=1.0)`` (``method="auto"``)
  norms       ``peg.per_example_norms`` (``method="auto"``)

Reported: ms, the ratio to batch_grad, the milliseconds added, and whether
``auto`` fell back from the layer-wise engine (its ``EngineFallbackWarning``). Models run
in inference mode (``training=False``: BatchNormalization uses its moving
statistics, as when frozen for fine-tuning). With ``--memory`` each quantity
also runs in a fresh process with TensorFlow's BFC CPU allocator, which
reports its peak allocated bytes above those held before the step
(``bench_layerwise.peak_allocated_mib``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_LM = dict(num_layers=4, hidden_dim=256, intermediate_dim=1024, vocabulary_size=8192, seq_len=64)
# name -> (zoo model, its settings, batch sizes)
PRESETS = {
    "gpt2": ("gpt2_lm", _LM, (8, 32)),
    "gpt2_t128": ("gpt2_lm", {**_LM, "seq_len": 128}, (8, 32)),
    "gpt2_lora": ("gpt2_lm", {**_LM, "lora_rank": 8}, (8, 32)),
    "gemma": ("gemma_lm", _LM, (8, 32)),
    "gemma_lora": ("gemma_lm", {**_LM, "lora_rank": 8}, (8, 32)),
    "bert": ("bert_classifier", _LM, (8, 32)),
    "bert_lora": ("bert_classifier", {**_LM, "lora_rank": 8}, (8, 32)),
    "mobilenet_v2": ("mobilenet_v2", {}, (32,)),
    "efficientnet_b0": ("efficientnet_b0", {}, (32,)),
    "convnext_tiny": ("convnext_tiny", {}, (32,)),
    "resnet50": ("resnet50", {}, (32,)),
    "xception": ("xception", {"image_size": 71}, (32,)),
    "conv_decoder": ("conv_decoder", {}, (32,)),
    "mobilenet_v2_224": ("mobilenet_v2", {"image_size": 224}, (8,)),
    "efficientnet_b0_224": ("efficientnet_b0", {"image_size": 224}, (8,)),
}
QUANTITIES = ("batch_grad", "clipped", "norms")


def quantities(model, x, trace=None):
    """``{name: trace(f)}`` for ``QUANTITIES``; ``trace`` default ``tf.function(f, reduce_retracing=True)``."""
    import keras
    import tensorflow as tf

    import per_example_grads as peg

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = model.trainable_variables

    def batch_grad(x, y):
        with tf.GradientTape() as tape:
            mean = tf.reduce_mean(loss(y, model(x, training=False)))
        return tape.gradient(mean, variables)

    fns = {
        "batch_grad": batch_grad,
        "clipped": lambda x, y: peg.clipped_gradients(model, loss, x, y, l2_norm_clip=1.0),
        "norms": lambda x, y: peg.per_example_norms(model, loss, x, y),
    }
    trace = trace or (lambda f: tf.function(f, reduce_retracing=True))
    return {q: trace(f) for q, f in fns.items()}


def _setup(preset: str, b: int):
    from per_example_grads.apps import zoo

    name, config, _ = PRESETS[preset]
    model, x, y = zoo.build(name, b, **config)
    return model, x, y, quantities(model, x)


def time_cell(preset: str, b: int, repeats: int) -> tuple[dict, str]:
    """Median seconds per quantity, and what ``auto`` fell back from (its warnings, first words), if anything."""
    import warnings

    from bench_layerwise import time_round_robin

    import per_example_grads as peg

    _, x, y, fns = _setup(preset, b)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", peg.EngineFallbackWarning)
        times = time_round_robin(fns, x, y, repeats)
    fallbacks = sorted({str(w.message)[:80] for w in caught if issubclass(w.category, peg.EngineFallbackWarning)})
    return times, "; ".join(fallbacks) or "none"


def memory_cell(preset: str, b: int, q: str) -> float:
    from bench_layerwise import peak_allocated_mib

    _, x, y, fns = _setup(preset, b)
    return peak_allocated_mib(fns[q], x, y)


def _memory_worker(preset: str, b: int, q: str) -> float:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true")
    out = subprocess.run(
        [sys.executable, __file__, "--cell", f"{preset},{b},{q}"], capture_output=True, text=True, timeout=1800, env=env
    )
    if out.returncode:
        raise RuntimeError(f"memory cell {preset},{b},{q} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["mib"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--batch-sizes", help="comma list; default: each preset's own")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--out")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        preset, b, q = args.cell.split(",")
        print(json.dumps({"mib": memory_cell(preset, int(b), q)}))
        return 0
    import tensorflow as tf

    unknown = [s for s in args.presets.split(",") if s not in PRESETS]
    if unknown:
        p.error(f"unknown presets {unknown}; choose from {list(PRESETS)}")
    lines = [
        f"command: python benchmarks/bench_models.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        f"tensorflow {tf.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| preset | B | batch_grad ms | clipped ms | clipped / batch | +ms | norms ms | norms / batch | +ms | auto fell back |"
        + (" peak MiB batch / clipped / norms | clipped / batch |" if args.memory else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.memory else ""),
    ]
    print("\n".join(lines), flush=True)
    for preset in args.presets.split(","):
        sizes = [int(s) for s in args.batch_sizes.split(",")] if args.batch_sizes else PRESETS[preset][2]
        for b in sizes:
            t, fallbacks = time_cell(preset, b, args.repeats)
            base = t["batch_grad"]
            row = (
                f"| {preset} | {b} | {base * 1e3:.1f} | {t['clipped'] * 1e3:.1f} | {t['clipped'] / base:.2f} | "
                f"{(t['clipped'] - base) * 1e3:+.1f} | {t['norms'] * 1e3:.1f} | {t['norms'] / base:.2f} | "
                f"{(t['norms'] - base) * 1e3:+.1f} | {fallbacks} |"
            )
            if args.memory:
                mem = {q: _memory_worker(preset, b, q) for q in QUANTITIES}
                row += (
                    f" {mem['batch_grad']:.0f} / {mem['clipped']:.0f} / {mem['norms']:.0f} | "
                    f"{mem['clipped'] / max(mem['batch_grad'], 1e-9):.2f} |"
                )
            lines.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
