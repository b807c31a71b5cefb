"""``--device cpu`` predicts the process's resident set (docs/cpu-memory.md): the checkpoint's mapped
pages, what the loader allocates, the heap glibc keeps after bitsandbytes quantizes, KV and prefill."""

from __future__ import annotations

import pytest

from vramcal.estimator.cpu import (ACT_RETAINED, GLIBC_MMAP_THRESHOLD_MAX, LOAD_FIXED_BYTES, RUN_FIXED_BYTES,
                                   CpuInputs, cpu_resident_stages, heap_retention_bound)
from vramcal.estimator.estimate import Estimator, estimate
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model
from vramcal.workload import STAGES

MIB = 2**20


@pytest.mark.alone  # a resident set against a tolerance: not beside another worker
def test_a_plain_load_maps_the_checkpoint_and_reads_it_at_the_first_forward(tiny_models):
    """bf16 in the checkpoint's dtype: from_pretrained copies nothing (the tensors are views of the
    mapping); the first forward reads every page, so the whole file is resident from then on."""
    e = estimate(tiny_models["tied"], "bf16", ctx=256, device="cpu")
    pages = e.components["weights"] - e.weights_breakdown.get("buffers", 0)  # rotary buffers are not stored
    assert e.stages["load_peak"] == e.stages["post_load"] == LOAD_FIXED_BYTES
    assert e.peak_breakdown["checkpoint_pages"] == pages  # tied: lm_head reads the whole embedding
    assert e.stages["first_token"] == (LOAD_FIXED_BYTES + RUN_FIXED_BYTES + pages + e.peak_breakdown["kv_cache"]
                                       + e.peak_breakdown["activations"])
    assert e.ranges is None  # nothing run-to-run about a plain load
    assert sum(e.peak_breakdown.values()) == e.peak == e.stages[e.peak_stage]


@pytest.mark.alone  # a resident set against a tolerance: not beside another worker
def test_bitsandbytes_on_the_cpu_keeps_its_16_bit_sources_resident_and_a_heap_range(tiny_models):
    source = resolve_model(tiny_models["dense-gqa"])
    est = Estimator(source, resolve_quant("nf4", source.config), device="cpu")
    e = est.estimate(1024)
    inv = est.inv
    t = e.peak_breakdown
    assert e.peak_stage == "first_token"
    assert t["loaded_tensors"] == inv.groups["quantized"] + inv.groups["quant_state"]
    # every quantized weight, as stored (bf16), plus the untied embedding's rows a 1008-token prompt can reach
    assert sum(o * i * n for o, i, n in inv.quantized_shapes) == inv.quantized_params
    lo, hi = e.ranges["post_load"]
    assert lo < e.stages["post_load"] < hi
    assert hi - lo == heap_retention_bound("bnb4", tuple(o * i for o, i, n in inv.quantized_shapes for _ in range(n)))
    assert e.stages["post_load"] < e.stages["load_peak"]  # one weight's float32 temporaries are gone
    for s in STAGES:
        assert e.ranges[s][0] <= e.stages[s] <= e.ranges[s][1]
    assert any("varies run to run" in n for n in e.notes)


@pytest.fixture(scope="module")
def untied_wide_vocab(tmp_path_factory):
    """An untied 64k-token vocabulary: the embedding and lm_head are most of the checkpoint."""
    from conftest import save_tiny
    from test_probe_cpu import MID

    return save_tiny("vocab", {**MID, "vocab_size": 64000}, tmp_path_factory.mktemp("vocab"))


@pytest.mark.alone  # a resident set against a tolerance: not beside another worker
def test_an_untied_embedding_is_resident_whole_after_a_short_prompt(untied_wide_vocab):
    """A 112-token prompt selects 112 of 64,000 rows, but every fault maps the readahead around its row:
    a real probe holds (nearly) the whole checkpoint after the first token, as the estimate counts it."""
    from vramcal.probes.probe import run_probe

    e = estimate(untied_wide_vocab, "bf16", ctx=128, device="cpu")
    r = run_probe(untied_wide_vocab, "bf16", 128, 1, device="cpu", with_estimate=False)
    assert r.status == "ok", r.error
    measured = r.measured()["first_token"].peak_bytes
    assert abs(e.peak_breakdown["checkpoint_pages"] - e.components["weights"]) < 4096  # the whole file (bf16)
    assert measured >= 0.9 * e.components["weights"]
    assert abs(e.stages["first_token"] - measured) < 0.15 * measured


