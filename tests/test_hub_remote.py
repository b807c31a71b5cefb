"""A Hub id not on this machine, sized from its config and weight headers over HTTP (docs/hub.md), against
the local stand-in Hub of tests/hub_server.py: never the internet, never a weight file.

Most tests call the command line in this process with huggingface_hub's constants pointed at the server
(the suite runs with HF_HUB_OFFLINE=1; these tests lift it for themselves); one runs ``vramcal`` in a
subprocess with HF_ENDPOINT in its environment, as a user would.
"""

from __future__ import annotations

import json
import shlex
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer

from vramcal.cli import main
from vramcal.errors import UserError
from vramcal.estimator import hub
from vramcal.estimator.checkpoint import checkpoint_tensors, source_tensors
from vramcal.estimator.resolve import resolve_model

# A llama big enough that its headers are a sliver of it: 32000 x 512 embeddings and an untied lm_head in
# bf16 (2 x 31 MiB) plus two small layers, 74 MB in all. huggingface_hub reads the first 100,001 bytes of
# each safetensors file (one range read; a second only for a longer header): 3 shards read 0.3 MB, 0.4 %.
BIG = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
       "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": False,
       "max_position_embeddings": 8192}
TOKEN = "hf_test_secret_token_0123456789"


def _save(root: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **BIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(root / "sharded", max_shard_size="20MB")
    model.save_pretrained(root / "single")
    (root / "single" / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "none", "size": 224}))
    return {"org/sharded": root / "sharded", "org/single": root / "single"}


