"""Agent-shaped replies on every server, in one run: Semantic with drafts off and on,
mlx_lm.server and Rapid-MLX, on SmolLM2 and Gemma 3 (real weights: acceptance needs them).

    .venv/bin/python benchmarks/agent_replies.py [--models smollm2-135m-instruct gemma3-270m]
        [--servers semantic_off semantic mlx_lm rapid_mlx] [--workloads edit "tool call" summary prose]
        [--max-tokens 160]

The replies are ``benchmarks/speculation.py``'s four: a file re-emitted with one change,
a JSON tool call quoting paths from the context, a summary, free prose. For each model the
servers run one after another on the same embedded model directory, on OpenBLAS as in
``peers.py``; each is started fresh (its own home: no reply is served from another's
cache), answers one short warm-up request, then each reply once: OpenAI chat, streamed,
greedy, ``--max-tokens`` tokens at most. "Semantic, drafts off" is the server with
``SEMANTIC_SPECULATIVE_TOKENS=0``; "Semantic" runs its defaults (prompt-lookup drafts on).

Per reply and server: the whole turn (request to the stream's end), the first token, and
decode tok/s (the server's completion tokens after the first over the time from the first
content delta to the last). For Semantic with drafts, the draft tokens kept of those
proposed (its request log line). "same": Semantic's reply with drafts is the reply
without, character for character. Prints a table per model, writes
benchmarks/results/agent_replies.json and agent_replies.png.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import shutil
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import RESULTS, device, machine, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.peers import (  # noqa: E402
    MLX_LM_MODEL, RAPID_MLX, SCRATCH, Running, chat, end, mlx_lm_server, rapid_mlx_server)
from benchmarks.speculation import WORKLOADS  # noqa: E402
from conftest import start_server  # noqa: E402

NAMES = {"semantic_off": "Semantic, drafts off", "semantic": "Semantic", "mlx_lm": "mlx_lm.server",
         "rapid_mlx": "Rapid-MLX"}
MODELS = ("smollm2-135m-instruct", "gemma3-270m")
WARM_UP = [{"role": "user", "content": "Say hello."}]
DRAFTS = re.compile(r"tok/s(?: \(drafts (\d+)/(\d+) kept\))?, ")


def servers(model_dir: Path, scratch: Path) -> dict[str, tuple[str, Callable[[], Running], str]]:
    """Each server: (the model name its API takes, how to start it, its version)."""
    commit = f"commit {machine()['commit']}"
    return {
        "semantic_off": ("semantic", lambda: start_server(scratch / "semantic_off", model_dir,
                                                           {"SEMANTIC_SPECULATIVE_TOKENS": "0"}), commit),
        "semantic": ("semantic", lambda: start_server(scratch / "semantic", model_dir), commit),
        "mlx_lm": (MLX_LM_MODEL, lambda: mlx_lm_server(model_dir, scratch / "mlx_lm.log"), f"mlx-lm {version('mlx-lm')}"),
        "rapid_mlx": (str(model_dir), lambda: rapid_mlx_server(model_dir, scratch / "rapid-home",
                                                               scratch / "rapid_mlx.log"), RAPID_MLX.replace("==", " ")),
    }


def replies(model: str, start: Callable[[], Running], workloads: list[str], max_tokens: int) -> dict[str, dict]:
    """One server's replies: started fresh, warmed up, each workload once, stopped."""
    server = start()
    try:
        chat(server.url, model, WARM_UP, 8)
        out = {}
        for name in workloads:
            messages = [{"role": m.role, "content": m.content} for m in WORKLOADS[name]]
            turn = chat(server.url, model, messages, max_tokens)
            n, decode_s = turn["completion_tokens"] or 0, turn["last_token_s"] - turn["ttft_s"]
            out[name] = {**turn, "decode_tps": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0}
            print(f"  {name}: {n} tokens, turn {turn['total_s']:.2f} s, {out[name]['decode_tps']:.2f} tok/s",
                  file=sys.stderr)
    finally:
        end(server.process, signal.SIGTERM)
    log = getattr(server, "log_path", None)
    if log is not None:  # Semantic: drafts kept, from its request lines (warm-up first)
        found = [m.groups() for m in DRAFTS.finditer(Path(log).read_text())][1:]
        for name, (kept, proposed) in zip(workloads, found):
            out[name].update(accepted=int(kept or 0), drafted=int(proposed or 0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--servers", nargs="+", choices=list(NAMES), default=list(NAMES))
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    previous = RESULTS / "agent_replies.json"  # other models' results are kept (--models runs some again)
    kept = json.loads(previous.read_text())["models"] if previous.exists() else {}
    results: dict[str, Any] = {"device": device(), "args": vars(args),
                               "models": {m: kept[m] for m in MODELS if m in kept and m not in args.models}}
    for model in args.models:
        model_dir = ensure_embedded(load_settings().models_dir, model)
        scratch = SCRATCH / "agent_replies" / model
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        runs: dict[str, Any] = {}
        for key, (name, start, server_version) in servers(model_dir, scratch).items():
            if key in args.servers:
                print(f"{time.strftime('%H:%M:%S')} {model} on {NAMES[key]}", file=sys.stderr)
                runs[key] = {"version": server_version,
                             "replies": replies(name, start, args.workloads, args.max_tokens)}
        results["models"][model] = {"commit": machine()["commit"], "servers": runs}
        write_results("agent_replies", results)
        report(model, runs, args.workloads)
    plot(results)


def report(model: str, runs: dict[str, Any], workloads: list[str]) -> None:
    keys = [k for k in NAMES if k in runs]
    peers = [k for k in ("mlx_lm", "rapid_mlx") if k in runs]
    headers = ["reply", "tokens"] + [f"{NAMES[k]} tok/s" for k in keys] + [f"{NAMES[k]} turn s" for k in keys]
    if "semantic" in runs:
        headers += ["drafts kept"]
        if peers:
            headers += ["tok/s vs faster peer", "turn vs faster peer"]
        if "semantic_off" in runs:
            headers += ["same"]
    rows = []
    for name in workloads:
        got = {k: runs[k]["replies"][name] for k in keys}
        row: list[Any] = [name, got[keys[0]]["completion_tokens"], *(got[k]["decode_tps"] for k in keys),
                          *(got[k]["total_s"] for k in keys)]
        if "semantic" in runs:
            ours = got["semantic"]
            row.append(f"{ours.get('accepted', 0)}/{ours.get('drafted', 0)}")
            if peers:
                row += [ours["decode_tps"] / max(got[p]["decode_tps"] for p in peers),
                        min(got[p]["total_s"] for p in peers) / ours["total_s"]]
            if "semantic_off" in runs:
                row.append(ours["reply"] == got["semantic_off"]["reply"])
        rows.append(row)
    print(f"\n{model}")
    print_table(headers, rows)


def plot(results: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 3.8), squeeze=False)
    for ax, (model, measured) in zip(axes[0], models.items()):
        runs = measured["servers"]
        keys = [k for k in NAMES if k in runs]
        workloads = list(next(iter(runs.values()))["replies"])
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            ax.bar([x + (i - (len(keys) - 1) / 2) * width for x in range(len(workloads))],
                   [runs[key]["replies"][w]["decode_tps"] for w in workloads], width, label=NAMES[key])
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("decode tok/s (greedy)")
        ax.set_title(f"{model}, {results['device']['name']}, commit {measured['commit']}", fontsize=8)
        ax.legend(fontsize=7)
    save_plot(fig, "agent_replies")


if __name__ == "__main__":
    main()
