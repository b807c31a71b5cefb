"""Ollama's spellings: a model run by Ollama, given as Ollama's options and environment, turned into the
``llama-server`` flags Ollama itself launches it with -- the one place vramcal maps them.

Since its llama-server runner, Ollama starts llama.cpp's own ``llama-server`` with flags built from its
options (ollama/ollama ``llm/llama_server.go`` ``startLlamaServer``, read at ``OLLAMA_VERSION``):

- ``-c num_ctx x parallel`` and ``-np parallel``; ``num_ctx`` first clamped to the model's
  ``context_length`` (``llm/server.go`` ``NewLlamaServer``); ``parallel`` is ``OLLAMA_NUM_PARALLEL``
  (default 1), forced to 1 for an embedding model and for the architectures ``server/sched.go`` lists;
- ``num_ctx`` defaults to ``OLLAMA_CONTEXT_LENGTH``, else to a tier of the GPUs' total memory: 4096 below
  23 GiB, 32768 from 23 GiB, 262144 from 47 GiB (``server/routes.go``);
- ``num_batch`` (default 512, ``api/types.go`` ``DefaultOptions``) as ``-b`` and ``-ub`` alike; an
  embedding model gets ``--embedding`` and ``min(num_batch, num_ctx x parallel)``;
- ``num_gpu`` (default -1: no ``-ngl``, llama-server's own auto) as ``-ngl``; ``main_gpu`` as ``-sm none
  -mg``; ``use_mmap false`` as ``--load-mode none``;
- ``OLLAMA_KV_CACHE_TYPE`` (lower-cased) as both ``-ctk`` and ``-ctv``; ``OLLAMA_FLASH_ATTENTION`` set as
  ``-fa on`` / ``off`` (a value that does not parse as a boolean counts as on, ``envconfig``
  ``BoolWithDefault``), unset as ``-fa auto`` where the GPUs support it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError

OLLAMA_VERSION = "v0.33.0-rc2"  # ollama/ollama at fb30760 (2026-08-21): the source these rules are read from
OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap")  # api.Options' runner fields priced here
ENV = ("OLLAMA_NUM_PARALLEL", "OLLAMA_CONTEXT_LENGTH", "OLLAMA_FLASH_ATTENTION", "OLLAMA_KV_CACHE_TYPE")
DEFAULT_NUM_BATCH = 512
VRAM_TIERS = ((47, 262144), (23, 32768), (0, 4096))  # (total GPU GiB at least, default num_ctx)
SERIAL_ARCHS = ("mllama", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen3next", "lfm2", "lfm2moe",
                "nemotron_h", "nemotron_h_moe", "nemotron_h_omni")  # server/sched.go: parallel forced to 1
# the llama.cpp flags Ollama sets itself: given beside --ollama they would contradict it
SET_BY_OLLAMA = ("ctx_size", "parallel", "n_gpu_layers", "batch_size", "ubatch_size", "flash_attn", "cache_type_k",
                 "cache_type_v", "load_mode", "no_mmap", "split_mode", "main_gpu", "embedding")


@dataclass(frozen=True)
class OllamaRun:
    """The llama-server flags Ollama would pass, and what was assumed on the way."""

    argv: tuple[str, ...]
    notes: tuple[str, ...]


def parse_settings(values) -> dict[str, str]:
    """``--ollama KEY=VALUE[,KEY=VALUE]`` (repeatable) as a dict; one line for an unknown key."""
    out: dict[str, str] = {}
    for value in values or ():
        for item in value.split(","):
            if not item.strip():
                continue
            key, sep, val = item.strip().partition("=")
            if key == "num_parallel":
                raise UserError("Ollama sets its parallel requests by the environment: write OLLAMA_NUM_PARALLEL=N "
                                "(num_parallel is not one of its options)")
            if not sep or key not in OPTIONS + ENV:
                raise UserError(f"--ollama {item!r}: write KEY=VALUE with KEY one of {', '.join(OPTIONS + ENV)}")
            out[key] = val.strip()
    return out


def _int(settings: dict, key: str, default: int, low: int) -> int:
    if key not in settings:
        return default
    try:
        n = int(settings[key])
    except ValueError:
        raise UserError(f"--ollama {key}={settings[key]!r}: a whole number") from None
    if n < low:
        raise UserError(f"--ollama {key}={n}: {low} or more")
    return n


def _bool(text: str) -> bool:
    """Go's ``strconv.ParseBool``; envconfig counts a value it cannot parse as true."""
    return text not in ("0", "f", "F", "false", "FALSE", "False")


