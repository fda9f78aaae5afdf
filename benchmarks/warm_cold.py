"""How far each stored KV format moves the answers of a reused cache from a true cold prefill.

    .venv/bin/python benchmarks/warm_cold.py [--formats auto q4c k6v4 q8 f16 f32] [--max-tokens 48]

For SmolLM2-135M and Gemma 3 270M, the fixed conversations of tests/support/warm_cold.py
(multi-turn, and edits in the middle of a word) are played on an engine storing each
format; every compared turn is asked again of an engine with reuse off (the whole prompt
tokenized at once, float KV). Greedy, ``--max-tokens`` per answer. Per format: how many
answers are token for token identical, and the mean (and lowest) fraction of an answer's
text shared before the two diverge. "auto" is the format the model's calibration chose.
Prints a table, writes benchmarks/results/warm_cold.json and warm_cold.png.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.engine.blas import load_fast_blas  # noqa: E402

load_fast_blas()

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.model import kv_choice  # noqa: E402
from app.settings import load_settings  # noqa: E402
from app.types import SamplingParams  # noqa: E402
from benchmarks.common import print_table, pyplot, save_plot, write_results  # noqa: E402
from support.engines import loaded_model, make_engine_at  # noqa: E402
from support.warm_cold import CASES, ColdAnswers, agent_of, answer_pairs  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["auto", "q4c", "k6v4", "q8", "f16", "f32"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    models_dir = load_settings().models_dir
    results: dict = {"max_tokens": args.max_tokens, "cases": [c.name for c in CASES], "models": {}}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for key in args.models:
            model_dir = ensure_embedded(models_dir, MODELS[key])
            cold = make_engine_at(Path(scratch) / key / "cold", model_dir, [], enabled=False, name=key)
            model_results = results["models"][key] = {}
            cold_answers: ColdAnswers = {}  # a prompt the formats share is asked of the cold engine once
            for name in args.formats:
                warm = make_engine_at(Path(scratch) / key / name, model_dir, [agent_of(c) for c in CASES],
                                      kv_format=name, name=key)
                stored = loaded_model(warm).kv_format.name
                pairs = [pair for case in CASES for pair in answer_pairs(warm, cold, case, sampling, cold_answers)]
                warm.stop()
                shared = [p.shared for p in pairs]
                model_results[name] = {
                    "format": stored, "identical": sum(p.identical for p in pairs), "answers": len(pairs),
                    "shared_mean": sum(shared) / len(shared), "shared_min": min(shared),
                    "pairs": [{"case": p.case, "turn": p.turn, "identical": p.identical, "shared": p.shared,
                               "n_cached": p.n_cached, "n_prompt": p.n_prompt} for p in pairs]}
                r = model_results[name]
                rows.append([key, name if name == stored else f"{name} ({stored})",
                             f"{r['identical']}/{r['answers']}", f"{r['shared_mean']:.1%}", f"{r['shared_min']:.1%}"])
                print("  ".join(map(str, rows[-1])), file=sys.stderr)
            cold.stop()
            model_results["auto_is"] = kv_choice(model_dir, "auto").format.name
    print_table(["model", "format", "identical", "text shared (mean)", "lowest"], rows)
    print(f"wrote {write_results('warm_cold', results)}")
    plot(results, args.formats)


def plot(results: dict, formats: list[str]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 3.6))
    models = list(results["models"])
    width = 0.8 / max(1, len(formats))
    for i, name in enumerate(formats):
        ax.bar([j + i * width for j in range(len(models))],
               [results["models"][m][name]["shared_mean"] for m in models], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("answer text shared with cold")
    ax.legend(fontsize=8, ncol=3)
    fig.suptitle(f"Warm (reused cache) against cold prefill, greedy, {results['max_tokens']} tokens")
    save_plot(fig, "warm_cold")


if __name__ == "__main__":
    main()
