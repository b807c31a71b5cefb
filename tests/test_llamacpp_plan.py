"""plan --engine llama.cpp: every plan, priced again by `vramcal estimate --engine llama.cpp` on the flags it
prints, fits each GPU (its buffers + the CUDA context) and the RAM (every host buffer) after the buffer; a MoE
model keeps its layers on the GPU with --n-cpu-moe before it gives any up; the decode bound is the bytes a
token reads per device over its bandwidth, checked by hand; a stronger goal never offers less; bad input is
one line and exit 2. Tiny GGUFs written by tests/tiny_gguf.py, and a Llama-3.1-70B-shaped Q4_K_M header
written sparse; no llama.cpp needed (the estimate is the arithmetic tests/test_llamacpp.py checks against it).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import write_sparse_header, write_tiny  # noqa: E402

from vramcal.calibrate.plan_llamacpp import plan_llamacpp  # noqa: E402
from vramcal.estimator.llamacpp.buffers import DraftArgs, LlamaArgs, estimate_llamacpp, token_reads  # noqa: E402
from vramcal.estimator.runtime import CUDA_DEFAULT  # noqa: E402
from vramcal.estimator.speed import sequential_bound  # noqa: E402
from vramcal.probes.hardware import Bandwidth, described, parse_hardware  # noqa: E402
from vramcal.units import GB, GIB, MIB  # noqa: E402

CONTEXT = CUDA_DEFAULT.context_bytes
TINY_BW = "cuda:0=1000GB,cuda:1=500GB,cpu=50GB"  # tiny models: bounds far beyond a real step, said in a note


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-gguf")
    quants = root / "quants"
    quants.mkdir()
    for wt in ("F16", "Q8_0", "Q4_0"):
        write_tiny(quants / f"tiny-{wt}.gguf", weight_type=wt, n_layer=4)
    (quants / "tiny-mmproj-F16.gguf").write_bytes(b"GGUF")  # a projector is not a model: never read
    moe = write_tiny(root / "moe.gguf", n_expert=8, n_expert_used=2, n_ff=512, n_layer=4, n_embd=512, n_head=8,
                     n_head_kv=2)
    big = write_sparse_header(root / "llama-70b-Q4_K_M.gguf")
    (root / "empty").mkdir()
    (root / "fake.gguf").write_text('{"model_type": "llama"}')
    return {"quants": str(quants), "moe": moe, "big": big, "root": root}


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from vramcal.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _plan_json(capsys, model, hardware, *extra):
    rc, out, err = _cli(capsys, "plan", "--engine", "llama.cpp", model, "--hardware", hardware, "--json", *extra)
    assert rc in (0, 1), err
    return rc, json.loads(out)


def _priced_again(capsys, plan: dict) -> dict:
    """The plan's own `vramcal estimate --engine llama.cpp ...` command, run: bytes per device."""
    argv = shlex.split(plan["estimate_command"])
    assert argv[:4] == ["vramcal", "estimate", "--engine", "llama.cpp"]
    rc, out, err = _cli(capsys, *argv[1:], "--json")
    assert rc == 0, err
    return json.loads(out)["device_bytes"]


def _assert_fits(capsys, doc: dict, sizes: dict[str, int]):
    buffer = doc["buffer_bytes"]
    gpus = [d for d in sizes if d.startswith("cuda")]
    for plan in doc["plans"]:
        assert plan["args"][:2] == ["-m", plan["file"]] and plan["command"] == shlex.join(["llama-server",
                                                                                            *plan["args"]])
        got = _priced_again(capsys, plan)
        for i, dev in enumerate(gpus):
            used = got.get(f"CUDA{i}", 0) + CONTEXT
            assert used == plan["gpu_bytes"][dev] and used <= sizes[dev] - buffer, (plan["command"], dev, used)
        assert got["CPU"] == plan["host_bytes"] <= sizes["cpu"] - buffer, plan["command"]


# ------------------------------------------------------------------------------------ every plan fits

