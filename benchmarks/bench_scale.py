"""Time and memory of one DP step at a real model's size: GPT-2 base, BERT base, Llama 1B with LoRA, ViT-B/16,
ResNet-50; random weights.

    python benchmarks/bench_scale.py --cells 8x128 --quantities batch,norms,clipped --json scale.json
    python benchmarks/bench_scale.py --cells 8x128 --quantities batch,clipped --dynamic-batch
    python benchmarks/bench_scale.py --cells 2x512 --quantities batch,norms,clipped
    python benchmarks/bench_scale.py --model bert --cells 8x128 --quantities batch,clipped
    python benchmarks/bench_scale.py --model llama_1b_lora --cells 2x128 --quantities batch,clipped,plain_step,dp_step
    python benchmarks/bench_scale.py --model vit_b16 --cells 4x224 --quantities batch,norms,clipped,plain_step,dp_step
    python benchmarks/bench_scale.py --model resnet50 --cells 8x224
    PYTHONPATH=/path/to/another/checkout python benchmarks/bench_scale.py ...   # that library instead

Cells are ``BxT``: batch size x sequence length, or x image side for ViT-B/16 and ResNet-50 (whose
BatchNormalization is frozen, ``build``). Each (cell, quantity)
runs in its own fresh process, with TensorFlow's BFC CPU allocator
(``TF_CPU_ALLOCATOR_USE_BFC=true``, set for the child: the allocator keeps
byte statistics only then). The model is built by the shared zoo
(``per_example_grads.apps.zoo``, nothing downloaded; its position table is
``T`` long, not GPT-2's 1024). Quantities:

  batch       ``tape.gradient`` of the mean loss: the plain batch gradient
  norms       ``peg.per_example_norms`` (``method="auto"``)
  clipped     ``peg.clipped_gradients(l2_norm_clip=1.0)`` (``method="auto"``)
  plain_step  the Keras model's own ``train_on_batch`` (SGD, ``jit_compile=False``)
  dp_step     ``train_on_batch`` of ``peg.keras.DPModel(model, l2_norm_clip=1.0,
              noise_multiplier=1.0, num_examples=1000, expected_batch_size=B)``, same compile

The first three are ``tf.function``s of ``(x, y)``; with ``--dynamic-batch``
they are traced with an ``input_signature`` whose batch dimension is unknown
(the Keras steps trace as Keras does). Reported per quantity:

  first s   the first call: trace, optimization, run
  ops       the graph operations traced during the first call (every function
            graph, ``tf.cond`` branches included, as Python creates them; the
            trace and TensorFlow's optimization of the graph grow with them)
  median s  median of the later calls (at least 3)
  kept MiB  TensorFlow's allocated bytes after the first call (its result
            freed) minus before it: what the traced function holds
  peak MiB  ``bench_layerwise.peak_allocated_mib``: median over 3 calls of the
            peak allocated bytes above those held before the call
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_BASE = dict(num_layers=12, hidden_dim=768, intermediate_dim=3072)
MODELS = {  # name -> (zoo model, its settings, the setting a cell's second number gives)
    "gpt2": ("gpt2_lm", {**_BASE, "vocabulary_size": 50257}, "seq_len"),
    "bert": ("bert_classifier", {**_BASE, "vocabulary_size": 30522}, "seq_len"),
    # Llama 3.2 1B's shape (16 x 2048, 8192, 32 query and 8 key/value heads, 128256 tokens, tied embeddings),
    # random weights; KerasHub's enable_lora(rank=8) on its query and value projections, all else frozen
    "llama_1b_lora": (
        "llama_lm",
        dict(
            num_layers=16,
            hidden_dim=2048,
            intermediate_dim=8192,
            vocabulary_size=128256,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            lora_rank=8,
        ),
        "seq_len",
    ),
    "vit_b16": ("vit_classifier", {**_BASE, "patch_size": 16}, "image_size"),  # ViT-B/16, 10 classes
    "resnet50": ("resnet50", {}, "image_size"),  # keras.applications, 10 classes, BatchNormalization frozen
}
QUANTITIES = ("batch", "norms", "clipped", "plain_step", "dp_step")
_MIB = 2**20


def _allocated() -> int:
    import tensorflow as tf

    return tf.config.experimental.get_memory_info("CPU:0")["current"]


def _functions(model, x, y, dynamic: bool) -> dict:
    """``bench_models.quantities`` traced once each; with ``dynamic``, for any batch size."""
    import tensorflow as tf
    from bench_models import quantities

    trace = tf.function
    if dynamic:
        spec = lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype)  # noqa: E731
        signature = [tf.nest.map_structure(spec, x), tf.nest.map_structure(spec, y)]
        trace = lambda f: tf.function(f, input_signature=signature)  # noqa: E731
    fns = quantities(model, x, trace)
    return {"batch": fns["batch_grad"], "norms": fns["norms"], "clipped": fns["clipped"]}


def keras_step(model, q: str, b: int, physical_batch_size: int | None = None, optimizer: str = "sgd"):
    """``(x, y) -> logs`` for one ``train_on_batch`` of the model (``plain_step``) or of its DPModel (``dp_step``).

    SGD (or ``optimizer="adam"``), no XLA; the DPModel in chunks of ``physical_batch_size`` rows if given
    (``bench_memory_budget``).
    """
    import keras

    import per_example_grads as peg

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    net = model
    if q == "dp_step":
        net = peg.keras.DPModel(
            model, l2_norm_clip=1.0, noise_multiplier=1.0, num_examples=1000, expected_batch_size=b, seed=0,
            physical_batch_size=physical_batch_size,
        )  # fmt: skip
    # The plain model through keras.Model.compile itself: KerasHub's CausalLM.compile would add its accuracy metric
    compile_ = net.compile if q == "dp_step" else lambda **kw: keras.Model.compile(net, **kw)
    optimizers = {"sgd": lambda: keras.optimizers.SGD(0.01), "adam": lambda: keras.optimizers.Adam(1e-4)}
    compile_(optimizer=optimizers[optimizer](), loss=loss, jit_compile=False)
    return lambda x, y: net.train_on_batch(x, y, return_dict=True)


def build(model_name: str, b: int, t: int) -> tuple:
    """``(model, x, y)`` of ``MODELS[model_name]`` with ``b`` rows of length (or image side) ``t``, as tensors.

    BatchNormalization is frozen (``peg.dp.fix_model(batch_norm="freeze")``: inference mode, not trained), as
    when fine-tuning a pretrained convolutional network privately.
    """
    import keras
    import tensorflow as tf

    import per_example_grads as peg
    from per_example_grads.apps import zoo

    name, config, side = MODELS[model_name]
    model, x, y = zoo.build(name, b, **config, **{side: t})
    if any(isinstance(layer, keras.layers.BatchNormalization) for layer in model._flatten_layers()):
        model = peg.dp.fix_model(model, batch_norm="freeze")
        gc.collect()  # the unfixed model's weights, freed now rather than during the first measured call
    return model, tf.nest.map_structure(tf.convert_to_tensor, x), tf.convert_to_tensor(y)


def run_cell(model_name: str, b: int, t: int, q: str, dynamic: bool, repeats: int) -> dict:
    """One quantity at one cell, in this process: the row's numbers (module docstring)."""
    import warnings

    import numpy as np
    from bench_layerwise import peak_allocated_mib, wait_for

    import per_example_grads as peg

    model, x, y = build(model_name, b, t)
    size = lambda vs: sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in vs) / _MIB  # noqa: E731
    fn = keras_step(model, q, b) if q.endswith("_step") else _functions(model, x, y, dynamic)[q]

    times = []

    def timed(x, y):  # waits for the result and frees it (a Keras step's logs are Python floats already)
        start = time.perf_counter()
        out = fn(x, y)
        if not q.endswith("_step"):
            wait_for(out)
        del out
        times.append(time.perf_counter() - start)
        return []

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", peg.EngineFallbackWarning)
        before = _allocated()
        with _counting_ops() as ops:
            timed(x, y)
        kept = _allocated() - before
        first = times.pop()
        peak = peak_allocated_mib(timed, x, y)  # 4 calls: a warm-up and 3 measured
        while len(times) < repeats:
            wait_for(timed(x, y))
    fallbacks = sorted({str(w.message)[:80] for w in caught if issubclass(w.category, peg.EngineFallbackWarning)})
    return {
        "model": model_name,
        "b": b,
        "t": t,
        "quantity": q,
        "dynamic_batch": dynamic,
        "library": os.path.dirname(os.path.dirname(os.path.abspath(peg.__file__))),
        "weights_mib": size(model.weights),
        "params_mib": size(model.trainable_variables),
        "first_s": first,
        "ops_traced": ops[0],
        "median_s": statistics.median(times),
        "later_calls": len(times),
        "kept_mib": kept / _MIB,
        "peak_mib": peak,
        "fell_back": "; ".join(fallbacks) or "none",
    }


