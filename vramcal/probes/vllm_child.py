"""The child process of a vLLM probe: start vLLM's engine as ``vllm serve`` would size it, generate, and
stream stage markers to the parent over a pipe (one JSON object per line), as :mod:`.child` does for
transformers. vLLM's own log goes to this process's stdout/stderr, which the parent keeps in a file and
reads back with :func:`vramcal.estimator.vllm.logparse.parse_log`.

Run as ``python -m vramcal.probes.vllm_child SPEC_JSON FD``. The parent starts it in a session of its
own with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in this process, so it ends with it) and
``VLLM_LOGGING_LEVEL=DEBUG`` (the profile line with the torch peak and the non-torch memory); it dies
with the parent (:func:`vramcal.probes.child.die_with_parent`). Markers: ``baseline`` (vLLM imported,
no engine yet), ``post_load`` (the engine is up: weights, KV cache, CUDA graphs), ``first_token`` (one
token generated), ``end`` (``new_tokens`` generated).
"""

from __future__ import annotations

import json
import sys

from .child import Emitter, die_with_parent
from .engine_run import report_failure


def engine_kwargs(spec: dict) -> dict:
    """``vllm.LLM`` keyword arguments for the probe's flags (their ``vllm serve`` names, underscored)."""
    keys = ("gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
            "tensor_parallel_size", "pipeline_parallel_size", "dtype", "kv_cache_dtype", "quantization", "block_size",
            "enforce_eager", "kv_cache_memory_bytes", "load_format", "skip_tokenizer_init", "mamba_cache_dtype",
            "mamba_ssm_cache_dtype", "enable_prefix_caching", "disable_custom_all_reduce")
    return {k: spec[k] for k in keys if spec.get(k) is not None}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    emit = Emitter(int(argv[1]))
    die_with_parent(int(spec["parent_pid"]), None)
    try:
        import vllm
        from vllm import LLM, SamplingParams

        emit("stage", name="baseline", vllm=vllm.__version__)
        llm = LLM(model=spec["model_dir"], **engine_kwargs(spec))
        emit("stage", name="post_load")
        prompt = {"prompt_token_ids": [1] * int(spec.get("prompt_tokens", 16))}
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        emit("stage", name="first_token")
        llm.generate([prompt], SamplingParams(max_tokens=int(spec.get("new_tokens", 16)), ignore_eos=True),
                     use_tqdm=False)
        emit("stage", name="end")
        emit("done")
        return 0
    except Exception as exc:  # noqa: BLE001 -- the parent records how the run ended
        return report_failure(emit, exc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
