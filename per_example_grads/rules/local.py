"""The layer-local fallback: exact per-example gradients for any layer.

For a layer without a closed form (custom layers, RNNs, normalization layers),
the engine keeps the layer's call arguments from the forward pass and the loss
gradient ``g`` at its outputs. Example i's gradient with respect to the
layer's weights is the vector-Jacobian product
``d <layer(args_i), g_i> / d weights``, recomputed on that one example; the
``B`` recomputations run under ``tf.vectorized_map`` (or a ``tf.map_fn`` loop
for layers whose one-example VJP has an op that pfor would push past its CPU
kernel's rank, ``per_example_grads._core.pfor_limits``, for recurrent layers
under XLA, or when vectorization fails). Only this
layer is recomputed, never the whole model.

The taps are the layer's float outputs as the engine separates them
(``rules.rule.separate_taps``): ``g`` is the gradient that reaches each output
from outside the layer. A layer that also uses one of its outputs inside
itself (KerasHub's ``T5MultiHeadAttention`` returns ``position_bias`` and adds
it to its scores) has that use differentiated once, inside the recomputed
VJP, not a second time through the gradient at the tap.

With ``preactivation=True`` (used for convolutions) the layer's fused
``activation`` is split off: the tap is the pre-activation output, and the
recomputation runs without the activation.
"""

from __future__ import annotations

import contextlib
import weakref

import keras
import tensorflow as tf

from per_example_grads._core import pfor_limits
from per_example_grads._core.example_ops import map_examples
from per_example_grads._core.quiet import quiet_vectorization
from per_example_grads._core.tape import dense_or_zeros, watch_variables
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.rules.rule import LayerRule


class LocalRule(LayerRule):
    """Per-example VJPs of one layer's call, vectorized over the batch."""

    def __init__(self, preactivation: bool = False):
        self.preactivation = preactivation

    def forward(self, layer, call, args, kwargs):
        with without_activation(layer, self.preactivation):
            outputs = call(*args, **kwargs)
        taps = [t for t in tf.nest.flatten(outputs) if _is_float_tensor(t)]
        if self.preactivation and getattr(layer, "activation", None) is not None:
            outputs = layer.activation(outputs)
        return outputs, (args, kwargs), taps

    def per_example(self, layer, saved, grads, variables=None):
        """As ``LayerRule.per_example``; ``variables`` overrides ``self.variables(layer)``.

        Called eagerly, the recomputation runs as a ``tf.function`` kept per
        layer and input signature (``_eager_function``): ``tf.vectorized_map``
        traces and converts its function anew at every eager call (seconds for
        a recurrent layer's loop), so an eager loop over batches would pay
        that at every batch.
        """
        variables = self.variables(layer) if variables is None else variables
        if tf.executing_eagerly():
            traced = _eager_function(self, layer, saved, grads, variables)
            if traced is not None:
                return traced([t for t in tf.nest.flatten(saved) if isinstance(t, tf.Tensor)], list(grads))
        return self._per_example(layer, saved, grads, variables)

    def _per_example(self, layer, saved, grads, variables):
        args, kwargs = saved
        leaves = tf.nest.flatten((args, kwargs))
        batched = [i for i, t in enumerate(leaves) if isinstance(t, tf.Tensor) and t.shape.rank]
        # Recompute in the variables' dtype: outside Layer.__call__'s autocast
        # scope a float16 input would meet float32 weights.
        var_dtype = tf.as_dtype(variables[0].dtype) if variables else tf.float32

        def one(elems):
            example_leaves, example_grads = elems
            full = list(leaves)
            for i, t in zip(batched, example_leaves):
                t = tf.expand_dims(t, 0)
                full[i] = tf.cast(t, var_dtype) if t.dtype.is_floating else t
            a, kw = tf.nest.pack_sequence_as((args, kwargs), full)
            with tf.GradientTape() as tape:
                watch_variables(tape, variables)
                with without_activation(layer, self.preactivation):
                    out = layer(*a, **kw)
                taps = [t for t in tf.nest.flatten(out) if _is_float_tensor(t)]
            cotangents = [tf.cast(tf.expand_dims(g, 0), t.dtype) for g, t in zip(example_grads, taps)]
            return dense_or_zeros(tape.gradient(taps, variables, output_gradients=cotangents), variables)

        elems = ([leaves[i] for i in batched], list(grads))
        fn = tf.autograph.experimental.do_not_convert(one)
        specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]

        def vectorized():
            # XLA cannot compile a vectorized while loop (it raises); a loop of loops it can.
            looping = in_xla_context() and isinstance(layer, (keras.layers.RNN, keras.layers.Bidirectional))
            # An op past its kernel's rank under pfor can crash the process
            # (not raise) on some CPUs: such a layer is never vectorized.
            if not (looping or pfor_limits.vectorization_hazards(fn, pfor_limits.example_specs(elems))):
                try:
                    with quiet_vectorization():
                        return tf.vectorized_map(fn, elems)
                except Exception:  # noqa: BLE001 - fall back to the loop below
                    pass
            return map_examples(fn, elems, fn_output_signature=specs)

        # Ops that tf.vectorized_map runs as a while loop fail on an empty
        # batch, so a batch of 0 short-cuts to empty gradients.
        b = tf.shape(grads[0])[0]
        empty = lambda: [tf.zeros([0, *v.shape], v.dtype) for v in variables]
        if isinstance(grads[0].shape[0], int):
            return vectorized() if grads[0].shape[0] > 0 else empty()
        return tf.cond(b > 0, vectorized, empty)


