"""The dry run's allocations in order, and the caching allocator replayed over them in the estimate.

The order is checked twice: the meta-device dry run against the same forward on real CPU tensors (the same
tracker), and that forward's tracker against torch.profiler's record of the CPU allocator itself (an
independent witness; the kernels' own scratch buffers are the only extra allocations it sees). A model
traced as one pair of layers gives the whole model's events: the same sequence as tracing every layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from vramcal.estimator.allocator import ALLOC, MARK, replay
from vramcal.estimator.dryrun import DryRunner, trace_model
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model


@pytest.fixture(autouse=True)
def replay_on(monkeypatch):
    """The replay is opt-in (VRAMCAL_ALLOC_REPLAY=1) until plan's and fit's searches agree with it."""
    monkeypatch.setenv("VRAMCAL_ALLOC_REPLAY", "1")


def signed(events, floor=0):
    """+bytes for each allocation, -bytes for each free, up to the decode step's mark."""
    sizes, out = {}, []
    for op, key, size in events:
        if op == MARK:
            if key == "decode":
                break
            continue
        if op == ALLOC:
            sizes[key] = size
            if size >= floor:
                out.append(size)
        elif key in sizes:
            size = sizes.pop(key)
            if size >= floor:
                out.append(-size)
    return out


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    from conftest import TINY, save_tiny

    root = tmp_path_factory.mktemp("five")
    return {name: save_tiny(name, {**TINY[name], "num_hidden_layers": 5}, root) for name in ("dense-gqa", "moe")}


@pytest.mark.parametrize("arch,quant", [("dense-gqa", "bf16"), ("dense-gqa", "nf4"), ("moe", "bf16")])
def test_a_pairs_events_give_the_whole_models(five_layers, arch, quant):
    s = resolve_model(five_layers[arch])
    r = DryRunner(s, resolve_quant(quant, s.config))
    assert r.kinds() == [4]
    batch, seq = 2, 300
    whole = trace_model(r.model, r.quant.method, r.dtype, batch, seq, lambda: r._new_cache(seq + 16))
    pair = r.trace(batch, seq)
    assert pair.events is not None
    assert signed(pair.events) == signed(whole.events)
    a, b = replay(whole.events), replay(pair.events)
    assert a.marks["prefill"] == b.marks["prefill"] and a.marks["decode"] == b.marks["decode"]


@pytest.mark.parametrize("quant", ["bf16", "nf4"])
def test_the_workspace_is_marked_after_the_first_linears_output(five_layers, quant):
    """torch allocates the cuBLAS workspace on the first cuBLAS product, after its output: on the H200 trace the
    first Linear's (q_proj): the rotary embedding before it multiplies without a product.
    The dry run marks it there once, in the pair's trace and in the whole model's alike."""
    from vramcal.estimator.allocator import WORKSPACE_MARK

    s = resolve_model(five_layers["dense-gqa"])
    r = DryRunner(s, resolve_quant(quant, s.config))
    batch, seq = 1, 300
    cfg = s.config
    q_bytes = batch * seq * cfg["num_attention_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
    whole = trace_model(r.model, r.quant.method, r.dtype, batch, seq, lambda: r._new_cache(seq + 16))
    pair = r.trace(batch, seq)
    for events in (whole.events, pair.events):
        at = [i for i, e in enumerate(events) if e[0] == MARK and e[1] == WORKSPACE_MARK]
        assert len(at) == 1
        before = [e for e in events[:at[0]] if e[0] == ALLOC]
        assert before[-1][2] == q_bytes  # q_proj's output, just allocated
        first_layer = next(i for i, e in enumerate(events) if e[0] == MARK and e[1] == ("pre", 0)) \
            if any(e[0] == MARK and e[1] == ("pre", 0) for e in events) else None
        assert first_layer is None or first_layer < at[0]  # inside layer 0, after the rotary embedding


def test_the_ops_that_reach_cublas_follow_torchs_source():
    """torch allocates the workspace on the first cuBLAS call of any dtype (CublasHandlePool.cpp's
    getCurrentCUDABlasHandle); a product skips BLAS only with an empty output or an inner dimension of 0. So a
    float32 (64 x 1) @ (1 x T) product counts, and a broadcast multiply (what transformers 5.24's rotary embedding
    does) does not."""
    from vramcal.estimator.dryrun import _first_product

    aten = torch.ops.aten

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, device="meta", dtype=dtype)

    assert _first_product(aten.bmm.default, (t(1, 64, 1, dtype=torch.float32), t(1, 1, 4096, dtype=torch.float32)))
    assert _first_product(aten.mm.default, (t(8, 128), t(128, 64)))
    assert _first_product(aten.addmm.default, (t(64), t(8, 128), t(128, 64)))
    assert _first_product(aten.mv.default, (t(64, 128), t(128)))
    assert _first_product(aten.dot.default, (t(128), t(128)))
    assert not _first_product(aten.bmm.default, (t(1, 64, 0), t(1, 0, 8)))  # inner dimension 0: no BLAS call
    assert not _first_product(aten.mm.default, (t(0, 128), t(128, 64)))  # empty output
    assert not _first_product(aten.mul.Tensor, (t(1, 8, 1), t(16)))


