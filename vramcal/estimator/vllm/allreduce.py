"""Tensor parallelism by interconnect: whether vLLM's custom all-reduce is on, what it allocates per rank,
and which of it the profile's "non-torch" figure sees. Pure arithmetic; the interconnect itself is read
through NVML by :func:`vramcal.probes.hardware.interconnect_here`, or given (``--interconnect``).

Read in the vLLM wheels 0.10.2, 0.11.0, 0.15.1, 0.19.1, 0.27.1 and 0.33.0:

- ``CudaCommunicator`` (``distributed/device_communicators/cuda_communicator.py``) makes a
  ``CustomAllreduce`` for the tensor-parallel group unless ``disable_custom_all_reduce``.
- ``CustomAllreduce.__init__`` (``custom_all_reduce.py``) stays off for a world size outside
  ``_SUPPORTED_WORLD_SIZES`` (2, 4, 6, 8; 16 as well in 0.27.1 and 0.33.0), for more than two GPUs that
  are not all NVLink-connected ("not supported on more than two PCIe-only GPUs"; NVLink is
  ``CudaPlatform.is_fully_connected``: ``nvmlDeviceGetP2PStatus(.., NVML_P2P_CAPS_INDEX_NVLINK)`` OK for
  every pair, ``platforms/cuda.py``), and where GPU P2P fails (``_can_p2p``). Two PCIe GPUs with P2P take it.
- When on it allocates, per rank: ``meta_size() + max_size`` (the synchronisation signals, uncached, and a
  scratch buffer), a registered buffer of ``max_size`` (from 0.27 ``max(max_size, all-gather 2 MiB,
  reduce-scatter 16 MiB)``), both by ``cudaMalloc`` through ``allocate_shared_buffer_and_handle``, and
  ``rank_data``, 8 MiB by torch; ``max_size`` is 8 MiB (``8192 * 1024``).
- All of it is made in ``init_worker_distributed_environment``. From 0.11 ``Worker.init_device`` takes its
  init snapshot after that (``v1/worker/gpu_worker.py``), so none of it is in non-torch; in 0.10 the snapshot
  comes first and the two ``cudaMalloc`` buffers are non-torch memory.

Not counted: ``meta_size()`` (``sizeof(Signal)`` in the C++ extension, not read; a few KiB), the smaller
``max_size`` with torch symmetric memory on SM 9.0 / 10.x (``CUSTOM_ALL_REDUCE_MAX_SIZES``), and 0.27's
MNNVL buffer (kept only where the GPUs have multicast).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import UserError
from ...units import MIB
from . import versions as V

INTERCONNECTS = ("nvlink", "pcie")
MAX_SIZE = 8192 * 1024  # CustomAllreduce's max_size default
RANK_DATA = 8 * 1024 * 1024  # rank_data: torch.empty(8 MiB) on the device
ALL_GATHER_MAX = 2 * MIB  # 0.27: _DEFAULT_ALL_GATHER_MAX_SIZE
REDUCE_SCATTER_MAX = 16 * MIB  # 0.27: _DEFAULT_REDUCE_SCATTER_MAX_SIZE

# names a described GPU by, when its interconnect is not given: a guess, said as one
_NVLINK_WORDS = frozenset({"sxm", "sxm2", "sxm4", "sxm5", "hbm3", "hbm3e", "h200", "gh200", "b200", "b300", "gb200",
                           "gb300", "nvl"})
_PCIE_WORDS = frozenset({"pcie", "geforce", "rtx", "l4", "l40", "l40s", "a10", "a10g", "a16", "a2", "a40", "t4",
                         "titan", "quadro"})


@dataclass(frozen=True)
class Interconnect:
    """How the GPUs of a tensor-parallel group reach each other, and how vramcal knows."""

    kind: str  # nvlink | pcie
    source: str  # what said so: --interconnect, this machine's NVML, the GPU's name, or the default
    p2p: bool | None = None  # peer access between PCIe GPUs (the driver may refuse it); None: not known


def parse(text: str, flag: str = "--interconnect") -> str:
    kind = str(text).strip().lower()
    if kind not in INTERCONNECTS:
        raise UserError(f"{flag} {text!r} is not an interconnect: give nvlink (GPUs joined by NVLink or NVSwitch) "
                        "or pcie (peer traffic over PCIe)")
    return kind


def from_name(gpu_name: str | None) -> Interconnect | None:
    """A described GPU's usual interconnect by its name (SXM / HBM parts: NVLink; PCIe cards, GeForce, RTX
    workstation cards, L4 / L40: PCIe), or None when the name does not say."""
    words = set(re.findall(r"[a-z0-9]+", (gpu_name or "").lower()))
    if words & _NVLINK_WORDS:
        return Interconnect("nvlink", f"guessed from the GPU's name ({gpu_name}: such parts usually sit on NVLink); "
                                      "give --interconnect to say")
    if words & _PCIE_WORDS:
        return Interconnect("pcie", f"guessed from the GPU's name ({gpu_name}: such cards usually talk over PCIe); "
                                    "give --interconnect to say")
    return None


def resolve(given: Interconnect | None, gpu_name: str | None) -> Interconnect:
    """What a tensor-parallel estimate assumes: the interconnect given (or read on this machine), else the
    GPU name's guess, else NVLink -- the larger non-torch term, so the smaller, safe KV figure."""
    if given is not None:
        if given.kind not in INTERCONNECTS:
            parse(given.kind)
        return given
    return from_name(gpu_name) or Interconnect(
        "nvlink", "not known: NVLink assumed (its larger non-torch term gives the smaller KV cache); give "
                  "--interconnect pcie for GPUs without NVLink")


