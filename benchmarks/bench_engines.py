"""Times every per-example-gradient engine against the plain batch gradient.

    python benchmarks/bench_engines.py                  # full run (15-20 minutes on 2 CPUs)
    python benchmarks/bench_engines.py --quick          # smoke run
    python benchmarks/bench_engines.py --models mlp --batch-sizes 64 --out t.md

For every (model, batch size) the script starts one worker subprocess per
method: the batch-gradient baseline, ``auto`` and every engine in
``per_example_grads.METHODS``. A worker is this script re-invoked with
``--cell model,method,B``: it builds the model (same seed everywhere, so the
same weights), wraps the call in a ``tf.function`` whose input signature has a
``None`` batch dimension, traces it on a batch of 2 and then serves calls on
the full batch when asked on stdin. The parent drives the workers round-robin,
one call at a time, rotating which method goes first in each repeat, so that
a burst of noise from other processes on the machine hits all methods alike.
Only one worker computes at any moment; the others wait.

Running each cell in its own process means a crash (``tf.vectorized_map`` has
crashed the process on Keras attention, depending on the CPU) only marks that cell
"crashed (signal N)". A call that takes longer than ``--max-seconds-per-cell``,
or a worker whose memory grows beyond ``--max-memory-gb``, is killed and its
cell marked "> cap". When the library refuses ``method="vectorized"`` for a
model, that cell times a raw ``tf.vectorized_map`` of a per-example tape
instead, labelled as such.

The library is imported from a copy of ``per_example_grads/`` taken when the
run starts (``--no-snapshot`` to import the live tree), so edits made to the
working tree during a long run cannot mix versions; the header records the git
revision and a digest of the sources measured.

Reported per cell: the median over ``--repeats`` timed calls (after
``--warmup`` untimed full-size calls), and its ratio to the median of the
batch gradient (``tape.gradient`` of the mean loss) from the same round-robin.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MODELS = ("mlp", "cnn", "transformer")
BASELINE = "batch_grad"
RAW_VECTORIZED_LABEL = "vectorized (raw tf.vectorized_map, refused by library)"
TRACE_BATCH = 2  # the batch the workers trace on (the signature's B is None)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "per_example_grads"


# --------------------------------------------------------------------------
# Worker side: one (model, method, B) cell in its own process.
# --------------------------------------------------------------------------


def _build_model(name: str):
    from per_example_grads.apps import zoo

    return zoo.build_model(name)


def _make_data(name: str, b: int):
    from per_example_grads.apps import zoo

    return zoo.build(name, b, seed=1)[1:]


def _input_signature(name: str):
    import tensorflow as tf

    x, y = _make_data(name, 1)
    return [tf.TensorSpec([None, *x.shape[1:]], x.dtype), tf.TensorSpec([None], y.dtype)]


def _make_callable(model_name: str, method: str, model, loss_fn):
    """The ``tf.function`` for one cell, and the label of its table row."""
    import tensorflow as tf

    import per_example_grads as peg

    signature = _input_signature(model_name)
    variables = model.trainable_variables

    if method == BASELINE:

        @tf.function(input_signature=signature)
        def fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, model(x, training=False)))
            return tape.gradient(loss, variables)

        return fn, "batch gradient (baseline)"

    if method == "raw_vectorized":

        @tf.function(input_signature=signature)
        def fn(x, y):
            def one(example):
                xi, yi = example
                with tf.GradientTape() as tape:
                    loss = loss_fn(yi[None], model(xi[None], training=False))[0]
                return tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)

            return tf.vectorized_map(one, (x, y))

        return fn, RAW_VECTORIZED_LABEL

    @tf.function(input_signature=signature)
    def fn(x, y):
        return peg.per_example_gradients(model, loss_fn, x, y, method=method)

    return fn, method


def _last_line(err: BaseException) -> str:
    """The line that says what went wrong (AutoGraph puts a traceback first)."""
    lines = [l.strip() for l in str(err).strip().splitlines() if l.strip()]
    return (lines[-1] if lines else type(err).__name__)[:300]


def _refusal(err: BaseException) -> str | None:
    """The library's reason for refusing a method on this model, if that is what ``err`` is."""
    if not isinstance(err, ValueError):
        return None
    lines = [l.strip() for l in str(err).splitlines() if "cannot run on this model" in l]
    lines = [l for l in lines if not l.startswith("raise ")]  # a quoted source line
    if not lines:
        return None
    return re.sub(r"^ValueError: ", "", lines[-1])[:400]


