"""Modules marked pure must import with MLX unavailable (layering check)."""

import importlib
import subprocess
import sys

PURE = [
    "app.settings", "app.types", "app.errors", "app.clock", "app.engine.stopping", "app.engine.drafting", "app.engine.blas",
    "app.protocol.anthropic", "app.protocol.validation", "app.agents.identity", "app.protocol.responses",
    "app.protocol.responses_output", "app.protocol.codex", "app.protocol.ollama", "app.protocol.direct",
    "app.protocol.reply", "app.store.responses",
    "app.catalog.gguf_tokenizer", "app.catalog.gguf_import", "app.store.models",
    "app.store.history", "worker.tasks", "app.cache.records", "app.cache.matcher", "app.cache.hashing",
    "app.cache.pool", "app.engine.token_text", "app.cache.files", "app.store.cache_index", "app.main",
    "app.cache.upkeep", "app.engine.surface", "app.engine.admission", "app.engine.channel", "app.agents.portable",
    "app.engine.backend", "app.engine.timing", "app.cache.janitor", "app.cache.ownership", "app.agents.agent_log", "app.protocol.structured", "app.cache.formats", "app.engine.kv_choice",
]


def test_pure_modules_import_without_mlx() -> None:
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None; sys.modules['mlx_lm'] = None\n"
        f"import importlib\nfor m in {PURE!r}: importlib.import_module(m)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_pure_modules_exist() -> None:
    for name in PURE:
        assert importlib.util.find_spec(name) is not None, name
