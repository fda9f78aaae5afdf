"""Convert a GGUF file into a directory that ``mlx_lm.load`` accepts.

Output: ``config.json``, ``model*.safetensors`` (dequantized to float32,
float16 or bfloat16, optionally re-quantized with MLX's affine 4/8-bit
scheme; sharded, with an index when there are several), ``tokenizer.json``
and ``tokenizer_config.json`` (with the chat template).

Tensors are dequantized with the ``gguf`` package, whatever their GGML type. What each
architecture is in mlx-lm (its config, each tensor's parameter, llama.cpp's conventions
undone) is ``gguf_families``; the tokenizer is rebuilt from metadata (``gguf_tokenizer``),
and Gemma gets its BOS from the chat template / post-processor.

MLX is imported only by an import (``gguf_families.placements`` builds mlx-lm's model of the
family, lazily, for its parameter names), so this module loads without it.
"""

from __future__ import annotations

import json
import logging
import platform
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from app.catalog import gguf_families
from app.catalog.gguf_tokenizer import GgufVocab, build_tokenizer
from app.catalog.shards import (
    PlannedTensor,
    iter_shard_files,
    plan_shards,
    shard_names,
    write_index,
    write_tensor,
)
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

# The weights mlx-lm holds in Linear / Embedding layers, the ones `nn.quantize` converts.
_QUANTIZABLE = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # --dtype -> safetensors tag
QUANTIZE_BITS = (4, 8)
_CHUNK_VALUES = 1 << 22  # values converted at a time (16 MB of float32)
DEFAULT_SHARD_BYTES = 2 << 30  # per shard file (mlx-lm's converter cuts at 5 GB)


@dataclass(frozen=True, slots=True)
class ImportResult:
    """Where an import wrote its model and what it holds."""

    path: Path
    architecture: str
    n_tensors: int
    n_params: int
    n_shards: int
    dtype: str
    quantize_bits: int | None


# The fewest bytes one metadata entry (key length, a 1-byte key, type, a 1-byte value) and
# one tensor description (name length, a 1-byte name, dims, one dim, type, offset) take.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8


