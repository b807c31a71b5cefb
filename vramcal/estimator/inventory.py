"""The weight inventory: every tensor ``from_pretrained`` will leave on the device, with its bytes.

Method (exact): build the installed transformers' own model class on the ``meta`` device (no memory,
no weights), hand it to the installed quantizer's ``preprocess_model`` -- the very call
``from_pretrained`` makes -- so skip lists, tied weights, fused experts and module types are what this
version of transformers would produce, then count each tensor with the storage layout of its format
(:mod:`vramcal.estimator.quant`). Nothing here allocates device or host memory for weights.

Fallbacks, each labelled ``approximate``: a formula from the config's fields when transformers cannot
be imported or does not know the architecture; layout formulas for pre-quantized formats whose
libraries are not installed (GPTQ, AWQ, fp8) unless the checkpoint's safetensors headers are present,
in which case the stored tensors are counted as stored.

The result is cached on disk (:mod:`vramcal.estimator.cache`), so a later estimate of the same model
needs no torch import. The model itself is built by :mod:`vramcal.estimator.meta`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..versions import software_versions
from .cache import CACHE_PROBLEMS, load_cached, store_cached
from .checkpoint import has_checkpoint, source_tensors, tensor_bytes
from .meta import UnknownArchitecture, _first_line, build_meta_model, declared_model_type, import_bitsandbytes
from .formats import REPLACED_ON_META, format_for
from .quant import (
    DTYPE_BYTES,
    QuantSpec,
    bnb4_tensors,
    bnb8_tensors,
    ceil_div,
    packed_int_tensors,
)
from .resolve import ModelSource, missing_fields, size_field, text_config

GROUPS = ("quantized", "quant_state", "embeddings", "lm_head", "experts", "norms", "dense", "buffers")


@dataclass
class Inventory:
    model_type: str
    architecture: str
    quant_key: str
    dtype: str
    params: int  # parameters of the unquantized model (tied weights once)
    quantized_params: int  # of those, how many the quantizer converts
    tensor_bytes: int  # exact bytes of every tensor held after load
    alloc_sizes: dict[int, int]  # {tensor bytes: how many tensors}, for allocator rounding
    groups: dict[str, int]  # bytes per group (GROUPS)
    largest_source_bytes: int  # bytes of the largest weight as read from the checkpoint before conversion
    warmup_bytes: int | None  # what transformers' caching_allocator_warmup pre-reserves, None if not known
    method: str  # meta | checkpoint | formula
    approximate: bool
    notes: list[str] = field(default_factory=list)
    software: dict[str, str | None] = field(default_factory=dict)
    # [[out_features, in_features, how many], ...] of the weights the quantizer converts (the CPU model's
    # heap terms need each weight's size, not only the total)
    quantized_shapes: list[list[int]] = field(default_factory=list)
    # the config as the installed transformers filled it (every default in place; text_config and
    # vision_config nested): what the KV formula, the warnings and the image rules read. The config as
    # given where transformers could not build it.
    config: dict = field(default_factory=dict)
    # a vision-language model's bytes per part, by module name (model.vision_tower,
    # model.multi_modal_projector, model.language_model, lm_head); empty for a text model
    parts: dict[str, int] = field(default_factory=dict)
    # the auto class from_pretrained is called on for this checkpoint (meta.auto_class_for)
    auto_class: str = "AutoModelForCausalLM"
    # what the first forward changes in the weights, module by module (Format.first_forward): [[bytes of each
    # tensor allocated], [bytes of each stored tensor dropped]]; empty where the model runs as loaded
    first_forward: list = field(default_factory=list)

    @property
    def run_tensor_bytes(self) -> int:
        """Bytes of the weights held from the first forward on."""
        return self.tensor_bytes + sum(sum(new) - sum(freed) for new, freed in self.first_forward)

    def run_alloc_sizes(self) -> dict[int, int]:
        """``alloc_sizes`` from the first forward on."""
        sizes = Counter(self.alloc_sizes)
        for new, freed in self.first_forward:
            sizes.update(new)
            sizes.subtract(freed)
        return {b: n for b, n in sizes.items() if n > 0}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["alloc_sizes"] = {str(k): v for k, v in self.alloc_sizes.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Inventory:
        d = dict(d)
        d["alloc_sizes"] = {int(k): v for k, v in d["alloc_sizes"].items()}
        return cls(**d)


def inventory(source: ModelSource, quant: QuantSpec, use_cache: bool = True, progress=None) -> Inventory:
    if use_cache:
        cached = load_cached(source, quant)
        if cached is not None:
            try:
                inv = Inventory.from_dict(cached)
                if inv.tensor_bytes > 0 and inv.params > 0 and all(
                        isinstance(v, int) and v >= 0 for v in (*inv.groups.values(), *inv.alloc_sizes.values(),
                                                                 *inv.alloc_sizes.keys(), inv.largest_source_bytes)):
                    return inv
                CACHE_PROBLEMS.append("a cached inventory held impossible figures (negative or zero); recomputed")
            except (TypeError, KeyError, ValueError, AttributeError):
                CACHE_PROBLEMS.append("a cached inventory did not have the expected fields; recomputed")
    if progress is not None:
        progress("building the model on the meta device (imports torch and transformers)")
    inv = _compute(source, quant)
    if use_cache:
        store_cached(source, quant, inv.to_dict())
    return inv


def _compute(source: ModelSource, quant: QuantSpec) -> Inventory:
    if quant.method in ("gptq", "awq") and has_checkpoint(source):
        return checkpoint_inventory(source, quant)
    try:
        return meta_inventory(source, quant)
    except ImportError as exc:
        why = f"transformers could not build it ({_first_line(exc)})"
        inv = formula_inventory(source, quant, why)
        inv.notes.append(f"{why}; weights from a formula")
        return inv
    except UnknownArchitecture as exc:
        inv = formula_inventory(source, quant, f"the installed transformers does not know model_type "
                                               f"{text_config(source.config).get('model_type')!r}")
        inv.notes.append(f"the installed transformers does not know this architecture ({exc}); weights from a formula")
        return inv


def _group(name: str, module, param, output_embeddings, input_embeddings) -> str:
    if module is input_embeddings:
        return "embeddings"
    if module is output_embeddings:
        return "lm_head"
    if param.dim() == 3:
        return "experts"
    if "norm" in name.lower() and param.dim() == 1:
        return "norms"
    return "dense"


def meta_inventory(source: ModelSource, quant: QuantSpec) -> Inventory:
    from .meta import auto_class_for

    model, hf_quantizer, dtype = build_meta_model(source, quant)
    refuse_mismatched_stored(source, model, hf_quantizer)
    inv = count_meta_model(source, quant, model, hf_quantizer, dtype)
    inv.auto_class = auto_class_for(model.config, source.config.get("architectures")).__name__
    fmt = format_for(quant.extra["quantization_config"]) if quant.method in REPLACED_ON_META else None
    if fmt is not None and hf_quantizer is not None:
        inv.first_forward = [[list(new), list(freed)] for new, freed in fmt.first_forward(model, hf_quantizer)]
    if inv.first_forward:
        inv.notes.append(f"transformers loads {fmt.label} as stored ({inv.tensor_bytes:,} bytes) and its first "
                         f"forward decompresses the {len(inv.first_forward)} quantized modules to "
                         f"{quant.dtype} ({inv.run_tensor_bytes:,} bytes from the first token on): the stages "
                         "from first_token on hold those")
    return inv


def count_meta_model(source: ModelSource, quant: QuantSpec, model, hf_quantizer, dtype,
                     per_tensor: list[tuple[str, int]] | None = None) -> Inventory:
    """The inventory of a model :func:`build_meta_model` made. With ``per_tensor``, every counted tensor is
    also appended to it as ``(name, bytes)`` (quantization state under its weight's name plus a suffix),
    so placement can sum the same bytes per device."""
    import torch

    part_names = model_parts(model)
    by_part: dict[str, int] = dict.fromkeys(part_names, 0)

    def note(name: str, b: int) -> None:
        if per_tensor is not None:
            per_tensor.append((name, b))
        if part_names:
            key = next((p for p in part_names if name.startswith(p + ".")), name.split(".", 1)[0])
            by_part[key] = by_part.get(key, 0) + b

    bnb = None
    if quant.method in ("bnb4", "bnb8"):
        bnb = import_bitsandbytes()
    dtype_plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    untied = _untied_in_checkpoint(model, source)
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    sizes: Counter[int] = Counter()
    groups = dict.fromkeys(GROUPS, 0)
    params = quantized_params = 0
    largest_source = 0
    shapes: Counter[tuple[int, int]] = Counter()
    seen: set[int] = set()
    linear_types = (torch.nn.Linear,)
    fmt = format_for(quant.extra["quantization_config"]) if quant.method in REPLACED_ON_META else None
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{pname}" if mod_name else pname
            params += p.numel()
            if bnb is not None and pname == "weight" and isinstance(module, bnb.nn.Linear4bit):
                n = module.in_features * module.out_features
                parts = bnb4_tensors(n, quant.double_quant)
            elif bnb is not None and pname == "weight" and isinstance(module, bnb.nn.Linear8bitLt):
                n = module.in_features * module.out_features
                parts = bnb8_tensors(module.out_features, module.in_features)
            elif fmt is not None and _stored_as_declared(module, pname, p):
                # a module the format's quantizer put in place keeps its packed weights and scales in the
                # dtypes it declares (fp8, uint8 blocks, int32 packs, float32 scales) where from_pretrained
                # casts other floating tensors to the load dtype
                n = _unpacked_elements(module, pname, p)
                params += n - p.numel()
                parts = [("weight", p.numel() * p.element_size())] + fmt.state_tensors(module, pname, p)
            elif (quant.method in ("gptq", "awq") and pname == "weight" and isinstance(module, linear_types)
                  and module is not out_emb):
                n = module.in_features * module.out_features
                parts = _layout(quant, module.out_features, module.in_features, DTYPE_BYTES[quant.dtype])
            else:
                n = None
                # from_pretrained casts every floating parameter to the load dtype, unless the model's
                # keep-in-fp32 plan says otherwise (bitsandbytes modules create their bias in float32), or a
                # format's quantizer put the module in place: the loader then casts to the dtype the module
                # declares (core_model_loading: the empty param's dtype), so FbgemmFp8Linear's bias and
                # Mxfp4GptOssExperts' biases stay float32
                declared = not p.is_floating_point() or (fmt is not None and _replaced(module))
                target = _planned_dtype(full, dtype_plan) or (p.dtype if declared else dtype)
                b = p.numel() * target.itemsize
                note(full, b)
                sizes[b] += 1
                groups[_group(full, module, p, out_emb, in_emb)] += b
                continue
            quantized_params += n
            if hasattr(module, "out_features") and p.dim() == 2:
                shapes[(module.out_features, module.in_features)] += 1
            largest_source = max(largest_source, n * torch.tensor([], dtype=dtype).element_size())
            state = fmt is not None and _is_state(pname)
            for suffix, b in parts:
                note(full if suffix in ("weight", "qweight") else f"{full}.{suffix}", b)
                sizes[b] += 1
                groups["quantized" if suffix in ("weight", "qweight") and not state else "quant_state"] += b
        for bname, buf in module.named_buffers(recurse=False):
            if id(buf) in seen or buf is None:
                continue
            seen.add(id(buf))
            b = buf.numel() * buf.element_size()
            note(f"{mod_name}.{bname}" if mod_name else bname, b)
            sizes[b] += 1
            groups["buffers"] += b
    for name in untied:  # the checkpoint stores both tied tensors: from_pretrained keeps them apart
        p = model.get_parameter(name)
        b = p.numel() * dtype.itemsize
        note(name, b)
        sizes[b] += 1
        groups["lm_head"] += b
        params += p.numel()
    if not largest_source:
        largest_source = max((k for k in sizes), default=0)
    # transformers pre-reserves the checkpoint's bytes on the device before loading; for a format whose
    # quantizer is not installed the meta model holds 16-bit Linear layers, so their size is not it
    warmup = _warmup_bytes(model, hf_quantizer) if quant.method not in ("gptq", "awq") else None
    tc = text_config(source.config)
    notes = _defaults_used(tc, model.config)
    given_type = source.config.get("model_type")
    if given_type and given_type != getattr(model.config, "model_type", given_type) and declared_model_type(
            source.config) is not None:
        notes.append(f"model_type {given_type!r} is remote code this transformers does not have; priced as the "
                      f"architecture the config declares, {type(model).__name__} ({model.config.model_type})")
    if untied:
        notes.append(f"the checkpoint stores {', '.join(untied)} beside the tensor the config ties it to: "
                     "transformers keeps both (it ties only equal tensors), so both are counted")
    if quant.method in ("gptq", "awq"):
        notes.append(f"{quant.implementation}: layout from the format's formula (no checkpoint headers to read)")
    if groups["experts"] and fmt is not None:
        notes.append(f"{groups['experts']:,} bytes of fused MoE expert weights in {quant.dtype}: transformers' "
                     f"{fmt.label} modules do not take this model's 3-D expert tensors, so its loader dequantizes "
                     "the stored experts into them (quantizers/base.py, update_weight_conversions); "
                     "--engine vllm keeps them quantized")
    if groups["experts"] and quant.method in ("bnb4", "bnb8"):
        notes.append(f"{groups['experts']:,} bytes of fused MoE expert weights stay in {quant.dtype}: "
                     "this transformers version keeps 3-D expert tensors out of bitsandbytes' Linear layers")
    return Inventory(
        model_type=tc.get("model_type", "?"), architecture=type(model).__name__, quant_key=quant.key(),
        dtype=str(dtype).removeprefix("torch."), params=params, quantized_params=quantized_params,
        tensor_bytes=sum(k * v for k, v in sizes.items()), alloc_sizes=dict(sizes), groups=groups,
        largest_source_bytes=largest_source, warmup_bytes=warmup,
        method="meta", approximate=quant.method in ("gptq", "awq"), notes=notes,
        software=software_versions(), quantized_shapes=[[o, i, c] for (o, i), c in sorted(shapes.items())],
        config=built_config_dict(model.config), parts={k: v for k, v in by_part.items() if v})


_STATE_WORDS = ("scale", "zero", "g_idx", "absmax")


def refuse_mismatched_stored(source: ModelSource, model, hf_quantizer) -> None:
    """One line (UserError) where ``from_pretrained`` would refuse the checkpoint: a tensor the quantizer's
    module declares, stored under the same name in another shape, is a size mismatch it raises on
    (``ignore_mismatched_sizes`` is False), so there is no load to price. Compared where the headers are known,
    for the quantizer's own tensors (``_stored_as_declared``) that none of its weight conversions reshapes.

    The case it was written for (tests/test_compressed_real.py): an asymmetric ``pack-quantized`` checkpoint
    that compressed-tensors 0.20 saves with its zero points packed eight to an int32 along the rows, where
    the module its meta compression builds for transformers 5.24 keeps them unpacked, one per row."""
    if hf_quantizer is None or not has_checkpoint(source):
        return
    stored = source_tensors(source)
    converted = [pat for conv in hf_quantizer.get_weight_conversions()
                 for pat in getattr(conv, "source_patterns", ())]
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if full not in stored or not _stored_as_declared(module, pname, p) or any(c in full for c in converted):
                continue
            shape = tuple(stored[full][1])
            if shape != tuple(p.shape):
                from ..versions import dist_info_versions

                found = dist_info_versions(("transformers", "compressed-tensors"))
                libs = ", ".join(f"{n} {v}" for n, v in found.items())
                raise UserError(f"{source.name}: from_pretrained would refuse this checkpoint ({libs}): {full} is "
                                f"stored as {list(shape)}, the module this quantizer builds holds {list(p.shape)} "
                                "(a size mismatch); there is no load to price with these versions")


def _is_state(pname: str) -> bool:
    return any(w in pname for w in _STATE_WORDS)


def _stored_as_declared(module, pname: str, p) -> bool:
    """A tensor of a quantizer's module that keeps its own dtype through from_pretrained: packed or 8-bit
    data, and quantization state (scales, zero points)."""
    if not _replaced(module):
        return False
    return p.element_size() == 1 or not p.is_floating_point() or _is_state(pname)


def _replaced(module) -> bool:
    """A module a format's quantizer put in place of the model's own (or, compressed-tensors, marked)."""
    return type(module).__module__.startswith(("transformers.integrations", "compressed_tensors")) or hasattr(
        module, "quantization_scheme")


def _unpacked_elements(module, pname: str, p) -> int:
    """How many of the unquantized model's parameters a stored tensor holds (none for its state)."""
    if _is_state(pname):
        return 0
    per_element = {"uint8": 2, "int32": 8}  # packed FP4 / INT4 codes: two a byte, eight an int32
    return p.numel() * (1 if p.is_floating_point() else per_element.get(str(p.dtype).removeprefix("torch."), 1))


def model_parts(model) -> list[str]:
    """A vision-language model's parts: the modules beside its language model (vision tower, projector)
    and the language model itself, by name (``model.vision_tower``, ``model.language_model`` ...). Empty
    for a model without a vision part."""
    if getattr(model.config, "vision_config", None) is None or not hasattr(model, "get_decoder"):
        return []
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        return []
    modules = dict(model.named_modules())
    name = next((n for n, m in modules.items() if m is decoder), None)
    if not name:
        return []
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    holder = modules[parent]
    prefix = f"{parent}." if parent else ""
    return [prefix + child for child, m in holder.named_children() if any(True for _ in m.parameters())]


def built_config_dict(config) -> dict:
    """The config object as JSON data, every field (defaults included)."""
    import json

    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (TypeError, ValueError):  # a field json cannot hold: the fields that could be written
        return {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, list, dict))}


