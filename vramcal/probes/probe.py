"""A probe: load the real model in a child process, generate ``new_tokens`` tokens (16 by default),
measure every stage.

The parent owns the measurement: a sampler thread reads NVML ``memory.used`` (GPU) or the child's
resident set (CPU) every few milliseconds, and the child streams stage markers over a pipe as they
happen. If the child dies, what was sampled and the last stage reached are kept.

Stages, in order: ``baseline`` (imports done, device untouched), ``context`` (CUDA initialised; GPU
only), ``load_peak`` (``from_pretrained`` returned), ``post_load``, ``first_token`` (the first new
token exists), ``end`` (all new tokens). For each: ``used_bytes`` at the marker and ``peak_bytes`` over
the interval that ends there; on a GPU also torch's ``max_memory_allocated`` / ``max_memory_reserved``
over the interval (reset at every marker) and the child's own usage as NVML reports it. Typed readings
and the rule that makes them comparable with an estimate: :mod:`vramcal.probes.readings`.

Every way a run ends leaves a result:

- the child finishes, runs out of memory or crashes: a :class:`ProbeResult` (``ok``, ``oom``,
  ``error``, ``crashed``) with the last stage and the samples;
- Ctrl-C (SIGINT) or SIGTERM in the parent: the child's process group is killed and
  :class:`ProbeInterrupted` is raised, carrying a result with status ``interrupted``, the last stage,
  the stages so far, the samples and the stage it was in (``unfinished``); the caller records it and
  exits with ``exc.exit_code`` (130 or 143). A signal while a child is being started waits until it is
  held, so it is killed too (:func:`~.lifecycle.signals_deferred`); one after the child finished, while
  the probe cleans up or builds its result, still raises :class:`ProbeInterrupted`, with the finished
  result (status ``ok``) to record;
- the parent killed outright (SIGKILL): nothing in it runs any more. The child gets SIGTERM from the
  kernel (``PR_SET_PDEATHSIG``) and exits, removing the temporary folder; ``journal=`` (a callback,
  see :func:`run_probe`) lets a caller keep the markers and samples on disk as they arrive, and
  :func:`vramcal.probes.result.recover` turns those events into a result afterwards.

The result is pure data (:mod:`vramcal.probes.result`); processes, temporary folders and signals are
:mod:`vramcal.probes.lifecycle`'s.
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from ..errors import UserError
from ..estimator.formats import CPU
from ..estimator.loading import quantization_kwargs
from ..estimator.quant import resolve_quant
from ..estimator.resolve import ModelSource, resolve_model
from ..estimator.vision import check_images
from ..interrupts import signal_of
from ..workload import CACHES, KV_DTYPES, NEW_TOKENS, Configuration, choice, device_kind, parse_device, workload
from . import nvml
from .child import remove_temp_folder
from .lifecycle import (ProbeInterrupted, kill_group, make_temp_folder, signals_deferred, signals_held, sigterm_raises,
                        sweep_stale)
from .result import ProbeResult, assemble, device_readings, sample_dict, vision_reading
from .sampler import Sampler, nvml_reader, rss_reader

JOURNAL_EVERY_S = 1.0  # samples reach the journal at every marker and at least this often


# ---------------------------------------------------------------------------------- devices

def _cuda_index(device: str) -> int:
    return parse_device(device).index or 0


def _check_device(device: str) -> tuple[str | None, list[str]]:
    """Which series to sample, and notes; refuses a device string other than cpu, cuda, cuda:N, and a
    device that is not there."""
    dev = parse_device(device)
    if dev.kind == "cpu":
        return "rss", []
    index = dev.index
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


def driver_reserves(series: str | None, gpus: list[int] | None, notes: list[str]) -> dict[str, int] | None:
    """The driver's reserve of each GPU series the probe samples (NVML v1 used counts it, the stages do
    not), read through the one NVML door before the child starts; a GPU whose reserve is not known is left
    out, said in ``notes`` (its readings are compared as read). None when no NVML series is sampled."""
    from .machine import reserve_here

    if series is None or series == "rss":
        return None
    indices = gpus if gpus else [int(series[3:])]
    out: dict[str, int] = {}
    for i in indices:
        r = reserve_here(f"cuda:{i}")
        if r.bytes is None:
            notes.append(f"cuda:{i}: the driver's reserve is {r.source}: its readings are compared as read, "
                         "the reserve in them")
        else:
            out[f"gpu{i}"] = r.bytes
    return out


# ---------------------------------------------------------------------------------- the probe

def run_probe(model: str | ModelSource, quant: str = "auto", ctx: int = 512, batch: int = 1, *,
              device: str = "cpu", synthetic: bool = False, interval_ms: float = 5.0, dtype: str | None = None,
              attn: str = "auto", with_estimate: bool = True, keep_samples: bool = True,
              command: str | None = None, timeout_s: float | None = None, on_event=None,
              new_tokens: int = NEW_TOKENS, journal: Callable[[dict], None] | None = None,
              kv_dtype: str = "auto", cache: str = "dynamic", max_memory: dict | str | None = None,
              device_map: str | None = None, estimate=None, images: int = 0, image_size=None,
              gpu=None) -> ProbeResult:
    """Probe ``model`` (anything ``vramcal estimate`` accepts): a prompt of ``ctx - new_tokens`` tokens,
    then exactly ``new_tokens`` generated.

    ``images`` pictures of ``image_size`` (default: the processor's size) in every prompt of a
    vision-language model: the real image processor makes their pixel inputs, the prompt holds their
    tokens as the family's processor lays them out, and ``generate`` runs the multimodal prefill. The
    vision encoder's stretch of it is kept as ``vision`` (docs/vision.md).

    ``max_memory`` / ``device_map``: load split across devices as ``from_pretrained`` would (see
    :func:`_placed_load`); every GPU of the map is sampled, and the child's resident set for the CPU
    share (``ProbeResult.devices``).

    ``estimate``: the :class:`~vramcal.estimator.result.Estimate` to compare with, when the caller has
    made it already (``check`` estimates once, before it records the run); else one is made here when
    ``with_estimate``.

    ``gpu``: the :class:`~vramcal.estimator.formats.GpuTarget` the estimate prices and the quantization path
    follows; default: this machine's GPU of ``device``, read through NVML (its context, kernels, cuBLAS workspace
    and driver's reserve from vramcal's table), as ``vramcal probe`` does.

    ``on_event(event_dict, child_pid)`` is called for each event the child streams, as sent (progress
    display; tests use it to kill the child).

    ``journal(event_dict)``, if given, is called in the parent as the run goes, so a caller can append
    each event to a file and rebuild a result with :func:`vramcal.probes.result.recover` if the parent is
    killed. Events, all
    JSON-serialisable, times in seconds since the child started:

    - ``{"event": "start", "parent_pid", "child_pid", ...}`` with every field :func:`recover` needs
      (model, quant, ctx, batch, series, command, estimate ...), once, when the child has started;
    - ``{"event": "samples", "samples": [{"t", SERIES: bytes, ...}, ...]}``: new samples, before each
      marker and at least every second;
    - ``{"event": "stage", "name", "t", ...}``: each stage marker as it arrives, with the child's fields;
    - ``{"event": "oom" | "error" | "done", ...}``: how the child ended, when it says.

    Nothing marks the end: the caller knows when it has recorded the result, and drops its journal then.

    An exception from ``journal`` ends the probe (the child is killed) and propagates.

    Ctrl-C or SIGTERM while this runs raises :class:`ProbeInterrupted` with the result so far.
    """
    work = workload(ctx, batch, new_tokens, images=images, image_size=image_size)
    ctx, batch, new_tokens = work.ctx, work.batch, work.new_tokens
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    check_images(source.config, work.images, source.name)
    if gpu is None:  # priced for the GPU it loads on (None on the CPU), as the CLI's probe is
        from .hardware import device_gpu_target

        gpu = device_gpu_target(device)
    spec = resolve_quant(quant, source, dtype, gpu or (CPU if device_kind(device) == "cpu" else None))
    series, notes, placed = preflight(source, spec, device, synthetic, interval_ms, kv_dtype, cache, max_memory,
                                      device_map)
    if placed is not None:
        device = placed["main_device"]

    identity = {"device": device, "model": source.name, "quant": spec.name,
                "quant_implementation": spec.implementation, "dtype": spec.dtype, "ctx": ctx, "batch": batch,
                "attn": attn, "new_tokens": new_tokens, "series": series, "interval_ms": float(interval_ms),
                "kv_dtype": kv_dtype, "cache": cache, "images": work.images, "image_size": work.image_size,
                "command": command or Configuration(source.ref, work, quant=quant, device=device, dtype=dtype,
                                                    kv_dtype=kv_dtype, attn=attn, cache=cache,
                                                    synthetic=synthetic, max_memory=max_memory,
                                                    device_map=device_map).command("probe"),
                "estimate": estimate, "placement": placed["plan"] if placed else None}
    gpus = [_cuda_index(g) for g in placed["gpus"]] if placed else None
    identity["driver_reserve"] = driver_reserves(series, gpus, notes)
    probe = _Probe(identity, interval_ms / 1000.0, timeout_s, on_event, journal, notes, gpus)
    with sigterm_raises() as terminated:
        try:
            if with_estimate and estimate is None:
                identity["estimate"] = _estimate_or_note(source, quant, work, dtype, attn, device, kv_dtype,
                                                         cache, notes, max_memory, device_map, gpu)
            terminated.check()  # the estimate (torch's import, a finalizer) swallowed it: no child is started
            child_spec = {"device": device, "dtype": spec.dtype, "ctx": ctx, "batch": batch,
                          "bnb": quantization_kwargs(spec), "attn": attn,
                          "new_tokens": new_tokens, "kv_dtype": kv_dtype, "cache": cache}
            if work.images:
                child_spec.update(images=work.images, image_size=work.image_size, processor=source.processor)
            if placed is not None:
                child_spec.update(load=placed["load"], gpus=placed["gpus"])
            probe.run(source, synthetic, child_spec)
            terminated.check()
            # built under sigterm_raises: a signal while it is built ends the run as interrupted below (a
            # child that finished keeps its status, and the caller still exits 130 / 143)
            return probe.result(keep_samples=keep_samples)
        except KeyboardInterrupt as exc:
            name = signal_of(exc)
            with signals_held():  # a second signal cannot cut the cleanup short: the first one stands
                probe.close()
                result = probe.result(interrupted=name, keep_samples=keep_samples)
            raise ProbeInterrupted(result, name) from None
        finally:
            probe.close()


def preflight(source: ModelSource, spec, device: str, synthetic: bool, interval_ms: float = 5.0,
              kv_dtype: str = "auto", cache: str = "dynamic", max_memory=None, device_map: str | None = None
              ) -> tuple[str | None, list[str], dict | None]:
    """Everything a probe needs, checked before anything runs or is recorded: the sampled series, notes
    and the placement it loads with (None on one device), or a one-line UserError."""
    if isinstance(interval_ms, bool) or not isinstance(interval_ms, (int, float)) or not math.isfinite(interval_ms) \
            or not 0 < interval_ms <= 10_000:
        raise UserError(f"--interval-ms must be a positive number of milliseconds (at most 10000), got {interval_ms!r}")
    choice(kv_dtype, KV_DTYPES, "--kv-dtype")
    choice(cache, CACHES, "--cache")
    if spec.method not in ("none", "bnb4", "bnb8") and not spec.pre_quantized:
        raise UserError(f"cannot probe quant {spec.name}")
    placed = None
    if max_memory is not None or device_map is not None:
        placed = _placed_load(source, spec, max_memory, device_map, device)
        device = placed["main_device"]
        for gpu in placed["gpus"][1:]:
            _check_device(gpu)
    series, notes = _check_device(device)
    if not source.weight_files and not synthetic:
        raise UserError(f"{source.name} has no *.safetensors weights here: "
                        + (f"only its metadata was read from the Hub; `hf download {source.name} --revision "
                           f"{source.revision}` puts the weights in the local cache, or " if source.origin == "hub" else "")
                        + "add --synthetic to probe random weights at its real widths")
    if synthetic:
        from .synthetic import check_room, refuse_pre_quantized

        refuse_pre_quantized(source, spec)
        check_room(source, spec)
    return series, notes, placed


def _placed_load(source, spec, max_memory, device_map, device: str) -> dict:
    """The placement a probe loads with: the plan of :func:`~vramcal.estimator.placement.plan_placement`;
    when the installed transformers refuses it (bitsandbytes with modules on cpu / disk), the
    alternative it suggests: the same map as a custom ``device_map`` with ``llm_int8_enable_fp32_cpu_offload``.
    Returns the child's ``load`` arguments, the GPUs to sample (main device first) and the plan's dict."""
    from ..estimator.estimate import placement_request
    from ..estimator.loading import placed_load
    from ..estimator.placement import plan_placement

    mm, strategy = placement_request(max_memory, device_map, device)
    plan = plan_placement(source, spec, mm, strategy)
    loads = plan.loads
    load = placed_load(plan)
    gpus = [loads.main_device] + [g for g in loads.gpus if g != loads.main_device]
    return {"load": load, "gpus": gpus, "main_device": loads.main_device, "plan": plan}


def _estimate_or_note(source, quant, work, dtype, attn, device, kv_dtype, cache, notes, max_memory=None,
                      device_map=None, gpu=None):
    from ..estimator.estimate import estimate as _estimate

    try:
        return _estimate(source, quant, batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens,
                         dtype=dtype, attn=attn, kv_dtype=kv_dtype, cache=cache,
                         device="cpu" if device == "cpu" else "cuda", max_memory=max_memory,
                         device_map=device_map, images=work.images, image_size=work.image_size, gpu=gpu)
    except UserError:
        raise
    except (RuntimeError, ValueError, TypeError, ImportError, OSError) as exc:  # the measurement is still worth having
        notes.append(f"no estimate: {type(exc).__name__}: {exc}")
        return None


class _Probe:
    """One probe's processes, temporary folder and measurements; :meth:`close` ends all of them (on every
    way out, more than once is fine), :meth:`result` turns what was gathered into a ProbeResult."""

    def __init__(self, identity: dict, interval_s: float, timeout_s: float | None, on_event, journal,
                 notes: list[str], gpus: list[int] | None = None):
        self.identity = identity
        self.gpus = gpus  # a placed run: every GPU of its map is sampled, and the child's resident set
        self.series = identity["series"]
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_event = on_event
        self.journal = journal
        self.notes = notes
        self.created = time.monotonic()
        self.folder: str | None = None
        self.procs: list[subprocess.Popen] = []
        self.child: subprocess.Popen | None = None
        self.sampler: Sampler | None = None
        self.start: float | None = None  # when the child started: time zero of stages and samples
        self.end_t: float | None = None
        self.markers: list[tuple[str, float]] = []
        self.reported: dict[str, dict] = {}
        self.final: dict | None = None
        self.vision: dict | None = None  # the child's "vision" event: the vision encoder's window
        self.log = None
        self.log_tail = ""
        self.journaled = 0  # samples already handed to the journal
        self.journal_t = 0.0
        self.timed_out = False

    # -- processes

    def _spawn(self, args: list[str], **kwargs) -> subprocess.Popen:
        # a session of its own: the terminal's Ctrl-C reaches the parent only; the group is killed in close().
        # A signal while Popen runs waits until the process is in self.procs (lifecycle.signals_deferred)
        with signals_deferred():
            proc = subprocess.Popen(args, start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)
            self.procs.append(proc)
        return proc

    @staticmethod
    def _wait_exited(proc: subprocess.Popen, timeout: float | None) -> bool:
        """Wait until ``proc`` has exited, without reaping it: while it is a zombie its pid, and so its
        process group id, cannot be reused, and :func:`~.lifecycle.kill_group` can still kill what is left of
        the group."""
        if not hasattr(os, "waitid"):
            try:
                proc.wait(timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                    return True
            except ChildProcessError:  # reaped already
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        for proc in self.procs:
            kill_group(proc)
        self.procs = []
        if self.sampler is not None:
            self.sampler.stop()
        if self.end_t is None:
            self.end_t = time.monotonic()
        if self.log is not None:
            self.log.seek(0)
            lines = [ln for ln in self.log.read().splitlines() if ln.strip()]
            self.log_tail = lines[-1][:200] if lines else ""
            self.log.close()
            self.log = None
        if self.folder is not None:
            remove_temp_folder(self.folder)
            self.folder = None

    # -- the run

    def run(self, source: ModelSource, synthetic: bool, child_spec: dict) -> None:
        sweep_stale()
        self.folder = make_temp_folder()
        model_dir = source.directory
        if synthetic:
            model_dir = self._write_synthetic(source)
        child_spec.update(model_dir=model_dir, parent_pid=os.getpid(), temp_dir=self.folder)
        if child_spec.get("load"):  # a map with disk entries offloads into the probe's own folder
            child_spec["offload_folder"] = os.path.join(self.folder, "offload")
        self._run_child(child_spec)

    def _write_synthetic(self, source: ModelSource) -> str:
        model_dir = os.path.join(self.folder, "synthetic")
        cfg_path = os.path.join(self.folder, "config.json")
        with open(cfg_path, "w") as fh:
            json.dump(source.config, fh)
        with tempfile.TemporaryFile(mode="w+") as log:
            proc = self._spawn([sys.executable, "-m", "vramcal.probes.child", "write-synthetic", cfg_path, model_dir,
                                str(os.getpid()), self.folder], stdout=log, stderr=log)
            self._wait_exited(proc, None)
            kill_group(proc)  # reaps it, and takes anything it left in its group
            if proc.returncode != 0:
                log.seek(0)
                tail = ([ln for ln in log.read().splitlines() if ln.strip()] or ["?"])[-1]
                raise UserError(f"could not write synthetic weights for {source.name}: {tail}")
        return model_dir

    def _run_child(self, child_spec: dict) -> None:
        read_fd, write_fd = os.pipe()
        self.log = tempfile.TemporaryFile(mode="w+")
        try:
            try:
                self.start = time.monotonic()
                with signals_deferred():  # held as self.child too before a signal acts (exit_code, the result)
                    self.child = self._spawn([sys.executable, "-m", "vramcal.probes.child", json.dumps(child_spec),
                                              str(write_fd)], pass_fds=(write_fd,), stdout=self.log, stderr=self.log)
            finally:
                os.close(write_fd)
            reader = self._reader()
            self.sampler = Sampler(reader, self.interval_s).start() if reader else None
            self._journal({"event": "start", "parent_pid": os.getpid(), "child_pid": self.child.pid,
                           "monotonic_start": self.start, "gpus": self.gpus, **self._identity_json()})
            self.journal_t = time.monotonic()
            self._read_events(read_fd)
        finally:
            os.close(read_fd)
        if not self.timed_out and not self._wait_exited(self.child, 60.0):  # closed its pipe, does not exit
            self.notes.append("the child did not exit within 60 s of its last event: killed")
        self.close()
        self._flush_samples()

    def _reader(self):
        """What the sampler reads of the child: its resident set on the CPU, NVML ``memory.used`` of its GPU
        (of every GPU of a placed run, and its resident set beside), or nothing without NVML."""
        if self.series == "rss":
            return rss_reader(self.child.pid)
        if self.series is not None and self.gpus:
            gpu_read, ram_read = nvml_reader(self.gpus, self.child.pid), rss_reader(self.child.pid)
            return lambda: {**gpu_read(), **ram_read()}
        if self.series is not None:
            return nvml_reader([_cuda_index(self.identity["device"])], self.child.pid)
        return None

    def _read_events(self, fd: int) -> None:
        buf = b""
        while True:
            ready, _, _ = select.select([fd], [], [], 0.25)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    self._event(line)
            now = time.monotonic()
            if self.journal is not None and now - self.journal_t >= JOURNAL_EVERY_S:
                self._flush_samples()
            if self.timeout_s and now - self.start > self.timeout_s:
                self.timed_out = True
                self.notes.append(f"timed out after {self.timeout_s:g} s: the child was killed")
                return

    def _event(self, line: bytes) -> None:
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            return
        kind = ev.get("event")
        if kind == "stage":
            if self.sampler:
                self.sampler.sample_now()  # a reading at the very marker, besides the timer's
            self.markers.append((ev["name"], ev["t"]))
            self.reported[ev["name"]] = {k: v for k, v in ev.items() if k not in ("event", "name")}
        elif kind in ("oom", "error", "done"):
            self.final = ev
        elif kind == "vision":
            self.vision = ev
        if kind in ("stage", "oom", "error", "done", "vision"):
            self._flush_samples()
            self._journal({**ev, "t": round(ev["t"] - self.start, 6)})
        if self.on_event is not None:
            self.on_event(ev, self.child.pid)

    def _identity_json(self) -> dict:
        est, plan = self.identity.get("estimate"), self.identity.get("placement")
        return {**self.identity, "estimate": est.to_dict() if est is not None else None,
                "placement": plan.to_dict() if plan is not None else None}

    def _journal(self, event: dict) -> None:
        if self.journal is not None:
            self.journal(event)

    def _flush_samples(self) -> None:
        if self.journal is None or self.sampler is None:
            return
        new = self.sampler.samples[self.journaled:]
        self.journaled += len(new)
        self.journal_t = time.monotonic()
        if new:
            self.journal({"event": "samples", "samples": [sample_dict(s, self.start) for s in new]})

    # -- the result

    def result(self, interrupted: str | None = None, keep_samples: bool = True) -> ProbeResult:
        if self.start is None:  # stopped before the child existed
            d = assemble(self.series, [], {}, None, [], self.created, self.end_t or time.monotonic(), None, "",
                         interrupted)
        else:
            d = assemble(self.series, self.markers, self.reported, self.final,
                         self.sampler.samples if self.sampler else [], self.start, self.end_t,
                         self.child.returncode if self.child else None, self.log_tail, interrupted)
        d["notes"] = self.notes + d["notes"]
        if self.gpus and self.series and self.start is not None:
            d["devices"] = device_readings(self.sampler.samples if self.sampler else [], self.markers,
                                           self.reported, self.gpus)
        if self.sampler is not None:
            d["sampler_overhead"] = self.sampler.overhead
            if self.sampler.error:
                d["notes"].append(f"sampler stopped early: {self.sampler.error}")
        if self.vision is not None and self.start is not None:
            d["vision"] = vision_reading(self.vision, self.sampler.samples if self.sampler else [], self.series,
                                         self.start, d["stages"].get("baseline"),
                                         (self.identity.get("driver_reserve") or {}).get(self.series))
        if "end" in self.reported and self.reported["end"].get("image_tokens") is not None:
            d["image_tokens"] = self.reported["end"]["image_tokens"]
        if not keep_samples:
            d["samples"] = []
        return ProbeResult(**{**self.identity, **d})
