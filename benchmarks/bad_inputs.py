#!/usr/bin/env python
"""A census of bad and edge inputs across the public API of ``per_example_grads``.

Every case feeds one bad or edge input to one public function and classifies
what happened, automatically:

* ``clear error``: a ``ValueError`` / ``TypeError`` (or a library error,
  ``per_example_grads.errors.EngineError`` / ``InvalidLossError``) whose
  message contains the words the case names (the offending argument), within
  the time limit; for the CLI, exit 1 or 2 with a ``pegrad CMD: error:`` line
  naming it and no traceback; for a data error the model itself reports (a
  wrong input shape, a missing input, a label out of range), the model's own
  message, not a ``No engine could compute`` that hides it;
* ``right answer``: it returned, and the result equals an independent
  reference the case computes (``dp_accounting`` called directly, a
  one-example ``tf.GradientTape`` loop, NumPy);
* ``silent``: it returned something wrong, or accepted an argument and
  ignored it (each case knows what right would be);
* ``crash``: any other exception, or a message that does not name the cause
  (a raw TensorFlow error, ``AttributeError``, ``ZeroDivisionError``, a CLI
  traceback), a hang past the time limit, memory past the limit, or the
  process dying;
* ``n/a``: the version under test lacks the feature (an argument, a class).

Each case runs in a child process (``--worker``): the cheap ones one after
the other in a few shared children (one without TensorFlow, one with it),
the accountant and memory cases each in its own. A child that hangs or dies
is killed or reaped, its case is a crash, and a new child runs the cases
that were left. The child limits its address space (``RLIMIT_AS``) to what
its imports took plus ``--memory-gb``. ``--jobs N`` runs up to ``N`` of these
children at once (the largest group first), each as above: a case is still
classified on its own, and a crash is still the case's that was running.

The package is imported from wherever ``PYTHONPATH`` points (else the
installed one), so one script measures any version:

    PYTHONPATH=/tmp/before python benchmarks/bad_inputs.py --json /tmp/before.json
    PYTHONPATH=$PWD python benchmarks/bad_inputs.py --json /tmp/after.json
    python benchmarks/bad_inputs.py --list
    python benchmarks/bad_inputs.py -k dpmodel
    python benchmarks/bad_inputs.py --jobs 2                           # two children at a time
    python benchmarks/bad_inputs.py --case dpmodel_trained_outside    # in this process, no isolation
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import gc
import inspect
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable

CLEAR, RIGHT, SILENT, CRASH, NA = "clear error", "right answer", "silent", "crash", "n/a"
OUTCOMES = (CLEAR, RIGHT, SILENT, CRASH, NA)
DEFAULT_TIMEOUT = 30.0
DEFAULT_MEMORY_GB = 3.0
STARTUP_TIMEOUT = 180.0  # a child's imports (TensorFlow, ~3-10 s) before its first case
CLI_MEMORY_GB = {False: 3.0, True: 6.0}  # a CLI child without / with TensorFlow (it takes ~1.5 GB of address space)
MASKED = "No engine could compute"
DELTA = 1e-5


# =============================================================================
# Cases and verdicts
# =============================================================================


@dataclasses.dataclass
class Case:
    name: str
    area: str
    fn: Callable
    words: tuple = ()  # each item a word, or a tuple of alternatives; all items must be in the message
    forbid: tuple = ()
    tf: bool = True  # needs TensorFlow in the child (imported before the memory limit is set)
    alone: bool = False  # in a child of its own (accountant and memory cases)
    any_type: bool = False  # the model's own error (any type) counts, if it has the words
    doc: str = ""


CASES: dict[str, Case] = {}


def case(area, *, words=(), forbid=(), tf=True, alone=False, any_type=False):
    def register(fn):
        name = fn.__name__
        if name in CASES:
            raise RuntimeError(f"duplicate case {name}")
        doc = inspect.cleandoc(fn.__doc__ or "").split("\n")[0]
        CASES[name] = Case(name, area, fn, tuple(words), tuple(forbid), tf, alone, any_type, doc)
        return fn

    return register


class Verdict(Exception):
    """Ends a case with an outcome (raised by the helpers below, or returned)."""

    def __init__(self, outcome: str, detail: str):
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


def right(detail: str) -> Verdict:
    return Verdict(RIGHT, detail)


def silent(detail: str) -> Verdict:
    return Verdict(SILENT, detail)


def clear(detail: str) -> Verdict:
    return Verdict(CLEAR, detail)


def crash(detail: str) -> Verdict:
    return Verdict(CRASH, detail)


def need(condition: Any, why: str) -> None:
    """Marks the case n/a for this version unless ``condition``."""
    if not condition:
        raise Verdict(NA, why)


def need_param(fn: Callable, param: str, what: str) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    need(param in params, f"{what} has no {param!r} argument in this version")


def one_line(text: Any, limit: int = 170) -> str:
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(text)).split())  # Keras bolds parts of its messages
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(text: Any) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {one_line(e, 140)}"


def _word_in(word: str, message: str) -> bool:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", word):
        return re.search(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])", message, re.IGNORECASE) is not None
    return word.lower() in message.lower()


def names_words(words: tuple, message: str) -> tuple[bool, str]:
    """Whether every item of ``words`` (a word or a tuple of alternatives) is in ``message``; the first missing."""
    for item in words:
        alternatives = item if isinstance(item, tuple) else (item,)
        if not any(_word_in(w, message) for w in alternatives):
            return False, " or ".join(repr(w) for w in alternatives)
    return True, ""


def library_errors() -> tuple:
    try:
        from per_example_grads import errors
    except Exception:  # noqa: BLE001 - a version without the module
        return ()
    return tuple(getattr(errors, n) for n in ("EngineError", "InvalidLossError") if hasattr(errors, n))


def classify_exception(c: Case, e: BaseException) -> tuple[str, str]:
    """The outcome of a case that raised ``e`` (not a ``Verdict``)."""
    if isinstance(e, MemoryError):
        return CRASH, f"memory past the limit: {describe(e)}"
    message = f"{e}"
    if c.forbid and any(f.lower() in message.lower() for f in c.forbid):
        hit = next(f for f in c.forbid if f.lower() in message.lower())
        return CRASH, f"{type(e).__name__} with {hit!r}, hiding the cause: {one_line(message, 120)}"
    typed = isinstance(e, (ValueError, TypeError) + library_errors()) or c.any_type
    if not typed:
        return CRASH, describe(e)
    ok, missing = names_words(c.words, message)
    if ok:
        return CLEAR, describe(e)
    return CRASH, f"message does not name {missing}: {describe(e)}"


# =============================================================================
# Shared helpers for the cases (TensorFlow is imported inside them)
# =============================================================================


def modules():
    import keras
    import numpy as np
    import tensorflow as tf

    import per_example_grads as peg

    return np, tf, keras, peg


def mlp(inputs: int = 4, classes: int = 3, hidden: int = 8, **dense):
    _, _, keras, _ = modules()
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(hidden, activation="relu", **dense),
            keras.layers.Dense(classes),
        ]
    )


def data(n: int = 64, inputs: int = 4, classes: int = 3, seed: int = 0):
    np = modules()[0]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, inputs)).astype("float32")
    y = (np.arange(n) % classes).astype("int32")
    return x, y


def sce():
    keras = modules()[2]
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def example_loss(y, logits):
    keras = modules()[2]
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def loop_grads(model, x, y, loss=None, variables=None):
    """Reference per-example gradients: one ``GradientTape`` per example; float64 ``[B, *shape]`` arrays."""
    np, tf, _, _ = modules()
    loss = loss or example_loss
    variables = list(model.trainable_variables if variables is None else variables)
    rows = tf.nest.flatten(x)[0].shape[0]
    out = [[] for _ in variables]
    for i in range(rows):
        xi = tf.nest.map_structure(lambda t: t[i : i + 1], x)
        yi = None if y is None else y[i : i + 1]
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss(yi, model(xi, training=False)))
        grads = tape.gradient(value, variables)
        for k, (g, v) in enumerate(zip(grads, variables)):
            out[k].append(np.zeros(v.shape) if g is None else np.asarray(tf.convert_to_tensor(g), np.float64))
    return [np.stack(o) if o else np.zeros((0, *v.shape)) for o, v in zip(out, variables)]


def norms64(grads) -> Any:
    np = modules()[0]
    return np.sqrt(sum(np.sum(np.square(g.reshape(len(g), -1)), axis=1) for g in grads))


def clipped_sum64(grads, clip: float, finite_only: bool = False):
    np = modules()[0]
    n = norms64(grads)
    factors = clip / np.maximum(n, clip)
    keep = np.isfinite(n) if finite_only else np.ones_like(n, bool)
    return [
        np.sum(
            np.where(keep.reshape(-1, *[1] * (g.ndim - 1)), g * factors.reshape(-1, *[1] * (g.ndim - 1)), 0.0), axis=0
        )
        for g in grads
    ]


def as_numpy(t):
    np, tf, _, _ = modules()
    return np.asarray(tf.convert_to_tensor(t), np.float64)


def close(a, b, rtol: float = 1e-4, atol: float = 1e-6) -> bool:
    np = modules()[0]
    a, b = list(a), list(b)
    if len(a) != len(b):
        return False
    for u, v in zip(a, b):
        u, v = as_numpy(u), np.asarray(v, np.float64)
        if u.shape != v.shape or not np.allclose(u, v, rtol=rtol, atol=atol, equal_nan=False):
            return False
    return True


def max_diff(a, b) -> str:
    np = modules()[0]
    try:
        return f"{max(float(np.max(np.abs(as_numpy(u) - np.asarray(v)))) for u, v in zip(a, b)):.3g}"
    except Exception:  # noqa: BLE001 - shapes differ
        return "shapes " + str([tuple(np.shape(u)) for u in a]) + " vs " + str([tuple(np.shape(v)) for v in b])


def ref_epsilon(sigma: float, q: float, steps: int, delta: float = DELTA, accountant: str = "pld") -> float:
    """Epsilon of ``steps`` Poisson-sampled Gaussian steps, asked of ``dp_accounting`` directly."""
    import dp_accounting
    from dp_accounting import pld, rdp

    if steps == 0:
        return 0.0
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    acc = (
        pld.PLDAccountant(neighboring_relation=relation)
        if accountant == "pld"
        else rdp.RdpAccountant(neighboring_relation=relation)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(acc.compose(event).get_epsilon(delta))


def same_number(a: float, b: float, rtol: float = 1e-3) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(b), 1e-12)


def judge_epsilon(got: float, expected: float, what: str, wrong: dict | None = None) -> Verdict:
    if same_number(got, expected):
        return right(f"epsilon {got:.4g} = dp_accounting's {expected:.4g} for {what}")
    for label, value in (wrong or {}).items():
        if same_number(got, value):
            return silent(f"epsilon {got:.4g} is the value for {label}; right: {expected:.4g} for {what}")
    return silent(f"epsilon {got:.4g}; right: {expected:.4g} for {what}")


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def dp_model(net=None, compile_kw=None, **kw):
    _, _, keras, peg = modules()
    dp = peg.keras.DPModel(net if net is not None else mlp(), **kw)
    dp.compile(optimizer=keras.optimizers.SGD(0.05), loss=sce(), **(compile_kw or {}))
    return dp


def fit(dp, *args, **kw):
    kw.setdefault("verbose", 0)
    with quiet():
        return dp.fit(*args, **kw)


def epsilon_of(dp, delta=DELTA):
    with quiet():
        return float(dp.epsilon(delta))


def steps_of(dp) -> int:
    return int(dp.dp_steps.numpy())


def accepted_then_trained(make: Callable, what: str) -> Verdict:
    """A DPModel built with a bad argument: construction is the test; if it passes, one epoch of fit."""
    x, y = data(64)
    dp = make()
    fit(dp, x, y, batch_size=16, epochs=1)
    try:
        eps = epsilon_of(dp)
    except Exception as e:  # noqa: BLE001 - reported, the fit already ran
        eps = f"raised {type(e).__name__}"
    return silent(f"accepted {what}; fit ran {steps_of(dp)} steps; epsilon {eps}")


def private(x=None, y=None, net=None, hide_warnings=True, **kw):
    _, _, _, peg = modules()
    if x is None:
        x, y = data(8)
    args = dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=8)
    args.update(kw)
    with quiet() if hide_warnings else contextlib.nullcontext():
        return peg.dp.private_gradients(net if net is not None else mlp(), sce(), x, y, **args)


def versus_model(direct: Callable, call: Callable, key_words: tuple = ()) -> Verdict:
    """A data error: ``call`` (the library) should raise what ``direct`` (the model or loss itself) raises.

    Clear: the library's message is the model's own (its first line, numbers
    aside) or has ``key_words``, and no ``No engine could compute`` hides it.
    """
    try:
        direct()
    except Exception as e:  # noqa: BLE001 - the reference
        own = e
    else:
        own = None
    try:
        result = call()
    except Exception as e:  # noqa: BLE001 - classified here
        message = str(e)
        if MASKED.lower() in message.lower():
            said = f" (the model says: {type(own).__name__}: {one_line(own, 60)})" if own else ""
            return crash(f"{type(e).__name__}: {MASKED}...{said}")
        if isinstance(e, MemoryError):
            return crash(f"memory past the limit: {describe(e)}")
        norm = lambda s: re.sub(r"\d+", "#", " ".join(s.split())).lower()  # noqa: E731
        own_key = norm(first_line(own))[:60] if own is not None else None
        if own_key and own_key in norm(message):
            return clear(f"the model's own {describe(e)}")
        if (
            key_words
            and names_words(key_words, message)[0]
            and (own is not None or isinstance(e, (ValueError, TypeError)))
        ):
            return clear(describe(e))
        return crash(f"{describe(e)} (the model itself: {describe(own) if own else 'runs'})")
    if own is not None:
        return silent(f"returned {type(result).__name__} where the model itself raises {describe(own)}")
    return right("returned, and the model itself runs on this input")


# =============================================================================
# Accounting (no TensorFlow)
# =============================================================================


def accounting():
    from per_example_grads.dp import accounting as acc

    return acc


def call_quietly(fn, *a, **k):
    with quiet():
        return fn(*a, **k)


@case("accounting", words=("epochs", "steps"), tf=False)
def compute_epsilon_epochs_and_steps():
    """compute_epsilon(60000, 256, epochs=1, steps=10): both lengths given; right = refuse, naming both."""
    got = call_quietly(accounting().compute_epsilon, 60000, 256, 1, 1.1, DELTA, steps=10)
    by_steps, by_epochs = ref_epsilon(1.1, 256 / 60000, 10), ref_epsilon(1.1, 256 / 60000, math.ceil(60000 / 256))
    used = "steps=10" if same_number(got, by_steps) else "epochs=1" if same_number(got, by_epochs) else "neither"
    return silent(f"accepted both; epsilon {got:.4g} follows {used}, the other ignored")


@case("accounting", words=("sampling_probability", "batch_size"), tf=False)
def compute_epsilon_q_and_batch_size():
    """compute_epsilon(60000, 256, None, 1.1, 1e-5, steps=10, sampling_probability=0.5): q disagrees with 256/60000."""
    got = call_quietly(accounting().compute_epsilon, 60000, 256, None, 1.1, DELTA, steps=10, sampling_probability=0.5)
    by_q, by_b = ref_epsilon(1.1, 0.5, 10), ref_epsilon(1.1, 256 / 60000, 10)
    used = (
        "sampling_probability=0.5"
        if same_number(got, by_q)
        else "batch_size/N"
        if same_number(got, by_b)
        else "neither"
    )
    return silent(f"accepted both; epsilon {got:.4g} follows {used}, the other ignored")


def bounded_by_rdp(got: float, sigma: float, q: float, steps: int) -> Verdict:
    rdp = ref_epsilon(sigma, q, steps, accountant="rdp")
    if got > 0 and (got <= rdp * (1 + 1e-6) or math.isinf(rdp)) and not math.isnan(got):
        return right(f"epsilon {got:.4g}, within dp_accounting's RDP bound {rdp:.4g}")
    return silent(f"epsilon {got!r}; dp_accounting's RDP bound is {rdp:.4g}")


@case("accounting", words=("steps",), tf=False, alone=True)
def compute_epsilon_steps_1e9():
    """compute_epsilon(60000, 256, None, 1.1, 1e-5, steps=10**9): accountant cost (right: a number within the RDP bound)."""
    got = call_quietly(accounting().compute_epsilon, 60000, 256, None, 1.1, DELTA, steps=10**9)
    return bounded_by_rdp(got, 1.1, 256 / 60000, 10**9)


@case("accounting", words=("noise_multiplier",), tf=False, alone=True)
def compute_epsilon_sigma_1e_3():
    """compute_epsilon(60000, 256, 60, noise_multiplier=1e-3, 1e-5): accountant cost at a tiny sigma."""
    got = call_quietly(accounting().compute_epsilon, 60000, 256, 60, 1e-3, DELTA)
    return bounded_by_rdp(got, 1e-3, 256 / 60000, math.ceil(60 * 60000 / 256))


@case("accounting", words=("target_epsilon",), tf=False, alone=True)
def noise_for_epsilon_1e4():
    """noise_multiplier_for_epsilon(1e4, 1e-5, 60000, 256, 60): a huge target (right: sigma whose epsilon <= 1e4)."""
    sigma = call_quietly(accounting().noise_multiplier_for_epsilon, 1e4, DELTA, 60000, 256, 60)
    steps, q = math.ceil(60 * 60000 / 256), 256 / 60000
    rdp = ref_epsilon(sigma, q, steps, accountant="rdp")
    if sigma >= 0 and rdp <= 1e4:
        return right(f"sigma {sigma:.4g}: dp_accounting's RDP epsilon {rdp:.4g} <= 1e4")
    pld = ref_epsilon(sigma, q, steps)
    if pld <= 1e4 * (1 + 1e-9):
        return right(f"sigma {sigma:.4g}: dp_accounting's PLD epsilon {pld:.4g} <= 1e4")
    return silent(f"sigma {sigma:.4g} gives epsilon {pld:.4g} > 1e4")


def epsilon_refused(**overrides) -> Verdict:
    args = dict(num_examples=60000, batch_size=256, epochs=60, noise_multiplier=1.1, delta=DELTA)
    args.update(overrides)
    got = call_quietly(accounting().compute_epsilon, **args)
    return silent(f"accepted {overrides}; returned {got!r}")


@case("accounting", words=("noise_multiplier",), tf=False)
def compute_epsilon_sigma_nan():
    """compute_epsilon(noise_multiplier=nan)."""
    return epsilon_refused(noise_multiplier=float("nan"))


@case("accounting", words=("noise_multiplier",), tf=False)
def compute_epsilon_sigma_negative():
    """compute_epsilon(noise_multiplier=-1)."""
    return epsilon_refused(noise_multiplier=-1.0)


@case("accounting", words=("noise_multiplier",), tf=False)
def compute_epsilon_sigma_zero():
    """compute_epsilon(noise_multiplier=0): no noise; right = inf."""
    got = call_quietly(accounting().compute_epsilon, 60000, 256, 1, 0.0, DELTA)
    return right("epsilon = inf") if got == math.inf else silent(f"epsilon {got!r} without noise; right: inf")


@case("accounting", words=("delta",), tf=False)
def compute_epsilon_delta_zero():
    """compute_epsilon(delta=0)."""
    return epsilon_refused(delta=0.0)


@case("accounting", words=("delta",), tf=False)
def compute_epsilon_delta_nan():
    """compute_epsilon(delta=nan)."""
    return epsilon_refused(delta=float("nan"))


@case("accounting", words=("delta",), tf=False)
def compute_epsilon_delta_above_one():
    """compute_epsilon(delta=1.5)."""
    return epsilon_refused(delta=1.5)


@case("accounting", words=("delta",), tf=False)
def compute_epsilon_delta_over_1_over_n():
    """compute_epsilon(N=100, delta=0.05 >= 1/N): right = the number with a warning naming delta."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = accounting().compute_epsilon(100, 10, 1, 1.1, 0.05)
    expected = ref_epsilon(1.1, 0.1, 10, 0.05)
    warned = [w for w in caught if "delta" in str(w.message)]
    if not same_number(got, expected):
        return silent(f"epsilon {got:.4g}; right {expected:.4g}")
    if warned:
        return right(f"epsilon {got:.4g} = dp_accounting's, and a warning: {one_line(warned[0].message, 70)}")
    return silent(f"epsilon {got:.4g} for delta 0.05 >= 1/N with no warning")


