"""``fit``: the largest context per quantization and batch that stays within a budget.

One device: the corrected peak (p95 margin) within ``budget - buffer``; on the CPU, where a bitsandbytes
load's resident set has a run-to-run range, its top until this machine has a correction. Split across devices
(``max_memory`` / ``device_map``, docs/placement.md): the placement is planned once per quantization,
and every GPU of the plan that loads must stay within its own budget minus the buffer, each with the
correction of its device position when this machine has one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..estimator.correction import apply
from ..estimator.estimate import Estimator, placement_request
from ..estimator.quant import resolve_quant
from ..estimator.resolve import resolve_model, size_field
from ..estimator.vision import check_images
from ..errors import UserError
from ..workload import MAX_TOKENS, NEW_TOKENS, STAGES, Workload, device_kind, images_of
from .corrections import lookup, lookup_device, lookup_store

FIT_QUANTS = ("bf16", "int8", "nf4-dq", "nf4")
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


def fit_contexts(model: str, budget: int | dict[str, int], *, device: str, db: str | None, buffer: int,
                 quants=FIT_QUANTS, batches=FIT_BATCHES, new_tokens: int = NEW_TOKENS,
                 max_memory: dict | str | None = None, device_map: str | None = None, images: int = 0,
                 image_size=None) -> FitResult:
    """The largest ctx (prompt + ``new_tokens``) per quant and batch whose corrected estimate, at the p95
    of this machine's residuals, stays within ``budget - buffer``; searched up to the model's
    ``max_position_embeddings``. ``budget`` is one figure, or with a placement one per GPU
    ({"cuda:0": bytes, ...}; a single figure applies to each GPU). ``images`` of ``image_size`` sit in
    every prompt: their tokens come on top of the ctx found (docs/vision.md)."""
    from ..probes.machine import machine_fingerprint

    images, image_size = images_of(images, image_size)
    placed = placement_request(max_memory, device_map, device)
    source = resolve_model(model)
    check_images(source.config, images, source.name)
    main = device if placed is None else next(d for d in placed[0] if d.startswith("cuda"))
    fp = machine_fingerprint(main)
    gpus = [d for d in placed[0] if d.startswith("cuda")] if placed else [device]
    corr_by_quant: dict[str, dict[str, dict]] = {}
    store, why = lookup_store(db)
    notes = [why] if why else []
    if store is not None:
        try:
            with store:
                for q in quants:
                    if placed is None:
                        corr_by_quant[q] = {device: lookup(store, fp, q, source.config_hash).stages}
                    else:
                        corr_by_quant[q] = {d: lookup_device(store, fp, d, q, source.config_hash).stages
                                            for d in gpus}
        except UserError as exc:
            corr_by_quant = {}
            notes.append(f"no correction applied: {exc}")
    budgets = budget if isinstance(budget, dict) else {d: budget for d in gpus}
    kind = device_kind(device)
    rows = []
    for q in quants:
        spec = resolve_quant(q, source.config)
        est = Estimator(source, spec, device=kind, images=images, image_size=image_size)
        image_tokens = est.images.tokens if est.images is not None else 0
        if est.images is not None and q == quants[0]:
            p = est.images.plan
            notes.append(f"every prompt holds {images} image(s) of {p.width}x{p.height} ({image_tokens} image tokens): "
                         "max ctx is the text, the image tokens come on top")
        limit = int(size_field(est.text_config, "max_position_embeddings") or 131072)
        max_ctx = min(max(limit - image_tokens, new_tokens + 1), MAX_TOKENS)
        plan = None
        if placed is not None:
            from ..estimator.placement import plan_placement

            try:
                plan = plan_placement(source, spec, placed[0], placed[1])
            except UserError as exc:  # e.g. no layer of this quantization fits the GPUs: said in the row
                rows += [FitRow(q, b, None, new_tokens, None, error=str(exc)) for b in batches]
                continue
        corr = corr_by_quant.get(q, {})

        def over(c: int, b: int) -> tuple[bool, int, dict[str, int]]:
            """(over some budget, the highest peak, peak per GPU) at ctx c, batch b."""
            pt = est.sweep([(c, b)], new_tokens=new_tokens, placement=plan)[0]
            # a CPU range (glibc heap kept run to run) is planned at its top until this machine has measured
            # where its runs land (a correction, with its p95 margin)
            raw = pt.upper if pt.upper is not None and not corr.get(device) else pt.stages
            per = pt.devices if plan is not None else {device: {k: raw[k] for k in STAGES}}
            peaks = {d: max(apply({k: st[k] for k in STAGES}, c * b, corr.get(d, {}), margin="p95").values())
                     for d, st in per.items() if d.startswith("cuda") or plan is None}
            return any(p > budgets.get(d, 0) - buffer for d, p in peaks.items()), max(peaks.values()), peaks

        for b in batches:
            lo, hi = new_tokens + 1, max(max_ctx, new_tokens + 1)
            bad, peak, per = over(lo, b)
            if bad:
                rows.append(FitRow(q, b, None, new_tokens, peak, per if plan is not None else None, images=images,
                                   image_size=image_size))
                continue
            while lo < hi:  # largest ctx within every budget
                mid_c = (lo + hi + 1) // 2
                if not over(mid_c, b)[0]:
                    lo = mid_c
                else:
                    hi = mid_c - 1
            _, peak, per = over(lo, b)
            rows.append(FitRow(q, b, lo, new_tokens, peak, per if plan is not None else None, images=images,
                               image_size=image_size))
    return FitResult(rows, notes)