@pytest.mark.alone  # a resident set against a tolerance: not beside another worker
def test_a_dtype_conversion_reads_every_page_then_holds_only_the_copies(untied_wide_vocab):
    """bf16 -> fp32: the load reads the whole file (at its peak) and copies every tensor; once loaded
    nothing references the mapping, and a real probe holds the copies alone."""
    from vramcal.probes.probe import run_probe

    e = estimate(untied_wide_vocab, "fp32", ctx=128, device="cpu")
    weights = e.components["weights"]  # the float32 copies
    r = run_probe(untied_wide_vocab, "fp32", 128, 1, device="cpu", with_estimate=False)
    assert r.status == "ok", r.error
    m = r.measured()
    assert m["post_load"].used_bytes < 1.2 * weights < m["load_peak"].peak_bytes  # the pages came and went
    for stage in ("load_peak", "post_load", "end"):
        assert abs(e.stages[stage] - m[stage].peak_bytes) < 0.15 * m[stage].peak_bytes, stage


def test_the_cpu_model_by_hand():
    """Three weights of 1, 2 and 8 Mi elements (the last one's float32 copy, exactly 32 MiB, is mmapped
    and given back, not kept in the heap)."""
    n = (MIB, 2 * MIB, 8 * MIB)
    inp = CpuInputs(method="bnb4", checkpoint_bytes=40 * MIB, checkpoint_elem_bytes=2, load_elem_bytes=2,
                    loaded_tensor_bytes=7 * MIB, quantized_elements=n)
    assert 4 * 8 * MIB == GLIBC_MMAP_THRESHOLD_MAX
    c = cpu_resident_stages(inp, kv_prompt=1 * MIB, kv_end=2 * MIB, prefill_extra=4 * MIB, decode_extra=0,
                            prompt_tokens=100, batch=1)
    bound = 4 * 3 * MIB
    assert c.lower["post_load"] == LOAD_FIXED_BYTES + 2 * 11 * MIB + 7 * MIB  # the quantized sources read
    assert c.upper["post_load"] == c.lower["post_load"] + bound
    assert c.lower["load_peak"] == c.lower["post_load"] + 16 * 8 * MIB
    act = int(ACT_RETAINED * 4 * MIB)
    assert c.lower["first_token"] == LOAD_FIXED_BYTES + RUN_FIXED_BYTES + 40 * MIB + 7 * MIB + MIB + act
    # the prefill's freed blocks land in the load's holes: the larger of the two shows, not both
    assert c.upper["first_token"] == c.lower["first_token"] - act + max(act, bound)


@pytest.mark.parametrize("quant", ["bf16", "nf4", "int8"])
def test_sweep_and_estimate_agree_on_the_cpu(tiny_models, quant):
    source = resolve_model(tiny_models["dense-gqa"])
    est = Estimator(source, resolve_quant(quant, source.config), device="cpu")
    single = est.estimate(512, exact=False)
    row = est.sweep([(512, 1)])[0]
    assert row.stages == single.stages
    assert row.upper == ({s: v[1] for s, v in single.ranges.items()} if single.ranges else None)


def test_fit_on_the_cpu_plans_for_the_top_of_the_range(tiny_models, tmp_path):
    from vramcal.calibrate.fit import fit_contexts

    source = resolve_model(tiny_models["dense-gqa"])
    est = Estimator(source, resolve_quant("nf4", source.config), device="cpu")
    at_64 = est.sweep([(64, 1)])[0]  # a short context: the heap range is not yet absorbed by the prefill's
    budget = max(at_64.upper.values())
    (row,) = fit_contexts(tiny_models["dense-gqa"], budget, device="cpu", db=str(tmp_path / "none.db"), buffer=0,
                          quants=("nf4",), batches=(1,)).rows
    assert row.peak_bytes <= budget and 64 <= row.max_ctx < 128
    after = est.sweep([(row.max_ctx + 1, 1)])[0]
    assert max(after.upper.values()) > budget  # the range's top decides
    assert after.peak < budget  # the typical figure alone would have let a longer context through


