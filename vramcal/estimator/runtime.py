"""What the software stack costs besides tensors, per device kind.

Defaults, each overridable and later replaced by what a machine measured (``vramcal.calibrate``):

CUDA (``memory.used`` as NVML reports it):

- ``context_bytes`` 512 MiB: the CUDA context torch creates on first use (driver state, kernel images
  loaded lazily since CUDA 11.7's ``CUDA_MODULE_LOADING=LAZY``); typically 300-600 MiB on recent
  drivers and GPUs.
- ``workspace_bytes`` 32 MiB: the cuBLAS / cuBLASLt workspace torch allocates on the first matmul
  through its own caching allocator (``CUBLAS_WORKSPACE_CONFIG``; 32 MiB on Hopper).
- ``segment_bytes`` 2 MiB: the caching allocator reserves device memory in segments rounded up to
  2 MiB and keeps them after tensors are freed, so ``memory.used`` never falls back after a peak
  unless ``empty_cache`` is called: every stage is a running peak.

CPU (resident set of the process, for the CPU probe path):

- ``context_bytes`` 0: the probe subtracts the process's resident set before loading (its baseline
  with torch and transformers imported), so only what loading and generating add is compared.
- ``keeps_freed`` False: no caching allocator, so CPU stages are not running peaks. What the resident
  set holds at each stage (the checkpoint's mapped pages, the heap glibc keeps) is the CPU model of
  :mod:`vramcal.estimator.cpu` (docs/cpu-memory.md), not this profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..units import MIB
from ..workload import device_kind
from .capacity import H200_SESSION, DriverReserve, reserve_for, reserve_of_target


@dataclass(frozen=True)
class RuntimeProfile:
    device_kind: str  # cuda | cpu
    context_bytes: int
    workspace_bytes: int
    segment_bytes: int
    source: str  # where the numbers came from
    keeps_freed: bool = True  # a caching allocator: memory in use never falls back after a peak
    kernels_bytes: int = 0  # loaded by the first forward (lazy module loading, cuBLAS's own state): first_token on
    terms: dict | None = None  # each non-torch term with its provenance (:func:`cuda_terms`), for --json

    def reserve(self, allocated_bytes: int) -> int:
        """Bytes the caching allocator holds for ``allocated_bytes`` of live blocks (no fragmentation)."""
        if self.segment_bytes <= 1:
            return allocated_bytes
        return -(-allocated_bytes // self.segment_bytes) * self.segment_bytes


CUDA_DEFAULT = RuntimeProfile("cuda", context_bytes=512 * MIB, workspace_bytes=32 * MIB, segment_bytes=2 * MIB,
                              source="vramcal defaults (docs/accounting.md)")
CPU_DEFAULT = RuntimeProfile("cpu", context_bytes=0, workspace_bytes=0, segment_bytes=1,
                             source="vramcal defaults: CPU probe subtracts its own baseline", keeps_freed=False)


def default_profile(device: str) -> RuntimeProfile:
    return CPU_DEFAULT if device_kind(device) == "cpu" else CUDA_DEFAULT


# ------------------------------------------------------------------ the non-torch terms, each by what it is

# Memory outside torch's allocator, by architecture: NVML used - the driver's reserve - torch's reserved,
# after loading (the context, the kernels loading needed) and what the first forward added (kernels loaded
# lazily, cuBLAS's own state). Only Hopper has been measured; every other architecture takes the default.
MEASURED_CONTEXT = {
    "hopper": {"context": 645_464_064, "kernels": 79_691_776, "source": H200_SESSION},
}
CUBLAS_SOURCE = ("torch aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize: 32 MiB on compute "
                 "capability 9.x-12.x, else 4096 KiB x 2 + 16 KiB x 8; one per handle and stream, allocated through "
                 "the caching allocator (so inside reserved)")


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None) -> int | None:
    """The cuBLAS workspace torch allocates for the generate stream's handle (``CUBLAS_WORKSPACE_CONFIG``
    unset), or None for an unknown GPU."""
    if compute_capability is None:
        return None
    return 32 * MIB if compute_capability[0] in (9, 10, 11, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


def cuda_terms(gpu=None, driver_reserve: DriverReserve | int | None = None) -> RuntimeProfile:
    """The CUDA runtime profile of ``gpu`` (a :class:`~vramcal.estimator.formats.GpuTarget`, or None),
    each term with where it came from: measured here (``driver_reserve``, read through NVML on this
    machine), vramcal's table of measured GPUs, or the default (the reserve's rule:
    :mod:`vramcal.estimator.capacity`).

    The driver's reserve is counted against the device's total (what a run can have), never in the
    stages: nvidia-smi's memory.used and the stages both leave it out."""
    arch = getattr(gpu, "architecture", None)
    cc = getattr(gpu, "compute_capability", None)
    name = getattr(gpu, "name", None)
    measured = MEASURED_CONTEXT.get(arch or "")
    terms: dict[str, dict] = {}
    if measured:
        context, kernels = measured["context"], measured["kernels"]
        terms["cuda_context"] = {"bytes": context, "source": f"table: {measured['source']}"}
        terms["kernels_after_first_forward"] = {"bytes": kernels, "source": f"table: {measured['source']}"}
    else:
        context, kernels = CUDA_DEFAULT.context_bytes, 0
        terms["cuda_context"] = {"bytes": context, "source": "default: 512 MiB (no measurement for "
                                 f"{'architecture ' + arch if arch else 'this GPU'}; docs/accounting.md)"}
        terms["kernels_after_first_forward"] = {"bytes": None, "source": "not known without a measurement of "
                                                "this architecture (counted in the default context)"}
    ws = cublas_workspace_bytes(cc)
    terms["cublas_workspace"] = {"bytes": ws if ws is not None else CUDA_DEFAULT.workspace_bytes,
                                 "source": f"table: {CUBLAS_SOURCE}" if ws is not None else
                                 "default: 32 MiB (compute capability not known)", "inside_reserved": True}
    reserve = driver_reserve if isinstance(driver_reserve, DriverReserve) else \
        reserve_of_target(gpu) if driver_reserve is None else reserve_for(name, driver_reserve)
    terms["driver_reserve"] = reserve.to_dict()
    where = "; ".join(f"{k}: {v['source'].split(':')[0]}" for k, v in terms.items())
    return RuntimeProfile("cuda", context_bytes=context, workspace_bytes=terms["cublas_workspace"]["bytes"],
                          segment_bytes=2 * MIB, source=where, kernels_bytes=kernels, terms=terms)

