"""Closed forms for KerasHub's sparse mixture-of-experts blocks (Mixtral, Qwen-MoE, Qwen3-MoE).

Registered by full class name, so importing this module never imports
``keras_hub``.

A block gets ``hidden_states`` ``[B, T, D]`` and flattens it, row-major, to
``X`` ``[N, D]``, ``N = B T``: row ``r`` is token ``r mod T`` of example
``r // T``. Every layer with variables inside the block works on such rows:

- the router, a bias-free ``Dense(E)``: logits ``X @ W_r`` ``[N, E]``, whose
  softmax, top-k and renormalization give each row's routing weights
  (zero for the experts it is not sent to);
- the expert bank, all ``E`` experts on every row, with stacked kernels:
  ``Z = einsum("th,ehm->etm", X, W_in)`` ``[E, N, M']`` (Mixtral: two such
  kernels, gate and intermediate, ``M' = M``; Qwen: one fused gate-and-up
  kernel, ``M' = 2M``, split in two), ``H = up * act(gate)`` ``[E, N, M]``
  and ``Y = einsum("eti,eih->eth", H, W_out)`` ``[E, N, D]``, which the
  block weights by the routing and sums over the experts;
- Qwen-MoE's shared expert (three bias-free ``Dense`` on the rows) and its
  sigmoid gate, a ``Dense(1)``.

With the loss gradient at each layer's output (``G = dL/dZ`` for a kernel
read by ``Z = X W``: the routing, the top-k selection and the activation
are differentiated by the one backward pass), row ``r``'s gradient is an
outer product, and example ``n``'s is the sum over its rows ``R_n``:

    dL_n/dW = sum_{r in R_n} x_r^T g_r,

which is a Dense layer's maths on ``[B, T, .]`` (``rules.outer_products``:
the Gram form ``sum_{t,s} (x_t . x_s)(g_t . g_s)`` for the norms when
cheaper, one contraction over all rows for a weighted sum). A stacked
``W_in`` ``[E, D, M']`` is one Dense from ``D`` to ``E M'`` (its gradient's
rows are ``G`` with the experts side by side); ``W_out`` ``[E, M, D]`` is one
Dense per expert, ``dL_n/dW_out[e] = sum_{r in R_n} H[e, r]^T G[e, r]``, with
per-expert Gram forms added over the experts for the norms. Rows a token
was not routed to carry zero gradient, so nothing is dropped or
double-counted; these blocks have no capacity limit (every row reaches its
top-k experts).

The rule runs the block's own ``call``. While it runs, the router and the
other ``Dense`` layers run their own ``call`` (each bias-free or not, with
no activation), and the expert bank runs the ops of its ``call`` in the
same order on the same tensors (the same values, bit for bit, checked by
the tests), so the rule can tap ``Z`` inside it. Every tap is handed to
the block as a ``tf.identity`` of itself, so no tap is an output of the
block (the router logits it returns are the identity, and the tap receives
their whole gradient). A block holding anything else (a LoRA-enabled or
activated ``Dense``, another layer with variables, an expert bank of
another class) is left to the layer-local fallback.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads._core import model_inspection
from per_example_grads._core.example_ops import WIDE, compute_dtype, widened
from per_example_grads.rules import outer_products
from per_example_grads.rules.rule import LayerRule, register_layer_rule, reparametrized

_HUB = "keras_hub.src.models"
MOE_BLOCKS = (
    f"{_HUB}.mixtral.mixtral_decoder.MixtralSparseMoeBlock",
    f"{_HUB}.qwen_moe.qwen_moe_decoder.QwenSparseMoeBlock",
    f"{_HUB}.qwen3_moe.qwen3_moe_decoder.Qwen3SparseMoeBlock",
)
# Expert banks, by how their call reads the input kernels: Mixtral's gate and
# intermediate kernels apart, Qwen's fused gate-and-up kernel split in two.
_SEPARATE, _FUSED = "separate", "fused"
EXPERT_BANKS = {
    f"{_HUB}.mixtral.mixtral_decoder.MixtralMoeExperts": _SEPARATE,
    f"{_HUB}.qwen_moe.qwen_moe_decoder.QwenMoeExperts": _FUSED,
    f"{_HUB}.qwen3_moe.qwen3_moe_decoder.Qwen3MoeExperts": _FUSED,
}


def _full_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _rows(t: tf.Tensor, steps) -> tf.Tensor:
    """``[N, ...]`` rows -> ``[B, T, ...]``, ``N = B T``, in the compute dtype (T static when known)."""
    t = tf.cast(t, compute_dtype(t.dtype))
    rest = list(t.shape[1:]) if t.shape[1:].is_fully_defined() else tf.unstack(tf.shape(t)[1:])
    return tf.reshape(t, [-1, steps, *rest])


def _expert_rows(t: tf.Tensor, steps) -> tf.Tensor:
    """``[E, N, f]`` -> ``[E, B, T, f]`` in the compute dtype."""
    t = tf.cast(t, compute_dtype(t.dtype))
    return tf.reshape(t, [t.shape[0], -1, steps, t.shape[-1]])


def _side_by_side(g: tf.Tensor, steps) -> tf.Tensor:
    """``[E, N, f]`` -> ``[B, T, E f]``: each row's gradients for the ``E`` experts side by side."""
    e, f = g.shape[0], g.shape[-1]
    g4 = tf.transpose(_expert_rows(g, steps), [1, 2, 0, 3])  # [B, T, E, f]
    return tf.reshape(g4, [-1, steps, e * f])


