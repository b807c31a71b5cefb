"""The one search over configurations: does a workload fit, what is the largest context that fits, and
how should a model be split across GPUs, RAM and disk so that each GPU's *whole* peak fits.

``fit``, the what-to-change ladder of ``check`` (its offload rung) and ``plan`` all ask these questions
through :class:`Search`, so a configuration one of them calls fitting is one the others call fitting.

What "fits" means: every GPU's peak at every stage -- weights, the cache of the layers it runs, the
activations, the offloaded block copied in, the CUDA context -- corrected by this machine's runs where
it has some, with their p95 margin, stays within that GPU's usable memory (its memory minus the
buffer); with offload, what the CPU holds stays within the RAM given (with bitsandbytes the offloaded
modules stay 16-bit: transformers' map sizes them at 0.5 or 1 byte an element, the load holds 2).

Splitting (:meth:`Search.split`): ``max_memory`` bounds only the weights transformers places on a
device, so a GPU's budget is searched, not set to its size: start from its usable memory less what the
workload adds beside the weights, ask transformers' own device map (``plan_placement``) for the
placement, price every device's stages, take back from a GPU what it went over by; once it holds, offer
a GPU as many whole layers as its slack holds while weights still sit in RAM (half way back to the last fit
while that goes over), until less than a layer's room is left -- the proof that one more layer does not
fit, made on the exact trace (every map from the first that holds is priced with it). Where transformers
cannot place the model in the budgets (a module fits no device), the budgets go back up
toward the GPU's usable memory, half way to the last that went over. At most :data:`MAX_STEPS` maps.
"""

from __future__ import annotations

import contextlib
import time

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UserError
from ..estimator.correction import apply
from ..estimator.estimate import Estimator
from ..estimator.quant import resolve_quant
from ..units import MIB
from ..workload import MAX_TOKENS, STAGES, Workload, device_kind

MAX_STEPS = 10
GRID = (16, 1024, 64)  # the largest context is found to 16 tokens below 1024, to 64 above (the exact trace decides)
SEARCH_SECONDS = 180.0  # plan's search stops asking new questions after this (docs/plan.md)


class OutOfTime(BaseException):
    """The search's time (:data:`SEARCH_SECONDS`) is spent: what was found so far is the answer. Not an
    Exception, so that no ``except Exception`` on the way (a dry run's fallback to formulas) takes it for a
    failure of the model."""
MARGIN = 2 * MIB  # one allocator segment: what a budget is taken back by beyond the overshoot
REPEAT_SECONDS = 0.5  # past the deadline the search's timer fires again this often until it is stopped


@contextlib.contextmanager
def bounded(search: Search, seconds: float | None = None):
    """Bound a search in time (default :data:`SEARCH_SECONDS`): past the deadline ``search.fits`` raises
    :class:`OutOfTime` before a new question, and in the main thread a timer (the process's one real-time
    timer, only where no one else holds it) stops a trace under way too -- a Mamba model's reference
    selective scan is a Python loop, minutes for one long trace. Yields a function that stops the timer
    (what follows prices only what was found); the caller catches OutOfTime and keeps what it found."""
    import signal
    import threading

    seconds = SEARCH_SECONDS if seconds is None else seconds
    search.deadline = time.monotonic() + seconds
    timer = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer") \
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    before = None
    if timer:
        def expire(signum, frame):
            if search.deadline is None:  # stopped: an alarm already on its way asks nothing now
                return
            # again shortly, should this one be lost: raised inside a finalizer ("Exception ignored in"),
            # it never reaches the trace (seen in CI); the caller stops the timer when it catches one
            signal.setitimer(signal.ITIMER_REAL, REPEAT_SECONDS)
            raise OutOfTime

        before = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)

    def stop() -> None:
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
        search.deadline = None

    try:
        yield stop
    finally:
        stop()
        if timer:
            signal.signal(signal.SIGALRM, before)


@dataclass(frozen=True)
class Budget:
    """Where a configuration must fit: each GPU's usable memory (its memory minus the buffer), the RAM
    offloaded weights may take, and disk room (None: no disk offload)."""

    usable: dict[str, int]
    cpu_bytes: int = 0
    disk_bytes: int | None = None

    def over(self, held: dict[str, int]) -> dict[str, tuple[int, int]]:
        """The offload devices whose weights (``held``: a placement's bytes per device) are more than they
        may take: ``{device: (held, room)}``; empty when the RAM and the disk hold them."""
        rooms = {"cpu": self.cpu_bytes, "disk": self.disk_bytes or 0}
        return {d: (held[d], room) for d, room in rooms.items() if held.get(d, 0) > room}


