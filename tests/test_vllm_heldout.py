"""--engine vllm beyond the runs it was fitted on (issue 27): the dummy sampler's sort against
FlashInfer's sampler, the log parser on the wording of each version the held-out rows come from, and
the held-out rows of benchmarks/published/vllm/corpus.csv through the estimate."""

from __future__ import annotations

import csv
import functools
import json
import re
import statistics
from pathlib import Path

import pytest

from vramcal.cli import main
from vramcal.errors import UserError
from vramcal.estimator.vllm.arch import arch_of
from vramcal.estimator.vllm.budget import HIDDEN_KEPT, SAMPLER_BYTES, SORT_BYTES, activation, compile_bench_bytes
from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm
from vramcal.estimator.vllm.layout import pad_vocab
from vramcal.estimator.vllm.logparse import parse_log
from vramcal.estimator.vllm.versions import parse_version, sampler_sorts

ROOT = Path(__file__).parent.parent
CORPUS_DIR = ROOT / "benchmarks" / "published" / "vllm"
GIB = 1024**3


def _rows() -> dict[str, dict]:
    """corpus.csv and the held-out collections beside it (heldout-*.csv), as the benchmark reads them."""
    rows = []
    for path in [CORPUS_DIR / "corpus.csv", *sorted(CORPUS_DIR.glob("heldout-*.csv"))]:
        with open(path, newline="") as fh:
            rows += list(csv.DictReader(fh))
    return {r["id"]: r for r in rows}


@functools.lru_cache(maxsize=1)
def _held_out_results() -> tuple[dict, ...]:
    """Every held-out row through the benchmark's own comparison, once per test session."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import run_row

    return tuple(run_row(r, CORPUS_DIR) for r in _rows().values() if r["split"] == "held-out")


def _collection_ids(name: str) -> set[str]:
    with open(CORPUS_DIR / name, newline="") as fh:
        return {r["id"] for r in csv.DictReader(fh)}


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
    sampling": priced with the sort its KV tokens came out 17 % short; without it, within 2 % (-1.4 %: since the
    weights count the allocator's blocks, layout.py, the row's 0.06 GiB of Qwen2 weights no longer hide the
    0.07 GiB by which the 0.10 activation and non-torch defaults exceed what this A100 run left; it was -0.3 %)."""
    row = _rows()["dl22_qwen2-7b_a100-80gb_tp1_u0.25"]
    base = dict(gpu_memory_bytes=int(79.25 * GIB), gpu_name=row["gpu"], gpu_memory_utilization=0.25,
                max_model_len=16384, vllm_version=row["vllm_version"])
    cfg = str(CORPUS_DIR / "configs" / "qwen2-7b.json")
    logged = int(row["kv_cache_tokens"])
    sorted_ = estimate_vllm(cfg, VllmArgs(**base)).kv_cache_tokens
    fi = estimate_vllm(cfg, VllmArgs(**base, flashinfer_sampler=True)).kv_cache_tokens
    assert abs(fi - logged) / logged < 0.02, (fi, logged)
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
# rows whose source tabulates vLLM's startup figures instead of quoting its lines (column `figures`)
TABLED = [r for r in HELD_OUT if r.get("figures") == "table"]


@pytest.mark.parametrize("row", [r for r in HELD_OUT if r not in TABLED], ids=lambda r: r["id"])
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


