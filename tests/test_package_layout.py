"""The package's layers: every import, at module level or inside a function, points down or sideways, never up.

core <- rules <- engines <- API <- dp, diagnostics <- keras <- apps; dp and
diagnostics do not import each other. Read statically (``ast``), so an
import inside a function that no test happens to call is checked too.
"""

import ast
from pathlib import Path

import per_example_grads

ROOT = Path(per_example_grads.__file__).parent

# A module's layer: its subpackage, or for a top-level module its own name.
RANK = {
    **dict.fromkeys(["_core", "_lazy", "errors", "per_example_slices", "transforms", "plots", "data"], 0),
    "rules": 1,
    "engines": 2,
    **dict.fromkeys(["clipping", "gradients", "grads_and_vars", "transfer"], 3),
    **dict.fromkeys(["dp", "diagnostics", "accumulation"], 4),  # accumulation: the old path of dp.accumulation
    "keras": 5,
    "apps": 6,
    "": 6,  # the package's namespace itself (``import per_example_grads as peg``)
}
APART = ({"dp", "accumulation"}, {"diagnostics"})  # one layer, two parts that do not import each other


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[str]:
    """The ``per_example_grads`` modules ``path`` imports (a name imported from a package counts as its module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("per_example_grads"):
            if node.module == "per_example_grads":
                found += [f"per_example_grads.{a.name}" for a in node.names]
            else:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "per_example_grads"]
    return found


def _modules():
    """``(dotted name below the package, path)`` of every module but the package's own ``__init__``."""
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        if relative != "__init__":  # the package's namespace exports every layer (lazily)
            yield relative, path


def test_every_module_has_a_layer():
    unranked = {_layer(f"per_example_grads.{relative}") for relative, _ in _modules()} - set(RANK)
    assert not unranked, sorted(unranked)


def test_no_module_imports_a_layer_above_it():
    upward = []
    for relative, path in _modules():
        source = _layer(f"per_example_grads.{relative}")
        for target_module in _imports(path):
            target = _layer(target_module)
            if target == source:
                continue
            apart = any(source in one and target in other for one in APART for other in APART if one is not other)
            if RANK[target] > RANK[source] or apart:
                upward.append(f"{relative} imports {target_module}")
    assert not upward, upward