LOCAL_RULE = LocalRule()

_PLAIN = (bool, int, float, str, type(None))
EAGER_FUNCTIONS_PER_LAYER = 8  # input signatures kept per layer; past them an eager call traces as before
_eager_functions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer -> {signature: tf.function}


def _eager_function(rule: LocalRule, layer, saved, grads, variables):
    """The kept ``tf.function`` of ``rule._per_example`` on ``layer`` for this call's signature, or None.

    The signature is every leaf of ``saved`` (a tensor's shape and dtype, any
    other value itself: a ``training`` flag, a ``None`` mask), the
    gradients' shapes and dtypes, which variables, and the plain-valued
    attributes (``_layer_settings``) of the layer and the layers inside it: a
    call that differs in any of them gets another function, so an attribute
    set between eager calls is seen as an eager call would see it. Tensors
    are the function's inputs, and it refers to the layer and variables
    weakly, so a kept function holds no batch's values and is dropped with
    its layer. None
    (nothing kept) under a distribution strategy (a function traced in one
    replica's context), when a leaf is neither a tensor nor a plain value, or
    when the layer already has ``EAGER_FUNCTIONS_PER_LAYER``.
    """
    flat = tf.nest.flatten(saved)
    if tf.distribute.has_strategy() or not all(isinstance(t, (tf.Tensor, *_PLAIN)) for t in flat):
        return None
    spec = lambda t: (tuple(t.shape), t.dtype.name)  # noqa: E731
    skeleton = tf.nest.map_structure(lambda _: 0, saved)
    signature = (
        rule.preactivation,
        repr(skeleton),  # the nesting, which pack_sequence_as rebuilds
        tuple(spec(t) if isinstance(t, tf.Tensor) else (type(t), t) for t in flat),
        tuple(spec(g) for g in grads),
        tuple(id(v) for v in variables),
        _layer_settings(layer),
    )
    try:
        kept = _eager_functions.setdefault(layer, {})
    except TypeError:  # a layer that cannot be weakly referenced
        return None
    if signature in kept or len(kept) >= EAGER_FUNCTIONS_PER_LAYER:
        return kept.get(signature)
    values = [(isinstance(t, tf.Tensor), None if isinstance(t, tf.Tensor) else t) for t in flat]  # tensors: inputs
    layer_ref, variable_refs = weakref.ref(layer), [weakref.ref(v) for v in variables]

    def run(tensors, grads):
        supplied = iter(tensors)
        leaves = [next(supplied) if tensor else value for tensor, value in values]
        return rule._per_example(
            layer_ref(), tf.nest.pack_sequence_as(skeleton, leaves), grads, [r() for r in variable_refs]
        )

    kept[signature] = tf.function(run, autograph=False)
    return kept[signature]


def _layer_settings(layer) -> tuple:
    """The attributes of ``layer`` and the layers inside it that hold plain values (or tuples of them), by name."""
    layers = layer._flatten_layers() if hasattr(layer, "_flatten_layers") else [layer]
    return tuple(
        tuple(
            (name, value)
            for name, value in sorted(vars(inner).items())
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))
        )
        for inner in layers
    )


@contextlib.contextmanager
def without_activation(layer, enabled: bool):
    activation = getattr(layer, "activation", None)
    if not enabled or activation is None:
        yield
        return
    object.__setattr__(layer, "activation", None)
    try:
        yield
    finally:
        object.__setattr__(layer, "activation", activation)


def _is_float_tensor(t) -> bool:
    return isinstance(t, tf.Tensor) and t.dtype.is_floating
