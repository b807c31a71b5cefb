"""``fit --engine vllm``: the largest ``--max-model-len`` vLLM starts with at a utilization, or the
utilization (and ``--kv-cache-memory-bytes``) a length and a concurrency need. Pure arithmetic over
an estimate: every rank's available memory is ``u x total - (what the profile subtracts)``, linear in u.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ...errors import UserError
from ...units import GIB
from . import kv as K
from . import versions as V
from .engine import VllmArgs, estimate_vllm
from .result import VllmEstimate

MAX_REQUESTS = 1 << 26  # --concurrency at most: vLLM's --max-num-seqs as VllmArgs bounds it


@dataclass
class VllmFit:
    question: str  # longest | utilization
    version: str
    gpu_memory_bytes: int
    gpu_memory_utilization: float | None  # asked (longest) or needed (utilization; None: more than the GPU)
    max_model_len: int  # the largest that fits (longest) or the one asked (utilization)
    max_concurrency: float
    kv_cache_tokens: int
    # the KV memory of the limiting rank (--kv-cache-memory-bytes to pin it); None where nothing fits, or
    # (utilization) where pinning it would not fit beside the rest: a suggestion never exceeds the GPU
    kv_cache_memory_bytes: int | None
    fits: bool
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def longest(model, args: VllmArgs, **kw) -> tuple[VllmFit, VllmEstimate]:
    """The largest max_model_len vLLM accepts at ``args``' utilization (up to the model's own limit,
    or beyond it with ``allow_long_max_model_len``)."""
    first = estimate_vllm(model, replace(args, max_model_len=None), **kw)
    best = first.max_model_len_fit
    if best <= 0:
        return VllmFit("longest", first.version, first.gpu_memory_bytes, first.gpu_memory_utilization, 0, 0.0, 0,
                       None, False, first.error or "no memory is left for the KV cache"), first
    est = estimate_vllm(model, replace(args, max_model_len=best), **kw)
    return VllmFit("longest", est.version, est.gpu_memory_bytes, est.gpu_memory_utilization, best, est.max_concurrency,
                   est.kv_cache_tokens, est.kv_cache_bytes, est.fits), est


def utilization(model, args: VllmArgs, length: int, concurrency: float, **kw) -> tuple[VllmFit, VllmEstimate]:
    """The smallest gpu_memory_utilization at which ``concurrency`` requests of ``length`` tokens fit
    (vLLM's "Maximum concurrency" at least ``concurrency``), and the KV memory that needs."""
    if not (isinstance(concurrency, (int, float)) and math.isfinite(concurrency) and 0 < concurrency <= MAX_REQUESTS):
        raise UserError(f"--concurrency must be a positive number of requests up to {MAX_REQUESTS:,} (vLLM's "
                        f"--max-num-seqs bound), got {concurrency!r}")
    base = estimate_vllm(model, replace(args, max_model_len=length, gpu_memory_utilization=1.0,
                                        kv_cache_memory_bytes=None), **kw)
    ranks = base.ranks or [None]
    need_util = 0.0
    kv_need = 0
    per_request = None
    for r in ranks:
        avail = r.available_bytes if r else base.kv_cache_bytes
        rest = base.requested_bytes - avail  # what the profile takes off, at any utilization
        block_bytes = base.block_bytes
        if per_request is None:
            per_request = base.num_blocks / base.max_concurrency if base.max_concurrency else None
        if per_request is None:  # nothing fits even at 1.0: per-request blocks from the length alone
            per_request = K.cdiv(length, base.block_size) * max(base.hybrid_groups, 1)
        blocks = math.ceil(concurrency * per_request - 1e-9)
        kv = blocks * block_bytes
        kv_need = max(kv_need, kv)
        need_util = max(need_util, (kv + rest) / base.gpu_memory_bytes)
    util = math.ceil(need_util * 10000) / 10000
    fits = util <= 1.0
    note = "" if fits else (f"{concurrency:g} requests of {length:,} tokens need {kv_need / GIB:,.2f} GiB of KV cache "
                            f"per GPU beside {rest / GIB:,.2f} GiB of weights, activations and the rest: more than "
                            f"the GPU's {base.gpu_memory_bytes / GIB:,.2f} GiB; add GPUs (tp or pp), or shorten the "
                            "length or the concurrency")
    est = estimate_vllm(model, replace(args, max_model_len=length, gpu_memory_utilization=min(util, 1.0)), **kw)
    pinned: int | None = kv_need if fits else None
    if pinned is not None and V.kv_memory_override(V.resolve_version(args.vllm_version)[0]):
        held = estimate_vllm(model, replace(args, max_model_len=length, kv_cache_memory_bytes=pinned), **kw)
        if held.error:  # pinned, the CUDA context counts too: the share can hold it, a pinned size cannot
            pinned, note = None, "--kv-cache-memory-bytes is not offered: " + held.error
    elif pinned is not None:
        pinned = None  # the flag exists from vLLM 0.10.2 on
    return VllmFit("utilization", est.version, est.gpu_memory_bytes, util if fits else None, length,
                   est.max_concurrency, est.kv_cache_tokens, pinned, fits and est.fits, note), est
