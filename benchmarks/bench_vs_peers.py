"""Head-to-head: our layer-wise engine and every installed peer, timed interleaved in one time window.

    python benchmarks/bench_vs_peers.py --out /tmp/vs_peers.md   # 4 models x B=64,256, 7 rounds
    python benchmarks/bench_vs_peers.py --quick                  # smoke: B=16, 2 rounds
    python benchmarks/bench_vs_peers.py --models cnn --batch-sizes 64 --repeats 3

Standard library only; any python 3.9+ runs it. It starts one worker process
per framework whose virtualenv exists (``--serve`` of
``benchmarks/peers/peer_<framework>.py``): ``tf`` (ours, from ``.venv``),
``jax`` (``benchmarks/peers/.venv-jax``), ``torch`` (torch.func and Opacus,
``benchmarks/peers/.venv-torch``); a missing one is skipped with a message.
For every (model, B) each worker builds the cell and warms it up, then for
``--repeats`` rounds every (peer, quantity) is timed once, quantity by
quantity, the starting worker rotating every round. Workers wait on their
stdin while another is timed, so all frameworks share one time window and
the same machine load, and their milliseconds can be compared directly.
Each time is measured inside its worker, around one call.

Reported per cell: median ms, IQR, ratio to the framework's own (a), and
per quantity "ours / fastest peer" (our median over the fastest other
peer's; < 1 means ours is faster). See ``benchmarks/peers/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "peers"))
import _common as C  # noqa: E402  (stdlib-only harness of the peer scripts)

OURS = "tf"
NOT_PRIVATE = "(not private)"  # in the peer label of (e)'s plain epochs
PARAMS_NOTE = re.compile(r"^(\w+): ([\d,]+) parameters")  # the "<model>: N parameters (...)" notes of make_tasks


@dataclass(frozen=True)
class Framework:
    """A framework's worker: its name, the python of its virtualenv, its peer script, how to install it."""

    name: str
    python: str  # relative to REPO
    script: str  # relative to REPO
    install: str


FRAMEWORKS = (
    Framework("tf", ".venv/bin/python", "benchmarks/peers/peer_tf.py", "the project's own .venv"),
    Framework(
        "jax",
        "benchmarks/peers/.venv-jax/bin/python",
        "benchmarks/peers/peer_jax.py",
        "bash benchmarks/peers/setup_peers.sh jax",
    ),
    Framework(
        "torch",
        "benchmarks/peers/.venv-torch/bin/python",
        "benchmarks/peers/peer_torch.py",
        "bash benchmarks/peers/setup_peers.sh torch",
    ),
)


class WorkerError(RuntimeError):
    """A worker answered a command with an error."""


class WorkerDied(WorkerError):
    """A worker exited, broke its pipe, or gave no answer in time (it has been killed)."""