# ----------------------------------------------------------------- the parts


class _DensePart:
    """A ``Dense`` without activation on the block's rows: ``z = x W (+ b)``; tap ``z``, keep ``x``."""

    def __init__(self, layer):
        self.layer = layer

    def variables(self) -> list:
        return [self.layer.kernel] + ([self.layer.bias] if self.layer.bias is not None else [])

    def forward(self, original, args, kwargs):
        z = original(*args, **kwargs)
        return z, (args[0] if args else kwargs["inputs"]), [z]

    def per_example(self, saved, grads, steps) -> list:
        a, g = _rows(saved, steps), _rows(grads[0], steps)
        return [outer_products.per_example_kernel(a, g)] + (
            [tf.reduce_sum(g, axis=1)] if self.layer.bias is not None else []
        )

    def norm_parts(self, saved, grads, steps) -> list:
        a, g = _rows(saved, steps), _rows(grads[0], steps)
        return (
            outer_products.kernel_and_bias_parts(a, g)
            if self.layer.bias is not None
            else [outer_products.kernel_part(a, g)]
        )

    def weighted_sum(self, saved, grads, steps, weights) -> list:
        a, g = _rows(saved, steps), _rows(grads[0], steps)
        out = [outer_products.weighted_kernel_sum(a, g, weights)]
        if self.layer.bias is not None:
            out.append(outer_products.weighted_bias_sum(g, weights))
        return out


