"""What the DP step's guarantees cost its first call at real scale: Keras's step, the DP step, and the DP step with
each guarantee's graph taken out (an experiment: those variants are not private or not exact, never a mode).

    python benchmarks/bench_first_step_parts.py --model resnet50 --cell 8x224 --rounds 3
    python benchmarks/bench_first_step_parts.py --model gpt2 --cell 8x128 --rounds 2 --variants plain,dp,without_both
    python benchmarks/bench_first_step_parts.py --model gpt2 --cell 8x128 --rounds 2 --variants plain,dp --optimizer adam

Variants (``train_on_batch``, SGD or ``--optimizer adam``, models and cells as in ``bench_scale.py``):

  plain           Keras's own step
  dp              ``DPModel``'s step, as shipped
  without_wide    the float64 recomputation of squared norms whose float32 squares overflow taken out
                  (``_core/example_ops.widened`` only casts): norms beyond about 1.8e19 become inf, so such an
                  example is left out as if its gradient were not finite; still private
  without_clean   the non-finite cleaning taken out (``engines/layerwise._finite_sums`` sums the captured tensors
                  as they are): one NaN or Inf example makes the whole sum NaN, which tells whether it was in the
                  batch: NOT private
  without_both    both

Each (variant, round) runs in its own fresh process, the variants interleaved round by round (this machine's speed
drifts between minutes). Per run: ``ops`` (the graph operations created while the first call traces, as
``bench_scale.py`` counts them), ``trace`` (Python tracing: TensorFlow's ``trace_function``), ``call`` (the rest of
the first call: TensorFlow's optimization and instantiation of the graph, and its first run, less a later call's
time) and ``later`` (a second call). The table gives medians over the rounds.
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

VARIANTS = ("plain", "dp", "without_wide", "without_clean", "without_both")


def _take_out(variant: str) -> None:
    """Patches the library for ``variant`` (in this process only)."""
    import tensorflow as tf

    if variant in ("without_wide", "without_both"):
        import importlib
        import pkgutil

        import per_example_grads.rules as rules
        from per_example_grads._core import example_ops

        def widened(parts):
            return [tf.cast(value, example_ops.WIDE) for value, _ in parts]

        example_ops.widened = widened
        for m in pkgutil.iter_modules(rules.__path__):
            module = importlib.import_module(f"{rules.__name__}.{m.name}")
            if hasattr(module, "widened"):
                module.widened = widened
    if variant in ("without_clean", "without_both"):
        from per_example_grads.engines import layerwise

        layerwise._finite_sums = lambda problem, captured, norms, weights_for: layerwise.weighted_sums(
            problem, captured, weights_for
        )


def run(model_name: str, b: int, t: int, variant: str, optimizer: str = "sgd") -> dict:
    """One variant's first and second call, in this process."""
    from bench_scale import _counting_ops, build, keras_step
    from tensorflow.python.eager.polymorphic_function import tracing_compilation

    _take_out(variant)
    model, x, y = build(model_name, b, t)
    step = keras_step(model, "plain_step" if variant == "plain" else "dp_step", b, optimizer=optimizer)
    traced = [0.0]
    trace_function = tracing_compilation.trace_function

    def timed_trace(*args, **kwargs):
        start = time.perf_counter()
        try:
            return trace_function(*args, **kwargs)
        finally:
            traced[0] += time.perf_counter() - start

    tracing_compilation.trace_function = timed_trace
    with _counting_ops() as ops:
        start = time.perf_counter()
        step(x, y)
        first = time.perf_counter() - start
    start = time.perf_counter()
    step(x, y)
    later = time.perf_counter() - start
    return {"variant": variant, "ops": ops[0], "first": first, "trace": traced[0], "later": later}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--cell", default="8x224", help="BxT")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--json")
    p.add_argument("--run", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    b, t = (int(n) for n in args.cell.split("x"))
    if args.run:
        print(json.dumps(run(args.model, b, t, args.run, args.optimizer)))
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    print(
        f"command: python benchmarks/bench_first_step_parts.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    print(f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC", flush=True)
    runs: dict = {v: [] for v in variants}
    base = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--cell", args.cell]
    base += ["--optimizer", args.optimizer, "--run"]
    for _ in range(args.rounds):
        for v in variants:
            out = subprocess.run(base + [v], capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = runs[v][-1]
            print(f"  {v}: first {r['first']:.2f} s (trace {r['trace']:.2f}), later {r['later']:.2f} s", flush=True)
    med = lambda v, k: statistics.median(r[k] for r in runs[v])  # noqa: E731
    plain = med("plain", "first") if "plain" in runs else None
    print("\n| variant | ops | first call s | trace s | call s | later call s | first call / Keras's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        call = statistics.median(r["first"] - r["trace"] - r["later"] for r in runs[v])
        ratio = f"{med(v, 'first') / plain:.2f}x" if plain else ""
        print(
            f"| {v} | {runs[v][0]['ops']:,} | {med(v, 'first'):.2f} | {med(v, 'trace'):.2f} | {call:.2f} | "
            f"{med(v, 'later'):.2f} | {ratio} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
