"""The child process of a llama.cpp probe: load a GGUF with llama-cpp-python's bindings to llama.cpp's C
API, create a context as the flags ask, decode a prompt and generate ``new_tokens`` tokens greedily, and
stream stage markers to the parent over a pipe (one JSON object per line), as :mod:`.child` does for
transformers. llama.cpp's own log (every level) goes to this process's stderr, which the parent keeps in
a file and reads back with :func:`vramcal.estimator.llamacpp.logparse.parse_log`.

Run as ``python -m vramcal.probes.llamacpp_child SPEC_JSON FD``; it dies with its parent. Markers:
``baseline`` (llama.cpp imported), ``post_load`` (the model buffers), ``context`` (KV, output and
compute buffers), ``first_token``, ``end``.
"""

from __future__ import annotations

import ctypes
import json
import sys

from .child import Emitter, die_with_parent
from .engine_run import report_failure

SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
FLASH = {"off": 0, "on": 1, "auto": -1}  # LLAMA_FLASH_ATTN_TYPE_DISABLED / ENABLED / AUTO


def ggml_type(name: str) -> int:
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[name.upper()])


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    emit = Emitter(int(argv[1]))
    die_with_parent(int(spec["parent_pid"]), None)
    try:
        import llama_cpp
        from llama_cpp import _logger

        _logger.set_verbose(True)  # every llama.cpp log line to stderr, where the parent reads them
        llama_cpp.llama_backend_init()
        emit("stage", name="baseline", llama_cpp=getattr(llama_cpp, "__version__", None))
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = int(spec["n_gpu_layers"])
        mp.split_mode = SPLIT_MODES[spec["split_mode"]]
        mp.main_gpu = int(spec["main_gpu"])
        mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_AUTO if spec["use_mmap"] else llama_cpp.LLAMA_LOAD_MODE_NONE
        if spec.get("tensor_split"):
            shares = (ctypes.c_float * len(spec["tensor_split"]))(*spec["tensor_split"])
            mp.tensor_split = ctypes.cast(shares, ctypes.POINTER(ctypes.c_float))
        model = llama_cpp.llama_model_load_from_file(spec["path"].encode(), mp)
        if not model:
            emit("error", error="llama.cpp could not load the model (its log says why)")
            return 1
        emit("stage", name="post_load")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = int(spec["ctx_size"])
        cp.n_batch = int(spec["n_batch"])
        cp.n_ubatch = int(spec["n_ubatch"])
        cp.n_seq_max = int(spec["n_parallel"])
        cp.kv_unified = bool(spec["kv_unified"])
        cp.flash_attn_type = FLASH[spec["flash_attn"]]
        cp.type_k = ggml_type(spec["cache_type_k"])
        cp.type_v = ggml_type(spec["cache_type_v"])
        cp.swa_full = bool(spec["swa_full"])
        cp.offload_kqv = bool(spec["offload_kqv"])
        cp.embeddings = bool(spec.get("embeddings", False))
        cp.n_threads = cp.n_threads_batch = int(spec.get("threads", 2))
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            emit("error", error="llama.cpp could not create the context (its log says why)")
            return 1
        emit("stage", name="context")
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        prompt = [min(n_vocab - 1, 300 + i) for i in range(int(spec.get("prompt_tokens", 16)))]
        tokens = (llama_cpp.llama_token * len(prompt))(*prompt)
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(prompt))) != 0:
            emit("error", error="llama_decode failed on the prompt")
            return 1
        for i in range(int(spec.get("new_tokens", 16))):
            logits = llama_cpp.llama_get_logits_ith(ctx, -1)
            best = max(range(n_vocab), key=lambda j: logits[j])
            if i == 0:
                emit("stage", name="first_token")
            one = (llama_cpp.llama_token * 1)(best)
            if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(one, 1)) != 0:
                emit("error", error=f"llama_decode failed at generated token {i + 1}")
                return 1
        emit("stage", name="end")
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
        emit("done")
        return 0
    except Exception as exc:  # noqa: BLE001 -- the parent records how the run ended
        return report_failure(emit, exc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
