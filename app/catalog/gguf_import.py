"""Convert a GGUF file into a directory that ``mlx_lm.load`` accepts.

Output: ``config.json``, ``model.safetensors`` (float32, dequantized),
``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template).
Format facts handled here (see SPEC "Models"):

* tensors are dequantized with the ``gguf`` package, whatever their GGML type;
* llama.cpp permutes the q/k projection rows of llama models for its
  interleaved RoPE; the permutation is undone so mlx-lm's rotate-half RoPE
  sees Hugging Face's layout;
* llama.cpp stores Gemma's RMSNorm weights as ``1 + w``; mlx-lm adds the 1
  itself, so 1 is subtracted here;
* the tokenizer is rebuilt from metadata (``gguf_tokenizer``), and Gemma gets
  its BOS from the chat template / post-processor.

No MLX: the worker and the CLI can import models without loading a backend.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from app.catalog.gguf_tokenizer import GgufVocab, build_tokenizer
from app.errors import InvalidModelFile

log = logging.getLogger(__name__)

# Tokens that end an assistant turn in the chat templates we know; those present
# in a vocabulary are added to the model's stop ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

# Gemma 3 base checkpoints ship no chat template; this is Google's published one
# (string contents only; richer content is flattened before rendering).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


@dataclass(frozen=True, slots=True)
class ImportResult:
    """Where an import wrote its model and what it holds."""

    path: Path
    architecture: str
    n_tensors: int
    n_params: int


class GgufFile:
    """Typed access to one GGUF file's metadata and tensors."""

    def __init__(self, path: Path) -> None:
        try:
            self.reader = GGUFReader(path)
        except (ValueError, OSError) as exc:  # gguf raises ValueError on bad magic
            raise InvalidModelFile(f"{path}: not a readable GGUF file ({exc})") from exc
        self.path = path
        self.architecture = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def array(self, key: str) -> list[Any] | None:
        field = self.reader.fields.get(key)
        if field is None:
            return None
        if field.types and field.types[-1] == GGUFValueType.STRING:
            return field.contents()
        return [field.parts[i][0].item() for i in field.data]

    def vocab(self) -> GgufVocab:
        tokens = self.array("tokenizer.ggml.tokens")
        if not tokens:
            raise InvalidModelFile(f"{self.path}: no tokenizer.ggml.tokens")
        return GgufVocab(
            model=str(self.get("tokenizer.ggml.model")),
            pre=str(self.get("tokenizer.ggml.pre", "default")),
            tokens=tokens,
            token_types=self.array("tokenizer.ggml.token_type") or [1] * len(tokens),
            scores=self.array("tokenizer.ggml.scores"),
            merges=self.array("tokenizer.ggml.merges"),
            bos_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_id=self.get("tokenizer.ggml.eos_token_id"),
            unk_id=self.get("tokenizer.ggml.unknown_token_id"),
            pad_id=self.get("tokenizer.ggml.padding_token_id"),
            add_bos=bool(self.get("tokenizer.ggml.add_bos_token", False)),
            add_space_prefix=bool(self.get("tokenizer.ggml.add_space_prefix", False)),
            chat_template=self.get("tokenizer.chat_template"),
        )


