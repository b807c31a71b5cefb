"""One runner for the engine probes (vLLM, llama.cpp): start the engine's child module in a process group
of its own, sample memory from outside while it streams stage markers over a pipe, and come back with what
ran -- the markers, how it ended, the engine's log and the samples -- as one :class:`ChildRun`.

Each engine gives only what differs: the child module, its settings, its environment and the reader
that samples it (NVML ``memory.used`` of its GPUs, or the child's resident set). Every way out (the end,
a timeout, Ctrl-C, SIGTERM) kills the child's group before it returns. A Ctrl-C or SIGTERM in the parent
does not propagate from here: the run comes back ``interrupted`` with its last stage and its samples, the
caller records it, then raises :class:`~.lifecycle.ProbeInterrupted` (exit 130 / 143), as the
transformers probe does. A signal while the child is being started waits until ``Popen`` has returned,
so the child is held and killed like any other (:func:`~.lifecycle.signals_deferred`); one during the
cleanup waits until the cleanup is done, then the run comes back stopped by it all the same
(:func:`~.lifecycle.signals_held`): ``interrupted``, or, when the child had already finished, its own
status with ``interrupted`` set, so the caller records a whole measurement and still exits 130 / 143.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from ..interrupts import signal_of
from .lifecycle import kill_group, signals_deferred, signals_held, sigterm_raises
from .sampler import Sampler, attribute

ENDINGS = {"done": "ok", "oom": "oom", "error": "error", "timeout": "timeout"}  # else: crashed


@dataclass
class ChildRun:
    markers: list[tuple[str, float]]  # (stage, monotonic time) as the child emitted them
    final: dict | None  # the child's last done / oom / error event, or the timeout; None if it died
    log_text: str  # everything the child (and the engine inside it) wrote to stdout and stderr
    wall_s: float
    samples: list = field(default_factory=list)
    sampler_overhead: float | None = None
    interrupted: str | None = None  # SIGINT / SIGTERM when the parent was stopped before the child ended

    @property
    def status(self) -> str:
        if self.interrupted and (self.final or {}).get("event") != "done":
            return "interrupted"
        return ENDINGS.get((self.final or {}).get("event"), "crashed")

    @property
    def error(self) -> str | None:
        if self.status == "interrupted":
            return f"interrupted by {self.interrupted} after stage {self.last_stage or 'none'}"
        return (self.final or {}).get("error")

    @property
    def last_stage(self) -> str | None:
        return self.markers[-1][0] if self.markers else None

    @property
    def log_tail(self) -> str:
        lines = [ln for ln in self.log_text.splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""

    def stages(self, series: str) -> dict[str, dict]:
        return stage_readings(self.samples, self.markers, series)


def stage_readings(samples, markers: list[tuple[str, float]], series: str) -> dict[str, dict]:
    """Each marker's reading of ``series``: the last value at the marker and the peak since the one before
    (:func:`.sampler.attribute`), as the run's stage rows take them."""
    if not samples:
        return {}
    return {k: {"used_bytes": v["used_bytes"], "peak_bytes": v["peak_bytes"]}
            for k, v in attribute(samples, markers, series).items()}


def run_child(module: str, spec: dict, reader_for: Callable[[int], Callable], *, env: dict[str, str],
              interval_ms: float, timeout_s: float | None) -> ChildRun:
    """Run ``python -m module SPEC_JSON FD`` (``spec`` gains ``parent_pid``), sampling it with
    ``reader_for(child_pid)`` every ``interval_ms``; the child's stage / done / oom / error events come
    over the pipe FD, one JSON object a line."""
    read_fd, write_fd = os.pipe()
    log = tempfile.TemporaryFile(mode="w+")
    start = time.monotonic()
    markers: list[tuple[str, float]] = []
    final: dict | None = None
    child = sampler = interrupted = None
    with sigterm_raises() as terminated:
        try:
            try:
                with signals_deferred():  # a signal waits until the child is held, to be killed below
                    child = subprocess.Popen([sys.executable, "-m", module,
                                              json.dumps({**spec, "parent_pid": os.getpid()}), str(write_fd)],
                                             pass_fds=(write_fd,), stdout=log, stderr=log,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
            finally:
                os.close(write_fd)
            sampler = Sampler(reader_for(child.pid), interval_ms / 1000.0).start()
            buf = b""
            while True:
                terminated.check()  # a Terminated something swallowed: end now, not when the child ends
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
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM through sigterm_raises: recorded by the caller
            interrupted = signal_of(exc)
        finally:
            with signals_held() as late:  # the cleanup is not cut short: a signal in it waits
                os.close(read_fd)
                if child is not None:
                    kill_group(child)
                if sampler is not None:
                    sampler.stop()
                log.seek(0)
                text = log.read()
                log.close()
        # a signal during the cleanup ends the run as one before it would; so does a Terminated swallowed
        interrupted = interrupted or late.name or terminated.name
    return ChildRun(markers=markers, final=final, log_text=text, wall_s=time.monotonic() - start,
                    samples=sampler.samples if sampler else [],
                    sampler_overhead=sampler.overhead if sampler else None, interrupted=interrupted)


def report_failure(emit, exc: BaseException) -> int:
    """In an engine's child: the exception that ended it as its last event (oom when the text says so), exit 1."""
    text = str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__
    emit("oom" if "out of memory" in text.lower() else "error", error=f"{type(exc).__name__}: {text}")
    return 1
