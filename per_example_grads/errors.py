"""Exceptions and warnings the library raises on purpose."""


class InvalidLossError(ValueError):
    """The loss does not give one value per example (for example, a scalar).

    Raised while an engine traces the loss; ``method="auto"`` never falls
    back on it, since every engine would fail the same way.
    """

    # AutoGraph re-raises errors from traced code as the same type only when
    # the type's __init__ is Exception.__init__ (else as a StagingError that
    # hides the type). Sharing it keeps this error recognizable through
    # tf.function, tf.vectorized_map and tf.map_fn.
    __init__ = Exception.__init__


class EngineFallbackWarning(UserWarning):
    """``method="auto"`` used an engine other than its first choice, and why."""


class EngineError(ValueError):
    """An engine refused or could not handle the model (the one refusal error type).

    The message names the engine and the cause. Raised when an explicitly
    chosen engine refuses the model or fails on it (``method="auto"`` would
    have fallen back to another engine instead), and when ``auto`` finds no
    engine that runs. A ``ValueError``: the model is what the engine cannot take.

    Never raised for a data error: when the plain batch gradient of the model
    and loss fails too (a wrong feature size, a missing input key, a label out
    of range), its own exception is raised instead, whatever the ``method``;
    see ``per_example_grads.engines.selection``.
    """

    __init__ = Exception.__init__  # recognizable through tf.function (see InvalidLossError)
