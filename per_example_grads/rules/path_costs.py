"""A cost model of the rules' formulations, so that each layer takes its cheapest exact path.

Several rules can compute the same per-example quantity in more than one
exact way: a convolution's per-example kernel gradients ``G_n = p_n^T g_n``
from patches built three ways, or one product per kernel offset without
patches; their squared norms from ``G_n`` or from the Gram form
``sum_{t,s} (p_t . p_s)(g_t . g_s)``; the clipped sum from the kept ``G_n``
(``sum_n c_n G_n``) or from one kernel VJP of the batch convolution at
``c * g``. Which is cheapest depends on the shapes, and by large factors
(a 1-channel input with an 8x8 kernel makes ``tf.image.extract_patches``
copy one float at a time). This module prices each path as the sum of its
operations' costs and picks the cheapest; the choice is a pure function of
the shapes and a ``Machine`` (a few rates), so it is made at trace time and
never depends on values.

The model of one operation (``Machine``):

- a launch cost per operation (``op_s``);
- matrix products and convolutions at ``flops`` FLOP/s, scaled down by
  ``min(1, d / VECTOR_WIDTH)`` where ``d`` is the product's smallest output
  dimension (a product with a 1-wide side runs at vector, not matrix, rate);
  a kernel VJP (``Conv2DBackpropFilter`` and its kin) at ``vjp_flops`` plus a
  fixed ``vjp_s``;
- copies at ``copy_bytes_s`` bytes per second (read and written), plus
  ``run_s`` per contiguous run of the source that the copy gathers;
- the two ways of copying patches, ``tf.image.extract_patches`` and slices
  concatenated on the feature axis, at a cost per element plus one per run
  of ``c_in`` floats (``extract_s``, ``extract_run_s``; ``slice_s``,
  ``slice_run_s``): a 1-channel input makes both copy one float at a time.

``DEFAULT`` holds typical rates for a CPU; ``calibrate()``, called
explicitly (never on import), measures this machine's (a few seconds of
micro-benchmarks, one per rate) and caches them in ``cache_path()`` (the
user's cache directory, keyed by CPU), which ``machine()`` then reads (once
per process); without a cache, or with an unreadable one, ``DEFAULT``. The chooser's guarantee is relative, not absolute: among
the exact paths a rule offers (materializing every example's gradient being
one of them), it takes the one the model prices lowest, so a clipped sum or
a norm is never priced above materializing, clipping and summing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform

VECTOR_WIDTH = (
    16  # float32 lanes of a 512-bit vector register: a product narrower than this runs at a fraction of the rate
)
BYTES = 4  # float32


@dataclasses.dataclass(frozen=True)
class Machine:
    """Rates of the operations the rules' paths are made of (module docstring); all positive."""

    flops: float = 40e9
    vjp_flops: float = 40e9
    vjp_s: float = 1e-3
    copy_bytes_s: float = 4e9
    run_s: float = 2e-8
    extract_s: float = 5e-9
    extract_run_s: float = 4e-8
    slice_s: float = 4e-9
    slice_run_s: float = 1.5e-8
    op_s: float = 2e-6

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Machine.{field.name} must be a positive finite number; got {value!r}.")

    # -- one operation each ---------------------------------------------------

    def product(self, batch: int, m: int, n: int, inner: int) -> float:
        """Seconds for ``batch`` products ``[m, inner] @ [inner, n]`` (one op)."""
        flops = 2.0 * batch * m * n * inner
        return self.op_s + flops / (self.flops * min(1.0, min(m, n) / VECTOR_WIDTH)) + self.copy(batch * m * n)

    def convolution(self, flops: float, narrowest: int) -> float:
        """Seconds for one convolution of ``flops`` FLOPs whose narrowest channel count is ``narrowest``."""
        return self.op_s + flops / (self.flops * min(1.0, narrowest / VECTOR_WIDTH))

    def kernel_vjp(self, flops: float, narrowest: int) -> float:
        """Seconds for one kernel VJP of a batch convolution (``Conv2DBackpropFilter``) of ``flops`` FLOPs."""
        return self.op_s + self.vjp_s + flops / (self.vjp_flops * min(1.0, narrowest / VECTOR_WIDTH))

    def copy(self, elements: float, runs: float = 0.0) -> float:
        """Seconds to copy ``elements`` floats gathered as ``runs`` contiguous runs (0: one run)."""
        return 2.0 * BYTES * elements / self.copy_bytes_s + runs * self.run_s

    def extract(self, elements: float, run: int) -> float:
        """Seconds for ``tf.image.extract_patches`` writing ``elements`` patch elements in runs of ``run`` floats."""
        return self.op_s + elements * (self.extract_s + self.extract_run_s / run)

    def slices(self, elements: float, run: int, count: int) -> float:
        """Seconds for ``count`` slices of ``elements`` in all, then their concatenation on the feature axis (runs of ``run``)."""
        return (count + 1) * self.op_s + elements * (self.slice_s + self.slice_run_s / run)