@case("accounting", words=("epochs",), tf=False)
def compute_epsilon_epochs_nan():
    """compute_epsilon(epochs=nan)."""
    return epsilon_refused(epochs=float("nan"))


@case("accounting", words=("epochs",), tf=False)
def compute_epsilon_epochs_negative():
    """compute_epsilon(epochs=-1)."""
    return epsilon_refused(epochs=-1)


@case("accounting", words=("epochs",), tf=False)
def compute_epsilon_epochs_inf():
    """compute_epsilon(epochs=inf)."""
    return epsilon_refused(epochs=float("inf"))


@case("accounting", words=("epochs",), tf=False)
def compute_epsilon_epochs_string():
    """compute_epsilon(epochs="60")."""
    return epsilon_refused(epochs="60")


@case("accounting", words=("num_examples",), tf=False)
def compute_epsilon_num_examples_zero():
    """compute_epsilon(num_examples=0)."""
    return epsilon_refused(num_examples=0)


@case("accounting", words=("batch_size",), tf=False)
def compute_epsilon_batch_above_n():
    """compute_epsilon(num_examples=100, batch_size=256)."""
    return epsilon_refused(num_examples=100)


@case("accounting", words=("accountant",), tf=False)
def compute_epsilon_accountant_bogus():
    """compute_epsilon(accountant="gdp")."""
    return epsilon_refused(accountant="gdp")


@case("accounting", words=("num_examples", "noise_multiplier"), tf=False)
def compute_epsilon_numpy_scalars():
    """compute_epsilon(np.int64(60000), np.int64(256), np.float32(60), np.float32(1.1), ...): right = as for Python numbers."""
    import numpy as np

    got = call_quietly(
        accounting().compute_epsilon, np.int64(60000), np.int64(256), np.float32(60), np.float32(1.1), DELTA
    )
    expected = ref_epsilon(float(np.float32(1.1)), 256 / 60000, math.ceil(60 * 60000 / 256))
    return judge_epsilon(got, expected, "the same run in Python numbers")


@case("accounting", words=("epochs",), tf=False)
def compute_epsilon_fractional_epochs():
    """compute_epsilon(epochs=0.1): ceil(0.1 * 60000 / 256) = 24 steps."""
    got = call_quietly(accounting().compute_epsilon, 60000, 256, 0.1, 1.1, DELTA)
    return judge_epsilon(
        got, ref_epsilon(1.1, 256 / 60000, 24), "24 steps", {"23 steps": ref_epsilon(1.1, 256 / 60000, 23)}
    )


@case("accounting", words=("steps",), tf=False)
def compute_epsilon_zero_steps():
    """compute_epsilon(steps=0): right = 0.0."""
    got = call_quietly(accounting().compute_epsilon, 60000, 256, None, 1.1, DELTA, steps=0)
    return right("epsilon 0.0") if got == 0.0 else silent(f"epsilon {got!r} for no steps")


@case("accounting", words=("sampling_probability",), tf=False)
def accountant_q_zero():
    """PrivacyAccountant(1.1, sampling_probability=0)."""
    acc = accounting().PrivacyAccountant(1.1, 0.0)
    acc.step(10)
    return silent(f"accepted q=0; epsilon {call_quietly(acc.epsilon, DELTA)!r}")


@case("accounting", words=("noise_multiplier",), tf=False)
def accountant_noise_inf():
    """PrivacyAccountant(noise_multiplier=inf, 0.01)."""
    acc = accounting().PrivacyAccountant(float("inf"), 0.01)
    acc.step(10)
    return silent(f"accepted sigma=inf; epsilon {call_quietly(acc.epsilon, DELTA)!r}")


@case("accounting", words=("delta",), tf=False)
def noise_for_epsilon_delta_nan():
    """noise_multiplier_for_epsilon(1.0, delta=nan, ...)."""
    got = call_quietly(accounting().noise_multiplier_for_epsilon, 1.0, float("nan"), 60000, 256, 1)
    return silent(f"returned sigma {got!r} for delta nan")


@case("accounting", words=(("n", "steps", "count"),), tf=False)
def accountant_negative_steps():
    """PrivacyAccountant(1.1, 0.01).step(-5)."""
    acc = accounting().PrivacyAccountant(1.1, 0.01)
    acc.step(10)
    acc.step(-5)
    got = call_quietly(acc.epsilon, DELTA)
    return silent(f"accepted step(-5); steps {acc.steps}, epsilon {got:.4g}")


@case("accounting", words=(("count", "segments"),), tf=False)
def accountant_state_tampered():
    """PrivacyAccountant.from_state(state with a segment count of "many")."""
    acc = accounting().PrivacyAccountant(1.1, 0.01)
    acc.step(10)
    state = json.loads(json.dumps(acc.get_state()))
    state["segments"][0]["count"] = "many"
    back = accounting().PrivacyAccountant.from_state(state)
    return silent(f"accepted count='many'; steps {back.steps!r}")


