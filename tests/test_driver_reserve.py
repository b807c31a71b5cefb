"""The driver's reserve (vramcal/estimator/capacity.py): what a run can have is the device's total less the
reserve, measured here through the NVML door (tests/fake_nvml.py), tabled for described GPUs, or not known;
the probe's GPU readings are compared less it, and check's verdict does not take it off twice."""

from __future__ import annotations

import pytest

from vramcal.estimator.capacity import DRIVER_RESERVE, capacity, reserve_for
from vramcal.probes.readings import StageReading
from vramcal.probes.result import ProbeResult
from vramcal.workload import STAGES

GIB = 1024**3
R = 600 * 1024**2  # the fake GPU's reserve


def test_the_rule_measured_table_unknown():
    here = reserve_for("NVIDIA H200", 123_456_789)
    assert (here.bytes, here.kind) == (123_456_789, "measured")  # a reading here beats the table
    table = reserve_for("NVIDIA H200")
    assert (table.bytes, table.kind) == (DRIVER_RESERVE["NVIDIA H200"][0], "table") == (648_347_648, "table")
    unknown = reserve_for("NVIDIA L4", why_unmeasured="no v2")
    assert unknown.bytes is None and unknown.source.startswith("not known") and "no v2" in unknown.source
    assert capacity(80 * GIB, here) == 80 * GIB - 123_456_789
    assert capacity(80 * GIB, unknown) == 80 * GIB  # today's behaviour, said by the line
    assert "not known" in unknown.line("cuda:0") and "measured here" in here.line("cuda:0")
    for bad in (-1, 1.5, True, "600MiB"):
        with pytest.raises(ValueError):
            reserve_for("NVIDIA H200", bad)
    with pytest.raises(ValueError):
        capacity(100, reserve_for("x", 100))


def test_reserve_here_reads_nvml_v2_else_the_table_else_says_not_known(fake):
    from vramcal.probes.machine import reserve_here

    fake({0: [R]}, reserved=R, gpu_name="NVIDIA GeForce RTX 4090")
    got = reserve_here("cuda:0")
    assert (got.bytes, got.kind) == (R, "measured")
    fake({0: [R]}, gpu_name="NVIDIA H200")  # a binding without v2 memory info: the table by the NVML name
    got = reserve_here("cuda:0")
    assert (got.bytes, got.kind) == (648_347_648, "table")
    fake({0: [R]}, gpu_name="NVIDIA GeForce RTX 4090")
    got = reserve_here("cuda:0")
    assert got.bytes is None and got.kind == "unknown" and "v2" in got.source


def _gpu_result(peak: int, reserve: dict | None) -> ProbeResult:
    stages = {k: StageReading(k, "gpu0", peak - 10, peak) for k in ("baseline",) + STAGES}
    return ProbeResult("ok", "cuda:0", "m", "bf16", "none", "bfloat16", 256, 1, "sdpa", "gpu0", stages, "end", None,
                       None, 1, [], 5.0, None, 1.0, "vramcal probe m", driver_reserve=reserve)


def test_the_probe_compares_gpu_readings_less_the_reserve():
    r = _gpu_result(5 * GIB, {"gpu0": R})
    m = r.measured()
    assert m["end"].peak_bytes == 5 * GIB - R and m["end"].used_bytes == 5 * GIB - 10 - R
    assert r.stages["end"].peak_bytes == 5 * GIB  # as read stays in the record
    back = ProbeResult.from_dict(r.to_dict())
    assert back.driver_reserve == {"gpu0": R} and back.measured()["end"].peak_bytes == 5 * GIB - R
    # not known (an old record, no v2 and no table row): as read, the reserve in it
    assert _gpu_result(5 * GIB, None).measured()["end"].peak_bytes == 5 * GIB
    # torch's mem_get_info (no NVML) already leaves the reserve out: never taken off
    assert r.reserve_of(None) is None and r.reserve_of("rss") is None


def test_a_split_runs_devices_less_each_reserve():
    from test_placement_cli import _placed_result

    r = _placed_result(None, 3 * GIB, 2 * GIB)
    r.driver_reserve = {"gpu0": R, "gpu1": 2 * R}
    d = r.measured_devices()
    assert d["cuda:0"]["end"].peak_bytes == 3 * GIB - R and d["cuda:1"]["end"].peak_bytes == 2 * GIB - 2 * R
    assert d["cpu"]["end"].peak_bytes == 7  # the resident set holds no reserve


