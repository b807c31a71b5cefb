"""How a probe ends when its parent is stopped or killed: the child goes, the temporary folder goes,
and what was measured is kept. Real processes, real signals, real transformers loads of a tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import default_sigint
from vramcal.errors import UserError
from vramcal.probes.lifecycle import ProbeInterrupted, folder_owner, make_temp_folder, sweep_stale
from vramcal.probes.probe import _check_device, run_probe
from vramcal.probes.result import recover
from vramcal.probes.readings import StageReading, comparable

# The parent under test: runs one probe with a journal file, writes what it got, exits as a CLI would.
PARENT = r"""
import json, signal, sys
from vramcal.probes.probe import ProbeInterrupted, run_probe
model, journal_path, out_path, synthetic, ctx, new, ignore_ctrl_c = sys.argv[1:8]
if ignore_ctrl_c == "1":  # a caller that decides to let the probe finish (a handler, not SIG_IGN: that is
    signal.signal(signal.SIGINT, lambda *_: None)  # inherited by the child and would hide the difference)
jf = open(journal_path, "a")
def journal(event):
    jf.write(json.dumps(event) + "\n")
    jf.flush()
try:
    r = run_probe(model, "auto", ctx=int(ctx), new_tokens=int(new), device="cpu", with_estimate=False,
                  synthetic=synthetic == "1", journal=journal)
    out, code = {"signal": None, **r.to_dict()}, 0
except ProbeInterrupted as exc:
    out, code = {"signal": exc.signal_name, **exc.result.to_dict()}, exc.exit_code
with open(out_path, "w") as fh:
    json.dump(out, fh)
sys.exit(code)
"""


def _events(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]


def _start_parent(tmp_path, model: str, synthetic: bool = False, ctx: int = 1000, new_tokens: int = 900,
                  ignore_ctrl_c: bool = False):
    """The parent in a subprocess. By default a long decode (900 tokens) keeps the child busy well
    after post_load, where the tests stop the parent."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    journal, out = tmp_path / "journal.jsonl", tmp_path / "out.json"
    env = dict(os.environ, TMPDIR=str(tmp))
    # its own session, like a shell job: a signal to the group stands for the terminal's Ctrl-C
    args = [model, str(journal), str(out), "1" if synthetic else "0", str(ctx), str(new_tokens),
            "1" if ignore_ctrl_c else "0"]
    with open(tmp_path / "stderr.txt", "wb") as err:  # a file, not a pipe nobody reads while it runs
        # SIGINT's default disposition first: a suite started in the background of a non-interactive shell
        # has it ignored, and a Python that starts with SIGINT ignored never raises KeyboardInterrupt
        proc = subprocess.Popen([sys.executable, "-c", PARENT, *args], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err, preexec_fn=default_sigint)
    proc.stderr_path = tmp_path / "stderr.txt"
    return proc, tmp, journal, out


def _stderr(proc) -> str:
    return proc.stderr_path.read_text(errors="replace")[-2000:]


def _wait_for_stage(proc, journal, stage: str, timeout: float = 180.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = _events(journal)
        if any(e["event"] == "stage" and e["name"] == stage for e in events):
            return events
        if proc.poll() is not None:
            raise AssertionError(f"the parent ended first: {_stderr(proc)}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {stage} marker within {timeout} s")


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _probe_folders(tmp) -> list[str]:
    return [n for n in os.listdir(tmp) if n.startswith("vramcal-probe-")]


def _probe_folders_left(tmp, within: float = 5.0) -> list[str]:
    """The probe folders still there after waiting up to ``within`` seconds for them to go."""
    deadline = time.monotonic() + within
    while _probe_folders(tmp) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _probe_folders(tmp)


def _child_pid(events) -> int:
    return next(e["child_pid"] for e in events if e["event"] == "start")


@pytest.fixture(scope="module")
def dense(tiny_models):
    return tiny_models["dense-gqa"]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory, tiny_models):
    d = tmp_path_factory.mktemp("cfg")
    with open(os.path.join(tiny_models["dense-gqa"], "config.json")) as fh:
        (d / "config.json").write_text(fh.read())
    return str(d)


