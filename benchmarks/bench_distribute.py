"""DP-SGD under MirroredStrategy: steps per second with 1 and 2 replicas, and the all-reduce payload.

    python benchmarks/bench_distribute.py [--steps 20] [--repeats 5] [--batch 256]

The CPU is split into two logical devices. Four training setups run side by
side in one process, each as ``fit`` on the MLP 784-512-512-10 with a global
batch of ``--batch`` rows:

  plain_1, plain_2   a plain Keras model, 1 and 2 replicas
  dp_1, dp_2         ``peg.keras.DPModel`` (layer-wise clipped sums), 1 and 2 replicas

Times are medians over ``--repeats`` epochs of ``--steps`` steps (the first,
tracing, epoch is dropped). This machine has 2 cores that the two logical
devices share, so the ratios show the mechanism's overhead, not scaling.

The payload is counted at trace time by wrapping
``tf.distribute.ReplicaContext.all_reduce`` (in this script only): the number
of elements each replica sends per step, against ``P`` (one gradient) and
``B x P`` (per-example gradients).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import per_example_grads as peg  # noqa: E402

_payload: list[int] = []
_original_all_reduce = tf.distribute.ReplicaContext.all_reduce


def _counting_all_reduce(self, reduce_op, value, options=None):
    # Tracing runs the replica function once per replica: count replica 0's calls.
    if tf.get_static_value(self.replica_id_in_sync_group) == 0:
        _payload.append(sum(int(np.prod(t.shape)) for t in tf.nest.flatten(value)))
    return _original_all_reduce(self, reduce_op, value, options)


tf.distribute.ReplicaContext.all_reduce = _counting_all_reduce


def _net() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


class _EpochTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def run(setup: str, strategy, data, args) -> tuple[float, int | None]:
    """(median seconds per step, all-reduce elements per replica per step)."""
    _payload.clear()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = _net()
        if setup.startswith("dp"):
            model = peg.keras.DPModel(
                model,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                expected_batch_size=args.batch,
                num_examples=4 * args.batch,
            )  # the repeated dataset's size: fit cannot count it
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    timer = _EpochTimer()
    model.fit(data, epochs=args.repeats + 1, steps_per_epoch=args.steps, verbose=0, callbacks=[timer])
    per_step = statistics.median(timer.times[1:]) / args.steps
    traced = sum(_payload) if strategy.num_replicas_in_sync > 1 else None
    return per_step, traced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 4, 784)).astype("float32")
    y = rng.integers(0, 10, args.batch * 4)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True).repeat()
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    one = tf.distribute.MirroredStrategy(devices[:1])
    two = tf.distribute.MirroredStrategy(devices[:2])
    params = sum(int(np.prod(v.shape)) for v in _net().trainable_variables)

    results = {}
    for setup, strategy in (("plain_1", one), ("plain_2", two), ("dp_1", one), ("dp_2", two)):
        results[setup] = run(setup, strategy, data, args)

    print(
        f"command: python benchmarks/bench_distribute.py --steps {args.steps} --repeats {args.repeats} --batch {args.batch}"
    )
    print(
        f"tensorflow {tf.__version__}, {os.cpu_count()} CPUs split into 2 logical devices, "
        f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print(f"MLP 784-512-512-10, P = {params} parameters, global batch B = {args.batch}\n")
    print("| setup | replicas | steps/s | step time / plain_1 | all-reduce elements per replica per step |")
    print("|---|---|---|---|---|")
    base = results["plain_1"][0]
    for setup, (per_step, payload) in results.items():
        replicas = setup[-1]
        where = (
            "" if payload is None else f"{payload} (= P + {payload - params})" if payload >= params else str(payload)
        )
        print(f"| {setup} | {replicas} | {1 / per_step:.1f} | {per_step / base:.2f} | {where} |")
    print(f"\nP = {params}; B x P = {args.batch * params} (what all-reducing per-example gradients would send).")


if __name__ == "__main__":
    main()
