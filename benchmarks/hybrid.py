"""Issue 37 item 4: one agent conversation on a hybrid (Qwen3.5-shaped) model, Semantic
against mlx_lm.server, with the bytes Semantic keeps on disk after each turn.

    .venv/bin/python benchmarks/hybrid.py [--model DIR] [--layers 4] [--turns 16] \
        [--system-tokens 400] [--turn-tokens 80] [--reply-tokens 16] [--servers semantic mlx_lm]

Without --model it makes a random 4-bit model of Qwen3.5-0.8B's shape with ``--layers``
layers (benchmarks/synthetic.py; 3 of every 4 layers Gated DeltaNet, whose recurrent
state Semantic keeps as checkpoints in the conversation's record file). The
conversation is peers.py's (same client, OpenAI chat completions, streamed, greedy):
a system prompt, ``--turns`` turns, then a SIGKILL and one more turn on the restarted
server. Per turn: TTFT, prompt and cached tokens as the server reports them, and for
Semantic (once the turn's cache is on disk) the bytes of its home's blocks directory,
of its record files and of the checkpoints in them. mlx_lm.server keeps one prompt
cache in memory: nothing on disk, nothing after a restart.

From the measured bytes it computes (and labels as computed) what one 84K-token
conversation would keep on disk for the real shape: the checkpoints' bytes per
recurrent layer times the real shape's recurrent layers times the bound per
conversation (``checkpoints.MAX_CHECKPOINTS``), and the attention KV's bytes per token
per attention layer times the real shape's attention layers times 84K.
Writes benchmarks/results/NAME.json and NAME.png (NAME: hybrid).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import start_server  # noqa: E402  (first: it binds MLX to OpenBLAS before MLX loads)
from app.cache.checkpoints import MAX_CHECKPOINTS  # noqa: E402
from app.cache.files import CHECKPOINT_PREFIX  # noqa: E402
from benchmarks import peers, synthetic  # noqa: E402
from benchmarks.common import RESULTS, device, machine, print_table, pyplot, save_plot, write_results  # noqa: E402
from support.dbcheck import query  # noqa: E402

SHAPE = "qwen3.5-0.8b"
SESSION_TOKENS = 84_000  # the session oMLX reported 282.7 GB of SSD cache for
OMLX_GB = 282.7


def safetensors_bytes(path: Path, prefix: str = "") -> int:
    """Bytes of the tensors in a safetensors file whose names start with ``prefix``."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return sum(end - start for name, entry in header.items() if name != "__metadata__" and name.startswith(prefix)
               for start, end in [entry["data_offsets"]])


def disk(home: Path) -> dict[str, int]:
    """What Semantic's ``home`` keeps on disk: the blocks directory's bytes, its record
    files' bytes, and the bytes and count of the checkpoints in the record files."""
    blocks = home / "blocks"
    files = [p for p in blocks.rglob("*.safetensors") if p.is_file()]
    records = [p for p in files if p.parent.name == "conversations"]
    checkpoints = 0
    for record in records:
        with record.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            meta = json.loads(handle.read(length)).get("__metadata__", {})
        checkpoints += len(json.loads(meta.get("checkpoints", "[]")))
    return {"blocks_dir_bytes": sum(p.stat().st_size for p in blocks.rglob("*") if p.is_file()),
            "record_bytes": sum(p.stat().st_size for p in records),
            "checkpoint_bytes": sum(safetensors_bytes(p, CHECKPOINT_PREFIX) for p in records),
            "checkpoints": checkpoints}


def semantic_probe(home: Path, timeout_s: float = 120) -> Any:
    """After a turn: wait until its cache (prompt and reply) is on disk, then measure ``disk``."""
    def probe(record: dict[str, Any]) -> dict[str, Any]:
        want = (record["prompt_tokens"] or 0) + (record["completion_tokens"] or 0) - 1
        deadline = time.monotonic() + timeout_s
        stored = 0
        while time.monotonic() < deadline:
            stored = query(home / "semantic.db", "SELECT max(n_tokens) FROM caches")[0][0] or 0
            if stored >= want:
                break
            time.sleep(0.1)
        return {"stored_tokens": stored, **disk(home)}
    return probe


