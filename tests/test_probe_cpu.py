"""End-to-end probes on the CPU: a real from_pretrained with real bitsandbytes 4-bit, a real generate,
the resident set sampled from outside the child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import save_tiny

from vramcal.errors import UserError
from vramcal.probes import child
from vramcal.probes.child import requested_bytes
from vramcal.probes.probe import run_probe

MID = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16000, "hidden_size": 512,
       "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
       "tie_word_embeddings": False, "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    return save_tiny("mid", MID, tmp_path_factory.mktemp("mid"))


def test_probe_nf4_end_to_end(mid_model):
    r = run_probe(mid_model, "nf4", ctx=128, batch=2, device="cpu")
    assert r.status == "ok", r.error
    assert list(r.stages) == ["baseline", "load_peak", "post_load", "first_token", "end"]
    times = [st.t for st in r.stages.values()]
    assert times == sorted(times)
    assert r.sample_count > 20 and all(st.used_bytes for st in r.stages.values())
    weights = r.estimate.components["weights"]
    assert r.measured()["post_load"].used_bytes >= weights  # the quantized weights really arrived
    assert r.stages["end"].generated == 16
    # the child counts what it really holds: the estimate's weights and KV cache, to the byte
    assert r.stages["load_peak"].weights_bytes == weights
    assert r.stages["end"].kv_bytes == r.estimate.components["kv_cache"]
    assert r.stages["load_peak"].peak_bytes >= r.stages["load_peak"].used_bytes
    assert r.estimate.quant == "nf4" and r.quant_implementation.startswith("bitsandbytes 4-bit")
    assert r.sampler_overhead is not None and r.exit_code == 0


def test_probe_cli_json_and_timeline(mid_model, tmp_path):
    png = tmp_path / "t.png"
    out = subprocess.run([sys.executable, "-m", "vramcal", "probe", mid_model, "--quant", "nf4", "--ctx", "64",
                          "--device", "cpu", "--json", "--timeline", str(png)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["status"] == "ok" and "samples" not in d and d["sample_count"] > 0
    assert d["command"].startswith("vramcal probe ") and "--timeline" in d["command"]
    assert set(d["estimate"]["stages"]) == {"load_peak", "post_load", "first_token", "end"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synthetic_weights_from_config_alone(tmp_path):
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MID))
    with pytest.raises(UserError, match="--synthetic"):
        run_probe(str(d), "nf4", ctx=64, device="cpu")
    r = run_probe(str(d), "nf4-dq", ctx=64, device="cpu", synthetic=True)
    assert r.status == "ok", r.error
    assert r.measured()["post_load"].used_bytes >= r.estimate.components["weights"]


def test_sigkill_mid_generation_leaves_a_crashed_result(mid_model):
    def kill_at_first_token(event, pid):
        if event.get("event") == "stage" and event.get("name") == "first_token":
            os.kill(pid, signal.SIGKILL)

    r = run_probe(mid_model, "auto", ctx=1024, batch=4, device="cpu", on_event=kill_at_first_token)
    assert r.status == "crashed"
    assert r.last_stage == "first_token"
    assert "SIGKILL" in r.error
    assert r.sample_count > 0 and "end" not in r.stages
    assert r.stages["first_token"].used_bytes > r.stages["baseline"].used_bytes
    assert r.unfinished.stage == "end" and r.unfinished.samples >= 1


def test_a_child_that_fails_reports_error_and_stage(tmp_path, mid_model):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(mid_model, "config.json")).read())
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    r = run_probe(str(broken), "auto", ctx=64, device="cpu", with_estimate=False)
    assert r.status in ("error", "crashed")
    assert r.last_stage == "baseline" and r.error


def test_an_unexpected_preimport_failure_is_an_error_at_baseline(mid_model, monkeypatch):
    """Only an unknown architecture is let through by the pre-import; anything else is reported."""
    import transformers.models.auto.auto_factory as auto_factory

    def broken(config, mapping):
        raise RuntimeError("the model's module is broken")

    monkeypatch.setattr(auto_factory, "_get_model_class", broken)
    read_fd, write_fd = os.pipe()
    emit = child.Emitter(write_fd)
    spec = {"model_dir": mid_model, "device": "cpu", "dtype": "bfloat16", "ctx": 32, "batch": 1, "bnb": None,
            "attn": "auto", "new_tokens": 4}
    assert child.run(spec, emit) == 4
    emit.out.close()
    with os.fdopen(read_fd) as fh:
        events = [json.loads(line) for line in fh]
    assert [e["event"] for e in events] == ["error"]
    assert events[0]["stage"] == "baseline" and "module is broken" in events[0]["message"]


def test_oom_message_parsing():
    msg = ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
           "1.02 GiB is free.")
    assert requested_bytes(msg) == int(1.5 * 1024**3)
    assert requested_bytes("something else") is None


@pytest.mark.parametrize("args,needle", [
    (["--device", "cuda"], "--device cpu"),
    (["--device", "tpu"], "unknown device"),
    (["--quant", "q2"], "unknown quant"),
    (["--ctx", "8"], "--ctx"),
    (["--interval-ms", "0"], "--interval-ms"),
    (["--timeline", "out.svg", "--device", "cpu"], ".png"),
])
def test_probe_bad_input(mid_model, args, needle):
    r = subprocess.run([sys.executable, "-m", "vramcal", "probe", mid_model] + args, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr and "Traceback" not in r.stderr


def test_probe_missing_model():
    r = subprocess.run([sys.executable, "-m", "vramcal", "probe", "/no/such/model", "--device", "cpu"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not found" in r.stderr
