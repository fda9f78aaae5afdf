"""The parts of a model's load, one by one, in a fresh process.

    python benchmarks/device/boot_parts.py MODEL_DIR [--json PATH]

What GPU run 3 left open (docs/benchmarks.md, "On a GPU"): on the H200 machine Semantic's log
said ``tokenizer and fingerprint 5.4-5.6 s`` on every start, where the same tokenizer loads in
0.8 s on the 2-core CPU, and the server listened 7.2-9.2 s after its process started. This times
each part the server runs, in its order: the imports (``app.engine.model``: MLX, mlx-lm,
transformers), mlx-lm's ``load_tokenizer``, the fingerprint (twice: the second finds the first's
memo), the token bytes, ``load_spec`` whole, the weights, then the first forward pass
(``cached_head_dims``: 4 tokens, where the kernels are set up); and says whether torch was
imported along the way (the GPU image has it; transformers may import it). Prints one JSON line
(also to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

STARTED = time.perf_counter()


def timed(parts: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    parts[f"{name}_s"] = round(time.perf_counter() - start, 3)
    parts[f"torch_imported_after_{name}"] = "torch" in sys.modules
    print(f"{name}: {parts[f'{name}_s']:.3f} s (torch imported: {'torch' in sys.modules})", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    path: Path = args.model_dir
    parts: dict[str, Any] = {"model": str(path)}
    timed(parts, "import_transformers", lambda: __import__("transformers"))
    timed(parts, "import_app_engine_model", lambda: __import__("app.engine.model"))
    from mlx_lm.utils import load_tokenizer

    from app.engine import model as engine_model
    from app.engine.token_text import TokenBytes

    config = json.loads((path / "config.json").read_text())
    tokenizer = timed(parts, "load_tokenizer", lambda: load_tokenizer(path, eos_token_ids=config.get("eos_token_id")))
    timed(parts, "fingerprint", lambda: engine_model.model_fingerprint(path, "q8"))
    timed(parts, "fingerprint_again", lambda: engine_model.model_fingerprint(path, "q8"))
    backend = getattr(tokenizer._tokenizer, "backend_tokenizer", None)
    timed(parts, "token_bytes", lambda: TokenBytes.from_tokenizer(backend, str(path / "tokenizer.json")))
    timed(parts, "load_spec", lambda: engine_model.load_spec(path.name, path, "auto", "q8"))

    def weights() -> Any:
        import mlx.core as mx
        model, _ = engine_model.load_weights(path)
        target = engine_model.compute_dtype("auto")  # as load_model: float32 on the CPU
        if target is not None:
            model.set_dtype(target)
        mx.eval(model.parameters())
        return model

    model = timed(parts, "weights", weights)
    timed(parts, "first_forward_pass", lambda: engine_model.cached_head_dims(model))
    parts["process_s"] = round(time.perf_counter() - STARTED, 3)
    result = json.dumps(parts)
    print(result)
    if args.json:
        args.json.write_text(result + "\n")


if __name__ == "__main__":
    main()