def _auto_choice(messages: list[str]) -> str:
    """Which engine ``auto`` ran, from its EngineFallbackWarning (if any)."""
    from per_example_grads.engines.selection import AUTO_ORDER

    for text in messages:
        match = re.search(r"used the '(\w+)' engine", text)
        if match:
            return match.group(1)
    return AUTO_ORDER[0]  # no fallback warning: auto used its first choice


def _source_digest(package_dir: str) -> str:
    """A short digest of every file of the package (to tell versions apart)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".pyc", ".pyo")):
                continue
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, package_dir).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


def run_worker(cell: str) -> int:
    """Serves one cell: setup and trace, then one call per stdin line until 'quit'."""
    # Keep the protocol channel clean: anything printed by TF/Keras goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**fields):
        proto.write(json.dumps(fields) + "\n")
        proto.flush()

    model_name, method, b = cell.split(",")
    b = int(b)
    t0 = time.perf_counter()
    import warnings

    import keras
    import tensorflow as tf

    import per_example_grads as peg

    info: dict = {"event": "ready", "model": model_name, "method": method, "batch": b}
    info["digest"] = _source_digest(os.path.dirname(peg.__file__))
    try:
        model = _build_model(model_name)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        x_np, y_np = _make_data(model_name, b)
        x, y = tf.constant(x_np), tf.constant(y_np)
        x_small, y_small = x[:TRACE_BATCH], y[:TRACE_BATCH]

        fn, label = _make_callable(model_name, method, model, loss_fn)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                tf.nest.flatten(fn(x_small, y_small))[-1].numpy()
            except ValueError as err:
                reason = _refusal(err)
                if reason is None:
                    raise
                info["refused"] = reason
                if method != "vectorized":
                    reply(**{**info, "event": "refused"})
                    return 0
                # The library refuses to vectorize this model; time what a raw
                # tf.vectorized_map of a per-example tape would cost instead.
                fn, label = _make_callable(model_name, "raw_vectorized", model, loss_fn)
                # Said first, so that a crash while tracing it is labelled right.
                reply(event="progress", refused=reason, label=label)
                tf.nest.flatten(fn(x_small, y_small))[-1].numpy()
    except Exception as err:  # noqa: BLE001 - reported in the table
        reply(**{**info, "event": "error", "error": f"{type(err).__name__}: {_last_line(err)}"})
        return 0
    fallback = [str(w.message) for w in caught if issubclass(w.category, peg.EngineFallbackWarning)]
    info["label"] = label
    if method == "auto":
        info["auto_picked"] = _auto_choice(fallback)
        info["auto_warning"] = fallback[0] if fallback else None
    info["setup_s"] = time.perf_counter() - t0
    reply(**info)

    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        start = time.perf_counter()
        out = fn(x, y)
        tf.nest.flatten(out)[-1].numpy()  # on CPU the call is synchronous; be sure anyway
        seconds = time.perf_counter() - start
        del out
        reply(event=command, seconds=seconds)
    return 0


# --------------------------------------------------------------------------
# Parent side: start workers, drive them round-robin, build the table.
# --------------------------------------------------------------------------


class Worker:
    """A cell's subprocess and a thread that forwards its protocol lines."""

    def __init__(self, model: str, method: str, b: int, log_dir: str):
        self.model, self.method, self.b = model, method, b
        self.log_path = os.path.join(log_dir, f"{model}-{method}-{b}.log")
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--cell", f"{model},{method},{b}"]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict = {}
        self.times: list[float] = []
        self.status: str | None = None  # None while alive and fine
        self.error: str | None = None
        self.peak_rss_gb = 0.0

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def rss_gb(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 2**20
        except OSError:
            pass
        return 0.0

    def send(self, command: str) -> bool:
        """Asks for one call; False (with ``self.status`` set) if the worker is gone."""
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            return True
        except OSError:  # BrokenPipeError: it died while idle
            self._mark_dead()
            return False

    def receive(self, timeout: float, max_memory_gb: float) -> dict | None:
        """The next reply; None (with ``self.status`` set) on timeout, memory cap or death."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:  # the worker's stdout closed: it died
                self._mark_dead()
                return None
            if line:
                return json.loads(line)
            rss = self.rss_gb()
            self.peak_rss_gb = max(self.peak_rss_gb, rss)
            if rss > max_memory_gb:
                self.kill(f"> memory cap ({max_memory_gb:g} GB)")
                return None
            if time.monotonic() > deadline:
                self.kill(f"> cap ({timeout:g} s)")
                return None

    def _mark_dead(self):
        rc = self.proc.wait()
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = "?"
            self.status = f"crashed (signal {-rc}, {name})"
        else:
            self.status = f"failed (exit code {rc})"
            errors = [
                l.strip() for l in self.log_tail(40).splitlines() if re.match(r"\w+(Error|Exception)\b", l.strip())
            ]
            if errors:
                self.error = errors[-1][:300]

    def kill(self, status: str):
        self.status = status
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by pid
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def log_tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def pfor_fallbacks(self) -> list[str]:
        """Ops that tf.vectorized_map / pfor ran in a while loop (from the worker's log)."""
        try:
            with open(self.log_path) as f:
                text = f.read()
        except OSError:
            return []
        found = re.findall(r"while_loop for converting (\w+)", text)
        found += re.findall(r"WARNING:tensorflow:(\w+) uses a while_loop", text)
        return sorted(set(found))


def _median(values):
    return statistics.median(values)


def _quartiles(values):
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def run_group(model: str, b: int, methods: list[str], args, log_dir: str, digest: str) -> list[Worker]:
    say = lambda msg: print(f"[{model} B={b}] {msg}", file=sys.stderr, flush=True)
    workers = [Worker(model, m, b, log_dir) for m in methods]
    setup_timeout = max(args.max_seconds_per_cell, 300.0)
    for w in workers:
        info = w.receive(setup_timeout, args.max_memory_gb)
        while info is not None and info.get("event") == "progress":
            w.info.update(info)  # e.g. the raw tf.vectorized_map label, before its trace
            info = w.receive(setup_timeout, args.max_memory_gb)
        if info is None:
            say(f"{w.method}: setup {w.status}\n{w.log_tail()}")
            continue
        w.info = info
        if info.get("digest") != digest:
            say(f"{w.method}: WARNING: imported library sources {info.get('digest')} != {digest}")
        if info["event"] == "refused":
            w.status, w.error = "refused by library", info["refused"]
            say(f"{w.method}: refused by the library: {info['refused']}")
        elif info["event"] == "error":
            w.status, w.error = "error", info["error"]
            say(f"{w.method}: error while tracing: {info['error']}")
        else:
            say(
                f"{w.method}: traced in {info['setup_s']:.1f} s"
                + (f" (auto picked {info['auto_picked']})" if "auto_picked" in info else "")
                + (" (library refused; timing raw tf.vectorized_map)" if "refused" in info else "")
            )
    # Untimed full-size calls (allocations, caches, thread pools), under the cap.
    for _ in range(args.warmup):
        for w in workers:
            if w.status is None:
                sent = w.send("warm")
                reply = w.receive(args.max_seconds_per_cell, args.max_memory_gb) if sent else None
                if reply is None:
                    tail = "\n" + w.log_tail(5) if w.status.startswith("crashed") else ""
                    say(f"{w.method}: warm-up {w.status}{tail}")
                else:
                    w.info.setdefault("first_call_s", reply["seconds"])
                    if reply["seconds"] > args.max_seconds_per_cell:
                        w.kill(f"> cap ({args.max_seconds_per_cell:g} s)")
                        say(f"{w.method}: warm-up {w.status}")
    for r in range(args.repeats):
        alive = [w for w in workers if w.status is None]
        if not alive:
            break
        k = r % len(alive)
        for w in alive[k:] + alive[:k]:  # rotate who goes first
            sent = w.send("time")
            reply = w.receive(args.max_seconds_per_cell, args.max_memory_gb) if sent else None
            if reply is None:
                say(f"{w.method}: repeat {r + 1} {w.status}")
                continue
            if reply["seconds"] > args.max_seconds_per_cell:  # finished, but past the cap
                w.kill(f"> cap ({args.max_seconds_per_cell:g} s)")
                say(f"{w.method}: repeat {r + 1} {w.status}")
                continue
            w.times.append(reply["seconds"])
        say(
            f"repeat {r + 1}/{args.repeats}: "
            + ", ".join(f"{w.method}={w.times[-1] * 1e3:.1f}ms" for w in alive if w.times and w.status is None)
        )
    for w in workers:
        w.close()
    return workers


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def build_table(results: dict) -> str:
    lines = [
        "| model | B | method | median ms | ratio to batch grad | IQR ms | runs | notes |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    summary = []
    for (model, b), workers in results.items():
        by_method = {w.method: w for w in workers}
        base = by_method.get(BASELINE)
        base_med = _median(base.times) if base and base.times and base.status is None else None
        stats = {}
        for w in workers:
            label = w.info.get("label", w.method)
            if w.method == "auto" and "auto_picked" in w.info:
                label = f"auto (→ {w.info['auto_picked']})"
            notes = []
            if w.status is not None and w.times:
                notes.append(f"{len(w.times)} runs before that")
            if "first_call_s" in w.info:
                notes.append(f"first call {_fmt_ms(w.info['first_call_s'])} ms")
            fallbacks = w.pfor_fallbacks()
            if fallbacks:
                notes.append("pfor while_loop fallback for " + ", ".join(fallbacks))
            if w.status is None and w.times:
                med = _median(w.times)
                q1, q3 = _quartiles(w.times)
                stats[w.method] = (med, q1, q3)
                med_s = _fmt_ms(med)
                ratio = f"{med / base_med:.2f}" if base_med else "n/a"
                iqr = f"{_fmt_ms(q1)}–{_fmt_ms(q3)}"
            else:
                med_s, ratio, iqr = w.status or "no data", "—", "—"
                if w.error and w.status != "refused by library":
                    notes.append(w.error.replace("|", "\\|"))
                if w.status == "refused by library":
                    notes.append("reason below")
            if w.method == BASELINE:
                ratio = "1.00" if base_med else "n/a"
            lines.append(
                f"| {model} | {b} | {label} | {med_s} | {ratio} | {iqr} | {len(w.times)} | {'; '.join(notes)} |"
            )

        # The per-group summary: auto vs the fastest library engine.
        auto = by_method.get("auto")
        raw_vec = by_method.get("vectorized") is not None and "refused" in by_method["vectorized"].info
        library = {m: s for m, s in stats.items() if m not in (BASELINE, "auto")}
        if raw_vec:
            library.pop("vectorized", None)  # that row is raw tf.vectorized_map, not the library
        ranking = " < ".join(f"`{m}` {_fmt_ms(library[m][0])}" for m in sorted(library, key=lambda m: library[m][0]))
        head = f"- {model} B={b}:"
        if auto is not None:
            picked = auto.info.get("auto_picked", "?")
            if "auto" in stats and library:
                fastest = min(library, key=lambda m: library[m][0])
                a_med, a_q1, _ = stats["auto"]
                f_med, _, f_q3 = library[fastest]
                a_q3, f_q1 = stats["auto"][2], library[fastest][1]
                f_txt = f"`{fastest}` ({_fmt_ms(f_med)} ms)"
                if picked == fastest:
                    verdict = f"the fastest library engine; its own row: {f_txt}"
                    if not (a_q1 <= f_q3 and f_q1 <= a_q3):
                        verdict += ", apart by more than the IQRs: noise"
                elif a_q1 <= f_q3 and f_q1 <= a_q3:
                    verdict = f"within noise of the fastest library engine {f_txt}"
                elif a_med > f_med:
                    verdict = f"{a_med / f_med:.2f}x the time of the fastest library engine {f_txt}"
                else:
                    verdict = f"faster than every timed library engine (fastest: {f_txt})"
                head += f" auto picked `{picked}` ({_fmt_ms(a_med)} ms): {verdict}."
            else:
                head += f" auto picked `{picked}`; nothing to compare (auto: {auto.status})."
        summary.append(head)
        if ranking:
            summary.append(f"  - library engines, median ms: {ranking}")
        for w in workers:
            if "refused" in w.info:
                summary.append(f"  - library refused `{w.method}`: {w.info['refused']}")
        if raw_vec:
            raw = by_method["vectorized"]
            what = f"{_fmt_ms(stats['vectorized'][0])} ms" if "vectorized" in stats else raw.status
            summary.append(f"  - raw tf.vectorized_map on this model (not offered by the library): {what}")
        if auto is not None and auto.info.get("auto_warning"):
            summary.append(f"  - auto's EngineFallbackWarning: {auto.info['auto_warning']}")
    lines += [
        "",
        'Auto vs the fastest library engine ("within noise": the interquartile ranges of the two overlap):',
        "",
    ]
    lines += summary
    return "\n".join(lines) + "\n"


def _git(*args) -> str:
    try:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def environment_header(args, digest: str) -> list[str]:
    import keras
    import tensorflow as tf

    import per_example_grads as peg

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    command = shlex.join([os.path.relpath(sys.executable), sys.argv[0], *sys.argv[1:]])
    head = _git("log", "-1", "--format=%h %cd", "--date=format:%Y-%m-%d %H:%M")
    changed = [l for l in _git("status", "--porcelain", "--", PACKAGE).splitlines() if l.strip()]
    tree = f"{len(changed)} uncommitted changes under {PACKAGE}/" if changed else "clean"
    source = "a snapshot copied at the start of the run" if args.snapshot else "the live working tree"
    return [
        "# per_example_grads engine benchmark",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')}",
        f"- library: {PACKAGE} {peg.__version__}, git {head or '?'} ({tree}), source digest "
        f"{digest}, imported from {source}; methods: {', '.join(peg.METHODS)}",
        f"- TensorFlow {tf.__version__}, Keras {keras.__version__}, Python "
        f"{platform.python_version()}, {platform.platform()}",
        f"- CPUs: os.cpu_count()={os.cpu_count()}, usable={usable}; "
        f"GPUs visible to TF: {len(tf.config.list_physical_devices('GPU'))}",
        f"- repeats={args.repeats} (median reported, after {args.warmup} untimed warm-up calls; "
        "methods interleaved round-robin, one worker process per cell), "
        f"cap={args.max_seconds_per_cell:g} s per call, memory cap={args.max_memory_gb:g} GB per worker; "
        "loss: SparseCategoricalCrossentropy(from_logits=True, reduction=None); "
        "every call in a tf.function with a None batch dimension",
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list of mlp,cnn,transformer")
    p.add_argument("--batch-sizes", default=None, help="comma list (default 64,256; --quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per cell (default 7; --quick: 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed full-size calls per cell first (default 2)")
    p.add_argument(
        "--max-seconds-per-cell",
        type=float,
        default=None,
        help="kill a cell when one call exceeds this (default 60; --quick: 20)",
    )
    p.add_argument(
        "--max-memory-gb", type=float, default=8.0, help="kill a worker whose resident memory exceeds this (default 8)"
    )
    p.add_argument(
        "--methods", default=None, help="comma list of methods besides the baseline (default: every peg.METHODS)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: B=16, 3 repeats, 20 s cap")
    p.add_argument("--out", default=None, help="also write the Markdown report to this file")
    p.add_argument("--keep-logs", default=None, help="keep each worker's stderr in this directory")
    p.add_argument(
        "--no-snapshot",
        dest="snapshot",
        action="store_false",
        help="import the live per_example_grads tree instead of a copy taken at start",
    )
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # worker mode: model,method,B
    args = p.parse_args(argv)

    if args.cell:
        return run_worker(args.cell)

    args.batch_sizes = args.batch_sizes or ("16" if args.quick else "64,256")
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.max_seconds_per_cell = args.max_seconds_per_cell or (20.0 if args.quick else 60.0)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad:
        p.error(f"unknown models {bad}; choose from {list(MODELS)}")
    batch_sizes = [int(s) for s in args.batch_sizes.split(",")]

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    tmp = tempfile.mkdtemp(prefix="bench_engines_")
    try:
        package_dir = os.path.join(REPO, PACKAGE)
        if args.snapshot:
            snap = os.path.join(tmp, "snapshot")
            shutil.copytree(
                package_dir, os.path.join(snap, PACKAGE), ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
            package_dir = os.path.join(snap, PACKAGE)
            sys.path.insert(0, snap)  # before the editable install's finder
            os.environ["PYTHONPATH"] = os.pathsep.join([snap, *filter(None, [os.environ.get("PYTHONPATH")])])
        digest = _source_digest(package_dir)

        import per_example_grads as peg
        from per_example_grads.engines.selection import AUTO_ORDER

        engines = [m for m in AUTO_ORDER if m in peg.METHODS]
        engines += [m for m in peg.METHODS if m not in engines and m != "auto"]
        default_methods = ["auto", *engines]
        methods = default_methods if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in methods if m not in peg.METHODS]
        if bad:
            p.error(f"unknown methods {bad}; choose from {list(peg.METHODS)}")

        header = environment_header(args, digest)
        print("\n".join(header), flush=True)

        log_dir = args.keep_logs or os.path.join(tmp, "logs")
        os.makedirs(log_dir, exist_ok=True)
        results = {}
        for model in models:
            for b in batch_sizes:
                results[(model, b)] = run_group(model, b, [BASELINE, *methods], args, log_dir, digest)

        table = build_table(results)
        print()
        print(table, end="", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(header) + "\n\n" + table)
            print(f"\nwritten to {args.out}", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
