"""The import graph of app/, module by module, read from the source (nothing is imported).

Every ``import app...`` / ``from app... import ...`` counts, those under ``TYPE_CHECKING``
and inside functions included. A module's layer is its package's depth in the layers
block of docs/layout.md (``store`` at the bottom); the shared modules (``types.py``,
``errors.py``, ...) sit below every package and the wiring (``main.py``, ``cli.py``, ...)
above. An edge *points up* when its target's layer is not below its source's (inside a
package: never), and *closes a circle* when it lies on one.

    python tests/support/import_graph.py            # the edges between packages
    python tests/support/import_graph.py --modules  # every edge, module by module
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "app"
# Below every package, lowest first; above every package, highest last.
SHARED = {"__init__": -3, "types": -3, "errors": -3, "redaction": -3, "clock": -3, "processes": -3, "huge_pages": -3, "settings": -2, "logs": -2}
WIRING = {"home_lock": 1000, "worker_process": 1000, "chat": 1000, "launch": 1000, "interrupts": 1000, "status": 1001, "setting_flags": 1000, "main": 1001, "cli": 1002,
          "entry": 1003, "__main__": 1004}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of app/ (migrations left out: Alembic's)."""
    found = {}
    for path in sorted(APP.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "migrations" in parts:
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 2 else parts)] = path
    return found


def edges() -> set[tuple[str, str]]:
    """(importer, imported) between modules of app/ (a package's ``__init__`` as the package)."""
    known = modules()
    found = set()
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from app.store import jobs`` imports the module app.store.jobs
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                           for a in node.names]
            for target in targets:
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != name and target != "app":
                    found.add((name, target))
    return found


def package(module: str) -> str:
    """``app.cache.blocks`` -> ``cache``; ``app.types`` -> ``types``."""
    return module.split(".")[1] if "." in module else module


def layer_ranks() -> dict[str, int]:
    """Each package's height in docs/layout.md's layers block (the bottom ones 0)."""
    text = (ROOT / "docs" / "layout.md").read_text()
    block = re.search(r"^```layers\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    below: dict[str, set[str]] = {}
    for line in (block.group(1) if block else "").strip().splitlines():
        source, _, targets = line.partition("->")
        below[source.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    ranks: dict[str, int] = {}

    def rank(name: str, seen: tuple[str, ...] = ()) -> int:
        if name not in ranks:
            ranks[name] = 0 if name in seen else 1 + max((rank(t, (*seen, name)) for t in below.get(name, ())),
                                                         default=-1)
        return ranks[name]

    for name in below:
        rank(name)
    return ranks


def rank_of(module: str, ranks: dict[str, int]) -> int:
    name = package(module)
    if name in SHARED or name in WIRING:
        return {**SHARED, **WIRING}[name]
    return ranks.get(name, 0)  # a package the block does not name (pool/): with the bottom ones


def circles(graph: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    succ: dict[str, list[str]] = {}
    for a, b in graph:
        succ.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in succ.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted({n for edge in graph for n in edge}):
        if node not in index:
            visit(node)
    return found


def bad_edges(graph: set[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The edges that point up or close a circle, each with what is wrong with it."""
    ranks = layer_ranks()
    bad = {}
    for a, b in sorted(graph):
        if package(a) != package(b) and rank_of(b, ranks) >= rank_of(a, ranks):
            bad[(a, b)] = "points up"
    for component in circles(graph):
        for a, b in sorted(graph):
            if a in component and b in component:
                bad[(a, b)] = "closes a circle"
    return bad


def main(argv: list[str]) -> None:
    graph = edges()
    bad = bad_edges(graph)
    if "--modules" in argv:
        for a, b in sorted(graph):
            print(f"{a} -> {b}" + (f"   # {bad[(a, b)]}" if (a, b) in bad else ""))
    else:
        between: dict[str, set[str]] = {}
        for a, b in graph:
            if package(a) != package(b):
                between.setdefault(package(a), set()).add(package(b))
        for name in sorted(between):
            print(f"{name} -> {', '.join(sorted(between[name]))}")
    print(f"# {len(modules())} modules, {len(graph)} edges; {len(bad)} point up or close a circle")
    for (a, b), why in sorted(bad.items()):
        print(f"#   {a} -> {b}: {why}")


if __name__ == "__main__":
    main(sys.argv[1:])
