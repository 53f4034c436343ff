"""The layer-wise engine: one forward pass, one backward pass, rules per layer.

``capture`` runs the model once with every watched layer's ``call`` watched, then takes
one gradient of the summed (weighted) loss with respect to all taps. The rest
of this module turns the captured ``(saved, g)`` pairs into per-example
gradients, per-example squared norms, or weighted sums over examples.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from per_example_grads import rules as _builtin_rules  # noqa: F401  (registers the rules)
from per_example_grads import transforms
from per_example_grads._core import model_inspection
from per_example_grads._core.batch import Batch, batch_size, branch_zeros
from per_example_grads._core.example_ops import WIDE, compute_dtype, graph_constant
from per_example_grads._core.problem import Problem
from per_example_grads.engines.base import ENGINES, ClipGroups, Engine, FiniteSums, finite_examples
from per_example_grads.engines.capture import (
    NotCoverable,
    Record,
    Watch,
    capturing,
    check_batch_axis,
    containers_of,
    plan_watches,
)
from per_example_grads.engines.moments import GradientFeatures, assemble, factored_moments, materialized_moments
from per_example_grads.errors import EngineError
from per_example_grads.per_example_slices import PerExampleSlices
from per_example_grads.rules.local import LocalRule
from per_example_grads.rules.rule import LayerRule


@dataclasses.dataclass
class Captured:
    """What one forward+backward pass left: records and the gradient at each tap."""

    watches: list[Watch]
    records: list[Record]
    grads: list[list[tf.Tensor]]  # grads[r][j]: loss gradient at records[r].taps[j]
    batch_size: tf.Tensor | int
    predictions: Any = None  # the model's outputs in the forward pass

    def by_watch(self) -> dict[Watch, list[tuple[Record, list]]]:
        out: dict[Watch, list] = {u: [] for u in self.watches}
        for r, g in zip(self.records, self.grads):
            out[r.watch].append((r, g))
        return out


def watches_of(problem: Problem) -> list[Watch]:
    """The watch plan of ``problem`` (raises ``NotCoverable``), worked out once per call."""
    if "layerwise_watches" not in problem.cache:
        try:
            problem.cache["layerwise_watches"] = plan_watches(problem.model, problem.variables)
        except NotCoverable as err:
            problem.cache["layerwise_watches"] = err
    plan = problem.cache["layerwise_watches"]
    if isinstance(plan, NotCoverable):
        raise plan
    return plan


def why_not(problem: Problem) -> str | None:
    """Why the layer-wise engine cannot cover ``problem``, or None.

    In training mode, a layer on the layer-local fallback with a random layer
    inside (Dropout) cannot be covered: the fallback recomputes it one
    example at a time, which would draw other random values than the forward
    pass did, so its per-example gradients would belong to another step.
    """
    try:
        watches = watches_of(problem)
    except NotCoverable as err:
        return str(err)
    if problem.training:
        for watch in watches:
            random = model_inspection.random_layers(watch.layer) if isinstance(watch.rule, LocalRule) else []
            if random:
                return (
                    f"the layer-local fallback recomputes {watch.layer.name!r} ({type(watch.layer).__name__}) one "
                    f"example at a time, and {model_inspection.describe(random)} inside it draws random values in "
                    "training mode, which the recomputation would draw anew (its per-example gradients would not "
                    "be the forward pass's); use training=False, a rate of 0, or another engine (method='vectorized')"
                )
    return None


def use_layerwise(method: str, problem: Problem) -> bool:
    """Whether ``method`` means the layer-wise engine for this problem.

    True for ``"layerwise"`` (raising ``EngineError`` with the reason if it
    cannot cover the model) and for ``"auto"`` when it can. Deprecated: the
    diagnostics ask the engine interface (``Engine.moments``,
    ``Engine.features``) through ``selection.run`` instead.
    """
    if method not in ("auto", "layerwise"):
        return False
    reason = why_not(problem)
    if reason and method == "layerwise":
        raise EngineError(f"method='layerwise' cannot run on this model: {reason}.")
    return reason is None


def containers(problem: Problem) -> list:
    """The layers that may stand in for watched layers called off the batch inside them (``capture.containers_of``), once per call."""
    if "layerwise_containers" not in problem.cache:
        problem.cache["layerwise_containers"] = containers_of(problem.model, watches_of(problem), problem.training)
    return problem.cache["layerwise_containers"]


def capture(problem: Problem, batch: Batch) -> Captured:
    """One forward and one backward pass with every watched layer watched.

    A watched layer called on something whose leading axis is not the batch is
    replaced, for that call, by the nearest enclosing layer that is, as a
    layer-local watch (``capture.capturing``); such watches join the plan's
    (``Captured.watches``), each where the first watch it replaced stood.

    Raises:
      NotCoverable: a watched layer is called off the batch and no enclosing layer
        below the model can take it (``check_batch_axis``), or a layer that
        took over holds variables that watched layers called outside it also
        compute.
    """
    watches = watches_of(problem)
    b = batch_size(batch)
    # Only what the taps' gradients need is watched (``capture.capturing``): a tape that watched every
    # variable read would also differentiate the loss with respect to each variable, for nothing.
    with tf.GradientTape(persistent=False, watch_accessed_variables=False) as tape:
        with capturing(watches, containers(problem), b, tape) as records:
            predictions, losses = problem.predictions_and_losses(batch)
        total = tf.reduce_sum(tf.cast(losses, tf.float32))
    flat_taps = [t for r in records for t in r.taps]
    flat_grads = tape.gradient(total, flat_taps) if flat_taps else []
    grads, i = [], 0
    for r in records:
        n = len(r.taps)
        grads.append([tf.zeros_like(t) if g is None else g for g, t in zip(flat_grads[i : i + n], r.taps)])
        i += n
    check_batch_axis(records, b)
    return Captured(_with_stand_ins(watches, records), records, grads, b, predictions)


def _with_stand_ins(watches: list[Watch], records: list[Record]) -> list[Watch]:
    """``watches`` and the layers that stood in for some of them (``capture``), each before the first it replaced.

    Raises ``NotCoverable`` when a stand-in's variables are also those of a
    watch that kept records (a layer shared between its inside and outside):
    the two would compute the same variable's gradients separately.
    """
    plan = {id(u) for u in watches}
    stand_ins = [u for u in dict.fromkeys(r.watch for r in records) if id(u) not in plan]
    if not stand_ins:
        return watches
    recorded = {id(r.watch) for r in records}
    kept = [u for u in watches if id(u) in recorded]
    for s in stand_ins:
        held = {id(v) for v in s.variables}
        clash = [u for u in kept + [o for o in stand_ins if o is not s] if any(id(v) in held for v in u.variables)]
        if clash:
            raise NotCoverable(
                f"layer '{s.layer.name}' stands in for the layers called off the batch inside it, but "
                f"'{clash[0].layer.name}', whose variables it holds, is also called outside it"
            )
    held_by = {id(v): s for s in stand_ins for v in s.variables}
    out: list[Watch] = []
    for u in watches:
        s = next((held_by[id(v)] for v in u.variables if id(v) in held_by), None)
        if s is not None and s not in out:
            out.append(s)
        out.append(u)
    out.extend(s for s in stand_ins if s not in out)
    return out


def watch_per_example(watch: Watch, calls: list, sparse: bool = False) -> list:
    """``[B, *var.shape]`` per variable of ``watch``, summed over its calls.

    A rule's ``PerExampleSlices`` (an embedding table's rows) is made dense
    unless ``sparse``.
    """
    total = None
    for record, g in calls:
        pe = watch.rule.per_example(watch.layer, record.saved, g)
        if not sparse:
            pe = [tf.convert_to_tensor(t) if isinstance(t, PerExampleSlices) else t for t in pe]
        total = pe if total is None else [add_per_example(a, b) for a, b in zip(total, pe)]
    return total


def add_per_example(a, b):
    """``a + b`` for per-example gradients, dense or ``PerExampleSlices`` (two slices stay slices)."""
    if isinstance(a, PerExampleSlices) and isinstance(b, PerExampleSlices):
        return a.concat(b)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


CHAIN_WINDOW = 3  # how many watches' norms may run at once (per_variable_squared_norms)


def per_variable_squared_norms(problem: Problem, captured: Captured, for_sums: bool = False) -> list[tf.Tensor]:
    """``[B]`` float64 squared norms aligned with ``problem.variables`` (zeros if unreached).

    Float64, because a squared norm leaves float32's range long before the
    norm does (a gradient entry of 1.8e19 squares to inf): the rules' values
    (``LayerRule.squared_norms``), float32 ones cast. ``norms_of`` turns them
    into norms.

    Watches are processed last layer first, the order in which the backward
    pass produces their gradients, so the norms of the last layers overlap
    with the backward pass of the first. Control dependencies bound how many
    run at once: a watch's norms wait for those of the watch ``CHAIN_WINDOW``
    places before it, and a watch whose norms build its per-example gradients
    (the rules' defaults: the layer-local fallback) also for the previous
    such watch, so at most one of those tensors exists at a time. Too small a
    window lets the norms lag behind the backward pass and hold its
    tensors; none lets the layer-local fallback's tensors pile up (peak
    memory of each choice: ``benchmarks/RESULTS.md``).

    Args:
      for_sums: a clipped sum follows: each call's rule gets its record's
        ``cache`` to leave what the sum can reuse.
    """
    found: dict[int, tf.Tensor] = {}
    done: list = []  # each watch's norms, in processing order
    materialized: list = []  # the last watch's norms that built per-example gradients
    for watch, calls in reversed(list(captured.by_watch().items())):
        if not calls:
            continue
        shared = len(calls) > 1
        materializes = _default(watch.rule, "shared_squared_norms" if shared else "squared_norms")
        waits_for = done[-CHAIN_WINDOW] if len(done) >= CHAIN_WINDOW else []
        with tf.control_dependencies(list(waits_for) + (materialized if materializes else [])):
            if not shared:
                record, g = calls[0]
                norms = watch.rule.squared_norms(watch.layer, record.saved, g, record.cache if for_sums else None)
            else:
                # A shared layer's norm has cross terms between its calls: the rule's
                # closed form, or by default its per-example gradient (this layer only).
                norms = watch.rule.shared_squared_norms(watch.layer, [(record.saved, g) for record, g in calls])
        done.append(norms)
        if materializes:
            materialized = list(norms)
        for v, n in zip(watch.variables, norms):
            found[id(v)] = tf.cast(n, WIDE)
    return [found[id(v)] if id(v) in found else tf.zeros([captured.batch_size], WIDE) for v in problem.variables]


def norms_of(squared: list[tf.Tensor], dtype) -> tf.Tensor:
    """``[B]`` ``sqrt(sum(squared))`` in ``dtype`` (the norms' dtype) from float64 squared norms.

    Where the sum in ``dtype`` is finite it is the one taken, so such norms
    are the ones float32 arithmetic always gave (casting the rules' float32
    values to float64 and back is exact); the other examples' norms are
    summed and rooted in float64, then cast: finite wherever the norm fits
    in ``dtype``.
    """
    narrow = tf.add_n([tf.cast(s, dtype) for s in squared])
    if narrow.dtype == WIDE:
        return tf.sqrt(narrow)
    return tf.where(tf.math.is_finite(narrow), tf.sqrt(narrow), tf.cast(tf.sqrt(tf.add_n(squared)), dtype))


def norm_dtype(problem: Problem) -> tf.DType:
    """The dtype of the norms the engine returns: float64 for a model with float64 variables, else float32."""
    return WIDE if any(compute_dtype(v.dtype) == WIDE for v in problem.variables) else tf.float32


def _default(rule: LayerRule, method: str) -> bool:
    """Whether ``rule`` inherits ``LayerRule``'s ``method`` (which builds per-example gradients)."""
    return getattr(type(rule), method) is getattr(LayerRule, method)


def weighted_sums(problem: Problem, captured: Captured, weights_for, rule_sum=None) -> list[tf.Tensor]:
    """``sum_i w_i grad_i`` per variable, ``[*var.shape]``, aligned with ``problem.variables``.

    Embedding tables' sums are ``tf.IndexedSlices`` (see ``rules.embedding``).

    Args:
      weights_for: ``variable -> [B]`` weights (the same tensor object for
        variables clipped together; each distinct one costs one rule call).
      rule_sum: ``(watch, record, g, w) -> the rule's sums`` for one call, in
        place of its ``weighted_sum`` on the record's tensors and cache.
    """
    rule_sum = rule_sum or _rule_sum
    requested = {id(v) for v in problem.variables}
    sums: dict[int, tf.Tensor] = {}
    for watch, calls in captured.by_watch().items():
        wanted = [v for v in watch.variables if id(v) in requested]
        distinct = {id(weights_for(v)): weights_for(v) for v in wanted}
        for w in distinct.values():
            for record, g in calls:
                outputs = rule_sum(watch, record, g, w)
                for v, s in zip(watch.variables, outputs):
                    if id(v) in requested and weights_for(v) is w:
                        sums[id(v)] = s if id(v) not in sums else add_sums(sums[id(v)], s)
    return [sums[id(v)] if id(v) in sums else tf.zeros(v.shape, v.dtype) for v in problem.variables]


def _rule_sum(watch: Watch, record: Record, g: list, w: tf.Tensor) -> list:
    return watch.rule.weighted_sum(watch.layer, record.saved, g, w, record.cache)


def add_sums(a, b):
    """``a + b`` for tensors or ``tf.IndexedSlices`` (two slices stay slices: rows concatenated)."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def per_example_gradients(problem: Problem, batch: Batch, sparse: bool = False) -> list:
    """Per-example gradients from closed forms per layer: list of ``[B, *var.shape]``.

    With ``sparse``, embedding tables' entries are ``PerExampleSlices``.
    """
    captured = capture(problem, batch)
    found: dict[int, tf.Tensor] = {}
    for watch, calls in captured.by_watch().items():
        if calls:
            for v, t in zip(watch.variables, watch_per_example(watch, calls, sparse)):
                found[id(v)] = t
    b = captured.batch_size
    return [
        found[id(v)] if id(v) in found else tf.zeros(tf.concat([[b], tf.constant(v.shape, tf.int32)], 0), v.dtype)
        for v in problem.variables
    ]


def squared_norms(problem: Problem, batch: Batch) -> list[tf.Tensor]:
    """``[B]`` float64 squared norms per variable from closed forms per layer, never ``B x P``."""
    return per_variable_squared_norms(problem, capture(problem, batch))


def example_norms(problem: Problem, batch: Batch, by_variable: bool = False):
    """``[B]`` global norms, or a list of ``[B]`` per variable, in ``norm_dtype(problem)`` (``norms_of``)."""
    squared, dtype = squared_norms(problem, batch), norm_dtype(problem)
    return [norms_of([s], dtype) for s in squared] if by_variable else norms_of(squared, dtype)


def clipped_sums(problem: Problem, batch: Batch, clip: ClipGroups) -> tuple[list, list, Any]:
    """``sum_i c_i grad_i`` per variable, ``[B]`` norms per group and the predictions, in one forward and one backward pass."""
    captured = capture(problem, batch)
    squared, dtype = per_variable_squared_norms(problem, captured, for_sums=True), norm_dtype(problem)
    norms = [norms_of([squared[i] for i in idx], dtype) for idx in clip.groups]
    factors = [transforms.clip_factors(n, c) for n, c in zip(norms, clip.clips)]
    group_of = {id(problem.variables[i]): g for g, idx in enumerate(clip.groups) for i in idx}
    weights_for = lambda v: factors[group_of[id(v)]]  # noqa: E731
    if not tf.executing_eagerly() and _cleanable(problem, captured, batch):
        return FiniteSums(_finite_sums(problem, captured, norms, weights_for)), norms, captured.predictions
    return weighted_sums(problem, captured, weights_for), norms, captured.predictions


def _cleanable(problem: Problem, captured: Captured, batch: Batch) -> bool:
    """Whether ``_finite_sums`` can clean ``captured`` exactly (decided while tracing).

    It can when ``B`` is not a static 0, no layer couples examples, no rule maps its
    taps to examples itself (``capture.batch_led``), every tap's gradient
    leads with ``B``, and every saved floating tensor that depends on the
    batch's tensors leads with ``B`` (one that does not, a table or a shared
    mask, is the same for every example and is left as it is; integer and
    bool tensors, ids and masks, are finite and are left as they are).
    """
    b = captured.batch_size
    if isinstance(b, int) and b < 1:
        return False
    if problem.batch_coupling:
        return False
    sources = _batch_sources(batch)
    if sources is None:
        return False
    depends: dict = {}
    for record, grads in zip(captured.records, captured.grads):
        if getattr(record.watch.rule, "batch_led", None) is not None:
            return False
        if any(not _leads_with(g, b) for g in grads):
            return False
        for t in tf.nest.flatten(record.saved, expand_composites=True):
            if _floating(t) and _depends_on(t, sources, depends) and not _leads_with(t, b):
                return False
    return True


def _floating(t) -> bool:
    return isinstance(t, tf.Tensor) and (t.dtype.is_floating or t.dtype.is_complex)


def _leads_with(t, b) -> bool:
    """Whether ``t``'s leading size can be ``B`` by its static shape: ``B`` itself, or unknown when ``B`` is."""
    if not isinstance(t, tf.Tensor) or not t.shape.rank:
        return False
    return t.shape[0] == b if isinstance(b, int) else t.shape[0] is None


