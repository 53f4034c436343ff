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
   active random layers in training mode (its cost against ``loop``:
   ``benchmarks/RESULTS.md``).
4. ``loop``, which runs anything that runs on one example.

``jacobian`` is never chosen automatically: it costs ``O(B^2)`` and does not
isolate examples from each other's NaNs. Whenever ``auto`` does not use its
first choice it says which engine ran and why, in an
``EngineFallbackWarning`` that fires once per engine and reason.

When an engine raises (an exception, not a crash), ``auto`` moves to the next
one only for the failures engines are built around: an engine's own refusal
(``EngineError``), TensorFlow's run-time errors (``tf.errors.OpError``), and
the Python errors TensorFlow and Keras raise while converting or
differentiating a model (``ValueError``, ``TypeError``, ``NotImplementedError``,
``AttributeError``, ``LookupError``, ``RuntimeError``: ``_FALLBACK_ERRORS``).
Any other exception (one a user's layer raises of its own type, say)
propagates at once, unchanged.

Data errors are raised as themselves. The first time an engine fails with one
of those errors, the plain batch gradient (the model, the loss and their
gradient on the whole batch, which every engine refines) is taken once:
eagerly when executing eagerly, else traced into a graph of its own that is
never run or added to the caller's graph. If that raises too, no engine can
succeed: the data or the model is wrong (a wrong feature size, a missing
input key, a label out of range, a sequence longer than the model's
positions), and that exception is raised as it is, with its own type and
message and nothing of the engines chained to it. Only if it runs does
``auto`` try the next engine. An explicitly chosen engine that refuses or
fails gets the same check: a data error is raised as itself, the engine's
own refusal or failure as an ``EngineError`` naming the engine. None of this
runs when the first engine tried succeeds, so the happy path calls the model
no more often than that engine does.

What ``auto`` learns is remembered per model (``_plans``): each engine's
refusal (the pfor hazard check traces the one-example graph) and the engine
it ended up using, keyed by everything they depend on (``_plan_key``: the
model's layers and the requested variables, the training flag, the loss,
the rules registered, the batch's structure, shapes and dtypes, and whether
it runs eagerly or under XLA). A later call with the same key (a retrace of
a training step, the next ``fit``) starts at that engine and traces nothing
for the engines before it; any change to the key plans anew. A remembered
engine that fails is not trusted: the whole order is tried again, as on a
first call. The memory only says where to start, never what to compute, so
it cannot change a result.
"""

from __future__ import annotations

import re
import warnings
import weakref
from typing import Any, Callable, TypeVar

import tensorflow as tf

from per_example_grads._core import model_inspection
from per_example_grads._core.batch import Batch
from per_example_grads._core.problem import Problem
from per_example_grads._core.tape import watch_variables
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.engines.base import ENGINES, Engine
from per_example_grads.errors import EngineError, EngineFallbackWarning, InvalidLossError
from per_example_grads.rules.rule import RULES

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


# What ``auto`` falls back on (module docstring). EngineError and the layer-wise engine's NotCoverable
# are ValueErrors; pfor raises TypeError (a masked RNN's variant tensors) and NotImplementedError,
# gradient registries LookupError, Keras re-raises a rule's error with its own type (RuntimeError).
_FALLBACK_ERRORS = (
    tf.errors.OpError,
    ValueError,
    TypeError,
    NotImplementedError,
    AttributeError,
    LookupError,
    RuntimeError,
)


def run(method: str, problem: Problem, use: Callable[[Engine], T], batch: Batch | None = None) -> T:
    """``use(engine)`` with the engine ``method`` names, or the one ``"auto"`` picks.

    ``use`` asks for one capability (``engine.compute(problem, batch)``,
    ``engine.squared_norms(...)`` or ``engine.clipped_sums(...)``); ``auto``
    falls back the same way for each: an engine that refuses the problem
    (``why_not``) or fails with one of ``_FALLBACK_ERRORS`` is skipped, with
    one ``EngineFallbackWarning`` naming it and the reason. With ``batch``,
    the engines' batch-dependent refusals (``Engine.why_not_batch``) apply
    too, and an engine's failure is first checked against the plain batch
    gradient (module docstring); every caller that runs an engine on a batch
    passes it.

    Raises:
      EngineError: an explicitly chosen engine refuses or fails while the
        plain batch gradient runs, or no engine can run (``auto``).
      InvalidLossError: the loss does not give one value per example.
      Exception: whatever the plain batch gradient raises on ``batch`` (a
        data error), as it raises it; and, unchanged, any exception an engine
        raises that is not one of ``_FALLBACK_ERRORS``.
    """
    plan = _plan(problem, batch, use)
    if method != "auto":
        engine = ENGINES[method]
        reason = _refusal(engine, problem, batch, plan)
        if reason:
            _raise_if_batch_gradient_fails(
                problem, batch
            )  # a refusal can stem from the data (a one-example graph that fails to trace)
            raise EngineError(f"method={method!r} cannot run on this model: {reason}.")
        result, err = _attempt(use, engine)
        if err is None:
            return result
        _raise_if_batch_gradient_fails(problem, batch)
        raise EngineError(
            f"method={method!r} could not handle this model: "
            f"{type(err).__name__}: {_first_line(err)}. method='auto' falls "
            "back to another engine; method='loop' runs anything that runs "
            "on one example."
        ) from err

    if plan is not None and "auto" in plan:  # this key's engine, the others' refusals not traced again
        name, skipped = plan["auto"]
        result, err = (None, True) if _refusal(ENGINES[name], problem, batch, plan) else _attempt(use, ENGINES[name])
        if err is None:
            if skipped:
                _warn_once(name, skipped)
            return result
        del plan["auto"]
    skipped = []
    checked = False
    for name in AUTO_ORDER:
        engine = ENGINES[name]
        reason = _refusal(engine, problem, batch, plan)
        if reason is None:
            result, err = _attempt(use, engine)
            if err is None:
                if skipped:
                    _warn_once(name, skipped)
                if plan is not None:
                    plan["auto"] = (name, list(skipped))
                return result
            if not checked:
                _raise_if_batch_gradient_fails(problem, batch)
                checked = True
            reason = f"it raised {type(err).__name__}: {_first_line(err)}"
        skipped.append((name, reason))
    raise EngineError(
        "No engine could compute per-example gradients for this model:\n" + "\n".join(f"  {n}: {r}" for n, r in skipped)
    )


# model -> {plan key: {"auto": (engine, skipped), ("refusal", engine): reason}}, with the objects the
# key names by id referred to beside it (weakly where they can be: a plan never keeps a model alive, a loss
# closing over it included), so a plan whose objects died, and whose ids may now be another's, is made anew;
# few keys per model.
_PLANS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_MAX_PLANS_PER_MODEL = 32


def _plan(problem: Problem, batch: Batch | None, use: Callable) -> dict | None:
    """The remembered plan of ``problem`` on ``batch`` for this capability (``use``), or None when it cannot be kept.

    Nothing is kept for a model that cannot be weakly referenced, or a batch
    whose leaves are not tensors or arrays.
    """
    key, keep = _plan_key(problem, batch, use)
    if key is None:
        return None
    try:
        plans = _PLANS.setdefault(problem.model, {})
    except TypeError:  # not weakly referenceable (a plain function as the model)
        return None
    if key not in plans or not all(r() is not None for r in plans[key]["keep"] if isinstance(r, weakref.ref)):
        if len(plans) >= _MAX_PLANS_PER_MODEL:
            plans.clear()
        plans[key] = {"keep": keep}
    return plans[key]


def _referred(objects) -> tuple:
    """A weak reference to each object that takes one (layers, variables, functions, losses); the others as they are."""
    out = []
    for o in objects:
        try:
            out.append(weakref.ref(o))
        except TypeError:  # a code object, a number, a tuple
            out.append(o)
    return tuple(out)


def _plan_key(problem: Problem, batch: Batch | None, use: Callable) -> tuple[tuple | None, tuple]:
    """``(key, referred)``: what an engine's refusal and success depend on, and the objects it names by id (``_referred``).

    The model's layers (any added, removed or replaced changes it), the
    requested variables, the training flag, the loss (its code and the
    objects it closes over), the registered rules, the capability asked for
    (the code of ``use``), the batch's nest of shapes and dtypes, and whether
    the call executes eagerly or under XLA. None when the batch is not made
    of tensors or arrays.
    """
    signature = []
    for path, leaf in _flat_with_paths(batch):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            return None, ()
        signature.append(
            (
                path,
                tuple(tf.TensorShape(shape).as_list()) if tf.TensorShape(shape).rank is not None else None,
                tf.as_dtype(dtype).name,
            )
        )
    layers = tuple(model_inspection.iter_layers(problem.model))
    loss = problem.loss
    cells = tuple(c.cell_contents for c in (getattr(loss, "__closure__", None) or ()))
    code = getattr(loss, "__code__", loss)
    keep = _referred([*layers, *problem.variables, code, *cells, *RULES.values()])  # not `use`: it holds the batch
    key = (
        tuple(map(id, layers)),
        tuple(map(id, problem.variables)),
        bool(problem.training),
        id(code),
        tuple(map(id, cells)),
        tuple(map(id, RULES.values())),
        id(getattr(use, "__code__", use)),
        tuple(signature),
        tf.executing_eagerly(),
        in_xla_context(),
    )
    return key, keep


def _flat_with_paths(batch: Batch | None) -> list:
    """``[(structure, leaf), ...]``: the batch's nest (as text) with the first leaf, then the other leaves."""
    if batch is None:
        return []
    leaves = tf.nest.flatten(batch)
    structure = repr(tf.nest.map_structure(lambda _: None, batch))
    return [(structure if i == 0 else i, leaf) for i, leaf in enumerate(leaves)]


def _refusal(engine: Engine, problem: Problem, batch: Batch | None, plan: dict | None) -> str | None:
    """``engine.refusal(problem, batch)``, worked out once per plan key (the pfor check traces a graph)."""
    if plan is None:
        return engine.refusal(problem, batch)
    slot = ("refusal", engine.name)
    if slot not in plan:
        plan[slot] = engine.refusal(problem, batch)
    return plan[slot]


def _attempt(use: Callable[[Engine], T], engine: Engine) -> tuple[T | None, Exception | None]:
    """``(use(engine), None)``, or ``(None, err)`` for an ``err`` in ``_FALLBACK_ERRORS``; anything else propagates.

    The error is returned rather than handled where it is caught, so that an
    exception raised after it (a data error) carries no context from it.
    """
    try:
        return use(engine), None
    except InvalidLossError:
        raise  # every engine would fail the same way
    except _FALLBACK_ERRORS as err:
        return None, err


def _raise_if_batch_gradient_fails(problem: Problem, batch: Batch | None) -> None:
    """Takes the plain batch gradient once: the model, the loss and their gradient on ``batch``; whatever that raises propagates as it is.

    That gradient is what every engine refines, so when it fails no engine
    can succeed and the failure is the data's or the model's, not an
    engine's. Eagerly it executes, so errors only running finds (a label out
    of range) show. Inside a ``tf.function`` trace it is traced, on specs of
    the batch, into a graph of its own that is never run or called (there the
    backward pass's trace can expose what only running the forward would: a
    sequence longer than a position table). A batch pass that runs out of
    memory says nothing about the data (the engines left may take one
    example at a time), so that one is not raised. Without a ``batch`` there
    is nothing to run.
    """
    if batch is None:
        return

    def batch_gradient(batch):
        with tf.name_scope("plain_batch_gradient"):  # at the root, a layer named "_x" is not a valid scope name
            with tf.GradientTape() as tape:
                watch_variables(tape, problem.variables)
                total = tf.reduce_sum(problem.losses(batch))
            tape.gradient(total, problem.variables)

    try:
        if tf.executing_eagerly():
            batch_gradient(batch)
        else:
            specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), batch)
            tf.function(batch_gradient, autograph=False).get_concrete_function(specs)
    except tf.errors.ResourceExhaustedError:
        pass


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


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(err: Exception) -> str:
    """The line that says what went wrong.

    The last line of the message (AutoGraph puts a traceback first), before
    the list of arguments Keras appends to errors raised in a layer's call.
    """
    text = _ANSI_ESCAPE.sub("", str(err)).split("Arguments received by ")[0]
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    return lines[-1][:300].rstrip(".") if lines else ""
