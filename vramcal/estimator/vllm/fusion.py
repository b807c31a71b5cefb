"""FlashInfer's all-reduce + RMSNorm fusion workspace: device memory outside torch that vLLM's profile counts
as non-torch on tensor-parallel Hopper / Blackwell ranks. Pure arithmetic.

Read in the vLLM wheels 0.15.1, 0.17.1, 0.18.0, 0.19.1, 0.24.0, 0.27.1 and 0.33.0, and in flashinfer-python 0.6.6
(the version 0.18.0 and 0.19.1 pin):

- *When it is on* (``config/vllm.py``): the optimization levels -O2 (the default) and -O3 set
  ``pass_config.fuse_allreduce_rms`` to ``enable_allreduce_rms_fusion``, true when tp > 1, the platform is CUDA,
  FlashInfer is installed (a hard dependency of every wheel read from 0.13), the GPU is compute capability 9.0 or
  10.0 (0.17.1, 0.18.0; the whole 10.x family from 0.19.1) and pp = dp = 1. 0.15.1 and before set it False at every
  level. ``--enforce-eager`` sets the compilation mode to NONE, so no Inductor pass runs and nothing is made.
- *When it is made*: ``AllReduceFusionPass.__init__`` (``compilation/passes/fusion/allreduce_rms_fusion.py``) asks
  ``get_fi_ar_workspace`` for it while the first compilation sets up its passes -- the profile run's forward, so
  inside ``memory_profiling``'s window. It is skipped for a world size outside ``FI_ALLREDUCE_FUSION_MAX_SIZE_MB``
  (2, 4, 8 on SM 9.0) and when FlashInfer cannot make it (no NVSwitch multicast: "expected on GPUs without
  NVSwitch").
- *Its size*: ``max_token_num = min(max_size // (hidden x itemsize), max_num_batched_tokens)``, ``max_size`` from
  ``FI_ALLREDUCE_FUSION_MAX_SIZE_MB[capability][tp]`` (SM 9.0: 64 MiB at tp 2, 2 at tp 4, 0.5 at tp 8). Single-node
  the backend is ``trtllm`` (0.18.0-0.24.0; from 0.27.1 ``mnnvl`` first -- its workspace is not read here, priced
  as trtllm's). flashinfer's ``trtllm_create_ipc_workspace_for_all_reduce_fusion`` (``comm/trtllm_ar.py``) makes
  three buffers per rank: ``tp x T x hidden x 2`` bytes, ``tp x 256 x 4`` of barrier flags, and
  ``3 x min(tp x T x hidden x (2, or 4 for float32), MAX_COMM_SIZE)`` of Lamport buffers, each rounded up to 2 MiB,
  then allocated as ``SymmDeviceMemory`` (``comm/mnnvl.py``): ``cuMemCreate`` of the size plus a 2 KiB signal pad,
  rounded up to the allocation granularity and then to the driver's *recommended multicast granularity*
  (``cuMulticastGetGranularity(.., CU_MULTICAST_GRANULARITY_RECOMMENDED)``). The quantized patterns' workspace is
  the same one when its backend is the same (trtllm).

The multicast granularity is the driver's, not in any source read: 512 MiB on H100 (the minimum is 2 MiB), as
published by others who measured it, and assumed the same on Blackwell (not published). On SM 9.0 and 10.0 that
makes every buffer 512 MiB and the workspace 1.5 GiB per rank at tp 2, 4 and 8 alike (SM 10.3's 64 MiB at tp 4 makes
its Lamport buffer 1 GiB at hidden 8192). The in-sample 0.19 H100 logs agree: tp 4 logs 0.07-0.12 GiB *more*
non-torch than tp 2, where a 2 MiB granularity would put tp 2 0.47 GiB above tp 4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...units import MIB
from . import versions as V

# FI_ALLREDUCE_FUSION_MAX_SIZE_MB by capability, MiB (0.17.1-0.33.0 read; 0.33.0 raises 10.3's tp 8 to 4, not
# versioned here: at the 512 MiB granularity it makes no difference to the bytes)
MAX_SIZE_MIB = {(9, 0): {2: 64, 4: 2, 8: 0.5}, (10, 0): {2: 64, 4: 32, 8: 1}, (10, 3): {2: 64, 4: 64, 8: 2}}
BARRIER_FLAGS = 256  # flashinfer's BarrierFlagCount (int32 each)
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)  # flashinfer's MAX_COMM_SIZE: INT32_MAX down to 2 MiB
SIGNAL_PAD = 2048  # SymmDeviceMemory's signal pad, allocated even when unused
BUFFER_ALIGN = 2 * MIB  # trtllm_create_ipc_workspace_for_all_reduce_fusion rounds each buffer to 2 MiB
ALLOC_GRANULARITY = 2 * MIB  # cuMemCreate's recommended granularity for device memory
MULTICAST_GRANULARITY = 512 * MIB  # the driver's recommended multicast granularity: H100 measured, Blackwell assumed


@dataclass(frozen=True)
class FusionWorkspace:
    """The fusion pass's workspace on one rank: on or off and why, and its bytes when on."""

    on: bool
    why: str
    device_bytes: int = 0


