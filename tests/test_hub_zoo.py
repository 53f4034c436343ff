"""One tiny model per KerasHub family, and keras.applications families, against the one-example loop.

Each case of ``tests/hub_zoo.py`` checks ``per_example_gradients`` (auto and
layerwise), ``per_example_norms`` and ``clipped_gradients`` (with its norms)
against a one-example ``GradientTape`` loop, and which rules the layer-wise
engine plans: the closed forms it should use (``EXPECTED_RULES``) and no
layer on the layer-local fallback beyond ``ALLOWED_FALLBACK``.

The cases run in child processes (``python tests/test_hub_zoo.py CASE...``),
a few cases per child (``GROUPS``, so that TensorFlow and KerasHub are
imported a few times, not once per case): a crash in a kernel
(``tf.vectorized_map`` over KerasHub attention took the process down on
some CPUs) fails the cases of one child from that case on, not pytest. The child prints
``START case`` before and one JSON line after each case.

Tolerances: the per-example gradients agree to ``rounding_rtol(path)``
(``tests/tolerances.py``) with ``path`` counted from the model
(``gradient_path``), at least ``GRADIENT_RTOL``; norms and clipped sums
inherit it as ``norm_rtol`` and ``clipped_sum_rtol`` do.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import pytest

B = 3
# The cases of one group run in one child process (one TensorFlow start); a crash there leaves its later cases without a result.
GROUPS = {
    "families": [
        "gemma3_lm",
        "qwen3_lm",
        "smollm3_lm",
        "deberta_v3_classifier",
        "roformer_v2_encoder",
        "bart",
        "vit",
        "deit",
        "app_mobilenet_v3_small",
        "app_efficientnet_v2_b0",
        "t5",
        "mixtral_lm",
    ],
}
# Rules (class names) the layer-wise engine must plan for some layer of the case.
EXPECTED_RULES = {
    "gemma3_lm": {"RMSNormRule", "ReversibleEmbeddingRule"},
    "qwen3_lm": {"RMSNormRule"},
    "smollm3_lm": {"KerasRMSNormRule"},
    "deberta_v3_classifier": {"RelativeEmbeddingRule", "LayerNormRule"},
    "roformer_v2_encoder": {"RMSNormRule"},
    "t5": {"RMSNormRule", "T5AttentionRule"},
    "bart": {"PositionEmbeddingRule", "LayerNormRule"},
    "vit": {"PatchEmbeddingRule", "LayerNormRule"},
    "deit": {"DeiTEmbeddingsRule", "LayerNormRule"},
    "mixtral_lm": {"RMSNormRule", "MoEBlockRule"},
    "app_mobilenet_v3_small": {"BatchNormRule"},
    "app_efficientnet_v2_b0": {"BatchNormRule"},
}
# Layer classes that may still take the layer-local fallback (None: any).
ALLOWED_FALLBACK: dict = {}


def gradient_path(model) -> int:
    """Rounded operations on the longest path from the input to a weight and back (``tests/tolerances.py``).

    An upper bound: the path through every layer in turn. Each layer counts
    its longest sum (a kernel's contraction ``size / last axis``: a Dense's
    inputs, a convolution's ``kh kw c_in``; a 1-D weight's length, for a
    normalization's moments) plus 8 elementwise operations, each way.
    """
    total = 0
    for layer in model._flatten_layers(include_self=False):
        longest = 0
        below = {id(v) for sub in layer._flatten_layers(include_self=False, recursive=False) for v in sub.weights}
        for v in (v for v in layer.weights if id(v) not in below):  # the layer's own weights
            shape = tuple(v.shape)
            if len(shape) >= 2 and shape[-1]:
                longest = max(longest, math.prod(shape) // shape[-1])
            elif len(shape) == 1:
                longest = max(longest, shape[0])
        total += longest + 8
    return 2 * total


def _child(names: list[str]) -> None:
    """Runs each case; prints START/JSON lines (module docstring)."""
    import time

    import numpy as np

    import hub_zoo
    import per_example_grads as peg
    from helpers import (
        assert_clipped_sums_close,
        assert_grads_close,
        gradient_scale,
        reference_gradients,
        reference_norms,
        sparse_ce,
    )
    from per_example_grads.dp import validation
    from per_example_grads.engines.capture import plan_watches
    from per_example_grads.rules.local import LocalRule
    from tolerances import EPS32, GRADIENT_RTOL, norm_rtol, rounding_rtol, weighted_sum_rtol

    for name in names:
        print(f"START {name}", flush=True)
        result = {"case": name, "status": "ok", "check": "", "message": "", "seconds": {}}
        started = time.perf_counter()
        try:
            model, x, y = hub_zoo.build(name, B)
            watches = plan_watches(model, model.trainable_variables)
            result["rules"] = sorted({type(u.rule).__name__ for u in watches})
            result["fallback"] = sorted({type(u.layer).__name__ for u in watches if isinstance(u.rule, LocalRule)})
            result["check_model"] = sorted(
                {(f.class_name, f.why) for f in validation.validate(model, training=False).fallback}
            )
            expected = reference_gradients(model, sparse_ce, x, y)
            assert any(np.abs(e).max() > 0 for e in expected)
            result["seconds"]["build_and_loop"] = time.perf_counter() - started
            path = gradient_path(model)
            rtol = max(GRADIENT_RTOL, rounding_rtol(path))
            result["path"], result["rtol"] = path, rtol
            p = sum(int(np.prod(e.shape[1:])) for e in expected)
            norms = reference_norms(expected)
            scale = gradient_scale(expected)
            clip = float(np.median(norms))  # one example clipped, one at the clip norm, one below
            factors = clip / np.maximum(norms, clip)

            def check_norms(got, label):
                np.testing.assert_allclose(
                    got, norms, rtol=norm_rtol(p, rtol), atol=rtol * scale * np.sqrt(p), err_msg=label
                )

            checks = {
                "auto": lambda: assert_grads_close(
                    peg.per_example_gradients(model, sparse_ce, x, y), expected, rtol=rtol
                ),
                "layerwise": lambda: assert_grads_close(
                    peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected, rtol=rtol
                ),
                "norms": lambda: check_norms(peg.per_example_norms(model, sparse_ce, x, y), "per_example_norms"),
            }

            def clipped():
                got, got_norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True)
                check_norms(got_norms, "clipped_gradients' norms")
                term_rtol = rtol + norm_rtol(p, rtol) + EPS32  # as tolerances.clipped_sum_rtol, at this path's rtol
                assert_clipped_sums_close(got, expected, factors, rtol=weighted_sum_rtol(B, term_rtol))

            checks["clipped"] = clipped
            for check, fn in checks.items():
                result["check"] = check
                t = time.perf_counter()
                fn()
                result["seconds"][check] = time.perf_counter() - t
            result["check"] = ""
        except AssertionError as err:
            result.update(status="mismatch", message=str(err)[:1500])
        except Exception as err:  # noqa: BLE001 - reported, and fails the test
            result.update(status="error", message=f"{type(err).__name__}: {err}"[:1500])
        result["seconds"]["total"] = time.perf_counter() - started
        print(json.dumps(result), flush=True)


@functools.lru_cache(maxsize=None)
def _run_group(group: str) -> tuple[dict, str]:
    """``({case: result}, diagnostics)`` of one child running ``GROUPS[group]``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="2"
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *GROUPS[group]],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=900,
    )
    lines = proc.stdout.splitlines()
    results = {r["case"]: r for r in (json.loads(l) for l in lines if l.startswith("{"))}
    started = [l.split()[1] for l in lines if l.startswith("START ")]
    note = f"return code {proc.returncode}"
    if proc.returncode != 0 and started and started[-1] not in results:
        note += f"; the child died in case {started[-1]}"
    return results, f"{note}:\n{proc.stderr[-3000:]}"


def _params():
    for group, names in GROUPS.items():
        for name in names:
            marks = [pytest.mark.slow]
            yield pytest.param(group, name, marks=marks, id=name)


@pytest.mark.parametrize("group, name", list(_params()))
def test_case_matches_the_loop(group, name):
    pytest.importorskip("keras_hub")
    results, diagnostics = _run_group(group)
    assert name in results, f"no result for {name} ({diagnostics})"
    r = results[name]
    assert r["status"] == "ok", f"{r['check']}: {r['status']}: {r['message']}"
    missing = EXPECTED_RULES[name] - set(r["rules"])
    assert not missing, f"rules not planned: {sorted(missing)} (planned: {r['rules']})"
    # check_model names exactly the fallback layers' classes, each with why.
    assert sorted({c for c, _ in r["check_model"]}) == r["fallback"]
    allowed = ALLOWED_FALLBACK.get(name, set())
    if allowed is not None:
        assert set(r["fallback"]) <= allowed, f"layers on the layer-local fallback: {r['fallback']}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _child(sys.argv[1:])
