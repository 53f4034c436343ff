"""Layer-wise engine vs the plain batch gradient: DP-step costs and peak memory.

    python benchmarks/bench_layerwise.py                 # timings + memory, 4 models x B in {64, 256}
    python benchmarks/bench_layerwise.py --quick         # smoke run

Timing: for every (model, B) one process builds the model and wraps each
quantity in a ``tf.function`` with an unknown batch dimension, then times the
quantities round-robin (the order rotates every repeat), so machine noise hits
all alike. Reported: the median over ``--repeats`` and its ratio to the median
of the plain batch-gradient step (``tape.gradient`` of the mean loss).

Quantities:
  batch_grad         plain step, the baseline
  clipped_layerwise  peg.clipped_gradients (one forward + one backward, no B x P)
  norms_layerwise    peg.per_example_norms (ghost norms)
  grads_layerwise    peg.per_example_gradients(method="layerwise"), materialized
  grads_layerwise_sparse  the same with sparse_embeddings=True: embedding tables'
                     per-example gradients as rows (PerExampleSlices), not
                     [B, vocab, dim]; only on the models with a table
  clipped_vectorized tf.vectorized_map per-example gradients, clip, sum
                     (what a generic vectorized DP-SGD step costs; refused
                     where pfor would hit ops oneDNN cannot take, as in the
                     transformer's attention, so not run there)

Memory (``--memory``): each quantity runs in a fresh subprocess that builds the
model, traces the quantity and runs it once; then, 3 times: it hands malloc's
free memory back to the OS (``malloc_trim``), resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), notes the resident size, runs the quantity once
and reads the new peak (``VmHWM``). Reported: the median increment (the memory
the step itself needs beyond what stays allocated) and its ratio to
batch_grad's. Without the trim, a step reuses what the previous one freed and
the increments swung by 2x between runs; with it they still read the CNN's
batch step anywhere from 18 to 47 MiB, because what the process holds
besides tensors varies. So a second fresh subprocess per quantity runs with
TensorFlow's BFC CPU allocator and reports its peak allocated bytes above
those held before the step (``peak_allocated_mib``): tensors only, exact
for that process (80.2 / 81.0 / 80.2 MiB for the CNN's batch step at B=256;
across fresh processes its B=64 step read 49 and 70 MiB, convolution
workspaces differing). And a third measures RSS again with
``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every block of 64 KiB or
more on its own and unmaps it when freed, instead of raising that threshold
after the first large free and keeping later large blocks in its heap, so
the peak RSS follows live memory. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("mlp", "cnn", "transformer", "embedding_bag")
QUANTITIES = (
    "batch_grad",
    "clipped_layerwise",
    "norms_layerwise",
    "grads_layerwise",
    "grads_layerwise_sparse",
    "clipped_vectorized",
)


def build(name: str, b: int):
    """``(model, x, y)`` from the shared zoo (``per_example_grads.apps.zoo``)."""
    from per_example_grads.apps import zoo

    return zoo.build(name, b)


def quantity_fn(name: str, model, x, jit_compile: bool = False):
    """``tf.function`` of quantity ``name`` (a key of ``fns`` below) on ``model``, batch dimension unknown."""
    import keras
    import tensorflow as tf

    import per_example_grads as peg

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = model.trainable_variables

    def batch_grad(x, y):
        with tf.GradientTape() as tape:
            l = tf.reduce_mean(loss(y, model(x)))
        return tape.gradient(l, variables)

    def clipped_vectorized(x, y):
        grads = peg.per_example_gradients(model, loss, x, y, method="vectorized")
        clipped, _ = peg.clip_by_global_norm(grads, 1.0)
        return peg.sum_examples(clipped)

    fns = {
        "batch_grad": batch_grad,
        "clipped_layerwise": lambda x, y: peg.clipped_gradients(
            model, loss, x, y, l2_norm_clip=1.0, method="layerwise"
        ),
        "norms_layerwise": lambda x, y: peg.per_example_norms(model, loss, x, y, method="layerwise"),
        "grads_layerwise": lambda x, y: peg.per_example_gradients(model, loss, x, y, method="layerwise"),
        "grads_layerwise_sparse": lambda x, y: peg.per_example_gradients(
            model, loss, x, y, method="layerwise", sparse_embeddings=True
        ),
        "clipped_vectorized": clipped_vectorized,
    }
    spec = [tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(x.dtype)), tf.TensorSpec([None], tf.int32)]
    return tf.function(fns[name], input_signature=spec, jit_compile=jit_compile)


def wait_for(out) -> None:
    """Waits for ``out`` by reading one element of each tensor in it (of an IndexedSlices or PerExampleSlices, of each part).

    ``memoryview`` is TensorFlow's zero-copy view of a CPU tensor, and making
    it waits for the tensor. Not ``.numpy()``, which copies the whole tensor
    (655 MB for the embedding bag's per-example table at B=256), nor eager
    slicing ops, which cost ~0.6 ms per tensor on this 2-CPU machine (~4 ms on
    the MLP's 6 gradients, as much as its batch gradient at B=16); this costs
    ~0.02 ms in all, as JAX's ``block_until_ready`` copies nothing either.
    """
    import numpy as np
    import tensorflow as tf

    for t in tf.nest.flatten(out, expand_composites=True):
        np.asarray(memoryview(t)).flat[:1]


def not_run_because(model_name: str, q: str) -> str | None:
    """Why quantity ``q`` is not measured on ``model_name``, or None."""
    if q == "grads_layerwise_sparse" and model_name not in ("transformer", "embedding_bag"):
        return "no embedding table"
    if model_name == "transformer" and q == "clipped_vectorized":
        return "refused (pfor hazards in attention)"
    return None


def time_cell(model_name: str, b: int, repeats: int) -> dict:
    model, x, y = build(model_name, b)
    return time_round_robin(
        {q: quantity_fn(q, model, x) for q in QUANTITIES if not not_run_because(model_name, q)}, x, y, repeats
    )


def time_round_robin(fns: dict, x, y, repeats: int, inner: int = 3) -> dict:
    """Median seconds per call of each ``fns[q](x, y)``: two warm-up calls each, then
    ``repeats`` rounds of ``inner`` calls per function, the starting function rotating.

    Each function's last result is freed before its clock stops, so freeing a
    large result (the dense embedding-bag per-example table: 655 MB, tens of
    ms to unmap) is charged to the function that made it, not to the next one.
    """
    for fn in fns.values():  # trace and warm up
        wait_for(fn(x, y))
        wait_for(fn(x, y))
    times = {q: [] for q in fns}
    order = list(fns)
    for _ in range(repeats):
        order = order[1:] + order[:1]
        for q in order:
            start = time.perf_counter()
            for _ in range(inner):
                out = fns[q](x, y)
            wait_for(out)
            del out
            times[q].append((time.perf_counter() - start) / inner)
    return {q: statistics.median(v) for q, v in times.items()}


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


MEASURES = {  # --memory's measures: the environment of their fresh worker process
    "rss": {},
    "rss_mmap": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "tf": {"TF_CPU_ALLOCATOR_USE_BFC": "true"},
}


def memory_cell(model_name: str, b: int, q: str, measure: str = "rss") -> float:
    """MiB the step ``q`` needs at its peak: ``"rss"``/``"rss_mmap"`` (``peak_increment_mib``) or ``"tf"`` (``peak_allocated_mib``)."""
    model, x, y = build(model_name, b)
    fn = quantity_fn(q, model, x)
    return peak_allocated_mib(fn, x, y) if measure == "tf" else peak_increment_mib(fn, x, y)


def peak_allocated_mib(fn, x, y) -> float:
    """Median over 3 calls of ``fn(x, y)`` of TensorFlow's peak allocated bytes above those held before, in MiB.

    Exact for the process, unlike RSS: it counts tensors only, from the
    allocator's own statistics, which the CPU allocator keeps only as a BFC
    allocator (``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts; the
    ``--cell`` workers get it). A BFC pool keeps what it grew, so RSS is
    measured in other processes.
    """
    import tensorflow as tf

    wait_for(fn(x, y))
    peaks = []
    for _ in range(3):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        wait_for(fn(x, y))
        peaks.append((tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2**20)
    return statistics.median(peaks)


def peak_increment_mib(fn, x, y) -> float:
    """Median over 3 calls of ``fn(x, y)`` of the peak RSS above the RSS just before the call, in MiB.

    One warm-up call first (tracing); before each measured call malloc's free
    memory goes back to the OS and the kernel's high-water mark is reset.
    """
    wait_for(fn(x, y))
    peaks = []
    for _ in range(3):
        _release_free_memory()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = status_kib("VmRSS")
        wait_for(fn(x, y))
        peaks.append((status_kib("VmHWM") - before) / 1024)
    return statistics.median(peaks)


def _release_free_memory() -> None:
    """Returns memory malloc keeps after frees to the OS (glibc ``malloc_trim``), where available.

    Without it the next step reuses whatever an earlier one freed, and the
    peak increment measures the allocator's leftovers instead of the step.
    """
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _memory_worker(cell: str) -> float:
    """Runs ``--cell cell`` in a fresh process, in its measure's environment (``MEASURES``)."""
    env = dict(os.environ, **MEASURES[cell.rsplit(",", 1)[1]])
    out = subprocess.run(
        [sys.executable, __file__, "--cell", cell], capture_output=True, text=True, timeout=900, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["increment_mib"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--memory",
        action="store_true",
        help="also measure peak RSS and peak TensorFlow allocations per quantity in subprocesses",
    )
    p.add_argument("--out")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:  # memory worker: model,B,quantity,measure
        m, b, q, measure = args.cell.split(",")
        print(json.dumps({"increment_mib": memory_cell(m, int(b), q, measure)}))
        return 0
    import tensorflow as tf

    sizes = [16] if args.quick else [int(s) for s in args.batch_sizes.split(",")]
    repeats = 2 if args.quick else args.repeats
    models = args.models.split(",")
    lines = [
        f"command: python benchmarks/bench_layerwise.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        f"tensorflow {tf.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| model | B | quantity | median ms | ratio to batch_grad |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for m in models:
        for b in sizes:
            res = time_cell(m, b, repeats)
            for q in QUANTITIES:
                row = (
                    f"| {m} | {b} | {q} | {res[q] * 1e3:.2f} | {res[q] / res['batch_grad']:.2f} |"
                    if q in res
                    else f"| {m} | {b} | {q} | {not_run_because(m, q)} | |"
                )
                lines.append(row)
                print(row, flush=True)
    if args.memory:
        mem = [
            "",
            "| model | B | quantity | peak RSS increment MiB | ratio to batch_grad's | same, MALLOC_MMAP_THRESHOLD_=64K "
            "| ratio | peak TF allocations MiB | ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        print("\n".join(mem), flush=True)
        for m in models:
            for b in sizes:
                incs = {measure: {} for measure in MEASURES}
                for q in QUANTITIES:
                    if not_run_because(m, q):
                        continue
                    cells = []
                    for measure, inc in incs.items():
                        inc[q] = _memory_worker(f"{m},{b},{q},{measure}")
                        cells.append(f"{inc[q]:.1f} | {inc[q] / max(inc['batch_grad'], 1e-9):.2f}")
                    row = f"| {m} | {b} | {q} | {' | '.join(cells)} |"
                    mem.append(row)
                    print(row, flush=True)
        lines += mem
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
