"""A memory budget's physical batch size, and the peak of the DPModel step that then trains with it.

    python benchmarks/bench_memory_budget.py --model gpt2 --batch 32 --seq-len 128 --budgets 2500,4000

Each budget runs in a fresh process with TensorFlow's BFC CPU allocator
(``TF_CPU_ALLOCATOR_USE_BFC=true``, which keeps the byte statistics). In it:
the zoo's model at the given size (``bench_scale.MODELS``; nothing
downloaded), ``peg.dp.physical_batch_size_for_memory`` for a logical batch of
``--batch`` rows (its time, its ``P`` and the peak it measured), then
``peg.keras.DPModel(..., physical_batch_size=P)`` (SGD, ``jit_compile=False``)
and its ``train_on_batch`` on ``--batch`` rows: one warm-up call, then the
device allocator's absolute peak during each of two calls (the larger is
reported) and their median time. ``--budgets none`` runs the DPModel step
unchunked, the reference; ``--budgets p2`` runs it in chunks of 2 rows,
with no search (to compare the step's peak at one ``P`` between two
checkouts, ``PYTHONPATH=/path/to/checkout``); ``--budgets plain`` runs the
Keras model's own ``train_on_batch`` (SGD) instead, measured the same way.
The function keeps its default headroom (10%
of the budget) free; a budget holds if the DPModel step's peak is at most
the budget (the function's docstring says what its probes run and what
they do not).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_MIB = 2**20


def run(model_name: str, b: int, t: int, budget: float | None, physical: int | None = None, plain=False) -> dict:
    import keras
    import tensorflow as tf
    from bench_scale import build, keras_step

    import per_example_grads as peg

    model, x, y = build(model_name, b, t)
    row = {
        "model": model_name,
        "b": b,
        "t": t,
        "budget_mib": budget,
        "p": physical,
        "fit_s": None,
        "fit_peak_mib": None,
        "plain": plain,
        "library": os.path.dirname(os.path.dirname(os.path.abspath(peg.__file__))),
    }
    if budget is not None:
        start = time.perf_counter()
        fit = peg.dp.physical_batch_size_for_memory(
            model, keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None), x, y,
            memory_budget_mib=budget, logical_batch_size=b, progress=False,
        )  # fmt: skip
        row |= {"p": fit.physical_batch_size, "fit_s": time.perf_counter() - start, "fit_peak_mib": fit.peak_mib}
        row["probes"] = fit.probes
    step = keras_step(model, "plain_step" if plain else "dp_step", b, physical_batch_size=row["p"])
    step(x, y)
    peaks, times = [], []
    for _ in range(2):
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] / _MIB)
    return row | {"step_peak_mib": max(peaks), "step_s": statistics.median(times)}


def _worker(model_name: str, b: int, t: int, budget: str, timeout: float) -> dict:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true")
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--run", f"{model_name},{b},{t},{budget}"],
            capture_output=True, text=True, timeout=timeout, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"budget": budget, "error": "timed out"}
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
        return {"budget": budget, "error": (out.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(r: dict) -> str:
    if "error" in r:
        return f"| {r['budget']} | {r['error']} | | | | | |"
    if r.get("plain"):
        return f"| plain (Keras's own step) | | | | {r['step_peak_mib']:.0f} | | {r['step_s']:.2f} |"
    if r["budget_mib"] is None:
        given = "none (one chunk)" if r["p"] is None else "none (P given)"
        return f"| {given} | {r['p'] or r['b']} | | | {r['step_peak_mib']:.0f} | | {r['step_s']:.2f} |"
    holds = "yes" if r["step_peak_mib"] <= r["budget_mib"] else "**no**"
    return (
        f"| {r['budget_mib']:.0f} | {r['p']} | {r['fit_peak_mib']:.0f} | {r['fit_s']:.0f} | "
        f"{r['step_peak_mib']:.0f} ({holds}) | {len(r['probes'])} | {r['step_s']:.2f} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=["gpt2", "bert"])
    p.add_argument("--batch", type=int, default=32, help="the logical batch B")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--budgets",
        default="none,2500,4000",
        help="comma list of MiB, none (unchunked), pN (chunks of N, no search) or plain (Keras's step)",
    )
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json")
    p.add_argument("--run", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run:
        model_name, b, t, budget = args.run.split(",")
        plain = budget == "plain"
        physical = int(budget[1:]) if budget.startswith("p") and not plain else None
        given = None if budget == "none" or physical or plain else float(budget)
        print(json.dumps(run(model_name, int(b), int(t), given, physical, plain)))
        return 0
    print(f"command: python benchmarks/bench_memory_budget.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC\n")
    print(
        "| budget MiB | P | its measured peak MiB (within 90%) | fit s | DPModel step's peak MiB (within) | probes | step s |"
    )
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for budget in args.budgets.split(","):
        rows.append(_worker(args.model, args.batch, args.seq_len, budget, args.timeout))
        print(_row(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