def test_a_workspace_mark_after_the_layers_is_kept_once(five_layers):
    """int8's matmul runs in bitsandbytes (its stand-in makes no torch product), so the first product torch runs
    is lm_head's, after the last layer: the whole model's events hold that mark once, as the whole trace does (it
    was written twice, and the second mark cut the prefill's peak short in the replay)."""
    from vramcal.estimator.allocator import WORKSPACE_MARK

    s = resolve_model(five_layers["dense-gqa"])
    r = DryRunner(s, resolve_quant("int8", s.config))
    batch, seq = 1, 300
    whole = trace_model(r.model, r.quant.method, r.dtype, batch, seq, lambda: r._new_cache(seq + 16))
    pair = r.trace(batch, seq)
    for events in (whole.events, pair.events):
        assert sum(1 for e in events if e[0] == MARK and e[1] == WORKSPACE_MARK) == 1
    assert signed(pair.events) == signed(whole.events)
    a, b = replay(whole.events), replay(pair.events)
    assert a.marks["prefill"] == b.marks["prefill"]


def test_the_replay_allocates_the_workspace_where_the_mark_is():
    """A 100 MiB block freed, then the workspace, then 100 MiB again: allocated before the prefill (no mark) the
    workspace has its own segment and the second block reuses the first's (no slack); at the mark it splits the
    freed block and the second needs a segment of its own (68 MiB stranded), as torch's allocator would."""
    from vramcal.estimator.allocator import FREE, WORKSPACE_MARK, AllocConf
    from vramcal.estimator.reserve import trace_slack

    mib = 1024**2
    body = [(ALLOC, "x", 100 * mib), (FREE, "x", 0), (ALLOC, "y", 100 * mib), (FREE, "y", 0),
            (MARK, "prefill", 0), (MARK, "decode", 0)]
    load = [(MARK, "load", 0)]
    assert trace_slack(load, body, 32 * mib, AllocConf())[0] == 0
    marked = body[:2] + [(MARK, WORKSPACE_MARK, 0)] + body[2:]
    assert trace_slack(load, marked, 32 * mib, AllocConf())[0] == 68 * mib
    # a second mark is dropped, not replayed as a mark: a mark starts the stretch whose peak the slack reads, and
    # here the prefill's peak (150 MiB, x and z) comes before it
    peaked = [(ALLOC, "x", 100 * mib), (ALLOC, "z", 50 * mib), (FREE, "z", 0), (FREE, "x", 0),
              (MARK, WORKSPACE_MARK, 0), (ALLOC, "y", 100 * mib), (MARK, WORKSPACE_MARK, 0), (FREE, "y", 0),
              (MARK, "prefill", 0), (MARK, "decode", 0)]
    once = peaked[:6] + peaked[7:]
    assert trace_slack(load, peaked, 32 * mib, AllocConf()) == trace_slack(load, once, 32 * mib, AllocConf())


