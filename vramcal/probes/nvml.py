"""The one door to NVML.

Every NVML call in vramcal goes through :func:`query`. It initialises NVML lazily, maps NVML errors to
:class:`NA` (a value that could not be read, with the reason: never 0), and refuses calls after
:func:`shutdown`, so a sampler thread can never outlive ``nvmlShutdown``.

Tests replace the backend with a scripted fake (:func:`use_backend`); nothing else in the project is
faked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class NA:
    """A field NVML could not give, and why (``not supported``, ``GPU is lost``, ...)."""

    reason: str

    def __bool__(self) -> bool:
        return False


class NVMLUnavailable(Exception):
    """NVML cannot be used at all here (no library, no driver)."""


_lock = threading.RLock()
_backend = None  # the pynvml module, or a fake with the same functions
_state = "uninitialised"  # uninitialised | ready | shut | unavailable
_why_unavailable = ""


def use_backend(module) -> None:
    """Use ``module`` (pynvml or a scripted fake) for every later call; resets the door."""
    global _backend, _state, _why_unavailable
    with _lock:
        if _state == "ready" and _backend is not None:
            try:
                _backend.nvmlShutdown()
            except _errors():
                pass
        _backend, _state, _why_unavailable = module, "uninitialised", ""


def _init() -> None:
    global _backend, _state, _why_unavailable
    if _state == "ready":
        return
    if _state == "unavailable":
        raise NVMLUnavailable(_why_unavailable)
    if _state == "shut":
        raise NVMLUnavailable("NVML was shut down")
    if _backend is None:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            _state, _why_unavailable = "unavailable", "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            raise NVMLUnavailable(_why_unavailable) from None
        _backend = pynvml
    try:
        _backend.nvmlInit()
    except _errors() as exc:
        _state, _why_unavailable = "unavailable", f"nvmlInit failed: {_reason(exc)}"
        raise NVMLUnavailable(_why_unavailable) from None
    _state = "ready"


def _errors() -> type[BaseException]:
    """NVML's own error class (pynvml.NVMLError, or the fake backend's): the only errors the door turns
    into NA. Anything else is a bug and goes up."""
    return getattr(_backend, "NVMLError", None) or _pynvml_error()


def _pynvml_error() -> type[BaseException]:
    import pynvml

    return pynvml.NVMLError


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text.strip().rstrip(".")


def available() -> tuple[bool, str]:
    with _lock:
        try:
            _init()
            return True, ""
        except NVMLUnavailable as exc:
            return False, str(exc)


def query(name: str, *args):
    """Call NVML function ``name``; an NVML error comes back as :class:`NA`, never raised, never 0."""
    with _lock:
        try:
            _init()
        except NVMLUnavailable as exc:
            return NA(str(exc))
        fn = getattr(_backend, name, None)
        if fn is None:
            return NA(f"{name} is not in this NVML binding")
        try:
            return fn(*args)
        except _errors() as exc:  # pynvml.NVMLError and its subclasses, or the fake's
            return NA(_reason(exc))


def shutdown() -> None:
    """Shut NVML down; later queries answer NA. Call after every sampler has stopped."""
    global _state
    with _lock:
        if _state == "ready":
            try:
                _backend.nvmlShutdown()
            except _errors():
                pass
        if _state != "unavailable":
            _state = "shut"


def reopen() -> None:
    """Allow initialisation again after :func:`shutdown` (a new probe in the same process)."""
    global _state
    with _lock:
        if _state == "shut":
            _state = "uninitialised"


# ----------------------------------------------------------------------------- typed helpers

def device_handle(index: int):
    return query("nvmlDeviceGetHandleByIndex", index)


def memory_used(handle) -> int | NA:
    if isinstance(handle, NA):
        return handle
    info = query("nvmlDeviceGetMemoryInfo", handle)
    return info if isinstance(info, NA) else int(info.used)


def memory_total(handle) -> int | NA:
    if isinstance(handle, NA):
        return handle
    info = query("nvmlDeviceGetMemoryInfo", handle)
    return info if isinstance(info, NA) else int(info.total)


def memory_free(handle) -> int | NA:
    """Memory no process holds on this device (NVML ``free``): what a new run can have."""
    if isinstance(handle, NA):
        return handle
    info = query("nvmlDeviceGetMemoryInfo", handle)
    return info if isinstance(info, NA) else int(info.free)


def memory_reserved(handle) -> int | NA:
    """The driver's reserve (NVML v2 ``reserved``): device memory no process can have, which
    nvidia-smi's memory.used leaves out and NVML v1's ``used`` counts; NA where the driver or the binding
    has no v2 memory info."""
    if isinstance(handle, NA):
        return handle
    version = getattr(_backend, "nvmlMemory_v2", None) if _backend is not None else None
    if version is None:
        try:
            _init()
        except NVMLUnavailable as exc:
            return NA(str(exc))
        version = getattr(_backend, "nvmlMemory_v2", None)
    if version is None:
        return NA("this NVML binding has no v2 memory info (nvmlMemory_v2)")
    info = query("nvmlDeviceGetMemoryInfo", handle, version)
    if isinstance(info, NA):
        return info
    reserved = getattr(info, "reserved", None)
    return NA("NVML's v2 memory info has no reserved field here") if reserved is None else int(reserved)


def processes(handle) -> list[tuple[int, str | NA, int | NA]] | NA:
    """The compute processes on this device: (pid, process name, GPU memory used). A name or a size the
    driver does not give (containers, older drivers) is NA; the whole list is NA when NVML cannot list."""
    if isinstance(handle, NA):
        return handle
    procs = query("nvmlDeviceGetComputeRunningProcesses", handle)
    if isinstance(procs, NA):
        return procs
    out = []
    for p in procs:
        pid = int(p.pid)
        used = getattr(p, "usedGpuMemory", None)
        out.append((pid, _process_name(pid), NA("per-process usage not available (driver or container)")
                    if used is None else int(used)))
    return out


def _process_name(pid: int) -> str | NA:
    """NVML's name for ``pid`` (``nvmlSystemGetProcessName``), else /proc's; NA when neither says."""
    name = query("nvmlSystemGetProcessName", pid)
    if not isinstance(name, NA):
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip() or name
    except OSError:
        return name


def process_used(handle, pid: int) -> int | NA:
    """GPU memory used by process ``pid`` on this device; NA when the driver does not say."""
    if isinstance(handle, NA):
        return handle
    procs = query("nvmlDeviceGetComputeRunningProcesses", handle)
    if isinstance(procs, NA):
        return procs
    for p in procs:
        if int(p.pid) == pid:
            used = getattr(p, "usedGpuMemory", None)
            return NA("per-process usage not available (driver or container)") if used is None else int(used)
    return NA(f"process {pid} not listed on this device")


def pcie_link(handle) -> tuple[int | NA, int | NA]:
    """(PCIe generation, lanes) the link can run at in this slot (``Max``, not ``Curr``: an idle link
    drops to Gen1 to save power). NA each where the driver does not say (vGPU, MIG, GH200's C2C link)."""
    if isinstance(handle, NA):
        return handle, handle
    return query("nvmlDeviceGetMaxPcieLinkGeneration", handle), query("nvmlDeviceGetMaxPcieLinkWidth", handle)


def memory_bandwidth(handle) -> int | NA:
    """Peak memory bandwidth in bytes per second: 2 x max memory clock x bus width / 8 (NVML reports the
    memory clock as half the per-pin data rate, HBM included; nvbench computes its peak so)."""
    if isinstance(handle, NA):
        return handle
    bits = query("nvmlDeviceGetMemoryBusWidth", handle)
    mhz = query("nvmlDeviceGetMaxClockInfo", handle, 2)  # NVML_CLOCK_MEM
    for v in (bits, mhz):
        if isinstance(v, NA):
            return v
    if not bits or not mhz:
        return NA("bus width or memory clock reported as 0")
    return int(2 * int(mhz) * 1_000_000 * int(bits) // 8)


def compute_capability(handle) -> tuple[int, int] | NA:
    """CUDA's (major, minor) of the device, e.g. (9, 0) for an H100."""
    if isinstance(handle, NA):
        return handle
    cc = query("nvmlDeviceGetCudaComputeCapability", handle)
    return cc if isinstance(cc, NA) else (int(cc[0]), int(cc[1]))


def device_info(index: int) -> dict:
    """Name, UUID, total memory and driver of device ``index``; each field a value or NA."""
    h = device_handle(index)

    def text(v):
        return v.decode() if isinstance(v, bytes) else v

    return {
        "index": index,
        "name": text(query("nvmlDeviceGetName", h)) if not isinstance(h, NA) else h,
        "uuid": text(query("nvmlDeviceGetUUID", h)) if not isinstance(h, NA) else h,
        "total_bytes": memory_total(h),
        "driver": text(query("nvmlSystemGetDriverVersion")),
    }


# NVML's P2P capability indices and status (nvml.h: nvmlGpuP2PCapsIndex_t, nvmlGpuP2PStatus_t)
P2P_CAPS_READ = 0  # NVML_P2P_CAPS_INDEX_READ: peer reads, over PCIe or NVLink
P2P_CAPS_NVLINK = 2  # NVML_P2P_CAPS_INDEX_NVLINK
P2P_STATUS_OK = 0  # NVML_P2P_STATUS_OK


def p2p_all(indices: list[int], caps: int) -> bool | NA:
    """Whether every pair of devices ``indices`` answers ``nvmlDeviceGetP2PStatus(a, b, caps)`` OK: with
    ``P2P_CAPS_NVLINK`` it is vLLM's own NVLink test (``CudaPlatform.is_fully_connected``,
    ``platforms/cuda.py``), with ``P2P_CAPS_READ`` whether the driver allows peer access at all. False as
    soon as one pair answers another status; NA when NVML cannot say for a pair (vLLM reads that as no
    NVLink; here it is not known)."""
    handles = [device_handle(i) for i in indices]
    for h in handles:
        if isinstance(h, NA):
            return h
    for i, a in enumerate(handles):
        for b in handles[i + 1:]:
            status = query("nvmlDeviceGetP2PStatus", a, b, caps)
            if isinstance(status, NA):
                return status
            if int(status) != P2P_STATUS_OK:
                return False
    return True
