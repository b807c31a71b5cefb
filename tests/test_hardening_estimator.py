"""The estimator never answers silently wrong: damaged caches are recomputed, failed dry runs retried,
components never negative, limits warned; random inputs give an answer or one line and exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramcal.cli import main
from vramcal.estimator.estimate import Estimator, estimate
from vramcal.paths import cache_dir
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model


def _cache_files(kind: str):
    return sorted((cache_dir() / kind).glob("*.json"))


def test_garbled_cache_file_is_recomputed_with_a_note(tiny_models):
    first = estimate(tiny_models["dense-gqa"], "nf4", ctx=128, device="cpu")
    [inv_file] = _cache_files("inventory")
    inv_file.write_bytes(b"\x00garbage{")
    again = estimate(tiny_models["dense-gqa"], "nf4", ctx=128, device="cpu")
    assert again.components == first.components and again.stages == first.stages
    assert any("damaged or altered" in n for n in again.notes), again.notes
    # the recomputed entry replaced the garbled one: the next estimate reads it without a note
    third = estimate(tiny_models["dense-gqa"], "nf4", ctx=128, device="cpu")
    assert not any("damaged" in n for n in third.notes)


def test_altered_numbers_in_the_cache_are_not_served(tiny_models):
    first = estimate(tiny_models["dense-gqa"], "nf4", ctx=128, device="cpu")
    [inv_file] = _cache_files("inventory")
    doc = json.loads(inv_file.read_text())
    doc["payload"]["tensor_bytes"] *= 10  # a number changed by hand or by a bad disk; checksum left as it was
    inv_file.write_text(json.dumps(doc))
    for act_file in _cache_files("activations"):
        d = json.loads(act_file.read_text())
        d["payload"]["kv"][0]["bytes_per_token"] += 1
        act_file.write_text(json.dumps(d))
    again = estimate(tiny_models["dense-gqa"], "nf4", ctx=128, device="cpu")
    assert again.components["weights"] == first.components["weights"]
    assert again.components["kv_cache"] == first.components["kv_cache"]
    assert sum("damaged or altered" in n for n in again.notes) == 2, again.notes


def test_failed_dry_run_is_retried_not_cached(tiny_models, monkeypatch):
    from vramcal.estimator import dryrun

    source = resolve_model(tiny_models["dense-gqa"])
    spec = resolve_quant("auto", source.config)
    real = dryrun.DryRunner.trace

    def broken(self, batch, seq):
        raise RuntimeError("meta kernel missing")

    monkeypatch.setattr(dryrun.DryRunner, "trace", broken)
    e = Estimator(source, spec, device="cpu").estimate(128)
    assert e.approximate and any("dry run failed" in n for n in e.notes)
    monkeypatch.setattr(dryrun.DryRunner, "trace", real)
    fixed = Estimator(source, spec, device="cpu").estimate(128)  # a new process would do the same
    assert not fixed.approximate and fixed.methods["activations"].startswith("dry run")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("quant", ["bf16", "nf4", "int8"])
def test_components_are_never_negative_and_the_breakdown_sums(tiny_models, device, quant):
    for arch in ("dense-gqa", "sliding"):
        e = estimate(tiny_models[arch], quant, ctx=256, batch=2, device=device)
        assert all(v >= 0 for v in e.components.values()), e.components
        assert all(v >= 0 for v in e.peak_breakdown.values()), e.peak_breakdown
        assert sum(e.peak_breakdown.values()) == e.peak == e.stages[e.peak_stage]


def test_beyond_max_position_embeddings_is_warned_in_table_and_json(capsys):
    # llama-3.2-1b: 131072 positions; the catalog entry builds on meta in seconds
    rc = main(["estimate", "llama-3.2-1b", "--ctx", "200000", "--fast", "--json", "--device", "cpu"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and any("max_position_embeddings" in w for w in out["warnings"])
    rc = main(["estimate", "llama-3.2-1b", "--ctx", "200000", "--fast", "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 0 and "WARNING" in text and "max_position_embeddings" in text


def test_more_than_any_gpu_is_warned():
    e = estimate("llama-3.2-1b", "bf16", ctx=32768, batch=1024, exact=False)
    assert any("more than any single GPU" in w for w in e.warnings)


# ------------------------------------------------------------------------- random inputs, property-based

def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _sane_or_one_line(rc: int, out: str, err: str) -> None:
    assert "Traceback" not in err
    if rc == 0:
        d = json.loads(out)
        assert d["peak"] is None or d["peak"] > 0
        assert all(v is None or (isinstance(v, int) and v >= 0) for v in d["components"].values()), d
    else:
        assert rc == 2, (rc, err)
        assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("vramcal: "), err


numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**12, 10**12),
                    st.sampled_from(["7", "-1", "0", "nan", "inf", "1e400", "x", ""]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=numbers, bits=numbers, ctx=numbers, batch=numbers, layers=numbers, kv_bytes=numbers)
def test_quick_mode_numbers(params, bits, ctx, batch, layers, kv_bytes):
    argv = ["estimate", "--params-b", str(params), "--bits", str(bits), "--ctx", str(ctx), "--batch", str(batch),
            "--layers", str(layers), "--kv-heads", "8", "--head-dim", "128", "--kv-bytes", str(kv_bytes), "--json"]
    _sane_or_one_line(*_run(argv))


field_values = st.one_of(st.integers(-5, 300), st.sampled_from([None, "64", 1.5, True, 10**9, math.nan, [], {}]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hidden=field_values, layers=field_values, heads=field_values, kv=field_values, vocab=field_values,
       inter=field_values, ctx=st.integers(-3, 5000), batch=st.integers(-1, 5))
def test_random_config_values(tmp_path_factory, hidden, layers, heads, kv, vocab, inter, ctx, batch):
    d = tmp_path_factory.mktemp("cfg")
    cfg = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "intermediate_size": inter, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    # small sizes only get past validation quickly; --fast keeps each answer to a few traces
    rc, out, err = _run(["estimate", str(d), "--ctx", str(ctx), "--batch", str(batch), "--device", "cpu",
                         "--fast", "--json", "--no-correction"])
    _sane_or_one_line(rc, out, err)


def test_a_cache_forged_with_negative_numbers_is_not_served(tiny_models):
    """A checksum only catches accidents; figures no model can have are refused as well."""
    from vramcal.estimator.cache import _digest

    first = estimate(tiny_models["dense-gqa"], "nf4", ctx=128, device="cpu")
    [inv_file] = _cache_files("inventory")
    doc = json.loads(inv_file.read_text())
    doc["payload"]["groups"] = {k: -v for k, v in doc["payload"]["groups"].items()}
    doc["sha256"] = _digest(doc["payload"])
    inv_file.write_text(json.dumps(doc))
    again = estimate(tiny_models["dense-gqa"], "nf4", ctx=128, device="cpu")
    assert again.components == first.components
    assert any("impossible figures" in n for n in again.notes), again.notes
