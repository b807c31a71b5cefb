"""llama.cpp startup logs others published (benchmarks/published/llamacpp/): the parser reads every wording
they use, and vramcal's buffers stay where docs/validation.md reports them."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from vramcal.estimator.llamacpp.logparse import parse_log
from vramcal.units import MIB

ROOT = Path(__file__).parent.parent
CORPUS = ROOT / "benchmarks" / "published" / "llamacpp"


def _log(rid: str):
    return parse_log((CORPUS / "logs" / f"{rid}.log").read_text())


def _mib(x: float) -> int:
    return round(x * MIB)


def test_every_row_has_a_source_and_its_log():
    rows = list(csv.DictReader(open(CORPUS / "corpus.csv", newline="")))
    assert len(rows) >= 20
    for r in rows:
        assert r["source_url"] and r["hparams_from"], r["id"]
        text = (CORPUS / "logs" / f"{r['id']}.log").read_text()
        assert text.startswith("# source: "), r["id"]
        assert parse_log(text).lines >= 3, r["id"]  # model, KV and compute lines at least


def test_the_oldest_wording_llm_load_tensors_and_kv_self_size():
    """Early 2024 (lc02): 'llm_load_tensors: CPU buffer size' without 'model', the KV of CPU layers in
    CUDA_Host, 'KV self size' for the total, 'llama_new_context_with_model' before the output and compute."""
    g = _log("lc02")
    assert g.model_buffer_bytes == {"CPU": _mib(4341.68), "CUDA0": _mib(3250.78)}
    assert g.kv_buffer_bytes == {"CUDA_Host": _mib(14), "CUDA0": _mib(50)}
    assert g.kv_size_bytes == _mib(64) and g.kv_types == ("f16", "f16")
    assert g.output_buffer == "CUDA_Host" and g.output_buffer_bytes == _mib(70.5)
    assert g.compute_buffer_bytes == {"CUDA0": _mib(73), "CUDA_Host": _mib(87.5)}
    assert (g.n_ctx, g.n_batch, g.n_ubatch) == (512, 512, 512)
    assert g.metadata["llama.block_count"] == 32 and g.metadata["tokenizer.ggml.tokens"] == ("array", 32000)
    assert g.hparams["n_head_kv"] == "8" and g.tensor_types == {"f32": 65, "q4_1": 225, "q6_K": 1}
    assert g.n_tensors == 291


def test_an_input_buffer_is_not_an_output_buffer():
    """lc06's build printed 'CUDA_Host input buffer size' and no output line; the parser keeps it out."""
    g = _log("lc06")
    assert g.output_buffer_bytes is None
    assert g.model_buffer_bytes == {"CUDA0": _mib(3820.94), "CPU": _mib(70.31)}
    assert g.compute_buffer_bytes == {"CUDA0": _mib(164.01), "CUDA_Host": _mib(8)}


def test_a_service_prefix_and_n_ctx_per_seq():
    """Ollama's journald lines (lc04) carry a date and a process before the function; n_ctx_per_seq is the
    older name of n_ctx_seq; llama_init_from_model the older name of llama_context."""
    g = _log("lc04")
    assert (g.n_ctx, g.n_ctx_seq, g.n_seq_max, g.flash_attn) == (8192, 2048, 4, "0")
    assert g.kv_buffer_bytes == {"CUDA0": _mib(1024)} and g.kv_size_bytes == _mib(1024)
    assert g.model_buffer_bytes == {"CUDA0": _mib(4403.49), "CPU_Mapped": _mib(281.81)}
    assert g.metadata["llama.vocab_size"] == 128256


def test_two_caches_add_up_and_a_mapped_gpu_buffer():
    """gpt-oss on Metal (lc12): an iSWA model logs two KV caches; Metal maps the file (MTL0_Mapped)."""
    g = _log("lc12")
    assert g.kv_buffer_bytes == {"MTL0": _mib(3072) + _mib(24)}
    assert g.kv_cells == [131072, 1024] and g.kv_layers == [12, 12] and g.kv_size_bytes == _mib(3096)
    assert g.model_buffer_bytes == {"CPU_Mapped": _mib(379.71), "MTL0_Mapped": _mib(11073.83)}
    assert g.compute_buffer_bytes == {"MTL0": _mib(420.83), "CPU": _mib(269.27)}


def test_quantized_cache_types_and_the_build():
    g = _log("lc15")
    assert g.kv_types == ("q8_0", "q8_0") and g.kv_size_bytes == _mib(4352)
    assert g.kv_buffer_bytes == {"CUDA0": _mib(2788), "CUDA1": _mib(1564)}
    assert _log("lc01").build == "7342 (2fbe3b7bb)" and _log("lc13").build == "5622 (97340b4c)"
    assert _log("lc08").model_buffer_bytes == {"CPU_AARCH64": _mib(3204), "CPU_Mapped": _mib(4165.38)}


