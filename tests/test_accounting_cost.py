"""The accountants' cost is bounded: PLD is estimated before it is built, and RDP answers past the bound.

Each hopeless case runs in a child process whose address space is limited
(``RLIMIT_AS``), with a time limit, so a regression fails the test instead of
exhausting the machine."""

import json
import math
import subprocess
import sys
import textwrap
import warnings

import dp_accounting
import pytest

from per_example_grads.dp import pld_cost
from per_example_grads.dp.accounting import _dp_sgd_event, compute_epsilon, noise_multiplier_for_epsilon

LIMIT_BYTES = 2 * 1024**3  # on top of what the imports take
TIME_LIMIT_S = 60


def _run_limited(code: str):
    """``json.loads`` of what ``code`` prints, run in a child with the address space and time limited."""
    script = textwrap.dedent(
        f"""
        import json, resource, warnings
        import dp_accounting, numpy, scipy.fft  # imports first: the limit is on top of them
        from per_example_grads.dp import accounting
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + {LIMIT_BYTES}, hard))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = {{"value": ({code})}}
            except ValueError as e:
                out = {{"error": str(e)}}
        out["warnings"] = [str(w.message) for w in caught]
        print(json.dumps(out))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIME_LIMIT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rdp(sigma, q, steps, delta):
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return accountant.compose(_dp_sgd_event(sigma, q, steps)).get_epsilon(delta)


@pytest.mark.slow
@pytest.mark.parametrize("sigma, steps", [(1.1, 10**9), (1e-3, 14_063)])
def test_hopeless_pld_runs_answer_with_rdp_within_the_bounds(sigma, steps):
    # Before: 21.6 GB and killed (steps=1e9); a 38 GiB allocation (sigma=1e-3).
    got = _run_limited(f"accounting.compute_epsilon(60_000, 256, None, {sigma}, 1e-5, steps={steps})")
    assert got["value"] == pytest.approx(_rdp(sigma, 256 / 60_000, steps, 1e-5), rel=1e-12)
    assert any("epsilon comes from the RDP accountant" in w for w in got["warnings"])


@pytest.mark.slow
@pytest.mark.parametrize("target", [1e4, 1e9])
def test_a_huge_target_is_calibrated_fast_and_validly(target):
    # Before: 54 s then a failure (1e4); 11 minutes at 9.7 GB (1e9). The sigma it returns must meet the
    # target with the accountant that answers for it (RDP there, whose epsilon is never below PLD's).
    got = _run_limited(
        f"(lambda s: (s, accounting.compute_epsilon(60_000, 256, 60, s, 1e-5)))("
        f"accounting.noise_multiplier_for_epsilon({target}, 1e-5, 60_000, 256, 60))"
    )
    sigma, epsilon = got["value"]
    assert 1e-3 <= sigma < 1 and epsilon <= target
    assert _rdp(sigma, 256 / 60_000, math.ceil(60 * 60_000 / 256), 1e-5) <= target
    assert any("epsilon comes from the RDP accountant" in w for w in got["warnings"])


def test_a_target_met_below_the_searched_range_is_refused_at_once():
    with pytest.raises(ValueError, match=r"target_epsilon=1e\+30 is met with noise_multiplier below 0.001"):
        noise_multiplier_for_epsilon(1e30, 1e-5, 60_000, 256, 1)


def test_the_usual_run_still_uses_pld():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RDP fallback warning
        got = compute_epsilon(60_000, 256, 60, 1.1, 1e-5)
    pld = dp_accounting.pld.PLDAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    expected = pld.compose(_dp_sgd_event(1.1, 256 / 60_000, math.ceil(60 * 60_000 / 256))).get_epsilon(1e-5)
    assert got == expected
    assert got < _rdp(1.1, 256 / 60_000, math.ceil(60 * 60_000 / 256), 1e-5)  # PLD is the tighter


def test_calibration_stays_valid():
    sigma = noise_multiplier_for_epsilon(2.0, 1e-5, 60_000, 256, 5)
    assert compute_epsilon(60_000, 256, 5, sigma, 1e-5) <= 2.0
    assert compute_epsilon(60_000, 256, 5, sigma * 0.99, 1e-5) > 2.0


@pytest.mark.parametrize(
    "sigma, q, steps, measured",
    [  # entries of the widest mass function dp_accounting built (compute_self_convolve_bounds)
        (1.1, 256 / 60_000, 14_063, 2.01e5),
        (1.1, 256 / 60_000, 10**6, 8.13e5),
        (1.1, 256 / 60_000, 10**9, 6.36e7),
        (0.3, 256 / 60_000, 14_063, 3.35e6),
        (0.1, 0.1, 100, 2.1e7),
        (1.0, 0.25, 40, 3.75e5),
        (0.05, 256 / 60_000, 14_063, 2.54e8),
    ],
)
def test_the_estimate_is_not_below_what_dp_accounting_allocates(sigma, q, steps, measured):
    estimate = pld_cost.pld_points(_dp_sgd_event(sigma, q, steps))
    assert measured <= estimate <= 10 * measured
