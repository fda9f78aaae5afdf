"""Workload 6: one agent conversation against Semantic, mlx_lm.server and Rapid-MLX, side by side.

    .venv/bin/python benchmarks/peers.py [--quick] [--servers semantic mlx_lm rapid_mlx]
    .venv/bin/python benchmarks/peers.py --model DIR --servers mlx_lm semantic --system-tokens 7100 \
        --turn-tokens 850 --max-context 9700 --reply-tokens 64 --restarts SIGKILL --name peers-8b

The servers run one after another on the same imported SmolLM2 directory, all on
OpenBLAS (the peers through LD_PRELOAD), and get the same client: OpenAI chat
completions, streamed, greedy, 32-token replies, the X-Session-ID header on every
request, each server continuing its own conversation as a real client would. The
conversation: a ~1.9K-token system prompt, turns of ~240 new tokens until the prompt
passes 6K tokens (--quick: 3K), one short turn (~20 new tokens); then the server is
stopped with SIGKILL and started again, takes one more short turn, is stopped with
SIGTERM (which lets Rapid-MLX save its prefix cache to disk) and started again for a
last short turn.

Recorded per turn: seconds to the first content delta and to the end of the reply, and
the prompt and cached tokens the server reports (stream_options.include_usage; "-": not
reported, as Rapid-MLX does when nothing was cached); for Semantic also its own time to
first token from its ``requests`` table, against the client's (``server_over_client``; a
client kept across turns, ``common.http_client``). Per server: cold prefill tokens/s
(turn 1), decode tokens/s, start-up seconds (until its health check answers 200: for
mlx_lm.server that is before its model is loaded, its generation thread loads it, so a
request waits for the load) and, comparable across servers, each process's start to its
first token (start-up plus the first turn it served), and the peak and final resident memory
(VmHWM, VmRSS of the server's process tree; Linux) of each process. Prints two tables, writes benchmarks/results/peers.json and peers.png
(--quick: peers-quick.*). --servers measures some servers again and keeps the others'
results from that file when the conversation was the same; each server's entry names
the commit it was measured at.

Rapid-MLX (PyPI rapid-mlx, the renamed vllm-mlx) is installed on first use into a venv
of its own, ~/.cache/semantic-bench/rapid-mlx, with this venv's MLX version; it runs
with HOME in the run's directory, ~/.cache/semantic-bench/peers (the servers' homes and
logs of the last run), which every run empties first: no server starts from an earlier
run's disk cache.

--model DIR serves an MLX model directory (benchmarks/synthetic.py makes them at real
sizes) instead of SmolLM2, on every server; the options after it size the conversation,
--semantic-env sets Semantic's settings (SEMANTIC_KV_FORMAT=q8: no KV calibration at
start-up), --out writes NAME.json elsewhere. Every result file names the commit and the
device MLX computed on (mx.default_device(); the GPU's name from nvidia-smi, else the CPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import statistics
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Protocol

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.blas import find_openblas  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import (  # noqa: E402
    RESULTS, device, machine, openai_stream_timed, print_table, pyplot, save_plot, write_results)
from benchmarks.multi_turn import user_message  # noqa: E402
from conftest import free_port, start_server  # noqa: E402

RAPID_MLX = "rapid-mlx==0.16.10"
SCRATCH = Path.home() / ".cache" / "semantic-bench"
RAPID_MLX_VENV = SCRATCH / "rapid-mlx"
# mlx_lm.server's name for the model given by --model (any other name is loaded as a path
# or a hub repository); Semantic serves any name with its model.
MLX_LM_MODEL = "default_model"
REPLY_TOKENS = 32
# SmolLM2's ChatML around a user turn after a reply cut at max_tokens, all new to the
# server: <|im_end|>\n<|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n
MARKERS = 10
HEADERS = {"X-Session-ID": "peers-bench"}
NAMES = {"semantic": "Semantic", "mlx_lm": "mlx_lm.server", "rapid_mlx": "Rapid-MLX"}


@dataclass(frozen=True)
class Turn:
    label: str
    user: str
    restart: str | None = None  # "SIGKILL" / "SIGTERM": stop the server so and start it again first


@dataclass(frozen=True)
class Plan:
    system: str
    turns: tuple[Turn, ...]


def text_of(rng: random.Random, n_tokens: int, count: Callable[[str], int]) -> str:
    """Note-like text of at most ``n_tokens`` tokens by ``count``: the longest run of words that fits."""
    words = user_message(rng, 2 * n_tokens).split()  # every word is at least one token
    low, high = 1, len(words)
    while low < high:
        middle = (low + high + 1) // 2
        if count(" ".join(words[:middle])) <= n_tokens:
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])


def plan(count: Callable[[str], int], *, system_tokens: int = 1900, turn_tokens: int = 240,
         max_context: int = 6000, short_tokens: int = 20, reply_tokens: int = REPLY_TOKENS,
         restarts: tuple[str, ...] = ("SIGKILL", "SIGTERM"), seed: int = 0) -> Plan:
    """The conversation: long turns of ``turn_tokens`` new tokens (template markers
    included) until a prompt reaches ``max_context`` tokens, a short turn, then a short
    turn after each restart. Prompt sizes are estimated with ``count`` and a reply of
    ``reply_tokens``; the servers report the real ones."""
    rng = random.Random(seed)
    system = text_of(rng, system_tokens, count)
    turns: list[Turn] = []
    prompt = count(system)
    while True:
        prompt += turn_tokens
        turns.append(Turn(str(len(turns) + 1), text_of(rng, turn_tokens - MARKERS, count)))
        if prompt >= max_context:
            break
        prompt += reply_tokens
    turns.append(Turn(f"{len(turns) + 1} short", text_of(rng, short_tokens - MARKERS, count)))
    turns += [Turn(f"after {sig}", text_of(rng, short_tokens - MARKERS, count), sig) for sig in restarts]
    return Plan(system, tuple(turns))


class Running(Protocol):
    """A server process that answered its health check."""

    url: str
    process: subprocess.Popen[bytes]


class PeerServer:
    """A peer's server as a process, on OpenBLAS (LD_PRELOAD) as Semantic binds it."""

    def __init__(self, argv: Callable[[int], list[str]], log_path: Path, env: dict[str, str] | None = None,
                 health: str = "/health", timeout_s: float = 300) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        blas = find_openblas()
        env = {**os.environ, **(env or {}), **({"LD_PRELOAD": str(blas)} if blas else {})}
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(argv(port), env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{argv(port)[0]} exited with {self.process.returncode}; see {log_path}")
            try:
                if httpx.get(f"{self.url}{health}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.process.kill()
        raise RuntimeError(f"{argv(port)[0]} did not become healthy; see {log_path}")

    def stop(self) -> None:
        end(self.process, signal.SIGTERM)


def mlx_lm_server(model_dir: Path, log_path: Path) -> PeerServer:
    """``mlx_lm server`` from this venv; it serves ``model_dir`` as MLX_LM_MODEL."""
    return PeerServer(lambda port: [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
                                    "--port", str(port)], log_path)


def rapid_mlx_venv() -> Path:
    """Rapid-MLX's own venv, created on first use: the pinned release with this venv's
    MLX (its requirement is mlx<0.33), so both peers run the same kernels."""
    try:
        cpu = "[cpu]" if version("mlx-cpu") else ""
    except PackageNotFoundError:
        cpu = ""
    spec = [RAPID_MLX, f"mlx{cpu}=={version('mlx')}"]
    stamp = RAPID_MLX_VENV / "semantic-bench-spec"
    if not stamp.exists() or stamp.read_text() != " ".join(spec):
        print(f"installing {' '.join(spec)} into {RAPID_MLX_VENV} (minutes, once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(RAPID_MLX_VENV)], check=True)
        subprocess.run([str(RAPID_MLX_VENV / "bin" / "python"), "-m", "pip", "install", "-q", *spec], check=True)
        stamp.write_text(" ".join(spec))
    return RAPID_MLX_VENV


def rapid_mlx_server(model_dir: Path, home: Path, log_path: Path) -> PeerServer:
    """``rapid-mlx serve`` on ``model_dir`` (served under its path) with HOME at ``home``:
    its prefix cache is saved under ``home`` at SIGTERM and loaded at start-up."""
    binary = rapid_mlx_venv() / "bin" / "rapid-mlx"
    home.mkdir(parents=True, exist_ok=True)
    return PeerServer(lambda port: [str(binary), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                                    "--yes", "--disable-model-downloads"],
                      log_path, {"HOME": str(home), "RAPID_MLX_TELEMETRY": "0", "DO_NOT_TRACK": "1"},
                      health="/health/ready")


def tree_memory_mb(pid: int) -> tuple[float, float]:
    """(peak, current) resident MiB of a process and its descendants: VmHWM and VmRSS summed."""
    peak = current = 0.0
    pending = [pid]
    while pending:
        proc = Path(f"/proc/{pending.pop()}")
        try:
            fields = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
            pending += [int(c) for task in (proc / "task").iterdir() for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # exited meanwhile
            continue
        peak += int(fields["VmHWM"].split()[0]) / 1024
        current += int(fields["VmRSS"].split()[0]) / 1024
    return peak, current


def end(process: subprocess.Popen[bytes], sig: int) -> float:
    """Stop ``process`` with ``sig``: seconds until it exited (SIGKILL after 300 s)."""
    start = time.perf_counter()
    process.send_signal(sig)
    try:
        process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Contender:
    name: str
    model: str  # the name its API serves the model under
    start: Callable[[], Running]
    version: str
    # After each turn: more fields for its record (given the record), e.g. bytes on disk.
    probe: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def chat(url: str, model: str, messages: list[dict], reply_tokens: int = REPLY_TOKENS) -> dict[str, Any]:
    """One streamed turn: TTFT, total seconds, the server's token counts, the reply."""
    body = {"model": model, "messages": messages, "max_tokens": reply_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}}
    times = openai_stream_timed(f"{url}/v1/chat/completions", body, HEADERS)
    usage = times.usage
    return {"ttft_s": times.ttft_s, "last_token_s": times.last_token_s, "total_s": times.end_s,
            "close_gap_s": times.close_gap_s, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "reply": times.text}


def server_ttft(db_path: Path, timeout_s: float = 10) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A probe of Semantic's own account of the turn just ended: the time to first token its
    ``requests`` row holds (counted from the request's arrival; written when the turn ends),
    beside the client's: ``server_ttft_s`` and ``server_over_client``."""
    def probe(record: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with sqlite3.connect(db_path) as db:
                    row = db.execute("SELECT ttft_ms FROM requests ORDER BY created_at DESC LIMIT 1").fetchone()
            except sqlite3.Error:
                row = None
            if row is not None and row[0] is not None:
                return {"server_ttft_s": row[0] / 1000, "server_over_client": row[0] / 1000 / record["ttft_s"]}
            if time.monotonic() > deadline:
                return {"server_ttft_s": None, "server_over_client": None}
            time.sleep(0.05)
    return probe


def converse(contender: Contender, conversation: Plan, reply_tokens: int = REPLY_TOKENS) -> dict[str, Any]:
    """The conversation on one server, restarted where the plan says; one record per
    turn and one per process (how it ended, start-up seconds, memory)."""
    history: list[dict] = [{"role": "system", "content": conversation.system}]
    turns: list[dict] = []
    processes: list[dict] = []

    def launch() -> Running:
        began = time.perf_counter()
        server = contender.start()
        processes.append({"start_s": time.perf_counter() - began})
        print(f"{contender.name} started in {processes[-1]['start_s']:.1f} s", file=sys.stderr)
        return server

    def finish(server: Running, how: str) -> None:
        peak, current = tree_memory_mb(server.process.pid)
        gpu = gpu_memory_mb(server.process.pid)
        processes[-1].update(ended_by=how, peak_rss_mb=peak, rss_mb=current, **({"gpu_mb": gpu} if gpu else {}),
                             stop_s=end(server.process, getattr(signal, how)))

    server = launch()
    try:
        for turn in conversation.turns:
            if turn.restart:
                finish(server, turn.restart)
                server = launch()
            history.append({"role": "user", "content": turn.user})
            record = chat(server.url, contender.model, history, reply_tokens)
            processes[-1].setdefault("first_token_s", processes[-1]["start_s"] + record["ttft_s"])
            history.append({"role": "assistant", "content": record.pop("reply")})
            if contender.probe is not None:
                record.update(contender.probe(record))
            turns.append({"turn": turn.label, **record})
            print(f"{time.strftime('%H:%M:%S')} {contender.name} turn {turn.label}: {record['prompt_tokens']} tokens, "
                  f"{record['cached_tokens']} cached, TTFT {record['ttft_s']:.2f} s, "
                  f"total {record['total_s']:.2f} s", file=sys.stderr)
    finally:
        if server.process.poll() is None:
            finish(server, "SIGTERM")
    return {"version": contender.version, "measured": machine(), "turns": turns, "processes": processes,
            **summary(turns, processes)}


def gpu_memory_mb(pid: int) -> float | None:
    """MiB of GPU memory held by a process and its descendants (nvidia-smi), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    pids, pending = set(), [pid]
    while pending:
        child = pending.pop()
        pids.add(child)
        try:
            pending += [int(c) for task in Path(f"/proc/{child}/task").iterdir()
                        for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    used = [float(fields[1]) for line in done.stdout.splitlines()
            if len(fields := [f.strip() for f in line.split(",")]) == 2 and fields[0].isdigit()
            and int(fields[0]) in pids and fields[1].replace(".", "").isdigit()]
    return sum(used) if used else None


def summary(turns: list[dict], processes: list[dict]) -> dict[str, float | None]:
    first = turns[0]
    decode = [(t["completion_tokens"] - 1) / (t["last_token_s"] - t["ttft_s"]) for t in turns
              if (t["completion_tokens"] or 0) > 1 and t["last_token_s"] > t["ttft_s"]]
    return {"cold_prefill_tps": first["prompt_tokens"] / first["ttft_s"] if first["prompt_tokens"] else None,
            "decode_tps": statistics.median(decode) if decode else None,
            "turns_total_s": sum(t["total_s"] for t in turns),
            "close_gap_s": statistics.median(t["close_gap_s"] for t in turns),
            "server_over_client": _range([t["server_over_client"] for t in turns if t.get("server_over_client")]),
            "peak_rss_mb": max(p["peak_rss_mb"] for p in processes),
            "rss_after_conversation_mb": processes[0]["rss_mb"]}


def _range(values: list[float]) -> list[float] | None:
    """[min, max] of ``values``, or None when there are none."""
    return [min(values), max(values)] if values else None


def report(conversation: dict, servers: dict[str, dict]) -> None:
    """Print the per-turn and per-server tables."""
    names = [n for n in NAMES if n in servers]
    headers = ["turn", "prompt", "new"]
    for name in names:
        headers += [f"{NAMES[name]} s", "turn s", "cached"]
    peers = [n for n in names if n != "semantic"]
    compare = "semantic" in servers and bool(peers)
    if compare:
        headers += ["fastest peer / Semantic", "turn: fastest peer / Semantic"]
    rows = []
    for i, label in enumerate(conversation["labels"]):
        turns = {name: servers[name]["turns"][i] for name in names}
        first = turns[names[0]]
        row: list[Any] = [label, first["prompt_tokens"], (first["prompt_tokens"] or 0) - (first["cached_tokens"] or 0)]
        for name in names:
            cached = turns[name]["cached_tokens"]
            row += [turns[name]["ttft_s"], turns[name]["total_s"], "-" if cached is None else cached]
        if compare:
            row += [min(turns[p]["ttft_s"] for p in peers) / turns["semantic"]["ttft_s"],
                    min(turns[p]["total_s"] for p in peers) / turns["semantic"]["total_s"]]
        rows.append(row)
    print_table(headers, rows)
    print()
    print_table(["server", "version", "cold prefill tok/s", "decode tok/s", "turns total s", "stream end gap s",
                 "start s", "start to 1st token s", "peak RSS MiB", "RSS after conversation MiB",
                 "its TTFT / client's"],
                [[NAMES[n], servers[n]["version"], servers[n]["cold_prefill_tps"], servers[n]["decode_tps"],
                  servers[n]["turns_total_s"], servers[n].get("close_gap_s"), servers[n]["processes"][0]["start_s"],
                  " / ".join(f"{p['first_token_s']:.1f}" for p in servers[n]["processes"] if "first_token_s" in p),
                  servers[n]["peak_rss_mb"], servers[n]["rss_after_conversation_mb"],
                  "-" if not servers[n].get("server_over_client")
                  else "{:.3f}-{:.3f}".format(*servers[n]["server_over_client"])] for n in names])


def plot(name: str, conversation: dict, servers: dict[str, dict], directory: Path = RESULTS) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = conversation["labels"]
    fig, (turns_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    for key, result in servers.items():
        first = turns_ax.plot(range(len(labels)), [t["ttft_s"] for t in result["turns"]], "o-",
                              label=f"{NAMES[key]}, first token")
        turns_ax.plot(range(len(labels)), [t["total_s"] for t in result["turns"]], "x--", color=first[0].get_color(),
                      alpha=0.6, label=f"{NAMES[key]}, whole turn")
    for i, label in enumerate(labels):
        if label.startswith("after"):
            turns_ax.axvline(i - 0.5, color="gray", linestyle=":")
    turns_ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=45, ha="right")
    turns_ax.set_yscale("log")
    turns_ax.set_ylabel("seconds from the request")
    where = f"{Path(conversation['model']).name}, {conversation['device']}" if "model" in conversation \
        else "SmolLM2-135M, 2-core CPU"
    turns_ax.set_title(f"Agent conversation to {conversation['max_context']} tokens, {where}")
    turns_ax.legend(fontsize=7)
    memory_ax.bar([NAMES[k] for k in servers], [r["peak_rss_mb"] for r in servers.values()])
    memory_ax.set_ylabel("peak RSS (MiB)")
    memory_ax.tick_params(axis="x", labelsize=8)
    save_plot(fig, name, directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: to 3K tokens of context")
    parser.add_argument("--servers", nargs="+", choices=list(NAMES), default=list(NAMES),
                        help="which servers, in the order they run")
    parser.add_argument("--model", type=Path, help="an MLX model directory for every server (default: SmolLM2)")
    parser.add_argument("--system-tokens", type=int, default=1900)
    parser.add_argument("--turn-tokens", type=int, default=240, help="new tokens of each long turn")
    parser.add_argument("--max-context", type=int, help="long turns until a prompt reaches it (6000; --quick 3000)")
    parser.add_argument("--short-tokens", type=int, default=20)
    parser.add_argument("--reply-tokens", type=int, default=REPLY_TOKENS)
    parser.add_argument("--restarts", nargs="*", choices=["SIGKILL", "SIGTERM"], default=["SIGKILL", "SIGTERM"],
                        help="how the server is stopped before each last short turn (none: no restarts)")
    parser.add_argument("--semantic-env", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of Semantic's process, e.g. SEMANTIC_KV_FORMAT=q8")
    parser.add_argument("--name", help="the result files' name (peers; --quick peers-quick)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where NAME.json and NAME.png go")
    parser.add_argument("--scratch", type=Path, help=f"the servers' homes and logs (default {SCRATCH}/NAME)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model_dir = args.model.resolve() if args.model else ensure_embedded(load_settings().models_dir,
                                                                          "smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    max_context = args.max_context or (3000 if args.quick else 6000)
    conversation_plan = plan(lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
                             system_tokens=args.system_tokens, turn_tokens=args.turn_tokens, max_context=max_context,
                             short_tokens=args.short_tokens, reply_tokens=args.reply_tokens,
                             restarts=tuple(args.restarts))
    conversation = {"max_context": max_context, "reply_tokens": args.reply_tokens,
                    "labels": [t.label for t in conversation_plan.turns],
                    "plan": [asdict(t) for t in conversation_plan.turns], "system": conversation_plan.system}
    semantic_env = dict(pair.split("=", 1) for pair in args.semantic_env)
    where = device()
    if args.model:  # results of another model (or device) are never merged with these
        conversation.update(model=str(model_dir), device=where["name"], semantic_env=semantic_env)
    name = args.name or ("peers-quick" if args.quick else "peers")
    previous_path = args.out / f"{name}.json"
    previous = json.loads(previous_path.read_text()) if previous_path.exists() else {}
    servers = previous.get("servers", {}) if previous.get("conversation") == conversation else {}

    scratch = args.scratch or SCRATCH / name  # the last run's homes and logs; its disk caches are gone before the next
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    print(f"{time.strftime('%H:%M:%S')} {model_dir} on {where['mlx_device']} ({where['name']}); "
          f"scratch (logs): {scratch}", file=sys.stderr)
    contenders = {
        "semantic": Contender("semantic", "smollm2-135m-instruct",
                              lambda: start_server(scratch / "semantic", model_dir, semantic_env),
                              f"commit {machine()['commit']}", server_ttft(scratch / "semantic" / "semantic.db")),
        "mlx_lm": Contender("mlx_lm", MLX_LM_MODEL, lambda: mlx_lm_server(model_dir, scratch / "mlx_lm.log"),
                            f"mlx-lm {version('mlx-lm')}"),
        "rapid_mlx": Contender("rapid_mlx", str(model_dir),
                               lambda: rapid_mlx_server(model_dir, scratch / "rapid-home", scratch / "rapid_mlx.log"),
                               RAPID_MLX.replace("==", " ")),
    }
    for key in args.servers:
        servers[key] = {**converse(contenders[key], conversation_plan, args.reply_tokens), "device": where}
        servers = {k: servers[k] for k in NAMES if k in servers}
        write_results(name, {"args": {**vars(args), "model": args.model and str(args.model), "out": str(args.out),
                                      "scratch": args.scratch and str(args.scratch)},
                             "device": where, "conversation": conversation, "servers": servers}, args.out)
    print(f"scratch (logs): {scratch}")
    report(conversation, servers)
    print(f"wrote {args.out / f'{name}.json'}")
    plot(name, conversation, servers, args.out)


if __name__ == "__main__":
    main()
