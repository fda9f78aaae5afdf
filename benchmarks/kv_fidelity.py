"""How close each stored KV format keeps the real models to float KV.

    .venv/bin/python benchmarks/kv_fidelity.py [--contexts 2048] [--long-smollm2 6144] [--long-gemma3 4096]

For SmolLM2-135M and Gemma 3 270M, two texts (the GPL-3 prose and argparse.py), a
prefix of each context length prefilled in float32 and passed through each stored format
(app/engine/fidelity.py: every kv_format through the product's own quantizer):
256 following tokens scored teacher-forced against float KV (top-1 agreement, mean and
max KL, perplexity change); 64 greedy tokens after the 2K prefix compared with float's; and a needle (a
passphrase at the start of ~2K tokens of prose, asked for at the end) per format. The
"auto" column marks the format the model's calibration chose (kv_format "auto").
Prints a table, writes benchmarks/results/kv_fidelity.json and kv_fidelity.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.engine.blas import load_fast_blas  # noqa: E402

load_fast_blas()

import mlx.core as mx  # noqa: E402

from app.cache.formats import KV_FORMATS  # noqa: E402
from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.fidelity import copy_cache, natural_texts, prefill, roundtrip, teacher_forced  # noqa: E402
from app.engine.model import load_model  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import print_table, pyplot, save_plot, write_results  # noqa: E402
from support.kv_fidelity import greedy, greedy_agreement, needle_prompt  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
SCORED = 256
SECRET = "amber-falcon-4172"


def needle(loaded, n_filler: int) -> dict[str, bool]:  # type: ignore[no-untyped-def]
    ids = needle_prompt(loaded.tokenizer, n_filler, SECRET)
    base = prefill(loaded.model, ids[:-1])
    n = len(ids) - 1
    answers = {"float": greedy(loaded.model, copy_cache(base, n), ids[-1], 16)}
    answers |= {name: greedy(loaded.model, roundtrip(base, n, f), ids[-1], 16) for name, f in KV_FORMATS.items()}
    return {name: "4172" in loaded.tokenizer.decode(tokens) for name, tokens in answers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048])
    parser.add_argument("--long-smollm2", type=int, default=6144)
    parser.add_argument("--long-gemma3", type=int, default=4096)
    args = parser.parse_args()
    models_dir = load_settings().models_dir
    texts = natural_texts()
    formats = list(KV_FORMATS)
    results: dict = {"formats": {f: {"bytes_vs_fp16": KV_FORMATS[f].bytes_vs_fp16} for f in formats}, "models": {}}
    rows = []
    for key, name in MODELS.items():
        loaded = load_model(key, ensure_embedded(models_dir, name))  # calibrated on its first load
        contexts = sorted({*args.contexts, getattr(args, f"long_{key}")})
        model_results: dict = {"contexts": {}, "auto": loaded.kv.format.name}
        for context in contexts:
            started = time.perf_counter()
            per_text = {}
            for text_name, text in texts.items():
                tokens = loaded.tokenizer.encode(text)[:context + SCORED + 1]
                if len(tokens) < context + SCORED + 1:
                    continue
                per_text[text_name] = teacher_forced(loaded.model, tokens, context, KV_FORMATS.values())
            summary = {}
            for f in formats:
                scores = [per_text[t][f] for t in per_text]
                summary[f] = {"top1_agreement": sum(s.top1_agreement for s in scores) / len(scores),
                              "kl_mean": sum(s.kl_mean for s in scores) / len(scores),
                              "kl_max": max(s.kl_max for s in scores),
                              "perplexity_change": sum(s.perplexity_change for s in scores) / len(scores),
                              "texts": sorted(per_text)}
            model_results["contexts"][context] = summary
            print(f"{key} at {context}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        first = min(contexts)
        greedy_matches = {f: 0 for f in formats}
        for text in texts.values():
            tokens = loaded.tokenizer.encode(text)[:first]
            for f, n in greedy_agreement(loaded.model, tokens, formats).items():
                greedy_matches[f] += n
        model_results["greedy_matches_of_64"] = {f: n / len(texts) for f, n in greedy_matches.items()}
        model_results["needle"] = needle(loaded, first)
        results["models"][key] = model_results
        for context, summary in model_results["contexts"].items():
            for f in formats:
                s = summary[f]
                rows.append([key, context, f, f"{KV_FORMATS[f].bytes_vs_fp16:.1%}", f"{s['top1_agreement']:.1%}",
                             f"{s['kl_mean']:.4f}", f"{s['kl_max']:.3f}", f"{s['perplexity_change']:+.2%}",
                             model_results["greedy_matches_of_64"][f] if context == first else "",
                             model_results["needle"][f] if context == first else "",
                             "*" if f == model_results["auto"] else ""])
        print(f"{key}: needle with float KV: {model_results['needle']['float']}", file=sys.stderr)
        del loaded
        mx.clear_cache()
    print_table(["model", "context", "format", "bytes vs FP16", "top-1", "KL mean", "KL max", "ppl change",
                 "greedy /64", "needle", "auto"], rows)
    print(f"wrote {write_results('kv_fidelity', results)}")
    plot(results, formats)


def plot(results: dict, formats: list[str]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, metric, title in zip(axes, ("top1_agreement", "perplexity_change"),
                                 ("top-1 agreement with float KV", "perplexity change vs float KV")):
        labels, width = [], 0.8 / max(1, len(formats))
        series = [(m, c, s) for m, r in results["models"].items() for c, s in r["contexts"].items()]
        for i, f in enumerate(formats):
            ax.bar([j + i * width for j in range(len(series))], [s[f][metric] for _, _, s in series], width, label=f)
        labels = [f"{m}\n{c}" for m, c, _ in series]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(series))], labels)
        ax.set_title(title)
    axes[0].set_ylim(0.8, 1.0)
    axes[0].legend(fontsize=8)
    fig.suptitle("KV formats against float KV, teacher-forced over 256 tokens")
    save_plot(fig, "kv_fidelity")


if __name__ == "__main__":
    main()
