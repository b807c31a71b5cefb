"""Probe costs and reach, measured (docs/performance.md):

    python benchmarks/bench_probe.py [--repeat 3]

1. sampler overhead: the sampler thread's CPU time / wall time, at 5 ms, reading a process's
   resident set (and NVML memory.used when a GPU is present);
2. probe wall time against a bare ``from_pretrained`` + ``generate`` of the same model (CPU);
3. the shortest memory spike the 5 ms sampler catches, against ``nvidia-smi -l 1``-style 1 s polling:
   a child process holds N MiB for D ms at random phases; a spike counts as caught when a sample
   sees at least half of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SPIKE_CHILD = r"""
import sys, time, os
mib, dur_ms, reps, gap_ms = (float(a) for a in sys.argv[1:5])
import random
random.seed(int(sys.argv[5]))
for _ in range(int(reps)):
    time.sleep(gap_ms / 1000 * (0.5 + random.random()))
    b = bytearray(int(mib * 1024 * 1024))   # zero-filled: every page is touched
    t = time.monotonic()
    while time.monotonic() - t < dur_ms / 1000:
        pass
    print(t, time.monotonic(), flush=True)
    del b
"""


def sampler_overhead(seconds: float) -> dict:
    from vramcal.probes import nvml
    from vramcal.probes.sampler import Sampler, nvml_reader, rss_reader

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s = Sampler(rss_reader(sleeper.pid), 0.005).start()
        time.sleep(seconds)
        s.stop()
        out = {"rss_5ms_overhead": s.overhead, "rss_samples_per_s": len(s.samples) / s.wall_seconds}
    finally:
        sleeper.kill()
    ok, why = nvml.available()
    if ok:
        s = Sampler(nvml_reader([0], os.getpid()), 0.005).start()
        time.sleep(seconds)
        s.stop()
        out["nvml_5ms_overhead"] = s.overhead
        out["nvml_samples_per_s"] = len(s.samples) / s.wall_seconds
    else:
        out["nvml_5ms_overhead"] = None
        out["nvml_note"] = f"no NVML here: {why}"
    return out


def spike_catch(mib: float, durations_ms: list[float], reps: int) -> dict:
    from vramcal.probes.sampler import Sampler, rss_reader

    results = {}
    for dur in durations_ms:
        child = subprocess.Popen([sys.executable, "-c", SPIKE_CHILD, str(mib), str(dur), str(reps), "300", "1"],
                                 stdout=subprocess.PIPE, text=True)
        s = Sampler(rss_reader(child.pid), 0.005).start()
        out, _ = child.communicate()
        s.stop()
        spikes = [tuple(map(float, line.split())) for line in out.splitlines()]
        base = min(v.values["rss"] for v in s.samples if v.values.get("rss"))
        half = base + mib * 1024 * 1024 / 2
        fast = sum(any(a <= v.t <= b and (v.values.get("rss") or 0) >= half for v in s.samples) for a, b in spikes)
        # 1 s polling, as `nvidia-smi -l 1`: the same samples, one per second, at every phase offset
        slow_hits = []
        for offset in (i * 0.1 for i in range(10)):
            polled = [v for v in s.samples if int((v.t - s.samples[0].t - offset) / 1.0 * 200) % 200 == 0]
            slow_hits.append(sum(any(a <= v.t <= b and (v.values.get("rss") or 0) >= half for v in polled)
                                 for a, b in spikes))
        results[f"{dur:g}ms"] = {"spikes": len(spikes), "caught_5ms": fast,
                                 "caught_1s_mean": statistics.mean(slow_hits)}
    return results


def probe_vs_bare(repeat: int) -> dict:
    from conftest import save_tiny

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16000, "hidden_size": 512,
           "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
           "dtype": "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        from pathlib import Path

        path = save_tiny("bench", cfg, Path(tmp))
        bare = (f"import torch; from transformers import AutoModelForCausalLM, BitsAndBytesConfig; "
                f"m = AutoModelForCausalLM.from_pretrained({path!r}, device_map='cpu', dtype=torch.bfloat16, "
                f"quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                f"bnb_4bit_compute_dtype=torch.bfloat16)); ids = torch.randint(3, 15000, (1, 496)); "
                f"m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, "
                f"do_sample=False, pad_token_id=0)")
        env = {**os.environ, "VRAMCAL_CACHE": os.path.join(tmp, "cache")}

        def run(cmd):
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode:
                raise SystemExit(r.stderr)
            return time.perf_counter() - t

        probe_cmd = [sys.executable, "-m", "vramcal", "probe", path, "--quant", "nf4", "--ctx", "512",
                     "--device", "cpu", "--json"]
        run(probe_cmd)  # warm the estimate cache and the page cache
        bare_s = statistics.median(run([sys.executable, "-c", bare]) for _ in range(repeat))
        probe_s = statistics.median(run(probe_cmd) for _ in range(repeat))
        r = subprocess.run(probe_cmd, capture_output=True, text=True, env=env)
        child_wall = json.loads(r.stdout)["wall_s"]
    return {"bare_load_generate_s": bare_s, "vramcal_probe_s": probe_s, "probe_child_wall_s": child_wall,
            "ratio_probe_cli_over_bare": probe_s / bare_s, "ratio_child_over_bare": child_wall / bare_s}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    report = {"sampler": sampler_overhead(args.seconds),
              "spikes_256MiB": spike_catch(256, [2, 5, 10, 20, 50, 200], reps=20),
              "wall": probe_vs_bare(args.repeat)}
    print(json.dumps(report, indent=2, default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
