"""Privacy accounting: PrivacyAccountant, compute_epsilon, calibration, EpsilonCallback, ``pegrad epsilon``.

Every epsilon is checked against ``dp_accounting`` called directly here, with
events and accountants built in the test, never against hard-coded numbers.
"""

import json
import math
import re
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import scipy.stats
from dp_accounting.dp_event import MixtureOfGaussiansDpEvent
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from per_example_grads.apps import cli
from per_example_grads.dp import (
    PrivacyAccountant,
    accounting,
    adaptive_clipping_noise_multiplier,
    compute_epsilon,
    noise_multiplier_for_epsilon,
)
from per_example_grads.dp.accounting import dp_sgd_schedule, user_level_event
from per_example_grads.dp.bisr import BISR
from per_example_grads.dp.mechanisms import BLT, BandMF
from per_example_grads.keras import EpsilonCallback
from tolerances import ACCOUNTING_COMPOSED_RTOL, ACCOUNTING_SAME_RTOL, FLOAT64_CLOSED_FORM_RTOL, PRINTED_RTOL

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def direct_epsilon(kind, q, sigma, steps, delta):
    """dp_accounting on ``steps`` Poisson-sampled Gaussian steps, built by hand."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    accountant = PLDAccountant(ADD_REMOVE) if kind == "pld" else RdpAccountant(neighboring_relation=ADD_REMOVE)
    return accountant.compose(event).get_epsilon(delta)


# (num_examples, batch_size, epochs, sigma, delta); PLD is slow for small
# sigma, so its configurations keep sigma >= 1.
CONFIGS = [
    (60_000, 256, 60, 1.1, 1e-5),  # the classic MNIST setting
    (10_000, 100, 2, 1.5, 1e-6),
    (1_000, 100, 3, 2.0, 1e-4),
    (50_000, 500, 4, 2.0, 1e-6),
]
RDP_ONLY = [
    (50_000, 512, 10, 0.8, 1e-5),
    (2_000, 64, 0.5, 1.0, 1e-5),  # a fractional epoch: ceil(0.5 * 2000 / 64) = 16 steps
    (100_000, 1_000, 100, 0.6, 1e-7),
]


@pytest.mark.parametrize(
    "kind, n, b, epochs, sigma, delta",
    [("rdp", *c) for c in CONFIGS + RDP_ONLY] + [("pld", *c) for c in CONFIGS],
)
def test_compute_epsilon_equals_dp_accounting(kind, n, b, epochs, sigma, delta):
    steps = math.ceil(epochs * n / b)
    expected = direct_epsilon(kind, b / n, sigma, steps, delta)
    assert compute_epsilon(n, b, epochs, sigma, delta, accountant=kind) == pytest.approx(
        expected, rel=ACCOUNTING_SAME_RTOL
    )
    assert 0 < expected < math.inf


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_steps_and_a_consistent_sampling_probability_give_the_schedule(kind):
    expected = direct_epsilon(kind, 0.01, 2.0, 250, 1e-6)
    got = compute_epsilon(10_000, 100, None, 2.0, 1e-6, accountant=kind, steps=250, sampling_probability=0.01)
    assert got == pytest.approx(expected, rel=ACCOUNTING_SAME_RTOL)


SAMPLING_CONFLICT = r"sampling_probability=0.5 disagrees with batch_size / num_examples = 256 / 60000"
BOTH_LENGTHS = r"give epochs or steps, not both \(got epochs=1, steps=10\)"


@pytest.mark.parametrize(
    "call, match",
    [  # Both were accepted, and steps / sampling_probability silently won.
        (lambda: compute_epsilon(60_000, 256, 1, 1.1, 1e-5, steps=10), BOTH_LENGTHS),
        (lambda: compute_epsilon(60_000, 256, None, 1.1, 1e-5, steps=10, sampling_probability=0.5), SAMPLING_CONFLICT),
        (lambda: noise_multiplier_for_epsilon(2.0, 1e-5, 60_000, 256, 1, steps=10), BOTH_LENGTHS),
        (lambda: noise_multiplier_for_epsilon(2.0, 1e-5, 60_000, 256, 1, sampling_probability=0.5), SAMPLING_CONFLICT),
        (lambda: dp_sgd_schedule(60_000, 256, 1, 10), BOTH_LENGTHS),
        (lambda: dp_sgd_schedule(60_000, 256, None, 10, 0.5), SAMPLING_CONFLICT),
    ],
)
def test_conflicting_schedule_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_whole_parts_whose_batch_size_rounds_up_are_q_1():
    # 500 / 15 * 15 is 500.00000000000006: a run sampling whole parts of 500 examples in 15 was refused.
    assert dp_sgd_schedule(500, 500 / 15, None, 30, cycle_length=15) == (1.0, 30)
    with pytest.raises(ValueError, match=r"batch_size \* cycle_length .* must be <= num_examples"):
        dp_sgd_schedule(500, 34, None, 30, cycle_length=15)


def test_a_sampling_probability_that_agrees_to_rounding_is_accepted():
    q = 256 / 60_000
    assert dp_sgd_schedule(60_000, 256, None, 10, q * (1 + 1e-12)) == (q * (1 + 1e-12), 10)


def test_zero_noise_is_infinite_and_zero_steps_is_zero():
    for kind in ("rdp", "pld"):
        assert compute_epsilon(1000, 10, 1, 0.0, 1e-5, accountant=kind) == math.inf
        assert compute_epsilon(1000, 10, None, 1.0, 1e-5, accountant=kind, steps=0) == 0.0
        assert PrivacyAccountant(1.0, 0.1, accountant=kind).epsilon(1e-5) == 0.0


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_accountant_matches_dp_accounting_and_grows_with_steps(kind):
    acc = PrivacyAccountant(2.0, 0.01, accountant=kind)
    previous = acc.epsilon(1e-5)
    for more in (1, 9, 90):
        acc.step(more)
        eps = acc.epsilon(1e-5)
        assert eps == pytest.approx(direct_epsilon(kind, 0.01, 2.0, acc.steps, 1e-5), rel=ACCOUNTING_SAME_RTOL)
        assert eps > previous
        previous = eps
    assert acc.steps == 100


def test_accountant_composes_mixed_segments_like_dp_accounting():
    acc = PrivacyAccountant(1.5, 0.01, accountant="rdp")
    acc.step(10)
    acc.step(5, noise_multiplier=2.0)
    acc.step(3, sampling_probability=0.02)
    acc.step(2)
    acc.compose_gaussian(20.0, count=3)
    assert acc.steps == 20

    def sampled(q, sigma, count):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count
        )

    event = dp_accounting.ComposedDpEvent(
        [
            sampled(0.01, 1.5, 12),
            sampled(0.01, 2.0, 5),
            sampled(0.02, 1.5, 3),
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(20.0), 3),
        ]
    )
    expected = RdpAccountant(neighboring_relation=ADD_REMOVE).compose(event).get_epsilon(1e-5)
    assert acc.epsilon(1e-5) == pytest.approx(expected, rel=ACCOUNTING_COMPOSED_RTOL)
    assert "steps=20" in repr(acc) and "other_releases=3" in repr(acc)


def test_recorded_events_are_composed_as_dp_accounting_composes_them():
    # A sampled Gaussian event is DP-SGD steps, recorded as step() records them; any other event is composed whole,
    # in order, and saved with the state by its dp_accounting class and fields.
    gaussian = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.5)), 12
    )
    laplace = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.LaplaceDpEvent(3.0)), 4
    )
    by_steps = PrivacyAccountant(1.5, 0.01)
    by_steps.step(12)
    by_event = PrivacyAccountant(1.5, 0.01)
    by_event.record_event(gaussian)
    assert by_event.steps == 12 and by_event.get_state() == by_steps.get_state()
    assert by_event.epsilon(1e-5) == by_steps.epsilon(1e-5)

    by_event.record_event(dp_accounting.ComposedDpEvent([laplace, dp_accounting.NoOpDpEvent()]))
    by_event.step(3)
    assert by_event.steps == 15  # the Laplace releases are no DP-SGD steps
    reference = dp_accounting.ComposedDpEvent(
        [
            gaussian,
            laplace,
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.5)), 3
            ),
        ]
    )
    expected = PLDAccountant(neighboring_relation=ADD_REMOVE).compose(reference).get_epsilon(1e-5)
    assert by_event.epsilon(1e-5) == pytest.approx(expected, rel=ACCOUNTING_COMPOSED_RTOL)
    restored = PrivacyAccountant.from_state(json.loads(json.dumps(by_event.get_state())))
    assert restored.epsilon(1e-5) == by_event.epsilon(1e-5) and restored.steps == 15

    state = by_event.get_state()
    state["segments"][1]["event"]["module_name"] = "os"  # only dp_accounting's own classes are read back
    with pytest.raises(ValueError, match=r"state\['segments'\]\[1\]\['event'\] is not a dp_accounting event"):
        PrivacyAccountant.from_state(state)
    with pytest.raises(TypeError, match="event must be a dp_accounting.DpEvent"):
        by_event.record_event((1.5, 0.01, 12))


def test_an_event_the_accountant_cannot_account_is_refused_naming_it():
    accountant = PrivacyAccountant(1.0, 0.1)
    accountant.record_event(dp_accounting.ZCDpEvent(0.5))  # RDP accounts zCDP; PLD does not
    with pytest.raises(ValueError, match="'pld' accountant of dp_accounting cannot account .*ZCDpEvent"):
        accountant.epsilon(1e-5)
    rdp = PrivacyAccountant(1.0, 0.1, accountant="rdp")
    rdp.record_event(dp_accounting.ZCDpEvent(0.5))
    expected = RdpAccountant(neighboring_relation=ADD_REMOVE).compose(dp_accounting.ZCDpEvent(0.5)).get_epsilon(1e-5)
    assert rdp.epsilon(1e-5) == pytest.approx(expected, rel=ACCOUNTING_SAME_RTOL)


# dp_accounting's PLD (its value discretization, 1e-4 in the privacy loss) against scipy's quadrature of the
# hockey-stick divergence: both about 1e-9 relative here; 1e-6 leaves room for either, and none for a wrong mixture.
USER_LEVEL_RTOL = 1e-6
# Building a mixture's PLD takes seconds (1.4 s for one row at sigma = 2, 6.8 s at sigma = 1 on the CI's CPUs):
# these tests use sigma = 2 and at most 3 rows.
USER_SIGMA = 2.0


def test_a_user_of_k_rows_is_the_mixture_of_gaussians_whose_exact_delta_dp_accounting_gives():
    # One step, a user of 3 rows each sampled at q: with the user the release is sum_j P(J = j) N(j, sigma^2) for
    # J ~ Binomial(3, q), without it N(0, sigma^2) (units of C); delta is the larger hockey-stick divergence,
    # integrated here on a grid of 1e-4 (trapezoids: error O(h^2) at the kink, below 1e-8 relative).
    q, k = 0.01, 3  # the mixture's PLD takes longer to build as q grows (3.5 s here, 17 s at q = 0.3)
    x = np.linspace(-12 * USER_SIGMA, k + 12 * USER_SIGMA, 700_001)
    weights = [math.comb(k, j) * q**j * (1 - q) ** (k - j) for j in range(k + 1)]
    with_user = sum(w * scipy.stats.norm.pdf(x, j, USER_SIGMA) for j, w in enumerate(weights))
    without = scipy.stats.norm.pdf(x, 0.0, USER_SIGMA)
    accountant = PLDAccountant(neighboring_relation=ADD_REMOVE).compose(user_level_event(USER_SIGMA, q, k, 1))
    for epsilon in (0.01, 0.03, 0.05):
        exact = max(
            np.trapezoid(np.maximum(0.0, with_user - math.exp(epsilon) * without), x),
            np.trapezoid(np.maximum(0.0, without - math.exp(epsilon) * with_user), x),
        )
        assert exact > 1e-4  # a delta the grid resolves
        assert accountant.get_delta(epsilon) == pytest.approx(exact, rel=USER_LEVEL_RTOL), epsilon


def test_per_user_epsilon_of_one_row_is_dp_sgds_and_grows_with_the_rows():
    run = dict(num_examples=60_000, batch_size=600, epochs=None, noise_multiplier=USER_SIGMA, delta=1e-6, steps=20)
    per_user = [compute_epsilon(**run, rows_per_user=k) for k in (1, 2)]
    assert per_user[0] == pytest.approx(compute_epsilon(**run), rel=USER_LEVEL_RTOL)
    assert per_user[0] < per_user[1]
    with pytest.raises(ValueError, match="rows_per_user accounts DP-SGD's independent noise only .* not a BandMF"):
        compute_epsilon(**run, rows_per_user=2, mechanism=BandMF(2, 20))
    with pytest.raises(ValueError, match="rows_per_user must be a positive integer"):
        compute_epsilon(**run, rows_per_user=0)
    # RDP has no mixture-of-Gaussians event: it accounts the dominating Poisson-sampled Gaussian, built here.
    rdp_accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
    dominating = dp_accounting.PoissonSampledDpEvent(1 - (1 - 0.01) ** 2, dp_accounting.GaussianDpEvent(USER_SIGMA / 2))
    rdp_accountant.compose(dp_accounting.SelfComposedDpEvent(dominating, 20))
    assert compute_epsilon(**run, rows_per_user=2, accountant="rdp") == pytest.approx(
        rdp_accountant.get_epsilon(1e-6), rel=1e-12
    )
    assert compute_epsilon(**run, rows_per_user=2, accountant="rdp") > per_user[1]


@pytest.mark.parametrize("q, k", [(0.01, 2), (0.01, 3)])
def test_the_user_level_dominating_event_dominates_the_mixture(q, k):
    """Its PLD delta is at least the mixture's at every epsilon (dp_accounting's PLDs of both); k = 1 is DP-SGD's."""
    mixture = PLDAccountant(neighboring_relation=ADD_REMOVE).compose(user_level_event(USER_SIGMA, q, k, 5))
    dominating = accounting.user_level_dominating_event(user_level_event(USER_SIGMA, q, k, 1).event)
    assert dominating.sampling_probability == pytest.approx(1 - (1 - q) ** k, rel=1e-12)
    assert dominating.event.noise_multiplier == USER_SIGMA / k
    looser = PLDAccountant(neighboring_relation=ADD_REMOVE).compose(dp_accounting.SelfComposedDpEvent(dominating, 5))
    for epsilon in (0.05, 0.2, 0.5, 1.0):
        assert looser.get_delta(epsilon) >= mixture.get_delta(epsilon) * (1 - USER_LEVEL_RTOL), epsilon
    one_row = accounting.user_level_dominating_event(user_level_event(USER_SIGMA, q, 1, 1).event)
    assert one_row.event == dp_accounting.GaussianDpEvent(USER_SIGMA)
    assert one_row.sampling_probability == pytest.approx(q, rel=1e-12)