def test_every_plan_fits_each_gpu_and_the_ram_as_llama_cpp_will_price_it(models, capsys):
    """A folder of three quantizations on a GPU that holds F16 only in part: each plan's printed flags, priced
    again, fit the GPU and the RAM; the highest precision comes first under --goal quality."""
    # room for 19 MiB of buffers beside the CUDA context and the 16 MiB buffer: at -c 4096 every layer of
    # Q4_0 is 17.93 MiB with its KV and compute buffers, of F16 21.52 MiB
    sizes = {"cuda:0": CONTEXT + 16 * MIB + 19 * MIB, "cpu": 64 * MIB}
    hw = ",".join(f"{d}={n}B" for d, n in sizes.items())
    rc, doc = _plan_json(capsys, models["quants"], hw, "--buffer", "16MiB", "--bandwidth", "cuda:0=1000GB,cpu=50GB")
    assert rc == 0 and len(doc["files"]) == 3 and not any("mmproj" in f["file"] for f in doc["files"])
    assert [Path(f["file"]).name for f in doc["files"]] == ["tiny-F16.gguf", "tiny-Q8_0.gguf", "tiny-Q4_0.gguf"]
    first = doc["plans"][0]
    assert Path(first["file"]).name == "tiny-F16.gguf" and first["n_gpu_layers"] < 5  # F16 only in part
    assert any(p["n_gpu_layers"] == 5 for p in doc["plans"])  # a smaller file holds every layer
    _assert_fits(capsys, doc, sizes)


def test_two_gpus_get_a_tensor_split_in_whole_layers_that_fits_each(models, capsys):
    sizes = {"cuda:0": 530 * MIB, "cuda:1": 525 * MIB, "cpu": 64 * MIB}
    hw = ",".join(f"{d}={n}B" for d, n in sizes.items())
    rc, doc = _plan_json(capsys, str(Path(models["quants"]) / "tiny-F16.gguf"), hw, "--buffer", "8MiB",
                         "--bandwidth", TINY_BW)
    assert rc == 0
    p = doc["plans"][0]
    assert p["tensor_split"] is not None and sum(p["tensor_split"]) == p["n_gpu_layers"] and "-ts" in p["args"]
    _assert_fits(capsys, doc, sizes)


def test_a_70b_header_partly_offloaded_fits_and_reads_what_the_bound_says(models, capsys):
    """Llama-3.1-70B Q4_K_M (header only) on one 24 GiB RTX 4090 and 64 GiB of RAM: about half the layers on the
    GPU; the flags fit both, priced again; the bound is the weights and KV each side reads over its bandwidth."""
    sizes = {"cuda:0": 24 * GIB, "cpu": 64 * GIB}
    rc, doc = _plan_json(capsys, models["big"], "cuda:0=24GiB,cpu=64GiB", "--gpu", "RTX 4090", "--bandwidth",
                         "cpu=80GB", "-ctk", "f16", "-ctv", "f16")
    assert rc == 0
    p = doc["plans"][0]
    assert (p["cache_type_k"], p["n_cpu_moe"]) == ("f16", 0) and 30 < p["n_gpu_layers"] < 50 and p["reaches_ctx"]
    assert p["ctx_size"] >= 4096 and p["ctx_size"] % 256 == 0
    reads = p["read_bytes_per_token"]
    step = reads["cuda:0"] / (1008 * GB) + reads["cpu"] / (80 * GB)
    assert p["tokens_per_s"] == pytest.approx(1 / step) and 1 < p["tokens_per_s"] < 10
    _assert_fits(capsys, doc, sizes)


# ------------------------------------------------------------------------------------ MoE