DEFAULT = Machine()


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """The sizes a convolution's paths cost depends on (static: the chooser runs at trace time).

    ``batch`` examples; ``spatial_in`` the (padded) input's spatial sizes;
    ``out`` the output's; ``kernel_size``; ``strided`` whether any stride
    exceeds 1; ``c_in``, ``c_out`` the channels.
    """

    batch: int
    spatial_in: tuple[int, ...]
    out: tuple[int, ...]
    kernel_size: tuple[int, ...]
    strided: bool
    c_in: int
    c_out: int

    @property
    def offsets(self) -> int:
        return math.prod(self.kernel_size)

    @property
    def positions(self) -> int:
        return math.prod(self.out)

    @property
    def features(self) -> int:
        return self.offsets * self.c_in


PATCH_BUILDERS = ("extract", "sliced", "one_hot")


def patch_cost(s: ConvShape, builder: str, m: Machine = DEFAULT) -> float:
    """Seconds to build the patches ``[B, T, K c_in]`` by ``builder`` (one of ``PATCH_BUILDERS``).

    ``extract``: ``tf.image.extract_patches``. ``sliced``: one slice per
    offset (runs of ``c_in`` floats when strided, of a row otherwise), then a
    concatenation on the feature axis (runs of ``c_in``). ``one_hot``: a
    convolution with a one-hot kernel ``[*kernel_size, c_in, K c_in]``.
    """
    b, t, k, c, f = s.batch, s.positions, s.offsets, s.c_in, s.features
    elements = b * t * f
    if builder == "extract":
        return m.extract(elements, c)
    if builder == "sliced":
        return m.slices(elements, c, k)
    if builder == "one_hot":
        return m.convolution(2.0 * elements * f, f)
    raise ValueError(f"builder must be one of {PATCH_BUILDERS}; got {builder!r}.")


def cheapest_patches(s: ConvShape, m: Machine = DEFAULT, builders=PATCH_BUILDERS) -> tuple[str, float]:
    """``(builder, seconds)``: the cheapest of ``builders`` for the patches of ``s``."""
    return min(((b, patch_cost(s, b, m)) for b in builders), key=lambda x: x[1])


def materialized_cost(s: ConvShape, m: Machine = DEFAULT, builders=PATCH_BUILDERS) -> tuple[str, float]:
    """``(path, seconds)`` of the cheapest way to build every ``G_n`` ``[B, f, k]``.

    ``path`` is ``"patches:<builder>"`` (the patches, then one batched
    product) or ``"offsets"`` (per kernel offset, the slice of the input it
    meets times ``g``: ``K`` products ``[c_in, T] @ [T, k]``, then their
    concatenation, never the patches).
    """
    b, t, k, c, f, o = s.batch, s.positions, s.offsets, s.c_in, s.features, s.c_out
    builder, build = cheapest_patches(s, m, builders)
    by_patches = build + m.product(b, f, o, t)
    by_offsets = k * (2 * m.op_s + m.copy(b * t * c) + m.product(b, c, o, t)) + m.op_s + m.copy(b * f * o)
    return min([(f"patches:{builder}", by_patches), ("offsets", by_offsets)], key=lambda x: x[1])


def gram_cost(s: ConvShape, m: Machine = DEFAULT, builders=PATCH_BUILDERS) -> tuple[str, float]:
    """``(builder, seconds)`` of the Gram-form norms ``sum_{t,s} (p_t . p_s)(g_t . g_s)`` from the cheapest patches."""
    b, t = s.batch, s.positions
    builder, build = cheapest_patches(s, m, builders)
    return builder, build + m.product(b, t, t, s.features) + m.product(b, t, t, s.c_out) + m.op_s + m.copy(
        2 * b * t * t
    )


