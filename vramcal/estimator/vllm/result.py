"""What a vLLM estimate says, as types: :class:`VllmEstimate` with one :class:`VllmRank` per GPU of
``tp x pp``. Pure data; its JSON is written and read here (the ``"vllm"`` object of an estimate)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class VllmRank:
    """One GPU of the run (rank = pp_rank x tp + tp_rank), with the terms vLLM logs for it."""

    rank: int
    tp_rank: int
    pp_rank: int
    layers: list[int]  # [first, end) decoder layers of its pipeline stage
    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    available_bytes: int  # "Available KV cache memory" this rank logs
    num_blocks: int  # blocks its own memory allows, before the minimum over ranks
    kv_cache_bytes: int  # what it allocates after the minimum
    weights_groups: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> VllmRank:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class VllmEstimate:
    """The startup of ``vllm serve`` as vLLM logs it. The top-level figures are the limiting rank's
    (the one with the fewest blocks), as vLLM's are after it takes the minimum over ranks."""

    version: str
    version_source: str
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int  # total x utilization
    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    cuda_graph_subtracted: bool
    kv_cache_bytes: int  # available KV memory of the limiting rank
    kv_cache_tokens: int  # "GPU KV cache size: N tokens"
    block_size: int
    num_blocks: int
    max_concurrency: float
    max_model_len: int
    max_model_len_fit: int  # the largest length one request can have with this memory
    fits: bool
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    dtype: str = ""
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    enforce_eager: bool = False
    page_bytes: int = 0  # one block of one layer
    block_bytes: int = 0  # one block across the limiting rank's layers (hybrid: one group's layers)
    hybrid_groups: int = 1
    limiting_rank: int = 0
    error: str | None = None  # the ValueError vLLM would raise at startup, if any
    log_lines: list[str] = field(default_factory=list)  # what vLLM will print, in its words
    methods: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ranks: list[VllmRank] | None = None  # every GPU when tp x pp > 1
    correction: dict | None = None  # this machine's learned terms, when applied (raw terms kept here)
    interconnect: str | None = None  # nvlink | pcie, assumed for tp > 1 (methods["interconnect"] says why)
    custom_all_reduce: bool | None = None  # whether vLLM's custom all-reduce is on (tp > 1)
    # the torch.compile cache's state priced: cold (the kernel benchmark in the profile) | warm; None where the
    # state changes nothing (--enforce-eager, before 0.12)
    compile_cache: str | None = None
    # the CUDA graphs vLLM captures (versions.cudagraph_captures): PIECEWISE graph sets and FULL decode graphs;
    # None where none are captured (--enforce-eager) or the list is not modelled (before 0.11)
    cuda_graph_piecewise: int | None = None
    cuda_graph_full: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.ranks is None:
            d["ranks"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> VllmEstimate:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if kw.get("ranks") is not None:
            kw["ranks"] = [VllmRank.from_dict(r) for r in kw["ranks"]]
        return cls(**kw)
