"""Convolutions.

Conv1D, Conv2D and Conv3D (channels_last, ``groups=1``) have closed forms for
norms and clipped sums (depthwise, separable and grouped ones:
``depthwise_conv.py``, which registers the convolution rule that picks
between the two; transposed ones: ``conv_transpose.py``, which reuses these
forms); channels_first convolutions use the exact layer-local VJP of the
layer's own convolution on each example, tapped before the fused activation.

Notation: ``a`` ``[B, *spatial_in, c_in]`` is the layer input (causal padding
applied), ``g`` ``[B, *spatial_out, c_out]`` the loss gradient at the
pre-activation output ``z = conv(a, W) + b``.

Norms. A convolution is a Dense layer applied to every input patch: with
``p = extract_patches(a)`` ``[B, positions, f]`` (``f = kh*kw*c_in``), example
n's kernel gradient is ``G_n = sum_t p_nt^T g_nt``. ``||G_n||^2`` is the Gram
form ``sum_{t,s} (p_nt . p_ns)(g_nt . g_ns)`` when
``positions (f + c_out) < f c_out``; otherwise ``G_n`` is built, one layer at a
time. With static image sizes outside XLA (``jit_compile``), it is built
without patches: for each kernel offset ``(i, j)`` the input that offset
meets, the slice ``a[:, i d_h : i d_h + (oh - 1) s_h + 1 : s_h, j d_w : ...
: s_w, :]`` of the (explicitly padded) input, gives the rows ``(i, j, :)`` of
``G_n`` by one batched product with ``g`` (``over_offsets``: one slice at a
time, each a contiguous copy; a strided axis is first reshaped to ``[o,
s]``), which avoids building the patches. Otherwise the patches are used:
built in batch chunks of at most ``PATCH_CHUNK_ELEMENTS`` elements outside
XLA (the patches of all ``B`` examples never exist at once), and under XLA,
when ``f <= c_out``, as the concatenation of those slices (``sliced_patches``,
in the ``(i, j, c_in)`` order of ``tf.image.extract_patches``), which XLA
fuses into the product's operand (``extract_patches`` inside XLA is slower);
the product takes the smaller of ``f`` and ``c_out`` first.
``NORMS_JIT_COMPILE = False`` runs the XLA-compiled pieces without XLA.
``"same"`` padding pads ``pad = max((o - 1) s + (k - 1) d + 1 - n, 0)``,
``pad // 2`` before, as TensorFlow does (``o = ceil(n / s)``).

Clipped sum. The convolution is linear in ``W`` and the examples do not mix,
so ``sum_n c_n dL_n/dW`` is the kernel gradient of the *batch* convolution with
output gradient ``c * g`` (``c_n`` scaling example n's rows):
``VJP_W(conv(a, .))(c * g)``. That is one call of the layer's own
weight-gradient op (``Conv2DBackpropFilter`` for a 2-D convolution), with the
layer's strides, dilation and padding, not a second backward pass through the
model. When the norms built ``G_n`` and it is no larger than the layer's input
and output gradient together (``f c_out <= size(a_n) + positions c_out``: both
are held until the clipped sum anyway), the clipped sum is ``sum_n c_n G_n``
instead, which costs ``B f c_out``. ``KEEP_PER_EXAMPLE_KERNELS = False``
always uses the convolution VJP. The bias part is ``sum_{n,t} c_n g_nt``.

Materialized per-example kernels are ``G_n`` from the patches, one batched
product (``per_example_kernels``); a 1x1 kernel with unit strides takes ``a``
as its patches.

Measured costs of each path: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import tensorflow as tf

from per_example_grads._core.example_ops import WIDE, example_column, graph_constant, squares_part, widened
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.rules import outer_products as op
from per_example_grads.rules import path_costs
from per_example_grads.rules.local import without_activation
from per_example_grads.rules.rule import (
    LayerRule,
    per_example_squared_norms,
    reparametrized,
    weighted_example_sum,
)

NORMS_JIT_COMPILE = True
CHOOSE_BY_COST = True  # outside XLA with static sizes, each path priced by path_costs; False: the fixed rules below
PRICED_BATCH = 64  # the batch size priced when it is unknown at trace time
KEEP_PER_EXAMPLE_KERNELS = True
PATCH_CHUNK_ELEMENTS = 1 << 20  # patches outside XLA are built for at most this many elements at a time


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """What the closed forms need from a Conv1D/Conv2D layer (hashable, so it keys XLA traces)."""

    rank: int
    kernel_size: tuple[int, ...]
    strides: tuple[int, ...]
    dilation_rate: tuple[int, ...]
    padding: str  # "valid", "same" or "causal"

    @classmethod
    def of(cls, layer) -> "ConvSpec":
        return cls(
            layer.rank, tuple(layer.kernel_size), tuple(layer.strides), tuple(layer.dilation_rate), layer.padding
        )


def _causal_pad(layer: ConvSpec, a: tf.Tensor) -> tf.Tensor:
    """``a`` with Conv1D's causal left padding applied (unchanged for other paddings)."""
    if layer.padding != "causal":
        return a
    left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
    return tf.pad(a, [[0, 0], [left, 0], [0, 0]])