def test_a_moe_plan_moves_experts_before_layers(models, capsys):
    """Tight GPU: every layer stays on the GPU and the fewest layers' experts go to RAM (--n-cpu-moe N, and
    N - 1 does not fit); tighter still: layers move only once every expert is in RAM."""
    m = models["moe"]
    # at -c 4096 every layer on the GPU is 76.09 MiB of buffers, each layer's experts 12 MiB of it: 54 MiB of room
    # holds them with the experts of 2 layers in RAM (52.09 MiB), not of 1 (64.09 MiB)
    gpu = CONTEXT + 16 * MIB + 54 * MIB
    rc, doc = _plan_json(capsys, m, f"cuda:0={gpu}B,cpu=1GiB", "--buffer", "16MiB", "-ctk", "f16", "-ctv", "f16")
    assert rc == 0
    p = doc["plans"][0]
    assert p["n_gpu_layers"] == 5 and p["n_cpu_moe"] == 2, p
    assert ["--n-cpu-moe", str(p["n_cpu_moe"])] == p["args"][p["args"].index("--n-cpu-moe"):][:2]
    fewer = estimate_llamacpp(m, LlamaArgs(ctx_size=4096, n_gpu_layers=5, n_cpu_moe=p["n_cpu_moe"] - 1))
    assert fewer.device_bytes()["CUDA0"] + CONTEXT > gpu - 16 * MIB  # one layer's experts fewer in RAM: over
    _assert_fits(capsys, doc, {"cuda:0": gpu, "cpu": 1 * GIB})
    tighter = CONTEXT + 16 * MIB + 20 * MIB  # below the 28.09 MiB of every layer with every expert in RAM
    rc, tight = _plan_json(capsys, m, f"cuda:0={tighter}B,cpu=1GiB", "--buffer", "16MiB", "-ctk", "f16", "-ctv", "f16")
    t = tight["plans"][0]
    assert rc == 0 and t["n_gpu_layers"] < 5 and t["n_cpu_moe"] == 4
    # fit --engine llama.cpp takes the same search: --n-cpu-moe, not fewer layers
    rc, out, _ = _cli(capsys, "fit", "--engine", "llama.cpp", m, "--budget", f"{gpu}B", "--buffer", "16MiB", "-c",
                      "4096", "--json")
    f = json.loads(out)
    assert rc == 0 and f["n_gpu_layers"] == 5 and f["n_cpu_moe"] == p["n_cpu_moe"]


# ------------------------------------------------------------------------------------ the decode bound

def test_the_decode_bound_by_hand(models):
    """tiny dense, 2 layers of F16: n_embd 256, 4 heads of 64, 2 KV heads, n_ff 512, 1024 tokens. With -ngl 2
    llama.cpp puts layer 1 and the output layer on the GPU, layer 0 on the CPU (docs/llamacpp.md):
      a layer's weights: norms 2 x 256 x 4 = 2,048; q and o 2 x 256 x 256 x 2 = 262,144; k and v
      2 x 128 x 256 x 2 = 131,072; gate, up, down 3 x 512 x 256 x 2 = 786,432: 1,181,696 bytes
      the output layer: its norm 1,024 + 1024 x 256 x 2 = 525,312 bytes (token_embd's lookup reads one row)
      KV of a layer at -c 4096: (128 + 128) values x 2 bytes x 4,096 cells = 2,097,152 bytes
    CPU 1,181,696 + 2,097,152 = 3,278,848 at 10 GB/s; GPU 1,181,696 + 525,312 + 2,097,152 = 3,804,160 at
    100 GB/s: 327.8848 + 38.0416 us = 365.9264 us a token, 2,732.79 tokens/s at most."""
    dense = write_tiny(Path(models["root"]) / "hand.gguf")
    r = token_reads(dense, LlamaArgs(ctx_size=4096, n_gpu_layers=2))
    assert r.by_device() == {"CPU": 3_278_848, "CUDA0": 3_804_160}
    b = sequential_bound({"cpu": 3_278_848, "cuda:0": 3_804_160},
                         {"cpu": Bandwidth(10 * GB, "t"), "cuda:0": Bandwidth(100 * GB, "t")})
    assert b.seconds_per_step == pytest.approx(365.9264e-6) and b.tokens_per_s == pytest.approx(2732.79, abs=0.01)
    unknown = sequential_bound({"cpu": 1, "cuda:0": 1}, {"cpu": Bandwidth(None, "no RAM bandwidth"),
                                                         "cuda:0": Bandwidth(100 * GB, "t")})
    assert unknown.tokens_per_s is None and "no RAM bandwidth" in unknown.why_none


