"""The multimodal projector (``--mmproj FILE``): what libmtmd allocates loading it beside the model, from the
projector GGUF's header (llama.cpp's tools/mtmd/clip.cpp, the tree llama-cpp-python 0.3.36 vendors).

- **Contexts** (``clip_init``): one ``clip_ctx`` per modality the file has (``clip.has_vision_encoder``,
  ``clip.has_audio_encoder``); a Gemma 3n vision projector skips the audio one (its audio is not supported
  yet). Each context loads the tensors its projector asks for (``load_tensors`` ``get_tensor``): the audio
  encoder's are named ``a.*`` / ``mm.a.*``, the vision encoder's are the rest; the clamp scalars of a
  clippable linear (``*.input_max`` ...) are read into host memory (``get_scalar``), not the buffer.
- **Model buffer** (``load_tensors``): one buffer per context of the backend's default buffer type -- the
  first GPU (``CUDA0``) unless ``--no-mmproj-offload`` (or a CPU-only build), then the CPU -- sized by
  ggml-alloc.c ``ggml_backend_alloc_ctx_tensors_from_buft``: each tensor's allocation size (CUDA adds a
  quantized tensor one row's padding to 512 values) rounded up to the buffer type's alignment (CUDA 128,
  CPU 32), summed.
  llama.cpp does not log this buffer; it logs ``load_hparams: model size: X MiB``, the file's tensors as
  stored (``ggml_nbytes``, summed), which ``model_size_bytes`` is.
- **Compute buffer** (``warmup`` -> ``reserve_compute_meta``): the scheduler's reservation of the encoder's
  graph for a warm-up image of ``warmup_image_size`` (per projector type in ``load_hparams``), logged as
  ``reserve_compute_meta: CPU compute buffer size = X MiB`` (and ``CUDA0`` with a GPU). Flash attention
  follows ``-fa`` (llama-server passes its ``flash_attn_type``; auto tries it first). The graph is written
  down node by node for the ``gemma3`` projector (a SigLIP ViT, :func:`_warmup_graph`) and run through the
  text model's replay of ggml's allocator (:mod:`.compute`); for the other projector types (some forty
  heads, conformer and whisper audio encoders) it is ``None`` with the reason, and fit and plan leave it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ...errors import UserError
from .gguf_file import GgufModel, GgufTensor

CLIP_ARCH = "clip"  # general.architecture of every projector file the converter writes (convert_hf_to_gguf.py)
AUDIO_PREFIXES = ("a.", "mm.a.")  # clip-impl.h TN_CONV1D, TN_MM_AUDIO_* ...: the audio encoder's tensors
HOST_SCALARS = (".input_max", ".input_min", ".output_max", ".output_min")  # clip.cpp get_scalar: clamp values


@dataclass(frozen=True)
class MmprojArgs:
    """``--mmproj FILE`` and ``--no-mmproj-offload`` (common/arg.cpp; llama-server passes them to
    ``mtmd_init_from_file`` as ``use_gpu``)."""

    path: str
    offload: bool = True


@dataclass
class MmprojEstimate:
    path: str
    name: str
    modalities: list[dict]  # per clip_ctx: modality, projector type, tensors, buffer, bytes
    model_size_bytes: int  # "load_hparams: model size": every tensor of the file as stored
    model_buffer_bytes: dict[str, int]  # buffer type name (CUDA0, CPU) -> bytes, every context's buffer summed
    compute_buffer_bytes: dict[str, int] | None  # None: not derived (compute_why_none says why)
    compute_why_none: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"path": self.path, "name": self.name, "modalities": list(self.modalities),
                "model_size_bytes": self.model_size_bytes, "model_buffer_bytes": dict(self.model_buffer_bytes),
                "compute_buffer_bytes": None if self.compute_buffer_bytes is None else dict(self.compute_buffer_bytes),
                "compute_why_none": self.compute_why_none, "notes": list(self.notes)}

    def log_lines(self) -> list[str]:
        """The projector's lines as libmtmd prints them, and (marked) the model buffer it does not print."""
        from ...units import MIB

        lines = [f"load_hparams: model size:         {self.model_size_bytes / MIB:.2f} MiB"]
        lines += [f"(not logged) clip {name} model buffer size = {b / MIB:8.2f} MiB"
                  for name, b in self.model_buffer_bytes.items()]
        if self.compute_buffer_bytes is None:
            lines.append("reserve_compute_meta: compute buffer size not priced (see the notes)")
        else:
            lines += [f"reserve_compute_meta: {name:>10} compute buffer size = {b / MIB:8.2f} MiB"
                      for name, b in self.compute_buffer_bytes.items()]
        return lines


