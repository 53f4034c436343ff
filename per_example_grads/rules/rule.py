"""The interface a per-layer rule implements, and the registry of rules.

A rule teaches the layer-wise engine one layer family. During the single
forward pass the engine calls ``rule.forward`` in place of the layer's own
``call``; the rule returns the layer's outputs, whatever it needs to keep
(``saved``: typically the layer's input ``a``), and the ``taps``: the tensors
at which it wants the loss gradient ``g`` (for a Dense layer, the
pre-activation ``z = a @ W + b``). After the one backward pass, the rule turns
``(saved, g)`` into per-example quantities:

- ``per_example`` (required): per-example gradients, ``[B, *var.shape]`` per
  variable;
- ``squared_norms`` (optional): ``||grad_i||^2`` per variable, ``[B]`` each,
  ideally without building per-example gradients ("ghost norms");
- ``weighted_sum`` (optional): ``sum_i c_i grad_i`` per variable,
  ``[*var.shape]``, ideally as one contraction (the clipped sum of DP-SGD).

The defaults of the last two materialize ``per_example`` for this one layer,
which is exact but costs ``B x (layer's parameters)`` memory. The engine
passes both the same per-call ``cache`` dict when it computes a clipped sum,
so what the norms built can serve the sum.

Taps never count a gradient twice. A tap that is one of the layer's
outputs receives the loss gradient that reaches that output from *outside*
the layer: every rule's ``forward`` is wrapped (once, here, for every
subclass) so that such an output is returned as a fresh ``tf.identity`` of
itself, and that identity is the tap (``separate_taps``). Without it, a layer
that returns a tensor and also uses it for another output (KerasHub's
``T5MultiHeadAttention`` returns ``position_bias`` and adds it to its
scores) would receive at that tap the gradient of its own internal use too,
and a rule differentiating the whole layer would count that path twice. A
tap that is not an output (a pre-activation ``z`` before a fused
activation) receives the whole gradient at ``z``, through the rest of the
layer's own computation.

A layer called several times gets ``shared_squared_norms`` with every call
(its gradients add up before the square), and ``for_layer`` lets the rule
registered for a class hand one instance to another rule (a LoRA-enabled
Dense to the LoRA rule).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Sequence

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import (  # noqa: F401  (per_example_squared_norms and wide_squared_norms re-exported)
    graph_constant,
    per_example_squared_norms,
    squares_part,
    weighted_example_sum,
    wide_squared_norms,
    widened,
)
from per_example_grads.per_example_slices import PerExampleSlices


class LayerRule:
    """Base class of layer rules; see the module docstring.

    Example (a layer computing ``x * w`` elementwise, with ``w`` of shape [d]):

        class ScaleRule(peg.LayerRule):
            def variables(self, layer):
                return [layer.w]

            def forward(self, layer, call, args, kwargs):
                a = args[0]
                out = a * layer.w
                return out, a, [out]

            def per_example(self, layer, saved, grads):
                a, (g,) = saved, grads
                return [peg.rules.sum_to_shape(a * g, layer.w.shape)]

        peg.register_layer_rule(Scale, ScaleRule())
    """

    def __init_subclass__(cls, **kwargs):
        # Every rule's forward, built-in or a user's, hands its taps to
        # separate_taps, and every rule's per-example gradients and weighted
        # sums come in the variables' dtypes (in_variable_dtypes): no rule can
        # forget either.
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None and not getattr(forward, "_separates_taps", False):
            cls.forward = _separating(forward)
        for name in ("per_example", "weighted_sum"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_casts_to_variables", False):
                setattr(cls, name, _casting(method))

    def unsupported(self, layer: keras.layers.Layer) -> str | None:
        """Why this rule cannot handle ``layer`` (e.g. LoRA enabled), or None."""
        return None

    def variables(self, layer: keras.layers.Layer) -> list:
        """The variables the rule returns gradients for, in its output order."""
        return list(layer.trainable_variables)

    def forward(self, layer, call, args: tuple, kwargs: dict) -> tuple[Any, Any, list]:
        """Runs the layer; returns ``(outputs, saved, taps)``.

        ``call`` is the layer's original ``call``; ``args``/``kwargs`` are what
        Keras passed to it (inputs already autocast).

        ``outputs`` must be what ``call`` returns, bit for bit: the model
        computes exactly what it computes unwatched (a rule that recomputes
        a layer differently can move a ReLU or max-pool kink, and change one
        example's gradients by far more than rounding). Calling ``call``
        (``rules.conv.pre_activation`` splits off a fused activation) gives
        that by construction.

        ``taps`` are float tensors of the forward pass with a leading batch
        axis. Whatever a subclass returns goes through ``separate_taps``
        (module docstring): a tap that is an output receives only the
        gradient from outside the layer; one that is not receives the whole
        gradient at that tensor.
        """
        raise NotImplementedError

    def per_example(self, layer, saved, grads: Sequence[tf.Tensor]) -> list:
        """Per-example gradients, list of ``[B, *var.shape]`` aligned with ``variables``.

        ``grads[j]`` is the loss gradient at ``taps[j]``, same shape. A table
        whose per-example gradients are a few of its rows may return a
        ``PerExampleSlices`` (the engine densifies it unless
        ``sparse_embeddings=True`` asked for the rows).
        """
        raise NotImplementedError

    # -- optional: closed forms that never build [B, *var.shape] --------------

    def squared_norms(self, layer, saved, grads, cache: dict | None = None) -> list[tf.Tensor]:
        """``||grad_i||^2`` per variable: list of ``[B]``, float32 or float64.

        The engine adds them in float64 (``engines.layerwise.norms_of``), so
        a rule may return float64 values beyond float32's range (the squared
        norm of a gradient with entries above about 1.8e19). The built-in
        rules return float64: float32's values wherever they are finite,
        else recomputed in float64 (``per_example_grads._core.example_ops.widened``).

        ``cache`` is a dict the engine passes when a ``weighted_sum`` on the
        same call follows (a clipped sum), else None: a rule may leave in it
        what that sum can reuse. By default the norms come from
        ``per_example``, whose tensors are cached when they hold no more
        elements per example than ``saved`` and ``grads``: the clipped sum
        then reads them, and ``saved`` and ``grads`` can be freed before every
        norm is known.
        """
        per_example = self.per_example(layer, saved, grads)
        if cache is not None:
            size, inputs_size = _elements_per_example(per_example), _elements_per_example([saved, grads])
            if size is not None and inputs_size is not None and size <= inputs_size:
                cache["per_example"] = per_example
        return _widened_norms(per_example)

    def weighted_sum(self, layer, saved, grads, weights: tf.Tensor, cache: dict | None = None) -> list:
        """``sum_i weights[i] * grad_i`` per variable: list of ``[*var.shape]``.

        A rule may return a ``tf.IndexedSlices`` of dense shape ``var.shape``
        for a variable whose gradient is sparse (an embedding table).

        Args:
          weights: ``[B]``.
          cache: what ``squared_norms`` left for this call, or None.
        """
        per_example = (cache or {}).get("per_example") or self.per_example(layer, saved, grads)
        return [
            t.scale(weights).sum_examples() if isinstance(t, PerExampleSlices) else weighted_example_sum(weights, t)
            for t in per_example
        ]

    def shared_squared_norms(self, layer, calls: Sequence[tuple[Any, Sequence[tf.Tensor]]]) -> list[tf.Tensor]:
        """``||sum_k grad_i^(k)||^2`` per variable for a layer called several times: list of ``[B]``.

        ``calls`` holds ``(saved, grads)`` of each call, in call order. The
        calls' gradients add up before the square, so the norm has cross terms
        between calls. By default each call's ``per_example`` is built and
        summed (this layer only; rows of a table stay rows when every call
        gives rows); a rule whose calls have a closed form for the cross terms
        (a tied embedding: lookup and output projection) overrides this.
        """
        total = None
        for saved, grads in calls:
            pe = self.per_example(layer, saved, grads)
            if total is None:
                total = list(pe)
                continue
            total = [
                a.concat(b)
                if isinstance(a, PerExampleSlices) and isinstance(b, PerExampleSlices)
                else tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
                for a, b in zip(total, pe)
            ]
        return _widened_norms(total)

    def for_layer(self, layer: keras.layers.Layer) -> "LayerRule":
        """The rule for this instance of the registered class: ``self`` by default.

        A rule may hand a variant of its layer to another rule (a LoRA-enabled
        Dense to the LoRA rule), so the registry keeps one rule per class.
        """
        return self

    def outer_factors(self, layer, saved, grads) -> list | None:
        """Optional, for the engine's moments and features: per variable ``(A, G)`` with ``grad_n = A_n^T G_n``.

        ``A`` ``[B, i]`` and ``G`` ``[B, j]`` (``A`` None: ``grad_n = G_n``, a
        bias). Means, variances, norms and dot products of such gradients
        need only ``A`` and ``G`` (``engines.moments``, which the diagnostics
        use). None (the default): the gradients have no such form, and the
        engine materializes this layer's.
        """
        return None


def separate_taps(outputs: Any, taps: Sequence[tf.Tensor], rule: "LayerRule | None" = None) -> tuple[Any, list]:
    """``(outputs, taps)`` with every tapped output replaced, in both, by a fresh ``tf.identity`` of itself.

    The identities are consumed by nothing inside the layer, so the gradient
    at such a tap is what the output receives from outside it (module
    docstring); values are unchanged, bit for bit, and a Keras mask on an
    output is carried over. Taps that are not outputs are kept. Tensors are
    matched by identity (``is``): a tensor returned ``n`` times and tapped
    ``n`` times gets one identity per place (the layer-local rule taps every
    float output); tapped once, one identity for all its places, whose
    gradient is then their sum. ``outputs`` is returned as it was (the same
    object) when none of its leaves is tapped.

    ``rule`` (the rule whose ``forward`` returned them) names it in errors.

    Raises:
      ValueError: a tensor tapped more than once in any other way (its one
        gradient would reach the rule several times).
    """
    taps = list(taps)
    flat = tf.nest.flatten(outputs)
    places: dict[int, list[int]] = collections.defaultdict(list)
    for i, t in enumerate(flat):
        if tf.is_tensor(t):
            places[id(t)].append(i)
    tapped: dict[int, list[int]] = collections.defaultdict(list)
    for j, t in enumerate(taps):
        tapped[id(t)].append(j)
    new_flat, new_taps = list(flat), list(taps)
    for key, at_taps in tapped.items():
        at_outputs = places.get(key, [])
        if len(at_taps) == len(at_outputs):
            pairs = [([i], [j]) for i, j in zip(at_outputs, at_taps)]
        elif len(at_taps) == 1:
            pairs = [(at_outputs, at_taps)]
        else:
            name = type(rule).__name__ if rule is not None else "a rule"
            raise ValueError(
                f"{name}.forward returned one tensor {len(at_taps)} times in taps but {len(at_outputs)} times "
                "in outputs: taps must be distinct tensors (the gradient at a tensor reaches each of its taps whole)."
            )
        for output_places, tap_places in pairs:
            if not output_places:
                continue  # not an output: an inner tensor, tapped once
            fresh = _fresh_identity(taps[tap_places[0]])
            for i in output_places:
                new_flat[i] = fresh
            for j in tap_places:
                new_taps[j] = fresh
    if all(a is b for a, b in zip(new_flat, flat)):
        return outputs, new_taps
    return tf.nest.pack_sequence_as(outputs, new_flat), new_taps


def _fresh_identity(t: tf.Tensor) -> tf.Tensor:
    """``tf.identity(t)`` with ``t``'s Keras mask, if any (a layer's call may set one: ``ReversibleEmbedding``)."""
    fresh = tf.identity(t)
    mask = getattr(t, "_keras_mask", None)
    if mask is not None:
        fresh._keras_mask = mask
    return fresh


def _separating(forward):
    """``forward`` whose ``(outputs, saved, taps)`` go through ``separate_taps``."""

    @functools.wraps(forward)
    def wrapped(self, layer, call, args, kwargs):
        outputs, saved, taps = forward(self, layer, call, args, kwargs)
        outputs, taps = separate_taps(outputs, taps, self)
        return outputs, saved, taps

    wrapped._separates_taps = True
    return wrapped


def in_variable_dtypes(values: Sequence, variables: Sequence) -> list:
    """``values`` with each dense tensor cast to its variable's dtype (a no-op where it has it already).

    What every rule's ``per_example`` and ``weighted_sum`` return passes
    through this (``LayerRule.__init_subclass__``), so a rule computes in its
    compute dtype (``example_ops.compute_dtype``) and returns that.
    ``PerExampleSlices`` and ``tf.IndexedSlices`` are returned as they are.
    """
    values, variables = list(values), list(variables)
    if len(values) != len(variables):
        return values  # not aligned with the variables: the engine reports the mismatch
    return [
        tf.cast(t, v.dtype) if isinstance(t, tf.Tensor) and t.dtype != v.dtype else t for t, v in zip(values, variables)
    ]


def _casting(method):
    """``method`` (``per_example`` or ``weighted_sum``) whose outputs go through ``in_variable_dtypes``."""

    @functools.wraps(method)
    def wrapped(self, layer, *args, **kwargs):
        variables = kwargs.get("variables")  # LocalRule.per_example's override of self.variables(layer)
        return in_variable_dtypes(
            method(self, layer, *args, **kwargs), self.variables(layer) if variables is None else variables
        )

    wrapped._casts_to_variables = True
    return wrapped


RULES: dict[type | str, LayerRule] = {}


def register_layer_rule(layer_class: type | str, rule: LayerRule) -> None:
    """Teaches the layer-wise engine ``layer_class`` (and its subclasses that keep its ``call``).

    Args:
      layer_class: a ``keras.layers.Layer`` subclass, or the full name of one
        (``"keras_hub.src.layers.modeling.reversible_embedding.ReversibleEmbedding"``:
        its ``__module__`` and ``__qualname__``), which registers a rule for a
        class of an optional package without importing that package.
      rule: a ``LayerRule`` instance. A rule registered for a more specific
        class wins over one for a base class.
    """
    if isinstance(layer_class, str):
        if "." not in layer_class:
            raise TypeError(f"layer_class as a string must be a full name 'module.Class'; got {layer_class!r}.")
    elif not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"layer_class must be a keras.layers.Layer subclass or its full name; got {layer_class!r}.")
    if not isinstance(rule, LayerRule):
        raise TypeError(f"rule must be a per_example_grads.LayerRule instance; got {type(rule).__name__}.")
    RULES[layer_class] = rule


def rule_for(layer: keras.layers.Layer) -> LayerRule | None:
    """The rule registered for the most specific class in ``type(layer)``'s MRO, if it applies.

    A rule never changes what a layer computes: it is written for its class's
    ``call``, so a subclass that overrides ``call`` (KerasHub's
    ``ReversibleEmbedding``, which an ``Embedding`` rule would run as a
    lookup in both directions) gets no rule, hence the exact layer-local
    fallback, unless a rule is registered for that subclass itself.
    """
    for cls in type(layer).__mro__:
        rule = RULES.get(cls) or RULES.get(f"{cls.__module__}.{cls.__qualname__}")
        if rule is not None:
            return None if _overrides_call(type(layer), cls) else rule.for_layer(layer)
    return None


def _overrides_call(layer_class: type, rule_class: type) -> bool:
    """Whether a class from ``layer_class`` down to (not including) ``rule_class`` defines ``call``."""
    for cls in layer_class.__mro__:
        if cls is rule_class:
            return False
        if "call" in vars(cls):
            return True
    return False


def reparametrized(layer: keras.layers.Layer) -> str | None:
    """Why a closed form cannot read ``layer.kernel`` directly (LoRA, quantization), or None.

    Such layers compute their kernel from other variables; the layer-local
    fallback handles them exactly, unless the rule hands LoRA-enabled layers
    to a LoRA rule (``rules.lora_forms``, through ``LayerRule.for_layer``).
    """
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "LoRA or quantized layers use the layer-local fallback"
    return None


def sum_to_shape(g: tf.Tensor, shape) -> tf.Tensor:
    """Sums per-example ``g`` ``[B, ...]`` down to ``[B, *shape]``.

    The gradient of a broadcast: ``shape`` (a variable's shape, e.g. a bias) is
    aligned with the trailing axes of ``g``; extra leading axes are summed, and
    so are axes where ``shape`` has 1 and ``g`` does not.
    """
    shape = list(shape)
    extra = g.shape.rank - 1 - len(shape)
    if extra > 0:
        g = tf.reduce_sum(g, axis=graph_constant(list(range(1, 1 + extra))))
    keep = [i + 1 for i, d in enumerate(shape) if d == 1 and g.shape[i + 1] != 1]
    if keep:
        g = tf.reduce_sum(g, axis=graph_constant(keep), keepdims=True)
    return g


def _widened_norms(per_example: list) -> list[tf.Tensor]:
    """``[B]`` float64 squared norms of per-example gradients (``widened``); a table's rows' stay float32's.

    A ``PerExampleSlices``' norms are not recomputed: as in ``rules.embedding``,
    the float64 grouping of its rows would cost more graph than the rest.
    """
    return widened(
        [(t.squared_norms(), None) if isinstance(t, PerExampleSlices) else squares_part(t) for t in per_example]
    )


def _elements_per_example(structure) -> int | None:
    """Elements per example of the batched tensors in ``structure`` (``prod(shape[1:])``); None if unknown."""
    total = 0
    for t in tf.nest.flatten(structure):
        if tf.is_tensor(t) and t.shape.rank:
            n = t.shape[1:].num_elements()
            if n is None:
                return None
            total += n
    return total