def layer_kinds(model_dir: Path) -> tuple[int, int]:
    """(attention layers, recurrent layers) of a Qwen3.5-shaped config."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    n, interval = config["num_hidden_layers"], config["full_attention_interval"]
    attention = n // interval
    return attention, n - attention


def extrapolate(turns: list[dict[str, Any]], model_dir: Path) -> dict[str, Any]:
    """Disk for one SESSION_TOKENS conversation on the real shape, computed from the last
    measured turn before the restart."""
    last = [t for t in turns if t.get("checkpoints")][-1]
    attention, recurrent = layer_kinds(model_dir)
    real = synthetic.shape_config(SHAPE)
    real_attention = real["num_hidden_layers"] // real["full_attention_interval"]
    real_recurrent = real["num_hidden_layers"] - real_attention
    per_checkpoint_layer = last["checkpoint_bytes"] / last["checkpoints"] / recurrent
    kv = last["blocks_dir_bytes"] - last["checkpoint_bytes"]  # blocks, and the records' tails and tokens
    per_token_layer = kv / last["stored_tokens"] / attention
    checkpoints = per_checkpoint_layer * real_recurrent * MAX_CHECKPOINTS
    attention_kv = per_token_layer * real_attention * SESSION_TOKENS
    return {"shape": SHAPE, "session_tokens": SESSION_TOKENS, "checkpoint_bytes_per_recurrent_layer":
            per_checkpoint_layer, "kv_bytes_per_token_per_attention_layer": per_token_layer,
            "real_recurrent_layers": real_recurrent, "real_attention_layers": real_attention,
            "bytes_per_checkpoint": per_checkpoint_layer * real_recurrent, "max_checkpoints": MAX_CHECKPOINTS,
            "checkpoints_bytes": checkpoints, "attention_kv_bytes": attention_kv,
            "total_bytes": checkpoints + attention_kv, "omlx_gb": OMLX_GB}


def report(servers: dict[str, dict], computed: dict[str, Any] | None) -> None:
    labels = [t["turn"] for t in next(iter(servers.values()))["turns"]]
    headers = ["turn", "prompt"]
    for name in servers:
        headers += [f"{peers.NAMES[name]} TTFT s", "cached"]
    headers += ["Semantic disk KiB", "records KiB", "checkpoints", "checkpoint KiB"] if "semantic" in servers else []
    rows = []
    for i, label in enumerate(labels):
        row: list[Any] = [label, next(iter(servers.values()))["turns"][i]["prompt_tokens"]]
        for result in servers.values():
            turn = result["turns"][i]
            row += [turn["ttft_s"], "-" if turn["cached_tokens"] is None else turn["cached_tokens"]]
        if "semantic" in servers:
            turn = servers["semantic"]["turns"][i]
            row += [turn["blocks_dir_bytes"] // 1024, turn["record_bytes"] // 1024, turn["checkpoints"],
                    turn["checkpoint_bytes"] // 1024]
        rows.append(row)
    print_table(headers, rows)
    if computed:
        print(f"\ncomputed for {computed['shape']} at {computed['session_tokens']} tokens: "
              f"{computed['bytes_per_checkpoint'] / 2**20:.1f} MiB per checkpoint x {computed['max_checkpoints']} = "
              f"{computed['checkpoints_bytes'] / 1e9:.2f} GB of checkpoints + "
              f"{computed['attention_kv_bytes'] / 1e9:.2f} GB of attention KV = {computed['total_bytes'] / 1e9:.2f} GB "
              f"(oMLX: {computed['omlx_gb']} GB)")


def plot(name: str, servers: dict[str, dict], where: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ttft, space) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [t["turn"] for t in next(iter(servers.values()))["turns"]]
    for key, result in servers.items():
        ttft.plot(range(len(labels)), [t["ttft_s"] for t in result["turns"]], "o-", label=peers.NAMES[key])
    ttft.set_xticks(range(len(labels)), labels, fontsize=7, rotation=45, ha="right")
    ttft.set_yscale("log")
    ttft.set_ylabel("time to first token (s)")
    ttft.set_title(f"Hybrid agent conversation, {where}", fontsize=9)
    ttft.legend()
    if "semantic" in servers:
        turns = servers["semantic"]["turns"]
        for key, label in (("blocks_dir_bytes", "blocks dir (all)"), ("record_bytes", "record files"),
                           ("checkpoint_bytes", "checkpoints in them")):
            space.plot(range(len(labels)), [t[key] / 2**20 for t in turns], "o-", label=label)
        space.set_xticks(range(len(labels)), labels, fontsize=7, rotation=45, ha="right")
        space.set_ylabel("Semantic on disk (MiB)")
        space.legend(fontsize=8)
    save_plot(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a Qwen3.5-shaped MLX model directory (default: synthetic)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the synthetic model")
    parser.add_argument("--turns", type=int, default=16, help="turns before the SIGKILL")
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--turn-tokens", type=int, default=80)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--servers", nargs="+", choices=["semantic", "mlx_lm"], default=["semantic", "mlx_lm"])
    parser.add_argument("--semantic-env", action="append", default=["SEMANTIC_KV_FORMAT=q8"], metavar="KEY=VALUE")
    parser.add_argument("--name", default="hybrid")
    args = parser.parse_args()

    scratch = peers.SCRATCH / args.name
    shutil.rmtree(scratch, ignore_errors=True)  # no server starts from an earlier run's disk cache
    scratch.mkdir(parents=True)
    model_dir = args.model.resolve() if args.model else scratch / "model"
    if not args.model:
        made = synthetic.make(SHAPE, model_dir, layers=args.layers)
        print(f"made {made['shape']} with {made['layers']} layers in {made['seconds']:.1f} s", file=sys.stderr)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    long_turns = args.turns - 1  # and one short turn, then one after the SIGKILL
    max_context = args.system_tokens + long_turns * args.turn_tokens + (long_turns - 1) * args.reply_tokens
    conversation = peers.plan(lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
                              system_tokens=args.system_tokens, turn_tokens=args.turn_tokens,
                              max_context=max_context, reply_tokens=args.reply_tokens, restarts=("SIGKILL",))
    semantic_env = dict(pair.split("=", 1) for pair in args.semantic_env)
    home = scratch / "semantic"
    contenders = {
        "semantic": peers.Contender("semantic", "default", lambda: start_server(home, model_dir, semantic_env),
                                    f"commit {machine()['commit']}", semantic_probe(home)),
        "mlx_lm": peers.Contender("mlx_lm", peers.MLX_LM_MODEL,
                                  lambda: peers.mlx_lm_server(model_dir, scratch / "mlx_lm.log"),
                                  f"mlx-lm {version('mlx-lm')}"),
    }
    where = device()
    servers = {key: peers.converse(contenders[key], conversation, args.reply_tokens) for key in args.servers}
    computed = extrapolate(servers["semantic"]["turns"], model_dir) if "semantic" in servers else None
    write_results(args.name, {"args": {**vars(args), "model": str(model_dir)}, "device": where,
                              "conversation": {"system": conversation.system, "turns": [t.label for t in conversation.turns]},
                              "servers": servers, "computed": computed})
    report(servers, computed)
    plot(args.name, servers, f"{SHAPE} x{layer_kinds(model_dir)[0] + layer_kinds(model_dir)[1]} layers, "
                             f"{where['name']}")
    print(f"wrote {RESULTS / f'{args.name}.json'}")


if __name__ == "__main__":
    main()
