"""The PLD accountant's cost is estimated before it runs; past the bounds RDP answers, or a ValueError says why.

Every case that was hopeless before (tens of GB, minutes, or a hang) runs in
a child process whose address space is limited to 2 GiB on top of its
imports (``RLIMIT_AS``) and whose time is limited, so that a regression fails
the test instead of exhausting the machine. Epsilons are checked against
``dp_accounting`` called directly here, never against hard-coded numbers.
"""

import json
import math
import re
import subprocess
import sys
import textwrap
import warnings

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from per_example_grads.dp import accounting, pld_cost
from per_example_grads.dp.accounting import PrivacyAccountant, compute_epsilon, noise_multiplier_for_epsilon
from tolerances import ACCOUNTING_SAME_RTOL

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
MNIST_Q, MNIST_STEPS = 256 / 60_000, math.ceil(60 * 60_000 / 256)  # 60 epochs, batches of 256 from 60,000
LIMIT_BYTES = 2 * 1024**3
CALL_SECONDS = 30  # the bound on one call
CHILD_SECONDS = 120  # the child's: imports and a slow machine included


def sampled_event(sigma, q, steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )


def rdp_epsilon(sigma, q, steps, delta):
    return RdpAccountant(neighboring_relation=ADD_REMOVE).compose(sampled_event(sigma, q, steps)).get_epsilon(delta)


def pld_epsilon(sigma, q, steps, delta, interval=1e-4):
    accountant = PLDAccountant(ADD_REMOVE, value_discretization_interval=interval)
    return accountant.compose(sampled_event(sigma, q, steps)).get_epsilon(delta)