def llama_server_flags(settings: dict[str, str], *, n_ctx_train: int | None = None, arch: str | None = None,
                       embedding: bool = False, gpu_total_bytes: int | None = None) -> OllamaRun:
    """The llama-server flags Ollama (``OLLAMA_VERSION``) launches a model with for these settings.
    ``n_ctx_train``, ``arch`` and ``embedding`` come from the GGUF header (None: not known, not applied);
    ``gpu_total_bytes`` picks the default ``num_ctx`` tier when neither num_ctx nor OLLAMA_CONTEXT_LENGTH
    is given (None: the lowest tier, said in a note)."""
    from ...units import GIB

    notes = [f"Ollama's spellings mapped to llama-server's flags as Ollama {OLLAMA_VERSION} launches it "
             "(llm/llama_server.go startLlamaServer)"]
    parallel = max(_int(settings, "OLLAMA_NUM_PARALLEL", 1, 0), 1)
    if embedding and parallel != 1:
        parallel = 1
        notes.append("an embedding model: Ollama loads it with one sequence (server/sched.go)")
    if arch in SERIAL_ARCHS and parallel != 1:
        parallel = 1
        notes.append(f"{arch}: Ollama loads it with one sequence (server/sched.go)")
    if "num_ctx" in settings:
        num_ctx = _int(settings, "num_ctx", 0, 1)
    elif _int(settings, "OLLAMA_CONTEXT_LENGTH", 0, 0):
        num_ctx = _int(settings, "OLLAMA_CONTEXT_LENGTH", 0, 0)
    else:
        total = gpu_total_bytes or 0
        num_ctx = next(ctx for gib, ctx in VRAM_TIERS if total >= gib * GIB)
        seen = f"GPUs of {total / GIB:.0f} GiB in all" if total else "no GPU memory known"
        notes.append(f"num_ctx {num_ctx}: Ollama's default for {seen} "
                     "(4096 below 23 GiB, 32768 from 23, 262144 from 47; server/routes.go); give num_ctx to price "
                     "another")
    if n_ctx_train and num_ctx > n_ctx_train:
        notes.append(f"num_ctx {num_ctx} is beyond the model's context_length: Ollama lowers it to {n_ctx_train}")
        num_ctx = n_ctx_train
    argv = ["-c", str(num_ctx * parallel), "-np", str(parallel)]
    if settings.get("use_mmap") is not None and not _bool(settings["use_mmap"]):
        argv += ["--load-mode", "none"]
    kv = settings.get("OLLAMA_KV_CACHE_TYPE", "").lower()
    if kv:
        argv += ["--cache-type-k", kv, "--cache-type-v", kv]
    fa = settings.get("OLLAMA_FLASH_ATTENTION", "")
    argv += ["--flash-attn", "auto" if fa == "" else "on" if _bool(fa) else "off"]
    if fa == "":
        notes.append("OLLAMA_FLASH_ATTENTION unset: -fa auto (Ollama passes off instead on GPUs it finds without "
                     "flash attention, ml.FlashAttentionSupported)")
    batch = _int(settings, "num_batch", DEFAULT_NUM_BATCH, 0)
    if embedding:
        batch = min(batch, num_ctx * parallel)
        argv.append("--embedding")
        notes.append("an embedding model: Ollama adds --embedding (each output's embedding in the output buffer)")
    elif "num_batch" not in settings:
        notes.append("num_batch 512 (Ollama's default); Ollama v0.33 may raise it to 1024 / 2048 for contexts over "
                     "4096 / 32768 when the GPU has room (server/sched.go), not modelled: give num_batch to price it")
    if batch > 0:
        argv += ["-b", str(batch), "-ub", str(batch)]
    ngl = _int(settings, "num_gpu", -1, -1)
    if ngl >= 0:
        argv += ["-ngl", str(ngl)]
    if "main_gpu" in settings:
        argv += ["--split-mode", "none", "--main-gpu", str(_int(settings, "main_gpu", 0, 0))]
    return OllamaRun(tuple(argv), tuple(notes))
