"""A sampling thread on a timer, and the pure functions that turn samples into stages.

The thread calls a *reader* every ``interval_s`` (default 5 ms) on a drift-free schedule. A reader
returns ``{series name: bytes or NA}``: NVML ``memory.used`` per GPU (:func:`nvml_reader`) or a
process's resident set (:func:`rss_reader`). Measuring is only in readers; samples are plain data.
The thread's own CPU time is measured (``thread_time``) so its cost can be reported.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from . import nvml
from .nvml import NA

_NO_MISSING: dict[str, str] = {}


class Sample(NamedTuple):
    """One reading. A NamedTuple, not a dataclass: 200 of these a second must cost next to nothing."""

    t: float  # time.monotonic(), shared by parent and child on one machine
    values: dict[str, int | None]
    missing: dict[str, str] = _NO_MISSING  # series -> why it could not be read


class Sampler:
    def __init__(self, read: Callable[[], dict[str, int | NA]], interval_s: float = 0.005):
        if interval_s <= 0:
            raise ValueError("the sampling interval must be positive")
        self.read = read
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cpu_seconds = 0.0
        self.wall_seconds = 0.0
        self.error: str | None = None

    def sample_now(self) -> Sample:
        t = time.monotonic()
        raw = self.read()
        if any(isinstance(v, NA) for v in raw.values()):
            s = Sample(t, {k: (None if isinstance(v, NA) else v) for k, v in raw.items()},
                       {k: v.reason for k, v in raw.items() if isinstance(v, NA)})
        else:
            s = Sample(t, raw)
        self.samples.append(s)
        return s

    def _run(self) -> None:
        start_cpu = time.thread_time()
        start = time.monotonic()
        nxt = start
        stop, sample, sleep, now = self._stop, self.sample_now, time.sleep, time.monotonic
        try:
            # time.sleep, not Event.wait: a condition variable per tick costs more than the reading;
            # stop() is seen within one interval
            while not stop.is_set():
                sample()
                nxt += self.interval_s
                delay = nxt - now()
                if delay > 0:
                    sleep(delay)
                else:  # fell behind (a slow read): skip missed ticks rather than burst
                    nxt = now()
        except Exception as exc:  # a reader that breaks ends sampling, and says why
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.cpu_seconds = time.thread_time() - start_cpu
            self.wall_seconds = time.monotonic() - start

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="vramcal-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def overhead(self) -> float | None:
        """The thread's CPU time as a fraction of one core over its life."""
        return self.cpu_seconds / self.wall_seconds if self.wall_seconds else None


# ------------------------------------------------------------------------------------- readers

def rss_reader(pid: int) -> Callable[[], dict[str, int | NA]]:
    """Resident set of ``pid`` from ``/proc/PID/statm`` (one pread per sample), psutil elsewhere."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    try:
        fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
    except OSError:
        fd = None
    if fd is not None:
        gone = {"rss": NA("process has exited")}

        def read_statm():
            try:
                data = os.pread(fd, 128, 0)
            except OSError:
                return gone
            if not data:
                return gone
            return {"rss": int(data.split()[1]) * page}

        return read_statm
    import psutil

    proc = psutil.Process(pid)

    def read():
        try:
            return {"rss": proc.memory_info().rss}
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return {"rss": NA("process has exited")}
        except psutil.AccessDenied:
            return {"rss": NA("access denied")}

    return read


def nvml_reader(indices: list[int], pid: int | None = None) -> Callable[[], dict[str, int | NA]]:
    """memory.used of each GPU in ``indices`` (``gpu0`` ...) and, if ``pid``, that process's share."""

    def read():
        out: dict[str, int | NA] = {}
        for i in indices:
            h = nvml.device_handle(i)
            out[f"gpu{i}"] = nvml.memory_used(h)
            if pid is not None:
                out[f"gpu{i}_proc"] = nvml.process_used(h, pid)
        return out

    return read


# ----------------------------------------------------------------------------- stage attribution

def attribute(samples: list[Sample], markers: list[tuple[str, float]], series: str) -> dict[str, dict]:
    """For each marker (name, t) in order: the peak of ``series`` over the interval that ends at the
    marker (after the previous one) and the last value read at or before the marker."""
    out: dict[str, dict] = {}
    ordered = sorted(samples, key=lambda s: s.t)
    prev_t = float("-inf")
    for name, t in markers:
        window = [s.values.get(series) for s in ordered if prev_t < s.t <= t]
        window = [v for v in window if v is not None]
        before = [s for s in ordered if s.t <= t and s.values.get(series) is not None]
        out[name] = {"peak_bytes": max(window) if window else None,
                     "used_bytes": before[-1].values[series] if before else None,
                     "samples": len(window)}
        prev_t = t
    return out
