"""Speculative decoding (prompt-lookup drafts) on agent-shaped replies: what it buys.

    .venv/bin/python benchmarks/speculation.py [--max-tokens 160] [--rounds 2] [--temperature 0]
        [--workloads edit prose] [--together]

SmolLM2-135M in process (the server's ``Engine``, cache reuse off so every turn is
cold and computes the same prompt), greedy, four replies an agent writes:

- ``edit``: re-emit a file shown in the prompt with one change;
- ``tool call``: a JSON tool call quoting paths from the context;
- ``summary``: summarize a change described in the prompt;
- ``prose``: free prose (nothing to copy).

Each reply is generated with speculation off (``speculate`` false) and on, in
alternating order for ``--rounds`` rounds (the fastest of each kept: this VM's
neighbours only ever slow a run down), and once by a bare mlx-lm
``generate_step`` loop on the same prompt tokens (the floor: the model's
forward pass and nothing else). Decode tok/s counts output tokens after the
first over the time after the first; the turn's time is from submit to the end,
prefill included. Acceptance: draft tokens the model agreed with, of those
proposed. Prints a table, writes benchmarks/results/speculation.json and
speculation.png; checks that both outputs are the same token for token.
``--temperature T`` above 0 samples instead (exact speculative sampling: the outputs
differ, their distribution does not; "same" is not checked) and writes
speculation-tT.json / .png.

``--together`` sends the workloads at once instead, so they decode side by side (with
speculation on, in one forward pass a step, each row keeping its own share of its draft:
``speculation.Lanes``; off, in mlx-lm's batch), and reports each reply's whole turn and
decode tok/s and when the last one ended (speculation-together.json / .png).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.engine.blas import blas_in_use, load_fast_blas  # noqa: E402

load_fast_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from app.catalog.registry import Catalog, ensure_embedded  # noqa: E402
from app.engine.engine import CacheConfig, Engine  # noqa: E402
from app.settings import load_settings  # noqa: E402
from app.store.db import make_engine, make_session_factory, upgrade  # noqa: E402
from app.types import ChatMessage, Finished, GenerationRequest, SamplingParams  # noqa: E402
from benchmarks.common import device, print_table, pyplot, save_plot, write_results  # noqa: E402
from support.engines import loaded_model  # noqa: E402

FILE = '''import json
from pathlib import Path


class Settings:
    """Settings read from a JSON file, with defaults."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values = {"port": 8000, "host": "127.0.0.1", "workers": 2}

    def load(self) -> None:
        """Read the file over the defaults."""
        if self.path.exists():
            self.values.update(json.loads(self.path.read_text()))

    def get(self, key: str, default=None):
        """One value, or default."""
        return self.values.get(key, default)

    def save(self) -> None:
        """Write the values back."""
        self.path.write_text(json.dumps(self.values, indent=2))