@pytest.mark.parametrize("row", TABLED, ids=lambda r: r["id"])
def test_tabled_rows_carry_the_figures_their_source_prints(row):
    """A row taken from a source's table (heldout-2026-12-03.csv: the L4 arms and the AWQ L40S runs of one
    post) has no log line to parse: its fixture quotes the table, and every figure of the row is there as
    the source prints it (tokens with thousands separators, GiB to two decimals, concurrency)."""
    text = (CORPUS_DIR / row["fixture"]).read_text()
    # a table, not vLLM's lines -- or, where the source quotes vLLM's KV lines beside its table (heldout-2026-12-04's
    # RTX 4080 notes), those lines, which then give the row's tokens
    parsed = parse_log(text).kv_cache_tokens
    assert parsed is None or parsed == int(row["kv_cache_tokens"]), parsed
    # every figure of the row is one of the numbers of the quoted table lines, as printed there (the sources print
    # GiB to one or two decimals: 9.10 GiB, 3.0 GiB); tokens with the thousands separators the tables use
    quoted = [ln for ln in text.splitlines() if not ln.startswith("#")]
    printed = {float(x) for ln in quoted for x in re.findall(r"-?\d+\.\d+", ln)}
    # the L4 page of heldout-2026-12-03d.csv is French: decimal commas ("3,3 Gio") and spaces between thousands
    printed |= {float(x.replace(",", ".")) for ln in quoted for x in re.findall(r"(?<![\d,])\d+,\d{1,2}(?![\d,])", ln)}
    if row["kv_cache_tokens"]:  # a KV table (heldout-2026-12-03.csv's post; the RTX 5090 notes of 2026-12-03c)
        n = int(row["kv_cache_tokens"])
        assert any(f"{n:,}" in ln or f"{n:,}".replace(",", " ") in ln for ln in quoted), row["kv_cache_tokens"]
        assert float(row["max_concurrency"]) in printed, row["max_concurrency"]
    for col in ("weights_gib", "activation_gib", "non_torch_gib", "kv_cache_gib", "cuda_graph_gib"):
        if row[col]:
            assert float(row[col]) in printed, (col, row[col])


def test_pool_line_not_the_estimating_capture_gives_the_graph_memory_of_0_29():
    """0.29 (v1/worker/gpu_worker.py determine_available_memory) calls profile_cudagraph_memory before the
    KV cache is sized: that capture prints its own "Graph capturing finished ... took 0.44 GiB"; the real
    capture after it is "CUDA graph pool memory: 0.27 GiB (actual), 0.51 GiB (estimated)", which the
    suggestion line repeats ("0.27 GiB for CUDAGraph memory"). The first "took" line is not the capture."""
    text = (CORPUS_DIR / "logs" / "l40s_qwen3-14b_v0.29.0.log").read_text()
    log = parse_log(text)
    assert abs(log.cuda_graph_bytes / GIB - 0.27) < 0.006 and abs(log.cuda_graph_estimate_bytes / GIB - 0.51) < 0.006
    only_took = "\n".join(ln for ln in text.splitlines() if "Graph capturing finished" in ln)
    assert abs(parse_log(only_took).cuda_graph_bytes / GIB - 0.44) < 0.006  # alone, the first capture line stands
    assert abs(log.activation_bytes / GIB - (1.99 - 0.51)) < 0.006  # printed peak minus the applied estimate


def test_consumed_accounting_line_of_0_31():
    """0.27 on the "peak activation" of that line is transient peak + the applied graph estimate
    (gpu_worker.py: peak_activation_memory = transient_peak_headroom + cudagraph_memory_estimate_applied):
    kept as printed; the activation proper is not read where the log prints no estimate."""
    log = parse_log((CORPUS_DIR / "logs" / "a100-80gb_llama-3.1-8b_v0.31.0.log").read_text())
    assert abs(log.consumed_bytes / GIB - 15.26) < 0.006 and abs(log.peak_with_graphs_bytes / GIB - 1.44) < 0.006
    assert log.activation_bytes is None
    assert abs(log.total_bytes / GIB - 79.25) < 0.006 and log.gpu_memory_utilization == 0.92
    assert log.max_model_len == 131072 and log.max_concurrency == 3.51


# ------------------------------------------------------------------- the held-out rows end to end

# Qwen3-14B-AWQ on vLLM 0.29.0 / 0.28.0: vLLM holds 9.44 GiB after loading a 9.29 GiB checkpoint (both logged);
# vramcal prices the checkpoint (9.30 GiB). The 0.15 GiB are not found in the AWQ -> Marlin conversion
# (auto_awq.py, MarlinLinearKernel: same-size repacks) -- docs/vllm.md "Held out". The blind Qwen2.5-1.5B-Instruct-AWQ
# start of heldout-2026-12-03c.csv (H200, 0.19.1, awq_marlin / Machete) shows the same: 1.13 GiB logged, 1.08 priced
# (-4.6 %). Strict: a fix shows here.
AWQ_WEIGHT_GAP = pytest.mark.xfail(strict=True, reason="AWQ Marlin load above the checkpoint, not modelled")


