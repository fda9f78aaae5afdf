"""The same model stored three ways: size on disk, load time, prompt and generation speed.

    .venv/bin/python benchmarks/weights.py [--prompt-tokens 512] [--gen-tokens 32]

SmolLM2-135M imported from its GGUF as float32 (the default here), as bfloat16
(``--dtype bfloat16``: half the disk; the CPU backend casts it to float32 at load)
and as 4-bit (``--quantize 4``: what ``mlx_lm.convert -q`` writes), each loaded the
way the server loads it (app.engine.model.load_model) and timed greedily in this
process with OpenBLAS. Prints a table, writes benchmarks/results/weights.json and .png.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.blas import blas_in_use, load_fast_blas  # noqa: E402

load_fast_blas()

from app.catalog.embedded import SMOLLM2, locate_gguf  # noqa: E402
from app.catalog.gguf_import import ImportOptions, import_gguf  # noqa: E402
from app.engine.model import load_model  # noqa: E402
from benchmarks.common import generation_speed, print_table, pyplot, save_plot, write_results  # noqa: E402

VARIANTS = {
    "float32": ImportOptions(dtype="float32"),
    "bfloat16": ImportOptions(dtype="bfloat16"),
    "4-bit": ImportOptions(dtype="float32", quantize_bits=4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=32)
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        source = locate_gguf(SMOLLM2, Path(scratch))
        for name, options in VARIANTS.items():
            print(f"importing and timing {name} ...", file=sys.stderr)
            directory = Path(scratch) / name
            start = time.perf_counter()
            import_gguf(source, directory, options, progress=False)
            imported = time.perf_counter()
            loaded = load_model(name, directory)
            loaded_at = time.perf_counter()
            disk = sum(f.stat().st_size for f in directory.glob("model*.safetensors"))
            runs[name] = {"disk_bytes": disk, "import_s": imported - start, "load_s": loaded_at - imported,
                          "compute_dtype": loaded.dtype,
                          **generation_speed(loaded, args.prompt_tokens, args.gen_tokens)}
            del loaded
    print_table(["weights", "disk MB", "import s", "load s", "prompt tok/s", "gen tok/s"],
                [[n, r["disk_bytes"] / 1e6, r["import_s"], r["load_s"], r["prompt_tps"], r["gen_tps"]]
                 for n, r in runs.items()])
    print(f"wrote {write_results('weights', {'blas': blas_in_use(), 'runs': runs})}")
    plot(runs)


def plot(runs: dict[str, dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    for ax, key, title in zip(axes, ("disk_bytes", "prompt_tps", "gen_tps"),
                              ("weights on disk (bytes)", "prompt tokens/s", "generated tokens/s")):
        ax.bar(list(runs), [r[key] for r in runs.values()], color=["tab:blue", "tab:green", "tab:orange"])
        ax.set_title(title)
    fig.suptitle("SmolLM2-135M on MLX CPU (OpenBLAS): float32 vs bfloat16 vs 4-bit weights")
    save_plot(fig, "weights")


if __name__ == "__main__":
    main()
