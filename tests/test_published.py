"""The published-measurements runner: a small corpus in, the same counters compared, the report out."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
CORPUS = ROOT / "benchmarks" / "published" / "corpus.csv"
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def test_every_corpus_row_has_a_source_a_counter_and_a_loadable_model():
    with open(CORPUS, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) >= 40 and len({r["source_id"] for r in rows}) >= 6
    from vramcal.estimator.resolve import catalog_names

    for r in rows:
        assert r["source_id"] and r["counter"] and r["source_url_or_repo_path"] and r["source_line"], r["id"]
        assert int(r["figure_bytes"]) > 0, r["id"]
        cfg = CORPUS.parent / "configs" / f"{r['model']}.json"
        assert cfg.is_file() or r["model"] in catalog_names(), r["model"]
    bnb = [r for r in rows if r["quant"] in ("int8", "nf4", "nf4-dq", "fp4", "fp4-dq")]
    assert len(bnb) >= 10


def _write_corpus(d: Path, rows: list[dict]) -> Path:
    (d / "configs").mkdir(parents=True)
    (d / "configs" / "tiny.json").write_text(json.dumps(TINY))
    fields = ["id", "source_id", "model", "hub_id", "quant", "quant_settings", "dtype", "attn", "prompt_tokens",
              "new_tokens", "batch", "figure", "unit", "figure_bytes", "counter", "gpu", "software",
              "source_url_or_repo_path", "source_line", "notes"]
    path = d / "corpus.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in fields})
    (d / "sources.md").write_text("# sources\n")
    return path


def _row(i, **kw):
    base = {"id": f"t-{i}", "source_id": "lab-a", "model": "tiny", "quant": "bf16", "dtype": "bfloat16",
            "attn": "sdpa", "prompt_tokens": "100", "new_tokens": "20", "batch": "1", "figure": "1",
            "unit": "B", "counter": "torch_max_allocated", "gpu": "x", "software": "transformers 4.46",
            "source_url_or_repo_path": "somewhere", "source_line": "line", "notes": ""}
    base.update(kw)
    return base


def test_runner_compares_the_same_counter_and_calibrates_within_a_source(tmp_path):
    from vramcal.estimator.estimate import estimate

    cfg = tmp_path / "c" / "configs" / "tiny.json"
    e = estimate(_tiny(tmp_path), "bf16", prompt=100, new_tokens=20)
    alloc = max(e.allocated.values())
    rows = [_row(1, figure_bytes=str(int(alloc * 1.10))), _row(2, figure_bytes=str(int(alloc * 1.10)), batch="2"),
            _row(3, figure_bytes=str(int(alloc * 1.10)), prompt_tokens="300"),
            _row(4, source_id="lab-b", counter="weights_only", prompt_tokens="", new_tokens="", batch="",
                 figure_bytes=str(e.components["weights"]), notes="old stack: tuple cache")]
    corpus = _write_corpus(tmp_path / "c", rows)
    assert cfg.is_file()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "published.py"), "--corpus", str(corpus),
                        "--out-dir", str(out), "--no-report"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = {x["id"]: x for x in csv.DictReader(open(out / "published.csv"))}
    assert float(got["t-1"]["err_pct"]) == pytest.approx(100 * (1 / 1.10 - 1), abs=0.01)  # allocated vs allocated
    assert float(got["t-4"]["err_pct"]) == 0.0 and got["t-4"]["compared"] == "weights"  # weights, to the byte
    assert got["t-4"]["old_stack"] == "True"
    # lab-a has 3 rows: each is corrected by the other two, which share its 10 % offset
    assert abs(float(got["t-1"]["calibrated_err_pct"])) < abs(float(got["t-1"]["err_pct"]))
    assert got["t-4"]["calibrated_err_pct"] == ""  # a source with fewer than 3 rows is not calibrated
    md = (out / "published.md").read_text()
    assert "| lab-a | 3 |" in md and "| **all** | 4 |" in md and "t-4" in md


def _tiny(tmp_path: Path) -> str:
    p = tmp_path / "tiny-config.json"
    p.write_text(json.dumps(TINY))
    return str(p)


def test_a_row_without_source_or_counter_is_refused(tmp_path):
    corpus = _write_corpus(tmp_path / "c", [_row(1, figure_bytes="1000", counter="")])
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "published.py"), "--corpus", str(corpus),
                        "--out-dir", str(tmp_path / "o"), "--no-report"], capture_output=True, text=True)
    assert r.returncode != 0 and "needs a source and a counter" in r.stderr
