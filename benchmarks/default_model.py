"""Which embedded model should ``./scripts/serve`` serve? The measurements that decide it.

    .venv/bin/python benchmarks/default_model.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b \
        qwen2.5-coder-1.5b] [--samples 3] [--prefill-tokens 2000]

For each embedded model (installed first if missing; the install is not timed), one real
``semantic serve`` is started in a fresh home, and these are measured:

- **first start**: seconds from the server's spawn to the end of its first answer (the
  weights' load, the KV format chosen from the shipped calibration record, one short turn);
- **right answers** on six short questions with checkable answers (a fact, arithmetic, two
  Python functions run against their tests, a shell command, a Python expression), each
  asked ``--samples`` times at the server's default sampling (what a client that sends no
  ``temperature`` gets) and once greedy (``temperature: 0``);
- **tool calls**: three agent requests through the Anthropic API with the tools an agent
  offers (read a file, run a command, write a file), each ``--samples`` times at the
  default sampling and once greedy: a call counts when it is a ``tool_use`` block naming
  the right tool with the argument the request asks for;
- **speed**: a cold ``--prefill-tokens`` prompt's time to first token (prefill tok/s), and
  decode tok/s of a 64-token greedy reply; the seconds a Claude Code first request of
  9,400 tokens would prefill at that rate;
- the model's size on disk and the server's resident memory after the run.

Prints a table, writes benchmarks/results/default_model.json and default_model.png.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import http_client, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.interleave import text_of  # noqa: E402
from benchmarks.peers import chat  # noqa: E402
from support.servers import start_server, stop_server  # noqa: E402

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
CLAUDE_CODE_PROMPT_TOKENS = 9400  # Claude Code 2.1.197's first request (the real-models issue)


def _code(reply: str) -> str:
    """The reply's first fenced block, or the reply itself."""
    match = re.search(r"```[a-zA-Z0-9]*\n(.*?)```", reply, re.S)
    return match[1] if match else reply


def _python_passes(tests: str) -> Callable[[str], bool]:
    """A check that runs the reply's code, then ``tests`` (asserts), in a child Python."""
    def check(reply: str) -> bool:
        program = _code(reply) + "\n" + tests + "\nprint('ok')\n"
        try:
            out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return out.stdout.strip().endswith("ok")
    return check


def _says(pattern: str) -> Callable[[str], bool]:
    return lambda reply: re.search(pattern, reply, re.I) is not None


QUESTIONS: list[tuple[str, str, Callable[[str], bool]]] = [
    ("fact", "What is the capital of France? Answer in one word.", _says(r"\bparis\b")),
    ("arithmetic", "What is 17 + 25? Answer with the number only.", _says(r"\b42\b")),
    ("python is_prime", "Write a Python function is_prime(n) that returns True when n is a prime number. "
     "Reply with only the code.",
     _python_passes("assert [n for n in range(20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]")),
    ("python reverse_words", "Write a Python function reverse_words(s) that returns the words of the string s "
     "in reverse order, joined by single spaces. Reply with only the code.",
     _python_passes("assert reverse_words('a bc d') == 'd bc a'")),
    ("shell", "Write one shell command that counts the lines of the file notes.txt. Reply with only the command.",
     _says(r"wc\s+-l")),
    ("python value", "In Python, what is the value of len([1, [2, 3], 4])? Answer with the number only.",
     _says(r"^\W*3\b")),
]