def _padding(layer: ConvSpec) -> str:
    return "VALID" if layer.padding == "causal" else layer.padding.upper()


def patches(layer: ConvSpec, a: tf.Tensor, builder: str | None = None) -> tf.Tensor:
    """``[B, positions, prod(kernel_size) * c_in]``: the input patch each output position sees.

    ``a`` is the layer input ``[B, *spatial_in, c_in]`` before causal padding.
    A 1x1 kernel with unit strides sees one position: its patches are ``a``.
    ``builder`` (one of ``path_costs.PATCH_BUILDERS``; None: by rank, as
    below) picks how they are copied, with the same values bit for bit:
    ``"extract"`` (``tf.image.extract_patches``, ranks 1 and 2),
    ``"sliced"`` (``sliced_patches``, static spatial sizes) or
    ``"one_hot"`` (``_patches_by_convolution``).
    """
    if all(k == 1 for k in layer.kernel_size) and all(s == 1 for s in layer.strides):
        return op.as_btf(a)
    if builder == "sliced" and None not in tuple(a.shape[1:-1]):
        return sliced_patches(layer, tuple(a.shape[1:-1]), a)
    if builder == "one_hot":
        return _patches_by_convolution(layer, _causal_pad(layer, tf.cast(a, op.compute_dtype(a.dtype))))
    if layer.rank == 3:
        spatial = tuple(a.shape[1:-1])
        if None not in spatial:
            return sliced_patches(layer, spatial, a)
        a = tf.cast(a, op.compute_dtype(a.dtype))
        if any(d > 1 for d in layer.dilation_rate):
            return _patches_by_convolution(layer, a)
        # Unknown sizes: extract_volume_patches (no dilation), which orders a patch's features
        # (depth, row, column, channel), as the kernel's rows.
        p = tf.extract_volume_patches(
            a, ksizes=[1, *layer.kernel_size, 1], strides=[1, *layer.strides, 1], padding=_padding(layer)
        )
        return op.as_btf(p)
    a = _causal_pad(layer, tf.cast(a, op.compute_dtype(a.dtype)))
    if layer.rank == 1:
        a = a[:, None]  # [B, 1, T, C]: a 1 x k 2-D patch
        sizes, strides, rates = (
            [1, 1, layer.kernel_size[0], 1],
            [1, 1, layer.strides[0], 1],
            [1, 1, layer.dilation_rate[0], 1],
        )
    else:
        sizes = [1, *layer.kernel_size, 1]
        strides = [1, *layer.strides, 1]
        rates = [1, *layer.dilation_rate, 1]
    p = tf.image.extract_patches(a, sizes=sizes, strides=strides, rates=rates, padding=_padding(layer))
    return op.as_btf(p)


def _patches_by_convolution(layer: ConvSpec, a: tf.Tensor) -> tf.Tensor:
    """``patches(layer, a)`` as the layer's convolution with a one-hot kernel ``[*kernel_size, c, K c]``.

    Output channel ``(offset, channel)`` copies the input that offset meets:
    exact, any rank, strides and dilation, sizes known only at run time, at
    ``K c`` times the cost of a ``c``-to-``c`` convolution (used for dilated
    Conv3D of unknown sizes, which ``extract_volume_patches`` cannot take).
    """
    c = a.shape[-1]
    f = math.prod(layer.kernel_size) * c
    one_hot = tf.reshape(tf.eye(f, dtype=a.dtype), [*layer.kernel_size, c, f])
    p = tf.nn.convolution(
        a, one_hot, strides=list(layer.strides), padding=_padding(layer), dilations=list(layer.dilation_rate)
    )
    return op.as_btf(p)