def test_the_noise_for_a_per_user_epsilon_meets_it_within_rtol():
    """With RDP (the dominating event). The PLD search runs the same segments, but each of its evaluations builds
    the mixture's PLD (3-18 s here; a whole search 37-75 s, even at one row), too slow for this suite. Checked by
    hand on 2026-12-05 with these very assertions: N = 60,000, B = 600, 20 steps, two rows, epsilon 2 per user:
    sigma 0.9028, met, and not met at sigma / 1.002; N = 1,000, B = 100, 4 steps, epsilon 0.5: sigma 4.077,
    epsilon 0.49997."""
    run = dict(num_examples=1_000, batch_size=100, epochs=None, delta=1e-6, steps=4)
    rdp = noise_multiplier_for_epsilon(0.5, **run, rows_per_user=2, accountant="rdp")
    assert compute_epsilon(**run, noise_multiplier=rdp, rows_per_user=2, accountant="rdp") <= 0.5
    assert compute_epsilon(**run, noise_multiplier=rdp / (1 + 2e-3), rows_per_user=2, accountant="rdp") > 0.5
    one_row = noise_multiplier_for_epsilon(0.5, **run, rows_per_user=1, accountant="rdp")
    assert one_row == pytest.approx(noise_multiplier_for_epsilon(0.5, **run, accountant="rdp"), rel=2e-3)
    assert rdp > one_row
    with pytest.raises(ValueError, match="rows_per_user accounts DP-SGD's independent noise only"):
        noise_multiplier_for_epsilon(0.5, **run, rows_per_user=2, mechanism=BandMF(2, 4))