def read_mmproj(path: str) -> GgufModel:
    """The projector file's header; one line when it is not a GGUF, or a GGUF but not a projector."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "is not a file" if p.exists() else "no such file"
        raise UserError(f"--mmproj {path}: {what}; give the projector GGUF (mmproj-*.gguf)")
    st = p.stat()
    return _read_once(str(p.resolve()), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=4)
def _read_once(path: str, mtime_ns: int, size: int) -> GgufModel:
    from .gguf_file import read_gguf

    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise UserError(f"--mmproj {path} is not a GGUF file (it starts with {magic!r}): give the projector GGUF "
                        "(mmproj-*.gguf) that goes with the model")
    m = read_gguf(path)
    if m.arch != CLIP_ARCH:
        raise UserError(f"--mmproj {path} is a GGUF of architecture {m.arch!r}, not a multimodal projector "
                        f"({CLIP_ARCH!r}): give the mmproj-*.gguf file, and the model itself as MODEL")
    return m


def _modalities(m: GgufModel) -> list[tuple[str, str, list[GgufTensor]]]:
    """(modality, projector type, tensors loaded) per clip_ctx, in clip_init's order."""
    meta = m.metadata
    vision, audio = bool(meta.get("clip.has_vision_encoder")), bool(meta.get("clip.has_audio_encoder"))
    if meta.get("clip.has_gen_audio_encoder"):
        raise UserError(f"--mmproj {m.path}: an audio-generation projector (clip.has_gen_audio_encoder) is not "
                        "modelled by vramcal yet")
    if not vision and not audio:
        raise UserError(f"--mmproj {m.path}: the file has neither a vision nor an audio encoder "
                        "(clip.has_vision_encoder / clip.has_audio_encoder): libmtmd refuses it")
    common = meta.get("clip.projector_type")
    out = []
    loaded = [t for t in m.tensors if not t.name.endswith(HOST_SCALARS)]
    if vision:
        proj = str(common or meta.get("clip.vision.projector_type") or "?")
        out.append(("vision", proj, [t for t in loaded if not t.name.startswith(AUDIO_PREFIXES)]))
    if audio and not (vision and out[0][1] == "gemma3nv"):
        proj = str(common or meta.get("clip.audio.projector_type") or "?")
        out.append(("audio", proj, [t for t in loaded if t.name.startswith(AUDIO_PREFIXES)]))
    return out


REPLAYED = ("gemma3",)  # projector types whose warm-up graph is written down below


