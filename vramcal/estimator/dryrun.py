"""The dry run: the installed model's real forward, on tensors that hold no memory.

The model is built on the ``meta`` device (:func:`~vramcal.estimator.inventory.build_meta_model`), so
every operator runs its shape function only: a Llama-3.1-8B prefill at 16k tokens takes well under a
second on a CPU. A :class:`AllocationTracker` (a ``TorchDispatchMode``) sees every tensor the forward
creates and when its storage dies, and keeps the running total the way the CUDA caching allocator
counts ``memory_allocated``: each allocation rounded up to 512 bytes.

Where the meta device's kernels differ from the CUDA ones, the dry run emulates the CUDA kernel:

- ``scaled_dot_product_attention``: on CUDA the flash / memory-efficient kernels allocate the output
  and a float32 log-sum-exp, never the ``seq x seq`` score matrix that the meta (math) path would
  build; the output is laid out as the kernel lays it out (:func:`_fused_output`), so a transpose back is a view. ``eager`` attention is traced as written: its scores really are ``seq x seq``.
- bitsandbytes ``Linear4bit``: prefill dequantizes the weight to the compute dtype, then matmuls (the
  transient copy is traced); a single-token decode step with batch 1 uses ``gemv_4bit``, no copy.
- bitsandbytes ``Linear8bitLt``: int8 copy of the input, float32 row scales, an int32 product, the
  dequantized output. Outlier columns (threshold 6.0) depend on the data and are not modelled.

The KV cache is taken from the cache object itself after tiny prefills: each layer's bytes at two
lengths give its bytes per token and fixed part. A sliding-window layer stops growing at
``sliding_window`` tokens of storage: transformers' ``DynamicSlidingWindowLayer`` keeps a view of the
last ``sliding_window - 1`` tokens of the ``sliding_window``-token concatenation it made at each step.
Right after the prefill, that view still holds the whole prompt's storage; the prefill trace counts it.

Images (:mod:`vramcal.estimator.vision`): the prefill runs the model's real multimodal forward -- the
vision encoder over pixel tensors of the shapes the image processor makes, the projector, the language
model over the prompt with the image tokens in it. That forward branches on a few small integer tensors
(the placeholder count check, Qwen's grid and rope positions, Mllama's cross-attention mask), which meta
tensors cannot answer; :class:`ShadowValues` carries their real values on the CPU beside them (never the
weights', never anything large). The vision encoder's window (from its first module to the language
model) is traced on its own: ``vision_peak_bytes`` is what was live at its peak, ``vision_extra_bytes``
what it added above what was live when it started.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field

from .allocator import ALLOC, FREE, MARK, WORKSPACE_MARK

ALLOC_ROUND = 512  # CUDA caching allocator: every block is a multiple of 512 bytes


def round_alloc(n: int) -> int:
    if n <= 0:
        return 0
    return -(-n // ALLOC_ROUND) * ALLOC_ROUND


@dataclass
class KVLayer:
    kind: str  # cache layer class name
    bytes_per_token: int  # per batch row
    fixed_bytes: int  # per batch row (states of linear-attention layers, scales)
    max_tokens: int | None  # sliding window: tokens kept at most

    def bytes_at(self, tokens: int, batch: int) -> int:
        t = tokens if self.max_tokens is None else min(tokens, self.max_tokens)
        return batch * (self.fixed_bytes + self.bytes_per_token * t)


@dataclass
class Trace:
    batch: int
    tokens: int
    prefill_peak_bytes: int  # above the weights: activations + the cache as it is built
    cache_bytes: int  # held by the cache after the prefill
    decode_peak_bytes: int  # during one decode step, above what was held before it
    ops: int
    layers: int | None = None  # decoder layers traced, one per kind (:meth:`DryRunner.trace`); None: all
    # with images: live bytes at the vision encoder's peak (the cache is still empty then), its own
    # transient above what was live when it started, and the prefill's peak outside its window
    vision_peak_bytes: int = 0
    vision_extra_bytes: int = 0
    lm_peak_bytes: int = 0
    # the caching allocator's reserve above what is allocated (:mod:`vramcal.estimator.allocator`), by the
    # settings' key: [at the prefill's peak, at the decode step's], from the replay of this trace's events
    slack: dict[str, list[int]] = field(default_factory=dict)
    # the allocations and frees of the whole model's prefill and decode step, in order (allocator events;
    # not cached: the replay's figures are, in ``slack``); None where not recorded
    events: list | None = field(default=None, repr=False, compare=False)


@dataclass
class ActivationModel:
    """Peak extra bytes at traced points, and between them a model of the traces. ``prefill`` /
    ``decode`` are None until a fit was made: an exact estimate traces only its own point.

    The prefill's extra is the largest of many transients, each linear in the tokens (``batch x seq``)
    where attention never holds ``seq x seq`` scores (fused SDPA / flash), so it is convex and piecewise
    linear: ``pieces`` interpolates between the batch-1 traces, which bounds it from above between them
    and is exact at them; the estimator traces a point beyond the largest before it answers there
    (:meth:`covers`). Eager attention's scores grow with ``seq**2`` per row: there the least-squares fit
    ``a + b*tokens + c*batch*seq**2`` (``prefill``) is used. The decode step's extra is fitted linearly."""

    prefill: tuple[float, float, float] | None
    decode: tuple[float, float] | None
    traces: list[Trace] = field(default_factory=list)
    pieces: bool = False
    # with images, per batch row over seq: (a, b) of the vision window's peak less the prompt's cache,
    # and of the vision encoder's own transient (the prefill is the larger of the window and the rest)
    vision: tuple[float, float] | None = None
    vision_own: tuple[float, float] | None = None

    def _points(self) -> list[tuple[int, int]]:
        """(tokens, the prefill's extra outside the vision window) of the batch-1 traces, in order."""
        pts = {t.tokens: (t.lm_peak_bytes if t.vision_peak_bytes else t.prefill_peak_bytes) - t.cache_bytes
               for t in self.traces if t.batch == 1}
        return sorted(pts.items())

    def covers(self, tokens: int) -> bool:
        """Whether a batch-1 trace reaches ``tokens`` (batch x seq), so the model interpolates there."""
        return not self.pieces or any(t.batch == 1 and t.tokens >= tokens for t in self.traces)

    def _trace(self, batch: int, seq: int) -> Trace | None:
        for t in self.traces:
            if t.batch == batch and t.tokens == seq:
                return t
        return None

    def prefill_extra(self, batch: int, seq: int) -> int:
        t = self._trace(batch, seq)
        if t is not None:
            return t.prefill_peak_bytes - t.cache_bytes
        n = batch * seq
        pts = self._points() if self.pieces else []
        if len(pts) >= 2:
            i = next((k for k in range(1, len(pts)) if pts[k][0] >= n), len(pts) - 1)
            (n0, y0), (n1, y1) = pts[i - 1], pts[i]
            rest = max(int(y0 + (y1 - y0) * (n - n0) / (n1 - n0)), 0)
        else:
            a, b, c = self.prefill
            rest = int(a + b * n + c * batch * seq * seq)
        if self.vision is None:
            return rest
        return max(rest, int(batch * (self.vision[0] + self.vision[1] * seq)))

    def vision_extra(self, batch: int, seq: int) -> int | None:
        """The vision encoder's own transient (what it added above what was live when it started)."""
        t = self._trace(batch, seq)
        if t is not None:
            return t.vision_extra_bytes if t.vision_peak_bytes else None
        if self.vision_own is None:
            return None
        return int(batch * (self.vision_own[0] + self.vision_own[1] * seq))

    def decode_extra(self, batch: int, seq: int, new_tokens: int = 2, growth_per_row_token: int = 0) -> int:
        """The largest decode step's transient after a ``seq``-token prefill. The traced step is the
        first (the cache at ``seq``); the last runs at ``seq + new_tokens - 2``. A dynamic cache layer
        appends with ``torch.cat``, so its old and new storage coexist for a moment: the step's transient
        grows by the largest layer's bytes per token (``growth_per_row_token``) per batch row and token."""
        extra_positions = max(new_tokens - 2, 0)
        t = self._trace(batch, seq)
        if t is not None:
            return t.decode_peak_bytes + growth_per_row_token * batch * extra_positions
        a, b = self.decode
        return int(a + b * batch * (seq + extra_positions))


