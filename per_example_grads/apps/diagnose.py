"""``pegrad diagnose``: gradient statistics of a saved model, or of the demo's digits MLP.

``run_diagnose`` loads ``MODEL.keras`` and ``DATA.npz`` (arrays ``x`` and
``y``), or with neither trains the demo's small MLP briefly on the shipped
digits, runs ``gradient_statistics`` over the data, writes ``report.json``,
``report.png`` (overview) and ``norms_histogram.png`` (all three or none),
and prints a summary with a suggested batch size.

Suggested batch size: the simple noise scale ``B_simple`` (McCandlish et
al., 2018) approximates the critical batch size, beyond which larger batches
stop reducing the number of steps much. The suggestion is ``ceil(B_simple)``,
and at the current batch size ``b`` that is ``ceil(B_simple / b)`` gradient
accumulation steps. ``B_simple`` here is ``GradientReport.noise_scale_full_data``,
the estimate from all N examples at once: it averages over every pair of
examples, where the per-batch ``noise_scale`` uses only pairs within a batch
and is noisier when ``|G|^2`` is small: its spread is wider, and it is more
often undefined (``|G|^2 <= 0``).
"""

from __future__ import annotations

import json
import math
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from per_example_grads.apps.tables import InputError, check_output_folder, first_line, write_files

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


class DiagnoseInputError(InputError):
    """A MODEL.keras, DATA.npz or --loss that ``pegrad diagnose`` cannot use.

    Its message is one line, naming the file and what is wrong with it;
    ``pegrad`` prints it as ``pegrad diagnose: error: MESSAGE`` and exits 2.
    """


MODEL_SUFFIXES = (".keras", ".h5", ".hdf5")