def _plain_config(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_vramcal")}


def _defaults_used(tc: dict, config) -> list[str]:
    """Name the size-deciding fields the config left out, with the default transformers filled in."""
    from .resolve import SIZE_FIELDS

    built = config.get_text_config() if hasattr(config, "get_text_config") else config
    aliases = getattr(built, "attribute_map", {}) or {}  # num_experts -> num_local_experts, and the like

    def given(k: str) -> bool:
        return k in tc or aliases.get(k) in tc or any(a in tc for a, real in aliases.items() if real == k)

    used = {k: getattr(built, k) for k in SIZE_FIELDS if not given(k) and getattr(built, k, None) is not None}
    if not used:
        return []
    return ["the config does not give " + ", ".join(f"{k} (transformers' {type(built).__name__} default {v} used)"
                                                  for k, v in used.items())]


def _untied_in_checkpoint(model, source: ModelSource) -> list[str]:
    """Tied parameters whose source and target both appear in the checkpoint's safetensors headers.

    ``from_pretrained`` ties them only if their values are equal; two separate tensors in a safetensors
    file (which cannot store shared tensors) are taken as different, so they stay untied."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    if not tied or not has_checkpoint(source):
        return []
    names = set(source_tensors(source))
    return sorted(target for target, src in tied.items() if target in names and src in names)


def _planned_dtype(name: str, plan: dict):
    for key, dt in plan.items():
        if key in name:
            return dt
    return None


def _warmup_bytes(model, hf_quantizer) -> int | None:
    """What ``caching_allocator_warmup`` would pre-allocate on a single accelerator, or None."""
    try:
        import torch
        from transformers.modeling_utils import get_total_byte_count

        names = list(model.state_dict().keys())
        dev = torch.device("cuda", 0)
        counts = get_total_byte_count(model, dict.fromkeys(names, dev), hf_quantizer)
        return int(sum(counts.values()))
    except Exception:  # private API of transformers; its absence only loses this one figure
        return None


# ------------------------------------------------------------------------------ checkpoint / formula

# Tensors a pre-quantized checkpoint keeps beside its packed weights: quantization state, not parameters
QUANT_STATE_SUFFIXES = ("scales", "qzeros", "g_idx", "scale_inv", "weight_scale", "input_scale", "SCB", "absmax",
                        "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4",
                        "quant_state.bitsandbytes__fp4")
PACKED_INT_DTYPES = ("int32",)


def checkpoint_inventory(source: ModelSource, quant: QuantSpec) -> Inventory:
    """Count the tensors of a pre-quantized checkpoint as stored (safetensors headers only). Parameters
    are the unquantized model's: a packed int32 ``qweight`` holds ``32 / bits`` of them per element, and
    scales, zeros and indices hold none."""
    tensors = source_tensors(source)
    sizes: Counter[int] = Counter()
    groups = dict.fromkeys(GROUPS, 0)
    params = quantized = 0
    per_int = 32 // (quant.bits or 4)
    for name, (dt, shape) in tensors.items():
        b = tensor_bytes(dt, shape)
        n = b // DTYPE_BYTES.get(dt, 2)
        sizes[b] += 1
        if name.endswith(QUANT_STATE_SUFFIXES):
            groups["quant_state"] += b
            continue
        if name.endswith("qweight") or (dt in ("uint8", "int8", "float8_e4m3fn", "float8_e5m2")
                                        and name.endswith("weight")):
            count = n * per_int if dt in PACKED_INT_DTYPES else n
            groups["quantized"] += b
            params += count
            quantized += count
            continue
        if "embed" in name:
            groups["embeddings"] += b
        elif "lm_head" in name:
            groups["lm_head"] += b
        elif "norm" in name:
            groups["norms"] += b
        else:
            groups["dense"] += b
        params += n
    tc = text_config(source.config)
    return Inventory(
        model_type=tc.get("model_type", "?"), architecture=(tc.get("architectures") or ["?"])[0],
        quant_key=quant.key(), dtype=quant.dtype, params=params, quantized_params=quantized,
        tensor_bytes=sum(k * v for k, v in sizes.items()), alloc_sizes=dict(sizes), groups=groups,
        largest_source_bytes=max(sizes, default=0), warmup_bytes=None, method="checkpoint",
        approximate=True, notes=[f"{quant.implementation}: counted from the checkpoint's safetensors headers as stored; "
                                 "kernels that repack at load (exllama, marlin) can differ"],
        software=software_versions(), config=_plain_config(source.config))


def formula_inventory(source: ModelSource, quant: QuantSpec, why: str = "transformers cannot build it") -> Inventory:
    """A Llama-shaped count from config fields, for architectures transformers cannot build here
    (``why``: what stopped it, said when the config lacks the fields the formula needs)."""
    tc = text_config(source.config)
    missing = missing_fields(source.config)
    if missing:
        raise UserError(f"{source.name}: {why}, so nothing fills the fields the config leaves out, and it does "
                        f"not give {', '.join(missing)}: give them, or use a transformers that builds this model")
    h = int(size_field(tc, "hidden_size"))
    layers = int(size_field(tc, "num_hidden_layers"))
    heads = int(size_field(tc, "num_attention_heads"))
    vocab = int(size_field(tc, "vocab_size"))
    kv = int(tc.get("num_key_value_heads") or heads)
    hd = int(tc.get("head_dim") or h // heads)
    inter = int(tc.get("intermediate_size") or 4 * h)
    experts = int(tc.get("num_local_experts") or tc.get("num_experts") or tc.get("n_routed_experts") or 1)
    moe_inter = int(tc.get("moe_intermediate_size") or inter)
    el = DTYPE_BYTES[quant.dtype]
    linears = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd)]
    mlp = [(inter, h), (inter, h), (h, inter)] if experts == 1 else []
    expert_params = 3 * h * moe_inter * experts if experts > 1 else 0
    sizes: Counter[int] = Counter()
    groups = dict.fromkeys(GROUPS, 0)
    qparams = 0
    for out_f, in_f in linears + mlp:
        n = out_f * in_f
        parts = _layout(quant, out_f, in_f, el)
        qparams += n if quant.method != "none" else 0
        for suffix, b in parts:
            sizes[b] += layers
            key = "dense" if quant.method == "none" else ("quantized" if suffix in ("weight", "qweight") else "quant_state")
            groups[key] += b * layers
    if expert_params:
        sizes[expert_params * el // 3] += 3 * layers
        groups["experts"] += expert_params * el * layers
    emb = vocab * h * el
    sizes[emb] += 1
    groups["embeddings"] += emb
    if not tc.get("tie_word_embeddings", False):
        sizes[emb] += 1
        groups["lm_head"] += emb
    sizes[h * el] += 2 * layers + 1
    groups["norms"] += h * el * (2 * layers + 1)
    params = layers * (sum(o * i for o, i in linears + mlp) + expert_params + 2 * h) + vocab * h * (
        1 if tc.get("tie_word_embeddings", False) else 2) + h
    return Inventory(
        model_type=tc.get("model_type", "?"), architecture=(tc.get("architectures") or ["?"])[0], quant_key=quant.key(),
        dtype=quant.dtype, params=params, quantized_params=qparams * layers,
        tensor_bytes=sum(k * v for k, v in sizes.items()), alloc_sizes=dict(sizes), groups=groups,
        largest_source_bytes=max(inter * h * el, emb),
        warmup_bytes=None, method="formula", approximate=True,
        notes=["weights from a Llama-shaped formula over the config's fields"], software=software_versions(),
        quantized_shapes=[[o, i, layers] for o, i in linears + mlp] if quant.method != "none" else [],
        config=_plain_config(source.config))


def _layout(quant: QuantSpec, out_f: int, in_f: int, el: int) -> list[tuple[str, int]]:
    if quant.method == "bnb4":
        return bnb4_tensors(out_f * in_f, quant.double_quant)
    if quant.method == "bnb8":
        return bnb8_tensors(out_f, in_f)
    if quant.method in ("gptq", "awq"):
        return packed_int_tensors(quant.method, out_f, in_f, quant.bits or 4, quant.group_size or 128)
    if quant.method == "fp8":
        block = (quant.extra.get("weight_block_size") or [128, 128])
        return [("weight", out_f * in_f), ("weight_scale_inv", ceil_div(out_f, block[0]) * ceil_div(in_f, block[1]) * 4)]
    return [("weight", out_f * in_f * el)]
