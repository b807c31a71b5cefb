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


def placed(device: str | None) -> bool:
    """A run split across devices records its devices joined (``cuda:0,cuda:1,cpu``) as its device."""
    return "," in (device or "")


def device_stack(stack: str, position: str) -> str:
    """The stack key of one device position of a split: corrections of ``cuda:1`` of a split are its own."""
    return f"{stack}|device={position}"


def refit(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None,
          rows: list[dict] | None = None) -> CorrectionSet:
    """Refit every scope this run belongs to and record them; return the most specific one. Runs split
    across devices are left out (their corrections are per device position: :func:`refit_devices`)."""
    if rows is None:
        rows = [r for r in store.stage_rows(machine_id) if not placed(r.get("device"))]
    best = CorrectionSet({})
    for (key, where), label in zip(reconcile.scopes(stack, quant, config_hash), _labels(config_hash)):
        corr = reconcile.fit_corrections(reconcile.rows_in(rows, where))
        if corr:
            store.add_corrections(machine_id, key, [asdict(c) for c in corr.values()])
            best = best or CorrectionSet(corr, scope=label)
    return best


def refit_devices(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None,
                  devices: list[str]) -> dict[str, CorrectionSet]:
    """Per device position of a split run: refit from the placed runs' per-device rows, record, return."""
    rows = store.device_stage_rows(machine_id)
    return {d: refit(store, machine_id, device_stack(stack, d), quant, config_hash,
                     [r for r in rows if r["device"] == d]) for d in devices}


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


def machine_device_corrections(e, db: str | None = None) -> dict[str, CorrectionSet]:
    """This machine's per-device-position corrections for a placed estimate (empty sets when none)."""
    from ..probes.machine import machine_fingerprint, stack_key

    store = existing_store(db)
    gpus = [d for d in (e.devices or {}) if d.startswith("cuda")]
    if store is None or not gpus:
        return {}
    fp = machine_fingerprint((e.placement or {}).get("main_device") or gpus[0])
    with store:
        mid = store.find_machine(fp)
        return {d: lookup(store, mid, device_stack(stack_key(fp), d), e.quant, e.config_hash) for d in gpus}
