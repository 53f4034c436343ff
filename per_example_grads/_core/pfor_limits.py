"""Which functions ``tf.vectorized_map`` (pfor) must not vectorize on CPU.

pfor vectorizes a function of one example by adding a leading batch axis to
every op's inputs, so an op that sees a rank-``r`` tensor in the one-example
graph sees rank ``r + 1`` in the vectorized one. Some CPU kernels accept only a
bounded rank. TensorFlow's x86 builds run ``Softmax`` through oneDNN
(``_MklSoftmax``), which takes inputs of rank 1 to 5 ("Input dims must be <=
5 and >=1"): grouped-query attention's rank-5 scores ``[b, kv_heads, groups,
T, S]`` (KerasHub Gemma) become rank 6 under pfor. On some CPUs that is an
``AbortedError``; on others the same graph takes the process down with
SIGSEGV/SIGABRT inside oneDNN, which no ``except`` can catch. Whether it crashes depends on the CPU, so the decision must not: the
one-example graph is traced (cheap: no kernel runs) and any op whose rank
after pfor would exceed its kernel's limit makes the function unvectorizable.

A second oneDNN fault: ``BatchMatMulV2`` that broadcasts a rank-4 operand
with a unit batch axis against a smaller one (``[5, 1, 6, 8] @ [8, 8]``, and
``@ [1, 8, 8]``) corrupts the heap ("free(): invalid pointer", SIGABRT or
SIGSEGV, sometimes only at exit, so a run that "worked" may have computed on
corrupted memory); ``[5, 2, 6, 8] @ [8, 8]``, ``[5, 1, 6, 8] @ [5, 1, 8, 8]``,
``[5, 3, 1, 6, 8] @ [8, 8]`` and oneDNN off (``TF_ENABLE_ONEDNN_OPTS=0``)
are fine. pfor produces exactly that shape:
Keras lowers ``EinsumDense`` (every attention projection) on a one-example
``[1, T, D]`` input to ``BatchMatMulV2([1, T, D], [D, E])``, which pfor turns
into ``[B, 1, T, D] @ [D, E]``. So a batch matmul whose operands' batch axes
differ (it broadcasts) and include an axis of size 1 (or unknown size) is a
hazard too (``broadcast_matmul_hazard``, conservatively: any batch axis of
size 1 or unknown size).

``RANK_LIMITS`` lists the ops with a rank limit. On TF 2.21 (x86, oneDNN
on) every op below runs at rank 6 and 7 in a ``tf.function`` except
``Softmax``: LogSoftmax, Transpose, BatchMatMulV2, Einsum, Relu, Gelu, Tanh,
Sigmoid, Swish, AddV2, Mul, LeakyRelu, Elu, Sum, Mean, SquaredDifference,
Rsqrt.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import tensorflow as tf

from per_example_grads.errors import InvalidLossError

# op type -> the largest input rank its CPU kernel accepts.
RANK_LIMITS: dict[str, int] = {"Softmax": 5}

BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")

# Attributes of control-flow and call ops that name nested function bodies.
_FUNCTION_ATTRS = ("then_branch", "else_branch", "body", "cond", "f", "branches")


def over_limit_ops(ops: Iterable[tf.Operation], graph: tf.Graph, added_axes: int = 1) -> list[str]:
    """``"Softmax on rank 5 (+1 under pfor > 5)"`` for each op of ``ops`` that pfor would push past its limit.

    Args:
      ops: operations of ``graph`` (a ``FuncGraph``); function bodies they
        call (``If``/``While``/``PartitionedCall``) are searched too.
      graph: the graph that holds the nested functions' definitions.
      added_axes: how many axes vectorization adds (1 for pfor).
    """
    found: list[str] = []
    seen: set[str] = set()

    def visit(ops, graph):
        for op in ops:
            limit = RANK_LIMITS.get(op.type)
            if limit is not None and op.inputs:
                rank = op.inputs[0].shape.rank
                if rank is not None and rank + added_axes > limit:
                    found.append(
                        f"{op.type} on rank {rank} ('{op.name}'; rank {rank + added_axes} under "
                        f"tf.vectorized_map, over the CPU kernel's limit of {limit})"
                    )
            if op.type in BATCH_MATMULS and broadcast_matmul_hazard(op.inputs[0].shape, op.inputs[1].shape):
                found.append(
                    f"{op.type} broadcasting {op.inputs[0].shape} with {op.inputs[1].shape} ('{op.name}'; "
                    "a unit batch axis under tf.vectorized_map, which corrupts oneDNN's heap)"
                )
            for name in _nested_function_names(op):
                if name in seen:
                    continue
                seen.add(name)
                fn = _get_function(graph, name)
                if fn is not None and getattr(fn, "graph", None) is not None:
                    visit(fn.graph.get_operations(), fn.graph)

    visit(list(ops), graph)
    return found


def broadcast_matmul_hazard(a: tf.TensorShape, b: tf.TensorShape) -> bool:
    """Whether a batch matmul of ``a`` and ``b`` (shapes before pfor) has a batch axis of size 1 or unknown size.

    Batch axes are all but the last two. pfor batches only the operands that
    depend on the example, so even equal batch axes before it broadcast after
    it (``[1, 6, 8] @ [1, 8, 8]`` becomes ``[B, 1, 6, 8] @ [1, 8, 8]``): any
    unit axis counts. Operands of unknown rank count too.
    """
    if a.rank is None or b.rank is None:
        return True
    return any(d is None or d == 1 for d in a.as_list()[:-2] + b.as_list()[:-2])


def vectorization_hazards(fn: Callable, specs: Any) -> list[str]:
    """What in ``fn``'s one-example graph ``tf.vectorized_map`` could not run on CPU (empty if nothing).

    Args:
      fn: the function ``tf.vectorized_map`` would vectorize, of one example.
      specs: a nest of ``tf.TensorSpec`` for one example (no batch axis),
        matching ``fn``'s single argument.

    Traces ``fn`` into a graph (no kernel runs) and applies ``over_limit_ops``.
    A function that cannot be traced on its own is reported as a hazard too
    (``tf.vectorized_map`` would trace it the same way), so the caller takes
    its non-vectorized path.
    """

    def scoped(example):
        # As inside tf.vectorized_map, the function runs below a name scope:
        # at the root, a layer named "_x" is not a valid scope name.
        with tf.name_scope("pfor_check"):
            return fn(example)

    try:
        concrete = tf.function(scoped, autograph=False).get_concrete_function(specs)
    except InvalidLossError:
        raise  # the loss itself is wrong: every engine would fail, so say so rather than refuse
    except Exception as err:  # noqa: BLE001 - reported, not raised: the caller avoids vectorizing
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return [f"a graph that cannot be traced on its own ({type(err).__name__}: {first})"]
    return over_limit_ops(concrete.graph.get_operations(), concrete.graph)


def example_specs(batched: Any) -> Any:
    """One example's ``tf.TensorSpec`` nest for a nest of batched tensors/arrays ``[B, ...]`` (the batch axis dropped)."""

    def spec(t):
        t = tf.convert_to_tensor(t)
        return tf.TensorSpec(t.shape[1:], t.dtype)

    return tf.nest.map_structure(spec, batched)


