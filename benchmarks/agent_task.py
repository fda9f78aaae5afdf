"""A real agent task, end to end: the real Claude Code and Codex CLIs each do a small coding
task on a real model, on Semantic and on Rapid-MLX, in one run.

    .venv/bin/python benchmarks/agent_task.py [--model qwen2.5-coder-0.5b] [--servers semantic rapid_mlx]
        [--clients claude codex]

The task, in a fresh git repository for each client and server, two turns of one session:

1. "Create a file hello.py that prints hello world, then run it with python3."
2. (``claude -c``, ``codex exec resume --last``) "python3 test_calc.py fails. Fix calc.py so
   that it passes, then run it." (``calc.py``'s ``add`` subtracts.)

Checked at the end: hello.py prints hello world, and test_calc.py (unchanged) passes.

Each CLI runs as ``semantic launch`` starts it (its environment for slow models: an hour's
request and stream timeouts, a reply budget sized to the context); Claude Code with a
reduced tool set (Bash, Read, Write, Edit), Codex over HTTP (Rapid-MLX has no WebSocket
transport) without a sandbox. Both servers serve the same model directory (Semantic's
import of the embedded model) on OpenBLAS. The clients talk to each server through a
counting proxy, which forwards every byte as it comes and records every request: its
body, the usage the server reported, and whether the client went away before the answer
ended (a cancelled attempt).

Reported per client and server: whether the task was done, its wall time (both turns, CLI
start-up included), the generation requests sent, the prompt tokens, the tokens the server
read from its cache and prefilled, the tokens a perfect cache would prefill (each distinct
token once: the bodies as Semantic renders them, ``perfect_cache.PerfectCache``), and the
cancelled attempts. Prints a table, writes benchmarks/results/agent_task.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import CLAUDE_CODE, CODEX, npm_cli  # noqa: E402
from support.codex_recorder import write_config  # noqa: E402
from support.servers import start_server, stop_server  # noqa: E402

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.launch import plan  # noqa: E402
from app.protocol import anthropic as anthropic_protocol  # noqa: E402
from app.protocol import responses as responses_protocol  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import print_table, write_results  # noqa: E402
from benchmarks.peers import rapid_mlx_server  # noqa: E402
from benchmarks.perfect_cache import PerfectCache, Renderer  # noqa: E402

PROMPTS = ("Create a file hello.py that prints hello world, then run it with python3.",
           "python3 test_calc.py fails. Fix calc.py so that it passes, then run it.")
CALC = "def add(a, b):\n    return a - b\n"
TEST = 'from calc import add\n\nassert add(2, 3) == 5, "add(2, 3) should be 5"\nprint("ok")\n'
CLAUDE_TOOLS = "Bash,Read,Write,Edit"
TASK_TIMEOUT_S = 1800
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer", "upgrade",
        "proxy-connection"}


class CountingProxy:
    """An HTTP proxy to ``upstream`` that records each request as it passes."""

    def __init__(self, upstream: str) -> None:
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy.forward(self, upstream)

            def do_POST(self) -> None:
                proxy.forward(self, upstream)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def forward(self, handler: BaseHTTPRequestHandler, upstream: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        record: dict[str, Any] = {"method": handler.command, "path": handler.path, "start": time.time(),
                                  "body": _json(body), "status": None, "cancelled": False}
        with self._lock:
            self.requests.append(record)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
        answer = bytearray()
        try:
            with httpx.stream(handler.command, upstream + handler.path, content=body, headers=headers,
                              timeout=httpx.Timeout(None)) as response:
                record["status"] = response.status_code
                handler.send_response(response.status_code)
                for k, v in response.headers.items():
                    if k.lower() not in _HOP:
                        handler.send_header(k, v)
                handler.send_header("Transfer-Encoding", "chunked")
                handler.end_headers()
                for chunk in response.iter_raw():
                    answer += chunk
                    handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    handler.wfile.flush()
                handler.wfile.write(b"0\r\n\r\n")
                handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            record["cancelled"] = True  # the client went away before the answer ended
            handler.close_connection = True
        except httpx.HTTPError as error:
            record["error"] = repr(error)
            handler.close_connection = True
        record["end"] = time.time()
        record["usage"] = usage_of(bytes(answer))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def usage_of(answer: bytes) -> dict[str, int]:
    """(prompt, cached) tokens an answer reported, streamed (Anthropic or Responses events)
    or whole; {} if it reported none."""
    events = []
    for line in answer.decode(errors="replace").splitlines():
        if line.startswith("data: ") and line[6:].strip().startswith("{"):
            events.append(_json(line[6:].encode()) or {})
    whole = _json(answer) if not events else None
    if isinstance(whole, dict):
        events = [{"type": "whole", **whole}]
    usage: dict[str, Any] = {}
    for event in events:
        if event.get("type") == "message_start":
            usage.update(event["message"].get("usage") or {})
        elif event.get("type") == "message_delta":
            usage.update(event.get("usage") or {})
        elif event.get("type") in ("response.completed", "response.incomplete"):
            usage.update(event["response"].get("usage") or {})
        elif event.get("type") == "whole":
            usage.update(event.get("usage") or {})
    if "input_tokens_details" in usage or (usage and "cache_read_input_tokens" not in usage):
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        return {"prompt": usage.get("input_tokens", 0), **({"cached": cached} if cached is not None else {})}
    if usage:
        cached = usage.get("cache_read_input_tokens") or 0
        return {"prompt": usage.get("input_tokens", 0) + cached + (usage.get("cache_creation_input_tokens") or 0),
                "cached": cached}
    return {}


def scratch_repository(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "calc.py").write_text(CALC)
    (path / "test_calc.py").write_text(TEST)
    git = ["git", "-c", "user.email=dev@example.com", "-c", "user.name=dev"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "a failing test"]):
        subprocess.run([*git, *args], cwd=path, check=True, capture_output=True)
    return path


def outcome(work: Path) -> dict[str, bool]:
    """Whether each step of the task was done."""
    def runs(name: str) -> subprocess.CompletedProcess[str] | None:
        if not (work / name).exists():
            return None
        return subprocess.run([sys.executable, name], cwd=work, capture_output=True, text=True, timeout=60)

    hello = runs("hello.py")
    test = runs("test_calc.py")
    return {"hello": hello is not None and hello.returncode == 0 and "hello" in hello.stdout.lower(),
            "fixed": (test is not None and test.returncode == 0
                      and (work / "test_calc.py").read_text() == TEST)}


def run_claude(url: str, model: str, context: int, work: Path, home: Path) -> list[float]:
    """Both turns, each a ``claude -p`` process as ``semantic launch claude`` starts it: the
    seconds each took."""
    claude = npm_cli(CLAUDE_CODE, "claude")
    times = []
    for turn, prompt in enumerate(PROMPTS):
        launch = plan("claude", url, home, None, model, [*(["-c"] if turn else []), "-p", prompt, "--output-format",
                                                          "json", "--max-turns", "10", "--tools", CLAUDE_TOOLS,
                                                          "--dangerously-skip-permissions"],
                      binary=str(claude), context_length=context)
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "IS_SANDBOX": "1", **launch.env,
               "ANTHROPIC_SMALL_FAST_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model}
        start = time.perf_counter()
        done = subprocess.run(launch.argv, cwd=work, env=env, capture_output=True, text=True, timeout=TASK_TIMEOUT_S)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            print(f"claude turn {turn + 1} exited {done.returncode}: {done.stdout[-1500:]} {done.stderr[-1500:]}",
                  file=sys.stderr)
    return times


def run_codex(url: str, model: str, work: Path, home: Path) -> list[float]:
    """Both turns, ``codex exec`` then ``codex exec resume --last``, over HTTP, no sandbox."""
    codex = npm_cli(CODEX, "codex")
    write_config(home / "codex-home", f"{url}/v1", model=model)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / "codex-home"),
           "SEMANTIC_API_KEY": "dummy"}
    times = []
    for turn, prompt in enumerate(PROMPTS):
        args = [str(codex), "exec", "--skip-git-repo-check", "--json", "--dangerously-bypass-approvals-and-sandbox"]
        args += ["resume", "--last", prompt] if turn else [prompt]
        start = time.perf_counter()
        done = subprocess.run(args, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TASK_TIMEOUT_S)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            print(f"codex turn {turn + 1} exited {done.returncode}: {done.stdout[-1500:]} {done.stderr[-1500:]}",
                  file=sys.stderr)
    return times


def generations(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in requests if r["method"] == "POST" and isinstance(r["body"], dict)
            and (r["path"].split("?")[0] in ("/v1/messages", "/v1/responses"))]


def prefill_costs(requests: list[dict[str, Any]], renderer: Renderer) -> dict[str, Any]:
    """What the server prefilled (its reported prompt less cached tokens, where it reported
    both) against a perfect cache, over the task's generation requests in order."""
    perfect = PerfectCache()
    prompt = cached = perfect_total = 0
    reported = True
    for request in generations(requests):
        parse = anthropic_protocol.parse_request if request["path"].startswith("/v1/messages") \
            else responses_protocol.parse_request
        ids = renderer.ids(parse, request["body"], ("task", ""))  # one pinned snapshot, as one session's
        perfect_total += perfect.new_tokens(ids)
        perfect.keep(ids)
        usage = request.get("usage") or {}
        prompt += usage.get("prompt", 0)
        if "cached" in usage:
            cached += usage["cached"]
        else:
            reported = False
    return {"prompt_tokens": prompt, "cached_tokens": cached if reported else None,
            "prefilled": prompt - cached if reported else None, "perfect_prefilled": perfect_total,
            "ratio": (prompt - cached) / perfect_total if reported and perfect_total else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="an embedded model")
    parser.add_argument("--servers", nargs="+", default=["semantic", "rapid_mlx"], choices=["semantic", "rapid_mlx"])
    parser.add_argument("--clients", nargs="+", default=["claude", "codex"], choices=["claude", "codex"])
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, args.model)
    context = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 32768)
    renderer = Renderer(model_dir)
    scratch = Path(tempfile.mkdtemp(prefix="semantic-agent-task-"))
    results = []
    for server_name in args.servers:
        stop: Callable[[], None]
        if server_name == "semantic":
            server = start_server(scratch / "semantic-home", model_dir, {})
            url, model, stop = server.url, args.model, partial(stop_server, server)
        else:
            peer = rapid_mlx_server(model_dir, scratch / "rapid-home", scratch / "rapid_mlx.log")
            url, model, stop = peer.url, str(model_dir), peer.stop
        try:
            for client in args.clients:
                proxy = CountingProxy(url)
                work = scratch_repository(scratch / f"{server_name}-{client}")
                home = scratch / f"{server_name}-{client}-home"
                home.mkdir()
                start = time.perf_counter()
                try:
                    turns = (run_claude(proxy.url, model, context, work, home) if client == "claude"
                             else run_codex(proxy.url, model, work, home))
                finally:
                    proxy.close()
                wall = time.perf_counter() - start
                sent = generations(proxy.requests)
                row = {"server": server_name, "client": client, **outcome(work), "wall_s": wall, "turns_s": turns,
                       "requests": len(sent), "cancelled": sum(r["cancelled"] for r in sent),
                       "failed": sum(1 for r in sent if r["status"] != 200),
                       **prefill_costs(proxy.requests, renderer),
                       "log": [{k: r.get(k) for k in ("path", "status", "cancelled", "usage", "start", "end")}
                               for r in sent]}
                results.append(row)
                print(f"{server_name} {client}: {'done' if row['hello'] and row['fixed'] else 'NOT done'} "
                      f"in {wall:.0f} s, {row['requests']} requests", file=sys.stderr)
        finally:
            stop()
    for row in results:
        peer_row = next((r for r in results if r["client"] == row["client"] and r["server"] != row["server"]), None)
        row["wall_vs_other"] = row["wall_s"] / peer_row["wall_s"] if peer_row else None
    print_table(["client", "server", "hello.py", "test fixed", "wall s", "turns s", "requests", "cancelled",
                 "prompt tokens", "cached", "prefilled", "perfect cache", "prefilled/perfect", "wall / other's"],
                [[r["client"], r["server"], r["hello"], r["fixed"], r["wall_s"],
                  " + ".join(f"{t:.0f}" for t in r["turns_s"]), r["requests"], r["cancelled"], r["prompt_tokens"],
                  "-" if r["cached_tokens"] is None else r["cached_tokens"],
                  "-" if r["prefilled"] is None else r["prefilled"], r["perfect_prefilled"],
                  "-" if r["ratio"] is None else r["ratio"],
                  "-" if r["wall_vs_other"] is None else r["wall_vs_other"]] for r in results])
    path = write_results("agent_task", {"args": vars(args), "prompts": PROMPTS, "claude_code": CLAUDE_CODE,
                                        "codex": CODEX, "tasks": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