def test_a_moe_token_reads_only_its_routed_experts(models):
    """moe: 8 experts, 2 routed; each layer's gate, up and down experts 8 x 512 x 512 x 2 bytes each: a token
    reads 2/8 of them, the router (8 x 512 x 4) whole; with --n-cpu-moe 4 that share is read in RAM."""
    m = models["moe"]
    exps = 3 * 8 * 512 * 512 * 2
    every = token_reads(m, LlamaArgs(ctx_size=1024, n_gpu_layers=99))
    moved = token_reads(m, LlamaArgs(ctx_size=1024, n_gpu_layers=99, n_cpu_moe=4))
    assert moved.by_device()["CPU"] == 4 * exps * 2 // 8
    assert every.by_device()["CUDA0"] - moved.by_device()["CUDA0"] == 4 * exps * 2 // 8
    assert every.expert_share == (2, 8)


# ------------------------------------------------------------------------------------ goals, pins, bounds

def test_a_stronger_goal_never_offers_less(models):
    """--goal context offers at least the context of every other goal's plan; --goal speed at least the bound
    of every plan of the others that reaches its context. Two quantizations of a model trained to 65,536
    tokens (128 MiB of f16 KV there) on two small GPUs of different bandwidths: the longest context needs
    layers in RAM, the fastest plan does not."""
    long = Path(models["root"]) / "long"
    long.mkdir()
    for wt in ("F16", "Q4_0"):
        write_tiny(long / f"long-{wt}.gguf", weight_type=wt, n_layer=4, n_ctx_train=65536)
    hw = described({"cuda:0": CONTEXT + 40 * MIB, "cuda:1": CONTEXT + 28 * MIB, "cpu": 512 * MIB}, None,
                   {"cuda:0": 1000 * GB, "cuda:1": 400 * GB, "cpu": 50 * GB})
    got = {g: plan_llamacpp(str(long), hw, buffer=8 * MIB, goal=g) for g in ("quality", "speed", "context")}
    assert all(r.plans for r in got.values())
    assert got["context"].plans[0].ctx_size == max(p.ctx_size for r in got.values() for p in r.plans) == 65536
    assert not got["context"].plans[0].on_gpus and got["quality"].plans[0].on_gpus
    target = got["speed"].target_ctx
    others = [p.tokens_per_s for g in ("quality", "context") for p in got[g].plans if p.ctx_size >= target]
    assert got["speed"].plans[0].tokens_per_s >= max(others)
    # quality: the highest precision and the model's own f16 cache first
    q = got["quality"].plans[0]
    assert (Path(q.file).name, q.cache_type_k) == ("long-F16.gguf", "f16")


def test_a_pinned_size_never_exceeds_the_device(models, capsys):
    """-c beyond what fits: the plan offers the largest -c that does, marked short, and fits; -ngl 99 on a GPU
    that cannot hold every layer: nothing fits, exit 1, no plan over the device."""
    q8 = str(Path(models["quants"]) / "tiny-Q8_0.gguf")
    rc, doc = _plan_json(capsys, q8, "cuda:0=530MiB,cpu=64MiB", "--buffer", "8MiB", "-c", "65536")
    assert rc == 0 and doc["ctx_asked"] and all(not p["reaches_ctx"] and p["ctx_size"] < 65536
                                                for p in doc["plans"])
    _assert_fits(capsys, doc, {"cuda:0": 530 * MIB, "cpu": 64 * MIB})
    rc, out, _ = _cli(capsys, "plan", "--engine", "llama.cpp", str(Path(models["quants"]) / "tiny-F16.gguf"),
                      "--hardware", "cuda:0=521MiB,cpu=64MiB", "--buffer", "8MiB", "-ngl", "99")
    assert rc == 1 and "nothing fits" in out


def test_the_search_is_bounded_in_time_with_progress_on_stderr(models, capsys):
    hw = described(parse_hardware("cuda:0=24GiB,cpu=64GiB"))
    lines: list[str] = []
    r = plan_llamacpp(models["quants"], hw, buffer=2 * GIB, progress=lines.append, seconds=0)
    assert not r.plans and "within the search's 0 s" in r.shortfall and "stopped after 0 s" in r.notes[-1]
    assert lines == ["plan: searching tiny-F16.gguf -ctk f16 -ctv f16 (1 of 9)"]
    rc, _, err = _cli(capsys, "plan", "--engine", "llama.cpp", models["moe"], "--hardware", "cuda:0=24GiB,cpu=8GiB")
    assert rc == 0 and "plan: searching moe.gguf" not in err  # no terminal, no VRAMCAL_PROGRESS: quiet