def _gguf(path: Path, tokens: int, template_bytes: int = 0) -> Path:
    """A real GGUF file (the gguf package's writer): a vocabulary and a chat template long enough that the
    header outgrows the first read (1 MiB), and 10 MB of tensor data after it."""
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_token_list([f"tok{i:07d}" for i in range(tokens)])
    w.add_token_scores([0.0] * tokens)
    if template_bytes:
        w.add_chat_template("{# " + "x" * template_bytes + " #}")
    w.add_tensor("token_embd.weight", np.zeros((2048, 1024), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(1024, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((1024, 1024), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-repos")
    out = _save(root)
    gptq = root / "gptq"  # the same tensors under a pre-quantized config: counted from the headers as stored
    gptq.mkdir()
    os.link(root / "single" / "model.safetensors", gptq / "model.safetensors")
    config = json.loads((root / "single" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (gptq / "config.json").write_text(json.dumps(config))
    out["org/gptq"] = gptq
    nodtype = root / "nodtype"  # a config naming no dtype: the load dtype is the checkpoint's (its first file)
    nodtype.mkdir()
    os.link(root / "single" / "model.safetensors", nodtype / "model.safetensors")
    config = json.loads((root / "single" / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    (nodtype / "config.json").write_text(json.dumps(config))
    out["org/nodtype"] = nodtype
    _gguf(root / "gguf-one" / "model-Q8_0.gguf", 2000, template_bytes=3 * 1024**2)
    out["org/gguf-one"] = root / "gguf-one"
    for quant in ("Q4_K_M", "Q8_0"):
        _gguf(root / "gguf-many" / f"tiny-{quant}.gguf", 100)
    (root / "gguf-many" / "README.md").write_text("two quants")
    out["org/gguf-many"] = root / "gguf-many"
    from tiny_gguf import write_tiny

    (root / "gguf-llama").mkdir()
    for wt in ("F16", "Q8_0"):  # a real llama.cpp model in two quant files (the tensor data is most of each)
        write_tiny(root / "gguf-llama" / f"tiny-{wt}.gguf", weight_type=wt, n_embd=512, n_ff=1536, n_layer=4)
    (root / "gguf-llama" / "mmproj-tiny-F16.gguf").write_bytes(b"GGUF")  # a projector: never read as a model
    out["org/gguf-llama"] = root / "gguf-llama"
    return out


@pytest.fixture(scope="module")
def server(repos):
    with HubServer(repos, token=TOKEN, slow_s=3.0, lifetime_s=1200) as srv:  # ends itself even if pytest hangs
        yield srv


@pytest.fixture
def hubenv(server, monkeypatch, tmp_path):
    """huggingface_hub in this process pointed at the server, online, with a home (token file, cache) of
    its own; vramcal's cache is the test's own (conftest)."""
    from huggingface_hub import constants

    server.reset()
    server.modes.clear()
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return server


def _cache_files(tmp_path: Path) -> list[Path]:
    root = tmp_path / "cache" / "hub"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _weights(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------------- the estimate itself

def test_remote_headers_and_estimate_equal_the_folder_on_disk(hubenv, repos, capsys, tmp_path):
    """The fetched config and tensors are the folder's, the estimate is the folder's figure for figure,
    and only headers crossed the wire (< 1 % of the weights; no GET of a safetensors file without Range)."""
    for repo_id in ("org/single", "org/sharded"):
        hubenv.reset()
        remote = resolve_model(repo_id)
        local = resolve_model(str(repos[repo_id]))
        assert remote.origin == "hub" and remote.revision == hubenv.commit(repo_id)
        assert remote.config == local.config
        assert source_tensors(remote) == checkpoint_tensors(local.weight_files)
        assert sorted(remote.weight_headers) == [Path(f).name for f in local.weight_files]
        assert hubenv.bytes_served < 0.01 * _weights(repos[repo_id]), (hubenv.bytes_served, _weights(repos[repo_id]))
        for method, path, _ in hubenv.requests:
            assert not path.endswith(".safetensors") or method == "GET"
        if repo_id == "org/single":
            assert remote.processor == local.processor and "preprocessor_config.json" in remote.processor

    rc, out_local, _ = _cli(capsys, "estimate", str(repos["org/sharded"]), "--json", "--no-correction", "--fast",
                            "--no-disk-cache")
    assert rc == 0
    hubenv.reset()
    rc, out_remote, _ = _cli(capsys, "estimate", "org/sharded", "--json", "--no-correction", "--fast",
                             "--no-disk-cache")
    assert rc == 0
    assert hubenv.requests == []  # fetched above, kept under its commit: this estimate asked nothing
    a, b = json.loads(out_local), json.loads(out_remote)
    assert b.pop("revision") == hubenv.commit("org/sharded") and a.pop("revision") is None
    assert b.pop("model") == "org/sharded"
    a.pop("model")
    assert a == b
    rc, table, _ = _cli(capsys, "estimate", "org/sharded", "--no-correction", "--fast", "--offline")
    assert rc == 0 and f"revision {hubenv.commit('org/sharded')}" in table.splitlines()[2]


def test_pre_quantized_inventory_from_remote_headers(hubenv, repos):
    """A pre-quantized checkpoint is counted tensor by tensor as stored: from the fetched headers exactly as
    from the files (the estimator takes that path because the headers count as a checkpoint)."""
    from vramcal.estimator.checkpoint import has_checkpoint
    from vramcal.estimator.inventory import _compute
    from vramcal.estimator.quant import resolve_quant

    remote, local = resolve_model("org/gptq"), resolve_model(str(repos["org/gptq"]))
    spec = resolve_quant("auto", local.config)
    assert spec.pre_quantized and has_checkpoint(remote) and not remote.weight_files
    a, b = _compute(local, spec), _compute(remote, spec)
    assert a.to_dict() == b.to_dict()
    assert sum(b.groups.values()) > 60 * 1024**2  # the stored bf16 tensors, not a formula's 4-bit guess


def test_load_dtype_from_remote_headers_when_the_config_names_none(hubenv, repos):
    from vramcal.estimator.quant import resolve_quant

    remote, local = resolve_model("org/nodtype"), resolve_model(str(repos["org/nodtype"]))
    assert resolve_quant("auto", remote).dtype == resolve_quant("auto", local).dtype == "bfloat16"


@pytest.mark.slow  # three estimates in fresh interpreters (~30 s on a busy machine)
def test_cli_with_hf_endpoint_second_run_makes_no_request(server, repos, tmp_path):
    """As a user runs it: HF_ENDPOINT in the environment, progress on stderr naming files and bytes; the
    second estimate makes no request, and so does HF_HUB_OFFLINE=1 afterwards."""
    server.reset()
    server.modes.clear()
    env = {**os.environ, "HF_ENDPOINT": server.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf-home"),
           "VRAMCAL_CACHE": str(tmp_path / "cache"), "VRAMCAL_PROGRESS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_TOKEN", None)
    cmd = [sys.executable, "-m", "vramcal", "estimate", "org/single", "--json", "--no-correction", "--fast"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "fetching config.json (" in first.stderr and "bytes)" in first.stderr
    assert "reading the header of model.safetensors" in first.stderr
    assert len(server.requests) > 0
    server.reset()
    second = subprocess.run(cmd, env={**env, "VRAMCAL_PROGRESS": "0"}, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    offline = subprocess.run(cmd, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert offline.returncode == 0, offline.stderr
    assert server.requests == []
    assert json.loads(first.stdout)["revision"] == json.loads(second.stdout)["revision"] == server.commit("org/single")
    assert json.loads(second.stdout)["stages"] == json.loads(offline.stdout)["stages"] == json.loads(first.stdout)["stages"]


def test_revision_and_refresh(hubenv, capsys):
    commit = hubenv.commit("org/single")
    by_commit = resolve_model("org/single", hub.HubOptions(revision=commit))
    assert by_commit.revision == commit
    hubenv.reset()
    assert resolve_model("org/single", hub.HubOptions(revision=commit)).revision == commit
    assert hubenv.requests == []  # a commit names its document directly
    resolve_model("org/single")  # main -> commit, remembered
    hubenv.reset()
    resolve_model("org/single")
    assert hubenv.requests == []
    resolve_model("org/single", hub.HubOptions(refresh=True))
    assert [p for _, p, _ in hubenv.requests] == ["/api/models/org/single/revision/main?blobs=true"]
    rc, _, err = _cli(capsys, "estimate", "org/single", "--revision", "v9-missing", "--fast")
    assert rc == 2 and err.count("\n") == 1 and "no revision 'v9-missing'" in err and "--revision" in err


def test_local_hf_cache_first_and_its_commit_named(hubenv, tmp_path, capsys):
    """A snapshot `hf download` left is read from disk (its folder name is the commit); a --revision the
    local cache does not hold goes to the Hub instead of taking another snapshot."""
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / "models--org--single"
    commit = "a" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps({**BIG, "model_type": "llama"}))
    local = resolve_model("org/single")
    assert (local.origin, local.revision) == ("hf-cache", commit) and hubenv.requests == []
    remote = resolve_model("org/single", hub.HubOptions(revision=hubenv.commit("org/single")))
    assert remote.origin == "hub" and hubenv.requests
    rc, out, _ = _cli(capsys, "estimate", "org/single", "--fast", "--json", "--no-correction")
    assert rc == 0 and json.loads(out)["revision"] == commit


def test_vllm_engine_sizes_a_remote_model_too(hubenv, capsys):
    rc, out, _ = _cli(capsys, "estimate", "org/single", "--engine", "vllm", "--gpu-memory", "80GiB", "--no-correction",
                      "--json")
    assert rc == 0 and json.loads(out)["revision"] == hubenv.commit("org/single")
    rc, table, _ = _cli(capsys, "estimate", "org/single", "--engine", "vllm", "--gpu-memory", "80GiB",
                        "--no-correction", "--offline")
    assert rc == 0 and f"revision {hubenv.commit('org/single')}" in table


# --------------------------------------------------------------------------------- failures: one line, exit 2

@pytest.mark.parametrize("mode, words", [
    ("gated401", "is gated: accept its licence at"),
    ("gated403", "is gated: accept its licence at"),
    ("private", "log in with an account that can read it"),
    ("ratelimit", "rate limited (HTTP 429)"),
    ("truncate", "cut short"),
    ("truncate-weights", "cut short"),
])
def test_failures_are_one_line_exit_2_and_cache_nothing(hubenv, capsys, tmp_path, monkeypatch, mode, words):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_" + TOKEN)
    hubenv.modes["org/single"] = mode
    rc, out, err = _cli(capsys, "estimate", "org/single", "--fast")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vramcal: ") and words in err, err
    assert TOKEN not in err
    assert _cache_files(tmp_path) == []
    if mode.startswith("gated"):
        assert f"{hubenv.endpoint}/org/single" in err and "hf auth login" in err
    if mode == "truncate":  # the cut came in a file's body, after the listing
        assert any("/resolve/" in p for _, p, _ in hubenv.requests)
    if mode == "truncate-weights":  # config.json arrived whole, the header read did not: still nothing kept
        assert any(p.endswith("model.safetensors") for _, p, _ in hubenv.requests)


def test_missing_repo_and_missing_revision(hubenv, capsys, tmp_path):
    rc, _, err = _cli(capsys, "estimate", "org/nothing-here", "--fast")
    assert rc == 2 and err.count("\n") == 1 and "org/nothing-here was not found on" in err and "spelling" in err
    assert _cache_files(tmp_path) == []


def test_private_repo_with_the_users_token(hubenv, monkeypatch, tmp_path):
    """The token is huggingface_hub's own (HF_TOKEN here; `hf auth login`'s file alike), sent to the Hub."""
    hubenv.modes["org/single"] = "private"
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    source = resolve_model("org/single")
    assert source.revision == hubenv.commit("org/single")
    assert set(hubenv.auth_seen) == {f"Bearer {TOKEN}"}
    assert TOKEN not in json.dumps([str(p.read_bytes()[:10_000]) for p in _cache_files(tmp_path)])


def test_timeout_is_one_line(server, tmp_path):
    """A Hub that does not answer: huggingface_hub's own timeouts (HF_HUB_ETAG_TIMEOUT /
    HF_HUB_DOWNLOAD_TIMEOUT, 1 s here), then one line, exit 2, nothing kept."""
    server.modes.clear()
    server.modes["org/single"] = "slow"
    env = {**os.environ, "HF_ENDPOINT": server.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf-home"),
           "VRAMCAL_CACHE": str(tmp_path / "cache"), "HF_HUB_ETAG_TIMEOUT": "1", "HF_HUB_DOWNLOAD_TIMEOUT": "1"}
    try:
        r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", "org/single", "--fast"], env=env,
                           capture_output=True, text=True, timeout=60)
    finally:
        server.modes.clear()
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "did not answer within 1 s" in r.stderr, r.stderr
    assert _cache_files(tmp_path) == []


def test_offline_refuses_in_one_line(hubenv, capsys, tmp_path):
    rc, _, err = _cli(capsys, "estimate", "org/single", "--offline", "--fast")
    assert rc == 2 and err.count("\n") == 1
    assert "not in the local Hugging Face cache" in err and "--offline or HF_HUB_OFFLINE=1" in err
    assert "hf download org/single" in err and "huggingface-cli" not in err
    assert hubenv.requests == [] and _cache_files(tmp_path) == []


@pytest.mark.parametrize("spec", ["орг/модель", "org/na me", "org/--x", "org/" + "x" * 120])
def test_invalid_hub_id_is_one_line_exit_2(hubenv, capsys, spec):
    """Issue 25's "a Unicode Hub id ends in exit 70": refused before any lookup."""
    rc, _, err = _cli(capsys, "estimate", spec, "--fast")
    assert rc == 2 and err.count("\n") == 1 and "not a Hub id" in err, err
    assert hubenv.requests == []


def test_damaged_cache_is_fetched_again(hubenv, tmp_path):
    resolve_model("org/single")
    doc = next(p for p in _cache_files(tmp_path) if p.suffix == ".json")
    doc.write_text(doc.read_text().replace('"bfloat16"', '"float32"', 1))  # altered: checksum mismatch
    hubenv.reset()
    again = resolve_model("org/single")
    assert hubenv.requests  # not trusted, fetched again
    assert {d for d, _ in source_tensors(again).values()} == {"bfloat16"}


def test_probe_of_a_remote_model_says_how_to_download(hubenv, capsys):
    rc, _, err = _cli(capsys, "probe", "org/single", "--device", "cpu")
    assert rc == 2 and err.count("\n") == 1
    assert "hf download org/single --revision" in err and "--synthetic" in err


# --------------------------------------------------------------------------------- GGUF headers

def test_gguf_header_by_range_reads_is_whole(hubenv, repos, tmp_path):
    """The header of a GGUF outgrowing the first read (a 3 MiB chat template) is read whole and
    only it; the gguf package's reader parses it (the header bytes, then a hole as long as the data)."""
    from gguf import GGUFReader

    original = repos["org/gguf-one"] / "model-Q8_0.gguf"
    got = hub.gguf_header("org/gguf-one")
    data = original.read_bytes()
    assert got.filename == "model-Q8_0.gguf" and got.size_bytes == len(data)
    assert got.commit == hubenv.commit("org/gguf-one")
    header = got.path.read_bytes()
    assert header == data[:got.header_bytes] and got.header_bytes > hub.GGUF_FIRST_READ
    assert hubenv.bytes_served < got.header_bytes + 8 * 1024**2  # the header and the last block read, no more
    assert hubenv.bytes_served < 0.6 * len(data)

    rebuilt = tmp_path / "rebuilt.gguf"
    with open(rebuilt, "wb") as fh:  # the header, then a sparse hole where the tensor data was
        fh.write(header)
        fh.truncate(got.size_bytes)
    a, b = GGUFReader(str(original)), GGUFReader(str(rebuilt))
    assert list(a.fields) == list(b.fields)
    assert [(t.name, t.tensor_type, list(t.shape), int(t.data_offset)) for t in a.tensors] == \
           [(t.name, t.tensor_type, list(t.shape), int(t.data_offset)) for t in b.tensors]
    assert bytes(b.fields["tokenizer.ggml.tokens"].parts[-1]) == b"tok0001999"
    assert len(bytes(b.fields["tokenizer.chat_template"].parts[-1])) == 3 * 1024**2 + 6

    hubenv.reset()
    assert hub.gguf_header("org/gguf-one", "model-Q8_0.gguf").path == got.path
    assert hubenv.requests == []  # cached under its commit


def test_gguf_file_picks_one_of_several(hubenv, capsys):
    with pytest.raises(UserError, match=r"2 GGUF files \(tiny-Q4_K_M.gguf, tiny-Q8_0.gguf\): pick one with --file"):
        hub.gguf_header("org/gguf-many")
    one = hub.gguf_header("org/gguf-many", "tiny-Q4_K_M.gguf")
    assert one.filename == "tiny-Q4_K_M.gguf" and one.header_bytes < hub.GGUF_FIRST_READ
    with pytest.raises(UserError, match="no file 'tiny-Q2.gguf'.*tiny-Q4_K_M.gguf, tiny-Q8_0.gguf"):
        hub.gguf_header("org/gguf-many", "tiny-Q2.gguf")
    rc, _, err = _cli(capsys, "estimate", "org/gguf-many", "--fast")
    assert rc == 2 and "has no config.json" in err and "GGUF files" in err


def test_gguf_header_length_stops_only_at_the_end(repos):
    data = (repos["org/gguf-many"] / "tiny-Q8_0.gguf").read_bytes()
    end = hub.gguf_header_length(data)
    assert end is not None and 24 < end < len(data)
    for cut in (0, 23, 24, 40, end // 2, end - 1):
        assert hub.gguf_header_length(data[:cut]) is None
    assert hub.gguf_header_length(data[:end]) == end
    with pytest.raises(UserError, match="not a GGUF file"):
        hub.gguf_header_length(b"PK\x03\x04" + bytes(40))


def test_llamacpp_estimate_of_a_hub_gguf_reads_its_header_only(hubenv, repos, capsys):
    """`estimate --engine llama.cpp owner/repo --file X.gguf`: the header by range reads, every buffer as the
    same file on disk gives, the commit named, a small share of the file served; a second run asks nothing."""
    local = repos["org/gguf-llama"] / "tiny-Q8_0.gguf"
    rc, out, err = _cli(capsys, "estimate", "--engine", "llama.cpp", str(local), "-c", "4096", "-ngl", "99",
                        "--gpu-count", "1", "--json")
    assert rc == 0, err
    want = json.loads(out)["llama_cpp"]
    hubenv.reset()
    rc, out, err = _cli(capsys, "estimate", "--engine", "llama.cpp", "org/gguf-llama", "--file", "tiny-Q8_0.gguf",
                        "-c", "4096", "-ngl", "99", "--gpu-count", "1", "--json")
    assert rc == 0, err
    got = json.loads(out)["llama_cpp"]
    for key in ("model_buffer_bytes", "kv_buffer_bytes", "compute_buffer_bytes", "output_buffer_bytes", "n_ctx"):
        assert got[key] == want[key], key
    assert got["revision"] == f"org/gguf-llama@{hubenv.commit('org/gguf-llama')}"
    assert hubenv.bytes_served < 0.2 * local.stat().st_size
    hubenv.reset()
    assert _cli(capsys, "estimate", "--engine", "llama.cpp", "org/gguf-llama/tiny-Q8_0.gguf", "-c", "4096",
                "--gpu-count", "1", "--json")[0] == 0
    assert hubenv.bytes_served == 0  # cached under the commit
    rc, out, err = _cli(capsys, "estimate", "--engine", "llama.cpp", "org/gguf-llama", "-c", "4096")
    assert rc == 2 and "--file" in err and len(err.strip().splitlines()) == 1
    rc, out, err = _cli(capsys, "estimate", "org/gguf-llama", "--file", "tiny-Q8_0.gguf")
    assert rc == 2 and "--engine llama.cpp" in err


def test_llamacpp_plan_of_a_hub_repository_searches_each_quantization(hubenv, repos, capsys):
    """`plan --engine llama.cpp owner/repo` for a repository not on this machine: its GGUF files listed by the
    Hub, the projector left out, each quantization's header read by range reads (a small share of the files
    served), and every plan priced as the same file on disk is."""
    folder = repos["org/gguf-llama"]
    hw = ["--hardware", "cuda:0=24GiB,cpu=64GiB", "--json"]
    rc, out, err = _cli(capsys, "plan", "--engine", "llama.cpp", str(folder), *hw)
    assert rc == 0, err
    local = json.loads(out)
    hubenv.reset()
    rc, out, err = _cli(capsys, "plan", "--engine", "llama.cpp", "org/gguf-llama", *hw)
    assert rc == 0, err
    remote = json.loads(out)
    assert [f["file"] for f in remote["files"]] == ["org/gguf-llama/tiny-F16.gguf", "org/gguf-llama/tiny-Q8_0.gguf"]
    assert hubenv.bytes_served < 0.2 * sum(p.stat().st_size for p in folder.glob("tiny-*.gguf"))
    assert len(remote["plans"]) == len(local["plans"]) == 6  # two files x three KV types
    for r, loc in zip(remote["plans"], local["plans"]):
        assert r["file"] == "org/gguf-llama/" + Path(loc["file"]).name
        assert (r["gpu_bytes"], r["host_bytes"], r["ctx_size"], r["n_gpu_layers"]) == \
            (loc["gpu_bytes"], loc["host_bytes"], loc["ctx_size"], loc["n_gpu_layers"])
        # llama-server downloads it itself; vramcal's own check reads the header it cached
        assert r["args"][:4] == ["-hf", "org/gguf-llama", "--hf-file", Path(loc["file"]).name]
        assert r["args"][4:] == loc["args"][2:]
        assert r["estimate_command"].split()[4] == r["file"]
    hubenv.reset()
    again = shlex.split(remote["plans"][0]["estimate_command"])[4:]
    rc, out, err = _cli(capsys, "estimate", "--engine", "llama.cpp", *again, "--json")
    assert rc == 0 and hubenv.bytes_served == 0, err  # the plan's own check asks the Hub for nothing more
