"""Corrections: fitted from this machine's recorded runs, looked up for an estimate (this machine's,
else its machine class's across the fleet), refitted after a run (docs/calibration.md, docs/fleet.md). The arithmetic of applying one lives in :mod:`vramcal.estimator.correction`.
"""

from __future__ import annotations

from dataclasses import asdict

from ..estimator.correction import CorrectionSet
from ..records.store import Store, open_existing
from . import reconcile


def placed(device: str | None) -> bool:
    """A run split across devices records its devices joined (``cuda:0,cuda:1,cpu``) as its device."""
    return "," in (device or "")


def device_stack(stack: str, position: str) -> str:
    """The stack key of one device position of a split: corrections of ``cuda:1`` of a split are its own."""
    return f"{stack}|device={position}"


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


def refit_devices(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None,
                  devices: list[str]) -> dict[str, CorrectionSet]:
    """Per device position of a split run: refit from the placed runs' per-device rows, record, return.
    A split's corrections stay on the machine that measured them (a class shares single-device runs)."""
    rows = store.device_stage_rows(machine_id)
    out = {}
    for d in devices:
        mine = [r for r in rows if r["device"] == d]
        best = CorrectionSet({})
        for (key, where), label in zip(reconcile.scopes(device_stack(stack, d), quant, config_hash),
                                       ("same model and quant", "same quant", "any run")[-3 if config_hash else -2:]):
            corr = reconcile.fit_corrections(reconcile.rows_in(mine, where))
            if corr:
                store.add_corrections(machine_id, key, [asdict(c) for c in corr.values()])
                best = best or CorrectionSet(corr, scope=f"this machine, {d} of a split, {label}")
        out[d] = best
    return out


def lookup_device(store: Store, fingerprint: dict, position: str, quant: str, config_hash: str | None
                  ) -> CorrectionSet:
    """This machine's correction for one device position of a split (empty when none)."""
    from ..probes.machine import stack_key

    mid = store.find_machine(fingerprint)
    if mid is None:
        return CorrectionSet({})
    for key, _ in reconcile.scopes(device_stack(stack_key(fingerprint), position), quant, config_hash):
        rows = store.latest_corrections(mid, key)
        if rows:
            return CorrectionSet(reconcile.corrections_from_rows(rows), scope=f"this machine, {position} of a split")
    return CorrectionSet({})


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


def machine_device_corrections(e, db: str | None = None) -> dict[str, CorrectionSet]:
    """This machine's per-device-position corrections for a placed estimate (empty sets when none)."""
    from ..probes.machine import machine_fingerprint

    store = existing_store(db)
    gpus = [d for d in (e.devices or {}) if d.startswith("cuda")]
    if store is None or not gpus:
        return {}
    fp = machine_fingerprint((e.placement or {}).get("main_device") or gpus[0])
    with store:
        return {d: lookup_device(store, fp, d, e.quant, e.config_hash) for d in gpus}
