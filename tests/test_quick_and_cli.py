"""Quick mode reproduces the source documents' worked numbers; bad input gets one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vramcal.estimator.quick import quick_estimate
from vramcal.units import GIB

VRAMCAL = [sys.executable, "-m", "vramcal"]


def run(*args, env=None):
    return subprocess.run(VRAMCAL + list(args), capture_output=True, text=True, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("bits,gib", [(16, 50.29), (8, 25.15), (4, 12.57)])
def test_documents_weights(bits, gib):
    q = quick_estimate(27, bits, ctx=8192)
    assert round(q.weights_bytes / GIB, 2) == gib


def test_documents_kv():
    q = quick_estimate(27, 4, ctx=8192, layers=60, kv_heads=8, head_dim=128)
    assert q.kv_bytes_per_token == 245_760
    assert q.kv_cache_bytes == 1.875 * GIB
    assert quick_estimate(27, 4, ctx=32768, layers=60, kv_heads=8, head_dim=128).kv_cache_bytes == 7.5 * GIB
    # the documents' own estimate_vram(27, 4, 60, 8, 128, 32768) evaluated by hand: (13.5e9 + 7.5 GiB) x 1.18
    wide = quick_estimate(27, 4, ctx=32768, layers=60, kv_heads=8, head_dim=128)
    assert wide.total_bytes == 25_432_615_142


def test_quick_cli_json():
    r = run("estimate", "--params-b", "27", "--bits", "4", "--layers", "60", "--kv-heads", "8", "--head-dim", "128",
            "--ctx", "32768", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    q = out["formula"]
    assert q["kv_cache_bytes"] == 7.5 * GIB and q["weights_bytes"] == 13_500_000_000
    # the same shape as a full estimate: the same component keys, a peak, None where the formula is silent
    assert set(out["components"]) == {"weights", "kv_cache", "activations", "runtime"}
    assert out["components"]["activations"] is None and out["mode"] == "quick"
    assert out["components"]["kv_cache"] == 7.5 * GIB
    assert out["peak"] == 25_432_615_142  # the documents' planning total for this model (see above)


BAD = [
    (["estimate", "/nonexistent/dir"], "not found"),
    (["estimate", "llama-3.1-8b", "--ctx", "0"], "--ctx"),
    (["estimate", "llama-3.1-8b", "--ctx", "-5"], "--ctx"),
    (["estimate", "llama-3.1-8b", "--batch", "0"], "--batch"),
    (["estimate", "llama-3.1-8b", "--quant", "q3_k_m"], "unknown quant"),
    (["estimate", "--params-b", "27", "--bits", "0"], "--bits"),
    (["estimate", "--params-b", "-1", "--bits", "4"], "--params-b"),
    (["estimate", "nobody/not-cached-model"], "not in the local Hugging Face cache"),
    (["estimate", "llama-3.1-8b", "--ctx", "many"], "invalid int"),
    (["estimate"], "give a MODEL"),
    (["estimate", "llama-3.1-8b", "--attn", "magic"], "--attn"),
    (["estimate", "llama-3.1-8b", "--kv-dtype", "int3"], "--kv-dtype"),
    (["estimate", "--params-b", "nan", "--bits", "4"], "--params-b"),
    (["estimate", "--params-b", "inf", "--bits", "4"], "--params-b"),
    (["estimate", "--params-b", "7", "--bits", "4", "--kv-bytes", "-2", "--layers", "2", "--kv-heads", "2",
      "--head-dim", "64"], "--kv-bytes"),
    (["estimate", "--params-b", "7", "--bits", "4", "--layers", "2"], "--head-dim"),
    (["estimate", "llama-3.1-8b", "--ctx", "100", "--prompt", "80"], "not both"),
    (["estimate", "llama-3.1-8b", "--new-tokens", "0"], "--new-tokens"),
    (["estimate", "llama-3.1-8b", "--ctx", "10", "--new-tokens", "16"], "leaves no prompt"),
    (["estimate", "llama-3.1-8b", "--ctx", "99999999999"], "beyond"),
    (["estimate", "llama-3.1-8b", "--batch", "9999999"], "beyond"),
    (["estimate", "llama-3.1-8b", "--device", "tpu"], "unknown device"),
    (["estimate", "llama-3.1-8b", "--dtype", "int4"], "--dtype"),
    (["probe", "llama-3.1-8b", "--device", "cuda:x"], "unknown device"),
    (["fit", "llama-3.1-8b", "--budget", "1GiB", "--buffer", "2GiB", "--device", "cpu"], "--buffer"),
    (["records", "list", "--out", "x.csv"], "records export"),
    # images (docs/vision.md)
    (["estimate", "llama-3.1-8b", "--images", "1"], "text-only model"),
    (["estimate", "gemma-3-4b", "--images", "1", "--image-size", "1024"], "does not parse"),
    (["estimate", "gemma-3-4b", "--images", "1", "--image-size", "0x768"], "width"),
    (["estimate", "gemma-3-4b", "--images", "1", "--image-size", "1024x-768"], "does not parse"),
    (["estimate", "gemma-3-4b", "--images", "-1"], "--images"),
    (["estimate", "gemma-3-4b", "--images", "two"], "invalid int"),
    (["estimate", "gemma-3-4b", "--image-size", "64x64"], "needs --images"),
    (["estimate", "--params-b", "7", "--bits", "4", "--images", "1"], "--images"),
    (["probe", "llama-3.1-8b", "--images", "1", "--device", "cpu", "--synthetic"], "text-only model"),
    (["fit", "llama-3.1-8b", "--budget", "24GiB", "--images", "2", "--device", "cpu"], "text-only model"),
    (["fit", "gemma-3-4b", "--budget", "24GiB", "--images", "1", "--image-size", "axb", "--device", "cpu"],
     "does not parse"),
]


@pytest.mark.parametrize("args,needle", BAD)
def test_bad_input_one_line_exit_2(tmp_path, args, needle):
    r = run(*args, env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vramcal: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("change,needle", [
    ({"hidden_size": -64}, "hidden_size = -64 is impossible"),
    ({"hidden_size": "64"}, "hidden_size must be a whole number"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers must be a whole number"),
    ({"vocab_size": True}, "vocab_size must be a whole number"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"hidden_size": 65}, "not divisible"),
])
def test_configs_with_impossible_sizes_are_refused(tmp_path, change, needle):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({k: v for k, v in {**CONFIG, **change}.items() if v is not None}))
    r = run("estimate", str(d), "--ctx", "64")
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_config_leaning_on_defaults_is_estimated_unless_transformers_cannot_fill_them(tmp_path):
    """A field left out is the config class's default, as from_pretrained takes it (named in the notes);
    only an architecture the installed transformers does not know, without the size fields, is refused."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    r = run("estimate", str(d), "--ctx", "64", "--json")
    assert r.returncode == 0, r.stderr
    notes = " ".join(json.loads(r.stdout)["notes"])
    assert "hidden_size (transformers' LlamaConfig default 4096 used)" in notes
    assert "vocab_size (transformers' LlamaConfig default 32000 used)" in notes
    (d / "config.json").write_text(json.dumps({"model_type": "not-a-model", "hidden_size": 64}))
    r = run("estimate", str(d))
    assert r.returncode == 2 and "does not give num_hidden_layers, num_attention_heads, vocab_size" in r.stderr, \
        r.stderr
    assert len(r.stderr.splitlines()) == 1
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": NaN}')
    r = run("estimate", str(d))
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "NaN" in r.stderr, r.stderr