def refusal(cache: dict, key: str, find: Callable[[], list[str]], what: str) -> str | None:
    """An engine's reason to refuse: ``find()``'s hazards (worked out once, kept in ``cache[key]``), or None.

    ``what`` names what would run them (``"tf.vectorized_map"``).
    """
    if key not in cache:
        cache[key] = find()
    hazards = cache[key]
    if not hazards:
        return None
    return f"{what} would run {describe(hazards)}, which fails or crashes the process (oneDNN) depending on the CPU"


def describe(hazards: list[str]) -> str:
    """The first hazard of each op type, and how many more, for a message."""
    firsts: dict[str, str] = {}
    for h in hazards:
        firsts.setdefault(h.split()[0], h)
    more = len(hazards) - len(firsts)
    return "; ".join(firsts.values()) + (f"; and {more} more" if more > 0 else "")


def _nested_function_names(op: tf.Operation) -> list[str]:
    names = []
    for attr in _FUNCTION_ATTRS:
        if attr not in op.node_def.attr:
            continue
        value = op.node_def.attr[attr]
        if value.HasField("func"):
            names.append(value.func.name)
        elif value.HasField("list"):
            names.extend(f.name for f in value.list.func)
    return names


def _get_function(graph: tf.Graph, name: str):
    """The function ``name`` in ``graph``'s library or an enclosing graph's, or None."""
    while graph is not None:
        getter = getattr(graph, "_get_function", None)
        fn = getter(name) if getter is not None else None
        if fn is not None:
            return fn
        graph = getattr(graph, "outer_graph", None)
    return None