def _tensors(obj):
    """The tensors in an op's arguments or results: nested tuples, lists and dicts of them (what the
    dispatcher passes; a plain walk is several times cheaper than torch's general pytree flatten, and it
    runs at every op of a trace)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


# Where the cuBLAS workspace is allocated (:func:`~vramcal.estimator.reserve.trace_slack` puts it there): torch
# allocates it through the caching allocator on the first cuBLAS or cuBLASLt call of a thread and stream, in any
# dtype (aten/src/ATen/cuda/CublasHandlePool.cpp: getCurrentCUDABlasHandle -> setWorkspaceForHandle ->
# getNewWorkspace, getChosenWorkspaceSize; the Lt handle shares it), after the op allocated its output. The
# products skip BLAS only for an empty output or an inner dimension of 0 (Blas.cpp, baddbmm_out_cuda_impl). On the
# H200's trace (docs/validation/gpu-h200/2026-12-04.md) it was the first Linear's (q_proj), the prefill's 23rd
# allocation: transformers 5.24's rotary embedding makes its frequencies with a broadcast multiply, no product.
# bitsandbytes' int8 matmul runs in bitsandbytes (its stand-in makes no torch product), so there the mark falls
# at the first module torch multiplies (lm_head): not measured. Replayed before the prefill instead, the
# workspace left one 896 MiB MLP segment more at 32k.
_PRODUCTS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "_int_mm": 0, "mv": 0, "addmv": 1, "dot": 0,
             "vdot": 0}  # op -> the left operand's place


def _first_product(func, args) -> bool:
    """Whether ``func`` on ``args`` reaches cuBLAS: mm / addmm / bmm / baddbmm / _int_mm / mv / addmv / dot / vdot
    with a non-empty inner dimension."""
    place = _PRODUCTS.get(getattr(getattr(func, "overloadpacket", None), "__name__", ""))
    if place is None or len(args) <= place:
        return False
    left = args[place]
    return getattr(left, "dim", lambda: 0)() >= 1 and left.shape[-1] > 0 and left.numel() > 0


class AllocationTracker:
    """Running total of live tensor storages on one device, counted as the CUDA caching allocator counts
    them. Tensors on other devices (a CPU scalar transformers makes before moving it) are not counted.
    The first matrix product that reaches cuBLAS is marked (:data:`WORKSPACE_MARK`) after its output."""

    def __init__(self, device_type: str = "meta"):
        self.device_type = device_type
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._note(out, (args, kwargs))
                if not tracker.product_seen and _first_product(func, args):
                    tracker.product_seen = True
                    tracker.mark(WORKSPACE_MARK)
                return out

        self.mode = _Mode()
        self.live: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.ops = 0
        self.product_seen = False
        # (ALLOC, storage, bytes) / (FREE, storage, 0) / (MARK, name, 0), in order: the allocator's replay
        self.events: list[tuple] = []

    def _note(self, out, inputs) -> None:
        self.ops += 1
        outs = [t for t in _tensors(out) if t.device.type == self.device_type]
        if not outs:
            return
        # A view or in-place result shares an input's storage: nothing new was allocated. Storages made
        # before tracking began (the weights) are never counted.
        input_keys = {t.untyped_storage()._cdata for t in _tensors(inputs)}
        for t in outs:
            key = t.untyped_storage()._cdata
            if key in input_keys and key not in self.live:
                continue
            if key not in self.live:
                nbytes = t.untyped_storage().nbytes()
                size = round_alloc(nbytes)
                self.live[key] = size
                self.refs[key] = 0
                self.events.append((ALLOC, key, nbytes))
                self.current += size
                if self.current > self.peak:
                    self.peak = self.current
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.current -= self.live.pop(key)
            self.events.append((FREE, key, 0))

    def mark(self, name) -> None:
        self.events.append((MARK, name, 0))

    def reset_peak(self) -> None:
        gc.collect()
        self.peak = self.current

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


SHADOW_CAP = 64 * 1024**2  # bytes: a result larger than this keeps no values (masks at long contexts, features)


class ShadowValues:
    """Real values, on the CPU, beside the meta tensors that need them.

    A meta tensor has shapes and no data, so the few places where a multimodal forward looks at data --
    ``.item()`` in a check, ``.tolist()`` of Qwen's image grid, ``nonzero`` and boolean indexing, a
    ``repeat_interleave`` by counts -- cannot run on it. Here every op whose meta inputs all have values
    (the ids, masks and grids the dry run made, and what is computed from them) is also run on those
    values on the CPU, and its meta results get the CPU results as theirs, when they are small
    (:data:`SHADOW_CAP`). An op the meta kernel cannot run takes its shapes from the CPU result (its meta
    result made with the same shape and strides, so the tracker counts the allocation the device would
    make); a copy to the CPU (``tolist``) or a scalar read returns the values. Ops on weights never have
    values: nothing heavy is ever computed. ``torch.tensor(data, device="meta")`` keeps its data too
    (:meth:`__enter__` routes it through a copy this mode sees)."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakTensorKeyDictionary

        self.values = WeakTensorKeyDictionary()
        shadows = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return shadows._dispatch(func, args, kwargs or {})

        self.mode = _Mode()
        self._torch = torch
        self._real_tensor = None

    def attach(self, meta, values) -> None:
        self.values[meta] = values

    def _cpu(self, x, shrink: bool = False):
        """``x`` with meta tensors replaced by their values (``shrink``: a value that is one element
        repeated by one element, of the same number of dimensions, for an op computed elementwise)."""
        torch = self._torch
        if isinstance(x, torch.Tensor):
            v = self.values[x] if x.device.type == "meta" else x
            if shrink and v.dim() and _one_value(v):
                return v.as_strided([1] * v.dim(), [1] * v.dim())
            return v
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        if isinstance(x, (list, tuple)):
            return type(x)(self._cpu(y, shrink) for y in x)
        if isinstance(x, dict):
            return {k: self._cpu(v, shrink) for k, v in x.items()}
        return x

    # ops that copy their input elementwise (a dtype or device change, a clone): on a repeated value,
    # computed on one element like the pointwise ops
    @property
    def _copies(self):
        aten = self._torch.ops.aten
        return (aten._to_copy.default, aten.clone.default, aten.lift_fresh_copy.default)

    def _all_constant(self, args, kwargs) -> bool:
        """Whether every tensor input has a value that is one element repeated (and there is one)."""
        tensors = list(_tensors((args, kwargs)))
        return bool(tensors) and all(_one_value(self.values[t] if t.device.type == "meta" else t) for t in tensors) \
            and any(t.numel() > 1 for t in tensors)

    def _shape_of(self, x):
        return tuple(x.shape)

    def _constant_index(self, args):
        """``x[mask]`` (``aten.index.Tensor``) of a repeated value: the indexed dimensions are gathered on
        the CPU with every dimension after them cut to one element, then expanded back -- the dry run's
        padding-image filter (Idefics3 / SmolVLM) at any number of images without their pixels in memory."""
        torch = self._torch
        x, indices = args[0], list(args[1])
        v = self.values[x] if x.device.type == "meta" else x
        last = 0
        for i, ix in enumerate(indices):
            if ix is not None:
                last = i + (ix.dim() if ix.dtype == torch.bool else 1)
        cut = v[(slice(None),) * last + (slice(0, 1),) * (v.dim() - last)]
        small = torch.ops.aten.index.Tensor(cut, self._cpu(indices))
        shape = tuple(small.shape[:small.dim() - (v.dim() - last)]) + tuple(v.shape[last:])
        m = torch.empty(shape, dtype=v.dtype, device="meta")
        if small.numel() and bool((small == small.flatten()[0]).all()):  # still one value: keep it as one element
            small = small.flatten()[:1].clone().reshape([1] * small.dim())
        self.values[m] = small.expand(shape)
        return m

    def _dispatch(self, func, args, kwargs):
        torch = self._torch
        metas = [t for t in _tensors((args, kwargs)) if t.device.type == "meta"]
        known = all(t in self.values for t in metas)
        if not known:
            out = func(*args, **kwargs)
            if func._schema.is_mutable:  # unknown values written into a tensor that had values
                for t in metas:
                    self.values.pop(t, None)
            return out
        constant = self._all_constant(args, kwargs)
        if constant and func._schema.is_mutable:  # written in place: the one shared element must not change
            out = func(*args, **kwargs)
            for t in metas:
                self.values.pop(t, None)
            return out
        device = kwargs.get("device")
        to_host = device is not None and torch.device(device).type != "meta"
        if constant and (torch.Tag.pointwise in func.tags or func in self._copies):
            # every input is one value repeated (the pixels of the dry run): so is the result, computed
            # on one element and expanded -- no memory in proportion to the images
            small = func(*self._cpu(args, shrink=True), **self._cpu(kwargs, shrink=True))
            if to_host:  # a copy to the CPU (.cpu()): the values themselves, still one element expanded
                return small.expand(self._shape_of(args[0]))
            out = func(*args, **kwargs)
            for m, c in zip(_tensors(out), _tensors(small)):
                if m.device.type == "meta":
                    self.values[m] = c.expand(m.shape)
            return out
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError):  # a kernel that needs data: the CPU values decide
            if func is torch.ops.aten.index.Tensor and self._all_constant((args[0],), {}):
                return self._constant_index(args)  # a repeated value gathered by real indices
            cpu = func(*self._cpu(args), **self._cpu(kwargs))
            if to_host:
                return cpu  # a copy to the CPU (tolist, .cpu()): the values themselves
            return self._to_meta(cpu)
        results = [t for t in _tensors(out) if t.device.type == "meta"]
        view_of_constant = constant and func.is_view  # a view of one repeated value costs nothing on the CPU
        if not results or (not view_of_constant and any(t.untyped_storage().nbytes() > SHADOW_CAP for t in results)):
            return out
        cpu = func(*self._cpu(args), **self._cpu(kwargs))
        for m, c in zip(_tensors(out), _tensors(cpu)):
            if m.device.type == "meta" and c.device.type == "cpu":
                self.values[m] = c
        return out

    def _to_meta(self, cpu):
        torch = self._torch
        if isinstance(cpu, torch.Tensor):
            if cpu.device.type != "cpu":
                return cpu
            if _one_value(cpu):  # the device would hold every element: a dense tensor, this value repeated
                m = torch.empty(cpu.shape, dtype=cpu.dtype, device="meta")
            else:
                m = torch.empty_strided(cpu.shape, cpu.stride(), dtype=cpu.dtype, device="meta")
            self.values[m] = cpu
            return m
        if isinstance(cpu, (list, tuple)):
            return type(cpu)(self._to_meta(x) for x in cpu)
        return cpu

    def __enter__(self):
        torch = self._torch
        real = self._real_tensor = torch.tensor

        def tensor(data, *args, device=None, **kwargs):
            try:  # torch.tensor reads tensors in ``data`` below the dispatcher: hand it their values
                data = self._cpu(data)
            except KeyError:
                pass
            if device is not None and torch.device(device).type == "meta":
                return real(data, *args, **kwargs).to("meta")
            return real(data, *args, device=device, **kwargs)

        torch.tensor = tensor
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self.mode.__exit__(*exc)
        finally:
            self._torch.tensor = self._real_tensor


