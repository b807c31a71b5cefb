"""How a configuration is loaded: the keyword arguments of ``from_pretrained``, in one home.

The probe's child loads with them (:func:`materialize` turns them into torch and transformers objects),
an estimate carries them (``Estimate.from_pretrained``), ``plan`` prints them as Python a user can
paste (:func:`python_code`) and the known-good memo stores them beside the command. So what vramcal
prices, what it measures and what it tells a user to run are the same load.

The arguments are plain data (JSON): the dtype by name, ``quantization_config`` as the keyword
arguments of ``BitsAndBytesConfig`` (none for a pre-quantized checkpoint: its config carries its own; its
dequantized load names its format's config class with ``dequantize=True``, e.g. ``FineGrainedFP8Config``),
and a placement as transformers takes it -- a strategy with ``max_memory`` (GPU indices as accelerate
takes them), or, where the installed transformers refuses a bitsandbytes map with modules on cpu or
disk, the same map as a custom ``device_map`` with ``llm_int8_enable_fp32_cpu_offload``
(docs/placement.md). In JSON a GPU index key becomes a string ("0"); :func:`python_code` writes it as
the integer accelerate wants.
"""

from __future__ import annotations

import json

from .placement import DEVICE_MAP_CHOICES, OFFLOAD_FLAG


def accelerate_key(device: str) -> int | str:
    """``cuda:1`` -> 1 (accelerate's key), ``cpu`` / ``disk`` unchanged."""
    from ..workload import parse_device

    return parse_device(device, placement=True).accelerate_key


def placed_load(plan) -> dict:
    """The load of a :class:`~vramcal.estimator.placement.Placement`: its strategy with its
    ``max_memory``, or -- when the installed transformers refuses it -- the alternative it suggests (the
    same map as a custom ``device_map``, with the offload flag for bitsandbytes)."""
    loads = plan.loads
    if loads is plan:
        if plan.strategy in DEVICE_MAP_CHOICES:
            return {"device_map": plan.strategy, "max_memory": dict(plan.max_memory)}
        return {"device_map": dict(plan.device_map)}
    return {"device_map": dict(loads.device_map), "bnb_extra": {OFFLOAD_FLAG: True}}


def load_kwargs(dtype: str, device: str, bnb: dict | None = None, load: dict | None = None,
                attn: str | None = None, offload_folder: str | None = None) -> dict:
    """``from_pretrained``'s keyword arguments as plain data: ``dtype`` by name, ``device`` the one
    device of an unplaced load, ``bnb`` the ``BitsAndBytesConfig`` arguments (None: no quantization
    asked), ``load`` a placement (:func:`placed_load`), ``offload_folder`` where disk entries go."""
    out: dict = {"dtype": dtype}
    if load:
        dm = load["device_map"]
        out["device_map"] = dm if isinstance(dm, str) else {k: accelerate_key(v) for k, v in dm.items()}
        if load.get("max_memory"):
            out["max_memory"] = {accelerate_key(k): int(v) for k, v in load["max_memory"].items()}
        on_disk = "disk" in (load.get("max_memory") or {}) or (isinstance(dm, dict) and "disk" in dm.values())
        if on_disk and offload_folder:
            out["offload_folder"] = offload_folder
        if bnb and load.get("bnb_extra"):
            bnb = {**bnb, **load["bnb_extra"]}
    else:
        out["device_map"] = "cpu" if device == "cpu" else {"": accelerate_key(device) if ":" in device else 0}
    if bnb:
        out["quantization_config"] = dict(bnb)
    if attn and attn != "auto":
        out["attn_implementation"] = attn
    return out


