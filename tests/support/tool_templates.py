"""A real model directory with another chat template: the embedded SmolLM2 (its tokenizer,
and its weights by link) under a template that defines tools, as no model installed here has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
LEFT_OUT = {"tokenizer_config.json", "kv_calibration.json", ".fingerprint.json"}  # rewritten, or stale


def with_template(model_dir: Path, out: Path, template: str) -> Path:
    """``model_dir`` copied to ``out`` with the chat template ``templates/<template>.jinja``
    (weights linked, not copied). Its KV calibration is left out: it is keyed by the template."""
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.name in LEFT_OUT or not path.is_file():
            continue
        if path.suffix == ".safetensors":
            (out / path.name).symlink_to(path.resolve())
        else:
            shutil.copy(path, out / path.name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / f"{template}.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