def test_cli_prints_the_per_user_epsilon(capsys):
    argv = ["epsilon", "--num-examples", "60000", "--batch-size", "600", "--steps", "20", "--delta", "1e-6"]
    assert cli.main([*argv, "--noise-multiplier", str(USER_SIGMA), "--rows-per-user", "2"]) == 0
    out = capsys.readouterr().out
    want = compute_epsilon(60_000, 600, None, USER_SIGMA, 1e-6, steps=20, rows_per_user=2)
    assert _number("epsilon", out) == pytest.approx(want, rel=PRINTED_RTOL) and "per user of at most 2 rows" in out
    assert cli.main([*argv, "--target-epsilon", "2", "--rows-per-user", "2", "--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    sigma = noise_multiplier_for_epsilon(2.0, 1e-6, 60_000, 600, None, steps=20, rows_per_user=2, accountant="rdp")
    assert _number("noise multiplier", out) == pytest.approx(sigma, rel=PRINTED_RTOL)
    assert "epsilon <= 2 per user of at most 2 rows" in out and _number("epsilon", out) <= 2.0
    for extra, message in (
        (["--noise-multiplier", "1", "--rows-per-user", "3", "--mechanism", "bandmf", "--bands", "2"], "dp-sgd"),
    ):
        with pytest.raises(SystemExit):
            cli.main([*argv, *extra])
        assert message in capsys.readouterr().err


def test_state_round_trip_through_json_keeps_epsilon_and_continues():
    acc = PrivacyAccountant(1.1, 0.02, accountant="rdp", extra_noise_multipliers=[8.0])
    acc.step(30)
    acc.step(7, noise_multiplier=1.5)
    state = json.loads(json.dumps(acc.get_state()))
    restored = PrivacyAccountant.from_state(state)
    assert restored.steps == acc.steps == 37
    assert restored.epsilon(1e-5) == acc.epsilon(1e-5)
    assert repr(restored) == repr(acc)
    assert restored.get_state() == acc.get_state()
    acc.step(13)
    restored.step(13)
    assert restored.epsilon(1e-5) == acc.epsilon(1e-5)


@pytest.mark.parametrize(
    "state, match",
    [
        ({"version": 99}, "version"),
        ({"version": 1, "accountant": "rdp"}, "missing the key"),
    ],
)
def test_from_state_rejects_bad_state(state, match):
    with pytest.raises(ValueError, match=match):
        PrivacyAccountant.from_state(state)


def test_from_state_rejects_bad_segment():
    state = PrivacyAccountant(1.0, 0.1).get_state()
    state["segments"] = [{"kind": "step", "noise_multipliers": [1.0], "sampling_probability": 2.0, "count": 3}]
    with pytest.raises(ValueError, match=r"state\['segments'\]\[0\]\['sampling_probability'\]"):
        PrivacyAccountant.from_state(state)


def test_adaptive_clipping_formula_and_its_accounting():
    sigma, sigma_b = 1.1, 3.0
    grad_sigma = adaptive_clipping_noise_multiplier(sigma, sigma_b, 64)
    assert grad_sigma == pytest.approx((sigma**-2 - (2 * sigma_b) ** -2) ** -0.5, rel=FLOAT64_CLOSED_FORM_RTOL)
    assert grad_sigma > sigma
    # The paper's default sigma_b = expected_batch_size / 20.
    assert adaptive_clipping_noise_multiplier(1.0, None, 100) == pytest.approx(
        adaptive_clipping_noise_multiplier(1.0, 5.0), rel=FLOAT64_CLOSED_FORM_RTOL
    )

    # Gradient + centred count on the same batch cost what sigma alone costs.
    # dp_accounting's RDP accountant combines Gaussians inside one Poisson
    # sample itself; compare both with it.
    q, steps = 0.01, 200
    inner = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(grad_sigma), dp_accounting.GaussianDpEvent(2 * sigma_b)]
    )
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, inner), steps)
    expected = RdpAccountant(neighboring_relation=ADD_REMOVE).compose(event).get_epsilon(1e-5)
    parts = PrivacyAccountant(grad_sigma, q, accountant="rdp", extra_noise_multipliers=[2 * sigma_b])
    total = PrivacyAccountant(sigma, q, accountant="rdp")
    parts.step(steps)
    total.step(steps)
    assert parts.epsilon(1e-5) == pytest.approx(expected, rel=ACCOUNTING_COMPOSED_RTOL)
    assert total.epsilon(1e-5) == pytest.approx(expected, rel=ACCOUNTING_COMPOSED_RTOL)
    gradient_only = PrivacyAccountant(grad_sigma, q, accountant="rdp")
    gradient_only.step(steps)
    assert gradient_only.epsilon(1e-5) < expected  # forgetting the count under-reports


