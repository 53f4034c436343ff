"""Jobs that the tf.distribute tests start as separate processes (see tests/cluster.py).

    python tests/cluster_jobs.py mwms DIR          # one MultiWorkerMirrored worker (TF_CONFIG set)
    python tests/cluster_jobs.py server            # a parameter server or worker: serve until killed
    python tests/cluster_jobs.py ps_chief DIR      # the ParameterServerStrategy coordinator
    python tests/cluster_jobs.py dp_fit DIR [--slow]  # DPModel.fit with BackupAndRestore

Inputs come from ``DIR/inputs.npz`` (data and initial weights, written by the
test) and results go to ``DIR/<job>-<task>.pkl``: the test compares them with
single-device runs.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import per_example_grads as peg  # noqa: E402

CLIP = 0.5


def net(d: int, k: int) -> keras.Model:
    return keras.Sequential([keras.Input((d,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(k)])


def loss_fn(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _inputs(out: Path):
    data = np.load(out / "inputs.npz")
    weights = [data[f"w{i}"] for i in range(int(data["n_weights"]))]
    return data["x"], data["y"], weights


def _task() -> tuple[str, int]:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return task["type"], int(task["index"])


def mwms(out: Path) -> None:
    x, y, init = _inputs(out)
    b = 16  # global batch: 8 rows per worker
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    _, index = _task()
    with strategy.scope():
        model = net(x.shape[1], int(y.max()) + 1)
        model.set_weights(init)
        acc = peg.GradientAccumulator(model, loss_fn, l2_norm_clip=CLIP, noise_multiplier=0.0, expected_batch_size=16)

    def shard(ctx: tf.distribute.InputContext):  # worker i takes rows [8i, 8i + 8) of each global batch
        rows = tf.data.Dataset.from_tensor_slices((x[:b], y[:b])).batch(b // ctx.num_input_pipelines)
        return rows.skip(ctx.input_pipeline_id).take(1)

    xb, yb = next(iter(strategy.distribute_datasets_from_function(shard)))

    @tf.function
    def sums(a, c):
        def replica(a, c):
            ctx = tf.distribute.get_replica_context()
            per_example = peg.per_example_gradients(model, loss_fn, a, c)
            clipped = ctx.all_reduce("SUM", peg.clipped_gradients(model, loss_fn, a, c, l2_norm_clip=CLIP))
            acc.accumulate(a, c)
            accumulated = ctx.all_reduce("SUM", acc.result())
            return per_example, clipped, accumulated

        return strategy.run(replica, args=(a, c))

    per_example, clipped, accumulated = sums(xb, yb)
    report = peg.diagnostics.gradient_statistics(model, loss_fn, (x[:b], y[:b]), batch_size=8, progress=False)

    dp = peg.keras.DPModel(
        model, l2_norm_clip=CLIP, noise_multiplier=0.0, num_examples=len(x), expected_batch_size=b, seed=1
    )
    with strategy.scope():
        dp.compile(
            optimizer=keras.optimizers.SGD(0.2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(b).with_options(options)
    history = dp.fit(ds, epochs=3, verbose=0)

    results = {
        "per_example": [t.numpy() for t in per_example],
        "clipped": [t.numpy() for t in clipped],
        "accumulated": [t.numpy() for t in accumulated],
        "norms": report.per_example_norms,
        "fitted": model.get_weights(),
        "dp_steps": int(dp.dp_steps.numpy()),
        "loss": history.history["loss"],
    }
    _save(out / f"mwms-{index}.pkl", results)


def server() -> None:
    """A ParameterServerStrategy worker or parameter server: serves until the test kills it."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    task_type, index = _task()
    tf.distribute.Server(
        resolver.cluster_spec(), job_name=task_type, task_index=index, protocol="grpc", start=True
    ).join()


