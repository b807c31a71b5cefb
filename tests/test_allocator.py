"""The caching allocator's replay against outcomes worked out by hand from torch's rules
(c10/cuda/CUDACachingAllocator.cpp; docs/accounting.md), and its settings against torch's own parser.

torch's CPU build has no CUDA caching allocator to compare the replay with (``torch.cuda.memory_*`` needs
a GPU): benchmarks/gpu_session.py's ``allocator`` part compares it segment by segment on a GPU. The CPU
build does carry torch's settings parser (``torch._C._accelerator_setAllocatorSettings``), which the
parse tests are checked against."""

import pytest

from vramcal.estimator.allocator import (
    ALLOC,
    DEFAULT_CONF,
    FREE,
    MARK,
    AllocConfError,
    CachingAllocator,
    conf_from,
    parse_alloc_conf,
    replay,
    round_size,
)

MIB = 1024**2


def run(steps, conf=DEFAULT_CONF, capacity=None):
    """``steps``: ("a", key, bytes) / ("f", key); returns the allocator after them."""
    a = CachingAllocator(conf, capacity)
    for s in steps:
        a.malloc(s[1], s[2]) if s[0] == "a" else a.free(s[1])
    return a


def blocks(a):
    return [[(b["size"] // MIB if b["size"] >= MIB else b["size"], b["state"][0]) for b in s["blocks"]]
            for s in a.snapshot()]


def test_512_byte_rounding_and_the_small_pool_in_2_mib_segments():
    a = run([("a", 1, 1)])
    assert (a.allocated, a.reserved) == (512, 2 * MIB)
    # four 512 KiB requests fill one 2 MiB segment (each split leaves >= 512 B); the fifth makes another
    a = run([("a", i, 512 * 1024) for i in range(4)])
    assert (a.allocated, a.reserved) == (2 * MIB, 2 * MIB)
    a.malloc(4, 512 * 1024)
    assert a.reserved == 4 * MIB
    assert round_size(1000) == 1024 and round_size(513) == 1024 and round_size(512) == 512


def test_large_requests_under_10_mib_share_20_mib_segments_split_only_past_1_mib():
    a = run([("a", 1, 3 * MIB), ("a", 2, 5 * MIB)])
    assert (a.reserved, a.allocated) == (20 * MIB, 8 * MIB)
    # 12 MiB remain; an 11 MiB request would leave exactly 1 MiB: not more than kSmallSize, so no split and
    # the whole 12 MiB block is allocated
    a.malloc(3, 11 * MIB)
    assert (a.reserved, a.allocated) == (20 * MIB, 20 * MIB)
    assert blocks(a) == [[(3, "a"), (5, "a"), (12, "a")]]


def test_requests_of_10_mib_and_more_get_their_size_rounded_to_2_mib():
    a = run([("a", 1, 11 * MIB + 1)])
    assert (a.reserved, a.allocated) == (12 * MIB, 12 * MIB)  # 1 MiB - 512 B left: not split
    a = run([("a", 1, 10 * MIB)])
    assert a.reserved == 10 * MIB


def test_a_freed_block_is_reused_best_fit():
    a = run([("a", "x", 100 * MIB), ("a", "y", 40 * MIB), ("f", "x"), ("f", "y"), ("a", "z", 30 * MIB)])
    assert a.reserved == 140 * MIB  # the 40 MiB block is the best fit: no new segment
    assert blocks(a) == [[(100, "i")], [(30, "a"), (10, "i")]]


def test_a_block_stranded_in_its_segment_forces_a_new_one():
    # the prefill's pattern: an intermediate's block is reused by a smaller tensor, and what remains of it
    # is too small for the next one
    a = run([("a", "A", 100 * MIB), ("a", "B", 100 * MIB), ("f", "A"), ("a", "C", 60 * MIB), ("a", "D", 50 * MIB)])
    assert (a.allocated, a.reserved) == (210 * MIB, 250 * MIB)
    a.free("C")  # C merges with the 40 MiB left beside it: the whole segment is free again
    assert blocks(a)[0] == [(100, "i")]


def test_no_merging_across_segments_and_coalescing_within_one():
    a = run([("a", 1, 20 * MIB), ("a", 2, 20 * MIB), ("f", 1), ("f", 2), ("a", 3, 40 * MIB)])
    assert a.reserved == 80 * MIB
    a = run([("a", 1, 3 * MIB), ("a", 2, 3 * MIB), ("a", 3, 3 * MIB), ("f", 1), ("f", 2)])
    assert blocks(a) == [[(6, "i"), (3, "a"), (11, "i")]]
    a.malloc(4, 6 * MIB)  # the merged 6 MiB block is the best fit, not the 11 MiB tail
    assert blocks(a) == [[(6, "a"), (3, "a"), (11, "i")]] and a.reserved == 20 * MIB


def test_small_and_large_pools_never_share_a_segment():
    a = run([("a", 1, 3 * MIB), ("a", 2, 1 * MIB)])  # 1 MiB exactly is small
    assert a.reserved == 22 * MIB
    assert [s["segment_type"] for s in a.snapshot()] == ["large", "small"]


def test_max_split_size_keeps_oversize_blocks_whole_and_their_reuse_rule():
    conf = parse_alloc_conf("max_split_size_mb:64")
    # default: the freed 100 MiB block is split for a 30 MiB request
    assert run([("a", 1, 100 * MIB), ("f", 1), ("a", 2, 30 * MIB)]).reserved == 100 * MIB
    # with 64: a request under 64 MiB never takes a block of 64 MiB or more
    a = run([("a", 1, 100 * MIB), ("f", 1), ("a", 2, 30 * MIB)], conf)
    assert a.reserved == 130 * MIB
    # a request of 64 MiB or more takes it whole when it is under 20 MiB larger (no split) ...
    a.malloc(3, 90 * MIB)
    assert (a.reserved, a.allocated) == (130 * MIB, 130 * MIB)
    # ... and not when it is 20 MiB larger or more
    a = run([("a", 1, 100 * MIB), ("f", 1), ("a", 2, 80 * MIB)], conf)
    assert a.reserved == 180 * MIB
    # an oversize fresh segment is never split either
    a = run([("a", 1, 70 * MIB)], parse_alloc_conf("max_split_size_mb:64"))
    assert blocks(a) == [[(70, "a")]]


def test_roundup_power2_divisions():
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(5 * MIB + 1, four) == 6 * MIB  # [4, 8) MiB in four steps of 1 MiB
    assert round_size(4 * MIB, four) == 4 * MIB  # a power of two is kept
    assert round_size(1500, four) == 1536  # under 512 x 4 bytes: 512-byte rounding
    # torch's list form fills from the last named interval on, that interval included
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,>:4]")
    assert conf.roundup_power2_divisions[:8] == (1,) * 8 and conf.roundup_power2_divisions[8:] == (4,) * 8
    conf = parse_alloc_conf("roundup_power2_divisions:[64:8,256:4]")
    assert conf.roundup_power2_divisions[6] == 8 and conf.roundup_power2_divisions[8] == 4
    assert round_size(65 * MIB, conf) == 72 * MIB  # [64, 128) MiB in eight steps of 8 MiB


def test_expandable_segments_grow_one_segment_by_pages():
    exp = parse_alloc_conf("expandable_segments:True")
    a = run([("a", 1, 3 * MIB)], exp)
    assert a.reserved == 20 * MIB  # one 20 MiB page of the large pool
    a.malloc(2, 30 * MIB)  # the 17 MiB free tail grows by one page: 37 MiB, 30 of them taken
    assert (a.reserved, a.allocated) == (40 * MIB, 33 * MIB)
    assert blocks(a) == [[(3, "a"), (30, "a"), (7, "i")]]
    # the pattern that needs a second segment by default is one grown segment here
    steps = [("a", "A", 100 * MIB), ("f", "A"), ("a", "B", 120 * MIB)]
    assert run(steps).reserved == 220 * MIB
    assert run(steps, exp).reserved == 120 * MIB
    # the small pool's pages are 2 MiB
    assert run([("a", 1, 512)], exp).reserved == 2 * MIB


def test_expandable_best_fit_passes_over_the_growable_tail():
    exp = parse_alloc_conf("expandable_segments:True")
    # free blocks: 10 MiB inside, 10 MiB at the tail (20 MiB page: 10 + 10 used) -> a 4 MiB request takes
    # the inner one, so the tail stays whole for growing
    a = run([("a", 1, 10 * MIB), ("a", 2, 10 * MIB), ("a", 3, 10 * MIB), ("f", 2)], exp)
    assert blocks(a) == [[(10, "a"), (10, "i"), (10, "a"), (10, "i")]]
    a.malloc(4, 4 * MIB)
    assert blocks(a) == [[(10, "a"), (4, "a"), (6, "i"), (10, "a"), (10, "i")]]


def test_garbage_collection_needs_a_fraction_and_frees_old_whole_segments():
    gc = parse_alloc_conf("garbage_collection_threshold:0.5,per_process_memory_fraction:1.0")
    steps = [("a", "A", 60 * MIB), ("f", "A"), ("a", "B", 70 * MIB), ("f", "B"), ("a", "C", 80 * MIB)]
    # reserved 130 MiB > half of 200 when C finds no block: A's segment (2 searches old, the average
    # 1.5) goes back, B's (1) stays
    a = run(steps, gc, capacity=200 * MIB)
    assert (a.reserved, a.peak_reserved) == (150 * MIB, 150 * MIB)
    assert sorted(s["total_size"] // MIB for s in a.snapshot()) == [70, 80]
    # without the threshold the device fills first: cudaMalloc fails, every cached segment is released
    a = run(steps, DEFAULT_CONF, capacity=200 * MIB)
    assert (a.reserved, a.peak_reserved) == (80 * MIB, 130 * MIB)
    # without a memory fraction the threshold does nothing (torch's set_fraction guard)
    a = run(steps, parse_alloc_conf("garbage_collection_threshold:0.5"), capacity=1000 * MIB)
    assert a.reserved == 210 * MIB


def test_out_of_memory_stops_the_replay_and_says_so():
    r = replay([(ALLOC, 1, 60 * MIB), (ALLOC, 2, 60 * MIB)], capacity=100 * MIB)
    assert r.oom and "requested" in r.oom and r.reserved == 60 * MIB


def test_marks_give_reserved_allocated_and_their_peaks_since_the_last_mark():
    events = [(ALLOC, "w", 30 * MIB), (MARK, "load", 0), (ALLOC, "t", 50 * MIB), (FREE, "t", 0),
              (ALLOC, "u", 10 * MIB), (MARK, "prefill", 0)]
    r = replay(events)
    assert r.marks["load"].reserved == 30 * MIB
    p = r.marks["prefill"]
    assert (p.reserved, p.allocated, p.peak_reserved, p.peak_allocated) == (80 * MIB, 40 * MIB, 80 * MIB, 80 * MIB)
    assert r.peak_reserved == 80 * MIB and r.segments_made == 2


BAD = ["foo:1", "max_split_size_mb:10", "expandable_segments:true", "garbage_collection_threshold:1.5",
       "max_split_size_mb", "roundup_power2_divisions:3", "roundup_power2_divisions:[256:3]",
       "max_split_size_mb:abc", "expandable_segments:True:False", "backend:cudaMallocAsync", "backend:other",
       "max_split_size_mb:64 expandable_segments:True", "roundup_power2_divisions:[256:1"]
GOOD = ["", "expandable_segments:True", "max_split_size_mb:64,garbage_collection_threshold:0.6",
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", "expandable_segments:False , max_split_size_mb:20",
        "max_non_split_rounding_mb:30", "pinned_use_background_threads:True,expandable_segments:True",
        "expandable_segments:True,,max_split_size_mb:40", "backend:native", "per_process_memory_fraction:0.5"]


@pytest.mark.parametrize("text", BAD)
def test_bad_settings_are_one_line(text):
    with pytest.raises(AllocConfError) as exc:
        parse_alloc_conf(text)
    assert "\n" not in str(exc.value) and str(exc.value).startswith("--alloc-conf")


@pytest.mark.parametrize("text", GOOD)
def test_good_settings_parse(text):
    parse_alloc_conf(text)


def test_the_parser_agrees_with_torchs_own():
    """torch's CPU build parses the settings (the CUDA hook aside: its unknown keys, and the
    cudaMallocAsync backend, which vramcal refuses on purpose, are left out here)."""
    torch = pytest.importorskip("torch")
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        pytest.skip("this torch has no settings parser outside CUDA")
    try:
        for text in [t for t in BAD + GOOD if not t.startswith(("foo", "backend"))]:
            try:
                setter(text)
                torch_ok = True
            except Exception:  # noqa: BLE001 -- torch raises RuntimeError or ValueError
                torch_ok = False
            try:
                parse_alloc_conf(text)
                ours = True
            except AllocConfError:
                ours = False
            assert ours == torch_ok, text
    finally:
        setter("")


def test_settings_come_from_the_flag_then_the_environment():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert conf_from(None, env).expandable_segments and conf_from(None, env).source == "PYTORCH_ALLOC_CONF"
    del env["PYTORCH_ALLOC_CONF"]
    assert conf_from(None, env).max_split_size == 64 * MIB
    assert conf_from("expandable_segments:True", env).source == "--alloc-conf"
    assert conf_from(None, {}) is DEFAULT_CONF
    with pytest.raises(AllocConfError, match="PYTORCH_CUDA_ALLOC_CONF"):
        conf_from(None, {"PYTORCH_CUDA_ALLOC_CONF": "nope:1"})


def test_equal_settings_share_a_key():
    assert parse_alloc_conf("expandable_segments:True").key == parse_alloc_conf(" expandable_segments : True ").key
    assert parse_alloc_conf("expandable_segments:False").key == DEFAULT_CONF.key == ""
