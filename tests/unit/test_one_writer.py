"""One writer per table, one upload path, one clock (issue 39, item 3), read from the source.

- ORM rows are added, merged and deleted in ``app/store`` only: no other module adds through a
  Session, builds a row of a model, or an INSERT / UPDATE / DELETE statement.
- The cache layer writes no history rows: ``app/cache`` never imports the history writer
  (``app/store/history.py``); the agents and API layers create conversations before a
  turn's cache is stored.
- The shared tier is written by ``shared_tier.upload_conversation`` alone (the persister's
  turns and fork copies, and an agent's import).
- ``utcnow`` lives in ``app/clock.py`` and is imported from there.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for p in [*(ROOT / "app").rglob("*.py"), *(ROOT / "worker").rglob("*.py")] if "migrations" not in p.parts]
SESSION_WRITES = {"add", "add_all", "merge", "delete", "bulk_save_objects", "bulk_insert_mappings",
                  "bulk_update_mappings"}


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"


def _name(node: ast.AST) -> str:
    """``session`` for ``session``, ``self._sessions`` -> ``_sessions``; "" for anything else."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _trees(outside: str | None = None) -> Iterator[tuple[Path, ast.Module]]:
    for path in SOURCES:
        if outside is None or not path.is_relative_to(ROOT / outside):
            yield path, ast.parse(path.read_text())


def test_orm_rows_are_written_in_the_store_only() -> None:
    found = []
    for path, tree in _trees(outside="app/store"):
        models = {alias.asname or alias.name for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module == "app.store.models" for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in SESSION_WRITES and "session" in _name(node.func.value).lower():
                found.append(f"{_where(path, node)} session.{node.func.attr}(...)")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in models:
                found.append(f"{_where(path, node)} builds a {node.func.id} row")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy") \
                    and {a.name for a in node.names} & {"insert", "update", "delete"}:
                found.append(f"{_where(path, node)} imports a write statement from {node.module}")
    assert found == [], "ORM writes outside app/store (add a function to the store module that owns the table):\n" \
        + "\n".join(found)


def test_the_cache_layer_writes_no_history_rows() -> None:
    found = [_where(path, node) for path, tree in _trees() if path.is_relative_to(ROOT / "app" / "cache")
             for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and (node.module == "app.store.history" or (
                 node.module == "app.store" and any(a.name == "history" for a in node.names)))]
    assert found == [], f"the cache layer imports the history writer: {found}"


def test_the_shared_tier_is_written_by_one_function() -> None:
    found = []
    for path, tree in _trees():
        allowed: set[ast.AST] = set()
        if path == ROOT / "app" / "cache" / "shared_tier.py":
            upload = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "upload_conversation")
            allowed = set(ast.walk(upload))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "put" \
                    and "tier" in _name(node.func.value).lower() and node not in allowed:
                found.append(_where(path, node))
    assert found == [], f"the shared tier written outside shared_tier.upload_conversation: {found}"


def test_utcnow_has_one_home() -> None:
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "utcnow" and path != ROOT / "app" / "clock.py":
                found.append(f"{_where(path, node)} defines utcnow")
            elif isinstance(node, ast.ImportFrom) and any(a.name == "utcnow" for a in node.names) \
                    and node.module != "app.clock":
                found.append(f"{_where(path, node)} imports utcnow from {node.module}")
    assert found == [], "\n".join(found)
