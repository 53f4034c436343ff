"""Shared harness for the peer benchmarks (standard library only).

Imported by ``peer_jax.py`` and ``peer_torch.py``, which each run in their own
virtualenv; this module must therefore stay free of third-party imports. It
never imports ``per_example_grads``, and the library never imports it.

What it provides: the command-line flags, the model/shape constants shared
with ``benchmarks/bench_engines.py``, the round-robin timer and the Markdown
report for a standalone run, and the worker loop (``--serve``, see
``serve``) through which ``benchmarks/bench_vs_peers.py`` times every
framework interleaved in one time window.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

# Shapes of the benchmark models (see benchmarks/bench_engines.py and README.md).
MODELS = ("mlp", "cnn", "transformer", "embbag", "small_cnn")
MODEL_DESCRIPTIONS = {
    "mlp": "Dense 784-512-512-10, relu",
    "cnn": "28x28x1 -> Conv 16 3x3 relu -> MaxPool 2 -> Conv 32 3x3 relu -> MaxPool 2 "
    "-> Flatten -> Dense 64 relu -> Dense 10",
    "transformer": "Embedding(1000, 64) over 32 tokens + learned positions -> MHA 4 heads "
    "(+residual, LayerNorm) -> FFN 128 relu -> 64 (+residual, LayerNorm) -> mean pool -> Dense 2",
    "embbag": "Embedding(20000, 32) over 64 tokens -> mean pool -> Dense 2",
    "small_cnn": "28x28x1 -> Conv 16 5x5 stride 2 relu -> Conv 32 3x3 stride 2 relu -> Flatten -> Dense 64 relu -> Dense 10",
}
N_CLASSES = {"mlp": 10, "cnn": 10, "transformer": 2, "embbag": 2, "small_cnn": 10}
TF_SEQ_LEN, TF_VOCAB, TF_DIM, TF_HEADS, TF_FFN = 32, 1000, 64, 4, 128
BAG_SEQ_LEN, BAG_VOCAB, BAG_DIM = 64, 20000, 32
CLIP_NORM = 1.0  # C in factor_i = C / max(||g_i||, C), as per_example_grads.clip_by_global_norm
LN_EPS = 1e-3  # Keras LayerNormalization's default epsilon

QUANTITIES = {
    "a": "(a) batch grad",
    "b": "(b) per-example grads",
    "c": "(c) per-example clip (C=1) + sum",
    "e": "(e) one DP epoch",
}
# (e): one epoch of training on EPOCH_N synthetic examples: DP-SGD with Poisson sampling of expected
# batch EPOCH_BATCH, noise multiplier EPOCH_SIGMA and clip CLIP_NORM, SGD; the plain epochs take
# batches of EPOCH_BATCH. A task's call returns the epoch's own seconds as a ``Seconds``.
EPOCH_N, EPOCH_BATCH, EPOCH_SIGMA, EPOCH_LR = 12_000, 256, 1.0, 0.01


class Seconds(float):
    """What a task returns when it times itself (an epoch, without its framework's per-call setup and teardown)."""


def make_data(model: str, b: int):
    """Inputs and integer labels; same generator and seed as bench_engines._make_data.

    Images are NHWC ``[B, 28, 28, 1]``; callers that want NCHW transpose them.
    """
    import numpy as np

    rng = np.random.default_rng(1)
    if model == "mlp":
        return rng.standard_normal((b, 784), "float32"), rng.integers(0, 10, b).astype("int32")
    if model in ("cnn", "small_cnn"):
        return (
            rng.standard_normal((b, 28, 28, 1), "float32"),
            rng.integers(0, 10, b).astype("int32"),
        )
    if model == "transformer":
        return (
            rng.integers(0, TF_VOCAB, (b, TF_SEQ_LEN)).astype("int32"),
            rng.integers(0, 2, b).astype("int32"),
        )
    if model == "embbag":
        return (
            rng.integers(0, BAG_VOCAB, (b, BAG_SEQ_LEN)).astype("int32"),
            rng.integers(0, 2, b).astype("int32"),
        )
    raise ValueError(f"unknown model {model!r}; choose from {MODELS}")


def parse_args(description: str, peers: tuple[str, ...]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", default=",".join(MODELS), help="comma list of %s" % ",".join(MODELS))
    p.add_argument("--batch-sizes", default=None, help="comma list (default 64,256; --quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per quantity (default 7; --quick: 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed full-size calls first (default 2; --quick: 1)")
    p.add_argument(
        "--max-seconds-per-call",
        type=float,
        default=60.0,
        help="a quantity whose single call takes longer stops being timed and is marked '> cap'",
    )
    p.add_argument("--peers", default=",".join(peers), help="comma list of %s" % ",".join(peers))
    p.add_argument(
        "--no-check", action="store_true", help="skip the check that per-example grads average to the batch grad"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="pin the process to this many CPUs before the framework starts (default 2)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: B=16, 2 repeats, 1 warm-up")
    p.add_argument("--out", default=None, help="also write the Markdown report to this file")
    p.add_argument(
        "--serve",
        action="store_true",
        help="worker for benchmarks/bench_vs_peers.py: JSON-line commands on stdin, answers on "
        "stdout (see serve()); of the other flags only --peers and --threads then apply",
    )
    a = p.parse_args()
    if a.serve:
        a.answers = claim_stdout()
    if a.quick:
        a.batch_sizes = a.batch_sizes or "16"
        a.repeats = a.repeats if a.repeats is not None else 2
        a.warmup = min(a.warmup, 1)
    a.batch_sizes = [int(s) for s in (a.batch_sizes or "64,256").split(",") if s]
    a.repeats = a.repeats if a.repeats is not None else 7
    a.models = [m for m in a.models.split(",") if m]
    for m in a.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {MODELS}")
    a.peers = [x for x in a.peers.split(",") if x]
    for x in a.peers:
        if x not in peers:
            p.error(f"unknown peer {x!r}; choose from {peers}")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    return a


@dataclass
class Task:
    """One timed callable: ``fn()`` runs one full call and returns only when its result exists."""

    peer: str
    quantity: str  # key of QUANTITIES
    fn: Callable[[], object]
    times: list = field(default_factory=list)
    first_s: float | None = None
    status: str = ""  # "" (ok), "> cap", "error: ..."


def call_task(t: Task, cap_s: float, log, enforce_cap: bool = True) -> float | None:
    """Seconds one call of ``t.fn`` took, or None if it raised (then ``t.status`` says why).

    A call longer than ``cap_s`` (when ``enforce_cap``) sets ``t.status`` to
    ``> cap``; the caller stops calling the task then. The result is freed
    before the clock stops, as every peer's is.
    """
    t0 = time.perf_counter()
    try:
        out = t.fn()
        own = float(out) if isinstance(out, Seconds) else None
        del out
    except Exception as e:  # noqa: BLE001 - reported in the table
        msg = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        t.status = f"error: {type(e).__name__}: {msg[:200]}"
        log(f"    {t.peer} {t.quantity}: {t.status}")
        return None
    dt = time.perf_counter() - t0 if own is None else own
    if dt > cap_s and enforce_cap:
        t.status = f"> cap ({dt:.0f} s for one call, cap {cap_s:.0f} s)"
        log(f"    {t.peer} {t.quantity}: {t.status}")
    return dt


def warm_up(t: Task, warmup: int, cap_s: float, log) -> None:
    """Make ``warmup`` untimed calls of ``t``, recording the first one's duration in ``t.first_s``.

    The first call may include one-time work (JAX compiles on it), so when
    there is a second warm-up call, that one decides the cap. Stops early once
    ``t.status`` is set.
    """
    for i in range(warmup):
        dt = call_task(t, cap_s, log, enforce_cap=not (i == 0 and warmup > 1))
        if dt is None:
            return
        if i == 0:
            t.first_s = dt
        if t.status:
            return


def run_round_robin(tasks: list[Task], repeats: int, warmup: int, cap_s: float, log) -> None:
    """Warm every task up, then time them interleaved, rotating the starting task each repeat.

    A call that raises marks its task ``error``; a call longer than ``cap_s``
    marks it ``> cap`` and it is not called again (the times it has are kept).
    The first warm-up call is exempt from the cap when ``warmup > 1``.
    """
    for t in tasks:
        warm_up(t, warmup, cap_s, log)
    live = [t for t in tasks if not t.status]
    for r in range(repeats):
        if not live:
            break
        k = r % len(live)
        for t in live[k:] + live[:k]:
            dt = call_task(t, cap_s, log)
            if dt is None:
                continue
            t.times.append(dt)
        live = [t for t in live if not t.status]


def quartiles(xs: list[float]) -> tuple[float, float]:
    """First and third quartiles of ``xs`` (both ``xs[0]`` for a single value)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def loadavg() -> str:
    """The 1-minute load average, formatted, or ``n/a``."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "n/a"


class Report:
    def __init__(self, title: str, versions: dict, args: argparse.Namespace):
        self.title = title
        self.versions = versions
        self.args = args
        self.rows: list[list[str]] = []
        self.notes: list[str] = []
        self.started = time.time()
        self.load_start = loadavg()

    def add(self, model: str, b: int, tasks: list[Task]) -> None:
        base = next((t for t in tasks if t.quantity == "a"), None)
        base_med = statistics.median(base.times) if base and base.times else None
        for t in tasks:
            label = QUANTITIES[t.quantity]
            if t.times:
                med = statistics.median(t.times)
                lo, hi = quartiles(t.times)
                med_s = f"{med * 1e3:.2f}"
                ratio = f"{med / base_med:.2f}" if base_med else "n/a"
                iqr = f"{lo * 1e3:.2f}-{hi * 1e3:.2f}"
                if t.status:
                    med_s += f" ({len(t.times)} runs)"
            else:
                med_s, ratio, iqr = "—", "—", "—"
            status = t.status or "ok"
            if t.first_s is not None:
                status += f"; first call {t.first_s * 1e3:.0f} ms"
            self.rows.append([t.peer, model, str(b), label, med_s, ratio, iqr, status])

    def note(self, text: str) -> None:
        self.notes.append(text)

    def render(self) -> str:
        a = self.args
        cmd = " ".join(shlex.quote(x) for x in [os.path.relpath(sys.executable)] + sys.argv)
        lines = [
            f"# {self.title}",
            "",
            f"- command: `{cmd}`",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- wall time of this run: {time.time() - self.started:.0f} s",
            f"- load average (1 min) at start {self.load_start}, at end {loadavg()} "
            "(other processes share the CPUs; compare ratios, not milliseconds)",
            f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
            f"os.cpu_count()={os.cpu_count()}",
            "- versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
            f"- batch sizes {a.batch_sizes}, {a.repeats} timed repeats (median), {a.warmup} warm-up "
            f"calls, cap {a.max_seconds_per_call:.0f} s per call",
            "- quantities: (a) gradient of the mean loss over the batch; (b) materialized per-example "
            "gradients `[B, *param.shape]`; (c) per-example clip to global L2 norm C=1 "
            "(factor C / max(norm, C)) then sum over the batch. Ratio = median / median of (a) "
            "from the same round-robin.",
            "",
        ]
        lines += markdown_table(
            ["peer", "model", "B", "quantity", "median ms", "ratio to (a)", "IQR ms", "status"], self.rows
        )
        return with_notes(lines, self.notes)

    def emit(self) -> None:
        text = self.render()
        sys.stdout.write("\n" + text)
        sys.stdout.flush()
        if self.args.out:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
            with open(self.args.out, "w") as f:
                f.write(text)
            print(f"[written to {self.args.out}]", file=sys.stderr)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def with_notes(lines: list[str], notes: list[str]) -> str:
    """``lines`` and a "Notes:" list under them (when there are notes), as one Markdown text."""
    if notes:
        lines = lines + ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def run(
    args: argparse.Namespace, title: str, versions: dict, notes: list[str], make_tasks: Callable[[str, int], tuple]
) -> int:
    """A peer script's main: serve a ``bench_vs_peers.py`` coordinator (``--serve``) or run standalone.

    ``notes`` (what the peer's numbers mean) go into the report or the hello answer.
    """
    log("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if args.serve:
        return serve(args, make_tasks, versions, notes)
    report = Report(title, versions, args)
    for n in notes:
        report.note(n)
    return run_standalone(args, report, make_tasks)


def run_standalone(args: argparse.Namespace, report: Report, make_tasks: Callable[[str, int], tuple]) -> int:
    """Time every (model, B) of ``args`` round-robin in this process, check it, and emit ``report``."""
    for model_name in args.models:
        for b in args.batch_sizes:
            log(f"== {model_name} B={b}")
            tasks, notes, check = make_tasks(model_name, b)
            run_round_robin(tasks, args.repeats, args.warmup, args.max_seconds_per_call, log)
            if not args.no_check:  # after timing: a first call (JAX's compile) is a warm-up call
                try:
                    notes += check()
                except Exception as e:  # noqa: BLE001 - reported, the timings stand
                    notes.append(f"{model_name} B={b}: correctness check raised {type(e).__name__}: {e}")
            report.add(model_name, b, tasks)
            for n in notes:
                if n not in report.notes:
                    report.note(n)
            del tasks
    report.emit()
    return 0


def pin_cpus(n: int) -> str:
    """Restrict this process (and the thread pools a framework creates later) to ``n`` CPUs.

    Call before importing the framework. Returns a description for the report.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return f"affinity not available; os.cpu_count()={os.cpu_count()}"
    if n > 0 and len(allowed) > n:
        os.sched_setaffinity(0, allowed[:n])
        return f"pinned to CPUs {allowed[:n]} of {len(allowed)}"
    return f"all {len(allowed)} allowed CPUs ({n} requested)"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- Worker mode (--serve) for benchmarks/bench_vs_peers.py ---------------------------------


def claim_stdout():
    """Keep the process's stdout for protocol answers only; return it as a line-buffered stream.

    File descriptor 1 and ``sys.stdout`` are pointed at stderr, so whatever a
    framework or library prints (from Python or C) lands in the log and never
    in the answers. Call before importing the framework.
    """
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


@dataclass
class Cell:
    """What a worker holds between commands: the built (model, B)'s warmed-up tasks and its check."""

    tasks: dict  # (peer, quantity) -> Task
    check: Callable[[], list]
    cap_s: float


def _build(cmd: dict, make_tasks: Callable[[str, int], tuple]) -> tuple[Cell, dict]:
    """Build the (model, B) of a ``build`` command, warm its requested quantities up; the cell and the answer."""
    log(f"== {cmd['model']} B={cmd['b']}")
    wants_epoch = "e" in cmd["quantities"]  # only scripts with (e) tasks take the keyword
    tasks, notes, check = (
        make_tasks(cmd["model"], cmd["b"], quantities=cmd["quantities"])
        if wants_epoch
        else make_tasks(cmd["model"], cmd["b"])
    )
    tasks = [t for t in tasks if t.quantity in cmd["quantities"]]
    for t in tasks:
        warm_up(t, cmd["warmup"], cmd["cap"], log)
    answer = {
        "tasks": [{"peer": t.peer, "quantity": t.quantity, "first_s": t.first_s, "status": t.status} for t in tasks],
        "notes": notes,
    }
    return Cell({(t.peer, t.quantity): t for t in tasks}, check, cmd["cap"]), answer


def _time_one(cmd: dict, cell: Cell | None) -> dict:
    """Answer to a ``time`` command: one call of the cell's (peer, quantity), in seconds."""
    if cell is None:
        raise RuntimeError("time before build")
    t = cell.tasks[(cmd["peer"], cmd["quantity"])]
    return {"seconds": call_task(t, cell.cap_s, log), "status": t.status}


def serve(args: argparse.Namespace, make_tasks: Callable[[str, int], tuple], versions: dict, notes: list[str]) -> int:
    """Answer JSON-line commands on stdin, one JSON line each on ``args.answers``, until ``quit`` or EOF.

    ``make_tasks(model, b) -> (tasks, notes, check)`` is the peer script's own.
    Commands and their answers (every answer also has ``"ok": true``, or is
    ``{"ok": false, "error": "..."}`` when the command raised):

    - ``{"cmd": "hello"}`` -> ``{"versions": {...}, "notes": [...]}``
    - ``{"cmd": "build", "model": m, "b": B, "quantities": ["a", "b"], "warmup": n, "cap": s}``:
      drop the previous cell, build this one and warm up its tasks of those
      quantities (``warm_up``) -> ``{"tasks": [{"peer", "quantity", "first_s",
      "status"}, ...], "notes": [...]}``
    - ``{"cmd": "time", "peer": p, "quantity": q}``: one call (``call_task``)
      -> ``{"seconds": s or null, "status": "" or why it stops}``
    - ``{"cmd": "check"}`` -> ``{"lines": [...]}`` (the script's correctness check)
    - ``{"cmd": "quit"}`` -> ``{}``, then the worker exits.

    Between commands the worker is blocked reading stdin, so it uses no CPU
    while other workers are timed. Logs go to stderr.
    """
    cell: Cell | None = None
    for line in iter(sys.stdin.readline, ""):
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "build":
                cell = None
                gc.collect()  # the previous cell's tensors (655 MB tables) go before new ones come
                cell, answer = _build(cmd, make_tasks)
            elif cmd["cmd"] == "time":
                answer = _time_one(cmd, cell)
            elif cmd["cmd"] == "check":
                answer = {"lines": cell.check() if cell else []}
            elif cmd["cmd"] == "hello":
                answer = {"versions": versions, "notes": notes}
            elif cmd["cmd"] == "quit":
                answer = {}
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
            answer["ok"] = True
        except Exception as e:  # noqa: BLE001 - answered; the coordinator reports it
            answer = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            log(f"  {cmd.get('cmd')}: {answer['error']}")
        args.answers.write(json.dumps(answer) + "\n")
        if cmd["cmd"] == "quit":
            break
    return 0