def _one_value(t) -> bool:
    """A CPU tensor that stores one element for all of its (more than one) elements: an expand of a
    scalar, as the dry run's pixels are made (:func:`vramcal.estimator.vision.pixel_inputs`)."""
    return t.device.type == "cpu" and t.numel() > 1 and t.untyped_storage().nbytes() <= t.element_size()


class VisionWindow:
    """The vision encoder's stretch of a prefill, traced on its own: it opens when the first module beside
    the language model (vision tower, projector) starts, and closes when the language model starts."""

    def __init__(self, model, tracker: AllocationTracker):
        from .inventory import model_parts

        modules = dict(model.named_modules())
        decoder = model.get_decoder()
        self.tracker = tracker
        self.parts = [modules[n] for n in model_parts(model) if modules[n] is not decoder]
        self.decoder = decoder
        self.handles = []
        self.opened = self.closed = False
        self.start = self.before = self.peak = 0

    def _open(self, *_):
        if not self.opened:
            t = self.tracker
            self.opened, self.start, self.before = True, t.current, t.peak
            t.peak = t.current

    def _close(self, *_):
        if self.opened and not self.closed:
            t = self.tracker
            self.closed, self.peak = True, t.peak
            t.peak = t.current  # from here the rest of the prefill, on its own

    def rest_peak(self) -> int:
        """The prefill's peak outside the window (call at the end of the prefill)."""
        return max(self.before, self.tracker.peak) if self.closed else self.tracker.peak

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(self._open) for m in self.parts]
        self.handles.append(self.decoder.register_forward_pre_hook(self._close))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


