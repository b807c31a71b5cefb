"""Corrections: fitted from this machine's recorded runs, looked up for an estimate, refitted after a
run (docs/calibration.md). The arithmetic of applying one lives in :mod:`vramcal.estimator.correction`.
"""

from __future__ import annotations

import os
from dataclasses import asdict

from ..estimator.correction import CorrectionSet
from ..records.store import Store, default_path
from . import reconcile

SCOPE_LABELS = ("this machine, same model and quant", "this machine, same quant", "this machine, any run")


def _labels(config_hash: str | None) -> tuple[str, ...]:
    return SCOPE_LABELS if config_hash else SCOPE_LABELS[1:]


def refit(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None) -> CorrectionSet:
    """Refit every scope this run belongs to and record them; return the most specific one."""
    rows = store.stage_rows(machine_id)
    best = CorrectionSet({})
    for (key, where), label in zip(reconcile.scopes(stack, quant, config_hash), _labels(config_hash)):
        corr = reconcile.fit_corrections(reconcile.rows_in(rows, where))
        if corr:
            store.add_corrections(machine_id, key, [asdict(c) for c in corr.values()])
            best = best or CorrectionSet(corr, scope=label)
    return best


def lookup(store: Store, machine_id: int | None, stack: str, quant: str, config_hash: str | None) -> CorrectionSet:
    """The recorded corrections of the most specific scope that has any (empty when none)."""
    if machine_id is None:
        return CorrectionSet({})
    for (key, _), label in zip(reconcile.scopes(stack, quant, config_hash), _labels(config_hash)):
        rows = store.latest_corrections(machine_id, key)
        if rows:
            return CorrectionSet(reconcile.corrections_from_rows(rows), scope=label)
    return CorrectionSet({})


def existing_store(db: str | None) -> Store | None:
    """The records database opened read-only, or None when there is none yet (nothing is created)."""
    path = db or str(default_path())
    if "://" not in str(path) and not os.path.exists(path):
        return None
    return Store(path, create=False, readonly=True)


def machine_correction(device: str, quant: str, config_hash: str | None, db: str | None = None) -> CorrectionSet:
    """This machine's correction for an estimate on ``device``, read without writing anything."""
    from ..probes.machine import machine_fingerprint, stack_key

    store = existing_store(db)
    if store is None:
        return CorrectionSet({})
    fp = machine_fingerprint("cpu" if str(device).startswith("cpu") else (device if ":" in device else "cuda:0"))
    with store:
        return lookup(store, store.find_machine(fp), stack_key(fp), quant, config_hash)


def corrected_estimate(model, quant: str = "auto", ctx: int | None = None, batch: int = 1, *, db: str | None = None,
                       device: str = "cuda", **kwargs):
    """:func:`vramcal.estimator.estimate.estimate`, corrected by this machine's recorded runs when it has
    any (``estimate.correction`` says which runs and which scope)."""
    from ..estimator.estimate import estimate

    raw = estimate(model, quant, ctx, batch, device=device, **kwargs)
    return raw.corrected(machine_correction(device, raw.quant, raw.config_hash, db))
