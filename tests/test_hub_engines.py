"""Every engine on every KerasHub zoo model (tiny; full and LoRA), each model in a child process.

A crash inside a kernel (oneDNN under tf.vectorized_map took the process
down on some CPUs) must fail one test, not kill pytest, so each model runs in
its own child (``python tests/test_hub_engines.py MODEL LORA``). The child
runs the engines one after the other and prints ``START engine`` before and
one JSON line after each: if the child dies, the last ``START`` names the
engine that took it down. One child per model (not per engine) builds the
model and the one-example reference once.

Each engine either refuses with an ``EngineError`` (by design: the expected
refusals are listed in ``REFUSED``) or matches the one-example loop at the
derived tolerance; ``auto`` also computes norms and a clipped sum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MODELS = ["gemma_lm", "llama_lm", "gpt2_lm", "bert_classifier"]
ENGINES = ["layerwise", "vectorized", "jacobian", "weight_copies", "loop", "auto"]
B = 2

# (model, engine) -> what the refusal must say (per_example_grads/_core/pfor_limits.py).
# Every attention projection (EinsumDense on [1, T, D]) is a broadcasting batch
# matmul with a unit batch axis under pfor, which corrupts oneDNN's heap; Gemma's
# grouped-query attention also has rank-5 scores, past oneDNN Softmax's rank 5.
# (Llama's attention reshapes its single key-value head away; Gemma's keeps it.)
_MATMUL = "BatchMatMulV2 broadcasting"
REFUSED = {
    ("gemma_lm", "vectorized"): ["Softmax on rank 5", _MATMUL],
    # One key-value head: [B, 1, T, S] scores, a unit batch axis in jacobian's backward pass.
    ("gemma_lm", "jacobian"): [_MATMUL],
    ("llama_lm", "vectorized"): [_MATMUL],
    ("gpt2_lm", "vectorized"): [_MATMUL],
    ("bert_classifier", "vectorized"): [_MATMUL],
}


def _child(name: str, lora: bool) -> None:
    """Runs every engine on one model; prints START/JSON lines (see the module docstring)."""
    import numpy as np

    import per_example_grads as peg
    from helpers import (
        assert_clipped_sums_close,
        assert_grads_close,
        assert_norms_close,
        reference_gradients,
        reference_norms,
        sparse_ce,
    )
    from per_example_grads.apps import zoo

    model, x, y = zoo.build(name, B, **({"lora_rank": 4} if lora else {}))
    expected = reference_gradients(model, sparse_ce, x, y)
    assert any(np.abs(e).max() > 0 for e in expected)

    def report(engine, status, message=""):
        print(json.dumps({"engine": engine, "status": status, "message": message[:500]}), flush=True)

    for engine in ENGINES:
        print(f"START {engine}", flush=True)
        try:
            assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method=engine), expected)
            if engine == "auto":
                assert_norms_close(peg.per_example_norms(model, sparse_ce, x, y), expected)
                norms = reference_norms(expected)
                clip = float(np.min(norms))  # one example clipped, one at the clip norm
                factors = clip / np.maximum(norms, clip)
                got = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip)
                assert_clipped_sums_close(got, expected, factors)
        except peg.EngineError as err:
            report(engine, "refused", str(err))
        except AssertionError as err:
            report(engine, "mismatch", str(err))
        except Exception as err:  # noqa: BLE001 - any other error is reported, and fails the test
            report(engine, "error", f"{type(err).__name__}: {err}")
        else:
            report(engine, "ok")


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", MODELS)
def test_every_engine_refuses_or_matches_the_loop(name, lora):
    pytest.importorskip("keras_hub")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="2"
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), name, str(int(lora))],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=900,
    )
    lines = proc.stdout.splitlines()
    results = {r["engine"]: r for r in (json.loads(l) for l in lines if l.startswith("{"))}
    started = [l.split()[1] for l in lines if l.startswith("START ")]
    if proc.returncode != 0:
        crashed = started[-1] if started and started[-1] not in results else "(before any engine)"
        pytest.fail(f"the child died with return code {proc.returncode} in engine {crashed}:\n{proc.stderr[-3000:]}")
    assert list(results) == ENGINES, proc.stderr[-3000:]
    for engine, r in results.items():
        refusal = REFUSED.get((name, engine))
        if refusal is None:
            assert r["status"] == "ok", f"{engine}: {r['status']}: {r['message']}"
        else:
            assert r["status"] == "refused" and all(m in r["message"] for m in refusal), f"{engine}: {r}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _child(sys.argv[1], bool(int(sys.argv[2])))