def test_nothing_fits_is_exit_1_with_what_is_missing(models, capsys):
    """F16 with 2 MiB of room on the GPU and 4 MiB of RAM: neither every layer on the GPU (about 12 MiB at
    -c 256) nor every layer in RAM (its 5 MiB of weights) fits; both shortfalls are said."""
    f16 = str(Path(models["quants"]) / "tiny-F16.gguf")
    rc, out, _ = _cli(capsys, "plan", "--engine", "llama.cpp", f16, "--hardware",
                      f"cuda:0={CONTEXT + 10 * MIB}B,cpu=12MiB", "--buffer", "8MiB")
    assert rc == 1 and "nothing fits: tiny-F16.gguf at -c 256 needs" in out and "more RAM with -ngl 0" in out, out


@pytest.mark.parametrize("argv,needle", [
    (["--goal", "fastest"], "--goal"),
    (["--hardware", "cuda:0=lots"], "cuda:0"),
    (["--hardware", "cuda:0=24GiB"], "cpu=SIZE"),
    (["--ctx", "4096"], "-c/--ctx-size"),
    (["--gpu-count", "2"], "--hardware"),
    (["--gpu-memory-utilization", "0.8"], "--engine vllm"),
    (["-ctk", "q3_k"], "is not a cache type"),
    (["-ts", "1,1,1"], "one per GPU"),
])
def test_bad_input_is_one_line_and_exit_2(models, capsys, argv, needle):
    hw = [] if "--hardware" in argv else ["--hardware", "cuda:0=24GiB,cpu=64GiB"]
    rc, out, err = _cli(capsys, "plan", "--engine", "llama.cpp", models["moe"], *hw, *argv)
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("which,needle", [("fake", "not a GGUF file"), ("empty", "no .gguf file")])
def test_a_model_that_is_not_gguf_is_one_line_and_exit_2(models, capsys, which, needle):
    path = models["root"] / ("fake.gguf" if which == "fake" else "empty")
    rc, out, err = _cli(capsys, "plan", "--engine", "llama.cpp", path, "--hardware", "cuda:0=24GiB,cpu=64GiB")
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and needle in err, err


def test_the_ram_bandwidth_is_refused_where_it_means_nothing(capsys):
    rc, _, err = _cli(capsys, "plan", "llama-3.1-8b", "--hardware", "cuda:0=24GiB,cpu=64GiB", "--bandwidth",
                      "cpu=80GB")
    assert rc == 2 and "only --engine llama.cpp reads" in err
    rc, _, err = _cli(capsys, "plan", "llama-3.1-8b", "--hardware", "cuda:0=24GiB", "-c", "4096")
    assert rc == 2 and "--engine llama.cpp" in err


# ------------------------------------------------------------------------------------ a draft model (-md)

