"""The machine a plan is for: its GPUs (how much memory a run may have on each, their memory bandwidth,
their host link), its RAM and disk.

Two ways to get one:

- :func:`this_machine` reads it through the one NVML door: each GPU's *free* memory (and who holds the
  rest), its peak memory bandwidth from its memory clock and bus width, its PCIe link (the generation
  and lanes the slot allows); the available RAM through psutil.
- :func:`described` takes the sizes a user gives (``--hardware cuda:0=24GiB,cpu=64GiB``: the devices'
  sizes, not weight budgets) and, for bandwidths, a GPU model's name (``--gpu "RTX 4090"``) looked up in
  the table of known GPUs (``vramcal/data/gpus.csv``: vendor specifications, each row with its source),
  or explicit figures (``--bandwidth``).

Every bandwidth carries where it came from; one that cannot be had is ``None`` with the reason, never 0.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from ..errors import UserError
from ..estimator.capacity import FROM_FREE, DriverReserve, capacity, reserve_for
from ..estimator.formats import GpuTarget
from ..units import GB, parse_size
from ..workload import parse_device

MAX_DEVICE_BYTES = 1 << 50  # 1 PiB: no GPU, RAM or offload disk a plan is for is larger
CPU_BANDWIDTH_UNKNOWN = "the RAM's bandwidth is not known here: give --bandwidth cpu=RATE (e.g. cpu=80GB)"
# Per lane and direction, after line encoding (8b/10b to Gen2, 128b/130b from Gen3; Gen6's FLIT mode)
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: int | None
    source: str  # where the figure comes from, or why there is none

    def __bool__(self) -> bool:
        return self.bytes_per_s is not None


@dataclass
class GPU:
    device: str  # cuda:N
    memory_bytes: int  # what a run may have: the size given, or free now
    name: str | None = None
    total_bytes: int | None = None
    memory_bandwidth: Bandwidth = field(default_factory=lambda: Bandwidth(None, "unknown"))
    link_bandwidth: Bandwidth = field(default_factory=lambda: Bandwidth(None, "unknown"))
    held_by: str | None = None  # this machine: who holds the memory that is not free
    reserve: DriverReserve | None = None  # the driver's reserve (vramcal.estimator.capacity); None: not asked
    reserve_taken_off: bool = False  # memory_bytes is the size given less the reserve (a described GPU)
    compute_capability: tuple[int, int] | None = None  # NVML's here, the table's for a named GPU; None: not known

    def reserve_json(self) -> dict | None:
        """The reserve for --json, with whether it came off ``memory_bytes`` and why (as fit says it)."""
        if self.reserve is None:
            return None
        why = ("the size given is the GPU's total: the reserve comes off it" if self.reserve_taken_off else
               "not known: counted as nothing" if self.reserve.bytes is None else
               f"this machine's {FROM_FREE}, as CUDA's total (vLLM's) has")
        return {**self.reserve.to_dict(), "taken_off": self.reserve_taken_off, "why": why}

    @property
    def capacity_bytes(self) -> int:
        """What a run can have of the whole device: its total less the driver's reserve (the total where the
        reserve is not known) -- CUDA's total, which vLLM takes its share of; ``memory_bytes`` where no
        total is known."""
        if self.total_bytes is None:
            return self.memory_bytes
        return capacity(self.total_bytes, self.reserve or reserve_for(None))


@dataclass
class Hardware:
    gpus: list[GPU]
    cpu_bytes: int  # RAM offloaded weights may take (0: no offload to the CPU)
    disk_bytes: int | None = None  # room for disk offload, when given
    source: str = ""
    notes: list[str] = field(default_factory=list)  # e.g. a GPU model whose memory is not the size given
    # the RAM's bandwidth, for an engine that computes layers on the CPU (llama.cpp); only --bandwidth cpu=
    # gives it: neither NVML nor psutil reads it
    cpu_bandwidth: Bandwidth = field(default_factory=lambda: Bandwidth(None, CPU_BANDWIDTH_UNKNOWN))

    def sizes(self) -> dict[str, int]:
        out = {g.device: g.memory_bytes for g in self.gpus}
        if self.cpu_bytes:
            out["cpu"] = self.cpu_bytes
        if self.disk_bytes:
            out["disk"] = self.disk_bytes
        return out

    def reserves(self) -> dict[str, dict | None]:
        """Each GPU's driver's reserve for --json: bytes, measured here / table / not known, and how it counts."""
        return {g.device: g.reserve_json() for g in self.gpus}

    def gpu(self, device: str) -> GPU:
        return next(g for g in self.gpus if g.device == device)


# ------------------------------------------------------------------------------ known GPUs

@dataclass(frozen=True)
class KnownGPU:
    name: str
    memory_gb: float
    bandwidth_gbps: float
    pcie_gen: int | None
    pcie_lanes: int | None
    source: str
    compute_capability: tuple[int, int] | None = None  # CUDA's (major, minor), from NVIDIA's table of GPUs
    architecture: str | None = None  # ampere, ada, hopper, blackwell, ...

    def target(self) -> GpuTarget:
        """What the estimator needs of this GPU (which path a pre-quantized checkpoint takes on it)."""
        return GpuTarget(self.name, self.compute_capability, self.architecture, "vramcal's table of GPUs")


@lru_cache(maxsize=1)
def known_gpus() -> tuple[KnownGPU, ...]:
    text = resources.files("vramcal").joinpath("data").joinpath("gpus.csv").read_text()
    out = []
    for r in csv.DictReader(text.splitlines()):
        out.append(KnownGPU(r["nvml_name"], float(r["memory_gib"]), float(r["bandwidth_gbps"]),
                            int(r["pcie_gen"]) if r["pcie_gen"] else None,
                            int(r["pcie_lanes"]) if r["pcie_lanes"] else None, r["source"],
                            _capability(r.get("compute_capability")), r.get("architecture") or None))
    return tuple(out)


def _capability(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def gpu_target(name: str) -> GpuTarget:
    """``--gpu NAME``: the table's row for a GPU a person names, as the estimator's target; one line when
    the table has no such GPU (or more than one matches)."""
    if not isinstance(name, str) or not name.strip():
        raise UserError("--gpu needs a GPU's name, e.g. --gpu \"RTX 4090\" or --gpu H100")
    row = find_gpu(name)
    if row is None:
        names = [g.name for g in known_gpus() if all(w in _words(g.name) for w in _words(name))]
        hint = f"it matches {', '.join(names[:4])}: say which" if len(names) > 1 else \
            "vramcal's table (vramcal/data/gpus.csv) has no such GPU: give its NVML name, e.g. \"NVIDIA L4\""
        raise UserError(f"--gpu {name!r}: {hint}")
    return row.target()


def machine_gpu_target(device: str) -> GpuTarget | None:
    """This machine's GPU ``device`` (cuda:N) as the estimator's target, read through the one NVML door;
    None where NVML cannot say (no driver, no such GPU)."""
    from . import nvml

    if not str(device).startswith("cuda") or not nvml.available()[0]:
        return None
    index = int(str(device).partition(":")[2] or 0)
    cc = capability_here(index, from_table=False)  # a guess from the name would refuse a --gpu the probe could take
    if cc is None:
        return None
    name = nvml.device_info(index)["name"]
    from .machine import reserve_here

    row = find_gpu(name) if isinstance(name, str) else None
    return GpuTarget(name if isinstance(name, str) else None, cc, row.architecture if row else None,
                     "this machine (NVML)", driver_reserve=reserve_here(f"cuda:{index}"))


def device_gpu_target(device) -> GpuTarget | None:
    """The GPU a run on ``device`` loads on, as the estimator's target (``cuda`` and ``auto`` mean cuda:0):
    this machine's, through NVML; None for the CPU, or where NVML cannot say."""
    from ..workload import device_kind

    d = str(device or "").strip().lower()
    if device_kind(d) == "cpu" or not d.partition(":")[2].isdigit() and ":" in d:
        return None  # the CPU; a device index that does not parse is preflight's to refuse in one line
    return machine_gpu_target(d if ":" in d else "cuda:0")


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower().replace("geforce", " ").replace("nvidia", " "))


