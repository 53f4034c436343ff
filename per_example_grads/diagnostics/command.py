"""``pegrad diagnose``: gradient statistics of a saved model, or of the demo's digits MLP.

``run_diagnose`` loads ``MODEL.keras`` and ``DATA.npz`` (arrays ``x`` and
``y``), or with neither trains the demo's small MLP briefly on the shipped
digits, runs ``gradient_statistics`` over the data, writes ``report.json``,
``report.png`` (overview) and ``norms_histogram.png``, and prints a summary
with a suggested batch size.

Suggested batch size: the simple noise scale ``B_simple`` (McCandlish et
al., 2018) approximates the critical batch size, beyond which larger batches
stop reducing the number of steps much. The suggestion is ``ceil(B_simple)``,
and at the current batch size ``b`` that is ``ceil(B_simple / b)`` gradient
accumulation steps.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_BATCH_SIZE = 32  # the demo's training batch size
FAST_EXAMPLES = 600
DEMO_EPOCHS = 3
STATS_BATCH_SIZE = 128


def suggest_batch_size(noise_scale: float, current_batch_size: int) -> tuple[int | None, int | None]:
    """``(ceil(B_simple), accumulation steps at current_batch_size)``; Nones if undefined."""
    if not (math.isfinite(noise_scale) and noise_scale > 0):
        return None, None
    suggested = max(1, math.ceil(noise_scale))
    return suggested, max(1, math.ceil(suggested / current_batch_size))


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` from an ``.npz`` with arrays ``x`` and ``y``."""
    with np.load(path) as arrays:
        missing = {"x", "y"} - set(arrays.files)
        if missing:
            raise ValueError(f"{path} must hold arrays 'x' and 'y'; it has {sorted(arrays.files)}.")
        return arrays["x"], arrays["y"]


def _demo_model(fast: bool, seed: int, say) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    import keras

    from per_example_grads import demo
    from per_example_grads.data import train_test_split_digits

    split = train_test_split_digits(seed=seed)
    x, y = split.x_train, split.y_train
    if fast:
        keep = np.sort(np.random.default_rng(seed).permutation(len(x))[:FAST_EXAMPLES])
        x, y = x[keep], y[keep]
    epochs = 1 if fast else DEMO_EPOCHS
    say(f"Training the demo's digits MLP on {len(x)} examples for {epochs} epoch(s)...")
    keras.utils.set_random_seed(seed)
    model = demo.build_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(demo.FAST_LEARNING_RATE if fast else demo.LEARNING_RATE), loss=loss)
    model.fit(x, y, epochs=epochs, batch_size=DEFAULT_BATCH_SIZE, verbose=0)
    return model, loss, x, y


def run_diagnose(
    out_dir: str | Path,
    model_path: str | Path | None = None,
    data_path: str | Path | None = None,
    *,
    fast: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    stats_batch_size: int = STATS_BATCH_SIZE,
    top_k: int = 10,
    loss: str | None = None,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, Any]:
    """Diagnoses a model's gradients and writes the report files.

    Args:
      out_dir: folder for ``report.json``, ``report.png``, ``norms_histogram.png``.
      model_path, data_path: a ``.keras`` model (compiled with a loss, or give
        ``loss``) and an ``.npz`` with ``x``, ``y``; both or neither (then the
        demo MLP on the digits).
      fast: with the demo, 1 epoch on a subset; with given data, at most
        ``FAST_EXAMPLES`` examples.
      batch_size: the training batch size the suggestion is relative to.
      stats_batch_size: batch size of the statistics stream (the ``B_big`` of
        the noise-scale estimate).
      top_k: largest-norm examples to report.
      loss: a Keras loss name overriding the model's compiled loss.
      seed: seed for the demo's split, subset and weights.
      verbose: print progress and the summary.

    Returns:
      ``{"report": GradientReport.to_dict(), "suggested_batch_size",
      "accumulation_steps", "files": [paths], "seconds"}``.
    """
    started = time.perf_counter()
    say = print if verbose else (lambda *a, **k: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (model_path is None) != (data_path is None):
        raise ValueError("give both MODEL.keras and DATA.npz, or neither (the demo model).")
    if model_path is None:
        model, loss_fn, x, y = _demo_model(fast, seed, say)
        if loss is not None:
            loss_fn = loss
    else:
        import keras

        model = keras.models.load_model(model_path)
        loss_fn = loss if loss is not None else getattr(model, "loss", None)
        if loss_fn is None:
            raise ValueError(f"{model_path} was saved without a compiled loss; pass --loss NAME.")
        x, y = load_npz(data_path)
        if fast:
            x, y = x[:FAST_EXAMPLES], y[:FAST_EXAMPLES]
        if np.issubdtype(x.dtype, np.floating) and x.dtype != np.float32:
            x = x.astype(np.float32)

    from per_example_grads.demo import save_norms_histogram
    from per_example_grads.diagnostics.statistics import gradient_statistics

    report = gradient_statistics(
        model, loss_fn, (x, y), batch_size=stats_batch_size, top_k=top_k, progress=verbose
    )
    d = report.to_dict()
    suggested, accumulation = suggest_batch_size(report.noise_scale, batch_size)
    files = [out / "report.json", out / "report.png", out / "norms_histogram.png"]
    with open(files[0], "w") as f:
        json.dump({**d, "suggested_batch_size": suggested, "accumulation_steps": accumulation,
                   "current_batch_size": batch_size}, f, indent=2, allow_nan=False)
    report.save_png(files[1])
    save_norms_histogram(report.per_example_norms.astype(np.float32), files[2], title_suffix=f"{report.num_examples} examples")

    say("")
    say(report.summary())
    if suggested is None:
        say("suggested batch size: undefined (the estimated |G|^2 is not positive: the gradient is "
            "dominated by noise; the model may be near a minimum)")
    else:
        say(f"suggested batch size ~ B_simple = {suggested}: at batch size {batch_size}, "
            f"{accumulation} gradient accumulation step(s) per update")
    top = ", ".join(f"{e['index']} ({e['norm']:.3g})" for e in d["top_examples"][:5])
    say(f"largest per-example gradient norms (index: norm): {top}")
    say(f"wrote {', '.join(str(p) for p in files)}")
    return {
        "report": d,
        "suggested_batch_size": suggested,
        "accumulation_steps": accumulation,
        "files": [str(p) for p in files],
        "seconds": time.perf_counter() - started,
    }