def test_rpc_servers_named_by_address():
    """llama.cpp's RPC backend names each server by its address (lc18)."""
    g = _log("lc18")
    assert g.kv_buffer_bytes == {"RPC[172.31.27.42:50052]": _mib(656), "RPC[172.31.20.38:50052]": _mib(624)}
    assert g.compute_buffer_bytes["CPU"] == _mib(28.01)


def test_a_decimal_comma():
    """Where the C locale was not in force the log prints '636,18 MiB' (a Jetson Nano build of 2024-02,
    llama.cpp a33e6a0; search-index file id 42505393621)."""
    g = parse_log("llm_load_tensors: offloaded 1/23 layers to GPU\n"
                  "llm_load_tensors:        CPU buffer size =   636,18 MiB\n"
                  "llm_load_tensors:      CUDA0 buffer size =    23,64 MiB\n")
    assert g.model_buffer_bytes == {"CPU": _mib(636.18), "CUDA0": _mib(23.64)}


@pytest.fixture(scope="module")
def compared():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import published_llamacpp as P
    finally:
        sys.path.pop(0)
    rows = list(csv.DictReader(open(CORPUS / "corpus.csv", newline="")))
    return P, [P.run_row(r, CORPUS) for r in rows]


def test_the_corpus_compares_as_docs_validation_reports(compared):
    """The medians docs/validation.md reports (benchmarks/published_llamacpp.py): a change of the KV,
    output, model or compute arithmetic that moves a published log shows here."""
    P, results = compared
    assert not [r.row["id"] for r in results if r.error]
    med = P.medians(results)
    assert med["n_ctx"][0] == 0 and med["n_ctx"][1] == 0  # every logged n_ctx, exactly
    # KV: exact everywhere but two older builds: lc02 (early 2024) put -ngl's layers on the GPU by the old
    # rule, lc17 (early 2025) kept a full-size cache for gemma3's sliding-window layers
    kv_miss = {c.id for r in results for c in r.compared if c.term == "KV" and c.err_pct != 0}
    assert kv_miss == {"lc02", "lc17"}
    # output: exact to the log's 0.01 MiB, the three that asked for embeddings too (--embedding) included, but
    # GritLM's 2024 build, which reserved a whole batch of outputs
    out_miss = {c.id for r in results for c in r.compared if c.term == "output" and c.err_pct != 0}
    assert out_miss == {"lc02"}
    # model buffers: the three single-type files (one with a tied output), every buffer within 0.01 %
    model = [c for r in results for c in r.compared if c.term == "model" and c.err_pct is not None]
    assert {c.id for c in model} == {"lc01", "lc14", "lc17"} and max(abs(c.err_pct) for c in model) < 0.01
    assert [c.err_pct for c in model if c.id == "lc01"] == [0.0, 0.0]  # CUDA: equal to the log's 0.01 MiB
    # compute: the median over 39 buffers, and the rows the replay meets within 3 % (no op in place on a view,
    # as ggml-alloc has it since v3: lc11, a 2026 llama-cpp-python on the CPU, equal)
    assert med["compute"][2] == 39
    assert med["compute"][0] == pytest.approx(5.26, abs=0.05)
    close = {(c.id, c.device) for r in results for c in r.compared
             if c.term == "compute" and abs(c.err_pct) <= 3.0}
    assert {("lc01", "GPU0"), ("lc01", "host"), ("lc05", "host"), ("lc07", "host"), ("lc08", "host"),
            ("lc10", "GPU0"), ("lc11", "host"), ("lc13", "GPU0"), ("lc13", "GPU1"), ("lc14", "GPU0"),
            ("lc16", "GPU0"), ("lc17", "GPU0"), ("lc18", "GPU0"), ("lc18", "GPU1"), ("lc18", "host")} <= close
    assert [c.err_pct for r in results for c in r.compared if c.term == "compute" and c.id == "lc11"] == [0.0]


def test_the_report_writes_its_section(compared, tmp_path):
    P, _ = compared
    assert P.main(["--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "published-llamacpp.md").read_text()
    assert md.startswith("## llama.cpp: startup logs others published")
    assert "| lc13 |" in md and "https://github.com/ggml-org/llama.cpp/issues/11200" in md
    rows = list(csv.DictReader(open(tmp_path / "published-llamacpp.csv", newline="")))
    assert {r["term"] for r in rows} == set(P.TERMS)
