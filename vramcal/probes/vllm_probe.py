"""A vLLM probe: start vLLM in a child process, sample NVML ``memory.used`` of its GPUs, read back the
startup terms vLLM logs, generate 16 tokens. The prediction (:mod:`vramcal.estimator.vllm`), the sampled
stages and the logged terms come out side by side in a :class:`VllmProbeResult`.

Without vLLM installed (an optional extra: ``pip install 'vramcal[vllm]'``) or without an NVIDIA GPU
(or fewer than tp x pp of them), :func:`preflight` says so in one line (exit 2) and nothing runs.

The child (:mod:`.vllm_child`) leads its own process group, dies with this process, and streams its
markers over a pipe; every way out kills its group. vLLM's workers for tp x pp > 1 are the child's
children, in its group.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields

from ..errors import UserError
from ..estimator.vllm.logparse import VllmLogged, parse_log
from . import nvml
from .engine_run import run_child
from .sampler import nvml_reader

STAGES = ("baseline", "post_load", "first_token", "end")


def preflight(gpus_needed: int) -> None:
    """One line, exit 2, when this machine cannot run vLLM: vLLM missing, no GPU, too few GPUs."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError("--engine vllm probes run vLLM itself, which is not installed here (an optional extra: "
                        "pip install 'vramcal[vllm]' on the GPU machine); `vramcal estimate --engine vllm` needs none")
    ok, why = nvml.available()
    if not ok:
        raise UserError(f"--engine vllm probes need an NVIDIA GPU: NVML sees none here ({why})")
    count = nvml.query("nvmlDeviceGetCount")
    if isinstance(count, nvml.NA) or count < gpus_needed:
        have = 0 if isinstance(count, nvml.NA) else count
        raise UserError(f"tensor x pipeline parallel size {gpus_needed} needs {gpus_needed} GPUs; NVML sees {have}")


@dataclass
class VllmProbeResult:
    status: str  # ok | oom | error | crashed | timeout | interrupted
    model: str
    version: str | None
    gpus: list[int]
    stages: dict[str, dict]  # per stage: used_bytes, peak_bytes (GPU 0 of the run, NVML memory.used)
    logged: VllmLogged
    estimate: object | None  # the Estimate it was compared with (engine vllm)
    error: str | None = None
    last_stage: str | None = None
    wall_s: float | None = None
    sampler_overhead: float | None = None
    log_tail: str = ""
    notes: list[str] = field(default_factory=list)
    samples: list = field(default_factory=list)
    interrupted: str | None = None  # SIGINT / SIGTERM: the parent was stopped; recorded, then exit 130 / 143

    def comparison(self) -> dict[str, tuple[int | None, int | None]]:
        """Predicted beside logged, term by term (bytes; tokens for kv_cache_tokens). The CUDA graphs: where the
        estimate comes off the KV budget (0.20 on) the prediction is vLLM's estimate, so it is held against the
        logged estimate (from 0.29 the capture that follows is smaller: 0.27 GiB against 0.51 on an L40S); else
        against the capture."""
        v = self.estimate.vllm if self.estimate is not None else None
        terms = ("weights_bytes", "activation_bytes", "non_torch_bytes", "kv_cache_bytes", "kv_cache_tokens",
                 "cuda_graph_bytes")

        def logged(t):
            if t == "cuda_graph_bytes" and v is not None and v.cuda_graph_subtracted \
                    and self.logged.cuda_graph_estimate_bytes is not None:
                return self.logged.cuda_graph_estimate_bytes
            return getattr(self.logged, t)

        return {t: (getattr(v, t) if v else None, logged(t)) for t in terms}

    def to_dict(self) -> dict:
        """The result without its samples (the records keep those as rows: :meth:`sample_rows`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("estimate", "logged", "samples")}
        d["vllm_logged"] = self.logged.to_dict()
        d["estimate"] = self.estimate.to_dict() if self.estimate is not None else None
        d["comparison"] = {k: list(v) for k, v in self.comparison().items()}
        return d

    def sample_rows(self) -> list[tuple[float, str, int | None]]:
        """The first GPU's series as the store records samples: (seconds since the first, series, bytes)."""
        series = f"gpu{self.gpus[0]}"
        t0 = self.samples[0].t if self.samples else 0.0
        return [(round(s.t - t0, 6), series, s.values.get(series)) for s in self.samples]


# a cold start by construction: vLLM's compile cache and Inductor's own (whose .kernel_perf files would skip the
# kernel benchmark although vLLM compiles) both off (vLLM's envs.py; torch's compiler/config.py)
COLD_COMPILE_ENV = {"VLLM_DISABLE_COMPILE_CACHE": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}


def run_vllm_probe(model_dir: str, name: str, child_args: dict, estimate, *, gpus: list[int],
                   interval_ms: float = 5.0, new_tokens: int = 16, timeout_s: float | None = 3600,
                   cold_compile: bool = False) -> VllmProbeResult:
    """Start vLLM on ``model_dir`` with ``child_args`` (:func:`.vllm_child.engine_kwargs`' names), sample,
    parse its log. ``cold_compile``: with torch.compile's caches off (``--compile-cache cold``); otherwise
    they are as this machine left them, and the log says which state the start found. Ctrl-C / SIGTERM kill
    the child's group and propagate (the caller records what ran)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_CONFIGURE_LOGGING": "1",
           **(COLD_COMPILE_ENV if cold_compile else {})}
    run = run_child("vramcal.probes.vllm_child", {**child_args, "model_dir": model_dir, "new_tokens": new_tokens},
                    lambda pid: nvml_reader(gpus, pid), env=env, interval_ms=interval_ms, timeout_s=timeout_s)
    logged = parse_log(run.log_text)
    return VllmProbeResult(status=run.status, model=name, version=logged.version, gpus=gpus,
                           stages=run.stages(f"gpu{gpus[0]}"), logged=logged, estimate=estimate,
                           error=run.error or logged.error, last_stage=run.last_stage, wall_s=run.wall_s,
                           sampler_overhead=run.sampler_overhead, log_tail=run.log_tail, samples=run.samples,
                           interrupted=run.interrupted)




def priced_as_started(result: VllmProbeResult, reprice) -> VllmProbeResult:
    """The result compared with the prediction for the compile cache's state its log shows: a start that
    loaded its compiled graphs (warm) against a cold price, or the reverse, would put the compile
    benchmark into the activation's difference and so into this machine's correction. ``reprice(state)``
    estimates the same run for that state. Unchanged where the log does not say or the state changes
    nothing (the estimate's ``compile_cache`` None)."""
    v = result.estimate.vllm if result.estimate is not None else None
    found = result.logged.compile_cache
    if v is None or v.compile_cache is None or found is None or found == v.compile_cache:
        return result
    result.estimate = reprice(found)
    result.notes.append(f"priced for a {v.compile_cache} compile cache, but vLLM's log shows a {found} start "
                        f"({'it compiled its graphs' if found == 'cold' else 'it loaded its compiled graphs'}): "
                        f"compared with the {found} price")
    return result