def _check_counts(path: Path) -> None:
    """Refuse a header whose tensor and metadata counts cannot fit in the file (a hostile
    2^40 would have the reader loop and allocate on its word), in either byte order."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(24)
    except OSError as exc:
        raise InvalidModelFile(f"{path}: not a readable GGUF file ({exc})") from None
    if len(head) < 24 or head[:4] != b"GGUF":
        raise InvalidModelFile(f"{path}: not a readable GGUF file (no GGUF magic)")
    counts = [struct.unpack(f"{order}QQ", head[8:24]) for order in "<>"]
    if any(n_tensors * _MIN_TENSOR_BYTES + n_kv * _MIN_KV_BYTES <= size for n_tensors, n_kv in counts):
        return
    n_tensors, n_kv = counts[0]
    raise InvalidModelFile(f"{path}: the header claims {n_tensors} tensors and {n_kv} metadata entries, "
                           f"more than a {size}-byte file holds")


class GgufFile:
    """Typed access to one GGUF file's metadata and tensors."""

    def __init__(self, path: Path) -> None:
        _check_counts(path)
        try:
            self.reader = GGUFReader(path)
            self.architecture = str(self.get("general.architecture"))
        except (ValueError, OSError, IndexError, KeyError, OverflowError, MemoryError, struct.error) as exc:
            # gguf raises ValueError on a bad magic, and whatever numpy raises when a length
            # or count in the file points past its end
            raise InvalidModelFile(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def arch_metadata(self) -> dict[str, Any]:
        """The architecture's own keys, without their prefix (``block_count``, ...)."""
        prefix = f"{self.architecture}."
        return {key[len(prefix):]: field.contents() for key, field in self.reader.fields.items()
                if key.startswith(prefix)}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape as numpy and mlx-lm hold it (GGUF lists dimensions innermost first)."""
        return {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in self.reader.tensors}

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


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32, dequantized a chunk of rows at a time into one array.

    ``gguf.quants.dequantize`` makes several whole-size temporaries; by rows,
    the peak is the float32 tensor plus one chunk's.
    """
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    out = np.empty(shape, dtype=np.float32)
    rows = out.reshape(-1, shape[-1])
    raw = tensor.data.reshape(rows.shape[0], -1)
    step = max(1, _CHUNK_VALUES // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        rows[start:start + step] = dequantize(raw[start:start + step], tensor.tensor_type)
    return out


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even), as the uint16 that carries it."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint16)
    for start in range(0, flat.size, _CHUNK_VALUES):  # by chunks: temporaries stay small
        bits = flat[start:start + _CHUNK_VALUES].view(np.uint32)
        rounded = (bits >> 16) & np.uint32(1)
        rounded += np.uint32(0x7FFF)
        rounded += bits
        rounded >>= 16
        out[start:start + _CHUNK_VALUES] = rounded
    return out.reshape(values.shape)


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return _bfloat16_bits(values)
    return values.astype(np.float16 if dtype == "float16" else np.float32, copy=False)


def _mlx_quantize(weight: np.ndarray, dtype: str, bits: int, group_size: int) -> list[np.ndarray]:
    """MLX affine quantization (what ``mlx_lm.convert -q`` writes): packed uint32, scales, biases.

    MLX is imported here only: an import that does not quantize stays MLX-free.
    """
    import mlx.core as mx

    packed, scales, biases = mx.quantize(mx.array(weight).astype(getattr(mx, dtype)), group_size=group_size, bits=bits)

    def to_numpy(array: mx.array) -> np.ndarray:
        return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)

    return [np.array(packed), to_numpy(scales), to_numpy(biases)]


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


def default_dtype() -> str:
    """bfloat16 on Apple silicon (Metal computes in it; half the disk and memory of
    float32); float32 elsewhere, where the CPU backend computes in float32 anyway."""
    return "bfloat16" if platform.system() == "Darwin" and platform.machine() == "arm64" else "float32"


