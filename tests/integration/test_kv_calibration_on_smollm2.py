"""The ``auto`` KV format on a real model (SmolLM2): the first load of a model that was
never calibrated measures the stored formats, records the fewest bytes that meet the
goal next to the weights, and every later load reads that record."""

from __future__ import annotations

import json
import time
from pathlib import Path

from app.catalog.embedded import EMBEDDED
from app.engine.calibration import RECORD_NAME, SHIPPED, read_record, shipped_record
from app.engine.kv_choice import CALIBRATION_VERSION, GOAL
from app.engine.model import calibration_key, load_model, load_spec, model_fingerprint

TEMPLATED = "tokenizer_config.json"


def _copy_of(model_dir: Path, destination: Path) -> Path:
    """The model's files linked into a directory of its own, under another chat template: a
    model no record is for (neither its own nor one shipped: ``calibration.SHIPPED``). The
    template is not in what calibration measures (teacher-forced text, no chat)."""
    destination.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.startswith(".") and path.name not in (RECORD_NAME, TEMPLATED):
            (destination / path.name).symlink_to(path)
    config = json.loads((model_dir / TEMPLATED).read_text())
    (destination / TEMPLATED).write_text(json.dumps({**config, "chat_template": config["chat_template"] + " "}))
    return destination


def test_the_shipped_records_are_the_embedded_models(smollm2_dir: Path, gemma3_dir: Path, coder05_dir: Path,
                                                      coder15_dir: Path) -> None:
    """Each embedded model, as imported here, has the key of its shipped record (fails when the
    calibration's version or the import changes: measure the models again into ``SHIPPED``)."""
    assert {p.stem for p in SHIPPED.glob("*.json")} == set(EMBEDDED)
    for model_dir in (smollm2_dir, gemma3_dir, coder05_dir, coder15_dir):
        record = json.loads((SHIPPED / f"{model_dir.name}.json").read_text())
        assert (record["key"], record["version"]) == (calibration_key(model_dir), CALIBRATION_VERSION), model_dir.name
        assert load_spec(model_dir.name, model_dir).kv.calibration == shipped_record(record["key"])


def test_calibration_picks_the_fewest_bytes_that_meet_the_goal_and_records_them(
        smollm2_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_of(smollm2_dir, tmp_path / "smollm2")
    assert load_spec("smollm2", model_dir).kv.chosen_by == "pending"
    started = time.perf_counter()
    loaded = load_model("smollm2", model_dir)  # kv_format "auto": calibrates
    print(f"load and calibration: {time.perf_counter() - started:.1f} s")
    kv = loaded.kv
    record = kv.calibration
    assert kv.chosen_by == "calibration" and record is not None and record.chosen == kv.format.name
    print({name: m.describe() for name, m in record.measured.items()}, f"calibration {record.seconds:.1f} s")
    chosen = record.measured[record.chosen]
    assert GOAL.met_by(chosen)
    for name, measured in record.measured.items():
        assert measured.bytes_vs_fp16 <= chosen.bytes_vs_fp16, name  # nothing larger was measured
        if measured.bytes_vs_fp16 < chosen.bytes_vs_fp16:
            assert not GOAL.met_by(measured), name  # nothing smaller meets the goal
    assert loaded.fingerprint == model_fingerprint(model_dir, kv.format.fingerprint)
    shipped = shipped_record(calibration_key(smollm2_dir))  # measured where Semantic was made: the same choice
    assert shipped is not None and shipped.chosen == record.chosen, (shipped, record)

    # Recorded with the model: the next load reads it, a pinned format overrides it.
    assert read_record(model_dir, calibration_key(model_dir)) == record
    spec = load_spec("smollm2", model_dir)
    assert (spec.kv.format, spec.kv.chosen_by, spec.fingerprint) == (kv.format, "calibration", loaded.fingerprint)
    other = "f16" if kv.format.name != "f16" else "q8"
    pinned = load_spec("smollm2", model_dir, kv_format=other)
    assert (pinned.kv.format.name, pinned.kv.chosen_by) == (other, "setting")
    assert pinned.fingerprint != spec.fingerprint

    # A changed model (here its config) is a stale record: calibrated again at its next load.
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").write_text(json.dumps({**config, "note": "changed"}))
    assert load_spec("smollm2", model_dir).kv.chosen_by == "pending"
