"""Import cycles among the modules of a package, read from their source: every import counts, lazy ones inside
functions too; only ``if TYPE_CHECKING:`` blocks do not (annotations are not run)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType


def import_cycle(package: ModuleType) -> list[str] | None:
    """The first import cycle among ``package``'s modules (its ``__init__`` files aside), as the module names around
    it (``[a, b, a]``: ``a`` imports ``b``, which imports ``a``); ``None`` if they have none."""
    folder = Path(package.__file__).parent
    modules = {
        f"{package.__name__}.{'.'.join(p.relative_to(folder).with_suffix('').parts)}": p
        for p in folder.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {name: _imported_modules(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            cycle = visit(target, (*path, name))
            if cycle:
                return cycle
        done.add(name)
        return None

    return next((cycle for name in sorted(graph) if (cycle := visit(name, ()))), None)


def _imported_modules(tree: ast.Module, modules: dict[str, Path]) -> set[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            }
    return found & set(modules)