def _matches(name: str) -> list[KnownGPU]:
    """The table's rows a GPU's name matches: the NVML name as reported, else every row holding all of the
    name's words (whole words only: "L4" is not "L40", "A10" not "A100")."""
    want = _words(name)
    if not want:
        return []
    exact = [g for g in known_gpus() if g.name.lower() == name.lower().strip()]
    return exact or [g for g in known_gpus() if all(w in _words(g.name) for w in want)]


def find_gpu(name: str, total_bytes: int | None = None) -> KnownGPU | None:
    """The table's row for a GPU model: the NVML name as reported, or a short name a person types
    ("RTX 4090", "A100 80GB", "H100 SXM"). Whole words only ("L4" is not "L40", "A10" not "A100"); where
    two rows share a name, the memory size decides. None when nothing matches, or more than one does."""
    matches = _matches(name)
    if total_bytes is not None and len(matches) > 1:
        gb = total_bytes / GB
        near = [g for g in matches if abs(g.memory_gb - gb) <= 0.12 * g.memory_gb]
        matches = near or matches
    if len(matches) > 1:  # the shortest name is the plain model ("RTX 4090" rather than "RTX 4090 D")
        shortest = min(len(_words(g.name)) for g in matches)
        matches = [g for g in matches if len(_words(g.name)) == shortest]
    return matches[0] if len(matches) == 1 else None