def _batch_sources(batch: Batch) -> set | None:
    """Names of the batch's tensors as the current function graph sees them, or None when not in a function graph.

    A tensor of ``batch`` made outside this graph (the batch is checked before
    ``unless_empty``'s ``tf.cond`` branch that runs the pass) is seen through
    the placeholder that captures it.
    """
    graph = tf.compat.v1.get_default_graph()
    captures = getattr(graph, "captures", None)
    if captures is None:
        return None
    leaves = {t.ref() for t in tf.nest.flatten(batch) if isinstance(t, tf.Tensor)}
    inside = {internal.name for external, internal in captures if external.ref() in leaves}
    return inside | {t.deref().name for t in leaves if t.deref().graph is graph}


def _depends_on(t: tf.Tensor, sources: set, memo: dict) -> bool:
    """Whether ``t`` is computed from a graph input named in ``sources`` (a post-order walk of its ops, memoized by op name)."""
    stack = [(t.op, False)]
    while stack:
        op, expanded = stack.pop()
        if expanded:
            memo[op.name] = any(x.name in sources for x in op.outputs) or any(memo[x.op.name] for x in op.inputs)
            continue
        if op.name in memo:
            continue
        memo[op.name] = None  # being visited
        stack.append((op, True))
        stack.extend((x.op, False) for x in op.inputs if x.op.name not in memo)
    return bool(memo[t.op.name])