@pytest.mark.parametrize(
    "args, match",
    [
        ((0.0, 3.0), "total_noise_multiplier must be > 0"),
        ((1.0, -1.0), "clipped_count_stddev must be > 0"),
        ((2.0, 1.0), r"total_noise_multiplier \(2.0\) must be < 2 \* clipped_count_stddev"),
        ((1.0,), "give clipped_count_stddev, or expected_batch_size"),
        ((1.0, None, 0), "expected_batch_size must be > 0"),
    ],
)
def test_adaptive_clipping_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        adaptive_clipping_noise_multiplier(*args)


@pytest.mark.parametrize(
    "kind, target, n, b, epochs, delta",
    [
        ("rdp", 3.0, 60_000, 256, 5, 1e-5),
        ("rdp", 8.0, 5_000, 50, 3, 1e-6),
        ("pld", 0.3, 1_000, 20, 2, 1e-5),
    ],
)
def test_noise_multiplier_for_epsilon_is_the_smallest_within_budget(kind, target, n, b, epochs, delta):
    sigma = noise_multiplier_for_epsilon(target, delta, n, b, epochs, accountant=kind)
    steps = math.ceil(epochs * n / b)
    assert direct_epsilon(kind, b / n, sigma, steps, delta) <= target
    assert direct_epsilon(kind, b / n, 0.99 * sigma, steps, delta) > target