def table_capability(name: str | None) -> tuple[int, int] | None:
    """The compute capability the table gives a GPU's name: its row's (:func:`find_gpu`, the lookup ``--gpu``
    makes), or, where the name matches several rows that all have one, that one (an "A100 80GB" is the SXM4
    or the PCIe card: 8.0 either way). None where the table does not say (no such GPU, or rows that differ)."""
    if not name:
        return None
    row = find_gpu(name)
    if row is not None:
        return row.compute_capability
    caps = {g.compute_capability for g in _matches(name)}
    return caps.pop() if len(caps) == 1 else None


def capability_here(index: int, from_table: bool = True) -> tuple[int, int] | None:
    """The compute capability of this machine's GPU ``index``, through the one NVML door: NVML's reading, else
    (an old driver without the query; ``from_table``) the table's for the name NVML gives; None where neither
    says."""
    from . import nvml

    cc = nvml.compute_capability(nvml.device_handle(index))
    if not isinstance(cc, nvml.NA):
        return cc
    if not from_table:
        return None
    name = nvml.device_info(index)["name"]
    return table_capability(name) if isinstance(name, str) else None


def link_bandwidth(gen: int | None, lanes: int | None, source: str) -> Bandwidth:
    if not gen or not lanes or gen not in PCIE_GBPS_PER_LANE:
        return Bandwidth(None, f"PCIe link unknown ({source})")
    return Bandwidth(int(PCIE_GBPS_PER_LANE[gen] * lanes * GB), f"PCIe Gen{gen} x{lanes}, {source}")


def from_table(gpu: GPU, name: str) -> None:
    """Fill a GPU's bandwidths from the table row of ``name``, where they are unknown."""
    row = find_gpu(name, gpu.total_bytes or gpu.memory_bytes)
    if row is None:
        if not gpu.memory_bandwidth:
            gpu.memory_bandwidth = Bandwidth(None, f"{name!r} is not in vramcal's table of GPUs: give --bandwidth")
        return
    gpu.name = gpu.name or row.name
    if not gpu.memory_bandwidth:
        gpu.memory_bandwidth = Bandwidth(int(row.bandwidth_gbps * GB), f"{row.name} specification ({row.source})")
    if not gpu.link_bandwidth:
        gpu.link_bandwidth = link_bandwidth(row.pcie_gen, row.pcie_lanes, f"{row.name} specification")


