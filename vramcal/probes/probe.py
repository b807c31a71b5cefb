"""A probe: load the real model in a child process, generate 16 tokens, measure every stage.

The parent owns the measurement: a sampler thread reads NVML ``memory.used`` (GPU) or the child's
resident set (CPU) every few milliseconds, and the child streams stage markers over a pipe as they
happen. If the child dies, what was sampled and the last stage reached are kept.

Stages, in order: ``baseline`` (imports done, device untouched), ``context`` (CUDA initialised; GPU
only), ``load_peak`` (``from_pretrained`` returned), ``post_load``, ``first_token`` (the first new
token exists), ``end`` (16 tokens). For each: ``used_bytes`` at the marker and ``peak_bytes`` over the
interval that ends there; on a GPU also torch's ``max_memory_allocated`` / ``max_memory_reserved``
over the interval (reset at every marker) and the child's own usage as NVML reports it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..estimator.quant import resolve_quant
from ..estimator.resolve import ModelSource, resolve_model
from . import nvml
from .sampler import Sampler, attribute, nvml_reader, rss_reader

STAGE_ORDER = ("baseline", "context", "load_peak", "post_load", "first_token", "end")


@dataclass
class ProbeResult:
    status: str  # ok | oom | error | crashed
    device: str
    model: str
    quant: str
    quant_implementation: str
    dtype: str
    ctx: int
    batch: int
    attn: str
    series: str | None  # the sampled series the stages are read from: rss, gpu0, ...
    stages: dict[str, dict]
    last_stage: str | None
    oom: dict | None
    error: str | None
    sample_count: int
    samples: list[dict]
    interval_ms: float
    sampler_overhead: float | None  # CPU time of the sampler thread / its wall time
    wall_s: float
    command: str
    estimate: dict | None = None
    notes: list[str] = field(default_factory=list)
    exit_code: int | None = None
    unfinished: dict | None = None  # a run that stopped: the stage it was in and what was sampled there
    # placement (--max-memory / --device-map): per device {stage: {used_bytes, peak_bytes, samples}},
    # GPUs from NVML, "cpu" from the child's resident set above its baseline; and the plan it loaded
    devices: dict[str, dict] | None = None
    placement: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def above_baseline(self, stage: str, key: str = "used_bytes") -> int | None:
        """A stage's reading minus the baseline: what loading and generating added (CPU comparisons)."""
        base = self.stages.get("baseline", {}).get("used_bytes")
        value = self.stages.get(stage, {}).get(key)
        return None if base is None or value is None else value - base


def _cuda_index(device: str) -> int:
    if device == "cuda":
        return 0
    try:
        return int(device.split(":", 1)[1])
    except (IndexError, ValueError):
        raise UserError(f"cannot read device {device!r}: use cpu, cuda or cuda:N") from None


def _check_device(device: str) -> tuple[str, list[str]]:
    """Which series to sample, and notes; refuses a device that is not there."""
    if device == "cpu":
        return "rss", []
    if not device.startswith("cuda"):
        raise UserError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    index = _cuda_index(device)
    ok, why = nvml.available()
    if ok:
        count = nvml.query("nvmlDeviceGetCount")
        if isinstance(count, nvml.NA) or count <= index:
            raise UserError(f"no CUDA GPU {index} here (NVML sees {0 if isinstance(count, nvml.NA) else count}): "
                            "use --device cpu to probe on the CPU")
        return f"gpu{index}", []
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() <= index:
        raise UserError(f"no CUDA GPU visible ({why}): use --device cpu to probe on the CPU")
    return None, [f"NVML unavailable ({why}): no sampling; stages read from torch.cuda.mem_get_info in the child"]


