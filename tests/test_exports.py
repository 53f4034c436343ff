"""Each lazy package's two declarations of its public names agree.

A package ``__init__`` lists its names twice: ``_EXPORTS`` (name -> module,
what ``_lazy`` imports at run time) and the ``TYPE_CHECKING`` block (what
static tools and IDEs see). Read from the source with ``ast``, so nothing is
imported: the two must name the same names from the same modules, the
subpackages of ``_SUBPACKAGES`` must be the block's subpackage imports, and
each module must define (or import) the name it exports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "per_example_grads"
LAZY_INITS = sorted(p for p in PACKAGE.rglob("__init__.py") if "_EXPORTS = {" in p.read_text())


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _assigned(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _type_checking_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    blocks = [
        n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "_TYPE_CHECKING"
    ]
    assert len(blocks) == 1, "one `if _TYPE_CHECKING:` block"
    (block,) = blocks
    assert all(isinstance(n, ast.ImportFrom) for n in block.body), "only `from ... import ...` in the block"
    return block.body


def _defined_names(module: str) -> set[str]:
    parts = module.split(".")
    path = PACKAGE.parent.joinpath(*parts)
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_every_lazy_package_is_found():
    found = {_module_name(p.parent / "x.py").rsplit(".", 1)[0] for p in LAZY_INITS}
    assert {"per_example_grads", "per_example_grads.dp", "per_example_grads.dp.audit"} <= found, found


@pytest.mark.parametrize("init", LAZY_INITS, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_exports_and_type_checking_block_agree(init: Path):
    tree = ast.parse(init.read_text())
    package = _module_name(init).removesuffix(".__init__")
    exports = _assigned(tree, "_EXPORTS")
    subpackages = set(_assigned(tree, "_SUBPACKAGES") or ())
    declared, imported_subpackages = {}, set()
    for node in _type_checking_imports(tree):
        for alias in node.names:
            assert alias.asname is None, f"{alias.name} is imported under another name"
            if node.module == package:  # `from package import sub`: a subpackage
                imported_subpackages.add(alias.name)
            else:
                assert alias.name not in declared, f"{alias.name} is imported twice"
                declared[alias.name] = node.module
    assert declared == exports, {
        "only in _EXPORTS": sorted(set(exports) - set(declared)),
        "only in TYPE_CHECKING": sorted(set(declared) - set(exports)),
        "other module": sorted(k for k in set(exports) & set(declared) if exports[k] != declared[k]),
    }
    assert imported_subpackages == subpackages
    for name, module in exports.items():
        assert name in _defined_names(module), f"{module} defines no {name}"