class Worker:
    """One framework's ``--serve`` process; a thread reads its answer lines into a queue."""

    def __init__(self, fw: Framework, timeout_s: float):
        self.fw = fw
        self.timeout_s = timeout_s
        self.dead = ""  # why it is no longer usable, once it is not
        self.versions: dict = {}
        self.notes: list[str] = []
        C.log(f"[{fw.name}] starting {fw.python} {fw.script} --serve")
        self.proc = subprocess.Popen(
            [os.path.join(REPO, fw.python), os.path.join(REPO, fw.script), "--serve"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.answers.put(line)
        self.answers.put(None)  # EOF: the process is gone

    def hello(self) -> None:
        """Wait until the framework is imported; keep its versions and general notes."""
        answer = self.ask({"cmd": "hello"})
        self.versions, self.notes = answer["versions"], answer["notes"]

    def ask(self, cmd: dict) -> dict:
        """Send ``cmd`` and return the answer; WorkerError if it failed, WorkerDied if none came."""
        if self.dead:
            raise WorkerDied(self.dead)
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            line = self.answers.get(timeout=self.timeout_s)
        except (BrokenPipeError, OSError) as e:
            self._die(f"pipe broke ({e})")
        except queue.Empty:
            self._die(f"no answer to {cmd['cmd']!r} within {self.timeout_s:.0f} s")
        if line is None:
            self._die(f"exited with code {self.proc.wait()} during {cmd['cmd']!r}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise WorkerError(answer["error"])
        return answer

    def _die(self, why: str) -> NoReturn:
        """Kill the process, remember why, raise WorkerDied."""
        self.dead = why
        self.proc.kill()
        self.proc.wait()
        raise WorkerDied(why)

    def close(self) -> None:
        """Ask the worker to quit; kill it if it has not exited within a few seconds."""
        if self.proc.poll() is None and not self.dead:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Timing:
    """One (framework, peer, quantity) of a cell: its timed seconds, first-call seconds and status."""

    framework: str
    peer: str
    quantity: str
    first_s: float | None = None
    status: str = ""  # "" (ok), "> cap ...", "error: ...", "worker died: ..."
    times: list = field(default_factory=list)

    def median(self) -> float | None:
        """Median of the timed seconds, None if there are none."""
        return statistics.median(self.times) if self.times else None


class Report:
    """The Markdown report: run facts, per-quantity summary of ours vs the fastest peer, all timings, notes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.time()
        self.load_start = C.loadavg()
        self.versions: dict[str, dict] = {}  # framework -> versions
        self.summary: list[list[str]] = []
        self.rows: list[list[str]] = []
        self.epochs: list[tuple[str, dict]] = []  # (model, {peer: median s}) of (e)
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        """Add a note under the tables, once."""
        if text not in self.notes:
            self.notes.append(text)

    def add_cell(self, model: str, b: int, timings: list[Timing]) -> None:
        """Rows for one (model, B): every timing, and per quantity ours against the fastest peer."""
        base = {t.framework: t.median() for t in timings if t.quantity == "a"}
        for t in timings:
            self.rows.append(_timing_row(model, b, t, base.get(t.framework)))
        epochs = {t.peer: t.median() for t in timings if t.quantity == "e" and t.times}
        if epochs:
            self.epochs.append((model, epochs))
        for q in self.args.quantities:
            self.summary += _summary_rows(model, b, q, [t for t in timings if t.quantity == q])

    def render(self) -> str:
        """The whole report as Markdown."""
        a = self.args
        cmd = " ".join(shlex.quote(x) for x in [os.path.relpath(sys.executable)] + sys.argv)
        lines = [
            "# Head-to-head: per_example_grads (layer-wise) vs JAX, torch.func, Opacus, interleaved",
            "",
            f"- command: `{cmd}`",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- wall time of this run: {time.time() - self.started:.0f} s",
            f"- load average (1 min) at start {self.load_start}, at end {C.loadavg()}",
            f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
            f"os.cpu_count()={os.cpu_count()}",
        ]
        for fw, versions in self.versions.items():
            lines.append(f"- {fw}: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        lines += [
            f"- models {a.models}, batch sizes {a.batch_sizes}, {a.repeats} interleaved rounds (median), "
            f"{a.warmup} warm-up calls, cap {a.max_seconds_per_call:.0f} s per call",
            "- quantities: (a) gradient of the mean loss over the batch; (b) materialized per-example "
            "gradients `[B, *param.shape]`; (c) per-example clip to global L2 norm C=1 then sum over "
            "the batch. Every round times each (peer, quantity) once, quantity by quantity, the "
            "starting framework rotating; idle workers wait on stdin.",
            "",
            "## Ours / fastest peer",
            "",
            "Median ms of one call, same rounds. < 1: ours is faster than every peer.",
            "",
        ]
        lines += C.markdown_table(
            ["model", "B", "quantity", "ours", "ours ms", "fastest peer", "its ms", "ours / fastest peer"], self.summary
        )
        if self.epochs:
            lines += [
                "",
                "## One DP epoch (e)",
                "",
                f"N = {C.EPOCH_N:,}, Poisson sampling of expected batch {C.EPOCH_BATCH}, noise multiplier "
                f"{C.EPOCH_SIGMA}, clip {C.CLIP_NORM}, SGD; plain epochs: batches of {C.EPOCH_BATCH}. "
                "Median seconds of one epoch, same rounds.",
                "",
            ]
            lines += C.markdown_table(
                [
                    "model",
                    "DPModel.fit s",
                    "keras fit s",
                    "DP / plain (ours)",
                    "opacus ghost s",
                    "opacus hooks s",
                    "torch s",
                    "DPModel.fit / fastest Opacus",
                ],
                [_epoch_row(m, e) for m, e in self.epochs],
            )
        lines += ["", "## All timings", ""]
        lines += C.markdown_table(
            ["model", "B", "framework", "peer", "quantity", "median ms", "IQR ms", "ratio to own (a)", "status"],
            self.rows,
        )
        return C.with_notes(lines, self.notes)


def _epoch_row(model: str, e: dict) -> list[str]:
    """A row of the DP epoch table from ``{peer: median seconds}``."""
    s = lambda k: f"{e[k]:.2f}" if k in e else "—"  # noqa: E731
    dp, plain = e.get("DPModel.fit"), e.get(f"keras fit {NOT_PRIVATE}")
    opacus = [e[k] for k in ("opacus ghost", "opacus hooks") if k in e]
    return [
        model,
        s("DPModel.fit"),
        s(f"keras fit {NOT_PRIVATE}"),
        f"{dp / plain:.2f}" if dp and plain else "—",
        s("opacus ghost"),
        s("opacus hooks"),
        s(f"torch {NOT_PRIVATE}"),
        f"**{dp / min(opacus):.2f}**" if dp and opacus else "—",
    ]


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds with two decimals, or a dash."""
    return "—" if seconds is None else f"{seconds * 1e3:.2f}"


def _timing_row(model: str, b: int, t: Timing, base: float | None) -> list[str]:
    """A row of the all-timings table."""
    med = t.median()
    iqr, ratio = "—", "—"
    if med is not None:
        lo, hi = C.quartiles(t.times)
        iqr = f"{lo * 1e3:.2f}-{hi * 1e3:.2f}"
        ratio = f"{med / base:.2f}" if base else "n/a"
    status = t.status or "ok"
    if t.first_s is not None:
        status += f"; first call {t.first_s * 1e3:.0f} ms"
    runs = f" ({len(t.times)} runs)" if t.status and t.times else ""
    return [model, str(b), t.framework, t.peer, C.QUANTITIES[t.quantity], _ms(med) + runs, iqr, ratio, status]


def _summary_rows(model: str, b: int, q: str, timings: list[Timing]) -> list[list[str]]:
    """Summary rows for ``q``: each of our variants' median, the fastest other peer's, their ratio.

    A median from a timing that stopped early (capped, failed, worker died) is marked ``(partial)``.
    """
    timings = [t for t in timings if NOT_PRIVATE not in t.peer]  # (e)'s plain epochs are no peer of a DP epoch
    fastest = min((t for t in timings if t.framework != OURS and t.times), key=Timing.median, default=None)
    theirs = fastest.median() if fastest else None
    rows = []
    for mine in [t for t in timings if t.framework == OURS and t.times] or [None]:
        ours = mine.median() if mine else None
        ratio = f"**{ours / theirs:.2f}**" if ours is not None and theirs else "—"
        rows.append(
            [
                model,
                str(b),
                C.QUANTITIES[q],
                mine.peer if mine else "—",
                _ms(ours) + _partial(mine),
                fastest.peer if fastest else "—",
                _ms(theirs) + _partial(fastest),
                ratio,
            ]
        )
    return rows


def _partial(t: Timing | None) -> str:
    """The mark of a median from a timing that stopped early."""
    return " (partial)" if t and t.status else ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with --quick's defaults applied and lists parsed; (a) always first in ``quantities``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(C.MODELS), help="comma list of %s" % ",".join(C.MODELS))
    p.add_argument("--batch-sizes", default=None, help="comma list (default 64,256; --quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 7; --quick: 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per task first (default 2; --quick: 1)")
    p.add_argument(
        "--quantities",
        default="b,c",
        help="comma list of b,c,e (default b,c); (a) is always timed, as each framework's baseline; "
        "e: one DP epoch (N = 12,000, expected batch 256, sigma 1) against plain epochs and Opacus, "
        "built once per model whatever the batch sizes (use --batch-sizes 256)",
    )
    p.add_argument(
        "--max-seconds-per-call",
        type=float,
        default=60.0,
        help="a (peer, quantity) whose call takes longer is not timed again and is marked '> cap'",
    )
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for any one answer (a build with its warm-up, a call, a check) "
        "before the worker is killed and reported",
    )
    p.add_argument("--no-check", action="store_true", help="skip the workers' correctness checks")
    p.add_argument("--quick", action="store_true", help="smoke run: B=16, 2 rounds, 1 warm-up")
    p.add_argument("--out", default=None, help="also write the Markdown report to this file")
    a = p.parse_args(argv)
    if a.quick:
        a.batch_sizes = a.batch_sizes or "16"
        a.repeats = a.repeats if a.repeats is not None else 2
        a.warmup = min(a.warmup, 1)
    a.batch_sizes = [int(s) for s in (a.batch_sizes or "64,256").split(",") if s]
    a.repeats = a.repeats if a.repeats is not None else 7
    a.models = [m for m in a.models.split(",") if m]
    if any(m not in C.MODELS for m in a.models):
        p.error(f"--models: choose from {C.MODELS}")
    asked = {q for q in a.quantities.split(",") if q}
    if not asked <= {"a", "b", "c", "e"}:
        p.error("--quantities: choose from b,c,e")
    a.quantities = ["a"] + sorted(asked - {"a"})
    if a.repeats < 1 or a.warmup < 1:
        p.error("--repeats and --warmup must be >= 1")
    return a


def installed_frameworks() -> list[Framework]:
    """The frameworks whose virtualenv exists; a message for each one that does not."""
    found = []
    for fw in FRAMEWORKS:
        if os.access(os.path.join(REPO, fw.python), os.X_OK):
            found.append(fw)
        else:
            C.log(f"[{fw.name}] skipped: no {fw.python} (install: {fw.install})")
    return found


def ensure_workers(
    workers: dict[str, Worker], frameworks: list[Framework], args: argparse.Namespace, report: Report
) -> list[Worker]:
    """Start the workers not running yet (and restart dead ones); the live ones, in FRAMEWORKS order."""
    started = []
    for fw in frameworks:
        w = workers.get(fw.name)
        if w is None or w.dead:
            if w is not None:
                C.log(f"[{fw.name}] restarting (it {w.dead})")
            workers[fw.name] = Worker(fw, args.worker_timeout)
            started.append(workers[fw.name])
    for w in started:  # the workers import their frameworks in parallel
        try:
            w.hello()
        except WorkerError as e:
            w.dead = w.dead or str(e)
            report.note(f"{w.fw.name} worker did not start: {e}")
            continue
        report.versions[w.fw.name] = w.versions
        for n in w.notes:
            report.note(n)
    return [workers[fw.name] for fw in frameworks if not workers[fw.name].dead]


def build_cell(
    workers: list[Worker], model: str, b: int, args: argparse.Namespace, report: Report
) -> dict[str, list[Timing]]:
    """Every worker builds (model, B) and warms it up; its timings by framework, for those that could."""
    cell, params = {}, {}
    for w in workers:
        C.log(f"[{w.fw.name}] build + warm up {model} B={b}")
        cmd = {
            "cmd": "build",
            "model": model,
            "b": b,
            "quantities": args.quantities,
            "warmup": args.warmup,
            "cap": args.max_seconds_per_call,
        }
        try:
            answer = w.ask(cmd)
        except WorkerError as e:
            report.note(f"{model} B={b} {w.fw.name}: build failed: {e}")
            continue
        cell[w.fw.name] = [
            Timing(w.fw.name, t["peer"], t["quantity"], t["first_s"], t["status"]) for t in answer["tasks"]
        ]
        for n in answer["notes"]:
            report.note(n)
            if m := PARAMS_NOTE.match(n):
                params[w.fw.name] = m.group(2)
    if len(set(params.values())) > 1:
        report.note(
            f"MODEL MISMATCH: {model} has different parameter counts: "
            + ", ".join(f"{fw} {n}" for fw, n in params.items())
        )
    return cell


def round_order(workers: list[Worker], r: int, quantities: list[str]) -> list[tuple[Worker, str]]:
    """Round ``r``'s (worker, quantity) order: quantity by quantity, the starting worker rotating with ``r``."""
    k = r % len(workers)
    return [(w, q) for q in quantities for w in workers[k:] + workers[:k]]


def time_rounds(workers: list[Worker], cell: dict[str, list[Timing]], args: argparse.Namespace, report: Report) -> None:
    """``args.repeats`` rounds, each timing every live (peer, quantity) of every worker once."""
    live = [w for w in workers if w.fw.name in cell]
    if not live:
        return
    for r in range(args.repeats):
        for w, q in round_order(live, r, args.quantities):
            for t in cell[w.fw.name]:
                if t.quantity == q and not t.status and not w.dead:
                    time_once(w, t, cell, report)


def time_once(w: Worker, t: Timing, cell: dict[str, list[Timing]], report: Report) -> None:
    """One timed call of ``t`` in its worker; a dead worker's unfinished timings are marked."""
    try:
        answer = w.ask({"cmd": "time", "peer": t.peer, "quantity": t.quantity})
    except WorkerDied as e:
        for u in cell[w.fw.name]:
            u.status = u.status or f"worker died: {e}"
        report.note(f"{w.fw.name} worker died while timing {t.peer} {t.quantity}: {e}")
        return
    except WorkerError as e:
        t.status = f"error: {e}"
        return
    if answer["seconds"] is not None:
        t.times.append(answer["seconds"])
    t.status = answer["status"]


def check_cell(workers: list[Worker], model: str, b: int, report: Report) -> None:
    """Each live worker's correctness check of the cell, into the notes."""
    for w in workers:
        if w.dead:
            continue
        try:
            lines = w.ask({"cmd": "check"})["lines"]
        except WorkerError as e:
            lines = [f"{model} B={b} {w.fw.name}: correctness check failed: {e}"]
        for line in lines:
            report.note(line)


def run(args: argparse.Namespace, report: Report, frameworks: list[Framework]) -> None:
    """Every (model, B): build and warm up in every worker, time interleaved, check."""
    workers: dict[str, Worker] = {}
    try:
        for model in args.models:
            for b in args.batch_sizes:
                live = ensure_workers(workers, frameworks, args, report)
                C.log(f"== {model} B={b} ({', '.join(w.fw.name for w in live)}), load {C.loadavg()}")
                cell = build_cell(live, model, b, args, report)
                time_rounds(live, cell, args, report)
                if not args.no_check:
                    check_cell([w for w in live if w.fw.name in cell], model, b, report)
                report.add_cell(model, b, [t for w in live for t in cell.get(w.fw.name, [])])
    finally:
        for w in workers.values():
            w.close()


def main(argv: list[str] | None = None) -> int:
    """Run the head-to-head, print the report, write it to --out; 1 if our own venv is missing."""
    args = parse_args(argv)
    frameworks = installed_frameworks()
    if not any(fw.name == OURS for fw in frameworks):
        C.log(f"no {FRAMEWORKS[0].python}: nothing to compare against")
        return 1
    report = Report(args)
    for fw in frameworks:
        report.note(f"{fw.name}: worker `{fw.python} {fw.script} --serve`")
    run(args, report, frameworks)
    text = report.render()
    sys.stdout.write("\n" + text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        C.log(f"[written to {args.out}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
