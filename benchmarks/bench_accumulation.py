"""Peak memory of large logical DP batches processed in physical chunks.

    python benchmarks/bench_accumulation.py

On the benchmark MLP (784-512-512-10), each configuration runs in a fresh
subprocess that builds a ``DPModel``, trains 3 steps with ``fit`` and reports
``ru_maxrss``; a subprocess that only builds the model and the data gives the
baseline. Configurations (``_vectorized``: per-example gradients materialized by the
vectorized engine, ``B x P`` floats per pass, instead of the layer-wise
engine's clipped sums):

  physical64[_vectorized]          logical batch 64, one pass (the plain physical step)
  logical4096_chunk64[_vectorized] logical batch 4096 in physical chunks of 64 (one noise draw)
  logical4096_whole                logical batch 4096 in one layer-wise pass (for contrast;
                                   the vectorized engine would need 4096 x P = 11 GB here)
  plain_batch_grad64               non-private Keras fit step on 64 rows

Each increment is measured over the build-only process holding the same data
(64-row or 4096-row batches). The claim to check: logical4096_chunk64's
increment is close to physical64's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CONFIGS = (
    "plain_batch_grad64",
    "physical64",
    "logical4096_chunk64",
    "logical4096_whole",
    "physical64_vectorized",
    "logical4096_chunk64_vectorized",
)


def run(config: str) -> float:
    import keras
    import numpy as np

    import per_example_grads as peg

    keras.utils.set_random_seed(0)
    logical = 4096 if "4096" in config else 64
    x = np.random.default_rng(0).normal(size=(logical * 3, 784)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, logical * 3)
    net = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config == "plain_batch_grad64":
        net.compile(optimizer="sgd", loss=loss)
        net.fit(x, y, batch_size=64, epochs=1, verbose=0)
    elif not config.startswith("build_only"):
        physical = 64 if "chunk64" in config else None
        method = "vectorized" if config.endswith("_vectorized") else "layerwise"
        dp = peg.keras.DPModel(
            net,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            expected_batch_size=float(logical),
            physical_batch_size=physical,
            seed=0,
            method=method,
        )
        dp.compile(optimizer="sgd", loss=loss)
        dp.fit(x, y, batch_size=logical, epochs=1, verbose=0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--config":
        print(json.dumps({"maxrss_mib": run(sys.argv[2])}))
        return 0
    import tensorflow as tf

    print(
        f"command: python benchmarks/bench_accumulation.py\ntensorflow {tf.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}\n"
    )

    def peak(config):
        out = subprocess.run(
            [sys.executable, __file__, "--config", config], capture_output=True, text=True, timeout=1200
        )
        return json.loads(out.stdout.strip().splitlines()[-1])["maxrss_mib"]

    base = {"64": peak("build_only_64"), "4096": peak("build_only_4096")}
    incs = {}
    print(
        "| configuration | peak RSS MiB | build-only peak MiB (same data) | increment MiB | increment / physical64's |"
    )
    print("|---|---|---|---|---|")
    rows = []
    for c in CONFIGS:
        p = peak(c)
        b = base["4096" if "4096" in c else "64"]
        incs[c] = p - b
        rows.append((c, p, b))
    for c, p, b in rows:
        print(f"| {c} | {p:.0f} | {b:.0f} | {incs[c]:.0f} | {incs[c] / incs['physical64']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
