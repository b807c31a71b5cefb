"""Faults and bad inputs an adversary found, round two: a database a full disk left with pages in its
write-ahead log, imported files that are not records, push targets that are not URLs, configs
transformers rejects in its own ways, files that are not regular files, a probe that fails after its
run was recorded. Every refusal is one line, exit 2, with the database byte for byte as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest
from helpers import context, outcome
from pg_server import pg_server, pg_url  # noqa: F401 (fixtures)

from vramcal.records.store import Store

VRAMCAL = [sys.executable, "-m", "vramcal"]


def run(*args, env=None, timeout=120):
    return subprocess.run(VRAMCAL + list(args), capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout)


def one_line(r, needle: str, code: int = 2) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def digest(*paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        if os.path.exists(p):
            h.update(open(p, "rb").read())
    return h.hexdigest()


def _fill(s: Store, n: int, start: int = 0) -> None:
    mid = s.machine_id({"kind": "cpu", "hostname": "h"})
    for i in range(n):
        rid = s.begin_run(mid, context(ctx=64 + start + i))
        s.finish_run(rid, outcome("ok", [{"stage": "end", "estimated_bytes": 1, "measured_peak_bytes": 2}],
                                  [(0.01 * k, "rss", k) for k in range(200)]))


# ------------------------------------------------------------------ a full disk, then space again

def disk_full_copy(tmp_path) -> str:
    """What a full disk leaves: pages written to the write-ahead log, then a checkpoint cut short after it
    rewrote page 1 -- the header counts more pages than the file holds; the log has them all."""
    live = str(tmp_path / "live.db")
    s = Store(live)
    _fill(s, 5)
    s.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    s.conn.execute("PRAGMA wal_autocheckpoint = 0")
    _fill(s, 40, start=100)
    crashed = str(tmp_path / "crashed.db")
    for suffix in ("", "-wal"):  # copied while the writer still holds them: as a power cut leaves them
        shutil.copy(live + suffix, crashed + suffix)
    s.close()
    page = int.from_bytes(open(crashed, "rb").read(100)[16:18], "big")
    wal, header, pos = open(crashed + "-wal", "rb").read(), None, 32
    while pos + 24 + page <= len(wal):
        if int.from_bytes(wal[pos:pos + 4], "big") == 1:
            header = wal[pos + 24:pos + 24 + 100]
        pos += 24 + page
    with open(crashed, "r+b") as fh:
        fh.write(header)
    assert int.from_bytes(header[28:32], "big") * page > os.path.getsize(crashed)
    return crashed


def test_a_database_a_full_disk_left_is_read_and_healed(tmp_path):
    db = disk_full_copy(tmp_path)
    listed = run("records", "list", "--db", db, "--json")
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 45  # the runs held in the log are all there
    assert run("records", "summary", "--db", db).returncode == 0
    # the run saved aside while the disk was full is recorded once space is back; the log is merged
    from vramcal.records.unrecorded import run_payload, save_unrecorded

    saved = save_unrecorded(run_payload({"kind": "cpu", "hostname": "h"}, context(ctx=9999), outcome("ok")),
                            tmp_path / "kept")
    imported = run("records", "import", str(saved), "--db", db)
    assert imported.returncode == 0 and "as run 46" in imported.stdout, imported.stderr
    with Store(db, create=False, readonly=True) as s:
        assert s.count("runs") == 46 and s.query("PRAGMA quick_check")[0]["quick_check"] == "ok"
    assert os.path.getsize(db + "-wal") == 0  # checkpointed into the file


def test_a_truncated_database_without_a_log_is_still_refused_untouched(tmp_path):
    db = str(tmp_path / "t.db")
    with Store(db) as s:
        _fill(s, 30)
    data = open(db, "rb").read()
    open(db, "wb").write(data[: len(data) // 2])
    before = digest(db)
    one_line(run("records", "list", "--db", db), "truncated or damaged")
    assert digest(db) == before


def test_an_estimate_does_not_apply_corrections_from_a_damaged_database(tmp_path, tiny_models):
    db = str(tmp_path / "d.db")
    with Store(db) as s:
        _fill(s, 60)
    c = sqlite3.connect(db)
    page = dict(c.execute("SELECT name, rootpage FROM sqlite_master WHERE type = 'table'"))["samples"]
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    with open(db, "r+b") as fh:
        fh.seek((page - 1) * 4096 + 8)
        fh.write(b"\xff" * 64)
    before = digest(db)
    one_line(run("records", "list", "--db", db), "damaged")
    r = run("estimate", tiny_models["dense-gqa"], "--device", "cpu", "--ctx", "64", "--json", "--db", db)
    assert r.returncode == 0 and json.loads(r.stdout)["correction"] is None
    assert any("damaged" in n for n in json.loads(r.stdout)["notes"])
    assert digest(db) == before


# ------------------------------------------------------------------ imports that are not records

POISON = {
    "ctx-text": lambda p: p["run"].update(ctx="lots"),
    "samples-text": lambda p: p["outcome"].update(samples=[["soon", "rss", "many"]]),
    "status": lambda p: p["outcome"].update(status="pwned"),
    "null-stage": lambda p: p["outcome"].update(stages=[None]),
    "device": lambda p: p["run"].update(device="../../etc"),
    "negative-batch": lambda p: p["run"].update(batch=-4),
    "fingerprint-kind": lambda p: p["fingerprint"].update(kind="toaster"),
    "uuid": lambda p: p.update(uuid=["a", "list"]),
    "stage-twice": lambda p: p["outcome"].update(stages=p["outcome"]["stages"] * 2),
    "device-stage-twice": lambda p: p["outcome"].update(devices=[{"device": "cuda:0", "stage": "end",
                                                                  "estimated_bytes": 5, "measured_peak_bytes": 7}] * 2),
}


def _saved(tmp_path, name="good", ctx=256):
    from vramcal.records.unrecorded import run_payload, save_unrecorded

    payload = run_payload({"kind": "cpu", "hostname": "h"}, context(ctx=ctx),
                          outcome("ok", [{"stage": "end", "estimated_bytes": 5, "measured_peak_bytes": 7}],
                                  [(0.0, "rss", 1)]), uuid=f"uuid-{name}")
    return save_unrecorded(payload, tmp_path / name)


@pytest.mark.parametrize("kind", sorted(POISON))
def test_an_import_that_is_not_a_record_is_refused_whole(tmp_path, kind):
    db = str(tmp_path / "r.db")
    with Store(db) as s:
        _fill(s, 2)
    before = digest(db, db + "-wal")
    path = _saved(tmp_path)
    payload = json.loads(path.read_text())
    POISON[kind](payload)
    path.write_text(json.dumps(payload))
    good = _saved(tmp_path, "other", ctx=512)
    one_line(run("records", "import", str(good), str(path), "--db", db), str(path))
    assert digest(db, db + "-wal") == before  # the good file beside it was not recorded either
    assert path.exists() and good.exists()
    assert run("records", "summary", "--db", db).returncode == 0


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b'{"format": "other"}', b"\xff\xfe\x00"])
def test_an_import_of_a_damaged_file_is_one_line(tmp_path, content):
    p = tmp_path / "run-x.json"
    p.write_bytes(content)
    one_line(run("records", "import", str(p), "--db", str(tmp_path / "r.db")), str(p))
    assert not (tmp_path / "r.db").exists()


def test_an_import_refused_whole_creates_no_database(tmp_path):
    path = _saved(tmp_path)
    payload = json.loads(path.read_text())
    POISON["stage-twice"](payload)
    path.write_text(json.dumps(payload))
    one_line(run("records", "import", str(path), "--db", str(tmp_path / "new.db")), "repeated")
    assert not (tmp_path / "new.db").exists() and path.exists()


def test_a_file_with_a_recorded_runs_id_but_other_contents_is_refused_and_kept(tmp_path):
    db = str(tmp_path / "r.db")
    first = _saved(tmp_path, "same")
    assert run("records", "import", str(first), "--db", db).returncode == 0
    again = _saved(tmp_path, "same", ctx=4096)  # the same uuid, another run
    before = digest(db, db + "-wal")
    one_line(run("records", "import", str(again), "--db", db), "already holds another run")
    assert again.exists() and digest(db, db + "-wal") == before
    repeat = _saved(tmp_path, "same")  # the same run again: recorded already, the file goes
    r = run("records", "import", str(repeat), "--db", db)
    assert r.returncode == 0 and "recorded already" in r.stdout and not repeat.exists()


def test_a_run_saved_by_the_first_format_is_imported(tmp_path):
    old = {"format": "vramcal-unrecorded-run/1", "uuid": "0e8f6f2a-1111-4222-8333-444455556666", "saved_at": 1.0,
           "not_recorded_because": "the server was down", "fingerprint": {"kind": "cuda", "hostname": "h"},
           "run": {"model": "m", "config_hash": "c", "quant": "nf4", "quant_impl": "bnb", "dtype": "bfloat16",
                   "ctx": 512, "batch": 1, "kv_dtype": "auto", "attn": "sdpa", "device": "cuda:0,cuda:1,cpu",
                   "command": "vramcal check m", "estimate": {"peak": 1}, "created_at": 1.0},
           "result": {"status": "ok", "last_stage": "end", "series": "gpu0", "wall_s": 3.0, "stages": {}},
           "stages": [{"stage": "end", "estimated_bytes": 5, "measured_peak_bytes": 7}],
           "samples": [[0.1, "gpu0", 9]]}
    p = tmp_path / "run-old.json"
    p.write_text(json.dumps(old))
    db = str(tmp_path / "r.db")
    assert run("records", "import", str(p), "--db", db).returncode == 0
    with Store(db, create=False, readonly=True) as s:
        got = s.run(1)
    assert got.context.split_devices == ["cuda:0", "cuda:1", "cpu"] and got.context.device == "cuda:0"
    assert got.stages["end"].measured_peak_bytes == 7 and got.sample_count == 1
    # the estimator model schema 5 gives a row of that time, so corrections use the run as they would the row
    from vramcal.records.schema import LEGACY_MODELS

    assert got.context.estimator_model == LEGACY_MODELS["cuda"]


def test_push_skips_records_an_older_import_poisoned(tmp_path):
    """A store that took nonsense before imports were checked: push copies the rest and names what it left."""
    from vramcal.records.sync import push

    src = str(tmp_path / "src.db")
    with Store(src) as s:
        _fill(s, 3)
    c = sqlite3.connect(src)  # what an unchecked import left: text where the context is a count
    c.execute("DROP TRIGGER runs_no_update")
    c.execute("UPDATE runs SET ctx = 'lots' WHERE id = 2")
    c.commit()
    c.close()
    report = push(src, str(tmp_path / "dst.db"))
    assert report.runs_added == 2 and len(report.skipped) == 1 and "run.ctx" in report.skipped[0]
    assert run("records", "summary", "--db", src).returncode == 0  # readers survive it too


# ------------------------------------------------------------------ databases named wrongly

@pytest.mark.parametrize("target,needle", [
    ("host=db.lab port=5432 dbname=vramcal password=hunter2", "libpq connection string"),
    ("postgresql//vramcal:hunter2@db.lab/vramcal", "not a PostgreSQL URL"),
    ("postgres:/db.lab/vramcal", "not a PostgreSQL URL"),
    ("db.lab:5432", "HOST:PORT"),
    ("db.lab:5432/vramcal", "HOST:PORT"),
    ("[::1]:5432", "HOST:PORT"),
    (" ", "empty name"),
])
def test_a_push_target_that_is_not_a_url_writes_no_file(tmp_path, target, needle):
    db = str(tmp_path / "r.db")
    with Store(db) as s:
        _fill(s, 1)
    r = subprocess.run(VRAMCAL + ["records", "push", "--db", db, "--to", target], capture_output=True, text=True,
                       cwd=tmp_path)
    one_line(r, needle)
    assert "hunter2" not in r.stderr + r.stdout
    assert sorted(os.listdir(tmp_path)) == sorted(n for n in os.listdir(tmp_path) if n.startswith("r.db"))


def test_an_existing_file_named_like_a_server_is_still_a_database(tmp_path):
    with Store(tmp_path / "data:1") as s:
        _fill(s, 1)
    r = subprocess.run(VRAMCAL + ["records", "list", "--db", "data:1"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.count("\n") == 2, r.stderr


def test_an_empty_writer_password_is_refused(tmp_path):
    r = run("records", "init-fleet", "--db", "postgresql://postgres@127.0.0.1:1/x",
            env={"VRAMCAL_WRITER_PASSWORD": ""})
    one_line(r, "set but empty")


@pytest.mark.parametrize("size,needle", [("24Gb", "bits"), ("24gb", "bits"), ("512Mb", "bits")])
def test_a_lowercase_b_is_not_read_as_bytes(size, needle):
    one_line(run("estimate", "llama-3.1-8b", "--max-memory", f"cuda:0={size}"), needle)
    one_line(run("fit", "llama-3.1-8b", "--budget", size), needle)


def test_a_device_outside_the_placement_is_refused():
    one_line(run("estimate", "llama-3.1-8b", "--quant", "nf4", "--max-memory", "cuda:0=24GiB", "--device", "cuda:1"),
             "not among the GPUs")


# ------------------------------------------------------------------ configs transformers rejects

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


@pytest.mark.parametrize("extra,needle", [
    ({"torch_dtype": "float8_e4m3fn"}, "no quantization_config"),
    ({"rope_scaling": [1, 2]}, "transformers rejects this config"),
    ({"text_config": [1, 2]}, "fix the config.json"),
])
def test_configs_transformers_rejects_are_one_line(tmp_path, extra, needle):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**BASE, **extra}))
    for device in ("cuda", "cpu"):
        one_line(run("estimate", str(d), "--ctx", "64", "--no-correction", "--device", device), needle)


def test_a_null_head_dim_takes_the_default(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**BASE, "head_dim": None}))
    r = run("estimate", str(d), "--ctx", "64", "--no-correction", "--json")
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ files that are not regular files

def test_a_fifo_as_config_json_is_refused_at_once(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    os.mkfifo(d / "config.json")
    one_line(run("estimate", str(d), "--no-correction", timeout=30), "not a regular file")


def test_a_huge_config_json_is_refused_unread(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    with open(d / "config.json", "wb") as fh:
        fh.truncate(64 * 1024**2)  # sparse: nothing to read, but far beyond any config
    one_line(run("estimate", str(d), "--no-correction"), "more than any config.json")


def test_a_fifo_in_the_cache_folder_is_recomputed(tmp_path, tiny_models):
    cache = tmp_path / "cache"
    env = {"VRAMCAL_CACHE": str(cache)}
    first = run("estimate", tiny_models["dense-gqa"], "--ctx", "64", "--json", "--no-correction", env=env)
    assert first.returncode == 0
    victim = next((cache / "inventory").glob("*.json"))
    victim.unlink()
    os.mkfifo(victim)
    again = run("estimate", tiny_models["dense-gqa"], "--ctx", "64", "--json", "--no-correction", env=env,
                timeout=60)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["stages"] == json.loads(first.stdout)["stages"]


def test_a_hub_snapshot_that_leads_outside_the_cache_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps(BASE))
    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "snapshots").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    os.symlink(elsewhere, repo / "snapshots" / "abc")
    one_line(run("estimate", "acme/tiny", "--no-correction", env={"HF_HUB_CACHE": str(tmp_path / "hub")}),
             "outside the Hugging Face cache")


def test_a_hub_snapshot_file_that_leads_outside_the_cache_is_refused(tmp_path):
    """The snapshot folder is inside the cache, its config.json a link to a file elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps(BASE))
    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    os.symlink(elsewhere / "config.json", repo / "snapshots" / "abc" / "config.json")
    one_line(run("estimate", "acme/tiny", "--no-correction", env={"HF_HUB_CACHE": str(tmp_path / "hub")}),
             "outside the Hugging Face cache")
    # the Hub's own layout, a link to ../../blobs/<hash> inside the repository, is read
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text(json.dumps(BASE))
    os.remove(repo / "snapshots" / "abc" / "config.json")
    os.symlink("../../blobs/f00d", repo / "snapshots" / "abc" / "config.json")
    assert run("estimate", "acme/tiny", "--no-correction", "--ctx", "64",
               env={"HF_HUB_CACHE": str(tmp_path / "hub")}).returncode == 0
    # a link loop beside it is not read, so not refused; as a weights file it is, in one line
    os.symlink("loop1", repo / "snapshots" / "abc" / "loop2")
    os.symlink("loop2", repo / "snapshots" / "abc" / "loop1")
    assert run("estimate", "acme/tiny", "--no-correction", "--ctx", "64",
               env={"HF_HUB_CACHE": str(tmp_path / "hub")}).returncode == 0
    os.symlink("model.safetensors", repo / "snapshots" / "abc" / "model.safetensors")
    one_line(run("estimate", "acme/tiny", "--no-correction", env={"HF_HUB_CACHE": str(tmp_path / "hub")}),
             "a link that leads nowhere")


