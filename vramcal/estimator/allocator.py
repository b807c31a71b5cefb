"""The CUDA caching allocator, replayed: what ``torch.cuda.memory_reserved`` will be, from an ordered trace
of allocations and frees. Pure Python, no torch import.

The rules are torch's own (``c10/cuda/CUDACachingAllocator.cpp``, ``c10/core/AllocatorConfig.{h,cpp}``,
``c10/cuda/CUDAAllocatorConfig.h``; torch 2.11 - 2.13 agree on every rule used here). Each is named next
to the code that follows it and in docs/accounting.md:

- ``round_size``: every request is rounded up to 512 bytes (``kMinBlockSize``), or, where
  ``roundup_power2_divisions`` gives the request's power-of-two interval ``d > 1`` divisions and the request
  exceeds ``512 * d``, up to the next of ``d`` equal steps between two powers of two;
- ``get_pool``: requests of at most 1 MiB (``kSmallSize``) come from the small pool, the rest from the large;
- ``get_allocation_size``: a new segment is 2 MiB for the small pool (``kSmallBuffer``), 20 MiB
  (``kLargeBuffer``) for a large request under 10 MiB (``kMinLargeAlloc``), else the request rounded up to
  2 MiB (``kRoundLarge``);
- ``get_free_block``: the smallest free block of the pool and stream that holds the request (blocks are
  ordered by stream, size, address); with ``max_split_size_mb`` a request under it never takes a block of
  at least that size, and a request of at least that size takes a block only if it is less than
  ``max_non_split_rounding_mb`` (20 MiB) larger;
- ``should_split``: the rest of the block is split off when at least 512 bytes remain (small pool, or any
  pool with expandable segments), or, in the large pool, when the request is under ``max_split_size`` and
  more than 1 MiB remains;
- ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours in the same segment
  only; segments are never merged;
- ``garbage_collect_cached_blocks``: only where a per-process memory fraction is set
  (``per_process_memory_fraction`` or ``torch.cuda.set_per_process_memory_fraction``), and only when reserved
  exceeds ``garbage_collection_threshold`` of the allowed memory, before a new segment is made: whole free
  large-pool segments at least as old as the average (in the pool's searches since they were freed) are
  released until enough is reclaimed;
- ``alloc_block`` fails when reserved + the new segment would pass the allowed memory (the fraction, or the
  device memory given to the replay); then ``release_available_cached_blocks`` (oversize blocks, with
  ``max_split_size_mb``) and ``release_cached_blocks`` (every whole free segment) run before the last try;
- expandable segments (``expandable_segments:True``): one segment per pool and stream whose mapped part
  grows in pages of 2 MiB (small pool) or 20 MiB (large pool) at its end; a request no free block holds is
  placed at the segment's free tail, and only the pages it lacks are mapped (``find_expandable_block``,
  ``map_block``); best fit passes over the tail while another free block fits. Freed pages stay mapped
  until an ``empty_cache`` or an out-of-memory retry (which here unmaps the free tail's whole pages only:
  pages freed inside the segment are not unmapped by the replay).

A trace is a list of events: ``(ALLOC, key, bytes)`` and ``(FREE, key, 0)`` (``key``: anything hashable,
unique while the block lives), and ``(MARK, name, 0)`` between stages. One stream is assumed (the
default stream: transformers' generate runs on it). :func:`replay` returns the reserved and allocated
bytes at each mark, their peaks since the previous one, and the segments at the end (the shape of
``torch.cuda.memory_snapshot()``, for a segment-by-segment comparison).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

MIB = 1024**2
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: a small-pool segment, and an expandable small segment's page
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: the segment of a large request under kMinLargeAlloc; expandable page
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
POW2_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one per power of two
UNLIMITED = (1 << 64) - 1  # std::numeric_limits<size_t>::max(): max_split_size's default

ALLOC, FREE, MARK = 0, 1, 2
# the mark a dry run leaves after the first cuBLAS product's output, where torch allocates the cuBLAS workspace
# (:func:`vramcal.estimator.reserve.trace_slack` allocates it there)
WORKSPACE_MARK = "cublas-workspace"

# keys torch 2.13 accepts (AllocatorConfig.h keys_ and CUDAAllocatorConfig::getKeys) that change nothing
# the replay models (pinned host memory, lock handling, graph capture, error policy)
NO_EFFECT_KEYS = frozenset({
    "pinned_use_background_threads", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb", "pinned_num_register_threads", "pinned_free_catch_all",
    "throw_on_cudamalloc_oom", "expandable_segments_reserve", "expandable_segments_reserve_by_class",
})
MODELLED_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
                 "roundup_power2_divisions", "expandable_segments", "per_process_memory_fraction", "backend")
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch reads the first before the second


class AllocConfError(ValueError):
    """An allocator setting that does not parse, or one torch does not know (one line)."""


@dataclass(frozen=True)
class AllocConf:
    """The caching allocator's settings, as torch parses ``PYTORCH_ALLOC_CONF``. Sizes in bytes."""

    max_split_size: int = UNLIMITED
    max_non_split_rounding: int = LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * POW2_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float | None = None
    text: str = ""  # as given
    source: str = "default"  # --alloc-conf | PYTORCH_ALLOC_CONF | PYTORCH_CUDA_ALLOC_CONF | default

    @property
    def key(self) -> str:
        """What decides the replay's outcome, as text (the same for two spellings of one setting)."""
        parts = []
        if self.max_split_size != UNLIMITED:
            parts.append(f"max_split_size_mb:{self.max_split_size // MIB}")
        if self.max_non_split_rounding != LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MIB}")
        if any(self.roundup_power2_divisions):
            parts.append("roundup_power2_divisions:[" + ",".join(
                f"{1 << i}:{d}" for i, d in enumerate(self.roundup_power2_divisions)) + "]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction}")
        return ",".join(parts)

    def with_expandable(self) -> AllocConf:
        """The same settings with ``expandable_segments:True`` added (what plan / fit suggest)."""
        text = ",".join(p for p in (self.text, "expandable_segments:True") if p)
        return replace(self, expandable_segments=True, text=text)