def _takes(v: V.Version, cap: tuple[int, int]) -> bool:
    """``enable_allreduce_rms_fusion``'s capability test: 9.0 or 10.0 (0.17, 0.18), 9.0 or the 10.x family (0.19 on)."""
    return cap == (9, 0) or (cap[0] == 10 if v >= (0, 19, 0) else cap == (10, 0))


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


def buffer_bytes(size: int) -> int:
    """What one of flashinfer's three buffers takes on the device: 2 MiB-aligned, plus the signal pad, rounded to
    the allocation and then the multicast granularity (``SymmDeviceMemory._get_allocation_prop``)."""
    return _up(_up(_up(size, BUFFER_ALIGN) + SIGNAL_PAD, ALLOC_GRANULARITY), MULTICAST_GRANULARITY)


def workspace_bytes(tp: int, max_size: int, hidden: int, itemsize: int, max_num_batched_tokens: int) -> int:
    """The trtllm workspace of one rank (the module's doc)."""
    tokens = min(max_size // (hidden * itemsize), max_num_batched_tokens)
    lamport_el = 4 if itemsize == 4 else 2
    sizes = (tp * tokens * hidden * 2, tp * BARRIER_FLAGS * 4,
             3 * min(tp * tokens * hidden * lamport_el, MAX_COMM_SIZE))
    return sum(buffer_bytes(s) for s in sizes)


def fusion_workspace(v: V.Version, tp: int, pp: int, interconnect: str, gpu_name: str | None,
                     capability: tuple[int, int] | None, hidden: int, itemsize: int, max_num_batched_tokens: int,
                     enforce_eager: bool) -> FusionWorkspace:
    """Whether vLLM makes the all-reduce + RMSNorm fusion workspace on this rank, and its bytes (the module's doc),
    by the GPU's compute ``capability`` (vramcal's table of GPUs for a named one, NVML for this machine's). Where
    the capability is not known: with no GPU named it is priced on over NVLink, as on an H100 (the larger non-torch
    term, so the smaller, safe KV figure); a GPU named but not in the table is priced without it, as a name outside
    the listed 9.0 / 10.x parts was before the table decided (the table carries the Hopper and Blackwell
    datacenter parts, so a name it does not know is most likely another kind, and no published figure moves)."""
    if tp <= 1:
        return FusionWorkspace(False, "one GPU: no all-reduce")
    if v < (0, 17, 0):
        return FusionWorkspace(False, "before 0.17 the fusion is off at every optimization level")
    if enforce_eager:
        return FusionWorkspace(False, "--enforce-eager: no torch.compile, so no fusion pass")
    if pp > 1:
        return FusionWorkspace(False, "pp > 1: vLLM leaves the fusion off (tp-pp combination)")
    if interconnect != "nvlink":
        return FusionWorkspace(False, "over PCIe: FlashInfer finds no NVSwitch multicast and makes no workspace")
    # the board, not the chip: an NVL part (H100 NVL, H200 NVL) is a bridged pair whatever its capability
    words = set(re.findall(r"[a-z0-9]+", (gpu_name or "").lower()))
    if "nvl" in words and not words & {"gb200", "gb300"}:
        return FusionWorkspace(False, f"{gpu_name}: NVLink-bridged pairs have no NVSwitch multicast, so FlashInfer "
                                      "makes no workspace")
    if capability is None and gpu_name:
        return FusionWorkspace(False, f"{gpu_name}: its compute capability is not known (not in vramcal's table of "
                                      "GPUs), so it is not taken for the 9.0 / 10.x the fusion needs")
    if capability is not None and capability[0] not in (9, 10):
        return FusionWorkspace(False, f"{gpu_name or 'the GPU'} ({capability[0]}.{capability[1]}) is not compute "
                                      "capability 9.0 / 10.x, which the fusion needs")
    assumed = capability is None
    cap = capability or (9, 0)
    if not _takes(v, cap):
        return FusionWorkspace(False, f"compute capability {cap[0]}.{cap[1]} is not one vLLM {V.fmt_version(v)} "
                                      "fuses on")
    sizes = MAX_SIZE_MIB.get(cap, {})
    if tp not in sizes:
        return FusionWorkspace(False, f"world size {tp} is not one FlashInfer's fusion supports (2, 4, 8)")
    max_size = int(sizes[tp] * MIB)
    n = workspace_bytes(tp, max_size, hidden, itemsize, max_num_batched_tokens)
    how = "no GPU named: an SM 9.0 GPU on NVSwitch assumed; " if assumed else ""
    return FusionWorkspace(True, f"{how}FlashInfer's all-reduce + RMSNorm fusion workspace (0.17 on, SM "
                                 f"{cap[0]}.{cap[1]}, tp {tp}, up to {max_size / MIB:g} MiB): three buffers of "
                                 f"{MULTICAST_GRANULARITY // MIB} MiB multicast granularity, {n / MIB:.0f} MiB",
                           device_bytes=n)