def _warmup_graph(m: GgufModel, flash_attn: bool):
    """The vision encoder's warm-up graph as clip.cpp builds it for a ``gemma3`` projector (models/siglip.cpp
    ``clip_graph_siglip::build``; clip.cpp ``build_inp``, ``build_vit``, ``build_norm``, ``build_ffn``,
    ``build_attn``) on a ``warmup_image_size`` square image (``image_size`` for gemma3), node by node in
    the order ggml's graph walk leaves them (``build_attn`` fixes each layer's Q, K, V chains first with
    ``ggml_build_forward_order``; the final expand then meets the projection's ``cont(transpose(W))`` before
    the last layer's attention). Weights live in the model buffer and are not graph allocations."""
    from .ggml_graph import F16, F32, Graph

    meta, names = m.metadata, {t.name: t for t in m.tensors}
    D = int(meta["clip.vision.embedding_length"])
    F = int(meta["clip.vision.feed_forward_length"])
    n_layer = int(meta["clip.vision.block_count"])
    size, patch = int(meta["clip.vision.image_size"]), int(meta["clip.vision.patch_size"])
    merge = int(meta.get("clip.vision.projector.scale_factor") or 4)  # load_hparams: n_merge 4 unless given
    side = size // patch
    P = side * side

    def has(name: str) -> bool:
        return name in names

    g = Graph()
    raw = g.input(size * size * 3 * F32)  # build_inp_raw: [nx, ny, 3, 1] f32
    # build_inp: ggml_conv_2d = im2col (f16 for a non-bf16 kernel) -> mul_mat -> cont(permute); then
    # cont(transpose) to [n_embd, n_patches]
    im2col = g.op("im2col", 3 * patch * patch * P * F16, raw)
    x = g.op("mul_mat", P * D * F32, g.view(im2col))
    x = g.op("cont", P * D * F32, g.view(g.view(x)))
    x = g.op("cont", P * D * F32, g.view(g.view(x)))
    if has("v.patch_embd.bias"):
        x = g.op("add", x.nbytes, x)
    if has("v.position_embd.weight"):
        x = g.op("add", x.nbytes, x)
    x = g.view(x)  # reshape_2d

    def norm(cur, prefix: str):  # build_norm, NORM_TYPE_NORMAL: ggml_norm (not in place), * w, + b
        cur = g.op("norm", cur.nbytes, cur)
        if has(prefix + ".weight"):
            cur = g.op("mul", cur.nbytes, cur)
        if has(prefix + ".bias"):
            cur = g.op("add", cur.nbytes, cur)
        return cur

    def linear(cur, prefix: str, n_out: int):
        out = g.op("mul_mat", n_out * P * F32, cur)
        return g.op("add", out.nbytes, out) if has(prefix + ".bias") else out

    if has("v.pre_ln.weight"):
        x = norm(x, "v.pre_ln")
    tail_w = names.get("mm.input_projection.weight")
    proj_w = None
    for il in range(n_layer):
        b = f"v.blk.{il}."
        inp = x
        cur = norm(x, b + "ln1")
        q = g.view(linear(cur, b + "attn_q", D))
        k = g.view(linear(cur, b + "attn_k", D))
        v = g.view(linear(cur, b + "attn_v", D))
        if il == n_layer - 1 and tail_w is not None:
            proj_w = g.op("cont", tail_w.nbytes)  # cont(transpose(W)): a copy of the weight
        if flash_attn:  # k, v cast to f16; the output [d_head, n_head, n_pos] f32
            qp = g.view(q)
            kc = g.op("cpy", P * D * F16, g.view(k))
            vc = g.op("cpy", P * D * F16, g.view(v))
            att = g.view(g.op("flash_attn_ext", P * D * F32, qp, kc, vc))
        else:
            vc = g.op("cont", P * D * F32, g.view(v))
            n_head = int(meta["clip.vision.attention.head_count"])
            kq = g.op("mul_mat", P * P * n_head * F32, g.view(k), g.view(q))
            kq = g.op("soft_max", kq.nbytes, kq)
            kqv = g.op("mul_mat", P * D * F32, vc, kq)
            att = g.op("cont", P * D * F32, g.view(kqv))
        cur = linear(att, b + "attn_out", D)
        cur = g.op("add", cur.nbytes, cur, inp)
        res = cur
        cur = norm(cur, b + "ln2")
        up = linear(cur, b + "ffn_up", F)
        if has(b + "ffn_gate.weight"):
            gate = linear(cur, b + "ffn_gate", F)
            act = g.op("glu", up.nbytes, gate, up)
        else:
            act = g.op("unary", up.nbytes, up)
        cur = linear(act, b + "ffn_down", D)
        x = g.op("add", cur.nbytes, res, cur)
    if has("v.post_ln.weight"):
        x = norm(x, "v.post_ln")
    x = g.view(x)  # reshape_3d
    # gemma3: cont_4d(transpose) -> pool_2d (avg, n_merge) -> cont(transpose) -> rms_norm * w -> W^T x
    x = g.op("cont", P * D * F32, g.view(x))
    T = (side // merge) ** 2
    x = g.op("pool_2d", T * D * F32, x)
    x = g.op("cont", T * D * F32, g.view(g.view(x)))
    x = g.op("rms_norm", x.nbytes, x)
    x = g.op("mul", x.nbytes, x)
    n_out = int(tail_w.shape[0]) if tail_w is not None else int(meta.get("clip.vision.projection_dim") or 0)
    out = g.op("mul_mat", n_out * T * F32, proj_w, x)
    out.is_output = True
    return g


def _compute(m: GgufModel, modality: str, proj: str, on_gpu: bool, gpu_backend: str, flash_attn: bool) \
        -> tuple[dict[str, int] | None, str | None]:
    """(buffer type -> compute bytes, None) where the warm-up graph is replayed, else (None, why)."""
    from .ggml_buffers import CPU_ALIGN, CUDA_ALIGN, pad
    from .ggml_graph import run_allocator

    if modality != "vision" or proj not in REPLAYED:
        return None, (f"the {modality} projector {proj!r}'s compute buffer (its warm-up graph, logged as "
                      "reserve_compute_meta: ... compute buffer size) is not replayed by vramcal (only "
                      f"{', '.join(REPLAYED)}): not priced")
    g = _warmup_graph(m, flash_attn)
    if not on_gpu:
        return {"CPU": run_allocator(g, CPU_ALIGN)}, None
    # ggml's scheduler keeps graph inputs (the image) on its last backend, the CPU, and copies them over
    size = int(m.metadata["clip.vision.image_size"])
    return {f"{gpu_backend}0": run_allocator(g, CUDA_ALIGN), "CPU": pad(size * size * 3 * 4, CPU_ALIGN)}, None


def estimate_mmproj(mm: MmprojArgs, n_gpus: int, gpu_backend: str = "CUDA", flash_attn: bool = True) \
        -> MmprojEstimate:
    """The projector's buffers for ``--mmproj`` beside a llama.cpp build with ``n_gpus`` GPUs."""
    from .ggml_buffers import CPU_ALIGN, cuda_alloc, pad

    m = read_mmproj(mm.path)
    on_gpu = mm.offload and n_gpus > 0
    buft = f"{gpu_backend}0" if on_gpu else "CPU"  # clip_ctx: ggml_backend_init_by_type(GPU) is the first GPU
    buffers: dict[str, int] = {}
    compute: dict[str, int] | None = {}
    modalities, whys = [], []
    for modality, proj, tensors in _modalities(m):
        size = sum(cuda_alloc(t) if on_gpu else pad(t.nbytes, CPU_ALIGN) for t in tensors)
        buffers[buft] = buffers.get(buft, 0) + size
        c, why = _compute(m, modality, proj, on_gpu, gpu_backend, flash_attn)
        if c is None:
            whys.append(why)
            compute = None
        elif compute is not None:
            for name, b in c.items():
                compute[name] = compute.get(name, 0) + b
        modalities.append({"modality": modality, "projector_type": proj, "tensors": len(tensors),
                           "buffer": buft, "model_buffer_bytes": size, "compute_buffer_bytes": c})
    notes = list(whys)
    if compute is not None and on_gpu:
        notes.append("the projector's GPU compute buffer is the CPU's replay at CUDA's 128-byte alignment, the "
                     "image input kept in the CPU's (checked against llama.cpp on the CPU only)")
    if not mm.offload and n_gpus > 0:
        notes.append("--no-mmproj-offload: the projector's weights and compute are in the CPU")
    return MmprojEstimate(path=str(Path(mm.path).expanduser()), name=m.name, modalities=modalities,
                          model_size_bytes=m.tensor_bytes, model_buffer_bytes=buffers, compute_buffer_bytes=compute,
                          compute_why_none="; ".join(whys) or None, notes=notes)
