"""Signals at the edges of a run, where they used to be lost: while a probe's child is being started
(inside ``subprocess.Popen``) and while a run that was ending normally cleans up. Either way the run is
recorded, the child is killed with its group, and the command exits 130 (SIGINT) / 143 (SIGTERM).

The signal is sent to this very process at the exact point (``os.kill`` from inside ``Popen``, or from
inside the cleanup's ``kill_group``), so nothing here depends on timing. And the one mechanism behind it,
:func:`vramcal.interrupts.noted`, on its own."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from vramcal import cli, interrupts
from vramcal.interrupts import Terminated, noted
from vramcal.probes import engine_run
from vramcal.probes.lifecycle import signals_deferred, signals_held, sigterm_raises
from vramcal.records.store import Store

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed (pip install 'vramcal[llamacpp]')")
SIGNALS = [(signal.SIGTERM, 143), (signal.SIGINT, 130)]


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt here, as in a terminal (a suite started in the background of a
    non-interactive shell has it ignored); put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """TMPDIR in the test's folder, so a probe folder left behind is seen."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    return tmp_path


@pytest.fixture
def started():
    """The pids of children the test's Popen started; any still alive at the end is killed (a test that
    fails must not leave a child behind)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if not _gone(pid):  # each leads its own process group, as a probe's child does
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _gone(pid: int) -> bool:
    """Whether ``pid`` is gone (or a zombie nobody needs any more); no waiting: the probe kills and reaps
    its child's group before it returns."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _signal_inside_popen(monkeypatch, started: list[int], sig: int, module: str) -> None:
    """``subprocess.Popen`` of ``module``'s child gets ``sig`` delivered inside the call, after the fork:
    where a signal that acted at once used to leave the child running, held by nobody."""
    real = subprocess.Popen

    def popen(args, *a, **kw):
        proc = real(args, *a, **kw)
        if module in args and "write-synthetic" not in args:
            started.append(proc.pid)
            os.kill(os.getpid(), sig)  # Python runs its handler at the next instruction: still in here
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)


def _signal_in_cleanup(monkeypatch, target, sig: int) -> list[int]:
    """``sig`` to this process once, from inside the first ``kill_group`` of ``target``'s cleanup."""
    real = target.kill_group
    sent: list[int] = []

    def kill_group(proc):
        if not sent:
            sent.append(proc.pid)
            os.kill(os.getpid(), sig)
        real(proc)

    monkeypatch.setattr(target, "kill_group", kill_group)
    return sent


# ------------------------------------------------------------------------------------ the mechanism

def test_a_deferred_signal_acts_when_the_body_ends_and_the_child_gets_signals_as_usual(started):
    """signals_deferred notes a SIGTERM inside the body and raises nothing there; on leaving the signal is
    sent again to the handler that was there (here the probe's: Terminated). Handlers only: the child
    started inside neither blocks nor ignores SIGTERM and SIGINT, and dies of a SIGTERM as usual."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with sigterm_raises() as terminated:
            with signals_deferred() as deferred:
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                started.append(child.pid)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0)  # the handler has run by now, and raised nothing
                assert deferred.name == "SIGTERM" and not terminated()
    assert terminated() and signal.getsignal(signal.SIGTERM) is before
    with open(f"/proc/{child.pid}/status") as fh:
        masks = {k: int(v, 16) for k, v in (line.split(":\t") for line in fh) if k in ("SigBlk", "SigIgn")}
    for sig in (signal.SIGTERM, signal.SIGINT):
        assert not masks["SigBlk"] & (1 << (sig - 1)) and not masks["SigIgn"] & (1 << (sig - 1)), masks
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM


def test_a_held_signal_waits_and_is_asked_for():
    """signals_held: noted, nothing raised, the caller asks; both handlers come back."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with signals_held() as late:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0)
    assert late.name == "SIGTERM" and late.signals == [signal.SIGTERM, signal.SIGINT]
    with pytest.raises(Terminated):
        late.check()
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_command_and_the_probe_note_through_one_mechanism(python_sigint):
    """sigint_noted (raise on leaving) and sigterm_raises (the caller asks) are uses of noted(): a swallowed
    SIGINT ends the body as KeyboardInterrupt on leaving; a swallowed SIGTERM is there to ask for."""
    with pytest.raises(KeyboardInterrupt):
        with interrupts.sigint_noted() as interrupted:
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass
            assert interrupted()
    with sigterm_raises() as terminated:
        try:
            signal.raise_signal(signal.SIGTERM)
        except Terminated:
            pass
    assert terminated.name == "SIGTERM"
    with noted(signal.SIGTERM, leaving="raise") as plain:  # nothing noted: nothing raised
        pass
    assert not plain()