def run_limited(code):
    """What ``code`` (an expression over ``accounting``) gives in a child: value or ValueError, warnings, seconds."""
    script = textwrap.dedent(
        f"""
        import json, resource, time, warnings
        from per_example_grads.dp import accounting  # imports first: the limit is on top of them
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + {LIMIT_BYTES}, resource.getrlimit(resource.RLIMIT_AS)[1]))
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = {{"value": ({code})}}
            except ValueError as e:
                out = {{"error": str(e)}}
        out["seconds"] = time.perf_counter() - start
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        print(json.dumps(out))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=CHILD_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["seconds"] < CALL_SECONDS, out
    return out


def assert_rdp_fallback_warning(out):
    (message,) = out["warnings"]
    assert "the PLD accountant would need about" in message and "GiB" in message
    assert "epsilon comes from the RDP accountant" in message


# --------------------------------------------------------------------------
# compute_epsilon past the bounds
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "sigma, epochs, steps, reference_interval",
    [
        (1.1, None, 10**9, 3e-3),  # before: grew to 21.6 GB and was killed
        (1e-3, 60, None, 100.0),  # before: asked for 38 GiB at once
        (1.1, 1e12, None, None),  # epochs=1e12: no PLD reference is affordable
    ],
)
def test_a_hopeless_pld_run_answers_with_rdp_which_is_not_below_pld(sigma, epochs, steps, reference_interval):
    out = run_limited(f"accounting.compute_epsilon(60_000, 256, {epochs}, {sigma}, 1e-5, steps={steps})")
    steps = steps or math.ceil(epochs * 60_000 / 256)
    assert out["value"] == pytest.approx(rdp_epsilon(sigma, MNIST_Q, steps, 1e-5), rel=ACCOUNTING_SAME_RTOL)
    assert_rdp_fallback_warning(out)
    if reference_interval is not None:
        # A coarser PLD grid is pessimistic too; RDP is above it.
        assert out["value"] >= pld_epsilon(sigma, MNIST_Q, steps, 1e-5, reference_interval)


@pytest.mark.slow
def test_huge_noise_with_huge_runs_is_refused_instead_of_hanging():
    # Before: dp_accounting's sparse grid of 3 points computed 3 ** 1e9 as a Python integer (a hang).
    # RDP answers 0 there (its numerics fail), which cannot stand for epsilon.
    out = run_limited("accounting.compute_epsilon(60_000, 256, None, 1e9, 1e-5, steps=10**9)")
    assert "the RDP accountant returns epsilon = 0" in out["error"]
    assert out["error"].startswith("steps=1000000000, noise_multiplier=1e+09, q=0.004267: the PLD accountant")


def test_too_many_steps_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"epochs=1e\+300 makes 2.34e\+302 steps, more than MAX_STEPS = 1e\+18"):
        compute_epsilon(60_000, 256, 1e300, 1.1, 1e-5)
    with pytest.raises(ValueError, match=r"steps must be <= 1e\+18"):
        compute_epsilon(60_000, 256, None, 1.1, 1e-5, steps=10**19)
    with pytest.raises(ValueError, match=r"n must be <= 1e\+18"):
        PrivacyAccountant(1.1, 0.01).step(10**19)


def test_the_usual_run_still_uses_pld_and_gives_the_same_number():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        got = compute_epsilon(60_000, 256, 60, 1.1, 1e-5)
    assert got == pld_epsilon(1.1, MNIST_Q, MNIST_STEPS, 1e-5)


@pytest.mark.parametrize("n, b, epochs, sigma, delta", [(10_000, 100, 2, 1.5, 1e-6), (1_000, 100, 3, 2.0, 1e-4)])
def test_past_the_bounds_the_answer_is_rdp_and_not_below_pld(monkeypatch, n, b, epochs, sigma, delta):
    steps = math.ceil(epochs * n / b)
    monkeypatch.setattr(pld_cost, "PLD_MAX_BYTES", 0)
    with pytest.warns(UserWarning, match=r"past the bound of 0 KiB / 20 s\), so epsilon comes from the RDP"):
        got = compute_epsilon(n, b, epochs, sigma, delta)
    rdp = rdp_epsilon(sigma, b / n, steps, delta)
    assert got == pytest.approx(rdp, rel=ACCOUNTING_SAME_RTOL)
    assert got >= pld_epsilon(sigma, b / n, steps, delta)

    acc = PrivacyAccountant(sigma, b / n)
    acc.step(steps)
    with pytest.warns(UserWarning, match="epsilon comes from the RDP accountant"):
        assert acc.epsilon(delta) == pytest.approx(rdp, rel=ACCOUNTING_SAME_RTOL)


# --------------------------------------------------------------------------
# noise_multiplier_for_epsilon past the bounds
# --------------------------------------------------------------------------


def rdp_answer(message):
    return float(re.search(r"accountant='rdp' gives noise_multiplier=([0-9.e+-]+)", message).group(1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "target, epochs",
    [
        (1e4, 60),  # before: failed after 54 s
        (1e9, 60),  # before: 11 minutes at 9.7 GB
        (3.0, 1e12),  # before: a hang (3 ** 2.3e14 at sigma = 1e9)
    ],
)
def test_a_calibration_pld_cannot_afford_fails_fast_naming_target_epsilon(target, epochs):
    out = run_limited(f"accounting.noise_multiplier_for_epsilon({target}, 1e-5, 60_000, 256, {epochs})")
    assert out["error"].startswith(f"target_epsilon={target!r}: the PLD accountant would need about")
    sigma = rdp_answer(out["error"])  # the RDP calibration it offers meets the target with RDP
    assert rdp_epsilon(sigma, MNIST_Q, math.ceil(epochs * 60_000 / 256), 1e-5) <= target


def test_a_target_met_below_the_searched_range_is_refused_at_once():
    with pytest.raises(ValueError, match=r"target_epsilon=1e\+30 is met with noise_multiplier below 0.001"):
        noise_multiplier_for_epsilon(1e30, 1e-5, 60_000, 256, 1)


@pytest.mark.parametrize(
    "module, bound, value, match",
    [
        (pld_cost, "PLD_MAX_SECONDS", 0.0, r"the PLD accountant would need about .* past the bound of"),
        (accounting, "SEARCH_MAX_SECONDS", 0.0, r"calibrating with the PLD accountant would take more than 0 s"),
    ],
)
def test_a_calibration_past_the_bounds_is_refused_with_the_rdp_answer(monkeypatch, module, bound, value, match):
    monkeypatch.setattr(module, bound, value)
    with pytest.raises(ValueError, match=r"^target_epsilon=0.5: " + match) as error:
        noise_multiplier_for_epsilon(0.5, 1e-5, 1_000, 20, 2, rtol=0.01)
    rdp = noise_multiplier_for_epsilon(0.5, 1e-5, 1_000, 20, 2, accountant="rdp", rtol=0.01)
    assert rdp_answer(str(error.value)) == pytest.approx(rdp, rel=1e-5)  # printed to 6 digits


# --------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "sigma, q, steps",
    [
        (1.1, MNIST_Q, 10**6),  # composition-bound
        (2.0, 0.1, 10**5),  # composition-bound, larger q
        (0.5, MNIST_Q, 1),  # single-step-bound
        (10.0, MNIST_Q, 10**6),  # a sparse single-step grid, raised to the power T
    ],
)
def test_the_estimate_is_above_the_memory_dp_accounting_takes_but_not_far(sigma, q, steps):
    # VmHWM, not ru_maxrss: a child inherits its parent's ru_maxrss across exec.
    code = f"""
        import json
        from dp_accounting.pld import PLDAccountant
        from per_example_grads.dp import accounting, pld_cost

        def kib(field):
            line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
            return int(line.split()[1]) * 1024

        segments = [accounting._Segment(accounting._STEP, ({sigma},), {q}, {steps})]
        cost = pld_cost.estimate([({sigma}, {q}, {steps})], 1e-4)
        pld_cost._single_step_probabilities.cache_clear()
        resident = kib("VmRSS")
        PLDAccountant().compose(accounting._composed_event(segments)).get_epsilon(1e-5)
        print(json.dumps([cost.bytes, kib("VmHWM") - resident]))  # the peak's rise
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=CHILD_SECONDS
    )
    assert done.returncode == 0, done.stderr[-3000:]
    estimated, used = json.loads(done.stdout.strip().splitlines()[-1])
    assert used <= estimated <= 3 * used + 2**24  # 16 MiB: the resolution of a small run's peak


def test_the_estimate_stops_before_building_an_unaffordable_grid(monkeypatch):
    def no_build(*args):
        raise AssertionError("built a single-step PMF the bounds exclude")

    monkeypatch.setattr(pld_cost, "_single_step_probabilities", no_build)
    cost = pld_cost.estimate([(1e-3, MNIST_Q, MNIST_STEPS)], 1e-4)
    assert not cost.fits() and cost.bytes > 100 * 2**30
