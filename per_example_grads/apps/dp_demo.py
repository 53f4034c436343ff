"""The private demo: DP-SGD on the digits, against the same model trained normally.

``run_dp_demo`` trains one small MLP twice on the bundled digits:

* privately, with ``peg.keras.DPModel`` on Poisson-sampled batches, the noise
  multiplier calibrated (PLD accountant) so the whole run spends at most the
  target epsilon;
* non-privately, with a plain Keras ``fit`` for the same number of epochs.

It prints the test accuracies next to the privacy actually spent, and saves a
PNG with the test accuracy per epoch of both runs and the fraction of
clipped examples at every private step (written under a temporary name and
moved into place, so never half-written).

``pegrad demo --dp`` (``per_example_grads.apps.cli``) runs it from the command line.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf
from tqdm import tqdm

from per_example_grads.apps import zoo
from per_example_grads.apps.tables import InputError, check_output_folder, first_line, format_table, write_files
from per_example_grads.data import N_CLASSES, N_FEATURES, train_test_split_digits
from per_example_grads.dp import compute_epsilon, noise_multiplier_for_epsilon, poisson_batches
from per_example_grads.keras import DPModel

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_TARGET_EPSILON = 8.0
DEFAULT_DELTA = 1e-5
DEFAULT_EPOCHS = 30
FAST_EPOCHS = 5
LEARNING_RATE = 3e-3
EXPECTED_BATCH_SIZE = 128
L2_NORM_CLIP = 1.0
PLOT_NAME = "dp_training.png"
DATA_NAME = "UCI handwritten digits"

# What the printed tables mean, printed under each.
COMPARISON_LEGEND = (
    "  test accuracy: share of the {test} held-out digits classified correctly after the\n"
    "  last epoch; epsilon (PLD): the privacy spent at delta = {delta:g}, by the PLD accountant\n"
    "  (inf: no guarantee); train s: wall-clock seconds of training, per-epoch evaluations included."
)
SETTINGS_LEGEND = (
    "  The three epsilons are for the same run: two PLD computations that must agree, and\n"
    "  the looser Renyi-DP bound. sigma: noise standard deviation / clip norm; q: the chance\n"
    "  that an example joins a step (Poisson sampling); clip norm: C, the largest L2 norm an\n"
    "  example's gradient keeps; s: seconds spent finding sigma and computing the epsilons."
)


def run_dp_demo(
    out_dir: str | Path,
    *,
    target_epsilon: float = DEFAULT_TARGET_EPSILON,
    delta: float = DEFAULT_DELTA,
    epochs: int | None = None,
    fast: bool = False,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, Any]:
    """Trains a digits MLP with DP-SGD and without, and compares them.

    The private run takes ``steps = round(epochs / q)`` DP-SGD steps on
    Poisson batches (each example joins a step with probability ``q =
    EXPECTED_BATCH_SIZE / N``), clipping every example's gradient to
    ``L2_NORM_CLIP``; its noise multiplier is the smallest whose PLD epsilon
    after ``steps`` steps is at most ``target_epsilon``. Its test accuracy is
    measured after every "epoch", i.e. every ``~1 / q`` steps (step
    ``round(k / q)`` ends epoch ``k``). The non-private run is a plain Keras
    ``fit`` of the same network, from the same initial weights, with shuffled
    batches of ``EXPECTED_BATCH_SIZE`` for ``epochs`` epochs.

    Only the trained models, the clipped fractions and the test accuracies
    come out of the private run. Note that the clipped fractions are computed
    from the private training data and are not covered by epsilon; they are
    shown here to explain the training, not to be published.

    Args:
      out_dir: folder for the PNG; created if missing, and tried
        (``check_output_folder``) before the calibration and training.
      target_epsilon: the privacy budget, ``> 0``.
      delta: the delta of the guarantee, well below ``1 / N``.
      epochs: epochs of each run; default ``DEFAULT_EPOCHS``, or
        ``FAST_EPOCHS`` with ``fast``.
      fast: train for ``FAST_EPOCHS`` epochs (a few seconds of training; the
        PLD calibration and accounting then take most of the run's time);
        the noise is calibrated for that shorter run.
      seed: seeds the split, the initial weights, the Poisson batches, the
        noise and the non-private shuffling.
      verbose: print the progress bars and tables (the results are returned
        either way).

    Returns:
      A dict with
      ``private_accuracy``, ``nonprivate_accuracy``: final test accuracies;
      ``epsilon``: PLD epsilon spent, ``DPModel.epsilon(delta)``;
      ``epsilon_check``: the same from ``compute_epsilon(..., steps=steps)``;
      ``epsilon_rdp``: the (looser) RDP bound for the same run;
      ``target_epsilon``, ``delta``, ``noise_multiplier`` (sigma),
      ``sampling_probability`` (q), ``expected_batch_size``, ``l2_norm_clip``;
      ``steps`` (DP-SGD steps taken, from ``DPModel.dp_steps``),
      ``planned_steps`` (``round(epochs / q)``), ``epochs``, ``train_size``,
      ``test_size``;
      ``private_curve``, ``nonprivate_curve``: ``[epochs]`` float test
      accuracies after each epoch;
      ``clipped_fraction``: ``[steps]`` float, the fraction of the step's
      sampled examples whose gradient norm exceeded the clip norm (0 for an
      empty batch);
      ``private_seconds``, ``nonprivate_seconds``: training wall times
      (including the per-epoch evaluations); ``calibration_seconds``: the
      search for sigma; ``accounting_seconds``: the three epsilon
      computations after training; ``seconds``: wall time of the whole demo;
      ``model``, ``data``: the network and data set, in words (the plot's
      title); ``png_path`` (str).

    Raises:
      ValueError: ``epochs < 1`` or ``target_epsilon <= 0``.
      InputError: ``out_dir`` cannot name a folder, or no noise multiplier
        meets ``target_epsilon`` at ``delta`` for this run (the accounting's
        ``ValueError`` or ``OverflowError``, raised before training).
      OutputError: ``out_dir`` cannot be created or written (before
        training), or writing the PNG failed (then no PNG is left).
    """
    started = time.perf_counter()
    say = print if verbose else _silent
    if epochs is None:
        epochs = FAST_EPOCHS if fast else DEFAULT_EPOCHS
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1; got {epochs}.")
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0; got {target_epsilon}.")
    out_dir = Path(out_dir)
    check_output_folder(out_dir)

    split = train_test_split_digits(seed=seed)
    n = len(split.x_train)
    q = EXPECTED_BATCH_SIZE / n
    steps = max(1, round(epochs / q))
    say(
        f"Calibrating the noise: epsilon <= {target_epsilon:g} at delta = {delta:g} "
        f"after {steps} Poisson steps (q = {q:.4f}, N = {n})..."
    )
    t0 = time.perf_counter()
    try:
        sigma = noise_multiplier_for_epsilon(target_epsilon, delta, n, EXPECTED_BATCH_SIZE, None, steps=steps)
    except (ValueError, OverflowError) as e:
        raise InputError(
            f"no noise multiplier for epsilon <= {target_epsilon:g} at delta = {delta:g}: {first_line(e)}"
        ) from e
    calibration_seconds = time.perf_counter() - t0

    say(
        f"Training a {N_FEATURES}-{zoo.DIGITS_HIDDEN_UNITS}-{N_CLASSES} MLP privately "
        f"(sigma = {sigma:.3f}, clip = {L2_NORM_CLIP:g}) for {epochs} epoch(s)..."
    )
    t0 = time.perf_counter()
    network = zoo.build_model("digits_dp_mlp", seed)
    dp_model = DPModel(
        network,
        l2_norm_clip=L2_NORM_CLIP,
        noise_multiplier=sigma,
        expected_batch_size=EXPECTED_BATCH_SIZE,
        num_examples=n,
        seed=seed,
    )
    dp_model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    batches = poisson_batches(split.x_train, split.y_train, sampling_probability=q, steps=steps, seed=seed)
    private_log = TrainingLog(
        split.x_test,
        split.y_test,
        epoch_ends=[round(k * steps / epochs) for k in range(1, epochs + 1)],
        desc="private (DP-SGD)",
        progress=verbose,
    )
    dp_model.fit(batches, epochs=1, shuffle=False, callbacks=[private_log], verbose=0)
    private_seconds = time.perf_counter() - t0

    say(f"Training the same MLP without privacy for {epochs} epoch(s)...")
    t0 = time.perf_counter()
    model = zoo.build_model("digits_dp_mlp", seed)  # the same initial weights as the private run
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    nonprivate_log = TrainingLog(split.x_test, split.y_test, desc="non-private", progress=verbose)
    model.fit(
        split.x_train,
        split.y_train,
        batch_size=EXPECTED_BATCH_SIZE,
        epochs=epochs,
        shuffle=True,
        callbacks=[nonprivate_log],
        verbose=0,
    )
    nonprivate_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    dp_steps = int(dp_model.dp_steps.numpy())
    epsilon = dp_model.epsilon(delta)
    epsilon_check = compute_epsilon(n, EXPECTED_BATCH_SIZE, None, sigma, delta, steps=dp_steps)
    epsilon_rdp = compute_epsilon(n, EXPECTED_BATCH_SIZE, None, sigma, delta, steps=dp_steps, accountant="rdp")
    if dp_steps != steps:
        raise RuntimeError(f"planned {steps} DP-SGD steps but DPModel counted {dp_steps}.")
    if not math.isclose(epsilon, epsilon_check, rel_tol=1e-9):
        raise RuntimeError(f"DPModel.epsilon ({epsilon}) disagrees with compute_epsilon ({epsilon_check}).")
    accounting_seconds = time.perf_counter() - t0

    result = {
        "private_accuracy": private_log.accuracies[-1],
        "nonprivate_accuracy": nonprivate_log.accuracies[-1],
        "epsilon": epsilon,
        "epsilon_check": epsilon_check,
        "epsilon_rdp": epsilon_rdp,
        "target_epsilon": float(target_epsilon),
        "delta": float(delta),
        "noise_multiplier": float(sigma),
        "sampling_probability": q,
        "expected_batch_size": EXPECTED_BATCH_SIZE,
        "l2_norm_clip": L2_NORM_CLIP,
        "steps": dp_steps,
        "planned_steps": steps,
        "epochs": int(epochs),
        "train_size": int(n),
        "test_size": int(len(split.x_test)),
        "private_curve": list(private_log.accuracies),
        "nonprivate_curve": list(nonprivate_log.accuracies),
        "clipped_fraction": list(private_log.clipped_fraction),
        "private_seconds": private_seconds,
        "nonprivate_seconds": nonprivate_seconds,
        "calibration_seconds": calibration_seconds,
        "accounting_seconds": accounting_seconds,
        "model": f"{network.name} ({N_FEATURES}-{zoo.DIGITS_HIDDEN_UNITS}-{N_CLASSES} tanh MLP, "
        f"{network.count_params():,} parameters)",
        "data": DATA_NAME,
    }
    say("")
    say(format_comparison(result))
    say(COMPARISON_LEGEND.format(test=result["test_size"], delta=result["delta"]) + "\n")
    say(format_settings(result))
    say(SETTINGS_LEGEND + "\n")
    say("The clipped fractions in the plot are computed from the private data and are not covered by epsilon.")

    png_path = out_dir / PLOT_NAME
    write_files({png_path: lambda path: save_dp_training_plot(result, path)})
    say(f"Plot of the training runs: {png_path}")
    result["png_path"] = str(png_path)
    result["seconds"] = time.perf_counter() - started
    say(f"Wall time of the demo: {result['seconds']:.1f} s.")
    return result


class TrainingLog(keras.callbacks.Callback):
    """Test accuracy at epoch boundaries and each step's ``step_clipped_fraction``, with a tqdm bar.

    Args:
      x_test: ``[N_test, 64]`` float32; y_test: ``[N_test]`` int labels.
      epoch_ends: None to evaluate at the end of every Keras epoch; or the
        1-based global step counts after which an "epoch" ends, for a run
        that is one long Keras epoch (Poisson steps).
      desc: the progress bar's label.
      progress: show the progress bar (one tick per epoch, the latest test
        accuracy as its postfix).

    Attributes:
      accuracies: test accuracy after each epoch.
      clipped_fraction: ``step_clipped_fraction`` of every training step whose
        batch logs have it (those of a ``DPModel``).
    """

    def __init__(
        self,
        x_test: np.ndarray,
        y_test: np.ndarray,
        *,
        epoch_ends: list[int] | None = None,
        desc: str = "training",
        progress: bool = True,
    ):
        super().__init__()
        self._x_test = tf.constant(x_test)
        self._y_test = np.asarray(y_test)
        self._epoch_ends = None if epoch_ends is None else list(epoch_ends)
        self._desc = desc
        self._progress = progress
        self._bar: tqdm | None = None
        self._next_end = 0  # index into epoch_ends
        self._steps_done = 0
        self.accuracies: list[float] = []
        self.clipped_fraction: list[float] = []

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        total = len(self._epoch_ends) if self._epoch_ends is not None else self.params.get("epochs")
        self._bar = tqdm(total=total, desc=self._desc, unit="epoch", disable=not self._progress)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._steps_done += 1
        if logs and "step_clipped_fraction" in logs:
            self.clipped_fraction.append(float(logs["step_clipped_fraction"]))
        if self._epoch_ends is None:
            return
        while self._next_end < len(self._epoch_ends) and self._steps_done >= self._epoch_ends[self._next_end]:
            self._next_end += 1
            self._record_epoch()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._epoch_ends is None:
            self._record_epoch()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._bar is not None:
            self._bar.close()

    def _record_epoch(self) -> None:
        accuracy = evaluate_accuracy(self.model, self._x_test, self._y_test)
        self.accuracies.append(accuracy)
        if self._bar is not None:
            self._bar.set_postfix(test_acc=f"{accuracy:.3f}")
            self._bar.update(1)


def evaluate_accuracy(model: keras.Model, x: Any, y: np.ndarray) -> float:
    """The share of ``[N]`` labels ``y`` that ``model``'s argmax logits on ``x`` get right."""
    logits = model(x, training=False)
    return float(np.mean(np.argmax(np.asarray(logits), axis=-1) == y))


def format_comparison(result: dict[str, Any]) -> str:
    """Private against non-private: test accuracy, epsilon and training time."""
    rows = [
        [
            "private (DP-SGD)",
            f"{result['private_accuracy']:.3f}",
            f"{result['epsilon']:.2f}",
            f"{result['private_seconds']:.1f}",
        ],
        [
            "non-private",
            f"{result['nonprivate_accuracy']:.3f}",
            "inf",
            f"{result['nonprivate_seconds']:.1f}",
        ],
    ]
    return format_table(["run", "test accuracy", "epsilon (PLD)", "train s"], rows)


def format_settings(result: dict[str, Any]) -> str:
    """The private run's privacy and training settings, one per row."""
    rows = [
        ["epsilon (PLD), DPModel.epsilon", f"{result['epsilon']:.4f}"],
        ["epsilon (PLD), compute_epsilon", f"{result['epsilon_check']:.4f}"],
        ["epsilon (RDP, looser bound)", f"{result['epsilon_rdp']:.4f}"],
        ["target epsilon", f"{result['target_epsilon']:g}"],
        ["delta", f"{result['delta']:g}"],
        ["noise multiplier sigma", f"{result['noise_multiplier']:.4f}"],
        ["sampling probability q", f"{result['sampling_probability']:.4f}"],
        ["expected batch size", f"{result['expected_batch_size']:g}"],
        ["steps", result["steps"]],
        ["epochs", result["epochs"]],
        ["clip norm", f"{result['l2_norm_clip']:g}"],
        ["training examples", result["train_size"]],
        ["sigma calibration s", f"{result['calibration_seconds']:.1f}"],
        ["epsilon accounting s", f"{result['accounting_seconds']:.1f}"],
    ]
    return format_table(["setting", "value"], rows)


def save_dp_training_plot(result: dict[str, Any], path: str | Path) -> Path:
    """Writes ``dp_training_figure(result)`` to ``path`` (PNG) itself; ``run_dp_demo`` gives it a temporary path."""
    path = Path(path)
    dp_training_figure(result).savefig(path, format="png")
    return path


def dp_training_figure(result: dict[str, Any]) -> "Figure":
    """Two panels: test accuracy per epoch of both runs, and the clipped fraction per DP-SGD step.

    ``result`` is ``run_dp_demo``'s dict (``private_curve``,
    ``nonprivate_curve``, ``clipped_fraction``, ``epsilon``, ``delta``,
    ``noise_multiplier``, ``sampling_probability``, ``l2_norm_clip``,
    ``steps``, ``expected_batch_size``, ``train_size``, ``test_size`` are
    used; ``model`` and ``data`` name them in the title when present). The
    privacy parameters are in the accuracy panel's legend; the clipped
    fraction panel says that it is outside the (epsilon, delta) guarantee.
    Uses matplotlib's Agg canvas directly, so the global pyplot backend is
    left alone.
    """
    from matplotlib.ticker import MaxNLocator

    from per_example_grads import plots

    fig = plots.new_figure(13, 5.4)
    acc_ax, clip_ax = fig.subplots(1, 2)
    model = result.get("model", "digits_dp_mlp")
    data = result.get("data", DATA_NAME)
    fig.suptitle(
        f"DP-SGD against non-private training: {model} on the {data}\n"
        f"({result['train_size']:,} training, {result['test_size']:,} test examples)",
        fontsize=12,
    )

    private = (
        f"DP-SGD: ε = {result['epsilon']:.2f} at δ = {result['delta']:g} (PLD accountant)\n"
        f"σ = {result['noise_multiplier']:.3f}, q = {result['sampling_probability']:.4f} "
        f"(batch ≈ {result['expected_batch_size']:g}), C = {result['l2_norm_clip']:g}, "
        f"{result['steps']} steps"
    )
    for key, label, color in (
        ("private_curve", private, "tab:blue"),
        ("nonprivate_curve", f"non-private (ε = ∞), batches of {result['expected_batch_size']:g}", "tab:orange"),
    ):
        curve = result[key]
        final = curve[-1] if curve else float("nan")
        acc_ax.plot(
            range(1, len(curve) + 1),
            curve,
            marker="o",
            markersize=3,
            color=color,
            label=f"{label}\nfinal test accuracy {final:.3f}",
        )
    acc_ax.set_title("Test accuracy after each epoch", fontsize=10)
    acc_ax.set_xlabel("epoch (one pass over the training set; DP-SGD: 1/q Poisson steps)")
    acc_ax.set_ylabel(f"test accuracy (fraction of {result['test_size']:,} examples)")
    acc_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    acc_ax.set_ylim(0, 1.02)
    acc_ax.grid(alpha=0.3)
    acc_ax.legend(loc="lower right", fontsize=8)

    fractions = np.asarray(result["clipped_fraction"], dtype=float)
    steps = np.arange(1, len(fractions) + 1)
    clip_ax.plot(
        steps,
        fractions,
        color="tab:blue",
        alpha=0.35,
        linewidth=0.8,
        label=f"per step (mean {np.mean(fractions):.2f})" if len(fractions) else "per step",
    )
    window = min(len(fractions), 10)
    if window > 1:
        smooth = np.convolve(fractions, np.ones(window) / window, mode="valid")
        clip_ax.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"mean of {window} steps")
    clip_ax.set_title(
        f"Examples clipped: fraction of each step's batch with ‖g_i‖₂ > C = {result['l2_norm_clip']:g}",
        fontsize=10,
    )
    clip_ax.set_xlabel("DP-SGD step")
    clip_ax.set_ylabel("fraction of the step's examples clipped")
    clip_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    clip_ax.set_ylim(-0.02, 1.02)
    clip_ax.grid(alpha=0.3)
    clip_ax.legend(
        loc="lower left",
        fontsize=8,
        title="Not covered by the (ε, δ) guarantee:\ncomputed from the private data, not noised;\n"
        "shown to explain training, not to publish",
        title_fontsize=8,
    )
    fig.tight_layout()
    return fig


def _silent(*args: Any, **kwargs: Any) -> None:
    pass