@dataclass(frozen=True, slots=True)
class ImportOptions:
    """How the weights are written.

    ``quantize_bits`` (4 or 8) quantizes the projection and embedding weights
    with MLX's affine scheme, the layout of mlx-lm's own 4-bit conversions;
    norms stay in ``dtype``. Shards hold at most ``max_shard_bytes`` each.
    """

    dtype: str = "auto"
    quantize_bits: int | None = None
    group_size: int = 64
    max_shard_bytes: int = DEFAULT_SHARD_BYTES

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidModelFile(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.quantize_bits not in (None, *QUANTIZE_BITS):
            raise InvalidModelFile(f"quantization to {self.quantize_bits} bits: only {QUANTIZE_BITS} are supported")
        if self.group_size not in (32, 64, 128):
            raise InvalidModelFile(f"group size {self.group_size}: only 32, 64 or 128")
        if self.max_shard_bytes < 1:
            raise InvalidModelFile("the shard size must be positive")

    @property
    def weights_dtype(self) -> str:
        return default_dtype() if self.dtype == "auto" else self.dtype


def _quantized(hf_name: str, shape: tuple[int, ...], options: ImportOptions) -> bool:
    """Whether mlx-lm holds this weight in a quantizable layer (Linear, Embedding) that takes the group size."""
    return (options.quantize_bits is not None and hf_name.endswith(_QUANTIZABLE) and len(shape) == 2
            and shape[-1] % options.group_size == 0)


def _plan_outputs(hf_name: str, shape: tuple[int, ...], options: ImportOptions) -> list[PlannedTensor]:
    tag = DTYPES[options.weights_dtype]
    if not _quantized(hf_name, shape, options):
        return [PlannedTensor(hf_name, tag, shape)]
    assert options.quantize_bits is not None
    rows, columns = shape
    stem = hf_name.removesuffix(".weight")
    return [
        PlannedTensor(hf_name, "U32", (rows, columns * options.quantize_bits // 32)),
        PlannedTensor(f"{stem}.scales", tag, (rows, columns // options.group_size)),
        PlannedTensor(f"{stem}.biases", tag, (rows, columns // options.group_size)),
    ]


def import_gguf(source: Path, destination: Path, options: ImportOptions | None = None, *,
                progress: bool = True) -> ImportResult:
    """Convert ``source`` (a .gguf file) into the model directory ``destination``.

    Tensors are dequantized, converted and written one at a time into shards
    whose headers are planned from the GGUF metadata, so memory stays bounded
    by the largest tensor whatever the model's size. The directory is
    assembled next to its final place and renamed into it, so an interrupted
    import never leaves a half-written model behind.

    Raises:
        InvalidModelFile: the file is not GGUF, or its architecture or
            tokenizer is one this importer does not support.
    """
    options = options or ImportOptions()
    gguf = GgufFile(source)
    vocab = gguf.vocab()
    shapes = gguf.shapes()
    try:
        config = gguf_families.config(gguf.architecture, gguf.arch_metadata(), shapes, len(vocab.tokens))
        if "rope_freqs.weight" in shapes:
            rope = next(t for t in gguf.reader.tensors if t.name == "rope_freqs.weight")
            config["rope_scaling"] = gguf_families.llama3_scaling(_dequantize(rope), config)
        placed = gguf_families.placements(config, gguf.architecture, shapes)
    except InvalidModelFile as exc:
        raise InvalidModelFile(f"{source}: {exc}") from None
    config["eos_token_id"] = _stop_ids(vocab)
    if vocab.bos_id is not None:
        config["bos_token_id"] = vocab.bos_id
    config["torch_dtype"] = options.weights_dtype
    if options.quantize_bits is not None:
        quantization = {"group_size": options.group_size, "bits": options.quantize_bits, "mode": "affine"}
        config["quantization"] = config["quantization_config"] = quantization

    groups: list[tuple[int, list[PlannedTensor]]] = []
    for index, tensor in enumerate(gguf.reader.tensors):
        target = placed.get(tensor.name)
        if target is None:
            log.info("%s: %s is not a parameter of mlx-lm's %s (left out)", source.name, tensor.name,
                     config["model_type"])
            continue
        groups.append((index, _plan_outputs(target.name, target.shape, options)))
    shards = plan_shards(groups, options.max_shard_bytes)

    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    bar = tqdm(total=sum(s.nbytes for s in shards), desc=f"import {source.name}", unit="B", unit_scale=True,
               disable=not progress)
    try:
        for shard, handle in iter_shard_files(staging, shards):
            for index, outputs in shard.groups:
                tensor = gguf.reader.tensors[index]
                shape = placed[tensor.name].shape
                weight = gguf_families.convert(gguf.architecture, tensor.name, _dequantize(tensor), config)
                weight = np.ascontiguousarray(weight.reshape(shape), dtype=np.float32)
                if len(outputs) == 3:
                    assert options.quantize_bits is not None
                    arrays = _mlx_quantize(weight, options.weights_dtype, options.quantize_bits, options.group_size)
                else:
                    arrays = [_cast(weight, options.weights_dtype)]
                for planned, array in zip(outputs, arrays, strict=True):
                    write_tensor(handle, planned, array)
                    bar.update(planned.nbytes)
        if len(shards) > 1:
            write_index(staging, shards, shard_names(len(shards)))
        bar.set_postfix_str("tokenizer")
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
    finally:
        bar.close()
    n_params = sum(int(gguf.reader.tensors[i].n_elements) for i, _ in groups)
    return ImportResult(destination, gguf.architecture, len(groups), n_params, len(shards),
                        options.weights_dtype, options.quantize_bits)