def run_probe(model: str | ModelSource, quant: str = "auto", ctx: int = 512, batch: int = 1, *,
              device: str = "cpu", synthetic: bool = False, interval_ms: float = 5.0, dtype: str | None = None,
              attn: str = "auto", with_estimate: bool = True, keep_samples: bool = True,
              command: str | None = None, timeout_s: float | None = None, on_event=None,
              max_memory: dict | str | None = None, device_map: str | None = None) -> ProbeResult:
    """Probe ``model`` (anything ``vramcal estimate`` accepts). ``on_event(event_dict, child_pid)`` is
    called for each event the child streams (progress display; tests use it to kill the child).
    ``max_memory`` / ``device_map``: load split across devices as ``from_pretrained`` would (see
    :func:`_placed_load`); every GPU of the map is sampled, and the child's resident set for the CPU."""
    if not isinstance(ctx, int) or ctx <= 16:
        raise UserError(f"--ctx must be an integer above 16 (prompt + 16 generated tokens), got {ctx}")
    if not isinstance(batch, int) or batch <= 0:
        raise UserError(f"--batch must be a positive integer, got {batch}")
    if interval_ms <= 0:
        raise UserError(f"--interval-ms must be positive, got {interval_ms}")
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    spec = resolve_quant(quant, source.config, dtype)
    if spec.method not in ("none", "bnb4", "bnb8") and not spec.pre_quantized:
        raise UserError(f"cannot probe quant {spec.name}")
    # ---- placement (begin)
    placed = None
    if max_memory is not None or device_map is not None:
        placed = _placed_load(source, spec, max_memory, device_map, device)
        device = placed["main_device"]
        for gpu in placed["gpus"][1:]:
            _check_device(gpu)
    # ---- placement (end)
    series, notes = _check_device(device)
    if not source.weight_files and not synthetic:
        raise UserError(f"{source.name} has no *.safetensors weights here: add --synthetic to probe random "
                        "weights at its real widths")

    estimate = None
    if with_estimate:
        from ..estimator.estimate import estimate as _estimate

        try:
            estimate = _estimate(source, quant, ctx, batch, dtype=dtype, attn=attn,
                                 device="cpu" if device == "cpu" else "cuda", max_memory=max_memory,
                                 device_map=device_map).to_dict()
        except UserError:
            raise
        except Exception as exc:  # the measurement is still worth having
            notes.append(f"no estimate: {type(exc).__name__}: {exc}")

    with tempfile.TemporaryDirectory(prefix="vramcal-probe-") as tmp:
        model_dir = source.directory
        if synthetic:
            model_dir = os.path.join(tmp, "synthetic")
            cfg_path = os.path.join(tmp, "config.json")
            with open(cfg_path, "w") as fh:
                json.dump(source.config, fh)
            r = subprocess.run([sys.executable, "-m", "vramcal.probes.synthetic", cfg_path, model_dir],
                               capture_output=True, text=True)
            if r.returncode != 0:
                tail = (r.stderr.strip().splitlines() or ["?"])[-1]
                raise UserError(f"could not write synthetic weights for {source.name}: {tail}")
        child_spec = {"model_dir": model_dir, "device": device, "dtype": spec.dtype, "ctx": ctx, "batch": batch,
                      "bnb": None if spec.pre_quantized else spec.bnb_config_kwargs(), "attn": attn,
                      "new_tokens": 16}
        if placed is not None:
            child_spec.update(load=placed["load"], gpus=placed["gpus"], offload_folder=os.path.join(tmp, "offload"))
        result = _run_child(child_spec, series, interval_ms / 1000.0, device, timeout_s, on_event,
                            gpus=[_cuda_index(g) for g in placed["gpus"]] if placed else None)
    if placed is not None:
        result["placement"] = placed["plan"]
    result.update(model=source.name, quant=spec.name, quant_implementation=spec.implementation, dtype=spec.dtype,
                  ctx=ctx, batch=batch, attn=attn, estimate=estimate,
                  command=command or _command(source.name, quant, ctx, batch, device, synthetic, interval_ms))
    result["notes"] = notes + result["notes"]
    if not keep_samples:
        result["samples"] = []
    return ProbeResult(**result)


