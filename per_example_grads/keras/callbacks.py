"""``EpsilonCallback``: the privacy spent, logged after every epoch of ``fit``."""

from __future__ import annotations

from typing import Any

import keras

from per_example_grads.dp.accounting import PrivacyAccountant


class EpsilonCallback(keras.callbacks.Callback):
    """Counts DP-SGD steps during ``fit`` and logs ``epsilon`` after each epoch.

    Every optimizer step of a DP-SGD model is one accountant step. After
    each epoch the callback writes ``logs["epsilon"] = accountant.epsilon(delta)``
    (``log_name`` to rename it), so it appears in the progress bar and in
    ``History.history["epsilon"]``. Pass the accountant itself to keep it
    (and checkpoint ``accountant.get_state()`` with the model), or the
    arguments to build one.

    Steps are counted from the batch indices Keras reports to
    ``on_train_batch_end``: one per call, or ``steps_per_execution`` per call.
    When an epoch's length is unknown to Keras and ``steps_per_execution >
    1``, its last call may report more steps than ran, so epsilon errs on the
    high side. With ``count_steps=False`` on a ``peg.keras.DPModel`` the accountant
    follows the model's ``dp_steps`` counter (the steps actually applied,
    restored with the model's checkpoints). Otherwise ``count_steps=False`` only reports: use it
    when the model (or your own loop) calls ``accountant.step()`` itself, so
    steps are not counted twice.

    Args:
      accountant: a ``PrivacyAccountant``; or the kind of one to build from
        ``noise_multiplier``, ``sampling_probability`` and ``sampling``:
        ``"pld"`` (also what None means) or ``"rdp"``, as everywhere else.
      delta: the delta epsilon is reported for.
      count_steps: record one accountant step per training batch.
      verbose: 1 prints ``Epoch k: epsilon = ...`` after each epoch.
      log_name: the key in the epoch logs.

    Examples:
      >>> import keras, numpy as np
      >>> from per_example_grads.dp import PrivacyAccountant
      >>> acc = PrivacyAccountant(1.1, 32 / 96)
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
      >>> model.compile("sgd", "mse")
      >>> history = model.fit(np.ones((96, 4)), np.ones((96, 1)), batch_size=32, epochs=2,
      ...                     callbacks=[EpsilonCallback(acc, delta=1e-3)], verbose=0)
      >>> acc.steps, len(history.history["epsilon"])
      (6, 2)
    """

    def __init__(
        self,
        accountant: PrivacyAccountant | str | None = None,
        delta: float | None = None,
        *,
        noise_multiplier: float | None = None,
        sampling_probability: float | None = None,
        sampling: str = "poisson",
        count_steps: bool = True,
        verbose: int = 0,
        log_name: str = "epsilon",
    ):
        super().__init__()
        if delta is None:
            raise ValueError("delta is required: the delta that epsilon is reported for.")
        if accountant is None or isinstance(accountant, str):
            if noise_multiplier is None or sampling_probability is None:
                raise ValueError(
                    "give a PrivacyAccountant as accountant, or noise_multiplier and sampling_probability to build one."
                )
            accountant = PrivacyAccountant(
                noise_multiplier, sampling_probability, accountant=accountant or "pld", sampling=sampling
            )
        elif not isinstance(accountant, PrivacyAccountant):
            raise TypeError(
                f"accountant must be a PrivacyAccountant, 'pld', 'rdp' or None; got {type(accountant).__name__}."
            )
        elif noise_multiplier is not None or sampling_probability is not None:
            raise ValueError("give either accountant or noise_multiplier/sampling_probability, not both.")
        accountant.epsilon(delta)  # validates delta now rather than after the first epoch
        self.accountant = accountant
        self.delta = float(delta)
        self.count_steps = bool(count_steps)
        self.verbose = verbose
        self.log_name = log_name
        self._batches_seen = 0  # batches of the current epoch already counted

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._batches_seen = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.count_steps:
            return
        # ``batch`` is the index of the last batch run by this call.
        last = batch
        known = self.params.get("steps") if self.params else None
        if known:
            last = min(last, known - 1)
        new = last + 1 - self._batches_seen
        if new > 0:
            self.accountant.step(new)
            self._batches_seen += new

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        applied = getattr(self.model, "dp_steps", None)  # a DPModel counts its own steps
        if not self.count_steps and applied is not None:
            behind = int(applied.numpy()) - self.accountant.steps
            if behind > 0:
                self.accountant.step(behind)
        epsilon = self.accountant.epsilon(self.delta)
        if logs is not None:
            logs[self.log_name] = epsilon
        if self.verbose:
            print(
                f"\nEpoch {epoch + 1}: {self.log_name} = {epsilon:.4g} (delta = {self.delta:g}, steps = {self.accountant.steps})"
            )