def test_checks_verdict_takes_the_reserve_off_once():
    """Budget from free memory: free = total - reserve - others, held = total - free. The measured peak is
    already without the reserve, so only what the others held comes off it."""
    from vramcal.calibrate.check import verdict_for

    total, others = 80 * GIB, 2 * GIB
    free, held = total - R - others, R + others
    peak_read = R + others + 70 * GIB  # NVML v1 used at the peak: reserve, the others, the run
    v = verdict_for(_gpu_result(peak_read, {"gpu0": R}), free, GIB, held)
    assert v.peak_bytes == 70 * GIB and v.fits
    old = verdict_for(_gpu_result(peak_read, None), free, GIB, held)  # reserve not known: as before
    assert old.peak_bytes == 70 * GIB
    given = verdict_for(_gpu_result(peak_read, {"gpu0": R}), 72 * GIB, GIB, 0)  # --budget: the run's own use
    assert given.peak_bytes == others + 70 * GIB


def test_the_probe_reads_each_sampled_gpus_reserve(fake):
    from vramcal.probes.probe import driver_reserves

    fake({0: [R], 1: [R]}, reserved=R, gpu_name="NVIDIA L4")
    notes: list[str] = []
    assert driver_reserves("gpu1", None, notes) == {"gpu1": R} and not notes
    assert driver_reserves("gpu0", [0, 1], notes) == {"gpu0": R, "gpu1": R}
    assert driver_reserves("rss", None, notes) is None and driver_reserves(None, None, notes) is None
    fake({0: [R]}, gpu_name="NVIDIA L4")  # no v2, not in the table
    assert driver_reserves("gpu0", None, notes) == {}
    assert len(notes) == 1 and "not known" in notes[0] and "as read" in notes[0]


# ------------------------------------------------------------------ plan and fit: total - reserve

@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """8 layers of 6 MB each and a long position limit: memory, not the model, bounds the context."""
    from conftest import TINY, save_tiny

    return save_tiny("wide", {**TINY["dense-gqa"], "num_hidden_layers": 8, "vocab_size": 256, "hidden_size": 512,
                              "intermediate_size": 1536, "max_position_embeddings": 131072},
                     tmp_path_factory.mktemp("reserve"))


def _json(capsys, argv) -> dict:
    import json

    from vramcal import cli

    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc in (0, 1), err
    return json.loads(out)


def test_a_described_gpu_has_the_tables_reserve_an_unnamed_one_says_not_known():
    from vramcal.probes.hardware import described

    h200 = described({"cuda:0": 141 * GIB}, ["H200"]).gpus[0]
    assert h200.total_bytes == 141 * GIB and h200.memory_bytes == 141 * GIB - 648_347_648
    assert h200.reserve.kind == "table" and h200.capacity_bytes == h200.memory_bytes
    hw = described({"cuda:0": 24 * GIB}, ["RTX 4090"])  # in the table of GPUs, not of reserves
    assert hw.gpus[0].memory_bytes == 24 * GIB and hw.gpus[0].reserve.bytes is None
    assert any("not known" in n and "counted as nothing" in n for n in hw.notes)
    bare = described({"cuda:0": 24 * GIB})
    assert bare.gpus[0].memory_bytes == 24 * GIB and bare.reserves()["cuda:0"]["bytes"] is None


def test_plan_answers_a_described_h200_against_its_total_less_the_reserve(wide, capsys):
    size = 3 * GIB
    named = _json(capsys, ["plan", wide, "--hardware", f"cuda:0={size}", "--gpu", "H200", "--buffer", "1GiB", "--json"])
    assert named["hardware"]["cuda:0"] == size - 648_347_648
    assert named["driver_reserve"]["cuda:0"]["bytes"] == 648_347_648
    assert named["driver_reserve"]["cuda:0"]["source"].startswith("table")
    assert named["driver_reserve"]["cuda:0"]["taken_off"] is True  # said as fit says it
    assert named["gpus"][0]["driver_reserve"] == named["driver_reserve"]["cuda:0"]
    assert named["gpus"][0]["total_bytes"] == size
    assert any("driver's reserve" in n and "618 MiB" in n for n in named["notes"])
    less = _json(capsys, ["plan", wide, "--hardware", f"cuda:0={size - 648_347_648}", "--buffer", "1GiB", "--json"])
    unknown = less["driver_reserve"]["cuda:0"]
    assert unknown["bytes"] is None and "not known" in unknown["source"] and unknown["taken_off"] is False
    ctx = lambda doc: [(p["quant"], p["ctx"]) for p in doc["plans"]]  # noqa: E731
    assert ctx(named) == ctx(less) and ctx(named)
    whole = _json(capsys, ["plan", wide, "--hardware", f"cuda:0={size}", "--buffer", "1GiB", "--json"])
    assert max(c for _, c in ctx(whole)) > max(c for _, c in ctx(named))  # the reserve moved the answer