@case("accounting", words=("target_epsilon",), tf=False)
def noise_for_epsilon_target_zero():
    """noise_multiplier_for_epsilon(target_epsilon=0, ...)."""
    got = call_quietly(accounting().noise_multiplier_for_epsilon, 0.0, DELTA, 60000, 256, 1)
    return silent(f"returned sigma {got!r} for epsilon 0")


@case("accounting", words=("target_epsilon",), tf=False)
def noise_for_epsilon_target_nan():
    """noise_multiplier_for_epsilon(target_epsilon=nan, ...)."""
    got = call_quietly(accounting().noise_multiplier_for_epsilon, float("nan"), DELTA, 60000, 256, 1)
    return silent(f"returned sigma {got!r} for epsilon nan")


@case("accounting", words=("clipped_count_stddev",), tf=False)
def adaptive_noise_count_stddev_too_small():
    """adaptive_clipping_noise_multiplier(1.0, clipped_count_stddev=0.4): the count alone spends the budget."""
    got = accounting().adaptive_clipping_noise_multiplier(1.0, 0.4)
    return silent(f"returned {got!r}; no gradient noise multiplier exists")


def budget_class():
    import per_example_grads as peg

    try:
        return peg.dp.PrivacyBudget
    except AttributeError:
        need(False, "peg.dp.PrivacyBudget does not exist in this version")


@case("accounting", words=("epsilon",), tf=False)
def budget_negative_epsilon():
    """peg.dp.PrivacyBudget(epsilon=-1, delta=1e-5)."""
    b = budget_class()(epsilon=-1.0, delta=DELTA)
    return silent(f"accepted epsilon=-1: max_steps {b.max_steps(noise_multiplier=1.1, sampling_probability=0.01)}")


@case("accounting", words=("steps", "epsilon"), tf=False)
def budget_steps_and_epsilon():
    """peg.dp.PrivacyBudget(epsilon=1, delta=1e-5, steps=3): two limits."""
    b = budget_class()(epsilon=1.0, delta=DELTA, steps=3)
    return silent(f"accepted both: max_steps {b.max_steps(noise_multiplier=1.1, sampling_probability=0.01)}")


@case("accounting", words=("delta",), tf=False)
def budget_delta_nan():
    """peg.dp.PrivacyBudget(epsilon=1, delta=nan)."""
    b = budget_class()(epsilon=1.0, delta=float("nan"))
    return silent(f"accepted delta=nan: max_steps {b.max_steps(noise_multiplier=1.1, sampling_probability=0.01)}")


@case("accounting", words=("epsilon",), tf=False)
def budget_tiny_epsilon():
    """PrivacyBudget(epsilon=1e-6, delta=1e-5).max_steps(1.1, 0.01): right = 0 (one step already costs more)."""
    steps = budget_class()(epsilon=1e-6, delta=DELTA).max_steps(noise_multiplier=1.1, sampling_probability=0.01)
    one = ref_epsilon(1.1, 0.01, 1)
    if steps == 0 and one > 1e-6:
        return right(f"max_steps 0; one step costs epsilon {one:.3g}")
    return silent(f"max_steps {steps}; one step already costs epsilon {one:.3g}")


# =============================================================================
# pegrad (the CLI, in a subprocess)
# =============================================================================


def run_cli(args: list[str], cwd: str, timeout: float, tensorflow: bool) -> dict:
    """``python -m per_example_grads.apps.cli ARGS`` in ``cwd`` (not the checkout: ``-m`` puts cwd on sys.path)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MALLOC_ARENA_MAX="2")
    limit = int(CLI_MEMORY_GB[tensorflow] * 2**30)

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "per_example_grads.apps.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit_memory,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return dict(rc=proc.returncode, out=out, err=err, seconds=time.monotonic() - start, timed_out=timed_out)


def cli_budget() -> float:
    """What is left of the case's time limit for its ``pegrad`` child."""
    return max(5.0, CURRENT_TIMEOUT - (time.monotonic() - CASE_START) - 0.5)


def cli_failure(r: dict, command: str, words: tuple) -> Verdict | None:
    """The verdict for a CLI run that did not succeed; None when it exited 0."""
    if r["timed_out"]:
        return crash(f"still running after {r['seconds']:.0f} s (killed)")
    err = r["err"]
    if "Traceback (most recent call last)" in err:
        last = [line for line in err.splitlines() if line.strip()][-1]
        return crash(f"exit {r['rc']}, traceback: {one_line(last, 120)}")
    if r["rc"] == 0:
        return None
    if r["rc"] < 0:
        tail = [line for line in err.splitlines() if line.strip()][-1:] or [""]
        return crash(f"killed by signal {-r['rc']}: {one_line(tail[0], 100)}")
    lines = [line for line in err.splitlines() if line.startswith(f"pegrad {command}: error:")]
    if r["rc"] in (1, 2) and len(lines) == 1:
        ok, missing = names_words(words, lines[0])
        if ok:
            return clear(f"exit {r['rc']}: {one_line(lines[0], 130)}")
        return crash(f"exit {r['rc']}, message does not name {missing}: {one_line(lines[0], 110)}")
    tail = [line for line in err.splitlines() if line.strip()][-1:] or ["(no stderr)"]
    return crash(f"exit {r['rc']}: {one_line(tail[0], 130)}")


@contextlib.contextmanager
def scratch():
    folder = tempfile.mkdtemp(prefix="bad_inputs_")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def epsilon_cli(extra: list[str], words: tuple, check: Callable[[str], Verdict], base=None) -> Verdict:
    args = base if base is not None else ["--num-examples", "60000", "--batch-size", "256"]
    with scratch() as folder:
        r = run_cli(["epsilon", *args, *extra], folder, cli_budget(), tensorflow=False)
    return cli_failure(r, "epsilon", words) or check(r["out"] + "\n" + r["err"])


def printed(text: str, label: str) -> float | None:
    m = re.search(rf"{label} = ([-+0-9.eEinfa]+)", text)
    return float(m.group(1)) if m else None


@case("cli", words=(("--target-epsilon", "epsilon", "noise"),), tf=False, alone=True)
def cli_epsilon_target_1e9():
    """pegrad epsilon --num-examples 60000 --batch-size 256 --epochs 60 --target-epsilon 1e9 --delta 1e-5."""

    def check(text):
        sigma = printed(text, "noise multiplier")
        if sigma is None:
            return silent(f"exit 0 without a noise multiplier: {one_line(text, 100)}")
        rdp = ref_epsilon(sigma, 256 / 60000, math.ceil(60 * 60000 / 256), accountant="rdp")
        if rdp <= 1e9:
            return right(f"sigma {sigma:g}: dp_accounting's RDP epsilon {rdp:.4g} <= 1e9")
        return silent(f"sigma {sigma:g}: dp_accounting's RDP epsilon {rdp:.4g} > 1e9")

    return epsilon_cli(
        ["--epochs", "60", "--target-epsilon", "1e9", "--delta", "1e-5"], CASES["cli_epsilon_target_1e9"].words, check
    )


@case("cli", words=(("--epochs", "steps", "memory", "accountant"),), tf=False, alone=True)
def cli_epsilon_epochs_1e12():
    """pegrad epsilon --num-examples 60000 --batch-size 256 --epochs 1e12 --noise-multiplier 1.1 --delta 1e-5."""

    def check(text):
        eps = printed(text, "epsilon")
        if eps is None:
            return silent(f"exit 0 without an epsilon: {one_line(text, 100)}")
        return bounded_by_rdp(eps, 1.1, 256 / 60000, math.ceil(1e12 * 60000 / 256))

    return epsilon_cli(
        ["--epochs", "1e12", "--noise-multiplier", "1.1", "--delta", "1e-5"],
        CASES["cli_epsilon_epochs_1e12"].words,
        check,
    )


def no_output_expected(text: str) -> Verdict:
    return silent(f"exit 0: {one_line(text, 120)}")


@case("cli", words=("--delta",), tf=False)
def cli_epsilon_delta_zero():
    """pegrad epsilon ... --delta 0."""
    return epsilon_cli(["--epochs", "1", "--noise-multiplier", "1.1", "--delta", "0"], ("--delta",), no_output_expected)


@case("cli", words=("--epochs",), tf=False)
def cli_epsilon_epochs_nan():
    """pegrad epsilon ... --epochs nan."""
    return epsilon_cli(
        ["--epochs", "nan", "--noise-multiplier", "1.1", "--delta", "1e-5"], ("--epochs",), no_output_expected
    )


@case("cli", words=("--batch-size",), tf=False)
def cli_epsilon_batch_above_n():
    """pegrad epsilon --num-examples 100 --batch-size 256 ..."""
    return epsilon_cli(
        ["--epochs", "1", "--noise-multiplier", "1.1", "--delta", "1e-5"],
        ("--batch-size",),
        no_output_expected,
        base=["--num-examples", "100", "--batch-size", "256"],
    )


@case("cli", words=("--steps", "--epochs"), tf=False)
def cli_epsilon_epochs_and_steps():
    """pegrad epsilon ... --epochs 1 --steps 10: two lengths."""
    return epsilon_cli(
        ["--epochs", "1", "--steps", "10", "--noise-multiplier", "1.1", "--delta", "1e-5"],
        ("--steps", "--epochs"),
        no_output_expected,
    )


@case("cli", words=("--noise-multiplier",), tf=False)
def cli_epsilon_no_noise():
    """pegrad epsilon ... --noise-multiplier 0: right = epsilon inf."""

    def check(text):
        eps = printed(text, "epsilon")
        return right("prints epsilon = inf") if eps == math.inf else silent(f"printed epsilon {eps!r} without noise")

    return epsilon_cli(["--epochs", "1", "--noise-multiplier", "0", "--delta", "1e-5"], ("--noise-multiplier",), check)


@case("cli", words=("--delta",), tf=False)
def cli_epsilon_delta_over_1_over_n():
    """pegrad epsilon --num-examples 100 --batch-size 10 --epochs 1 --noise-multiplier 1.1 --delta 0.05: right = the number and a warning."""

    def check(text):
        eps = printed(text, "epsilon")
        expected = ref_epsilon(1.1, 0.1, 10, 0.05)
        if eps is None or not same_number(eps, expected, 1e-4):
            return silent(f"printed epsilon {eps!r}; right {expected:.6g}")
        if re.search(r"warning.*delta", text, re.IGNORECASE):
            return right(f"epsilon {eps:g} = dp_accounting's, with a warning about delta")
        return silent(f"epsilon {eps:g} for delta >= 1/N, no warning")

    return epsilon_cli(
        ["--epochs", "1", "--noise-multiplier", "1.1", "--delta", "0.05"],
        ("--delta",),
        check,
        base=["--num-examples", "100", "--batch-size", "10"],
    )


def demo_cli(extra: list[str], words: tuple, folder: str) -> Verdict | dict:
    r = run_cli(["demo", "--fast", *extra], folder, cli_budget(), tensorflow=True)
    return cli_failure(r, "demo", words) or r


@case("cli", words=("--seed",), tf=False)
def cli_demo_seed_negative():
    """pegrad demo --fast --seed -1."""
    with scratch() as folder:
        r = demo_cli(["--seed", "-1", "--out", os.path.join(folder, "out")], ("--seed",), folder)
    return r if isinstance(r, Verdict) else silent("exit 0: ran with --seed -1")


@case("cli", words=(("--out", "out.txt"),), tf=False)
def cli_demo_out_existing_file():
    """pegrad demo --fast --out <an existing file>."""
    with scratch() as folder:
        path = os.path.join(folder, "out.txt")
        with open(path, "w") as f:
            f.write("keep me\n")
        r = demo_cli(["--out", path], CASES["cli_demo_out_existing_file"].words, folder)
        intact = open(path).read() == "keep me\n" if os.path.isfile(path) else False
    if isinstance(r, Verdict):
        if not intact:
            return silent(f"the file given as --out was overwritten or removed ({r.outcome}: {r.detail})")
        return r
    return silent(f"exit 0 with --out an existing file (file intact: {intact})")


@case("cli", words=(("--out", "out.txt"),), tf=False)
def cli_demo_out_under_file():
    """pegrad demo --fast --out <a file>/sub."""
    with scratch() as folder:
        path = os.path.join(folder, "out.txt")
        with open(path, "w") as f:
            f.write("keep me\n")
        r = demo_cli(["--out", os.path.join(path, "sub")], CASES["cli_demo_out_under_file"].words, folder)
    return r if isinstance(r, Verdict) else silent("exit 0 with --out under a file")