def kernel_squared_norms(
    layer: ConvSpec, a: tf.Tensor, g: tf.Tensor, keep: bool = False
) -> tuple[tf.Tensor, tf.Tensor | None]:
    """``([B] float64, kept)``: ``||dL_n/dW||^2`` from ``kernel_part``, widened (``example_ops.widened``)."""
    part, kept = kernel_part(layer, a, g, keep)
    return widened([part])[0], kept


def kernel_part(layer: ConvSpec, a: tf.Tensor, g: tf.Tensor, keep: bool = False) -> tuple[tuple, tf.Tensor | None]:
    """``(part, kept)``: ``||dL_n/dW||^2`` from the input ``a`` and pre-activation gradient ``g``.

    ``part`` is the norms and their float64 recomputation, for
    ``example_ops.widened``: from the kernels, when the norms built them.
    With ``keep``, ``kept`` is the per-example kernels ``[B, f, k]`` (``f =
    prod(kernel_size) * c_in``; ``[B, k, f]`` when ``k < f``) if the
    materialized form was used and they are no larger than this layer's
    input and output gradient together (``f k <= size(a_n) + positions k``,
    both held until the clipped sum anyway); otherwise None.
    """
    spatial = tuple(a.shape[1:-1])
    k = g.shape[-1]
    f = math.prod(layer.kernel_size) * a.shape[-1] if a.shape[-1] is not None else None
    t = g.shape[1:-1].num_elements() if g.shape[1:-1].is_fully_defined() else None
    small = (
        t is not None
        and f is not None
        and a.shape[1:].is_fully_defined()
        and f * k <= a.shape[1:].num_elements() + t * k
    )
    shape = conv_shape(layer, a, g)
    if shape is not None and CHOOSE_BY_COST:
        choice = path_costs.conv_norm_path(shape, keep, small and KEEP_PER_EXAMPLE_KERNELS, path_costs.machine())
        path, _, builder = choice.norms.partition(":")
        if path == "gram":
            return _gram_part(patches(layer, a, builder), op.as_btf(g)), None
        if path == "offsets":
            norms, kernels = _shifted_norms(layer, spatial, a, g)
        else:
            norms, kernels = _patch_norms(layer, a, g, t, f, builder)
        return squares_part(kernels, norms), (kernels if keep and choice.keep else None)
    if t is not None and f is not None and t * (f + k) < f * k:
        return op.kernel_part(patches(layer, a), op.as_btf(g)), None  # the Gram form
    if None in spatial or f is None:  # slices need static sizes
        norms, kernels = _patch_norms(layer, a, g, t, f)
    elif not in_xla_context():
        norms, kernels = _shifted_norms(layer, spatial, a, g)
    elif f > k:  # under XLA the slices are slower than the patches here (benchmarks/RESULTS.md)
        norms, kernels = _patch_norms(layer, a, g, t, f)
    else:
        fn = _sliced_norms_xla if NORMS_JIT_COMPILE else _sliced_norms
        norms, kernels = fn(layer, spatial, a, g)
    return squares_part(kernels, norms), (kernels if keep and KEEP_PER_EXAMPLE_KERNELS and small else None)


def conv_shape(layer: ConvSpec, a: tf.Tensor, g: tf.Tensor) -> path_costs.ConvShape | None:
    """The sizes ``path_costs`` prices, or None where the chooser does not apply (under XLA, or sizes unknown when traced).

    Under XLA, which fuses the patches into their product, the paths of the
    module docstring are kept. An unknown batch size is priced as
    ``PRICED_BATCH`` examples (every path's cost but the launch costs grows
    with it alike).
    """
    if in_xla_context() or not a.shape[1:].is_fully_defined() or not g.shape[1:].is_fully_defined():
        return None
    spatial = list(a.shape[1:-1])
    if layer.padding == "causal":
        spatial[0] += layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
    b = a.shape[0] if a.shape[0] is not None else PRICED_BATCH
    return path_costs.ConvShape(
        b,
        tuple(spatial),
        tuple(g.shape[1:-1]),
        tuple(layer.kernel_size),
        any(s > 1 for s in layer.strides),
        a.shape[-1],
        g.shape[-1],
    )


