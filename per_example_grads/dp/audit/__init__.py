"""Privacy auditing: canaries, one-run and Gaussian-DP estimators, an empirical epsilon beside the accountant's.

A DP library's epsilon is a proof about an implementation nobody can see.
An audit checks it from outside: it trains with ``m`` canaries, each
included with probability 1/2, guesses from the result which were included,
and turns the success rate into a *lower bound* on epsilon that holds with
probability ``1 - significance``. A lower bound above the accountant's
epsilon means the implementation (or its accounting) is wrong; one below it
proves nothing (a weak attack finds little).

    import per_example_grads as peg
    report = peg.dp.audit.audit(dp_model, x, y, canaries=peg.dp.audit.GradientCanaries(1000),
                                sampling_probability=q, steps=T, delta=1e-5, png="audit.png")
    print(report.summary())

- Canaries (``canaries``): ``GradientCanaries`` (white box: Dirac canaries
  inserted into the clipped sum through ``DPAggregator.canaries``, scored on
  the releases) and ``InputCanaries`` / ``mislabeled_canaries`` (black box:
  extra training examples, scored by their loss).
- ``audit`` (``run``): one ordinary ``DPModel.fit`` with the canaries, the
  bounds, the accountant's epsilon and a PNG (``AuditReport``).
- ``CanaryScoreAuditor`` (``auditor``): guesses and thresholds over in/out
  scores, with the corrections that keep the bounds valid.
- The estimators (``statistics``), functions of counts:
  ``epsilon_one_run`` (Steinke, Nasr and Jagielski 2023, with its delta
  term), ``mu_gaussian_dp`` / ``epsilon_gaussian_dp`` (Nasr et al. 2023),
  ``epsilon_clopper_pearson``, ``clopper_pearson``, ``epsilon_for_mu``.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from per_example_grads import _lazy

_EXPORTS = {
    "CanaryScoreAuditor": "per_example_grads.dp.audit.auditor",
    "OneRunBound": "per_example_grads.dp.audit.auditor",
    "ThresholdBound": "per_example_grads.dp.audit.auditor",
    "GradientCanaries": "per_example_grads.dp.audit.canaries",
    "InputCanaries": "per_example_grads.dp.audit.canaries",
    "mislabeled_canaries": "per_example_grads.dp.audit.canaries",
    "AuditReport": "per_example_grads.dp.audit.run",
    "audit": "per_example_grads.dp.audit.run",
    "clopper_pearson": "per_example_grads.dp.audit.statistics",
    "epsilon_clopper_pearson": "per_example_grads.dp.audit.statistics",
    "epsilon_for_mu": "per_example_grads.dp.audit.statistics",
    "epsilon_gaussian_dp": "per_example_grads.dp.audit.statistics",
    "epsilon_one_run": "per_example_grads.dp.audit.statistics",
    "gaussian_dp_delta": "per_example_grads.dp.audit.statistics",
    "mu_for_epsilon": "per_example_grads.dp.audit.statistics",
    "mu_gaussian_dp": "per_example_grads.dp.audit.statistics",
    "one_run_p_value": "per_example_grads.dp.audit.statistics",
}

__all__ = sorted(_EXPORTS, key=str.lower)

if _TYPE_CHECKING:  # what static tools see; at run time __getattr__ does this
    from per_example_grads.dp.audit.auditor import CanaryScoreAuditor, OneRunBound, ThresholdBound  # noqa: F401
    from per_example_grads.dp.audit.canaries import GradientCanaries, InputCanaries, mislabeled_canaries  # noqa: F401
    from per_example_grads.dp.audit.run import AuditReport, audit  # noqa: F401
    from per_example_grads.dp.audit.statistics import (  # noqa: F401
        clopper_pearson,
        epsilon_clopper_pearson,
        epsilon_for_mu,
        epsilon_gaussian_dp,
        epsilon_one_run,
        gaussian_dp_delta,
        mu_for_epsilon,
        mu_gaussian_dp,
        one_run_p_value,
    )

__getattr__, __dir__ = _lazy.exports(globals(), _EXPORTS)
