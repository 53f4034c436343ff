"""The audit demo: DP-SGD on the digits with canaries, the empirical epsilon beside the accountant's.

``run_audit_demo`` trains the digits MLP of ``pegrad demo --dp`` (64-64-10,
tanh) with ``peg.keras.DPModel`` at a target epsilon, with ``m`` canaries
each included with probability 1/2, through ``peg.dp.audit.audit``:

* gradient canaries (white box, the default): Dirac canaries of the clipped
  sum, scored on the released gradients;
* input canaries (black box): ``m`` training digits given a wrong label,
  scored by their loss at the trained model.

It prints the accountant's epsilon and the one-run, Gaussian-DP and
Clopper-Pearson lower bounds with the counts they come from, and writes
``audit.png`` (the score distributions and the trade-off curve) and
``audit.json`` (the numbers), both moved into place together.

``pegrad audit`` (``per_example_grads.apps.cli``) runs it from the command line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import keras

from per_example_grads.apps import zoo
from per_example_grads.apps.tables import InputError, check_output_folder, first_line, write_files
from per_example_grads.data import N_CLASSES, N_FEATURES, train_test_split_digits

DEFAULT_TARGET_EPSILON = 4.0
DEFAULT_DELTA = 1e-5
DEFAULT_CANARIES = 1000
DEFAULT_EPOCHS = 10
FAST_EPOCHS = 2
EXPECTED_BATCH_SIZE = 128
L2_NORM_CLIP = 1.0
LEARNING_RATE = 3e-3
PLOT_NAME = "audit.png"
JSON_NAME = "audit.json"
KINDS = ("gradient", "input")


def digits_parameters() -> int:
    """Trainable parameters of the demo's MLP: the most gradient canaries it takes."""
    return (
        N_FEATURES * zoo.DIGITS_HIDDEN_UNITS + zoo.DIGITS_HIDDEN_UNITS + zoo.DIGITS_HIDDEN_UNITS * N_CLASSES + N_CLASSES
    )