def _unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama_config(gguf: GgufFile, n_vocab: int, tied: bool) -> dict[str, Any]:
    n_heads = gguf.arch("attention.head_count")
    hidden = gguf.arch("embedding_length")
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": gguf.arch("block_count"),
        "intermediate_size": gguf.arch("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": gguf.arch("attention.head_count_kv", n_heads),
        "head_dim": gguf.arch("rope.dimension_count", hidden // n_heads),
        "rms_norm_eps": gguf.arch("attention.layer_norm_rms_epsilon"),
        "rope_theta": gguf.arch("rope.freq_base", 10000.0),
        "max_position_embeddings": gguf.arch("context_length"),
        "vocab_size": n_vocab,
        "tie_word_embeddings": tied,
    }


def _gemma3_config(gguf: GgufFile, n_vocab: int, tied: bool) -> dict[str, Any]:
    head_dim = gguf.arch("attention.key_length")
    return {
        "model_type": "gemma3_text",
        "hidden_size": gguf.arch("embedding_length"),
        "num_hidden_layers": gguf.arch("block_count"),
        "intermediate_size": gguf.arch("feed_forward_length"),
        "num_attention_heads": gguf.arch("attention.head_count"),
        "num_key_value_heads": gguf.arch("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": gguf.arch("attention.layer_norm_rms_epsilon"),
        "rope_theta": gguf.arch("rope.freq_base", 1_000_000.0),
        # Not stored in GGUF; llama.cpp hard-codes these for Gemma 3 too.
        "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": gguf.arch("attention.sliding_window"),
        "max_position_embeddings": gguf.arch("context_length"),
        "vocab_size": n_vocab,
        "tie_word_embeddings": tied,
    }


_ARCHITECTURES: dict[str, tuple[Callable[[GgufFile, int, bool], dict[str, Any]], dict[str, str]]] = {
    "llama": (_llama_config, _LLAMA_LAYER_NAMES),
    "gemma3": (_gemma3_config, _GEMMA3_LAYER_NAMES),
}


def _hf_name(name: str, layer_names: dict[str, str]) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in layer_names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{layer_names[part]}.{kind}"
    return None


def _convert_tensor(gguf: GgufFile, name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if gguf.architecture == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
        data = _unpermute_rows(data, heads)
    if gguf.architecture == "gemma3" and name.endswith("norm.weight"):
        data = data - 1.0
    return np.ascontiguousarray(data, dtype=np.float32)


def _tokenizer_config(vocab: GgufVocab, architecture: str, context: int) -> dict[str, Any]:
    def name(token_id: int | None) -> str | None:
        return vocab.tokens[token_id] if token_id is not None else None

    template = vocab.chat_template
    if template is None and architecture == "gemma3":
        template = GEMMA3_CHAT_TEMPLATE
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(vocab.bos_id),
        "eos_token": name(vocab.eos_id),
        "unk_token": name(vocab.unk_id),
        "pad_token": name(vocab.pad_id),
        "add_bos_token": vocab.add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "chat_template": template,
    }


def _stop_ids(vocab: GgufVocab) -> list[int]:
    ids = [vocab.eos_id] if vocab.eos_id is not None else []
    index = {t: i for i, t in enumerate(vocab.tokens)}
    ids += [index[t] for t in END_OF_TURN_TOKENS if t in index and index[t] not in ids]
    return ids


def import_gguf(source: Path, destination: Path, *, progress: bool = True) -> ImportResult:
    """Convert ``source`` (a .gguf file) into the model directory ``destination``.

    The directory is assembled next to its final place and renamed into it,
    so an interrupted import never leaves a half-written model behind.

    Raises:
        InvalidModelFile: the file is not GGUF, or its architecture or
            tokenizer is one this importer does not support.
    """
    gguf = GgufFile(source)
    if gguf.architecture not in _ARCHITECTURES:
        raise InvalidModelFile(
            f"{source}: architecture {gguf.architecture!r} is not supported "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    make_config, layer_names = _ARCHITECTURES[gguf.architecture]
    vocab = gguf.vocab()
    names = {t.name for t in gguf.reader.tensors}
    config = make_config(gguf, len(vocab.tokens), "output.weight" not in names)
    config["eos_token_id"] = _stop_ids(vocab)
    if vocab.bos_id is not None:
        config["bos_token_id"] = vocab.bos_id
    config["torch_dtype"] = "float32"

    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(gguf.reader.tensors, desc=f"import {source.name}", unit="tensor",
                       disable=not progress):
        hf_name = _hf_name(tensor.name, layer_names)
        if hf_name is None:
            log.warning("skipping unknown tensor %s", tensor.name)
            continue
        data = dequantize(tensor.data, tensor.tensor_type)
        weights[hf_name] = _convert_tensor(gguf, tensor.name, data, config)

    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "mlx"})
        build_tokenizer(vocab).save(str(staging / "tokenizer.json"))
        tokenizer_config = _tokenizer_config(vocab, gguf.architecture, config["max_position_embeddings"])
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "source.json").write_text(json.dumps({"gguf": str(source.resolve())}, indent=2))
        if destination.exists():
            shutil.rmtree(destination)
        staging.rename(destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    n_params = sum(int(w.size) for w in weights.values())
    return ImportResult(destination, gguf.architecture, len(weights), n_params)
