"""How a probe's processes live and end: process identity, temporary folders, signals.

- **Identity** (:func:`process_alive`): a pid and its start time, read through psutil, so a later
  process that reuses a pid (after the first ended, or after a reboot) is not taken for it.
- **Temporary folders** are named ``vramcal-probe-PID-START-*`` (the parent's pid and start time in
  hundredths of a second); every probe first removes those whose parent is gone (:func:`sweep_stale`),
  so even a folder left by a parent and child killed together does not outlive the next probe.
- **Signals** (each a use of :func:`vramcal.interrupts.noted`): while a probe runs, SIGTERM raises in the
  main thread like Ctrl-C does (:func:`sigterm_raises`); while a child is started, a signal waits until
  the child is held, to be killed with its group (:func:`signals_deferred`); while a probe cleans up, on
  every way out, a signal waits and the run then ends as it asks (:func:`signals_held`).
  :class:`ProbeInterrupted` carries what was measured to the caller.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile

from ..interrupts import Terminated, noted  # noqa: F401 (Terminated re-exported: the probe's SIGTERM)
from .child import TEMP_PREFIX, remove_temp_folder

_FOLDER = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-(\d+)-")


class ProbeInterrupted(KeyboardInterrupt):
    """A probe stopped by SIGINT (Ctrl-C) or SIGTERM in the parent, after its child was killed.

    ``result`` is what was measured: status ``interrupted`` with the last stage, the stages so far, the
    samples and ``unfinished`` (unless the child had finished before the signal: then its own status
    stands). Record it, then exit with :attr:`exit_code`. A ``KeyboardInterrupt``, so that
    ``except Exception`` never swallows it and a caller that knows only KeyboardInterrupt still stops."""

    def __init__(self, result, signal_name: str):
        super().__init__(f"probe interrupted by {signal_name}")
        self.result = result
        self.signal_name = signal_name

    @property
    def exit_code(self) -> int:
        return 128 + int(signal.Signals[self.signal_name])


# ---------------------------------------------------------------------------- process identity

def start_time(pid: int) -> int | None:
    """When ``pid`` started, in hundredths of a second since the epoch (psutil's ``create_time``);
    None when there is no such process or it cannot be read."""
    import psutil

    try:
        return int(round(psutil.Process(pid).create_time() * 100))
    except (psutil.Error, OSError):
        return None


def process_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` exists and, when ``start`` (:func:`start_time`) is given, is the same
    process rather than a later one that reused the pid."""
    import psutil

    try:
        if not psutil.pid_exists(pid):
            return False
    except (psutil.Error, OSError):
        return False
    if not start:
        return True
    now = start_time(pid)
    return now is None or abs(now - start) <= 1


# --------------------------------------------------------------------------- temporary folders

def folder_owner(path: str) -> tuple[int, int] | None:
    """(pid, start time) encoded in a probe's temporary folder name, or None for another name."""
    m = _FOLDER.match(os.path.basename(os.path.normpath(path)))
    return (int(m.group(1)), int(m.group(2))) if m else None


def make_temp_folder(root: str | None = None) -> str:
    """A new ``vramcal-probe-PID-START-*`` folder under ``root`` (default: the temp dir) for this process."""
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{pid}-{start_time(pid) or 0}-", dir=root)


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
# Three uses of the one mechanism, :func:`vramcal.interrupts.noted`; each says what a probe needs there.

def sigterm_raises():
    """While a probe runs: SIGTERM raises :class:`Terminated` in the main thread, as Ctrl-C raises
    ``KeyboardInterrupt`` (elsewhere Python cannot install handlers: the caller's own handling stands).
    The old handler comes back after. As for every noted signal: a handler the caller installed from
    Python runs instead of the raise (the probe still notes the SIGTERM and ends terminated when it next
    checks), and an ignored SIGTERM stays ignored.

    Yields the :class:`~vramcal.interrupts.Noted`. A ``Terminated`` can be swallowed where the main thread
    happens to be (a finalizer, a library's bare ``except:``, an import that clears the error it met), as
    a Ctrl-C can: the probe calls ``.check()`` after each step it cannot trust and ends as terminated, with
    its record, all the same."""
    return noted(signal.SIGTERM, leaving="ask")


def signals_held():
    """While a probe kills its child and gathers what it measured, on every way out: SIGINT and SIGTERM
    are noted and wait, so the cleanup cannot be cut short. Yields the
    :class:`~vramcal.interrupts.Noted`: a run that was ending normally ends as the first signal asks once
    the cleanup is done (interrupted, or its own status if the child had finished, then exit 130 / 143);
    a run already interrupted keeps the signal that interrupted it."""
    return noted(signal.SIGINT, signal.SIGTERM, hold=True, leaving="ask")


def signals_deferred():
    """Around ``subprocess.Popen``: SIGINT and SIGTERM wait until the call has returned and its process is
    held, then act as they would have (sent again once the old handlers are back). Raised inside the call,
    they would leave a child forked, leading its own process group, that nobody holds and so nobody kills.
    Handlers only, never the signal mask (the sampler thread exists, and the child must get SIGTERM and
    SIGINT as usual)."""
    return noted(signal.SIGINT, signal.SIGTERM, hold=True, leaving="deliver")


def kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s process group (it leads one: ``start_new_session``; vLLM's workers of tp > 1 are in
    it) and reap ``proc``. Only while not reaped: the group id is the leader's pid, free for reuse once
    the leader is reaped."""
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
