"""Reconcile a measurement with its estimate: the stage rows a run records (estimate beside
measurement, per stage and, for a split run, per device) and the component differences ``check``
reports. The corrections fitted from those rows are :mod:`vramcal.calibrate.corrections`.

On the CPU path the measured figure is the child's reading minus its baseline (docs/accounting.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..records.store import DeviceStageRow, StageRow

__all__ = ["ComponentDeltas", "component_deltas", "device_stage_rows", "stage_rows"]


def stage_rows(result) -> list[StageRow]:
    """Rows for the ``stages`` table: estimate beside measurement, per stage of a probe result. The
    measured figures follow the probe's one baseline rule (``ProbeResult.measured``); the baseline row
    itself is kept as read, so the absolute figure stays in the records. A split run's main series is
    set beside its main device's estimate, not beside the sum over GPUs."""
    est = result.estimate.main_stages() if result.estimate is not None else {}
    measured = result.measured()
    rows = []
    for name, r in measured.items():
        if name == "baseline":
            r = result.stages[name]
        rows.append(StageRow(name, est.get(name), r.peak_bytes, r.used_bytes, r.torch_max_allocated,
                             r.torch_max_reserved))
    return rows


def device_stage_rows(result) -> list[DeviceStageRow]:
    """Rows for the ``device_stages`` table of a split run: per device and stage, the estimate beside
    the measurement (GPUs: NVML less the driver's reserve where known; ``cpu``: the child's resident set
    above its baseline)."""
    est = (result.estimate.devices if result.estimate is not None else None) or {}
    rows = []
    for dev, stages in (result.measured_devices() or {}).items():
        e = est[dev].stages if dev in est else {}
        for name, r in stages.items():
            rows.append(DeviceStageRow(dev, name, e.get(name), r.peak_bytes, r.used_bytes))
    return rows


@dataclass(frozen=True)
class ComponentDeltas:
    """Measured minus estimated, where the stages separate the components (None where they do not)."""

    context: int | None = None
    weights: int | None = None
    generation: int | None = None

    def items(self):
        return {"context": self.context, "weights": self.weights, "generation": self.generation}.items()


def component_deltas(result) -> ComponentDeltas:
    """Measured minus estimated where the stages separate the components: the context
    (``context - baseline``), the weights (``post_load`` minus where loading started) and generation
    (the prefill's peak above ``post_load``, minus the estimated activations and prompt cache). A CPU
    estimate's stages are the resident set, so there the weights are compared with its ``post_load``
    stage and generation with its ``first_token - post_load``. Each difference of two readings goes
    through the one delta rule (``StageReading.minus``)."""
    read = result.readings()
    est = result.estimate
    if est is None:
        return ComponentDeltas()
    start = read.get("context") or read.get("baseline")
    context = None
    if "context" in read and "baseline" in read:
        context = read["context"].minus(read["baseline"]).used_bytes
    staged = est.main_stages()
    if "resident set" in est.methods:
        # the CPU estimate's stages are the resident set (mapped pages, heap), not the tensors: compare
        # what loading added with its post_load stage, and the prefill with its first_token - post_load
        weights_est, generation_est = staged["post_load"], staged["first_token"] - staged["post_load"]
    elif est.devices:
        dev = est.devices[est.main_device]
        weights_est = dev.components["weights"]
        generation_est = dev.components["activations"] + _kv_prompt(dev.components["kv_cache"], est)
    else:
        weights_est = est.components["weights"]
        generation_est = est.components["activations"] + _kv_prompt(est.components["kv_cache"], est)
    weights = generation = None
    if start is not None and "post_load" in read:
        added = read["post_load"].minus(start).used_bytes
        weights = None if added is None else added - weights_est
    if "first_token" in read and "post_load" in read:
        above = read["first_token"].minus(read["post_load"]).peak_bytes
        generation = None if above is None else above - generation_est
    return ComponentDeltas(context, weights, generation)


def _kv_prompt(kv_end: int, est) -> int:
    """The cache right after the prefill, scaled from the cache at the end (prompt of prompt + new - 1)."""
    return int(kv_end * est.prompt / max(est.prompt + est.new_tokens - 1, 1))
