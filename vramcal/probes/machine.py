"""The machine fingerprint a record carries: what the numbers were measured on."""

from __future__ import annotations

import platform
import socket

from ..estimator.inventory import software_versions
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
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    info = nvml.device_info(index)
    fp.update(kind="cuda", gpu_name=_na(info["name"]), gpu_uuid=_na(info["uuid"]), total_bytes=_na(info["total_bytes"]),
              driver=_na(info["driver"]))
    try:
        import torch

        fp["cuda_runtime"] = torch.version.cuda
    except ImportError:
        fp["cuda_runtime"] = None
    return fp


def stack_key(fp: dict) -> str:
    """The software stack a correction belongs to: device kind and the versions that lay memory out."""
    return "|".join(f"{k}={fp.get(k)}" for k in ("kind", "torch", "transformers", "bitsandbytes", "accelerate",
                                                  "driver", "cuda_runtime"))
