"""The machine fingerprint a record carries: what the numbers were measured on."""

from __future__ import annotations

import os
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
    """The software stack a correction belongs to: device kind and the versions that lay memory out."""
    return "|".join(f"{k}={fp.get(k)}" for k in ("kind", "torch", "transformers", "bitsandbytes", "accelerate",
                                                  "driver", "cuda_runtime"))