BAD_INPUTS = [
    (lambda: compute_epsilon(1000, 10, 1, -0.5, 1e-5), ValueError, "noise_multiplier must be >= 0"),
    (lambda: compute_epsilon(1000, 10, 1, 1.0, 0.0), ValueError, r"delta must be in \(0, 1\)"),
    (lambda: compute_epsilon(1000, 10, 1, 1.0, 1.0), ValueError, r"delta must be in \(0, 1\)"),
    (lambda: compute_epsilon(0, 10, 1, 1.0, 1e-5), ValueError, "num_examples must be a positive integer; got 0"),
    (
        lambda: compute_epsilon(1000.5, 10, 1, 1.0, 1e-5),
        TypeError,
        "num_examples must be a positive integer; got float 1000.5",
    ),
    (lambda: compute_epsilon(1000, 0, 1, 1.0, 1e-5), ValueError, "batch_size must be > 0"),
    (lambda: compute_epsilon(1000, 2000, 1, 1.0, 1e-5), ValueError, r"batch_size \(2000\) must be <= num_examples"),
    (lambda: compute_epsilon(1000, 10, 0, 1.0, 1e-5), ValueError, "epochs must be > 0"),
    (lambda: compute_epsilon(1000, 10, None, 1.0, 1e-5), ValueError, "epochs is required unless steps"),
    (
        lambda: compute_epsilon(1000, 10, None, 1.0, 1e-5, steps=-1),
        ValueError,
        "steps must be a non-negative integer; got -1",
    ),
    (
        lambda: compute_epsilon(1000, 10, 1, 1.0, 1e-5, sampling_probability=1.5),
        ValueError,
        r"sampling_probability must be in \(0, 1\]",
    ),
    (
        lambda: compute_epsilon(1000, 10, 1, 1.0, 1e-5, accountant="moments"),
        ValueError,
        "accountant must be one of 'pld', 'rdp'",
    ),
    (
        lambda: compute_epsilon(1000, 10, 1, 1.0, 1e-5, sampling="uniform"),
        ValueError,
        "sampling must be one of 'poisson', 'shuffle'",
    ),
    (lambda: compute_epsilon(1000, 10, 1, float("nan"), 1e-5), ValueError, "noise_multiplier must be finite"),
    (lambda: compute_epsilon(1000, "10", 1, 1.0, 1e-5), TypeError, "batch_size must be a number"),
    (lambda: PrivacyAccountant(-1.0, 0.1), ValueError, "noise_multiplier must be >= 0"),
    (lambda: PrivacyAccountant(1.0, 0.0), ValueError, r"sampling_probability must be in \(0, 1\]"),
    (lambda: PrivacyAccountant(1.0, 1.5), ValueError, r"sampling_probability must be in \(0, 1\]"),
    (lambda: PrivacyAccountant(1.0, 0.1, accountant="gdp"), ValueError, "accountant must be one of"),
    (
        lambda: PrivacyAccountant(1.0, 0.1, extra_noise_multipliers=[-2.0]),
        ValueError,
        r"extra_noise_multipliers\[0\] must be >= 0",
    ),
    (lambda: PrivacyAccountant(1.0, 0.1).epsilon(2.0), ValueError, r"delta must be in \(0, 1\)"),
    (lambda: PrivacyAccountant(1.0, 0.1).step(-1), ValueError, "n must be a non-negative integer; got -1"),
    (lambda: PrivacyAccountant(1.0, 0.1).step(1, noise_multiplier=-1), ValueError, "noise_multiplier must be >= 0"),
    (lambda: noise_multiplier_for_epsilon(0.0, 1e-5, 1000, 10, 1), ValueError, "target_epsilon must be > 0"),
    (lambda: noise_multiplier_for_epsilon(1.0, 1e-5, 1000, 10, 1, rtol=0), ValueError, r"rtol must be in \(0, 1\)"),
]