@case("cli", words=(("not found", "none.keras", "none.npz"),), tf=False)
def cli_diagnose_missing_files():
    """pegrad diagnose none.keras none.npz (neither exists)."""
    with scratch() as folder:
        r = run_cli(
            [
                "diagnose",
                os.path.join(folder, "none.keras"),
                os.path.join(folder, "none.npz"),
                "--out",
                os.path.join(folder, "out"),
            ],
            folder,
            cli_budget(),
            tensorflow=True,
        )
    return cli_failure(r, "diagnose", CASES["cli_diagnose_missing_files"].words) or silent("exit 0 without the files")


@case("cli", words=(("nan", "finite", "non-finite", "nonfinite"),))
def cli_diagnose_nan_row():
    """pegrad diagnose model.keras data.npz with one NaN row: crash if a traceback, silent if tr(Sigma) is NaN."""
    np = modules()[0]
    net = mlp()
    net.compile(optimizer="sgd", loss=sce())
    x, y = data(64)
    x[5] = np.nan
    with scratch() as folder:
        model_path, data_path, out = (os.path.join(folder, n) for n in ("m.keras", "d.npz", "out"))
        net.save(model_path)
        np.savez(data_path, x=x, y=y)
        r = run_cli(["diagnose", model_path, data_path, "--out", out], folder, cli_budget(), tensorflow=True)
        failed = cli_failure(r, "diagnose", CASES["cli_diagnose_nan_row"].words)
        if failed:
            return failed
        report_path = os.path.join(out, "report.json")
        if not os.path.isfile(report_path):
            return silent("exit 0 but no report.json")
        with open(report_path) as f:
            text = f.read()
    report = json.loads(text.replace("NaN", "null").replace("-Infinity", "null").replace("Infinity", "null"))
    trace = _find_key(report, "trace_covariance")
    if trace is None or (isinstance(trace, float) and not math.isfinite(trace)):
        return silent(f"exit 0; report.json trace_covariance = {trace!r} (NaN) from one NaN row")
    loop = loop_grads(net, x, y)
    keep = np.isfinite(norms64(loop))
    expected = float(sum(np.sum(np.var(g[keep].reshape(int(keep.sum()), -1), axis=0, ddof=1)) for g in loop))
    if same_number(float(trace), expected, 1e-3):
        return right(f"exit 0; trace_covariance {trace:.4g} = that of the 63 finite rows")
    return silent(f"exit 0; trace_covariance {trace:.4g}; the 63 finite rows give {expected:.4g}")


def _find_key(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


# =============================================================================
# DPModel
# =============================================================================


@case("dp_model", words=("num_examples",))
def dpmodel_num_examples_too_large_arrays():
    """DPModel(num_examples=60000, expected_batch_size=16).fit on 64 rows, batch 16, 5 epochs: right = refuse or epsilon for N=64."""
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, num_examples=60_000, expected_batch_size=16, seed=0)
    fit(dp, x, y, batch_size=16, epochs=5)
    return judge_epsilon(
        epsilon_of(dp), ref_epsilon(1.0, 16 / 64, 20), "N=64, 20 steps", {"N=60000": ref_epsilon(1.0, 16 / 60000, 20)}
    )


@case("dp_model", words=("num_examples",))
def dpmodel_num_examples_too_large_dataset():
    """As above, on tf.data.Dataset.from_tensor_slices((x, y)).batch(16)."""
    tf = modules()[1]
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, num_examples=60_000, expected_batch_size=16, seed=0)
    fit(dp, tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=5)
    return judge_epsilon(
        epsilon_of(dp), ref_epsilon(1.0, 16 / 64, 20), "N=64, 20 steps", {"N=60000": ref_epsilon(1.0, 16 / 60000, 20)}
    )


@case("dp_model", words=("num_examples",))
def dpmodel_num_examples_validation_split():
    """DPModel(num_examples=60000).fit(64 rows, validation_split=0.5): right = refuse or epsilon for N=32."""
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, num_examples=60_000, expected_batch_size=16, seed=0)
    fit(dp, x, y, batch_size=16, epochs=5, validation_split=0.5)
    return judge_epsilon(
        epsilon_of(dp),
        ref_epsilon(1.0, 16 / 32, 10),
        "N=32, 10 steps",
        {"N=60000": ref_epsilon(1.0, 16 / 60000, 10), "N=64": ref_epsilon(1.0, 16 / 64, 10)},
    )


@case("dp_model", words=("num_examples",))
def dpmodel_default_n_validation_split():
    """DPModel() without num_examples, fit(64 rows, validation_split=0.5): right = epsilon for the 32 rows it trains on."""
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, seed=0)
    fit(dp, x, y, batch_size=16, epochs=5, validation_split=0.5)
    return judge_epsilon(
        epsilon_of(dp), ref_epsilon(1.0, 16 / 32, 10), "N=32, 10 steps", {"N=64": ref_epsilon(1.0, 16 / 64, 10)}
    )


@case("dp_model", words=(("num_examples", "repeat"),))
def dpmodel_dataset_repeat():
    """DPModel().fit(from_tensor_slices(64 rows).repeat(2).batch(16), epochs=2): 64 distinct examples; right = epsilon for N=64."""
    tf = modules()[1]
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, seed=0)
    fit(dp, tf.data.Dataset.from_tensor_slices((x, y)).repeat(2).batch(16), epochs=2)
    steps = steps_of(dp)
    return judge_epsilon(
        epsilon_of(dp),
        ref_epsilon(1.0, 16 / 64, steps),
        f"N=64, {steps} steps",
        {"N=128 (the repeated rows counted as examples)": ref_epsilon(1.0, 16 / 128, steps)},
    )


@case("dp_model", words=(("outside", "changed", "trained"),))
def dpmodel_trained_outside():
    """After dp.fit, dp.model.compile + dp.model.fit; then dp.epsilon(): unchanged = silent, refusal = clear."""
    x, y = data(64)
    net = mlp()
    dp = dp_model(net, noise_multiplier=1.0, seed=0)
    fit(dp, x, y, batch_size=16, epochs=1)
    before = epsilon_of(dp)
    net.compile(optimizer="sgd", loss=sce())
    with quiet():
        net.fit(x, y, epochs=2, verbose=0)
    after = epsilon_of(dp)
    if after == math.inf:
        return right("epsilon inf after non-private training")
    return silent(f"epsilon {after:.4g} (was {before:.4g}) after 2 non-private epochs of dp.model.fit")


@case("dp_model", words=(("another", "already", "wrapped"),))
def dpmodel_second_wrapper_after_training():
    """Two DPModels on one network, the second made after the first trained: right = refuse, or one ledger for both."""
    x, y = data(64)
    net = mlp()
    first = dp_model(net, noise_multiplier=1.0, seed=0)
    fit(first, x, y, batch_size=16, epochs=1)
    second = dp_model(net, noise_multiplier=1.0, seed=1)
    fit(second, x, y, batch_size=16, epochs=1)
    total, own = steps_of(first) + steps_of(second), steps_of(second)
    return judge_epsilon(
        epsilon_of(second),
        ref_epsilon(1.0, 0.25, total),
        f"all {total} steps the network took",
        {f"its own {own} steps only": ref_epsilon(1.0, 0.25, own)},
    )


@case("dp_model", words=(("another", "wrapped", "outside", "changed"),))
def dpmodel_first_after_second_trained():
    """dp1 and dp2 wrap one network; dp2 trains it; then dp1.epsilon(): right = refuse, or the steps dp2 took."""
    x, y = data(64)
    net = mlp()
    first = dp_model(net, noise_multiplier=1.0, num_examples=64, expected_batch_size=16, seed=0)
    second = dp_model(net, noise_multiplier=1.0, seed=1)
    fit(second, x, y, batch_size=16, epochs=1)
    steps = steps_of(second)
    return judge_epsilon(
        epsilon_of(first), ref_epsilon(1.0, 0.25, steps), f"the {steps} steps dp2 took", {"no steps": 0.0}
    )


@case("dp_model", words=("loss_weights",))
def dpmodel_loss_weights():
    """DPModel.compile(loss_weights=[2.0]): right = refuse, or a step twice as large (noise 0, no clipping)."""
    np, tf, keras, peg = modules()
    x, y = data(16)
    net = mlp()
    dp = peg.keras.DPModel(net, l2_norm_clip=1e6, noise_multiplier=0.0, seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=sce(), loss_weights=[2.0])
    w0 = [v.numpy().astype(np.float64) for v in net.trainable_variables]
    with tf.GradientTape() as tape:
        mean = tf.reduce_mean(example_loss(y, net(x)))
    g = [as_numpy(t) for t in tape.gradient(mean, net.trainable_variables)]
    fit(dp, x, y, batch_size=16, epochs=1, shuffle=False)
    moved = [v.numpy() - w for v, w in zip(net.trainable_variables, w0)]
    if close(moved, [-0.1 * 2 * t for t in g], rtol=1e-3, atol=1e-6):
        return right("the step is that of loss 2 * L")
    if close(moved, [-0.1 * t for t in g], rtol=1e-3, atol=1e-6):
        return silent("accepted loss_weights=[2.0] and ignored it: the step is that of loss L")
    return silent(
        f"accepted loss_weights=[2.0]; the step matches neither L nor 2L (max diff {max_diff(moved, [-0.2 * t for t in g])})"
    )


@case("dp_model", words=("loss",))
def dpmodel_loss_list():
    """DPModel.compile(loss=[loss, loss]) for a one-output model."""
    _, _, keras, peg = modules()
    dp = peg.keras.DPModel(mlp(), noise_multiplier=1.0, seed=0)
    dp.compile(optimizer="sgd", loss=[sce(), sce()])
    x, y = data(64)
    fit(dp, x, y, batch_size=16, epochs=1)
    return silent(f"accepted two losses for one output; fit ran {steps_of(dp)} steps")


def dpmodel_with(**kw):
    _, _, _, peg = modules()
    return lambda: dp_model(**{"noise_multiplier": 1.0, **kw})


@case("dp_model", words=("seed",))
def dpmodel_seed_string():
    """DPModel(seed="a")."""
    return accepted_then_trained(dpmodel_with(seed="a"), "seed='a'")


@case("dp_model", words=("seed",))
def dpmodel_seed_float():
    """DPModel(seed=1.5)."""
    return accepted_then_trained(dpmodel_with(seed=1.5), "seed=1.5")


@case("dp_model", words=("method",))
def dpmodel_method_bogus():
    """DPModel(method="bogus"): clear only if refused at construction."""
    x, y = data(64)
    dp = dpmodel_with(method="bogus")()
    try:
        fit(dp, x, y, batch_size=16, epochs=1)
    except Exception as e:  # noqa: BLE001 - too late either way
        return silent(f"accepted at construction; fit then raised {describe(e)}")
    return silent(f"accepted method='bogus'; fit ran {steps_of(dp)} steps")


@case("dp_model", words=("l2_norm_clip",))
def dpmodel_clip_nan():
    """DPModel(l2_norm_clip=nan)."""
    return accepted_then_trained(dpmodel_with(l2_norm_clip=float("nan")), "l2_norm_clip=nan")


@case("dp_model", words=("l2_norm_clip",))
def dpmodel_clip_zero():
    """DPModel(l2_norm_clip=0)."""
    return accepted_then_trained(dpmodel_with(l2_norm_clip=0.0), "l2_norm_clip=0")


@case("dp_model", words=("l2_norm_clip",))
def dpmodel_clip_string():
    """DPModel(l2_norm_clip="1.0")."""
    return accepted_then_trained(dpmodel_with(l2_norm_clip="1.0"), "l2_norm_clip='1.0'")


@case("dp_model", words=("noise_multiplier",))
def dpmodel_noise_nan():
    """DPModel(noise_multiplier=nan)."""
    return accepted_then_trained(dpmodel_with(noise_multiplier=float("nan")), "noise_multiplier=nan")


@case("dp_model", words=("noise_multiplier",))
def dpmodel_noise_negative():
    """DPModel(noise_multiplier=-1)."""
    return accepted_then_trained(dpmodel_with(noise_multiplier=-1.0), "noise_multiplier=-1")


@case("dp_model", words=("noise_multiplier",))
def dpmodel_noise_inf():
    """DPModel(noise_multiplier=inf)."""
    return accepted_then_trained(dpmodel_with(noise_multiplier=float("inf")), "noise_multiplier=inf")


@case("dp_model", words=("expected_batch_size",))
def dpmodel_expected_batch_size_nan():
    """DPModel(expected_batch_size=nan)."""
    return accepted_then_trained(dpmodel_with(expected_batch_size=float("nan")), "expected_batch_size=nan")


@case("dp_model", words=("expected_batch_size",))
def dpmodel_expected_batch_size_zero():
    """DPModel(expected_batch_size=0)."""
    return accepted_then_trained(dpmodel_with(expected_batch_size=0), "expected_batch_size=0")


