"""The ``auto`` KV format's choice rule and its record, with plain numbers (the real-model
calibration is tests/integration/test_kv_calibration_on_smollm2.py)."""

from __future__ import annotations

import json
from pathlib import Path


from app.cache.formats import KV_FORMATS, KVFormat
from app.engine.calibration import (LOSSLESS, RECORD_NAME, SHIPPED, by_size, choose, read_record, search,
                                    shipped_record, write_record)
from app.engine.kv_choice import CALIBRATION_VERSION, GOAL, Calibration, Goal, Measured


def m(top1: float, ppl: float, kl: float, size: float) -> Measured:
    return Measured(top1_agreement=top1, perplexity_change=ppl, kl_mean=kl, bytes_vs_fp16=size)


def test_the_fewest_bytes_that_meet_every_criterion_win() -> None:
    measured = {"small": m(0.975, 0.004, GOAL.kl * 0.8, 0.28),  # top-1 short of 98%
                "mid": m(0.985, 0.008, GOAL.kl * 0.8, 0.34),
                "big": m(0.995, 0.001, GOAL.kl / 5, 0.53)}
    assert choose(measured) == "mid"
    assert choose({**measured, "mid": m(0.985, -0.012, GOAL.kl * 0.8, 0.34)}) == "big"  # perplexity 1.2% lower: too far
    assert choose({**measured, "mid": m(0.985, 0.008, GOAL.kl * 1.2, 0.34)}) == "big"  # KL too high for a lucky top-1
    assert choose({"a": m(GOAL.top1, -GOAL.perplexity, GOAL.kl, 0.3)}) == "a"  # the bounds themselves meet it
    assert choose({"small": measured["small"]}) is None
    assert choose(measured, Goal(top1=0.97)) == "small"


def test_equal_bytes_prefer_the_lower_kl() -> None:
    measured = {"a": m(0.99, 0.0, GOAL.kl * 0.9, 0.28), "b": m(0.98, 0.0, GOAL.kl / 2, 0.28),
                "c": m(0.99, 0.0, GOAL.kl / 10, 0.4)}
    assert choose(measured) == "b"


def test_search_stops_at_the_first_size_that_meets_the_goal() -> None:
    groups = by_size(KV_FORMATS.values())
    sizes = [g[0].bytes_vs_fp16 for g in groups]
    assert sizes == sorted(sizes) and groups[-1] == [KV_FORMATS[LOSSLESS]]
    assert {f.name for g in groups for f in g} == set(KV_FORMATS) - {"f32"}  # exact at 200%: only pinned
    target = groups[1]  # the second smallest size meets it
    scored: list[str] = []

    def measure(kv_format: KVFormat) -> Measured:
        scored.append(kv_format.name)
        good = kv_format.bytes_vs_fp16 >= target[0].bytes_vs_fp16
        return m(0.99 if good else 0.9, 0.0, GOAL.kl / 2 if good else 0.02, kv_format.bytes_vs_fp16)

    chosen, measured = search(measure, KV_FORMATS.values())
    assert chosen in {f.name for f in target}
    assert scored == [f.name for g in groups[:2] for f in g] == list(measured)  # nothing larger was measured


def test_nothing_but_float16_meets_the_goal() -> None:
    chosen, measured = search(lambda f: m(1.0 if f.name == LOSSLESS else 0.9, 0.0, 0.0, f.bytes_vs_fp16),
                              KV_FORMATS.values())
    assert chosen == LOSSLESS and set(measured) == set(KV_FORMATS) - {"f32"}
    chosen, _ = search(lambda f: m(0.5, 0.5, 1.0, f.bytes_vs_fp16), KV_FORMATS.values())  # not even f16: still f16
    assert chosen == LOSSLESS


def test_only_the_formats_that_fit_the_heads_are_measured() -> None:
    """Heads of 80 values fit no affine group (32 or 64), heads of 160 no exact rotation:
    ``auto`` measures what is left, and float16 always is."""
    fitting: dict[int, list[KVFormat]] = {80: [], 96: [], 160: []}
    for head_dim, formats in fitting.items():
        for kv_format in KV_FORMATS.values():
            try:
                formats.append(kv_format.for_head_dim(head_dim))
            except ValueError as exc:
                assert f"head_dim {head_dim}" in str(exc)
    assert [[f.name for f in g] for g in by_size(fitting[80])] == [[LOSSLESS]]
    assert [[f.name for f in g] for g in by_size(fitting[160])] == [["q8"], [LOSSLESS]]
    scored: list[str] = []
    chosen, _ = search(lambda f: scored.append(f.name) or m(1.0, 0.0, 0.0, f.bytes_vs_fp16), fitting[160])
    assert (chosen, scored) == ("q8", ["q8"])
    # Groups of 32 along heads of 96 and 160: a scale and bias per 32 values (+1 bit each).
    assert {f.group_size for f in fitting[96] + fitting[160] if f.quantized} == {32}
    assert round(fitting[160][0].bytes_vs_fp16, 3) == round((8 + 1) / 16, 3)


def test_the_record_is_kept_for_the_same_model_and_version_only(tmp_path: Path) -> None:
    calibration = Calibration("key-1", "q8", {"q8": m(0.99, 0.001, 0.0003, 0.53)}, 12.5)
    assert read_record(tmp_path, "key-1") is None
    write_record(tmp_path, calibration)
    assert read_record(tmp_path, "key-1") == calibration
    assert read_record(tmp_path, "key-2") is None  # another model (or weights changed)
    path = tmp_path / RECORD_NAME
    path.write_text(path.read_text().replace(f'"version": {CALIBRATION_VERSION}', '"version": 0'))
    assert read_record(tmp_path, "key-1") is None  # an older calibration
    for damaged in ("{", '{"version": 1}', calibration.to_json().replace('"chosen": "q8"', '"chosen": "q9"')):
        path.write_text(damaged)
        assert read_record(tmp_path, "key-1") is None
    assert not list(tmp_path.glob("*.tmp"))


def test_a_model_without_a_record_takes_the_one_shipped_for_its_key(tmp_path: Path) -> None:
    """A shipped record is taken by the model of its key only, and written next to its
    weights; the model's own record, when current, comes first."""
    shipped = shipped_record(json.loads((SHIPPED / "smollm2-135m-instruct.json").read_text())["key"])
    assert shipped is not None and shipped.version == CALIBRATION_VERSION
    assert read_record(tmp_path, "another-key") is None and not (tmp_path / RECORD_NAME).exists()
    assert read_record(tmp_path, shipped.key) == shipped
    assert Calibration.from_json((tmp_path / RECORD_NAME).read_text()) == shipped  # kept with the model
    own = Calibration(shipped.key, "f16", {"f16": m(1.0, 0.0, 0.0, 1.0)}, 1.0)
    write_record(tmp_path, own)
    assert read_record(tmp_path, shipped.key) == own
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "old.json").write_text(shipped.to_json().replace(f'"version": {CALIBRATION_VERSION}', '"version": 0'))
    assert shipped_record(shipped.key, stale) is None  # a record of another calibration version is not taken


def test_the_goal_is_the_one_documented() -> None:
    assert (GOAL.top1, GOAL.perplexity) == (0.98, 0.01)
