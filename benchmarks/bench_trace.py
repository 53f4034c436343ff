"""Where a DP step's first call goes: traces, graph nodes per part, and the first step against Keras's.

    python benchmarks/bench_trace.py                                   # the zoo, MobileNetV2, GPT-2; SGD
    python benchmarks/bench_trace.py --models mlp,cnn --optimizer adam
    python benchmarks/bench_trace.py --models mobilenet_v2 --breakdown  # nodes per rule and per engine part

For each model (the shared zoo of ``per_example_grads.apps.zoo``, MobileNetV2
with its BatchNormalization made GroupNormalization by ``peg.dp.fix_model``,
and a small KerasHub GPT-2 built from its classes; the sizes of
``bench_dp_fit.LARGER``) and an expected batch of ``b`` rows:

- ``plain first step s``: Keras's ``fit`` on ``b`` rows, one step: from the
  first ``on_train_batch_begin`` to its ``on_train_batch_end``, so tracing
  plus one run of the step (what bench_dp_fit's first-step column reports),
  and in brackets the trace: the seconds Python spent in ``train_step``
  building the graph the first time (the rest is the graph's first run:
  TensorFlow's optimization of the graph, its kernels' creation and the
  step itself, and any second trace);
- ``dp first step s``: the same for ``DPModel.fit`` on one Poisson batch
  (``poisson_batches(..., steps=1)``);
- ``from the call s``: from just before the ``fit`` call (for DP, before
  the ``poisson_batches`` call) to the first step's end: what the user
  waits, with what ``fit`` does before its first batch (its data adapter;
  ``DPModel``'s creation of the optimizer's variables on symbolic inputs,
  which Keras does inside the first trace);
- ``first-step traces``: the Python calls of ``train_step`` by the end of
  the first ``fit`` (Keras traces a step twice when the optimizer creates
  its variables during the first trace, as Adam's moments are);
- ``traces``: how many times Python ran ``train_step`` over two ``fit``
  calls (the second on a new ``poisson_batches`` dataset of the same ``q``),
  then a third on another ``q``, reported as ``traces of the first two + those
  of the third`` (``1 + 1``: the second ``fit`` adds none; ``--no-trace-count``
  skips these fits, each retrace of a large model takes minutes);
- ``nodes``: the operations of the traced step (its graph and every function
  it calls, counted once each), for Keras's step and the DP step, and how
  many of the DP step's are ``Const``.

``--floor`` adds, for a model that is a chain of Dense layers (the MLP),
the first step of a DP-SGD step written by hand with nothing but DP-SGD's
own computation (per-example norms in closed form from each layer's input
and output gradient, clip factors, the clipped sum, one Gaussian draw per
variable, the optimizer's update; a fixed batch, no checks, no non-finite
handling, no ledger, no metrics): a floor for how small a DP step's graph,
and so its first step, can be.

``--grappler`` times TensorFlow's graph optimizer (Grappler, part of a
first step's first run) on the traced steps' graphs, offline
(``tf_optimizer.OptimizeGraph``, best of 2, no kernels created): with no
pass, with all of them, and with each pass alone, for Keras's step and the
DP step, with the nodes each leaves; and each graph's largest functions
(a ``tf.cond`` branch is one).

``--custom-loop`` instead times a custom loop's first DP step
(``tf.function(dp.train_step)`` on one batch of ``b`` rows: trace and one
run, which also records the weights' fingerprint in the step) against
Keras's first ``fit`` step, alternated, and counts its nodes.

``--breakdown`` traces the DP step once more with its parts instrumented and
prints the nodes each added: the capture (forward and backward with the
rules' taps), each rule class's ``squared_norms`` and ``weighted_sum``, the
aggregator's noise and release, and the rest. Configurations are timed in
turn, each model in a fresh ``tf.function`` (a first step cannot be
repeated on one model without measuring a cached trace), ``--repeats``
times on new copies, and the medians are reported.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_dp_fit import LARGER  # noqa: E402  (the same sizes as the epoch benchmark)

B = 64
MODELS = "mlp,cnn,transformer,embedding_bag,mobilenet_v2,gpt2_lm"


def _build(name: str, n: int):
    import keras

    import per_example_grads as peg
    from per_example_grads.apps import zoo

    _, config = LARGER.get(name, (None, {}))
    _, x, y = zoo.build(name, n, **config)

    def copy():
        m = zoo.build_model(name, **config)
        if any(isinstance(layer, keras.layers.BatchNormalization) for layer in m._flatten_layers()):
            m = peg.dp.fix_model(m)
        return m

    return copy, x, y


def _optimizer(kind: str):
    import keras

    return {"sgd": lambda: keras.optimizers.SGD(0.01), "adam": lambda: keras.optimizers.Adam(1e-3)}[kind]()


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class _Clock:
    def __init__(self):
        import keras

        marks = self.marks = {"called": time.perf_counter()}  # made just before the fit (and its dataset)

        class Clock(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                marks.setdefault("begin", time.perf_counter())

            def on_train_batch_end(self, batch, logs=None):
                marks.setdefault("end", time.perf_counter())

        self.callback = Clock()

    @property
    def seconds(self) -> float:
        return self.marks["end"] - self.marks["begin"]

    @property
    def since_call(self) -> float:
        """From just before the ``fit`` call (and, for DP, the ``poisson_batches`` call) to the first step's end."""
        return self.marks["end"] - self.marks["called"]