def test_parent_sigkilled_takes_child_and_synthetic_weights_along(tmp_path, config_only):
    proc, tmp, journal, _ = _start_parent(tmp_path, config_only, synthetic=True)
    events = _wait_for_stage(proc, journal, "post_load")
    child = _child_pid(events)
    assert _probe_folders(tmp), "the synthetic checkpoint should be in a probe folder while the child runs"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone(child), "the child outlived its SIGKILLed parent"
    assert _probe_folders_left(tmp) == []
    # the journal the parent kept is enough for a record with the last stage and the samples
    r = recover(_events(journal))
    assert r.status == "interrupted" and r.last_stage in ("post_load", "first_token")
    assert r.sample_count > 0 and r.samples and r.stages["post_load"].used_bytes > 0
    assert "journal" in r.error and r.new_tokens == 900 and r.ctx == 1000


def test_parent_sigkilled_while_writing_synthetic_weights(tmp_path, config_only):
    proc, tmp, journal, _ = _start_parent(tmp_path, config_only, synthetic=True)
    deadline = time.monotonic() + 60
    writer = None
    while writer is None and time.monotonic() < deadline:
        for p in psutil.Process(proc.pid).children():
            try:
                if "write-synthetic" in p.cmdline():
                    writer = p.pid
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)
    assert writer is not None, "the writer never started"
    time.sleep(1.0)  # inside its imports or its writing
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone(writer), "the synthetic writer outlived its SIGKILLed parent"
    assert _probe_folders_left(tmp) == []
    assert recover(_events(journal)) is None  # no child ever started: nothing was measured


@pytest.mark.parametrize("how,signame,code", [("term", "SIGTERM", 143), ("ctrl-c", "SIGINT", 130)])
def test_parent_stopped_records_interrupted_and_kills_child(tmp_path, dense, how, signame, code):
    proc, tmp, journal, out = _start_parent(tmp_path, dense)
    events = _wait_for_stage(proc, journal, "post_load")
    child = _child_pid(events)
    if how == "term":
        proc.send_signal(signal.SIGTERM)
    else:  # the terminal's Ctrl-C goes to the foreground group: the parent's, not the child's session
        os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == code, _stderr(proc)
    assert _gone(child, within=2)
    assert _probe_folders(tmp) == []
    d = json.loads(out.read_text())
    assert d["signal"] == signame and d["status"] == "interrupted"
    assert d["last_stage"] in ("post_load", "first_token") and list(d["stages"])[:3] == [
        "baseline", "load_peak", "post_load"]
    assert d["error"].startswith(f"interrupted by {signame} after stage ")
    assert d["sample_count"] > 0 and len(d["samples"]) == d["sample_count"]
    assert d["unfinished"]["stage"] in ("first_token", "end")
    assert d["exit_code"] == -signal.SIGKILL  # the parent killed it: the child never saw the SIGINT itself


def test_ctrl_c_reaches_the_parent_only(tmp_path, dense):
    """The child has a session of its own: a parent that lets the probe go on after a Ctrl-C gets a
    finished run (a child in the terminal's group would have died of the KeyboardInterrupt)."""
    proc, tmp, journal, out = _start_parent(tmp_path, dense, ctx=96, new_tokens=64, ignore_ctrl_c=True)
    _wait_for_stage(proc, journal, "post_load")
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 0, _stderr(proc)
    d = json.loads(out.read_text())
    assert d["status"] == "ok" and d["exit_code"] == 0 and d["stages"]["end"]["generated"] == 64
    assert _probe_folders(tmp) == []


