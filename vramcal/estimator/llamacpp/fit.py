"""What llama.cpp can hold: the search behind ``fit --engine llama.cpp`` and ``plan --engine llama.cpp``.

Every configuration is priced whole by :func:`~.buffers.estimate_llamacpp` (each GPU: its buffers plus the
CUDA context; the host: every host buffer, ``CPU_Mapped`` included when a host budget is given), and the
search looks for what a llama.cpp user chooses, in this order (:class:`LayoutSearch`):

1. every layer on the GPUs (``-ngl`` = ``n_layer + 1``, the output layer counted as llama.cpp counts it);
2. for a MoE model, the fewest layers whose experts stay in the CPU (``--n-cpu-moe N``, bisected): the
   experts are most of a MoE model's bytes and only ``expert_used_count`` of them are read per token, so
   keeping them in RAM and attention on the GPU gives up the least;
3. then the most layers on the GPUs (bisected), with every expert in the CPU for a MoE model;
4. across several GPUs, a ``-ts`` in whole layers: first the GPUs' shares of the budget (llama.cpp's own
   default splits by each device's free memory, llama-model.cpp ``load_tensors``), else each GPU in turn
   takes the most layers it holds;
5. the largest ``-c`` that configuration holds, in llama.cpp's steps of 256 (what it pads ``n_ctx`` to).

The layers are sized for a context to reach (llama.cpp's own ``--fit`` keeps ``fit_params_min_ctx`` =
4096 before it moves layers to the host); where no layout holds it, the next one tried is the power of
two below, down to 256 (:func:`ctx_ladder`). Each buffer grows with ``-ngl``, the context and the layers'
experts on the GPU, and the host's with what leaves the GPUs, so each step is a bisection, and the layers
most on the GPUs are also the fewest bytes on the host: where the host cannot hold that, no fewer layers
on the GPUs can help at that context.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from typing import Callable

from ..runtime import CUDA_DEFAULT
from .buffers import LlamaArgs, LlamaEstimate, estimate_llamacpp, hparams_of
from .gguf_file import GgufModel, read_gguf

MIN_CTX = 4096  # llama.cpp's fit_params_min_ctx (common/common.h): the context its own --fit will not go below
CTX_STEP = 256  # llama-context.cpp pads n_ctx to 256
SHORTEST_CTX = 256
PINNABLE = frozenset({"ctx", "ngl", "moe", "split"})


@dataclass(frozen=True)
class Beyond:
    """What a llama.cpp process holds besides the buffers it logs. On each GPU it uses: the CUDA context,
    cuBLAS's handles and ggml-cuda's kernels. On the host: its own resident memory beyond the host buffers
    (the vocabulary, the graph's metadata, the thread pool). By default the GPU's is the CUDA context the
    other engines assume and the host's is not known (``None``, counted as nothing); a machine's own
    llama.cpp runs replace either (:mod:`vramcal.calibrate.llamacpp_corrections`)."""

    gpu_bytes: int = CUDA_DEFAULT.context_bytes
    gpu_source: str = "default: the CUDA context the other engines assume, 512 MiB (docs/accounting.md)"
    host_bytes: int | None = None
    host_source: str = "not known without a llama.cpp run on this machine (a CPU probe measures it)"
    source_runs: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"gpu_bytes": self.gpu_bytes, "gpu_source": self.gpu_source, "host_bytes": self.host_bytes,
                "host_source": self.host_source, "source_runs": list(self.source_runs)}


DEFAULT_BEYOND = Beyond()


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
    n_cpu_moe: int = 0  # layers whose experts stay in the CPU
    tensor_split: list[int] | None = None  # -ts in whole layers (several GPUs)
    host_bytes: int | None = None  # every host buffer (CPU_Mapped included)
    llama_args: LlamaArgs | None = field(default=None, repr=False)  # the flags found, whole
    estimate: LlamaEstimate | None = field(default=None, repr=False)
    beyond: Beyond | None = None  # what each GPU holds beyond the buffers, as priced

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("llama_args", "estimate", "beyond")}
        d["beyond_buffers"] = (self.beyond or DEFAULT_BEYOND).to_dict()
        return d


def gpu_totals(e, n_gpus: int | None = None, backend: str = "CUDA", beyond: Beyond = DEFAULT_BEYOND) -> dict[str, int]:
    """Each GPU's bytes: its buffers plus what llama.cpp holds there beyond them (``beyond``: the CUDA context
    by default, as for the other engines). ``n_gpus``: every GPU llama.cpp sees, each with the CUDA context at
    least, buffers or none (llama.cpp initialises every visible device, and its scheduler reserves on the GPU
    even at -ngl 0)."""
    out: dict[str, int] = {f"{backend}{i}": beyond.gpu_bytes for i in range(n_gpus or 0)}
    for dev, b in e.device_bytes().items():
        if dev != "CPU":
            out[dev] = b + beyond.gpu_bytes
    return out


def host_total(e, beyond: Beyond = DEFAULT_BEYOND) -> int:
    """The host's bytes: every host buffer llama.cpp logs (``CPU_Mapped``, ``CPU``, ``CPU_REPACK``,
    ``CUDA_Host``), the KV and compute buffers of the CPU, the output buffer; plus the process's own memory
    beyond them where a run on this machine measured it."""
    return e.device_bytes().get("CPU", 0) + (beyond.host_bytes or 0)


def ctx_ladder(want: int, floor: int = SHORTEST_CTX) -> list[int]:
    """The contexts the layers are sized for, longest first: ``want``, then the powers of two below it down
    to ``floor``. The same points for every ``want`` above them, so a search for a longer context passes
    through each point a search for a shorter one would stop at."""
    out = [want]
    c = 1 << max(want - 1, 1).bit_length()
    while c // 2 >= floor:
        c //= 2
        if c < want:
            out.append(c)
    return out


@dataclass(frozen=True)
class Found:
    """A configuration that fits: the flags, its estimate, and the context its layers were sized for."""

    args: LlamaArgs
    estimate: LlamaEstimate
    sized_for: int

    @property
    def ctx(self) -> int:
        return self.args.ctx_size


class LayoutSearch:
    """The search of the module's doc for one GGUF and the flags it keeps (``args``; ``pinned`` names those
    the user gave: ``ctx``, ``ngl``, ``moe`` for --n-cpu-moe / --cpu-moe, ``split`` for -ts).
    ``gpu_budgets``: what each GPU's buffers and CUDA context may take, GPU 0 first. ``host_budget``: what
    the host buffers may take (None: not checked). ``tick``: called before each new estimate, so a caller
    can bound the search in time (it raises to stop)."""

    def __init__(self, m: GgufModel, args: LlamaArgs, gpu_budgets: list[int], host_budget: int | None = None, *,
                 pinned: frozenset[str] = frozenset(), tick: Callable[[], None] | None = None,
                 beyond: Beyond = DEFAULT_BEYOND):
        unknown = set(pinned) - PINNABLE
        if unknown:
            raise ValueError(f"unknown pinned {sorted(unknown)}")
        self.m, self.budgets, self.host_budget, self.pinned, self.tick = m, list(gpu_budgets), host_budget, \
            frozenset(pinned), tick
        self.beyond = beyond
        self.base = replace(args, n_gpus=len(self.budgets)).validated()
        h = hparams_of(m)
        self.h, self.n_layer, self.n_all = h, h.n_layer, h.n_layer + 1
        self.moe = h.n_expert > 0 and "moe" not in self.pinned and not self.base.cpu_moe
        self.estimates = 0
        self._cache: dict[LlamaArgs, LlamaEstimate] = {}

    # ------------------------------------------------------------------ pricing
    def args_for(self, ngl: int, ncm: int, ctx: int, ts) -> LlamaArgs:
        return replace(self.base, n_gpu_layers=ngl, n_cpu_moe=ncm, ctx_size=ctx,
                       tensor_split=None if ts is None else tuple(float(x) for x in ts))

    def estimate(self, a: LlamaArgs) -> LlamaEstimate:
        e = self._cache.get(a)
        if e is None:
            if self.tick:
                self.tick()
            e = self._cache[a] = estimate_llamacpp(self.m, a)
            self.estimates += 1
        return e

    def gpus_fit(self, e: LlamaEstimate) -> bool:
        totals = gpu_totals(e, len(self.budgets), self.base.gpu_backend, self.beyond)
        return all(totals[f"{self.base.gpu_backend}{i}"] <= b for i, b in enumerate(self.budgets))

    def host_fits(self, e: LlamaEstimate) -> bool:
        return self.host_budget is None or host_total(e, self.beyond) <= self.host_budget

    # ------------------------------------------------------------------ the split across GPUs
    def split(self, ngl: int, ncm: int, ctx: int) -> Found | None:
        """The ``-ts`` with which every GPU holds its layers at ``ctx``, priced (None: no split does). One GPU,
        a pinned -ts or no layer on the GPUs: that one as it is."""
        act = min(ngl, self.n_all)
        if len(self.budgets) <= 1 or "split" in self.pinned or act == 0:
            ts = self.base.tensor_split if "split" in self.pinned else None
            a = self.args_for(ngl, ncm, ctx, ts)
            e = self.estimate(a)
            return Found(a, e, ctx) if self.gpus_fit(e) else None
        tried = set()
        for ts in (self._shares(act), None):
            if ts is None:
                ts = self._sequential(ngl, ncm, ctx, act)
            if ts is None or ts in tried:
                continue
            tried.add(ts)
            a = self.args_for(ngl, ncm, ctx, ts)
            e = self.estimate(a)
            if self.gpus_fit(e):
                return Found(a, e, ctx)
        return None

    def _shares(self, act: int) -> tuple[int, ...]:
        """Whole layers in proportion to each GPU's budget (largest remainders), summing to ``act``."""
        total = sum(self.budgets)
        raw = [act * b / total for b in self.budgets]
        counts = [int(x) for x in raw]
        for i in sorted(range(len(raw)), key=lambda i: counts[i] - raw[i])[:act - sum(counts)]:
            counts[i] += 1
        return tuple(counts)

    def _sequential(self, ngl: int, ncm: int, ctx: int, act: int) -> tuple[int, ...] | None:
        """Each GPU in turn takes the most layers it holds (the rest on the next); the last GPU the rest."""
        n = len(self.budgets)
        counts: list[int] = []
        start = 0
        for i in range(n - 1):
            rest = act - start

            def holds(k: int) -> bool:
                ts = tuple(counts + [k, rest - k] + [0] * (n - i - 2))
                e = self.estimate(self.args_for(ngl, ncm, ctx, ts))
                return gpu_totals(e, n, self.base.gpu_backend, self.beyond)[f"{self.base.gpu_backend}{i}"] \
                    <= self.budgets[i]

            lo, hi = 0, rest
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if holds(mid):
                    lo = mid
                else:
                    hi = mid - 1
            counts.append(lo)
            start += lo
        counts.append(act - start)
        return tuple(counts) if any(counts) else None

    # ------------------------------------------------------------------ the layers
    def top_ngl(self) -> int:
        if "ngl" in self.pinned:
            n = self.base.n_gpu_layers
            return self.n_all if n < 0 else min(n, self.n_all)
        return self.n_all

    def layers(self, ctx: int) -> Found | None:
        """The most on the GPUs at ``ctx`` (module doc, steps 1-4), the host within its budget; None when not
        even that fits."""
        top, ncm0 = self.top_ngl(), self.base.n_cpu_moe
        found = self.split(top, ncm0, ctx)
        rest_ncm = ncm0
        if found is None and self.moe:
            rest_ncm = self.n_layer
            if self.split(top, self.n_layer, ctx) is not None:
                lo, hi = max(ncm0, 1), self.n_layer  # the fewest layers' experts in the CPU
                while lo < hi:
                    mid = (lo + hi) // 2
                    if self.split(top, mid, ctx) is not None:
                        hi = mid
                    else:
                        lo = mid + 1
                found = self.split(top, lo, ctx)
        if found is None and "ngl" not in self.pinned:
            if self.split(0, rest_ncm, ctx) is None:
                return None
            lo, hi = 0, top - 1  # the most layers on the GPUs
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.split(mid, rest_ncm, ctx) is not None:
                    lo = mid
                else:
                    hi = mid - 1
            found = self.split(lo, rest_ncm, ctx)
        if found is None or not self.host_fits(found.estimate):
            return None
        return found

    def largest_ctx(self, at: Found, limit: int) -> Found:
        """The largest ``-c`` up to ``limit`` (in steps of 256; ``limit`` itself at the top) that the layers
        of ``at`` hold, the split found again for each context tried."""
        a = at.args

        def ok(k: int) -> Found | None:
            c = min(k * CTX_STEP, limit)
            f = self.split(a.n_gpu_layers, a.n_cpu_moe, c)
            return f if f is not None and self.host_fits(f.estimate) else None

        lo, hi = at.ctx // CTX_STEP, -(-limit // CTX_STEP)
        best = at
        while lo < hi:
            mid = (lo + hi + 1) // 2
            f = ok(mid)
            if f is not None:
                lo, best = mid, f
            else:
                hi = mid - 1
        return Found(best.args, best.estimate, at.sized_for)

    def run(self, want: int, limit: int, *, ladder: bool = True) -> Found | None:
        """The configuration of the module's doc: layers sized for ``want`` (else the ladder below it), then the
        largest context up to ``limit`` they hold."""
        points = ctx_ladder(want) if ladder else [want]
        for i, c in enumerate(points):
            found = self.layers(c)
            if found is not None:
                return self.largest_ctx(found, limit) if limit > c else found
            if i == 0 and len(points) > 2 and self.layers(points[-1]) is None:
                return None  # not even the shortest point: nothing between either (every buffer grows with -c)
        return None