def ps_chief(out: Path) -> None:
    """Workers compute private gradients; the parameter server holds the variables and applies them."""
    x, y, init = _inputs(out)
    b, first, more = 16, 1, 11
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = net(x.shape[1], int(y.max()) + 1)
        model.set_weights(init)
        optimizer = keras.optimizers.SGD(0.2)
        optimizer.build(model.trainable_variables)
        applied = peg.dp.AppliedSteps()
    devices = {v.value.device for v in model.trainable_variables} | {applied.count.device}

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x[:b], y[:b])).batch(b).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def worker_step(noise_multiplier, seed):
        @tf.function
        def step(iterator):
            def replica(a, c):
                grads = peg.dp.private_gradients(
                    model,
                    loss_fn,
                    a,
                    c,
                    l2_norm_clip=CLIP,
                    noise_multiplier=noise_multiplier,
                    expected_batch_size=b,
                    seed=seed,
                )
                applied.apply_gradients(optimizer, zip(grads, model.trainable_variables))

            a, c = next(iterator)
            strategy.run(replica, args=(a, c))

        return step

    exact = worker_step(0.0, (0, 0))  # no noise: comparable with one device
    for _ in range(first):
        coordinator.schedule(exact, args=(iterator,))
    coordinator.join()
    after_one = [w.numpy() for w in model.trainable_variables]
    private = worker_step(1.1, None)  # real noise, from the operating system's entropy
    for _ in range(more):
        coordinator.schedule(private, args=(iterator,))
    coordinator.join()
    accountant = applied.update(peg.dp.PrivacyAccountant(1.1, b / len(x)))
    results = {
        "after_one": after_one,
        "final": [w.numpy() for w in model.trainable_variables],
        "applied": int(applied.count.numpy()),
        "iterations": int(optimizer.iterations.numpy()),
        "accountant_steps": accountant.steps,
        "scheduled": first + more,
        "devices": sorted(devices),
    }
    _save(out / "ps_chief.pkl", results)


def dp_fit(out: Path, slow: bool) -> None:
    """DPModel.fit, 6 epochs of 4 steps, backed up every epoch; ``--slow`` lets the test kill it mid-run."""
    x, y, init = _inputs(out)
    model = net(x.shape[1], int(y.max()) + 1)
    model.set_weights(init)
    dp = peg.keras.DPModel(model, l2_norm_clip=CLIP, noise_multiplier=1.1, num_examples=len(x), expected_batch_size=16)
    dp.compile(optimizer=keras.optimizers.SGD(0.2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.build((None, x.shape[1]))
    progress = out / "progress.json"
    started = {}

    class Progress(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):  # after BackupAndRestore (listed first) restored the weights
            started["dp_steps"] = int(dp.dp_steps.numpy())

        def on_train_batch_end(self, batch, logs=None):
            progress.write_text(json.dumps({"dp_steps": int(dp.dp_steps.numpy())}))
            if slow:
                time.sleep(0.4)

    backup = keras.callbacks.BackupAndRestore(str(out / "backup"), save_freq="epoch")
    dp.fit(x, y, batch_size=16, epochs=6, verbose=0, callbacks=[backup, Progress()])
    results = {"resumed_from": started["dp_steps"], "dp_steps": int(dp.dp_steps.numpy()), "epsilon": dp.epsilon(1e-5)}
    _save(out / "dp_fit.pkl", results)


def _save(path: Path, results: dict) -> None:
    """Writes ``results`` (numpy arrays, lists of them, numbers) so that it appears complete or not at all."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(results))
    os.replace(tmp, path)


def load(path: Path) -> dict:
    return pickle.loads(Path(path).read_bytes())


if __name__ == "__main__":
    job, *rest = sys.argv[1:]
    if job == "server":
        server()
    elif job == "mwms":
        mwms(Path(rest[0]))
    elif job == "ps_chief":
        ps_chief(Path(rest[0]))
    elif job == "dp_fit":
        dp_fit(Path(rest[0]), slow="--slow" in rest)
    else:
        raise SystemExit(f"unknown job {job!r}")