def quantization_kwargs(quant) -> dict | None:
    """``quantization_config`` as plain data: ``BitsAndBytesConfig``'s arguments for an on-the-fly
    bitsandbytes load; a pre-quantized checkpoint's dequantized load as its format's config class with
    ``dequantize=True`` (``{"config_class": "FineGrainedFP8Config", "dequantize": True}``); else None (a
    checkpoint's own quantization_config, or none)."""
    if quant.method == "dequantized":
        from .formats import format_for

        return {"config_class": format_for(quant.extra["quantization_config"]).config_class, "dequantize": True}
    return None if quant.pre_quantized else quant.bnb_config_kwargs()


def from_pretrained_kwargs(quant, device: str, placement=None, attn: str | None = None,
                           offload_folder: str | None = None) -> dict:
    """The arguments that load ``quant`` (a :class:`~vramcal.estimator.quant.QuantSpec`) on ``device``,
    or as ``placement`` places it."""
    return load_kwargs(quant.dtype, device, quantization_kwargs(quant), None if placement is None else placed_load(placement), attn,
                       offload_folder)


def materialize(kwargs: dict) -> dict:
    """The arguments as ``from_pretrained`` takes them: torch dtypes, a ``BitsAndBytesConfig``."""
    import torch
    from transformers import BitsAndBytesConfig

    out = dict(kwargs)
    out["dtype"] = getattr(torch, kwargs["dtype"])
    qc = kwargs.get("quantization_config")
    if qc and "config_class" in qc:  # a pre-quantized format's own config class (dequantize=True)
        import transformers

        rest = {k: v for k, v in qc.items() if k != "config_class"}
        out["quantization_config"] = getattr(transformers, qc["config_class"])(**rest)
    elif qc:
        bnb = dict(kwargs["quantization_config"])
        if "bnb_4bit_compute_dtype" in bnb:
            bnb["bnb_4bit_compute_dtype"] = getattr(torch, bnb["bnb_4bit_compute_dtype"])
        out["quantization_config"] = BitsAndBytesConfig(**bnb)
    return out


def hub_ref(source) -> str:
    """What ``from_pretrained`` is given for a model: the Hub id of a catalog entry, the folder (as an
    absolute path) of a directory or of a config.json, else vramcal's ref (a cached Hub id)."""
    import os

    hub = (source.config.get("_vramcal_catalog") or {}).get("hub_id") if source.origin == "catalog" else None
    if source.origin == "config" and source.directory:
        return os.path.abspath(source.directory)
    return hub or source.ref


def _literal(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def python_code(model: str, kwargs: dict, auto_class: str = "AutoModelForCausalLM", kv_dtype: str = "auto") -> str:
    """The load as Python a user can paste. ``kv_dtype`` "fp8": the KV cache ``generate`` fills is
    transformers' fp8 ``QuantizedCache``, set on the model's generation config (from_pretrained takes no
    cache argument), as the probe's child builds it."""
    lines = ["import torch"]
    bnb = kwargs.get("quantization_config")
    config_class = (bnb or {}).get("config_class", "BitsAndBytesConfig")
    lines.append(f"from transformers import {auto_class}" + (f", {config_class}" if bnb else ""))
    lines += ["", f"model = {auto_class}.from_pretrained(", f"    {json.dumps(model)},"]
    for key, value in kwargs.items():
        if key == "dtype":
            text = f"torch.{value}"
        elif key == "quantization_config":
            text = config_class + "(" + ", ".join(
                f"{k}=torch.{v}" if k == "bnb_4bit_compute_dtype" else f"{k}={_literal(v)}"
                for k, v in value.items() if k != "config_class") + ")"
        elif key == "device_map" and isinstance(value, dict) and len(value) > 4:
            text = "{\n" + "".join(f"        {_literal(k)}: {_literal(v)},\n" for k, v in value.items()) + "    }"
        else:
            text = _literal(value)
        lines.append(f"    {key}={text},")
    lines.append(")")
    if kv_dtype == "fp8":  # every generate() then fills the fp8 cache the estimate priced
        lines += ["model.generation_config.cache_implementation = \"quantized\"",
                  "model.generation_config.cache_config = {\"backend\": \"fp8\"}"]
    return "\n".join(lines)