@case("dp_model", words=("num_examples",))
def dpmodel_num_examples_zero():
    """DPModel(num_examples=0)."""
    return accepted_then_trained(dpmodel_with(num_examples=0), "num_examples=0")


@case("dp_model", words=("num_examples",))
def dpmodel_num_examples_fractional():
    """DPModel(num_examples=63.5)."""
    return accepted_then_trained(dpmodel_with(num_examples=63.5), "num_examples=63.5")


@case("dp_model", words=("physical_batch_size",))
def dpmodel_physical_batch_size_zero():
    """DPModel(physical_batch_size=0)."""
    return accepted_then_trained(dpmodel_with(physical_batch_size=0), "physical_batch_size=0")


@case("dp_model", words=("delta",))
def dpmodel_epsilon_delta_nan():
    """dp.epsilon(delta=nan) after a fit."""
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, seed=0)
    fit(dp, x, y, batch_size=16, epochs=1)
    return silent(f"epsilon(nan) = {epsilon_of(dp, float('nan'))!r}")


@case("dp_model", words=("delta",))
def dpmodel_epsilon_delta_zero():
    """dp.epsilon(delta=0) after a fit: right = refuse or inf."""
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, seed=0)
    fit(dp, x, y, batch_size=16, epochs=1)
    got = epsilon_of(dp, 0.0)
    return right("epsilon(0) = inf") if got == math.inf else silent(f"epsilon(0) = {got!r}; right: inf")


@case("dp_model", words=("num_examples",))
def dpmodel_epsilon_before_fit():
    """DPModel() without num_examples, epsilon(1e-5) before any step: right = 0.0, or refuse naming num_examples."""
    dp = dp_model(noise_multiplier=1.0, seed=0)
    got = epsilon_of(dp)
    return right("epsilon 0.0 before any step") if got == 0.0 else silent(f"epsilon {got!r} before any step")


@case("dp_model", words=("budget",))
def dpmodel_budget_not_a_budget():
    """DPModel(budget=5.0)."""
    _, _, _, peg = modules()
    need_param(peg.keras.DPModel.__init__, "budget", "DPModel")
    return accepted_then_trained(dpmodel_with(budget=5.0), "budget=5.0")


@case("dp_model", words=(("budget", "steps"),))
def dpmodel_backup_restore_budget():
    """BackupAndRestore(save_freq=3) restoring a run killed after 6 steps, budget PrivacyBudget(steps=10): right = 10 steps in all."""
    _, _, keras, peg = modules()
    need_param(peg.keras.DPModel.__init__, "budget", "DPModel")
    budget = budget_class()
    x, y = data(64)

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.dp_steps.numpy()) >= 6:
                raise RuntimeError("simulated kill")

    def run(callbacks):
        dp = dp_model(noise_multiplier=1.0, seed=0, budget=budget(steps=10))
        fit(dp, x, y, batch_size=16, epochs=5, callbacks=callbacks)
        return dp

    uninterrupted = steps_of(run([]))
    with scratch() as folder:
        backup = os.path.join(folder, "backup")
        try:
            run([keras.callbacks.BackupAndRestore(backup, save_freq=3), Kill()])
        except RuntimeError as e:
            if "simulated kill" not in str(e):
                raise
        else:
            return crash("the simulated kill did not stop the first run")
        restored = run([keras.callbacks.BackupAndRestore(backup, save_freq=3)])
    got = steps_of(restored)
    if got == uninterrupted <= 10:
        return right(f"the restored run stops at {got} steps, as an uninterrupted one")
    return silent(f"the restored run's ledger ends at {got} steps; uninterrupted: {uninterrupted}, budget 10")


@case("dp_model", words=(("empty", "no data", "0 examples", "no examples", "zero", "non-empty", "num_examples"),))
def dpmodel_fit_empty():
    """DPModel.fit on 0 rows."""
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, seed=0)
    fit(dp, x[:0], y[:0], batch_size=16, epochs=1)
    try:
        eps = f"{epsilon_of(dp):.4g}"
    except Exception as e:  # noqa: BLE001 - reported
        eps = f"raises {describe(e)}"
    return silent(
        f"fit on 0 rows returned after {steps_of(dp)} DP step(s); num_examples {dp.num_examples!r}; epsilon {eps}"
    )


@case("dp_model", words=(("expected_batch_size", "sampling_probability", "q="),))
def dpmodel_poisson_q_mismatch():
    """DPModel(expected_batch_size=16, num_examples=64) fit on poisson_batches(q=0.5): right = refuse, or epsilon at q=0.5."""
    _, _, _, peg = modules()
    x, y = data(64)
    dp = dp_model(noise_multiplier=1.0, expected_batch_size=16, num_examples=64, seed=0)
    fit(dp, peg.dp.poisson_batches(x, y, sampling_probability=0.5, seed=0), epochs=1)
    steps = steps_of(dp)
    return judge_epsilon(
        epsilon_of(dp),
        ref_epsilon(1.0, 0.5, steps),
        f"q=0.5, {steps} steps",
        {"q=16/64": ref_epsilon(1.0, 0.25, steps)},
    )


@case("dp_model", words=("activity_regularizer",))
def dpmodel_activity_regularizer():
    """DPModel of a network with an activity regularizer (a batch-coupled penalty)."""
    return accepted_then_trained(
        lambda: dp_model(mlp(activity_regularizer="l2"), noise_multiplier=1.0, seed=0), "an activity_regularizer"
    )


@case("dp_model", words=("target_quantile",))
def adaptive_clipping_quantile_above_one():
    """peg.dp.AdaptiveClipping(target_quantile=1.5)."""
    _, _, _, peg = modules()
    a = peg.dp.AdaptiveClipping(target_quantile=1.5)
    return silent(f"accepted {a!r}")


# =============================================================================
# private_gradients
# =============================================================================


@case("private", words=("seed",), alone=True)  # alone: the library remembers the seeds a process used
def private_repeated_seed():
    """peg.dp.private_gradients(..., seed=0) twice on one batch: identical noise without a warning = silent."""
    np = modules()[0]
    x, y = data(8)
    net = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = private(x, y, net, hide_warnings=False, seed=0)
        second = private(x, y, net, hide_warnings=False, seed=0)
    warned = [
        w
        for w in caught
        if "seed" in str(w.message).lower()
        or "noise" in str(w.message).lower()
        or type(w.message).__name__ == "RepeatedNoiseWarning"
    ]
    same = all(np.array_equal(as_numpy(a), as_numpy(b)) for a, b in zip(first, second))
    if not same:
        return right("a repeated seed gave fresh noise")
    if warned:
        return clear(f"{type(warned[0].message).__name__}: {one_line(warned[0].message, 110)}")
    return silent("identical noise in both releases, no warning")


def private_refused(what: str, **kw) -> Verdict:
    np = modules()[0]
    grads = private(**kw)
    finite = all(np.all(np.isfinite(as_numpy(g))) for g in grads)
    return silent(f"accepted {what}; returned {'finite' if finite else 'non-finite'} gradients")


@case("private", words=("l2_norm_clip",))
def private_clip_nan():
    """private_gradients(l2_norm_clip=nan)."""
    return private_refused("l2_norm_clip=nan", l2_norm_clip=float("nan"))


@case("private", words=("l2_norm_clip",))
def private_clip_none():
    """private_gradients(l2_norm_clip=None)."""
    return private_refused("l2_norm_clip=None", l2_norm_clip=None)


@case("private", words=("l2_norm_clip",))
def private_clip_negative():
    """private_gradients(l2_norm_clip=-1)."""
    return private_refused("l2_norm_clip=-1", l2_norm_clip=-1.0)


@case("private", words=("noise_multiplier",))
def private_noise_nan():
    """private_gradients(noise_multiplier=nan)."""
    return private_refused("noise_multiplier=nan", noise_multiplier=float("nan"))


@case("private", words=("noise_multiplier",))
def private_noise_negative():
    """private_gradients(noise_multiplier=-1)."""
    return private_refused("noise_multiplier=-1", noise_multiplier=-1.0)


@case("private", words=("expected_batch_size",))
def private_expected_batch_size_zero():
    """private_gradients(expected_batch_size=0)."""
    return private_refused("expected_batch_size=0", expected_batch_size=0)


@case("private", words=("expected_batch_size",))
def private_expected_batch_size_inf():
    """private_gradients(expected_batch_size=inf)."""
    return private_refused("expected_batch_size=inf", expected_batch_size=float("inf"))


@case("private", words=("seed",))
def private_seed_string():
    """private_gradients(seed="abc")."""
    return private_refused("seed='abc'", seed="abc")


@case("private", words=(("l2_norm_clip", "nonexistent", "layer"),))
def private_clip_dict_unknown_layer():
    """private_gradients(l2_norm_clip={"nonexistent": 1.0}): no clip norm for the model's layers."""
    return private_refused("a clip dict naming no layer of the model", l2_norm_clip={"nonexistent": 1.0})


@case("private", words=(("empty", "no examples", "0 examples", "batch"),))
def private_empty_batch():
    """private_gradients on 0 rows, noise 0, expected_batch_size=4: right = zeros."""
    np = modules()[0]
    x, y = data(8)
    net = mlp()
    grads = private(x[:0], y[:0], net, noise_multiplier=0.0, expected_batch_size=4)
    shapes_ok = [tuple(np.shape(as_numpy(g))) for g in grads] == [tuple(v.shape) for v in net.trainable_variables]
    if shapes_ok and all(np.all(as_numpy(g) == 0) for g in grads):
        return right("zeros of the variables' shapes")
    return silent(f"returned {[np.shape(as_numpy(g)) for g in grads]}, not zeros")


@case("private", words=("noise_multiplier",))
def private_no_noise():
    """private_gradients(noise_multiplier=0, l2_norm_clip=0.5, expected_batch_size=8): right = the loop's clipped mean."""
    x, y = data(8)
    net = mlp()
    grads = private(x, y, net, noise_multiplier=0.0, l2_norm_clip=0.5, expected_batch_size=8)
    expected = [s / 8 for s in clipped_sum64(loop_grads(net, x, y), 0.5)]
    if close(grads, expected):
        return right("= sum of clipped loop gradients / 8")
    return silent(f"differs from the loop's clipped mean by {max_diff(grads, expected)}")


# =============================================================================
# per_example_gradients, per_example_norms, clipped_gradients
# =============================================================================


def peg_grads(net, x, y, **kw):
    _, _, _, peg = modules()
    with quiet():
        return peg.per_example_gradients(net, sce(), x, y, **kw)


@case("gradients", words=(("incompatible", "expected axis", "shape"),), forbid=(MASKED,), any_type=True)
def grads_wrong_feature_size():
    """per_example_gradients with x of 5 features for a 4-feature model: clear = the model's own message."""
    np = modules()[0]
    net = mlp()
    x = np.ones((8, 5), "float32")
    y = np.zeros(8, "int32")
    return versus_model(lambda: net(x), lambda: peg_grads(net, x, y), ("incompatible", "expected axis"))


@case("gradients", words=("b",), forbid=(MASKED,), any_type=True)
def grads_missing_dict_key():
    """per_example_gradients on a two-input model given only x={"a": ...}: clear = the model's own message."""
    np, _, keras, _ = modules()
    a, b = keras.Input((2,), name="a"), keras.Input((2,), name="b")
    out = keras.layers.Dense(3)(keras.layers.Concatenate()([a, b]))
    net = keras.Model({"a": a, "b": b}, out)
    x = {"a": np.ones((8, 2), "float32")}
    y = np.zeros(8, "int32")
    return versus_model(lambda: net(x), lambda: peg_grads(net, x, y), ("'b'", "missing"))


@case("gradients", words=("label",), forbid=(MASKED,), any_type=True)
def grads_labels_out_of_range():
    """per_example_gradients with label 7 for 3 classes: clear = the loss's own message."""
    np = modules()[0]
    net = mlp()
    x, _ = data(8)
    y = np.full(8, 7, "int32")
    return versus_model(lambda: example_loss(y, net(x)), lambda: peg_grads(net, x, y), ("label",))


def gpt2():
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=8
    )


def sequence_loss(y, outputs):
    tf = modules()[1]
    return tf.reduce_mean(tf.square(outputs), axis=[1, 2])


def hub_grads(net, x):
    _, _, _, peg = modules()
    with quiet():
        return peg.per_example_gradients(net, sequence_loss, x, None)


@case("gradients", words=("padding_mask",), forbid=(MASKED,), any_type=True)
def grads_gpt2_without_padding_mask():
    """per_example_gradients on a tiny KerasHub GPT2Backbone given token_ids only: clear = the model's own message."""
    np = modules()[0]
    net = gpt2()
    x = {"token_ids": np.ones((4, 8), "int32")}
    return versus_model(lambda: net(x), lambda: hub_grads(net, x), ("padding_mask",))