@contextlib.contextmanager
def cuda_kernels(model, quant_method: str, compute_dtype, target: str = "cuda"):
    """Swap in allocation-faithful stand-ins for the kernels the meta device lacks (module doc).

    ``target="cpu"`` follows the CPU's choice instead: its fused (flash) attention kernel needs the
    query and value head sizes to match; otherwise (MLA: 96 vs 64 in DeepSeek-V2) torch falls back to
    the math kernel, whose ``seq x seq`` scores the meta device traces as they are."""
    import torch
    import torch.nn.functional as F

    real_sdpa = F.scaled_dot_product_attention

    def fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if target == "cpu" and query.shape[-1] != value.shape[-1]:
            return real_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)
        out = _fused_output(query, value.shape[-1], mem_efficient=target == "cuda" and attn_mask is not None)
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        del lse
        return out

    patched = []
    bnb = None
    if quant_method in ("bnb4", "bnb8"):
        from .meta import import_bitsandbytes

        bnb = import_bitsandbytes()
    if bnb is not None:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                patched.append((module, module.forward))
                module.forward = _linear4bit_stand_in(module, compute_dtype)
            elif isinstance(module, bnb.nn.Linear8bitLt):
                patched.append((module, module.forward))
                module.forward = _linear8bit_stand_in(module)
    F.scaled_dot_product_attention = fused_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real_sdpa
        for module, fwd in patched:
            module.forward = fwd


def _fused_output(query, head_dim: int, mem_efficient: bool = False):
    """The fused kernels' output: the query's shape with the value's head size.

    - The flash kernels (CUDA's and the CPU's) lay it out as the query is: ``empty_like`` of the query
      (``mha_fwd`` in ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``, torch's meta
      registration of ``_scaled_dot_product_flash_attention``). A query made from a projection viewed as
      (batch, seq, heads, dim) and transposed keeps that layout through the rotary embedding, so the output's
      ``transpose(1, 2).contiguous()`` in transformers' attention is then a view, not a copy.
    - CUDA's memory-efficient kernel, which takes what flash cannot (query and value head sizes that differ,
      as MLA's; an explicit mask: ``mem_efficient``), always makes a (batch, seq, heads, dim) tensor and returns
      it transposed (``_efficient_attention_forward`` in ``aten/src/ATen/native/transformers/cuda/attention.cu``).
      The CPU target never gets here with head sizes that differ: its fused kernel refuses them, and the real
      (math) kernel runs instead (:func:`cuda_kernels`).
    - A query that is not 4-D takes neither fused kernel: the math path's output is contiguous."""
    import torch

    if query.dim() != 4:
        return query.new_empty(tuple(query.shape[:-1]) + (head_dim,))
    if mem_efficient or head_dim != query.shape[-1]:
        b, h, s, _ = query.shape
        return query.new_empty((b, s, h, head_dim)).transpose(1, 2)
    return torch.empty_like(query)


def _linear4bit_stand_in(module, compute_dtype):
    import torch
    import torch.nn.functional as F

    def forward(x):
        inp_dtype = x.dtype
        x = x.to(compute_dtype)
        bias = None if module.bias is None else module.bias.to(compute_dtype)
        if x.numel() == x.shape[-1]:  # gemv_4bit: one token, no dequantized copy
            out = x.new_empty(x.shape[:-1] + (module.out_features,))
        else:
            w = torch.empty(module.out_features, module.in_features, dtype=compute_dtype, device=x.device)
            out = F.linear(x, w, bias)
            del w
        return out.to(inp_dtype)

    return forward


