"""A correction: what one machine measured beyond the estimate, per stage, as a line in tokens.

Pure arithmetic, so an estimate can be corrected without importing the records layer: the records and
the fitting live in :mod:`vramcal.calibrate.corrections`, which hands the estimator these objects.

Per stage, ``measured - estimated = intercept + slope x tokens`` (tokens = ctx x batch); the residuals'
p95 is the band a corrected figure is likely to be off by (docs/calibration.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Correction:
    stage: str
    intercept_bytes: int
    slope_bytes_per_token: float
    n_runs: int
    residual_p50_bytes: int
    residual_p95_bytes: int
    source_runs: list[int]

    def at(self, tokens: int) -> int:
        return int(self.intercept_bytes + self.slope_bytes_per_token * tokens)


@dataclass
class CorrectionSet:
    """The corrections of one scope, and where they came from (shown beside a corrected estimate)."""

    stages: dict[str, Correction]
    scope: str = ""  # e.g. "this machine, same model and quant"
    hosts: list[str] = field(default_factory=list)
    note: str | None = None  # why no correction could be had (the records could not be read)

    def __bool__(self) -> bool:
        return bool(self.stages)

    @property
    def source_runs(self) -> list[int]:
        return sorted({r for c in self.stages.values() for r in c.source_runs})


def apply(stages: dict[str, int], tokens: int, corrections: dict[str, Correction],
          margin: str | None = None) -> dict[str, int]:
    """Corrected stages; ``margin='p95'`` adds each stage's p95 residual (for fitting to a budget).
    A corrected stage is never below zero."""
    out = {}
    for stage, raw in stages.items():
        c = corrections.get(stage)
        extra = 0 if c is None else c.at(tokens) + (c.residual_p95_bytes if margin == "p95" else 0)
        out[stage] = max(0, raw + extra)
    return out
