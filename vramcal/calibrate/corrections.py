"""Corrections: fitted from this machine's recorded runs, looked up for an estimate (this machine's,
else its machine class's across the fleet), refitted after a run (docs/calibration.md, docs/fleet.md). The arithmetic of applying one lives in :mod:`vramcal.estimator.correction`.
"""

from __future__ import annotations

from ..estimator.correction import CorrectionSet
from ..records.store import Store, open_existing


def refit(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None) -> CorrectionSet:
    """Refit every scope this run belongs to and record them, holding the machine's refit lock (two
    hosts refitting at once both see every run: :func:`vramcal.calibrate.fleet.refit`); return the most
    specific one."""
    from .fleet import refit as _refit

    return _refit(store, machine_id, stack, quant, config_hash)


def lookup(store: Store, fingerprint: dict, quant: str, config_hash: str | None) -> CorrectionSet:
    """The recorded corrections of the most specific scope that has any: this machine's, else its
    machine class's across hosts (:func:`vramcal.calibrate.fleet.find_correction`); empty when none."""
    from .fleet import find_correction

    return find_correction(store, fingerprint, quant, config_hash).as_set()


def existing_store(db: str | None) -> Store | None:
    """The records database opened read-only, or None when there is none yet (nothing is created)."""
    return open_existing(db)


def machine_correction(device: str, quant: str, config_hash: str | None, db: str | None = None) -> CorrectionSet:
    """This machine's correction for an estimate on ``device``, read without writing anything."""
    from ..probes.machine import machine_fingerprint

    store = existing_store(db)
    if store is None:
        return CorrectionSet({})
    fp = machine_fingerprint("cpu" if str(device).startswith("cpu") else (device if ":" in device else "cuda:0"))
    with store:
        return lookup(store, fp, quant, config_hash)


def corrected_estimate(model, quant: str = "auto", ctx: int | None = None, batch: int = 1, *, db: str | None = None,
                       device: str = "cuda", **kwargs):
    """:func:`vramcal.estimator.estimate.estimate`, corrected by this machine's recorded runs when it has
    any (``estimate.correction`` says which runs and which scope)."""
    from ..estimator.estimate import estimate

    raw = estimate(model, quant, ctx, batch, device=device, **kwargs)
    return raw.corrected(machine_correction(device, raw.quant, raw.config_hash, db))
