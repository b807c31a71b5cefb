"""--ollama: a run given in Ollama's spellings, priced as the llama-server flags Ollama launches it with
(vramcal/estimator/llamacpp/ollama.py, read from ollama/ollama v0.33.0-rc2 llm/llama_server.go)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import write_tiny  # noqa: E402

from vramcal.errors import UserError  # noqa: E402
from vramcal.estimator.llamacpp.buffers import LlamaArgs, estimate_llamacpp  # noqa: E402
from vramcal.estimator.llamacpp.ollama import llama_server_flags, parse_settings  # noqa: E402
from vramcal.units import GIB  # noqa: E402


def _flags(text: str, **kw) -> list[str]:
    return list(llama_server_flags(parse_settings([text] if text else []), **kw).argv)


def test_ollamas_defaults_and_options_become_its_llama_server_flags():
    # nothing given: one sequence, num_ctx by the GPUs' memory tier, -fa auto, num_batch 512, no -ngl
    assert _flags("") == ["-c", "4096", "-np", "1", "--flash-attn", "auto", "-b", "512", "-ub", "512"]
    assert _flags("", gpu_total_bytes=24 * GIB)[:2] == ["-c", "32768"]
    assert _flags("", gpu_total_bytes=80 * GIB)[:2] == ["-c", "262144"]
    assert _flags("OLLAMA_CONTEXT_LENGTH=8192", gpu_total_bytes=80 * GIB)[:2] == ["-c", "8192"]
    # -c is num_ctx for every sequence; the KV type goes to K and V; mmap off is --load-mode none
    assert _flags("num_ctx=8192,OLLAMA_NUM_PARALLEL=4,OLLAMA_KV_CACHE_TYPE=Q8_0,OLLAMA_FLASH_ATTENTION=1,"
                  "num_batch=256,num_gpu=20,main_gpu=1,use_mmap=false") == \
        ["-c", "32768", "-np", "4", "--load-mode", "none", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0",
         "--flash-attn", "on", "-b", "256", "-ub", "256", "-ngl", "20", "--split-mode", "none", "--main-gpu", "1"]
    assert "--flash-attn" in _flags("OLLAMA_FLASH_ATTENTION=false") and \
        _flags("OLLAMA_FLASH_ATTENTION=false")[5] == "off"
    assert _flags("OLLAMA_FLASH_ATTENTION=yes")[5] == "on"  # envconfig: a value that does not parse is true
    assert _flags("num_gpu=0")[-2:] == ["-ngl", "0"]
    # clamped to the model's context; one sequence for an embedding model and the serial architectures
    assert _flags("num_ctx=9000", n_ctx_train=4096)[:2] == ["-c", "4096"]
    assert _flags("OLLAMA_NUM_PARALLEL=4", arch="qwen3vl")[:4] == ["-c", "4096", "-np", "1"]
    assert _flags("num_ctx=2048,OLLAMA_NUM_PARALLEL=4,num_batch=4096", embedding=True)[-5:] == \
        ["--embedding", "-b", "2048", "-ub", "2048"]


@pytest.mark.parametrize("text, needle", [("num_parallel=2", "OLLAMA_NUM_PARALLEL"), ("ctx=2", "KEY=VALUE"),
                                          ("num_ctx=lots", "a whole number"), ("num_ctx=0", "1 or more")])
def test_bad_settings_are_one_line(text, needle):
    with pytest.raises(UserError, match=needle):
        _flags(text)


def test_estimate_prices_the_ollama_run_as_its_llama_server_command(tmp_path, capsys):
    from vramcal.cli import main

    model = write_tiny(tmp_path / "m-F16.gguf")
    rc = main(["estimate", "--engine", "llama.cpp", model, "--gpu-count", "1", "--json", "--ollama",
               "num_ctx=1024,OLLAMA_NUM_PARALLEL=2", "--ollama", "OLLAMA_KV_CACHE_TYPE=q8_0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    got = json.loads(out)["llama_cpp"]
    same = estimate_llamacpp(model, LlamaArgs(ctx_size=2048, n_parallel=2, cache_type_k="q8_0", cache_type_v="q8_0",
                                              n_batch=512, n_ubatch=512, n_gpus=1))
    assert got["device_bytes"] == same.device_bytes() and got["n_ctx"] == 2048 and got["n_seq_max"] == 2
    assert any("llama-server -c 2048 -np 2" in n for n in got["notes"])
    rc = main(["estimate", "--engine", "llama.cpp", model, "--ollama", "num_ctx=1024", "-np", "4"])
    _, err = capsys.readouterr()
    assert rc == 2 and "--ollama sets --parallel" in err and len(err.strip().splitlines()) == 1
