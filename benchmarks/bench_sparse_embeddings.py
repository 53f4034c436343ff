"""Sparse embedding noise against dense DP-SGD: epoch time, step memory, utility on Zipf-distributed ids.

    python benchmarks/bench_sparse_embeddings.py speed     # epochs, round-robin (~5 min on 2 CPUs)
    python benchmarks/bench_sparse_embeddings.py memory    # step memory, one process per configuration
    python benchmarks/bench_sparse_embeddings.py utility   # eps 1, 3, 8; 3 seeds (~10 min)

``speed``: for the zoo's embedding bag (20,000 x 32 table, 64 ids per
example) and a large bag (10^6 x 64 table, 64 ids per example), expected
batch 256, SGD: one plain Keras epoch (``fit(x, y, batch_size=256)``), one
``DPModel`` epoch on ``poisson_batches`` with dense noise, and one with
``sparse_embeddings=SparseEmbeddings()``, each on its own copy of the model.
Epochs are timed round-robin from ``on_epoch_begin`` to ``on_epoch_end``
(the first, tracing epoch untimed), ``--repeats`` ``fit`` calls of 2 epochs
each: the first epoch of a call pays the call's set-up (a Poisson dataset's
iterator: tf.data instantiates its functions), the second does not; medians
of each, and their ratio to the plain epoch. Then the steps alone, without
the fit loop: each configuration's compiled train function called on its own iterator (plain: batches of 256;
private: Poisson batches of the same q), ``--step-calls`` calls round-robin across
the configurations (so slow spells of a shared machine hit all of them),
medians. The share of CPU time the hypervisor took (steal, from
``/proc/stat``) during the run is printed: above a few percent the epochs
are noisy.

``memory``: the memory of one step. Each (model, configuration) in its own
process that builds only that model and runs ``--warmup`` steps (tracing,
optimizer state); then, for each of ``--windows`` windows of ``--steps``
steps, the peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` at the window's start) less the resident set at
its start; the median window is reported, with the rows the table's update
touched per step and the update's analytic size.

``utility``: a synthetic recommendation task. Items ``v < V = 20,000`` have
hidden scores ``s_v ~ N(0, 1)``; an example is 8 items drawn from a Zipf
law (``P(v) ~ (v + 1)^-1.1``, item 0 the most popular) and its label is
``1[mean s + N(0, 0.5^2) > 0]``. The model is an 8-dimensional embedding
averaged over the items and a logistic unit; 20,000 training examples,
expected batch 256, 5 epochs of Poisson batches, SGD(1.0); the noise
multiplier gives epsilon 1, 3 or 8 at delta = 1e-5 for those steps (RDP accountant). Reported
per epsilon and method: test accuracy (mean and spread over 3 seeds) and,
for the sparse runs, the fraction of the table's rows a step updated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_layerwise import status_kib  # noqa: E402  (the shared /proc/self/status reader)

MODELS = {"embedding_bag": (20_000, 32, 12_000), "large_bag": (1_000_000, 64, 2_560)}  # vocabulary, dim, examples
B, T = 256, 64


def _bag(vocab: int, dim: int):
    import keras

    return keras.Sequential(
        [
            keras.Input((T,), dtype="int32"),
            keras.layers.Embedding(vocab, dim),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )


def _data(vocab: int, n: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (n, T)).astype("int32"), rng.integers(0, 2, n)


class _EpochTimer:
    def __init__(self):
        import keras

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(s, epoch, logs=None):
                s.start = time.perf_counter()

            def on_epoch_end(s, epoch, logs=None):
                (self.later if epoch else self.first).append(time.perf_counter() - s.start)

        self.first: list[float] = []  # the first epoch of each fit call
        self.later: list[float] = []  # the epochs after it
        self.callback = Timer()


def configurations(name: str):
    """``{label: (fit(callback, epochs=1), one compiled step)}``, each on its own copy of the model (same initial weights).

    The step calls the train function the first ``fit`` built, on an
    iterator of its own; it trains outside ``fit``, so only after the epochs.
    """
    import keras
    import tensorflow as tf

    import per_example_grads as peg
    from per_example_grads.dp.sparse_embeddings import SparseEmbeddings

    vocab, dim, n = MODELS[name]
    x, y = _data(vocab, n)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    first = _bag(vocab, dim)
    out = {}

    def plain():
        m = _bag(vocab, dim)
        m.set_weights(first.get_weights())
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True).repeat()
        return (
            lambda cb, epochs=1: m.fit(x, y, batch_size=B, epochs=epochs, verbose=0, shuffle=False, callbacks=[cb]),
            _step(m, batches),
        )

    def private(sparse):
        m = _bag(vocab, dim)
        m.set_weights(first.get_weights())
        dp = peg.keras.DPModel(
            m, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0, sparse_embeddings=SparseEmbeddings() if sparse else None
        )
        dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        data = peg.dp.poisson_batches(x, y, sampling_probability=B / n, seed=0)
        more = peg.dp.poisson_batches(x, y, sampling_probability=B / n, steps=10**6, seed=1)
        return lambda cb, epochs=1: dp.fit(data, epochs=epochs, verbose=0, callbacks=[cb]), _step(dp, more)

    out["plain"] = plain()
    out["dp dense noise"] = private(False)
    out["dp sparse selection"] = private(True)
    return out


def _step(model, dataset):
    """One call of ``model``'s compiled train function on ``dataset`` (an iterator made at the first call), synced."""
    import tensorflow as tf

    state = {}

    def step():
        if "it" not in state:
            state["it"] = iter(dataset)
        tf.nest.map_structure(lambda t: t.numpy(), model.train_function(state["it"]))

    return step


