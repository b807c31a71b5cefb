"""Round three of the adversarial pass, the records / images / memo half: sizes in PiB, special files as
the records database, runs whose weights could not be written, poisoned imports and their withdrawal,
memos whose Python must run as printed, and image workloads that must be monotone and bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers import context, outcome

from vramcal.errors import UserError
from vramcal.records.store import Store

VRAMCAL = [sys.executable, "-m", "vramcal"]


def run(*args, env=None, timeout=120, **kw):
    return subprocess.run(VRAMCAL + list(args), capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout, **kw)


def one_line(r, needle: str, code: int = 2) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------------- sizes

def test_pib_is_read_as_1024_tib():
    from vramcal.units import parse_size, size_option

    assert parse_size("1PiB") == parse_size("1024TiB") == 1024**5
    assert parse_size("2 PB") == 2 * 1000**5
    assert parse_size("1P") == 1024**5
    assert size_option("1.5PiB", "--budget") == int(1.5 * 1024**5)
    with pytest.raises(UserError, match="bits"):
        size_option("1Pb", "--budget")


# ------------------------------------------------------------------- special files as the database

@pytest.mark.parametrize("args", [["records", "list"], ["records", "show", "1"],
                                  ["records", "push", "--to", "{other}"], ["records", "pull", "--from", "{other}"]])
def test_a_fifo_as_the_database_is_one_line_not_a_hang(tmp_path, args):
    fifo = tmp_path / "records.db"
    os.mkfifo(fifo)
    other = tmp_path / "other.db"
    Store(other).close()
    args = [a.replace("{other}", str(other)) for a in args]
    t0 = time.monotonic()
    r = run(*args, "--db", str(fifo), timeout=30)
    assert time.monotonic() - t0 < 15  # the same bound as any unreadable database (3 s here, more when loaded)
    one_line(r, "FIFO")


def test_a_fifo_as_the_source_of_a_pull_or_the_target_of_a_push(tmp_path):
    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    db = tmp_path / "records.db"
    Store(db).close()
    one_line(run("records", "push", "--to", str(fifo), "--db", str(db), timeout=30), "FIFO")
    one_line(run("records", "pull", "--from", str(fifo), "--db", str(db), timeout=30), "FIFO")


def test_a_fifo_beside_the_database_as_its_wal(tmp_path):
    db = tmp_path / "records.db"
    Store(db).close()
    os.mkfifo(f"{db}-wal")
    one_line(run("records", "list", "--db", str(db), timeout=30), "-wal")


def test_dev_null_as_the_database_is_a_clear_line():
    for args in (["records", "list"], ["records", "push", "--to", "/tmp/never-made.db"]):
        r = run(*args, "--db", os.devnull, timeout=30)
        one_line(r, "device")
        assert "disk I/O" not in r.stderr
    with pytest.raises(UserError, match="device"):
        Store(os.devnull)


# --------------------------------------------------------- synthetic weights that cannot be written

def _tiny_config(**over) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "float32"}
    cfg.update(over)
    return cfg


def test_synthetic_weights_without_room_change_no_database(tmp_path):
    """2 TiB of random weights: refused before the run is recorded, the database byte for byte as it was."""
    import hashlib
    import json

    d = tmp_path / "huge"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_tiny_config(hidden_size=1 << 19, vocab_size=1 << 21,
                                                           num_hidden_layers=1, torch_dtype="bfloat16")))
    db = tmp_path / "r.db"
    with Store(db) as s:
        s.machine_id({"kind": "cpu", "hostname": "h"})
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    r = run("check", str(d), "--synthetic", "--device", "cpu", "--ctx", "64", "--db", str(db))
    one_line(r, "nothing was run or recorded")
    assert "TiB" in r.stderr or "GiB" in r.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_synthetic_room_counts_the_checkpoint_against_the_temp_disk(tmp_path, monkeypatch):
    import json
    import shutil

    from vramcal.estimator.quant import resolve_quant
    from vramcal.estimator.resolve import resolve_model
    from vramcal.probes import synthetic

    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_tiny_config()))
    source = resolve_model(str(d))
    spec = resolve_quant("auto", source.config, None)
    need = synthetic.checkpoint_bytes(source, spec)
    assert need == 4 * (256 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64)
    assert synthetic.check_room(source, spec, str(tmp_path)) == need
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    with pytest.raises(UserError, match="TMPDIR"):
        synthetic.check_room(source, spec, str(tmp_path))
