"""--engine vllm beyond the runs it was fitted on (issue 27): the dummy sampler's sort against
FlashInfer's sampler, the log parser on the wording of each version the held-out rows come from, and
the held-out rows of benchmarks/published/vllm/corpus.csv through the estimate."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from vramcal.cli import main
from vramcal.errors import UserError
from vramcal.estimator.vllm.arch import arch_of
from vramcal.estimator.vllm.budget import HIDDEN_KEPT, SAMPLER_BYTES, SORT_BYTES, activation
from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm
from vramcal.estimator.vllm.layout import pad_vocab
from vramcal.estimator.vllm.logparse import parse_log
from vramcal.estimator.vllm.versions import parse_version, sampler_sorts

ROOT = Path(__file__).parent.parent
CORPUS_DIR = ROOT / "benchmarks" / "published" / "vllm"
GIB = 1024**3


def _rows() -> dict[str, dict]:
    with open(CORPUS_DIR / "corpus.csv", newline="") as fh:
        return {r["id"]: r for r in csv.DictReader(fh)}


def _f(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


# ------------------------------------------------------------------- the dummy sampler's sort

def test_flashinfer_sampler_skips_the_sort_only_where_vllm_sorts():
    """v1/sample/ops/topk_topp_sampler.py: before 0.17 the PyTorch-native path sorts the vocabulary;
    FlashInfer's kernel (when installed and usable) samples without it; from 0.17 nothing sorts."""
    v10, v17 = parse_version("0.10.1"), parse_version("0.17.0")
    assert sampler_sorts(v10) and sampler_sorts(v10, False) and not sampler_sorts(v10, True)
    assert not any(sampler_sorts(v17, f) for f in (None, True, False))


def test_the_sort_is_the_only_difference_in_the_sampler_term():
    """The sampler's peak with and without the sort differs by SORT_BYTES per padded logit of the
    S = min(max_num_seqs, T) rows, nothing else (budget.py's formula)."""
    a = arch_of(json.loads((ROOT / "vramcal/estimator/catalog/qwen2.5-7b.json").read_text()))
    v = parse_version("0.10.1")
    t, s, el = 2048, 256, 2
    sort = activation(a, 1, 0, 1, el, t, s, v)
    fi = activation(a, 1, 0, 1, el, t, s, v, flashinfer=True)
    v_pad = pad_vocab(a.vocab)
    assert fi.sampler == int((SAMPLER_BYTES + el) * s * v_pad + HIDDEN_KEPT * t * a.hidden * el)
    assert sort.sampler == int((SAMPLER_BYTES + el + SORT_BYTES) * s * v_pad + HIDDEN_KEPT * t * a.hidden * el)
    assert activation(a, 1, 0, 1, el, t, s, parse_version("0.19.0"), flashinfer=True).sampler == \
        activation(a, 1, 0, 1, el, t, s, parse_version("0.19.0")).sampler


def test_a100_at_quarter_utilization_with_flashinfer_matches_its_log():
    """The 0.10.1.1 A100 80GB run at utilization 0.25 logged "Using FlashInfer for top-p & top-k
    sampling": priced with the sort its KV tokens came out 17 % short; without it, within 1 %."""
    row = _rows()["dl22_qwen2-7b_a100-80gb_tp1_u0.25"]
    base = dict(gpu_memory_bytes=int(79.25 * GIB), gpu_name=row["gpu"], gpu_memory_utilization=0.25,
                max_model_len=16384, vllm_version=row["vllm_version"])
    cfg = str(CORPUS_DIR / "configs" / "qwen2-7b.json")
    logged = int(row["kv_cache_tokens"])
    sorted_ = estimate_vllm(cfg, VllmArgs(**base)).kv_cache_tokens
    fi = estimate_vllm(cfg, VllmArgs(**base, flashinfer_sampler=True)).kv_cache_tokens
    assert abs(fi - logged) / logged < 0.01, (fi, logged)
    assert sorted_ < 0.9 * logged  # the sort priced for a run that did not sort


def test_flashinfer_sampler_flag_is_checked():
    with pytest.raises(UserError):
        VllmArgs(flashinfer_sampler="maybe").validated()