@pytest.mark.parametrize("call, error, match", BAD_INPUTS)
def test_bad_inputs_raise_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_delta_not_below_one_over_n_warns():
    with pytest.warns(UserWarning, match=r"delta=0.001 is >= 1/num_examples"):
        compute_epsilon(1000, 10, 1, 1.0, 1e-3, accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compute_epsilon(1000, 10, 1, 1.0, 1e-4, accountant="rdp")


def test_shuffle_warns_and_is_accounted_as_poisson():
    with pytest.warns(UserWarning, match="not a proven bound"):
        shuffled = compute_epsilon(1000, 10, 2, 1.0, 1e-5, accountant="rdp", sampling="shuffle")
    assert shuffled == compute_epsilon(1000, 10, 2, 1.0, 1e-5, accountant="rdp")
    with pytest.warns(UserWarning, match="sampling='shuffle'"):
        acc = PrivacyAccountant(1.0, 0.01, accountant="rdp", sampling="shuffle")
    assert acc.sampling == "shuffle"


# --------------------------------------------------------------------------
# EpsilonCallback
# --------------------------------------------------------------------------


def _tiny_fit(callback, epochs=2, steps_per_execution=1):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution, run_eagerly=True)
    x = np.random.default_rng(0).normal(size=(12, 3)).astype("float32")
    return model.fit(x, x[:, :1], batch_size=4, epochs=epochs, callbacks=[callback], verbose=0)


def test_callback_counts_steps_and_logs_increasing_epsilon():
    acc = PrivacyAccountant(1.0, 4 / 12, accountant="rdp")
    history = _tiny_fit(EpsilonCallback(acc, delta=1e-3))
    assert acc.steps == 6
    eps = history.history["epsilon"]
    assert len(eps) == 2 and 0 < eps[0] < eps[1]
    assert eps[1] == pytest.approx(direct_epsilon("rdp", 4 / 12, 1.0, 6, 1e-3), rel=ACCOUNTING_SAME_RTOL)


def test_callback_with_steps_per_execution_counts_batches_not_calls():
    acc = PrivacyAccountant(1.0, 4 / 12, accountant="rdp")
    _tiny_fit(EpsilonCallback(acc, delta=1e-3), steps_per_execution=2)
    assert acc.steps == 6


def test_callback_builds_accountant_and_can_leave_counting_to_the_model(capsys):
    callback = EpsilonCallback("rdp", delta=1e-3, noise_multiplier=1.0, sampling_probability=1 / 3, verbose=1)
    history = _tiny_fit(callback, epochs=1)
    assert callback.accountant.steps == 3
    assert "Epoch 1: epsilon = " in capsys.readouterr().out
    assert history.history["epsilon"][0] == pytest.approx(callback.accountant.epsilon(1e-3), rel=ACCOUNTING_SAME_RTOL)

    acc = PrivacyAccountant(1.0, 1 / 3, accountant="rdp")
    history = _tiny_fit(EpsilonCallback(acc, delta=1e-3, count_steps=False), epochs=1)
    assert acc.steps == 0 and history.history["epsilon"] == [0.0]


def test_callback_bad_arguments():
    with pytest.raises(ValueError, match="delta is required"):
        EpsilonCallback(PrivacyAccountant(1.0, 0.1))
    with pytest.raises(ValueError, match="noise_multiplier and sampling_probability"):
        EpsilonCallback(delta=1e-5)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        EpsilonCallback(PrivacyAccountant(1.0, 0.1), delta=5.0)
    with pytest.raises(ValueError, match="noise_multiplier and sampling_probability"):
        EpsilonCallback("pld", delta=1e-5)
    with pytest.raises(TypeError, match="PrivacyAccountant, 'pld', 'rdp' or None"):
        EpsilonCallback(3, delta=1e-5)


# --------------------------------------------------------------------------
# pegrad epsilon
# --------------------------------------------------------------------------


def _number(pattern, text):
    match = re.search(pattern + r" = ([0-9.eE+-]+)", text)
    assert match, text
    return float(match.group(1))


