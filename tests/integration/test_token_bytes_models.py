"""A model's token bytes come from the tokenizer it loaded (``TokenBytes.from_tokenizer``)
and equal, token for token, those read from its ``tokenizer.json`` again: the byte-level
SmolLM2 and the SentencePiece byte-fallback Gemma 3, special tokens included."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.model import load_spec
from app.engine.token_text import TextTracker, TokenBytes


@pytest.mark.parametrize("fixture", ["smollm2_dir", "gemma3_dir"])
def test_token_bytes_from_the_loaded_tokenizer_are_the_files(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    spec = load_spec(fixture, path)
    ours, from_file = spec.token_bytes._pieces, TokenBytes.from_tokenizer_json(path / "tokenizer.json")._pieces
    assert len(ours) == len(from_file) > 40_000
    differing = [i for i, (a, b) in enumerate(zip(ours, from_file)) if a != b]
    assert not differing, [(i, from_file[i], ours[i]) for i in differing[:5]]
    # And they spell what the tokenizer decodes, special tokens as their text.
    text = "Résumé: naïve café, 東京 — x² ≥ 3 <|im_end|> <end_of_turn>\n\tdone."
    ids = spec.tokenizer.encode(text, add_special_tokens=False)
    tracker = TextTracker(spec.token_bytes)
    for token in ids:
        tracker.add(token)
    tracker.finish()
    assert tracker.text == spec.tokenizer.decode(ids, skip_special_tokens=False)