TOOLS = [
    {"name": "read_file", "description": "Read a file of the project and return its text.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "bash", "description": "Run a shell command in the project's directory and return its output.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "write_file", "description": "Write text to a file of the project, creating it if missing.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                      "required": ["path", "content"]}},
]
TOOL_TASKS: list[tuple[str, str, str, str, str]] = [
    # (name, request, the tool, its argument, what the argument must hold)
    ("read", "Read the file src/main.py.", "read_file", "path", "src/main.py"),
    ("run", "Run the test suite with pytest.", "bash", "command", "pytest"),
    ("write", "Create a file hello.py that prints hello world.", "write_file", "path", "hello.py"),
]
AGENT_SYSTEM = "You are a coding agent. Use the tools to act on the user's project."


def message(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http_client().post(f"{url}/v1/messages", json=body, timeout=900)
    response.raise_for_status()
    return response.json()


def reply_text(payload: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in payload["content"] if block["type"] == "text")


def ask(url: str, question: str, temperature: float | None) -> str:
    body: dict[str, Any] = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": question}]}
    if temperature is not None:
        body["temperature"] = temperature
    return reply_text(message(url, body))


def tool_call(url: str, request: str, tool: str, argument: str, holds: str,
              temperature: float | None) -> tuple[bool, list[dict[str, Any]]]:
    """Whether the reply calls ``tool`` with ``argument`` holding ``holds``, and the reply's blocks."""
    body: dict[str, Any] = {"model": "m", "max_tokens": 200, "system": AGENT_SYSTEM, "tools": TOOLS,
                            "messages": [{"role": "user", "content": request}]}
    if temperature is not None:
        body["temperature"] = temperature
    blocks = message(url, body)["content"]
    calls = [b for b in blocks if b["type"] == "tool_use"]
    return any(c["name"] == tool and holds in str(c["input"].get(argument, "")) for c in calls), blocks


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def disk_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def measure(name: str, samples: int, prefill_tokens: int) -> dict[str, Any]:
    model_dir = ensure_embedded(load_settings().models_dir, name)
    home = Path(tempfile.mkdtemp(prefix=f"semantic-default-{name}-"))
    spawned = time.perf_counter()
    server = start_server(home, model_dir, timeout_s=900)
    try:
        healthy_s = time.perf_counter() - spawned
        ask(server.url, "Say hello.", 0)
        first_answer_s = time.perf_counter() - spawned
        kv = http_client().get(f"{server.url}/health").json().get("kv_format")
        answers: dict[str, dict[str, Any]] = {}
        for label, question, check in QUESTIONS:
            sampled = [ask(server.url, question, None) for _ in range(samples)]
            greedy = ask(server.url, question, 0)
            answers[label] = {"sampled_right": sum(map(check, sampled)), "greedy_right": check(greedy),
                              "greedy": greedy, "sampled": sampled}
            print(f"  {name} {label}: {answers[label]['sampled_right']}/{samples} sampled, "
                  f"greedy {'right' if check(greedy) else 'wrong'}", file=sys.stderr)
        tools: dict[str, dict[str, Any]] = {}
        for label, request, tool, argument, holds in TOOL_TASKS:
            sampled_calls = [tool_call(server.url, request, tool, argument, holds, None) for _ in range(samples)]
            greedy_call = tool_call(server.url, request, tool, argument, holds, 0)
            tools[label] = {"sampled_right": sum(right for right, _ in sampled_calls), "greedy_right": greedy_call[0],
                            "greedy": greedy_call[1], "sampled": [blocks for _, blocks in sampled_calls]}
            print(f"  {name} tool {label}: {tools[label]['sampled_right']}/{samples} sampled, "
                  f"greedy {'right' if greedy_call[0] else 'wrong'}", file=sys.stderr)
        cold = chat(server.url, "m", [{"role": "user", "content": text_of(prefill_tokens, 7)}], 1)
        prefill_tps = (cold["prompt_tokens"] or prefill_tokens) / cold["ttft_s"]
        reply = chat(server.url, "m", [{"role": "user", "content": "Write a Python class for a bank account "
                                        "with deposit and withdraw methods."}], 64)
        n = reply["completion_tokens"] or 0
        decode_tps = (n - 1) / (reply["last_token_s"] - reply["ttft_s"]) if n > 1 else 0.0
        rss = rss_mib(server.process.pid)
    finally:
        stop_server(server)
    return {"healthy_s": healthy_s, "first_answer_s": first_answer_s, "kv_format": kv, "answers": answers,
            "tools": tools, "prefill_tps": prefill_tps, "prefill_prompt_tokens": cold["prompt_tokens"],
            "decode_tps": decode_tps, "claude_code_first_prefill_s": CLAUDE_CODE_PROMPT_TOKENS / prefill_tps,
            "disk_mib": disk_mib(model_dir), "rss_mib": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    args = parser.parse_args()
    results = {name: measure(name, args.samples, args.prefill_tokens) for name in args.models}
    n_q, n_t, s = len(QUESTIONS), len(TOOL_TASKS), args.samples
    rows = []
    for name, r in results.items():
        rows.append([name, r["first_answer_s"],
                     f"{sum(a['sampled_right'] for a in r['answers'].values())}/{n_q * s}",
                     f"{sum(a['greedy_right'] for a in r['answers'].values())}/{n_q}",
                     f"{sum(t['sampled_right'] for t in r['tools'].values())}/{n_t * s}",
                     f"{sum(t['greedy_right'] for t in r['tools'].values())}/{n_t}",
                     r["prefill_tps"], r["decode_tps"], r["claude_code_first_prefill_s"], r["disk_mib"],
                     r["rss_mib"], r["kv_format"]])
    print_table(["model", "first answer (s)", "right, default sampling", "right, greedy", "tool calls, default",
                 "tool calls, greedy", "prefill tok/s", "decode tok/s", "9.4K prefill (s)", "disk MiB",
                 "RSS MiB", "KV"], rows)
    path = write_results("default_model", {"args": vars(args), "models": results})
    print(f"wrote {path}")
    plot(results, args.samples)


def plot(results: dict[str, Any], samples: int) -> None:
    """Per model: the share of right answers and tool calls (default sampling and greedy),
    and the speeds."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(results)
    shares = {
        "answers, default": [sum(a["sampled_right"] for a in r["answers"].values()) / (len(QUESTIONS) * samples)
                             for r in results.values()],
        "answers, greedy": [sum(a["greedy_right"] for a in r["answers"].values()) / len(QUESTIONS)
                            for r in results.values()],
        "tool calls, default": [sum(t["sampled_right"] for t in r["tools"].values()) / (len(TOOL_TASKS) * samples)
                                for r in results.values()],
        "tool calls, greedy": [sum(t["greedy_right"] for t in r["tools"].values()) / len(TOOL_TASKS)
                               for r in results.values()],
    }
    width = 0.8 / len(shares)
    for i, (label, values) in enumerate(shares.items()):
        left.bar([x + i * width for x in range(len(names))], values, width, label=label)
    left.set_xticks([x + width * (len(shares) - 1) / 2 for x in range(len(names))], names, fontsize=8)
    left.set_ylabel("share right")
    left.set_ylim(0, 1.05)
    left.legend(fontsize=7)
    speeds = {"prefill tok/s": [r["prefill_tps"] for r in results.values()],
              "decode tok/s": [r["decode_tps"] for r in results.values()]}
    for i, (label, values) in enumerate(speeds.items()):
        right.bar([x + i * 0.4 for x in range(len(names))], values, 0.4, label=label)
    right.set_xticks([x + 0.2 for x in range(len(names))], names, fontsize=8)
    right.set_yscale("log")
    right.legend(fontsize=7)
    fig.suptitle("The embedded models on this machine (benchmarks/default_model.py)")
    save_plot(fig, "default_model")


if __name__ == "__main__":
    main()