def test_cli_prints_epsilon_q_and_steps(capsys):
    argv = [
        "epsilon",
        "--num-examples",
        "60000",
        "--batch-size",
        "256",
        "--epochs",
        "60",
        "--noise-multiplier",
        "1.1",
        "--delta",
        "1e-5",
        "--accountant",
        "rdp",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    expected = compute_epsilon(60_000, 256, 60, 1.1, 1e-5, accountant="rdp")
    assert _number("epsilon", out) == pytest.approx(expected, rel=PRINTED_RTOL)
    assert _number("sampling probability q", out) == pytest.approx(256 / 60_000, rel=PRINTED_RTOL)
    assert _number("steps", out) == 14063


def test_cli_target_epsilon_prints_the_noise_needed(capsys):
    argv = [
        "epsilon",
        "--num-examples",
        "10000",
        "--batch-size",
        "100",
        "--epochs",
        "2",
        "--target-epsilon",
        "2",
        "--delta",
        "1e-6",
        "--accountant",
        "rdp",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    sigma = _number("noise multiplier", out)
    assert compute_epsilon(10_000, 100, 2, sigma, 1e-6, accountant="rdp") <= 2.0
    assert compute_epsilon(10_000, 100, 2, 0.99 * sigma, 1e-6, accountant="rdp") > 2.0
    assert _number("epsilon", out) <= 2.0


@pytest.mark.slow  # builds the mechanisms (Keras layers)
@pytest.mark.parametrize(
    "options, make",
    [
        (["--mechanism", "bandmf", "--bands", "4"], lambda t: BandMF(4, t)),
        (["--mechanism", "bandmf", "--bands", "2", "--cycle-length", "5"], lambda t: BandMF(2, t, cycle_length=5)),
        (["--mechanism", "blt", "--buffers", "2", "--cycle-length", "4"], lambda t: BLT(2, t, cycle_length=4)),
        (["--mechanism", "bisr", "--bands", "3"], lambda t: BISR(3, t, cycle_length=3)),
    ],
    ids=["bandmf", "bandmf_cycle", "blt", "bisr"],
)
def test_cli_plans_a_correlated_noise_run_as_compute_epsilon_accounts_it(capsys, options, make):
    # pegrad epsilon took DP-SGD only; a run planned with BandMF, BLT or BISR had to be accounted in Python (#54).
    common = ["epsilon", "--num-examples", "2000", "--batch-size", "50", "--steps", "48", "--delta", "1e-5"]
    assert cli.main([*common, "--noise-multiplier", "3", "--accountant", "rdp", *options]) == 0
    out = capsys.readouterr().out
    mechanism = make(48)
    cycle = mechanism.cycle_length
    expected = compute_epsilon(2000, 50, None, 3.0, 1e-5, steps=48, mechanism=mechanism, accountant="rdp")
    assert _number("epsilon", out) == pytest.approx(expected, rel=PRINTED_RTOL)
    assert _number("sampling probability q", out) == pytest.approx(cycle * 50 / 2000, rel=PRINTED_RTOL)
    assert f"mechanism = {type(mechanism).__name__}(" in out and f"cycle_length={cycle}" in out

    assert cli.main([*common, "--target-epsilon", "8", "--accountant", "rdp", *options]) == 0
    sigma = _number("noise multiplier", capsys.readouterr().out)
    epsilon = lambda s: compute_epsilon(  # noqa: E731
        2000, 50, None, s, 1e-5, steps=48, mechanism=make(48), accountant="rdp"
    )
    assert epsilon(sigma) <= 8.0 < epsilon(0.99 * sigma)


@pytest.mark.slow  # builds a BLT (a Keras layer)
def test_cli_monte_carlo_prints_the_librarys_figure_for_its_seed(capsys):
    """--monte-carlo prints monte_carlo_epsilon's result for the run's mechanism, q and steps, and the seed it drew with."""
    from per_example_grads.dp.monte_carlo import monte_carlo_epsilon

    common = ["epsilon", "--num-examples", "400", "--batch-size", "8", "--steps", "100", "--delta", "1e-2"]
    options = ["--mechanism", "blt", "--buffers", "2", "--cycle-length", "50", "--noise-multiplier", "2"]
    assert cli.main([*common, *options, "--monte-carlo", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    expected = monte_carlo_epsilon(BLT(2, 100, cycle_length=50), 2.0, 100, delta=1e-2, sampling_probability=1.0, seed=3)
    line = out.splitlines()[-1]
    assert line.startswith(f"epsilon = {expected.epsilon:.6g} at delta = {expected.delta:.6g} by Monte Carlo")
    assert f"({expected.samples} draws of each side, seed 3;" in line
    assert expected.epsilon < _number("epsilon", out)  # the ledger's, printed first
    # q < 1 with BLT: ten turns of parts of 40 at q = 0.5, its loss bounded and the slack printed.
    short_cycle = [*options[:5], "10", *options[6:]]
    assert cli.main([*common[:4], "20", *common[5:], *short_cycle, "--monte-carlo", "--seed", "3"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    expected = monte_carlo_epsilon(BLT(2, 100, cycle_length=10), 2.0, 100, delta=1e-2, sampling_probability=0.5, seed=3)
    assert line.startswith(f"epsilon = {expected.epsilon:.6g} at delta = {expected.delta:.6g} by Monte Carlo")
    assert line.endswith(f"losses bounded within {expected.loss_slack:.2g} nats)") and expected.loss_slack > 0
    assert cli.main([*common, *options, "--monte-carlo", "--samples", "10"]) == 2
    assert "samples=10 are too few to state delta=0.01 by Monte Carlo: take at least 6300" in capsys.readouterr().err


def test_cli_monte_carlo_calibrates_to_a_target_as_the_library_does(capsys):
    """--target-epsilon with --monte-carlo: monte_carlo_noise_multiplier's sigma, rounded up, and its certificate."""
    from per_example_grads.dp.monte_carlo import monte_carlo_noise_multiplier

    argv = ["epsilon", "--num-examples", "1000", "--batch-size", "100", "--steps", "20", "--delta", "1e-2"]
    assert cli.main([*argv, "--target-epsilon", "2", "--monte-carlo", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    expected = monte_carlo_noise_multiplier([1.0], 2.0, 20, delta=1e-2, sampling_probability=0.1, seed=1)
    line = next(line for line in out.splitlines() if "by Monte Carlo, each example's part random (pilot" in line)
    sigma = float(line.split()[3])
    assert expected.noise_multiplier <= sigma <= expected.noise_multiplier * (1 + 1e-5)
    assert f"certification {expected.certifications} of at most 3" in line
    certificate = expected.certificate
    assert out.splitlines()[-1].startswith(f"epsilon = {certificate.epsilon:.6g} at delta = {certificate.delta:.6g}")
    assert f"seed {certificate.seed}, drawn from --seed 1;" in out.splitlines()[-1]


def test_cli_shuffle_prints_the_warning(capsys):
    argv = [
        "epsilon",
        "--num-examples",
        "1000",
        "--batch-size",
        "10",
        "--steps",
        "50",
        "--noise-multiplier",
        "1",
        "--delta",
        "1e-5",
        "--sampling",
        "shuffle",
        "--accountant",
        "rdp",
    ]
    assert cli.main(argv) == 0
    assert "warning: sampling='shuffle'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--noise-multiplier", "-1"], "argument --noise-multiplier: must be >= 0"),
        (["--noise-multiplier", "1", "--delta", "2"], r"argument --delta: must be in \(0, 1\)"),
        ([], "one of the arguments --noise-multiplier --target-epsilon is required"),
        (["--noise-multiplier", "1", "--target-epsilon", "1"], "not allowed with argument"),
        (["--noise-multiplier", "1", "--accountant", "moments"], "argument --accountant: invalid choice"),
        (
            ["--noise-multiplier", "1", "--batch-size", "5000"],
            r"--batch-size \(5000\) must be <= --num-examples \(1000\)",
        ),
        (["--noise-multiplier", "1", "--bands", "4"], "--bands needs --mechanism bandmf or bisr"),
        (["--noise-multiplier", "1", "--mechanism", "bandmf"], "--mechanism bandmf needs --bands"),
        (["--noise-multiplier", "1", "--mechanism", "blt", "--buffers", "2"], "--mechanism blt needs --cycle-length"),
        (["--noise-multiplier", "1", "--mechanism", "bandmf", "--bands", "2", "--buffers", "2"], "--buffers needs"),
        (["--noise-multiplier", "1", "--cycle-length", "2"], "--cycle-length needs --mechanism bandmf or blt or bisr"),
        (["--noise-multiplier", "1", "--samples", "100"], "--samples and --seed need --monte-carlo"),
        (["--noise-multiplier", "0", "--monte-carlo"], "--monte-carlo needs --noise-multiplier > 0"),
        (
            ["--noise-multiplier", "1", "--monte-carlo", "--sampling", "shuffle"],
            "--monte-carlo needs --sampling poisson",
        ),
        (["--noise-multiplier", "1", "--monte-carlo", "--rows-per-user", "2"], "not with --rows-per-user"),
    ],
)
def test_cli_errors(capsys, extra, message):
    argv = ["epsilon", "--num-examples", "1000", "--batch-size", "10", "--epochs", "1", "--delta", "1e-5"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv + extra)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_pld_of_a_step_is_built_once_and_composes_what_dp_accounting_builds():
    """``_ReusingPLDAccountant`` keeps each kind of step's PLD and self-composes it: equal to ``PLDAccountant``'s
    epsilon and delta (the same PLD, so the same numbers), with each step's PLD built once across accountants."""
    from per_example_grads.dp import accounting, pld_cost

    poisson = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1))
    truncated = dp_accounting.TruncatedSubsampledGaussianDpEvent(1000, 0.02, 30, 1.1)
    mixture = MixtureOfGaussiansDpEvent(0.55, [0.0, 1.0, 2.0], [0.9604, 0.0392, 0.0004])
    events = [
        dp_accounting.ComposedDpEvent(
            [dp_accounting.SelfComposedDpEvent(poisson, 40), dp_accounting.SelfComposedDpEvent(truncated, 25)]
        ),
        dp_accounting.SelfComposedDpEvent(mixture, 30),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.0, dp_accounting.GaussianDpEvent(1.0)), 5
        ),
    ]
    pld_cost.step_distribution.cache_clear()
    for event in events:
        accounting._make_accountant("pld", 1e-3).compose(event).get_epsilon(1e-5)  # a coarse grid: quicker
        # the same steps at another count: their PLDs are reused, not built again
        twice = dp_accounting.SelfComposedDpEvent(event, 2)
        want = PLDAccountant(value_discretization_interval=1e-3).compose(twice)
        got = accounting._make_accountant("pld", 1e-3).compose(twice)
        assert got.get_epsilon(1e-5) == want.get_epsilon(1e-5)
        assert got.get_delta(1.0) == want.get_delta(1.0)
    assert pld_cost.step_distribution.cache_info().misses == 3  # poisson, truncated, mixture; q = 0 is the parent's


