"""A clipped sum's function holds no tensor the size of the model's parameters between calls; its chunks run one at a time and keep no predictions (#53).

Zeros of a variable's static shape in a ``tf.cond`` branch (the sums when no
example is finite, the results of an empty batch) became ``Const`` nodes
under Grappler's constant folding, each holding a full-size tensor for as
long as the function lived, although the branch never ran: one more float32
copy of the parameters (``_core.batch.branch_zeros``). TensorFlow's CPU
allocator counts what a call leaves allocated only as a BFC allocator, chosen
before TensorFlow starts, so the calls run in a new process.
"""

import json

import keras
import pytest
import tensorflow as tf

from helpers import run_in_new_process
from per_example_grads.dp.aggregator import clipped_sum
from per_example_grads.rules import conv

_PROCESS = """
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import keras
import pytest
import tensorflow as tf
import per_example_grads as peg

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024), keras.layers.Dense(1024), keras.layers.Dense(10)])
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
x = np.random.default_rng(0).normal(size=(8, 512)).astype("float32")
y = np.arange(8) % 10
clipped = lambda x, y, **kw: peg.clipped_gradients(model, loss, x, y, l2_norm_clip=1.0, **kw)
dynamic = [tf.TensorSpec([None, 512]), tf.TensorSpec([None], tf.int64)]
calls = {
    "static_b": tf.function(clipped),
    "dynamic_b": tf.function(clipped, input_signature=dynamic),
    "units": tf.function(lambda x, y: clipped(x, y, unit_ids=np.arange(8) % 3, num_units=3)),
}
held = {}
for name, fn in calls.items():
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    sums = fn(x, y)
    del sums
    held[name] = tf.config.experimental.get_memory_info("CPU:0")["current"] - before
params = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
print(json.dumps({"held": held, "params": params}))
"""


def test_a_clipped_sum_holds_no_copy_of_the_parameters_after_its_call():
    out = json.loads(run_in_new_process(_PROCESS).strip().splitlines()[-1])
    for name, held in out["held"].items():
        assert held < out["params"] / 8, f"{name}: {held} bytes held after the call, parameters {out['params']}"


def _while_loops(fn, *specs) -> list[int]:
    """The ``parallel_iterations`` of every while loop in ``fn``'s traced graph."""
    graph = tf.function(fn, input_signature=specs).get_concrete_function().graph
    return [
        op.get_attr("parallel_iterations") for op in graph.get_operations() if op.type in ("While", "StatelessWhile")
    ]


def test_chunk_loops_run_one_chunk_at_a_time():
    """A loop that bounds memory by chunks must not overlap them: a while loop's default runs up to 10 iterations at once.

    Measured (B = 16 rows of [256, 32] through two Dense(1024), chunks of 4,
    BFC allocator, 5 calls): the clipped sum's peak was 43-50 MiB with the
    default and 32-33 MiB with one chunk at a time (one chunk of 16: 65 MiB).
    """
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def chunked(x, y):
        return clipped_sum(model, loss, x, y, l2_norm_clip=1.0, physical_batch_size=2).sums

    assert _while_loops(chunked, tf.TensorSpec([None, 3]), tf.TensorSpec([None], tf.int64)) == [1]

    def patches(a, g):
        return conv._in_batch_chunks(lambda a, g: (tf.reduce_sum(a, 1), a * g), a, g, 2, [[None], [None, 4]])

    assert _while_loops(patches, tf.TensorSpec([None, 4]), tf.TensorSpec([None, 4])) == [1]


_CHUNKED_STEP = """
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import keras
import pytest
import tensorflow as tf
import per_example_grads as peg

keras.utils.set_random_seed(0)
b, t, v = 32, 64, 4096  # a language model's [B, T, V] logits: 32 MiB of float32
x = np.random.default_rng(0).integers(0, 64, (b, t)).astype("int32")
y = np.random.default_rng(1).integers(0, v, (b, t))
peaks = {}
for jit in (False, True):
    net = keras.Sequential([keras.Input((t,), dtype="int32"), keras.layers.Embedding(64, 8), keras.layers.Dense(v)])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=b, physical_batch_size=2)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dp.compile(optimizer="sgd", loss=loss, metrics=["accuracy"], jit_compile=jit)
    dp.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    dp.train_on_batch(x, y)
    peaks["xla" if jit else "graph"] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
print(json.dumps({"peaks": peaks, "logits": b * t * v * 4}))
"""


