"""Two versions of the library side by side in one process: clipped sums, norms and peak memory.

    git archive <base-commit> per_example_grads | tar -x -C /tmp/base
    mv /tmp/base/per_example_grads /tmp/base/per_example_grads_base
    grep -rl per_example_grads /tmp/base/per_example_grads_base | xargs sed -i 's/\\bper_example_grads\\b/per_example_grads_base/g'
    PYTHONPATH=.:/tmp/base python benchmarks/bench_before_after.py mlp,cnn,transformer,embedding_bag 64,256 9 2

Arguments: models, batch sizes, timing repeats, memory repeats (0: no memory).
``per_example_grads_base`` (the renamed copy) is "before", the checkout
"after". Both are traced on the same model and timed round-robin with the
plain batch gradient, as in ``bench_layerwise.py``, so machine load hits all
alike; reported are ratios of medians to the batch gradient's. Memory: as
``bench_layerwise.py --memory`` (``peak_increment_mib``: median peak-RSS
increment of 3 calls after one warm-up, fresh subprocess per cell), the median over the memory repeats.
"""

import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layerwise import build, peak_increment_mib, quantity_fn, time_round_robin  # noqa: E402


def fns(model, x):
    """``tf.function``s by name: ``batch_grad`` (``bench_layerwise``'s), and clipped sums and norms before and after."""
    import keras
    import per_example_grads_base as old
    import tensorflow as tf

    import per_example_grads as new

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    out = {}
    for tag, peg in (("before", old), ("after", new)):
        out[f"clipped_{tag}"] = (
            lambda peg: lambda x, y: peg.clipped_gradients(model, loss, x, y, l2_norm_clip=1.0, method="layerwise")
        )(peg)
        out[f"norms_{tag}"] = (lambda peg: lambda x, y: peg.per_example_norms(model, loss, x, y, method="layerwise"))(
            peg
        )
    spec = [tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(x.dtype)), tf.TensorSpec([None], tf.int32)]
    return {"batch_grad": quantity_fn("batch_grad", model, x)} | {
        k: tf.function(f, input_signature=spec) for k, f in out.items()
    }


def time_cell(m: str, b: int, repeats: int) -> dict:
    model, x, y = build(m, b)
    return time_round_robin(fns(model, x), x, y, repeats)


def mem_cell(m: str, b: int, q: str) -> float:
    model, x, y = build(m, b)
    return peak_increment_mib(fns(model, x)[q], x, y)


def main() -> None:
    if sys.argv[1] == "--cell":
        m, b, q = sys.argv[2].split(",")
        print(json.dumps(mem_cell(m, int(b), q)))
        return
    models, sizes = sys.argv[1].split(","), [int(s) for s in sys.argv[2].split(",")]
    repeats, mem_reps = int(sys.argv[3]), int(sys.argv[4])
    print(
        "| model | B | clipped before | clipped after | norms before | norms after | batch_grad ms |\n|---|---|---|---|---|---|---|",
        flush=True,
    )
    for m in models:
        for b in sizes:
            r = time_cell(m, b, repeats)
            base = r["batch_grad"]
            print(
                f"| {m} | {b} | {r['clipped_before'] / base:.2f} | {r['clipped_after'] / base:.2f} | "
                f"{r['norms_before'] / base:.2f} | {r['norms_after'] / base:.2f} | {base * 1e3:.1f} |",
                flush=True,
            )
    if not mem_reps:
        return
    print(
        "\n| model | B | batch_grad MiB | clipped before MiB (ratio) | clipped after MiB (ratio) |\n|---|---|---|---|---|",
        flush=True,
    )
    for m in models:
        for b in sizes:
            vals = {}
            for q in ("batch_grad", "clipped_before", "clipped_after"):
                runs = []
                for _ in range(mem_reps):
                    out = subprocess.run(
                        [sys.executable, __file__, "--cell", f"{m},{b},{q}"],
                        capture_output=True,
                        text=True,
                        timeout=900,
                    )
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                vals[q] = statistics.median(runs)
            bg = max(vals["batch_grad"], 1e-9)
            print(
                f"| {m} | {b} | {vals['batch_grad']:.1f} | {vals['clipped_before']:.1f} ({vals['clipped_before'] / bg:.2f}) | "
                f"{vals['clipped_after']:.1f} ({vals['clipped_after'] / bg:.2f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
