"""--engine vllm: vLLM's layout of the weights against published "Model loading took" figures, the KV
page rules of each attention kind, the startup-log parser against real log excerpts, the messages for a
length that does not fit, the command line's refusals, and the published-figures runner."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramcal.estimator.vllm import kv as K
from vramcal.estimator.vllm import messages as M
from vramcal.estimator.vllm.arch import arch_of
from vramcal.estimator.vllm.engine import VllmArgs, as_estimate, estimate_vllm
from vramcal.estimator.vllm.logparse import parse_log
from vramcal.estimator.vllm.versions import parse_version

ROOT = Path(__file__).parent.parent
DATA = ROOT / "tests" / "data" / "vllm"
CONFIGS = ROOT / "benchmarks" / "published" / "vllm" / "configs"
GIB = 1024**3
H100 = int(79.19 * GIB)  # what vLLM reports for an H100 80GB HBM3 ("Free memory on device (78.68/79.19 GiB)")


def cfg(name: str) -> str:
    path = CONFIGS / f"{name}.json"
    return str(path) if path.is_file() else name


def _est(model, **kw):
    base = dict(gpu_memory_bytes=H100, gpu_memory_utilization=0.95, max_model_len=8192, vllm_version="0.19.0")
    return estimate_vllm(cfg(model), VllmArgs(**{**base, **kw}))


# ------------------------------------------------------------------------------------ weights

# (config, tp, pp, --quantization, --dtype, logged "Model loading took" GiB) from the llm-d-planner 0.19 logs
# (benchmarks/published/vllm/corpus.csv); vLLM prints two decimals, so 0.005 GiB is its own rounding
WEIGHTS = [
    ("llama-3.1-8b", 1, 1, None, "auto", 14.99, 0.006),  # dense, GQA, untied, llama3 rope cache
    ("llama-3.1-8b", 4, 1, None, "auto", 3.77, 0.006),  # vocab split by tp
    ("llama-3.1-8b", 1, 4, None, "auto", 4.26, 0.006),  # the first pipeline stage: embedding + 8 layers
    ("llama-3.1-8b", 1, 1, "fp8", "auto", 8.49, 0.006),  # online fp8: linear layers 1 byte, embeddings 16-bit
    ("llama-3.1-8b", 1, 1, None, "float32", 29.98, 0.006),
    ("qwen3-8b", 1, 1, None, "auto", 15.27, 0.006),
    ("qwen3-30b-a3b", 1, 1, None, "auto", 56.88, 0.006),  # MoE: fused experts
    ("mixtral-8x7b", 2, 1, None, "auto", 43.51, 0.006),  # MoE split by tp
    ("gemma-2-9b", 1, 1, None, "auto", 17.22, 0.006),  # sliding window, tied
    ("granite-3.1-8b", 1, 1, None, "auto", 15.25, 0.006),  # tied, padded vocab 49155 -> 49216
    ("llama-3.3-70b-fp8-dynamic", 4, 1, None, "auto", 16.96, 0.006),  # compressed-tensors per-channel fp8
    ("deepseek-v2-lite", 1, 1, None, "auto", 29.43, 0.16),  # MLA: 0.15 GiB short (docs/vllm.md)
    ("llama-3.1-8b-w4a16", 1, 1, None, "float16", 5.38, 0.05),  # Marlin: 0.04 GiB short (workspaces)
]


@pytest.mark.parametrize("model,tp,pp,quant,dtype,logged,tol", WEIGHTS)
def test_weights_in_vllm_layout_match_published_loading_figures(model, tp, pp, quant, dtype, logged, tol):
    e = _est(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, quantization=quant, dtype=dtype)
    first = e.ranks[0].weights_bytes if e.ranks else e.weights_bytes
    assert abs(first / GIB - logged) <= tol, (model, first / GIB, logged)


def test_kv_heads_replicate_when_tp_exceeds_them():
    a = arch_of(json.loads((ROOT / "vramcal/estimator/catalog/llama-3.1-8b.json").read_text()))
    v = parse_version("0.19")
    pages = {tp: K.layer_specs(a, tp, 2, 16, v)[0].page_bytes for tp in (1, 2, 8, 16)}
    assert pages == {1: 2 * 16 * 8 * 128 * 2, 2: 2 * 16 * 4 * 128 * 2, 8: 2 * 16 * 1 * 128 * 2, 16: 2 * 16 * 1 * 128 * 2}


# ------------------------------------------------------------------------------------ KV rules

def test_page_size_of_each_attention_kind():
    v = parse_version("0.19")
    ds = arch_of(json.loads((ROOT / "vramcal/estimator/catalog/deepseek-v2-lite.json").read_text()))
    mla = K.layer_specs(ds, 4, 2, 16, v)
    assert {s.page_bytes for s in mla} == {16 * (512 + 64) * 2}  # MLA: one latent vector, not split by tp
    g = arch_of(json.loads((ROOT / "vramcal/estimator/catalog/gemma-3-27b.json").read_text()))
    specs = K.layer_specs(g, 1, 2, 16, v)
    assert sum(s.kind == "sliding" for s in specs) == 52 and sum(s.kind == "full" for s in specs) == 10
    sliding = next(s for s in specs if s.kind == "sliding")
    assert sliding.page_bytes == 2 * 16 * 16 * 128 * 2 and sliding.window == 1024
    # a sliding layer holds min(window - 1 + mnbt, len) tokens, plus one block
    assert sliding.max_memory(8192, 16, 8192) == (512 + 1) * sliding.page_bytes
    assert sliding.max_memory(100_000, 16, 2048) == (K.cdiv(1023 + 2048, 16) + 1) * sliding.page_bytes
    fp8 = K.layer_specs(g, 1, 1, 16, v)[0]
    assert fp8.page_bytes * 2 == sliding.page_bytes
    old = K.layer_specs(g, 1, 2, 16, parse_version("0.9.0"))  # before the hybrid manager: all full attention
    assert {s.kind for s in old} == {"full"}
    chunked = K.LayerSpec("chunked", 1000, 8192)
    assert chunked.max_memory(100_000, 16, 8192) == K.cdiv(16384, 16) * 1000


def test_hybrid_grouping_reproduces_the_gemma_3_log():
    """gemma-3-27b on vLLM 0.19 (llm-d log): Available 19.53 GiB -> 15,997 blocks, 7 groups of 10 layers,
    "GPU KV cache size: 36,560 tokens", "Maximum concurrency for 8,192 tokens per request: 4.46x"."""
    v = parse_version("0.19")
    g = K.grouping(K.layer_specs(arch_of(json.loads((ROOT / "vramcal/estimator/catalog/gemma-3-27b.json").read_text())),
                                 1, 2, 16, v))
    assert (g.uniform, g.group_size, g.num_groups) == (False, 10, 7)
    blocks = int(19.5285 * GIB) // g.bytes_per_block  # the log rounds it to 19.53
    assert blocks == 15997
    conc = K.max_concurrency(g, blocks, 8192, 16, 8192, v, blocks * 16)
    assert K.reported_tokens(g, blocks, 16, conc, 8192, v) == 36560 and f"{conc:.2f}" == "4.46"
    # from 0.20 the tokens are int(concurrency x max_model_len)
    v20 = parse_version("0.20")
    assert K.reported_tokens(g, blocks, 16, conc, 8192, v20) == int(conc * 8192)


def test_uniform_blocks_and_the_minimum_over_pipeline_stages():
    """Llama-3.1-8B, PP 2 on 0.19 (llm-d log): the first stage logs 66.54 GiB available, the last (which runs
    the sampler) has less; the tokens are the last stage's: 1,075,312."""
    e = _est("llama-3.1-8b", pipeline_parallel_size=2)
    first, last = e.ranks
    assert last.available_bytes < first.available_bytes and e.limiting_rank == 1
    assert abs(first.available_bytes / GIB - 66.54) < 0.1
    assert abs(e.kv_cache_tokens - 1_075_312) / 1_075_312 < 0.005
    assert e.num_blocks == last.num_blocks and first.kv_cache_bytes == e.num_blocks * 16 * 65536