def _counting_train_step(model) -> list:
    """The seconds of each Python call of ``model.train_step`` (one per trace: building its graph), on the instance."""
    calls = []
    original = model.train_step

    def train_step(data):
        start = time.perf_counter()
        try:
            return original(data)
        finally:
            calls.append(time.perf_counter() - start)

    model.train_step = train_step
    return calls


def nodes(concrete) -> tuple[int, int]:
    """``(operations, Const operations)`` of a concrete function's graph and every function in its library."""
    graph_def = concrete.graph.as_graph_def()
    ops = [n.op for n in graph_def.node] + [n.op for f in graph_def.library.function for n in f.node_def]
    return len(ops), ops.count("Const")


def _step_concrete(model, data):
    """The train step traced once more, as Keras traces it (``tf.function`` of ``train_step``), without running."""
    import tensorflow as tf

    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), data)
    return tf.function(model.train_step, reduce_retracing=True).get_concrete_function(spec)


def plain_first_step(copy, x, y, b, optimizer, loss=True):
    """Keras's ``fit`` of one step on ``b`` rows of a ``copy()`` (``loss``: compiled with ``_loss()``)."""
    m = copy()
    m.compile(optimizer=_optimizer(optimizer), loss=_loss() if loss else None)
    traces = _counting_train_step(m)
    rows, labels = _rows(x, b), y[:b]
    clock = _Clock()
    m.fit(rows, labels, batch_size=b, epochs=1, verbose=0, callbacks=[clock.callback])
    return (clock.seconds, clock.since_call, traces[0], len(traces)), m


def _rows(x, b):
    import tensorflow as tf

    return tf.nest.map_structure(lambda t: t[:b], x)


def dp_first_step(copy, x, y, b, optimizer, method="auto", count_traces=True):
    import per_example_grads as peg

    n = len(y)
    dp = peg.keras.DPModel(copy(), l2_norm_clip=1.0, noise_multiplier=1.0, method=method, seed=0)
    dp.compile(optimizer=_optimizer(optimizer), loss=_loss())
    traces = _counting_train_step(dp)
    clock = _Clock()
    data = peg.dp.poisson_batches(x, y, sampling_probability=b / n, steps=1, seed=0)
    dp.fit(data, epochs=1, verbose=0, callbacks=[clock.callback])
    first = clock.seconds, clock.since_call, traces[0], len(traces)
    if not count_traces:
        return first, dp, None, data
    dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=b / n, steps=1, seed=1), epochs=1, verbose=0)
    same_q = len(traces)
    dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=b / (2 * n), steps=1, seed=2), epochs=1, verbose=0)
    return first, dp, (same_q, len(traces)), data


def dp_custom_loop_first_step(copy, x, y, b):
    """A custom loop's first DP step: ``tf.function(dp.train_step)`` on ``b`` rows, trace plus one run (s), and its nodes."""
    import tensorflow as tf

    import per_example_grads as peg

    dp = peg.keras.DPModel(copy(), l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)
    dp.compile(optimizer=_optimizer("sgd"), loss=_loss())
    batch = tf.nest.map_structure(tf.convert_to_tensor, (_rows(x, b), y[:b]))
    step = tf.function(dp.train_step)
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), step(batch))
    return time.perf_counter() - start, nodes(step.get_concrete_function(batch))[0]


