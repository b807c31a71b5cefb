"""The sampler and the NVML door, against a scripted fake NVML: the project's only fake."""

from __future__ import annotations

import threading
import time

import pytest
from fake_nvml import NVMLError_NotSupported

from vramcal.probes import nvml
from vramcal.probes.nvml import NA
from vramcal.probes.sampler import Sample, Sampler, attribute, nvml_reader

GIB = 1024**3


def test_door_maps_errors_to_na_never_zero(fake):
    f = fake({0: [5 * GIB, NVMLError_NotSupported()]})
    h = nvml.device_handle(0)
    assert nvml.memory_used(h) == 5 * GIB
    v = nvml.memory_used(h)
    assert isinstance(v, NA) and not v and v.reason == "Not Supported" and v != 0
    assert isinstance(nvml.process_used(h, 1234), NA)  # no process list on this GPU
    info = nvml.device_info(0)
    assert info["name"] == "NVIDIA H200" and isinstance(info["driver"], NA)
    assert f.inits == 1  # lazily, once


def test_per_process_usage_and_missing_driver_field(fake):
    fake({0: [GIB]}, procs={0: {111: 3 * GIB, 222: None}})
    h = nvml.device_handle(0)
    assert nvml.process_used(h, 111) == 3 * GIB
    assert "per-process usage not available" in nvml.process_used(h, 222).reason
    assert "not listed" in nvml.process_used(h, 333).reason


def test_unavailable_nvml_is_na_with_reason(fake):
    fake({0: [GIB]}, fail_init=True)
    ok, why = nvml.available()
    assert not ok and "Shared Library Not Found" in why
    assert isinstance(nvml.memory_used(nvml.device_handle(0)), NA)


def test_no_call_after_shutdown(fake):
    f = fake({0: [GIB]})
    assert nvml.memory_used(nvml.device_handle(0)) == GIB
    nvml.shutdown()
    assert f.shutdowns == 1
    assert isinstance(nvml.memory_used(nvml.device_handle(0)), NA)
    nvml.reopen()
    assert nvml.memory_used(nvml.device_handle(0)) == GIB


def test_sampler_interval_and_series(fake):
    fake({0: [i * GIB for i in range(1000)], 1: [7 * GIB]})
    s = Sampler(nvml_reader([0, 1]), interval_s=0.01)
    with s:
        time.sleep(0.5)
    n = len(s.samples)
    assert 25 <= n <= 55  # ~50 ticks in 0.5 s at 10 ms; loose for a loaded 2-core machine
    gaps = [b.t - a.t for a, b in zip(s.samples, s.samples[1:])]
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.01, abs=0.004)  # median tick
    assert [x.values["gpu0"] for x in s.samples[:3]] == [0, GIB, 2 * GIB]
    assert all(x.values["gpu1"] == 7 * GIB for x in s.samples)
    assert s.cpu_seconds >= 0 and s.overhead is not None


def test_gpu_that_disappears_mid_run(fake):
    f = fake({0: [GIB, 2 * GIB, 3 * GIB]})
    s = Sampler(nvml_reader([0]), interval_s=0.005)
    s.sample_now()
    s.sample_now()
    f.lost.add(0)
    lost = s.sample_now()
    assert lost.values["gpu0"] is None and lost.missing["gpu0"] == "GPU is lost"
    assert [x.values["gpu0"] for x in s.samples[:2]] == [GIB, 2 * GIB]


def test_field_errors_are_per_series(fake):
    fake({0: [GIB, NVMLError_NotSupported(), 3 * GIB], 1: [5 * GIB]})
    s = Sampler(nvml_reader([0, 1]), 0.005)
    s.sample_now()
    bad = s.sample_now()
    assert bad.values == {"gpu0": None, "gpu1": 5 * GIB} and bad.missing == {"gpu0": "Not Supported"}


def test_sampler_stops_cleanly_and_never_outlives_shutdown(fake):
    fake({0: [GIB]})
    s = Sampler(nvml_reader([0]), 0.002).start()
    time.sleep(0.05)
    s.stop()
    assert not any(t.name == "vramcal-sampler" for t in threading.enumerate())
    nvml.shutdown()
    n = len(s.samples)
    time.sleep(0.02)
    assert len(s.samples) == n


def test_reader_that_breaks_ends_sampling_with_reason():
    calls = []

    def read():
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("driver went away")
        return {"x": 1}

    s = Sampler(read, 0.001).start()
    time.sleep(0.05)
    s.stop()
    assert s.error == "RuntimeError: driver went away" and len(s.samples) == 2


def test_attribute_peaks_to_the_interval_ending_at_each_marker():
    samples = [Sample(t, {"m": v}) for t, v in [(0.0, 10), (1.0, 50), (1.5, 20), (2.0, 30), (2.5, None), (3.0, 90),
                                               (3.5, 40)]]
    markers = [("baseline", 0.5), ("load_peak", 2.0), ("first_token", 3.2), ("end", 4.0)]
    out = attribute(samples, markers, "m")
    assert out["baseline"] == {"peak_bytes": 10, "used_bytes": 10, "samples": 1}
    assert out["load_peak"] == {"peak_bytes": 50, "used_bytes": 30, "samples": 3}
    assert out["first_token"] == {"peak_bytes": 90, "used_bytes": 90, "samples": 1}  # None is skipped, not 0
    assert out["end"]["peak_bytes"] == 40


def test_bad_interval():
    with pytest.raises(ValueError):
        Sampler(lambda: {}, 0)


def test_door_lets_a_bug_through_instead_of_calling_it_not_available(fake):
    f = fake({0: [GIB]})

    def broken(handle):
        raise ZeroDivisionError("a bug, not NVML")

    f.nvmlDeviceGetMemoryInfo = broken
    with pytest.raises(ZeroDivisionError):
        nvml.memory_used(nvml.device_handle(0))