def _placed_load(source, spec, max_memory, device_map, device: str) -> dict:
    """The placement a probe loads with: the plan of :func:`~vramcal.estimator.placement.plan_placement`;
    when the installed transformers refuses it (bitsandbytes with modules on cpu / disk), the
    alternative it suggests: the same map as a custom ``device_map`` with ``llm_int8_enable_fp32_cpu_offload``.
    Returns the child's ``load`` arguments, the GPUs to sample (main device first) and the plan's dict."""
    from ..estimator.estimate import placement_request
    from ..estimator.placement import OFFLOAD_FLAG, plan_placement

    mm, strategy = placement_request(max_memory, device_map, device)
    plan = plan_placement(source, spec, mm, strategy)
    loads = plan.alternative if plan.refused and plan.alternative is not None else plan
    if loads is plan:
        load = {"device_map": plan.strategy, "max_memory": dict(mm)}
    else:
        load = {"device_map": dict(loads.device_map), "bnb_extra": {OFFLOAD_FLAG: True}}
    gpus = [loads.main_device] + [g for g in loads.gpus if g != loads.main_device]
    return {"load": load, "gpus": gpus, "main_device": loads.main_device, "plan": plan.to_dict()}


def _command(name, quant, ctx, batch, device, synthetic, interval_ms) -> str:
    parts = ["vramcal", "probe", name, "--quant", quant, "--ctx", str(ctx), "--batch", str(batch), "--device", device]
    if synthetic:
        parts.append("--synthetic")
    if interval_ms != 5.0:
        parts += ["--interval-ms", f"{interval_ms:g}"]
    return shlex.join(parts)


def _run_child(child_spec: dict, series: str | None, interval_s: float, device: str,
               timeout_s: float | None, on_event=None, gpus: list[int] | None = None) -> dict:
    read_fd, write_fd = os.pipe()
    log = tempfile.TemporaryFile(mode="w+")
    start = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", "vramcal.probes.child", json.dumps(child_spec), str(write_fd)],
                             pass_fds=(write_fd,), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    os.close(write_fd)
    if series == "rss":
        reader = rss_reader(child.pid)
    elif series is not None and gpus:  # placement: every GPU of the map, and the child's RAM for the CPU share
        gpu_read, ram_read = nvml_reader(gpus, child.pid), rss_reader(child.pid)

        def reader():
            return {**gpu_read(), **ram_read()}
    elif series is not None:
        reader = nvml_reader([_cuda_index(device)], child.pid)
    else:
        reader = None
    sampler = Sampler(reader, interval_s).start() if reader else None
    markers: list[tuple[str, float]] = []
    reported: dict[str, dict] = {}
    final: dict | None = None
    try:
        with os.fdopen(read_fd) as events:
            for line in events:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if ev["event"] == "stage":
                    if sampler:
                        sampler.sample_now()  # a reading at the very marker, besides the timer's
                    markers.append((ev["name"], ev["t"]))
                    reported[ev["name"]] = {k: v for k, v in ev.items() if k not in ("event", "name")}
                elif ev["event"] in ("oom", "error", "done"):
                    final = ev
                if on_event is not None:
                    on_event(ev, child.pid)
                if timeout_s and time.monotonic() - start > timeout_s:
                    child.kill()
                    break
        rc = child.wait(timeout=timeout_s)
    except KeyboardInterrupt:
        child.kill()
        child.wait()
        raise
    except subprocess.TimeoutExpired:
        child.kill()
        rc = child.wait()
    finally:
        if sampler:
            sampler.stop()
    end_t = time.monotonic()
    notes: list[str] = []
    if sampler and sampler.error:
        notes.append(f"sampler stopped early: {sampler.error}")
    status = {"done": "ok", "oom": "oom", "error": "error"}.get((final or {}).get("event"), "crashed")
    samples = sampler.samples if sampler else []
    # a crashed child: attribute what was sampled after the last marker to the stage it was in
    if status != "ok" and samples:
        markers_for_attr = markers + [("_unfinished", end_t)]
    else:
        markers_for_attr = markers
    stages = attribute(samples, markers_for_attr, series) if series else {n: {} for n, _ in markers}
    for name, info in reported.items():
        st = stages.setdefault(name, {})
        st.update({k: v for k, v in info.items() if k != "t"})
        st["t"] = round(info["t"] - start, 6)
        if series == "rss" and info.get("rss") is not None:
            st["used_bytes"] = info["rss"]  # the child's own reading at the marker is exact
            st["peak_bytes"] = max(v for v in (st.get("peak_bytes"), info["rss"]) if v is not None)
        if series and series != "rss":
            st["process_used_bytes"] = _proc_at(samples, info["t"], series + "_proc")
        if series is None and info.get("mem_get_info_used") is not None:
            # no NVML: the child's torch.cuda.mem_get_info at the marker; no peak between markers
            st["used_bytes"] = info["mem_get_info_used"]
            st["peak_bytes"] = None
    unfinished = stages.pop("_unfinished", None)
    devices = _device_stages(samples, markers, reported, gpus) if gpus and series else None
    oom = None
    if status == "oom":
        oom = {"stage": final.get("stage"), "requested_bytes": final.get("requested_bytes"),
               "message": final.get("message")}
    error = final.get("message") if status == "error" else None
    if status == "crashed":
        log.seek(0)
        tail = [ln for ln in log.read().splitlines() if ln.strip()][-1:] or [""]
        error = f"child exited with {_describe_rc(rc)} after stage {markers[-1][0] if markers else 'none'}" + (
            f" ({tail[0][:200]})" if tail[0] else "")
    in_flight = None
    if unfinished is not None and status != "ok":
        in_flight = {"stage": (final or {}).get("stage") or _next_stage(markers),
                     "peak_bytes": unfinished["peak_bytes"], "samples": unfinished["samples"]}
    log.close()
    return {
        "status": status, "device": device, "series": series,
        "stages": {k: stages[k] for k in STAGE_ORDER if k in stages},
        "last_stage": markers[-1][0] if markers else None, "oom": oom, "error": error,
        "sample_count": len(samples),
        "samples": [{"t": round(s.t - start, 6), **s.values, **({"missing": s.missing} if s.missing else {})}
                    for s in samples],
        "interval_ms": interval_s * 1000, "sampler_overhead": sampler.overhead if sampler else None,
        "wall_s": round(end_t - start, 3), "notes": notes, "exit_code": rc, "unfinished": in_flight,
        "devices": devices,
    }


