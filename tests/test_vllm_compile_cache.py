"""The torch.compile cache's state of a vLLM start: read from its log, priced as it was, and kept out of the
machine's correction (issue 27: a warm probe compared with a cold price would put the compile benchmark into
the learned activation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramcal.estimator.resolve import resolve_model
from vramcal.estimator.vllm.engine import VllmArgs, as_estimate, estimate_vllm
from vramcal.estimator.vllm.logparse import parse_log

ROOT = Path(__file__).parent.parent
PUBLISHED = ROOT / "benchmarks" / "published" / "vllm" / "logs"
GIB = 1024**3

# lines as published vLLM logs print them (search-index excerpts of pasted startup logs), by wording; AVAILABLE and
# LATER_COLD are written in the format of 0.28's gpu_worker.py and backends.py to frame them
WARM_RANGE = ("(Worker_TP0 pid=57) INFO 06-21 07:20:13 [backends.py:292] Directly load the compiled graph(s) for "
              "compile range (1, 8192) from the cache, took 0.717 s")
WARM_SHAPE = ("INFO 08-06 10:17:27 [backends.py:165] Directly load the compiled graph(s) for dynamic shape from the "
              "cache, took 2.517 s")
WARM_AOT = ("(Worker_TP0 pid=79) INFO 07-05 08:55:20 [decorators.py:311] Directly load AOT compilation from path "
            "/cache/huggingface/vllm-cache/torch_compile_cache/torch_aot_compile/348fd1f53f1288e7b7d4f92e3b1446d86243296fd"
            "5981cd7dd3f01f5b1fe1c3f/rank_0_0/model")
COLD_SHAPE = "INFO 10-18 09:53:46 [backends.py:218] Compiling a graph for dynamic shape takes 15.65 s"
AVAILABLE = "(Worker_TP0 pid=79) INFO 07-05 08:55:31 [gpu_worker.py:436] Available KV cache memory: 60.69 GiB"
LATER_COLD = ("(Worker_TP0 pid=79) INFO 07-05 08:56:02 [backends.py:393] Compiling a graph for compile range "
              "(8193, 8193) takes 3.10 s")


def test_the_log_says_whether_the_profiles_compile_found_its_cache():
    cold = parse_log((PUBLISHED / "l40s_qwen3-14b-awq_v0.29.0.log").read_text())
    assert cold.compile_cache == "cold"  # "Compiling a graph for compile range (1, 2048) takes 27.59 s"
    for line in (WARM_RANGE, WARM_SHAPE, WARM_AOT):
        assert parse_log(line + "\n" + AVAILABLE).compile_cache == "warm", line
    assert parse_log(COLD_SHAPE + "\n" + AVAILABLE).compile_cache == "cold"
    # a size compiled after the KV cache is sized (compile_or_warm_up_model) is outside the profile
    assert parse_log("\n".join([WARM_AOT, AVAILABLE, LATER_COLD])).compile_cache == "warm"
    # an artifact that failed to load is compiled again inside the profile: its benchmarks ran
    again = ("WARNING [decorators.py:321] Compiling model again due to a load failure from /x, reason: corrupted\n"
             + "INFO [backends.py:393] Compiling a graph for compile range (1, 8192) takes 30.1 s")
    assert parse_log(WARM_RANGE + "\n" + again + "\n" + AVAILABLE).compile_cache == "cold"
    assert parse_log(AVAILABLE).compile_cache is None  # not printed: not known, never a guess
    # tp 2: each worker profiles its own; the second's compile counts although the first sized its cache already
    tp1 = LATER_COLD.replace("Worker_TP0", "Worker_TP1").replace("(8193, 8193)", "(1, 8192)")
    assert parse_log("\n".join([WARM_AOT, AVAILABLE, tp1])).compile_cache == "cold"
    assert parse_log("\n".join([WARM_AOT, AVAILABLE, tp1.replace("Worker_TP1", "Worker_TP0")])).compile_cache == "warm"
    prefixed = "vllm-1  | " + COLD_SHAPE.replace("INFO", "(EngineCore_DP0 pid=9) INFO", 1)
    assert parse_log(prefixed + "\n" + AVAILABLE).compile_cache == "cold"


def _args(**kw) -> VllmArgs:
    return VllmArgs(**{**dict(gpu_memory_bytes=int(44.39 * GIB), gpu_memory_utilization=0.92, vllm_version="0.29.0",
                              max_model_len=8192), **kw})


def test_the_estimate_says_which_state_it_priced_and_when_the_state_changes_nothing():
    src = resolve_model("qwen2.5-14b")
    cold, warm = estimate_vllm(src, _args()), estimate_vllm(src, _args(compile_cache="warm"))
    assert (cold.compile_cache, warm.compile_cache) == ("cold", "warm")
    assert warm.activation_bytes < cold.activation_bytes and warm.kv_cache_bytes > cold.kv_cache_bytes
    assert "warm start" in warm.methods["activation"] and "priced for a cold compile" in cold.methods["activation"]
    eager = estimate_vllm(src, _args(compile_cache="warm", enforce_eager=True))
    assert eager.compile_cache is None and any("changes nothing" in n and "--enforce-eager" in n for n in eager.notes)
    old = estimate_vllm(src, _args(compile_cache="cold", vllm_version="0.11.0"))
    assert old.compile_cache is None and any("0.12.0" in n for n in old.notes)
    assert not any("changes nothing" in n for n in cold.notes + warm.notes)


def test_at_two_stages_the_method_says_the_benchmark_is_not_on_the_limiting_stage():
    src = resolve_model("llama-3.1-8b")
    # 0.23: Llama still on the V1 runner, whose float32 sampler on the last stage outweighs the benchmark
    e = estimate_vllm(src, _args(pipeline_parallel_size=2, gpu_memory_bytes=int(79.19 * GIB), vllm_version="0.23.0"))
    assert e.compile_cache == "cold" and e.limiting_rank == 1  # the last stage: the sampler's, no benchmark
    assert "not this limiting one" in e.methods["activation"]
    # 0.29: on the V2 runner the last stage's sampler is the logits alone, so the first stage, with the
    # benchmark, limits
    v2 = estimate_vllm(src, _args(pipeline_parallel_size=2, gpu_memory_bytes=int(79.19 * GIB)))
    assert v2.limiting_rank == 0 and "priced for a cold compile" in v2.methods["activation"]
    assert "priced for a cold compile" in estimate_vllm(src, _args()).methods["activation"]


def _result(logged_text: str, estimate):
    from vramcal.probes.vllm_probe import VllmProbeResult

    logged = parse_log(logged_text)
    return VllmProbeResult("ok", "qwen2.5-14b", "0.29.0", [0], {"post_load": {"used_bytes": 1, "peak_bytes": 2}},
                           logged, estimate, last_stage="end", wall_s=1.0)


def test_a_warm_start_is_compared_with_the_warm_price_and_teaches_no_compile_benchmark(tmp_path):
    """A probe priced cold (the default) whose vLLM loaded its compiled graphs: the comparison and the record
    take the warm price, so this machine's activation correction is the profile's own difference, not minus
    the benchmark that did not run."""
    from vramcal.calibrate.runs import begin_engine_run, finish_engine_run
    from vramcal.calibrate.vllm_corrections import learned_terms, runs_of
    from vramcal.cli_vllm import vllm_outcome, vllm_run_context
    from vramcal.probes.vllm_probe import priced_as_started
    from vramcal.records.store import Store

    src = resolve_model("qwen2.5-14b")
    cold = as_estimate(src, estimate_vllm(src, _args()))
    warm_raw = estimate_vllm(src, _args(compile_cache="warm"))
    # vLLM measured the warm profile 50 MiB above the warm price
    log = "\n".join([WARM_AOT, "DEBUG [gpu_worker.py:300] Memory profiling takes 4.1 seconds. Total non KV cache "
                     f"memory: 10.0GiB; torch peak memory increase: {(warm_raw.activation_bytes + 50 * 2**20) / GIB:.4f}"
                     "GiB; non-torch forward increase memory: 0.25GiB; weights memory: 9.3GiB.", AVAILABLE])
    result = priced_as_started(_result(log, cold), lambda state: as_estimate(
        src, estimate_vllm(src, _args(compile_cache=state))))
    assert result.estimate.vllm.compile_cache == "warm" and any("warm start" in n for n in result.notes)
    assert result.comparison()["activation_bytes"][0] == warm_raw.activation_bytes

    db = str(tmp_path / "runs.db")
    run_id = begin_engine_run(db, "cuda:0", vllm_run_context(src, cold, "vramcal probe qwen3-14b --engine vllm"))
    finish_engine_run(db, run_id, vllm_outcome(cold, result))
    with Store(db, create=False, readonly=True) as s:
        rows = s.query("SELECT r.id AS run_id, r.estimate_json, s.result_json FROM runs r JOIN results s "
                       "ON s.run_id = r.id")
    terms, ids, _ = learned_terms(runs_of(rows), "0.29.0", 1, 1)
    assert ids == [run_id]
    assert abs(terms["activation_bytes"] - 50 * 2**20) < 0.0001 * GIB  # not 50 MiB minus the benchmark
    assert json.loads(rows[0]["estimate_json"])["vllm"]["compile_cache"] == "cold"  # the prediction as made


def test_a_start_whose_state_matches_or_is_not_logged_keeps_its_price():
    from vramcal.probes.vllm_probe import priced_as_started

    src = resolve_model("qwen2.5-14b")
    cold = as_estimate(src, estimate_vllm(src, _args()))

    def never(state):
        raise AssertionError("re-priced")

    for text in (COLD_SHAPE + "\n" + AVAILABLE, AVAILABLE):
        r = priced_as_started(_result(text, cold), never)
        assert r.estimate is cold and not r.notes
    eager = as_estimate(src, estimate_vllm(src, _args(enforce_eager=True)))
    assert priced_as_started(_result(WARM_AOT + "\n" + AVAILABLE, eager), never).estimate is eager


def test_a_cold_probe_turns_both_compile_caches_off_in_the_child(monkeypatch):
    """--compile-cache cold on a probe makes the start cold: vLLM's cache and Inductor's (whose kernel timings
    would skip the benchmark although vLLM compiles) are off in the child's environment; otherwise the
    machine's caches are left alone."""
    from vramcal.probes import vllm_probe

    seen = []

    class Run:
        status, error, last_stage, wall_s, sampler_overhead, log_tail, samples, interrupted = (
            "ok", None, "end", 1.0, None, "", [], None)
        log_text = COLD_SHAPE + "\n" + AVAILABLE

        def stages(self, series):
            return {}

    def fake_run_child(module, spec, reader, *, env, interval_ms, timeout_s):
        seen.append(env)
        return Run()

    monkeypatch.setattr(vllm_probe, "run_child", fake_run_child)
    r = vllm_probe.run_vllm_probe("/x", "m", {}, None, gpus=[0], cold_compile=True)
    assert r.logged.compile_cache == "cold"
    assert seen[0]["VLLM_DISABLE_COMPILE_CACHE"] == "1" and seen[0]["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] == "1"
    vllm_probe.run_vllm_probe("/x", "m", {}, None, gpus=[0])
    assert "VLLM_DISABLE_COMPILE_CACHE" not in seen[1] and "TORCHINDUCTOR_FORCE_DISABLE_CACHES" not in seen[1]


@pytest.mark.parametrize("argv", [["--compile-cache", "warm", "--enforce-eager"], ["--compile-cache", "cold",
                                                                                  "--vllm-version", "0.11.0"]])
def test_a_compile_cache_flag_that_changes_nothing_is_said_on_the_command_line(argv, capsys):
    from vramcal.cli import main

    rc = main(["estimate", "qwen2.5-14b", "--engine", "vllm", "--gpu-memory", "44.39GiB", "--max-model-len", "8192",
               "--no-correction", *argv])
    out = capsys.readouterr().out
    assert rc == 0 and "changes nothing" in out


def _fake_vllm(monkeypatch, lines: list[str]):
    """`probe` / `check --engine vllm` through the real command, vLLM's child replaced by a log (no vLLM, no GPU)."""
    from vramcal.probes import vllm_probe

    seen: dict = {}

    class Run:
        status, error, last_stage, wall_s, sampler_overhead, log_tail, samples, interrupted = (
            "ok", None, "end", 1.0, None, "", [], None)
        log_text = "\n".join(lines)

        def stages(self, series):
            return {"post_load": {"used_bytes": 1, "peak_bytes": 2}}

    def fake_run_child(module, spec, reader, *, env, interval_ms, timeout_s):
        seen["env"] = env
        return Run()

    monkeypatch.setattr(vllm_probe, "preflight", lambda n: None)
    monkeypatch.setattr(vllm_probe, "run_child", fake_run_child)
    return seen


def test_check_answers_by_the_price_for_the_state_the_start_found(tmp_path, monkeypatch, capsys):
    """A start that loaded its compiled graphs, on a GPU where only the warm price leaves room for the cache:
    `check` prints the warm comparison, records it, and exits 0 by it (it exited 1 by the cold price it no
    longer showed); the same run priced cold, with its log saying cold, exits 1."""
    from vramcal.cli import main
    from vramcal.records.store import Store

    flags = ["--engine", "vllm", "--synthetic", "--gpu-memory", "33.05GiB", "--gpu-memory-utilization", "0.9",
             "--vllm-version", "0.29.0", "--max-model-len", "1024"]
    src = resolve_model("qwen2.5-14b")
    args = dict(gpu_memory_bytes=int(33.05 * GIB), gpu_memory_utilization=0.9, vllm_version="0.29.0",
                max_model_len=1024)
    assert not estimate_vllm(src, VllmArgs(**args)).fits
    assert estimate_vllm(src, VllmArgs(**args, compile_cache="warm")).fits
    for line, want in ((WARM_RANGE, 0), (COLD_SHAPE, 1)):
        seen = _fake_vllm(monkeypatch, [line, AVAILABLE])
        db = str(tmp_path / f"{want}.db")
        rc = main(["check", "qwen2.5-14b", *flags, "--db", db])
        out = capsys.readouterr().out
        assert rc == want, out
        assert "compile cache" in out and ("warm" in out.split("compile cache")[1].splitlines()[0]) is (want == 0)
        assert "VLLM_DISABLE_COMPILE_CACHE" not in seen["env"]
        with Store(db, create=False, readonly=True) as s:
            result = json.loads(s.query("SELECT result_json FROM results")[0]["result_json"])
        assert result["estimate"]["vllm"]["compile_cache"] == ("warm" if want == 0 else "cold")
    seen = _fake_vllm(monkeypatch, [COLD_SHAPE, AVAILABLE])
    assert main(["probe", "qwen2.5-14b", *flags, "--compile-cache", "cold", "--db", str(tmp_path / "c.db")]) in (0, 1)
    assert seen["env"]["VLLM_DISABLE_COMPILE_CACHE"] == "1"


def test_a_probe_says_when_its_compile_cache_flag_changes_nothing(tmp_path, monkeypatch, capsys):
    from vramcal.cli import main

    _fake_vllm(monkeypatch, [AVAILABLE])
    rc = main(["probe", "qwen2.5-0.5b", "--engine", "vllm", "--synthetic", "--gpu-memory", "24GiB", "--enforce-eager",
               "--compile-cache", "warm", "--db", str(tmp_path / "r.db")])
    out = capsys.readouterr().out
    assert rc == 0 and "changes nothing" in out, out