def test_end_to_end_against_the_llama_log():
    e = _est("llama-3.1-8b")
    assert abs(e.kv_cache_tokens - 476_016) / 476_016 < 0.002
    assert "Model loading took 14.99 GiB memory" in e.log_lines
    assert any(line.startswith("Maximum concurrency for 8,192 tokens per request: 58.1") for line in e.log_lines)
    assert e.fits and e.max_model_len_fit == 131072


# ------------------------------------------------------------------------------------ messages

def _fixture_line(name: str, start: str) -> str:
    for line in (DATA / name).read_text().splitlines():
        i = line.find(start)
        if i >= 0:
            return line[i:]
    raise AssertionError(f"{start!r} not in {name}")


def test_length_error_of_0_10_reproduces_the_published_one():
    """Qwen3-30B-A3B with an fp8 KV cache at --max-model-len 221000 (vllm#25350, 0.10.2): 10.12 GiB needed,
    5.59 GiB available, estimated maximum length 122080 -- from the page rules alone."""
    v = parse_version("0.10.2")
    a = arch_of(json.loads((ROOT / "vramcal/estimator/catalog/qwen3-30b-a3b.json").read_text()))
    specs = K.layer_specs(a, 1, 1, 16, v)
    available = int(5.5885 * GIB)  # what the log rounds to 5.59
    needed = K.needed_bytes(specs, 221000, 16, 8192)
    est = K.largest_length(specs, available, 221000, 16, 8192)
    assert est == 122080
    want = _fixture_line("r028.log", "To serve at least one request")
    assert M.too_long_error(v, 221000, needed, available, est) == want


