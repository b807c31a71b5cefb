"""--mmproj: the multimodal projector's buffers (vramcal/estimator/llamacpp/mmproj.py) beside a llama.cpp model,
against the projector's header and, where llama-cpp-python is installed, libmtmd's own load log."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import write_tiny, write_tiny_mmproj  # noqa: E402

from vramcal.estimator.llamacpp.buffers import LlamaArgs, estimate_llamacpp  # noqa: E402
from vramcal.estimator.llamacpp.mmproj import MmprojArgs, estimate_mmproj  # noqa: E402
from vramcal.units import MIB  # noqa: E402

# (writer arguments): a SigLIP ViT with the gemma3 projector at three shapes; Q8_0 rows of 128 values are
# padded to 512 on CUDA
SHAPES = {"tiny": {}, "224px": {"image_size": 224, "patch_size": 14, "n_embd": 128, "n_ff": 512, "n_merge": 4},
          "q8_0": {"image_size": 128, "patch_size": 16, "n_embd": 128, "n_ff": 256, "n_head": 2, "n_layer": 3,
                   "weight_type": "Q8_0"}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmproj")
    out = {"text": write_tiny(root / "text-F16.gguf")}
    for name, kw in SHAPES.items():
        out[name] = write_tiny_mmproj(root / f"mmproj-{name}.gguf", **kw)
    out["root"] = root
    return out


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from vramcal.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _header_arithmetic(path: str, align: int, cuda: bool) -> int:
    """Every tensor of the file as gguf's own reader sees it, each rounded up to ``align`` (on CUDA a quantized
    tensor gets one row's padding to 512 values first, ggml-cuda.cu ``get_alloc_size``): ggml-alloc.c's
    ``ggml_backend_alloc_ctx_tensors_from_buft``."""
    import gguf

    total = 0
    for t in gguf.GGUFReader(path).tensors:
        n = int(t.n_bytes)
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        row = int(t.shape[0])
        if cuda and block > 1 and row % 512:
            n += (512 - row % 512) // block * size
        total += (n + align - 1) // align * align
    return total


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_model_buffer_is_the_headers_tensors_at_the_buffer_types_alignment(files, name):
    cpu = estimate_mmproj(MmprojArgs(files[name], offload=False), n_gpus=1)
    gpu = estimate_mmproj(MmprojArgs(files[name]), n_gpus=1)
    assert cpu.model_buffer_bytes == {"CPU": _header_arithmetic(files[name], 32, cuda=False)}
    assert gpu.model_buffer_bytes == {"CUDA0": _header_arithmetic(files[name], 128, cuda=True)}
    if name == "q8_0":
        assert gpu.model_buffer_bytes["CUDA0"] >= cpu.model_buffer_bytes["CPU"] + 3 * 6 * 384 // 32 * 34
    none = estimate_mmproj(MmprojArgs(files[name]), n_gpus=0)  # a CPU-only build
    assert none.model_buffer_bytes == cpu.model_buffer_bytes and set(none.compute_buffer_bytes) == {"CPU"}


_LOAD = """
import sys
import llama_cpp
from llama_cpp import mtmd_cpp
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
p = mtmd_cpp.mtmd_context_params_default()
p.use_gpu = False
p.n_threads = 1
p.flash_attn_type = int(sys.argv[3])
assert mtmd_cpp.mtmd_init_from_file(sys.argv[2].encode(), model, p)
"""


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_libmtmd_logs_the_model_size_and_compute_buffer_priced(files, name, flash_attn):
    """libmtmd (llama-cpp-python 0.3.36, a CPU build) loads the projector beside the text model and warms
    it up: its ``model size`` and ``CPU compute buffer size`` lines equal the estimate to the log's 0.01 MiB."""
    if importlib.util.find_spec("llama_cpp.mtmd_cpp") is None:
        pytest.skip("this llama-cpp-python has no mtmd bindings")
    run = subprocess.run([sys.executable, "-c", _LOAD, files["text"], files[name], "1" if flash_attn == "on" else "0"],
                         capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-2000:]
    e = estimate_llamacpp(files["text"], LlamaArgs(ctx_size=512, n_gpus=0, flash_attn=flash_attn,
                                                   mmproj=MmprojArgs(files[name])))
    p = e.mmproj
    assert f"model size:         {p.model_size_bytes / MIB:.2f} MiB" in log
    logged = dict(re.findall(r"reserve_compute_meta:\s+(\S+) compute buffer size =\s+([\d.]+) MiB", log))
    assert logged == {k: f"{b / MIB:.2f}" for k, b in p.compute_buffer_bytes.items()}, log[-1500:]
    assert f"flash attention is {'enabled' if flash_attn == 'on' else 'disabled'}" in log