def _linear8bit_stand_in(module):
    import torch

    def forward(x):
        rows = x.numel() // x.shape[-1]
        ca = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        sca = torch.empty(rows, dtype=torch.float32, device=x.device)
        acc = torch.empty(rows, module.out_features, dtype=torch.int32, device=x.device)
        out = x.new_empty(x.shape[:-1] + (module.out_features,))
        del ca, sca, acc
        if module.bias is not None:
            out = out + module.bias.to(x.dtype)
        return out

    return forward


def _cache_tensors(obj, seen=None):
    import torch

    seen = set() if seen is None else seen
    out = []
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            out += _cache_tensors(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            out += _cache_tensors(x, seen)
    return out


def layer_bytes(layer) -> int:
    seen: set[int] = set()
    total = 0
    for value in vars(layer).values():
        for t in _cache_tensors(value, seen):
            if t.dim() >= 2:  # skip bookkeeping scalars such as a window length
                total += t.untyped_storage().nbytes()
    return total


class DryRunner:
    """Holds one meta model and runs prefill / decode traces over it."""

    def __init__(self, source, quant, attn: str | None = None, cache: str = "dynamic", kv_dtype: str = "auto",
                 target: str = "cuda"):
        import torch

        self.target = target
        from ..errors import UserError
        from .meta import build_meta_model

        self.cache_kind = cache
        self.kv_dtype = kv_dtype
        # flash_attention_2 allocates what fused sdpa allocates (output + log-sum-exp); build it as sdpa
        build_attn = "sdpa" if attn == "flash_attention_2" else attn
        try:
            self.model, _, self.dtype = build_meta_model(source, quant, attn=build_attn)
        except Exception as exc:
            if attn and "attention implementation" in str(exc):
                raise UserError(f"{source.name}: transformers does not support --attn {attn} for this "
                                "architecture; use --attn auto or eager") from None
            raise
        self.attn_used = attn or getattr(self.model.config, "_attn_implementation", None) or "sdpa"
        self.model.eval()
        self.quant = quant
        self._cache_kw = cache_keyword(self.model)
        self.torch = torch

    def _new_cache(self, max_len: int):
        from transformers import DynamicCache, QuantizedCache, StaticCache

        cfg = self.model.config
        if self.kv_dtype == "fp8":
            return QuantizedCache(backend="fp8", config=cfg)
        if self.cache_kind == "static":
            return StaticCache(config=cfg, max_cache_len=max_len)
        return DynamicCache(config=cfg)

    def trace(self, batch: int, seq: int, images=None) -> Trace:
        """The prefill and first decode step at ``batch`` x ``seq`` (``seq`` prompt positions per row, the
        image tokens of ``images`` among them): traced one decoder layer per kind (:meth:`kinds`) where
        the model allows and no image is in the prompt, else whole.

        By kinds: a model's layers of one kind (the same class, parameter shapes, settings and layer
        type) allocate the same transients wherever they sit; what differs is the cache around them.
        Each kind's last layer is traced with the layer before it (the model cut to those two: the layer
        then reads another layer's output while the embeddings' output is still held, as in the whole
        model), and the whole model's figures follow from the KV layout: held after the prefill = the
        traced pair's held bytes less their cache plus every layer's cache; the prefill's extra above
        that = the largest over kinds of the pair's extra less the cache of the layers after it (not yet
        written while it runs); the decode step's = the largest over kinds (every cache is held by then).
        The last layer's trace carries the logits. An 80-layer model then costs two layers' trace
        instead of eighty. Checked against whole traces for every architecture the tests build."""
        kinds = self.kinds() if images is None else []
        if kinds:
            try:
                return self._trace_kinds(kinds, batch, seq)
            except Exception:  # noqa: BLE001 -- a model that does not take being cut: traced whole
                self._kinds = []
        return trace_model(self.model, self.quant.method, self.dtype, batch, seq,
                           lambda: self._new_cache(seq + 16), device="meta", target=self.target, images=images)

    def _trace_kinds(self, kinds: list[int], batch: int, seq: int) -> Trace:
        kv = self._layout()
        # right after the prefill a layer holds the whole prompt (a sliding window's view included)
        cache = [batch * (layer.fixed_bytes + layer.bytes_per_token * seq) for layer in kv]
        traces = {}
        for i in kinds:
            with self._only_layers(i):
                traces[i] = trace_model(self.model, self.quant.method, self.dtype, batch, seq,
                                        lambda: self._new_cache(seq + 16), device="meta", target=self.target,
                                        layers=self._decoder_list()[2])
        last = traces[kinds[-1]]
        held = last.cache_bytes - sum(cache[max(kinds[-1] - 1, 0):kinds[-1] + 1]) + sum(cache)
        extra = max(t.prefill_peak_bytes - t.cache_bytes - sum(cache[i + 1:]) for i, t in traces.items())
        # a decode step appends a token to every layer it passed (a new concatenation of keys and of values,
        # the old ones freed): the layers before the pair had grown by then
        grow = [2 * (round_alloc(batch * layer.bytes_per_token * (seq + 1) // 2)
                     - round_alloc(batch * layer.bytes_per_token * seq // 2)) for layer in kv]
        decode = max(t.decode_peak_bytes + sum(grow[:max(i - 1, 0)]) for i, t in traces.items())
        # one kind: the whole model's allocations follow from the pair's (its second layer repeated); with
        # several kinds the layers' order of kinds would have to be woven in, which is not done: no events
        events = whole_model_events(last.events, len(kv)) if len(kinds) == 1 else None
        return Trace(batch=batch, tokens=seq, prefill_peak_bytes=held + extra, cache_bytes=held,
                     decode_peak_bytes=decode, ops=sum(t.ops for t in traces.values()), layers=len(kinds),
                     events=events)

    def _decoder_list(self):
        """(parent module, attribute, ModuleList) of the decoder layers, or None."""
        from .placement import decoder_layers

        names = decoder_layers(self.model)
        if not names:
            return None
        path = names[0].rsplit(".", 1)[0]
        parent_path, _, attr = path.rpartition(".")
        parent = self.model.get_submodule(parent_path) if parent_path else self.model
        return parent, attr, getattr(parent, attr)

    def kinds(self) -> list[int]:
        """One decoder layer per kind, its last occurrence, in order; [] when the model is traced whole:
        a vision-language model, fewer than two layers, an fp8 or a static cache (their layouts at long contexts are not their
        tiny prefills'), a config with per-layer lists besides ``layer_types`` (the cache or the masks may
        read them), cache layers that are not one per decoder layer, or any with a sliding window or a
        fixed state (what they hold while the prefill runs is not what their layout says after it)."""
        if getattr(self, "_kinds", None) is not None:
            return self._kinds
        self._kinds = []
        kind_of = self._kind_map()
        if not kind_of:
            return self._kinds
        kv = self._layout()
        if len(kv) != len(kind_of) or any(layer.max_tokens is not None or layer.fixed_bytes for layer in kv):
            return self._kinds  # a sliding window's storage during the prefill is not its layout's
        self._kinds = sorted(set(kind_of))
        return self._kinds

    def _kind_map(self) -> list[int] | None:
        """For each decoder layer, the index of the last layer of its kind (:func:`_signature`); None when
        the model is not cut (see :meth:`kinds`)."""
        if getattr(self, "_kind_of", False) is not False:
            return self._kind_of
        self._kind_of = None
        found = self._decoder_list()
        tc = self.model.config.get_text_config()
        if found is None or self.kv_dtype != "auto" or self.cache_kind != "dynamic":
            return None
        if getattr(self.model.config, "vision_config", None) is not None:
            return None  # a vision-language model: its language model's layers and cache have their own rules
        layers = list(found[2])
        n = len(layers)
        types = getattr(tc, "layer_types", None)
        if n < 2 or getattr(tc, "num_hidden_layers", None) != n or (types is not None and len(types) != n):
            return None
        if any(isinstance(v, (list, tuple)) and len(v) == n and k != "layer_types" for k, v in vars(tc).items()):
            return None
        sigs = [_signature(layer, types[i] if types else None) for i, layer in enumerate(layers)]
        last = {sig: i for i, sig in enumerate(sigs)}
        self._kind_of = [last[sig] for sig in sigs]
        return self._kind_of

    def _layout(self) -> list[KVLayer]:
        if getattr(self, "_kv_layout", None) is None:
            self._kv_layout = self.kv_layers()
        return self._kv_layout

    def _only_layers(self, index: int):
        """The model cut to decoder layers ``index - 1`` and ``index`` (renumbered from 0), restored after."""
        return self._cut(list(range(max(index - 1, 0), index + 1)))

    @contextlib.contextmanager
    def _cut(self, keep: list[int]):
        """The model cut to the decoder layers ``keep`` (renumbered from 0), restored after."""
        import torch

        parent, attr, full = self._decoder_list()
        tc = self.model.config.get_text_config()
        saved = (tc.num_hidden_layers, getattr(tc, "layer_types", None))
        numbered = [(m, m.layer_idx, new) for new, i in enumerate(keep) for m in full[i].modules()
                    if isinstance(getattr(m, "layer_idx", None), int)]
        try:
            setattr(parent, attr, torch.nn.ModuleList([full[i] for i in keep]))
            tc.num_hidden_layers = len(keep)
            if saved[1] is not None:
                tc.layer_types = [saved[1][i] for i in keep]
            for m, _, new in numbered:
                m.layer_idx = new
            yield
        finally:
            setattr(parent, attr, full)
            tc.num_hidden_layers = saved[0]
            if saved[1] is not None:
                tc.layer_types = saved[1]
            for m, i, _ in numbered:
                m.layer_idx = i

    def kv_layers(self, batch: int = 1, images=None) -> list[KVLayer]:
        """Each cache layer's bytes per token (per batch row) and fixed part, from two tiny prefills: of
        one layer per kind (:meth:`kinds`), each layer then given its kind's, where the model is cut and
        no image is in the prompt; else of the whole model.

        With ``images`` both prefills hold them (the prompt's image tokens count as tokens): a layer
        that caches the images themselves (Mllama's cross-attention K/V) then shows as a fixed part."""
        kind_of = self._kind_map() if images is None else None
        if kind_of:
            reps = sorted(set(kind_of))
            try:
                with self._cut(reps):
                    measured = self._measure_kv(batch)
            except Exception:  # noqa: BLE001 -- a model that does not take being cut: measured whole
                measured = []
            if len(measured) == len(reps):
                by_kind = dict(zip(reps, measured))
                return [by_kind[k] for k in kind_of]
        return self._measure_kv(batch, images)

    def _measure_kv(self, batch: int, images=None) -> list[KVLayer]:
        torch = self.torch
        small, large = 4, 12
        extra_tokens = images.tokens if images is not None else 0
        sizes = []
        kinds = []
        windows = []
        _forget_positions(self.model)
        with torch.no_grad(), cuda_kernels(self.model, self.quant.method, self.dtype, self.target):
            for n in (small, large):
                seq = n + extra_tokens
                cache = self._new_cache(seq if self.cache_kind == "static" else seq + 16)
                if images is None:
                    ids, extra = torch.zeros(batch, n, dtype=torch.long, device="meta"), {}
                    shadows = contextlib.nullcontext()
                else:
                    shadows = ShadowValues()
                with shadows:
                    if images is not None:
                        host = multimodal_prompt(self.model, images, batch, seq, self.dtype)
                        extra = place({"input_ids": host[0], **host[1]}, "meta")
                        ids = extra.pop("input_ids")
                        del host
                    self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache}, **extra)
                layers = getattr(cache, "layers", None) or []
                sizes.append([layer_bytes(layer) for layer in layers])
                kinds = [type(layer).__name__ for layer in layers]
                windows = [_window(layer, self.cache_kind) for layer in layers]
                del ids, extra, cache
        out = []
        for kind, win, b_small, b_large in zip(kinds, windows, sizes[0], sizes[1]):
            per_tok = (b_large - b_small) // (large - small)
            out.append(KVLayer(kind=kind, bytes_per_token=per_tok // batch,
                               fixed_bytes=(b_small - per_tok * (small + extra_tokens)) // batch, max_tokens=win))
        return out


def _signature(layer, layer_type) -> tuple:
    """What makes two decoder layers allocate alike: their classes, parameter shapes and dtypes, the
    plain settings of every submodule (a sliding window, an attention type, whether it uses rope, ...)
    and the config's layer type; not the layer's index."""
    parts: list = [type(layer).__name__, layer_type]
    for name, module in layer.named_modules():
        settings = sorted((k, v) for k, v in vars(module).items()
                          if not k.startswith("_") and k not in ("layer_idx", "training")
                          and (v is None or isinstance(v, (bool, int, float, str))))
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters(recurse=False)]
        parts.append((name, type(module).__name__, tuple(settings), tuple(params)))
    return tuple(parts)


def _window(layer, cache_kind: str) -> int | None:
    win = getattr(layer, "sliding_window", None)
    if not isinstance(win, int) or win <= 0:
        return None
    # DynamicSlidingWindowLayer keeps a view of the last sliding_window - 1 tokens, but the view's
    # storage is the concatenation it was cut from: sliding_window tokens stay allocated.
    return win


def fit_activations(traces: list[Trace], pieces: bool = False) -> ActivationModel:
    """The prefill and decode models over traces at batch 1 (:class:`ActivationModel`): interpolated
    between them where ``pieces``, else a least-squares fit."""
    import numpy as np

    ones = [t for t in traces if t.batch == 1] or traces
    n = np.array([t.batch * t.tokens for t in ones], dtype=float)
    seen = any(t.vision_peak_bytes for t in ones)  # images: the rest of the prefill, and the window apart
    pre = np.array([(t.lm_peak_bytes if seen else t.prefill_peak_bytes) - t.cache_bytes for t in ones], dtype=float)
    dec = np.array([t.decode_peak_bytes for t in ones], dtype=float)
    if len(ones) >= 3:
        coef_p = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], 1), pre, rcond=None)[0]
    else:
        coef_p = np.array([pre.mean(), 0.0, 0.0])
    if len(ones) >= 2:
        coef_d = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), dec, rcond=None)[0]
    else:
        coef_d = np.array([dec.mean(), 0.0])
    vision = own = None
    if seen:
        rows = np.array([t.batch for t in ones], dtype=float)
        seq = n / rows
        lin = np.stack([np.ones_like(seq), seq], 1)
        win = np.array([(t.vision_peak_bytes - t.cache_bytes) / t.batch for t in ones], dtype=float)
        mine = np.array([t.vision_extra_bytes / t.batch for t in ones], dtype=float)
        if len(ones) >= 2:
            vision = tuple(float(x) for x in np.linalg.lstsq(lin, win, rcond=None)[0])
            own = tuple(float(x) for x in np.linalg.lstsq(lin, mine, rcond=None)[0])
        else:
            vision, own = (float(win.mean()), 0.0), (float(mine.mean()), 0.0)
    return ActivationModel(prefill=tuple(float(x) for x in coef_p), decode=tuple(float(x) for x in coef_d),
                           traces=list(traces), pieces=pieces, vision=vision, vision_own=own)


