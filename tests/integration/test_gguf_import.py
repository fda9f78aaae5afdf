"""GGUF import on the real packaged files: weights, tokenizer, chat template."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from app.catalog.embedded import GEMMA3, SMOLLM2, locate_gguf
from app.catalog.gguf_import import GgufFile, ImportOptions, import_gguf
from app.engine.model import LoadedModel, load_model
from app.errors import InvalidModelFile
from support.reference_tokenizers import ReferenceBpe, ReferenceSpm

FEW_SHOT = "The capital of Germany is Berlin. The capital of Italy is Rome. The capital of France is"

TRICKY = [
    "Hello world", "  leading spaces", "trailing spaces   ", "tabs\t\tand\nnewlines\n\n\n",
    "def f(x):\n    return x ** 2  # square\n", "ünïcödé Ωμέγα 日本語の文 🙂🚀 emoji",
    "numbers 1234567 3.14159 -42", "I'm sure you're right, we'll see", "a\u00a0b\u200bc\r\nd",
    "<|im_start|>user\nhi<|im_end|>\n", "<start_of_turn>user\nhello<end_of_turn>\n",
    "<b>bold</b> <table><tr>", "x" * 64, "    four    spaces    ", "{\"json\": [1, 2, {\"k\": null}]}",
    "e\u0301 combining accents", "\u202eright-to-left override", "🏳️‍🌈 zwj sequence",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> LoadedModel:
    return load_model("smollm2", smollm2_dir)


@pytest.fixture(scope="module")
def gemma3(gemma3_dir: Path) -> LoadedModel:
    return load_model("gemma3", gemma3_dir)


def greedy(loaded: LoadedModel, text: str, n_tokens: int = 8) -> str:
    ids = loaded.tokenizer.encode(text)  # with BOS where the model wants one
    steps = generate_step(mx.array(ids), loaded.model, max_tokens=n_tokens,
                          sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
                          prompt_cache=make_prompt_cache(loaded.model))
    return loaded.tokenizer.decode([int(token) for token, _ in steps])


def test_smollm2_answers_paris(smollm2: LoadedModel) -> None:
    assert "Paris" in greedy(smollm2, FEW_SHOT)
    assert "Paris" in greedy(smollm2, "The capital of France is")


def test_gemma3_answers_paris(gemma3: LoadedModel) -> None:
    assert "Paris" in greedy(gemma3, FEW_SHOT)


def test_smollm2_config_matches_the_architecture(smollm2: LoadedModel) -> None:
    args = smollm2.model.args
    assert (args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads) == (30, 9, 3)
    assert (args.vocab_size, smollm2.context_length) == (49152, 8192)


def test_gemma3_has_sliding_window_layers(gemma3: LoadedModel) -> None:
    kinds = {type(c).__name__ for c in gemma3.model.make_cache()}
    assert kinds == {"RotatingKVCache", "KVCache"}


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_tokenizer_matches_the_gguf_vocabulary(which: str, request: pytest.FixtureRequest,
                                               tmp_path: Path) -> None:
    loaded: LoadedModel = request.getfixturevalue(which)
    gguf = GgufFile(locate_gguf(SMOLLM2 if which == "smollm2" else GEMMA3, tmp_path))
    reference = (ReferenceBpe if which == "smollm2" else ReferenceSpm)(gguf.vocab())
    tokenizer = loaded.tokenizer._tokenizer
    for text in TRICKY:
        assert tokenizer.encode(text) == reference.encode(text), text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(list("ab cé\n\t1_(){}日🙂'") + ["<|im_end|>", "  ", "'ll"]),
                     max_size=30).map("".join))
def test_smollm2_tokenizer_matches_reference_on_random_text(smollm2: LoadedModel, smollm2_reference: ReferenceBpe,
                                                            text: str) -> None:
    assert smollm2.tokenizer._tokenizer.encode(text) == smollm2_reference.encode(text)


@pytest.fixture(scope="module")
def smollm2_reference(tmp_path_factory: pytest.TempPathFactory) -> ReferenceBpe:
    return ReferenceBpe(GgufFile(locate_gguf(SMOLLM2, tmp_path_factory.mktemp("gguf"))).vocab())


def test_token_strings_are_the_gguf_tokens(smollm2: LoadedModel, smollm2_reference: ReferenceBpe) -> None:
    vocab = smollm2.tokenizer._tokenizer.get_vocab()
    assert all(vocab[token] == i for i, token in enumerate(smollm2_reference.vocab.tokens))


def test_chat_templates_render(smollm2: LoadedModel, gemma3: LoadedModel) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    smol = smollm2.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert smol == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    gemma = gemma3.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert gemma == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_stop_ids_include_end_of_turn(smollm2: LoadedModel, gemma3: LoadedModel) -> None:
    vocab = smollm2.tokenizer._tokenizer.get_vocab()
    assert vocab["<|im_end|>"] in smollm2.stop_token_ids
    assert gemma3.tokenizer._tokenizer.get_vocab()["<end_of_turn>"] in gemma3.stop_token_ids


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not gguf" * 10)
    with pytest.raises(InvalidModelFile, match="not a readable GGUF"):
        import_gguf(bogus, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_import_streams_tensors_into_shards_with_bounded_memory(tmp_path: Path) -> None:
    source = locate_gguf(SMOLLM2, tmp_path)
    tracemalloc.start()
    reader = GgufFile(source)  # its metadata (the vocabulary's parts) is a fixed cost
    baseline = tracemalloc.get_traced_memory()[0]
    largest = max(int(t.n_elements) * 4 for t in reader.reader.tensors)  # one tensor in float32
    del reader
    tracemalloc.reset_peak()
    options = ImportOptions(dtype="bfloat16", max_shard_bytes=100 << 20)
    result = import_gguf(source, tmp_path / "bf16", options, progress=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    files = sorted((tmp_path / "bf16").glob("model*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    # One tensor at a time: the largest in float32 (113 MB), its bfloat16 copy and a chunk's
    # temporaries (213 MB measured). Holding the output would add all of it (269 MB) on top.
    assert peak - baseline < 2.5 * largest < total + largest
    assert result.n_shards == len(files) == 3
    assert all(f.stat().st_size <= options.max_shard_bytes + (1 << 16) for f in files)  # + the header
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    loaded = {name: path.name for path in files for name in mx.load(str(path))}
    assert index["weight_map"] == loaded and len(loaded) == result.n_tensors
    assert {str(v.dtype) for v in mx.load(str(files[0])).values()} == {"mlx.core.bfloat16"}
    model = load_model("bf16", tmp_path / "bf16", kv_format="f16")  # cast to float32 on this backend (no calibration)
    assert "Paris" in greedy(model, FEW_SHOT)


def test_4bit_import_equals_mlx_lm_convert(tmp_path: Path, smollm2_dir: Path) -> None:
    from mlx_lm.convert import convert

    result = import_gguf(locate_gguf(SMOLLM2, tmp_path), tmp_path / "q4", ImportOptions(quantize_bits=4),
                         progress=False)
    assert (result.quantize_bits, result.dtype) == (4, "float32")
    convert(str(smollm2_dir), str(tmp_path / "reference"), quantize=True, q_bits=4, q_group_size=64)
    ours = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    reference = mx.load(str(tmp_path / "reference" / "model.safetensors"))
    assert ours.keys() == reference.keys()
    assert all(mx.array_equal(ours[k], reference[k]).item() for k in ours)
    config = json.loads((tmp_path / "q4" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model = load_model("q4", tmp_path / "q4", kv_format="f16")
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"


def test_import_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelFile, match="dtype"):
        ImportOptions(dtype="int8")
    with pytest.raises(InvalidModelFile, match="bits"):
        ImportOptions(quantize_bits=3)
