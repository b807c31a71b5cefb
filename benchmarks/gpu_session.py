"""Everything a lent GPU should measure, in one command that fits 8 minutes of device time.

On the device machine (its image has no bitsandbytes and an older transformers: carry bitsandbytes 0.50.2,
transformers 5.24.0 and gguf as wheels, 57 MB together, as docs/validation/gpu-h200/2026-12-04.md did; not
huggingface_hub 2.x, which needs httpx2 that the image lacks -- the image's 1.33 serves transformers 5.24):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    timeout 480 python3 benchmarks/gpu_session.py --device cuda:0 --out /tmp/o --budget-s 420

``--parts`` runs some of them, sharing the whole budget in their proportions.

then copy /tmp/o to $OUT as one archive (at most 8 files come back). Seven parts, run in the order of
:data:`SHARES` (what the sessions so far left open first), each with its own share of the time budget, each
writing as it goes (a part cut short still leaves its rows, and ``session.json`` is rewritten after
every part). Numbered as they were first written:

1. ``validate``  -- benchmarks/validate.py's matrix on the GPU: ``<out>/gpu.csv``, the CSV that
   benchmarks/report.py turns into GPU rows of docs/validation.md (copy it to docs/validation/gpu-<name>.csv);
2. ``widths``    -- benchmarks/gpu_validate.py at real widths, models cut to a few layers:
   ``<out>/gpu-widths.csv`` and ``.md``;
3. ``offload``   -- a probe split between the GPU and the CPU (``--max-memory cuda:0=...,cpu=...``, the
   placement issue's case a single GPU can show): ``<out>/offload.json`` with the plan, the per-device
   estimate and the per-device measurement;
4. ``plan``      -- ``vramcal plan`` of Llama-3.2-3B for a described 3 GiB GPU and 32 GiB of RAM (every
   quantization needs offload there), then its first offloaded plan probed as planned (synthetic
   weights): ``<out>/plan.json`` with the plan and the planned beside the measured peak per device
   (commit it to docs/validation/plan/);
5. ``vlm``       -- Qwen2.5-VL-7B in nf4 with one 1024 x 1024 image (docs/vision.md): the whole vision
   tower, the language model cut to 4 layers at its real widths, random weights; ``<out>/vlm.json`` with
   the estimate, the probe's stages and its vision-encoder reading;
6. ``vllm``      -- when vLLM imports on the machine (carried as wheels: docs/vllm.md), one
   ``vramcal probe --engine vllm --synthetic`` (vLLM's dummy weights, no download): ``<out>/vllm-probe.json``
   with the predicted and the logged startup terms side by side (commit it to docs/validation/vllm/).

7. ``allocator`` -- benchmarks/gpu_allocator.py three times, in fresh processes: torch's defaults and
   ``PYTORCH_ALLOC_CONF=expandable_segments:True`` at 4k, the defaults at 32k (the widest miss of the
   replayed reserve, docs/validation.md); Llama-3.1-8B cut to 4 layers, a prefill and a decode
   step under ``torch.cuda.memory._record_memory_history``, each stage's segments beside vramcal's replay of
   the real trace, and the dry run's prefill allocations beside the GPU's (``<out>/allocator-*.json``).

``--device cpu --quick`` runs parts 1 and 2 on tiny models on the CPU (the tests do); parts 3 to 5 need a
GPU and say so, as part 6 does without vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# in the order they run: what no GPU has measured yet first (docs/validation/gpu-h200/README.md says what the
# first session, 2026-11-30, got through), then the matrices that add rows to what is there
# shares sized by that session: a probe of a 3B model with synthetic weights took 157 s there, most of it
# writing and reading the checkpoint, so the parts with such a probe get the time one needs
# the second session (2026-12-04) measured allocator, plan, vlm, offload and six validate runs, and no widths
# row: the allocator first again (it now keeps both prefills' order of allocations and frees, which is where the
# dry run's replay parts from the GPU's), then the widths rows no session has repeated, then the rest
SHARES = {"allocator": 0.15, "widths": 0.25, "vlm": 0.15, "plan": 0.15, "offload": 0.10, "vllm": 0.05,
          "validate": 0.15}
# what each part took on the 2026-12-04 H200 (session-log.txt there): the least that leaves a row -- widths one
# real-width checkpoint and its probe, validate one configuration; vLLM's first start is a guess (never run).
# On a GPU a part is not started with less of the budget left than this (device time spent on a part the outer
# timeout then kills leaves nothing), and is given at least this much of what is left.
NEEDS_S = {"allocator": 50, "plan": 140, "vlm": 105, "offload": 130, "vllm": 120, "widths": 80, "validate": 45}


def part_allocator(args, budget_s: float) -> str:
    """benchmarks/gpu_allocator.py with torch's defaults and with expandable segments at 4k, then the defaults
    at 32k (the H200 row whose replayed reserve was furthest off: 1,737 MiB above allocated against 939
    measured), each in its own process (the setting is read when CUDA starts), a third of the share each."""
    import subprocess

    if not args.device.startswith("cuda"):
        print("allocator: skipped, it needs a GPU (torch's CPU build has no CUDA caching allocator)", file=sys.stderr)
        return ""
    written = []
    for name, conf, ctx in (("default", "", 4096), ("expandable", "expandable_segments:True", 4096),
                            ("default-32k", "", 32768)):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
        if conf:
            env["PYTORCH_ALLOC_CONF"] = conf
        out = Path(args.out) / f"allocator-{name}.json"
        try:
            subprocess.run([sys.executable, str(HERE / "gpu_allocator.py"), "--device", args.device, "--ctx", str(ctx),
                            "--out", str(out)], env=env, timeout=budget_s / 3, check=False)
        except subprocess.TimeoutExpired:
            print(f"allocator: {name} ran past its {budget_s / 3:.0f} s", file=sys.stderr)
        if out.exists():
            written.append(out.name)
    return ", ".join(written)


def part_validate(args, budget_s: float) -> str:
    import validate

    argv = ["--device", args.device, "--name", "gpu", "--out", os.path.join(args.out, "gpu.csv"),
            "--db", os.path.join(args.out, "validation-gpu.db"), "--budget-s", str(budget_s)]
    if args.quick:
        argv += ["--archs", "dense-gqa", "--quants", "nf4", "--ctx", "64", "--batch", "1"]
    else:
        argv += ["--quants", "bf16", "nf4", "--ctx", "1024", "8192", "--batch", "1", "4"]
    validate.main(argv)
    return "gpu.csv"


def part_widths(args, budget_s: float) -> str:
    import gpu_validate

    out = os.path.join(args.out, "gpu-widths.csv")
    argv = ["--device", args.device, "--out", out, "--summary", os.path.join(args.out, "gpu-widths.md"),
            "--budget-s", str(budget_s)]
    if args.quick:
        argv += ["--models", *args.quick_models, "--layers", "2", "--quants", "nf4", "--ctx", "64", "--batch", "1"]
    else:
        argv += ["--models", "llama-3.1-8b", "qwen2.5-7b", "gemma-3-12b", "--layers", "4",
                 "--quants", "bf16", "nf4", "int8", "--ctx", "4096", "32768", "--batch", "1"]
    gpu_validate.main(argv)
    return "gpu-widths.csv"


def rss_kinds(pid: int) -> dict | None:
    """The resident set of process ``pid`` by kind, in bytes, as the CPU path reads it
    (``cpu_rss_instrument.rollup``: ``smaps_rollup``'s Anonymous, file-backed = Rss - Anonymous); None where it
    cannot be read (not Linux, the process gone)."""
    from cpu_rss_instrument import rollup

    try:
        got = rollup(pid)
    except (OSError, ValueError):
        return None
    return {"Rss": got.get("Rss", 0), "RssAnon": got.get("Anonymous", 0), "RssFile": got["File"]}


def stage_rss_kinds(kinds: dict):
    """A probe's ``on_event``: the child's resident set by kind as each stage's event arrives (a moment after
    the child marked it). An offloaded load's resident set doubles at the first forward (3.15 to 7.11 GB in
    both H200 sessions); file-backed pages (the checkpoint's mapping, read as the hooks copy the CPU share in)
    against anonymous copies tell the suspects apart."""
    def on_event(event: dict, pid: int) -> None:
        if event.get("event") == "stage" and pid:
            kinds[event.get("name")] = rss_kinds(pid)
    return on_event


def part_offload(args, budget_s: float) -> str:
    """Llama-3.2-3B bf16 (6.4 GB of weights) with 3 GiB of the GPU: about half its layers on the CPU."""
    from vramcal.estimator.estimate import estimate
    from vramcal.probes.hardware import device_gpu_target
    from vramcal.probes.probe import run_probe

    if not args.device.startswith("cuda"):
        print("offload: skipped, it needs a GPU (--max-memory is refused on the CPU path)", file=sys.stderr)
        return ""
    model, quant, mm = "llama-3.2-3b", "bf16", f"{args.device}=3GiB,cpu=32GiB"
    est = estimate(model, quant, ctx=1024, max_memory=mm, device="cuda", gpu=device_gpu_target(args.device))
    kinds: dict = {}
    r = run_probe(model, quant, 1024, 1, device=args.device, synthetic=True, keep_samples=False, max_memory=mm,
                  timeout_s=budget_s, on_event=stage_rss_kinds(kinds))
    measured = r.to_dict(samples=False)
    out = {"command": r.command, "max_memory": mm, "status": r.status, "error": r.error,
           "plan": est.to_dict().get("device_map"), "estimated_devices": est.to_dict().get("devices"),
           "measured_devices": measured["devices"], "measured_stages": measured["stages"],
           "child_rss_kinds": kinds, "notes": r.notes}
    (Path(args.out) / "offload.json").write_text(json.dumps(out, indent=1, default=str))
    return "offload.json"


def part_plan(args, budget_s: float) -> str:
    """The first offloaded plan of Llama-3.2-3B on a described 3 GiB GPU, probed as planned: does each
    GPU's measured peak stay within what the plan promised (its memory less the buffer)?"""
    from vramcal.calibrate.plan import plan_model
    from vramcal.probes.hardware import described, parse_hardware
    from vramcal.probes.probe import run_probe
    from vramcal.units import MIB

    if not args.device.startswith("cuda"):
        print("plan: skipped, it needs a GPU to probe the plan on", file=sys.stderr)
        return ""
    device = args.device if ":" in args.device else "cuda:0"
    hw = described(parse_hardware(f"{device}=3GiB,cpu=32GiB"))
    result = plan_model("llama-3.2-3b", hw, buffer=512 * MIB, ctx=1024)
    plans = [p for p in result.plans if p.offloaded] or result.plans
    out = {"hardware": hw.sizes(), "buffer_bytes": 512 * MIB, "plans": [p.to_dict() for p in result.plans],
           "why": result.why, "shortfall": result.shortfall}
    if plans:
        p = plans[0]
        dm = p.from_pretrained.get("device_map")
        kinds: dict = {}
        r = run_probe("llama-3.2-3b", p.quant, p.ctx, p.batch, device=device, synthetic=True, keep_samples=False,
                      kv_dtype=p.kv_dtype, max_memory=p.max_memory,
                      device_map=dm if isinstance(dm, str) and dm != "auto" else None, timeout_s=budget_s,
                      on_event=stage_rss_kinds(kinds))
        measured = r.to_dict(samples=False)
        out.update(probed=p.to_dict(), status=r.status, error=r.error, command=r.command, child_rss_kinds=kinds,
                   planned_peak_bytes=p.peak_bytes,
                   measured_peak_bytes={d: max((s.get("peak_bytes") or 0) for s in st.values())
                                        for d, st in (measured.get("devices") or {}).items()},
                   notes=r.notes)
    (Path(args.out) / "plan.json").write_text(json.dumps(out, indent=1, default=str))
    return "plan.json"


def part_vllm(args, budget_s: float) -> str:
    """One vLLM probe of Qwen2.5-0.5B with dummy weights: predicted beside logged, term by term."""
    import importlib.util

    if not args.device.startswith("cuda") or importlib.util.find_spec("vllm") is None:
        print("vllm: skipped, it needs vLLM installed and a GPU", file=sys.stderr)
        return ""
    import contextlib
    import io

    from vramcal.cli import main as vramcal

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = vramcal(["probe", "qwen2.5-0.5b", "--engine", "vllm", "--synthetic", "--max-model-len", "4096",
                      "--gpu-memory-utilization", "0.5", "--db", str(Path(args.out) / "vllm.db"), "--json"])
    (Path(args.out) / "vllm-probe.json").write_text(out.getvalue() or json.dumps({"rc": rc}))
    return "vllm-probe.json"


def part_vlm(args, budget_s: float) -> str:
    """Qwen2.5-VL-7B, nf4, one 1024 x 1024 image, a 512-token prompt and 64 new tokens; the language model
    cut to 4 layers (the vision tower whole), estimated and probed with the same cut config."""
    import gpu_validate

    from vramcal.estimator.estimate import estimate
    from vramcal.estimator.resolve import resolve_model
    from vramcal.probes.hardware import device_gpu_target
    from vramcal.probes.probe import run_probe

    if not args.device.startswith("cuda"):
        print("vlm: skipped, it needs a GPU (Qwen2.5-VL-7B's vision tower alone is 1.3 GB of random weights)",
              file=sys.stderr)
        return ""
    model = Path(args.out) / "qwen2.5-vl-7b-4layers"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(gpu_validate._config_for("qwen2.5-vl-7b", 4)))
    for name, data in resolve_model("qwen2.5-vl-7b").processor.items():
        (model / name).write_text(json.dumps(data))
    est = estimate(str(model), "nf4", ctx=512 + 64, new_tokens=64, images=1, image_size=(1024, 1024), device="cuda",
                   gpu=device_gpu_target(args.device))
    r = run_probe(str(model), "nf4", 512 + 64, 1, device=args.device, synthetic=True, keep_samples=False,
                  new_tokens=64, images=1, image_size=(1024, 1024), timeout_s=budget_s, estimate=est)
    out = {"command": r.command, "status": r.status, "error": r.error, "estimate": est.to_dict(),
           "probe": r.to_dict(samples=False), "notes": r.notes}
    (Path(args.out) / "vlm.json").write_text(json.dumps(out, indent=1, default=str))
    return "vlm.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", required=True, help="folder for the CSVs and the offload JSON")
    ap.add_argument("--budget-s", type=float, default=420, help="device time for all the parts (default 7 min)")
    ap.add_argument("--parts", nargs="+", default=list(SHARES), choices=list(SHARES))
    ap.add_argument("--quick", action="store_true", help="tiny models: the CPU test of this script")
    ap.add_argument("--quick-models", nargs="+", default=[], help="model dirs for --quick's widths part")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    done = {}
    start = time.monotonic()

    def written(part: str) -> None:  # after every part, so a session cut short still says what it finished
        print(f"{part}: {done[part]}", file=sys.stderr, flush=True)
        (Path(args.out) / "session.json").write_text(
            json.dumps({"parts": done, "seconds": round(time.monotonic() - start, 1)}, indent=1))

    chosen = sum(SHARES[p] for p in args.parts)  # the parts asked for share the whole budget
    for part in args.parts:
        share = args.budget_s * SHARES[part] / chosen
        t = time.monotonic()
        if args.device.startswith("cuda") and not args.quick:
            left = args.budget_s - (t - start)
            if left < NEEDS_S[part]:
                done[part] = {"skipped": f"{max(left, 0):.0f} s of the budget left; it took {NEEDS_S[part]} s on "
                                         "the 2026-12-04 H200", "seconds": 0.0}
                written(part)
                continue
            share = min(max(share, NEEDS_S[part]), left)
        try:
            done[part] = {"file": {"validate": part_validate, "widths": part_widths,
                                   "offload": part_offload, "plan": part_plan, "vlm": part_vlm,
                                   "vllm": part_vllm, "allocator": part_allocator}[part](args, share)}
        except BaseException as exc:  # one part failing must not lose the others' rows; an interrupt stops
            done[part] = {"error": f"{type(exc).__name__}: {exc}"}
            if not isinstance(exc, Exception):
                raise
        finally:
            done[part]["seconds"] = round(time.monotonic() - t, 1)
            written(part)
    return 0 if all("error" not in d for d in done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