def test_the_dry_runs_order_is_the_cpu_forwards_and_the_cpu_allocators(tiny_models):
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, DynamicCache

    path = tiny_models["dense-gqa"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        real = trace_model(model, "none", torch.bfloat16, 2, 96, lambda: DynamicCache(config=model.config),
                           device="cpu", target="cpu")
    s = resolve_model(path)
    r = DryRunner(s, resolve_quant("bf16", s.config), attn="eager", target="cpu")
    meta = trace_model(r.model, "none", r.dtype, 2, 96, lambda: r._new_cache(112), target="cpu")
    assert signed(meta.events) == signed(real.events)  # op for op, in the same order
    # torch's CPU allocator, as the profiler saw it: every tracked block of 4 KiB or more, allocated and
    # freed in this order (the profiler also sees kernels' scratch buffers the tracker does not)
    seen = [e.nbytes() for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
            if e.name() == "[memory]" and abs(e.nbytes()) >= 4096]
    ours = signed(real.events, floor=4096)
    it = iter(seen)
    assert len(ours) > 100 and all(x in it for x in ours)


def test_the_fused_attentions_output_is_laid_out_as_the_kernels_make_it(tiny_models):
    """The fused SDPA kernels return their output laid out as the query is (the flash kernels'
    ``empty_like``), and Llama's query is a transposed view: transformers' ``transpose(1, 2).contiguous()``
    after the attention is then a view, no copy. The dry run's stand-in must not make one either: its
    order of allocations matches the real CPU forward's, with torch's own SDPA kernel, as the CPU allocator
    saw it (a stand-in with a contiguous output adds a copy of the attention's output to every layer)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, DynamicCache

    from vramcal.estimator.dryrun import _fused_output, cache_keyword

    q = torch.empty(2, 96, 4, 16).transpose(1, 2)
    real_out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert _fused_output(q, 16).stride() == real_out.stride() and _fused_output(q, 8).shape == (2, 4, 96, 8)
    # CUDA's memory-efficient kernel (MLA's head sizes, a mask) returns (batch, seq, heads, dim) transposed
    mla = _fused_output(torch.empty(2, 4, 96, 24), 16, mem_efficient=True)
    assert mla.shape == (2, 4, 96, 16) and mla.transpose(1, 2).is_contiguous()
    path = tiny_models["dense-gqa"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ids = torch.zeros(2, 96, dtype=torch.long)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                    **{cache_keyword(model): DynamicCache(config=model.config)})
        logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)  # as generate() and the dry run do
        del out, logits
    seen = [e.nbytes() for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
            if e.name() == "[memory]" and abs(e.nbytes()) >= 4096]
    s = resolve_model(path)
    r = DryRunner(s, resolve_quant("bf16", s.config), attn="sdpa", target="cpu")
    meta = trace_model(r.model, "none", r.dtype, 2, 96, lambda: r._new_cache(112), target="cpu")
    prefill = []
    for op, key, size in meta.events:
        if op == MARK and key == "prefill":
            break
        prefill.append((op, key, size))
    ours = [x for x in signed(prefill + [(MARK, "decode", 0)], floor=4096) if x > 0]
    it = iter(x for x in seen if x > 0)
    assert len(ours) > 50 and all(x in it for x in ours)


def test_the_estimate_replays_the_allocator(tiny_models):
    from vramcal.estimator.estimate import estimate
    from vramcal.estimator.stages import STAGES

    e = estimate(tiny_models["dense-gqa"], "auto", ctx=2048, use_cache=False)
    assert e.methods["reserved"].startswith("the caching allocator replayed")
    ctx = e.stages["load_peak"] - e.reserved["load_peak"]
    for k in STAGES:
        assert e.reserved[k] >= e.allocated[k]
        assert e.stages[k] == ctx + e.reserved[k]
        assert e.reserved[k] % (2 * 1024**2) == 0
    x = estimate(tiny_models["dense-gqa"], "auto", ctx=2048, use_cache=False, alloc_conf="expandable_segments:True")
    assert x.alloc_conf == "expandable_segments:True" and x.allocated == e.allocated
    assert x.reserved != e.reserved


@pytest.mark.parametrize("replay", ["1", "0"])
def test_a_placement_of_everything_on_one_gpu_is_priced_as_the_plain_load(tiny_models, monkeypatch, replay):
    """A split's search prices its maps through the placement path: the map that holds everything on one GPU
    is the plain load, so it has the plain estimate's figures, replayed or not (before: never replayed, so a
    split called the whole model fitting where the plain estimate did not, and offloaded nothing)."""
    from vramcal.estimator.estimate import Estimator
    from vramcal.estimator.placement import plan_placement

    monkeypatch.setenv("VRAMCAL_ALLOC_REPLAY", replay)
    source = resolve_model(tiny_models["dense-gqa"])
    quant = resolve_quant("bf16", source.config)
    est = Estimator(source, quant, use_cache=False)
    plain = est.estimate(ctx=1024, exact=True)
    whole = plan_placement(source, quant, {"cuda:0": 10**10, "cpu": 10**10})
    assert whole.loads.devices == ["cuda:0"]
    placed = est.estimate(ctx=1024, exact=True, placement=whole)
    assert placed.devices["cuda:0"].stages == plain.stages
    assert est.sweep([(1024, 1)], placement=whole)[0].devices["cuda:0"] == plain.stages
    assert placed.methods["reserved"].startswith("the caching allocator replayed") == (replay == "1")
    assert plain.reserved != plain.allocated or replay == "0"  # the replay's slack is in both figures


def test_the_replay_runs_when_a_figure_asks_and_a_cached_trace_is_replayed_alike(tiny_models, monkeypatch):
    """Traces are replayed when a one-GPU figure first needs their slack, not as they are made (a placement's
    GPUs are not replayed, but for the map of everything on one GPU); a trace cached by a run that never replayed it is traced again for its slack,
    and gives the figures of a cold replayed estimate."""
    from vramcal.estimator import estimate as est_mod
    from vramcal.estimator.placement import plan_placement

    replays = []
    real = est_mod.trace_slack
    monkeypatch.setattr(est_mod, "trace_slack", lambda *a: replays.append(1) or real(*a))
    source = resolve_model(tiny_models["dense-gqa"])
    quant = resolve_quant("bf16", source.config)
    cold = est_mod.Estimator(source, quant, use_cache=False).estimate(ctx=1024, exact=True)
    assert replays and cold.methods["reserved"].startswith("the caching allocator replayed")

    monkeypatch.setenv("VRAMCAL_ALLOC_REPLAY", "0")
    placed = est_mod.Estimator(source, quant)  # caches its traces to the disk, replayed for no setting
    placed.estimate(ctx=1024, exact=True, placement=plan_placement(source, quant, {"cuda:0": 10**9, "cpu": 10**10}))
    replays.clear()
    placed.sweep([(1024, 1), (4096, 1)])
    assert replays == []
    monkeypatch.setenv("VRAMCAL_ALLOC_REPLAY", "1")
    warm = est_mod.Estimator(source, quant)  # reads those traces: no slack for this setting in them
    assert warm._act is not None and all(not t.slack for t in warm._act.traces)
    again = warm.estimate(ctx=1024, exact=True)
    assert replays and again.reserved == cold.reserved and again.stages == cold.stages


def test_alloc_conf_bad_input_is_one_line_exit_2(tiny_models):
    for bad, says in (("expandable_segments:yes", "True or False"), ("nope:1", "unknown allocator setting")):
        r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", tiny_models["dense-gqa"], "--alloc-conf", bad,
                            "--json", "--quiet"], capture_output=True, text=True)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stdout == ""
    env = {**__import__("os").environ, "PYTORCH_ALLOC_CONF": "max_split_size_mb:1"}
    r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", tiny_models["dense-gqa"], "--json", "--quiet"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "PYTORCH_ALLOC_CONF" in r.stderr


def test_estimate_json_has_reserved_beside_allocated(tiny_models):
    r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", tiny_models["dense-gqa"], "--json", "--quiet",
                        "--alloc-conf", "expandable_segments:True", "--no-correction"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d["reserved"]) == set(d["allocated"]) and d["alloc_conf"] == "expandable_segments:True"


def test_the_non_torch_terms_by_gpu(tiny_models):
    """The H200's measured context and first-forward kernels, the cuBLAS workspace by compute capability, and
    the driver's reserve reported but never in the stages; an unmeasured architecture says it took the default."""
    from vramcal.estimator.estimate import estimate
    from vramcal.probes.hardware import gpu_target
    from vramcal.units import MIB

    h200 = estimate(tiny_models["dense-gqa"], "auto", ctx=1024, use_cache=False, gpu=gpu_target("H200"))
    t = h200.runtime_terms
    assert t["cuda_context"]["bytes"] == 645_464_064 and t["cuda_context"]["source"].startswith("table")
    assert t["cublas_workspace"]["bytes"] == 32 * MIB
    assert t["driver_reserve"]["bytes"] == 648_347_648
    assert h200.stages["post_load"] == 645_464_064 + h200.reserved["post_load"]
    assert h200.stages["first_token"] == 645_464_064 + 79_691_776 + h200.reserved["first_token"]
    a100 = estimate(tiny_models["dense-gqa"], "auto", ctx=1024, use_cache=False, gpu=gpu_target("A100-SXM4-80GB"))
    t = a100.runtime_terms
    assert t["cublas_workspace"]["bytes"] == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert t["cuda_context"]["source"].startswith("default") and t["kernels_after_first_forward"]["bytes"] is None
    assert t["driver_reserve"]["bytes"] is None and "not known" in t["driver_reserve"]["source"]
    assert a100.stages["post_load"] == 512 * MIB + a100.reserved["post_load"]