def cache_keyword(model) -> str:
    """``cache`` where the model's forward takes it (transformers deprecates ``past_key_values``)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def trace_model(model, quant_method: str, dtype, batch: int, seq: int, new_cache, device="meta",
                target: str = "cuda", images=None, layers=None) -> Trace:
    """Prefill ``seq`` tokens for ``batch`` rows, then one decode step, as ``generate`` does, under the
    tracker. Works on the meta model of the dry run and, for cross-checks, on a real loaded model.

    ``images`` (:class:`~vramcal.estimator.vision.Images`): each row's prompt holds them, ``seq`` counts
    their tokens, and the prefill gets the pixel tensors the image processor makes; they stay held
    through the decode step, as ``generate`` holds them.

    The trace's ``events`` are its allocations and frees in order, with a mark after the prefill and
    after the decode step; ``layers`` (modules) get a mark as each starts and ends (``("pre", i)``,
    ``("post", i)``): :func:`whole_model_events` builds a whole model's events from them."""
    import torch

    cache_kw = cache_keyword(model)

    def step(ids, cache, extra):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache}, **extra)
        # generate() copies the last position's logits to float32 before choosing the token
        logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
        nxt = logits.argmax(-1, keepdim=True)
        del out, logits
        return nxt

    # gc.collect() frees the reference cycles a forward leaves, so the tracker sees those tensors die;
    # the objects that exist before the trace (modules, the model, torch's own) cannot hold new tensors,
    # so they are frozen out of the collector's scan: a full collection then takes milliseconds, not
    # a second over transformers' heap (three per trace).
    gc.freeze()
    try:
        return _trace(model, quant_method, dtype, batch, seq, new_cache, device, target, step, images, layers)
    finally:
        gc.unfreeze()


