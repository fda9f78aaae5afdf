"""A scripted stand-in for the OpenAI Responses API that records what the real Codex CLI sends.

Each ``POST .../responses`` is recorded (headers and JSON body) and answered with the
smallest stream Codex accepts: ``response.created``, one message item with its text,
``response.completed`` with usage. Used to capture real requests (CODEX.md) for the
unit-test fixture: ``cd tests && python -m support.codex_recorder OUT.json PATH/TO/codex`` records two
turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from support.recording import RecordingServer


def _stream(n: int, text: str) -> bytes:
    response = {"id": f"resp_rec{n}", "object": "response", "status": "in_progress", "output": []}
    item = {"type": "message", "id": f"msg_rec{n}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    events = [("response.created", {"response": response}),
              ("response.output_item.added", {"output_index": 0, "item": {**item, "content": []}}),
              ("response.output_text.delta", {"item_id": item["id"], "output_index": 0, "content_index": 0,
                                              "delta": text}),
              ("response.output_item.done", {"output_index": 0, "item": item}),
              ("response.completed", {"response": {**response, "status": "completed", "output": [item],
                                                   "usage": usage}})]
    return b"".join(f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()
                    for name, data in events)


def stand_in(reply: str = "4") -> RecordingServer:
    """The Responses API's stand-in: every request is answered with ``reply``."""
    return RecordingServer(lambda path, body, n: (_stream(n, reply), "text/event-stream"))


def write_config(codex_home: Path, base_url: str, model: str = "smollm2-135m-instruct",
                 websockets: bool = False) -> None:
    """A CODEX_HOME whose default provider is ``base_url`` (a Responses API server), over the
    Responses WebSocket transport when ``websockets``."""
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "semantic"\n\n[model_providers.semantic]\nname = "Semantic"\n'
        f'base_url = "{base_url}"\nwire_api = "responses"\nenv_key = "SEMANTIC_API_KEY"\n'
        + ("supports_websockets = true\n" if websockets else ""))


def codex_env(codex_home: Path, home: Path) -> dict[str, str]:
    """Codex headless, talking only to the configured provider."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(codex_home),
            "SEMANTIC_API_KEY": "dummy"}


def run_codex(codex: Path, workdir: Path, env: dict[str, str], prompt: str, resume: bool,
              timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    """``codex exec`` (or ``codex exec resume --last``) with ``prompt``; JSONL events on stdout."""
    args = [str(codex), "exec", "--skip-git-repo-check", "--json"]
    args += ["resume", "--last", prompt] if resume else [prompt]
    return subprocess.run(args, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout_s)


def main(out: Path, codex: Path) -> None:
    """Record two turns of a session into ``out`` (a JSON list of requests)."""
    recorder = stand_in()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_config(root / "codex-home", f"{recorder.url}/v1")
        (root / "work").mkdir()
        env = codex_env(root / "codex-home", root)
        try:
            for resume, prompt in ((False, "What is 2+2?"), (True, "And 3+3?")):
                done = run_codex(codex, root / "work", env, prompt, resume, timeout_s=120)
                if done.returncode != 0:
                    raise RuntimeError(f"codex exited with {done.returncode}: {done.stdout} {done.stderr}")
        finally:
            recorder.close()
    out.write_text(json.dumps([asdict(r) for r in recorder.requests], indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