def test_missing_optional_fields_take_named_defaults(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "intermediate_size"}))
    r = run("estimate", str(d), "--ctx", "64", "--json")
    assert r.returncode == 0, r.stderr
    notes = " ".join(json.loads(r.stdout)["notes"])
    assert "intermediate_size" in notes and "default" in notes, notes


def test_dtype_spellings_agree_with_quant(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    for spelling in ("fp16", "float16", "half"):  # --quant fp16 was accepted; --dtype fp16 is now too
        r = run("estimate", str(d), "--quant", "nf4", "--dtype", spelling, "--ctx", "64", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["dtype"] == "float16"


def test_output_into_a_closed_pipe_ends_quietly():
    """`vramcal models | head -1`: the reader goes away; no BrokenPipeError traceback."""
    code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); "
            "from vramcal.cli import main; sys.exit(main(['models']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_malformed_and_unknown_configs(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    r = run("estimate", str(bad))
    assert r.returncode == 2 and "not valid JSON" in r.stderr and len(r.stderr.splitlines()) == 1
    (bad / "config.json").write_text(json.dumps({"hidden_size": 8}))
    r = run("estimate", str(bad))
    assert r.returncode == 2 and "no model_type" in r.stderr


def test_unknown_model_type_falls_back_to_labelled_formula(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "not_a_real_arch", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "intermediate_size": 512, "torch_dtype": "bfloat16"}))
    r = run("estimate", str(d), "--ctx", "256", "--json")  # a formula's answer is not given as if exact
    assert r.returncode == 2 and "--allow-approximate" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run("estimate", str(d), "--ctx", "256", "--json", "--allow-approximate")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["approximate"] is True
    assert any("does not know this architecture" in n for n in out["notes"])


