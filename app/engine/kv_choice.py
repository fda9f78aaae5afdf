"""The stored KV format a model uses, and why (``KVChoice``), with what its calibration
measured (``Calibration``, ``Measured``) against the goal (``Goal``): values, no MLX
(the engine's status hands them to the API). The calibration itself is ``calibration.py``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from app.cache.formats import KV_FORMATS, KVFormat

if TYPE_CHECKING:
    from app.engine.fidelity import Scores

CALIBRATION_VERSION = 4  # bump when the texts, sizes, goal or formats change: every model measures again


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


@dataclass(frozen=True, slots=True)
class KVChoice:
    """The stored KV format a model uses, and why: ``chosen_by`` "calibration" (the
    ``auto`` format: ``calibration`` holds what it measured), "setting" (``kv_format``
    or the model's entry in ``kv_formats``), or "pending" (``auto`` for a model not
    calibrated yet: it is, when it loads)."""

    format: KVFormat
    chosen_by: str
    calibration: Calibration | None = None

    @property
    def measured(self) -> Measured | None:
        """The format's calibration scores, if it was measured."""
        return self.calibration.measured.get(self.format.name) if self.calibration else None

    def describe(self) -> str:
        if self.chosen_by == "pending":
            return "auto (calibrated when the model first loads)"
        how = "auto" if self.chosen_by == "calibration" else "set"
        measured = self.measured
        size = measured.describe() if measured else f"{self.format.bytes_vs_fp16:.1%} of FP16"
        return f"{self.format.name} ({how}: {size})"