# gpt-oss on vLLM 0.11.0's docker image (heldout-2026-12-03b.csv): 13.47 / 64.38 GiB logged, the Triton layout's
# figures (64.38 is also the 0.14.1 Triton log's); vramcal takes Marlin before 0.13 (mxfp4.backend: the 0.11 wheel
# has no triton_kernels) and the source does not say which backend ran. Strict: a rule for the image shows here.
MXFP4_BACKEND_UNKNOWN = pytest.mark.xfail(strict=True, reason="0.11 image's MXFP4 backend (Triton?) not known")


def _weights_mark(r: dict):
    # the RTX 4080 notes' Qwen2.5-7B-AWQ, 5.29 GiB against 5.20 priced (heldout-2026-12-04)
    if r["model"] in ("qwen3-14b-awq", "qwen2.5-1.5b-awq") or r["id"] == "rtx4080_qwen2.5-7b-awq_u0.90_len32768_v0.26.0":
        return pytest.param(r, marks=AWQ_WEIGHT_GAP)
    if r["model"].startswith("gpt-oss") and r["vllm_version"] == "0.11.0":
        return pytest.param(r, marks=MXFP4_BACKEND_UNKNOWN)
    return r


@pytest.mark.parametrize("row", [_weights_mark(r) for r in HELD_OUT if r["weights_gib"]], ids=lambda r: r["id"])
def test_held_out_weights_within_one_percent(row):
    got = next(r for r in _held_out_results() if r["id"] == row["id"])
    assert not got["error"] and abs(got["weights_err_pct"]) < 1.0, got


# Qwen3-14B(-AWQ) on vLLM 0.29.0, L40S, each a cold start (the raw logs compile: "Compiling a graph for compile
# range"): the transient peak the logs give (printed peak minus the printed graph estimate) is 1.48-1.60 GiB. It
# was 0.9 GiB above what vramcal priced until the cold compile's kernel benchmark was read (budget.py: a random
# copy of the embedding table and the kernel's outputs, 1.49 / 1.60 GiB here).
V2_LOGGED = [r for r in HELD_OUT if r["vllm_version"] == "0.29.0" and r["activation_gib"]]  # (the T4 rows of 2026-12-03d print none)


@pytest.mark.parametrize("row", V2_LOGGED, ids=lambda r: r["id"])
def test_held_out_v2_transient_peak_within_0_15_gib(row):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import args_of, model_ref

    logged = parse_log((CORPUS_DIR / row["fixture"]).read_text()).activation_bytes
    assert logged is not None  # printed peak minus the printed estimate
    est = estimate_vllm(model_ref(row, CORPUS_DIR), args_of(row))
    assert abs(est.activation_bytes - logged) < 0.15 * GIB, (est.activation_bytes / GIB, logged / GIB)


# ------------------------------------------------------------------- the cold compile's kernel benchmark

def _qwen3_14b():
    return arch_of(json.loads((CORPUS_DIR / "configs" / "qwen3-14b.json").read_text()))


