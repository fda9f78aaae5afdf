"""A first start does not wait for a KV calibration (issue 57, item 4): a model no record is
for serves at once in the lossless format, the log says how to calibrate it, `semantic models
calibrate` records its format (with its progress bar), and the next start uses it. A tiny
random llama model (SmolLM2's tokenizer), calibrated in seconds."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conftest import ROOT
from support.families import save
from support.servers import start_server, stop_server


def test_an_uncalibrated_model_serves_at_once_and_is_calibrated_by_command(tmp_path: Path, smollm2_dir: Path) -> None:
    model = save("llama", tmp_path / "tiny-llama", smollm2_dir)
    started = time.monotonic()
    server = start_server(tmp_path / "home", model)
    try:
        answer = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
            "model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200
        waited = time.monotonic() - started
        kv = httpx.get(f"{server.url}/health", timeout=10).json()["kv_format"]
        assert (kv["name"], kv["chosen_by"]) == ("f16", "pending"), kv
        assert "until its calibration is recorded: `semantic models calibrate" in server.log()
        assert "calibrating the KV format" not in server.log()
    finally:
        stop_server(server)
    env = {**os.environ, "SEMANTIC_HOME": str(tmp_path / "home")}
    env.pop("SEMANTIC_CONFIG", None)
    done = subprocess.run([sys.executable, "-m", "app", "models", "calibrate", str(model)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "calibrate the KV format of" in done.stderr and (model / "kv_calibration.json").exists()
    server = start_server(tmp_path / "home", model)
    try:
        kv = httpx.get(f"{server.url}/health", timeout=10).json()["kv_format"]
        assert kv["chosen_by"] == "calibration", kv
    finally:
        stop_server(server)
    assert waited < 60