def test_a_draft_model_is_priced_on_the_same_devices_in_estimate_fit_and_plan(models, capsys):
    """-md: the draft's own model, KV (its -ctkd/-ctvd, the target's -c) and compute buffers, added per device;
    a plan keeps it, leaves it out of the files it ranks, and its printed flags priced again fit."""
    folder = Path(models["root"]) / "with-draft"
    folder.mkdir()
    target = write_tiny(folder / "target-F16.gguf", n_layer=4)
    draft = write_tiny(folder / "draft-F16.gguf", n_layer=1, n_embd=128, n_head=2, n_head_kv=1, n_ff=256)
    a = LlamaArgs(ctx_size=2048, n_gpu_layers=99, flash_attn="on", draft=DraftArgs(draft, cache_type_k="q8_0",
                                                                                   cache_type_v="q8_0"))
    both = estimate_llamacpp(target, a)
    alone = estimate_llamacpp(target, LlamaArgs(ctx_size=2048, n_gpu_layers=99, flash_attn="on"))
    d = estimate_llamacpp(draft, LlamaArgs(ctx_size=2048, n_gpu_layers=99, flash_attn="on", cache_type_k="q8_0",
                                           cache_type_v="q8_0"))
    assert d.kv_buffer_bytes == {"CUDA0": 2 * (64 // 32 * 34) * 2048}  # 1 layer, 1 KV head of 64, K and V in q8_0
    assert both.device_bytes() == {k: alone.device_bytes()[k] + d.device_bytes()[k] for k in alone.device_bytes()}
    sizes = {"cuda:0": CONTEXT + 16 * MIB + 24 * MIB, "cpu": 64 * MIB}
    rc, doc = _plan_json(capsys, str(folder), f"cuda:0={sizes['cuda:0']}B,cpu=64MiB", "--buffer", "16MiB", "-md",
                         draft, "-ctkd", "q8_0", "-ctvd", "q8_0")
    assert rc == 0 and [f["file"] for f in doc["files"]] == [target]
    assert all(p["args"][-6:] == ["-md", draft, "-ctkd", "q8_0", "-ctvd", "q8_0"] for p in doc["plans"])
    _assert_fits(capsys, doc, sizes)
    rc, out, _ = _cli(capsys, "fit", "--engine", "llama.cpp", target, "--budget", f"{sizes['cuda:0']}B", "--buffer",
                      "16MiB", "-md", draft, "--json")
    f = json.loads(out)
    assert rc == 0 and "-md" in f["args"] and f["peak_bytes"] <= sizes["cuda:0"] - 16 * MIB
    for argv, needle in ((["estimate", "--engine", "llama.cpp", target, "-ngld", "2"], "give the draft with -md"),
                         (["probe", "--engine", "llama.cpp", target, "-md", draft], "loads the target model only")):
        rc, _, err = _cli(capsys, *argv)
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_a_folder_of_quantizations_lists_each_model_once(tmp_path):
    """Its files and its sub-folders' (a split GGUF by its first part), never a projector; a folder with none
    is one line."""
    from vramcal.errors import UserError
    from vramcal.estimator.llamacpp.gguf_file import gguf_models

    for name in ("m-Q4_K_M.gguf", "mmproj-m-F16.gguf", "Q8_0/m-Q8_0-00001-of-00002.gguf",
                 "Q8_0/m-Q8_0-00002-of-00002.gguf", "notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"GGUF")
    assert [Path(f).relative_to(tmp_path).as_posix() for f in gguf_models(str(tmp_path))] == \
        ["Q8_0/m-Q8_0-00001-of-00002.gguf", "m-Q4_K_M.gguf"]
    (tmp_path / "none").mkdir()
    with pytest.raises(UserError, match="no .gguf file"):
        gguf_models(str(tmp_path / "none"))


def test_a_plan_counts_what_the_machine_holds_beyond_the_buffers(models):
    """What llama.cpp holds beyond its buffers (learned from this machine's runs) is in every plan's GPU and RAM
    figures, and the plan says where it came from."""
    from vramcal.estimator.llamacpp.fit import Beyond

    hw = described(parse_hardware("cuda:0=24GiB,cpu=64GiB"))
    f16 = str(Path(models["quants"]) / "tiny-F16.gguf")
    learned = Beyond(gpu_bytes=CONTEXT + 300 * MIB, gpu_source="this machine: ...", host_bytes=40 * MIB,
                     host_source="this machine: ...", source_runs=(3,))
    plain, more = plan_llamacpp(f16, hw, buffer=GIB), plan_llamacpp(f16, hw, buffer=GIB, beyond=learned)
    a, b = plain.plans[0], more.plans[0]
    assert (a.ctx_size, a.n_gpu_layers, a.cache_type_k) == (b.ctx_size, b.n_gpu_layers, b.cache_type_k)
    assert b.gpu_bytes["cuda:0"] - a.gpu_bytes["cuda:0"] == 300 * MIB and b.host_bytes - a.host_bytes == 40 * MIB
    assert more.to_dict()["beyond_buffers"]["source_runs"] == [3]
