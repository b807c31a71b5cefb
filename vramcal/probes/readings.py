"""Typed stage readings, and the one rule for "minus the baseline".

A :class:`StageReading` is pure data: what a probe read at one stage marker, from one *series* (the
sampled counter: ``rss`` for the child's resident set on the CPU, ``gpu0``, ``gpu1`` ... for NVML
``memory.used``, ``None`` where no series was sampled and the child's ``torch.cuda.mem_get_info``
stands in). Every field that was not read is ``None``, never 0.

Which figure is compared with an estimate (:func:`comparable`):

- **CPU (series ``rss``)**: the child's resident set includes the Python interpreter, torch and
  transformers (about 0.5-1 GiB before any tensor exists), which the estimator does not count. The
  child reads its own resident set at ``baseline`` (imports done, nothing loaded), and every stage is
  compared as ``stage - baseline``: ``used_bytes`` and ``peak_bytes`` each minus the baseline's
  ``used_bytes``. The baseline stage itself becomes 0 used.
- **GPU (series ``gpuN``, or ``None`` with mem_get_info)**: the figure is absolute, less the driver's
  reserve where it is known (``reserve``: NVML v1 ``used``, which the sampler reads, counts the reserve;
  the stages are nvidia-smi's memory.used, which does not -- the rule: :mod:`vramcal.estimator.capacity`).
  Other processes' memory stays in (NVML ``memory.used`` is what decides an out-of-memory on that
  device), and the estimator counts the CUDA context itself; subtracting the baseline would hide both.
  Without a known reserve the figures are as read (and include it).

Worked example (CPU): baseline ``used_bytes`` 812 MiB; ``post_load`` used 1,020 MiB, peak 1,100 MiB
-> compared as used 208 MiB, peak 288 MiB. On ``gpu0`` the same figures are compared as read.

The torch counters (``torch_max_allocated``/``torch_max_reserved``, the child's peaks since the
previous marker, reset at every marker) and ``process_used_bytes`` (NVML's figure for the child alone,
which has no CUDA context at baseline) are not relative to the baseline: :meth:`StageReading.minus`
keeps them as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

CPU_SERIES = "rss"


@dataclass(frozen=True)
class StageReading:
    """One stage of one probe, as read. ``t``: seconds since the child started; ``samples``: how many
    samples fell in the interval that ends at the marker. What the child itself reported at the marker
    rides along: the weights it holds (``weights_bytes``), the cache's bytes, the prompt and the number
    of tokens generated (at ``end``)."""

    stage: str
    series: str | None
    used_bytes: int | None = None
    peak_bytes: int | None = None
    torch_max_allocated: int | None = None
    torch_max_reserved: int | None = None
    process_used_bytes: int | None = None
    t: float | None = None
    samples: int | None = None
    weights_bytes: int | None = None
    kv_bytes: int | None = None
    prompt_tokens: int | None = None
    generated: int | None = None

    @classmethod
    def from_stage(cls, stage: str, series: str | None, data: dict) -> StageReading:
        """From a stage's fields as assembled or serialised (absent keys are None; others ignored)."""
        known = {f.name for f in fields(cls)} - {"stage", "series"}
        return cls(stage, series, **{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("stage", "series")}

    def minus(self, baseline: StageReading) -> StageReading:
        """This reading with ``used_bytes`` and ``peak_bytes`` each reduced by the baseline's
        ``used_bytes`` (None stays None). Refuses a baseline read from another series: a resident
        set minus an NVML figure, or one GPU minus another, means nothing."""
        if baseline.series != self.series:
            raise ValueError(f"cannot subtract a {baseline.series!r} reading from a {self.series!r} reading")
        return self._less(baseline.used_bytes)

    def less_reserve(self, reserve: int) -> StageReading:
        """This GPU reading without the driver's reserve: ``used_bytes`` and ``peak_bytes`` each less
        ``reserve`` (None stays None). The torch counters and NVML's per-process figure never held it."""
        if self.series == CPU_SERIES:
            raise ValueError("a resident set holds no driver's reserve")
        return self._less(reserve)

    def _less(self, amount: int | None) -> StageReading:
        """``used_bytes`` and ``peak_bytes`` each less ``amount``; None (either side) gives None."""
        def less(v: int | None) -> int | None:
            return None if v is None or amount is None else v - amount

        return replace(self, used_bytes=less(self.used_bytes), peak_bytes=less(self.peak_bytes))


def subtracts_baseline(series: str | None) -> bool:
    """Whether readings of ``series`` are compared as ``stage - baseline`` (the module's rule)."""
    return series == CPU_SERIES


def comparable(readings: dict[str, StageReading], series: str | None,
               baseline: StageReading | None = None, reserve: int | None = None) -> dict[str, StageReading]:
    """The readings an estimate is compared with, by the module's rule: on ``rss`` each minus the
    baseline (``baseline``, or ``readings['baseline']``); on a GPU each less the driver's ``reserve``
    where it is known, else as read. Without a baseline reading on ``rss`` the used and peak figures are
    None: an absolute resident set is not comparable."""
    if not subtracts_baseline(series):
        for r in readings.values():
            if r.series != series:
                raise ValueError(f"a {r.series!r} reading among {series!r} readings")
        if reserve is None:
            return dict(readings)
        return {name: r.less_reserve(reserve) for name, r in readings.items()}
    base = baseline if baseline is not None else readings.get("baseline")
    if base is None:
        base = StageReading("baseline", series)  # nothing to subtract: every figure becomes None
    return {name: r.minus(base) for name, r in readings.items()}