@pytest.mark.slow
def test_the_ladder_offers_a_lower_quantization_only_where_it_saves_memory():
    """On a GPU nf4 halves the weights; on the CPU an on-the-fly bitsandbytes load keeps the bf16 pages
    mapped beside the quantized copies, so the same step would raise the resident set."""
    from vramcal.calibrate.proposals import propose
    from vramcal.estimator.correction import CorrectionSet
    from vramcal.workload import Workload

    source = resolve_model("qwen2.5-0.5b")  # real widths: on a tiny model the CUDA context hides the weights
    work = Workload(1008, 16, 1)
    none = lambda q: CorrectionSet({})  # noqa: E731
    for device, kind in (("cuda:0", "cuda"), ("cpu", "cpu")):
        bf16 = Estimator(source, resolve_quant("bf16", source.config), device=kind).estimate(1024).peak
        nf4 = Estimator(source, resolve_quant("nf4", source.config), device=kind).estimate(1024).peak
        rows = propose(source, "bf16", work, usable=bf16 - 1, corrections_for=none, prefer="context",
                       device=device, limit=10)
        quants = {r.quant for r in rows}
        if kind == "cuda":
            assert nf4 < bf16 and "nf4" in quants
        else:
            assert nf4 > bf16 and quants <= {"bf16"}


def test_the_quantized_weights_source_pages_are_said_to_be_reclaimable(tiny_models):
    source = resolve_model(tiny_models["dense-gqa"])
    est = Estimator(source, resolve_quant("nf4", source.config), device="cpu")
    e = est.estimate(256)
    cold = 2 * est.inv.quantized_params  # their bf16 sources
    assert any(f"{cold / MIB:,.0f} MiB of the resident set" in n and "drop" in n for n in e.notes)
    plain = estimate(tiny_models["dense-gqa"], "bf16", ctx=256, device="cpu")
    assert not any("drop" in n for n in plain.notes)  # a plain load reads its pages at every token


@pytest.mark.slow
def test_on_the_cpu_the_lowest_quantization_is_the_smallest_estimate_not_the_last_name():
    """From fp32 on the CPU, bf16 is the smallest resident set (nf4 keeps the bf16 pages and adds its
    own): the ladder's 'lowest' steps use bf16, and no label claims a change that did not happen."""
    from vramcal.calibrate.proposals import propose
    from vramcal.estimator.correction import CorrectionSet
    from vramcal.workload import Workload

    source = resolve_model("qwen2.5-0.5b")
    bf16 = Estimator(source, resolve_quant("bf16", source.config), device="cpu")
    usable = bf16.estimate(1024, 1, exact=False).peak + 1
    rows = propose(source, "fp32", Workload(4080, 16, 4), usable, lambda q: CorrectionSet({}), "throughput",
                   "cpu", limit=10)
    assert rows and all(r.quant == "bf16" for r in rows)
    same = propose(source, "bf16", Workload(4080, 16, 4), usable, lambda q: CorrectionSet({}), "throughput",
                   "cpu", limit=10)
    assert same and not any("quant" in r.change for r in same)


def test_the_stored_dtype_comes_from_the_files_not_the_config(tiny_models, tmp_path):
    """A bf16 checkpoint whose config says float32 is read as stored: a bf16 load of it converts
    nothing, and its pages are 2 bytes per parameter."""
    import json
    import shutil

    d = tmp_path / "says-fp32"
    shutil.copytree(tiny_models["tied"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "float32"
    (d / "config.json").write_text(json.dumps(cfg))
    e = estimate(str(d), "bf16", ctx=256, device="cpu")
    plain = estimate(tiny_models["tied"], "bf16", ctx=256, device="cpu")
    assert e.peak_breakdown["loaded_tensors"] == 0
    assert e.peak_breakdown["checkpoint_pages"] == plain.peak_breakdown["checkpoint_pages"]
