"""What makes two machines interchangeable for memory: the *machine class*.

Two hosts are of one class when everything that lays memory out is the same:

- the device model and its memory (GPU name and total memory rounded to whole GiB; on the CPU path
  the CPU model and the RAM),
- the driver's major version (``550.54.15`` -> ``550``: minor releases do not change allocations),
- the CUDA runtime torch was built with,
- torch, transformers and bitsandbytes versions (accelerate is left out: it places modules, it does not
  size them).

The hostname, the GPU's UUID and the driver's minor version are what differs between the hosts of a
class. A correction measured on one host of a class is the best guess for every other host of it
(``vramcal.calibrate.corrections``), with a band widened by the spread between hosts.
"""

from __future__ import annotations

GIB = 1024**3
CLASS_FIELDS = ("kind", "device_model", "memory_gib", "driver_major", "cuda_runtime", "torch", "transformers",
                "bitsandbytes")


def machine_class(fp: dict) -> dict:
    """The fields of a fingerprint that define its machine class (values may be None: unread)."""
    kind = fp.get("kind")
    total = fp.get("total_bytes")
    driver = fp.get("driver")
    return {
        "kind": kind,
        "device_model": fp.get("cpu_model") if kind == "cpu" else fp.get("gpu_name"),
        "memory_gib": None if total is None else int(round(int(total) / GIB)),
        "driver_major": None if not driver else str(driver).split(".")[0],
        "cuda_runtime": fp.get("cuda_runtime"),
        "torch": fp.get("torch"),
        "transformers": fp.get("transformers"),
        "bitsandbytes": fp.get("bitsandbytes"),
    }


def class_key(fp: dict) -> str:
    """The machine class as one string, stored with each machine (``machines.class_key``)."""
    cls = machine_class(fp)
    return "|".join(f"{k}={cls[k]}" for k in CLASS_FIELDS)


def class_label(key: str) -> str:
    """A short human name of a class key: device, memory, driver, CUDA, torch."""
    fields = dict(part.split("=", 1) for part in key.split("|") if "=" in part)
    parts = [fields.get("device_model") or fields.get("kind") or "?"]
    if fields.get("memory_gib") not in (None, "None"):
        parts.append(f"{fields['memory_gib']} GiB")
    if fields.get("driver_major") not in (None, "None"):
        parts.append(f"driver {fields['driver_major']}")
    if fields.get("cuda_runtime") not in (None, "None"):
        parts.append(f"CUDA {fields['cuda_runtime']}")
    parts.append(f"torch {fields.get('torch')}")
    return ", ".join(parts)
