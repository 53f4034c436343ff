"""Finding the layers to watch, and watching them during one forward pass.

Keras 3 has no forward hooks, so capturing replaces a layer's ``call`` on the
*instance* for the duration of one forward pass (``Layer.__call__`` looks
``self.call`` up on the instance, whatever the model type: Sequential,
Functional, subclassed, or a layer called inside another layer's ``call``) and
restores it afterwards. That lookup is the one Keras behaviour this module
relies on; the capturing tests of ``tests/test_engine_interface.py`` fail loudly if it changes.

A watched layer must be called on tensors whose leading axis is the batch. One that is
not (a mixture-of-experts block flattens ``[B, T, D]`` to ``[B*T, D]`` before
its router) is handed, for that call, to the nearest enclosing layer that is
(``containers_of``, ``capturing``): that layer becomes a watch of its own with
the layer-local fallback, the exact per-example VJP of its call, in place of
every watched layer called inside it. Only where no layer below the model sees the
batch is the model refused (``check_batch_axis``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Iterator

import keras
import tensorflow as tf

from per_example_grads._core import model_inspection
from per_example_grads.rules.local import LOCAL_RULE  # the fallback rule
from per_example_grads.rules.rule import LayerRule, rule_for

# Layers that call their sublayers inside a loop or on a reshaped batch: they
# are treated as one watch (layer-local fallback) instead of being descended.
OPAQUE_LAYERS: tuple[type, ...] = (
    keras.layers.RNN,
    keras.layers.Bidirectional,
    keras.layers.TimeDistributed,
)


class NotCoverable(ValueError):
    """The layer-wise engine cannot account for every requested variable."""


@dataclasses.dataclass(frozen=True, eq=False)
class Watch:
    """A layer the engine watches, with the rule that explains its gradients.

    (Not a privacy unit, the group of rows ``engines.grouped`` clips whole.)
    """

    layer: keras.layers.Layer
    rule: LayerRule

    @property
    def variables(self) -> list:
        return self.rule.variables(self.layer)


@dataclasses.dataclass
class Record:
    """One call of a watch: what the rule saved, where it tapped the output, and its per-call cache.

    ``cache`` is what the rule's ``squared_norms`` leaves for its
    ``weighted_sum`` on this call (``LayerRule.squared_norms``).
    """

    watch: Watch
    saved: Any
    taps: list
    cache: dict = dataclasses.field(default_factory=dict)


def _role(layer, model) -> tuple[str, LayerRule | None]:
    """How the plan treats ``layer``: ``("watch", rule)``, ``("local", None)`` (the fallback), ``("root", None)``
    (the model itself, which owns no variables outside its layers) or ``("descend", None)``."""
    rule = rule_for(layer)
    if rule is not None and rule.unsupported(layer) is None:
        return "watch", rule
    if isinstance(layer, OPAQUE_LAYERS) or model_inspection.own_variables(layer) or rule is not None:
        # A registered rule that declines this instance (grouped conv,
        # LoRA...) also falls back to the exact layer-local VJP.
        return ("local", None) if layer is not model else ("root", None)
    return "descend", None


def plan_watches(model: Any, variables) -> list[Watch]:
    """The watches whose rules together cover ``variables``.

    Descends from ``model`` through layers without own variables; a layer with
    a registered rule becomes a watch, and so does (through the layer-local
    fallback rule) any other layer that owns variables or is opaque. Watches
    with none of ``variables`` are left out.

    Raises:
      NotCoverable: if ``model`` is not a Keras layer, owns variables itself, or
        some requested variable belongs to no watch.
    """
    if not isinstance(model, keras.layers.Layer):
        raise NotCoverable("the model is not a Keras layer or model")
    if model_inspection.own_variables(model) and rule_for(model) is None:
        raise NotCoverable(f"'{model.name}' owns variables itself (add_weight on the model), outside any layer")
    watches: list[Watch] = []
    seen: set[int] = set()

    def visit(layer):
        # A layer tracked by two parents (KerasHub's CausalLM and its backbone
        # both hold the token embedding) is one watch: two would record each
        # call twice, and the clipped sum would count it twice.
        if id(layer) in seen:
            return
        seen.add(id(layer))
        role, rule = _role(layer, model)
        if role == "watch":
            watches.append(Watch(layer, rule))
        elif role == "local":
            watches.append(Watch(layer, LOCAL_RULE))
        elif role == "descend":
            for sub in model_inspection.direct_sublayers(layer):
                if sub.weights:
                    visit(sub)

    visit(model)
    covered = {id(v) for u in watches for v in u.variables}
    missing = [v for v in variables if id(v) not in covered]
    if missing:
        raise NotCoverable(
            f"{len(missing)} requested variable(s) belong to no watched layer "
            f"(first: {getattr(missing[0], 'path', missing[0].name)})"
        )
    # A watch none of whose variables is requested (a frozen table next to LoRA
    # layers) needs no watching: its rule's work would be thrown away.
    requested = {id(v) for v in variables}
    return [u for u in watches if any(id(v) in requested for v in u.variables)]


def containers_of(model: Any, watches: list[Watch], training: bool = False) -> list[keras.layers.Layer]:
    """The layers ``plan_watches`` descends through below ``model``: those that may take over an off-batch watched layer.

    Each one can stand in, as one layer-local watch, for the watched layers called
    inside it (``capturing``). Left out: the model itself (standing in for
    it would be a whole-model engine, not this one) and, in training mode,
    layers with active random layers inside (a per-example recomputation
    would draw other dropout masks than the forward pass did).
    """
    watched_layers = {id(u.layer) for u in watches}
    found: list = []
    seen: set[int] = set()

    def visit(layer):
        if id(layer) in seen or id(layer) in watched_layers:
            return
        seen.add(id(layer))
        if _role(layer, model)[0] != "descend":
            return
        if layer is not model and not (training and model_inspection.random_layers(layer)):
            found.append(layer)
        for sub in model_inspection.direct_sublayers(layer):
            if sub.weights:
                visit(sub)

    if isinstance(model, keras.layers.Layer):
        visit(model)
    return found


@contextlib.contextmanager
def capturing(
    watches: list[Watch], containers: list = (), batch_size: Any = None, tape: tf.GradientTape | None = None
) -> Iterator[list[Record]]:
    """Within the block, every call of a watch's layer appends a ``Record``.

    With ``tape`` (made with ``watch_accessed_variables=False``), each call
    is watched so that the tape records exactly what the gradients at the
    taps need (``_watched_call``): the gradient of the loss with respect to
    the taps is then the one a tape watching every variable gives, without
    the variables' own gradients, which no rule reads.

    With ``containers`` (``containers_of``), a container whose call made a
    record with a leading axis that is not the batch (``off_batch``: decided
    from static shapes, as ``check_batch_axis`` decides) while its own
    inputs and outputs may lead with it replaces every record made during that call with one of its own:
    the layer-local fallback's (``LOCAL_RULE``: its call's arguments, taps at
    its outputs). Its watch, one per layer, is new (``Record.watch`` names it)
    and covers the layer's trainable variables, so it takes over only calls
    whose watches' variables it holds. An off-batch record no container could
    take is left for ``check_batch_axis`` to refuse.
    """
    records: list[Record] = []
    static_b = batch_size if isinstance(batch_size, int) else None
    taken: dict[int, Watch] = {}
    # A generator: each wrapper reads layer.call after the replacements before it are in place.
    watched = itertools.chain(
        ((watch.layer, _watched_call(watch, watch.layer.call, records, tape)) for watch in watches),
        ((layer, _container_call(layer, layer.call, records, static_b, taken, tape)) for layer in containers),
    )
    with model_inspection.replaced_calls(watched):
        yield records


_BUILTIN_RULES = "per_example_grads.rules."  # the modules of the rules whose taps ``_watched_call`` knows


def _watched_call(watch: Watch, original, records: list[Record], tape: tf.GradientTape | None):
    """``watch``'s layer's call through its rule's ``forward``, recording each call; with ``tape``, watched on it.

    A tape records an operation only when one of its inputs is already
    watched, or computed by an operation it recorded; a tensor watched later
    gets no gradient through the operations that read it before. So, with
    ``tape``, the call's floating inputs are watched before the rule's
    ``forward`` runs, and its taps as soon as it returns them: a tap that is
    an output (``separate_taps``' identity, read by nothing yet) is then
    recorded wherever it is read, and one that is not (``z`` before a
    fused activation) is computed from the inputs within the call. A tap
    computed from the layer's variables alone, and read within the call by
    an operation that reads nothing else the tape records, would get no
    gradient through that read: the built-in rules that make one say so
    (``taps_from_variables``: T5's relative position bias), and for them and
    for every rule defined outside the package the layer's variables are
    watched too, as a tape watching every variable it sees read would.
    """

    def call(*args, **kwargs):
        if tape is not None:
            _watch_floats(tape, (args, kwargs))
            if getattr(watch.rule, "taps_from_variables", False) or not type(watch.rule).forward.__module__.startswith(
                _BUILTIN_RULES
            ):
                for v in [*watch.variables, *watch.layer.trainable_variables]:
                    tape.watch(v.value if isinstance(v, keras.Variable) else v)
        outputs, saved, taps = watch.rule.forward(watch.layer, original, args, kwargs)
        if tape is not None:
            tape.watch(list(taps))
        records.append(Record(watch, saved, list(taps)))
        return outputs

    return call


def _watch_floats(tape: tf.GradientTape, structure) -> None:
    """Watches the floating tensors of ``structure`` (composite tensors' components included) on ``tape``."""
    leaves = tf.nest.flatten(structure, expand_composites=True)
    floats = [t for t in leaves if isinstance(t, tf.Tensor) and (t.dtype.is_floating or t.dtype.is_complex)]
    if floats:
        tape.watch(floats)


def _container_call(
    layer, original, records: list[Record], static_b: int | None, taken: dict, tape: tf.GradientTape | None
):
    """``layer``'s call, taking over the records made inside it when one is off the batch (``capturing``).

    With ``tape``, the taps of a record it makes are watched (outputs: ``_watched_call``).
    """

    def call(*args, **kwargs):
        start = len(records)
        outputs = original(*args, **kwargs)
        inner = records[start:]
        if not any(off_batch(batch_led(r), static_b) is not None for r in inner):
            return outputs
        own = {id(v) for v in layer.trainable_variables}
        if not all(id(v) in own for r in inner for v in r.watch.variables):
            return outputs  # a watched layer called here that the layer does not hold: not its to take
        # Hand the computed outputs to the fallback's forward, which taps them as it taps any layer's.
        outputs, saved, taps = LOCAL_RULE.forward(layer, lambda *a, **k: outputs, args, kwargs)
        leaves = [t for t in tf.nest.flatten((args, kwargs)) if isinstance(t, tf.Tensor) and t.shape.rank]
        if off_batch(leaves + list(taps), static_b) is not None or not taps:
            return outputs  # the layer itself is not split along the batch either: an enclosing one may be
        watch = taken.setdefault(id(layer), Watch(layer, LOCAL_RULE))
        if tape is not None:
            tape.watch(list(taps))
        del records[start:]
        records.append(Record(watch, saved, list(taps)))
        return outputs

    return call


def batch_led(record: Record) -> list:
    """The tensors of ``record`` that must lead with the batch: its taps, unless its rule names others.

    A rule whose taps are rows of the batch flattened with another axis
    (the mixture-of-experts rule's ``[B*T, E]`` router logits and
    ``[E, B*T, M]`` expert activations, which it maps back to examples
    itself) defines ``batch_led(saved, taps)``, the tensors its mapping
    rests on (there, the block's ``[B, T, D]`` input).
    """
    own = getattr(record.watch.rule, "batch_led", None)
    return list(own(record.saved, record.taps)) if own is not None else list(record.taps)


def off_batch(tensors, static_b: int | None) -> int | None:
    """The first static leading size among ``tensors`` that is not the batch ``static_b`` (None: all may be).

    With ``B`` dynamic (``static_b`` None) any static leading size counts
    (a constant, such as positions ``arange(T)[None]``, is not the batch).
    """
    for t in tensors:
        lead = t.shape[0] if t.shape.rank else None
        if lead is not None and (static_b is None or lead != static_b):
            return lead
    return None


def _leading_sizes(tensors: list) -> tf.Tensor:
    """``[n]`` int32: each tensor's leading size at run time.

    With every rank static, one ``Shape`` per tensor and one gather from
    their concatenation (slicing each shape took four nodes more per tensor).
    """
    ranks = [t.shape.rank for t in tensors]
    if not all(ranks):
        return tf.stack([tf.shape(t, out_type=tf.int32)[0] for t in tensors])
    starts = list(itertools.accumulate([0] + ranks[:-1]))
    return tf.gather(tf.concat([tf.shape(t, out_type=tf.int32) for t in tensors], 0), starts)


def check_batch_axis(records: list[Record], batch_size) -> None:
    """Checks each tap's leading axis is the batch (``batch_led``); a layer fed something else cannot be split per example.

    Decided while tracing when shapes allow (``NotCoverable``, so ``auto``
    moves to another engine): a static leading size that differs from a static
    ``B``, or any static leading size when ``B`` is dynamic (a constant, such as
    positions ``arange(T)[None]``, is not the batch). Otherwise asserted at run
    time.
    """
    static_b = batch_size if isinstance(batch_size, int) else None
    checked, names = [], []
    for r in records:
        led = batch_led(r)
        lead = off_batch(led, static_b)
        if lead is not None:
            raise NotCoverable(
                f"layer '{r.watch.layer.name}' was called on a tensor whose leading axis "
                f"({lead}) is not the batch, and no layer enclosing it below the model is"
            )
        for t in led:
            if static_b is None or not t.shape.rank or t.shape[0] != static_b:  # static_b itself: nothing to check
                checked.append(t)
                names.append(r.watch.layer.name)
    if not checked:
        return
    # One assertion for every tap (one per tap made each tap's check cost more graph nodes than its rule's
    # sums); its message names the first layer whose input was not split along the batch.
    matches = tf.equal(_leading_sizes(checked), tf.cast(batch_size, tf.int32))
    first = tf.argmin(tf.cast(matches, tf.int32))
    tf.debugging.Assert(
        tf.reduce_all(matches),
        [
            "the layer-wise engine cannot use layer",
            tf.gather(tf.constant(names), first),
            ": it was called on a tensor whose leading axis is not the batch",
        ],
    )