def vjp_sum_cost(s: ConvShape, m: Machine = DEFAULT) -> float:
    """Seconds of the clipped sum as one kernel VJP of the batch convolution at ``c * g``."""
    return (
        m.op_s
        + m.copy(s.batch * s.positions * s.c_out)
        + m.kernel_vjp(2.0 * s.batch * s.positions * s.features * s.c_out, min(s.c_in, s.c_out))
    )


def kept_sum_cost(s: ConvShape, m: Machine = DEFAULT) -> float:
    """Seconds of the clipped sum ``sum_n c_n G_n`` from kept per-example kernels (a matrix-vector product)."""
    return (
        m.op_s
        + m.copy(s.batch * s.features * s.c_out) / 2
        + 2.0 * s.batch * s.features * s.c_out / (m.flops / VECTOR_WIDTH)
    )


@dataclasses.dataclass(frozen=True)
class ConvChoice:
    """What the chooser picked: ``norms`` (``"gram:<builder>"``, ``"patches:<builder>"`` or ``"offsets"``), ``keep`` (the clipped sum reads the kernels), and each candidate's price."""

    norms: str
    keep: bool
    costs: tuple[tuple[str, float], ...]


def conv_norm_path(
    s: ConvShape, for_sum: bool, may_keep: bool, m: Machine = DEFAULT, builders=PATCH_BUILDERS
) -> ConvChoice:
    """The cheapest exact path for a convolution's kernel norms (and, with ``for_sum``, the clipped sum after them).

    Norms only: the cheaper of the Gram form and materializing ``G_n``.
    With ``for_sum`` each norm path is priced with the clipped sum it allows:
    the Gram form with the kernel VJP; materialized kernels with their kept
    sum when ``may_keep`` (the caller's memory bound), else with the VJP.
    """
    gram_builder, gram = gram_cost(s, m, builders)
    path, built = materialized_cost(s, m, builders)
    vjp = vjp_sum_cost(s, m) if for_sum else 0.0
    kept = kept_sum_cost(s, m) if for_sum else 0.0
    candidates = [(f"gram:{gram_builder}", False, gram + vjp)]
    if for_sum and may_keep:
        candidates.append((path, True, built + kept))
    candidates.append((path, False, built + vjp))
    best = min(candidates, key=lambda x: x[2])
    return ConvChoice(best[0], best[1], tuple((f"{n}{'+kept' if k else ''}", c) for n, k, c in candidates))


def dense_gram_cheaper(batch: int, t: int, i: int, j: int, m: Machine = DEFAULT) -> bool:
    """Whether the Gram form prices below building ``G_n = a_n^T g_n`` for ``[B, T, i]`` and ``[B, T, j]`` inputs."""
    gram = m.product(batch, t, t, i) + m.product(batch, t, t, j) + m.op_s + m.copy(2 * batch * t * t)
    built = m.product(batch, i, j, t) + m.op_s + m.copy(batch * i * j) / 2
    return gram < built


# -- this machine's rates -------------------------------------------------------


def cache_path() -> str:
    """Where ``calibrate(save=True)`` writes this machine's rates (``$PEG_PATH_COSTS`` overrides)."""
    if os.environ.get("PEG_PATH_COSTS"):
        return os.environ["PEG_PATH_COSTS"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "per_example_grads", "path_costs.json")


def _machine_key() -> str:
    """The CPU the rates belong to: architecture, model name (``/proc/cpuinfo`` where there is one), core count."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{platform.machine()}|{name}|{os.cpu_count()}"


@functools.cache
def machine() -> Machine:
    """This machine's rates: the cached calibration for this CPU if there is one, else ``DEFAULT``."""
    try:
        with open(cache_path()) as f:
            saved = json.load(f).get(_machine_key())
        return Machine(**saved) if saved else DEFAULT
    except (OSError, ValueError, TypeError, AttributeError):
        return DEFAULT