class _ExpertsPart:
    """The expert bank: input kernels ``[E, D, M']`` (one or two) and the output kernel ``[E, M, D]``.

    Taps the input einsums' outputs ``Z`` ``[E, N, M']`` and the output
    ``Y`` ``[E, N, D]``; keeps ``X`` ``[N, D]`` and ``H`` ``[E, N, M]``.
    """

    def __init__(self, layer, kind: str):
        self.layer, self.kind = layer, kind

    def _in_kernels(self) -> list:
        l = self.layer
        if self.kind == _SEPARATE:
            return [l._expert_feedforward_gate_dense, l._expert_feedforward_intermediate_dense]
        return [l._expert_feedforward_gate_dense]

    def variables(self) -> list:
        return self._in_kernels() + [self.layer._expert_feedforward_output_dense]

    def forward(self, original, args, kwargs):
        # The ops of the bank's call, in its order, on the same tensors.
        l, ops = self.layer, keras.ops
        x = args[0] if args else kwargs["hidden_states"]
        if self.kind == _SEPARATE:  # MixtralMoeExperts.call
            z_gate = ops.einsum("th,ehm->etm", x, l._expert_feedforward_gate_dense)
            gate = ops.cast(z_gate, "float32")
            gate = l.activation(gate)
            gate = ops.cast(gate, l.compute_dtype)
            z_inter = ops.einsum("th,ehm->etm", x, l._expert_feedforward_intermediate_dense)
            hidden = z_inter * gate
            taps = [z_gate, z_inter]
        else:  # QwenMoeExperts.call, Qwen3MoeExperts.call
            z = ops.einsum("th,ehm->etm", x, l._expert_feedforward_gate_dense)
            gate, up = ops.split(z, 2, axis=-1)
            hidden = up * l.activation(gate)
            taps = [z]
        y = ops.einsum("eti,eih->eth", hidden, l._expert_feedforward_output_dense)
        return y, (x, hidden), taps + [y]

    def per_example(self, saved, grads, steps) -> list:
        x, hidden = saved
        a = _rows(x, steps)
        out = [
            self._unflatten_per_example(outer_products.per_example_kernel(a, _side_by_side(g, steps)), g)
            for g in grads[:-1]
        ]
        h, g = _expert_rows(hidden, steps), _expert_rows(grads[-1], steps)
        out.append(tf.einsum("ebtm,ebtd->bemd", h, g))
        return out

    @staticmethod
    def _unflatten_per_example(k: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
        """``[B, D, E M']`` -> ``[B, E, D, M']``."""
        e, f = g.shape[0], g.shape[-1]
        return tf.transpose(tf.reshape(k, [-1, k.shape[1], e, f]), [0, 2, 1, 3])

    def norm_parts(self, saved, grads, steps) -> list:
        x, hidden = saved
        a = _rows(x, steps)
        parts = [outer_products.kernel_part(a, _side_by_side(g, steps)) for g in grads[:-1]]
        parts.append(_per_expert_kernel_part(_expert_rows(hidden, steps), _expert_rows(grads[-1], steps)))
        return parts

    def weighted_sum(self, saved, grads, steps, weights) -> list:
        x, hidden = saved
        x = tf.cast(x, compute_dtype(x.dtype))
        w_rows = tf.repeat(tf.cast(weights, x.dtype), steps)  # [N]: each row's example's weight
        out = []
        for g in grads[:-1]:  # sum_r w_r x_r^T g[e, r]: [E, D, M']
            g = tf.cast(g, x.dtype)
            if x.shape[-1] is not None and g.shape[-1] is not None and x.shape[-1] < g.shape[-1]:
                out.append(tf.einsum("nd,enm->edm", x * w_rows[:, None], g))
            else:
                out.append(tf.einsum("nd,enm->edm", x, g * w_rows[None, :, None]))
        h, g = tf.cast(hidden, x.dtype), tf.cast(grads[-1], x.dtype)
        m, d = h.shape[-1], g.shape[-1]
        if m is not None and d is not None and m < d:
            h = h * w_rows[None, :, None]
        else:
            g = g * w_rows[None, :, None]
        out.append(tf.linalg.matmul(h, g, transpose_a=True))  # [E, M, D]
        return out


def _per_expert_kernel_part(h: tf.Tensor, g: tf.Tensor) -> tuple:
    """``sum_e ||sum_t h[e, n, t]^T g[e, n, t]||^2`` from ``[E, B, T, i]`` and ``[E, B, T, j]``, a part for ``widened``.

    The Gram form ``sum_{e,t,s} (h_et . h_es)(g_et . g_es)`` when
    ``T (i + j) < i j``, else the per-expert kernels built; with its float64
    recomputation on the examples ``widened`` picks (None for float64).
    """
    t, i, j = h.shape[2], h.shape[3], g.shape[3]
    gram = t is not None and t * (i + j) < i * j

    def value(h, g):
        if gram:
            hh = tf.einsum("ebti,ebsi->ebts", h, h)
            gg = tf.einsum("ebtj,ebsj->ebts", g, g)
            return tf.reduce_sum(hh * gg, axis=[0, 2, 3])
        k = tf.einsum("ebti,ebtj->beij", h, g)
        return tf.reduce_sum(tf.square(k), axis=[1, 2, 3])

    if h.dtype == WIDE:
        return value(h, g), None

    def exact(pick):
        examples = pick(tf.range(tf.shape(h)[1]))  # the picked examples' indices (pick gathers rows)
        take = lambda t: tf.cast(tf.gather(t, examples, axis=1), WIDE)  # noqa: E731
        return value(take(h), take(g))

    return value(h, g), exact


# ----------------------------------------------------------------- the rule


class MoEBlockRule(LayerRule):
    """A sparse MoE block's router, experts and shared expert, per example (module docstring)."""

    def _parts(self, layer) -> list | str:
        """The block's layers with variables as parts, in creation order, or why the rule declines the block."""
        parts: list = []

        def visit(sub):
            name = _full_name(type(sub))
            if name in EXPERT_BANKS:
                if reparametrized(sub):
                    raise _Declined(f"expert bank '{sub.name}': {reparametrized(sub)}")
                parts.append(_ExpertsPart(sub, EXPERT_BANKS[name]))
                return
            if isinstance(sub, keras.layers.Dense):
                if type(sub).call is not keras.layers.Dense.call or reparametrized(sub):
                    raise _Declined(f"'{sub.name}' is not a plain Dense")
                if sub.activation not in (None, keras.activations.linear):
                    raise _Declined(f"Dense '{sub.name}' has an activation")
                parts.append(_DensePart(sub))
                return
            if model_inspection.own_variables(sub):
                raise _Declined(f"'{sub.name}' ({type(sub).__name__}) has variables the rule does not know")
            for inner in model_inspection.direct_sublayers(sub):
                if inner.weights:
                    visit(inner)

        try:
            if model_inspection.own_variables(layer):
                raise _Declined("the block owns variables itself")
            for sub in model_inspection.direct_sublayers(layer):
                if sub.weights:
                    visit(sub)
        except _Declined as why:
            return str(why)
        covered = {id(v) for p in parts for v in p.variables()}
        if any(id(v) not in covered for v in layer.trainable_variables):
            return "the block has trainable variables outside its router and experts"
        return parts

    def unsupported(self, layer):
        parts = self._parts(layer)
        return parts if isinstance(parts, str) else None

    def variables(self, layer):
        return [v for p in self._parts(layer) for v in p.variables()]

    def forward(self, layer, call, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        steps = hidden.shape[1] if hidden.shape[1] is not None else tf.shape(hidden)[1]
        parts = self._parts(layer)
        calls: list = [[] for _ in parts]

        def watched(k, part, original):
            def part_call(*a, **kw):
                out, saved, taps = part.forward(original, a, kw)
                calls[k].append((saved, taps))
                # The block consumes identities: a tap is never one of its outputs.
                return tf.identity(out)

            return part_call

        with model_inspection.replaced_calls([(p.layer, watched(k, p, p.layer.call)) for k, p in enumerate(parts)]):
            outputs = call(*args, **kwargs)
        if any(len(c) != 1 for c in calls):
            raise NotImplementedError(
                f"MoE block '{layer.name}' called its parts "
                f"{[len(c) for c in calls]} times; its closed form expects each once"
            )
        saved = (steps, [c[0][0] for c in calls], [len(c[0][1]) for c in calls], hidden)
        taps = [t for c in calls for t in c[0][1]]
        return outputs, saved, taps

    def batch_led(self, saved, taps) -> list:
        """The block's ``[B, T, D]`` input: the taps are its rows (``engines.capture.batch_led``)."""
        return [saved[3]]

    def _split(self, layer, saved, grads):
        steps, part_saved, counts, _ = saved
        parts, out, i = self._parts(layer), [], 0
        for p, s, n in zip(parts, part_saved, counts):
            out.append((p, s, list(grads[i : i + n])))
            i += n
        return steps, out

    def per_example(self, layer, saved, grads):
        steps, split = self._split(layer, saved, grads)
        values = [t for p, s, g in split for t in p.per_example(s, g, steps)]
        return values

    def squared_norms(self, layer, saved, grads, cache=None):
        steps, split = self._split(layer, saved, grads)
        return widened([part for p, s, g in split for part in p.norm_parts(s, g, steps)])

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        steps, split = self._split(layer, saved, grads)
        values = [t for p, s, g in split for t in p.weighted_sum(s, g, steps, weights)]
        return values


class _Declined(Exception):
    pass


MOE_BLOCK_RULE = MoEBlockRule()
for _name in MOE_BLOCKS:
    register_layer_rule(_name, MOE_BLOCK_RULE)
