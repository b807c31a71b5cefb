"""An upper bound on decode speed: generated tokens per second, from the bytes each decode step must move.

A decode step reads every weight once (the input embedding: its tokens' rows, not the table) and the
whole KV cache of every row (the attention of the new
token looks at every cached position), and produces one token per batch row. Where the bytes sit
decides how fast they can be read:

- weights and cache held on a GPU are read from its memory, at most at its memory bandwidth;
- weights offloaded to the CPU are copied to the GPU that runs them at every step (accelerate's hooks:
  one tensor at a time, then dropped), at most at the host link's bandwidth, and then read there;
- weights offloaded to disk are read from disk first (no bandwidth is assumed for a disk: the bound is
  then unknown, and says so).

The layers run one after the other, so the step's time is the sum of these terms, and
``tokens/s <= batch / step time``. It is a bound, not a prediction: kernels reach 85-92 % of the memory
bandwidth at best, and accelerate copies from pageable memory, which measured offload runs show at
0.4-0.5 of the link's rate (docs/plan.md). Pure arithmetic; bandwidths come with their sources
(:mod:`vramcal.probes.hardware`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


MOST_TOKENS_PER_S = 100_000.0  # per batch of steps: beyond what launch latency lets any decode step reach
FEWEST_TOKENS_PER_S = 1e-3  # under a token in 1,000 s


@dataclass(frozen=True)
class DecodeBound:
    tokens_per_s: float | None  # None: a bandwidth it needs is unknown (``why_none`` says which)
    seconds_per_step: float | None
    terms: dict[str, float] = field(default_factory=dict)  # seconds per step: what each device or link takes
    bandwidths: dict[str, str] = field(default_factory=dict)  # which bandwidth was used where, and its source
    why_none: str | None = None

    @property
    def implausible(self) -> str | None:
        """Why a bound is no guide, or None: above :data:`MOST_TOKENS_PER_S` a step is shorter than the
        kernel launches it leaves out (microseconds per layer); below :data:`FEWEST_TOKENS_PER_S` the sizes
        or bandwidths behind it are not a real machine's."""
        t = self.tokens_per_s
        if t is None:
            return None
        if t > MOST_TOKENS_PER_S:
            return (f"a decode bound of {t:,.3g} tokens/s is no guide: a step that short is bounded by kernel "
                    "launches (microseconds per layer), which the bound leaves out")
        if t < FEWEST_TOKENS_PER_S:
            return f"a decode bound of {t:.3g} tokens/s: check the bandwidths and sizes it rests on"
        return None


def unread_embedding(estimate, tied: bool) -> int:
    """Bytes of an untied input embedding a step does not read: the lookup reads its tokens' rows, not the
    table (a tied table is read whole by lm_head). The inventory counts both tables of an untied model as
    its embeddings, each vocabulary x hidden in the load dtype."""
    return 0 if tied else estimate.weights_breakdown.get("embeddings", 0) // 2


def decode_bound(estimate, memory_bw: dict, link_bw: dict, device: str | None = None,
                 unread_embedding_bytes: int = 0) -> DecodeBound:
    """The bound for an :class:`~vramcal.estimator.result.Estimate` (on one GPU, or placed): ``memory_bw``
    and ``link_bw`` map each GPU to an object with ``bytes_per_s`` (None when unknown) and ``source``.
    ``device``: the GPU of an unplaced estimate (default ``cuda:0``). ``unread_embedding_bytes``: held by
    the GPU that runs the input embedding but not read per step (:func:`unread_embedding`)."""
    batch = estimate.batch
    terms: dict[str, float] = {}
    used: dict[str, str] = {}
    missing: list[str] = []

    def take(label: str, nbytes: int, bw, what: str) -> None:
        if nbytes <= 0:
            return
        if bw is None or bw.bytes_per_s is None:
            missing.append(f"{what} ({bw.source if bw is not None else 'unknown'})")
            return
        terms[label] = terms.get(label, 0.0) + nbytes / bw.bytes_per_s
        used[label] = f"{bw.bytes_per_s / 1e9:,.0f} GB/s, {bw.source}"

    if estimate.devices:
        loads = estimate.placement.loads
        for dev, d in estimate.devices.items():
            if dev.startswith("cuda"):
                held = d.components["weights"] + d.components["kv_cache"]
                copied = loads.pcie_bytes_per_token + loads.disk_bytes_per_token if dev == loads.main_device else 0
                unread = unread_embedding_bytes if dev == loads.embed_device else 0
                take(f"{dev} memory", max(held + copied - unread, 0), memory_bw.get(dev), f"{dev}'s memory bandwidth")
        take(f"host link to {loads.main_device}", loads.pcie_bytes_per_token, link_bw.get(loads.main_device),
             f"the host link of {loads.main_device}")
        if loads.disk_bytes_per_token:
            missing.append("the disk's read bandwidth (vramcal assumes none)")
    else:
        dev = device or ("cuda:0" if estimate.device == "cuda" else estimate.device)
        take(f"{dev} memory", max(estimate.components["weights"] + estimate.components["kv_cache"]
                                  - unread_embedding_bytes, 0), memory_bw.get(dev), f"{dev}'s memory bandwidth")
    if missing:
        return DecodeBound(None, None, terms, used, "unknown: " + "; ".join(missing))
    step = sum(terms.values())
    return DecodeBound(batch / step if step else None, step, terms, used)


def sequential_bound(read_bytes: dict[str, int], memory_bw: dict, sequences: int = 1) -> DecodeBound:
    """The bound of an engine that runs each layer where its weights are (llama.cpp: a layer on the CPU is
    computed by the CPU, from RAM; nothing is streamed to a GPU): ``read_bytes`` maps each device to the
    bytes one step reads there (weights and KV cache), ``memory_bw`` each device to an object with
    ``bytes_per_s`` (None when unknown) and ``source``. The layers run one after the other, so the step is
    the sum over devices of bytes / bandwidth, and ``tokens/s <= sequences / step``."""
    terms: dict[str, float] = {}
    used: dict[str, str] = {}
    missing: list[str] = []
    for dev, n in read_bytes.items():
        if n <= 0:
            continue
        bw = memory_bw.get(dev)
        if bw is None or bw.bytes_per_s is None:
            missing.append(f"{dev}'s memory bandwidth ({bw.source if bw is not None else 'unknown'})")
            continue
        terms[f"{dev} memory"] = n / bw.bytes_per_s
        used[f"{dev} memory"] = f"{bw.bytes_per_s / 1e9:,.0f} GB/s, {bw.source}"
    if missing:
        return DecodeBound(None, None, terms, used, "unknown: " + "; ".join(missing))
    step = sum(terms.values())
    return DecodeBound(sequences / step if step else None, step or None, terms, used)