@dataclass(frozen=True)
class CustomAllReduce:
    """vLLM's custom all-reduce on one rank: on or off and why, and what it allocates when on."""

    on: bool
    why: str
    device_bytes: int = 0  # the meta and registered buffers (cudaMalloc, outside torch's allocator)
    torch_bytes: int = 0  # rank_data (torch)

    def non_torch_bytes(self, v: V.Version) -> int:
        """What of it the profile's non-torch figure sees: the cudaMalloc buffers before 0.11 (made after vLLM's
        init snapshot), nothing from 0.11 (made before it)."""
        return 0 if V.comms_before_snapshot(v) else self.device_bytes


def world_sizes(v: V.Version) -> tuple[int, ...]:
    """``CustomAllreduce._SUPPORTED_WORLD_SIZES``: 2, 4, 6, 8 (0.10.2-0.19.1 read); 16 as well (0.27.1, 0.33.0)."""
    return (2, 4, 6, 8, 16) if v >= (0, 27, 0) else (2, 4, 6, 8)


def custom_all_reduce(v: V.Version, tp: int, ic: Interconnect, disabled: bool = False) -> CustomAllReduce:
    """Whether ``CustomAllreduce`` turns itself on for a tensor-parallel group of ``tp`` GPUs (the module's doc),
    and its buffers."""
    if tp <= 1:
        return CustomAllReduce(False, "one GPU: no all-reduce")
    if disabled:
        return CustomAllReduce(False, "--disable-custom-all-reduce")
    if tp not in world_sizes(v):
        return CustomAllReduce(False, f"world size {tp} is not one it supports ({', '.join(map(str, world_sizes(v)))})")
    if ic.kind == "pcie" and tp > 2:
        return CustomAllReduce(False, "more than two PCIe-only GPUs (vLLM: \"not supported on more than two "
                                      "PCIe-only GPUs\"); NCCL does the all-reduce")
    if ic.kind == "pcie" and ic.p2p is False:
        return CustomAllReduce(False, "the GPUs have no P2P access (vLLM: \"your platform lacks GPU P2P "
                                      "capability\"); NCCL does the all-reduce")
    buffer = max(MAX_SIZE, ALL_GATHER_MAX, REDUCE_SCATTER_MAX) if v >= (0, 27, 0) else MAX_SIZE
    how = "NVLink" if ic.kind == "nvlink" else "two PCIe GPUs" + (" with P2P" if ic.p2p else " (P2P assumed)")
    return CustomAllReduce(True, f"on ({how}): meta {MAX_SIZE // MIB} MiB + buffer {buffer // MIB} MiB (cudaMalloc) + "
                                 f"rank_data {RANK_DATA // MIB} MiB (torch) per rank",
                           device_bytes=MAX_SIZE + buffer, torch_bytes=RANK_DATA)
