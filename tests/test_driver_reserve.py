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