def _forget_positions(model) -> None:
    """Qwen-VL keeps the last prefill's rope offsets on the model for the decode steps after it; a dry
    run reuses one model for many traces, so each starts as a fresh ``generate`` does."""
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None


def multimodal_prompt(model, images, batch: int, seq: int, dtype):
    """The prefill's ids and multimodal inputs (on the CPU, real values) and those each decode step
    gets. ``seq`` counts the image tokens. :func:`place` puts them on the traced device."""
    from .vision import decode_inputs, pixel_inputs, prompt_ids, text_side_inputs

    text = seq - images.tokens
    if text < 1:
        raise ValueError(f"{seq} prompt positions cannot hold {images.tokens} image tokens and any text")
    ids = prompt_ids(model.config, images, batch, text)
    extra = {**text_side_inputs(model.config, images, ids), **pixel_inputs(images, batch, dtype)}
    return ids, extra, decode_inputs(images, extra)


def place(tensors: dict, device: str) -> dict:
    """Tensors made on the CPU, now on ``device`` as a run would hold them there (a copy, so a tracker
    counts it; on ``meta`` under :class:`ShadowValues` the copy keeps the values)."""
    import torch

    if torch.device(device).type == "cpu":
        return {k: v.clone() for k, v in tensors.items()}
    return {k: v.to(device) for k, v in tensors.items()}


def _held(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage()._cdata] = round_alloc(t.untyped_storage().nbytes())
    return sum(seen.values())