'''
CHANGE = '''The change in this commit: the cache module now keeps every conversation's keys and values in
blocks of 256 tokens, hashed by content, so that two agents with the same system prompt share them.
Blocks are written to disk in the background after each turn, and a block file that fails its checksum
is treated as a miss. The pool evicts least recently used blocks first when memory runs short.'''
WORKLOADS = {
    "edit": [ChatMessage("user", "Here is settings.py:\n```python\n" + FILE + "```\nRewrite the whole file "
                         "with one change: the default port is 9000. Output only the file.")],
    "tool call": [ChatMessage("system", "You can call tools. To read a file, answer with JSON: "
                              '{"name": "read_file", "arguments": {"path": "<path>"}}'),
                  ChatMessage("user", "The repository has src/semantic/cache/blocks.py, src/semantic/cache/pool.py, "
                              "src/semantic/engine/runner.py and tests/unit/test_pool.py. Read the pool module and "
                              "its test: answer with two JSON tool calls, one per line, each naming a path.")],
    "summary": [ChatMessage("user", CHANGE + "\n\nSummarize this change for a changelog, in a few sentences.")],
    "prose": [ChatMessage("user", "Write a short story about a lighthouse keeper who finds a message in a bottle.")],
}


def start_engine(model_dir: Path) -> Engine:
    home = Path(tempfile.mkdtemp(prefix="semantic-speculation-"))
    url = f"sqlite:///{home / 'semantic.db'}"
    upgrade(url)
    cache = CacheConfig(home / "blocks", make_session_factory(make_engine(url)), 1 << 30, enabled=False)
    engine = Engine(Catalog.single("smollm2", model_dir), cache, max_queue=4, max_batch=4)
    engine.start()
    return engine


def turn(engine: Engine, name: str, sampling: SamplingParams, tag: str) -> dict:
    started = time.perf_counter()
    job = engine.submit(GenerationRequest(f"bench-{tag}", engine.render(WORKLOADS[name]), sampling))
    finished = [e for e in job.events() if isinstance(e, Finished)][0]
    total = time.perf_counter() - started
    decode_s = finished.total_s - finished.ttft_s
    return {"tokens": finished.output_token_ids, "n_output": finished.n_output_tokens, "turn_s": total,
            "ttft_s": finished.ttft_s, "decode_tps": (finished.n_output_tokens - 1) / decode_s if decode_s > 0 else 0.0,
            "drafted": finished.n_draft_tokens, "accepted": finished.n_draft_accepted}


def floor(engine: Engine, name: str, max_tokens: int) -> float:
    """Decode tok/s of a bare mlx-lm ``generate_step`` loop on the same prompt tokens."""
    loaded, prompt = loaded_model(engine), engine.render(WORKLOADS[name]).token_ids
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens,
                          sampler=lambda lp: mx.argmax(lp, axis=-1), prefill_step_size=256,
                          prompt_cache=make_prompt_cache(loaded.model))
    first, n = None, 0
    for n, _ in enumerate(steps, 1):
        if n == 1:
            first = time.perf_counter()
    assert first is not None
    return (n - 1) / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--together", action="store_true", help="send the workloads at once")
    args = parser.parse_args()
    engine = start_engine(ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct"))
    if args.together:
        try:
            together(engine, args)
        finally:
            engine.stop()
        return
    try:
        runs = []
        for name in args.workloads:
            greedy = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
            results: dict[str, list[dict]] = {"off": [], "on": []}
            for round_ in range(args.rounds):
                order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
                for mode in order:
                    sampling = dataclasses.replace(greedy, speculate=mode == "on")
                    results[mode].append(turn(engine, name, sampling, f"{name}-{mode}-{round_}"))
            off, on = (max(results[m], key=lambda r: r["decode_tps"]) for m in ("off", "on"))
            same = all(r["tokens"] == results["off"][0]["tokens"] for r in results["off"] + results["on"]) \
                if args.temperature == 0 else None
            runs.append({"workload": name, "n_output": on["n_output"], "same_output": same,
                         "floor_tps": floor(engine, name, on["n_output"]),
                         "off_tps": off["decode_tps"], "on_tps": on["decode_tps"],
                         "off_turn_s": off["turn_s"], "on_turn_s": on["turn_s"],
                         "drafted": on["drafted"], "accepted": on["accepted"],
                         "acceptance": on["accepted"] / on["drafted"] if on["drafted"] else 0.0})
            print(f"{name} done", file=sys.stderr)
    finally:
        engine.stop()
    print_table(["reply", "tokens", "mlx-lm tok/s", "off tok/s", "on tok/s", "speed-up", "off turn s", "on turn s",
                 "accepted", "same"],
                [[r["workload"], r["n_output"], r["floor_tps"], r["off_tps"], r["on_tps"], r["on_tps"] / r["off_tps"],
                  r["off_turn_s"], r["on_turn_s"], f"{r['accepted']}/{r['drafted']} ({r['acceptance']:.0%})",
                  r["same_output"]] for r in runs])
    name = "speculation" if args.temperature == 0 else f"speculation-t{args.temperature:g}"
    path = write_results(name, {"device": device(), "blas": blas_in_use(), "args": vars(args),
                                         "runs": runs})
    print(f"wrote {path}")
    plot(runs, name)


def together(engine: Engine, args: argparse.Namespace) -> None:
    """The workloads sent at once, speculation off and on in alternating rounds."""
    results: dict[str, list[dict]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        for mode in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
            sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                      speculate=mode == "on")
            turns: dict[str, dict] = {}
            started = time.perf_counter()

            def one(name: str, tag: str, sampling: SamplingParams = sampling, turns: dict = turns) -> None:
                turns[name] = turn(engine, name, sampling, tag)

            threads = [threading.Thread(target=one, args=(name, f"{name}-{mode}-{round_}-together"))
                       for name in args.workloads]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            results[mode].append({"all_s": time.perf_counter() - started, "turns": turns})
            print(f"round {round_} {mode}: {results[mode][-1]['all_s']:.1f} s", file=sys.stderr)
    off, on = (min(results[m], key=lambda r: r["all_s"]) for m in ("off", "on"))
    runs = []
    for name in args.workloads:
        a, b = off["turns"][name], on["turns"][name]
        runs.append({"workload": name, "n_output": b["n_output"],
                     "same_output": a["tokens"] == b["tokens"] if args.temperature == 0 else None,
                     "off_tps": a["decode_tps"], "on_tps": b["decode_tps"], "off_turn_s": a["turn_s"],
                     "on_turn_s": b["turn_s"], "drafted": b["drafted"], "accepted": b["accepted"],
                     "acceptance": b["accepted"] / b["drafted"] if b["drafted"] else 0.0})
    print_table(["reply (all at once)", "tokens", "off tok/s", "on tok/s", "speed-up", "off turn s", "on turn s",
                 "accepted", "same"],
                [[r["workload"], r["n_output"], r["off_tps"], r["on_tps"], r["on_tps"] / r["off_tps"],
                  r["off_turn_s"], r["on_turn_s"], f"{r['accepted']}/{r['drafted']} ({r['acceptance']:.0%})",
                  r["same_output"]] for r in runs])
    print(f"all replies ended: off {off['all_s']:.1f} s, on {on['all_s']:.1f} s ({off['all_s'] / on['all_s']:.2f}x)")
    path = write_results("speculation-together", {"device": device(), "blas": blas_in_use(), "args": vars(args),
                                                  "all_s": {"off": off["all_s"], "on": on["all_s"]}, "runs": runs})
    print(f"wrote {path}")
    plot(runs, "speculation-together")


def plot(runs: list[dict], name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names = [r["workload"] for r in runs]
    width = 0.27
    bars = [(key, label) for key, label in (("floor_tps", "mlx-lm generate_step"), ("off_tps", "Semantic, drafts off"),
                                            ("on_tps", "Semantic, drafts on")) if key in runs[0]]
    for i, (key, label) in enumerate(bars):
        ax.bar([x + (i - len(bars) + 2) * width for x in range(len(runs))], [r[key] for r in runs], width,
               label=label)
    for x, r in enumerate(runs):
        ax.annotate(f"{r['acceptance']:.0%}", (x + width, r["on_tps"]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(runs)), names)
    ax.set_ylabel("decode tok/s (greedy)")
    ax.set_title("Prompt-lookup speculation, SmolLM2-135M" + (", replies at once" if "together" in name else "")
                 + " (draft acceptance above)", fontsize=9)
    ax.legend(fontsize=7)
    save_plot(fig, name)


if __name__ == "__main__":
    main()