def _finite_sums(problem: Problem, captured: Captured, norms: list, weights_for) -> list:
    """``weighted_sums`` over the examples whose norms are all finite. Requires ``_cleanable``.

    Such an example's weight is already 0 (``transforms.clip_factors``), but
    its gradient may hold NaN or Inf, and ``0 * inf`` is NaN. So the rules
    sum tensors that a ``tf.cond`` on "every norm is finite" chooses
    (``_Choice``): the captured ones as they are, or with each non-finite
    example's rows replaced. When every norm is finite the conds pass their
    inputs through, and the sums are the ones taken on the captured tensors.
    What replaces the rows depends on the record:

    - The package's own norms left per-example tensors in its cache
      (``_zeroable_cache``): their rows are zeroed. The sum from such a
      cache is ``sum_n w_n K_n``, linear in each example's rows, so zeroed
      rows add exactly zero, and nothing of the per-example computation is
      traced again. If the rule's sum reads the record's saved tensors or
      tap gradients too, those are chosen as below and the rule sums again
      (the first sum is left unused).
    - No cache: its tap gradients' rows are zeroed and its saved floating
      tensors that lead with the batch get a finite example's rows. Each
      rule's per-example gradient is linear in its tap gradients, and its
      other operands are a finite example's, so the replaced rows add
      exactly zero and the other examples' terms are unchanged.
    - A cache of another kind (a rule's own): its sum from the cache, or,
      in a ``tf.cond`` branch taken only when some norm is not finite, its
      sum without the cache from tensors replaced as for no cache.

    With no finite example there is no finite row to give, and the sums
    that some record given rows adds to are zeros (one more ``tf.cond``).
    """
    finite = finite_examples(norms)
    every, b = tf.reduce_all(finite), captured.batch_size
    zeroable = {id(r) for r in captured.records if _zeroable_cache(r, b)}
    chosen = _Choice(every, finite, b)
    for r, g in zip(captured.records, captured.grads):
        if id(r) in zeroable:
            chosen.zero(r.cache)
        elif not r.cache:
            chosen.zero(g)
            chosen.give(r.saved)
    chosen.choose()
    graph = tf.compat.v1.get_default_graph()
    # The variables whose sums some record given a finite example's rows adds to.
    given = {id(v) for r in captured.records if not r.cache for v in r.watch.variables}
    again: dict = {}  # id(record) -> its own _Choice of (saved, tap gradients): its cached sum read them

    def rule_sum(watch, record, g, w):
        rule, key = watch.rule, id(record)
        if key in zeroable:
            cache = chosen.of(record.cache)
            if key not in again:
                start = len(graph.get_operations())
                out = rule.weighted_sum(watch.layer, record.saved, g, w, cache)
                if not _reads(graph, start, [record.saved, g]):
                    return out
                again[key] = _Choice(every, finite, b).zero(g).give(record.saved).choose()
                given.update(id(v) for v in watch.variables)
            return rule.weighted_sum(watch.layer, again[key].of(record.saved), again[key].of(g), w, cache)
        if not record.cache:
            return rule.weighted_sum(watch.layer, chosen.of(record.saved), chosen.of(g), w)
        given.update(id(v) for v in watch.variables)
        first = rule.weighted_sum(watch.layer, record.saved, g, w, record.cache)

        def without_cache():
            rows = _RowReplacement(finite, b)
            saved = tf.nest.map_structure(rows.given, record.saved, expand_composites=True)
            return tf.nest.flatten(
                rule.weighted_sum(watch.layer, saved, [rows.zeroed(t) for t in g], w), expand_composites=True
            )

        flat = tf.nest.flatten(first, expand_composites=True)
        return tf.nest.pack_sequence_as(first, tf.cond(every, lambda: flat, without_cache), expand_composites=True)

    sums = weighted_sums(problem, captured, weights_for, rule_sum)
    at = [i for i, v in enumerate(problem.variables) if id(v) in given]
    if at:
        picked = [sums[i] for i in at]
        flat = tf.nest.flatten(picked, expand_composites=True)
        some = tf.reduce_any(finite)
        zeros = lambda: tf.nest.flatten(_zeroed_sums(picked, some), expand_composites=True)  # noqa: E731
        out = tf.cond(some, lambda: flat, zeros)
        for i, s in zip(at, tf.nest.pack_sequence_as(picked, out, expand_composites=True)):
            sums[i] = s
    return sums