# ------------------------------------------------------------------------- an engine probe (llama.cpp)

@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_gguf import write_tiny

    return write_tiny(tmp_path_factory.mktemp("g") / "dense.gguf")


def _llamacpp_probe(gguf, db, capsys) -> tuple[int, str, str]:
    """``vramcal probe --engine llama.cpp ... --json`` here: exit code, stdout, stderr."""
    rc = cli.main(["probe", "--engine", "llama.cpp", gguf, "-c", "1024", "--device", "cpu", "--db", str(db),
                   "--json"])
    return rc, *capsys.readouterr()


@needs_llama
@pytest.mark.parametrize("sig,code", SIGNALS)
def test_a_signal_while_the_engine_child_starts_kills_it_and_records_the_run(
        tmp_path, gguf, capsys, monkeypatch, started, python_sigint, sig, code):
    """A signal inside run_child's Popen waits until the call returns: the child is held, its group
    killed, the run recorded as interrupted, and the exit is 143 / 130 (it was: the child left running,
    the run closed without an outcome of its own, and 130 for a SIGTERM too)."""
    _signal_inside_popen(monkeypatch, started, sig, "vramcal.probes.llamacpp_child")
    name = signal.Signals(sig).name
    rc, out, err = _llamacpp_probe(gguf, tmp_path / "r.db", capsys)
    [pid] = started
    assert _gone(pid), "the child started as the signal came outlived the probe"
    assert rc == code, err[-2000:]
    assert err.strip().splitlines()[-1] == f"vramcal: probe interrupted by {name}"
    doc = json.loads(out)
    assert doc["status"] == "interrupted" and doc["interrupted"] == name and doc["last_stage"] is None
    with Store(str(tmp_path / "r.db")) as s:
        run = s.run(doc["run_id"])
    assert run.outcome is not None and run.outcome.status == "interrupted"
    assert run.outcome.last_stage is None and run.outcome.error == f"interrupted by {name} after stage none"


@needs_llama
@pytest.mark.parametrize("sig,code", SIGNALS)
def test_a_signal_during_the_engine_cleanup_still_ends_the_run(tmp_path, gguf, capsys, monkeypatch, python_sigint,
                                                                sig, code):
    """The child finished; a signal comes while its group is killed. It waits for the cleanup, then ends
    the command as the signal asks: the whole measurement is recorded (ok, last stage end) and the exit
    is 143 / 130 (it was: the signal dropped, exit 0 as if none had come)."""
    sent = _signal_in_cleanup(monkeypatch, engine_run, sig)
    name = signal.Signals(sig).name
    rc, out, err = _llamacpp_probe(gguf, tmp_path / "r.db", capsys)
    assert sent and rc == code, err[-2000:]
    assert err.strip().splitlines()[-1] == f"vramcal: probe interrupted by {name}"
    assert _gone(sent[0])
    doc = json.loads(out)
    assert doc["status"] == "ok" and doc["interrupted"] == name and doc["last_stage"] == "end"
    with Store(str(tmp_path / "r.db")) as s:
        run = s.run(doc["run_id"])
    assert run.outcome.status == "ok" and run.outcome.last_stage == "end" and run.sample_count > 0


# --------------------------------------------------------------------------------- a transformers probe

@pytest.fixture(scope="module")
def dense(tiny_models):
    return tiny_models["dense-gqa"]