def test_plan_of_this_machine_takes_nothing_more_off_free_memory(fake):
    from vramcal.probes.hardware import this_machine

    fake({0: [R + GIB]}, total=24 * GIB, reserved=R, gpu_name="NVIDIA GeForce RTX 4090")
    hw = this_machine()
    g = hw.gpus[0]
    assert g.memory_bytes == 24 * GIB - R - GIB  # NVML's free: the reserve and the others' GiB already out
    assert g.reserve.kind == "measured" and g.capacity_bytes == 24 * GIB - R
    assert any("already leaves the driver's reserve out" in n for n in hw.notes)
    assert hw.reserves()["cuda:0"]["taken_off"] is False and "already left" in hw.reserves()["cuda:0"]["why"]


def test_fit_on_this_machine_answers_against_total_less_the_reserve(wide, fake, capsys):
    fake({0: [R]}, total=3 * GIB, reserved=R, gpu_name="NVIDIA GeForce RTX 4090", compute_capability=(8, 9))
    auto = _json(capsys, ["fit", wide, "--budget", "auto", "--buffer", "1GiB", "--json"])
    assert auto["budget_bytes"] == 3 * GIB - R
    r = auto["driver_reserve"]["cuda:0"]
    assert (r["bytes"], r["kind"], r["taken_off"]) == (R, "measured", False) and "free memory" in r["why"]
    given = _json(capsys, ["fit", wide, "--budget", str(3 * GIB - R), "--buffer", "1GiB", "--json"])
    rows = lambda doc: [(x["quant"], x["batch"], x["max_ctx"]) for x in doc["rows"]]  # noqa: E731
    assert rows(auto) == rows(given) and any(x[2] for x in rows(auto))
    assert "--budget is the run's own use" in given["driver_reserve"]["cuda:0"]["why"]


def test_fit_for_a_named_gpu_reports_the_tables_reserve_and_an_unknown_one(wide, capsys):
    doc = _json(capsys, ["fit", wide, "--budget", "3GiB", "--buffer", "1GiB", "--gpu", "H200", "--json"])
    assert doc["driver_reserve"]["cuda:0"]["bytes"] == 648_347_648
    assert any("outside it" in n for n in doc["notes"])
    doc = _json(capsys, ["fit", wide, "--budget", "3GiB", "--buffer", "1GiB", "--gpu", "RTX 4090", "--json"])
    assert doc["driver_reserve"]["cuda:0"]["bytes"] is None and doc["driver_reserve"]["cuda:0"]["kind"] == "unknown"


def test_vllm_reads_cudas_total_here(fake):
    from vramcal.cli_vllm import this_gpu

    fake({0: [R]}, total=80 * GIB, reserved=R, gpu_name="NVIDIA H100 80GB HBM3")
    assert this_gpu() == (80 * GIB - R, "NVIDIA H100 80GB HBM3", (9, 0))
    fake({0: [R]}, total=80 * GIB, gpu_name="NVIDIA H100 80GB HBM3")  # no v2, not tabled: NVML's total, as before
    assert this_gpu() == (80 * GIB, "NVIDIA H100 80GB HBM3", (9, 0))


def test_vllm_for_a_named_gpu_takes_its_size_less_the_reserve_as_plan_does():
    """`estimate --engine vllm --gpu NAME` without --gpu-memory: vLLM's total is CUDA's, the table's size less
    the driver's reserve (the same rule as plan's described GPU); a GPU the table has no reserve for keeps its
    size."""
    from types import SimpleNamespace

    from vramcal.cli_vllm import vllm_args
    from vramcal.probes.hardware import find_gpu

    def total(gpu):
        args = SimpleNamespace(gpu_memory=None, gpu=gpu, gpu_memory_utilization=None, max_model_len=None,
                               max_num_seqs=None, max_num_batched_tokens=None, tensor_parallel_size=None,
                               pipeline_parallel_size=None, dtype=None, kv_cache_dtype=None, quantization=None,
                               block_size=None, enforce_eager=False, kv_cache_memory=None, vllm_version=None,
                               allow_long_max_model_len=False, vllm_entrypoint=None, flashinfer_sampler=None)
        return vllm_args(args).gpu_memory_bytes

    h200 = int(find_gpu("NVIDIA H200").memory_gb * GIB)
    assert total("H200") == h200 - DRIVER_RESERVE["NVIDIA H200"][0]
    assert total("RTX 4090") == int(find_gpu("RTX 4090").memory_gb * GIB)


@pytest.mark.parametrize("argv", [
    ["plan", "{m}", "--hardware", "cuda:0=500MiB", "--gpu", "H200"],  # not above the H200's reserve
    ["plan", "{m}", "--hardware", "cuda:0=618MiB", "--gpu", "H200"],
])
def test_a_size_within_the_reserve_is_one_line_exit_2(wide, argv, capsys):
    from vramcal import cli

    rc = cli.main([a.replace("{m}", wide) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "reserve" not in out, err
    assert "driver" in err