def ctx_limit(m: GgufModel) -> int:
    """The model's context (``context_length``), at least 256."""
    v = m.get(".context_length", 0)
    return max(SHORTEST_CTX, int(v) if isinstance(v, int) else 0)


def server_argv(model: GgufModel | str, a: LlamaArgs, n_layer: int | None = None) -> list[str]:
    """``llama-server -m FILE -c N -ngl N ...`` (``-hf REPO --hf-file FILE`` for a Hub GGUF): the flags of ``a``
    that differ from llama.cpp's defaults.
    With ``n_layer``, the MoE flags as a person writes them: ``--cpu-moe`` for every layer's experts, none
    with no layer on a GPU (the experts are in the CPU anyway); the same placement either way."""
    if n_layer is not None and a.n_cpu_moe and not a.overrides:
        if a.n_gpu_layers == 0:
            a = replace(a, n_cpu_moe=0, cpu_moe=False)
        elif a.n_cpu_moe >= n_layer:
            a = replace(a, n_cpu_moe=0, cpu_moe=True)
    given = model.server_model_args() if isinstance(model, GgufModel) else ["-m", model]
    return ["llama-server", *given, "-c", str(a.ctx_size), "-ngl", str(a.n_gpu_layers)] + _flags(a)


def fit_llamacpp(spec, args: LlamaArgs, budget_bytes: int, *, ctx_given: bool, ngl_given: bool,
                 moe_given: bool = False, beyond: Beyond = DEFAULT_BEYOND) -> LlamaFit:
    """``fit --engine llama.cpp``: one budget for each GPU (the host is not checked); a -c or -ngl given is
    kept and the other searched. ``spec``: a GGUF path (or Hub id) to read, or a
    :class:`~.gguf_file.GgufModel` already read or derived from an HF config."""
    m = spec if isinstance(spec, GgufModel) else read_gguf(spec)
    pinned = {k for k, on in (("ctx", ctx_given), ("ngl", ngl_given), ("moe", moe_given or args.cpu_moe),
                              ("split", args.tensor_split is not None)) if on}
    s = LayoutSearch(m, args, [budget_bytes] * max(args.n_gpus, 1), None, pinned=frozenset(pinned), beyond=beyond)
    limit = ctx_limit(m)
    if ctx_given:
        found = s.run(args.ctx_size or limit, args.ctx_size or limit, ladder=False)
    else:
        found = s.run(min(MIN_CTX, limit), limit)
    if found is None:
        return LlamaFit(m.name, m.spec, False, None, None, s.n_layer, None, None, {}, "", [],
                        note=f"not even -ngl 0 -c 256 fits {budget_bytes / 1024**3:.2f} GiB per GPU: the compute "
                             "and the CUDA context alone are more" if not ctx_given and not ngl_given else
                        f"nothing with the -c / -ngl given fits {budget_bytes / 1024**3:.2f} GiB per GPU",
                        priced_from=m.priced_from.to_dict() if m.priced_from is not None else None, beyond=beyond)
    return fit_of(m, s, found)


