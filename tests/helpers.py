"""Ground truth for the tests: count what a really loaded model and a really filled cache hold."""

from __future__ import annotations

import torch


def _storages(objs) -> dict[int, int]:
    seen: dict[int, int] = {}
    for t in objs:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return seen


def held_tensors(model) -> dict[int, int]:
    """{storage address: bytes} of every parameter, buffer and quantization-state tensor of ``model``."""
    objs = []
    for p in model.parameters():
        objs.append(p)
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            objs += [qs.absmax, qs.code, qs.offset]
            if qs.nested:
                objs += [qs.state2.absmax, qs.state2.code]
        objs += [getattr(p, "SCB", None), getattr(p, "CB", None)]
    objs += list(model.buffers())
    return _storages(objs)


def cache_bytes(cache) -> int:
    """Bytes of every tensor storage a transformers cache object holds."""
    objs = []
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                objs.append(value)
            elif isinstance(value, (tuple, list)):
                objs += [v for v in value if isinstance(v, torch.Tensor) and v.dim() >= 2]
    return sum(_storages(objs).values())