def check_paths(out_dir: str | Path, model_path: str | Path | None, data_path: str | Path | None) -> None:
    """Checks what can be checked without reading the files (or importing TensorFlow).

    That includes ``check_output_folder(out_dir)``, which tries the folder
    and leaves it as it was.

    Raises:
      DiagnoseInputError: only one of model and data given; a path that does
        not exist, is a folder, or (model) lacks a Keras suffix or (data) is
        not a zip archive, as every ``.npz`` is.
      InputError: ``out_dir`` cannot name a folder (an existing file, or
        under one).
      OutputError: ``out_dir`` cannot be created or written.
    """
    if (model_path is None) != (data_path is None):
        raise DiagnoseInputError("give both MODEL.keras and DATA.npz, or neither (the demo model)")
    check_output_folder(out_dir)
    if model_path is None:
        return
    model, data = Path(model_path), Path(data_path)
    for what, path in (("model", model), ("data", data)):
        if not path.exists():
            raise DiagnoseInputError(f"{what} file not found: {path}")
        if path.is_dir():
            raise DiagnoseInputError(f"{what} file {path} is a folder")
    if model.suffix.lower() not in MODEL_SUFFIXES:
        raise DiagnoseInputError(
            f"model file {model} is not a Keras model file: expected a .keras file "
            "(or a legacy .h5) written by model.save()"
        )
    if not zipfile.is_zipfile(data):
        raise DiagnoseInputError(f"data file {data} is not an .npz archive: write one with numpy.savez(path, x=x, y=y)")


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` from an ``.npz`` with arrays ``x`` and ``y`` sharing their first axis.

    Raises:
      DiagnoseInputError: the file cannot be read as an ``.npz``, lacks ``x``
        or ``y``, holds Python objects (pickles are never loaded), or its
        arrays disagree on the number of examples or hold none.
    """
    try:
        arrays = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DiagnoseInputError(f"data file {path} could not be read as an .npz archive ({first_line(e)})") from e
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise DiagnoseInputError(f"data file {path} holds a single array, not an .npz archive with arrays x and y")
    with arrays:
        missing = {"x", "y"} - set(arrays.files)
        if missing:
            raise DiagnoseInputError(f"data file {path} must hold arrays 'x' and 'y'; it has {sorted(arrays.files)}")
        loaded = {}
        for name in ("x", "y"):
            try:
                loaded[name] = arrays[name]
            except ValueError as e:  # object arrays need pickle, which stays off
                raise DiagnoseInputError(
                    f"array '{name}' in data file {path} holds Python objects (dtype=object); save numeric arrays"
                ) from e
            except (OSError, zipfile.BadZipFile) as e:
                raise DiagnoseInputError(f"array '{name}' in data file {path} is unreadable ({first_line(e)})") from e
    x, y = loaded["x"], loaded["y"]
    if x.ndim == 0 or y.ndim == 0:
        raise DiagnoseInputError(
            f"data file {path}: x and y must have an examples axis; got shapes {x.shape} and {y.shape}"
        )
    if len(x) != len(y):
        raise DiagnoseInputError(f"data file {path}: x has {len(x)} examples but y has {len(y)}")
    if len(x) == 0:
        raise DiagnoseInputError(f"data file {path} holds no examples")
    return x, y


def load_model(path: str | Path, loss: str | None):
    """``(model, loss)`` from a saved Keras model; ``loss`` overrides its compiled loss.

    Raises:
      DiagnoseInputError: the file does not load, it has no compiled loss and
        ``loss`` is None, or ``loss`` is not a Keras loss name.
    """
    import keras

    try:
        model = keras.models.load_model(path)
    except Exception as e:  # noqa: BLE001 - Keras raises many types for a bad file
        raise DiagnoseInputError(f"model file {path} could not be loaded ({type(e).__name__}: {first_line(e)})") from e
    if loss is not None:
        check_loss_name(loss)
        return model, loss
    compiled = getattr(model, "loss", None)
    if compiled is None:
        raise DiagnoseInputError(f"model file {path} was saved without a compiled loss; pass --loss NAME")
    return model, compiled


def check_loss_name(loss: str) -> None:
    """Refuses a ``--loss`` that Keras does not know."""
    import keras

    try:
        keras.losses.get(loss)
    except (ValueError, TypeError) as e:
        raise DiagnoseInputError(
            f"--loss {loss!r} is not a Keras loss name (for example sparse_categorical_crossentropy or mse)"
        ) from e


def check_model_input(model: Any, x: np.ndarray, path: str | Path) -> None:
    """Refuses ``x`` whose example shape a single-input model cannot take."""
    inputs = getattr(model, "inputs", None)
    if not inputs or len(inputs) != 1 or inputs[0].shape is None:
        return
    expected = tuple(inputs[0].shape)[1:]
    got = tuple(x.shape[1:])
    if len(expected) != len(got) or any(e is not None and e != g for e, g in zip(expected, got)):
        raise DiagnoseInputError(
            f"x in data file {path} has examples of shape {_shape(got)}; the model takes {_shape(expected)}"
        )


def _write_json(obj: Any, path: str | Path) -> None:
    """Writes ``obj`` to ``path`` as indented JSON; NaN and infinity are refused (``ValueError``)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, allow_nan=False)


def _shape(dims: tuple) -> str:
    text = ", ".join("None" if d is None else str(d) for d in dims)
    return f"({text},)" if len(dims) == 1 else f"({text})"


def _demo_model(fast: bool, seed: int, say) -> tuple[Any, Any, np.ndarray, np.ndarray, np.ndarray]:
    """``(model, loss, x, y, rows)``: the demo MLP trained briefly; ``rows`` index ``load_digits()``."""
    import keras

    from per_example_grads.apps import demo, zoo
    from per_example_grads.data import train_test_split_digits

    split = train_test_split_digits(seed=seed)
    x, y, rows = split.x_train, split.y_train, split.train_index
    if fast:
        keep = np.sort(np.random.default_rng(seed).permutation(len(x))[:FAST_EXAMPLES])
        x, y, rows = x[keep], y[keep], rows[keep]
    epochs = 1 if fast else DEMO_EPOCHS
    say(f"Training the demo's digits MLP on {len(x)} examples for {epochs} epoch(s)...")
    model = zoo.build_model("digits_mlp", seed)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(demo.FAST_LEARNING_RATE if fast else demo.LEARNING_RATE), loss=loss)
    model.fit(x, y, epochs=epochs, batch_size=DEFAULT_BATCH_SIZE, verbose=0)
    return model, loss, x, y, rows


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

    Raises:
      DiagnoseInputError: for a model, data or loss it cannot use (see
        ``check_paths``, ``load_npz``, ``load_model``, ``check_model_input``).
      InputError: ``out_dir`` cannot name a folder.
      OutputError: ``out_dir`` cannot be created or written, tried before
        any work, or writing a file failed at the end (a full disk).
      After any of these, nothing has been written: the three files are
      written with ``write_files``, all or none.
    """
    started = time.perf_counter()
    say = print if verbose else (lambda *a, **k: None)
    check_paths(out_dir, model_path, data_path)
    out = Path(out_dir)
    if model_path is None:
        if loss is not None:
            check_loss_name(loss)
        model, loss_fn, x, y, rows = _demo_model(fast, seed, say)
        if loss is not None:
            loss_fn = loss
        data_name = f"{len(x):,} UCI digits (training split)"
        index_meaning = "row of per_example_grads.data.load_digits()"
    else:
        x, y = load_npz(data_path)
        rows = None
        data_name = f"{Path(data_path).name} ({min(len(x), FAST_EXAMPLES) if fast else len(x):,} examples)"
        index_meaning = f"row of x in {Path(data_path).name}"
        model, loss_fn = load_model(model_path, loss)
        check_model_input(model, x, data_path)
        if fast:
            x, y = x[:FAST_EXAMPLES], y[:FAST_EXAMPLES]
        if np.issubdtype(x.dtype, np.floating) and x.dtype != np.float32:
            x = x.astype(np.float32)

    from per_example_grads.apps.demo import save_norms_histogram
    from per_example_grads.diagnostics.statistics import gradient_statistics

    report = gradient_statistics(model, loss_fn, (x, y), batch_size=stats_batch_size, top_k=top_k, progress=verbose)
    d = report.to_dict()
    if rows is not None:  # the demo: name the examples by their row of load_digits()
        for e in d["top_examples"]:
            e["index"] = int(rows[e["index"]])
    suggested, accumulation = suggest_batch_size(report.noise_scale_full_data, batch_size)
    loss_name = loss_fn if isinstance(loss_fn, str) else getattr(loss_fn, "name", type(loss_fn).__name__)
    title = f"{model.name} ({model.count_params():,} parameters, loss {loss_name}) on {data_name}"
    # Only now, with everything computed, is anything written: all three files or none.
    summary = {
        **d,
        "suggested_batch_size": suggested,
        "accumulation_steps": accumulation,
        "current_batch_size": batch_size,
        "suggestion_from": "noise_scale_full_data",
        "top_examples_index": index_meaning,
        "title": title,
    }
    files = write_files(
        {
            out / "report.json": lambda path: _write_json(summary, path),
            out / "report.png": lambda path: report.save_png(path, title=title),
            out / "norms_histogram.png": lambda path: save_norms_histogram(
                report.per_example_norms.astype(np.float32), path, title=title
            ),
        }
    )

    say("")
    say(report.summary())
    if suggested is None:
        say("suggested batch size: undefined, since B_simple is")
    else:
        say(
            f"suggested batch size ~ B_simple = {suggested}, about the critical batch size above which "
            "larger batches\n  stop cutting the number of steps much; at your batch size "
            f"{batch_size}: {accumulation} gradient accumulation step(s) per update"
        )
    top = ", ".join(f"{e['index']} ({e['norm']:.3g})" for e in d["top_examples"][:5])
    say(f"largest per-example gradient norms, as index (norm), index = {index_meaning}:\n  {top}")
    say(f"wrote {', '.join(str(p) for p in files)}")
    return {
        "report": d,
        "suggested_batch_size": suggested,
        "accumulation_steps": accumulation,
        "files": [str(p) for p in files],
        "seconds": time.perf_counter() - started,
    }
