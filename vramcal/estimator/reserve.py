"""What the caching allocator reserves on one GPU, from the load's and the dry run's allocations replayed
(:mod:`vramcal.estimator.allocator`). Pure arithmetic over events; no torch.

The load, as ``from_pretrained`` makes it (transformers 5): ``caching_allocator_warmup`` allocates one
block of the checkpoint's bytes on the device and frees it (its segment stays reserved, and the weights
are then carved out of it); then every weight tensor is allocated -- with bitsandbytes quantizing on the
fly, each quantized weight's 16-bit source first, its packed tensors, then the source freed. The weights
come in the inventory's order of sizes (the order the loader first meets each size), the tensors bitsandbytes
quantizes after those it keeps (the embeddings lead a checkpoint); once the warmup block holds them the
order decides little, without it how tensors of 1 to 10 MiB share 20 MiB segments.

A format whose first forward rewrites the weights (compressed-tensors decompresses every quantized module
then: :meth:`~vramcal.estimator.formats.Format.first_forward`) adds that, module by module, after the load:
each module's new tensors allocated, then the stored ones it drops freed (one of that size from the load).

Then the dry run's prefill and decode step, with the cuBLAS workspace allocated through the caching allocator
where torch allocates it: right after the first cuBLAS product's output (``dryrun.WORKSPACE_MARK``). What the stage rules take from it, per allocator setting: the reserve after
loading, and at the prefill's and the decode step's peaks the *slack*: reserved minus the highest
allocated in that stretch (segments' rounding, blocks stranded in their segments, a warmup block's
unused rest). Between traced points the slack is interpolated (:func:`slack_at`).
"""

from __future__ import annotations

from .allocator import ALLOC, FREE, MARK, WORKSPACE_MARK, AllocConf, CachingAllocator, replay
from .quant import DTYPE_BYTES, bnb4_tensors, bnb8_tensors


def load_events(inv, quant, on_the_fly: bool) -> list[tuple]:
    """The load's allocations in order, then the first forward's rewrite of the weights where the format has
    one (module doc), from an :class:`~vramcal.estimator.inventory.Inventory`."""
    out: list[tuple] = []
    if inv.warmup_bytes:
        out += [(ALLOC, "warmup", inv.warmup_bytes // 2 * 2), (FREE, "warmup", 0)]
    sizes = dict(inv.alloc_sizes)
    quantized: list[tuple] = []
    n = 0
    if on_the_fly and inv.quantized_shapes:
        src_bytes = DTYPE_BYTES.get(inv.dtype, 2)
        for o, i, count in inv.quantized_shapes:
            parts = bnb4_tensors(o * i, quant.double_quant) if quant.method == "bnb4" else bnb8_tensors(o, i)
            for _ in range(count):
                quantized.append((ALLOC, ("source", n), o * i * src_bytes))
                for _, b in parts:
                    quantized.append((ALLOC, ("w", n, b), b))
                    sizes[b] = sizes.get(b, 0) - 1
                quantized.append((FREE, ("source", n), 0))
                n += 1
    # the tensors kept as they are first (the embeddings lead the checkpoint), then the quantized ones
    for b, count in sizes.items():
        for k in range(max(count, 0)):
            out.append((ALLOC, ("w", b, k), b))
    out += quantized
    out.append((MARK, "load", 0))
    if inv.first_forward:
        left = {b: max(n, 0) for b, n in sizes.items()}
        for m, (new, freed) in enumerate(inv.first_forward):
            out += [(ALLOC, ("run", m, j), b) for j, b in enumerate(new)]
            for b in freed:
                if left.get(b, 0) > 0:  # a tensor of the load's of that size
                    left[b] -= 1
                    out.append((FREE, ("w", b, left[b]), 0))
        out.append((MARK, "first_forward", 0))
    return out


def loaded(events: list[tuple], conf: AllocConf) -> tuple[CachingAllocator, tuple[int, int]]:
    """The allocator after the load (and the first forward's rewrite of the weights, where the events have
    one), and (reserved at the load's peak, after it) -- the same, as nothing is released."""
    a = CachingAllocator(conf)
    r = replay(events, allocator=a)
    return a, (r.marks["load"].peak_reserved, r.marks["load"].reserved)


def trace_slack(load: list[tuple], events: list[tuple], workspace_bytes: int, conf: AllocConf) -> list[int] | None:
    """[slack at the prefill's peak, at the decode step's] for one trace's ``events`` after ``load``, the
    workspace allocated at the trace's first :data:`WORKSPACE_MARK` (as the prefill starts where it has none;
    any other such mark is dropped); None when the events lack their marks."""
    a, _ = loaded(load, conf)
    # where torch allocates it: after the first cuBLAS call's output (dryrun.WORKSPACE_MARK); a trace without the
    # mark (no call reached cuBLAS) as the prefill starts
    at = next((i for i, e in enumerate(events) if e[0] == MARK and e[1] == WORKSPACE_MARK), 0)
    workspace = [(ALLOC, "cublas-workspace", workspace_bytes)] if workspace_bytes else []
    rest = [e for e in events if not (e[0] == MARK and e[1] == WORKSPACE_MARK)]
    r = replay(rest[:at] + workspace + rest[at:], allocator=a)  # no mark before ``at``: the indices agree
    if "prefill" not in r.marks or "decode" not in r.marks:
        return None
    p, d = r.marks["prefill"], r.marks["decode"]
    return [max(p.reserved - p.peak_allocated, 0), max(d.reserved - d.peak_allocated, 0)]


# the slack's ladder (:func:`slack_nodes`): the activation fit's points, then every power of two up to 2**24
# tokens (the estimator's COVER_LIMIT, the longest batch-1 trace it makes)
SLACK_LADDER = (512, 2048, 8192) + tuple(1 << k for k in range(14, 25))


def slack_nodes(tokens: int) -> tuple[int, ...]:
    """The batch-1 token counts the slack at ``tokens`` (batch x seq) is interpolated from: the two nodes
    of :data:`SLACK_LADDER` around it (the first alone below it, the last two beyond it). Fixed, so the
    figure between traced points is the same whatever else was traced: the slack is not convex in the
    tokens (a segment's rounding comes and goes), and an interpolation over the traces one happens to
    have moves with them."""
    ladder = SLACK_LADDER
    if tokens <= ladder[0]:
        return ladder[:1]
    for lo, hi in zip(ladder, ladder[1:]):
        if tokens <= hi:
            return lo, hi
    return ladder[-2:]


def slack_at(traces, batch: int, seq: int, key: str) -> tuple[int, int] | None:
    """The slack at (batch, seq) for the settings ``key``: the trace's own where it was traced, else
    linear between the batch-1 traces in tokens (batch x seq), and beyond them along the last two (the
    stranded blocks grow with the tokens); None without any."""
    for t in traces:
        if t.batch == batch and t.tokens == seq and key in t.slack:
            s = t.slack[key]
            return s[0], s[1]
    pts = sorted({t.tokens: t.slack[key] for t in traces if t.batch == 1 and key in t.slack}.items())
    if not pts:
        return None
    n = batch * seq
    if n <= pts[0][0] or len(pts) == 1:
        return pts[0][1][0], pts[0][1][1]
    i = next((k for k in range(1, len(pts)) if pts[k][0] >= n), len(pts) - 1)
    (n0, y0), (n1, y1) = pts[i - 1], pts[i]
    w = (n - n0) / (n1 - n0)
    return max(int(y0[0] + (y1[0] - y0[0]) * w), 0), max(int(y0[1] + (y1[1] - y0[1]) * w), 0)
