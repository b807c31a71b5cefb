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


@dataclass(frozen=True)
class RuntimeProfile:
    device_kind: str  # cuda | cpu
    context_bytes: int
    workspace_bytes: int
    segment_bytes: int
    source: str  # where the numbers came from
    keeps_freed: bool = True  # a caching allocator: memory in use never falls back after a peak

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
    return CPU_DEFAULT if device.startswith("cpu") else CUDA_DEFAULT