def test_the_rdp_of_a_step_is_computed_once_and_composes_what_dp_accounting_computes():
    """``_ReusingRdpAccountant`` keeps each DP-SGD step's RDP curve: its curve and epsilon equal ``RdpAccountant``'s
    bit for bit (the same curve, times the same count, added in the same order), with each curve computed once."""
    from per_example_grads.dp import accounting

    poisson = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1))
    other = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(3.0))
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(poisson, 40),
            dp_accounting.GaussianDpEvent(2.0),  # not a sampled step: the parent's
            dp_accounting.SelfComposedDpEvent(other, 7),
            dp_accounting.SelfComposedDpEvent(poisson, 13),
            dp_accounting.PoissonSampledDpEvent(0.0, dp_accounting.GaussianDpEvent(1.0)),
            dp_accounting.PoissonSampledDpEvent(0.3, dp_accounting.GaussianDpEvent(0.0)),  # infinite
        ]
    )
    accounting._step_rdp.cache_clear()
    for count in (1, 2, 5):
        twice = dp_accounting.SelfComposedDpEvent(event, count)
        want = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE).compose(twice)
        got = accounting._make_accountant("rdp").compose(twice)
        np.testing.assert_array_equal(got._rdp, want._rdp)
        finite = dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent(event.events[:-1]), count)
        assert accounting._make_accountant("rdp").compose(finite).get_epsilon(1e-5) == RdpAccountant().compose(
            finite
        ).get_epsilon(1e-5)
    assert accounting._step_rdp.cache_info().misses == 2  # poisson, other; q = 0 and sigma = 0 are the parent's