def test_debug_shows_traceback():
    r = run("--debug", "estimate", "llama-3.1-8b", "--ctx", "0")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_hub_cache_lookup(tmp_path):
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256, "torch_dtype": "bfloat16"}))
    r = run("estimate", "acme/tiny", "--ctx", "64", "--json", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "acme/tiny"


def test_quick_mode_imports_neither_torch_nor_the_estimator():
    code = ("import sys; from vramcal.cli import main; "
            "rc = main(['estimate', '--params-b', '27', '--bits', '4', '--json']); "
            "print(sorted(m for m in ('torch', 'transformers', 'vramcal.estimator.inventory', "
            "'vramcal.calibrate.check', 'vramcal.calibrate.proposals') if m in sys.modules), file=sys.stderr); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.strip().splitlines()[-1] == "[]", r.stderr


def test_configs_that_name_sizes_their_own_way_are_accepted(tmp_path):
    """GPT-2-style configs say n_embd / n_layer / n_head (transformers maps them with attribute_map)."""
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2,
                                               "vocab_size": 256, "n_positions": 128}))
    r = run("estimate", str(d), "--ctx", "64", "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": -64, "n_layer": 2, "n_head": 2,
                                               "vocab_size": 256}))
    r = run("estimate", str(d), "--ctx", "64")
    assert r.returncode == 2 and "hidden_size = -64 is impossible" in r.stderr, r.stderr


@pytest.mark.parametrize("change,needle", [
    ({"torch_dtype": "float13"}, "is not a dtype"),
    ({"torch_dtype": 7}, "is not a dtype"),
    ({"quantization_config": "nf4"}, "quantization_config must be an object"),
    ({"rope_scaling": "yes"}, "transformers rejects this config"),
])
def test_config_fields_transformers_would_choke_on(tmp_path, change, needle):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**CONFIG, **change}))
    r = run("estimate", str(d), "--ctx", "64", "--device", "cpu")
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_quick_mode_refuses_flags_it_would_ignore():
    r = run("estimate", "--params-b", "8", "--bits", "4", "--kv-dtype", "fp8")
    assert r.returncode == 2 and "--kv-bytes (1 for fp8)" in r.stderr
    r = run("estimate", "--params-b", "8", "--bits", "4", "--device", "cpu")  # a GPU formula, not a resident set
    assert r.returncode == 2 and "--device cpu" in r.stderr and r.stdout == ""


def test_output_to_a_full_disk_is_one_line():
    r = subprocess.run(" ".join(VRAMCAL) + " models > /dev/full", shell=True, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("vramcal: cannot write the output"), r.stderr


def test_unknown_database_url_is_refused_without_its_password(tmp_path):
    r = subprocess.run(VRAMCAL + ["records", "list", "--db", "mysql://u:secret@127.0.0.1/db"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 2 and "secret" not in r.stderr and "postgresql://" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["plan", "llama-3.1-8b", "--engine", "vllm", "--hardware", "cuda:0=24GiB", "--gpu-memory", "0.5"],
    ["estimate", "llama-3.1-8b", "--ct", "4096"],
], ids=["plan --gpu-memory (was --gpu-memory-utilization)", "estimate --ct"])
def test_an_abbreviated_flag_is_not_taken_for_a_longer_one(argv, capsys):
    """argparse takes a unique prefix for the flag it begins: plan has --gpu-memory-utilization and no
    --gpu-memory, so `--gpu-memory 0.5` silently set the utilization. Now every flag is spelled out."""
    from vramcal.cli import main

    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "unrecognized arguments" in err, err