def _gram_part(p: tf.Tensor, g: tf.Tensor) -> tuple:
    """The Gram-form norms of ``p_n^T g_n`` and their float64 recomputation, a part for ``example_ops.widened``."""
    wide = (
        (lambda pick: op._gram_squared_norms(tf.cast(pick(p), WIDE), tf.cast(pick(g), WIDE)))
        if p.dtype != WIDE
        else None
    )
    return op._gram_squared_norms(p, g), wide


def _patch_norms(
    layer: ConvSpec, a: tf.Tensor, g: tf.Tensor, t: int | None, f: int | None, builder: str | None = None
) -> tuple[tf.Tensor, tf.Tensor]:
    """``_materialized_norms`` of ``patches(layer, a, builder)`` and ``g``, in batch chunks.

    ``t`` positions and ``f`` patch width (None if unknown) set the chunk:
    at most ``PATCH_CHUNK_ELEMENTS`` patch elements exist at a time,
    not ``B`` times them.
    One chunk when the size is unknown or under XLA (static shapes).
    """
    materialized = _materialized_norms_xla if NORMS_JIT_COMPILE else _materialized_norms

    def chunk_norms(a_chunk, g_chunk):
        p, g2 = patches(layer, a_chunk, builder), op.as_btf(g_chunk)
        if builder is not None:  # chosen by cost, outside XLA: kernels [B, f, k]
            return _materialized_norms(p, g2)
        return materialized(p, g2) if p.shape[-1] is not None and p.shape[-1] <= g2.shape[-1] else materialized(g2, p)

    k = g.shape[-1]
    chunk = max(1, PATCH_CHUNK_ELEMENTS // (t * f)) if t and f else None
    # Element shapes let an empty batch (no chunk) concatenate to [0] and [0, *kernel].
    shapes = [[None], [None, f, k] if builder is not None or (f is not None and f <= k) else [None, k, f]]
    return _in_batch_chunks(chunk_norms, a, g, chunk, shapes)


def _in_batch_chunks(fn, a: tf.Tensor, g: tf.Tensor, chunk: int | None, element_shapes: list) -> tuple:
    """``fn(a, g)``, a tuple of ``[B, ...]`` tensors, computed ``chunk`` examples at a time (a loop) and concatenated.

    One piece when ``chunk`` is None, the batch is known to fit in one chunk,
    or under XLA (static shapes). ``element_shapes``: each output's shape
    ``[None, ...]``, so that an empty batch concatenates to ``[0, ...]``.
    """
    b = a.shape[0]
    if chunk is None or (b is not None and b <= chunk) or in_xla_context():
        return fn(a, g)
    count = (tf.shape(a)[0] + chunk - 1) // chunk

    def body(i, *arrays):
        parts = fn(a[i * chunk : (i + 1) * chunk], g[i * chunk : (i + 1) * chunk])
        return (i + 1, *[array.write(i, part) for array, part in zip(arrays, parts)])

    arrays = [
        tf.TensorArray(op.compute_dtype(g.dtype), size=count, infer_shape=False, element_shape=shape)
        for shape in element_shapes
    ]
    # One chunk at a time: the default 10 parallel iterations would hold up to 10 chunks' patches at once.
    _, *arrays = tf.while_loop(lambda i, *_: i < count, body, [tf.constant(0), *arrays], parallel_iterations=1)
    return tuple(array.concat() for array in arrays)


def per_example_kernels(layer: ConvSpec, a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``[B, f, k]``: every example's kernel gradient ``G_n = p_n^T g_n`` (``p = patches(layer, a)``), one batched product.

    Outside XLA, when an example's patches are larger than its kernel
    gradient (``positions > k``), in batch chunks of at most
    ``PATCH_CHUNK_ELEMENTS`` patch elements, as for the norms.
    """
    t = g.shape[1:-1].num_elements() if g.shape[1:-1].is_fully_defined() else None
    f = math.prod(layer.kernel_size) * a.shape[-1] if a.shape[-1] is not None else None
    k = g.shape[-1]
    builder = None
    shape = conv_shape(layer, a, g)
    if shape is not None and CHOOSE_BY_COST:
        path, _, builder = path_costs.materialized_cost(shape, path_costs.machine())[0].partition(":")
        if path == "offsets":
            return _shifted_norms(layer, tuple(a.shape[1:-1]), a, g)[1]

    def product(a_chunk, g_chunk):
        return (tf.matmul(patches(layer, a_chunk, builder or None), op.as_btf(g_chunk), transpose_a=True),)

    chunk = max(1, PATCH_CHUNK_ELEMENTS // (t * f)) if t and f and t > k else None
    return _in_batch_chunks(product, a, g, chunk, [[None, f, k]])[0]


def _materialized_norms(first: tf.Tensor, second: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``[B]`` ``||first_n^T second_n||^2`` and ``first_n^T second_n``, from ``[B, T, f]`` and ``[B, T, k]``."""
    kernels = tf.matmul(first, second, transpose_a=True)
    return per_example_squared_norms(kernels), kernels


def over_offsets(layer: ConvSpec, spatial: tuple[int, ...], a: tf.Tensor, fn) -> tuple[list, list[int]]:
    """``[fn(piece) for each kernel offset]`` (offsets row-major) and the output's spatial shape ``out``.

    ``piece`` ``[B, *out, C]`` is the input that offset meets, following the
    layer's padding, strides and dilation; ``spatial`` is ``a``'s static
    spatial shape. Each piece is sliced after the previous ``fn`` result is
    computed, so one piece exists at a time.
    """
    a, index, out = _offset_view(layer, spatial, a)
    results: list = []
    for offset in itertools.product(*[range(kk) for kk in layer.kernel_size]):
        with tf.control_dependencies(tf.nest.flatten(results[-1:])):
            results.append(fn(_inner_slice(a, index(offset))))
    return results, out


def _offset_view(layer: ConvSpec, spatial: tuple[int, ...], a: tf.Tensor) -> tuple:
    """``(view, index, out)`` for ``over_offsets``: ``a`` padded (with strides, each strided axis cut into blocks
    ``[m, s]``), ``index(offset)`` of the piece an offset meets in it, and the output's spatial shape."""
    a = _causal_pad(layer, tf.cast(a, op.compute_dtype(a.dtype)))
    n_in = list(spatial)
    if layer.padding == "causal":
        n_in[0] += layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
    reach = [(kk - 1) * d + 1 for kk, d in zip(layer.kernel_size, layer.dilation_rate)]
    if layer.padding == "same":
        out = [-(-n // s) for n, s in zip(n_in, layer.strides)]
        pads = [max((o - 1) * s + r - n, 0) for o, s, r, n in zip(out, layer.strides, reach, n_in)]
        a = tf.pad(a, graph_constant([[0, 0]] + [[p // 2, p - p // 2] for p in pads] + [[0, 0]]))
    else:
        out = [(n - r) // s + 1 for n, r, s in zip(n_in, reach, layer.strides)]
    if all(s == 1 for s in layer.strides):
        index = lambda offset: [slice(i * d, i * d + o) for i, d, o in zip(offset, layer.dilation_rate, out)]
    else:
        # Strided slices copy element by element (slower than a contiguous slice). Instead each
        # axis of size s m becomes [m, s]: position j s + r is (j, r), so offset i, at i d, meets (j + i d // s, i d % s).
        blocks = [
            o + (kk - 1) * d // s for o, kk, d, s in zip(out, layer.kernel_size, layer.dilation_rate, layer.strides)
        ]
        a = _inner_slice(a, [slice(0, m * s) for m, s in zip(blocks, layer.strides)])
        short = [m * s - n for m, s, n in zip(blocks, layer.strides, a.shape[1:-1])]
        a = tf.pad(a, graph_constant([[0, 0]] + [[0, max(e, 0)] for e in short] + [[0, 0]]))
        a = tf.reshape(a, [-1, *[x for m, s in zip(blocks, layer.strides) for x in (m, s)], a.shape[-1]])
        index = lambda offset: [
            x
            for i, d, o, s in zip(offset, layer.dilation_rate, out, layer.strides)
            for x in (slice(i * d // s, i * d // s + o), i * d % s)
        ]
    return a, index, out


def _inner_slice(a: tf.Tensor, index: list) -> tf.Tensor:
    """``a[:, *index, :]`` for ``index`` of slices with static bounds and ints, its bounds the graph's shared constants.

    ``a[...]`` makes three ``Const`` nodes per slice; a convolution has a
    slice per kernel offset, and layers of one shape share every bound.
    """
    begin, end, shrink = [0], [0], 0
    for axis, x in enumerate(index, start=1):
        if isinstance(x, slice):
            begin.append(x.start)
            end.append(x.stop)
        else:
            begin.append(x)
            end.append(x + 1)
            shrink |= 1 << axis
    begin.append(0)
    end.append(0)
    ends = 1 | 1 << (len(begin) - 1)  # the first and last axes whole
    return tf.strided_slice(
        a,
        graph_constant(begin),
        graph_constant(end),
        graph_constant([1] * len(begin)),
        begin_mask=ends,
        end_mask=ends,
        shrink_axis_mask=shrink,
    )


def sliced_patches(layer: ConvSpec, spatial: tuple[int, ...], a: tf.Tensor) -> tf.Tensor:
    """``patches(layer, a)`` from the slices of ``over_offsets`` (module docstring); ``spatial`` is ``a``'s static spatial shape."""
    if _tiling(layer):
        # Each stride a kernel wide: the view's blocks [B, o_1, k_1, ..., o_r, k_r, C] are the patches, transposed to
        # (positions, offsets, C), as the slices' concatenation orders them.
        view, _, out = _offset_view(layer, spatial, a)
        r = layer.rank
        p = tf.transpose(view, [0, *range(1, 2 * r, 2), *range(2, 2 * r + 1, 2), 2 * r + 1])
        return tf.reshape(p, [-1, math.prod(out), math.prod(layer.kernel_size) * view.shape[-1]])
    pieces, out = over_offsets(layer, spatial, a, lambda piece: piece)
    p = tf.concat(pieces, axis=-1) if len(pieces) > 1 else pieces[0]
    return tf.reshape(p, [-1, math.prod(out), p.shape[-1]])


def _tiling(layer: ConvSpec) -> bool:
    """Whether the kernel's positions tile the input without overlap (strides = kernel size > 1, no dilation): a
    ViT's patch embedding."""
    return (
        layer.strides == layer.kernel_size
        and any(s > 1 for s in layer.strides)
        and all(d == 1 for d in layer.dilation_rate)
    )


def _shifted_norms(
    layer: ConvSpec, spatial: tuple[int, ...], a: tf.Tensor, g: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """``[B]`` norms and the per-example kernels ``[B, f, k]``: one batched product per kernel offset, no patches."""
    g = op.as_btf(g)
    per_offset, _ = over_offsets(layer, spatial, a, lambda piece: tf.matmul(op.as_btf(piece), g, transpose_a=True))
    kernels = tf.concat(per_offset, axis=graph_constant(1))  # [B, K c_in, k], rows in the patches' (offset, c_in) order
    return per_example_squared_norms(kernels), kernels


def _sliced_norms(layer: ConvSpec, spatial: tuple[int, ...], a: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``_materialized_norms`` of the sliced patches and ``g``, the smaller of ``f`` and ``k`` first."""
    p, g = sliced_patches(layer, spatial, a), op.as_btf(g)
    return _materialized_norms(p, g) if p.shape[-1] <= g.shape[-1] else _materialized_norms(g, p)


_materialized_norms_xla = tf.function(_materialized_norms, jit_compile=True, reduce_retracing=True)
_sliced_norms_xla = tf.function(_sliced_norms, jit_compile=True, reduce_retracing=True)


def kept_weighted_sum(kernels: tf.Tensor, weights: tf.Tensor, shape) -> tf.Tensor:
    """``[*shape]``: ``sum_n weights[n] kernels[n]``, ``kernels`` ``[B, f, k]`` or ``[B, k, f]`` as kept."""
    s = weighted_example_sum(weights, kernels)
    if s.shape[1] != shape[-1]:  # kept as [k, f]
        s = tf.transpose(s)
    return tf.reshape(s, graph_constant(list(shape)))


def weighted_kernel_sum(layer: ConvSpec, kernel, a: tf.Tensor, g: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """``[*kernel.shape]``: ``sum_n weights[n] dL_n/dW``, the kernel VJP of the layer's convolution at ``weights * g``.

    An ungrouped 2-D convolution without dilation runs its weight-gradient op
    alone (``_conv2d_kernel_vjp``). Others record the convolution on a tape:
    in a graph the forward convolution feeds nothing and is pruned; run
    eagerly it is computed once and discarded. A grouped 3-D convolution's
    VJP is XLA-compiled, as Keras compiles its forward: TensorFlow's CPU
    kernels refuse it.
    """
    dtype = op.compute_dtype(a.dtype)
    a = _causal_pad(layer, tf.cast(a, dtype))
    gw = tf.cast(g, dtype) * example_column(weights, dtype, g.shape.rank)
    if _filter_gradient_op(layer, kernel, a):
        return _conv2d_kernel_vjp(layer, kernel.shape, a, gw)
    kernel = tf.cast(tf.convert_to_tensor(kernel), dtype)
    grouped_3d = layer.rank == 3 and kernel.shape[-2] != a.shape[-1]
    return (_kernel_vjp_xla if grouped_3d else _kernel_vjp)(layer, kernel, a, gw)


def _kernel_vjp(layer: ConvSpec, kernel: tf.Tensor, a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    if _pointwise_strided(layer, kernel, a):
        return _pointwise_strided_kernel_vjp(layer, kernel, a, g)
    # The data format is named: run eagerly, a Conv3D recorded without one has a
    # None format attribute, which TensorFlow's Conv3D gradient cannot read.
    with tf.GradientTape() as tape:
        tape.watch(kernel)
        z = tf.nn.convolution(
            a,
            kernel,
            strides=list(layer.strides),
            padding=_padding(layer),
            dilations=list(layer.dilation_rate),
            data_format=_CHANNELS_LAST[layer.rank],
        )
    return tape.gradient(z, kernel, output_gradients=g)


_CHANNELS_LAST = {1: "NWC", 2: "NHWC", 3: "NDHWC"}
_kernel_vjp_xla = tf.function(_kernel_vjp, jit_compile=True, reduce_retracing=True)


def _filter_gradient_op(layer: ConvSpec, kernel, a: tf.Tensor) -> bool:
    """Whether ``_conv2d_kernel_vjp`` gives ``_kernel_vjp``: an ungrouped 2-D convolution, no dilation, not
    ``_pointwise_strided``."""
    return (
        layer.rank == 2
        and all(d == 1 for d in layer.dilation_rate)
        and kernel.shape[-2] == a.shape[-1]
        and not _pointwise_strided(layer, kernel, a)
    )


def _conv2d_kernel_vjp(layer: ConvSpec, kernel_shape, a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``_kernel_vjp`` of a ``_filter_gradient_op`` layer: the one op TensorFlow's gradient of its ``Conv2D`` runs.

    ``tf.nn.convolution`` of such a layer is one ``Conv2D``, whose gradient
    is ``Conv2DBackpropFilter`` with the same attributes; recording the
    convolution on a tape for it also built the forward convolution, its
    input gradient and shape ops (pruned, but traced and optimized on a
    model's first step), and read the kernel.
    """
    return tf.raw_ops.Conv2DBackpropFilter(
        input=a,
        filter_sizes=graph_constant(list(kernel_shape)),
        out_backprop=g,
        strides=[1, *layer.strides, 1],
        padding=_padding(layer),
        dilations=[1, 1, 1, 1],
        data_format="NHWC",
    )


def _pointwise_strided(layer: ConvSpec, kernel: tf.Tensor, a: tf.Tensor) -> bool:
    """A 1x1 (ungrouped) kernel with a stride above one.

    oneDNN's x86 backward-weights kernel for these convolutions (the "reduce to
    unit stride" path, taken when ``c_in`` is below its channel block) writes
    past its workspace (oneDNN issue #6035): the heap is corrupted and the
    process aborts later, or the kernel gradient is wrong. Their kernel VJP is
    computed without it, by ``_pointwise_strided_kernel_vjp``.
    """
    return (
        all(k == 1 for k in layer.kernel_size) and any(s > 1 for s in layer.strides) and kernel.shape[-2] == a.shape[-1]
    )


def _pointwise_strided_kernel_vjp(layer: ConvSpec, kernel: tf.Tensor, a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``[1, ..., 1, c_in, c_out]``: ``sum_{n,t} a[n, s t] g[n, t]^T``, the exact kernel VJP of a 1x1 strided convolution.

    A 1x1 kernel never pads (``"same"``'s total padding ``(o - 1) s + 1 - n`` is
    at most zero, causal padding is ``d (k - 1) = 0``) and ignores dilation, so
    output position ``t`` reads input position ``s t``, and both paddings give
    ``ceil(n / s)`` positions: the input sliced with the strides is the patches.
    """
    sliced = a[(slice(None),) + tuple(slice(None, None, s) for s in layer.strides)]
    c_in, c_out = kernel.shape[-2], kernel.shape[-1]
    product = tf.matmul(tf.reshape(sliced, [-1, c_in]), tf.reshape(g, [-1, c_out]), transpose_a=True)
    return tf.reshape(product, kernel.shape)


def pre_activation(layer, call, args, kwargs) -> tuple[tf.Tensor, tf.Tensor]:
    """``(outputs, z)``: the layer's own call with its fused activation split off, ``z`` taken before it."""
    with without_activation(layer, True):
        z = call(*args, **kwargs)
    return (layer.activation(z) if layer.activation is not None else z), z


def channels_last_only(layer, kind: str) -> str | None:
    """Why a rule declines ``layer`` (channels_first, or a reparametrized kernel), or None."""
    if layer.data_format != "channels_last":
        return f"channels_first {kind} convolutions use the layer-local fallback"
    return reparametrized(layer)


class KernelBiasRule(LayerRule):
    """A layer ``z = op(a, kernel) + bias``, then its fused activation: the tap is ``z``, ``saved`` is ``a``."""

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.use_bias else [])

    def forward(self, layer, call, args, kwargs):
        out, z = pre_activation(layer, call, args, kwargs)
        return out, args[0], [z]


class ConvPatchesRule(KernelBiasRule):
    def unsupported(self, layer):
        if layer.groups != 1:
            return "grouped convolutions have their own rule (depthwise_conv.py)"
        return channels_last_only(layer, "ungrouped")

    def per_example(self, layer, saved, grads):
        kernels = per_example_kernels(ConvSpec.of(layer), *self.convolution_operands(saved, grads))
        out = [tf.reshape(kernels, [-1, *layer.kernel.shape])]
        if layer.use_bias:
            out.append(tf.reduce_sum(op.as_btf(grads[0]), axis=1))
        return out

    def convolution_operands(self, saved, grads) -> tuple[tf.Tensor, tf.Tensor]:
        """``(a, g)``: the input and output gradient of the convolution whose kernel gradient is the layer's."""
        return saved, grads[0]

    def squared_norms(self, layer, saved, grads, cache=None):
        """Norms; with a ``cache`` (a clipped sum follows), the per-example ``(kernels, biases)`` when small.

        The per-example bias gradients ``[B, c_out]`` are kept with the
        kernels, so that nothing in the clipped sum reads ``g`` and it can be
        freed before every norm is known.
        """
        kernel_norms, kernels = kernel_part(
            ConvSpec.of(layer), *self.convolution_operands(saved, grads), cache is not None
        )
        parts = [kernel_norms]
        biases = None
        if layer.use_bias:
            biases = tf.reduce_sum(op.as_btf(grads[0]), axis=graph_constant(1))  # [B, c_out]
            parts.append(squares_part(biases))
        if kernels is not None:
            cache["kept"] = (kernels, biases)
        return widened(parts)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        kept = (cache or {}).get("kept")
        if kept is not None:
            kernels, biases = kept
            out = [kept_weighted_sum(kernels, weights, layer.kernel.shape)]
            if layer.use_bias:
                out.append(weighted_example_sum(weights, biases))
        else:
            out = [
                weighted_kernel_sum(ConvSpec.of(layer), layer.kernel, *self.convolution_operands(saved, grads), weights)
            ]
            if layer.use_bias:
                out.append(op.weighted_bias_sum(op.as_btf(grads[0]), weights))
        return out


PATCHES_RULE = ConvPatchesRule()
