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
  exits with ``exc.exit_code`` (130 or 143);
- the parent killed outright (SIGKILL): nothing in it runs any more. The child gets SIGTERM from the
  kernel (``PR_SET_PDEATHSIG``) and exits, removing the temporary folder; ``journal=`` (a callback,
  see :func:`run_probe`) lets a caller keep the markers and samples on disk as they arrive, and
  :func:`recover` turns those events into a result afterwards.

Temporary folders are named ``vramcal-probe-PID-START-*`` (the parent's pid and its start time);
every probe first removes those whose parent is gone (:func:`sweep_stale`), so even a folder left by
a parent and child killed together does not outlive the next probe.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..estimator.quant import resolve_quant
from ..estimator.resolve import ModelSource, resolve_model
from . import nvml
from .child import TEMP_PREFIX, remove_temp_folder
from .readings import StageReading, comparable
from .sampler import Sample, Sampler, attribute, nvml_reader, rss_reader
from ..workload import NEW_TOKENS, PROBE_STAGES, Configuration, parse_device, workload

STAGE_ORDER = PROBE_STAGES
JOURNAL_EVERY_S = 1.0  # samples reach the journal at every marker and at least this often


@dataclass
class ProbeResult:
    status: str  # ok | oom | error | crashed | interrupted
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
    new_tokens: int = NEW_TOKENS  # generated after a prompt of ctx - new_tokens
    # placement (--max-memory / --device-map): per device {stage: {used_bytes, peak_bytes, samples}},
    # GPUs from NVML, "cpu" from the child's resident set above its baseline; and the plan it loaded
    devices: dict[str, dict] | None = None
    placement: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def readings(self) -> dict[str, StageReading]:
        """Each stage reached, as read, in stage order."""
        return {name: StageReading.from_stage(name, self.series, st) for name, st in self.stages.items()}

    def unfinished_reading(self) -> StageReading | None:
        """The stage a stopped run was in, with the peak sampled there (``used_bytes`` None), as read."""
        u = self.unfinished
        if not u or not u.get("stage"):
            return None
        return StageReading(u["stage"], self.series, None, u.get("peak_bytes"))

    def measured(self) -> dict[str, StageReading]:
        """Each stage as compared with an estimate: on the CPU (``rss``) minus the child's baseline,
        on a GPU as read (:func:`vramcal.probes.readings.comparable` states the rule)."""
        return comparable(self.readings(), self.series)

    def measured_unfinished(self) -> StageReading | None:
        """:meth:`unfinished_reading` by the same rule as :meth:`measured`."""
        u = self.unfinished_reading()
        if u is None:
            return None
        return comparable({u.stage: u}, self.series, baseline=self.readings().get("baseline"))[u.stage]


class ProbeInterrupted(KeyboardInterrupt):
    """A probe stopped by SIGINT (Ctrl-C) or SIGTERM in the parent, after its child was killed.

    ``result`` is what was measured: status ``interrupted`` with the last stage, the stages so far, the
    samples and ``unfinished`` (unless the child had finished before the signal: then its own status
    stands). Record it, then exit with :attr:`exit_code`. A ``KeyboardInterrupt``, so that
    ``except Exception`` never swallows it and a caller that knows only KeyboardInterrupt still stops."""

    def __init__(self, result: ProbeResult, signal_name: str):
        super().__init__(f"probe interrupted by {signal_name}")
        self.result = result
        self.signal_name = signal_name

    @property
    def exit_code(self) -> int:
        return 128 + int(signal.Signals[self.signal_name])


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread while a probe runs."""


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


# ---------------------------------------------------------------------------- temporary folders

_FOLDER = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-(\d+)-")


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22): tells a live owner from a
    later process that reuses its pid. None where there is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2:].split()[19])


def process_alive(pid: int, start: int = 0) -> bool:
    """Whether process ``pid`` exists and, when ``start`` (its start time in clock ticks) is given, is
    the same process rather than a later one that reused the pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        pass
    ticks = _start_ticks(pid)
    return ticks is None or start == 0 or ticks == start


def folder_owner(path: str) -> tuple[int, int] | None:
    """(pid, start ticks) encoded in a probe's temporary folder name, or None for another name."""
    m = _FOLDER.match(os.path.basename(os.path.normpath(path)))
    return (int(m.group(1)), int(m.group(2))) if m else None


def make_temp_folder(root: str | None = None) -> str:
    """A new ``vramcal-probe-PID-START-*`` folder under ``root`` (default: the temp dir) for this process."""
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{pid}-{_start_ticks(pid) or 0}-", dir=root)


def sweep_stale(root: str | None = None) -> list[str]:
    """Remove the probe folders under ``root`` (default: the temp dir) whose owner process is gone
    (a parent and child killed together). Returns the folders removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        owner = folder_owner(name)
        path = os.path.join(root, name)
        if owner is None or process_alive(*owner) or not os.path.isdir(path):
            continue
        remove_temp_folder(path)
        if not os.path.exists(path):
            removed.append(path)
    return removed


# ------------------------------------------------------------------------------------ signals

@contextmanager
def _sigterm_raises():
    """While a probe runs: SIGTERM raises :class:`_Terminated` in the main thread (elsewhere Python
    cannot install handlers: the caller's own handling stands). The old handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def _signals_held():
    """While an interrupted probe kills its child and builds its result: a second Ctrl-C or SIGTERM
    is ignored, so the cleanup and the result cannot be cut short (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------- the probe

def run_probe(model: str | ModelSource, quant: str = "auto", ctx: int = 512, batch: int = 1, *,
              device: str = "cpu", synthetic: bool = False, interval_ms: float = 5.0, dtype: str | None = None,
              attn: str = "auto", with_estimate: bool = True, keep_samples: bool = True,
              command: str | None = None, timeout_s: float | None = None, on_event=None,
              new_tokens: int = NEW_TOKENS, journal: Callable[[dict], None] | None = None,
              kv_dtype: str = "auto", cache: str = "dynamic", max_memory: dict | str | None = None,
              device_map: str | None = None) -> ProbeResult:
    """Probe ``model`` (anything ``vramcal estimate`` accepts): a prompt of ``ctx - new_tokens`` tokens,
    then exactly ``new_tokens`` generated.

    ``max_memory`` / ``device_map``: load split across devices as ``from_pretrained`` would (see
    :func:`_placed_load`); every GPU of the map is sampled, and the child's resident set for the CPU
    share (``ProbeResult.devices``).

    ``on_event(event_dict, child_pid)`` is called for each event the child streams, as sent (progress
    display; tests use it to kill the child).

    ``journal(event_dict)``, if given, is called in the parent as the run goes, so a caller can append
    each event to a file and rebuild a result with :func:`recover` if the parent is killed. Events, all
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
    work = workload(ctx, batch, new_tokens)
    ctx, batch, new_tokens = work.ctx, work.batch, work.new_tokens
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    spec = resolve_quant(quant, source.config, dtype)
    series, notes, placed = preflight(source, spec, device, synthetic, interval_ms, kv_dtype, cache, max_memory,
                                      device_map)
    if placed is not None:
        device = placed["main_device"]

    identity = {"device": device, "model": source.name, "quant": spec.name,
                "quant_implementation": spec.implementation, "dtype": spec.dtype, "ctx": ctx, "batch": batch,
                "attn": attn, "new_tokens": new_tokens, "series": series, "interval_ms": float(interval_ms),
                "command": command or Configuration(source.ref, work, quant=quant, device=device, dtype=dtype,
                                                    kv_dtype=kv_dtype, attn=attn, cache=cache,
                                                    synthetic=synthetic, max_memory=max_memory,
                                                    device_map=device_map).command("probe"),
                "estimate": None, "placement": placed["plan"] if placed else None}
    gpus = [_cuda_index(g) for g in placed["gpus"]] if placed else None
    probe = _Probe(identity, interval_ms / 1000.0, timeout_s, on_event, journal, notes, gpus)
    with _sigterm_raises():
        try:
            if with_estimate:
                identity["estimate"] = _estimate_or_note(source, quant, work, dtype, attn, device, kv_dtype,
                                                         cache, notes, max_memory, device_map)
            child_spec = {"device": device, "dtype": spec.dtype, "ctx": ctx, "batch": batch,
                          "bnb": None if spec.pre_quantized else spec.bnb_config_kwargs(), "attn": attn,
                          "new_tokens": new_tokens, "kv_dtype": kv_dtype, "cache": cache}
            if placed is not None:
                child_spec.update(load=placed["load"], gpus=placed["gpus"])
            probe.run(source, synthetic, child_spec)
        except KeyboardInterrupt as exc:
            name = "SIGTERM" if isinstance(exc, _Terminated) else "SIGINT"
            with _signals_held():
                probe.close()
                result = probe.result(interrupted=name, keep_samples=keep_samples)
            raise ProbeInterrupted(result, name) from None
        finally:
            probe.close()
    return probe.result(keep_samples=keep_samples)


def preflight(source: ModelSource, spec, device: str, synthetic: bool, interval_ms: float = 5.0,
              kv_dtype: str = "auto", cache: str = "dynamic", max_memory=None, device_map: str | None = None
              ) -> tuple[str | None, list[str], dict | None]:
    """Everything a probe needs, checked before anything runs or is recorded: the sampled series, notes
    and the placement it loads with (None on one device), or a one-line UserError."""
    from ..workload import CACHES, KV_DTYPES, choice

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
        raise UserError(f"{source.name} has no *.safetensors weights here: add --synthetic to probe random "
                        "weights at its real widths")
    return series, notes, placed


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


def _estimate_or_note(source, quant, work, dtype, attn, device, kv_dtype, cache, notes, max_memory=None,
                      device_map=None) -> dict | None:
    from ..estimator.estimate import estimate as _estimate

    try:
        return _estimate(source, quant, batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens,
                         dtype=dtype, attn=attn, kv_dtype=kv_dtype, cache=cache,
                         device="cpu" if device == "cpu" else "cuda", max_memory=max_memory,
                         device_map=device_map).to_dict()
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
        self.log = None
        self.log_tail = ""
        self.journaled = 0  # samples already handed to the journal
        self.journal_t = 0.0
        self.timed_out = False

    # -- processes

    def _spawn(self, args: list[str], **kwargs) -> subprocess.Popen:
        # a session of its own: the terminal's Ctrl-C reaches the parent only; the group is killed below
        proc = subprocess.Popen(args, start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _wait_exited(proc: subprocess.Popen, timeout: float | None) -> bool:
        """Wait until ``proc`` has exited, without reaping it: while it is a zombie its pid, and so its
        process group id, cannot be reused, and :meth:`_kill` can still kill what is left of the group."""
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

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """Kill ``proc``'s process group (it leads one: ``start_new_session``) and reap ``proc``. Only
        while not reaped: the group id is the leader's pid, free for reuse once the leader is reaped."""
        if proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # stuck in the driver: nothing more a parent can do
            pass

    def close(self) -> None:
        for proc in self.procs:
            self._kill(proc)
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
            self._kill(proc)  # reaps it, and takes anything it left in its group
            if proc.returncode != 0:
                log.seek(0)
                tail = ([ln for ln in log.read().splitlines() if ln.strip()] or ["?"])[-1]
                raise UserError(f"could not write synthetic weights for {source.name}: {tail}")
        return model_dir

    def _run_child(self, child_spec: dict) -> None:
        read_fd, write_fd = os.pipe()
        self.log = tempfile.TemporaryFile(mode="w+")
        try:
            self.start = time.monotonic()
            self.child = self._spawn([sys.executable, "-m", "vramcal.probes.child", json.dumps(child_spec),
                                      str(write_fd)], pass_fds=(write_fd,), stdout=self.log, stderr=self.log)
        finally:
            os.close(write_fd)
        try:
            if self.series == "rss":
                reader = rss_reader(self.child.pid)
            elif self.series is not None and self.gpus:
                gpu_read, ram_read = nvml_reader(self.gpus, self.child.pid), rss_reader(self.child.pid)

                def reader():
                    return {**gpu_read(), **ram_read()}
            elif self.series is not None:
                reader = nvml_reader([_cuda_index(self.identity["device"])], self.child.pid)
            else:
                reader = None
            self.sampler = Sampler(reader, self.interval_s).start() if reader else None
            self._journal({"event": "start", "parent_pid": os.getpid(), "child_pid": self.child.pid,
                           "monotonic_start": self.start, **self.identity})
            self.journal_t = time.monotonic()
            self._read_events(read_fd)
        finally:
            os.close(read_fd)
        if not self.timed_out and not self._wait_exited(self.child, 60.0):  # closed its pipe, does not exit
            self.notes.append("the child did not exit within 60 s of its last event: killed")
        self.close()
        self._flush_samples()

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
        if kind in ("stage", "oom", "error", "done"):
            self._flush_samples()
            self._journal({**ev, "t": round(ev["t"] - self.start, 6)})
        if self.on_event is not None:
            self.on_event(ev, self.child.pid)

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
            self.journal({"event": "samples", "samples": [_sample_dict(s, self.start) for s in new]})

    # -- the result

    def result(self, interrupted: str | None = None, keep_samples: bool = True) -> ProbeResult:
        if self.start is None:  # stopped before the child existed
            d = _assemble(self.series, [], {}, None, [], self.created, self.end_t or time.monotonic(), None, "",
                          interrupted)
        else:
            d = _assemble(self.series, self.markers, self.reported, self.final,
                          self.sampler.samples if self.sampler else [], self.start, self.end_t,
                          self.child.returncode if self.child else None, self.log_tail, interrupted)
        d["notes"] = self.notes + d["notes"]
        if self.gpus and self.series and self.start is not None:
            d["devices"] = _device_stages(self.sampler.samples if self.sampler else [], self.markers,
                                          self.reported, self.gpus)
        if self.sampler is not None:
            d["sampler_overhead"] = self.sampler.overhead
            if self.sampler.error:
                d["notes"].append(f"sampler stopped early: {self.sampler.error}")
        if not keep_samples:
            d["samples"] = []
        return ProbeResult(**{**self.identity, **d})


def _device_stages(samples, markers, reported: dict, gpus: list[int]) -> dict[str, dict]:
    """Stages per device of a placed run: each GPU's NVML series as read, and for ``cpu`` the child's
    resident set by the readings' rule (minus its baseline: what loading put in RAM, the offloaded
    weights), with the child's own reading at each marker."""
    out = {}
    for i in gpus:
        st = attribute(samples, markers, f"gpu{i}")
        out[f"cuda:{i}"] = {k: st[k] for k in STAGE_ORDER if k in st}
    st = attribute(samples, markers, "rss")
    for name, info in reported.items():  # the child's own reading at the marker is exact
        if name in st and info.get("rss") is not None:
            st[name]["used_bytes"] = info["rss"]
            st[name]["peak_bytes"] = max(v for v in (st[name].get("peak_bytes"), info["rss"]) if v is not None)
    readings = {k: StageReading.from_stage(k, "rss", st[k]) for k in STAGE_ORDER if k in st}
    out["cpu"] = {k: {"used_bytes": r.used_bytes, "peak_bytes": r.peak_bytes, "samples": st[k].get("samples")}
                  for k, r in comparable(readings, "rss").items()}
    return out


def _sample_dict(s: Sample, start: float) -> dict:
    return {"t": round(s.t - start, 6), **s.values, **({"missing": s.missing} if s.missing else {})}


def _assemble(series: str | None, markers: list[tuple[str, float]], reported: dict[str, dict], final: dict | None,
              samples: list[Sample], start: float, end_t: float, rc: int | None, log_tail: str,
              interrupted: str | None) -> dict:
    """The measured fields of a ProbeResult from what a run gathered; all times on one clock, ``start``
    its zero. ``interrupted``: the signal (or reason) that stopped the parent, if one did."""
    if final is not None:
        status = {"done": "ok", "oom": "oom", "error": "error"}[final["event"]]
    else:
        status = "interrupted" if interrupted else "crashed"
    # a run that stopped: attribute what was sampled after the last marker to the stage it was in
    markers_for_attr = markers + [("_unfinished", end_t)] if status != "ok" and samples else markers
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
    last = markers[-1][0] if markers else None
    oom = None
    error = None
    if status == "oom":
        oom = {"stage": final.get("stage"), "requested_bytes": final.get("requested_bytes"),
               "message": final.get("message")}
    elif status == "error":
        error = final.get("message")
    elif status == "crashed":
        error = f"child exited with {_describe_rc(rc)} after stage {last or 'none'}" + (
            f" ({log_tail})" if log_tail else "")
    elif status == "interrupted":
        where = f"after stage {last}" if last else ("before the first stage" if samples or reported else
                                                    "before the child started")
        error = f"interrupted by {interrupted} {where}"
    in_flight = None
    if status != "ok" and (unfinished is not None or status == "interrupted"):
        in_flight = {"stage": (final or {}).get("stage") or _next_stage(markers, gpu=series != "rss"),
                     "peak_bytes": (unfinished or {}).get("peak_bytes"),
                     "samples": (unfinished or {}).get("samples", 0)}
    return {
        "status": status, "series": series,
        "stages": {k: stages[k] for k in STAGE_ORDER if k in stages},
        "last_stage": last, "oom": oom, "error": error,
        "sample_count": len(samples),
        "samples": [_sample_dict(s, start) for s in samples],
        "sampler_overhead": None, "wall_s": round(end_t - start, 3), "notes": [], "exit_code": rc,
        "unfinished": in_flight,
    }


def recover(events: Iterable[dict]) -> ProbeResult | None:
    """A result rebuilt from a probe's ``journal`` events (see :func:`run_probe`), for a parent that was
    killed before its result was recorded: status ``interrupted`` (or the child's own, if it said how
    it ended), the last stage, the stages and samples so far. None when the journal has no ``start``
    event (the child never started: nothing was measured)."""
    identity = None
    markers: list[tuple[str, float]] = []
    reported: dict[str, dict] = {}
    final = None
    samples: list[Sample] = []
    last_t = 0.0
    for ev in events:
        kind = ev.get("event")
        if kind == "start":
            identity = {k: ev.get(k) for k in ("device", "model", "quant", "quant_implementation", "dtype", "ctx",
                                                "batch", "attn", "new_tokens", "series", "interval_ms", "command",
                                                "estimate", "placement")}
        elif kind == "samples":
            for s in ev["samples"]:
                values = {k: v for k, v in s.items() if k not in ("t", "missing")}
                samples.append(Sample(s["t"], values, s.get("missing") or {}))
                last_t = max(last_t, s["t"])
        elif kind == "stage":
            markers.append((ev["name"], ev["t"]))
            reported[ev["name"]] = {k: v for k, v in ev.items() if k not in ("event", "name")}
            last_t = max(last_t, ev["t"])
        elif kind in ("oom", "error", "done"):
            final = ev
            last_t = max(last_t, ev.get("t", last_t))
    if identity is None:
        return None
    d = _assemble(identity["series"], markers, reported, final, samples, 0.0, last_t, None, "",
                  "the end of the parent process")
    if d["status"] == "interrupted":
        d["error"] = (f"the probe's parent ended after stage {d['last_stage'] or 'none'}: "
                      "rebuilt from its journal")
    d["notes"].append("rebuilt from the journal of a parent that ended before finishing its record")
    return ProbeResult(**{**identity, **d})


def _next_stage(markers, gpu: bool) -> str | None:
    done = {m for m, _ in markers}
    for name in STAGE_ORDER:
        if name not in done and (gpu or name != "context"):
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
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"