def test_estimate_fit_and_plan_carry_the_projector(files, capsys):
    text, mm = files["text"], files["224px"]
    rc, out, err = _cli(capsys, "estimate", "--engine", "llama.cpp", text, "-c", "512", "--gpu-count", "1",
                        "-mm", mm, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    block = doc["llama_cpp"]["mmproj"]
    alone = estimate_llamacpp(text, LlamaArgs(ctx_size=512, n_gpus=1)).device_bytes()
    assert block["modalities"][0]["projector_type"] == "gemma3" and set(block["compute_buffer_bytes"]) == {"CUDA0",
                                                                                                          "CPU"}
    assert doc["device_bytes"]["CUDA0"] == alone["CUDA0"] + block["model_buffer_bytes"]["CUDA0"] + \
        block["compute_buffer_bytes"]["CUDA0"]
    rc, out, err = _cli(capsys, "estimate", "--engine", "llama.cpp", text, "-c", "512", "--gpu-count", "1",
                        "-mm", mm, "--no-mmproj-offload")
    assert rc == 0 and "load_hparams: model size:" in out and "clip CPU model buffer size" in out, err
    assert "reserve_compute_meta:        CPU compute buffer size" in out
    rc, out, err = _cli(capsys, "fit", "--engine", "llama.cpp", text, "--budget", "1GiB", "--buffer", "0",
                        "--mmproj", mm, "--json")
    f = json.loads(out)
    assert rc == 0 and f["args"][-2:] == ["--mmproj", mm], err
    folder = Path(files["root"])
    rc, out, err = _cli(capsys, "plan", "--engine", "llama.cpp", str(folder), "--hardware", "cuda:0=4GiB,cpu=8GiB",
                        "--buffer", "16MiB", "--json", "-mm", mm)
    doc = json.loads(out)
    assert rc == 0 and [Path(x["file"]).name for x in doc["files"]] == ["text-F16.gguf"], err
    assert all(p["args"][-2:] == ["--mmproj", mm] for p in doc["plans"])
    assert any("projector (--mmproj)" in n for n in doc["notes"])


def test_misuse_is_one_line(files, capsys, tmp_path):
    text, mm = files["text"], files["tiny"]
    (tmp_path / "notes.gguf").write_text("not a projector")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "cut.gguf").write_bytes(Path(mm).read_bytes()[:100])  # stopped inside the header
    for extra, needle in ((["-mm", mm, "--mmproj", mm], "given 2 times"),
                          (["-mm", str(tmp_path / "notes.gguf")], "is not a GGUF file"),
                          (["-mm", str(tmp_path / "empty.gguf")], "is not a GGUF file"),
                          (["-mm", str(tmp_path / "cut.gguf")], "truncated or damaged"),
                          (["-mm", str(tmp_path)], "is a directory"),
                          (["-mm", text], "not a multimodal projector"),
                          (["-mm", str(tmp_path / "absent.gguf")], "no such file"),
                          (["--no-mmproj-offload"], "give it with --mmproj")):
        rc, out, err = _cli(capsys, "estimate", "--engine", "llama.cpp", text, "-c", "512", *extra)
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and not out, err
    rc, _, err = _cli(capsys, "probe", "--engine", "llama.cpp", text, "-mm", mm)
    assert rc == 2 and "--mmproj is priced by" in err, err


def _rewrite(src_path: str, dst, kv: dict, extra: dict | None = None) -> str:
    """A copy of a projector GGUF with some metadata changed (``kv``, str / bool values) and ``extra`` f32
    tensors (name -> numpy array) added."""
    import gguf

    src = gguf.GGUFReader(src_path)
    w = gguf.GGUFWriter(str(dst), "clip")
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in kv:
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        sub_type=field.types[-1] if len(field.types) > 1 else None)
    for key, value in kv.items():
        (w.add_bool if isinstance(value, bool) else w.add_string)(key, value)
    for t in src.tensors:
        w.add_tensor(t.name, t.data, raw_shape=tuple(reversed([int(x) for x in t.shape])), raw_dtype=t.tensor_type)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_a_projector_type_not_replayed_says_so(files, tmp_path):
    """Its model buffer is priced; its compute buffer is None with the reason, and left out of the devices."""
    path = _rewrite(files["tiny"], tmp_path / "mmproj-idefics3.gguf", {"clip.projector_type": "idefics3"})
    e = estimate_llamacpp(files["text"], LlamaArgs(ctx_size=512, n_gpus=1, mmproj=MmprojArgs(path)))
    p = e.mmproj
    assert p.compute_buffer_bytes is None and "'idefics3'" in p.compute_why_none and p.compute_why_none in e.notes
    assert p.model_buffer_bytes == estimate_mmproj(MmprojArgs(files["tiny"]), 1).model_buffer_bytes
    alone = estimate_llamacpp(files["text"], LlamaArgs(ctx_size=512, n_gpus=1)).device_bytes()
    assert e.device_bytes()["CUDA0"] == alone["CUDA0"] + p.model_buffer_bytes["CUDA0"]


def test_an_audio_encoders_tensors_are_its_own_context(files, tmp_path):
    """A file with both encoders: two clip contexts, the a.* / mm.a.* tensors in the audio one's buffer, the
    clamp scalars in neither; the audio graph is not replayed, so the compute is None with its reason."""
    import numpy as np

    audio = {"a.blk.0.attn_q.weight": np.zeros((64, 100), np.float32), "mm.a.fc.weight": np.zeros((3, 5), np.float32),
             "v.blk.0.attn_q.input_max": np.zeros((1,), np.float32)}
    path = _rewrite(files["tiny"], tmp_path / "mmproj-omni.gguf",
                    {"clip.projector_type": "", "clip.vision.projector_type": "gemma3",
                     "clip.audio.projector_type": "qwen2a", "clip.has_audio_encoder": True}, audio)
    p = estimate_mmproj(MmprojArgs(path, offload=False), 1)
    vision, sound = p.modalities
    assert (vision["modality"], vision["projector_type"], sound["modality"], sound["projector_type"]) == \
        ("vision", "gemma3", "audio", "qwen2a")
    assert sound["tensors"] == 2 and sound["model_buffer_bytes"] == 64 * 100 * 4 + 64  # 15 floats padded to 32 B
    assert vision["model_buffer_bytes"] == estimate_mmproj(MmprojArgs(files["tiny"], offload=False), 1) \
        .model_buffer_bytes["CPU"]
    assert p.model_buffer_bytes == {"CPU": vision["model_buffer_bytes"] + sound["model_buffer_bytes"]}
    assert vision["compute_buffer_bytes"] is not None and p.compute_buffer_bytes is None
    assert "audio projector 'qwen2a'" in p.compute_why_none
