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
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..estimator.llamacpp.logparse import LlamaLogged, parse_log
from .lifecycle import kill_group
from .sampler import Sampler, attribute, nvml_reader, rss_reader

TERMS = ("model_buffer_bytes", "kv_buffer_bytes", "compute_buffer_bytes", "output_buffer_bytes", "n_ctx")


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
            "offload_kqv": a["offload_kqv"]}


def run_llamacpp_probe(path: str, name: str, spec: dict, estimate, *, gpus: list[int], interval_ms: float = 5.0,
                       new_tokens: int = 16, timeout_s: float | None = 1800) -> LlamaProbeResult:
    """Run llama.cpp on ``path`` with ``spec`` (:func:`child_spec`), sample, parse its log."""
    from .lifecycle import sigterm_raises

    read_fd, write_fd = os.pipe()
    log = tempfile.TemporaryFile(mode="w+")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = {**spec, "parent_pid": os.getpid(), "new_tokens": new_tokens}
    start = time.monotonic()
    markers: list[tuple[str, float]] = []
    final: dict | None = None
    sampler = None
    series = f"gpu{gpus[0]}" if gpus else "rss"
    with sigterm_raises():
        try:
            child = subprocess.Popen([sys.executable, "-m", "vramcal.probes.llamacpp_child", json.dumps(full),
                                      str(write_fd)], pass_fds=(write_fd,), stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        finally:
            os.close(write_fd)
        try:
            reader = nvml_reader(gpus, child.pid) if gpus else rss_reader(child.pid)
            sampler = Sampler(reader, interval_ms / 1000.0).start()
            buf = b""
            while True:
                if timeout_s and time.monotonic() - start > timeout_s:
                    final = {"event": "timeout", "error": f"no end within {timeout_s:g} s"}
                    break
                ready, _, _ = select.select([read_fd], [], [], 0.25)
                if not ready:
                    continue
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    try:
                        ev = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if ev.get("event") == "stage":
                        sampler.sample_now()
                        markers.append((ev["name"], ev["t"]))
                    elif ev.get("event") in ("done", "oom", "error"):
                        final = ev
        finally:
            os.close(read_fd)
            kill_group(child)
            if sampler is not None:
                sampler.stop()
    log.seek(0)
    text = log.read()
    log.close()
    logged = parse_log(text)
    samples = sampler.samples if sampler else []
    stages = {k: {"used_bytes": v["used_bytes"], "peak_bytes": v["peak_bytes"]}
              for k, v in attribute(samples, markers, series).items()} if sampler else {}
    status = {"done": "ok", "oom": "oom", "error": "error", "timeout": "timeout"}.get((final or {}).get("event"),
                                                                                      "crashed")
    tail = [ln for ln in text.splitlines() if ln.strip()]
    return LlamaProbeResult(status=status, model=name, path=path, series=series, stages=stages, logged=logged,
                            estimate=estimate, error=(final or {}).get("error"),
                            last_stage=markers[-1][0] if markers else None, wall_s=time.monotonic() - start,
                            sampler_overhead=sampler.overhead if sampler else None,
                            log_tail=tail[-1][:300] if tail else "", samples=samples)
