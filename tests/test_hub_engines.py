"""Every engine on every KerasHub zoo model (tiny; full and LoRA), in a child process.

A crash inside a kernel (oneDNN under tf.vectorized_map took the process
down on some CPUs) must fail one test, not kill pytest, so the models run in
a child (``python tests/test_hub_engines.py MODEL-full MODEL-lora ...``).
The child prints ``CASE model-kind`` before each model, then runs the
engines one after the other and prints ``START engine`` before and one JSON
line after each: if the child dies, the last ``CASE`` and ``START`` name the
model and engine that took it down. The child builds each model and its
one-example reference once.

All ten cases share one child (TensorFlow and KerasHub imported once, not
ten times: most of a child's seconds). If that child dies, or runs past
its time, every case runs again in a child of its own, as each once did: a
crash is then the case's own, and the case the shared child died in fails
even if it passes alone (a crash that needs an earlier case is still a crash).

Each engine either refuses with an ``EngineError`` (by design: the expected
refusals are listed in ``REFUSED``) or matches the one-example loop at the
derived tolerance; ``auto`` also computes norms and a clipped sum.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

MODELS = ["gemma_lm", "llama_lm", "gpt2_lm", "bert_classifier", "vit_classifier"]
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
    ("vit_classifier", "vectorized"): [_MATMUL],
}


def _case(name: str, lora: bool) -> str:
    """The case's name, as its test id has it: ``gpt2_lm-full``, ``gpt2_lm-lora``."""
    return f"{name}-{'lora' if lora else 'full'}"


CASES = [_case(name, lora) for name in MODELS for lora in (False, True)]


def _child(cases: list[str]) -> None:
    """Runs every engine on each case's model; prints CASE/START/JSON lines (see the module docstring)."""
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

    for case in cases:
        print(f"CASE {case}", flush=True)
        name, kind = case.rsplit("-", 1)

        def report(engine, status, message=""):
            print(json.dumps({"case": case, "engine": engine, "status": status, "message": message[:500]}), flush=True)

        try:
            model, x, y = zoo.build(name, B, **({"lora_rank": 4} if kind == "lora" else {}))
            expected = reference_gradients(model, sparse_ce, x, y)
            assert any(np.abs(e).max() > 0 for e in expected)
        except Exception as err:  # noqa: BLE001 - reported, and fails the case's test
            report("(build)", "error", f"{type(err).__name__}: {err}")
            continue

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


def _run_child(cases: list[str]) -> tuple[dict, str | None, str | None]:
    """One child running ``cases``: ``({case: {engine: result}}, None, None)``, or, if it died or ran past its
    time, ``(what it reported, why (naming the case and the engine it died in), that case)``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="2"
    )
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *cases],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )
    try:
        out, err = proc.communicate(timeout=900)
        status = f"return code {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        status = "still running after 900 s (killed)"
    results, case, engine = {c: {} for c in cases}, None, None
    for line in out.splitlines():
        if line.startswith("CASE "):
            case, engine = line.split()[1], None
        elif line.startswith("START "):
            engine = line.split()[1]
        elif line.startswith("{"):
            r = json.loads(line)
            results[r["case"]][r["engine"]] = r
    if proc.returncode == 0:
        return results, None, None
    where = "before any case" if case is None else f"in case {case}, engine {engine or '(before any engine)'}"
    return results, f"the child died ({status}) {where}:\n{err[-3000:]}", case


@functools.lru_cache(maxsize=None)
def _results() -> dict[str, tuple[dict, str | None]]:
    """``{case: ({engine: result}, failure or None)}``: every case in one child, or each in its own if that died."""
    shared, shared_failure, died_in = _run_child(CASES)
    if shared_failure is None:
        return {case: (shared[case], None) for case in CASES}
    out = {}
    for case in CASES:
        results, failure, _ = _run_child([case])
        if failure is None and case == died_in:
            failure = f"passes alone, but the child all cases shared died in it: {shared_failure}"
        out[case] = results[case], failure
    return out


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", MODELS)
def test_every_engine_refuses_or_matches_the_loop(name, lora):
    pytest.importorskip("keras_hub")
    results, failure = _results()[_case(name, lora)]
    if failure is not None:
        pytest.fail(failure)
    assert "(build)" not in results, results["(build)"]["message"]
    assert list(results) == ENGINES, results
    for engine, r in results.items():
        refusal = REFUSED.get((name, engine))
        if refusal is None:
            assert r["status"] == "ok", f"{engine}: {r['status']}: {r['message']}"
        else:
            assert r["status"] == "refused" and all(m in r["message"] for m in refusal), f"{engine}: {r}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _child(sys.argv[1:])
