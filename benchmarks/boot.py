"""Boot: seconds from exec to the first served request, Semantic against mlx_lm.server.

    .venv/bin/python benchmarks/boot.py [--runs 5] [--model DIR] [--baseline TREE] [--stored-words N]
        [--name boot]

Each round starts, one after another on the same model directory (default: the embedded
SmolLM2-135M), ``semantic serve`` with its defaults (its worker child too) on a fresh home
(no database, no caches), ``semantic serve`` on a home with a store (a database at head
and one conversation's cache on disk, made once before the first round by a server that
answered one request: "Hello", or with ``--stored-words N`` a user message of N words;
each start gets a copy of it, so every start prefetches that conversation while its first
request arrives), and ``mlx_lm.server`` (on OpenBLAS through LD_PRELOAD, as Semantic binds
it); ``--runs``
rounds, the servers alternating. Each start is timed from just before the exec to the
first answered request: a 1-token greedy chat completion (not streamed), sent again every
25 ms until one is answered with a 200 (a refused connection or a 503 while the model
loads are retried). The server is then stopped with SIGTERM.

Also recorded: the server's CPU seconds (every thread, user and system) when its first
request was answered, the work a start does, which a machine others share does not
stretch as it stretches the wall-clock seconds. ``--baseline TREE`` adds Semantic started
from another commit's files (``git archive COMMIT | tar -x -C /tmp/boot-COMMIT``) to the
same rounds: a change's gain measured beside what it changed.

Semantic's phases are read from its log, in seconds after its process started: listening
(the port is bound), loaded (the model's weights are in: ``loaded model ... in``, with
its tokenizer-and-fingerprint and weights seconds) and ready (``/health`` says ok).

Prints a table (median and min per server, and Semantic's phases), writes
benchmarks/results/NAME.json (every start) and NAME.png; both name the commit and the
device (mx.default_device(); the GPU's name, else the CPU's). The servers' homes and logs
are kept under ~/.cache/semantic-bench/NAME, emptied first.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.catalog.registry import ensure_embedded
from app.engine.blas import find_openblas
from app.settings import load_settings
from benchmarks.common import (
    device,
    machine,
    print_table,
    pyplot,
    save_plot,
    write_results,
)

SCRATCH = Path.home() / ".cache" / "semantic-bench"
ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.025
TIMEOUT_S = 300.0
SERVERS = {"semantic_fresh": "Semantic, fresh home", "semantic_store": "Semantic, home with a store",
           "mlx_lm": "mlx_lm.server"}
# Semantic's log lines: seconds after its process started, and the model load's parts.
PHASES = {
    "listening_s": re.compile(r"listening on \S+ .*?([\d.]+) s after the process started"),
    "ready_s": re.compile(r" ready, .*\(([\d.]+) s after the process started\)"),
}
FIRST_TTFT = re.compile(r"ttft [\d.]+ s \(queue ([\d.]+), restore ([\d.]+), prefill ([\d.]+)\)")
STORED = re.compile(r"prompt (\d+) tokens")
WORDS = ("river", "stone", "lantern", "orchard", "harbor", "meadow", "copper", "willow", "signal", "canyon")
LOADED = re.compile(r"loaded model .* in ([\d.]+) s \(tokenizer and fingerprint ([\d.]+) s, weights ([\d.]+) s")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def semantic_argv(model_dir: Path, port: int) -> list[str]:
    """``semantic serve`` of the tree the process starts in (``python -m app`` imports it from its cwd)."""
    return [sys.executable, "-m", "app", "serve", "--model", str(model_dir), "--port", str(port)]


def semantic_env(home: Path) -> dict[str, str]:
    """A home of its own and every other setting at its default: the Huey worker child runs,
    as it does for a user's ``semantic serve``."""
    env = {**os.environ, "SEMANTIC_HOME": str(home)}
    for name in ("SEMANTIC_CONFIG", "SEMANTIC_WORKER"):
        env.pop(name, None)
    return env


def mlx_lm_argv(model_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(port)]


def mlx_lm_env() -> dict[str, str]:
    blas = find_openblas()
    return {**os.environ, **({"LD_PRELOAD": str(blas)} if blas else {})}


def request_body(model: str, content: str = "Hello") -> dict[str, Any]:
    """The 1-token greedy chat completion every start is timed to (``content``: the one that made the store)."""
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}


def filler(n_words: int) -> str:
    """Text of ``n_words`` words (about 4 tokens each on SmolLM2) no other prompt shares."""
    return " ".join(f"{WORDS[i % len(WORDS)]}{i % 997}" for i in range(n_words))