# ------------------------------------------------------------------ a probe that fails after it was recorded

def test_a_check_whose_synthetic_weights_cannot_be_written_records_nothing(tmp_path):
    """Weights that cannot be written (2 TB of synthetic weights): found before the run is recorded
    (round three: the room for the checkpoint is validated first), so one line, exit 2, no database."""
    d = tmp_path / "huge"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**BASE, "hidden_size": 1 << 19, "vocab_size": 1 << 21,
                                                "num_hidden_layers": 1, "torch_dtype": "bfloat16"}))
    db = str(tmp_path / "r.db")
    r = run("check", str(d), "--synthetic", "--device", "cpu", "--ctx", "64", "--db", db)
    one_line(r, "nothing was run or recorded")
    assert not os.path.exists(db)


# ------------------------------------------------------------------ interrupted commands say so

def test_an_interrupted_estimate_says_interrupted(tmp_path):
    """Ctrl-C while the meta model is built (torch and transformers being imported): exit 130 and one
    line. The estimate takes about 4 s here; a test worker that is not scheduled for that long sends its
    signal to a process that has already answered, which is no interrupt at all: that attempt is made
    again (three at most), and the test fails if none could be interrupted."""
    import signal
    import time

    interrupted = 0
    for _ in range(3):
        proc = subprocess.Popen(VRAMCAL + ["estimate", "llama-3.1-70b", "--no-disk-cache", "--ctx", "131072"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "VRAMCAL_CACHE": str(tmp_path), "VRAMCAL_PROGRESS": "1"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        first = proc.stderr.readline()  # the first slow step has started (building the meta model)
        assert "building the model" in first, first
        time.sleep(0.2)
        if proc.poll() is not None:  # it answered before the signal could be sent
            proc.communicate(timeout=60)
            continue
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and err.strip() == "vramcal: interrupted", (first, err)
        interrupted += 1
        break
    assert interrupted == 1, "the estimate always ended before the signal was sent"


def test_a_ctrl_c_something_swallowed_still_ends_the_command(monkeypatch, capsys):
    """A KeyboardInterrupt can be lost where the main thread was (a C extension clearing the error of an
    import it tried, a finalizer): seen once in CI, an estimate interrupted as torch was imported printed
    its answer and exited 0. The command notes each SIGINT and ends with 130 all the same."""
    import signal

    from vramcal import cli

    def swallows(args):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:  # lost, as the library did with it
            pass
        print("an answer")
        return 0

    monkeypatch.setattr(cli, "cmd_estimate", swallows)
    assert cli.main(["estimate", "qwen2.5-0.5b"]) == 130
    out, err = capsys.readouterr()
    assert err.strip() == "vramcal: interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was

    def plain(args):
        print("an answer")
        return 0

    monkeypatch.setattr(cli, "cmd_estimate", plain)  # without a signal nothing changes
    assert cli.main(["estimate", "qwen2.5-0.5b"]) == 0
    assert capsys.readouterr().err == ""


def test_a_model_built_through_a_swallowed_ctrl_c_is_not_kept(monkeypatch):
    """The build notes a SIGINT even where the import that received it swallowed it and the build
    then succeeded: the interrupt ends it, and the half-imported model is not cached for the next call."""
    import signal

    from vramcal.estimator import meta
    from vramcal.estimator.quant import resolve_quant
    from vramcal.estimator.resolve import resolve_model

    def swallowed(*args, **kwargs):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        return ("model", None, "bfloat16")

    monkeypatch.setattr(meta, "_build_meta_model", swallowed)
    source = resolve_model("qwen2.5-0.5b")
    quant = resolve_quant("bf16", source.config)
    with pytest.raises(KeyboardInterrupt):
        meta.build_meta_model(source, quant)
    assert (source.config_hash, quant.key(), None) not in meta._META_MODELS
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an ignored SIGINT stays ignored: nothing is noted
    try:
        assert meta.build_meta_model(source, quant) == ("model", None, "bfloat16")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        meta._META_MODELS.pop((source.config_hash, quant.key(), None), None)


def test_an_ignored_sigint_stays_ignored_through_nested_notes_and_in_children():
    """Under nohup, `cmd &` in a script or a supervisor, SIGINT is ignored. The command's note and the
    meta build's inside it install nothing then: a SIGINT ends nothing, and a child started inside still
    inherits it ignored (a Python handler would be reset to the default in the child)."""
    import signal

    from vramcal.interrupts import sigint_noted

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sigint_noted() as outer, sigint_noted() as inner:
            signal.raise_signal(signal.SIGINT)
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"],
                                   capture_output=True, text=True)
        assert not outer() and not inner()
        assert child.stdout.strip() == "True", child
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.mark.parametrize("failure", ["import", "user"])
def test_a_swallowed_ctrl_c_then_a_failure_is_the_interrupt(monkeypatch, capsys, failure):
    """A Ctrl-C that tears an import apart is swallowed there, and the next import of that module fails
    (or a check that reads it says the input is bad): the command exits 130, not 70 or 2."""
    import signal

    from vramcal import cli
    from vramcal.errors import UserError

    def torn(args):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        if failure == "import":
            raise ImportError("Could not import module 'LlamaConfig'")
        raise UserError("qwen2.5-0.5b: not a model")

    monkeypatch.setattr(cli, "cmd_estimate", torn)
    assert cli.main(["estimate", "qwen2.5-0.5b"]) == 130
    assert capsys.readouterr().err.strip() == "vramcal: interrupted"

    def fails(args):  # without a signal the failure is what it says
        raise UserError("qwen2.5-0.5b: not a model")

    monkeypatch.setattr(cli, "cmd_estimate", fails)
    assert cli.main(["estimate", "qwen2.5-0.5b"]) == 2


def test_an_interrupted_push_says_how_far_it_got(tmp_path, monkeypatch):
    from vramcal.records import sync

    src = str(tmp_path / "src.db")
    with Store(src) as s:
        _fill(s, 5)
    real = sync._insert_outcome
    calls = {"n": 0}

    def ctrl_c_at_the_third(tx, run_id, outcome):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(tx, run_id, outcome)

    monkeypatch.setattr(sync, "_insert_outcome", ctrl_c_at_the_third)
    with pytest.raises(sync.CopyInterrupted, match="after copying 2 runs and 2 outcomes of 5") as info:
        sync.push(src, str(tmp_path / "dst.db"))
    assert info.value.report.runs_added == 2
    monkeypatch.setattr(sync, "_insert_outcome", real)
    assert sync.push(src, str(tmp_path / "dst.db")).runs_added == 3  # the rest comes next time


def test_a_damaged_schema_version_on_postgresql_is_one_line(pg_url):
    import psycopg

    Store(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("ALTER TABLE vramcal.meta DISABLE TRIGGER ALL")
        c.execute("UPDATE vramcal.meta SET value = 'five' WHERE key = 'schema_version'")
    one_line(run("records", "list", "--db", pg_url), "schema version")


def test_a_ctrl_c_that_tears_an_import_is_an_interrupt_not_a_formula(monkeypatch):
    """A SIGINT inside transformers' first imports can leave a module half made; transformers then reports
    "Could not import module 'LlamaConfig'" (seen in a fresh clone: the estimate answered from a formula,
    exit 2, instead of 'interrupted'). The build notes the signal and raises the interrupt it was."""
    import signal

    from vramcal.estimator import meta
    from vramcal.estimator.quant import resolve_quant
    from vramcal.estimator.resolve import resolve_model

    def torn(*args, **kwargs):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:  # what the torn import did with it: lost
            pass
        raise ModuleNotFoundError("Could not import module 'LlamaConfig'. Are this object's requirements defined "
                                  "correctly?")

    monkeypatch.setattr(meta, "_build_meta_model", torn)
    source = resolve_model("qwen2.5-0.5b")
    with pytest.raises(KeyboardInterrupt):
        meta.build_meta_model(source, resolve_quant("bf16", source.config))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'flash_attn'")

    monkeypatch.setattr(meta, "_build_meta_model", missing)
    with pytest.raises(ModuleNotFoundError):  # without a signal the failure is what it says
        meta.build_meta_model(source, resolve_quant("bf16", source.config))
