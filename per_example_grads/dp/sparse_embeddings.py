"""Sparse embedding noise: a DP step that updates only the rows a noisy count selects (DP-AdaFEST).

Dense DP-SGD adds ``N(0, (sigma C)^2)`` to every entry of every embedding
table, so a private step writes the whole ``[V, D]`` table where a plain one
touches only the looked-up rows. Following Ghazi, Huang, Kamath, Kumar,
Manurangsi, Sinha and Zhang (NeurIPS 2023, "Sparsity-Preserving
Differentially Private Training of Large Embedding Models", DP-AdaFEST), a
step with ``sparse_embeddings=SparseEmbeddings(...)`` does, for the tables
``T_1..T_L`` it covers (vocabularies ``V_k``):

1. **Contributions.** Example ``n`` (a real row: sample weight non-zero)
   looks up a set ``U_n`` of distinct ``(table, id)`` pairs, over all its
   lookups of all covered tables (repeated ids count once; id 0 of a
   ``mask_zero`` table, the padding, not at all). Its contribution is the
   vector ``u_n = 1_{U_n} / sqrt(|U_n|)`` over the concatenated
   vocabularies: ``||u_n||_2 = 1`` (0 for an example with no ids), whatever
   it looks up.
2. **Selection.** ``c = sum_n u_n + N(0, sigma_sel^2 I)``; the rows ``S =
   {v : c_v >= tau}`` are selected. A row no example looked up has count
   0 and is selected with probability ``p_0 = Q(tau / sigma_sel)``; those
   rows are drawn directly (independent Bernoulli(``p_0``) positions from
   geometric gaps), so the step never touches all ``V`` rows.
3. **Gradient.** The clipped sum's rows in ``S`` get ``N(0, (sigma_grad
   C)^2)`` noise and become the table's update, a ``tf.IndexedSlices`` on
   ``S`` only; rows outside ``S`` get no update at all. Every other
   variable (dense layers, a ``ReversibleEmbedding``'s untied
   ``reverse_embeddings``) gets ``N(0, (sigma_grad C)^2)`` on every entry.

**Privacy (enforced here: the split in ``noise_multipliers``, the clip of
the contributions in ``contribution_counts``).** With ``f =
selection_share``,

    1 / sigma_sel^2 = f / sigma^2,      1 / sigma_grad^2 = (1 - f) / sigma^2,

so ``1 / sigma_sel^2 + 1 / sigma_grad^2 = 1 / sigma^2``, and one step is as
private as one DP-SGD step with noise multiplier ``sigma`` on the same
(Poisson) batch; the accountant's ledger, which records ``sigma``, is
unchanged. Proof sketch: consider the joint release ``(c, g~) = (sum_n u_n
+ Z_1, sum_n clip_C(g_n) + Z_2)`` with ``Z_1 ~ N(0, sigma_sel^2 I)`` and
``Z_2 ~ N(0, (sigma_grad C)^2 I)`` on *every* coordinate. Rescaled to unit
noise, ``(c / sigma_sel, g~ / (sigma_grad C))``, it is a Gaussian sum query
whose per-example term ``(u_n / sigma_sel, clip_C(g_n) / (sigma_grad C))``
has norm at most ``sqrt(1 / sigma_sel^2 + 1 / sigma_grad^2) = 1 / sigma``:
exactly the Gaussian mechanism of DP-SGD with multiplier ``sigma``, so with
Poisson sampling at rate ``q`` the same subsampled Gaussian and the same
epsilon. What the step outputs, ``S`` and the rows of ``g~`` in ``S`` (plus
the dense variables), is a function of ``(c, g~)``: post-processing. The
noise of coordinates not in ``S`` is never drawn (their values are never
output), and the zero-count rows' selection is drawn directly with its exact
law (``c_v = Z_1[v]`` there). Correlated mechanisms (``BandMF``, ``BLT``)
are refused: their noise mixes steps, and the selection of a step would
then see earlier steps' gradient noise in a way this argument does not
cover; adaptive clipping is refused too (it splits the gradient's budget
once more), as are privacy-audit canaries (they assume the dense release).

**Defaults.** ``selection_share = 0.5`` gives the counts and the gradient
the same budget: ``sigma_sel = sigma_grad = sqrt(2) sigma`` (41% more noise
on every dense parameter than DP-SGD's); the default threshold ``tau =
3.09 sigma_sel`` makes ``p_0 = 1e-3``: about one never-looked-up row in
10^3 gets a pure-noise update per step (a row seen in ``k`` units of count
is selected with probability ``Phi((k - tau) / sigma_sel)``). They were
chosen on the Zipf recommendation task of
``benchmarks/bench_sparse_embeddings.py`` (``grid`` mode, over ``f`` in
{0.1, 0.3, 0.5} and ``p_0`` in {1e-4, 1e-3, 1e-2} at three epsilons), where
a larger selection share, which lowers ``tau`` in units of count, brought
the test metric closest to dense DP-SGD's for few rows updated. A model
whose dense part dominates its gradient may prefer a smaller
``selection_share`` (its dense noise grows as ``1 / sqrt(1 - f)``); the
paper tunes the ratio and ``tau`` per task.

**Where the ids come from.** For a functional or ``Sequential`` Keras model
the ids each table is called on are read by a sub-model from the model's
inputs to those calls (usually the inputs themselves: nothing is
computed); for any other model give ``ids_fn(x)``, returning one
``[B, ...]`` integer tensor (or a list, one per call) per covered table, in
the order of ``tables``. The guarantee holds whatever ids are counted (each
example's contribution is clipped to norm 1, and restricting the gradient
to any selected rows is a projection, which cannot raise its norm): ids
that are not the ones looked up cost utility, never privacy.

**Optimizers** (Keras 3, TensorFlow backend) given the sparse update:
``SGD()`` without momentum and ``Adagrad`` scatter into the selected rows
only (rows not selected are not written); ``SGD(momentum > 0)``, ``Adam``,
``RMSprop`` and ``AdamW`` turn the ``IndexedSlices`` into a dense ``[V, D]``
tensor (``UnsortedSegmentSum``) for their state: their momenta decay on
every row, so a row selected earlier keeps moving on later steps (a row
never selected has zero moments and stays), ``AdamW``'s weight decay moves
every row, and the step costs ``O(V D)`` again in the optimizer (the
release itself stays sparse; that densification is post-processing).

Unsupported, refused with a clear error: XLA (the selected rows' number
varies per step), ``GradientAccumulator`` under a strategy with several
replicas (its summed counts live on one replica), ``privacy_unit`` other
than ``"example"``, a tied ``ReversibleEmbedding`` named in ``tables`` (its output
projection's gradient is dense on every row, so the table gets dense noise;
with ``tables=None`` such tables are left dense). Under ``tf.distribute``
each replica counts its shard into a dense ``[V]`` vector with its share of
the count noise, all-reduced so every replica selects the same rows
(``V`` floats per table, against ``V D`` for the dense gradient).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from per_example_grads._core import model_inspection, replicas
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.dp import composition
from per_example_grads.dp.noise import standard_normal

# Folded into the step's noise key: the counts' and the selected rows' draws
# never share a key with the dense noise (``noise.NOISE_TAG``) or each other.
_COUNT_TAG, _ROWS_TAG, _FALSE_POSITIVE_TAG = 0x73656C, 0x726F7773, 0x6670
DENSE_COUNTS = 1 << 18  # up to this many (table, id) keys in all, the counts are summed in one dense vector


def noise_multipliers(noise_multiplier: float, selection_share: float) -> tuple[float, float]:
    """``(sigma_sel, sigma_grad)`` with ``1/sigma_sel^2 = f/sigma^2`` and ``1/sigma_grad^2 = (1-f)/sigma^2``.

    Examples:
      >>> s, g = noise_multipliers(1.0, 0.1)
      >>> round(s, 4), round(g, 4), round(1 / s**2 + 1 / g**2, 12)
      (3.1623, 1.0541, 1.0)
    """
    if not 0.0 < selection_share < 1.0:
        raise ValueError(f"selection_share must lie in (0, 1); got {selection_share!r}.")
    if noise_multiplier == 0:
        return 0.0, 0.0
    return noise_multiplier / math.sqrt(selection_share), noise_multiplier / math.sqrt(1.0 - selection_share)


def gaussian_tail(x: float) -> float:
    """``Q(x) = P(N(0, 1) >= x)``."""
    return 0.5 * math.erfc(x / math.sqrt(2.0))


@dataclasses.dataclass(frozen=True)
class SparseEmbeddings:
    """Settings of sparse embedding noise (module docstring): ``DPModel(..., sparse_embeddings=SparseEmbeddings())``.

    Args:
      selection_share: ``f`` in ``(0, 1)``, the share of ``1 / sigma^2``
        given to the row selection (the rest goes to the gradient).
      threshold: ``tau``, in units of count (each example adds at most 1 in
        L2 norm over all covered tables); None: ``tau`` such that a row no
        example looked up is selected with probability
        ``false_positive_rate``.
      false_positive_rate: ``p_0`` for the default ``threshold``.
      tables: the ``Embedding`` / ``ReversibleEmbedding`` layers (or their
        table variables) to update sparsely; None: every ``Embedding`` and
        every untied ``ReversibleEmbedding`` whose table is trained and has
        no regularizer (a regularizer's gradient touches every row).
      ids_fn: ``x -> [ids per table]`` (each a ``[B, ...]`` integer tensor
        or a list of them, one per call), for models that are not
        functional; None reads them from the model's graph.
    """

    selection_share: float = 0.5
    threshold: float | None = None
    false_positive_rate: float = 1e-3
    tables: Sequence | None = None
    ids_fn: Callable[[Any], Sequence] | None = None

    def __post_init__(self):
        noise_multipliers(1.0, self.selection_share)
        if self.threshold is not None and not (isinstance(self.threshold, (int, float)) and self.threshold > 0):
            raise ValueError(f"threshold must be a positive number or None; got {self.threshold!r}.")
        if not 0.0 < self.false_positive_rate < 0.5:
            raise ValueError(f"false_positive_rate must lie in (0, 0.5); got {self.false_positive_rate!r}.")
        if self.ids_fn is not None and not callable(self.ids_fn):
            raise TypeError(f"ids_fn must be callable or None; got {type(self.ids_fn).__name__}.")

    def bind(self, model: Any, variables: Sequence, *, noise_multiplier: float) -> "SparseSelection":
        """The step's selection for ``model``'s tables among ``variables``.

        Which other parts of a DP step it combines with is checked by the
        owner (``per_example_grads.dp.composition``).

        Raises:
          ValueError: a table
            that is tied, not an embedding or not trained, no table at all,
            or (without ``ids_fn``) a model whose calls of a table cannot be
            read from its graph.
        """
        layers = _tables(model, variables, self.tables)
        return SparseSelection(self, model, layers, variables, float(noise_multiplier))


def check_sparse_embeddings(sparse_embeddings: Any) -> None:
    """Refuses a ``sparse_embeddings=`` that is neither None nor a ``SparseEmbeddings`` (DPModel's and GradientAccumulator's).

    Raises:
      TypeError: as said.
    """
    if sparse_embeddings is not None and not isinstance(sparse_embeddings, SparseEmbeddings):
        raise TypeError(
            "sparse_embeddings must be a per_example_grads.dp.sparse_embeddings.SparseEmbeddings or None; "
            f"got {sparse_embeddings!r}."
        )


def _is_tied(layer) -> bool:
    return bool(getattr(layer, "tie_weights", False))


def _is_regularized(layer) -> bool:
    return getattr(layer.embeddings, "regularizer", None) is not None


def _tables(model, variables, wanted) -> list:
    """The covered layers, in order, each with its table among ``variables``."""
    trained = {id(v) for v in variables}
    embeddings = [
        l
        for l in model_inspection.iter_layers(model)
        if isinstance(l, keras.layers.Embedding) or hasattr(l, "tie_weights")
    ]
    if wanted is None:  # a regularized table's gradient touches every row: it stays dense, as a tied one does
        dense = [l.name for l in embeddings if _is_tied(l) or _is_regularized(l)]
        layers = [l for l in embeddings if l.name not in dense and id(l.embeddings) in trained]
        if not layers:
            raise ValueError(
                "sparse_embeddings found no Embedding or untied ReversibleEmbedding without a regularizer whose "
                f"table is trained in this model (tied or regularized tables stay dense: {dense})."
            )
        return layers
    by_variable = {id(l.embeddings): l for l in embeddings}
    layers = []
    for t in wanted:
        layer = t if isinstance(t, keras.layers.Layer) else by_variable.get(id(t))
        if layer is None or layer not in embeddings:
            raise ValueError(
                f"sparse_embeddings tables must be Embedding layers of the model or their tables; got {t!r}."
            )
        if _is_tied(layer):
            raise ValueError(
                f"ReversibleEmbedding {layer.name!r} ties its table to the output projection, whose gradient is dense "
                "on every row: its table cannot be updated sparsely. Leave it out of tables (it then gets dense noise)."
            )
        if id(layer.embeddings) not in trained:
            raise ValueError(f"the table of {layer.name!r} is not among the trained variables.")
        layers.append(layer)
    for layer in layers:
        if _is_regularized(layer):
            raise ValueError(
                f"the table of {layer.name!r} has a regularizer, whose gradient touches every row: its update "
                "cannot stay sparse. Remove embeddings_regularizer, or leave the table out of tables."
            )
    return layers


def _id_probe(model, layers) -> tuple[keras.Model, list[int]]:
    """A sub-model ``x -> [ids of every lookup call]`` and, per output, the index of its table in ``layers``."""
    graph = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    try:
        inputs = graph.input if isinstance(graph, keras.Model) else None
    except AttributeError:  # a subclassed model, or one never called
        inputs = None
    if inputs is None:
        raise ValueError("it has no functional graph")
    outputs, owners = [], []
    for k, layer in enumerate(layers):
        for node in layer._inbound_nodes:
            args, kwargs = node.arguments.args, node.arguments.kwargs
            if kwargs.get("reverse", args[1] if len(args) > 1 else False):
                continue
            try:  # a node of another model's graph (a layer shared with it) is not reachable from these inputs
                keras.Model(inputs, args[0])
            except Exception:  # noqa: BLE001 - Keras raises several types for an unconnected graph
                continue
            outputs.append(args[0])
            owners.append(k)
    missing = [l.name for k, l in enumerate(layers) if k not in owners]
    if missing:
        raise ValueError(f"the lookups of {missing} are not in the model's graph")
    return keras.Model(inputs, outputs), owners


class SparseSelection:
    """``SparseEmbeddings`` bound to one model: counts in ``contribution_counts``, the release in ``release``."""

    def __init__(self, settings: SparseEmbeddings, model, layers, variables, noise_multiplier: float):
        self.settings = settings
        self.layers = layers
        self.vocabularies = [int(l.embeddings.shape[0]) for l in layers]
        self.offsets = np.concatenate([[0], np.cumsum(self.vocabularies)]).astype(np.int64)
        table_ids = [id(l.embeddings) for l in layers]
        self.positions = [[i for i, v in enumerate(variables) if id(v) == t][0] for t in table_ids]
        self.selection_noise_multiplier, self.gradient_noise_multiplier = noise_multipliers(
            noise_multiplier, settings.selection_share
        )
        if settings.threshold is not None:
            self.threshold = float(settings.threshold)
        elif self.selection_noise_multiplier > 0:
            self.threshold = self.selection_noise_multiplier * _inverse_tail(settings.false_positive_rate)
        else:
            self.threshold = (
                1e-6  # no noise: the rows some example looked up (every such count is at least 1/sqrt(|U_n|))
            )
        self.false_positive_rate = (
            gaussian_tail(self.threshold / self.selection_noise_multiplier)
            if self.selection_noise_multiplier > 0
            else 0.0
        )
        self._probe = None
        if settings.ids_fn is None:
            try:
                self._probe, self._owners = _id_probe(model, layers)
            except ValueError as e:
                raise ValueError(
                    f"sparse_embeddings cannot read the ids of {[l.name for l in layers]} from the model's graph ({e}): "
                    "give SparseEmbeddings(ids_fn=lambda x: [ids of each table]) for a model that is not "
                    "functional or Sequential."
                ) from None

    # -- counts ------------------------------------------------------------

    def lookups(self, x) -> list[list[tf.Tensor]]:
        """Per table, the ``[B, T]`` int64 ids of each of its lookups of the batch ``x``."""
        per_table = [[] for _ in self.layers]
        if self._probe is not None:
            outs = self._probe(x)
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            for k, ids in zip(self._owners, outs):
                per_table[k].append(ids)
        else:
            given = self.settings.ids_fn(x)
            if len(given) != len(self.layers):
                raise ValueError(f"ids_fn returned {len(given)} entries for {len(self.layers)} tables.")
            for k, ids in enumerate(given):
                per_table[k].extend(ids if isinstance(ids, (list, tuple)) else [ids])
        flat = []
        for k, calls in enumerate(per_table):
            rows = []
            for ids in calls:
                ids = tf.convert_to_tensor(ids)
                if not (ids.dtype.is_integer or ids.dtype.is_floating):
                    raise ValueError(f"ids of {self.layers[k].name!r} must be numbers; got {ids.dtype}.")
                b = tf.shape(ids)[0]
                rows.append(tf.reshape(tf.cast(ids, tf.int64), tf.stack([b, -1])))
            flat.append(rows)
        return flat

    def contribution_counts(self, x, real: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """``(keys, counts)``: the distinct ``(table, id)`` keys the batch looks up, ascending, and ``sum_n u_n`` at them.

        A key is ``offset_k + id`` (int64). Each real example (``real[n] =
        1``) adds ``1 / sqrt(|U_n|)`` to each of its ``|U_n|`` distinct keys
        (its contribution's L2 norm is 1, or 0 with no keys); rows with
        ``real[n] = 0`` and id 0 of a ``mask_zero`` table add nothing.
        """
        total = int(self.offsets[-1])
        dtype = tf.int32 if total < 2**31 - 1 else tf.int64  # a sort of int32 keys costs less
        parts = []
        for k, calls in enumerate(self.lookups(x)):
            for ids in calls:
                ids = tf.cast(ids, dtype)
                keep = tf.not_equal(ids, 0) if getattr(self.layers[k], "mask_zero", False) else None
                if int(self.offsets[k]):
                    ids += int(self.offsets[k])
                parts.append(ids if keep is None else tf.where(keep, ids, -tf.ones_like(ids)))
        keys = tf.concat(parts, axis=1) if len(parts) > 1 else parts[0]  # [B, T_total], -1 for nothing
        keys = tf.where(tf.cast(real, tf.bool)[:, None], keys, -tf.ones_like(keys))
        # Each example's distinct keys: the first of each run of its sorted keys (-1, nothing, sorts first).
        ordered = tf.sort(keys, axis=1)
        first = tf.concat([ordered[:, :1] >= 0, ordered[:, 1:] > ordered[:, :-1]], 1)  # [B, T_total]
        first = tf.cast(first, tf.float32)
        distinct = tf.reduce_sum(first, axis=1, keepdims=True)  # |U_n|
        weights = first * tf.math.rsqrt(tf.maximum(distinct, 1.0))  # 0 on repeats and on nothing
        if total <= DENSE_COUNTS:  # a [total] vector costs less than hashing the keys
            # Every position is summed, weight 0 where it adds nothing (there -1 becomes key 0).
            dense = tf.math.unsorted_segment_sum(
                tf.reshape(weights, [-1]), tf.reshape(tf.maximum(ordered, 0), [-1]), total
            )
            unique = tf.where(dense > 0)[:, 0]  # ascending
            return unique, tf.gather(dense, unique)
        chosen = tf.cast(first, tf.bool)
        unique, slot = tf.unique(tf.cast(tf.boolean_mask(ordered, chosen), tf.int64), out_idx=tf.int64)
        summed = tf.math.unsorted_segment_sum(
            tf.boolean_mask(weights, chosen), slot, tf.size(unique, out_type=tf.int64)
        )
        order = tf.argsort(unique)
        return tf.gather(unique, order), tf.gather(summed, order)

    # -- selection and release ---------------------------------------------

    def selected_rows(self, keys, counts, source, step) -> list[tf.Tensor]:
        """Per table, the sorted ``[M_k]`` int64 ids whose noisy count reaches ``threshold``; ``keys`` ascending."""
        sigma = self.selection_noise_multiplier
        if replicas.num_replicas() > 1:
            return self._selected_dense(keys, counts, source, step)
        noisy = counts
        if sigma > 0:
            noisy = counts + sigma * standard_normal(tf.size(counts, out_type=tf.int64), _key(source, _COUNT_TAG, step))
        chosen = tf.boolean_mask(keys, noisy >= self.threshold)  # ascending, as keys
        out = []
        for k, v in enumerate(self.vocabularies):
            lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
            mine = tf.boolean_mask(chosen, (chosen >= lo) & (chosen < hi)) - lo
            if self.false_positive_rate > 0:
                touched = tf.boolean_mask(keys, (keys >= lo) & (keys < hi)) - lo
                extra = bernoulli_positions(v, self.false_positive_rate, _key(source, _FALSE_POSITIVE_TAG + k, step))
                hit = _member(touched, extra)
                extra = tf.boolean_mask(extra, tf.logical_not(hit))  # touched rows were decided by their own count
                mine = tf.sort(tf.concat([mine, extra], 0))
            out.append(mine)
        return out

    def _selected_dense(self, keys, counts, source, step) -> list[tf.Tensor]:
        """Multi-replica: ``[V_k]`` counts with this replica's share of the noise, all-reduced, thresholded."""
        total = int(self.offsets[-1])
        dense = tf.scatter_nd(keys[:, None], counts, [total])
        sigma = self.selection_noise_multiplier
        if sigma > 0:
            dense += replicas.noise_share(sigma) * standard_normal(total, _key(source, _COUNT_TAG, step))
        dense = replicas.global_sum(dense)
        return [
            tf.where(dense[int(self.offsets[k]) : int(self.offsets[k + 1])] >= self.threshold)[:, 0]
            for k in range(len(self.layers))
        ]

    def release(
        self, sums: Sequence, selected: Sequence[tf.Tensor], clip, divisor, source, step
    ) -> dict[int, tf.IndexedSlices]:
        """``{variable index: (rows of the sum in S + N(0, (sigma_grad C)^2)) / divisor}`` as ``tf.IndexedSlices`` on ``S``."""
        out = {}
        std = replicas.noise_share(self.gradient_noise_multiplier * clip)
        for k, (i, rows) in enumerate(zip(self.positions, selected)):
            s = sums[i]
            d = int(self.layers[k].embeddings.shape[1])
            dtype = s.dtype
            m = tf.size(rows)
            if isinstance(s, tf.IndexedSlices):
                idx = tf.reshape(tf.cast(s.indices, tf.int64), [-1])  # rank unknown after physical chunks
                at = tf.searchsorted(rows, idx)
                hit = _member(rows, idx)
                values = tf.math.unsorted_segment_sum(
                    tf.boolean_mask(tf.reshape(s.values, [-1, d]), hit), tf.boolean_mask(at, hit), m
                )
            else:  # a dense sum (the table is also used elsewhere): restricting it to S is still a projection
                values = tf.gather(s, rows)
            if self.gradient_noise_multiplier > 0:
                z = standard_normal(tf.cast(m, tf.int64) * d, _key(source, _ROWS_TAG + k, step))
                values += tf.cast(tf.reshape(z * tf.cast(std, tf.float32), [m, d]), dtype)
            values = values / tf.cast(divisor, dtype)
            out[i] = tf.IndexedSlices(values, rows, tf.constant(list(self.layers[k].embeddings.shape), tf.int64))
        return out

    def check_context(self) -> None:
        """Refuses a step being compiled with XLA (``composition``)."""
        composition.check(composition.Parts("the DP step", sparse=True, xla=in_xla_context()))


def _member(sorted_ids: tf.Tensor, ids: tf.Tensor) -> tf.Tensor:
    """``[n]`` bool: whether each of ``ids`` is in the sorted ``sorted_ids`` (which may be empty)."""
    padded = tf.concat([sorted_ids, tf.constant([-1], sorted_ids.dtype)], 0)
    return tf.equal(tf.gather(padded, tf.searchsorted(sorted_ids, ids)), ids)


def _inverse_tail(p: float) -> float:
    """``x`` with ``Q(x) = p`` (bisection on ``gaussian_tail``; ``p`` in ``(0, 0.5)``)."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gaussian_tail(mid) > p else (lo, mid)
    return (lo + hi) / 2


def _key(source, tag: int, step) -> tf.Tensor:
    """A ``[2]`` stateless key for one of the step's draws: the aggregator's key folded with ``tag``, the step and the replica."""
    if isinstance(source, tf.random.Generator):
        return source.make_seeds(1)[:, 0]
    key = tf.random.experimental.stateless_fold_in(source, tag)
    key = tf.random.experimental.stateless_fold_in(key, tf.cast(step, tf.int64))
    if replicas.num_replicas() > 1:
        key = tf.random.experimental.stateless_fold_in(key, replicas.replica_id())
    return key


def bernoulli_positions(n: int, p: float, key: tf.Tensor) -> tf.Tensor:
    """The sorted int64 positions in ``[0, n)`` kept by independent Bernoulli(``p``) trials, drawn from geometric gaps.

    Gap ``G = 1 + floor(log(U) / log(1 - p))`` (``U`` uniform on ``(0, 1]``)
    is geometric on ``{1, 2, ...}`` with success probability ``p``: the
    distance to the next kept position. Expected work ``O(n p)``, never
    ``O(n)``: gaps are drawn in blocks of about ``1.2 n p + 64`` until they
    pass ``n``.
    """
    if p <= 0:
        return tf.zeros([0], tf.int64)
    block = int(1.2 * n * p) + 64
    log_keep = math.log1p(-p)

    def body(i, last, found):
        u = tf.random.stateless_uniform(
            [block], seed=tf.random.experimental.stateless_fold_in(key, tf.cast(i, tf.int64)), dtype=tf.float64
        )
        gaps = 1 + tf.cast(tf.floor(tf.math.log1p(-u) / log_keep), tf.int64)  # 1 - u is uniform on (0, 1]
        positions = last + tf.cumsum(gaps)
        return i + 1, positions[-1], found.write(i, positions)

    _, _, found = tf.while_loop(
        lambda i, last, found: last < n - 1,
        body,
        (
            tf.constant(0, tf.int32),
            tf.constant(-1, tf.int64),
            tf.TensorArray(tf.int64, size=0, dynamic_size=True, infer_shape=False),
        ),
    )
    positions = tf.reshape(found.concat(), [-1])
    return tf.boolean_mask(positions, positions < n)


__all__ = [
    "SparseEmbeddings",
    "SparseSelection",
    "bernoulli_positions",
    "check_sparse_embeddings",
    "gaussian_tail",
    "noise_multipliers",
]