def _zeroed_sums(sums: list, off: tf.Tensor) -> list:
    """Zeros like each sum (a ``tf.IndexedSlices``' values), in a branch run only where ``off`` is False (``branch_zeros``).

    ``off`` is cast once per dtype and fills them all (``branch_zeros`` casts
    nothing more): one cast per sum was one more graph node per variable.
    """
    fills: dict = {}

    def zeros(t):
        if t.dtype not in fills:
            fills[t.dtype] = tf.cast(off, t.dtype)
        shape = graph_constant(t.shape.as_list()) if t.shape.is_fully_defined() else tf.shape(t)
        return branch_zeros(shape, t.dtype, fills[t.dtype])

    return [
        tf.IndexedSlices(zeros(s.values), s.indices, s.dense_shape) if isinstance(s, tf.IndexedSlices) else zeros(s)
        for s in sums
    ]


class _Choice:
    """``[B, ...]`` tensors passed through one ``tf.cond``: as they are when ``every`` norm is finite, else with the rows of the examples not ``finite`` replaced (``_RowReplacement``).

    ``zero`` and ``give`` name the tensors whose rows are zeroed or given a
    finite example's (a saved tensor's floating leaves that lead with ``B``;
    the others are left as they are); ``choose`` builds the cond; ``of``
    maps a structure of named tensors to the chosen ones.
    """

    def __init__(self, every: tf.Tensor, finite: tf.Tensor, b):
        self._every, self._finite, self._b = every, finite, b
        self._named: dict = {}  # (ref, zeroed?) -> tensor, in order
        self._chosen: dict = {}  # the same keys -> chosen tensor

    def _name(self, structure, zeroed: bool):
        for t in tf.nest.flatten(structure, expand_composites=True):
            if isinstance(t, tf.Tensor) and (zeroed or _floating(t) and _leads_with(t, self._b)):
                self._named.setdefault((t.ref(), zeroed), t)
        return self

    def zero(self, structure) -> _Choice:
        return self._name(structure, True)

    def give(self, structure) -> _Choice:
        return self._name(structure, False)

    def choose(self) -> _Choice:
        keys, tensors = list(self._named), list(self._named.values())
        if not tensors:
            return self

        def replaced():
            rows = _RowReplacement(self._finite, self._b)
            return [rows.zeroed(t) if zeroed else rows.given(t) for (_, zeroed), t in zip(keys, tensors)]

        self._chosen = dict(zip(keys, tf.cond(self._every, lambda: tensors, replaced)))
        return self

    def of(self, structure):
        def pick(t):
            if not isinstance(t, tf.Tensor):
                return t
            return self._chosen.get((t.ref(), True), self._chosen.get((t.ref(), False), t))

        return tf.nest.map_structure(pick, structure, expand_composites=True)