def test_cold_compile_benchmark_is_a_copy_of_the_embedding_table_and_its_outputs():
    """torch 2.13 Inductor: ``benchmark_fused_nodes`` runs the kernel on ``get_args()``, one ``rand_strided``
    tensor per argument at its size (``codegen_kernel_benchmark``): the embedding kernel's table
    (``num_embeddings_per_partition`` = the 64-padded vocabulary / tp rows of H, model dtype) and, at tp 1, its
    two T x H outputs (layer 0's residual and the fused RMSNorm's); at tp > 1 the all-reduce ends the kernel
    after one output."""
    a = _qwen3_14b()
    v, el = parse_version("0.28.0"), 2
    for tp, t, outputs in ((1, 2048, 2), (1, 8192, 2), (2, 2048, 1)):
        want = (pad_vocab(a.vocab) // tp + outputs * t) * a.hidden * el
        assert compile_bench_bytes(a, tp, el, t) == want
        assert activation(a, tp, 0, 1, el, t, 256, v, cold_compile=True).compile_bench == want
    # Qwen3-14B at vLLM's small-GPU defaults: 151,936 x 5,120 x 2 B + 2 x 2048 x 5,120 x 2 B = 1.488 GiB
    assert round(compile_bench_bytes(a, 1, 2, 2048) / GIB, 3) == 1.488


def test_cold_compile_is_the_peak_only_where_it_is_larger():
    """The benchmark's tensors are freed before the profiling forward runs: the peak is the larger of the two,
    not their sum; only the first pipeline stage holds the embedding."""
    a = _qwen3_14b()
    v = parse_version("0.29.0")
    warm = activation(a, 1, 0, 1, 2, 2048, 256, v)
    cold = activation(a, 1, 0, 1, 2, 2048, 256, v, cold_compile=True)
    assert warm.compile_bench == 0 and cold.which == "compile" and cold.total == cold.compile_bench > warm.total
    big = activation(a, 1, 0, 1, 2, 8192, 1024, v, cold_compile=True)  # H100 defaults: the sampler is larger
    assert big.which == "sampler" and big.total == activation(a, 1, 0, 1, 2, 8192, 1024, v).total
    assert activation(a, 1, 1, 2, 2, 2048, 256, v, cold_compile=True).compile_bench == 0


def test_compile_benchmark_follows_version_eager_and_cache():
    """config/compilation.py sets combo_kernels / benchmark_combo_kernel from 0.12.0 (the first to pin torch 2.9);
    --enforce-eager compiles nothing; a warm cache loads the compiled artifact."""
    from vramcal.estimator.vllm.versions import compile_benchmarks_kernels

    assert not compile_benchmarks_kernels(parse_version("0.11.0"))
    assert compile_benchmarks_kernels(parse_version("0.12.0")) and compile_benchmarks_kernels(parse_version("0.29.0"))
    assert not compile_benchmarks_kernels(parse_version("0.29.0"), enforce_eager=True)
    assert not compile_benchmarks_kernels(parse_version("0.29.0"), compile_cache="warm")
    assert compile_benchmarks_kernels(parse_version("0.29.0"), compile_cache="cold")


def test_compile_cache_flag_reaches_the_estimate(capsys):
    common = ["estimate", "qwen2.5-7b", "--engine", "vllm", "--gpu-memory", "44.39GiB",
              "--max-model-len", "8192", "--vllm-version", "0.28.0", "--json"]
    got = {}
    for flag in ("cold", "warm"):
        assert main(common + ["--compile-cache", flag]) == 0
        got[flag] = json.loads(capsys.readouterr().out)["vllm"]["activation_bytes"]
    assert got["cold"] > got["warm"]
    assert main(common) == 0
    assert json.loads(capsys.readouterr().out)["vllm"]["activation_bytes"] == got["cold"]  # not known: cold


def test_compile_cache_bad_value_is_one_line_exit_2(capsys):
    rc = main(["estimate", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "79.25GiB", "--compile-cache", "tepid"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "--compile-cache" in err, err
    with pytest.raises(UserError):
        VllmArgs(compile_cache="tepid").validated()


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


# ------------------------------------------------------------------- rules read from 0.17-0.31's source

def test_default_utilization_follows_the_version():
    """config/cache.py: gpu_memory_utilization defaults to 0.9 in 0.17.1 and 0.19.1, to 0.92 from 0.20.0
    (0.20.0, 0.20.2, 0.24.0, 0.27.1, 0.31.0 read); an estimate without the flag asks for total x that."""
    from vramcal.estimator.vllm.versions import default_utilization

    assert default_utilization(parse_version("0.19.1")) == 0.9
    assert default_utilization(parse_version("0.20.0")) == 0.92 == default_utilization(parse_version("0.31.0"))
    cfg = str(ROOT / "vramcal/estimator/catalog/llama-3.1-8b.json")
    total = int(79.25 * GIB)
    for ver, util in (("0.19.1", 0.9), ("0.31.0", 0.92)):
        est = estimate_vllm(cfg, VllmArgs(gpu_memory_bytes=total, gpu_name="A100-SXM4-80GB", vllm_version=ver,
                                          max_model_len=8192))
        assert est.gpu_memory_utilization == util and est.requested_bytes == int(total * util)
    assert VllmArgs(gpu_memory_utilization=None).validated().gpu_memory_utilization is None
    with pytest.raises(UserError):
        VllmArgs(gpu_memory_utilization=1.5).validated()


def test_peak_activation_of_0_27_is_activation_plus_graph_estimate():
    """From 0.27 the line after the capture prints transient peak + the graph estimate; with the estimate
    logged ("CUDA graph pool memory: A (actual), E (estimated)") the activation is the difference, and
    KV = requested - consumed - printed peak (gpu_worker.py: available = requested - non_kv - estimate)."""
    from vramcal.estimator.vllm.versions import usage_peak_includes_graphs

    assert usage_peak_includes_graphs(parse_version("0.27.1")) and not usage_peak_includes_graphs(
        parse_version("0.26.0"))
    text = ("CUDA graph pool memory: 0.71 GiB (actual), 1.55 GiB (estimated), difference: 0.84 GiB (119.3%).\n"
            "Free memory on device (79.99/80.0 GiB) on startup. Desired GPU memory utilization is (0.92, 73.6 GiB). "
            "Actual usage is 51.66 GiB for consumed memory (weights + non-torch), 2.4 GiB for peak activation, and "
            "0.71 GiB for CUDAGraph memory.\nAvailable KV cache memory: 19.54 GiB\n")
    log = parse_log(text)
    assert log.cuda_graph_estimate_bytes == int(round(1.55 * GIB)) and log.cuda_graph_bytes == int(round(0.71 * GIB))
    assert log.peak_with_graphs_bytes == int(round(2.4 * GIB))
    assert log.activation_bytes == int(round(2.4 * GIB)) - int(round(1.55 * GIB))
    assert abs(73.6 - 51.66 - 2.4 - 19.54) < 0.011  # the budget closes with the printed peak, no graph term more
    old = parse_log("Free memory on device (43.93/44.42 GiB) on startup. Desired GPU memory utilization is (0.9, "
                    "39.98 GiB). Actual usage is 27.72 GiB for weight, 1.4 GiB for peak activation, 0.21 GiB for "
                    "non-torch memory, and 3.45 GiB for CUDAGraph memory.")
    assert old.activation_bytes == int(round(1.4 * GIB)) and old.peak_with_graphs_bytes is None


# ------------------------------------------------------------------- the held-out figures docs/validation.md reports

def test_held_out_figures_are_the_reported_ones():
    """The earlier held-out rows (34: 12 in corpus.csv, 12 in heldout-2026-12-02.csv, 10 in
    heldout-2026-12-03.csv; nothing fitted to them, the blind collections pinned apart): KV tokens median 0.88 %, p90
    2.89 % (3.11 % before round 9's V2 graph estimate, fitted to the T4 sweep, moved the 0.29 L40S and 0.31 A100
    rows; 0.94 % / 4.13 % before round 8's CUDA-graph captures and V2-runner sampler; 1.52 % / 7.64 % before
    the cold compile's kernel benchmark was priced, budget.py; 9.40 % p90 before the L4 pair's tp 2 was priced
    over PCIe, --interconnect); weights median 0.01 % (0.19 % before the weights counted the caching
    allocator's blocks, layout.allocated_bytes) (docs/validation.md). Pinned so that a change to a rule that
    moves them fails here and is reported, better or worse. The issue's targets (KV tokens median <= 2 % and
    p90 <= 5 %, weights median <= 1 %) are met on these 34 and asserted; over the whole held-out set, the second
    and third blind collections included, the p90 is missed (docs/validation.md)."""
    blind = (_collection_ids("heldout-2026-12-03b.csv") | _collection_ids("heldout-2026-12-03c.csv")
             | _collection_ids("heldout-2026-12-03d.csv") | _collection_ids("heldout-2026-12-04.csv"))
    earlier = [r for r in _held_out_results() if r["id"] not in blind]
    res = [r for r in earlier if not r["error"]]
    assert len(res) == len(earlier) == 34  # the blind rows (2026-12-03b, -03c, -03d, -04) are pinned apart
    kv = sorted(abs(r["KV tokens_err_pct"]) for r in res if r["KV tokens_err_pct"] is not None)
    w = sorted(abs(r["weights_err_pct"]) for r in res if r["weights_err_pct"] is not None)
    kv_med, kv_p90 = statistics.median(kv), statistics.quantiles(kv, n=10, method="inclusive")[8]
    w_med = statistics.median(w)
    assert (len(kv), len(w)) == (34, 28)
    assert kv_med == pytest.approx(0.88, abs=0.02) and kv_p90 == pytest.approx(2.89, abs=0.05), (kv_med, kv_p90)
    assert w_med == pytest.approx(0.01, abs=0.01), w_med
    assert kv_med <= 2.0 and kv_p90 <= 5.0 and w_med <= 1.0


def test_v2_model_runner_estimates_no_graphs_before_0_29():
    """0.22-0.28: the V2 model runner's profile_cudagraph_memory returns 0, so "Available KV cache memory"
    is requested - weights - peak - non-torch with no graph term: the 0.26.0 log prints 13.99 - 0.93 -
    1.06 - 0.07 = 11.93 against 11.94 available. Which models run on it by default follows config/vllm.py."""
    from vramcal.estimator.vllm.versions import graphs_off_budget, v2_runner_default

    v = parse_version
    assert not v2_runner_default(v("0.20.2"), ["LlamaForCausalLM"], False, False)  # opt-in only
    assert v2_runner_default(v("0.22.0"), ["Qwen3ForCausalLM"], False, False)
    assert not v2_runner_default(v("0.22.0"), ["LlamaForCausalLM"], False, False)
    assert v2_runner_default(v("0.24.0"), ["LlamaForCausalLM"], False, False)
    assert not v2_runner_default(v("0.24.0"), ["Qwen2ForCausalLM"], False, False)
    assert v2_runner_default(v("0.26.0"), ["Qwen2ForCausalLM"], False, False)
    assert not v2_runner_default(v("0.27.1"), ["MixtralForCausalLM"], True, False)  # MoE outside the list
    assert not v2_runner_default(v("0.27.1"), ["Qwen3NextForCausalLM"], True, True)  # hybrid
    assert not v2_runner_default(v("0.28.0"), ["MixtralForCausalLM"], True, False)
    # 0.29 on: every model (use_v2_model_runner no longer asks for the architecture list)
    assert v2_runner_default(v("0.29.0"), ["MixtralForCausalLM"], True, False)
    assert v2_runner_default(v("0.33.0"), ["Qwen3NextForCausalLM"], True, True)
    assert not graphs_off_budget(v("0.26.0"), ["Qwen2ForCausalLM"], False, False, False)
    assert graphs_off_budget(v("0.24.0"), ["Qwen2ForCausalLM"], False, False, False)  # V1 runner estimates
    assert graphs_off_budget(v("0.31.0"), ["Qwen2ForCausalLM"], False, False, False)  # V2 estimates from 0.29
    assert not graphs_off_budget(v("0.31.0"), ["Qwen2ForCausalLM"], False, False, True)  # eager
    log = parse_log((CORPUS_DIR / "logs" / "gpu16gb_qwen2.5-0.5b-fp16_v0.26.0.log").read_text())
    requested = 0.9 * log.total_bytes
    rest = requested - log.weights_bytes - log.activation_bytes - log.non_torch_bytes
    assert abs(rest - log.kv_cache_bytes) < 0.02 * GIB  # no graph term in the budget
    cfg = str(ROOT / "vramcal/estimator/catalog/qwen2.5-0.5b.json")
    args = dict(gpu_memory_bytes=log.total_bytes, gpu_memory_utilization=0.9, dtype="float16", usage="llm",
                max_num_seqs=256, max_num_batched_tokens=32768, flashinfer_sampler=True)
    e26 = estimate_vllm(cfg, VllmArgs(**args, vllm_version="0.26.0"))
    e29 = estimate_vllm(cfg, VllmArgs(**args, vllm_version="0.29.0"))
    assert not e26.cuda_graph_subtracted and e29.cuda_graph_subtracted
    assert e26.kv_cache_bytes - e29.kv_cache_bytes == e29.cuda_graph_bytes


def test_plan_takes_the_compile_cache_and_writes_it_into_its_check(capsys):
    """plan --engine vllm prices what --compile-cache says, as estimate does, and the estimate command it
    prints for checking carries the flag; transformers' plan refuses it (one line, exit 2)."""
    hw = ["plan", "qwen2.5-7b", "--engine", "vllm", "--hardware", "cuda:0=44.39GiB", "--vllm-version", "0.28.0",
          "--ctx", "8192", "--json"]
    got = {}
    for flag in ("cold", "warm"):
        assert main(hw + ["--compile-cache", flag]) == 0
        plan = json.loads(capsys.readouterr().out)["plans"][0]
        assert f"--compile-cache {flag}" in plan["command"]
        got[flag] = plan["kv_cache_bytes"]
    assert got["warm"] > got["cold"]  # the benchmark's copy of the embedding table is not priced warm
    rc = main(["plan", "qwen2.5-7b", "--hardware", "cuda:0=24GiB", "--compile-cache", "warm"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "--compile-cache" in err, err
