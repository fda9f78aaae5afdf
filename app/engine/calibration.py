"""The ``auto`` KV format: per model, the fewest stored bytes that keep it faithful.

A short calibration scores the stored formats against float KV on a fixed text
(``fidelity.natural_texts``: a prose prefix and a code prefix, teacher-forced), from the
fewest bytes up, and stops at the first size where a format meets the goal: top-1
agreement with float KV >= 98% and perplexity within 1% (``Goal``). The result is
recorded with the model (``kv_calibration.json`` in its directory, keyed by its
fingerprint and ``CALIBRATION_VERSION``), so a changed model or a changed calibration
measures again, and ``semantic models list`` and ``/health`` show it.

The embedded models' records ship with Semantic (``calibrations/``, measured on the
development machine): a model whose key one of them holds (the same weights, tokenizer
and template, and this calibration) takes it, and its first load measures nothing (what a
calibration costs a first start: docs/benchmarks.md, "Measured choices in the code").
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from itertools import groupby
from pathlib import Path
from typing import Any

import mlx.nn as nn

from app.cache.formats import KV_FORMATS, KVFormat
from app.engine.fidelity import TeacherForced, natural_texts
from app.engine.kv_choice import CALIBRATION_VERSION, GOAL, Calibration, Goal, Measured

log = logging.getLogger(__name__)

RECORD_NAME = "kv_calibration.json"
SHIPPED = Path(__file__).parent / "calibrations"  # the embedded models' records, one a model
PREFIX_TOKENS, SCORED_TOKENS = 1024, 256  # per text: the prefix stored in a format, the tokens scored after it
CHARS_PER_TOKEN = 8  # more than enough characters of a text are tokenized (both texts hold 3-4 a token)
LOSSLESS = "f16"


def choose(measured: Mapping[str, Measured], goal: Goal = GOAL) -> str | None:
    """The format with the fewest bytes that meets ``goal`` (equal bytes: the lower KL),
    or None if no measured format does."""
    meeting = [(m.bytes_vs_fp16, m.kl_mean, name) for name, m in measured.items() if goal.met_by(m)]
    return min(meeting)[2] if meeting else None


def by_size(formats: Iterable[KVFormat]) -> list[list[KVFormat]]:
    """The ``formats`` up to float16 (those that fit the model: ``KVFormat.for_head_dim``),
    grouped by bytes, smallest first (float16 last; ``f32``, exact at twice its bytes, is
    only ever pinned)."""
    ordered = sorted((f for f in formats if f.bytes_vs_fp16 <= 1), key=lambda f: f.bytes_vs_fp16)
    return [list(group) for _, group in groupby(ordered, key=lambda f: f.bytes_vs_fp16)]


Progress = Callable[[str], None]  # called once per step done (a text prefilled, a format scored)


def n_steps() -> int:
    """Steps of a calibration that measures every format (for a progress bar's total: at most)."""
    return len(natural_texts()) + sum(len(group) for group in by_size(KV_FORMATS.values()))


def search(measure: Callable[[KVFormat], Measured], formats: Iterable[KVFormat], goal: Goal = GOAL,
           progress: Progress | None = None) -> tuple[str, dict[str, Measured]]:
    """Measure ``formats`` from the fewest bytes up until one meets ``goal``: the one chosen
    (float16 if nothing smaller meets it) and everything measured."""
    measured: dict[str, Measured] = {}
    for group in by_size(formats):
        for kv_format in group:
            measured[kv_format.name] = measure(kv_format)
            if progress:
                progress(kv_format.name)
        chosen = choose(measured, goal)
        if chosen is not None:
            return chosen, measured
    return LOSSLESS, measured


def calibrate(model: nn.Module, tokenizer: Any, key: str, formats: Iterable[KVFormat],
              progress: Progress | None = None, goal: Goal = GOAL) -> Calibration:
    """Score ``formats`` (those that fit the model) on ``model`` (``search``) over a prose and a code prefix."""
    started = time.perf_counter()
    measures = []
    for name, text in natural_texts().items():
        tokens = tokenizer.encode(text[:CHARS_PER_TOKEN * (PREFIX_TOKENS + SCORED_TOKENS)])
        tokens = tokens[:PREFIX_TOKENS + SCORED_TOKENS + 1]
        if len(tokens) < PREFIX_TOKENS + SCORED_TOKENS + 1:
            raise ValueError(f"the {name} calibration text is only {len(tokens)} tokens for this tokenizer")
        measures.append(TeacherForced(model, tokens, PREFIX_TOKENS))
        if progress:
            progress(f"prefill {name}")
    chosen, measured = search(lambda f: Measured.mean([m.score(f) for m in measures], f), formats, goal, progress)
    if chosen == LOSSLESS:
        log.warning("KV calibration: no quantized format meets the goal (top-1 >= %.0f%%, perplexity within "
                    "%.0f%%); using f16 (100%% of FP16)", goal.top1 * 100, goal.perplexity * 100)
    return Calibration(key, chosen, measured, round(time.perf_counter() - started, 1))


def read_record(model_dir: Path, key: str) -> Calibration | None:
    """The model's recorded calibration: its own, else one shipped for a model of this key
    (``SHIPPED``: then written next to its weights, as a calibration's is), or None if neither
    (missing, unreadable, or stale: another key or version)."""
    path = model_dir / RECORD_NAME
    own = _parse(path)
    if own is not None and _is_for(own, key):
        return own
    if own is not None:
        log.info("%s is from another model or calibration version", path)
    shipped = shipped_record(key)
    if shipped is not None:
        log.info("KV calibration of %s: the record shipped for this model (%s, measured in %.0f s where it was "
                 "made)", model_dir, shipped.chosen, shipped.seconds)
        write_record(model_dir, shipped)
    return shipped


def shipped_record(key: str, shipped: Path = SHIPPED) -> Calibration | None:
    """The record shipped for the model of ``key`` with this calibration version, or None."""
    for path in sorted(shipped.glob("*.json")):
        calibration = _parse(path)
        if calibration is not None and _is_for(calibration, key):
            return calibration
    return None


def _is_for(calibration: Calibration, key: str) -> bool:
    """Whether ``calibration`` is the model of ``key``'s under this calibration version."""
    return calibration.version == CALIBRATION_VERSION and calibration.key == key


def _parse(path: Path) -> Calibration | None:
    """The record in ``path``, or None (missing; unreadable: logged)."""
    try:
        return Calibration.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None


def write_record(model_dir: Path, calibration: Calibration) -> None:
    """Write the record atomically (a concurrent reader sees the old one or the new one)."""
    path = model_dir / RECORD_NAME
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        scratch.write_text(calibration.to_json())
        scratch.replace(path)
    except OSError:
        scratch.unlink(missing_ok=True)
        log.warning("cannot write %s; the record is not kept with the model", path)