def test_sigterm_in_process_restores_the_handler(tmp_path, dense, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def term_at_post_load(event, pid):
        if event.get("name") == "post_load":
            seen["pid"] = pid
            signal.raise_signal(signal.SIGTERM)

    with pytest.raises(ProbeInterrupted) as info:
        run_probe(dense, "auto", ctx=64, device="cpu", with_estimate=False, on_event=term_at_post_load)
    r = info.value.result
    assert info.value.signal_name == "SIGTERM" and info.value.exit_code == 143
    assert r.status == "interrupted" and r.last_stage == "post_load" and r.sample_count > 0
    assert signal.getsignal(signal.SIGTERM) is before
    assert _gone(seen["pid"], within=2) and _probe_folders(tmp_path) == []
    assert r.measured()["post_load"].used_bytes == r.stages["post_load"].used_bytes - r.stages[
        "baseline"].used_bytes


def test_a_sigterm_something_swallowed_still_ends_the_probe_terminated(tmp_path, dense, monkeypatch):
    """A Terminated can be lost where the main thread was (a finalizer, torch's import clearing an error),
    as a Ctrl-C can: here the estimate before the child swallows it. The probe starts no child and ends
    as terminated, with its record, as if the signal had not been lost."""
    from vramcal.probes import probe as probe_module
    from vramcal.probes.lifecycle import Terminated

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    before = signal.getsignal(signal.SIGTERM)
    started = []

    def swallows(*args, **kwargs):
        try:
            signal.raise_signal(signal.SIGTERM)
        except Terminated:  # lost, as a library did with it
            pass
        return None

    monkeypatch.setattr(probe_module, "_estimate_or_note", swallows)
    with pytest.raises(ProbeInterrupted) as info:
        run_probe(dense, "auto", ctx=64, device="cpu", with_estimate=True,
                  on_event=lambda event, pid: started.append(pid))
    r = info.value.result
    assert info.value.signal_name == "SIGTERM" and info.value.exit_code == 143
    assert r.status == "interrupted" and started == []
    assert signal.getsignal(signal.SIGTERM) is before and _probe_folders(tmp_path) == []


def test_stale_folders_of_dead_owners_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = make_temp_folder(str(tmp_path))  # this process: alive
    assert folder_owner(mine)[0] == os.getpid()
    gone = tmp_path / f"vramcal-probe-{dead.pid}-12345-abc"
    reused = tmp_path / f"vramcal-probe-{os.getpid()}-1-abc"  # a live pid, but another start time: not its owner
    other = tmp_path / "vramcal-probe-notapid"
    for d in (gone, reused, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
    removed = sweep_stale(str(tmp_path))
    assert sorted(removed) == sorted([str(gone), str(reused)])
    assert os.path.isdir(mine) and other.is_dir() and not gone.exists() and not reused.exists()


def test_new_tokens_generates_that_many_and_the_cache_holds_prompt_plus_new_minus_one(dense):
    cfg = json.load(open(os.path.join(dense, "config.json")))
    ctx, new, batch = 40, 5, 2
    r = run_probe(dense, "auto", ctx=ctx, batch=batch, device="cpu", new_tokens=new, with_estimate=False)
    assert r.status == "ok", r.error
    assert r.new_tokens == new and "--new-tokens 5" in r.command
    end = r.stages["end"]
    assert end.generated == new and end.prompt_tokens == ctx - new
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # K and V, every layer, every KV head, bf16 (2 bytes), ctx - 1 positions: the last token is never fed back
    assert end.kv_bytes == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * (ctx - 1) \
        * batch * 2


def test_new_tokens_and_ctx_are_validated(dense):
    with pytest.raises(UserError, match="--new-tokens"):
        run_probe(dense, ctx=64, device="cpu", new_tokens=0)
    with pytest.raises(UserError, match="--ctx"):
        run_probe(dense, ctx=32, device="cpu", new_tokens=32)
    with pytest.raises(UserError, match="--interval-ms"):
        run_probe(dense, ctx=64, device="cpu", interval_ms=float("nan"))


@pytest.mark.parametrize("device", ["tpu", "CPU", "cuda:-1", "cuda:x", "cuda: 0", "cuda:01", "cudax", "gpu0"])
def test_device_strings_other_than_cpu_cuda_cuda_n_are_refused(device):
    with pytest.raises(UserError) as info:
        _check_device(device)
    assert "cpu, cuda or cuda:N" in str(info.value) and "\n" not in str(info.value)


def test_a_delta_refuses_two_series_and_keeps_none():
    base = StageReading("baseline", "rss", used_bytes=800, peak_bytes=900)
    st = StageReading("post_load", "rss", used_bytes=1000, peak_bytes=None, t=1.5)
    d = st.minus(base)
    assert (d.used_bytes, d.peak_bytes, d.t, d.stage) == (200, None, 1.5, "post_load")
    with pytest.raises(ValueError, match="gpu0"):
        st.minus(StageReading("baseline", "gpu0", used_bytes=1))
    with pytest.raises(ValueError):
        StageReading("end", "gpu0", used_bytes=5).minus(StageReading("baseline", "gpu1", used_bytes=1))
    assert StageReading("end", "rss", 5).minus(StageReading("baseline", "rss", None)).used_bytes is None
    # the rule: rss minus its baseline; a GPU series as read, torch counters never shifted
    gpu = {"baseline": StageReading("baseline", "gpu0", 500), "end": StageReading("end", "gpu0", 9000, 9500, 7000)}
    assert comparable(gpu, "gpu0") == gpu
    cpu = comparable({"baseline": base, "post_load": st}, "rss")
    assert cpu["baseline"].used_bytes == 0 and cpu["post_load"].used_bytes == 200
    with pytest.raises(ValueError):
        comparable({"end": StageReading("end", "rss", 1)}, "gpu0")
