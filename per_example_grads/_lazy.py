"""Lazy public names for a package's ``__init__`` (PEP 562), so importing it loads nothing heavy.

    __getattr__, __dir__ = _lazy.exports(globals(), {"name": "package.module", ...})

Each public name's module is imported on first access of the name, and the
value is then stored in the package's namespace, so later lookups are plain.
Any other attribute that names a submodule imports it (``peg.dp``,
``peg.clipping.dense_sums``).
"""

from __future__ import annotations

import importlib
from importlib.util import find_spec
from typing import Callable, Mapping


def exports(namespace: dict, names: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``.

    ``names`` maps each public name to the module that defines it.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            if not name.startswith("_") and find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
