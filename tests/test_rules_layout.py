"""How ``per_example_grads/rules/`` is put together: its imports form no circle and import no private names."""

import ast
import pathlib

import numpy as np

RULES_DIR = pathlib.Path(__file__).resolve().parents[1] / "per_example_grads" / "rules"


def _imports(path: pathlib.Path):
    """``(module, names, top_level)`` of every ``from per_example_grads.rules... import`` in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("per_example_grads.rules"):
            names = [a.name for a in node.names]
            if node.module == "per_example_grads.rules":  # from per_example_grads.rules import outer_products
                for name in names:
                    yield name, [], id(node) in top
            else:
                yield node.module.rsplit(".", 1)[-1], names, id(node) in top


def test_the_rule_modules_import_each_other_without_a_circle_and_only_at_the_top():
    graph = {}
    for path in RULES_DIR.glob("*.py"):
        if path.stem == "__init__":
            continue
        found = list(_imports(path))
        local = [m for m, _, top in found if not top]
        assert not local, f"{path.name} imports {local} inside a function"
        graph[path.stem] = {m for m, _, _ in found if m != path.stem}
    state = {}

    def visit(m, trail):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import circle: {' -> '.join(trail + [m])}"
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            visit(n, trail + [m])
        state[m] = "done"

    for m in sorted(graph):
        visit(m, [])


def test_no_rule_module_imports_a_private_name_of_another():
    private = [
        (path.name, module, name)
        for path in RULES_DIR.glob("*.py")
        for module, names, _ in _imports(path)
        for name in names
        if name.startswith("_")
    ]
    assert not private, private


def test_rule_outputs_come_in_the_variables_dtypes_whatever_the_rule_returns():
    import tensorflow as tf

    from per_example_grads.rules.rule import LayerRule

    class Widening(LayerRule):  # returns float64 for float32 variables
        def variables(self, layer):
            return layer

        def per_example(self, layer, saved, grads):
            return [tf.ones([2, 3], tf.float64), None]

        def weighted_sum(self, layer, saved, grads, weights, cache=None):
            return [
                tf.ones([3], tf.float64) * 1.5,
                tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([4, 2])),
            ]

    variables = [tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([4, 2]))]
    rule = Widening()
    pe = rule.per_example(variables, None, None)
    assert pe[0].dtype == tf.float32 and pe[1] is None
    sums = rule.weighted_sum(variables, None, None, tf.ones([2]))
    assert sums[0].dtype == tf.float32 and np.array_equal(sums[0].numpy(), np.full(3, 1.5, np.float32))
    assert isinstance(sums[1], tf.IndexedSlices)  # slices are returned as they are
