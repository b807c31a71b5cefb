"""``fit --engine llama.cpp``: the most layers on the GPUs (-ngl), then the largest context (-c), whose
buffers -- model, KV, compute, the output's host buffer aside -- plus the CUDA context stay within each
GPU's budget. A -c or -ngl given is kept and the other searched. -c moves in llama.cpp's own steps of 256
(what it pads to); the search is a bisection on each, as every buffer grows with both."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace

from ..runtime import CUDA_DEFAULT
from .buffers import LlamaArgs, estimate_llamacpp
from .gguf_file import GgufModel, read_gguf

MIN_CTX = 4096  # llama.cpp's fit_params_min_ctx: the context its own --fit will not go below
GPU_BUFFER = re.compile(r"^[A-Za-z]+\d+$")


@dataclass
class LlamaFit:
    model: str
    path: str
    fits: bool
    n_gpu_layers: int | None
    gpu_layers: int | None
    n_layer: int
    ctx_size: int | None
    peak_bytes: int | None  # the fullest GPU: its buffers + the CUDA context
    per_gpu_bytes: dict[str, int]
    command: str
    args: list[str]
    note: str | None = None
    notes: list[str] = field(default_factory=list)
    priced_from: dict | None = None  # a GGUF priced from its HF config (.from_config.PricedFrom.to_dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def gpu_totals(e) -> dict[str, int]:
    """Each GPU's bytes: its buffers plus the CUDA context (estimator.runtime's, as for the other engines)."""
    out: dict[str, int] = {}
    for dev, b in e.device_bytes().items():
        if GPU_BUFFER.match(dev) and not dev.startswith("CPU"):
            out[dev] = b + CUDA_DEFAULT.context_bytes
    return out


def fit_llamacpp(spec, args: LlamaArgs, budget_bytes: int, *, ctx_given: bool, ngl_given: bool) -> LlamaFit:
    """``spec``: a GGUF path (or Hub id) to read, or a :class:`~.gguf_file.GgufModel` already read or derived."""
    m = spec if isinstance(spec, GgufModel) else read_gguf(spec)
    base = estimate_llamacpp(m, replace(args, ctx_size=256))
    n_layer = base.n_layer
    n_ctx_train = max(256, (base.n_ctx if args.ctx_size else 0) or _ctx_train(m))

    def fits(ngl: int, ctx: int):
        e = estimate_llamacpp(m, replace(args, n_gpu_layers=ngl, ctx_size=ctx))
        totals = gpu_totals(e)
        return (max(totals.values(), default=0) <= budget_bytes), e, totals

    def largest_ctx(ngl: int) -> int | None:
        if ctx_given:
            return args.ctx_size if fits(ngl, args.ctx_size)[0] else None
        lo, hi = 0, n_ctx_train // 256  # in steps of 256
        if not fits(ngl, 256)[0]:
            return None
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(ngl, mid * 256)[0]:
                lo = mid
            else:
                hi = mid - 1
        return lo * 256

    want = min(MIN_CTX, n_ctx_train)
    ngls = [args.n_gpu_layers if args.n_gpu_layers >= 0 else n_layer + 1] if ngl_given else \
        list(range(n_layer + 1, -1, -1))
    chosen = None
    for ngl in ngls:  # the most layers whose largest context reaches llama.cpp's minimum (or the -c given)
        ctx = largest_ctx(ngl)
        if ctx is not None and (ctx_given or ngl_given or ctx >= want or ngl == 0):
            chosen = (ngl, ctx)
            break
    if chosen is None:
        return LlamaFit(m.name, m.path, False, None, None, n_layer, None, None, {}, "", [],
                        note=f"not even -ngl 0 -c 256 fits {budget_bytes / 1024**3:.2f} GiB per GPU: the compute "
                             "and the CUDA context alone are more", priced_from=base.priced_from)
    ngl, ctx = chosen
    _, e, totals = fits(ngl, ctx)
    argv = ["llama-server", "-m", m.path, "-c", str(ctx), "-ngl", str(ngl)] + _flags(args)
    return LlamaFit(m.name, m.path, True, ngl, e.n_gpu_layers, n_layer, ctx, max(totals.values(), default=0), totals,
                    shlex.join(argv), argv[1:], notes=list(e.notes), priced_from=e.priced_from)


def _ctx_train(m) -> int:
    v = m.get(".context_length", 0)
    return int(v) if isinstance(v, int) else 0


def _flags(a: LlamaArgs) -> list[str]:
    """The other flags of the search, in llama.cpp's spellings, for the command it prints."""
    out: list[str] = []
    if a.cache_type_k != "f16":
        out += ["-ctk", a.cache_type_k]
    if a.cache_type_v != "f16":
        out += ["-ctv", a.cache_type_v]
    if a.flash_attn != "auto":
        out += ["-fa", a.flash_attn]
    if a.n_parallel != 1:
        out += ["-np", str(a.n_parallel)]
    if a.kv_unified:
        out.append("-kvu")
    if a.tensor_split:
        out += ["-ts", ",".join(f"{x:g}" for x in a.tensor_split)]
    if a.split_mode != "layer":
        out += ["-sm", a.split_mode]
    if a.n_ubatch != 512:
        out += ["-ub", str(a.n_ubatch)]
    if a.n_batch != 2048:
        out += ["-b", str(a.n_batch)]
    if a.n_cpu_moe:
        out += ["--n-cpu-moe", str(a.n_cpu_moe)]
    if a.cpu_moe:
        out.append("--cpu-moe")
    for p, b in a.overrides:
        out += ["-ot", f"{p}={b}"]
    if not a.use_mmap:
        out.append("--no-mmap")
    return out