@case("gradients", words=(("sequence", "8", "12", "shape"),), forbid=(MASKED,), any_type=True)
def grads_gpt2_sequence_too_long():
    """A tiny GPT2Backbone (max_sequence_length=8) given 12 tokens: clear = the model's own message."""
    np = modules()[0]
    net = gpt2()
    x = {"token_ids": np.ones((4, 12), "int32"), "padding_mask": np.ones((4, 12), "int32")}
    return versus_model(lambda: net(x), lambda: hub_grads(net, x), ("max_sequence_length", "sequence length"))


@case("gradients", words=(("x", "ragged"),))
def grads_ragged_x():
    """per_example_gradients with x a tf.RaggedTensor (uniform rows): right = the dense result, or refuse naming x."""
    _, tf, _, _ = modules()
    x, y = data(8)
    net = mlp()
    got = peg_grads(net, tf.RaggedTensor.from_tensor(x), y)
    expected = loop_grads(net, x, y)
    return (
        right("= the loop on the dense x")
        if close(got, expected)
        else silent(f"differs from the dense x by {max_diff(got, expected)}")
    )


@case("gradients", words=(("x", "sparse"),))
def grads_sparse_x():
    """per_example_gradients with x a tf.SparseTensor: right = the dense result, or refuse naming x."""
    _, tf, _, _ = modules()
    x, y = data(8)
    x[x < 0] = 0
    net = mlp()
    got = peg_grads(net, tf.sparse.from_dense(x), y)
    expected = loop_grads(net, x, y)
    return (
        right("= the loop on the dense x")
        if close(got, expected)
        else silent(f"differs from the dense x by {max_diff(got, expected)}")
    )


@case("gradients", words=("method",))
def grads_method_bogus():
    """per_example_gradients(method="bogus")."""
    x, y = data(8)
    peg_grads(mlp(), x, y, method="bogus")
    return silent("accepted method='bogus'")


@case("gradients", words=("sample_weight",))
def grads_sample_weight_wrong_length():
    """per_example_gradients(sample_weight of 5 rows for a batch of 8)."""
    np = modules()[0]
    x, y = data(8)
    got = peg_grads(mlp(), x, y, sample_weight=np.ones(5, "float32"))
    return silent(f"accepted; returned {[tuple(as_numpy(g).shape) for g in got]}")


@case("gradients", words=("x",))
def grads_x_none():
    """per_example_gradients(x=None)."""
    _, y = data(8)
    peg_grads(mlp(), None, y)
    return silent("accepted x=None")


@case("gradients", words=(("empty", "no examples", "0 examples", "batch"),))
def grads_empty_batch():
    """per_example_gradients on 0 rows: right = [0, *var.shape] entries."""
    x, y = data(8)
    net = mlp()
    got = peg_grads(net, x[:0], y[:0])
    shapes = [tuple(as_numpy(g).shape) for g in got]
    expected = [(0, *v.shape) for v in net.trainable_variables]
    return right("[0, *var.shape] per variable") if shapes == expected else silent(f"shapes {shapes}, right {expected}")


@case("gradients", words=(("loss", "scalar", "per example", "per-example"),))
def grads_scalar_loss():
    """per_example_gradients with a loss that returns one scalar for the batch."""
    _, tf, _, peg = modules()
    x, y = data(8)
    with quiet():
        got = peg.per_example_gradients(mlp(), lambda t, p: tf.reduce_mean(example_loss(t, p)), x, y)
    return silent(f"accepted a scalar loss; returned {[tuple(as_numpy(g).shape) for g in got]}")


@case("gradients", words=("x", "dtype"))
def grads_int_x():
    """per_example_gradients with int32 x for a float model: right = as for the same values in float32, or refuse naming x's dtype."""
    np = modules()[0]
    x = (np.arange(32).reshape(8, 4) % 5).astype("int32")
    y = (np.arange(8) % 3).astype("int32")
    net = mlp()
    got = peg_grads(net, x, y)
    expected = loop_grads(net, x.astype("float32"), y)
    return right("= the loop on float32 x") if close(got, expected) else silent(f"differs by {max_diff(got, expected)}")


@case("gradients", words=("x", "dtype"))
def grads_float64_x():
    """per_example_gradients with float64 x: right = as for float32 x."""
    x, y = data(8)
    net = mlp()
    got = peg_grads(net, x.astype("float64"), y)
    expected = loop_grads(net, x, y)
    return right("= the loop on float32 x") if close(got, expected) else silent(f"differs by {max_diff(got, expected)}")


@case("gradients", words=("y",))
def grads_y_missing():
    """per_example_gradients with y=None and a loss that needs labels."""
    x, _ = data(8)
    got = peg_grads(mlp(), x, None)
    return silent(f"accepted y=None; returned {[tuple(as_numpy(g).shape) for g in got]}")


@case("gradients", words=("variables",))
def grads_unused_variable():
    """per_example_gradients(variables=[..., a variable the loss does not reach]): right = zeros for it."""
    np, tf, _, _ = modules()
    x, y = data(8)
    net = mlp()
    extra = tf.Variable(tf.ones([3]))
    got = peg_grads(net, x, y, variables=[*net.trainable_variables, extra])
    expected = [*loop_grads(net, x, y), np.zeros((8, 3))]
    return (
        right("zeros for the unreached variable, the loop elsewhere")
        if close(got, expected)
        else silent(f"differs by {max_diff(got, expected)}")
    )


@case("gradients", words=("bogus",))
def norms_unknown_argument():
    """per_example_norms(..., bogus=1)."""
    _, _, _, peg = modules()
    x, y = data(8)
    with quiet():
        peg.per_example_norms(mlp(), sce(), x, y, bogus=1)
    return silent("accepted bogus=1 and ignored it")


@case("gradients", words=())
def norms_layerwise_activations_1e20():
    """per_example_norms(method="layerwise") on an MLP whose activations are 1e20: silent if inf/nan where the float64 loop norm is finite."""
    np, _, _, peg = modules()
    x, _ = data(8)
    x = x * np.float32(1e20)
    net = mlp()
    y = np.argmin(net(x).numpy(), axis=1).astype(
        "int32"
    )  # wrong predictions: gradients of size 1e20, squares past float32
    expected = norms64(loop_grads(net, x, y))
    need(np.all(np.isfinite(expected)), "the float64 reference itself is not finite")
    with quiet():
        layerwise = as_numpy(peg.per_example_norms(net, sce(), x, y, method="layerwise"))
        try:
            loop = as_numpy(peg.per_example_norms(net, sce(), x, y, method="loop"))
            loop_text = f"loop {np.max(loop):.3g}" if np.all(np.isfinite(loop)) else "loop non-finite too"
        except Exception as e:  # noqa: BLE001 - only reported
            loop_text = f"loop raised {type(e).__name__}"
    k = int(np.argmax(expected))
    if np.allclose(layerwise, expected, rtol=1e-3):
        return right(f"layerwise {layerwise[k]:.3g} = the float64 loop norm ({loop_text})")
    if not np.all(np.isfinite(layerwise)):
        bad = int(np.sum(~np.isfinite(layerwise)))
        return silent(
            f"layerwise gives {layerwise[k]} for {bad} of 8 examples where the float64 norm is {expected[k]:.3g} ({loop_text})"
        )
    return silent(f"layerwise {layerwise[k]:.3g}, float64 loop {expected[k]:.3g} ({loop_text})")


@case("gradients", words=("reduction",))
def clipped_reduction_bogus():
    """clipped_gradients(reduction="avg")."""
    _, _, _, peg = modules()
    x, y = data(8)
    with quiet():
        peg.clipped_gradients(mlp(), sce(), x, y, l2_norm_clip=1.0, reduction="avg")
    return silent("accepted reduction='avg'")


@case("gradients", words=("l2_norm_clip",))
def clipped_clip_nan():
    """clipped_gradients(l2_norm_clip=nan)."""
    _, _, _, peg = modules()
    x, y = data(8)
    with quiet():
        peg.clipped_gradients(mlp(), sce(), x, y, l2_norm_clip=float("nan"))
    return silent("accepted l2_norm_clip=nan")


@case("gradients", words=(("nan", "finite"),))
def clipped_nan_example():
    """clipped_gradients with one NaN row: right = the clipped sum of the finite examples (the NaN one contributes nothing)."""
    np, _, _, peg = modules()
    x, y = data(8)
    x[2] = np.nan
    net = mlp()
    with quiet():
        got = peg.clipped_gradients(net, sce(), x, y, l2_norm_clip=1.0)
    expected = clipped_sum64(loop_grads(net, x, y), 1.0, finite_only=True)
    if close(got, expected):
        return right("= the clipped sum over the 7 finite examples")
    finite = all(np.all(np.isfinite(as_numpy(g))) for g in got)
    return silent(
        f"{'finite' if finite else 'NaN'} sums, differing from the finite examples' by {max_diff(got, expected)}"
    )


# =============================================================================
# Transforms on per-example gradients
# =============================================================================


def grads_tensor():
    _, tf, _, _ = modules()
    return tf.reshape(tf.range(12, dtype=tf.float32), [4, 3])


@case("transforms", words=(("list", "grads"),))
def sum_examples_single_tensor():
    """peg.sum_examples(one [4, 3] tensor): right = [sum over axis 0], or refuse asking for a list."""
    np, _, _, peg = modules()
    g = grads_tensor()
    got = peg.sum_examples(g)
    expected = [np.sum(g.numpy(), axis=0)]
    return (
        right("treated as one variable")
        if close(got, expected)
        else silent(f"returned {len(got)} entries, each row summed as a variable")
    )


@case("transforms", words=(("list", "grads"),))
def mean_examples_single_tensor():
    """peg.mean_examples(one [4, 3] tensor)."""
    np, _, _, peg = modules()
    g = grads_tensor()
    got = peg.mean_examples(g)
    expected = [np.mean(g.numpy(), axis=0)]
    return (
        right("treated as one variable")
        if close(got, expected)
        else silent(f"returned {len(got)} entries, each row as a variable")
    )


@case("transforms", words=(("list", "grads"),))
def global_norms_single_tensor():
    """peg.global_norms(one [4, 3] tensor): right = the 4 row norms."""
    np, _, _, peg = modules()
    g = grads_tensor()
    got = peg.global_norms(g)
    expected = np.linalg.norm(g.numpy(), axis=1)
    return (
        right("the row norms")
        if close([got], [expected])
        else silent(f"returned shape {tuple(as_numpy(got).shape)}, not the 4 row norms")
    )


@case("transforms", words=("l2_norm_clip",))
def clip_by_global_norm_clip_nan():
    """peg.clip_by_global_norm([g], l2_norm_clip=nan)."""
    np, _, _, peg = modules()
    clipped, _ = peg.clip_by_global_norm([grads_tensor()], float("nan"))
    return silent(f"accepted nan; finite result: {bool(np.all(np.isfinite(as_numpy(clipped[0]))))}")


# =============================================================================
# compute_gradients
# =============================================================================


@case("compute_gradients", words=("l2_norm_clip",))
def compute_gradients_mean_with_clip():
    """peg.compute_gradients(mode="mean", l2_norm_clip=1e-6): right = refuse or the clipped mean; the unclipped mean = silent."""
    _, _, _, peg = modules()
    x, y = data(8)
    net = mlp()
    with quiet():
        pairs = peg.compute_gradients(net, sce(), x, y, mode="mean", l2_norm_clip=1e-6)
    got = [g for g, _ in pairs]
    loop = loop_grads(net, x, y)
    if close(got, [s / 8 for s in clipped_sum64(loop, 1e-6)], atol=1e-12):
        return right("the clipped mean")
    if close(got, [g.mean(axis=0) for g in loop]):
        return silent("accepted l2_norm_clip=1e-6 and returned the unclipped mean")
    return silent("matches neither the clipped nor the unclipped mean")


@case("compute_gradients", words=("mode",))
def compute_gradients_mode_bogus():
    """peg.compute_gradients(mode="average")."""
    _, _, _, peg = modules()
    x, y = data(8)
    with quiet():
        peg.compute_gradients(mlp(), sce(), x, y, mode="average")
    return silent("accepted mode='average'")


@case("compute_gradients", words=("l2_norm_clip",))
def compute_gradients_clipped_sum_without_clip():
    """peg.compute_gradients(mode="clipped_sum") without l2_norm_clip."""
    _, _, _, peg = modules()
    x, y = data(8)
    with quiet():
        peg.compute_gradients(mlp(), sce(), x, y, mode="clipped_sum")
    return silent("accepted clipped_sum without a clip norm")


