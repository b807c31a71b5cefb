"""The machine fingerprint a record carries: what the numbers were measured on."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass, field

from ..errors import UserError
from ..versions import software_versions
from ..units import fmt_gib_gb
from ..workload import parse_device
from . import nvml


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _na(v):
    return None if isinstance(v, nvml.NA) else v


def machine_fingerprint(device: str) -> dict:
    """GPU name, UUID, total memory, driver, CUDA runtime and library versions for ``cuda[:N]``; CPU model
    and total memory for ``cpu``. A field that cannot be read is None (NULL in the database)."""
    fp = {**software_versions(), "hostname": socket.gethostname(), "cpu_model": _cpu_model()}
    if device == "cpu":
        import psutil

        fp.update(kind="cpu", total_bytes=psutil.virtual_memory().total)
        return fp
    index = parse_device(device).index or 0
    info = nvml.device_info(index)
    fp.update(kind="cuda", gpu_name=_na(info["name"]), gpu_uuid=_na(info["uuid"]), total_bytes=_na(info["total_bytes"]),
              driver=_na(info["driver"]))
    fp["cuda_runtime"] = torch_cuda_version()
    return fp


def torch_cuda_version() -> str | None:
    """The CUDA runtime torch was built with, read from ``torch/version.py`` without importing torch
    (an estimate with a cached inventory must stay torch-free)."""
    import importlib.util
    import re
    import sys

    if "torch" in sys.modules:
        return sys.modules["torch"].version.cuda
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")).read()
    except OSError:
        return None
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]?([^'\"\n]+?)['\"]?\s*$", text, re.M)
    return None if m is None or m.group(1) == "None" else m.group(1)


def stack_key(fp: dict) -> str:
    """The software stack a correction belongs to: device kind and the versions that lay memory out.
    (Which estimator made the estimates is a column of its own: ``estimator_model``.)"""
    return "|".join(f"{k}={fp.get(k)}" for k in ("kind", "torch", "transformers", "bitsandbytes", "accelerate",
                                                  "driver", "cuda_runtime"))


# ------------------------------------------------------------------------------- free memory

@dataclass
class FreeMemory:
    """What a new run can have on one device, read through the one NVML door (RAM for ``cpu``):
    ``free_bytes`` is NVML's free memory (total minus what every process and the driver hold), and
    ``others`` the compute processes holding memory there: (pid, name, bytes), a name or a size the
    driver does not give is None with ``others_note`` saying why."""

    device: str
    total_bytes: int | None
    free_bytes: int | None
    others: list[tuple[int, str | None, int | None]] = field(default_factory=list)
    others_note: str | None = None
    why_unread: str | None = None

    @property
    def held_bytes(self) -> int | None:
        """Memory in use by someone else when it was read: total - free."""
        return None if self.total_bytes is None or self.free_bytes is None else self.total_bytes - self.free_bytes

    def describe(self) -> str:
        """One line: ``cuda:0: 61.2 GiB free of 80 GiB; held by pid 4242 python (18.0 GiB)``."""
        if self.free_bytes is None:
            return f"{self.device}: free memory unreadable ({self.why_unread})"
        text = f"{self.device}: {fmt_gib_gb(self.free_bytes)} free of {fmt_gib_gb(self.total_bytes)}"
        if self.others:
            text += "; held by " + ", ".join(
                f"pid {pid} {name or '?'} ({fmt_gib_gb(b) if b is not None else 'size not reported'})"
                for pid, name, b in self.others)
        elif self.others_note:
            text += f"; processes not listed ({self.others_note})"
        return text


def free_memory(device: str, exclude_pid: int | None = None) -> FreeMemory:
    """Free memory of ``device`` (``cuda:N`` or ``cpu``) and who else holds some, now."""
    if device == "cpu":
        import psutil

        vm = psutil.virtual_memory()
        return FreeMemory("cpu", int(vm.total), int(vm.available))
    index = parse_device(device).index or 0
    h = nvml.device_handle(index)
    total, free = nvml.memory_total(h), nvml.memory_free(h)
    if isinstance(total, nvml.NA) or isinstance(free, nvml.NA):
        why = (total if isinstance(total, nvml.NA) else free).reason
        return FreeMemory(f"cuda:{index}", None, None, why_unread=why)
    procs = nvml.processes(h)
    if isinstance(procs, nvml.NA):
        return FreeMemory(f"cuda:{index}", total, free, others_note=procs.reason)
    mine = os.getpid() if exclude_pid is None else exclude_pid
    others = [(pid, _na(name), _na(used)) for pid, name, used in procs if pid != mine]
    return FreeMemory(f"cuda:{index}", total, free, others)


def reserve_here(device: str):
    """The driver's reserve of this machine's GPU ``device`` (cuda:N), through the one NVML door: NVML v2
    ``reserved`` where the driver and the binding give it, else the table's for the GPU's NVML name, else not
    known with the reason (:func:`vramcal.estimator.capacity.reserve_for`, the rule's one home)."""
    from ..estimator.capacity import reserve_for

    index = parse_device(device).index or 0
    got = nvml.memory_reserved(nvml.device_handle(index))
    name = nvml.device_info(index)["name"]
    name = None if isinstance(name, nvml.NA) else str(name)
    if isinstance(got, nvml.NA):
        return reserve_for(name, why_unmeasured=got.reason)
    return reserve_for(name, got)


def budget_from_free(device: str, buffer: int) -> tuple[int, FreeMemory]:
    """The memory a run on ``device`` may use: free now (see :func:`free_memory`); UserError when it
    cannot be read or leaves nothing above ``buffer``."""
    fm = free_memory(device)
    if fm.free_bytes is None:
        raise UserError(f"cannot read the free memory of {device} ({fm.why_unread}): pass --budget, e.g. --budget 24GiB")
    if fm.free_bytes <= buffer:
        raise UserError(f"{fm.describe()}: nothing is left above the {fmt_gib_gb(buffer)} buffer; free the device "
                        "or pass --budget / --buffer")
    return fm.free_bytes, fm


def machine_max_memory() -> dict[str, int]:
    """``max_memory`` as accelerate computes it when none is given: each visible GPU's free memory and
    the available RAM, read now. UserError when no GPU is visible."""
    count = nvml.query("nvmlDeviceGetCount")
    if isinstance(count, nvml.NA) or count < 1:
        why = count.reason if isinstance(count, nvml.NA) else "none visible"
        raise UserError(f"no GPU to read free memory from here ({why}): give --max-memory, e.g. "
                        "--max-memory cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB")
    out: dict[str, int] = {}
    for i in range(int(count)):
        fm = free_memory(f"cuda:{i}")
        if fm.free_bytes is None:
            raise UserError(f"cannot read the free memory of cuda:{i} ({fm.why_unread}): give --max-memory")
        out[f"cuda:{i}"] = fm.free_bytes
    out["cpu"] = free_memory("cpu").free_bytes
    return out
