"""--engine llama.cpp: the GGUF header, each buffer llama.cpp allocates, and the command line.

The first half needs no llama.cpp: the arithmetic of n_ctx, the KV cache and the placement against
llama.cpp's source rules, and bad input. The second half loads tiny GGUFs (written here with the gguf
package: numpy weights, a vocabulary of our own; some quantized by llama.cpp's own quantize API) in the
real llama.cpp (llama-cpp-python, skipped with the reason when it is not installed), reads the buffer
lines it logs, and asserts the estimate equals each to the log's rounding (0.01 MiB) -- the compute
buffer within 1 %.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tiny_gguf  # noqa: E402
from tiny_gguf import write_tiny  # noqa: E402

from vramcal.errors import UserError  # noqa: E402
from vramcal.estimator.llamacpp.buffers import LlamaArgs, context_of, estimate_llamacpp, hparams_of  # noqa: E402
from vramcal.estimator.llamacpp.gguf_file import read_gguf  # noqa: E402
from vramcal.units import MIB  # noqa: E402

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed (pip install "
                                                        "'vramcal[llamacpp]'; .ci/run builds it)")
CPU = dict(n_gpus=0)


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "vramcal", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("g") / "dense.gguf")


# ------------------------------------------------------------------------------------ without llama.cpp

@pytest.mark.parametrize("kw,n_ctx,n_ctx_seq", [
    (dict(ctx_size=1000), 1024, 1024),  # padded to 256 (llama-context.cpp)
    (dict(ctx_size=4096, n_parallel=3), 4608, 1536),  # per sequence pad(4096 / 3, 256) = 1536, x 3
    (dict(ctx_size=4096, n_parallel=3, kv_unified=True), 4096, 4096),
    (dict(ctx_size=0), 4096, 4096),  # 0: the model's context_length
])
def test_n_ctx_as_llama_cpp_sets_it(dense, kw, n_ctx, n_ctx_seq):
    c = context_of(hparams_of(read_gguf(dense)), LlamaArgs(**kw, **CPU))
    assert (c.n_ctx, c.n_ctx_seq) == (n_ctx, n_ctx_seq)


def test_kv_cache_bytes_from_first_principles(dense):
    """2 layers x 2 KV heads x 64 dims: K and V rows of 128 values; f16 2 bytes, q8_0 34 bytes per 32."""
    e = estimate_llamacpp(dense, LlamaArgs(ctx_size=2048, **CPU))
    assert e.kv_buffer_bytes == {"CPU": 2 * 2 * 128 * 2 * 2048}
    q = estimate_llamacpp(dense, LlamaArgs(ctx_size=2048, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on",
                                           **CPU))
    assert q.kv_buffer_bytes == {"CPU": 2 * 2 * (128 // 32 * 34) * 2048}


def test_placement_of_layers_and_the_output(dense):
    """-ngl counts the output layer: 2 repeating layers + output; -ngl 1 puts only the output on the GPU."""
    m = read_gguf(dense)
    all_on = estimate_llamacpp(m, LlamaArgs(ctx_size=512, n_gpu_layers=999))
    assert set(all_on.model_buffer_bytes) == {"CPU_Mapped", "CUDA0"} and all_on.n_gpu_layers == 3
    emb = next(t for t in m.tensors if t.name == "token_embd.weight")
    assert all_on.model_buffer_bytes["CPU_Mapped"] == emb.nbytes  # the input layer stays on the CPU
    one = estimate_llamacpp(m, LlamaArgs(ctx_size=512, n_gpu_layers=1))
    out = [t for t in m.tensors if t.name in ("output.weight", "output_norm.weight")]
    assert one.model_buffer_bytes["CUDA0"] == sum(-(-t.nbytes // 128) * 128 for t in out)
    assert "CUDA0" not in one.kv_buffer_bytes
    split = estimate_llamacpp(m, LlamaArgs(ctx_size=512, n_gpu_layers=999, n_gpus=2, tensor_split=(1, 1)))
    # split points 0.5, 1.0 over 3 layers (upper_bound of il / 3): both repeating layers on CUDA0, the output on
    # CUDA1 -- so CUDA1 holds model weights and no KV
    assert set(split.model_buffer_bytes) == {"CPU_Mapped", "CUDA0", "CUDA1"} and set(split.kv_buffer_bytes) == {"CUDA0"}


def test_a_lazy_graph_is_built_and_placed_as_ggml_does():
    """``expand`` orders nodes as ggml_build_forward_expand (sources first, left to right, each once; inputs as
    leafs in the order met); an in-place op takes its parent's memory, but never a view's (ggml-alloc.c: a view
    is never "own")."""
    from vramcal.estimator.llamacpp.ggml_graph import Graph, run_allocator

    def graph(on_view: bool):
        g = Graph(lazy=True)
        a = g.t("mul_mat", (256, 64), g.new_input((16,)))
        b = g.t("mul_mat", (256, 64), g.new_input((32,)))
        s = g.t("add", (256, 64), a, b)
        n = g.t("rms_norm", (64, 4, 64), g.reshape(s, (64, 4, 64))) if on_view else g.t("rms_norm", (256, 64), s)
        g.expand(n, a, g.t("scale", (256, 64), b))  # b stays alive past the norm
        return g

    g = graph(True)
    assert [x.op for x in g.nodes] == ["mul_mat", "mul_mat", "add", "view", "rms_norm", "scale"]
    assert [x.nbytes for x in g.leafs] == [64, 128]
    # inputs 64 + 128 bytes; a, b 64 KiB each; add in place on a; rms_norm on the reshape of it: a new 64 KiB
    assert run_allocator(g, 32) == 64 + 128 + 3 * 65536
    assert run_allocator(graph(False), 32) == 64 + 128 + 2 * 65536  # on the add itself: in place again


def test_quantized_v_without_flash_attention_is_refused(dense):
    with pytest.raises(UserError, match="requires Flash Attention"):
        estimate_llamacpp(dense, LlamaArgs(cache_type_v="q8_0", flash_attn="off", **CPU))


def test_split_gguf_reads_every_part(tmp_path):
    import gguf

    whole = read_gguf(write_tiny(tmp_path / "whole.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama", split_max_tensors=8)
    src = gguf.GGUFReader(whole.path)
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in src.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(tmp_path.glob("s-0000*-of-*.gguf"))
    assert len(parts) > 1
    split = read_gguf(str(parts[0]))
    assert len(split.files) == len(parts) and split.tensor_bytes == whole.tensor_bytes
    os.unlink(parts[-1])
    with pytest.raises(UserError, match="split GGUF"):
        read_gguf(str(parts[0]))


def test_a_gguf_in_the_hugging_face_cache(tmp_path, dense):
    repo = tmp_path / "hub" / "models--org--tiny-GGUF"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    os.symlink(dense, snap / "tiny-F16.gguf")
    r = _cli("estimate", "--engine", "llama.cpp", "org/tiny-GGUF", "-c", "512", "--device", "cpu", "--json",
             env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["llama_cpp"]["n_ctx"] == 512 and doc["llama_cpp"]["files"][0].endswith("tiny-F16.gguf")


@pytest.mark.parametrize("make,extra,needle", [
    ("truncated", [], "truncated"),
    ("header-cut", [], "truncated"),  # a download stopped inside the header itself (the reader's struct.error)
    ("text", [], "not a GGUF file"),
    ("dir", [], "no .gguf file"),
    ("dense", ["-ctk", "q3_k"], "is not a cache type llama.cpp accepts"),
    ("dense", ["-ctv", "q4_0", "-fa", "off"], "requires Flash Attention"),
    ("dense", ["-ot", "exps=CUDA7"], "no buffer type"),
    ("dense", ["-np", "0"], "-np/--parallel must be 1 or more"),
    ("dense", ["-sm", "row", "--gpu-count", "2"], "ggml-org/llama.cpp#24216"),  # CUDA's split buffers are gone
    ("dense", ["-sm", "tensor", "--gpu-count", "2"], "not modelled yet"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, dense, make, extra, needle):
    if make == "truncated":
        data = Path(dense).read_bytes()
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[: len(data) // 2])
    elif make == "header-cut":
        path = tmp_path / "cut.gguf"
        path.write_bytes(Path(dense).read_bytes()[:100])
    elif make == "text":
        path = tmp_path / "config.gguf"
        path.write_text('{"model_type": "llama"}')
    elif make == "dir":
        path = tmp_path
    else:
        path = dense
    r = _cli("estimate", "--engine", "llama.cpp", str(path), *extra)
    err = r.stderr.strip()
    assert r.returncode == 2 and err.startswith("vramcal: ") and "\n" not in err and needle in err, err


def test_estimate_json_carries_llamas_buffer_names(dense):
    r = _cli("estimate", "--engine", "llama.cpp", dense, "-c", "8192", "-ngl", "99", "--json")
    assert r.returncode == 0, r.stderr
    lc = json.loads(r.stdout)["llama_cpp"]
    assert lc["n_ctx"] == 8192 and set(lc["model_buffer_bytes"]) == {"CPU_Mapped", "CUDA0"}
    assert all(isinstance(v, int) for d in ("model_buffer_bytes", "kv_buffer_bytes", "compute_buffer_bytes")
               for v in lc[d].values()) and isinstance(lc["output_buffer_bytes"], int)


def test_fit_gives_the_most_layers_then_the_longest_context(dense):
    r = _cli("fit", "--engine", "llama.cpp", dense, "--budget", "560MiB", "--buffer", "16MiB", "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    assert f["fits"] and f["n_gpu_layers"] == 3 and f["ctx_size"] == 4096  # the model's whole context
    # -ngl given: the longest -c for it, in llama.cpp's steps of 256, each priced whole (CUDA context included)
    tight = _cli("fit", "--engine", "llama.cpp", dense, "--budget", "540MiB", "--buffer", "16MiB", "-ngl", "3", "--json")
    t = json.loads(tight.stdout)
    assert t["fits"] and 256 <= t["ctx_size"] < 4096 and t["ctx_size"] % 256 == 0
    assert t["peak_bytes"] <= (540 - 16) * MIB < json.loads(_cli(
        "estimate", "--engine", "llama.cpp", dense, "-ngl", "3", "-c", str(t["ctx_size"] + 256), "--json").stdout)[
        "device_bytes"]["CUDA0"] + 512 * MIB


# ------------------------------------------------------------------------------------ against llama.cpp

def _probe(path, args: LlamaArgs):
    from vramcal.probes.llamacpp_probe import child_spec, run_llamacpp_probe

    est = estimate_llamacpp(path, args)
    r = run_llamacpp_probe(path, "t", child_spec(path, args), est, gpus=[], interval_ms=50.0, new_tokens=4,
                           timeout_s=240)
    assert r.status == "ok", (r.error, r.log_tail)
    return est, r.logged


def _mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def assert_matches(est, logged):
    """Every buffer equal to the log's 0.01 MiB; the compute buffer within 1 %."""
    assert logged.lines >= 4, "llama.cpp printed no buffer lines"
    assert logged.n_ctx == est.n_ctx
    for kind in ("model", "kv", "rs"):
        assert {k: _mib(v) for k, v in getattr(est, f"{kind}_buffer_bytes").items()} == \
            {k: _mib(v) for k, v in getattr(logged, f"{kind}_buffer_bytes").items()}, kind
    assert _mib(est.output_buffer_bytes) == _mib(logged.output_buffer_bytes)
    assert set(est.compute_buffer_bytes) == set(logged.compute_buffer_bytes)
    for name, b in logged.compute_buffer_bytes.items():
        assert abs(est.compute_buffer_bytes[name] - b) <= 0.01 * b + MIB // 200, \
            (name, est.compute_buffer_bytes, b)


