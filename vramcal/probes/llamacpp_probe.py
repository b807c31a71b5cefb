"""A llama.cpp probe: run llama.cpp (llama-cpp-python, an optional extra) in a child process on a GGUF,
sample its memory -- the child's resident set on a CPU-only run, NVML ``memory.used`` of its GPUs
otherwise --, read back the buffer lines llama.cpp logs, generate 16 tokens. The prediction
(:mod:`vramcal.estimator.llamacpp`), the logged buffers and the sampled stages come out side by side in a
:class:`LlamaProbeResult`.

Without llama-cpp-python (``pip install 'vramcal[llamacpp]'``) :func:`preflight` says so in one line
(exit 2) and nothing runs. The child leads its own process group, dies with this process, and streams
its markers over a pipe; every way out kills its group.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..estimator.llamacpp.logparse import LlamaLogged, parse_log
from .engine_run import run_child
from .sampler import nvml_reader, rss_reader

TERMS = ("model_buffer_bytes", "kv_buffer_bytes", "rs_buffer_bytes", "compute_buffer_bytes", "output_buffer_bytes",
         "n_ctx")


def preflight(gpus: int) -> None:
    """One line, exit 2, when this machine cannot run llama.cpp: llama-cpp-python missing, no GPU for -ngl."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError("--engine llama.cpp probes run llama.cpp itself through llama-cpp-python, which is not "
                        "installed here (an optional extra: pip install 'vramcal[llamacpp]'); `vramcal estimate "
                        "--engine llama.cpp` needs none")
    if gpus:
        from . import nvml

        ok, why = nvml.available()
        if not ok:
            raise UserError(f"this llama.cpp probe would offload layers to a GPU but NVML sees none here ({why}): "
                            "add --device cpu for a CPU-only run")


@dataclass
class LlamaProbeResult:
    status: str  # ok | oom | error | crashed | timeout
    model: str
    path: str
    series: str  # rss (CPU) or gpuN
    stages: dict[str, dict]  # per stage: used_bytes, peak_bytes of the series
    logged: LlamaLogged
    estimate: object | None  # the LlamaEstimate it is compared with
    error: str | None = None
    last_stage: str | None = None
    wall_s: float | None = None
    sampler_overhead: float | None = None
    log_tail: str = ""
    notes: list[str] = field(default_factory=list)
    samples: list = field(default_factory=list)
    interrupted: str | None = None  # SIGINT / SIGTERM: the parent was stopped; recorded, then exit 130 / 143

    def comparison(self) -> dict[str, tuple]:
        """Predicted beside logged, term by term (bytes per buffer name; n_ctx in cells)."""
        e = self.estimate
        out = {}
        for t in TERMS:
            pred = getattr(e, t, None) if e is not None else None
            out[t] = (pred, getattr(self.logged, t))
        return out

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("estimate", "logged", "samples")}
        d["llama_cpp_logged"] = self.logged.to_dict()
        d["estimate"] = self.estimate.to_dict() if self.estimate is not None else None
        d["comparison"] = {k: list(v) for k, v in self.comparison().items()}
        return d

    def sample_rows(self) -> list[tuple[float, str, int | None]]:
        t0 = self.samples[0].t if self.samples else 0.0
        return [(round(s.t - t0, 6), self.series, s.values.get(self.series)) for s in self.samples]


def child_spec(path: str, args) -> dict:
    """The child's settings from :class:`~vramcal.estimator.llamacpp.buffers.LlamaArgs`."""
    a = asdict(args)
    ngl = a["n_gpu_layers"]
    return {"path": path, "n_gpu_layers": 999 if ngl < 0 else ngl, "split_mode": a["split_mode"],
            "main_gpu": a["main_gpu"], "use_mmap": a["use_mmap"], "tensor_split": a["tensor_split"],
            "ctx_size": a["ctx_size"], "n_batch": a["n_batch"], "n_ubatch": a["n_ubatch"],
            "n_parallel": a["n_parallel"], "kv_unified": a["kv_unified"], "flash_attn": a["flash_attn"],
            "cache_type_k": a["cache_type_k"], "cache_type_v": a["cache_type_v"], "swa_full": a["swa_full"],
            "offload_kqv": a["offload_kqv"], "embeddings": a["embeddings"]}


def run_llamacpp_probe(path: str, name: str, spec: dict, estimate, *, gpus: list[int], interval_ms: float = 5.0,
                       new_tokens: int = 16, timeout_s: float | None = 1800) -> LlamaProbeResult:
    """Run llama.cpp on ``path`` with ``spec`` (:func:`child_spec`), sample, parse its log."""
    series = f"gpu{gpus[0]}" if gpus else "rss"
    run = run_child("vramcal.probes.llamacpp_child", {**spec, "new_tokens": new_tokens},
                    (lambda pid: nvml_reader(gpus, pid)) if gpus else rss_reader, env={},
                    interval_ms=interval_ms, timeout_s=timeout_s)
    return LlamaProbeResult(status=run.status, model=name, path=path, series=series, stages=run.stages(series),
                            logged=parse_log(run.log_text), estimate=estimate, error=run.error,
                            last_stage=run.last_stage, wall_s=run.wall_s, sampler_overhead=run.sampler_overhead,
                            log_tail=run.log_tail, samples=run.samples,
                            interrupted=run.interrupted)
