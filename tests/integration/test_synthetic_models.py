"""Random-weight models of real shapes (benchmarks/synthetic.py): the tiny one loads with
mlx_lm.load and the project's loader, renders SmolLM2's chat template and generates; the
named shapes have the parameter counts of the models they stand for."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import _get_classes

from app.engine.model import load_model
from app.engine.prompting import render_chat
from app.types import ChatMessage
from benchmarks.synthetic import SHAPES, SPECIAL_TOKENS, make, shape_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("synthetic") / "tiny"
    made = make("tiny", out, tokenizer=smollm2_dir)
    assert made["layers"] == 4 and made["bytes"] < 16 * 2**20
    return out


def first_tokens(model, prompt: list[int], n: int = 3) -> list[int]:  # type: ignore[no-untyped-def]
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, axis=-1))
    return [int(token) for token, _ in steps]


def test_the_tiny_model_loads_with_mlx_lm_and_generates(tiny: Path) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(tiny))
    config = json.loads((tiny / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["vocab_size"] == 49152
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    tokens = first_tokens(model, prompt)
    assert len(tokens) == 3 and all(t >= SPECIAL_TOKENS for t in tokens)  # never an end of turn


def test_the_tiny_model_loads_with_the_project_loader_and_generates(tiny: Path) -> None:
    loaded = load_model("tiny", tiny, kv_format="q8")
    assert loaded.context_length == 32768 and {0, 2} <= loaded.stop_token_ids
    prompt = render_chat(loaded.tokenizer, [ChatMessage("user", "Hello")])
    assert prompt.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert len(first_tokens(loaded.model, list(prompt.token_ids), 1)) == 1


def test_the_same_seed_makes_the_same_weights(tiny: Path, tmp_path: Path, smollm2_dir: Path) -> None:
    again = tmp_path / "tiny"
    make("tiny", again, tokenizer=smollm2_dir)
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


@pytest.mark.parametrize(("shape", "billions"), [
    # The published models' parameters, less the embeddings of their larger vocabularies.
    ("llama3-8b", 8.03 - 2 * (128256 - 49152) * 4096 / 1e9),
    ("llama3.2-1b", 1.24 - (128256 - 49152) * 2048 / 1e9),
    ("qwen3-30b-a3b", 30.53 - 2 * (151936 - 49152) * 2048 / 1e9),
    ("gemma3-12b", 11.77 - (262208 - 49152) * 3840 / 1e9),
])
def test_each_shape_has_the_parameters_of_its_model(shape: str, billions: float) -> None:
    config = shape_config(shape)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))  # lazy: nothing is computed
    if config["tie_word_embeddings"] and "lm_head" in model.children():
        model.sanitize({})
    count = sum(v.size for _, v in tree_flatten(model.parameters())) / 1e9
    assert count == pytest.approx(billions, rel=0.03)
    assert set(SHAPES) == {"llama3-8b", "llama3.2-1b", "qwen3-30b-a3b", "gemma3-12b", "qwen3.5-0.8b", "tiny"}


def test_layers_override_and_gemma_needs_its_pattern() -> None:
    assert shape_config("llama3-8b", layers=2)["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="at least 6 layers"):
        shape_config("gemma3-12b", layers=2)


def test_the_hybrid_shape_keeps_one_attention_layer_in_four() -> None:
    """qwen3.5-0.8b: 18 Gated DeltaNet layers (recurrent state) and 6 of attention; fewer
    layers keep at least one of attention."""
    from app.cache.checkpoints import CacheLayout

    config = shape_config("qwen3.5-0.8b", layers=8)
    model_class, args_class = _get_classes(config)
    layout = CacheLayout.of(model_class(args_class.from_dict(config)))
    assert layout.hybrid and layout.n_attention == 2 and len(layout.kinds) == 8
    with pytest.raises(ValueError, match="at least 4 layers"):
        shape_config("qwen3.5-0.8b", layers=3)
