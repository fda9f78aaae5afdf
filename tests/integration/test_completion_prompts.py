"""A raw completion prompt as the model reads it (``app.engine.prompting.render_completion``):
the text as sent, special tokens included, no chat template; with ``suffix``, the model's
fill-in-the-middle form when its vocabulary has the tokens, else a 400."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import AutoTokenizer

from app.engine.prompting import fim_tokens, render_completion
from app.errors import InvalidRequest


def wrapped(model_dir: Path, extra: list[str] = ()) -> TokenizerWrapper:  # type: ignore[assignment]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if extra:
        tokenizer.add_special_tokens({"additional_special_tokens": list(extra)})
    return TokenizerWrapper(tokenizer)


def test_a_raw_prompt_is_its_own_text_and_tokens(smollm2_dir: Path) -> None:
    tokenizer = wrapped(smollm2_dir)
    prompt = render_completion(tokenizer, "def add(a, b):\n    return<|im_end|>")
    assert prompt.text == "def add(a, b):\n    return<|im_end|>"  # SmolLM2's tokenizer adds no BOS
    assert list(prompt.token_ids) == tokenizer.encode(prompt.text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in prompt.token_ids  # the client's own special token
    assert prompt.ends[-1] == len(prompt.text)
    with pytest.raises(InvalidRequest, match="fill-in-the-middle"):
        render_completion(tokenizer, "def add(a, b):", suffix="\n")


def test_a_suffix_takes_the_models_fill_in_the_middle_form(smollm2_dir: Path) -> None:
    names = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
    tokenizer = wrapped(smollm2_dir, names)
    assert fim_tokens(tokenizer) == tuple(names)
    prompt = render_completion(tokenizer, "def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))")
    assert prompt.text == "<fim_prefix>def add(a, b):\n    <fim_suffix>\n\nprint(add(1, 2))<fim_middle>"
    ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
    assert [t for t in prompt.token_ids if t in ids] == ids  # each one special token, in PSM order