# ------------------------------------------------------------------------------ a described machine

def parse_hardware(text: str) -> dict[str, int]:
    """``--hardware cuda:0=24GiB,cuda:1=12GiB,cpu=64GiB[,disk=500GiB]``: each device's size. One-line
    UserError for a size that does not parse, zero or negative, a device twice, no GPU."""
    from ..estimator.placement import parse_max_memory

    try:
        sizes = parse_max_memory(text)
    except UserError as exc:
        raise UserError(str(exc).replace("--max-memory", "--hardware")) from None
    for dev, n in sizes.items():
        if n <= 0:
            raise UserError(f"--hardware {dev}={n}: a device's size must be above zero")
        if n > MAX_DEVICE_BYTES:
            raise UserError(f"--hardware {dev}: {n:,} bytes is beyond any device (at most 1 PiB): check the unit")
    if not any(d.startswith("cuda") for d in sizes):
        raise UserError("--hardware names no GPU: give at least one cuda:N=SIZE, e.g. cuda:0=24GiB,cpu=64GiB")
    return sizes


# what a bandwidth may be, in bytes per second: a GPU's memory (an RTX 3050 ~ 224 GB/s, a B200 8 TB/s) and
# a host link (PCIe 1.0 x1 ~ 0.25 GB/s, NVLink-C2C 900 GB/s), each with room; outside is a unit mistake,
# and gives decode bounds of 1e-10 or 1e11 tokens/s
MEMORY_RANGE = (GB, 100_000 * GB)
LINK_RANGE = (GB // 10, 10_000 * GB)


def parse_bandwidth(text: str | None) -> dict[str, int]:
    """``--bandwidth cuda:0=1008GB,pcie=25GB[,cpu=80GB]``: bytes per second per GPU's memory, the host link,
    and the RAM (``cpu``: what an engine that computes on the CPU reads its layers at)."""
    out: dict[str, int] = {}
    if text is None:
        return out
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise UserError(f"cannot read {item.strip()!r} in --bandwidth: write cuda:0=1008GB,pcie=25GB (per second)")
        if key not in ("pcie", "cpu"):
            key = str(parse_device(key, flag="device in --bandwidth"))
        if key in out:
            raise UserError(f"--bandwidth names {key} twice")
        try:
            n = parse_size(value.strip().removesuffix("/s"))
        except ValueError as exc:
            raise UserError(f"--bandwidth {key}: {exc}") from None
        if n <= 0:
            raise UserError(f"--bandwidth {key}: a bandwidth must be above zero")
        lo, hi = LINK_RANGE if key == "pcie" else MEMORY_RANGE
        if not lo <= n <= hi:
            what = "a host link" if key == "pcie" else "the RAM" if key == "cpu" else "a GPU's memory"
            raise UserError(f"--bandwidth {key}={value.strip()}: {n / GB:,.3g} GB/s is outside what {what} moves "
                            f"({lo / GB:g} to {hi / GB:,.0f} GB/s): check the unit (GB is GB per second)")
        out[key] = n
    return out


def described(sizes: dict[str, int], gpu_names: list[str] | None = None,
              bandwidths: dict[str, int] | None = None) -> Hardware:
    """A machine the user describes: sizes per device (a GPU's is its total), a GPU model per GPU (one name
    for all, or one per GPU in order) for the table's bandwidths and driver's reserve, explicit bandwidths
    over both. What a run may have of each GPU is its size less the reserve (the size where the model, and so
    the reserve, is not known: a note says so)."""
    gpus = [GPU(d, n, total_bytes=n) for d, n in sizes.items() if d.startswith("cuda")]
    names = gpu_names or []
    notes: list[str] = []
    if names and len(names) not in (1, len(gpus)):
        raise UserError(f"--gpu names {len(names)} models for {len(gpus)} GPUs: give one for all, or one per GPU")
    for i, g in enumerate(gpus):
        if names:
            name = names[0] if len(names) == 1 else names[i]
            if find_gpu(name, g.total_bytes) is None:
                raise UserError(f"--gpu {name!r}: not a GPU in vramcal's table (or it matches several): write its "
                                "name as nvidia-smi shows it, or give --bandwidth")
            from_table(g, name)
            row = find_gpu(name, g.total_bytes)
            g.reserve = reserve_for(row.name)
            g.compute_capability = row.compute_capability
            if abs(row.memory_gb * GB - g.memory_bytes) > 0.15 * row.memory_gb * GB:
                notes.append(f"--gpu {name!r} is the {row.name} with {row.memory_gb:g} GB, but {g.device} was given "
                             f"{g.memory_bytes / GB:,.1f} GB: its bandwidths are that model's")
    for g in gpus:
        g.reserve = g.reserve or reserve_for(None)
        if g.reserve.bytes is not None and g.reserve.bytes >= g.total_bytes:
            raise UserError(f"--hardware {g.device}={g.total_bytes:,} B is not above the {g.reserve.bytes:,} B the "
                            f"driver of a {g.name} keeps: give the GPU's whole size (NVML's total, as nvidia-smi "
                            "shows it)")
        g.memory_bytes = g.capacity_bytes
        g.reserve_taken_off = g.reserve.bytes is not None
    notes += reserve_notes(gpus)
    _override(gpus, bandwidths or {})
    return Hardware(gpus, sizes.get("cpu", 0), sizes.get("disk"), source="as described (--hardware)", notes=notes,
                    cpu_bandwidth=cpu_bandwidth(bandwidths or {}))


def reserve_notes(gpus: list[GPU], from_free: bool = False) -> list[str]:
    """One short line for the GPUs' driver's reserve: how much is taken off each (``from_free``: free memory
    has left it out already), or that it is not known."""
    known = [g for g in gpus if g.reserve is not None and g.reserve.bytes is not None]
    unknown = [g for g in gpus if g.reserve is None or g.reserve.bytes is None]
    out = []
    if known:
        lead = "free memory already leaves the driver's reserve out: " if from_free else \
            "the driver's reserve is not the run's: "
        out.append(lead + ", ".join(
            f"{g.device} ({g.reserve.short()})"
            for g in known))
    if unknown and not from_free:
        named = all(g.name for g in unknown)
        why = "vramcal's table has no reserve for that GPU" if named else "name the GPU with --gpu"
        out.append(f"the driver's reserve of {', '.join(g.device for g in unknown)} is not known ({why}, or read it "
                   "with NVML v2 on the machine): counted as nothing")
    return out


def cpu_bandwidth(bandwidths: dict[str, int]) -> Bandwidth:
    """The RAM's bandwidth: ``--bandwidth cpu=`` only (None with the reason otherwise, never a guess)."""
    if "cpu" in bandwidths:
        return Bandwidth(bandwidths["cpu"], "--bandwidth")
    return Bandwidth(None, CPU_BANDWIDTH_UNKNOWN)


def _override(gpus: list[GPU], bandwidths: dict[str, int]) -> None:
    for g in gpus:
        if g.device in bandwidths:
            g.memory_bandwidth = Bandwidth(bandwidths[g.device], "--bandwidth")
        if "pcie" in bandwidths:
            g.link_bandwidth = Bandwidth(bandwidths["pcie"], "--bandwidth")
    unknown = [d for d in bandwidths if d not in ("pcie", "cpu") and d not in {g.device for g in gpus}]
    if unknown:
        raise UserError(f"--bandwidth names {', '.join(unknown)}, which the machine has not")


# ------------------------------------------------------------------------------ this machine

def this_machine(bandwidths: dict[str, int] | None = None) -> Hardware:
    """This machine now, through the NVML door: free memory per GPU, bandwidths from the GPU's clocks and
    link (else the table by its name), available RAM. UserError when no GPU can be read."""
    import psutil

    from . import nvml
    from .machine import free_memory, reserve_here

    count = nvml.query("nvmlDeviceGetCount")
    if isinstance(count, nvml.NA) or count < 1:
        why = count.reason if isinstance(count, nvml.NA) else "none visible"
        raise UserError(f"no GPU to plan for here ({why}): describe the machine, e.g. --hardware "
                        "cuda:0=24GiB,cpu=64GiB")
    gpus = []
    for i in range(int(count)):
        fm = free_memory(f"cuda:{i}")
        if fm.free_bytes is None:
            raise UserError(f"cannot read the free memory of cuda:{i} ({fm.why_unread}): describe it with --hardware")
        h = nvml.device_handle(i)
        info = nvml.device_info(i)
        name = None if isinstance(info["name"], nvml.NA) else str(info["name"])
        # free memory has already left the driver's reserve out (NVML's free, either version): nothing comes off
        g = GPU(f"cuda:{i}", fm.free_bytes, name=name, total_bytes=fm.total_bytes, held_by=fm.describe(),
                reserve=reserve_here(f"cuda:{i}"), compute_capability=capability_here(i))
        bw = nvml.memory_bandwidth(h)
        if not isinstance(bw, nvml.NA):
            g.memory_bandwidth = Bandwidth(bw, "NVML: 2 x max memory clock x bus width")
        gen, lanes = nvml.pcie_link(h)
        if not isinstance(gen, nvml.NA) and not isinstance(lanes, nvml.NA):
            g.link_bandwidth = link_bandwidth(int(gen), int(lanes), "NVML max link")
        if name and (not g.memory_bandwidth or not g.link_bandwidth):
            from_table(g, name)
        gpus.append(g)
    _override(gpus, bandwidths or {})
    return Hardware(gpus, int(psutil.virtual_memory().available), None, source="this machine, now (NVML, psutil)",
                    cpu_bandwidth=cpu_bandwidth(bandwidths or {}), notes=reserve_notes(gpus, from_free=True))


def interconnect_here(gpus: list[int]):
    """How this machine's GPUs ``gpus`` reach each other, through the NVML door: NVLink when NVML says every
    pair is NVLink-connected (vLLM's own test, ``is_fully_connected``), else PCIe, with whether the driver allows
    P2P reads between them. None for fewer than two GPUs, or when NVML cannot say (an estimate then assumes,
    and says so)."""
    from ..estimator.vllm.allreduce import Interconnect
    from . import nvml

    have = nvml.query("nvmlDeviceGetCount")
    if isinstance(have, nvml.NA) or len(gpus) < 2 or max(gpus) >= int(have):
        return None
    which = f"this machine's GPUs {','.join(map(str, gpus))}"
    nvlink = nvml.p2p_all(gpus, nvml.P2P_CAPS_NVLINK)
    if nvlink is True:
        return Interconnect("nvlink", f"{which}: NVML's P2P status says NVLink for every pair")
    p2p = nvml.p2p_all(gpus, nvml.P2P_CAPS_READ)
    if isinstance(nvlink, nvml.NA) and isinstance(p2p, nvml.NA):
        return None
    said = "not every pair on NVLink" if nvlink is False else f"NVLink not readable ({nvlink.reason}; vLLM reads that as none)"
    peer = "P2P reads allowed" if p2p is True else "no P2P reads" if p2p is False else f"P2P not readable ({p2p.reason})"
    return Interconnect("pcie", f"{which}: NVML's P2P status says {said}, {peer}",
                        p2p=p2p if isinstance(p2p, bool) else None)
