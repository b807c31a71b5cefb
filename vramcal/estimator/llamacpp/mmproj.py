"""The multimodal projector (``--mmproj FILE``): what libmtmd allocates loading it beside the model, from the
projector GGUF's header (llama.cpp's tools/mtmd/clip.cpp, the tree llama-cpp-python 0.3.36 vendors).

- **Contexts** (``clip_init``): one ``clip_ctx`` per modality the file has (``clip.has_vision_encoder``,
  ``clip.has_audio_encoder``); a Gemma 3n vision projector skips the audio one (its audio is not supported
  yet). Each context loads the tensors its projector asks for (``load_tensors`` ``get_tensor``): the audio
  encoder's are named ``a.*`` / ``mm.a.*``, the vision encoder's are the rest; the clamp scalars of a
  clippable linear (``*.input_max`` ...) are read into host memory (``get_scalar``), not the buffer.
- **Model buffer** (``load_tensors``): one buffer per context of the backend's default buffer type -- the
  first GPU (``CUDA0``) unless ``--no-mmproj-offload`` (or a CPU-only build), then the CPU -- sized by
  ggml-alloc.c ``ggml_backend_alloc_ctx_tensors_from_buft``: each tensor's allocation size (CUDA pads a
  quantized row to 512 values) rounded up to the buffer type's alignment (CUDA 128, CPU 32), summed.
  llama.cpp does not log this buffer; it logs ``load_hparams: model size: X MiB``, the file's tensors as
  stored (``ggml_nbytes``, summed), which ``model_size_bytes`` is.
- **Compute buffer** (``warmup`` -> ``reserve_compute_meta``): the scheduler's reservation of the encoder's
  graph for a warm-up image of ``warmup_image_size`` (per projector type in ``load_hparams``), logged as
  ``reserve_compute_meta: CUDA0 compute buffer size = X MiB`` (and the CPU's). That graph -- a ViT, a conformer,
  a whisper encoder, and some forty projector heads -- is not replayed here: the estimate carries ``None``
  with the reason, and fit and plan leave it out, saying so.
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
COMPUTE_NOT_REPLAYED = ("the projector's compute buffer (its warm-up graph, logged as reserve_compute_meta: ... "
                        "compute buffer size) is not replayed by vramcal: not priced")


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
    compute_why_none: str | None = COMPUTE_NOT_REPLAYED
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
        raise UserError(f"--mmproj {path}: no such file; give the projector GGUF (mmproj-*.gguf)")
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


def estimate_mmproj(mm: MmprojArgs, n_gpus: int, gpu_backend: str = "CUDA") -> MmprojEstimate:
    """The projector's buffers for ``--mmproj`` beside a llama.cpp build with ``n_gpus`` GPUs."""
    from .buffers import CPU_ALIGN, _cuda_alloc, pad

    m = read_mmproj(mm.path)
    on_gpu = mm.offload and n_gpus > 0
    buft = f"{gpu_backend}0" if on_gpu else "CPU"  # clip_ctx: ggml_backend_init_by_type(GPU) is the first GPU
    buffers: dict[str, int] = {}
    modalities = []
    for modality, proj, tensors in _modalities(m):
        size = sum(_cuda_alloc(t) if on_gpu else pad(t.nbytes, CPU_ALIGN) for t in tensors)
        buffers[buft] = buffers.get(buft, 0) + size
        modalities.append({"modality": modality, "projector_type": proj, "tensors": len(tensors),
                           "buffer": buft, "model_buffer_bytes": size})
    notes = [COMPUTE_NOT_REPLAYED]
    if not mm.offload and n_gpus > 0:
        notes.append("--no-mmproj-offload: the projector's weights and compute are in the CPU")
    return MmprojEstimate(path=str(Path(mm.path).expanduser()), name=m.name, modalities=modalities,
                          model_size_bytes=m.tensor_bytes, model_buffer_bytes=buffers, compute_buffer_bytes=None,
                          notes=notes)
