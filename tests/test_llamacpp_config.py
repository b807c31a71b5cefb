"""--engine llama.cpp --type: a GGUF's header derived from an HF config (from_config.header_for), checked
against GGUFs llama.cpp's own tools make.

The fixture builds three tiny HF checkpoints with transformers (llama, qwen2, qwen3moe: tests/tiny_hf.py
says which type rule each reaches), converts each with the vendored ``convert_hf_to_gguf.py`` to F16 and
quantizes it with ``llama_cpp.llama_model_quantize`` (Q4_K_M for all three, IQ4_XS for llama and qwen2,
Q8_0 for qwen3moe; IQ4_XS needs no importance matrix). Each produced header is read with the project's
reader and compared with the one derived from the config alone, tensor by tensor: name, ggml type, shape,
bytes, and (for the quantized files) the order and offsets; then both are priced by the same buffers code.

The converter's source is llama-cpp-python's sdist (the wheel does not carry it): ``VRAMCAL_LLAMACPP_SRC``
names a llama.cpp tree, else ``build/llama_cpp_python-VERSION/vendor/llama.cpp`` (``.ci/run`` unpacks it
there); without it, or without llama-cpp-python, those tests skip and say why.
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
from tiny_hf import MORE_JOBS  # noqa: E402

from vramcal.cli import main  # noqa: E402
from vramcal.errors import UserError  # noqa: E402
from vramcal.estimator.llamacpp.buffers import LlamaArgs, estimate_llamacpp, hparams_of  # noqa: E402
from vramcal.estimator.llamacpp.from_config import header_for  # noqa: E402
from vramcal.estimator.llamacpp.gguf_file import read_gguf  # noqa: E402
from vramcal.estimator.resolve import catalog_entry  # noqa: E402
from vramcal.units import MIB  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOBS = ("llama:Q4_K_M,IQ4_XS", "qwen2:Q4_K_M,IQ4_XS", "qwen3moe:Q4_K_M,Q8_0")
if os.environ.get("VRAMCAL_HF2GGUF_ALL") == "1":  # the other modelled architectures too (about 8 s more)
    JOBS += MORE_JOBS
FILES = [(job.split(":")[0], t) for job in JOBS for t in ("F16", *job.split(":")[1].split(","))]


def _converter() -> tuple[Path | None, str]:
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama-cpp-python is not installed (pip install 'vramcal[llamacpp]'; .ci/run builds it)"
    given = os.environ.get("VRAMCAL_LLAMACPP_SRC")
    if given:
        src = Path(given)
    else:
        from importlib.metadata import version

        src = ROOT / "build" / f"llama_cpp_python-{version('llama_cpp_python')}" / "vendor" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").is_file():
        return None, (f"no convert_hf_to_gguf.py in {src}: unpack llama-cpp-python's sdist there (.ci/run does) "
                      "or set VRAMCAL_LLAMACPP_SRC to a llama.cpp tree")
    return src, ""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    src, why = _converter()
    if src is None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("hf2gguf")
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "tiny_hf.py"), str(out), str(src), *JOBS],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _tensors(m):
    return {t.name: (t.type_name, t.shape, t.nbytes) for t in m.tensors}


@pytest.mark.parametrize("arch,ftype", FILES, ids=[f"{a}-{t}" for a, t in FILES])
def test_each_tensor_is_what_llama_cpp_made(made, arch, ftype):
    real = read_gguf(str(made / f"{arch}-{ftype}.gguf"))
    # the config.json the converter read: transformers' save_pretrained writes its defaults into it, as a Hub
    # checkpoint's config.json has them
    pred = header_for(json.loads((made / arch / "config.json").read_text()), ftype, name=arch)
    assert _tensors(pred) == _tensors(real)
    assert pred.tensor_bytes == real.tensor_bytes
    if ftype != "F16":  # llama-quantize's order and 32-byte padding; the converter keeps the checkpoint's order
        start = real.tensors[0].offset
        assert [(t.name, t.offset) for t in pred.tensors] == [(t.name, t.offset - start) for t in real.tensors]
        assert pred.priced_from.file_bytes == real.file_bytes[0] - start
    assert hparams_of(pred) == hparams_of(real)
    cases = [LlamaArgs(ctx_size=1024, n_gpus=0), LlamaArgs(ctx_size=2048, n_gpu_layers=99)]
    if ftype != "F16":
        cases.append(LlamaArgs(ctx_size=1024, n_gpu_layers=3, n_parallel=2))
    for a in cases:
        e, f = estimate_llamacpp(pred, a), estimate_llamacpp(real, a)
        assert (e.model_buffer_bytes, e.kv_buffer_bytes, e.compute_buffer_bytes, e.output_buffer_bytes) == \
            (f.model_buffer_bytes, f.kv_buffer_bytes, f.compute_buffer_bytes, f.output_buffer_bytes), a


def test_the_rules_reached(made):
    """What the tiny configs were chosen for, read from llama.cpp's own files (not from the prediction)."""
    def types(arch, t):
        return {x.name: x.type_name for x in read_gguf(str(made / f"{arch}-{t}.gguf")).tensors}

    q4 = types("llama", "Q4_K_M")  # use_more_bits over 8 layers: 0, 3, 6, 7 get Q6_K on attn_v and ffn_down
    assert [q4[f"blk.{i}.attn_v.weight"] for i in range(8)] == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K",
                                                                 "Q6_K", "Q6_K"]
    assert q4["output.weight"] == "Q6_K" and q4["token_embd.weight"] == "Q4_K" and q4["rope_freqs.weight"] == "F32"
    iq = types("llama", "IQ4_XS")  # n_gqa 4: attn_v Q5_K; the first n/8 ffn_down Q5_K without an imatrix
    assert iq["blk.1.attn_v.weight"] == "Q5_K" and iq["blk.0.ffn_down.weight"] == "Q5_K"
    qw = types("qwen2", "Q4_K_M")  # rows of 320: Q4_K -> Q5_0, Q6_K -> Q8_0; tied token_embd typed as the output
    assert qw["blk.1.attn_q.weight"] == "Q5_0" and qw["blk.3.ffn_down.weight"] == "Q8_0"  # layer 3 of 4: Q6_K
    assert qw["token_embd.weight"] == "Q8_0" and "output.weight" not in qw
    assert types("qwen2", "IQ4_XS")["blk.1.attn_q.weight"] == "IQ4_NL"
    moe = types("qwen3moe", "Q4_K_M")
    assert moe["blk.3.ffn_down_exps.weight"] == "Q6_K" and moe["blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert moe["blk.0.ffn_gate_inp.weight"] == "F32"
    qwen2 = json.loads((made / "qwen2" / "config.json").read_text())
    assert header_for(qwen2, "Q4_K_M").priced_from.fallbacks  # said, not silent


# ------------------------------------------------------------------------------- without llama.cpp

def test_llama_3_1_8b_q4_k_m_as_llama_cpp_logs_it(capsys):
    """Published llama.cpp logs of Llama-3.1-8B-Instruct Q4_K_M with every layer offloaded (e.g. an Ollama
    llama3.1:8b load, llama.cpp's own lines): CPU_Mapped 281.81 MiB, CUDA0 4403.49 MiB, KV 1024.00 MiB at
    n_ctx 8192, "model size = 4.58 GiB". CUDA0 is that plus 32 x 256 bytes here (4403.50 MiB): a copy of
    rope_freqs per layer (TENSOR_DUPLICATED; checked on the CPU against llama.cpp, not yet on a GPU), which the
    logged file may not have had -- an open 0.01 MiB."""
    assert main(["estimate", "--engine", "llama.cpp", "llama-3.1-8b", "--type", "Q4_K_M", "-c", "8192", "-ngl", "99",
                 "--gpu-count", "1", "--json"]) == 0
    lc = json.loads(capsys.readouterr().out)["llama_cpp"]
    assert f"{lc['model_buffer_bytes']['CPU_Mapped'] / MIB:.2f}" == "281.81"
    assert f"{(lc['model_buffer_bytes']['CUDA0'] - 32 * 256) / MIB:.2f}" == "4403.49"
    assert lc["kv_buffer_bytes"] == {"CUDA0": 1024 * MIB}
    assert f"{lc['weights_bytes'] / 1024**3:.2f}" == "4.58"
    assert lc["priced_from"]["type"] == "Q4_K_M" and lc["priced_from"]["model"] == "llama-3.1-8b"


def test_f16_is_the_whole_file_llama_cpp_maps():
    """ollama/ollama#8361: an F16 Llama-3.1-8B GGUF maps as CPU_Mapped 15317.02 MiB."""
    m = header_for(catalog_entry("llama-3.1-8b"), "F16")
    assert f"{m.priced_from.file_bytes / MIB:.2f}" == "15317.02"


def test_the_table_says_where_the_header_came_from(capsys):
    assert main(["fit", "--engine", "llama.cpp", "qwen2.5-7b", "--type", "q8_0", "--budget", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "priced from its config" in out and "llama-quantize Q8_0" in out and "qwen2.5-7b-Q8_0.gguf" in out


@pytest.mark.parametrize("argv,needle", [
    (["llama-3.1-8b", "--type", "Q9_K"], "Q4_K_M, Q5_K_S"),  # the valid ones are listed
    (["deepseek-v3", "--type", "Q4_K_M"], "DeepseekV3ForCausalLM: its conversion to GGUF is not modelled"),
    (["GGUF", "--type", "Q4_K_M"], "is a GGUF file"),
    (["llama-3.1-8b", "--type", "IQ2_XXS"], "without an importance matrix"),
    (["GGUF", "--imatrix"], "--imatrix goes with --type"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, needle):
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(b"GGUF" + bytes(60))
    argv = [str(gguf_path) if a == "GGUF" else a for a in argv]
    assert main(["estimate", "--engine", "llama.cpp", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vramcal: ") and "\n" not in err and needle in err, err


def test_type_belongs_to_llama_cpp_and_probe_refuses_it(capsys):
    assert main(["estimate", "llama-3.1-8b", "--type", "Q4_K_M"]) == 2
    assert "--type belongs to --engine llama.cpp" in capsys.readouterr().err
    assert main(["probe", "--engine", "llama.cpp", "llama-3.1-8b", "--type", "Q4_K_M", "--device", "cpu"]) == 2
    assert "a probe loads the file itself" in capsys.readouterr().err


def test_header_for_is_the_library_entry():
    m = header_for(catalog_entry("gemma-3-4b"), "q4_k_m", name="gemma-3-4b")  # text_config; tied
    assert m.arch == "gemma3" and "output.weight" not in {t.name for t in m.tensors}
    assert m.get(".attention.sliding_window") == 1024 and estimate_llamacpp(m, LlamaArgs(ctx_size=8192)).kv_caches
    with pytest.raises(UserError, match="llama.cpp file type"):
        header_for(catalog_entry("gemma-3-4b"), "Q4_K_X")