def _floor_model(inner, clip: float = 1.0, noise_multiplier: float = 1.0):
    """``inner`` (a ``Sequential`` of Dense layers) with the hand-written DP-SGD ``train_step`` of ``--floor`` (module docstring).

    For Dense layer ``l`` with input rows ``a_n`` and output gradient rows
    ``g_n``: ``||dW_n||^2 + ||db_n||^2 = ||a_n||^2 ||g_n||^2 + ||g_n||^2``;
    ``c_n = min(1, C / ||grad_n||)``; the update's gradient is
    ``(sum_n c_n grad_n + N(0, (sigma C)^2)) / B``.
    """
    import keras
    import tensorflow as tf

    dense = inner.layers

    class FloorDP(keras.Model):
        def call(self, x):
            return inner(x)

        def noised_gradients(self, x, y, seed):
            """``(sum_n c_n grad_n + sigma C noise) / B`` per variable of ``variables_in_order``, and the mean loss."""
            with tf.GradientTape() as tape:
                h, inputs, outputs = x, [], []
                for layer in dense:
                    inputs.append(h)
                    outputs.append(tf.matmul(h, layer.kernel) + layer.bias)
                    h = layer.activation(outputs[-1])
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(y, tf.int32), h))
            output_grads = tape.gradient(loss, outputs)
            squared = tf.add_n(
                [
                    (tf.reduce_sum(tf.square(a), 1) + 1.0) * tf.reduce_sum(tf.square(g), 1)
                    for a, g in zip(inputs, output_grads)
                ]
            )
            factors = tf.minimum(1.0, clip * tf.math.rsqrt(squared + 1e-12))[:, None]
            batch = tf.cast(tf.shape(x)[0], tf.float32)
            grads = []
            for a, g in zip(inputs, output_grads):
                for summed in (tf.matmul(a, factors * g, transpose_a=True), tf.reduce_sum(factors * g, 0)):
                    noise = tf.random.stateless_normal(tf.shape(summed), seed + [0, len(grads)])
                    grads.append((summed + noise_multiplier * clip * noise) / batch)
            return grads, loss / batch

        @property
        def variables_in_order(self):
            return [v for layer in dense for v in (layer.kernel, layer.bias)]

        def train_step(self, data):
            x, y = data[:2]
            grads, loss = self.noised_gradients(x, y, tf.stack([tf.cast(self.optimizer.iterations, tf.int32), 0]))
            self.optimizer.apply(grads, self.variables_in_order)
            return {"loss": loss}

    return FloorDP()


def _dense_chain(model) -> bool:
    import keras

    return isinstance(model, keras.Sequential) and all(isinstance(layer, keras.layers.Dense) for layer in model.layers)


def check_floor(copy, x, y, b):
    """Raises unless the floor's noise-free gradients are the library's ``clipped_gradients / B`` (float32 rounding)."""
    import numpy as np
    import tensorflow as tf

    import per_example_grads as peg

    inner = copy()
    floor = _floor_model(inner, noise_multiplier=0.0)
    got, _ = floor.noised_gradients(_rows(x, b), y[:b], tf.constant([0, 0]))
    want = peg.clipped_gradients(inner, _loss(), _rows(x, b), y[:b], l2_norm_clip=1.0)
    for g, w, v in zip(got, want, floor.variables_in_order):
        w = np.asarray(w) / b
        # Float32 sums of at most B * 784 products: their rounding is within about (B + 784) eps32 = 5e-5
        # of the terms' magnitudes, which 1e-4 of the largest entry allows.
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4 * np.max(np.abs(w)), err_msg=v.path)


def floor_first_step(copy, x, y, b, optimizer):
    return plain_first_step(lambda: _floor_model(copy()), x, y, b, optimizer, loss=False)  # its step has its own loss


GRAPPLER_PASSES = (
    "layout_optimizer",
    "constant_folding",
    "shape_optimization",
    "remapping",
    "arithmetic_optimization",
    "dependency_optimization",
    "loop_optimization",
    "function_optimization",
    "implementation_selector",
    "pin_to_host_optimization",
)