class _RowReplacement:
    """Inside a ``tf.cond`` branch: ``[B, ...]`` tensors with the rows of the examples not ``finite`` replaced.

    ``zeroed``: by zeros. ``given``: by the rows of a finite example (the
    first), for a floating tensor that leads with ``B`` (others are returned
    as they are); when ``B`` is known only at run time, only where the
    tensor's leading size is ``B`` then. Masks, indices and a zero per dtype
    are built once per branch (fewer nodes to trace).
    """

    def __init__(self, finite: tf.Tensor, b):
        self._finite, self._b = finite, b
        self._keep_by_rank: dict = {}
        self._zero_of: dict = {}
        self._source = None

    def zeroed(self, t: tf.Tensor) -> tf.Tensor:
        rank = t.shape.rank
        if rank not in self._keep_by_rank:
            self._keep_by_rank[rank] = tf.reshape(self._finite, [-1] + [1] * (rank - 1))
        if t.dtype not in self._zero_of:
            self._zero_of[t.dtype] = tf.zeros([], t.dtype)
        out = tf.where(self._keep_by_rank[rank], t, self._zero_of[t.dtype])
        out.set_shape(t.shape)
        return out

    def given(self, t):
        b = self._b
        if not (_floating(t) and _leads_with(t, b)):
            return t
        if self._source is None:
            rows = tf.range(b)
            donor = tf.cast(tf.argmax(tf.cast(self._finite, tf.int32)), rows.dtype)
            self._source = tf.where(self._finite, rows, donor)
        if isinstance(b, int):
            return tf.gather(t, self._source, axis=graph_constant(0))
        # No tf.cond on the leading size (cheaper to trace): rows are replaced where it is B.
        n = tf.shape(t, out_type=self._source.dtype)[0]
        own = tf.range(n)
        out = tf.gather(t, tf.where(tf.equal(n, b), tf.gather(self._source, tf.minimum(own, b - 1)), own))
        out.set_shape(t.shape)
        return out


