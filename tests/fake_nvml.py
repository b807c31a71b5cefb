"""A scripted stand-in for pynvml at vramcal's one NVML door (gpustat's approach): per-GPU values
that change over time, NVML errors per field, and a GPU that disappears."""

from __future__ import annotations

from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    def __str__(self):
        return "Not Supported"


class NVMLError_GpuIsLost(NVMLError):
    def __str__(self):
        return "GPU is lost"


class FakeNVML:
    """``script`` maps a GPU index to a list of memory.used values returned in turn (the last repeats);
    a value that is an exception instance is raised instead. ``procs`` maps index to {pid: bytes}, and a
    pid's bytes of None means the driver does not report per-process usage. ``names`` maps pid to the
    process name NVML reports (a pid not in it: NVML says "Not Found"). Free memory is total - used."""

    NVMLError = NVMLError  # the door catches its backend's NVML errors only

    def __init__(self, script: dict[int, list], total: int = 80 * 1024**3, procs=None, fail_init: bool = False,
                 names: dict[int, str] | None = None, gpu_name: str = "NVIDIA H200", pcie: tuple | None = None,
                 memory_clock: tuple | None = None, reserved: int | None = None,
                 compute_capability: tuple[int, int] | None = None, p2p: dict | None = None):
        self.script = {k: list(v) for k, v in script.items()}
        self.calls = {k: 0 for k in script}
        self.total = total
        self.procs = procs or {}
        self.names = names or {}
        self.fail_init = fail_init
        self.inits = 0
        self.shutdowns = 0
        self.lost: set[int] = set()
        self.gpu_name = gpu_name
        self.pcie = pcie  # (max generation, max lanes); None: not supported
        self.memory_clock = memory_clock  # (max memory clock MHz, bus width bits); None: not supported
        self.reserved = reserved  # the driver's reserve (NVML v2 memory info); None: a binding without v2
        self.compute_capability = compute_capability  # None: not supported (an old driver)
        # (caps index) -> P2P status of every pair, or an exception to raise (nvmlDeviceGetP2PStatus);
        # a caps index not in it: NVML says "Not Supported"
        self.p2p = p2p or {}
        if reserved is not None:
            self.nvmlMemory_v2 = 0x02000028

    def nvmlInit(self):
        if self.fail_init:
            raise NVMLError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.script)

    def nvmlDeviceGetHandleByIndex(self, i):
        if i in self.lost:
            raise NVMLError_GpuIsLost()
        if i not in self.script:
            raise NVMLError("Invalid Argument")
        return i

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        values = self.script[h]
        v = values[min(self.calls[h], len(values) - 1)]
        self.calls[h] += 1
        if isinstance(v, Exception):
            raise v
        if version is not None:  # v2: used leaves the driver's reserve out, as nvidia-smi does
            return SimpleNamespace(used=v - self.reserved, total=self.total, free=self.total - v,
                                   reserved=self.reserved)
        return SimpleNamespace(used=v, total=self.total, free=self.total - v)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if h not in self.procs:
            raise NVMLError_NotSupported()
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in self.procs[h].items()]

    def nvmlSystemGetProcessName(self, pid):
        if pid not in self.names:
            raise NVMLError("Not Found")
        return self.names[pid].encode()

    def nvmlDeviceGetName(self, h):
        return self.gpu_name.encode()

    def nvmlDeviceGetCudaComputeCapability(self, h):
        if self.compute_capability is None:
            raise NVMLError_NotSupported()
        return self.compute_capability

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        if self.pcie is None:
            raise NVMLError_NotSupported()
        return self.pcie[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        if self.pcie is None:
            raise NVMLError_NotSupported()
        return self.pcie[1]

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        if self.memory_clock is None or kind != 2:
            raise NVMLError_NotSupported()
        return self.memory_clock[0]

    def nvmlDeviceGetMemoryBusWidth(self, h):
        if self.memory_clock is None:
            raise NVMLError_NotSupported()
        return self.memory_clock[1]

    def nvmlDeviceGetP2PStatus(self, a, b, caps):
        v = self.p2p.get(caps)
        if v is None:
            raise NVMLError_NotSupported()
        if isinstance(v, Exception):
            raise v
        return v

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-fake-{h}"

    def nvmlSystemGetDriverVersion(self):
        raise NVMLError_NotSupported()