def calibrate(save: bool = True, repeats: int = 15) -> Machine:
    """Measures this machine's rates with one micro-benchmark each (a few seconds); with ``save``, caches them.

    The rates are fitted so that the model prices each micro-benchmark at its
    median time: a wide batched product (``flops``), a kernel VJP at two
    sizes (``vjp_flops``, ``vjp_s``), a contiguous and a one-float-run copy
    (``copy_bytes_s``, ``run_s``), ``extract_patches`` (``extract_s``) and a
    tiny op (``op_s``). Never run on import: the rules read ``machine()``,
    which is ``DEFAULT`` until this has been called once on the machine.
    With ``save`` (the default) the rates are written to ``cache_path()``
    by ``save_rates`` and used from the next trace on.

    Example (once per machine)::

        from per_example_grads.rules import path_costs
        path_costs.calibrate()  # a few seconds; later processes read the cache
    """
    import time

    import tensorflow as tf

    def median_s(fn, *args) -> float:
        fn = tf.function(fn)
        fn(*args)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args).numpy()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    rng = tf.random.stateless_normal
    tiny = rng([8], [0, 1])
    call_s = median_s(lambda x: x + 1.0, tiny)  # one call of a one-op function: subtracted from the others

    def chain(x):
        for _ in range(64):
            x = x * 1.0001 + 1.0
        return x

    op_s = max((median_s(chain, tiny) - call_s) / 128, 1e-7)
    timed = lambda fn, *args: max(median_s(fn, *args) - call_s, 1e-7)  # noqa: E731
    a, b = rng([64, 256, 256], [0, 2]), rng([64, 256, 256], [0, 3])
    flops = 2.0 * 64 * 256**3 / timed(lambda x, y: tf.matmul(x, y), a, b)
    big = rng([1 << 22], [0, 4])
    copy_bytes_s = 2.0 * BYTES * (1 << 22) / timed(lambda x: x * 2.0, big)

    def builder_rates(build) -> tuple[float, float]:
        """Per-element and per-run seconds of a patch builder, from 1- and 16-channel inputs (3x3 kernel)."""
        times = []
        for c in (1, 16):
            x = rng([64, 30, 30, c], [0, c])
            times.append((64 * 28 * 28 * 9 * c, timed(build, x)))
        (e1, t1), (e16, t16) = times
        # t = e (s + r / c): with c = 1, t1 = e1 (s + r); with c = 16, t16 = e16 (s + r / 16).
        per1, per16 = t1 / e1, t16 / e16
        run = max((per1 - per16) * 16 / 15, 1e-12)
        return max(per1 - run, 1e-12), run

    extract_s, extract_run_s = builder_rates(
        lambda x: tf.image.extract_patches(x, [1, 3, 3, 1], [1, 1, 1, 1], [1, 1, 1, 1], "VALID")
    )
    slice_s, slice_run_s = builder_rates(
        lambda x: tf.concat([x[:, i : i + 28, j : j + 28, :] for i in range(3) for j in range(3)], axis=-1)
    )
    image = rng([64, 64, 64, 1], [0, 5])
    run_s = max(timed(lambda x: x[:, ::2, ::2, :], image) - 2.0 * BYTES * 64 * 32 * 32 / copy_bytes_s, 1e-7) / (
        64 * 32 * 32
    )

    def vjp_time(c: int) -> tuple[float, float]:
        x, g = rng([64, 16, 16, c], [0, 7]), rng([64, 14, 14, c], [0, 8])
        kernel = tf.zeros([3, 3, c, c])
        fn = lambda x, g: tf.compat.v1.nn.conv2d_backprop_filter(x, tf.shape(kernel), g, [1, 1, 1, 1], "VALID")  # noqa: E731
        return 2.0 * 64 * 14 * 14 * 9 * c * c, timed(fn, x, g)

    # t = vjp_s + flops / (vjp_flops min(1, c / 16)): c = 8 runs at half the rate, c = 64 at the full rate.
    (f1, t1), (f2, t2) = vjp_time(8), vjp_time(64)
    vjp_flops = max((f2 - 2 * f1) / max(t2 - t1, 1e-7), 1e6)
    vjp_s = max(t1 - 2 * f1 / vjp_flops, 1e-7)
    found = Machine(
        flops=flops,
        vjp_flops=vjp_flops,
        vjp_s=vjp_s,
        copy_bytes_s=copy_bytes_s,
        run_s=run_s,
        extract_s=extract_s,
        extract_run_s=extract_run_s,
        slice_s=slice_s,
        slice_run_s=slice_run_s,
        op_s=op_s,
    )
    if save:
        save_rates(found)
    return found


def save_rates(rates: Machine) -> str:
    """Writes ``rates`` as this machine's in ``cache_path()`` (other machines' entries kept); returns the path.

    ``machine()`` returns them from then on (its per-process cache is cleared).
    """
    if not isinstance(rates, Machine):
        raise TypeError(f"rates must be a path_costs.Machine; got {type(rates).__name__}.")
    path = cache_path()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[_machine_key()] = dataclasses.asdict(rates)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    machine.cache_clear()
    return path
