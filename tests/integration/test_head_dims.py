"""Models of every head_dim that occurs store their caches, or are refused by name (issue 36).

Head dims 64 (SmolLM2), 80, 96 (Phi-3/3.5-mini), 128, 160 and 256 (Gemma 3): tiny random
llama models of each, through the same format resolution the engine uses when it loads a
model (``kv_choice`` on its config) and the cache manager. A format either stores a
600-token conversation that a new manager on the same home reloads with the logits it
stored, or is refused with one line that names it and the head_dim; it never loads and
then fails at every commit ("storing the cache failed", every turn a miss).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from app.cache.formats import KV_FORMATS, rotation_is_exact
from app.engine.model import kv_choice, load_model
from app.errors import InvalidModelFile
from app.types import ChatMessage, SamplingParams
from support.engines import make_engine_at, turn
from test_cache_round_trips import VOCAB, as_prompt, cold_same_split, forward, manager, store_turn

HEAD_DIMS = (64, 80, 96, 128, 160, 256)
QUANTIZED = {"q4r", "q4c", "k5c", "k6v4", "k8v4", "q8"}
ROTATED = QUANTIZED - {"q8"}
# What MLX cannot do: affine groups (32 or 64 values along the head) must divide head_dim,
# and the Hadamard rotation is its own inverse only for 2^k and 12 * 2^k values.
REFUSED = {64: set(), 80: QUANTIZED, 96: set(), 128: set(), 160: ROTATED, 256: set()}


def llama_args(head_dim: int, vocab_size: int = VOCAB) -> dict[str, Any]:
    return dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, rms_norm_eps=1e-5,
                vocab_size=vocab_size, max_position_embeddings=4096)


def tiny_llama(head_dim: int, vocab_size: int = VOCAB) -> llama.Model:
    mx.random.seed(11)
    model = llama.Model(llama.ModelArgs.from_dict(llama_args(head_dim, vocab_size)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    assert model.layers[0].self_attn.head_dim == head_dim
    return model


def config_dir(path: Path, head_dim: int) -> Path:
    """A model directory as far as the KV format's resolution reads it: its config."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(llama_args(head_dim)))
    return path


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_format_that_fits_a_head_dim_stores_and_reloads_and_the_others_are_refused(
        head_dim: int, tmp_path: Path) -> None:
    model = tiny_llama(head_dim)
    path = config_dir(tmp_path / "model", head_dim)
    rng = np.random.default_rng(5)
    first, more = rng.integers(0, VOCAB, 600).tolist(), rng.integers(0, VOCAB, 40).tolist()
    refused = set()
    for name in KV_FORMATS:
        try:
            kv_format = kv_choice(path, name).format
        except InvalidModelFile as exc:
            message = str(exc)
            assert name in message and f"head_dim {head_dim}" in message and "\n" not in message, message
            refused.add(name)
            continue
        home = tmp_path / name
        caches = manager(home, len(model.layers), kv_format=kv_format)
        assert store_turn(caches, model, "a-c", first) == 0
        assert caches.record("a-c") is not None and caches.record("a-c").n_tokens == 600, name
        assert caches.flush(30)
        reloaded = manager(home, len(model.layers), kv_format=kv_format)  # a restart: from disk
        lease = reloaded.lease("a", "a-c", as_prompt(first + more))
        assert (lease.n_reused, lease.report.reason) == (600, "extend"), name
        warm = forward(model, lease.cache, more)
        assert mx.array_equal(warm, cold_same_split(model, len(model.layers), first, more, kv_format)), name
        reloaded.close()
        caches.close()
        # Groups of 64 along the head where 64 divides it (every existing cache keeps its
        # fingerprint), else 32: another group size is another fingerprint.
        expected = KV_FORMATS[name].fingerprint
        assert kv_format.fingerprint == (expected if head_dim % 64 == 0 else expected.replace("-g64-", "-g32-"))
    assert refused == REFUSED[head_dim]


def test_the_rotation_rule_is_what_mlx_computes() -> None:
    """The sizes the rotation is allowed for are those MLX's transform inverts exactly (sizes
    it does not support at all are never probed: there it can corrupt memory rather than raise)."""
    for n in (16, 64, 96, 128, 192, 256, 80, 160, 112):  # 2^k, 12 * 2^k; 20 * 2^k, 28 * 2^k
        eye = mx.eye(n)
        twice = mx.hadamard_transform(mx.hadamard_transform(eye, scale=n ** -0.5), scale=n ** -0.5)
        assert mx.allclose(twice, eye, atol=1e-4).item() == rotation_is_exact(n), n
    assert [n for n in range(1, 513) if rotation_is_exact(n)] == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192,
                                                                    256, 384, 512]
    with pytest.raises(ValueError, match="Hadamard.*head_dim 160"):
        KV_FORMATS["k8v4"].for_head_dim(160)


def test_a_head_dim_96_model_calibrates_loads_and_serves_turns_from_its_stored_cache(
        tmp_path: Path, smollm2_dir: Path) -> None:
    """The whole path on a Phi-3-shaped head: ``auto`` calibrates among the formats that fit,
    the engine stores every turn, and the next turn reads it back."""
    from mlx_lm.utils import save_config, save_model

    tokenizer = json.loads((smollm2_dir / "config.json").read_text())
    model_dir = tmp_path / "phi-shaped"
    model_dir.mkdir()
    save_model(model_dir, tiny_llama(96, tokenizer["vocab_size"]))
    save_config({**llama_args(96, tokenizer["vocab_size"]), "eos_token_id": tokenizer.get("eos_token_id")},
                model_dir / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            (model_dir / name).symlink_to(smollm2_dir / name)
    loaded = load_model("phi-shaped", model_dir)  # kv_format "auto": calibrated here
    assert loaded.kv.chosen_by == "calibration" and loaded.kv_format.unfit_reason(96) is None
    assert set(loaded.kv.calibration.measured) >= {"q4r", "q4c"}  # rotated formats fit 96 (12 * 8)

    engine = make_engine_at(tmp_path / "home", model_dir, ["a"], name="phi-shaped")
    try:
        sampling = SamplingParams(max_tokens=8, temperature=0.0)
        messages = [ChatMessage("system", "Be brief. " * 40), ChatMessage("user", "Hello there.")]
        _, first = turn(engine, "a", messages, sampling)
        assert first.n_cache_written > 0
        _, second = turn(engine, "a", [*messages, ChatMessage("assistant", "Hi."), ChatMessage("user", "Again.")],
                         sampling)
        assert second.n_cached_tokens > 0 and second.reuse.reason != "miss"
    finally:
        engine.stop()