def _device_stages(samples, markers, reported: dict, gpus: list[int]) -> dict[str, dict]:
    """Stages per device of a placed run: each GPU's NVML series, and for ``cpu`` the child's resident
    set minus its baseline (what loading put in RAM: the offloaded weights), read at the markers."""
    out = {}
    for i in gpus:
        st = attribute(samples, markers, f"gpu{i}")
        out[f"cuda:{i}"] = {k: st[k] for k in STAGE_ORDER if k in st}
    st = attribute(samples, markers, "rss")
    for name, info in reported.items():  # the child's own reading at the marker is exact
        if name in st and info.get("rss") is not None:
            st[name]["used_bytes"] = info["rss"]
            st[name]["peak_bytes"] = max(v for v in (st[name].get("peak_bytes"), info["rss"]) if v is not None)
    base = st.get("baseline", {}).get("used_bytes")
    cpu = {}
    for k in STAGE_ORDER:
        if k in st:
            used, peak = st[k].get("used_bytes"), st[k].get("peak_bytes")
            cpu[k] = {"used_bytes": None if used is None or base is None else used - base,
                      "peak_bytes": None if peak is None or base is None else peak - base,
                      "samples": st[k].get("samples")}
    out["cpu"] = cpu
    return out


def _next_stage(markers) -> str | None:
    done = {m for m, _ in markers}
    for name in STAGE_ORDER:
        if name not in done and name != "context":
            return name
    return None


def _proc_at(samples, t: float, key: str) -> int | None:
    best = None
    for s in samples:
        if s.t <= t and s.values.get(key) is not None:
            best = s.values[key]
    return best


def _describe_rc(rc: int | None) -> str:
    if rc is None:
        return "no exit code"
    if rc < 0:
        import signal

        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"