def test_flashinfer_sampler_bad_value_is_one_line_exit_2(capsys):
    rc = main(["estimate", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "79.25GiB",
               "--flashinfer-sampler", "maybe"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "--flashinfer-sampler" in err, err


def test_flashinfer_sampler_flag_reaches_the_estimate(capsys):
    common = ["estimate", "qwen2.5-7b", "--engine", "vllm", "--gpu-memory", "79.25GiB", "--gpu-memory-utilization",
              "0.5", "--max-model-len", "16384", "--vllm-version", "0.10.1", "--json"]
    got = {}
    for flag in ("yes", "no"):
        assert main(common + ["--flashinfer-sampler", flag]) == 0
        got[flag] = json.loads(capsys.readouterr().out)["vllm"]["activation_bytes"]
    assert got["yes"] < got["no"]


# ------------------------------------------------------------------- the parser on each version's wording

HELD_OUT = [r for r in _rows().values() if r["split"] == "held-out" and r["id"] not in ("r008", "r010")]


@pytest.mark.parametrize("row", HELD_OUT, ids=lambda r: r["id"])
def test_parser_reads_each_held_out_log_as_the_corpus_does(row):
    """0.10.1.1 / 0.10.2 (four decimals, separate size and concurrency lines, the "Actual usage ...
    for weight" line), 0.18 (two decimals), 0.27 / 0.31 (one line for size and concurrency, "for
    consumed memory (weights + non-torch)")."""
    log = parse_log((CORPUS_DIR / row["fixture"]).read_text())
    checks = {"weights_bytes": "weights_gib", "kv_cache_bytes": "kv_cache_gib", "activation_bytes": "activation_gib"}
    for attr, col in checks.items():
        want = _f(row[col])
        if want is not None and not (attr == "activation_bytes" and row["vllm_version"] >= "0.27"):
            assert getattr(log, attr) is not None and abs(getattr(log, attr) / GIB - want) < 0.006, (attr, log)
    assert log.kv_cache_tokens == int(row["kv_cache_tokens"])
    if row["max_concurrency"]:
        assert log.max_concurrency == pytest.approx(float(row["max_concurrency"]))
    if row["cuda_graph_gib"]:
        assert log.cuda_graph_bytes is not None and abs(log.cuda_graph_bytes / GIB - float(row["cuda_graph_gib"])) < 0.006


def test_consumed_accounting_line_of_0_31():
    log = parse_log((CORPUS_DIR / "logs" / "a100-80gb_llama-3.1-8b_v0.31.0.log").read_text())
    assert abs(log.consumed_bytes / GIB - 15.26) < 0.006 and abs(log.activation_bytes / GIB - 1.44) < 0.006
    assert abs(log.total_bytes / GIB - 79.25) < 0.006 and log.gpu_memory_utilization == 0.92
    assert log.max_model_len == 131072 and log.max_concurrency == 3.51


# ------------------------------------------------------------------- the held-out rows end to end

@pytest.mark.parametrize("row", [r for r in HELD_OUT if r["weights_gib"]], ids=lambda r: r["id"])
def test_held_out_weights_within_one_percent(row):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import run_row

    got = run_row(row, CORPUS_DIR)
    assert not got["error"] and abs(got["weights_err_pct"]) < 1.0, got


def test_gpu_name_gives_vllms_device_defaults():
    """`_set_default_args` keys on the device's name as well as its memory: an A100 of 79.25 GiB gets 256
    sequences and 2048 batched tokens under `vllm serve`, an H100 of the same memory 1024 and 8192 (issue 27:
    the A100 row was priced with the H100's defaults when only --gpu-memory said what it was)."""
    import json
    import subprocess
    import sys

    def run(gpu):
        r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", "llama-3.1-8b", "--engine", "vllm",
                            "--gpu", gpu, "--gpu-memory", "79.25GiB", "--max-model-len", "8192", "--json"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["vllm"]

    a100, h100 = run("A100-SXM4-80GB"), run("H100 80GB HBM3")
    assert (a100["max_num_seqs"], a100["max_num_batched_tokens"]) == (256, 2048)
    assert (h100["max_num_seqs"], h100["max_num_batched_tokens"]) == (1024, 8192)
    r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", "llama-3.1-8b", "--engine", "vllm", "--gpu",
                        "Voodoo 3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