def run_audit_demo(
    out_dir: str | Path,
    *,
    target_epsilon: float = DEFAULT_TARGET_EPSILON,
    kind: str = "gradient",
    num_canaries: int | None = None,
    epochs: int | None = None,
    full_batch: bool = False,
    fast: bool = False,
    significance: float = 0.05,
    delta: float = DEFAULT_DELTA,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, Any]:
    """Audits a DP-SGD run of the digits MLP; returns the report's numbers with the files' paths.

    The run: Poisson batches at ``q = EXPECTED_BATCH_SIZE / N`` (``q = 1``
    with ``full_batch``: every example at every step, where white-box
    canaries can reach the accountant's epsilon), ``steps = round(epochs /
    q)``, clip norm ``L2_NORM_CLIP``, Adam, and the noise multiplier whose PLD
    epsilon after those steps is ``target_epsilon`` at ``delta``. ``N`` is
    the training digits (less the input canaries, which are then added back
    as ``m`` rows).

    Args:
      out_dir: folder for ``audit.png`` and ``audit.json``; tried before training.
      target_epsilon: the claim to audit, ``> 0``.
      kind: ``"gradient"`` or ``"input"`` canaries.
      num_canaries: ``m``; at most the MLP's parameters (gradient) or a
        third of the training digits (input). Default ``DEFAULT_CANARIES``,
        or that third if it is fewer.
      epochs: passes over the data; default ``DEFAULT_EPOCHS``, or
        ``FAST_EPOCHS`` with ``fast``.
      full_batch: ``q = 1``.
      fast: fewer epochs.
      significance, delta: of the bounds (and ``delta`` of the claim).
      seed: the split, the weights, the batches, the noise and the canaries.
      verbose: print the settings and the report.

    Returns:
      ``report.to_dict()`` plus ``png_path``, ``json_path``,
      ``calibration_seconds`` and ``seconds`` (the whole demo).

    Raises:
      InputError: an argument out of range, or no noise multiplier reaches
        ``target_epsilon`` (before training).
      OutputError: ``out_dir`` cannot be written.
    """
    started = time.perf_counter()
    say = print if verbose else (lambda *a, **k: None)
    if kind not in KINDS:
        raise InputError(f"--canaries must be one of {', '.join(KINDS)}; got {kind!r}")
    if epochs is None:
        epochs = FAST_EPOCHS if fast else DEFAULT_EPOCHS
    if epochs < 1:
        raise InputError(f"--epochs must be >= 1; got {epochs}")
    if not target_epsilon > 0:
        raise InputError(f"--target-epsilon must be > 0; got {target_epsilon}")
    if not 0 < significance < 1:
        raise InputError(f"--significance must be in (0, 1); got {significance}")
    out_dir = Path(out_dir)
    check_output_folder(out_dir)

    from per_example_grads.dp import audit as audit_lib
    from per_example_grads.dp import noise_multiplier_for_epsilon
    from per_example_grads.keras import DPModel

    split = train_test_split_digits(seed=seed)
    x, y = split.x_train, split.y_train
    if kind == "gradient":
        limit = digits_parameters()
        num_canaries = DEFAULT_CANARIES if num_canaries is None else num_canaries
        if not 2 <= num_canaries <= limit:
            raise InputError(
                f"--num-canaries must be in [2, {limit}] for gradient canaries (one parameter each); got {num_canaries}"
            )
        canaries = audit_lib.GradientCanaries(num_canaries, seed=seed)
    else:
        limit = len(x) // 3
        num_canaries = min(DEFAULT_CANARIES, limit) if num_canaries is None else num_canaries
        if not 2 <= num_canaries <= limit:
            raise InputError(
                f"--num-canaries must be in [2, {limit}] for input canaries (a third of the digits); got {num_canaries}"
            )
        canaries, x, y = audit_lib.mislabeled_canaries(x, y, num_canaries, num_classes=N_CLASSES, seed=seed)
    n = len(x) + (num_canaries if kind == "input" else 0)
    q = 1.0 if full_batch else min(1.0, EXPECTED_BATCH_SIZE / n)
    steps = max(1, round(epochs / q))
    say(
        f"Calibrating the noise: epsilon <= {target_epsilon:g} at delta = {delta:g} after {steps} steps (q = {q:.4f}, N = {n})..."
    )
    t0 = time.perf_counter()
    try:
        sigma = noise_multiplier_for_epsilon(target_epsilon, delta, n, q * n, None, steps=steps)
    except (ValueError, OverflowError) as e:
        raise InputError(
            f"no noise multiplier for epsilon <= {target_epsilon:g} at delta = {delta:g}: {first_line(e)}"
        ) from e
    calibration_seconds = time.perf_counter() - t0

    network = zoo.build_model("digits_dp_mlp", seed)
    dp_model = DPModel(network, l2_norm_clip=L2_NORM_CLIP, noise_multiplier=sigma, seed=seed)
    dp_model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    title = (
        f"the digits MLP ({N_FEATURES}-{zoo.DIGITS_HIDDEN_UNITS}-{N_CLASSES}, {network.count_params():,} parameters) "
        f"on the UCI handwritten digits"
    )
    say(f"Training it with DP-SGD (sigma = {sigma:.3f}) and {num_canaries} {kind} canaries for {steps} steps...")
    report = audit_lib.audit(
        dp_model,
        x,
        y,
        canaries=canaries,
        sampling_probability=q,
        steps=steps,
        delta=delta,
        significance=significance,
        seed=seed,
        title=title,
    )
    say("")
    say(report.summary())
    result = report.to_dict()
    png_path, json_path = out_dir / PLOT_NAME, out_dir / JSON_NAME
    result["calibration_seconds"] = calibration_seconds
    result["png_path"], result["json_path"] = str(png_path), str(json_path)
    write_files(
        {
            png_path: lambda path: report.figure().savefig(path, format="png"),
            json_path: lambda path: path.write_text(json.dumps(result, indent=2) + "\n"),
        }
    )
    say(f"Score distributions and trade-off curve: {png_path}; the numbers: {json_path}")
    result["seconds"] = time.perf_counter() - started
    say(f"Wall time of the demo: {result['seconds']:.1f} s.")
    return result
