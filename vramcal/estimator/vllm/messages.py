"""The lines vLLM prints about memory at startup and the errors it raises, per version, as texts
(``v1/worker/gpu_model_runner.py``, ``v1/worker/gpu_worker.py``, ``v1/core/kv_cache_utils.py``;
0.33: ``v1/core/kv_cache_planning.py``). Formatting only: the figures come from the estimate.

GiB everywhere is bytes / 2^30. ``format_gib`` (0.14 on) is ``str(round(x / 2**30, 2))``: two decimals,
trailing zeros dropped (``25.8``, ``14.99``).
"""

from __future__ import annotations

from ...units import GIB
from . import versions as V


def format_gib(n: int) -> str:
    return str(round(n / GIB, 2))


def _gib(v: V.Version, n: int) -> str:
    """A GiB figure as that version prints it in the lines below."""
    return format_gib(n) if v >= (0, 14, 0) else f"{n / GIB:.2f}"


def loading_line(v: V.Version, weights: int) -> str:
    if v < (0, 8, 3):
        return f"Model loading took {weights / GIB:.4f} GB"
    if v < (0, 11, 1):
        return f"Model loading took {weights / GIB:.4f} GiB"
    if v < (0, 14, 0):
        return f"Model loading took {weights / GIB:.4f} GiB memory"
    return f"Model loading took {format_gib(weights)} GiB memory"


def available_line(v: V.Version, available: int) -> str | None:
    if v < (0, 9, 2):
        return None  # not logged before 0.9.2
    return f"Available KV cache memory: {_gib(v, available)} GiB"


def kv_lines(v: V.Version, tokens: int, max_len: int, concurrency: float) -> list[str]:
    size = f"GPU KV cache size: {tokens:,} tokens"
    conc = f"Maximum concurrency for {max_len:,} tokens per request: {concurrency:.2f}x"
    if v < (0, 28, 0):
        return [size, conc]
    return [f"{size}, {conc}"]


def profile_line(v: V.Version, non_kv: int, activation: int, non_torch: int, weights: int) -> str | None:
    """The DEBUG summary of the profile (``MemoryProfilingResult.__repr__``), up to 0.26."""
    if v < (0, 9, 2) or v >= (0, 27, 0):
        return None
    return (f"Total non KV cache memory: {_gib(v, non_kv)}GiB; torch peak memory increase: "
            f"{_gib(v, activation)}GiB; non-torch forward increase memory: {_gib(v, non_torch)}GiB; weights memory: "
            f"{_gib(v, weights)}GiB.")


def graph_estimate_line(v: V.Version, graphs: int) -> str | None:
    """The V1 model runner's own line (``gpu_model_runner.py``; the V2 runner prints none)."""
    if not V.cuda_graph_estimate_logged(v) or not graphs:
        return None
    return f"Estimated CUDA graph memory: {graphs / GIB:.2f} GiB total"


def graph_utilization_line(v: V.Version, graphs: int, total: int, utilization: float) -> str | None:
    """The worker's line after "Available KV cache memory" where the estimate comes off the budget
    (``gpu_worker.py``, either runner; 0.28.0, 0.29.0, 0.31.0 and 0.33.0 read): the estimate as a share of
    the device total, rounded to 4 decimals."""
    if v < (0, 28, 0) or not graphs or not total:
        return None
    share = graphs / total
    return (f"CUDA graph memory profiling is enabled (default since v0.21.0). The current --gpu-memory-utilization="
            f"{utilization:.4f} is equivalent to --gpu-memory-utilization={round(utilization - share, 4):.4f} without "
            "CUDA graph memory profiling. To maintain the same effective KV cache size as before, increase "
            f"--gpu-memory-utilization to {min(round(utilization + share, 4), 1.0):.4f}. To disable, set "
            "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.")


def no_memory_error(v: V.Version) -> str:
    text = "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine."
    return text


def too_long_error(v: V.Version, max_len: int, needed: int, available: int, estimated: int) -> str:
    """``check_enough_kv_cache_memory``'s ValueError when one request of ``max_len`` does not fit."""
    unit = "GB" if v < (0, 8, 3) else "GiB"
    who = "model's" if v >= (0, 22, 0) else "models's"
    head = (f"To serve at least one request with the {who} max seq len ({max_len}), ({_gib(v, needed)} {unit} KV cache "
            f"is needed, which is larger than the available KV cache memory ({_gib(v, available)} {unit}).")
    if v < (0, 8, 5):
        middle = ""
    elif v < (0, 9, 2):  # the estimate's f-string was a separate statement: only its prefix is printed
        middle = " Based on the available memory,"
    else:
        middle = f" Based on the available memory, the estimated maximum model length is {estimated}."
    if v >= (0, 22, 0):
        tail = (" Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
                "decreasing `max_model_len` when initializing the engine.")
    else:
        tail = " Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    if v >= (0, 13, 0):
        tail += " See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    return head + middle + tail


def too_long_config_error(max_len: int, derived: int) -> str:
    """``_get_and_verify_max_len`` (``config/model.py``) for a length above the model's own limit."""
    return (f"User-specified max_model_len ({max_len}) is greater than the derived max_model_len "
            f"({derived}). Make sure the value is correct and within the model context size.")
