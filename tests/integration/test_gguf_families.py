"""GGUF import for every family the importer knows (issue 57, item 1): for each, a tiny random
model of mlx-lm's own class is written as llama.cpp's converter writes it
(``support/gguf_writer.py``), imported, and loaded by mlx-lm: its logits equal the original
model's. The real files of three families anchor the conventions: SmolLM2 (llama) and Gemma 3
(tests/integration/test_gguf_import.py), Qwen2.5-Coder (qwen2, tests/e2e/test_real_models.py).
"""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from app.catalog import gguf_families
from app.catalog.embedded import SMOLLM2, locate_gguf
from app.catalog.gguf_import import import_gguf
from app.errors import InvalidModelFile
from support.gguf_writer import FAMILIES, LLAMA3_SCALING, write

TOKENS = mx.array([[1, 5, 300, 20000, 7, 9, 4000, 12, 48000, 33]])


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return locate_gguf(SMOLLM2, tmp_path_factory.mktemp("scratch"))


def test_every_supported_family_has_a_tiny_model_here() -> None:
    assert sorted(FAMILIES) == sorted(gguf_families.supported())
    assert len(FAMILIES) >= 12


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_a_gguf_of_the_family_imports_as_mlx_lms_own_model(arch: str, tmp_path: Path, smollm2_gguf: Path) -> None:
    model, path = write(arch, tmp_path / f"{arch}.gguf", smollm2_gguf)
    result = import_gguf(path, tmp_path / arch, progress=False)
    assert result.architecture == arch
    imported, config = load_model(tmp_path / arch)  # strict: every parameter present, none extra
    assert config["model_type"] == FAMILIES[arch]["model_type"]
    expected, got = np.array(model(TOKENS)), np.array(imported(TOKENS))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_llama_3s_rope_scaling_comes_back_from_its_rope_freqs_tensor(tmp_path: Path, smollm2_gguf: Path) -> None:
    config = {**FAMILIES["llama"], "rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0,
              "max_position_embeddings": 131072}
    model, path = write("llama", tmp_path / "llama3.gguf", smollm2_gguf, config=config)
    import_gguf(path, tmp_path / "llama3", progress=False)
    imported, imported_config = load_model(tmp_path / "llama3")
    assert imported_config["rope_scaling"] == LLAMA3_SCALING
    np.testing.assert_allclose(np.array(imported(TOKENS)), np.array(model(TOKENS)), rtol=1e-5, atol=1e-5)
    without = {**config}
    without.pop("rope_scaling")
    plain, _ = write("llama", tmp_path / "plain.gguf", smollm2_gguf, config=without)
    # the same weights without the scaling answer otherwise: the test would see a lost scaling
    assert not np.allclose(np.array(plain(TOKENS)), np.array(model(TOKENS)), atol=1e-4)


def test_an_unknown_architecture_is_refused_naming_the_known_ones(tmp_path: Path, smollm2_gguf: Path) -> None:
    _, path = write("llama", tmp_path / "m.gguf", smollm2_gguf)
    raw = path.read_bytes().replace(b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                    b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00xyzzy")
    assert raw != path.read_bytes()
    path.write_bytes(raw)
    with pytest.raises(InvalidModelFile, match=r"architecture 'xyzzy' is not supported \(supported: gemma2, gemma3"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_file_missing_a_tensor_names_the_parameter(tmp_path: Path, smollm2_gguf: Path) -> None:
    import gguf

    model, path = write("qwen2", tmp_path / "full.gguf", smollm2_gguf)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(tmp_path / "cut.gguf", "qwen2")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if tensor.name != "blk.1.attn_k.bias":
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    missing = r"qwen2: no tensor for mlx-lm's model\.layers\.1\.self_attn\.k_proj\.bias \(blk\.1\.attn_k\.bias\)"
    with pytest.raises(InvalidModelFile, match=missing):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "out", progress=False)