@contextlib.contextmanager
def _counting_ops():
    """``[n]``: the operations created in function graphs inside the block (a counter on ``FuncGraph``'s op creation)."""
    from tensorflow.python.framework import func_graph

    count, original = [0], func_graph.FuncGraph._create_op_internal

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    func_graph.FuncGraph._create_op_internal = counted
    try:
        yield count
    finally:
        func_graph.FuncGraph._create_op_internal = original


def _worker(model_name: str, b: int, t: int, q: str, dynamic: bool, repeats: int, timeout: float) -> dict:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true")
    cell = f"{model_name},{b},{t},{q},{int(dynamic)},{repeats}"
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--cell", cell], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"model": model_name, "b": b, "t": t, "quantity": q, "dynamic_batch": dynamic, "error": "timed out"}
    if out.returncode:
        error = out.stderr.strip().splitlines()[-1:] or ["no output"]
        print(out.stderr[-3000:], file=sys.stderr)
        return {"model": model_name, "b": b, "t": t, "quantity": q, "dynamic_batch": dynamic, "error": error[0][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(r: dict) -> str:
    cell = f"{r['model']} B={r['b']} T={r['t']}" + (" B unknown" if r["dynamic_batch"] else "")
    if "error" in r:
        return f"| {cell} | {r['quantity']} | {r['error']} | | | | | | |"
    return (
        f"| {cell} | {r['quantity']} | {r['weights_mib']:.0f} / {r['params_mib']:.1f} | {r['kept_mib']:.1f} | "
        f"{r['peak_mib']:.0f} | "
        f"{r['first_s']:.1f} | {r.get('ops_traced', '')} | {r['median_s']:.2f} | {r['fell_back']} |"
    )


def _plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    labels = [f"B={r['b']} T={r['t']}{' B?' if r['dynamic_batch'] else ''}\n{r['quantity']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows)), 4))
    at = range(len(rows))
    ax.bar([i - 0.2 for i in at], [r["peak_mib"] for r in rows], 0.4, label="peak MiB")
    ax.bar([i + 0.2 for i in at], [r["kept_mib"] for r in rows], 0.4, label="kept MiB")
    ax.set_xticks(list(at), labels, fontsize=7)
    ax.set_ylabel("MiB (TensorFlow allocator)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=list(MODELS))
    p.add_argument("--cells", default="8x128", help="comma list of BxT")
    p.add_argument("--quantities", default="batch,norms,clipped", help=f"comma list from {','.join(QUANTITIES)}")
    p.add_argument("--dynamic-batch", action="store_true", help="trace batch/norms/clipped for an unknown batch size")
    p.add_argument("--repeats", type=int, default=3, help="later calls timed, at least 3")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per (cell, quantity) process")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        model_name, b, t, q, dynamic, repeats = args.cell.split(",")
        print(json.dumps(run_cell(model_name, int(b), int(t), q, bool(int(dynamic)), int(repeats))))
        return 0
    quantities = args.quantities.split(",")
    unknown = [q for q in quantities if q not in QUANTITIES]
    if unknown:
        p.error(f"unknown quantities {unknown}; choose from {list(QUANTITIES)}")
    cells = [tuple(int(n) for n in c.split("x")) for c in args.cells.split(",")]
    import per_example_grads as peg

    print(f"command: python benchmarks/bench_scale.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"library: {peg.__file__}; {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC\n")
    print(
        "| cell | quantity | weights / trainable MiB | kept MiB | peak MiB | first call s | ops | median s "
        "| auto fell back |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for b, t in cells:
        for q in quantities:
            rows.append(_worker(args.model, b, t, q, args.dynamic_batch, max(3, args.repeats), args.timeout))
            print(_row(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.png:
        _plot(rows, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