def _zeroable_cache(record: Record, b) -> bool:
    """Whether zeroing the rows of ``record.cache``'s tensors zeroes exactly those examples' terms of the rule's sum from it.

    True when the package's own ``squared_norms`` filled the cache (a
    rule's own may keep anything there) and every tensor in it is a
    floating per-example tensor leading with ``B``: a rule's sum from such a
    cache is linear in each example's rows (``sum_n w_n K_n``).
    """
    if not record.cache or not type(record.watch.rule).squared_norms.__module__.startswith(_RULES):
        return False
    return all(t is None or (_floating(t) and _leads_with(t, b)) for t in tf.nest.flatten(record.cache))


def _reads(graph, start: int, structures) -> bool:
    """Whether an op ``graph`` made after its first ``start`` ones reads a tensor of ``structures`` (or, if captured, its capture)."""
    inner = {outer.ref(): inside for outer, inside in graph.captures}
    read = {
        (inner[t.ref()] if t.ref() in inner else t).ref()
        for t in tf.nest.flatten(structures, expand_composites=True)
        if isinstance(t, tf.Tensor)
    }
    return bool(read) and any(x.ref() in read for op in graph.get_operations()[start:] for x in op.inputs)


_RULES = _builtin_rules.__name__ + "."  # the modules whose rules' caches hold only per-example tensors