def test_length_error_texts_per_version():
    assert M.too_long_error(parse_version("0.19"), 262144, 36 * GIB, int(6.94 * GIB), 50512) == \
        _fixture_line("r034.log", "To serve at least one request")
    assert M.too_long_error(parse_version("0.8.3"), 32768, int(0.95 * GIB), int(0.93 * GIB), 0) == \
        _fixture_line("r015.log", "To serve at least one request")
    new = M.too_long_error(parse_version("0.22"), 1000, GIB, GIB // 2, 500)
    assert "model's max seq len" in new and "CPU backend" in new


def test_an_estimate_that_does_not_fit_carries_vllms_message():
    e = _est("llama-3.1-8b", gpu_memory_bytes=24 * GIB, gpu_memory_utilization=0.9, max_model_len=131072)
    assert not e.fits and e.error.startswith("To serve at least one request with the models's max seq len (131072)")
    assert f"the estimated maximum model length is {e.max_model_len_fit}." in e.error
    assert 30000 < e.max_model_len_fit < 60000


# ------------------------------------------------------------------------------------ the log parser

def _expected() -> list[dict]:
    with open(DATA / "expected.csv", newline="") as fh:
        return list(csv.DictReader(fh))


NOT_IN_ITS_OWN_LINE = {("r015", "kv_cache_gib"), ("r017", "kv_cache_tokens"), ("r028", "kv_cache_gib"),
                       ("r034", "kv_cache_gib")}  # inside an error text, derived, or a second run in the file


@pytest.mark.parametrize("row", _expected(), ids=lambda r: r["id"][:40])
def test_parser_reads_each_fixture_as_the_research_table_does(row):
    log = parse_log((DATA / f"{row['id']}.log").read_text())
    checks = (("weights_gib", log.weights_bytes, GIB), ("activation_peak_gib", log.activation_bytes, GIB),
              ("non_torch_gib", log.non_torch_bytes, GIB), ("kv_cache_gib", log.kv_cache_bytes, GIB),
              ("kv_cache_tokens", log.kv_cache_tokens, 1), ("max_concurrency", log.max_concurrency, 1))
    compared = 0
    for col, got, unit in checks:
        text = row[col].split(" ")[0].replace(",", "")
        if not text or (row["id"], col) in NOT_IN_ITS_OWN_LINE:
            continue
        assert got is not None, (col, row["id"])
        assert abs(got / unit - float(text)) <= 0.0051 * max(1.0, abs(float(text))) if unit == 1 else \
            abs(got / unit - float(text)) < 0.0051, (col, got / unit, text)
        compared += 1
    assert compared >= 1 or row["error_message"]
    if row["error_message"]:
        assert log.error and row["error_message"].split("...")[0].replace("ValueError: ", "").strip()[:60] in log.error


def test_parser_keeps_every_workers_lines():
    log = parse_log((DATA / "r001.log").read_text())  # TP 8 on 0.10.2: each worker logs its own tokens
    assert len(log.per_worker["kv_cache_tokens"]) == 8 and min(log.per_worker["kv_cache_tokens"]) == 237344
    assert parse_log((DATA / "r002.log").read_text()).cuda_graph_bytes < 0  # unified memory
    v0 = parse_log((DATA / "r017.log").read_text())
    assert v0.engine == "v0" and v0.num_blocks == 5519
    assert parse_log("nothing of vLLM here").found is False


# ------------------------------------------------------------------------------------ the command line

def _cli(*argv):
    from vramcal.cli import main

    return main(list(argv))


BAD = [
    ["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "1.5"], ["-tp", "3"],
    ["--max-model-len", "262144"], ["--quant", "nf4"], ["--kv-cache-dtype", "int3"], ["--block-size", "7"],
    ["--vllm-version", "0.5"], ["--gpu-memory", "lots"], ["--quantization", "gptq"],
    ["-tp", "0"], ["-pp", "0"], ["--max-num-batched-tokens", "128", "--max-num-seqs", "256"], ["--images", "1"],
    ["--image-size", "0x0"],
]


@pytest.mark.parametrize("extra", BAD, ids=lambda x: " ".join(x))
def test_bad_input_is_one_line_and_exit_2(extra, capsys):
    rc = _cli("estimate", "qwen2.5-7b", "--engine", "vllm", "--gpu-memory", "80GiB", "--no-correction", *extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("vramcal: ") and "\n" not in err, err


def test_batched_tokens_below_the_default_concurrency_lower_it():
    """vLLM sets an unset max_num_seqs to its default, at most max_num_batched_tokens
    (engine/arg_utils.py, _set_default_args): 512 batched tokens on an 80 GiB GPU serve 512 sequences."""
    e = _est("qwen2.5-7b", max_num_batched_tokens=512)
    assert e.max_num_seqs == 512 and e.max_num_batched_tokens == 512
    assert _est("qwen2.5-7b").max_num_seqs == 1024


def test_unknown_engine_and_vllm_flags_without_it(capsys):
    assert _cli("estimate", "qwen2.5-7b", "--engine", "sglang") == 2
    assert _cli("estimate", "qwen2.5-7b", "--max-num-seqs", "8") == 2
    assert _cli("fit", "qwen2.5-7b", "--budget", "24GiB", "--tensor-parallel-size", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "unknown --engine 'sglang'" in err[0] and "belongs to --engine vllm" in err[1]


def test_vision_language_weights_against_vllms_logged_figures():
    """benchmarks/published/vlm_vllm_weights.csv: the "Model loading took" lines others published for
    Gemma 3 and Qwen2.5-VL, read by nothing else. vLLM's load delta holds the parameters and a little
    more (0.2-0.7 GiB here, not modelled): the engine's weights come out 0.6-1.3 % under each verbatim
    log line (docs/vision.md lists the rows). The MI300X row is an author's paraphrase, listed only."""
    rows = [r for r in csv.DictReader(open(ROOT / "benchmarks" / "published" / "vlm_vllm_weights.csv"))
            if r["kind"] == "weights" and r["catalog"]]
    assert len(rows) == 4
    for r in rows:
        got = _est(r["catalog"], max_model_len=4096).weights_bytes
        err = (got - int(r["figure_bytes"])) / int(r["figure_bytes"])
        if "paraphrase" in r["counter"]:
            continue
        assert -0.015 < err < 0, (r["id"], got, r["figure_bytes"], err)


def test_json_carries_the_vllm_object_per_rank(capsys):
    rc = _cli("estimate", "qwen2.5-7b", "--engine", "vllm", "--gpu-memory", "79.19GiB", "-tp", "2", "-pp", "2",
              "--max-model-len", "8192", "--vllm-version", "0.19", "--json", "--no-correction")
    d = json.loads(capsys.readouterr().out)
    assert rc == 0
    v = d["vllm"]
    for key in ("version", "weights_bytes", "activation_bytes", "non_torch_bytes", "cuda_graph_bytes", "kv_cache_bytes",
                "kv_cache_tokens", "block_size", "num_blocks", "max_concurrency", "max_model_len", "max_model_len_fit",
                "fits", "ranks"):
        assert key in v, key
    assert len(v["ranks"]) == 4 and v["num_blocks"] == min(r["num_blocks"] for r in v["ranks"])
    lim = v["ranks"][v["limiting_rank"]]
    assert v["kv_cache_bytes"] == lim["available_bytes"] and v["activation_bytes"] == lim["activation_bytes"]
    from vramcal.estimator.result import Estimate

    back = Estimate.from_dict(d)
    assert back.vllm.ranks[3].weights_bytes == v["ranks"][3]["weights_bytes"] and back.estimator_model.startswith("vllm")


def test_fit_the_longest_length_and_the_utilization_a_length_needs(capsys):
    assert _cli("fit", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "24GiB", "--gpu-memory-utilization", "0.9",
                "--vllm-version", "0.19", "--json", "--no-correction") == 0
    longest = json.loads(capsys.readouterr().out)
    assert longest["fits"] and 30000 < longest["max_model_len"] < 60000
    e = _est("llama-3.1-8b", gpu_memory_bytes=24 * GIB, gpu_memory_utilization=0.9, max_model_len=longest["max_model_len"])
    assert e.fits and not _est("llama-3.1-8b", gpu_memory_bytes=24 * GIB, gpu_memory_utilization=0.9,
                               max_model_len=longest["max_model_len"] + 16).fits
    rc = _cli("fit", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "79.19GiB", "--max-model-len", "32768",
              "--concurrency", "8", "--vllm-version", "0.19", "--json", "--no-correction")
    need = json.loads(capsys.readouterr().out)
    assert rc == 0 and need["fits"] and need["max_concurrency"] >= 8
    at = _est("llama-3.1-8b", gpu_memory_utilization=need["gpu_memory_utilization"] - 0.002, max_model_len=32768)
    assert at.max_concurrency < 8  # the utilization found is the smallest that holds 8 requests


def test_as_estimate_stages():
    e = _est("llama-3.1-8b")
    est = as_estimate(type("S", (), {"name": "x", "config": {"architectures": ["L"]}, "config_hash": "h",
                                     "revision": None})(), e)
    assert est.stages["post_load"] > e.requested_bytes > est.stages["load_peak"] > e.weights_bytes


def test_learned_terms_per_version_and_shape():
    from vramcal.calibrate.vllm_corrections import learned_terms

    runs = [{"run_id": 1, "version": "0.19.0", "tp": 1, "pp": 1, "predicted": {"activation_bytes": 100, "non_torch_bytes": 10},
             "logged": {"activation_bytes": 160, "non_torch_bytes": 30}},
            {"run_id": 2, "version": "0.19.0", "tp": 2, "pp": 1, "predicted": {"activation_bytes": 100, "non_torch_bytes": 10},
             "logged": {"activation_bytes": 140, "non_torch_bytes": 5000}},
            {"run_id": 3, "version": "0.18.0", "tp": 1, "pp": 1, "predicted": {"activation_bytes": 1, "non_torch_bytes": 1},
             "logged": {"activation_bytes": 9, "non_torch_bytes": 9}}]
    terms, ids, scope = learned_terms(runs, "0.19.0", 1, 1)
    assert terms == {"activation_bytes": 60, "non_torch_bytes": 20} and ids == [1] and "tp=1" in scope
    terms, ids, _ = learned_terms(runs, "0.19.0", 4, 1)  # no run of this shape: activation from any, no non-torch
    assert terms == {"activation_bytes": 50} and ids == [1, 2]
    assert learned_terms(runs, "0.20.0", 1, 1)[0] == {}


def test_probe_engine_vllm_without_vllm_says_so_in_one_line(capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    for verb in ("probe", "check"):
        rc = _cli(verb, "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "24GiB")
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err and "vLLM" in err, err


def test_published_runner_on_two_rows(tmp_path):
    corpus = ROOT / "benchmarks" / "published" / "vllm" / "corpus.csv"
    with open(corpus, newline="") as fh:
        rows = list(csv.DictReader(fh))
    pick = [r for r in rows if r["model"] in ("llama-3.1-8b", "gemma-2-9b") and r["tp"] == "1" and r["pp"] == "1"
            and r["id"].startswith("llmd_")][:2]
    small = tmp_path / "corpus.csv"
    with open(small, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(pick)
    (tmp_path / "configs").symlink_to(corpus.parent / "configs")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "published_vllm.py"), "--corpus", str(small),
                        "--out-dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = list(csv.DictReader(open(tmp_path / "out" / "published-vllm.csv")))
    assert len(got) == 2 and all(abs(float(g["KV tokens_err_pct"])) < 1.0 for g in got)
    assert "| KV tokens | all | 2 |" in (tmp_path / "out" / "published-vllm.md").read_text()


def _record(db, source, result) -> int:
    """A vLLM probe's record, written as `probe --engine vllm` writes it: the run before vLLM starts, its
    outcome after."""
    from vramcal.calibrate.runs import begin_engine_run, finish_engine_run
    from vramcal.cli_vllm import vllm_outcome, vllm_run_context

    run_id = begin_engine_run(db, "cuda:0", vllm_run_context(source, result.estimate,
                                                             "vramcal probe llama-3.1-8b --engine vllm"))
    finish_engine_run(db, run_id, vllm_outcome(result.estimate, result))
    return run_id


def test_a_vllm_probes_stages_and_samples_reach_the_records(tmp_path):
    """The sampler's readings at vLLM's markers become the run's stage rows, and its series the run's
    samples (a vLLM probe once recorded every stage as None and no samples)."""
    from vramcal.estimator.resolve import resolve_model
    from vramcal.probes.sampler import Sample
    from vramcal.probes.engine_run import stage_readings
    from vramcal.probes.vllm_probe import VllmProbeResult
    from vramcal.records.store import Store

    gib = 1024**3
    samples = [Sample(t, {"gpu0": int(b * gib)}) for t, b in
               [(0.0, 0.5), (1.0, 0.6), (2.0, 16.0), (2.5, 17.2), (3.0, 16.1), (4.0, 70.0), (4.5, 71.3), (5.0, 71.0)]]
    markers = [("baseline", 1.0), ("post_load", 3.0), ("first_token", 5.0)]
    stages = stage_readings(samples, markers, "gpu0")
    assert stages == {"baseline": {"used_bytes": int(0.6 * gib), "peak_bytes": int(0.6 * gib)},
                      "post_load": {"used_bytes": int(16.1 * gib), "peak_bytes": int(17.2 * gib)},
                      "first_token": {"used_bytes": int(71.0 * gib), "peak_bytes": int(71.3 * gib)}}
    source = resolve_model("llama-3.1-8b")
    raw = _est("llama-3.1-8b")
    logged = parse_log((DATA / "llmd_meta-llama-llama-3-1-8b_-h100-80gb_tp1pp1dp1_8192.log").read_text())
    result = VllmProbeResult("ok", source.name, "0.19.0", [0], stages, logged, as_estimate(source, raw),
                             last_stage="first_token", wall_s=5.0, samples=samples)
    db = str(tmp_path / "runs.db")
    run_id = _record(db, source, result)
    with Store(db, create=False, readonly=True) as s:
        run = s.run(run_id)
    assert {r.stage: r.measured_peak_bytes for r in run.outcome.stages} == {
        k: v["peak_bytes"] for k, v in stages.items()}
    assert run.sample_count == len(samples)


def test_a_recorded_vllm_run_corrects_the_next_estimate(tmp_path, monkeypatch, capsys):
    """A vLLM probe's record (faked here: no vLLM, no GPU) holds the prediction and the logged terms; the
    next estimate on this machine and version takes the logged activation and non-torch instead."""
    from vramcal.estimator.resolve import resolve_model
    from vramcal.estimator.vllm.logparse import parse_log
    from vramcal.probes.vllm_probe import VllmProbeResult

    db = str(tmp_path / "runs.db")
    source = resolve_model("llama-3.1-8b")
    raw = _est("llama-3.1-8b")
    logged = parse_log((DATA / "llmd_meta-llama-llama-3-1-8b_-h100-80gb_tp1pp1dp1_8192.log").read_text())
    logged.activation_bytes = raw.activation_bytes + 300 * 1024**2  # this machine's profile takes 300 MiB more
    logged.non_torch_bytes = raw.non_torch_bytes + 100 * 1024**2
    result = VllmProbeResult("ok", source.name, "0.19.0", [0], {"post_load": {"used_bytes": 1, "peak_bytes": 2}},
                             logged, as_estimate(source, raw), last_stage="end", wall_s=1.0)
    run_id = _record(db, source, result)
    assert run_id is not None
    rc = _cli("estimate", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "79.19GiB", "--gpu-memory-utilization",
              "0.95", "--max-model-len", "8192", "--vllm-version", "0.19", "--db", db, "--json")
    v = json.loads(capsys.readouterr().out)["vllm"]
    assert rc == 0 and v["correction"]["source_runs"] == [run_id]
    assert v["activation_bytes"] == logged.activation_bytes and v["non_torch_bytes"] == logged.non_torch_bytes
    assert v["kv_cache_bytes"] == raw.kv_cache_bytes - 400 * 1024**2
    assert v["correction"]["raw"]["kv_cache_tokens"] == raw.kv_cache_tokens > v["kv_cache_tokens"]


def test_kv_cache_memory_pins_the_budget_and_exists_from_0_10_2():
    e = _est("llama-3.1-8b", kv_cache_memory_bytes=20 * GIB)
    assert e.kv_cache_bytes == 20 * GIB and e.num_blocks == 20 * GIB // (2 * 1024**2)
    from vramcal.errors import UserError

    with pytest.raises(UserError, match="0.10.2"):
        _est("llama-3.1-8b", kv_cache_memory_bytes=20 * GIB, vllm_version="0.9.2")
    graphs = _est("llama-3.1-8b", vllm_version="0.20")  # 0.20 on: the CUDA-graph estimate comes off the budget
    assert graphs.cuda_graph_subtracted and graphs.kv_cache_bytes == _est("llama-3.1-8b").kv_cache_bytes - graphs.cuda_graph_bytes
    assert graphs.kv_cache_tokens == int(graphs.max_concurrency * 8192) or \
        abs(graphs.kv_cache_tokens - graphs.num_blocks * 16) <= 16


def test_a_config_that_leaves_fields_to_the_defaults_is_filled_as_transformers_fills_it():
    """gemma-3-4b's published config gives no vocabulary and no head counts: the vLLM engine reads them as
    transformers fills them (vLLM's config class fills the same), instead of failing on None."""
    from vramcal.estimator.vllm.arch import arch_of
    from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm

    raw = json.loads((ROOT / "vramcal/estimator/catalog/gemma-3-4b.json").read_text())
    assert "vocab_size" not in raw["text_config"]
    e = estimate_vllm("gemma-3-4b", VllmArgs(gpu_memory_bytes=80 * 1024**3, max_model_len=8192))
    assert e.fits and e.kv_cache_tokens > 0 and e.weights_bytes > 0
    from transformers import Gemma3TextConfig

    filled = {"text_config": {"vocab_size": Gemma3TextConfig().vocab_size, "num_attention_heads": 8}}
    a = arch_of(raw, filled)
    assert a.vocab == Gemma3TextConfig().vocab_size and a.hidden == raw["text_config"]["hidden_size"]
