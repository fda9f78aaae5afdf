"""HEAD /, /health and /v1/models on the real server, read by real clients."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from importlib.metadata import version

import anthropic
import httpx
import openai

from pathlib import Path

from support.servers import ServerProcess


def test_head_root_answers_200(server: ServerProcess) -> None:
    assert httpx.head(f"{server.url}/").status_code == 200


def test_health_reports_model_backend_blas_uptime(server: ServerProcess, smollm2_dir: Path) -> None:
    health = httpx.get(f"{server.url}/health").json()
    record = json.loads((smollm2_dir / "kv_calibration.json").read_text())  # kv_format "auto": the model's own
    measured = record["measured"][record["chosen"]]
    assert health["kv_format"] == {"name": record["chosen"], "chosen_by": "calibration",
                                   "bytes_vs_fp16": round(measured["bytes_vs_fp16"], 4),
                                   "top1_agreement": round(measured["top1_agreement"], 4),
                                   "perplexity_change": round(measured["perplexity_change"], 4),
                                   "kl_mean": round(measured["kl_mean"], 5)}
    assert health["kv_format"]["top1_agreement"] >= 0.98
    assert health["status"] == "ok"
    assert health["model"] == "smollm2-135m-instruct"
    assert health["backend"] == "cpu" and health["dtype"] == "float32"
    assert health["context_length"] == 8192 and health["uptime_s"] >= 0
    if platform.system() == "Linux":
        assert health["blas"].startswith("openblas")


def test_every_response_names_the_server_that_answered(server: ServerProcess) -> None:
    """``x-semantic-server``: "<hostname>-<port>" unless server_id is set (pool mode)."""
    port = server.url.rsplit(":", 1)[1]
    health = httpx.get(f"{server.url}/health")
    assert health.json()["server_id"] == f"{socket.gethostname()}-{port}"
    answered = [health, httpx.get(f"{server.url}/nowhere"),
                httpx.post(f"{server.url}/v1/messages", json={"model": "m"}),  # a 400
                httpx.post(f"{server.url}/v1/messages/count_tokens",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})]
    assert [r.headers.get("x-semantic-server") for r in answered] == [health.json()["server_id"]] * 4
    assert [r.status_code for r in answered] == [200, 404, 400, 200]


def test_models_list_for_both_sdks(server: ServerProcess) -> None:
    anthropic_ids = [m.id for m in anthropic.Anthropic(base_url=server.url, api_key="k").models.list()]
    openai_ids = [m.id for m in openai.OpenAI(base_url=f"{server.url}/v1", api_key="k").models.list()]
    assert "smollm2-135m-instruct" in anthropic_ids and anthropic_ids == openai_ids


def test_metrics_in_prometheus_format(server: ServerProcess) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(f"{server.url}/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    httpx.post(f"{server.url}/v1/messages", json={"model": "m"})  # rejected
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    for name in ("semantic_requests", "semantic_ttft_seconds", "semantic_cache_reuse_reasons",
                 "semantic_cache_read_tokens", "semantic_cache_pool_bytes", "semantic_cache_evictions",
                 "semantic_cache_hot_conversations", "semantic_decode_tokens_per_second"):
        assert name in families, name
    subprocess.run([sys.executable, "-m", "app", "jobs", "run", "compact"], check=True, capture_output=True,
                   env={**os.environ, "SEMANTIC_HOME": str(server.home)})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    runs = {(s.labels["job"], s.labels["status"]): s.value for s in families["semantic_job_runs"].samples}
    assert runs.get(("compact", "ok"), 0) >= 1  # run by another process, counted from SQL
    statuses = {s.labels.get("status") for s in families["semantic_requests"].samples if s.value > 0}
    assert {"ok", "rejected"} <= statuses
    assert [s.value for s in families["semantic_ttft_seconds"].samples if s.name.endswith("_count")][0] >= 1


def test_the_server_says_what_version_it_is(server: ServerProcess) -> None:
    from importlib.metadata import version

    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{server.url}/health")
    assert response.json()["version"] == version("semantic")
    assert response.headers["server"] == f"semantic/{version('semantic')}"
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    assert [(s.labels, s.value) for s in families["semantic_build_info"].samples] == [
        ({"version": version("semantic")}, 1.0)]
    # The standard process and Python series, of the server's own process.
    assert families["process_resident_memory_bytes"].samples[0].value > 50 * 2**20
    assert families["process_start_time_seconds"].samples[0].value > 0
    assert "python_info" in families and "python_gc_objects_collected" in families


def test_status_of_a_server_named_by_url_as_json(server: ServerProcess) -> None:
    """The server's port is not in the environment: only --url finds it."""
    env = {**os.environ, "SEMANTIC_HOME": str(server.home)}
    env.pop("SEMANTIC_PORT", None)
    done = subprocess.run([sys.executable, "-m", "app", "status", "--url", f"{server.url}/", "--json"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["url"] == server.url and report["health"]["status"] == "ok"
    assert report["health"]["model"] == "smollm2-135m-instruct"
    assert set(report) == {"url", "health", "tiers", "disk_bytes", "disk_budget_bytes", "jobs", "recent"}


def test_every_request_is_logged_with_status_request_id_and_agent(server: ServerProcess) -> None:
    from support.dbcheck import query

    api = httpx.Client(base_url=server.url, timeout=120, headers={"user-agent": "log-test/1"})
    answered = api.post("/v1/chat/completions", headers={"x-session-id": "log-session-1"}, json={
        "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    missing = api.get("/v1/nowhere")
    invalid = api.post("/v1/messages", json={"model": "m"})
    unknown_agent = api.post("/v1/agents/nobody/generate", json={"messages": [{"role": "user", "content": "x"}]})
    assert [r.status_code for r in (answered, missing, invalid, unknown_agent)] == [200, 404, 400, 404]
    [(agent,)] = query(server.db_path, "SELECT agent_id FROM requests WHERE id = ?", answered.headers["request-id"])
    expected = {answered: ("POST /v1/chat/completions 200", agent), missing: ("GET /v1/nowhere 404", None),
                invalid: ("POST /v1/messages 400", None),
                unknown_agent: ("POST /v1/agents/nobody/generate 404", "nobody")}
    for response, (line_start, agent) in expected.items():
        [line] = [line for line in server.log().splitlines()
                  if "app.api.middleware" in line and response.headers["request-id"] in line]
        assert line.endswith(f"{line_start} request {response.headers['request-id']} agent {agent} "
                             "client 'log-test/1'"), line
    assert "GET /health 200" not in server.log()  # succeeding probes are DEBUG lines


def test_root_links_to_the_operator_page_and_the_api_docs(server: ServerProcess) -> None:
    browser = httpx.get(f"{server.url}/", headers={"accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert browser.status_code == 200 and browser.headers["content-type"].startswith("text/html")
    for href in ("/status", "/health", "/metrics", "/docs", "/openapi.json",
                 "https://docs.anthropic.com/en/api/messages", "https://platform.openai.com/docs/api-reference/chat"):
        assert f'href="{href}"' in browser.text, href
    assert httpx.get(f"{server.url}/status").status_code == 200  # the links lead somewhere
    assert "/v1/agents/{agent_id}/generate" in httpx.get(f"{server.url}/docs").text
    assert httpx.get(f"{server.url}/openapi.json").json()["info"]["version"] == version("semantic")
    program = httpx.get(f"{server.url}/").json()  # Accept: */*
    assert program["status"] == "/status" and program["health"] == "/health"
    assert set(program["api_docs"]) == {"POST /v1/messages", "POST /v1/chat/completions", "POST /v1/responses"}