# the compute replay is within 1 % of llama.cpp's reservation for every one of these graphs. The last six hold
# what were gaps of one or a few [n_embd, n_ubatch] f32 tensors until the replay followed ggml and llama.cpp
# there (docs/llamacpp.md, "The compute buffer"): KQ without flash attention and a peak at the logits (n_vocab
# 4000), once no op ran in place on a view; quantized caches, once their Hadamard rotations were replayed (head
# sizes 64, 192 and 128 -- a 128 x 128 K rotation, K alone without flash attention: -1.5 %, -9.2 %, +3.8 %
# without them); gemma3's sliding window (+2.2 %), once the window cache's K came before V and the output rows
# before the post-attention norm, as ggml's walk has them
CASES = [
    ("dense-f16", dict(), dict(ctx_size=2048)),
    ("q4_0-repacked", dict(weight_type="Q4_0", embd_type="Q8_0"), dict(ctx_size=1024)),
    ("long-ctx-no-fa", dict(n_head=8, n_head_kv=8, n_vocab=600), dict(ctx_size=8192, flash_attn="off",
                                                                      n_ubatch=256)),
    ("moe", dict(n_expert=4, n_expert_used=2, n_ff=256), dict(ctx_size=1024)),
    ("gemma2-swa", dict(arch="gemma2", tied=True, sliding_window=256, n_layer=4), dict(ctx_size=2048)),
    ("gqa-q8_0-np2-no-fa", dict(weight_type="Q8_0", n_head=8, n_head_kv=2), dict(ctx_size=3000, n_parallel=2,
                                                                                 flash_attn="off")),
    ("tied-no-mmap", dict(tied=True, n_vocab=4000), dict(ctx_size=1024, use_mmap=False)),
    ("kv-q8_0-unified", dict(n_vocab=2000), dict(ctx_size=4096, n_parallel=4, kv_unified=True, cache_type_k="q8_0",
                                                  cache_type_v="q8_0", flash_attn="on")),
    ("kv-q4_0-head-192", dict(n_embd=384, n_head=2, n_head_kv=1, n_vocab=3000),
     dict(ctx_size=4096, n_parallel=2, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn="on")),
    ("k-q8_0-head-128-no-fa", dict(n_embd=512, n_head=4, n_head_kv=2), dict(ctx_size=2048, cache_type_k="q8_0",
                                                                           flash_attn="off")),
    ("gemma3-swa", dict(arch="gemma3", tied=True, sliding_window=256, n_layer=6), dict(ctx_size=2048,
                                                                                       flash_attn="off")),
]


