"""``fit``: the largest context per quantization and batch that stays within a budget.

One device: the corrected peak (p95 margin) within ``budget - buffer``; on the CPU, where a bitsandbytes
load's resident set has a run-to-run range, its top until this machine has a correction. Split across devices
(``max_memory`` / ``device_map``, docs/placement.md): the placement is planned once per quantization,
and every GPU of the plan that loads must stay within its own budget minus the buffer, each with the
correction of its device position when this machine has one. The questions are asked through
:class:`vramcal.calibrate.search.Search`, as ``plan`` and the what-to-change ladder ask them: each row's
context is bisected on the activation fit, then refined with the exact trace as plan refines its own
(:meth:`~vramcal.calibrate.search.Search.verified_ctx`), so fit and plan give one answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..units import fmt_gib_gb
from ..estimator.estimate import env_prefix, expandable_advice, placement_request
from ..estimator.placement import plan_placement
from ..estimator.resolve import resolve_model
from ..estimator.vision import check_images
from ..workload import NEW_TOKENS, Workload, images_of
from .search import SEARCH_SECONDS, Budget, OutOfTime, Search, bounded, context_limit, stored_corrections

FIT_QUANTS = ("bf16", "int8", "nf4-dq", "nf4")


def prequantized_quants(config: dict) -> tuple[str, ...] | None:
    """A pre-quantized checkpoint's choices: as it loads (``auto``), and its dequantized bf16 load where the
    format has one; None for a checkpoint in 16 bits (or bitsandbytes-serialized: as stored only)."""
    from ..estimator.formats import format_for

    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    fmt = format_for(qc)
    return ("auto", "bf16") if fmt.can_dequantize else ("auto",)
FIT_BATCHES = (1, 2, 4, 8)


@dataclass
class FitRow:
    """The largest context of one quantization and batch within the budget (``max_ctx`` None: not even the
    shortest fits, or the placement is impossible, said in ``error``)."""

    quant: str
    batch: int
    max_ctx: int | None
    new_tokens: int
    peak_bytes: int | None
    device_peaks: dict[str, int] | None = None  # a placement: each GPU's peak at max_ctx
    error: str | None = None
    images: int = 0  # images in every prompt (their tokens come on top of max_ctx)
    image_size: tuple[int, int] | None = None
    # PYTORCH_ALLOC_CONF=expandable_segments:True where it saves >= 5 % of the peak at max_ctx, and how much
    env: dict[str, str] = field(default_factory=dict)
    expandable_saved_bytes: int | None = None

    @property
    def workload(self) -> list[str] | None:
        """The flags that reproduce the row's workload, when it has one."""
        if self.max_ctx is None:
            return None
        return Workload(self.max_ctx - self.new_tokens, self.new_tokens, self.batch, self.images,
                        self.image_size).args()

    def to_dict(self) -> dict:
        return {**asdict(self), "workload": self.workload}


@dataclass
class FitResult:
    rows: list[FitRow]
    notes: list[str]  # e.g. why no correction could be read


def _free_ram() -> int:
    from ..probes.machine import free_memory

    return free_memory("cpu").free_bytes


