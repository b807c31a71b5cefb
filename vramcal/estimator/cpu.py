"""What a CPU process's resident set holds while transformers loads and runs a model (``--device cpu``).

Pure arithmetic, no torch. Measured on this stack (torch 2.13 CPU, transformers 5.24, bitsandbytes
0.50.2, glibc 2.36, an AVX2 machine without AVX-512) with ``benchmarks/cpu_rss_instrument.py``,
which reads ``/proc/self/smaps_rollup`` and ``/proc/self/smaps`` at every stage; the figures behind
each term are in docs/cpu-memory.md. All quantities are bytes above the probe's baseline (the child
with torch, transformers and bitsandbytes imported).

The resident set is not "the tensors". It is, per stage:

``checkpoint_pages`` (file-backed)
    safetensors memory-maps the checkpoint, and transformers keeps every tensor it does not convert
    as a *view* of that mapping. A page is resident once something reads it, and stays resident (and
    counted in RSS) while the mapping lives, which is as long as the model. So: at load, only the
    pages the loader reads -- the 16-bit source of every weight bitsandbytes quantizes on the fly;
    nothing for a plain load in the checkpoint's dtype (bf16 Qwen2.5-0.5B: +22 MiB after
    ``from_pretrained`` for a 942 MiB file). After the first forward every weight has been read: the
    whole file. (A tied embedding is read whole by the ``lm_head`` matmul; an untied one is read a few
    rows at a time, but each fault maps the readahead around it: 112 random tokens left 59 of a 65 MB
    untied embedding resident, so it is counted whole.) A dtype conversion copies every tensor: it reads
    the whole file while loading (at ``load_peak``), and then nothing references the mapping any more,
    so it is released: no pages after the load (a bf16 checkpoint loaded as fp16: 166 MiB after the
    load for 147 MiB of copies, 299 MiB at its peak).
``loaded_tensors`` (anonymous)
    tensors the loader allocates rather than maps: bitsandbytes' packed weights and their quant state
    (the inventory's ``quantized`` + ``quant_state`` groups, to the MiB in glibc's ``mallinfo2``),
    or every tensor when the load converts the dtype.
``fixed``
    code and data pages of torch / bitsandbytes touched for the first time by loading (about 22 MiB)
    and by the first forward (about 16 MiB more): measured, not derived.
``quantize_transient``
    the temporaries of quantizing the largest weight (``load_peak`` only; the float32 copies of
    bitsandbytes' pure-torch ``quantize_4bit``, the float16 copies of ``int8_vectorwise_quant``).
``heap_retained``
    glibc keeps freed memory in its heap. Its mmap threshold starts at 128 KiB and rises to the size of
    the largest mmapped block freed so far (at most 32 MiB), so after the first quantized weight every
    temporary up to 32 MiB comes from the heap; the packed results land between them, and the holes
    they leave are resident but reusable only by requests that fit. How much stays is *not
    deterministic*: the same load of Qwen2.5-0.5B nf4 left 40 MiB in one run and 1.29 GiB in the
    next (see docs/cpu-memory.md; thread timing, hash seeds and address layout change the order of
    small allocations between the large ones). The bound is one float32 copy of every weight whose
    float32 copy is at most 32 MiB (nf4), one and a half float16 copies for LLM.int8. ``stages``
    uses ``RETENTION_TYPICAL`` of that bound; ``upper`` uses all of it.
``activations`` / ``kv_cache``
    from the dry run, as on CUDA; the freed prefill blocks stay in the heap too, so the prefill's
    share is scaled by ``ACT_RETAINED`` (bf16 Qwen2.5-0.5B ctx 1024: 73 MiB above weights for a dry
    run of 47 MiB), and it is absorbed by ``heap_retained`` holes where those are larger.
LLM.int8's CPU matmul (part of ``heap_retained`` at ``first_token`` / ``end``)
    LLM.int8 on a CPU without AVX-512 multiplies in float32: each linear converts its int8 weight
    to a float32 copy (``4 x out x in``) and the int32 product to float32 for every forward; during
    a prefill whose ``tokens x out x 4`` is below glibc's 32 MiB cap these land in the heap and stay
    (Qwen2.5-0.5B, 1008 tokens: +725 MiB over the load); see :func:`int8_prefill_heap`.
``decompressed_weights`` (anonymous, ``first_token`` / ``end``)
    a compressed-tensors checkpoint loads compressed, and the first forward decompresses every quantized
    module into new 16-bit weights (:meth:`~vramcal.estimator.formats.Format.first_forward`); the checkpoint's
    pages stay mapped beside them. A W4A16 Llama of 4 layers (hidden 1024, 162 MB loaded): measured +339 MiB
    at first_token over the baseline, 320 MiB with this term, 204 MiB without it; the rest is the
    decompression's temporaries (an int8 and a float copy of one weight at a time) left in the heap.
``merged`` MoE experts (in ``checkpoint_pages`` and ``loaded_tensors`` from the load on)
    transformers stacks a checkpoint's per-expert weights into one 3-D tensor per layer while loading:
    the per-expert pages are read and the stack is a new allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..units import MIB
from .checkpoint import stored_layout
from .quant import DTYPE_BYTES, config_dtype

GLIBC_MMAP_THRESHOLD_MAX = 32 * MIB  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc


def from_heap(request_bytes: int) -> bool:
    """Whether glibc serves a block from its heap once the dynamic mmap threshold has risen to its
    maximum: the request plus the chunk header must stay below the threshold (a block of exactly
    32 MiB is mmapped, as Llama-3.2-1B's 2048 x 8192 float16 copies are)."""
    return request_bytes + 16 < GLIBC_MMAP_THRESHOLD_MAX
LOAD_FIXED_BYTES = 22 * MIB  # library pages touched by from_pretrained (bf16 Qwen2.5-0.5B: 21.6-22.3 MiB)
RUN_FIXED_BYTES = 16 * MIB  # more library pages touched by the first forward (libtorch_cpu.so: +8 MiB, ...)
# The share of the heap-retention bound a load keeps: the median of the nine loads measured before this
# model was wired in (Qwen2.5-0.5B nf4 and int8, probes and instrumented runs, docs/cpu-memory.md: 0.015,
# 0.048, 0.053, 0.066, 0.883, 0.887, 0.926, 0.950, 0.975). Runs land near none or near all of it, so the
# middle of the range would be wrong for nearly every run; the median is right for most, the range
# says the rest.
RETENTION_TYPICAL = 0.88
ACT_RETAINED = 1.25  # resident prefill blocks per byte of the dry run's prefill peak (bf16, ctx 256/1024)
QUANT_TEMP_FACTOR = {"bnb4": 4 * 4, "bnb8": 4 * 2}  # live temporaries per element while quantizing one weight
INT8_RETENTION_FACTOR = 1.5  # LLM.int8 load: heap kept per float16 byte of the quantized weights (0.07-1.49)


@dataclass(frozen=True)
class CpuInputs:
    """What the CPU model needs, all from the inventory, the config and the checkpoint listing.

    ``quantized_elements``: element count of every weight bitsandbytes quantizes (one entry per
    tensor); ``checkpoint_bytes``: bytes of the tensors in the safetensors files as stored;
    ``checkpoint_elem_bytes``: their element size (2 for a bf16 checkpoint); ``load_elem_bytes``:
    the load dtype's; ``converts``: whether the load converts the stored dtype to another (bf16 to
    fp16 converts although both take 2 bytes); ``loaded_tensor_bytes``: anonymous bytes the loader allocates (see
    :func:`loaded_tensor_bytes`); ``merged_bytes``: checkpoint bytes the
    loader reads and copies into new tensors although their dtype stays (per-expert MoE weights that
    transformers stacks into one 3-D tensor per layer; their copies are in ``loaded_tensor_bytes``).
    """

    method: str  # none | bnb4 | bnb8
    checkpoint_bytes: int
    checkpoint_elem_bytes: int
    load_elem_bytes: int
    loaded_tensor_bytes: int
    converts: bool = False
    quantized_elements: tuple[int, ...] = ()
    merged_bytes: int = 0
    decompressed_bytes: int = 0  # new tensors the first forward allocates (compressed-tensors' decompression)


@dataclass(frozen=True)
class CpuStages:
    stages: dict[str, int]  # predicted resident set above the baseline, typical heap retention
    upper: dict[str, int]  # the same with the whole heap-retention bound
    lower: dict[str, int]  # the same with no heap kept (what MALLOC_MMAP_THRESHOLD_=131072 measures)
    terms: dict[str, dict[str, int]]  # stage -> {term: bytes}, typical
    notes: list[str] = field(default_factory=list)


def cpu_inputs(inv, quant, source) -> CpuInputs:
    """:class:`CpuInputs` from an :class:`~vramcal.estimator.inventory.Inventory`, its
    :class:`~vramcal.estimator.quant.QuantSpec` and the :class:`~vramcal.estimator.resolve.ModelSource`
    (its safetensors headers, where it has files, say how the checkpoint stores its tensors)."""
    on_the_fly = quant.method in ("bnb4", "bnb8") and not quant.pre_quantized
    method = quant.method if on_the_fly else "none"
    load_el = DTYPE_BYTES.get(inv.dtype, 2)
    stored = stored_layout(source)
    stored_dtype = stored.dtype or config_dtype(source.config)
    stored_el = DTYPE_BYTES.get(stored_dtype, load_el)
    # every parameter is stored once in the checkpoint (tied ones once, untied copies counted in params)
    checkpoint = inv.params * stored_el if not quant.pre_quantized else inv.tensor_bytes
    # a dtype conversion copies every tensor, whatever the element sizes (bf16 -> fp16 is 2 -> 2 bytes)
    converts = stored_dtype != inv.dtype and not quant.pre_quantized
    elements = tuple(o * i for o, i, n in (inv.quantized_shapes if on_the_fly else ()) for _ in range(n))
    experts = inv.groups.get("experts", 0)
    merged = experts // load_el * stored_el if experts and not stored.fused_experts and not converts else 0
    loaded = loaded_tensor_bytes(method, inv.groups, inv.tensor_bytes, converts)
    return CpuInputs(method=method, checkpoint_bytes=checkpoint, checkpoint_elem_bytes=stored_el,
                     load_elem_bytes=load_el, quantized_elements=elements,
                     merged_bytes=merged, loaded_tensor_bytes=loaded + (experts if merged else 0), converts=converts,
                     decompressed_bytes=sum(sum(new) for new, _ in inv.first_forward))


def out_features(inv) -> tuple[int, ...]:
    """Output width of each entry of :func:`cpu_inputs`' ``quantized_elements``, in the same order."""
    return tuple(o for o, i, n in inv.quantized_shapes for _ in range(n))


def loaded_tensor_bytes(method: str, groups: dict[str, int], tensor_bytes: int, converts_dtype: bool) -> int:
    """Anonymous bytes ``from_pretrained`` allocates: quantized data and state for bitsandbytes; every
    tensor when the load converts the checkpoint's dtype; none for a plain load in the stored dtype."""
    if converts_dtype:
        return tensor_bytes
    if method in ("bnb4", "bnb8"):
        return groups.get("quantized", 0) + groups.get("quant_state", 0)
    return 0


def heap_retention_bound(method: str, quantized_elements: tuple[int, ...]) -> int:
    """The most a bitsandbytes load leaves in glibc's heap: a float32 copy (nf4/fp4) of every weight
    whose copy is served from the heap (at most 32 MiB), or 1.5 float16 copies (LLM.int8)."""
    if method == "bnb4":
        return sum(4 * n for n in quantized_elements if from_heap(4 * n))
    if method == "bnb8":
        return int(INT8_RETENTION_FACTOR * sum(2 * n for n in quantized_elements if from_heap(2 * n)))
    return 0


def int8_prefill_heap(quantized_elements: tuple[int, ...], tokens: int, out_features: tuple[int, ...]
                      ) -> tuple[int, int]:
    """Heap the CPU LLM.int8 prefill leaves behind, (typical, most): per linear a float32 weight copy
    and the float32 product ``tokens x out``, where glibc serves each from its heap. Typical: half the
    heap-served weight copies from 512 prompt tokens on (Qwen2.5-0.5B at 1008 tokens: 423-690 MiB of
    heap beyond the load's for 1.33 GiB of copies); most: every heap-served copy and product (Llama-3.2-1B
    at 1008 tokens kept about 1 GiB for 0.63 GiB of copies and 0.43 GiB of products). A product past
    32 MiB is mmapped and given back, so the heap-served sum falls at each linear's cliff; ``most`` keeps
    the largest sum of any shorter prompt (an envelope, never falling as the prompt grows, so that
    ``fit``'s search over contexts stays sound)."""
    copies = sum(4 * n for n in quantized_elements if from_heap(4 * n))

    def products(t: int) -> int:
        return sum(4 * t * out for out in out_features if from_heap(4 * t * out))

    # the sum is largest just below a cliff: the last token count at which some linear's product still fits
    cliffs = {t for out in set(out_features) if (t := (GLIBC_MMAP_THRESHOLD_MAX - 17) // (4 * out)) < tokens}
    most = max([products(tokens)] + [products(t) for t in cliffs])
    return (copies // 2 if tokens >= 512 else 0), copies + most


def cpu_resident_stages(inp: CpuInputs, *, kv_prompt: int, kv_end: int, prefill_extra: int, decode_extra: int,
                        prompt_tokens: int, batch: int, out_features: tuple[int, ...] = ()) -> CpuStages:
    """The resident set above the baseline at each probe stage (docs/cpu-memory.md).

    ``kv_prompt`` / ``kv_end`` / ``prefill_extra`` / ``decode_extra`` are the dry run's (the same values
    ``Estimator._stages`` receives); ``out_features`` lines up with ``inp.quantized_elements`` (only
    LLM.int8's prefill term uses it)."""
    m = inp.method
    on_the_fly = m in ("bnb4", "bnb8")
    converts = inp.converts
    q_src = sum(inp.quantized_elements) * inp.checkpoint_elem_bytes
    if converts:  # every tensor is a copy: nothing references the mapping once loaded, and it is released
        pages_peak, pages_load, pages_run = inp.checkpoint_bytes, 0, 0
    else:
        pages_load = (q_src if on_the_fly else 0) + inp.merged_bytes
        pages_peak, pages_run = pages_load, inp.checkpoint_bytes
    bound = heap_retention_bound(m, inp.quantized_elements)
    n_max = max(inp.quantized_elements, default=0)
    transient = QUANT_TEMP_FACTOR.get(m, 0) * n_max if on_the_fly else 0
    act_first = kv_prompt + int(ACT_RETAINED * prefill_extra)
    act_end = kv_end + int(ACT_RETAINED * decode_extra)
    int8_first = int8_most = 0
    if m == "bnb8" and out_features:
        int8_first, int8_most = int8_prefill_heap(inp.quantized_elements, batch * prompt_tokens, out_features)
    notes = []
    cold = pages_load  # none when the load converts (above)
    if on_the_fly:
        notes.append("glibc heap retention after an on-the-fly bitsandbytes load varies run to run "
                     f"between 0 and {bound / MIB:,.0f} MiB after loading"
                     + (f", and LLM.int8's prefill may keep up to {int8_most / MIB:,.0f} MiB more"
                        if int8_most else "") + " (docs/cpu-memory.md)")
    if converts:
        notes.append(f"converting the dtype reads the whole checkpoint ({inp.checkpoint_bytes / MIB:,.0f} MiB of file "
                     "pages at the load's peak); once loaded only the converted copies are held")
    if cold:
        what = " and ".join(w for w, b in (("the weights bitsandbytes quantized", q_src),
                                           ("the MoE experts the loader stacked", inp.merged_bytes)) if b)
        notes.append(f"{cold / MIB:,.0f} MiB of the resident set are the checkpoint's pages of {what}: read "
                     "once while loading, never again; they are clean file pages the kernel can drop when "
                     "memory runs short, so less free RAM than the peak can still be enough")

    def build(keep: float, int8_heap: int) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        retained = int(keep * bound)
        terms: dict[str, dict[str, int]] = {}
        base_load = {"fixed": LOAD_FIXED_BYTES, "checkpoint_pages": pages_load, "loaded_tensors": inp.loaded_tensor_bytes,
                     "heap_retained": retained}
        terms["load_peak"] = {**base_load, "checkpoint_pages": pages_peak, "quantize_transient": transient}
        terms["post_load"] = dict(base_load)
        run = {"fixed": LOAD_FIXED_BYTES + RUN_FIXED_BYTES, "checkpoint_pages": pages_run,
               "loaded_tensors": inp.loaded_tensor_bytes,
               **({"decompressed_weights": inp.decompressed_bytes} if inp.decompressed_bytes else {})}
        # the prefill's freed blocks and the load's holes are the same heap: the larger one shows
        first_heap = retained + int8_heap
        first_act = act_first - kv_prompt
        terms["first_token"] = {**run, "kv_cache": kv_prompt, "activations": first_act,
                                "heap_retained": max(0, first_heap - first_act)}
        end_act = act_end - kv_end
        terms["end"] = {**run, "kv_cache": kv_end, "activations": end_act,
                        "heap_retained": max(0, first_heap - end_act)}
        return {s: sum(t.values()) for s, t in terms.items()}, terms

    stages, terms = build(RETENTION_TYPICAL, int8_first)
    upper, _ = build(1.0, int8_most)
    lower, _ = build(0.0, 0)
    return CpuStages(stages=stages, upper=upper, lower=lower, terms=terms, notes=notes)
