"""Workload 1: one agent, turns of ~250 new tokens, up to a context length.

    .venv/bin/python benchmarks/multi_turn.py [--max-context 4096] [--turn-tokens 250]

Per turn, side by side in one run:

* warm: a real `semantic serve` (cache reuse on), streaming over HTTP; TTFT is
  the time to the first text delta, measured by the client;
* cold: a second real server with SEMANTIC_CACHE_REUSE=0, same conversation;
* token-level: mlx-lm alone in this process, float32 cache in memory, reusing
  the longest common *token* prefix (what prefix caches keyed by token ids do);
  it generates its own greedy reply and caches the generated token ids, as a
  token-level server does (a reply re-tokenized in the next prompt may split
  differently: the loss Semantic's character matching avoids);
* floor: mlx-lm alone prefilling exactly the tokens the warm server prefilled,
  on an in-memory cache of the length the warm server reused; everything
  Semantic adds shows up as warm / floor.

Prints a table, writes benchmarks/results/multi_turn.json and multi_turn.png.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.engine.blas import load_fast_blas  # noqa: E402

load_fast_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.model import load_model  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import anthropic_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402

WORDS = ("cache token agent memory server prefix block model turn reply disk quantize layer "
         "context window tool request stream latency budget history restart matrix vector").split()
SYSTEM = "You are a careful assistant. Answer each message with one short sentence."


def user_message(rng: random.Random, n_words: int) -> str:
    sentences = []
    while sum(len(s.split()) for s in sentences) < n_words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    return "Notes: " + " ".join(sentences) + " Summarise."


def stream_ttft(url: str, session: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """(seconds to first text delta, full reply text, final usage) for one streamed turn."""
    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "system": SYSTEM, "messages": messages}
    return anthropic_stream(f"{url}/v1/messages", body, {"X-Claude-Code-Session-Id": session})


class MlxLmAlone:
    """mlx-lm with a float32 in-memory cache, as a single-user server keeps it."""

    def __init__(self, loaded) -> None:  # type: ignore[no-untyped-def]
        self.loaded = loaded
        self.cache = make_prompt_cache(loaded.model)
        self.tokens: list[int] = []

    def prefill(self, tokens: list[int], keep: int) -> float:
        """Keep ``keep`` cached tokens, prefill the rest of ``tokens``; seconds to the first token."""
        for layer in self.cache:
            layer.trim(len(self.tokens) - keep)
        start = time.perf_counter()
        logits = None
        for at in range(keep, len(tokens), 256):
            logits = self.loaded.model(mx.array([tokens[at:at + 256]]), cache=self.cache)
            mx.eval(logits)
        mx.eval(mx.argmax(logits[0, -1]))
        self.tokens = list(tokens)
        return time.perf_counter() - start

    def token_level(self, tokens: list[int]) -> tuple[float, int]:
        common = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            common += 1
        keep = min(common, len(tokens) - 1)
        return self.prefill(tokens, keep), keep

    def generate(self, n_tokens: int, stop_ids: frozenset[int]) -> list[int]:
        """Greedy tokens after the prefilled prompt (the last prompt token is fed first);
        they join the cached ids as generated."""
        for layer in self.cache:
            layer.trim(1)
        token, generated = self.tokens[-1], []
        for _ in range(n_tokens):
            token = int(mx.argmax(self.loaded.model(mx.array([[token]]), cache=self.cache)[0, -1]))
            generated.append(token)
            if token in stop_ids:
                break
        self.tokens += generated
        return generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--turn-tokens", type=int, default=250)
    parser.add_argument("--reply-tokens", type=int, default=32)
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    loaded = load_model("smollm2", model_dir)
    token_level, floor = MlxLmAlone(loaded), MlxLmAlone(loaded)
    rng = random.Random(0)
    home = Path(tempfile.mkdtemp(prefix="semantic-bench-"))
    warm_server = start_server(home / "warm", model_dir)
    cold_server = start_server(home / "cold", model_dir, {"SEMANTIC_CACHE_REUSE": "0"})
    messages: list[dict] = []
    rows, results = [], []
    try:
        while True:
            messages.append({"role": "user", "content": user_message(rng, int(args.turn_tokens * 0.75))})
            rendered = loaded.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, *messages],
                                                            add_generation_prompt=True)
            if len(rendered) + args.reply_tokens >= args.max_context:
                break
            warm_ttft, reply, usage = stream_ttft(warm_server.url, "bench", messages, args.reply_tokens)
            cold_ttft, _, _ = stream_ttft(cold_server.url, f"cold-{len(messages)}", messages, args.reply_tokens)
            tl_ttft, tl_reused = token_level.token_level(rendered)
            reused, new = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
            floor_keep = min(reused, len(floor.tokens))
            floor_ttft = floor.prefill(rendered[:floor_keep + new] if floor_keep + new <= len(rendered) else rendered,
                                       floor_keep)
            own = token_level.generate(args.reply_tokens, loaded.stop_token_ids)
            same_reply = loaded.tokenizer.decode([t for t in own if t not in loaded.stop_token_ids]) == reply
            reply_ids = loaded.tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
            floor.prefill(floor.tokens + reply_ids, len(floor.tokens))  # the floor's cache holds the reply
            messages.append({"role": "assistant", "content": reply})
            context = reused + new
            result = {"turn": len(results) + 1, "context": context, "reused": reused, "new": new,
                      "warm_s": warm_ttft, "cold_s": cold_ttft, "token_level_s": tl_ttft,
                      "token_level_reused": tl_reused, "token_level_same_reply": same_reply, "floor_s": floor_ttft}
            results.append(result)
            rows.append([result["turn"], context, new, warm_ttft, cold_ttft, tl_ttft, floor_ttft,
                         warm_ttft / floor_ttft, cold_ttft / warm_ttft, tl_reused, reused])
            print(f"turn {result['turn']}: context {context}, warm {warm_ttft:.2f}s, cold {cold_ttft:.2f}s, "
                  f"floor {floor_ttft:.2f}s", file=sys.stderr)
    finally:
        stop_server(warm_server)
        stop_server(cold_server)
    print_table(["turn", "context", "new", "warm s", "cold s", "token-level s", "floor s", "warm/floor", "cold/warm",
                 "token-level reused", "Semantic reused"], rows)
    ratios = sorted(r["warm_s"] / r["floor_s"] for r in results)
    last = results[-1]
    summary = {"median_warm_over_floor": ratios[len(ratios) // 2], "at_max_context": {
        "context": last["context"], "warm_over_floor": last["warm_s"] / last["floor_s"],
        "cold_over_warm": last["cold_s"] / last["warm_s"], "cold_over_floor": last["cold_s"] / last["floor_s"]}}
    print(f"median warm/floor over all turns: {summary['median_warm_over_floor']:.2f}; at {last['context']} tokens: "
          f"warm/floor {summary['at_max_context']['warm_over_floor']:.2f}, cold/warm "
          f"{summary['at_max_context']['cold_over_warm']:.1f}x, cold/floor {summary['at_max_context']['cold_over_floor']:.1f}x")
    print(f"wrote {write_results('multi_turn', {'args': vars(args), 'summary': summary, 'turns': results})}")
    plot(results)


def plot(results: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    context = [r["context"] for r in results]
    for key, label in (("cold_s", "cold (reuse off)"), ("token_level_s", "mlx-lm, token-level match"),
                       ("warm_s", "Semantic warm"), ("floor_s", "floor: mlx-lm prefilling only new tokens")):
        ax.plot(context, [r[key] for r in results], marker="o", label=label)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Multi-turn agent, SmolLM2-135M, 2-core CPU")
    save_plot(fig, "multi_turn")


if __name__ == "__main__":
    main()
