"""Prompt and generation speed of the embedded model with and without OpenBLAS.

Each mode runs in its own process (BLAS must be chosen before MLX loads):

    .venv/bin/python benchmarks/blas_speed.py [--prompt-tokens 256] [--gen-tokens 32]

Prints a table, writes benchmarks/results/blas_speed.json and blas_speed.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, pyplot, save_plot, write_results  # noqa: E402

MODES = {"openblas": "", "reference": "none"}


def measure(blas: str, prompt_tokens: int, gen_tokens: int) -> dict[str, float | str]:
    """Runs inside the child process."""
    from app.engine.blas import blas_in_use, load_fast_blas

    load_fast_blas(blas)
    from app.catalog.registry import ensure_embedded
    from app.engine.model import load_model
    from app.settings import load_settings
    from benchmarks.common import generation_speed

    loaded = load_model("smollm2", ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct"))
    return {"blas": blas_in_use(), **generation_speed(loaded, prompt_tokens, gen_tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.prompt_tokens, args.gen_tokens)))
        return
    runs = {}
    for mode, blas in MODES.items():
        print(f"running {mode} ...", file=sys.stderr)
        out = subprocess.run([sys.executable, __file__, "--child", blas, "--prompt-tokens", str(args.prompt_tokens),
                              "--gen-tokens", str(args.gen_tokens)], capture_output=True, text=True, check=True)
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    fast, slow = runs["openblas"], runs["reference"]
    print_table(["mode", "blas", "prompt tokens", "prefill s", "prompt tok/s", "gen tok/s"],
                [[m, r["blas"], r["prompt_tokens"], r["prefill_s"], r["prompt_tps"], r["gen_tps"]] for m, r in runs.items()])
    ratios = {"prompt_speedup": fast["prompt_tps"] / slow["prompt_tps"], "gen_speedup": fast["gen_tps"] / slow["gen_tps"]}
    print(f"OpenBLAS speed-up: prompt {ratios['prompt_speedup']:.1f}x, generation {ratios['gen_speedup']:.1f}x")
    print(f"wrote {write_results('blas_speed', {'runs': runs, 'ratios': ratios})}")
    plot(runs)


def plot(runs: dict[str, dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, title in zip(axes, ("prompt_tps", "gen_tps"), ("prompt tokens/s", "generated tokens/s")):
        ax.bar(list(runs), [r[key] for r in runs.values()], color=["tab:green", "tab:red"])
        ax.set_title(title)
        ax.set_yscale("log")
    fig.suptitle("SmolLM2-135M float32 on MLX CPU: OpenBLAS vs bundled reference BLAS")
    save_plot(fig, "blas_speed")


if __name__ == "__main__":
    main()