def grappler_seconds(concrete, passes=GRAPPLER_PASSES) -> dict[str, tuple[float, int]]:
    """``{"none" | "all" | pass: (best seconds of 2, nodes after)}`` of Grappler on ``concrete``'s graph, offline."""
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import tf_optimizer

    graph = concrete.graph
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(add_shapes=True), graph=graph)
    fetch = meta.collection_def["train_op"].node_list.value  # what Grappler must keep: outputs and variable writes
    fetch.extend(t.name for t in concrete.outputs)
    fetch.extend(op.name for op in graph.get_operations() if op.type.startswith("Assign"))
    toggle = rewriter_config_pb2.RewriterConfig

    def config(only: str):
        c = config_pb2.ConfigProto()
        rewrite = c.graph_options.rewrite_options
        rewrite.min_graph_nodes = -1  # optimize graphs of any size
        for name in passes:
            setattr(rewrite, name, toggle.ON if only in (name, "all") else toggle.OFF)
        rewrite.disable_model_pruning = only != "all"
        return c

    out = {}
    for only in ("none", "all", *passes):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            optimized = tf_optimizer.OptimizeGraph(config(only), meta, graph_id=b"step")
            times.append(time.perf_counter() - start)
        out[only] = min(times), len(optimized.node) + sum(len(f.node_def) for f in optimized.library.function)
    return out


def largest_functions(concrete, count: int = 3) -> list[tuple[str, int]]:
    """The ``count`` largest functions of ``concrete``'s graph library, ``(name, nodes)``, and the outer graph's."""
    graph_def = concrete.graph.as_graph_def()
    sizes = sorted(((f.signature.name, len(f.node_def)) for f in graph_def.library.function), key=lambda x: -x[1])
    return [("outer graph", len(graph_def.node)), *sizes[:count]]


@contextlib.contextmanager
def _instrumented(counts: collections.Counter):
    """Within the block, ``counts[part]`` gains the graph operations each instrumented part creates."""
    import tensorflow as tf

    from per_example_grads.dp import aggregator
    from per_example_grads.engines import layerwise
    from per_example_grads.rules import rule as rule_module

    patches = []

    def wrap(owner, name, label):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            graph = tf.compat.v1.get_default_graph()
            before = len(graph.get_operations())
            try:
                return original(*args, **kwargs)
            finally:
                counts[label(args) if callable(label) else label] += len(graph.get_operations()) - before

        patches.append((owner, name, original))
        setattr(owner, name, counted)

    wrap(layerwise, "capture", "engine: capture (forward, backward, taps)")
    for rule_class in {type(r) for r in rule_module.RULES.values()}:
        for method in ("squared_norms", "shared_squared_norms", "weighted_sum"):
            if method in vars(rule_class):
                wrap(rule_class, method, f"rule {rule_class.__name__}.{method}")
    wrap(
        aggregator.DPAggregator,
        "clipped_sum",
        "aggregator: clipped_sum (its own ops; the engine's are in a function of their own)",
    )
    wrap(aggregator.DPAggregator, "release", "aggregator: release (noise, divide, ledger)")
    try:
        yield
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def run_custom_loop(models, b, repeats):
    """``--custom-loop``: Keras's first ``fit`` step against a custom loop's first DP step, alternated."""
    print(
        f"B = {b}, SGD; custom loop: tf.function(dp.train_step), median of {repeats}; `python {' '.join(sys.argv)}`\n"
    )
    print("| model | plain first step s | custom-loop DP first step s | ratio | custom-loop DP step nodes |")
    print("|---|---|---|---|---|", flush=True)
    for name in models:
        copy, x, y = _build(name, max(4 * b, 256))
        plain, custom = [], []
        for _ in range(repeats):
            plain.append(plain_first_step(copy, x, y, b, "sgd")[0][0])
            custom.append(dp_custom_loop_first_step(copy, x, y, b))
        p, (c, n) = statistics.median(plain), (statistics.median(col) for col in zip(*custom))
        print(f"| {name} | {p:.2f} | {c:.2f} | {c / p:.2f} | {n:g} |", flush=True)


