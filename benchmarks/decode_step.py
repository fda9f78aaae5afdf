"""What one batched decode step costs on this machine: the ceiling under workload 4.

    .venv/bin/python benchmarks/decode_step.py [--contexts 32 512 1024] [--batches 1 2 4 8] [--rounds 6]

For SmolLM2-135M, the median time of one decode step with B sequences at a
context of L tokens (every case measured in every round, so the VM's drift
hits all alike), measured these ways:

- ``floor``: one token of a bare mlx-lm ``generate_step`` loop (one sequence, its own
  ``KVCache``, the next step queued before the current token is read): what
  mlx-lm's own generation costs, the floor under the engine's one-sequence step;
- ``model``: the bare mlx-lm forward pass over a ``(B, 1)`` batch with one
  shared float ``KVCache`` (no engine at all), then an argmax;
- ``engine``: the server's own ``DecodeBatch`` (mlx-lm's ``GenerationBatch``,
  caches of different lengths left-padded, per-sequence samplers), on the plain
  path (OpenBLAS's own threads);
- ``split``: the same batches as the server runs them: split over both cores
  when several sequences decode (``app/engine/cores.py``); "x one" against the
  engine's one sequence, which is never split;
- ``matmul``: the 60 projection matmuls of 30 layers' MLPs alone (576x1536 and
  1536x576, float32 through BLAS), the part of a step that reads the weights.

"x one" is the aggregate tokens per second against one sequence: what batching
can give at best here, whatever the scheduler does. Prints a table, writes
benchmarks/results/decode_step.json and decode_step.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.blas import blas_in_use, load_fast_blas  # noqa: E402

load_fast_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from mlx_lm.sample_utils import greedy_sampler  # noqa: E402

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.batch import DecodeBatch, prefill  # noqa: E402
from app.engine.model import load_model  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import print_table, pyplot, save_plot, write_results  # noqa: E402


Step = Callable[[], None]


def model_step(model, batch: int, context: int) -> Step:  # type: ignore[no-untyped-def]
    cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([[1] * context] * batch), cache=cache))
    token = mx.array([[1]] * batch)
    return lambda: mx.eval(mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1))


def floor_step(model, context: int) -> Step:  # type: ignore[no-untyped-def]
    """The next token of an endless greedy ``generate_step`` loop over a ``context``-token prompt."""
    steps = generate_step(mx.array([1] * context), model, max_tokens=-1, sampler=greedy_sampler)
    next(steps)
    return lambda: next(steps) and None


def engine_step(model, batch: int, context: int) -> Step:  # type: ignore[no-untyped-def]
    decoding = DecodeBatch(model)
    for uid in range(batch):  # contexts differ by a token each, as real agents' do
        cache = [KVCache() for _ in model.layers]
        prefill(model, cache, [1] * (context - 1 + uid))
        decoding.add(uid, cache, 1, [1] * (context - 1 + uid), greedy_sampler, [])
    return lambda: decoding.step() and None


def matmul_step(batch: int) -> Step:
    up = [mx.random.normal((1536, 576)) * 0.02 for _ in range(30)]
    down = [mx.random.normal((576, 1536)) * 0.02 for _ in range(30)]
    x = mx.random.normal((batch, 576))
    mx.eval(up, down, x)

    def step() -> None:
        y = x
        for a, b in zip(up, down):
            y = (y @ a.T) @ b.T
        mx.eval(y)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 512, 1024])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each case per round")
    args = parser.parse_args()
    loaded = load_model("smollm2", ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct"), split_cores=True)
    model, cores = loaded.model, loaded.cores
    cases: list[tuple[dict, Step, bool]] = []  # (run, step, split)
    for batch in args.batches:
        cases.append(({"kind": "matmul", "context": 0, "batch": batch}, matmul_step(batch), False))
    for context in args.contexts:
        cases.append(({"kind": "floor", "context": context, "batch": 1}, floor_step(model, context), False))
        for batch in args.batches:
            cases.append(({"kind": "model", "context": context, "batch": batch}, model_step(model, batch, context), False))
            step = engine_step(model, batch, context)
            cases.append(({"kind": "engine", "context": context, "batch": batch}, step, False))
            if cores is not None and batch > 1:  # one sequence is never split: its row is the engine's
                cases.append(({"kind": "split", "context": context, "batch": batch}, step, True))
    times: list[list[float]] = [[] for _ in cases]
    for round_ in range(args.rounds):  # every case in every round: the VM's drift hits all alike
        for (run, step, split), measured in zip(cases, times):
            if cores is not None:
                cores.use(split)
            step()
            for _ in range(args.steps):
                started = time.perf_counter()
                step()
                measured.append(time.perf_counter() - started)
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    if cores is not None:
        cores.use(False)
    runs = [{**run, "step_s": statistics.median(measured)} for (run, _, _), measured in zip(cases, times)]
    one = {(r["kind"], r["context"]): r["step_s"] for r in runs if r["batch"] == 1}
    for r in runs:
        r["tokens_per_s"] = r["batch"] / r["step_s"]
        r["x_one"] = r["tokens_per_s"] * one[("engine" if r["kind"] == "split" else r["kind"], r["context"])]
    for r in runs:  # the engine's one sequence against mlx-lm's own loop
        if r["kind"] == "engine" and r["batch"] == 1:
            r["x_floor"] = one[("floor", r["context"])] / r["step_s"]
    print_table(["measured", "context", "batch", "step ms", "tok/s", "x one"],
                [[r["kind"], r["context"] or "-", r["batch"], r["step_s"] * 1000, r["tokens_per_s"], r["x_one"]]
                 for r in runs])
    for r in runs:
        if "x_floor" in r:
            print(f"context {r['context']}: the engine's one-sequence step runs at {r['x_floor']:.2f}x mlx-lm's "
                  "generate_step loop")
    print(f"wrote {write_results('decode_step', {'blas': blas_in_use(), 'args': vars(args), 'runs': runs})}")
    plot(runs)


def plot(runs: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    series = sorted({(r["kind"], r["context"]) for r in runs})
    contexts = sorted({r["context"] for r in runs if r["context"]})
    for kind, context in series:
        if kind == "floor":
            continue
        points = [r for r in runs if (r["kind"], r["context"]) == (kind, context)]
        if kind == "split":  # its one sequence is the engine's
            points = [r for r in runs if (r["kind"], r["context"], r["batch"]) == ("engine", context, 1)] + points
        label = "MLP matmuls only" if kind == "matmul" else f"{kind}, {context} tokens"
        ax.plot([r["batch"] for r in points], [r["x_one"] for r in points], marker="o",
                color="black" if kind == "matmul" else f"C{contexts.index(context)}",
                linestyle={"model": "--", "engine": ":"}.get(kind, "-"), label=label)
    batches = sorted({r["batch"] for r in runs})
    ax.plot(batches, batches, color="grey", linewidth=0.8, label="free batching")
    ax.axhline(3, color="red", linewidth=0.8, linestyle=":", label="goal at 4 (3x)")
    ax.set_xlabel("sequences in the step")
    ax.set_ylabel("aggregate tok/s, x one sequence")
    ax.set_title("One decode step, SmolLM2-135M, 2-core CPU (split solid)")
    ax.legend(fontsize=7)
    save_plot(fig, "decode_step")


if __name__ == "__main__":
    main()