def layerwise(problem: Problem, batch: Batch) -> list:
    """Per-example gradients from closed forms per layer: list of ``[B, *var.shape]``."""
    return per_example_gradients(problem, batch)


def _outer_factors(watch: Watch, calls: list) -> list | None:
    """The rule's ``(A, G)`` per variable of a watched layer called once, or None (``LayerRule.outer_factors``)."""
    if len(calls) != 1:
        return None
    record, g = calls[0]
    return watch.rule.outer_factors(watch.layer, record.saved, g)


def moments(problem: Problem, batch: Batch, reference: list) -> dict:
    """``Engine.moments`` from one capture: outer factors where the rule gives them, else that one watch's per-example gradients.

    Watches are chained by control dependencies, so one watch's
    ``[B, *var.shape]`` tensors exist at a time.
    """
    refs = {id(v): r for v, r in zip(problem.variables, reference)}
    captured = capture(problem, batch)
    found: dict[int, tuple] = {}
    previous: list = []
    for watch, calls in captured.by_watch().items():
        if not calls:
            continue
        with tf.control_dependencies(previous):
            factors = _outer_factors(watch, calls)
            part = {}
            if factors is not None:
                for v, (a, g) in zip(watch.variables, factors):
                    if id(v) in refs:
                        part[id(v)] = factored_moments(a, g, refs[id(v)])
            else:
                for v, pe in zip(watch.variables, watch_per_example(watch, calls)):
                    if id(v) in refs:
                        part[id(v)] = materialized_moments(pe, refs[id(v)])
        found.update(part)
        previous = [t for stats in part.values() for t in stats]
    return assemble(problem.variables, found, captured.batch_size)