DEFAULT_CONF = AllocConf()
EXPANDABLE_CONF = DEFAULT_CONF.with_expandable()


def _tokens(text: str) -> list[str]:
    """torch's ConfigTokenizer: ``,`` ``:`` ``[`` ``]`` are tokens of their own, whitespace is dropped."""
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        out.append(buf)
    return out


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parse_alloc_conf(text: str, source: str = "--alloc-conf") -> AllocConf:
    """``text`` as torch 2.13 parses it (AllocatorConfig.cpp ``parseArgs`` and the CUDA hook). Every check
    torch makes is made here; a key torch does not know, a value it refuses, or
    ``backend:cudaMallocAsync`` (the driver's allocator, whose rules are not these) raise
    :class:`AllocConfError` with one line naming ``source``."""
    tok = _tokens(text or "")
    kw: dict = {}
    i = 0

    def fail(why: str):
        raise AllocConfError(f"{source} {text!r}: {why}")

    def value(key: str) -> str:
        nonlocal i
        if i + 1 >= len(tok) or tok[i + 1] != ":":
            fail(f"{key} needs a value (write {key}:VALUE)")
        i += 2
        if i >= len(tok) or tok[i] in ",:]":
            fail(f"{key} needs a value (write {key}:VALUE)")
        return tok[i]

    def integer(key: str, v: str) -> int:
        if not v.isdigit():
            fail(f"{key} takes a whole number, not {v!r}")
        return int(v)

    while i < len(tok):
        key = tok[i]
        if key == ",":  # an empty item (``a:1,,b:2``): torch skips it too
            i += 1
            continue
        if key in ":[]":
            fail(f"unexpected {key!r} where a setting's name belongs")
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            n = integer(key, value(key))
            if n < LARGE_BUFFER // MIB:
                fail(f"{key} too small, must be >= {LARGE_BUFFER // MIB}")
            kw["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = \
                min(n, UNLIMITED // MIB) * MIB
        elif key == "garbage_collection_threshold":
            v = value(key)
            try:
                t = float(v)
            except ValueError:
                fail(f"{key} takes a number in (0.0, 1.0), not {v!r}")
            if not 0.0 < t < 1.0:
                fail(f"{key} must be in (0.0, 1.0), not {v}")
            kw["garbage_collection_threshold"] = t
        elif key == "per_process_memory_fraction":
            v = value(key)
            try:
                f = float(v)
            except ValueError:
                fail(f"{key} takes a number in [0.0, 1.0], not {v!r}")
            if not 0.0 <= f <= 1.0:
                fail(f"{key} must be in [0.0, 1.0], not {v}")
            kw["per_process_memory_fraction"] = f
        elif key == "expandable_segments":
            v = value(key)
            if v not in ("True", "False"):
                fail(f"expandable_segments takes True or False (capitalised, as torch reads it), not {v!r}")
            kw["expandable_segments"] = v == "True"
        elif key == "backend":
            v = value(key)
            if v == "cudaMallocAsync":
                fail("backend:cudaMallocAsync is the driver's stream-ordered allocator, whose reservations "
                     "vramcal does not replay; use backend:native (the default) or drop it")
            if v != "native":
                fail(f"unknown allocator backend {v!r}: torch knows native and cudaMallocAsync")
        elif key == "roundup_power2_divisions":
            kw["roundup_power2_divisions"], i = _divisions(tok, i, fail)
        elif key in NO_EFFECT_KEYS:
            v = value(key)
            if v == "[":
                while i < len(tok) and tok[i] != "]":
                    i += 1
                if i >= len(tok):
                    fail(f"{key}: a '[' without its ']'")
        else:
            known = ", ".join(MODELLED_KEYS)
            fail(f"unknown allocator setting {key!r} (torch 2.13 knows {known} and a few pinned-memory ones)")
        i += 1
        if i < len(tok):
            if tok[i] != ",":
                fail(f"expected ',' after {key}'s value, got {tok[i]!r}")
            i += 1
    return AllocConf(**kw, text=text or "", source=source if text else "default")


def _divisions(tok: list[str], i: int, fail) -> tuple[tuple[int, ...], int]:
    """``roundup_power2_divisions:4`` (every interval) or ``:[256:1,512:2,>:8]`` (intervals by their
    lower bound in MiB, a power of two; ``>`` for the rest): the 16 divisions, and the index of the
    setting's last token."""
    key = "roundup_power2_divisions"
    if i + 2 >= len(tok) or tok[i + 1] != ":":
        fail(f"{key} needs a value (write {key}:4 or {key}:[256:1,>:4])")
    i += 2
    out = [0] * POW2_INTERVALS
    if tok[i] != "[":
        if not tok[i].isdigit() or not _pow2(int(tok[i])):
            fail(f"{key} takes a power of two, not {tok[i]!r}")
        return (int(tok[i]),) * POW2_INTERVALS, i
    first, last = True, 0
    i += 1
    while i < len(tok) and tok[i] != "]":
        bound = tok[i]
        if i + 2 >= len(tok) or tok[i + 1] != ":" or not tok[i + 2].isdigit():
            fail(f"{key}: write each interval as MiB:DIVISIONS, e.g. [256:1,>:4]")
        d = int(tok[i + 2])
        if d != 0 and not _pow2(d):
            fail(f"{key}: the divisions must be a power of two or 0, not {d}")
        if bound == ">":
            out[last:] = [d] * (POW2_INTERVALS - last)
        else:
            if not bound.isdigit() or not _pow2(int(bound)):
                fail(f"{key}: the intervals must be powers of two (MiB), not {bound!r}")
            index = min(int(bound).bit_length() - 1, POW2_INTERVALS - 1)
            if first:
                out[:index] = [d] * index
                first = False
            out[index] = d
            last = index
        i += 3
        if i < len(tok) and tok[i] == ",":
            i += 1
    if i >= len(tok):
        fail(f"{key}: a '[' without its ']'")
    return tuple(out), i


def conf_from(flag: str | None = None, environ: dict | None = None) -> AllocConf:
    """The settings a run will have: ``--alloc-conf`` where given, else ``PYTORCH_ALLOC_CONF``, else
    ``PYTORCH_CUDA_ALLOC_CONF`` (torch's own order), else the defaults."""
    if flag is not None:
        return parse_alloc_conf(flag, "--alloc-conf")
    import os

    env = os.environ if environ is None else environ
    for name in ENV_VARS:
        if env.get(name):
            return parse_alloc_conf(env[name], name)
    return DEFAULT_CONF


def round_size(size: int, conf: AllocConf = DEFAULT_CONF) -> int:
    """``round_size`` (CUDACachingAllocator.cpp) with ``roundup_power2_next_division``."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    index = min(max(size.bit_length() - 1 - 20, 0), POW2_INTERVALS - 1)  # AllocatorConfig::roundup_power2_divisions
    d = conf.roundup_power2_divisions[index]
    if d > 1 and size > MIN_BLOCK * d:
        if _pow2(size):
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (d.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a request that no free block holds makes."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class OutOfMemory(Exception):
    """The replay ran out of the device memory it was given (``capacity``)."""


class _Block:
    __slots__ = ("addr", "size", "seg", "allocated", "prev", "next", "gc_base", "requested")

    def __init__(self, addr, size, seg, prev=None, nxt=None):
        self.addr, self.size, self.seg = addr, size, seg
        self.allocated = False
        self.prev, self.next = prev, nxt
        self.gc_base = 0
        self.requested = 0


class _Segment:
    __slots__ = ("base", "size", "small", "expandable", "head")

    def __init__(self, base, size, small, expandable):
        self.base, self.size, self.small, self.expandable = base, size, small, expandable
        self.head = None


class _Pool:
    """Free blocks of one pool, ordered as torch's BlockComparatorSize orders them (size, address; one
    stream): a sorted list searched by bisection."""

    __slots__ = ("small", "keys", "blocks", "searches", "expandable")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, _Block] = {}
        self.searches = 0  # get_free_blocks_call_count
        self.expandable: _Segment | None = None

    def insert(self, b: _Block) -> None:
        b.gc_base = self.searches
        bisect.insort(self.keys, (b.size, b.addr))
        self.blocks[b.addr] = b

    def remove(self, b: _Block) -> None:
        i = bisect.bisect_left(self.keys, (b.size, b.addr))
        del self.keys[i]
        del self.blocks[b.addr]


@dataclass
class Figures:
    """At a mark: bytes reserved and allocated now, and their highest since the previous mark."""

    reserved: int
    allocated: int
    peak_reserved: int
    peak_allocated: int


@dataclass
class Replay:
    """What :func:`replay` found: figures at each mark, the highest reserved and allocated over the whole
    trace, and how many segments (cudaMalloc calls or mapped pages) were made."""

    conf: AllocConf
    marks: dict[str, Figures] = field(default_factory=dict)
    peak_reserved: int = 0
    peak_allocated: int = 0
    reserved: int = 0
    allocated: int = 0
    segments_made: int = 0
    oom: str | None = None  # why the replay stopped: a request the device memory given could not hold


class CachingAllocator:
    """One device's caching allocator (one stream), fed :meth:`malloc` and :meth:`free` in order.

    ``capacity``: the bytes the allocator can get from the driver (the device's free memory after the
    context); None: unbounded, which never releases a cached segment."""

    def __init__(self, conf: AllocConf = DEFAULT_CONF, capacity: int | None = None):
        self.conf = conf
        self.capacity = capacity
        frac = conf.per_process_memory_fraction
        self.allowed = None if capacity is None else int(capacity * frac) if frac is not None else capacity
        self.set_fraction = frac is not None and capacity is not None
        self.pools = (_Pool(small=True), _Pool(small=False))
        self.live: dict[object, _Block] = {}
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.segments: dict[int, _Segment] = {}
        self.segments_made = 0
        self._next_addr = 1 << 40

    # ------------------------------------------------------------------ torch's malloc
    def malloc(self, key, nbytes: int) -> int:
        """Allocate ``nbytes`` for ``key``; returns the block's size. Raises :class:`OutOfMemory`."""
        conf = self.conf
        size = round_size(nbytes, conf)
        pool = self.pools[0] if size <= SMALL_SIZE else self.pools[1]
        block = self._free_block(pool, size)
        if block is None:
            gc = self.set_fraction and conf.garbage_collection_threshold > 0.0
            if gc:
                self._garbage_collect()
            block = self._new_block(pool, size)
            if block is None and self._release_available(pool, size):
                block = self._new_block(pool, size)
            if block is None:
                self._release_cached()
                block = self._new_block(pool, size)
            if block is None:
                raise OutOfMemory(f"{size:,} bytes requested with {self.reserved:,} reserved "
                                  f"({self.allocated:,} allocated) of {self.allowed:,} allowed")
        if self._should_split(pool, block, size):
            rest = _Block(block.addr + size, block.size - size, block.seg, prev=block, nxt=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        block.requested = nbytes
        self.live[key] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block.size

    def _should_split(self, pool: _Pool, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if pool.small or self.conf.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.conf.max_split_size and remaining > SMALL_SIZE

    def _free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit, the expandable tail passed over while another block fits, and
        max_split_size's two rules for oversize blocks."""
        conf = self.conf
        if self.set_fraction and conf.garbage_collection_threshold > 0.0:
            pool.searches += 1
        keys = pool.keys
        i = bisect.bisect_left(keys, (size, 0))
        if i == len(keys):
            return None
        b = pool.blocks[keys[i][1]]
        if b.seg.expandable and self._is_tail(b) and i + 1 < len(keys):
            b = pool.blocks[keys[i + 1][1]]  # any other fitting block is "smaller" than the growable tail
        mss = conf.max_split_size
        if size < mss and b.size >= mss:
            return None
        if size >= mss and b.size >= size + conf.max_non_split_rounding:
            return None
        pool.remove(b)
        return b

    @staticmethod
    def _is_tail(b: _Block) -> bool:
        return b.next is None and b.addr + b.size == b.seg.base + b.seg.size

    def _new_block(self, pool: _Pool, size: int) -> _Block | None:
        """``alloc_block``: a new segment (cudaMalloc) or, with expandable segments, the pages the
        segment's free tail lacks. None when the allowed memory cannot hold it."""
        if self.conf.expandable_segments:
            return self._expand(pool, size)
        grow = allocation_size(size)
        if self.allowed is not None and self.reserved + grow > self.allowed:
            return None
        seg = _Segment(self._next_addr, grow, pool.small, expandable=False)
        self._next_addr += grow + LARGE_BUFFER  # a gap: no two segments are ever adjacent
        b = _Block(seg.base, grow, seg)
        seg.head = b
        self.segments[seg.base] = seg
        self.segments_made += 1
        self._reserve(grow)
        return b

    def _expand(self, pool: _Pool, size: int) -> _Block | None:
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        seg = pool.expandable
        if seg is None:
            seg = pool.expandable = _Segment(self._next_addr, 0, pool.small, expandable=True)
            self._next_addr += 1 << 50  # the address space of a whole device and more
            self.segments[seg.base] = seg
        tail = seg.head
        while tail is not None and tail.next is not None:
            tail = tail.next
        have = tail.size if tail is not None and not tail.allocated else 0
        grow = -(-(size - have) // page) * page
        if self.allowed is not None and self.reserved + grow > self.allowed:
            return None
        self.segments_made += grow // page
        self._reserve(grow)
        end = seg.base + seg.size
        seg.size += grow
        if have:
            pool.remove(tail)
            tail.size += grow
            return tail
        b = _Block(end, grow, seg, prev=tail)
        if tail is not None:
            tail.next = b
        else:
            seg.head = b
        return b

    def _reserve(self, n: int) -> None:
        self.reserved += n
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    # ------------------------------------------------------------------ torch's free
    def free(self, key) -> None:
        """``free_block``: the block merges with its free neighbours in its segment and is cached."""
        b = self.live.pop(key)
        b.allocated = False
        self.allocated -= b.size
        pool = self.pools[0] if b.seg.small else self.pools[1]
        for other in (b.prev, b.next):
            if other is not None and not other.allocated:
                pool.remove(other)
                if other is b.prev:
                    b.addr, b.prev = other.addr, other.prev
                    if other.prev is not None:
                        other.prev.next = b
                    else:
                        b.seg.head = b
                else:
                    b.next = other.next
                    if other.next is not None:
                        other.next.prev = b
                b.size += other.size
        pool.insert(b)

    # ------------------------------------------------------------------ giving memory back
    def _release_segment(self, pool: _Pool, b: _Block) -> None:
        pool.remove(b)
        del self.segments[b.seg.base]
        self.reserved -= b.size

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: whole free large-pool segments of at least the average age,
        until reserved is back under the threshold's share of the allowed memory."""
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.pools[1]
        whole = [pool.blocks[a] for _, a in pool.keys if self._whole(pool.blocks[a])]
        if not whole:
            return
        total_age = sum(pool.searches - b.gc_base for b in whole)
        count = len(whole)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age = total_age / count
            freed = False
            for b in list(whole):
                if pool.searches - b.gc_base >= age:
                    freed = True
                    reclaimed += b.size
                    total_age -= pool.searches - b.gc_base
                    count -= 1
                    whole.remove(b)
                    self._release_segment(pool, b)

    @staticmethod
    def _whole(b: _Block) -> bool:
        return b.prev is None and b.next is None and not b.seg.expandable

    def _release_available(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks`` (only with max_split_size_mb): the smallest oversize free
        segment that holds the request, or the largest ones until enough is freed."""
        mss = self.conf.max_split_size
        if mss == UNLIMITED or self.conf.expandable_segments:
            return False
        need = max(size, mss)
        keys = pool.keys
        i = bisect.bisect_left(keys, (need, 0))
        if i < len(keys):
            b = pool.blocks[keys[i][1]]
            if not self._whole(b):
                return False  # torch's release_block asserts here; a split oversize block never happens
            self._release_segment(pool, b)
            return True
        released = 0
        for _, addr in reversed(list(keys)):
            b = pool.blocks[addr]
            if released >= need or b.size < mss:
                break
            if self._whole(b):
                released += b.size
                self._release_segment(pool, b)
        return released >= need

    def _release_cached(self) -> None:
        """``release_cached_blocks`` (``empty_cache`` too): every whole free segment goes back; with
        expandable segments the free tail's whole pages are unmapped."""
        for pool in self.pools:
            for _, addr in list(pool.keys):
                b = pool.blocks[addr]
                if self._whole(b):
                    self._release_segment(pool, b)
                elif b.seg.expandable and self._is_tail(b):
                    page = SMALL_BUFFER if pool.small else LARGE_BUFFER
                    cut = (b.seg.size - -(-(b.addr - b.seg.base) // page) * page)  # the tail's whole pages
                    if cut:
                        pool.remove(b)
                        b.size -= cut
                        b.seg.size -= cut
                        self.reserved -= cut
                        if b.size:
                            pool.insert(b)
                        elif b.prev is not None:
                            b.prev.next = None
                        else:
                            b.seg.head = None

    def empty_cache(self) -> None:
        self._release_cached()

    # ------------------------------------------------------------------ what it holds
    def snapshot(self) -> list[dict]:
        """The segments, as ``torch.cuda.memory_snapshot()`` lists them (address order): each with
        ``total_size``, ``allocated_size``, ``segment_type`` and its blocks (``size``, ``state``)."""
        out = []
        for base in sorted(self.segments):
            seg = self.segments[base]
            blocks, b = [], seg.head
            while b is not None:
                blocks.append({"size": b.size, "requested_size": b.requested if b.allocated else 0,
                               "state": "active_allocated" if b.allocated else "inactive"})
                b = b.next
            if not blocks:
                continue
            out.append({"total_size": sum(x["size"] for x in blocks),
                        "allocated_size": sum(x["size"] for x in blocks if x["state"] == "active_allocated"),
                        "segment_type": "small" if seg.small else "large", "is_expandable": seg.expandable,
                        "blocks": blocks})
        return out


def replay(events, conf: AllocConf = DEFAULT_CONF, capacity: int | None = None,
           allocator: CachingAllocator | None = None) -> Replay:
    """Feed ``events`` (module doc) through a :class:`CachingAllocator` (a fresh one, or ``allocator``
    continued). An out-of-memory stops the replay and is said in ``oom``."""
    a = allocator or CachingAllocator(conf, capacity)
    out = Replay(conf=a.conf)
    since_r, since_a = a.reserved, a.allocated
    malloc, free = a.malloc, a.free
    try:
        for op, key, size in events:
            if op == ALLOC:
                malloc(key, size)
                if a.reserved > since_r:
                    since_r = a.reserved
                if a.allocated > since_a:
                    since_a = a.allocated
            elif op == FREE:
                free(key)
            else:
                out.marks[key] = Figures(a.reserved, a.allocated, since_r, since_a)
                since_r, since_a = a.reserved, a.allocated
    except OutOfMemory as exc:
        out.oom = str(exc)
    out.peak_reserved, out.peak_allocated = a.peak_reserved, a.peak_allocated
    out.reserved, out.allocated, out.segments_made = a.reserved, a.allocated, a.segments_made
    return out