def test_a_chunked_step_never_holds_the_logical_batchs_predictions():
    """In chunks of 2, a DPModel step's loss and metrics are taken chunk by chunk (#53).

    The chunk loop kept every chunk's predictions for them, so a language
    model's step held its logical batch's ``[B, T, V]`` logits (twice, in the
    loop's array and once stacked, and once more in the loss's softmax)
    whatever the physical batch size: 32 MiB each here. Measured on this
    model, the step's peak above what the process held before it: 112 MiB
    before the change, 7.5-8.0 MiB after; under XLA (chunks of 2 divide the
    32 rows, so the loss and metrics are taken per chunk there too), 128
    MiB before, 16 MiB after.
    """
    out = json.loads(run_in_new_process(_CHUNKED_STEP).strip().splitlines()[-1])
    for where, peak in out["peaks"].items():
        assert peak < out["logits"], (where, out)


_NOISED_STEP = """
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import keras
import pytest
import tensorflow as tf
import per_example_grads as peg

keras.utils.set_random_seed(0)
w, b = 2048, 4
x = np.random.default_rng(0).normal(size=(b, w)).astype("float32")
y = np.arange(b) % 10
net = keras.Sequential([keras.Input((w,))] + [keras.layers.Dense(w) for _ in range(16)] + [keras.layers.Dense(10)])
dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=b, physical_batch_size=2, seed=0)
dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
dp.train_on_batch(x, y)
tf.config.experimental.reset_memory_stats("CPU:0")
before = tf.config.experimental.get_memory_info("CPU:0")["current"]
dp.train_on_batch(x, y)
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
params = (16 * (w * w + w) + w * 10 + 10) * 4
print(json.dumps({"peak": peak, "params": params}))
"""


@pytest.mark.slow
def test_a_dp_step_never_holds_a_models_worth_of_noise():
    """The noise is drawn group by group, each as it is added (``noise.gaussian_like``'s ``combine``; #53).

    A draw depends only on its key, so the executor ran every draw as the
    step started, and all the noise (one more copy of the parameters) lived
    through the chunk loop until the last sum was ready. What a chunked step
    needs above the weights is the running sums (one copy), a chunk's
    layer-by-layer work, and now one noise group (``MAX_DRAW`` coordinates
    and its draw's temporaries, about 40 MiB). Measured on this model (256
    MiB of parameters, chunks of 2), the step's peak in copies of the
    parameters: 1.50 before the change, 1.16 after.
    """
    out = json.loads(run_in_new_process(_NOISED_STEP).strip().splitlines()[-1])
    assert out["peak"] < 1.33 * out["params"], out


_FINGERPRINT_PROCESS = """
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import tensorflow as tf
from per_example_grads.keras import network_guard

v = tf.Variable(np.random.default_rng(0).normal(size=(1024, 4096)).astype("float32"))  # 16 MiB
small = tf.Variable(np.arange(6, dtype="float64"))
in_graph = tf.function(lambda: network_guard.graph_fingerprint([small, v]))
first = in_graph().numpy()
tf.config.experimental.reset_memory_stats("CPU:0")
before = tf.config.experimental.get_memory_info("CPU:0")["current"]
again = in_graph().numpy()
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
host = network_guard.fingerprint([small, v])
print(json.dumps({"peak": peak, "bytes": 1024 * 4096 * 4, "equal": bool((first == host).all() and (again == host).all())}))
"""


def test_a_custom_loops_fingerprint_of_the_weights_holds_no_position_vector():
    # It held an int64 position per entry and its weights: 48 MiB for this 16 MiB variable, 497 MiB on GPT-2 base's.
    out = json.loads(run_in_new_process(_FINGERPRINT_PROCESS).strip().splitlines()[-1])
    assert out["equal"]  # the host's fingerprint, exactly
    assert out["peak"] < out["bytes"] / 8, f"{out['peak']} bytes at the peak for a {out['bytes']}-byte variable"