# =============================================================================
# GradientAccumulator
# =============================================================================


def accumulator(net=None, **kw):
    _, _, _, peg = modules()
    return peg.GradientAccumulator(net if net is not None else mlp(), sce(), **kw)


def plain_mean(net, x, y):
    return [g.mean(axis=0) for g in loop_grads(net, x, y)]


@case("accumulation", words=("expected_batch_size",))
def accumulator_expected_batch_size_without_dp():
    """peg.GradientAccumulator(model, loss, expected_batch_size=10) without DP settings."""
    x, y = data(8)
    net = mlp()
    acc = accumulator(net, expected_batch_size=10)
    acc.accumulate(x, y)
    got = acc.result()
    if close(got, plain_mean(net, x, y)):
        return silent("accepted expected_batch_size=10 and ignored it: the plain mean over 8")
    if close(got, [8 * g / 10 for g in plain_mean(net, x, y)]):
        return right("divided by expected_batch_size")
    return silent("matches neither mean")


@case("accumulation", words=(("noise_multiplier", "l2_norm_clip"),))
def accumulator_noise_without_clip():
    """peg.GradientAccumulator(noise_multiplier=1.0) without l2_norm_clip: noise that would not be added."""
    x, y = data(8)
    net = mlp()
    acc = accumulator(net, noise_multiplier=1.0)
    acc.accumulate(x, y)
    got = acc.result()
    if close(got, plain_mean(net, x, y)):
        return silent("accepted noise_multiplier=1.0 and added no noise")
    return silent("accepted noise_multiplier=1.0 without a clip norm")


@case("accumulation", words=("method",))
def accumulator_method_without_dp():
    """peg.GradientAccumulator(method="loop") without l2_norm_clip: an engine that plain mode never uses."""
    x, y = data(8)
    acc = accumulator(method="loop")
    acc.accumulate(x, y)
    acc.result()
    return silent("accepted method='loop' in plain mode, where it is not used")


@case("accumulation", words=("expected_batch_size",))
def accumulator_dp_without_expected_batch_size():
    """peg.GradientAccumulator(l2_norm_clip=1, noise_multiplier=1) without expected_batch_size."""
    x, y = data(8)
    acc = accumulator(l2_norm_clip=1.0, noise_multiplier=1.0)
    acc.accumulate(x, y)
    acc.result()
    return silent("accepted DP mode without expected_batch_size")


@case("accumulation", words=("l2_norm_clip",))
def accumulator_clip_nan():
    """peg.GradientAccumulator(l2_norm_clip=nan, noise_multiplier=1, expected_batch_size=8)."""
    x, y = data(8)
    acc = accumulator(l2_norm_clip=float("nan"), noise_multiplier=1.0, expected_batch_size=8)
    acc.accumulate(x, y)
    acc.result()
    return silent("accepted l2_norm_clip=nan")


@case("accumulation", words=("expected_batch_size",))
def accumulator_expected_batch_size_nan():
    """peg.GradientAccumulator(l2_norm_clip=1, noise_multiplier=1, expected_batch_size=nan)."""
    x, y = data(8)
    acc = accumulator(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=float("nan"))
    acc.accumulate(x, y)
    acc.result()
    return silent("accepted expected_batch_size=nan")


@case("accumulation", words=("noise_multiplier",))
def accumulator_noise_negative():
    """peg.GradientAccumulator(l2_norm_clip=1, noise_multiplier=-1, expected_batch_size=8)."""
    x, y = data(8)
    acc = accumulator(l2_norm_clip=1.0, noise_multiplier=-1.0, expected_batch_size=8)
    acc.accumulate(x, y)
    acc.result()
    return silent("accepted noise_multiplier=-1")


@case("accumulation", words=("seed",))
def accumulator_seed_string():
    """peg.GradientAccumulator(DP mode, seed="abc")."""
    x, y = data(8)
    acc = accumulator(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=8, seed="abc")
    acc.accumulate(x, y)
    acc.result()
    return silent("accepted seed='abc'")


@case("accumulation", words=("optimizer",))
def accumulator_apply_string():
    """GradientAccumulator.apply("sgd"): right = refuse, or one SGD(0.01) step."""
    x, y = data(8)
    net = mlp()
    acc = accumulator(net)
    mean = plain_mean(net, x, y)
    w0 = [v.numpy().astype("float64") for v in net.trainable_variables]
    acc.accumulate(x, y)
    acc.apply("sgd")
    moved = [v.numpy() - w for v, w in zip(net.trainable_variables, w0)]
    return (
        right("applied one SGD(0.01) step")
        if close(moved, [-0.01 * g for g in mean], rtol=1e-3)
        else silent("the step is not SGD(0.01)'s")
    )


@case("accumulation", words=("optimizer",))
def accumulator_apply_string_twice():
    """GradientAccumulator.apply("adam") on two logical batches: right = refuse, or two steps of one Adam (its state kept)."""
    np, _, keras, _ = modules()
    x, y = data(16)
    net, twin = mlp(), mlp()
    twin.set_weights(net.get_weights())
    acc = accumulator(net)
    adam = keras.optimizers.Adam()
    for part in (slice(0, 8), slice(8, 16)):
        grads = plain_mean(twin, x[part], y[part])
        adam.apply_gradients(zip([np.float32(g) for g in grads], twin.trainable_variables))
        acc.accumulate(x[part], y[part])
        acc.apply("adam")
    got, expected = [v.numpy() for v in net.trainable_variables], [v.numpy() for v in twin.trainable_variables]
    if close(got, expected, rtol=1e-3, atol=1e-7):
        return right("two steps of one Adam")
    return silent(
        f"a new Adam at every apply (its moments lost): weights differ from one Adam's by {max_diff(got, expected)}"
    )


@case("accumulation", words=())
def accumulator_result_before_accumulate():
    """GradientAccumulator.result() before any accumulate: right = zeros."""
    np = modules()[0]
    net = mlp()
    got = accumulator(net).result()
    ok = all(np.all(as_numpy(g) == 0) for g in got) and len(got) == len(net.trainable_variables)
    return right("zeros") if ok else silent("not zeros")


@case("accumulation", words=(("incompatible", "expected axis", "shape"),), forbid=(MASKED,), any_type=True)
def accumulator_wrong_feature_size():
    """GradientAccumulator(DP mode).accumulate(x of 5 features for a 4-feature model): clear = the model's own message."""
    np = modules()[0]
    net = mlp()
    acc = accumulator(net, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=8)
    x = np.ones((8, 5), "float32")
    y = np.zeros(8, "int32")
    return versus_model(lambda: net(x), lambda: acc.accumulate(x, y), ("incompatible", "expected axis"))


# =============================================================================
# export_gradients / import_gradients
# =============================================================================


def arrays_for(variables, seed=0):
    np = modules()[0]
    rng = np.random.default_rng(seed)
    return [rng.normal(size=tuple(v.shape)).astype("float32") for v in variables]


def paired_right(pairs, arrays, variables) -> bool:
    np = modules()[0]
    return len(pairs) == len(variables) and all(
        g_v[1] is v and np.array_equal(as_numpy(g_v[0]), a) for g_v, a, v in zip(pairs, arrays, variables)
    )


@case("transfer", words=(("dict", "position", "mapping"),))
def import_list_of_arrays():
    """peg.import_gradients([arrays], variables): right = paired by position, clear = says to pass a dict."""
    _, _, _, peg = modules()
    variables = mlp().trainable_variables
    arrays = arrays_for(variables)
    with quiet():
        pairs = peg.import_gradients(arrays, variables)
    return right("paired by position") if paired_right(pairs, arrays, variables) else silent("paired wrongly")


@case("transfer", words=(("missing", "position"),))
def import_between_two_copies():
    """import_gradients(export_gradients(worker pairs), server variables) for two copies of one architecture in one process."""
    _, _, _, peg = modules()
    worker, server = mlp(), mlp()
    arrays = arrays_for(worker.trainable_variables)
    exported = peg.export_gradients(list(zip(arrays, worker.trainable_variables)))
    try:
        params = inspect.signature(peg.import_gradients).parameters
    except (TypeError, ValueError):
        params = {}
    if "match" in params:
        pairs = peg.import_gradients(exported, server.trainable_variables, match="position")
        how = "match='position'"
    else:
        pairs = peg.import_gradients(exported, server.trainable_variables)
        how = "by name"
    if paired_right(pairs, arrays, server.trainable_variables):
        return right(f"paired with the server's variables ({how})")
    return silent(f"paired wrongly ({how})")


@case("transfer", words=("shape",))
def import_wrong_shape():
    """import_gradients({path: a transposed kernel}, variables)."""
    _, _, _, peg = modules()
    variables = mlp().trainable_variables
    arrays = arrays_for(variables)
    arrays[0] = arrays[0].T.copy()
    exported = peg.export_gradients(list(zip(arrays, variables)))
    peg.import_gradients(exported, variables)
    return silent("accepted a transposed kernel")


@case("transfer", words=("dtype",))
def import_float64_arrays():
    """import_gradients with float64 arrays for float32 variables: right = cast to float32, or refuse naming dtype."""
    np, _, _, peg = modules()
    variables = mlp().trainable_variables
    arrays = arrays_for(variables)
    exported = peg.export_gradients([(a.astype("float64"), v) for a, v in zip(arrays, variables)])
    pairs = peg.import_gradients({k: v.astype("float64") for k, v in exported.items()}, variables)
    ok = all(str(g.dtype) == "float32" or getattr(g.dtype, "name", "") == "float32" for g, _ in pairs) and paired_right(
        pairs, arrays, variables
    )
    return (
        right("cast to float32, paired by name")
        if ok
        else silent(f"returned dtypes {[getattr(g.dtype, 'name', g.dtype) for g, _ in pairs]}")
    )


@case("transfer", words=("match",))
def import_match_bogus():
    """import_gradients(..., match="name")."""
    _, _, _, peg = modules()
    need_param(peg.import_gradients, "match", "import_gradients")
    variables = mlp().trainable_variables
    exported = peg.export_gradients(list(zip(arrays_for(variables), variables)))
    peg.import_gradients(exported, variables, match="name")
    return silent("accepted match='name'")


@case("transfer", words=(("name", "share", "twice", "duplicate"),))
def export_same_variable_twice():
    """peg.export_gradients([(g1, v), (g2, v)]): one entry would be lost."""
    _, _, _, peg = modules()
    v = mlp().trainable_variables[0]
    a, b = arrays_for([v, v])
    out = peg.export_gradients([(a, v), (b, v)])
    return silent(f"returned {len(out)} entry for two gradients")


# =============================================================================
# Diagnostics
# =============================================================================


def statistics(net, x, y, **kw):
    _, _, _, peg = modules()
    kw.setdefault("progress", False)
    with quiet():
        return peg.diagnostics.gradient_statistics(net, sce(), (x, y), **kw)


@case("diagnostics", words=("batch_size",))
def statistics_batch_size_zero():
    """peg.diagnostics.gradient_statistics(model, loss, (x, y), batch_size=0)."""
    x, y = data(16)
    report = statistics(mlp(), x, y, batch_size=0)
    return silent(f"accepted batch_size=0; report of {getattr(report, 'num_examples', '?')} examples")


@case("diagnostics", words=(("nan", "finite", "non-finite", "nonfinite"),))
def statistics_nan_example():
    """gradient_statistics with one NaN example: silent if tr(Sigma) is NaN; right = tr(Sigma) of the finite examples."""
    np = modules()[0]
    x, y = data(16)
    x[3] = np.nan
    net = mlp()
    report = statistics(net, x, y, batch_size=8)
    trace = float(report.trace_covariance)
    loop = loop_grads(net, x, y)
    keep = np.isfinite(norms64(loop))
    expected = float(sum(np.sum(np.var(g[keep].reshape(int(keep.sum()), -1), axis=0, ddof=1)) for g in loop))
    if math.isnan(trace):
        return silent(f"tr(Sigma) = nan from one NaN example of 16 (the 15 finite ones give {expected:.4g})")
    if same_number(trace, expected, 1e-3):
        return right(f"tr(Sigma) {trace:.4g} = that of the 15 finite examples")
    return silent(f"tr(Sigma) {trace:.4g}; the 15 finite examples give {expected:.4g}")


@case("diagnostics", words=("cosine",))
def statistics_cosine_bogus():
    """gradient_statistics(cosine="yes")."""
    x, y = data(16)
    statistics(mlp(), x, y, cosine="yes")
    return silent("accepted cosine='yes'")


@case("diagnostics", words=("top_k",))
def statistics_top_k_negative():
    """gradient_statistics(top_k=-1)."""
    x, y = data(16)
    report = statistics(mlp(), x, y, top_k=-1)
    return silent(f"accepted top_k=-1; top_examples() has {len(report.top_examples())} entries")