def test_expandable_advice_needs_five_percent():
    from vramcal.estimator.allocator import DEFAULT_CONF
    from vramcal.estimator.estimate import env_prefix, expandable_advice
    from vramcal.workload import Workload

    class Est:
        alloc_conf = DEFAULT_CONF

        def __init__(self, got):
            self.got = got

        def expandable_saving(self, **_):
            return self.got

    work = Workload(1000, 16, 1)
    advice = expandable_advice(Est((1000, 950)), work)
    assert advice["env"] == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"} and advice["saved_bytes"] == 50
    assert expandable_advice(Est((1000, 951)), work) is None and expandable_advice(Est(None), work) is None
    assert env_prefix(advice["env"]) == "PYTORCH_ALLOC_CONF=expandable_segments:True "


def test_expandable_saving_at_real_widths():
    """Llama-3.1-8B cut to 4 layers, 32k prompt: the replay both ways (the H200 session's bf16 row)."""
    import json
    import tempfile
    from pathlib import Path

    from vramcal.estimator.estimate import Estimator, expandable_advice
    from vramcal.workload import Workload

    d = Path(tempfile.mkdtemp())
    cfg = {**json.loads((Path(__file__).parent.parent / "vramcal/estimator/catalog/llama-3.1-8b.json").read_text()),
           "num_hidden_layers": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    est = Estimator(resolve_model(str(d)), resolve_quant("bf16", cfg), use_cache=False)
    est.estimate(prompt=32752, new_tokens=16)
    advice = expandable_advice(est, Workload(32752, 16, 1))
    assert advice is not None and advice["share"] >= 0.05


def test_nvml_reserved_is_na_not_zero_without_v2(fake):
    from vramcal.probes import nvml

    fake({0: [1000]})
    got = nvml.memory_reserved(nvml.device_handle(0))
    assert not got and isinstance(got, nvml.NA) and "v2" in got.reason
    fake({0: [700 * 1024**2]}, reserved=648_347_648)
    assert nvml.memory_reserved(nvml.device_handle(0)) == 648_347_648