def _cpu_times() -> tuple[int, int]:
    """``(all, steal)`` CPU time since boot, in clock ticks (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks[:8]), ticks[7]


def speed(args) -> None:
    for name in args.models.split(","):
        configs = configurations(name)
        steps = {k: [] for k in configs}
        start = _cpu_times()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for fit, _ in configs.values():  # tracing epoch, untimed
                fit(_EpochTimer().callback)
            timers = {k: _EpochTimer() for k in configs}
            for _ in range(args.repeats):
                for k, (fit, _) in configs.items():
                    fit(timers[k].callback, epochs=2)
            for _, step in configs.values():  # the step's own warm-up (a new iterator)
                step()
            for _ in range(args.step_calls):
                for k, (_, step) in configs.items():
                    t0 = time.perf_counter()
                    step()
                    steps[k].append(time.perf_counter() - t0)
        end = _cpu_times()
        steal = (end[1] - start[1]) / max(end[0] - start[0], 1)
        plain = [statistics.median(getattr(timers["plain"], e)) for e in ("first", "later")]
        plain_step = statistics.median(steps["plain"])
        print(
            f"\n{name} (vocabulary {MODELS[name][0]:,}, dim {MODELS[name][1]}, {MODELS[name][2]:,} examples, "
            f"expected batch {B}; {args.repeats} fit calls of 2 epochs, {args.step_calls} steps; medians; "
            f"CPU steal {steal:.1%})"
        )
        print(
            "| configuration | 1st epoch of a fit (s) | / plain | 2nd epoch (s) | / plain | step alone (ms) | / plain |"
        )
        print("|---|---|---|---|---|---|---|")
        for k, t in timers.items():
            first, later, med_step = statistics.median(t.first), statistics.median(t.later), statistics.median(steps[k])
            print(
                f"| {k} | {first:.3f} | {first / plain[0]:.2f}x | {later:.3f} | {later / plain[1]:.2f}x "
                f"| {med_step * 1e3:.2f} | {med_step / plain_step:.2f}x |"
            )


MODES = ("plain", "dp dense noise", "dp sparse selection")


def _memory_child(name: str, label: str, warmup: int, steps: int, windows: int) -> None:
    """Prints ``RESULT <median peak RSS growth over a window, MiB> <mean rows updated> <each window's> <median RSS at a window's start, MiB>``."""
    import gc

    import keras
    import numpy as np

    import per_example_grads as peg
    from per_example_grads.dp.sparse_embeddings import SparseEmbeddings

    vocab, dim, n = MODELS[name]
    x, y = _data(vocab, n)
    keras.utils.set_random_seed(0)
    m = _bag(vocab, dim)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if label == "plain":
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)

        def fit(k, callbacks=()):
            m.fit(x[: k * B], y[: k * B], batch_size=B, epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks))
    else:
        sparse = SparseEmbeddings() if label == "dp sparse selection" else None
        dp = peg.keras.DPModel(m, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0, sparse_embeddings=sparse)
        dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        first = [0]

        def fit(k, callbacks=()):
            data = peg.dp.poisson_batches(x, y, sampling_probability=B / n, steps=k, seed=0, first_step=first[0])
            first[0] += k
            dp.fit(data, epochs=1, verbose=0, callbacks=list(callbacks))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(warmup)  # builds, traces, allocates the optimizer's state
        growth, bases = [], []
        for _ in range(windows):
            gc.collect()
            base = status_kib("VmRSS")
            bases.append(base / 1024)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM, the peak resident set, to the current one
            fit(steps)
            growth.append((status_kib("VmHWM") - base) / 1024)
        rows = []

        class Rows(keras.callbacks.Callback):  # after the measurement: the copies would count in it
            def on_train_batch_begin(self, batch, logs=None):
                self.before = m.layers[0].embeddings.numpy()

            def on_train_batch_end(self, batch, logs=None):
                rows.append(int(np.any(m.layers[0].embeddings.numpy() != self.before, axis=1).sum()))

        fit(3, [Rows()])
    each = ",".join(f"{g:.1f}" for g in growth)
    print(f"RESULT {statistics.median(growth):.1f} {statistics.mean(rows):.0f} {each} {statistics.median(bases):.0f}")


def memory(args) -> None:
    """One process per (model, configuration): the peak RSS growth over ``--steps`` steps after ``--warmup`` steps.

    The children run with glibc's mmap threshold fixed at 64 KiB and trimming
    on, so that a step's buffers are returned to the system when freed
    instead of staying in the heap from the warm-up (where they would not show
    as growth). The update's analytic size: dense noise writes ``V D``
    float32; a plain step's embedding gradient is an ``IndexedSlices`` of the
    ``B T`` looked-up rows (``D`` float32 and one int index each); the sparse
    step's, of the selected rows ``S`` (the rows the step changed, counted
    over 3 further steps).
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    print(
        f"warm-up {args.warmup} steps, then the peak RSS growth over each of {args.windows} windows of {args.steps} "
        f"steps (median, and each window's); expected batch {B}, {T} ids per example"
    )
    print(
        "| model | configuration | resident at a window's start (MiB) | peak RSS growth in a window (MiB) "
        "| rows updated per step | update size (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        vocab, dim, _ = MODELS[name]
        for label in MODES:
            cmd = [
                sys.executable,
                __file__,
                "_memory",
                name,
                label,
                str(args.warmup),
                str(args.steps),
                str(args.windows),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            got = [l.split()[1:] for l in out.stdout.splitlines() if l.startswith("RESULT")]
            if not got:
                print(f"| {name} | {label} | failed: {out.stderr[-300:]} | | | |")
                continue
            growth, rows, each, base = float(got[0][0]), int(got[0][1]), got[0][2], got[0][3]
            if label == "dp dense noise":
                size = vocab * dim * 4
            elif label == "plain":
                size = B * T * (dim * 4 + 4)  # the looked-up rows, repeats included (int32 indices)
            else:
                size = rows * (dim * 4 + 8)  # the selected rows (int64 indices)
            print(
                f"| {name} ({vocab:,} x {dim}) | {label} | {base} | {growth:.1f} ({each}) | {rows:,} | {size / 2**20:.2f} |",
                flush=True,
            )


def _zipf_task(seed: int, vocab: int = 20_000, n: int = 20_000, n_test: int = 5_000, k: int = 8):
    import numpy as np

    rng = np.random.default_rng(seed)
    p = (np.arange(vocab) + 1.0) ** -1.1
    p /= p.sum()
    scores = rng.normal(size=vocab)
    ids = rng.choice(vocab, size=(n + n_test, k), p=p).astype("int32")
    y = (scores[ids].mean(axis=1) + 0.5 * rng.normal(size=n + n_test) > 0).astype("int32")
    return (ids[:n], y[:n]), (ids[n:], y[n:])


def _utility_run(eps: float, seed: int, settings, *, vocab=20_000, n=20_000, epochs=5, lr=1.0):
    """``(test accuracy, mean fraction of table rows a step updated)`` of one run (``settings`` None: dense noise)."""
    import keras
    import numpy as np

    import per_example_grads as peg

    q = B / n
    steps = epochs * round(1 / q)
    sigma = peg.dp.noise_multiplier_for_epsilon(eps, 1e-5, n, B, None, steps=steps, accountant="rdp")
    (x, y), (xt, yt) = _zipf_task(seed, vocab, n)
    keras.utils.set_random_seed(seed)
    net = keras.Sequential(
        [
            keras.Input((8,), dtype="int32"),
            keras.layers.Embedding(vocab, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=sigma, seed=seed, sparse_embeddings=settings)
    dp.compile(optimizer=keras.optimizers.SGD(lr), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    fractions = []

    class Rows(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.before = net.layers[0].embeddings.numpy()

        def on_train_batch_end(self, batch, logs=None):
            changed = np.any(net.layers[0].embeddings.numpy() != self.before, axis=1)
            fractions.append(changed.mean())

    data = peg.dp.poisson_batches(x, y[:, None].astype("float32"), sampling_probability=q, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp.fit(data, epochs=epochs, verbose=0, callbacks=[Rows()])
    pred = net.predict(xt, verbose=0, batch_size=1024)[:, 0] > 0
    return float(np.mean(pred == yt)), float(np.mean(fractions)), sigma


def _utility_table(methods: dict, epsilons, seeds: int) -> None:
    """Runs every ``{label: SparseEmbeddings or None}`` at every epsilon and seed; prints one table."""
    rows = {}
    for eps in epsilons:
        for seed in range(seeds):
            for label, settings in methods.items():
                acc, frac, sigma = _utility_run(eps, seed, settings)
                rows.setdefault((eps, label), []).append((acc, frac))
                print(
                    f"eps {eps} seed {seed} {label}: sigma {sigma:.3f} accuracy {acc:.4f} rows/step {frac:.4%}",
                    flush=True,
                )
    print(f"\n| epsilon | method | test accuracy (mean +- sd, {seeds} seeds) | table rows updated per step |")
    print("|---|---|---|---|")
    for (eps, label), runs in rows.items():
        accs = [a for a, _ in runs]
        fr = statistics.mean(f for _, f in runs)
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"| {eps:g} | {label} | {statistics.mean(accs):.4f} +- {sd:.4f} | {fr:.3%} |")


def utility(args) -> None:
    from per_example_grads.dp.sparse_embeddings import SparseEmbeddings

    methods = {"dense DP-SGD": None, "sparse selection": SparseEmbeddings()}
    _utility_table(methods, (1.0, 3.0, 8.0), args.seeds)


def grid(args) -> None:
    """The utility task over selection_share x false_positive_rate (and dense DP-SGD), for choosing the defaults."""
    from per_example_grads.dp.sparse_embeddings import SparseEmbeddings

    methods = {"dense DP-SGD": None}
    for f in (float(v) for v in args.shares.split(",")):
        for p0 in (float(v) for v in args.fprs.split(",")):
            methods[f"sparse f={f:g} p0={p0:g}"] = SparseEmbeddings(selection_share=f, false_positive_rate=p0)
    _utility_table(methods, [float(e) for e in args.epsilons.split(",")], args.seeds)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_memory":
        _memory_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["speed", "memory", "utility", "grid"])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-calls", type=int, default=100, help="speed: steps alone per configuration")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="memory: steps before the measurement")
    parser.add_argument("--steps", type=int, default=10, help="memory: steps per measured window")
    parser.add_argument("--windows", type=int, default=3, help="memory: measured windows (median reported)")
    parser.add_argument("--epsilons", default="1,3,8")
    parser.add_argument("--shares", default="0.1,0.3,0.5", help="grid: selection_share values")
    parser.add_argument("--fprs", default="1e-4,1e-3,1e-2", help="grid: false_positive_rate values")
    args = parser.parse_args()
    {"speed": speed, "memory": memory, "utility": utility, "grid": grid}[args.what](args)


if __name__ == "__main__":
    main()