def _layer_marks(tracker: AllocationTracker, layers) -> list:
    hooks = []
    for i, layer in enumerate(layers or []):
        hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: tracker.mark(("pre", i))))
        hooks.append(layer.register_forward_hook(lambda *_, i=i: tracker.mark(("post", i))))
    return hooks


def _trace(model, quant_method, dtype, batch, seq, new_cache, device, target, step, images=None,
           layers=None) -> Trace:
    import torch

    _forget_positions(model)
    meta = torch.device(device).type == "meta"
    with torch.no_grad(), cuda_kernels(model, quant_method, dtype, target):
        tracker = AllocationTracker(torch.device(device).type)
        shadows = ShadowValues() if images is not None and meta else None
        window = VisionWindow(model, tracker) if images is not None else None
        host = multimodal_prompt(model, images, batch, seq, dtype) if images is not None else None
        hooks = _layer_marks(tracker, layers)
        with tracker, shadows or contextlib.nullcontext(), window or contextlib.nullcontext():
            cache = new_cache()
            if host is None:
                ids, extra, later = torch.zeros(batch, seq, dtype=torch.long, device=device), {}, {}
            else:
                placed = place({"input_ids": host[0], **host[1]}, device)
                ids, extra = placed.pop("input_ids"), placed
                later = place(host[2], device)
                del host, placed
            nxt = step(ids, cache, extra)
            del ids
            gc.collect()
            tracker.mark("prefill")
            rest_peak = window.rest_peak() if window is not None else tracker.peak
            prefill_peak = max(rest_peak, window.peak if window is not None else 0)
            inputs = _held(_tensors(extra))  # pixels and masks: generate holds them to the end
            held = tracker.current - inputs
            tracker.reset_peak()
            if shadows is not None:  # the next token is text
                from .vision import reserved_ids

                reserved = reserved_ids(model.config)
                shadows.attach(nxt, torch.full(tuple(nxt.shape), next(i for i in range(3, 1 << 20) if i not in reserved),
                                               dtype=nxt.dtype))
            nxt = step(nxt, cache, later)
            gc.collect()
            tracker.mark("decode")
            decode_peak = tracker.peak - held
            del nxt, cache, extra, later
        for h in hooks:
            h.remove()
        ops = tracker.ops
    vision_peak = window.peak if window is not None and window.closed else 0
    return Trace(batch=batch, tokens=seq, prefill_peak_bytes=prefill_peak, cache_bytes=held,
                 decode_peak_bytes=decode_peak, ops=ops, vision_peak_bytes=vision_peak,
                 vision_extra_bytes=vision_peak - window.start if vision_peak else 0,
                 lm_peak_bytes=rest_peak if vision_peak else 0, events=tracker.events)


def whole_model_events(events: list, layers: int) -> list | None:
    """A whole model's allocations and frees (prefill and one decode step), from those of a model cut to
    two layers of one kind (:meth:`DryRunner._trace_kinds`), marked as each layer starts and ends.

    Each phase (the prefill, then the decode step) is cut into the part before the first layer, the first
    layer (A), the second (B) and the rest. The whole model runs the part before, A as its layer 0, B as
    each of its layers 1 .. n-1, and the rest. An allocation is known by its phase, part and place among
    that part's allocations; a free in part ``b`` of what part ``a`` allocated frees, at layer ``f``, what
    layer ``f - (b - a)`` allocated (B freeing A's output frees the layer before's; a decode step's B
    replacing its cache frees its own layer's). What B frees of the part before (the embeddings' output,
    as layer l frees what layer l - 2 made) is, from layer 2 on, what layer l - 2 made in its place: the
    allocation of A's of the same size that the rest frees (A's output, freed after B), matched in order.
    Layers of one kind allocate alike, so A's and B's places correspond: where their counts differ, None.
    Events after the decode step's mark are left out (only the figures up to it are read)."""
    parts: list[list[list]] = [[[], [], [], []] for _ in range(2)]  # phase -> part (-1 as 0) -> events
    origin: dict = {}
    count: dict = {}
    phase, part, trailing = 0, 0, False
    for op, key, size in events:
        if op == MARK:
            if key == "prefill" or key == "decode":
                parts[phase][3].append((MARK, key, 0))
                if key == "decode":
                    break
                phase, part = 1, 0
            elif key == ("pre", 0):
                part = 1
            elif key == ("pre", 1):
                part = 2
            elif key == ("post", 1):
                part, trailing = 2, True
            elif key == WORKSPACE_MARK:  # kept where it fell: the part before, layer A (layer 0's), the rest
                parts[phase][part].append((MARK, key, 0))
            continue
        if trailing and op != FREE:
            part, trailing = 3, False
        if op == ALLOC:
            n = count.get((phase, part), 0)
            count[(phase, part)] = n + 1
            origin[key] = (phase, part, n)
            parts[phase][part].append((ALLOC, (phase, part, n), size))
        elif key in origin:
            parts[phase][part].append((FREE, origin.pop(key), 0))
    if any(count.get((ph, 1), 0) != count.get((ph, 2), 0) for ph in (0, 1)):
        return None
    out: list = []
    live: set = set()

    def emit(evs, b: int, f: int) -> None:
        for op, org, size in evs:
            if op == MARK:
                if org == WORKSPACE_MARK and b != 2:  # a tracker marks once, never in B (A has a product first)
                    out.append((MARK, org, 0))
                continue
            ph, a, n = org
            at = f if op == ALLOC else f - (b - a)
            if a in (1, 2):  # a layer's: A's places are layer 0's, B's are every later layer's
                if not 0 <= at < layers:
                    continue
                full = (ph, "layer", at, n)
            else:
                full = (ph, a, n)
            if op == ALLOC:
                live.add(full)
                out.append((ALLOC, full, size))
            elif full in live:
                live.discard(full)
                out.append((FREE, full, 0))

    for ph in (0, 1):
        before, first, second, rest = parts[ph]
        emit(before, 0, -1)
        emit(first, 1, 0)
        for layer in range(1, layers):
            emit(second, 2, layer)
        emit(rest, 3, layers)
        out += [e for e in rest if e[0] == MARK and e[1] != WORKSPACE_MARK]  # emit wrote the workspace's already
    return out
