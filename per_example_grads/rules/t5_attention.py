"""KerasHub's ``T5MultiHeadAttention`` with its relative attention bias, in closed form.

Registered by full class name, so importing this module never imports
``keras_hub``. Only the first attention layer of a T5 stack owns a variable
of its own, the bias table ``R`` ``[buckets, heads]``, and without this rule
that made it one layer-local watch (one VJP of the whole attention per
example). Its call, on queries ``h`` ``[B, Tq, D]`` with a mask, is

    z_q = h W_q,   z_k = s W_k,   z_v = s W_v           (s = h, or the encoder states)
    P = R[bucket(k - q)] (as [1, heads, Tq, Tk]) + mask bias        [B, heads, Tq, Tk]
    o = softmax(z_q z_k^T + P) z_v,   y = o W_o;   the layer returns (y, P, cache)

with ``bucket`` T5's fixed map of relative positions to buckets. The rule
runs that call as it is, with each projector's output and the bias values
``R[bucket]`` (broadcast to the batch, which the mask's addition does
anyway) passed through identities it taps. With the loss gradients at those
taps (``g_q, g_k, g_v, g_o`` and ``G`` ``[B, heads, Tq, Tk]``, each the
whole gradient at that tensor: through the layer's own use of ``P`` and
through the later layers that reuse it), example n's gradients are

- each projector's kernel: the Dense rule's closed form on its input and
  ``g`` (``sum_t a_nt^T g_nt``; Gram-form norms; the clipped sum one product);
- the bias table: ``dL_n/dR[c, h] = sum_{q, k: bucket(k - q) = c} G_n[h, q, k]``,
  one product with the one-hot ``[Tq Tk, buckets]`` bucket matrix, ``[B,
  buckets, heads]`` (small: norms from it, the clipped sum its weighted sum).

The model computes what it computes without the engine, bit for bit. The
layers that own no bias (they reuse the first one's, or have none) get the
projectors' forms alone: registering the class makes every instance one
watched layer. Calls that compute the bias without a mask (the bias would stay ``[1,
...]`` in the output), with a ``cache`` (generation), or a layer with LoRA
or quantized projectors use the exact layer-local fallback.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import compute_dtype, squares_part, weighted_example_sum, widened
from per_example_grads._core.model_inspection import replaced_on_instances
from per_example_grads.rules.local import LOCAL_RULE
from per_example_grads.rules.rule import RULES, LayerRule, register_layer_rule, reparametrized

T5_ATTENTION = "keras_hub.src.models.t5.t5_multi_head_attention.T5MultiHeadAttention"
PROJECTORS = ("query_projector", "key_projector", "value_projector", "output_projector")


def _dense_rule() -> LayerRule:
    return RULES[keras.layers.Dense]


class T5AttentionRule(LayerRule):
    """``T5MultiHeadAttention`` (module docstring); one without a bias of its own has the projectors' forms alone.

    ``saved`` is ``("closed", inputs, buckets)`` (``inputs``: each
    projector's input, in ``PROJECTORS`` order; ``buckets`` ``[Tq, Tk]``
    int32, None when the bias was not computed) or ``("local", saved)``.

    ``taps_from_variables``: the bias values' tap is computed from the table
    alone, and read within the call (by the scores' sum), so the capturing
    tape must watch the layer's variables (``engines.capture._watched_call``).
    """

    taps_from_variables = True

    def unsupported(self, layer):
        for name in PROJECTORS:
            dense = getattr(layer, name, None)
            if (
                type(dense) is not keras.layers.Dense
                or dense.bias is not None
                or dense.activation not in (None, keras.activations.linear)
            ):
                return f"'{layer.name}.{name}' is not a bias-free linear keras.layers.Dense"
            why = reparametrized(dense)
            if why:
                return why
        return None

    def _all(self, layer) -> list:
        own = [layer.relative_attention_bias] if layer.use_relative_attention_bias else []
        return [getattr(layer, name).kernel for name in PROJECTORS] + own

    def variables(self, layer):
        return [v for v in self._all(layer) if v.trainable]

    def _keep(self, layer, values):
        return [t for t, v in zip(values, self._all(layer)) if v.trainable]

    def forward(self, layer, call, args, kwargs):
        names = ["hidden_states", "mask", "key_value_states", "position_bias", "cache", "cache_update_index"]
        given = dict(zip(names, args), **kwargs)
        biased = layer.use_relative_attention_bias and given.get("position_bias") is None
        if given.get("cache") is not None or (biased and given.get("mask") is None):
            outputs, saved, taps = LOCAL_RULE.forward(layer, call, args, kwargs)
            return outputs, ("local", saved), taps
        batch = tf.shape(args[0])[0]
        inputs, taps, buckets = {}, {}, []

        def projector(name, inner):
            def tapped(x, *a, **kw):
                inputs[name] = x
                taps[name] = tf.identity(inner(x, *a, **kw))
                return taps[name]

            return tapped

        def compute_bias(query_length, key_length, query_start_index=0):
            values = type(layer).compute_bias(layer, query_length, key_length, query_start_index)
            buckets.append(_buckets(layer, query_length, key_length, query_start_index))
            taps["bias"] = tf.identity(tf.broadcast_to(values, tf.concat([[batch], tf.shape(values)[1:]], 0)))
            return tf.identity(taps["bias"])  # the tap is no output: it gets the whole gradient at the bias values

        patches = [(getattr(layer, n), projector(n, getattr(layer, n).call)) for n in PROJECTORS]
        with replaced_on_instances([*((p, "call", c) for p, c in patches), (layer, "compute_bias", compute_bias)]):
            outputs = call(*args, **kwargs)
        if sorted(inputs) != sorted(PROJECTORS) or len(buckets) > 1:
            raise NotImplementedError(f"T5MultiHeadAttention '{layer.name}' did not call each projector once")
        tapped = [taps[n] for n in PROJECTORS] + ([taps["bias"]] if buckets else [])
        return outputs, ("closed", [inputs[n] for n in PROJECTORS], buckets[0] if buckets else None), tapped

    def _table_gradients(self, layer, buckets, grads) -> tf.Tensor:
        """``[B, buckets, heads]`` per-example gradients of the bias table (zeros if it was not used)."""
        table = layer.relative_attention_bias
        g = grads[0]
        if buckets is None:
            return tf.zeros(tf.concat([tf.shape(g)[:1], table.shape], 0), compute_dtype(g.dtype))
        big = tf.cast(grads[4], compute_dtype(grads[4].dtype))  # [B, heads, Tq, Tk]
        one_hot = tf.one_hot(tf.reshape(buckets, [-1]), table.shape[0], dtype=big.dtype)  # [Tq Tk, buckets]
        flat = tf.reshape(big, [tf.shape(big)[0], table.shape[1], -1])  # [B, heads, Tq Tk]
        return tf.transpose(tf.matmul(flat, one_hot), [0, 2, 1])

    def _projector_calls(self, layer, saved, grads):
        _, inputs, _ = saved
        return [(getattr(layer, n), a, [g]) for n, a, g in zip(PROJECTORS, inputs, grads[:4])]

    def per_example(self, layer, saved, grads):
        if saved[0] == "local":
            return LOCAL_RULE.per_example(layer, saved[1], grads, variables=self.variables(layer))
        dense = _dense_rule()
        kernels = [dense.per_example(d, a, g)[0] for d, a, g in self._projector_calls(layer, saved, grads)]
        if layer.use_relative_attention_bias:
            kernels.append(self._table_gradients(layer, saved[2], grads))
        return self._keep(layer, kernels)

    def squared_norms(self, layer, saved, grads, cache=None):
        if saved[0] == "local":
            return LayerRule.squared_norms(self, layer, saved, grads, cache)
        dense = _dense_rule()
        norms = []
        for i, (d, a, g) in enumerate(self._projector_calls(layer, saved, grads)):
            sub = None if cache is None else cache.setdefault(PROJECTORS[i], {})
            norms.append(dense.squared_norms(d, a, g, sub)[0])
        if layer.use_relative_attention_bias:
            table = self._table_gradients(layer, saved[2], grads)
            if cache is not None:
                cache["table"] = table
            norms += widened([squares_part(table)])
        return [n for n, v in zip(norms, self._all(layer)) if v.trainable]

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        if saved[0] == "local":
            return LayerRule.weighted_sum(self, layer, saved, grads, weights, cache)
        dense = _dense_rule()
        sums = [
            dense.weighted_sum(d, a, g, weights, (cache or {}).get(PROJECTORS[i]))[0]
            for i, (d, a, g) in enumerate(self._projector_calls(layer, saved, grads))
        ]
        if layer.use_relative_attention_bias:
            table = (cache or {}).get("table")
            if table is None:
                table = self._table_gradients(layer, saved[2], grads)
            sums.append(weighted_example_sum(tf.cast(weights, table.dtype), table))
        return self._keep(layer, sums)


def _buckets(layer, query_length, key_length, query_start_index) -> tf.Tensor:
    """``[Tq, Tk]`` int32: the bucket of each (query, key) pair, as ``compute_bias`` takes its rows of the table."""
    ops = keras.ops
    context = ops.arange(query_length)[:, None] + query_start_index
    memory = ops.arange(key_length)[None, :]
    bucket = type(layer)._relative_position_bucket(
        memory - context,
        bidirectional=(not layer.is_decoder),
        num_buckets=layer.relative_attention_buckets,
        max_distance=layer.relative_attention_max_distance,
    )
    return tf.cast(bucket, tf.int32)


T5_ATTENTION_RULE = T5AttentionRule()
register_layer_rule(T5_ATTENTION, T5_ATTENTION_RULE)
