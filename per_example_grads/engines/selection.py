"""Which engine runs: the rule behind ``method="auto"``, and its fallbacks.

The rule, in order of preference:

1. ``layerwise``, when every requested variable belongs to a layer (closed
   forms per layer, or the exact layer-local fallback); see
   ``per_example_grads.rules``.
2. ``vectorized``, unless the one-example graph has an op that, with the
   axis ``tf.vectorized_map`` adds, would exceed the rank its CPU kernel
   accepts, or that oneDNN mishandles (``per_example_grads._core.pfor_limits``:
   its Softmax takes rank <= 5, and grouped-query attention's scores are rank
   5 before pfor; batch matmuls with a unit batch axis, which every
   EinsumDense on one sequence example becomes, corrupt its heap). On some
   CPUs that is a segfault, which cannot be caught, so such models never
   reach it, whatever the CPU.
3. ``weight_copies``, the fallback the design asks for when vectorization is
   impossible, unless a variable is not a Keras variable, or the model has
   active random layers in training mode. (``benchmarks/RESULTS.md`` measures
   it 1.3-2.7x slower than ``loop`` on CPU.)
4. ``loop``, which runs anything that runs on one example.

``jacobian`` is never chosen automatically: it costs ``O(B^2)`` and does not
isolate examples from each other's NaNs. When an engine raises an exception
(not a crash) while building, ``auto`` moves to the next one. Whenever ``auto``
does not use its first choice it says which engine ran and why, in an
``EngineFallbackWarning`` that fires once per engine and reason.
"""

from __future__ import annotations

import warnings
from typing import Callable, TypeVar

from per_example_grads._core.batch import Batch
from per_example_grads.engines.base import ENGINES, Engine
from per_example_grads.errors import EngineError, EngineFallbackWarning, InvalidLossError
from per_example_grads._core.problem import Problem

AUTO_ORDER = ("layerwise", "vectorized", "weight_copies", "loop")
# The built-in choices of ``method=``. Engines registered later with
# ``register_engine`` are valid too (``check_method`` reads ``ENGINES``), but
# ``auto`` tries only ``AUTO_ORDER``.
METHODS = ("auto",) + tuple(ENGINES)
T = TypeVar("T")

_warned: set = set()


def check_method(method: str) -> None:
    """Raises ``ValueError`` naming the valid choices for an unknown ``method``."""
    if method != "auto" and method not in ENGINES:
        raise ValueError(f"method must be one of {['auto', *ENGINES]}; got {method!r}.")


def run(method: str, problem: Problem, use: Callable[[Engine], T], batch: Batch | None = None) -> T:
    """``use(engine)`` with the engine ``method`` names, or the one ``"auto"`` picks.

    ``use`` asks for one capability (``engine.compute(problem, batch)``,
    ``engine.squared_norms(...)`` or ``engine.clipped_sums(...)``); ``auto``
    falls back the same way for each: an engine that refuses the problem
    (``why_not``) or raises while building is skipped, with one
    ``EngineFallbackWarning`` naming it and the reason. With ``batch``, the
    engines' batch-dependent refusals (``Engine.why_not_batch``) apply too;
    every caller that runs an engine on a batch passes it.

    Raises:
      EngineError: an explicitly chosen engine refuses or fails, or no engine
        can run (``auto``).
    """
    if method != "auto":
        engine = ENGINES[method]
        reason = engine.refusal(problem, batch)
        if reason:
            raise EngineError(f"method={method!r} cannot run on this model: {reason}.")
        try:
            return use(engine)
        except InvalidLossError:
            raise
        except Exception as err:  # noqa: BLE001 - re-raised with the engine named
            raise EngineError(
                f"method={method!r} could not handle this model: "
                f"{type(err).__name__}: {_first_line(err)}. method='auto' falls "
                "back to another engine; method='loop' runs anything that runs "
                "on one example."
            ) from err

    skipped = []
    for name in AUTO_ORDER:
        engine = ENGINES[name]
        reason = engine.refusal(problem, batch)
        if reason is None:
            try:
                result = use(engine)
            except InvalidLossError:
                raise
            except Exception as err:  # noqa: BLE001 - any build failure means "try the next engine"
                reason = f"it raised {type(err).__name__}: {_first_line(err)}"
            else:
                if skipped:
                    _warn_once(name, skipped)
                return result
        skipped.append((name, reason))
    raise EngineError(
        "No engine could compute per-example gradients for this model:\n"
        + "\n".join(f"  {n}: {r}" for n, r in skipped)
    )


def compute(method: str, problem: Problem, batch: Batch) -> list:
    """Per-example gradients from ``method``: list of ``[B, *var.shape]``."""
    return run(method, problem, lambda engine: engine.compute(problem, batch), batch)


def _warn_once(used: str, skipped: list) -> None:
    key = (used, tuple(skipped))
    if key in _warned:
        return
    _warned.add(key)
    reasons = "; ".join(f"not '{n}' because {r}" for n, r in skipped)
    warnings.warn(
        f"per_example_grads: method='auto' used the '{used}' engine ({reasons}).",
        EngineFallbackWarning,
        stacklevel=4,
    )


def _first_line(err: Exception) -> str:
    """The line that says what went wrong (AutoGraph puts a traceback first)."""
    lines = [l.strip() for l in str(err).strip().splitlines() if l.strip()]
    return lines[-1][:300].rstrip(".") if lines else ""