def features(problem: Problem, batch: Batch) -> GradientFeatures:
    """``Engine.features``: the outer factors of every reached watch when all have them, else materialized gradients."""
    captured = capture(problem, batch)
    wanted = {id(v) for v in problem.variables}
    factors = []
    for watch, calls in captured.by_watch().items():
        if not calls or not any(id(v) in wanted for v in watch.variables):
            continue  # not requested, or the loss does not reach it (zero gradients)
        watch_factors = _outer_factors(watch, calls)
        if watch_factors is None:
            return GradientFeatures.of(per_example_gradients(problem, batch))
        factors += [
            (None if a is None else tf.cast(a, tf.float64), tf.cast(g, tf.float64))
            for v, (a, g) in zip(watch.variables, watch_factors)
            if id(v) in wanted
        ]
    return GradientFeatures(factors=factors)


def sparse_per_example_gradients(problem: Problem, batch: Batch) -> list:
    """``per_example_gradients`` with embedding tables' entries as ``PerExampleSlices``."""
    return per_example_gradients(problem, batch, sparse=True)


def slow_layers(problem: Problem) -> list:
    """The layers of the watch plan on the layer-local rule (one VJP per example): exact, slower than a closed form."""
    return [u.layer for u in watches_of(problem) if isinstance(u.rule, LocalRule)]


@dataclasses.dataclass(frozen=True)
class LayerwiseEngine(Engine):
    """The layer-wise engine; its norms are ``example_norms``' (``Engine.norms`` would return float64 norms of its float64 squared norms)."""

    def norms(self, problem: Problem, batch: Batch, by_variable: bool = False):
        return example_norms(problem, batch, by_variable)


# Its per-unit forms are ``engines.grouped``'s, which builds on this module and completes the registration.
ENGINES["layerwise"] = LayerwiseEngine(
    name="layerwise",
    compute=layerwise,
    isolates_examples=True,
    why_not=why_not,
    native_squared_norms=squared_norms,
    native_clipped_sums=clipped_sums,
    native_moments=moments,
    native_features=features,
    native_sparse_compute=sparse_per_example_gradients,
    native_slow_layers=slow_layers,
)
