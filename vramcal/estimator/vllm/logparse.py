"""Read vLLM's startup log back into the terms vramcal predicts: the lines of :mod:`.messages`, in every
version's wording (V1 0.8-0.33, and the V0 engine's summary line). Pure text parsing.

A term that is not in the log is ``None`` ("not read", never 0). Lines a worker prints once each (with
tp x pp > 1: "Model loading took", "Available KV cache memory", the profile line) are kept in order in
``per_worker``; the top-level figure is the first one seen, as a reader of the log would take it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from ...units import GIB

_NUM = r"(-?[0-9][0-9,]*\.?[0-9]*)"
_PATTERNS = {
    "version": re.compile(r"(?:V1 LLM engine \(v|vLLM API server version |version )v?([0-9]+\.[0-9]+(?:\.[0-9]+)?[^\s),]*)"),
    "weights": re.compile(r"(?:Model loading took|Loading model weights took) " + _NUM + r" ?(GiB|GB)"),
    "profile": re.compile(r"torch peak memory increase: " + _NUM + r" ?GiB; (?:non-torch forward increase memory: "
                          + _NUM + r" ?GiB|total consumed \(from mem_get_info\): " + _NUM + r" ?GiB)"),
    "profile_weights": re.compile(r"weights memory: " + _NUM + r" ?GiB"),
    "v0": re.compile(r"model weights take " + _NUM + r" ?GiB; non_torch_memory takes " + _NUM + r" ?GiB; PyTorch "
                     r"activation peak memory takes " + _NUM + r" ?GiB; the rest of the memory reserved for KV Cache is "
                     + _NUM + r" ?GiB"),
    "usage": re.compile(r"Actual usage is " + _NUM + r" GiB for (weight|consumed memory \(weights \+ non-torch\)), "
                        + _NUM + r" GiB for peak activation, (?:" + _NUM + r" GiB for non-torch memory, )?and " + _NUM
                        + r" GiB for CUDAGraph memory"),
    "v0_results": re.compile(r"non_torch_memory=" + _NUM + r"GiB kv_cache_size=" + _NUM + r"GiB"),
    "available": re.compile(r"Available KV cache memory: " + _NUM + r" ?GiB"),
    "reserved": re.compile(r"reserved " + _NUM + r" GiB memory for KV Cache as specified by kv_cache_memory_bytes"),
    "tokens": re.compile(r"KV cache size:\s+" + _NUM + r" tokens"),
    "concurrency": re.compile(r"Maximum concurrency for " + _NUM + r" tokens per request: " + _NUM + r"x"),
    "graph_estimate": re.compile(r"Estimated CUDA graph memory: " + _NUM + r" ?GiB"),
    # 0.21 on, the V2 runner's estimate too: "The current --gpu-memory-utilization=0.9000 is equivalent to
    # --gpu-memory-utilization=0.8929 without CUDA graph memory profiling" (gpu_worker.py: the estimate over the
    # device total, the second figure rounded to 4 decimals)
    "graph_util": re.compile(r"current --gpu-memory-utilization=" + _NUM + r" is equivalent to "
                             r"--gpu-memory-utilization=" + _NUM + r" without CUDA graph memory profiling"),
    "graph_taken": re.compile(r"Graph capturing finished in " + _NUM + r" secs, took " + _NUM + r" ?GiB"),
    "graph_pool": re.compile(r"CUDA graph pool memory: " + _NUM + r" ?GiB \(actual\)(?:, " + _NUM + r" ?GiB \(estimated\))?"),
    "startup": re.compile(r"Free memory on device \(" + _NUM + r"/" + _NUM + r" GiB\) on startup"),
    "utilization": re.compile(r"Desired GPU memory utilization is \(" + _NUM + r", " + _NUM + r" GiB\)"),
    "batched": re.compile(r"max_num_batched_tokens=" + _NUM),
    "blocks": re.compile(r"num_gpu_blocks is: " + _NUM + r"|# (?:CUDA|GPU) blocks: " + _NUM),
    "error": re.compile(r"((?:To serve at least one request|No available memory for the cache blocks|Free memory on "
                        r"device|CUDA out of memory occurred when warming up|The model's max seq len).*)"),
    "estimated_len": re.compile(r"estimated maximum model length is " + _NUM),
    "hybrid_block": re.compile(r"Setting attention block size to " + _NUM + r" tokens"),
    "mamba_padding": re.compile(r"Padding mamba page size by " + _NUM + r"%"),
    # torch.compile in the profiled region: a cache hit loads the compiled graphs ("dynamic shape" in 0.10-0.13,
    # "compile range" later; 0.28's AOT artifact too, decorators.py); a miss compiles them, Inductor's kernel
    # benchmarks included (versions.py)
    "compile_warm": re.compile(r"Directly load (?:the compiled graph\(s\) for|AOT compilation from)"),
    "compile_cold": re.compile(r"Compiling a graph for (?:compile range|dynamic shape|shape)"),
    "mxfp4_backend": re.compile(r"(?:\[mxfp4\.py:\d+\] Using (Triton|Marlin) backend|leveraging the (Marlin) kernel)"),
}


_WORKER = re.compile(r"\(((?:Worker|EngineCore)[^ )]*) pid=\d+\)")  # the process prefix a vLLM line carries


def _n(text: str) -> float:
    return float(text.replace(",", ""))


def _gib(text: str) -> int:
    return int(round(_n(text) * GIB))


@dataclass
class VllmLogged:
    """The startup terms one vLLM log printed (bytes; ``None`` where the log does not say)."""

    version: str | None = None
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    non_torch_bytes: int | None = None
    consumed_bytes: int | None = None  # 0.27 on: "total consumed (from mem_get_info)"
    kv_cache_bytes: int | None = None  # "Available KV cache memory" (or the pinned --kv-cache-memory)
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_model_len: int | None = None
    cuda_graph_estimate_bytes: int | None = None
    # the estimate as a share of the device total, from the "is equivalent to --gpu-memory-utilization" line
    # (good to 0.00005 of the total); it gives the bytes where the log prints the total, else with a known one
    cuda_graph_estimate_fraction: float | None = None
    cuda_graph_bytes: int | None = None  # what the capture took (device-level)
    # 0.27 on: "X GiB for peak activation" after "consumed memory" is the activation *plus* the CUDA-graph
    # estimate taken off the KV budget (versions.usage_peak_includes_graphs); kept as printed here, and
    # activation_bytes is that minus the logged estimate, or None where the log prints no estimate
    peak_with_graphs_bytes: int | None = None
    num_blocks: int | None = None
    total_bytes: int | None = None  # the device total vLLM saw
    startup_free_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    engine: str | None = None  # v1 | v0
    error: str | None = None
    estimated_max_model_len: int | None = None
    block_size: int | None = None  # a hybrid model's attention block ("Setting attention block size to N tokens")
    mamba_padding_pct: float | None = None  # "Padding mamba page size by X%"
    mxfp4_backend: str | None = None  # triton | marlin: the kernel holding gpt-oss's MXFP4 experts
    # cold | warm: whether the profile's torch.compile compiled or loaded its graphs from vLLM's cache (lines
    # before "Available KV cache memory" only: later sizes compile outside the profile); None: not printed
    compile_cache: str | None = None
    per_worker: dict[str, list] = field(default_factory=dict)  # every value of the lines each worker prints

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> VllmLogged:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @property
    def found(self) -> bool:
        return any(v is not None for k, v in asdict(self).items() if k.endswith("_bytes") or k == "kv_cache_tokens")


def _first(log: VllmLogged, name: str, value) -> None:
    log.per_worker.setdefault(name, []).append(value)
    if getattr(log, name) is None:
        setattr(log, name, value)


def parse_log(text: str) -> VllmLogged:
    """Every startup term in ``text`` (a whole log, or the lines kept of one)."""
    log = VllmLogged()
    # "Graph capturing finished ... took X GiB" stands for the capture only where no line names the actual
    # pool: from 0.29 profile_cudagraph_memory captures once before the KV cache is sized (its own "took"
    # line), and "CUDA graph pool memory: A (actual)" / "... GiB for CUDAGraph memory" give the real one
    taken: int | None = None
    sized: set[str] = set()  # the workers ("(Worker_TP1 pid=..)") past their "Available KV cache memory" line
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue  # a fixture's own comments
        m = _PATTERNS["version"].search(line)
        if m and log.version is None:
            log.version = m.group(1).rstrip(".")
        if "V1 LLM engine" in line:
            log.engine = "v1"
        m = _PATTERNS["weights"].search(line)
        if m:
            _first(log, "weights_bytes", _gib(m.group(1)))
        m = _PATTERNS["profile"].search(line)
        if m:
            log.engine = log.engine or "v1"
            _first(log, "activation_bytes", _gib(m.group(1)))
            if m.group(2) is not None:
                _first(log, "non_torch_bytes", _gib(m.group(2)))
            else:
                _first(log, "consumed_bytes", _gib(m.group(3)))
        m = _PATTERNS["v0"].search(line)
        if m:
            log.engine = "v0"
            _first(log, "weights_bytes", _gib(m.group(1))) if log.weights_bytes is None else None
            _first(log, "non_torch_bytes", _gib(m.group(2)))
            _first(log, "activation_bytes", _gib(m.group(3)))
            _first(log, "kv_cache_bytes", _gib(m.group(4)))
        m = _PATTERNS["usage"].search(line)
        if m:  # the suggestion line after the graph capture (0.10.2 on); the profile line may be DEBUG-only
            weight, act, non_torch, graphs = m.group(1), m.group(3), m.group(4), m.group(5)
            log.per_worker.setdefault("usage_activation_bytes", []).append(_gib(act))
            if m.group(2) != "weight":
                if log.peak_with_graphs_bytes is None:
                    log.peak_with_graphs_bytes = _gib(act)
            elif log.activation_bytes is None:
                log.activation_bytes = _gib(act)
            if non_torch is not None:
                log.per_worker.setdefault("usage_non_torch_bytes", []).append(_gib(non_torch))
                if log.non_torch_bytes is None:
                    log.non_torch_bytes = _gib(non_torch)
            if m.group(2) == "weight" and log.weights_bytes is None:
                log.weights_bytes = _gib(weight)
            elif m.group(2) != "weight" and log.consumed_bytes is None:
                log.consumed_bytes = _gib(weight)
            if log.cuda_graph_bytes is None:
                log.cuda_graph_bytes = _gib(graphs)
        m = _PATTERNS["v0_results"].search(line)
        if m:
            log.engine = "v0"
            _first(log, "non_torch_bytes", _gib(m.group(1)))
            _first(log, "kv_cache_bytes", _gib(m.group(2)))
        for key, attr in (("available", "kv_cache_bytes"), ("reserved", "kv_cache_bytes"),
                          ("graph_estimate", "cuda_graph_estimate_bytes"), ("graph_pool", "cuda_graph_bytes")):
            m = _PATTERNS[key].search(line)
            if m:
                _first(log, attr, _gib(m.group(1)))
                if key == "graph_pool" and m.group(2) is not None:
                    _first(log, "cuda_graph_estimate_bytes", _gib(m.group(2)))
        m = _PATTERNS["graph_util"].search(line)
        if m and log.cuda_graph_estimate_fraction is None:
            log.cuda_graph_estimate_fraction = round(_n(m.group(1)) - _n(m.group(2)), 4)
        m = _PATTERNS["tokens"].search(line)
        if m:
            _first(log, "kv_cache_tokens", int(_n(m.group(1))))
        m = _PATTERNS["concurrency"].search(line)
        if m:
            _first(log, "max_model_len", int(_n(m.group(1))))
            _first(log, "max_concurrency", _n(m.group(2)))
        m = _PATTERNS["graph_taken"].search(line)
        if m and taken is None:
            taken = _gib(m.group(2))
        m = _PATTERNS["startup"].search(line)
        if m and log.total_bytes is None:
            log.startup_free_bytes, log.total_bytes = _gib(m.group(1)), _gib(m.group(2))
        m = _PATTERNS["utilization"].search(line)
        if m and log.gpu_memory_utilization is None:
            log.gpu_memory_utilization = _n(m.group(1))
        m = _PATTERNS["batched"].search(line)
        if m and log.max_num_batched_tokens is None:
            log.max_num_batched_tokens = int(_n(m.group(1)))
        m = _PATTERNS["blocks"].search(line)
        if m and log.num_blocks is None:
            log.num_blocks = int(_n(m.group(1) or m.group(2)))
        m = _PATTERNS["hybrid_block"].search(line)
        if m and log.block_size is None:
            log.block_size = int(_n(m.group(1)))
        m = _PATTERNS["mamba_padding"].search(line)
        if m and log.mamba_padding_pct is None:
            log.mamba_padding_pct = _n(m.group(1))
        worker = _WORKER.search(line)
        worker = worker.group(1) if worker else ""
        if _PATTERNS["available"].search(line) or _PATTERNS["reserved"].search(line):
            sized.add(worker)
        elif worker not in sized and not (worker == "" and sized):  # still inside this worker's profiled region
            if _PATTERNS["compile_cold"].search(line):
                log.compile_cache = "cold"  # one graph compiled: its benchmarks ran, whatever else loaded
            elif _PATTERNS["compile_warm"].search(line) and log.compile_cache is None:
                log.compile_cache = "warm"
        m = _PATTERNS["mxfp4_backend"].search(line)
        if m and log.mxfp4_backend is None:
            log.mxfp4_backend = (m.group(1) or m.group(2)).lower()
        m = _PATTERNS["error"].search(line)
        if m and log.error is None:
            log.error = m.group(1).strip()
            e = _PATTERNS["estimated_len"].search(line)
            if e:
                log.estimated_max_model_len = int(_n(e.group(1)))
    if log.cuda_graph_bytes is None and taken is not None:
        log.cuda_graph_bytes = taken
    if log.cuda_graph_estimate_bytes is None and log.cuda_graph_estimate_fraction and log.total_bytes:
        log.cuda_graph_estimate_bytes = int(round(log.cuda_graph_estimate_fraction * log.total_bytes))
    if log.activation_bytes is None and log.peak_with_graphs_bytes is not None \
            and log.cuda_graph_estimate_bytes is not None:
        log.activation_bytes = max(log.peak_with_graphs_bytes - log.cuda_graph_estimate_bytes, 0)
    return log