@dataclass
class Split:
    """A placement that fits: the ``max_memory`` transformers is given, its plan, each GPU's peak."""

    max_memory: dict[str, int]
    placement: object  # vramcal.estimator.placement.Placement
    peaks: dict[str, int]

    @property
    def offloaded(self) -> bool:
        loads = self.placement.loads
        return bool(loads.pcie_bytes_per_token or loads.disk_bytes_per_token)


class Search:
    """One model's configurations against budgets. ``corrections(quant, devices)`` gives this machine's
    corrections per device (``{device: {stage: Correction}}``; devices of a split by position), or
    nothing; ``device`` is ``cuda``/``cuda:N`` or ``cpu``."""

    def __init__(self, source, *, device: str = "cuda", attn: str = "auto", strategy: str = "auto",
                 corrections: Callable[[str, list[str], bool], dict] | None = None, progress=None,
                 images: int = 0, image_size=None, gpu=None):
        self.source, self.device, self.attn, self.strategy = source, device, attn, strategy
        self.gpu = gpu  # the GPU a pre-quantized checkpoint's path is decided for (estimator.formats)
        self.images, self.image_size = images, image_size  # in every prompt (docs/vision.md)
        self.kind = device_kind(device)
        self._corrections = corrections or (lambda quant, devices, placed: {})
        self._estimators: dict[tuple[str, str], Estimator] = {}
        self._progress = progress
        self.notes: list[str] = []  # what the answers rest on beyond the dry run, said once
        self.deadline: float | None = None  # time.monotonic() past which fits() raises OutOfTime

    # ------------------------------------------------------------------ building blocks
    def estimator(self, quant: str, kv_dtype: str = "auto") -> Estimator:
        key = (quant, kv_dtype)
        if key not in self._estimators:
            self._estimators[key] = Estimator(self.source, resolve_quant(quant, self.source, gpu=self.gpu), attn=self.attn,
                                              kv_dtype=kv_dtype, device=self.kind, progress=self._progress,
                                              images=self.images, image_size=self.image_size)
        return self._estimators[key]

    def corrections(self, quant: str, devices: list[str], placed: bool) -> dict:
        return self._corrections(quant, devices, placed) or {}

    def placement(self, est: Estimator, max_memory: dict[str, int], strategy: str | None = None):
        from ..estimator.placement import plan_placement

        return plan_placement(self.source, est.quant, max_memory, strategy or self.strategy)

    def peaks(self, est: Estimator, work: Workload, placement=None, exact: bool = False,
              corrected: bool = True) -> dict[str, int]:
        """Each GPU's highest stage (one device: that device's), corrected at the p95 of this machine's
        residuals where it has runs. On the CPU after an on-the-fly bitsandbytes load, the top of the
        run-to-run range until this machine has a correction (docs/cpu-memory.md). ``corrected=False``:
        the estimator's own figures."""
        pt = None
        if not exact and est.dry_run_error is None:
            try:
                pt = est.sweep([(work.ctx, work.batch)], new_tokens=work.new_tokens, placement=placement)[0]
            except UserError:
                if est.dry_run_error is None:
                    raise
        if pt is None:  # exact, or no activation fit without a dry run: the estimate's own figures, formulas and all
            e = est.estimate(batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens, exact=True,
                             placement=placement)
            if e.approximate:
                err = est.dry_run_error
                note = (f"approximate: the dry run cannot run this model here ({err[:120]}), so its activations "
                        "come from formulas" if err else "approximate figures (`vramcal estimate` says which)")
                if note not in self.notes:
                    self.notes.append(note)
            per = {d: v.stages for d, v in e.devices.items()} if e.devices else {self.device: e.stages}
            upper = {k: hi for k, (_, hi) in e.ranges.items()} if e.ranges else None
        else:
            per = pt.devices if placement is not None else {self.device: pt.stages}
            upper = pt.upper
        corr = {} if not corrected else self.corrections(
            est.quant.name, [d for d in per if d.startswith("cuda") or placement is None], placement is not None)
        if corrected and placement is None and upper is not None and not corr.get(self.device):
            per = {self.device: upper}
        return {d: max(apply({k: st[k] for k in STAGES}, work.tokens, corr.get(d, {}), margin="p95").values())
                for d, st in per.items() if d.startswith("cuda") or placement is None}

    def fits(self, est: Estimator, work: Workload, budget: Budget, placement=None,
             exact: bool = False) -> tuple[bool, dict[str, int]]:
        if self.deadline is not None:
            if time.monotonic() > self.deadline:
                raise OutOfTime
        peaks = self.peaks(est, work, placement, exact)
        ok = all(p <= budget.usable.get(d, 0) for d, p in peaks.items())
        if placement is not None:
            held = placement.loads.weights
            ok = ok and not budget.over(held)
        return ok, peaks

    # ------------------------------------------------------------------ the questions
    def largest_ctx(self, est: Estimator, batch: int, new_tokens: int, budget: Budget, limit: int,
                    placement=None, lowest: int | None = None) -> tuple[int | None, dict[str, int]]:
        """The largest context (prompt + ``new_tokens``, at most ``limit``) whose peaks fit ``budget``:
        bisection on the estimator's activation fit (arithmetic, no trace). None when not even the
        shortest (``lowest``, default one prompt token) fits."""
        lo = max(lowest or new_tokens + 1, new_tokens + 1)
        hi = max(limit, lo)

        def work(c: int) -> Workload:
            return Workload(c - new_tokens, new_tokens, batch)

        ok, peaks = self.fits(est, work(lo), budget, placement)
        if not ok:
            return None, peaks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok, p = self.fits(est, work(mid), budget, placement)
            if ok:
                lo, peaks = mid, p  # the peaks of the largest that fits so far: not priced again at the end
            else:
                hi = mid - 1
        return lo, peaks

    def verified_ctx(self, est: Estimator, batch: int, new_tokens: int, budget: Budget, ctx: int, limit: int,
                     placement=None) -> tuple[int | None, dict[str, int]]:
        """``ctx`` (a :meth:`largest_ctx` answer) checked with the exact trace, and the largest context the exact
        trace allows near it, with its peaks; plan and fit both end their searches here, so they give one
        answer. The activation fit's answer may be off either way: it bounds the activations from above
        between its traces (short, by how much depending on the traces the disk cache holds), and the
        caching allocator's slack is interpolated between the nodes of its ladder, which bounds nothing (past
        the exact answer: fit said 20,896 tokens where the exact trace allows 18,944). Going down by sixteenths
        to one that fits, up by sixteenths to one that does not, then halving on a fixed grid of contexts
        (:data:`GRID`: every 16 tokens below 1024, every 64 above) makes the answer the exact trace's -- the
        largest context on the grid that fits (or ``limit``), whatever the fit said. None: not even the
        shortest (one prompt token) fits."""
        floor = new_tokens + 1
        seen: dict[int, tuple[bool, dict[str, int]]] = {}

        def ok(c: int) -> bool:
            if c not in seen:
                seen[c] = self.fits(est, Workload(c - new_tokens, new_tokens, batch), budget, placement, exact=True)
            return seen[c][0]

        lo, hi, c = None, None, ctx
        for _ in range(12):
            if ok(c):
                lo = c
                break
            hi = c
            if c <= floor:
                return None, seen[c][1]
            c = max(floor, c - max(c // 16, 1))
        if lo is None:
            return None, seen[hi][1]  # the last context checked
        for _ in range(12):
            if hi is not None or lo >= limit:
                break
            c = min(limit, lo + max(lo // 16, 1))
            if ok(c):
                lo = c
            else:
                hi = c
        if hi is None:
            return lo, seen[lo][1]  # the limit fits
        a, b = _grid_index(lo), _grid_index(hi)
        if _grid_point(b) < hi:
            b += 1
        if _grid_point(a) < floor:
            return lo, seen[lo][1]  # shorter than the grid reaches
        # on the grid: the point at or below lo fits and the one at or above hi does not (a longer context
        # never needs less memory), so halving between them ends at the same point from any start
        while b - a > 1:
            mid = (a + b) // 2
            if ok(_grid_point(mid)):
                a = mid
            else:
                b = mid
        c = _grid_point(a)
        # priced (the caller prices its answer anyway: the trace is kept): with the allocator's slack a longer
        # context can need a little less, so the grid point below lo may not fit where lo does
        return (c, seen[c][1]) if ok(c) else (lo, seen[lo][1])

    def split(self, est: Estimator, work: Workload, budget: Budget, offload: bool = True,
              strategy: str | None = None) -> Split | None:
        """The placement that keeps the most weights on the GPUs while every GPU's whole peak fits and what
        RAM and disk hold stays within them (see the module's doc). ``offload=False``: the GPUs alone (None
        when they cannot hold the model). ``strategy``: the device map's (default the search's)."""
        gpus = list(budget.usable)
        with est.unreplayed():  # everything on one device, priced as the split's GPUs are (no allocator replay)
            one = self.peaks(est, work, corrected=False)[self.device]
        beside = one - est.inv.tensor_bytes  # what the workload adds to the weights
        layer_bytes = _layer_bytes(est)
        usable = {g: budget.usable[g] for g in gpus}
        budgets = {g: max(usable[g] - beside // (1 if len(gpus) == 1 else 2), MIB) for g in gpus}
        ram = budget.cpu_bytes  # the cpu= transformers is given: less than the RAM where what it holds is bigger
        # transformers sizes bitsandbytes weights at 0.5 or 1 byte an element, below what they hold: a GPU's
        # weight budget may go above its usable memory, never far (at most a quarter)
        cap = {g: usable[g] * 5 // 4 for g in gpus}
        best: Split | None = None
        fitted: dict[str, int] = {}  # the budgets of the best split
        too_small: dict[str, int] | None = None  # budgets transformers could not place the model in
        too_large: dict[str, int] | None = None  # budgets whose peaks went over
        ceiling: dict[str, int] = {}  # per GPU: the smallest budget that went over once a split held
        exact = False  # priced with the exact trace at ``work`` once a map fits (below)
        for _ in range(MAX_STEPS):
            budgets = {g: min(b, cap[g]) for g, b in budgets.items()}
            mm = dict(budgets)
            if offload and ram:
                mm["cpu"] = ram
            if offload and budget.disk_bytes:
                mm["disk"] = budget.disk_bytes
            try:
                placement = self.placement(est, mm, strategy)
            except UserError:  # a module fits no device given: the GPUs need more of their memory
                too_small = budgets
                budgets = usable if too_large is None else _between(budgets, too_large)
                if budgets == too_small or budgets == usable and too_small == usable:
                    break
                continue
            ok, peaks = self.fits(est, work, budget, placement, exact=exact)
            if ok and not exact:
                # the activation fit bounds a point between its traces from above, by how much depending on
                # the traces made so far: the room that proves one more layer does not fit is the exact
                # trace's. One trace at this workload, then every map is priced with it
                exact = True
                ok, peaks = self.fits(est, work, budget, placement, exact=True)
            if not ok:
                over = {g: peaks.get(g, 0) - usable[g] for g in gpus}
                if all(v <= 0 for v in over.values()):  # RAM or disk over, every GPU within its memory
                    held = placement.loads.weights
                    moved = False
                    if budget.disk_bytes and held.get("cpu", 0) > budget.cpu_bytes:
                        # transformers sizes bitsandbytes modules quantized, they load 16-bit: give it less
                        # cpu= so that more goes to disk
                        ram = max(int(ram * budget.cpu_bytes / held["cpu"] * 0.98) // MIB * MIB, MIB)
                        moved = True
                    grow = {g: (s // layer_bytes) * layer_bytes for g in gpus  # or move layers to a GPU's room
                            if (s := usable[g] - peaks.get(g, 0)) >= layer_bytes > 0 and budgets[g] < cap[g]}
                    if grow and not moved:
                        budgets = {g: b + grow.get(g, 0) for g, b in budgets.items()}
                        moved = True
                    if not moved:
                        break
                    continue
                if best is not None:
                    # the layers offered were too many: half way back to the last fit. Not one layer's bytes
                    # back: transformers sizes a layer by its own rule (bitsandbytes' weights at 0.5 or 1 byte
                    # an element, without their quantization state), so a budget one such layer smaller can
                    # map the same layers (a tiny nf4 model went from 6 layers to 8 and back, never 7)
                    ceiling.update({g: min(ceiling.get(g, b), b) for g, b in budgets.items() if over[g] > 0})
                    fewer = {g: _between(fitted, budgets)[g] if over[g] > 0 else b for g, b in budgets.items()}
                    if all(fewer[g] <= fitted[g] for g in gpus if over[g] > 0):
                        break
                    budgets = fewer
                    continue
                too_large = budgets
                # a budget that moves less than a layer moves nothing: take back at least one layer's worth
                budgets = {g: max(b - max(over[g] + MARGIN, layer_bytes) if over[g] > 0 else b, MIB)
                           for g, b in budgets.items()}
                if too_small is not None:
                    budgets = _between(too_small, too_large)
                    if budgets in (too_small, too_large):
                        break
                continue
            best, fitted = Split(mm, placement, peaks), dict(budgets)
            if not best.offloaded:
                break
            # room for more layers: offer as many whole layers as the slack holds (too many: half way back, above);
            # less room than a layer holds is proof enough that one more does not fit
            grow = {g: (s // layer_bytes) * layer_bytes for g in gpus
                    if (s := usable[g] - peaks.get(g, 0)) >= layer_bytes > 0 and budgets[g] < cap[g]}
            # below a budget that went over, at most half way to it: within a MiB of it, nothing more fits
            half = {g: (budgets[g] + c) // 2 // MIB * MIB - budgets[g] for g, c in ceiling.items()}
            grow = {g: min(v, half.get(g, v)) for g, v in grow.items() if half.get(g, v) > 0}
            if not grow:
                break
            budgets = {g: b + grow.get(g, 0) for g, b in budgets.items()}
        if best is not None and not offload and best.offloaded:
            return None
        return best


def _grid_index(c: int) -> int:
    """The index of the largest point of the context grid (:data:`GRID`) at or below ``c``."""
    fine, turn, coarse = GRID
    return c // fine if c < turn else turn // fine + (c - turn) // coarse


def _grid_point(i: int) -> int:
    fine, turn, coarse = GRID
    return i * fine if i < turn // fine else turn + (i - turn // fine) * coarse


def _between(low: dict[str, int], high: dict[str, int]) -> dict[str, int]:
    """Half way between two budgets per GPU, in whole MiB."""
    return {g: (low[g] + high[g]) // 2 // MIB * MIB for g in low}


def offloaded_layers(placement) -> str:
    """How much of a placement is offloaded, for a person: ``12 of 80 layers``."""
    loads = placement.loads
    n = sum(1 for d in loads.layer_devices if d in ("cpu", "disk"))
    return f"{n} of {len(loads.layers)} layers" if n else "the modules that do not fit"


def context_limit(est: Estimator, new_tokens: int = 1) -> int:
    """The longest (text) context searched: the model's ``max_position_embeddings`` (131072 when it
    names none) less the image tokens every prompt holds, at most :data:`~vramcal.workload.MAX_TOKENS`."""
    from ..estimator.resolve import size_field

    image_tokens = est.images.tokens if est.images is not None else 0
    limit = int(size_field(est.text_config, "max_position_embeddings") or 131072)
    if image_tokens and image_tokens + new_tokens + 1 > limit:  # the images alone fill the positions
        n = est.images.count
        raise UserError(f"{n} image(s) take {image_tokens:,} tokens of the model's {limit:,} positions: no text "
                        f"fits beside them (one prompt token and {new_tokens} new ones); give fewer --images "
                        "or a smaller --image-size")
    return min(limit - image_tokens, MAX_TOKENS)


def stored_corrections(db: str | None, fingerprint: dict, source, quants, device: str | None,
                       gpus: list[str]) -> tuple[Callable[[str, list[str], bool], dict], list[str]]:
    """This machine's corrections (else its machine class's) per quantization, read once through a short
    lookup: for an unplaced run on ``device`` (None: none wanted) and for each GPU position of a split.
    Returns the ``corrections`` argument of :class:`Search` and notes on why none could be read."""
    from .corrections import lookup, lookup_device, lookup_store

    plain: dict[str, dict] = {}
    placed: dict[str, dict] = {}
    store, why = lookup_store(db)
    notes = [why] if why else []
    if store is not None:
        try:
            with store:
                for q in quants:
                    if device is not None:
                        plain[q] = lookup(store, fingerprint, q, source.config_hash).stages
                    if gpus:
                        placed[q] = {d: lookup_device(store, fingerprint, d, q, source.config_hash).stages
                                     for d in gpus}
        except UserError as exc:
            plain, placed = {}, {}
            notes.append(f"no correction applied: {exc}")

    def corrections(quant: str, devices: list[str], is_placed: bool) -> dict:
        if is_placed:
            return placed.get(quant, {})
        return {d: plain[quant] for d in devices if quant in plain}

    return corrections, notes


def _layer_bytes(est: Estimator) -> int:
    """A decoder layer's weights in this quantization: all but the input embeddings, an untied lm_head (no
    layer holds it: transformers' map places it as a module of its own, and bitsandbytes keeps it 16-bit,
    so counting it in a layer made Llama-3.1-8B's nf4 layer 155 MB for its 123 MB), norms and buffers,
    over the layers. A tied lm_head is the embeddings' tensor, counted once under them."""
    from ..estimator.resolve import size_field, text_config

    layers = max(int(size_field(text_config(est.source.config), "num_hidden_layers") or 1), 1)
    g = est.inv.groups
    outside = sum(g.get(k, 0) for k in ("embeddings", "lm_head", "norms", "buffers"))
    return max(est.inv.tensor_bytes - outside, 0) // layers
