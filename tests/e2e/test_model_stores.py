"""The models users already have (issue 57, item 2): Ollama's store and LM Studio's, built on
disk in each application's layout (no Ollama or LM Studio binary) with tiny random GGUF files
written as llama.cpp writes them. ``semantic models list`` shows them with their source,
``semantic models import ollama:NAME`` imports one by its own name, and ``semantic serve
--model lmstudio:...`` imports and serves one, answering to the store's name."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.catalog.embedded import SMOLLM2, locate_gguf
from conftest import ROOT
from support.gguf_writer import write
from support.servers import start_server, stop_server


@pytest.fixture(scope="module")
def user_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home directory holding an Ollama store (a qwen2 model) and an LM Studio store (a llama one)."""
    home = tmp_path_factory.mktemp("user")
    smollm2 = locate_gguf(SMOLLM2, tmp_path_factory.mktemp("scratch"))
    scratch = tmp_path_factory.mktemp("gguf")
    _, qwen = write("qwen2", scratch / "qwen.gguf", smollm2)
    digest = hashlib.sha256(qwen.read_bytes()).hexdigest()
    store = home / ".ollama" / "models"
    (store / "blobs").mkdir(parents=True)
    qwen.rename(store / "blobs" / f"sha256-{digest}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny-qwen" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1}]}))
    studio = home / ".lmstudio" / "models" / "tiny-org" / "tiny-llama-GGUF"
    studio.mkdir(parents=True)
    write("llama", studio / "tiny-llama.Q8_0.gguf", smollm2)
    (studio / "mmproj-tiny-llama.gguf").write_bytes(b"GGUF")  # a vision projector: no model
    return home


def semantic(user_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(user_home), "SEMANTIC_HOME": str(user_home / "semantic")}
    for name in ("SEMANTIC_CONFIG", "OLLAMA_MODELS", "LMSTUDIO_MODELS"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_stores_are_listed_and_a_model_imports_by_its_store_name(user_home: Path) -> None:
    listed = semantic(user_home, "models", "list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split("\t")[0]: line.split("\t") for line in listed.stdout.splitlines()}
    assert rows["ollama:tiny-qwen:latest"][1] == "qwen2"
    assert rows["ollama:tiny-qwen:latest"][2].startswith(f"Ollama store ({user_home}/.ollama/models)")
    assert rows["lmstudio:tiny-org/tiny-llama-GGUF/tiny-llama.Q8_0"][1] == "llama"
    assert not any("mmproj" in name for name in rows)

    done = semantic(user_home, "models", "import", "ollama:tiny-qwen", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    imported = user_home / "semantic" / "models" / "ollama-tiny-qwen-latest"
    assert json.loads((imported / "config.json").read_text())["model_type"] == "qwen2"
    again = semantic(user_home, "models", "list")
    assert "(imported as ollama-tiny-qwen-latest)" in again.stdout

    missing = semantic(user_home, "models", "import", "ollama:nope")
    assert missing.returncode == 2
    assert "'ollama:nope' is not in Ollama's store" in missing.stderr and "ollama:tiny-qwen:latest" in missing.stderr


def test_serve_takes_a_model_of_lm_studios_store_by_its_name(user_home: Path) -> None:
    server = start_server(user_home / "serve", "lmstudio:tiny-org/tiny-llama-GGUF",
                          {"HOME": str(user_home), "SEMANTIC_KV_FORMAT": "f16"})
    try:
        answer = httpx.post(f"{server.url}/v1/messages", timeout=120, json={
            "model": "lmstudio:tiny-org/tiny-llama-GGUF", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models][0] == "lmstudio-tiny-org-tiny-llama-GGUF"
        assert "importing lmstudio-tiny-org-tiny-llama-GGUF from" in server.log()
    finally:
        stop_server(server)