def fit_of(m: GgufModel, s: LayoutSearch, found: Found) -> LlamaFit:
    a, e = found.args, found.estimate
    totals = gpu_totals(e, len(s.budgets), a.gpu_backend, s.beyond)
    argv = server_argv(m, a, s.n_layer)
    ts = split_list(a)
    return LlamaFit(m.name, m.spec, True, a.n_gpu_layers, e.n_gpu_layers, s.n_layer, a.ctx_size,
                    max(totals.values(), default=0), totals, shlex.join(argv), argv[1:], notes=list(e.notes),
                    n_cpu_moe=a.n_cpu_moe, tensor_split=ts, host_bytes=host_total(e, s.beyond), llama_args=a,
                    estimate=e, priced_from=e.priced_from, beyond=s.beyond)


def split_list(a: LlamaArgs) -> list | None:
    """``-ts`` for JSON: whole layers as integers, other shares as given."""
    if not a.tensor_split:
        return None
    return [int(x) if float(x).is_integer() else x for x in a.tensor_split]


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
    if a.split_mode == "none" and a.main_gpu:
        out += ["-mg", str(a.main_gpu)]
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
    if a.embeddings:
        out.append("--embedding")
    if a.swa_full:
        out.append("--swa-full")
    if not a.offload_kqv:
        out.append("-nkvo")
    d = a.draft
    if d is not None:
        out += ["-md", d.path]
        if d.n_gpu_layers != -1:
            out += ["-ngld", "all" if d.n_gpu_layers == -2 else str(d.n_gpu_layers)]
        if d.cache_type_k != "f16":
            out += ["-ctkd", d.cache_type_k]
        if d.cache_type_v != "f16":
            out += ["-ctvd", d.cache_type_v]
        if d.n_cpu_moe:
            out += ["-ncmoed", str(d.n_cpu_moe)]
        if d.cpu_moe:
            out.append("-cmoed")
        for p, b in d.overrides:
            out += ["-otd", f"{p}={b}"]
    if a.mmproj is not None:
        out += ["--mmproj", a.mmproj.path] + ([] if a.mmproj.offload else ["--no-mmproj-offload"])
    return out
