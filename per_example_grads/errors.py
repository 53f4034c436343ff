"""Exceptions and warnings the library raises on purpose."""


class InvalidLossError(ValueError):
    """The loss does not give one value per example (for example, a scalar).

    Raised while an engine traces the loss; ``method="auto"`` never falls
    back on it, since every engine would fail the same way.
    """


class EngineFallbackWarning(UserWarning):
    """``method="auto"`` used an engine other than its first choice, and why."""