@needs_llama
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_buffers_equal_what_llama_cpp_logs(tmp_path, case):
    name, model, flags = case
    path = write_tiny(tmp_path / f"{name}.gguf", **model)
    est, logged = _probe(path, LlamaArgs(**flags, **CPU))
    assert_matches(est, logged)


@needs_llama
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0", "IQ4_XS"])
def test_quantized_by_llama_cpp_itself(tmp_path, ftype):
    """A GGUF quantized by llama.cpp's own quantize API (its per-tensor type choice), then loaded."""
    src = write_tiny(tmp_path / "f16.gguf", n_embd=256, n_ff=768, n_vocab=2048)
    dst = str(tmp_path / f"{ftype}.gguf")
    code = ("import llama_cpp, sys\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{ftype}\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n")
    q = subprocess.run([sys.executable, "-c", code, src, dst], capture_output=True, text=True, timeout=300)
    assert q.returncode == 0, q.stderr[-2000:]
    m = read_gguf(dst)
    assert len({t.type_name for t in m.tensors}) >= 2  # llama.cpp's mix: norms F32, weights per its rules
    est, logged = _probe(dst, LlamaArgs(ctx_size=1024, **CPU))
    assert_matches(est, logged)


@needs_llama
def test_probe_cli_records_the_logged_buffers(tmp_path, dense):
    db = tmp_path / "r.db"
    r = _cli("probe", "--engine", "llama.cpp", dense, "-c", "1024", "--device", "cpu", "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["status"] == "ok" and doc["run_id"] is not None
    assert doc["llama_cpp_logged"]["n_ctx"] == 1024 and doc["stages"]["end"]["peak_bytes"] > 0


def test_probe_without_llama_cpp_is_one_line(dense):
    if HAVE_LLAMA:
        pytest.skip("llama-cpp-python is installed here")
    r = _cli("probe", "--engine", "llama.cpp", dense, "--device", "cpu")
    assert r.returncode == 2 and "\n" not in r.stderr.strip() and "llama-cpp-python" in r.stderr


@needs_llama
def test_check_says_whether_the_buffers_fit_the_budget(tmp_path, dense):
    db = str(tmp_path / "r.db")
    base = ["check", "--engine", "llama.cpp", dense, "-c", "1024", "--device", "cpu", "--db", db, "--json"]
    ok = _cli(*base, "--budget", "1GiB", "--buffer", "64MiB")
    assert ok.returncode == 0 and json.loads(ok.stdout)["fits"] is True, ok.stderr[-2000:]
    tight = _cli(*base, "--budget", "8MiB", "--buffer", "1MiB")
    assert tight.returncode == 1 and json.loads(tight.stdout)["fits"] is False


def test_header_reader_agrees_with_gguf_reader(tmp_path):
    """read_header walks the header itself (GGUFReader parses every vocabulary string); both agree."""
    import gguf

    from vramcal.estimator.llamacpp.gguf_file import read_header

    path = write_tiny(tmp_path / "m.gguf", arch="gemma2", tied=True, sliding_window=128, weight_type="Q8_0")
    meta, infos = read_header(Path(path))
    r = gguf.GGUFReader(path)
    assert [(t.name, int(t.tensor_type), tuple(int(x) for x in t.shape), int(t.data_offset)) for t in r.tensors] == \
        [(n, ty, sh, off) for n, ty, sh, off in infos]
    assert meta["gemma2.attention.sliding_window"] == 128 and meta["general.architecture"] == "gemma2"
    assert len(meta["tokenizer.ggml.tokens"]) == 1024 and meta["tokenizer.ggml.tokens"][259] == "\u2581t0"


@needs_llama
@pytest.mark.parametrize("how,code", [("SIGTERM", 143), ("SIGINT", 130), ("SIGKILL", -9)])
def test_a_stopped_llamacpp_probe_is_recorded_with_its_last_stage(tmp_path, dense, how, code):
    """Ctrl-C (SIGINT to the parent's group, as a terminal sends it) or SIGTERM mid-run: llama.cpp's child is
    killed with its group, the run is recorded as interrupted with the last stage it reached, and the exit
    is 130 / 143 -- the engine probes end as the transformers probe does. SIGKILL: the run was recorded
    before the child started, so it stays, with no outcome (interrupted), and the child dies with it."""
    import signal
    import time

    import psutil
    from helpers import default_sigint

    from vramcal.records.store import Store

    db = tmp_path / "r.db"
    proc = subprocess.Popen([sys.executable, "-m", "vramcal", "probe", "--engine", "llama.cpp", dense, "-c", "8192",
                             "--new-tokens", "6000", "--device", "cpu", "--db", str(db), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_sigint)
    deadline, child = time.monotonic() + 120, None
    while child is None and time.monotonic() < deadline and proc.poll() is None:
        child = next((c for c in psutil.Process(proc.pid).children()
                      if "llamacpp_child" in " ".join(c.cmdline())), None)
        time.sleep(0.05)
    assert child is not None, proc.communicate()[1][-2000:]
    time.sleep(1.5)  # llama.cpp imported, the model loaded, generating
    if how == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(getattr(signal, how))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    child_gone = time.monotonic() + 10
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < child_gone:
        time.sleep(0.05)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    if how == "SIGKILL":
        with Store(str(db)) as s:
            (row,) = s.runs()
            assert s.run(row["id"]).status == "interrupted" and s.run(row["id"]).outcome is None
        return
    assert err.strip().splitlines()[-1] == f"vramcal: probe interrupted by {how}"
    doc = json.loads(out)
    assert doc["status"] == "interrupted" and doc["interrupted"] == how
    assert doc["error"] == f"interrupted by {how} after stage {doc['last_stage']}"
    with Store(str(db)) as s:
        assert [r["id"] for r in s.runs()] == [doc["run_id"]]
        run = s.run(doc["run_id"])
        assert run.status == "interrupted" and run.outcome.last_stage == doc["last_stage"] is not None
        assert run.context.estimate["mode"] == "llama.cpp" and run.sample_count > 0


def test_a_header_estimate_imports_no_numpy(dense):
    """The gguf package's __init__ imports numpy with its reader and writer; a header estimate needs only
    its constants (docs/performance.md: half of a fresh estimate's time), and equals the one made with the
    whole package imported."""
    code = ("import json, sys; from vramcal.estimator.llamacpp.buffers import LlamaArgs, estimate_llamacpp; "
            "from vramcal.estimator.llamacpp.gguf_file import read_gguf; "
            f"e = estimate_llamacpp(read_gguf({str(dense)!r}), LlamaArgs(ctx_size=1024, n_gpus=0)); "
            "print(json.dumps([e.to_dict(), 'numpy' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    light, numpy_imported = json.loads(out.stdout)
    assert numpy_imported is False
    import gguf  # noqa: F401 -- now with the whole package imported
    full = estimate_llamacpp(read_gguf(dense), LlamaArgs(ctx_size=1024, n_gpus=0)).to_dict()
    assert json.loads(json.dumps(full)) == light


@pytest.mark.parametrize("flags", [["--n-cpu-moe", "1"], ["--cpu-moe"], ["-ot", "ffn=CPU"]])
def test_a_probe_refuses_tensor_overrides_it_cannot_pass_on(dense, flags):
    """The probe's child sets no tensor overrides yet: with layers on a GPU it would measure another placement
    than the one asked, so it says so (one line, exit 2) before anything runs or is recorded."""
    r = _cli("probe", "--engine", "llama.cpp", dense, "-ngl", "99", "--gpu-count", "1", *flags)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "-ot / --n-cpu-moe" in r.stderr


# ------------------------------------------------------------------ what llama.cpp holds beyond its buffers

def _result(series: str, base: int, peaks: list[int], buffers: dict[str, int], output=("CPU", 0)) -> dict:
    """A recorded llama.cpp probe's result as the records hold it (LlamaProbeResult.to_dict)."""
    stages = {"baseline": {"used_bytes": base, "peak_bytes": base}}
    stages.update({s: {"used_bytes": p, "peak_bytes": p} for s, p in zip(("post_load", "context", "first_token",
                                                                            "end"), peaks)})
    return {"series": series, "stages": stages,
            "llama_cpp_logged": {"lines": 5, "model_buffer_bytes": {k: v for k, v in buffers.items() if "model" in k},
                                 "kv_buffer_bytes": {}, "compute_buffer_bytes": {},
                                 "output_buffer": output[0], "output_buffer_bytes": output[1]}}


def test_what_a_gpu_run_holds_beyond_its_buffers_is_nvml_less_the_logged_gpu_buffers():
    """NVML's memory.used rose by 1,500 MiB over the baseline; 900 MiB of it are buffers llama.cpp logged on
    CUDA0 (the CPU_Mapped range and the CUDA_Host output are not GPU memory): 600 MiB is the context's."""
    import json

    from vramcal.calibrate.llamacpp_corrections import beyond_of, learned_beyond

    r = _result("gpu0", 1000 * MIB, [1800 * MIB, 2400 * MIB, 2500 * MIB, 2450 * MIB],
                {"CUDA0 model": 900 * MIB, "CPU_Mapped model": 300 * MIB}, ("CUDA_Host", 2 * MIB))
    r["llama_cpp_logged"]["model_buffer_bytes"] = {"CUDA0": 900 * MIB, "CPU_Mapped": 300 * MIB}
    assert beyond_of(r) == ("gpu", 600 * MIB)
    other = json.loads(json.dumps(r))
    other["stages"]["first_token"]["peak_bytes"] = 2520 * MIB  # another run of the same: 620 MiB
    b = learned_beyond([{"run_id": 7, "result_json": json.dumps(r)}, {"run_id": 9, "result_json": json.dumps(other)},
                        {"run_id": 11, "result_json": "{not json"}], "this machine")
    assert b.gpu_bytes == 610 * MIB and b.source_runs == (7, 9) and "2 llama.cpp run(s)" in b.gpu_source
    assert b.host_bytes is None  # no CPU-only run: the host's stays not known
    r["llama_cpp_logged"]["lines"] = 0  # a log with no buffer lines says nothing
    assert beyond_of(r) is None


def test_fit_counts_what_this_machine_holds_beyond_the_buffers(dense):
    """A larger term beyond the buffers leaves less of the budget to the layers: the same budget fits fewer, and
    every GPU total fit reports is its buffers plus that term."""
    from vramcal.estimator.llamacpp.fit import Beyond, fit_llamacpp, gpu_totals

    m = read_gguf(dense)
    a = LlamaArgs(n_gpus=1, ctx_size=1024)
    # every layer on the GPU is 8.77 MiB of buffers at -c 1024, two layers 6.63 MiB
    plain = fit_llamacpp(m, a, 522 * MIB, ctx_given=True, ngl_given=False)  # + the default 512 MiB context
    more = fit_llamacpp(m, a, 522 * MIB, ctx_given=True, ngl_given=False, beyond=Beyond(gpu_bytes=515 * MIB))
    assert (plain.n_gpu_layers, more.n_gpu_layers) == (3, 2), (plain, more)
    assert more.peak_bytes == max(gpu_totals(more.estimate, 1, "CUDA", Beyond(gpu_bytes=515 * MIB)).values())
    assert more.to_dict()["beyond_buffers"]["gpu_bytes"] == 515 * MIB


@needs_llama
def test_a_probe_teaches_what_llama_cpp_holds_beyond_its_buffers(tmp_path, dense):
    """A CPU probe measures the resident set beyond the host buffers llama.cpp logged; the next estimate on this
    machine counts it, names the run, and so lands on what was measured; --no-correction and a withdrawn run
    give the default (not known) back."""
    db = str(tmp_path / "r.db")
    est = ["estimate", "--engine", "llama.cpp", dense, "-c", "1024", "--device", "cpu", "--db", db, "--json"]
    before = json.loads(_cli(*est).stdout)
    assert before["beyond_buffers"]["host_bytes"] is None and "not known" in before["beyond_buffers"]["host_source"]
    r = _cli("probe", "--engine", "llama.cpp", dense, "-c", "1024", "--device", "cpu", "--db", db, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    stages = doc["stages"]
    # a short stage may end between two samples (no peak of its own): the highest reading after loading
    grew = max(stages[s]["peak_bytes"] for s in ("post_load", "context", "first_token", "end")
               if stages.get(s, {}).get("peak_bytes") is not None) - stages["baseline"]["used_bytes"]
    logged = doc["llama_cpp_logged"]
    held = sum(sum(logged[k].values()) for k in ("model_buffer_bytes", "kv_buffer_bytes", "rs_buffer_bytes",
                                                  "compute_buffer_bytes")) + logged["output_buffer_bytes"]
    after = json.loads(_cli(*est).stdout)
    b = after["beyond_buffers"]
    assert b["source_runs"] == [doc["run_id"]] and b["host_bytes"] == grew - held
    assert "this machine" in b["host_source"] and b["gpu_bytes"] == before["beyond_buffers"]["gpu_bytes"]
    # the buffers are priced to the log's 0.01 MiB, so the corrected host total is what the run grew by
    assert abs(after["device_totals"]["CPU"] - grew) <= 64 * 1024, (after["device_totals"]["CPU"], grew)
    assert json.loads(_cli(*est, "--no-correction").stdout)["beyond_buffers"]["host_bytes"] is None
    w = _cli("records", "withdraw", str(doc["run_id"]), "--why", "a test run", "--db", db)
    assert w.returncode == 0, w.stderr
    assert json.loads(_cli(*est).stdout)["beyond_buffers"]["host_bytes"] is None


@needs_llama
def test_an_embeddings_context_keeps_each_outputs_embedding_in_the_output_buffer(tmp_path):
    """--embedding: output_reserve keeps n_embd_out floats per output beside the logits (llama-context.cpp);
    wide enough here (n_embd 1024, 4 sequences: 16 KiB) to show at the log's 0.01 MiB."""
    path = write_tiny(tmp_path / "wide.gguf", n_embd=1024, n_ff=256, n_layer=1, n_head=8, n_head_kv=8)
    a = LlamaArgs(ctx_size=1024, n_parallel=4, kv_unified=True, embeddings=True, **CPU)
    est, logged = _probe(path, a)
    h = hparams_of(read_gguf(path))
    assert est.output_buffer_bytes == (h.n_vocab + 1024) * 4 * 4
    assert _mib(estimate_llamacpp(path, LlamaArgs(ctx_size=1024, n_parallel=4, kv_unified=True, **CPU))
                .output_buffer_bytes) != _mib(logged.output_buffer_bytes)  # the logits alone are not what it logs
    assert_matches(est, logged)


def test_embedding_on_the_command_line_lowers_the_batch_as_llama_server_does(dense):
    r = _cli("estimate", "--engine", "llama.cpp", dense, "-c", "1024", "--embedding", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    lc = json.loads(r.stdout)["llama_cpp"]
    assert lc["n_batch"] == lc["n_ubatch"] == 512 and any("lowered to -ub 512" in n for n in lc["notes"])


# ------------------------------------------------------------------ recurrent, hybrid and MLA state

def test_state_bytes_from_first_principles(tmp_path):
    """mamba: per layer f32 R rows of (d_conv - 1) x d_inner and S rows of d_state x d_inner, one cell per
    sequence, no KV; granitehybrid: KV for its attention layers only, RS for its Mamba2 ones; deepseek2 (MLA):
    K only, one head of kv_lora_rank + rope values."""
    m = estimate_llamacpp(tiny_gguf.write_mamba(tmp_path / "m.gguf", E=128, d_state=16, d_conv=4),
                          LlamaArgs(ctx_size=1024, n_parallel=3, **CPU))
    assert m.kv_buffer_bytes == {} and m.memory == "recurrent"
    assert m.rs_buffer_bytes == {"CPU": 2 * 3 * (3 * 256 + 16 * 256) * 4} and m.rs_cache["cells"] == 3
    g = estimate_llamacpp(tiny_gguf.write_granitehybrid(tmp_path / "g.gguf", kinds="MAMA", n_head_kv=2, d_state=16,
                                                        n_group=1), LlamaArgs(ctx_size=1024, **CPU))
    assert g.kv_buffer_bytes == {"CPU": 2 * 2 * (2 * 32 * 2) * 1024}  # 2 attention layers, K + V, 2 heads of 32
    assert g.rs_buffer_bytes == {"CPU": 2 * (3 * (256 + 2 * 16) + 16 * 256) * 4} and g.rs_cache["layers"] == 2
    d = estimate_llamacpp(tiny_gguf.write_deepseek2(tmp_path / "d.gguf", kv_lora=64, rope=16),
                          LlamaArgs(ctx_size=1024, **CPU))
    assert d.kv_buffer_bytes == {"CPU": 2 * (64 + 16) * 2 * 1024} and d.kv_caches[0]["v_bytes"] == 0
    assert any("MLA" in n for n in d.notes) and "deepseek2's own graph" in d.compute_method


def test_a_quantized_cache_says_where_its_rotations_are_not_replayed(tmp_path):
    """The Hadamard rotations of a quantized cache (head size a multiple of 64) are in the llama family's graph;
    a replayed hybrid graph does not have them yet and says so."""
    path = tiny_gguf.write_granitehybrid(tmp_path / "g.gguf", kinds="MAMA", E=256)  # heads of 64
    q8 = dict(cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")
    assert any("Hadamard" in n for n in estimate_llamacpp(path, LlamaArgs(ctx_size=1024, **q8, **CPU)).notes)
    assert not any("Hadamard" in n for n in estimate_llamacpp(path, LlamaArgs(ctx_size=1024, **CPU)).notes)


def test_a_published_qwen35_log_on_a_gpu(tmp_path):
    """Held out: a llama-server log others published (Qwen3.5-27B Q4_K_S, build 8586 (64ac9ab66), RTX 4070,
    ``-c 131072 -np 1 -ngl 26 -b 1024 -ub 1024``; a GitHub repository file, search-index file id 58671331675).
    Its header keys (the loader's dump) give, with 39 layers on the CPU and 25 on CUDA0, the KV of the 16
    full-attention layers and the RS of the 48 gated delta-net ones, per device, as the log prints them."""
    from vramcal.estimator.llamacpp.buffers import kv_buffers, placement_of, rs_buffers

    kv = {"block_count": 64, "context_length": 262144, "embedding_length": 5120, "feed_forward_length": 17408,
          "attention.head_count": 24, "attention.head_count_kv": 4, "attention.key_length": 256,
          "attention.value_length": 256, "ssm.conv_kernel": 4, "ssm.state_size": 128, "ssm.group_count": 16,
          "ssm.time_step_rank": 48, "ssm.inner_size": 6144, "full_attention_interval": 4}
    m = read_gguf(tiny_gguf.write_gguf(tmp_path / "q35.gguf", "qwen35", kv, [("token_embd.weight", (64, 512))]))
    h = hparams_of(m)
    a = LlamaArgs(ctx_size=131072, n_gpu_layers=26, n_batch=1024, n_ubatch=1024, n_gpus=1)
    c, p = context_of(h, a), placement_of(h, a)
    kv_bytes, caches, _ = kv_buffers(h, a, c, p)
    rs_bytes, rs = rs_buffers(h, a, c, p)
    assert {k: _mib(v) for k, v in kv_bytes.items()} == {"CPU": "4608.00", "CUDA0": "3584.00"}
    assert caches[0]["layers"] == 16
    assert {k: _mib(v) for k, v in rs_bytes.items()} == {"CPU": "93.52", "CUDA0": "56.11"}
    assert (rs["cells"], rs["layers"], _mib(rs["r_bytes"]), _mib(rs["s_bytes"])) == (1, 48, "5.62", "144.00")


def test_logparse_reads_the_recurrent_state_lines():
    from vramcal.estimator.llamacpp.logparse import parse_log

    log = ("llama_memory_recurrent:        CPU RS buffer size =     0.27 MiB\n"
           "llama_memory_recurrent: size =    0.27 MiB (     3 cells,   4 layers,  3 seqs  0 rs_seq), R (f32):    0.02 "
           "MiB, S (f32):    0.25 MiB, P (f32):    0.00 MiB\n"
           "llama_kv_cache:        CPU KV buffer size =     4.00 MiB\n")
    g = parse_log(log)
    assert g.rs_buffer_bytes == {"CPU": round(0.27 * MIB)} and g.rs_cells == 3
    assert g.rs_size_bytes == round(0.27 * MIB) and g.kv_buffer_bytes == {"CPU": 4 * MIB} and g.kv_cells == []


def test_an_architecture_still_refused_is_one_line(tmp_path):
    path = tiny_gguf.write_gguf(tmp_path / "k.gguf", "kimi-linear", {"block_count": 1, "embedding_length": 64,
                                                                     "context_length": 512},
                                [("token_embd.weight", (64, 512))])
    r = _cli("estimate", "--engine", "llama.cpp", path, "--device", "cpu")
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and "kimi-linear" in err and "not model" in err, err


STATE_CASES = [
    ("mamba-np3", "mamba", dict(E=256, d_state=64), dict(ctx_size=1536, n_parallel=3)),
    ("mamba2", "mamba2", dict(E=256, d_state=64, head_dim=64), dict(ctx_size=1024)),
    ("rwkv6-np4", "rwkv6", dict(E=256, head_size=64), dict(ctx_size=1024, n_parallel=4)),
    ("rwkv7-np2", "rwkv7", dict(E=256, head_size=64), dict(ctx_size=1024, n_parallel=2)),
    ("granitehybrid-np2-no-fa", "granitehybrid", dict(kinds="MAMA", d_state=64), dict(ctx_size=2048, n_parallel=2,
                                                                                      flash_attn="off")),
    ("jamba", "jamba", dict(kinds="MAMM", d_state=64), dict(ctx_size=2048)),
    ("lfm2-np4", "lfm2", dict(kinds="CCAC", E=256), dict(ctx_size=2048, n_parallel=4)),
    ("falcon-h1-np2", "falcon_h1", dict(d_state=64), dict(ctx_size=2048, n_parallel=2)),
    ("nemotron_h", "nemotron_h", dict(kinds="MFAFMF", d_state=64), dict(ctx_size=2048)),
    ("qwen3next-np2", "qwen3next", dict(n_layer=8, d_state=64), dict(ctx_size=2048, n_parallel=2)),
    ("deepseek2-mla", "deepseek2", dict(), dict(ctx_size=4096)),
    ("deepseek2-mla-mtp", "deepseek2", dict(nextn=1), dict(ctx_size=2048)),  # the MTP layer has no KV here
    ("deepseek2-mla-np2-no-fa", "deepseek2", dict(kv_lora=128), dict(ctx_size=2048, n_parallel=2, flash_attn="off")),
]


@needs_llama
@pytest.mark.parametrize("case", STATE_CASES, ids=[c[0] for c in STATE_CASES])
def test_state_buffers_equal_what_llama_cpp_logs(tmp_path, case):
    """Model, KV, RS and output buffers equal llama.cpp's log, and the compute buffer -- each architecture's own
    graph replayed (graphs.py) -- within 1 % (all equal it to the log's 0.01 MiB today)."""
    name, arch, model, flags = case
    path = getattr(tiny_gguf, f"write_{arch}")(tmp_path / f"{name}.gguf", **model)
    est, logged = _probe(path, LlamaArgs(**flags, **CPU))
    assert_matches(est, logged)
    assert "own graph" in est.compute_method and not any("approximate" in n for n in est.notes)
    if est.rs_cache is not None:
        assert logged.rs_cells == est.rs_cache["cells"] == flags.get("n_parallel", 1)
        assert _mib(logged.rs_size_bytes) == _mib(est.rs_cache["r_bytes"] + est.rs_cache["s_bytes"])
    else:
        assert logged.rs_buffer_bytes == {}
    assert logged.kv_layers == [c["layers"] for c in est.kv_caches]  # the attention layers only
