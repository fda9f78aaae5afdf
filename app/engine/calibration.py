"""The ``auto`` KV format: per model, the fewest stored bytes that keep it faithful.

A short calibration scores the stored formats against float KV on a fixed text
(``fidelity.natural_texts``: a prose prefix and a code prefix, teacher-forced), from the
fewest bytes up, and stops at the first size where a format meets the goal: top-1
agreement with float KV >= 98% and perplexity within 1% (``Goal``). The result is
recorded with the model (``kv_calibration.json`` in its directory, keyed by its
fingerprint and ``CALIBRATION_VERSION``), so a changed model or a changed calibration
measures again, and ``semantic models list`` and ``/health`` show it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from itertools import groupby
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import mlx.nn as nn

from app.cache.blocks import KV_FORMATS, KVFormat
from app.engine.fidelity import Scores, TeacherForced, natural_texts

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 4  # bump when the texts, sizes, goal or formats change: every model measures again
RECORD_NAME = "kv_calibration.json"
PREFIX_TOKENS, SCORED_TOKENS = 1024, 256  # per text: the prefix stored in a format, the tokens scored after it
CHARS_PER_TOKEN = 8  # more than enough characters of a text are tokenized (both texts hold 3-4 a token)
LOSSLESS = "f16"


@dataclass(frozen=True, slots=True)
class Goal:
    """What a stored format must keep to be chosen."""

    top1: float = 0.98  # top-1 agreement with float KV, at least
    perplexity: float = 0.01  # |perplexity change| at most
    # Mean KL divergence from float KV at most: top-1 over a few hundred tokens moves by
    # 0.2-0.4 points a token, KL does not. Set by what answers keep (benchmarks/warm_cold.py,
    # greedy answers from a reused cache against a cold prefill): on SmolLM2, k6v4 (KL 0.0011,
    # top-1 98.6%) and k8v4 (KL 0.0009, 99.0%) share 82% and 78% of an answer's text, 7 of 10
    # identical; q8 (KL 0.0001) 100%, 10 of 10. Gemma 3's q8 measures KL 0.0006.
    kl: float = 0.0008

    def met_by(self, measured: Measured) -> bool:
        return (measured.top1_agreement >= self.top1 and abs(measured.perplexity_change) <= self.perplexity
                and measured.kl_mean <= self.kl)


GOAL = Goal()


@dataclass(frozen=True, slots=True)
class Measured:
    """One format's calibration scores (means over the texts)."""

    top1_agreement: float
    perplexity_change: float
    kl_mean: float
    bytes_vs_fp16: float

    @classmethod
    def mean(cls, scores: list[Scores], kv_format: KVFormat) -> Measured:
        n = len(scores)
        return cls(sum(s.top1_agreement for s in scores) / n, sum(s.perplexity_change for s in scores) / n,
                   sum(s.kl_mean for s in scores) / n, kv_format.bytes_vs_fp16)

    def describe(self) -> str:
        return (f"top-1 {self.top1_agreement:.1%}, perplexity {self.perplexity_change:+.2%}, "
                f"KL {self.kl_mean:.4f}, {self.bytes_vs_fp16:.1%} of FP16")


@dataclass(frozen=True)
class Calibration:
    """What a model's calibration measured and chose."""

    key: str  # the model's fingerprint under this calibration version: another one is stale
    chosen: str
    measured: dict[str, Measured]
    seconds: float
    version: int = CALIBRATION_VERSION

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "key": self.key, "chosen": self.chosen,
                           "seconds": self.seconds, "goal": asdict(GOAL),
                           "measured": {name: asdict(m) for name, m in self.measured.items()}}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Raises ValueError (or KeyError, TypeError) on a record that does not parse."""
        data = json.loads(text)
        measured = {name: Measured(**values) for name, values in data["measured"].items()}
        if data["chosen"] not in KV_FORMATS:
            raise ValueError(f"unknown format {data['chosen']!r}")
        return cls(str(data["key"]), data["chosen"], measured, float(data["seconds"]), int(data["version"]))


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
    """The model's recorded calibration, or None if missing, unreadable or stale (another key or version)."""
    path = model_dir / RECORD_NAME
    try:
        calibration = Calibration.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    if calibration.version != CALIBRATION_VERSION or calibration.key != key:
        log.info("%s is from another model or calibration version: measuring again", path)
        return None
    return calibration


def write_record(model_dir: Path, calibration: Calibration) -> None:
    """Write the record atomically (a concurrent reader sees the old one or the new one)."""
    path = model_dir / RECORD_NAME
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        scratch.write_text(calibration.to_json())
        scratch.replace(path)
    except OSError:
        scratch.unlink(missing_ok=True)
        log.warning("cannot write %s; the model will be calibrated again on its next load", path)
