"""The caching allocator on a real GPU beside its replay (vramcal.estimator.allocator), segment by segment.

Run once per allocator setting, each in its own process (torch reads PYTORCH_ALLOC_CONF when CUDA starts):

    PYTORCH_ALLOC_CONF=expandable_segments:True python3 benchmarks/gpu_allocator.py --out a.json

What it does on ``--device`` (a GPU): builds Llama-3.1-8B cut to ``--layers`` layers at its real widths
(random weights, made on the GPU: no checkpoint to write), with ``torch.cuda.memory._record_memory_history``
on, then a prefill of ``--ctx`` tokens and one decode step, as vramcal's dry run does them. At each stage it
keeps torch's figures (memory_reserved / memory_allocated and their peaks, the segments of
``memory_snapshot()``) and the length of the allocator's own trace. Then, with no GPU needed any more:

- the real trace (every alloc and free torch's allocator saw, in order) replayed through vramcal's
  allocator: reserved and the segments at each stage, beside torch's -- the replay's rules checked alone;
- the dry run of the same config on meta tensors, its prefill's allocations beside the real prefill's: the
  sizes that differ, in order -- where the dry run's trace is not the GPU's; then the same with the frees in
  the sequence (``prefill_order``), and both prefills as ``+size`` / ``-size`` lists (``prefill_ops``);
- NVML's used and (v2) reserved before CUDA starts and at the end, through vramcal's one NVML door.

:func:`compare` is the part the CPU tests run, on a snapshot-shaped trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def events_of(trace: list[dict]) -> list[tuple]:
    """torch's device trace (``_snapshot()["device_traces"][i]``) as replay events: each ``alloc`` and each
    ``free_completed`` (one stream: a free completes as it is asked for)."""
    from vramcal.estimator.allocator import ALLOC, FREE

    out = []
    for e in trace:
        if e.get("action") == "alloc":
            out.append((ALLOC, e["addr"], int(e["size"])))
        elif e.get("action") == "free_completed":
            out.append((FREE, e["addr"], 0))
    return out


def segments_of(snapshot_segments: list[dict]) -> list[dict]:
    """torch's segments, reduced to what the replay's snapshot says (sizes, blocks' sizes and states)."""
    return [{"total_size": s["total_size"], "segment_type": s.get("segment_type"),
             "blocks": [{"size": b["size"], "state": b["state"]} for b in s.get("blocks", [])]}
            for s in sorted(snapshot_segments, key=lambda s: s.get("address", 0))]


def compare(trace: list[dict], stages: dict[str, dict], conf_text: str = "") -> dict:
    """Replay ``trace`` (torch's, in order) through vramcal's allocator and set each stage's figures beside
    torch's: ``stages`` maps a stage to ``{"trace_len": n, "reserved": bytes, "peak_reserved": bytes,
    "segments": [...]}`` as recorded when the stage ended."""
    from vramcal.estimator.allocator import CachingAllocator, parse_alloc_conf, replay

    conf = parse_alloc_conf(conf_text, "PYTORCH_ALLOC_CONF")
    a = CachingAllocator(conf)
    done = 0
    out = {}
    for name, st in sorted(stages.items(), key=lambda kv: kv[1]["trace_len"]):
        n = st["trace_len"]
        replay(events_of(trace[done:n]), allocator=a)
        done = n
        got = sorted(s["total_size"] for s in a.snapshot())
        want = sorted(s["total_size"] for s in st.get("segments", []))
        out[name] = {"reserved_torch": st["reserved"], "reserved_replay": a.reserved,
                     "peak_reserved_torch": st.get("peak_reserved"), "peak_reserved_replay": a.peak_reserved,
                     "error_bytes": a.reserved - st["reserved"],
                     "segments_torch": len(want), "segments_replay": len(got), "same_segments": got == want}
    return out


def size_diff(real: list[tuple], dry: list[tuple], limit: int = 60) -> dict:
    """The real prefill's allocation sizes beside the dry run's, in order: how many, and the first places
    where they part (difflib over the two sequences of sizes)."""
    from vramcal.estimator.allocator import ALLOC

    a = [e[2] for e in real if e[0] == ALLOC]
    b = [e[2] for e in dry if e[0] == ALLOC]
    return {"real_allocs": len(a), "dry_allocs": len(b), "differ": _differ(a, b, limit)}


def _differ(a: list, b: list, limit: int) -> list[dict]:
    """The first ``limit`` places where sequences ``a`` (the GPU's) and ``b`` (the dry run's) part (difflib)."""
    import difflib

    ops = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    return [{"op": t, "real": a[i1:i2][:8], "dry": b[j1:j2][:8], "at_real": i1, "at_dry": j1}
            for t, i1, i2, j1, j2 in ops[:limit]]


def op_sequence(events: list[tuple]) -> list[str]:
    """Replay events as ``+size`` for an allocation and ``-size`` for a free (the size of the block it frees):
    the order in which blocks live and die, which decides the segments as much as their sizes do."""
    from vramcal.estimator.allocator import ALLOC, FREE

    live, out = {}, []
    for op, key, size in events:
        if op == ALLOC:
            live[key] = size
            out.append(f"+{size}")
        elif op == FREE and key in live:
            out.append(f"-{live.pop(key)}")
    return out


def order_diff(real: list[tuple], dry: list[tuple], limit: int = 60) -> dict:
    """The real prefill's allocations and frees beside the dry run's, in order (:func:`op_sequence`): the
    first places where they part, frees included -- two traces of the same sizes can still strand different
    blocks if a tensor dies at another moment."""
    a, b = op_sequence(real), op_sequence(dry)
    return {"real_events": len(a), "dry_events": len(b), "differ": _differ(a, b, limit)}


def nvml_memory(index: int) -> dict:
    from vramcal.probes import nvml

    h = nvml.device_handle(index)
    used, reserved = nvml.memory_used(h), nvml.memory_reserved(h)
    return {"used": used if isinstance(used, int) else None, "reserved_v2": reserved if isinstance(reserved, int)
            else None, "why_not": None if isinstance(reserved, int) else str(getattr(reserved, "reason", reserved))}


def run(device: str, ctx: int, layers: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_validate

    from vramcal.estimator.allocator import ALLOC, FREE

    index = torch.device(device).index or 0
    before = nvml_memory(index)
    fields = {k: v for k, v in gpu_validate._config_for("llama-3.1-8b", layers).items() if not k.startswith("_")}
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg._attn_implementation = "sdpa"
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    stages: dict[str, dict] = {}

    def stage(name: str) -> None:
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        stages[name] = {"trace_len": len(snap["device_traces"][index]), "reserved": torch.cuda.memory_reserved(),
                        "allocated": torch.cuda.memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
                        "peak_allocated": torch.cuda.max_memory_allocated(),
                        "segments": segments_of(snap["segments"])}
        torch.cuda.reset_peak_memory_stats()

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    stage("post_load")
    ids = torch.zeros(1, ctx, dtype=torch.long, device=device)
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1, :].to(copy=True, dtype=torch.float32).argmax(-1, keepdim=True)
        del out
        stage("first_token")
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        del out
        stage("end")
    trace = torch.cuda.memory._snapshot()["device_traces"][index]
    torch.cuda.memory._record_memory_history(enabled=None)
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    result = {"device": torch.cuda.get_device_name(index), "torch": torch.__version__, "ctx": ctx,
              "layers": layers, "alloc_conf": conf, "nvml_before": before, "nvml_after": nvml_memory(index),
              "stages": {k: {kk: vv for kk, vv in v.items() if kk != "segments"} for k, v in stages.items()},
              "segments": {k: v["segments"] for k, v in stages.items()},
              "replay_of_real_trace": compare(trace, stages, conf)}
    # the dry run of the same model on meta tensors, its prefill beside the real one's
    from vramcal.estimator.dryrun import DryRunner
    from vramcal.estimator.quant import resolve_quant
    from vramcal.estimator.resolve import resolve_model

    d = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-allocator-{layers}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(gpu_validate._config_for("llama-3.1-8b", layers)))
    s = resolve_model(str(d))
    dry = DryRunner(s, resolve_quant("bf16", s.config)).trace(1, ctx)
    real = events_of(trace[stages["post_load"]["trace_len"]:stages["first_token"]["trace_len"]])
    cut = next((i for i, e in enumerate(dry.events or []) if e[0] == 2 and e[1] == "prefill"), None)
    result["prefill_sizes"] = size_diff(real, (dry.events or [])[:cut]) if cut is not None else \
        {"why_not": "the dry run gave no whole-model events here"}
    if cut is not None:  # the order, frees included, and both sequences whole: a CPU can replay them later
        result["prefill_order"] = order_diff(real, dry.events[:cut])
        result["prefill_ops"] = {"real": op_sequence(real), "dry": op_sequence(dry.events[:cut])}
    result["free_events"] = sum(1 for e in real if e[0] == FREE)
    result["alloc_events"] = sum(1 for e in real if e[0] == ALLOC)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    t = time.monotonic()
    result = run(args.device, args.ctx, args.layers)
    result["seconds"] = round(time.monotonic() - t, 1)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