def run(models, b, optimizer, repeats, breakdown, count_traces=True, floor=False, grappler=False):
    print(
        f"B = {b} (expected batch), {optimizer}; first step: trace plus one run, median of {repeats}; "
        f"`python {' '.join(sys.argv)}`\n"
    )
    print(
        "| model | plain first step s (trace) | dp first step s (trace) | dp / plain | plain, dp from the call s | "
        "dp / plain from the call | first-step traces plain, dp | traces (2 fits, then new q) | plain nodes | dp nodes | dp Const |"
        + (" floor first step s (trace) | floor / plain | floor nodes |" if floor else "")
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if floor else ""), flush=True)
    for name in models:
        copy, x, y = _build(name, max(4 * b, 256))
        plain, dp, hand = [], [], []  # per repeat: (first step s, from the call s, first trace s, traces)
        for _ in range(repeats):  # alternated, so load hits all alike
            first, plain_model = plain_first_step(copy, x, y, b, optimizer)
            plain.append(first)
            first, dp_model, traces, data = dp_first_step(copy, x, y, b, optimizer, count_traces=count_traces)
            dp.append(first)
            if floor and _dense_chain(plain_model):
                first, floor_model = floor_first_step(copy, x, y, b, optimizer)
                hand.append(first)
        steps = {
            "plain": _step_concrete(plain_model, (_rows(x, b), y[:b])),
            "dp": _step_concrete(dp_model, next(iter(data))),
        }
        (plain_nodes, _), (dp_nodes, dp_const) = nodes(steps["plain"]), nodes(steps["dp"])
        (p, pc, pt, pn), (d, dc, dt, dn) = ([statistics.median(col) for col in zip(*runs)] for runs in (plain, dp))
        print(
            f"| {name} | {p:.2f} ({pt:.2f}) | {d:.2f} ({dt:.2f}) | {d / p:.2f} | {pc:.2f}, {dc:.2f} | {dc / pc:.2f} | "
            f"{pn:g}, {dn:g} | {f'{traces[0]} + {traces[1] - traces[0]}' if traces else ''} | "
            f"{plain_nodes} | {dp_nodes} | {dp_const} |",
            end="",
        )
        if floor and hand:
            check_floor(copy, x, y, b)  # after the timings: its eager run would warm the floor's kernels
            f, _, ft, _ = (statistics.median(col) for col in zip(*hand))
            floor_nodes, _ = nodes(_step_concrete(floor_model, (_rows(x, b), y[:b])))
            print(f" {f:.2f} ({ft:.2f}) | {f / p:.2f} | {floor_nodes} |", end="")
        elif floor:
            print(" | | |", end="")
        print(flush=True)
        if grappler:
            found = {k: grappler_seconds(c) for k, c in steps.items()}
            none = {k: f["none"][0] for k, f in found.items()}
            for part in found["plain"]:
                (ps, pn), (ds, dn) = found["plain"][part], found["dp"][part]
                print(
                    f"|   {name} | grappler {part}: s above no pass (nodes after), plain | "
                    f"{ps - none['plain']:.2f} ({pn}) | dp | {ds - none['dp']:.2f} ({dn}) |"
                )
            for k, c in steps.items():
                print(f"|   {name} | {k} graph's largest functions (nodes) | {largest_functions(c)} |")
        if breakdown:
            counts = collections.Counter()
            with _instrumented(counts):
                _step_concrete(dp_model, next(iter(data)))
            for part, count in counts.most_common():
                print(f"|   {name} | {part} | {count} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--batch-size", type=int, default=B)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--floor", action="store_true", help="also the hand-written DP-SGD step (Dense chains only)")
    parser.add_argument("--grappler", action="store_true", help="time each Grappler pass offline on both steps' graphs")
    parser.add_argument(
        "--custom-loop",
        action="store_true",
        help="instead: Keras's first fit step against a custom loop's first DP step (tf.function(dp.train_step))",
    )
    parser.add_argument(
        "--no-trace-count",
        action="store_true",
        help="skip the two extra fits (each retrace of a large model is minutes)",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.custom_loop:
        return run_custom_loop(args.models.split(","), args.batch_size, args.repeats)
    run(
        args.models.split(","),
        args.batch_size,
        args.optimizer,
        args.repeats,
        args.breakdown,
        not args.no_trace_count,
        args.floor,
        args.grappler,
    )


if __name__ == "__main__":
    main()
