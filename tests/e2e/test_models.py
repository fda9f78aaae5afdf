"""Several installed models on one real server: aliases, the request's `model` choosing
among them (hot swap), and unknown names refused when they are not mapped."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path,
               gemma3_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("models-home"), smollm2_dir, {
        "SEMANTIC_MODEL_ALIASES": f"gemma={gemma3_dir}", "SEMANTIC_MAP_UNKNOWN_MODELS": "0"})
    yield server
    stop_server(server)


def test_models_lists_the_installed_models_and_the_aliases(two_models: ServerProcess, smollm2_dir: Path,
                                                           gemma3_dir: Path) -> None:
    ids = [m.id for m in openai.OpenAI(base_url=f"{two_models.url}/v1", api_key="k").models.list()]
    assert {"gemma", smollm2_dir.name, gemma3_dir.name} <= set(ids)
    listed = {m["id"]: m for m in httpx.get(f"{two_models.url}/v1/models").json()["data"]}
    assert listed["gemma"]["alias_of"] == gemma3_dir.name and not listed["gemma"]["default"]
    assert listed[smollm2_dir.name]["default"] and listed[smollm2_dir.name]["loaded"]


def test_each_request_is_served_by_the_model_it_names(two_models: ServerProcess, smollm2_dir: Path,
                                                      gemma3_dir: Path) -> None:
    """Both models asked for at once: the engine drains one and swaps in the other."""
    chat = openai.OpenAI(base_url=f"{two_models.url}/v1", api_key="k", max_retries=0)
    messages = anthropic.Anthropic(base_url=two_models.url, api_key="k", max_retries=0)

    def on_gemma() -> str:
        reply = chat.chat.completions.create(model="gemma", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "The capital of France is"}])
        return reply.choices[0].message.content or ""

    def on_default() -> str:
        reply = messages.messages.create(model="default", max_tokens=8, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": "The capital of France is"}])
        return reply.content[0].text

    with ThreadPoolExecutor(2) as pool:
        answers = [f.result(timeout=300) for f in [pool.submit(on_gemma), pool.submit(on_default)]]
    assert all(answers)
    served = query(two_models.db_path, "SELECT model, served_model FROM requests WHERE status = 'ok'")
    assert {("gemma", gemma3_dir.name), ("default", smollm2_dir.name)} <= set(served)
    health = httpx.get(f"{two_models.url}/health").json()
    assert health["status"] == "ok" and health["model_swaps"] >= 1
    loaded_dir = {smollm2_dir.name: smollm2_dir, gemma3_dir.name: gemma3_dir}[health["model"]]
    chosen = json.loads((loaded_dir / "kv_calibration.json").read_text())["chosen"]  # each model its own format
    assert health["kv_format"]["name"] == chosen


def test_an_unknown_model_is_a_404_in_each_protocol(two_models: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError, match="not a model this server serves"):
        openai.OpenAI(base_url=f"{two_models.url}/v1", api_key="k", max_retries=0).chat.completions.create(
            model="gpt-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError, match="not a model this server serves"):
        anthropic.Anthropic(base_url=two_models.url, api_key="k", max_retries=0).messages.create(
            model="../../etc", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


def test_an_installed_model_a_request_names_answers_as_itself(two_models: ServerProcess, gemma3_dir: Path) -> None:
    """Issue 62: after `semantic models install gemma3-270m`, a request naming it was
    answered by SmolLM2 with its name echoed back. An installed model, configured nowhere,
    is swapped in as Ollama loads the model a request names (serve_installed_models, on by
    default), and the log says so with the swap's time."""
    models = two_models.home / "models"
    models.mkdir(exist_ok=True)
    (models / "gemma-installed").symlink_to(gemma3_dir)  # installed after the server started
    reply = anthropic.Anthropic(base_url=two_models.url, api_key="k", max_retries=0).messages.create(
        model="gemma-installed", max_tokens=4, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "The capital of France is"}])
    assert reply.model == "gemma-installed"
    served = query(two_models.db_path, "SELECT served_model FROM requests WHERE model = 'gemma-installed'")
    assert served == [("gemma-installed",)], served
    log = two_models.log()
    assert "for gemma-installed" in log and "model gemma-installed loaded in" in log, log[-2000:]