def fit_contexts(model: str, budget: int | dict[str, int], *, device: str, db: str | None, buffer: int,
                 quants=FIT_QUANTS, batches=FIT_BATCHES, new_tokens: int = NEW_TOKENS,
                 max_memory: dict | str | None = None, device_map: str | None = None, images: int = 0,
                 image_size=None, gpu=None, progress=None, seconds: float | None = None) -> FitResult:
    """The largest ctx (prompt + ``new_tokens``) per quant and batch whose corrected estimate, at the p95
    of this machine's residuals, stays within ``budget - buffer``; searched up to the model's
    ``max_position_embeddings``. ``budget`` is one figure, or with a placement one per GPU
    ({"cuda:0": bytes, ...}; a single figure applies to each GPU). ``images`` of ``image_size`` sit in
    every prompt: their tokens come on top of the ctx found (docs/vision.md). A pre-quantized checkpoint is
    searched as it loads on ``gpu`` (kept or dequantized: :mod:`vramcal.estimator.formats`), and dequantized
    to bf16 beside it where its format has that load. The search is bounded in time like plan's
    (:func:`~vramcal.calibrate.search.bounded`, ``seconds``): rows not reached by then say so.
    ``progress(step)`` is told which quantization is searched."""
    from ..probes.machine import machine_fingerprint

    images, image_size = images_of(images, image_size)
    placed = placement_request(max_memory, device_map, device)
    source = resolve_model(model)
    check_images(source.config, images, source.name)
    quants = prequantized_quants(source.config) or quants
    main = device if placed is None else next(d for d in placed[0] if d.startswith("cuda"))
    fp = machine_fingerprint(main)
    gpus = [d for d in placed[0] if d.startswith("cuda")] if placed else [device]
    corrections, notes = stored_corrections(db, fp, source, quants, device if placed is None else None,
                                            gpus if placed is not None else [])
    budgets = budget if isinstance(budget, dict) else {d: budget for d in gpus}
    search = Search(source, device=device, corrections=corrections, images=images, image_size=image_size, gpu=gpu)
    # offloaded weights must fit the RAM given to transformers' map (cpu=, else what is free now): the map
    # sizes bitsandbytes' layers quantized, but offloaded ones stay 16-bit in RAM
    mm = placed[0] if placed is not None else {}
    ram = mm.get("cpu") if "cpu" in mm or placed is None else _free_ram()
    target = Budget({d: budgets.get(d, 0) - buffer for d in gpus}, cpu_bytes=ram or 0, disk_bytes=mm.get("disk"))
    rows: list[FitRow] = []
    try:
        with bounded(search, seconds):
            _search_rows(rows, quants, batches, search, source, target, placed, new_tokens, images, image_size,
                         notes, progress)
    except OutOfTime:
        done = {(r.quant, r.batch) for r in rows}
        left = [(q, b) for q in quants for b in batches if (q, b) not in done]
        spent = SEARCH_SECONDS if seconds is None else seconds
        why = f"not searched: the search's {spent:g} s were spent (docs/plan.md)"
        rows += [FitRow(q, b, None, new_tokens, None, error=why, images=images, image_size=image_size)
                 for q, b in left]
        notes.append(f"the search stopped after {spent:g} s: "
                     f"{', '.join(sorted({q for q, _ in left}))} not (fully) searched")
    if rows and all(r.max_ctx is None for r in rows):
        notes.append(f"nothing fits as asked: `vramcal plan {source.ref} --hardware ...` searches the split across "
                     "GPUs and offload to RAM for a machine's sizes (docs/plan.md)")
    return FitResult(rows, notes)


def _search_rows(rows, quants, batches, search, source, target, placed, new_tokens, images, image_size, notes,
                 progress) -> None:
    for i, q in enumerate(quants):
        if progress is not None:
            progress(f"fit: searching {q} ({i + 1} of {len(quants)})")
        est = search.estimator(q)
        if est.images is not None and q == quants[0]:
            p = est.images.plan
            notes.append(f"every prompt holds {images} image(s) of {p.width}x{p.height} ({est.images.tokens} image "
                         "tokens): max ctx is the text, the image tokens come on top")
        max_ctx = context_limit(est, new_tokens)
        plan = None
        if placed is not None:
            try:
                plan = plan_placement(source, est.quant, placed[0], placed[1])
            except UserError as exc:  # e.g. no layer of this quantization fits the GPUs: said in the row
                rows += [FitRow(q, b, None, new_tokens, None, error=str(exc), images=images, image_size=image_size)
                         for b in batches]
                continue
        over = target.over(plan.loads.weights) if plan is not None else {}
        if over:
            why = "; ".join(f"{d} holds {fmt_gib_gb(h)} of weights, over the {fmt_gib_gb(room)} it is given"
                            for d, (h, room) in over.items())
            rows += [FitRow(q, b, None, new_tokens, None, error=why, images=images, image_size=image_size)
                     for b in batches]
            continue
        for b in batches:
            ctx, peaks = search.largest_ctx(est, b, new_tokens, target, max_ctx, placement=plan)
            if ctx is not None:  # refined with the exact trace, as plan refines its own: one answer
                ctx, peaks = search.verified_ctx(est, b, new_tokens, target, ctx, max_ctx, placement=plan)
            row = FitRow(q, b, ctx, new_tokens, max(peaks.values()), peaks if plan is not None else None,
                         images=images, image_size=image_size)
            advice = expandable_advice(est, Workload(ctx - new_tokens, new_tokens, b)) \
                if ctx is not None and plan is None and ctx > new_tokens else None
            if advice:
                row.env, row.expandable_saved_bytes = advice["env"], advice["saved_bytes"]
                notes.append(f"{q} x{b} at {ctx:,}: {env_prefix(advice['env']).strip()} saves "
                             f"{fmt_gib_gb(advice['saved_bytes'])} ({100 * advice['share']:.1f} % of the peak; the "
                             "caching allocator replayed both ways): set it in the run's environment")
            rows.append(row)
