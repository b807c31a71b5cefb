"""What a run can have on a GPU: the device's total less the driver's reserve. The one home of that rule.

NVML reports a device's memory two ways (docs/accounting.md, "The driver's reserve"):

- ``nvmlDeviceGetMemoryInfo`` (v1): ``used`` counts the driver's reserve, ``free = total - used``;
- ``nvmlDeviceGetMemoryInfo_v2``: ``reserved`` on its own, ``used`` without it (nvidia-smi's
  memory.used), ``free = total - reserved - used``; ``total`` is the same physical total in both.

So ``free`` already leaves the reserve out, and a capacity read from free memory needs nothing taken off;
a capacity derived from a *total* (a described GPU, a device's size) is ``total - reserve``. The stages an
estimate prices are in nvidia-smi's sense (the reserve is no process's), so a measurement compared with
them is NVML v1 used less the reserve.

Where the reserve comes from, in order: measured on this machine (NVML v2 ``reserved``, read through the
one NVML door by :func:`vramcal.probes.machine.reserve_here`), vramcal's table of measured GPUs by NVML
name, else not known -- ``bytes`` None with the reason, and a capacity from a total stays the total.
"""

from __future__ import annotations

from dataclasses import dataclass

H200_SESSION = "measured on an NVIDIA H200, CUDA 13.0, driver 580.159.04, torch 2.11 (docs/validation/gpu-h200/)"
# NVML v2 ``reserved`` (or NVML v1 used with no process on the GPU) of described GPUs, by NVML name
DRIVER_RESERVE = {
    "NVIDIA H200": (648_347_648, "NVML used with no process, " + H200_SESSION),
}
COUNTED = "against the device's total, not in the stages"
# why nothing comes off a capacity read as free memory (--json's driver_reserve.why, fit and plan)
FROM_FREE = "free memory (NVML's free, either version) has already left the driver's reserve out"


@dataclass(frozen=True)
class DriverReserve:
    """The driver's reserve of one GPU: ``bytes`` (None: not known) and where it came from (``kind``:
    measured | table | unknown; ``source`` says which, or why not)."""

    bytes: int | None
    kind: str
    source: str

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "kind": self.kind, "source": self.source, "counted": COUNTED}

    def short(self) -> str:
        """The figure and where it came from, for a line of human output: ``618 MiB, vramcal's table``."""
        if self.bytes is None:
            return "not known"
        where = "measured here" if self.kind == "measured" else "vramcal's table"
        return f"{self.bytes / 1024**2:,.0f} MiB, {where}"

    def line(self, device: str = "the GPU") -> str:
        """One short line for human output."""
        if self.bytes is None:
            return f"{device}: the driver's reserve is not known ({self.source}): counted as nothing"
        return f"{device}: the driver's reserve ({self.short()}) is not the run's to have"


def reserve_for(name: str | None, measured: int | None = None, why_unmeasured: str | None = None) -> DriverReserve:
    """The reserve of a GPU named ``name`` (its NVML name): ``measured`` (NVML v2 here) where given, else the
    table's, else not known (``why_unmeasured`` says why there is no measurement)."""
    if measured is not None:
        if not isinstance(measured, int) or isinstance(measured, bool) or measured < 0:
            raise ValueError(f"a driver's reserve is a count of bytes >= 0, not {measured!r}")
        return DriverReserve(measured, "measured", "measured here: NVML v2 reserved")
    hit = DRIVER_RESERVE.get(name or "")
    if hit:
        return DriverReserve(hit[0], "table", f"table: {hit[1]}")
    why = f"no NVML v2 reading here ({why_unmeasured}), and " if why_unmeasured else ""
    return DriverReserve(None, "unknown", f"not known: {why}vramcal's table has no measurement of "
                         f"{name or 'this GPU'} (read it with NVML v2 on the machine)")


def reserve_of_target(gpu) -> DriverReserve:
    """The reserve of an estimate's GPU (a :class:`~vramcal.estimator.formats.GpuTarget`, or None): as read
    on this machine where the target is this machine's, else its name's table row, else not known."""
    here = getattr(gpu, "driver_reserve", None)
    return here if isinstance(here, DriverReserve) else reserve_for(getattr(gpu, "name", None))


def capacity(total_bytes: int, reserve: DriverReserve) -> int:
    """What a run can have of a device whose total is ``total_bytes``: the total less the driver's reserve;
    the total itself where the reserve is not known (the output says so: :meth:`DriverReserve.line`)."""
    if reserve.bytes is None:
        return total_bytes
    if reserve.bytes >= total_bytes:
        raise ValueError(f"a driver's reserve of {reserve.bytes:,} B leaves nothing of a {total_bytes:,} B device")
    return total_bytes - reserve.bytes
