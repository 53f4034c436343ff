"""Canaries: the examples an audit adds, each with probability 1/2, and how it scores them.

**Gradient canaries** (``GradientCanaries``, white box): canary ``j`` is an
extra example whose clipped gradient is ``C u_j``, ``C`` the clip norm in
force (``total_clip`` of per-layer norms) and ``u_j`` a unit vector of the
flattened trainable variables: one coordinate ("Dirac" canaries, the
default; ``m`` distinct coordinates drawn from the seed) or, with
``directions="random"``, the ``j``-th of ``m`` random orthonormal directions.
``attach`` sets them as the aggregator's hook (``DPAggregator.canaries``), so
they go through the code a run uses: at every step ``t`` each included
canary whose turn it is joins with probability ``q``, the sampling
probability of the step, as an example would (its turn: always, or under
the cyclic Poisson sampling of a correlated mechanism every ``b``-th step,
``t mod b`` equal to its part), and its ``C u_j`` is added to the clipped
sum *before* the noise; the mechanism, noise, divisor, ledger, physical
chunks, optimizer and all are the run's own.

Each step's release ``g_t = (S_t + sum of canaries + x_t) / D`` is read
right after (``observe``): the score of canary ``j`` sums, over the steps of
its turn, ``<u_j, D g_t - S_t>``, where ``S_t`` is the clipped sum of the
real examples. A white-box adversary may subtract ``S_t``: it is a function
of the weights (public to it) and the other examples, which DP allows it to
know; what is left is the canaries' signal and the noise. The score is
divided by ``sum_t C_t`` over those steps, so an included canary scores
``q`` on average and a left-out one 0. The score never uses whether the
canary was sampled at a step (that is the run's secret randomness; using it
would defeat amplification by sampling, which the accounting counts on).

With distinct coordinates (or orthonormal directions) and data subtracted,
the scores of different canaries are independent given which were included
(the noise is isotropic, under DP-SGD and the correlated mechanisms alike),
which the Gaussian-DP estimator needs.

**Input canaries** (``InputCanaries``, black box): ``m`` examples the model
would not fit otherwise (``mislabeled_canaries``: real examples with another
label, taken out of the training set), each included with probability 1/2,
scored by minus their loss at the trained model. They go through the whole
pipeline, Poisson sampling, per-example gradients and clipping included, so a
missing clip shows; their scores depend on each other through the model,
which the one-run bound allows and the Gaussian-DP one does not.

The included canaries, the coordinates or directions, the parts and the
canaries' sampling all come from the ``seed``, which the auditor keeps.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

_INCLUSION_TAG = 0x696E636C  # "incl"
_LAYOUT_TAG = 0x6C61796F  # "layo"
_SAMPLING_TAG = 0x73616D70  # "samp"
MAX_DIRECTION_FLOATS = 2**25  # m x P floats of random directions (128 MB)


def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), tag]))


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; got {seed!r}.")
    return int(seed)


def _check_num_canaries(num_canaries) -> int:
    if isinstance(num_canaries, bool) or not isinstance(num_canaries, (int, np.integer)) or num_canaries < 2:
        raise ValueError(f"num_canaries must be an integer >= 2; got {num_canaries!r}.")
    return int(num_canaries)


def inclusion(num_canaries: int, seed: int) -> np.ndarray:
    """``[m]`` booleans: canary ``j`` is included, independently with probability 1/2, from ``seed``."""
    return _rng(seed, _INCLUSION_TAG).random(num_canaries) < 0.5


class GradientCanaries:
    """``m`` gradient-space canaries for a white-box audit, inserted by ``DPAggregator.release`` (module docstring).

    Args:
      num_canaries: ``m >= 2``; at most the number of trainable parameters.
      directions: ``"coordinates"`` (Dirac canaries: one parameter each;
        ``O(m)`` work per step) or ``"random"`` (random orthonormal directions
        of all parameters: ``m x P`` floats, ``O(m P)`` per step).
      seed: which canaries are included, their coordinates or directions,
        their parts and their sampling.

    Attributes:
      included: ``[m]`` bool, the canaries the run includes.
      kind: ``"gradient"``.

    Examples:
      >>> import tensorflow as tf
      >>> from per_example_grads.dp.aggregator import ClippedSum, DPAggregator
      >>> w = tf.Variable(tf.zeros([6]))
      >>> aggregator = DPAggregator(l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
      >>> canaries = GradientCanaries(4, seed=1).attach(aggregator, [w])
      >>> for _ in range(3):   # no data, no noise: each release is the included canaries' C u_j
      ...     _ = aggregator.release(ClippedSum([tf.zeros([6])], tf.zeros([0]), tf.zeros([0])), 1.0)
      >>> in_scores, out_scores = canaries.scores()
      >>> in_scores.tolist(), out_scores.tolist()   # q = 1: an included canary scores 1, a left-out one 0
      ([1.0, 1.0], [0.0, 0.0])
      >>> canaries.detach()
    """

    kind = "gradient"

    def __init__(self, num_canaries: int = 1000, *, directions: str = "coordinates", seed: int = 0):
        self.num_canaries = _check_num_canaries(num_canaries)
        if directions not in ("coordinates", "random"):
            raise ValueError(f"directions must be 'coordinates' or 'random'; got {directions!r}.")
        self.directions = directions
        self.seed = _check_seed(seed)
        self.included = inclusion(self.num_canaries, self.seed)
        self._aggregator = None

    # -- set-up -------------------------------------------------------------

    def attach(self, aggregator: Any, variables: Sequence) -> "GradientCanaries":
        """Makes these canaries ``aggregator``'s hook for noise shaped like ``variables``; returns self.

        ``variables``: the trainable variables the releases are for
        (``dp_model.model.trainable_variables``). The cycle of the
        aggregator's mechanism sets the canaries' parts. Scores start at 0.
        A traced train step does not see the hook: retrace it
        (``dp_model.train_function = None``; ``audit`` does).

        Raises:
          ValueError: the aggregator has canaries already, these are attached
            elsewhere, there are fewer parameters than canaries, random
            directions would take more than ``MAX_DIRECTION_FLOATS`` floats,
            or a variable's shape is not static.
        """
        import tensorflow as tf

        if getattr(aggregator, "canaries", None) is not None:
            raise ValueError("this aggregator has canaries already: detach them first.")
        if self._aggregator is not None:
            raise ValueError("these canaries are attached to another aggregator: detach them first.")
        variables = list(variables)
        sizes = []
        for v in variables:
            if not v.shape.is_fully_defined():
                raise ValueError(f"variable {v.name!r} has shape {v.shape}: canaries need static shapes.")
            sizes.append(int(np.prod(v.shape)))
        total = sum(sizes)
        m = self.num_canaries
        if m > total:
            raise ValueError(
                f"{m} canaries need as many parameters (one coordinate or orthonormal direction each); the "
                f"model has {total}. Use fewer canaries."
            )
        rng = _rng(self.seed, _LAYOUT_TAG)
        self._shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self._dtypes = [v.dtype for v in variables]
        if self.directions == "coordinates":
            flat = np.sort(rng.choice(total, size=m, replace=False))  # canary j at flat coordinate flat[j]
            starts = np.concatenate([[0], np.cumsum(sizes)])
            layout = []
            for k in range(len(variables)):
                mine = np.flatnonzero((flat >= starts[k]) & (flat < starts[k + 1]))
                if len(mine):
                    layout.append((k, tf.constant(mine, tf.int64), tf.constant(flat[mine] - starts[k], tf.int64)))
            self._layout = layout
            self._ids = tf.constant(np.concatenate([ids.numpy() for _, ids, _ in layout]), tf.int64)
            self._coordinates = flat
        else:
            if m * total > MAX_DIRECTION_FLOATS:
                raise ValueError(
                    f"{m} random directions of {total} parameters are {m * total:,} floats (more than "
                    f"{MAX_DIRECTION_FLOATS:,}); use directions='coordinates'."
                )
            q, _ = np.linalg.qr(rng.standard_normal((total, m)))  # [P, m], orthonormal columns
            self._directions = tf.constant(q.T.astype(np.float32))  # [m, P]
            self._sizes = sizes
        cycle = int(getattr(aggregator.mechanism, "cycle_length", 1))
        parts = np.empty(m, np.int64)
        parts[rng.permutation(m)] = np.arange(m) % cycle  # a balanced random partition into the cycle's parts
        self.cycle_length = cycle
        self.parts = parts
        with tf.init_scope():
            self._parts = tf.constant(parts, tf.int64)
            self._included = tf.constant(self.included)
            from per_example_grads.dp.noise import hashed_key

            self._key = tf.random.experimental.stateless_fold_in(
                tf.constant(hashed_key(self.seed), tf.int64), _SAMPLING_TAG
            )
            zeros = lambda dtype: tf.Variable(tf.zeros([m], dtype), trainable=False)  # noqa: E731
            self._score = zeros(tf.float64)  # sum over the canary's turns of <u_j, D g_t - S_t>
            self._clip_sum = zeros(tf.float64)  # sum over its turns of C_t
            self._expected = zeros(tf.float64)  # sum over its turns of q_t C_t: an included canary's mean score
            self._turns = zeros(tf.int64)
            self._joined = zeros(tf.int64)  # steps it joined (included and sampled): for checks, not for scores
        aggregator.canaries = self
        self._aggregator = aggregator
        return self

    def detach(self) -> None:
        """Removes the hook from the aggregator (the scores stay readable)."""
        if self._aggregator is not None:
            self._aggregator.canaries = None
            self._aggregator = None

    # -- the hook -----------------------------------------------------------

    def _check_replicas(self) -> None:
        """Refuses a release under several replicas (``audit()`` refuses it up front; canaries attached by hand here)."""
        from per_example_grads._core import replicas
        from per_example_grads.dp import composition

        composition.check(composition.Parts("GradientCanaries", audit="gradient", replicas=replicas.num_replicas()))

    def insert(self, sums: list, *, step, l2_norm_clip, sampling_probability=None) -> list:
        """``sums`` plus ``l2_norm_clip * u_j`` for every canary that joins step ``step`` (included, its turn, sampled)."""
        import tensorflow as tf

        from per_example_grads.clipping import dense_sums

        self._check_replicas()
        sums = dense_sums(sums)
        step = tf.cast(step, tf.int64)
        q = tf.constant(1.0, tf.float64) if sampling_probability is None else tf.cast(sampling_probability, tf.float64)
        clip = tf.cast(l2_norm_clip, tf.float64)
        turn = tf.equal(self._parts, step % self.cycle_length)
        u = tf.random.stateless_uniform(
            [self.num_canaries], seed=tf.random.experimental.stateless_fold_in(self._key, step), dtype=tf.float64
        )
        joins = turn & self._included & (u < q)
        self._turns.assign_add(tf.cast(turn, tf.int64))
        self._joined.assign_add(tf.cast(joins, tf.int64))
        self._clip_sum.assign_add(tf.where(turn, clip, tf.zeros_like(clip)))
        self._expected.assign_add(tf.where(turn, q * clip, tf.zeros_like(clip)))
        weights = tf.where(joins, clip, tf.zeros_like(clip))  # [m]: C for each canary of this step
        out = list(sums)
        if self.directions == "coordinates":
            for k, ids, offsets in self._layout:
                size = int(np.prod(self._shapes[k]))
                add = tf.scatter_nd(offsets[:, None], tf.gather(weights, ids), [size])
                out[k] = out[k] + tf.cast(tf.reshape(add, self._shapes[k]), out[k].dtype)
        else:
            flat = tf.linalg.matvec(self._directions, tf.cast(weights, tf.float32), transpose_a=True)  # [P]
            for k, piece in enumerate(tf.split(flat, self._sizes)):
                out[k] = out[k] + tf.cast(tf.reshape(piece, self._shapes[k]), out[k].dtype)
        return out

    def observe(self, released: list, data_sums: list, divisor, *, step) -> None:
        """Adds ``<u_j, D g_t - S_t>`` to the score of every canary whose turn step ``step`` is."""
        import tensorflow as tf

        from per_example_grads.clipping import dense_sums

        data = dense_sums(data_sums)
        d = tf.cast(divisor, tf.float64)
        step = tf.cast(step, tf.int64)
        flat = lambda t: tf.reshape(tf.cast(t, tf.float64), [-1])  # noqa: E731
        if self.directions == "coordinates":
            values = [
                tf.gather(flat(released[k]), offsets) * d - tf.gather(flat(data[k]), offsets)
                for k, _, offsets in self._layout
            ]
            seen = tf.scatter_nd(self._ids[:, None], tf.concat(values, 0), [self.num_canaries])
        else:
            shown = tf.concat([flat(g) * d - flat(s) for g, s in zip(released, data)], 0)  # canaries + noise
            seen = tf.cast(tf.linalg.matvec(self._directions, tf.cast(shown, tf.float32)), tf.float64)
        turn = tf.equal(self._parts, step % self.cycle_length)
        self._score.assign_add(tf.where(turn, seen, tf.zeros_like(seen)))

    # -- results ------------------------------------------------------------

    def _normalized(self) -> np.ndarray:
        scale = self._clip_sum.numpy()
        return np.divide(self._score.numpy(), scale, out=np.zeros(self.num_canaries), where=scale > 0)

    def scores(self) -> tuple[np.ndarray, np.ndarray]:
        """``(in_scores, out_scores)``: each canary's score over the steps so far, in units of ``C`` per turn.

        An included canary scores the fraction of its turns it joined
        (about ``q``) plus noise; a left-out one, noise around 0.
        """
        s = self._normalized()
        return s[self.included], s[~self.included]

    @property
    def threshold(self) -> float:
        """Half the mean score of an included canary (``q / 2``): a threshold fixed before the scores are seen."""
        scale = self._clip_sum.numpy()
        expected = np.divide(self._expected.numpy(), scale, out=np.zeros(self.num_canaries), where=scale > 0)
        return 0.5 * float(np.mean(expected))

    def vectors(self) -> np.ndarray:
        """``[m, P]`` float32: the unit vectors ``u_j`` of the flattened variables (concatenated in order; after ``attach``)."""
        if self.directions == "random":
            return self._directions.numpy()
        out = np.zeros((self.num_canaries, sum(int(np.prod(s)) for s in self._shapes)), np.float32)
        out[np.arange(self.num_canaries), self._coordinates] = 1.0
        return out

    @property
    def joined(self) -> np.ndarray:
        """``[m]`` int: the steps each canary joined (0 for the left-out ones). Not used by the scores."""
        return self._joined.numpy()

    @property
    def turns(self) -> np.ndarray:
        """``[m]`` int: the steps that were each canary's turn (all steps without a cycle)."""
        return self._turns.numpy()


class InputCanaries:
    """``m`` input-space canaries for a black-box audit: examples added to the training data with probability 1/2 each.

    Args:
      x: the canaries' inputs, an array (or a structure of arrays) with
        leading dimension ``m``, like the training inputs.
      y: their labels, ``[m, ...]``.
      seed: which are included.

    ``training_data(x, y)`` returns the training set with every canary
    appended and a ``[N + m]`` weight that is 0 for the left-out ones:
    ``audit`` multiplies the Poisson batches' mask by it, so a left-out
    canary contributes exactly nothing (it is never computed), while the
    number of examples ``N + m``, hence ``q N`` and the divisor, does not
    depend on which are included. ``scores(model, loss)`` gives minus each
    canary's loss at the trained model.

    Attributes:
      included: ``[m]`` bool; kind: ``"input"``.
    """

    kind = "input"

    def __init__(self, x: Any, y: Any, *, seed: int = 0):
        import tensorflow as tf

        leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(x)] + [np.asarray(leaf) for leaf in tf.nest.flatten(y)]
        sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"x and y of the canaries must share one leading dimension m; got {sorted(map(str, sizes))}."
            )
        self.x, self.y = x, y
        self.num_canaries = _check_num_canaries(sizes.pop())
        self.seed = _check_seed(seed)
        self.included = inclusion(self.num_canaries, self.seed)

    def training_data(self, x: Any, y: Any) -> tuple[Any, Any, np.ndarray]:
        """``(x_all, y_all, weight)``: ``x``, ``y`` with every canary appended, and ``[N + m]`` float32 weights.

        The weight is 1 for the training examples and the included canaries,
        0 for the left-out ones.
        """
        import tensorflow as tf

        join = lambda a, b: np.concatenate([np.asarray(a), np.asarray(b).astype(np.asarray(a).dtype)], axis=0)  # noqa: E731
        x_all = tf.nest.map_structure(join, x, self.x)
        y_all = tf.nest.map_structure(join, y, self.y)
        n = np.asarray(tf.nest.flatten(x)[0]).shape[0]
        weight = np.concatenate([np.ones(n, np.float32), self.included.astype(np.float32)])
        return x_all, y_all, weight

    def scores(self, model: Any, loss: Any, *, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """``(in_scores, out_scores)``: minus each canary's loss at ``model`` (inference mode), split by inclusion."""
        import tensorflow as tf

        from per_example_grads._core.losses import as_per_example_loss

        per_example = as_per_example_loss(loss)
        values = []
        for start in range(0, self.num_canaries, batch_size):
            part = lambda t: np.asarray(t)[start : start + batch_size]  # noqa: E731
            xb, yb = tf.nest.map_structure(part, self.x), tf.nest.map_structure(part, self.y)
            values.append(np.asarray(per_example(tf.convert_to_tensor(yb), model(xb, training=False)), np.float64))
        s = -np.concatenate(values).reshape(self.num_canaries, -1).mean(axis=1)
        return s[self.included], s[~self.included]

    threshold = None  # chosen on half the canaries by the auditor


def mislabeled_canaries(
    x: np.ndarray, y: np.ndarray, num_canaries: int, *, num_classes: int, seed: int = 0
) -> tuple[InputCanaries, np.ndarray, np.ndarray]:
    """``(canaries, x_rest, y_rest)``: ``num_canaries`` examples of ``(x, y)`` given another label, and the rest.

    The canaries are drawn from ``seed`` and taken out of the training data
    (their true label would otherwise teach the model against them); each
    gets a label drawn uniformly from the ``num_classes - 1`` wrong ones.

    Raises:
      ValueError: ``num_canaries`` is not in ``[2, N)``, ``y`` is not
        ``[N]`` integer labels in ``[0, num_classes)``, or ``num_classes < 2``.
    """
    x, y = np.asarray(x), np.asarray(y)
    m = _check_num_canaries(num_canaries)
    if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"y must be [N] integer class labels matching x's {len(x)} rows; got {y.dtype} {y.shape}.")
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2; got {num_classes!r}.")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}); got {y.min()}..{y.max()}.")
    if m >= len(x):
        raise ValueError(f"num_canaries ({m}) must be smaller than the {len(x)} examples they are taken from.")
    rng = _rng(_check_seed(seed), _LAYOUT_TAG)
    chosen = np.sort(rng.choice(len(x), size=m, replace=False))
    shift = rng.integers(1, int(num_classes), size=m)
    labels = ((y[chosen] + shift) % int(num_classes)).astype(y.dtype)
    rest = np.setdiff1d(np.arange(len(x)), chosen)
    return InputCanaries(x[chosen], labels, seed=seed), x[rest], y[rest]