def boot(argv: Callable[[int], list[str]], env: dict[str, str], model: str, log_path: Path,
         cwd: Path = ROOT, content: str = "Hello") -> dict[str, Any]:
    """Start a server in ``cwd``, time it to its first answered request, stop it (SIGTERM)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        began = time.perf_counter()
        process = subprocess.Popen(argv(port), env=env, cwd=cwd, stdout=log,
                                   stderr=subprocess.STDOUT)
    refused = loading = 0
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{argv(port)[:4]} exited with {process.returncode}; see {log_path}")
            if time.perf_counter() - began > TIMEOUT_S:
                raise RuntimeError(f"{argv(port)[:4]} served no request in {TIMEOUT_S:.0f} s; see {log_path}")
            try:
                reply = httpx.post(f"{url}/v1/chat/completions", json=request_body(model, content), timeout=120)
            except httpx.TransportError:
                refused += 1
                time.sleep(POLL_S)
                continue
            if reply.status_code not in (200, 503):
                raise RuntimeError(f"{argv(port)[:4]} answered {reply.status_code}: {reply.text[:300]}")
            if reply.status_code == 200:
                served = time.perf_counter() - began
                cpu = cpu_seconds(process.pid)
                break
            loading += 1
            time.sleep(POLL_S)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return {"served_s": served, **({"cpu_s": cpu} if cpu is not None else {}), "refused": refused, "not_ready": loading, "reply": reply.json()["choices"][0],
            **phases(log_path.read_text(errors="replace"))}


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system, every thread) the process has used so far (Linux), or None.
    On a machine others share, the work a start does, which their load does not stretch."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phases(log: str) -> dict[str, float]:
    """Semantic's phases from its log (absent: not Semantic's log, or not logged)."""
    found: dict[str, float] = {}
    for key, pattern in PHASES.items():
        match = pattern.search(log)
        if match:
            found[key] = float(match.group(1))
    match = FIRST_TTFT.search(log)
    if match:  # the first request's own account: waiting in the queue, then its prefill
        found.update(first_queue_s=float(match.group(1)), first_prefill_s=float(match.group(3)))
    match = LOADED.search(log)
    if match:
        found.update(load_s=float(match.group(1)), tokenizer_fingerprint_s=float(match.group(2)),
                     weights_s=float(match.group(3)))
    return found


def make_store(model_dir: Path, home: Path, tree: Path = ROOT, stored_words: int = 0) -> int:
    """A home with a store: a server answered one request on it (a user message of
    ``stored_words`` words, or "Hello"), then stopped. Returns the tokens its cache holds."""
    log_path = home.parent / f"make-{home.name}.log"
    boot(lambda port: semantic_argv(model_dir, port), semantic_env(home), "default", log_path, tree,
         filler(stored_words) if stored_words else "Hello")
    match = STORED.search(log_path.read_text(errors="replace"))
    return int(match.group(1)) + 1 if match else 0


def start_home(template: Path, home: Path) -> Path:
    """A copy of the store ``template`` for one start: every start finds the same store (the
    conversation a start answers would otherwise be the newest one the next start prefetches)."""
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(template, home)
    return home


def summarise(starts: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in ("served_s", "cpu_s", "listening_s", "load_s", "tokenizer_fingerprint_s", "weights_s", "ready_s",
                        "first_queue_s", "first_prefill_s")
            if all(k in s for s in starts)]
    return {f"{k}_median": statistics.median(s[k] for s in starts) for k in keys} | \
           {f"{k}_min": min(s[k] for s in starts) for k in keys}


def report(servers: dict[str, dict[str, Any]]) -> None:
    def cell(summary: dict[str, Any], key: str) -> Any:
        return summary.get(f"{key}_median", "-")

    print_table(["server", "starts", "served s (median)", "served s (min)", "CPU s", "listening s", "model loaded s",
                 "tokenizer+fingerprint s", "weights s", "ready s", "request queued s", "request prefill s"],
                [[v["label"], len(v["starts"]), v["summary"]["served_s_median"], v["summary"]["served_s_min"],
                  cell(v["summary"], "cpu_s"),
                  cell(v["summary"], "listening_s"), cell(v["summary"], "load_s"),
                  cell(v["summary"], "tokenizer_fingerprint_s"), cell(v["summary"], "weights_s"),
                  cell(v["summary"], "ready_s"), cell(v["summary"], "first_queue_s"),
                  cell(v["summary"], "first_prefill_s")] for k, v in servers.items()])


def plot(name: str, servers: dict[str, dict[str, Any]], where: str, commit: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [v["label"] for v in servers.values()]
    for row, result in enumerate(servers.values()):
        served = [s["served_s"] for s in result["starts"]]
        ax.scatter(served, [row] * len(served), marker="o", color="C0", label="first request served" if row == 0 else None)
        for key, marker, color, label in (("listening_s", "|", "C1", "listening"), ("ready_s", "x", "C2", "ready")):
            values = [s[key] for s in result["starts"] if key in s]
            if values:
                ax.scatter(values, [row + 0.15] * len(values), marker=marker, color=color,
                           label=label if row == 0 else None)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("seconds from exec")
    ax.set_xlim(left=0)
    ax.set_title(f"Boot to the first served request, {where}, commit {commit}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_plot(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="rounds (each starts every server once)")
    parser.add_argument("--model", type=Path, help="an MLX model directory (default: the embedded SmolLM2)")
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="also start Semantic from TREE, another commit's files named for it "
                             "(git archive COMMIT | tar -x -C /tmp/boot-COMMIT), in the same rounds")
    parser.add_argument("--stored-words", type=int, default=0,
                        help="the store's one conversation: a user message of this many words (about 4 tokens "
                             "each; default: \"Hello\"), prefetched by a start while its first request arrives")
    parser.add_argument("--name", default="boot", help="the result files' name")
    args = parser.parse_args()

    model_dir = args.model.resolve() if args.model else ensure_embedded(load_settings().models_dir,
                                                                          "smollm2-135m-instruct")
    scratch = SCRATCH / args.name
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    where = device()
    print(f"{model_dir} on {where['mlx_device']} ({where['name']}); homes and logs: {scratch}", file=sys.stderr)
    info = machine()
    load_before = os.getloadavg()
    # key -> (label, version, tree, home with a store or None: a fresh home per start); mlx_lm: tree None
    contenders: dict[str, tuple[str, str, Path | None, Path | None]] = {}
    trees = [("", ROOT, f"commit {info['commit']}")]
    if args.baseline:
        trees.append(("baseline_", args.baseline.resolve(), f"baseline {args.baseline.resolve().name}"))
    for prefix, tree, label in trees:
        for key in args.servers:
            if key != "mlx_lm":
                name = SERVERS[key] + (f" ({label})" if prefix else "")
                home = scratch / f"{prefix}store-template" if key == "semantic_store" else None
                contenders[prefix + key] = (name, label, tree, home)
    if "mlx_lm" in args.servers:
        contenders["mlx_lm"] = (SERVERS["mlx_lm"], f"mlx-lm {version('mlx-lm')}", None, None)
    stored_tokens = {}
    for key, (name, _, tree, home) in contenders.items():
        if home is not None and tree is not None:
            stored_tokens[key] = make_store(model_dir, home, tree, args.stored_words)
            print(f"{name}: a store of one {stored_tokens[key]}-token conversation", file=sys.stderr)
    starts: dict[str, list[dict[str, Any]]] = {k: [] for k in contenders}
    for run in range(args.runs):
        for key, (name, _, tree, home) in contenders.items():
            log_path = scratch / f"{key}-{run}.log"
            if tree is None:
                result = boot(lambda port: mlx_lm_argv(model_dir, port), mlx_lm_env(), "default_model", log_path)
            else:
                home_now = start_home(home, scratch / f"{key}-home-{run}") if home else scratch / f"{key}-home-{run}"
                result = boot(lambda port: semantic_argv(model_dir, port), semantic_env(home_now), "default",
                              log_path, tree)
            starts[key].append(result)
            print(f"{time.strftime('%H:%M:%S')} {name} run {run + 1}: served in {result['served_s']:.2f} s"
                  + (f" (listening {result['listening_s']:.2f}, ready {result['ready_s']:.2f})"
                     if "ready_s" in result else ""), file=sys.stderr)
    servers = {k: {"label": contenders[k][0], "version": contenders[k][1], "starts": v, "summary": summarise(v)}
               for k, v in starts.items()}
    path = write_results(args.name, {"args": {**vars(args), "model": str(model_dir),
                                              "stored_tokens": stored_tokens,
                                              "baseline": args.baseline and str(args.baseline)},
                                     "device": where, "servers": servers,
                                     # others' work on the machine, 1-minute average (runnable threads)
                                     "load_average": {"before": load_before[0], "after": os.getloadavg()[0]}})
    report(servers)
    print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs)")
    print(f"wrote {path}")
    plot(args.name, servers, where["name"] if "gpu" in where["mlx_device"] else f"{os.cpu_count()}-core CPU",
         info["commit"])


if __name__ == "__main__":
    main()