def _check(dense, db, capsys) -> tuple[int, str]:
    rc = cli.main(["check", dense, "--ctx", "64", "--new-tokens", "4", "--device", "cpu", "--db", str(db),
                   "--budget", "64GiB"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("sig,code", SIGNALS)
def test_a_signal_while_the_transformers_child_starts_kills_it_and_records_the_run(
        own_tmp, dense, capsys, monkeypatch, started, python_sigint, sig, code):
    """The same for the transformers probe's child (probe._Probe._spawn): it used to be left running, held
    by nobody, its temporary folder removed under it."""
    _signal_inside_popen(monkeypatch, started, sig, "vramcal.probes.child")
    name = signal.Signals(sig).name
    rc, err = _check(dense, own_tmp / "r.db", capsys)
    assert rc == code, err[-2000:]
    [pid] = started
    assert _gone(pid), "the child started as the signal came outlived the probe"
    assert not [n for n in os.listdir(own_tmp) if n.startswith("vramcal-probe-")]
    with Store(str(own_tmp / "r.db")) as s:
        [row] = s.runs()
        run = s.run(row["id"])
    assert run.outcome is not None and run.outcome.status == "interrupted" and run.outcome.last_stage is None
    assert run.outcome.error.startswith(f"interrupted by {name} ")
    assert run.outcome.result["exit_code"] == -signal.SIGKILL  # held, so killed with its group
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize("sig,code", SIGNALS)
def test_a_signal_during_the_transformers_cleanup_still_ends_the_run(own_tmp, dense, capsys, monkeypatch,
                                                                     python_sigint, sig, code):
    """The transformers probe cleans up under sigterm_raises (and Python's own SIGINT handler): a signal
    there ends the run as the engine probes' does -- the finished measurement recorded ok, exit 143 / 130. (It
    did before the engine probes learnt it: this keeps the two alike.)"""
    from vramcal.probes import probe

    sent = _signal_in_cleanup(monkeypatch, probe, sig)
    rc, err = _check(dense, own_tmp / "r.db", capsys)
    assert sent and rc == code, err[-2000:]
    assert _gone(sent[0]) and not [n for n in os.listdir(own_tmp) if n.startswith("vramcal-probe-")]
    with Store(str(own_tmp / "r.db")) as s:
        [row] = s.runs()
        run = s.run(row["id"])
    assert run.outcome.status == "ok" and run.outcome.last_stage == "end"


# The parent of the next test: a SIGTERM as the finished probe builds its result.
PARENT = r"""
import json, os, signal, sys
from vramcal.probes import probe
from vramcal.probes.probe import ProbeInterrupted, run_probe
real, sent = probe._Probe.result, []
def result(self, *args, **kwargs):
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, *args, **kwargs)
probe._Probe.result = result
try:
    r = run_probe(sys.argv[1], "auto", ctx=64, new_tokens=4, device="cpu", with_estimate=False)
    out, code = {"signal": None, "status": r.status}, 0
except ProbeInterrupted as exc:
    out, code = {"signal": exc.signal_name, "status": exc.result.status, "last_stage": exc.result.last_stage}, \
        exc.exit_code
print(json.dumps(out))
sys.exit(code)
"""


def test_a_sigterm_as_the_finished_probe_builds_its_result_still_hands_it_over(tmp_path, dense):
    """The result of a finished probe is built under sigterm_raises: a SIGTERM then comes out as
    ProbeInterrupted with the whole result (ok, last stage end), for the caller to record before exit 143.
    It was built after, where SIGTERM's default killed the process on the spot: no result, no record but
    what the next command recovers from the journal. In a process of its own, for that reason."""
    r = subprocess.run([sys.executable, "-c", PARENT, dense], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 143, r.stderr[-2000:]
    assert json.loads(r.stdout) == {"signal": "SIGTERM", "status": "ok", "last_stage": "end"}
    assert not [n for n in os.listdir(tmp_path) if n.startswith("vramcal-probe-")]