@case("diagnostics", words=(("empty", "no examples", "0 examples", "data"),))
def statistics_empty_data():
    """gradient_statistics on 0 examples: right = a report of 0 examples, or refuse."""
    x, y = data(16)
    report = statistics(mlp(), x[:0], y[:0])
    n = getattr(report, "num_examples", None)
    return right("a report of 0 examples") if n == 0 else silent(f"a report of {n} examples")


@case("diagnostics", words=("every_n_steps",))
def statistics_callback_every_zero():
    """peg.diagnostics.GradientStatisticsCallback((x, y), every_n_steps=0)."""
    _, _, _, peg = modules()
    x, y = data(16)
    peg.diagnostics.GradientStatisticsCallback((x, y), every_n_steps=0, loss_fn=sce())
    return silent("accepted every_n_steps=0")


# =============================================================================
# Sampling, validation, rules
# =============================================================================


def poisson(q, x=None, y=None):
    _, _, _, peg = modules()
    if x is None:
        x, y = data(64)
    ds = peg.dp.poisson_batches(x, y, sampling_probability=q, seed=0)
    next(iter(ds))
    return silent(f"accepted sampling_probability={q!r}")


@case("sampling", words=("sampling_probability",))
def poisson_q_zero():
    """peg.dp.poisson_batches(sampling_probability=0)."""
    return poisson(0.0)


@case("sampling", words=("sampling_probability",))
def poisson_q_nan():
    """peg.dp.poisson_batches(sampling_probability=nan)."""
    return poisson(float("nan"))


@case("sampling", words=("sampling_probability",))
def poisson_q_above_one():
    """peg.dp.poisson_batches(sampling_probability=1.5)."""
    return poisson(1.5)


@case("sampling", words=(("y", "rows", "examples", "length"),))
def poisson_x_y_lengths_differ():
    """peg.dp.poisson_batches(x of 64 rows, y of 60)."""
    x, y = data(64)
    return poisson(0.25, x, y[:60])


@case("sampling", words=("physical_batch_size",))
def physical_chunks_size_zero():
    """peg.dp.physical_chunks(x, y, mask, physical_batch_size=0)."""
    np, _, _, peg = modules()
    x, y = data(8)
    chunks = list(peg.dp.physical_chunks(x, y, np.ones(8, "float32"), 0))
    return silent(f"accepted 0; {len(chunks)} chunks")


@case("sampling", words=("sampling_probability",))
def default_max_batch_size_q_zero():
    """peg.dp.default_max_batch_size(60000, sampling_probability=0)."""
    _, _, _, peg = modules()
    return silent(f"returned {peg.dp.default_max_batch_size(60000, 0.0)!r}")


@case("validation", words=("model",))
def check_model_not_a_model():
    """peg.dp.check_model("not a model")."""
    _, _, _, peg = modules()
    report = peg.dp.check_model("not a model")
    return silent(f"accepted a string: {one_line(report, 80)}")


@case("validation", words=("model",))
def fix_model_not_a_model():
    """peg.dp.fix_model("not a model")."""
    _, _, _, peg = modules()
    peg.dp.fix_model("not a model")
    return silent("accepted a string")


@case("validation", words=("rule",))
def register_layer_rule_not_a_rule():
    """peg.register_layer_rule(MyLayer, "not a rule") (a layer class of this case only)."""
    _, _, keras, peg = modules()

    class MyLayer(keras.layers.Layer):
        pass

    peg.register_layer_rule(MyLayer, "not a rule")
    return silent("accepted a string as a rule")


# =============================================================================
# The child: runs cases, one JSON line each
# =============================================================================


CURRENT_TIMEOUT = DEFAULT_TIMEOUT
CASE_START = 0.0


def run_case(c: Case) -> dict:
    """Runs one case in this process; its outcome and one-line detail."""
    global CASE_START
    start = CASE_START = time.monotonic()
    if c.tf:
        _, tf, keras, _ = modules()
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = c.fn()
        if not isinstance(result, Verdict):
            raise RuntimeError(f"case {c.name} returned {result!r}, not a verdict")
        outcome, detail = result.outcome, result.detail
    except Verdict as v:
        outcome, detail = v.outcome, v.detail
    except BaseException as e:  # noqa: BLE001 - every exception is a result here
        if isinstance(e, KeyboardInterrupt):
            raise
        outcome, detail = classify_exception(c, e)
        if outcome == CRASH:
            where = traceback.extract_tb(e.__traceback__)
            if where:
                frame = where[-1]
                detail += f" [at {os.path.basename(frame.filename)}:{frame.lineno}]"
    return dict(
        name=c.name,
        area=c.area,
        outcome=outcome,
        detail=one_line(detail, 230),
        seconds=round(time.monotonic() - start, 2),
    )


def vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker(names: list[str], results: str, memory_gb: float) -> None:
    cases = [CASES[n] for n in names]
    if any(c.tf for c in cases):
        modules()
        import per_example_grads.gradients  # noqa: F401 - the heavy imports, before the limit
        import per_example_grads.keras  # noqa: F401
    # What the imports made lives as long as the child: kept out of the collector's sight, so that the full
    # collection keras.backend.clear_session() makes before each case goes over what the cases made, not again
    # over TensorFlow's few hundred thousand objects (0.2 s a case, about 100 TensorFlow cases).
    gc.freeze()
    # The soft limit only: a CLI case's own child (run_cli) sets its own limit, above this one.
    limit = vm_size() + int(memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    with open(results, "a") as out:
        for c in cases:
            out.write(json.dumps({"start": c.name}) + "\n")
            out.flush()
            out.write(json.dumps(run_case(c)) + "\n")
            out.flush()


# =============================================================================
# The parent: children, time limits, the table
# =============================================================================


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def last_lines(path: str, n: int = 1) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    keep = [line for line in lines if not line.startswith(("WARNING: All log messages", "I0000", "W0000"))]
    return " | ".join(keep[-n:])


def run_group(names: list[str], args, logs: str, progress: Callable[[dict], None]) -> list[dict]:
    """Runs ``names`` in children, one at a time; a hang or death ends its case and a new child takes the rest."""
    done: list[dict] = []
    pending = list(names)
    attempt = 0
    while pending:
        attempt += 1
        results = os.path.join(logs, f"{pending[0]}.{attempt}.jsonl")
        log = os.path.join(logs, f"{pending[0]}.{attempt}.log")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--results",
            results,
            "--memory-gb",
            str(args.memory_gb),
            "--timeout",
            str(args.timeout),
            *pending,
        ]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"), MALLOC_ARENA_MAX="2")
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started_at, current, _seen, position = time.monotonic(), None, 0, 0
        failure = None
        while True:
            time.sleep(0.1)
            lines = []
            if os.path.exists(results):
                with open(results) as f:
                    f.seek(position)
                    chunk = f.read()
                cut = chunk.rfind("\n") + 1
                position += cut
                lines = [json.loads(line) for line in chunk[:cut].splitlines() if line.strip()]
            for item in lines:
                if "start" in item:
                    current, started_at = item["start"], time.monotonic()
                else:
                    done.append(item)
                    progress(item)
                    pending.remove(item["name"])
                    current = None
            rc = proc.poll()
            if rc is not None and not lines:
                if current is not None or pending:
                    reason = (
                        f"the process died ({signal_name(-rc)})" if rc < 0 else f"the process exited with status {rc}"
                    )
                    failure = (current, f"{reason}: {one_line(last_lines(log), 150)}")
                break
            limit = args.timeout + 3 if current is not None else STARTUP_TIMEOUT
            if time.monotonic() - started_at > limit:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                what = (
                    f"hang: still running after {limit:.0f} s (killed)"
                    if current
                    else "the child did not start its first case"
                )
                failure = (current, what)
                break
        if failure is None:
            continue
        name, detail = failure
        victims = [name] if name is not None else list(pending)  # no case started: the child itself failed
        for n in victims:
            item = dict(
                name=n,
                area=CASES[n].area,
                outcome=CRASH,
                detail=one_line(detail, 230),
                seconds=round(time.monotonic() - started_at, 2),
            )
            done.append(item)
            progress(item)
            pending.remove(n)
    return done


def package_info() -> dict:
    import per_example_grads

    folder = os.path.dirname(os.path.dirname(os.path.abspath(per_example_grads.__file__)))
    info = dict(
        package=os.path.dirname(os.path.abspath(per_example_grads.__file__)),
        version=getattr(per_example_grads, "__version__", "?"),
    )
    try:
        info["revision"] = subprocess.run(
            ["git", "-C", folder, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", folder, "status", "--porcelain", "--", "per_example_grads"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        info["package_modified"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def select(args) -> list[Case]:
    cases = list(CASES.values())
    if args.k:
        cases = [c for c in cases if any(k.lower() in (c.name + " " + c.area).lower() for k in args.k)]
    return cases


def print_table(rows: list[dict], out=sys.stdout) -> None:
    width = max([len(r["name"]) for r in rows] + [4])
    area = max([len(r["area"]) for r in rows] + [4])
    print(f"{'case':<{width}}  {'area':<{area}}  {'outcome':<12}  detail", file=out)
    print(f"{'-' * width}  {'-' * area}  {'-' * 12}  {'-' * 40}", file=out)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['area']:<{area}}  {r['outcome']:<12}  {r['detail']}", file=out)


def counts_of(rows: list[dict]) -> dict:
    return {o: sum(1 for r in rows if r["outcome"] == o) for o in OUTCOMES}


def main(argv=None) -> int:
    global CURRENT_TIMEOUT
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument(
        "-k", action="append", metavar="SUBSTRING", help="only cases whose name or area contains it (repeatable)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results and counts as JSON")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds a case may take (default: %(default)s)"
    )
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=DEFAULT_MEMORY_GB,
        help="address space a child may add after its imports (default: %(default)s)",
    )
    parser.add_argument(
        "--case", metavar="NAME", help="run one case in this process (no isolation) and print its result"
    )
    parser.add_argument("--keep-logs", metavar="DIR", help="keep the children's output in DIR")
    parser.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="children that run at once (default: %(default)s)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    CURRENT_TIMEOUT = args.timeout

    if args.worker:
        worker(args.names, args.results, args.memory_gb)
        return 0
    if args.case:
        if args.case not in CASES:
            parser.error(f"no case {args.case!r} (see --list)")
        print(json.dumps(run_case(CASES[args.case])))
        return 0
    cases = select(args)
    if args.list:
        for c in cases:
            flags = ",".join(f for f, on in (("alone", c.alone), ("no-tf", not c.tf)) if on)
            print(f"{c.name:<45} {c.area:<18} {flags:<12} {c.doc}")
        print(f"{len(cases)} cases")
        return 0
    if not cases:
        parser.error("no case matches -k")

    info = package_info()
    print(
        f"per_example_grads {info.get('version')} from {info['package']} (revision {info.get('revision', '?')}"
        f"{', modified' if info.get('package_modified') else ''}); {len(cases)} cases, "
        f"{args.timeout:g} s and +{args.memory_gb:g} GB each",
        flush=True,
    )
    start = time.monotonic()
    logs = args.keep_logs or tempfile.mkdtemp(prefix="bad_inputs_logs_")
    os.makedirs(logs, exist_ok=True)
    groups = [[c.name] for c in cases if c.alone]
    groups += [[c.name for c in cases if not c.alone and not c.tf], [c.name for c in cases if not c.alone and c.tf]]
    rows: list[dict] = []

    def progress(item):
        print(f"  {item['outcome']:<12} {item['name']} ({item['seconds']:.1f} s)", file=sys.stderr, flush=True)

    groups = [group for group in groups if group]
    if args.jobs > 1:  # the largest group first, so that it is not the one left running alone at the end
        groups.sort(key=len, reverse=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for done in pool.map(lambda group: run_group(group, args, logs, progress), groups):
                rows += done
    finally:
        if not args.keep_logs:
            shutil.rmtree(logs, ignore_errors=True)
    order = {c.name: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: order[r["name"]])
    seconds = time.monotonic() - start
    print()
    print_table(rows)
    counts = counts_of(rows)
    print()
    print("outcome       count")
    for outcome in OUTCOMES:
        print(f"{outcome:<12}  {counts[outcome]:>5}")
    print(f"{'total':<12}  {len(rows):>5}   ({seconds:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    info,
                    command=sys.argv,
                    date=time.strftime("%Y-%m-%d %H:%M:%S"),
                    seconds=round(seconds, 1),
                    timeout=args.timeout,
                    memory_gb=args.memory_gb,
                    jobs=args.jobs,
                    counts=counts,
                    cases=rows,
                ),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
