"""Nothing measured is lost: a run whose record cannot be written (the server is down, the file is
locked or read-only) is kept as one JSON file, and recorded later, once, by its ``uuid``.

The folder is ``$VRAMCAL_UNRECORDED`` if set, else ``unrecorded/`` beside the default SQLite database
(``~/.local/share/vramcal/unrecorded/``); if that cannot be written, the system's temporary folder.
``vramcal records import FILE...`` (:func:`record_saved`) records them into any store.

A file holds the machine's fingerprint, the run's :class:`~vramcal.records.store.RunContext` and its
:class:`~vramcal.records.store.Outcome` -- every series sampled and, for a split run, the per-device
stages -- exactly what the store would have recorded.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..files import atomic_write, read_regular
from .schema import legacy_run_fields
from .store import Outcome, RunContext, Store, default_path, new_uuid

FORMAT = "vramcal-unrecorded-run/2"
FORMAT_1 = "vramcal-unrecorded-run/1"  # vramcal before records schema 5: still imported


def unrecorded_dir() -> Path:
    if os.environ.get("VRAMCAL_UNRECORDED"):
        return Path(os.environ["VRAMCAL_UNRECORDED"])
    return default_path().parent / "unrecorded"


def run_payload(fingerprint: dict, context: RunContext, outcome: Outcome | None, uuid: str | None = None,
                error: str | None = None) -> dict:
    """Everything :meth:`Store.record_run` needs, as plain JSON; ``error`` says why it was not recorded."""
    context.created_at = context.created_at or time.time()
    return {"format": FORMAT, "uuid": uuid or new_uuid(), "saved_at": time.time(), "not_recorded_because": error,
            "fingerprint": fingerprint, "run": context.to_dict(),
            "outcome": None if outcome is None else outcome.to_dict()}


def save_unrecorded(payload: dict, folder: str | os.PathLike | None = None) -> Path:
    """Write ``payload`` (see :func:`run_payload`) as ``run-<uuid>.json``, atomically; returns the path.
    Falls back to the temporary folder when the usual one cannot be written."""
    if payload.get("format") != FORMAT or not payload.get("uuid"):
        raise ValueError("save_unrecorded takes the dict run_payload() builds")
    text = json.dumps(payload, default=str)
    name = f"run-{payload['uuid']}.json"
    candidates = [Path(folder)] if folder else [unrecorded_dir(), Path(tempfile.gettempdir()) / "vramcal-unrecorded"]
    last: Exception | None = None
    for place in candidates:
        try:
            place.mkdir(parents=True, exist_ok=True)
            return atomic_write(place / name, text, "unrecorded run")
        except (OSError, UserError) as exc:
            last = exc
    raise UserError(f"could not keep the unrecorded run anywhere ({last}): set VRAMCAL_UNRECORDED to a writable "
                    "folder")


MAX_SAVED_BYTES = 512 * 1024**2  # a run's samples at 5 ms for an hour are a few tens of MB


@dataclass
class SavedRun:
    uuid: str
    fingerprint: dict
    context: RunContext
    outcome: Outcome | None


def load_saved(path: str | os.PathLike) -> SavedRun:
    """A saved run, checked field by field (:mod:`vramcal.records.validate`) before anything records
    it; a file of the first format (vramcal before records schema 5) is read too."""
    from .validate import InvalidRecord, valid_context, valid_fingerprint, valid_outcome, valid_physics

    raw = read_regular(path, MAX_SAVED_BYTES, "saved run")
    try:
        payload = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"{path} is not a saved run (not JSON: {str(exc).splitlines()[0][:100]})") from None
    if not isinstance(payload, dict) or payload.get("format") not in (FORMAT, FORMAT_1):
        raise UserError(f"{path} is not a saved vramcal run (no format {FORMAT!r})")
    if payload["format"] == FORMAT_1:
        payload = _from_format_1(payload)
    where = str(path)
    uuid = payload.get("uuid")
    if not isinstance(uuid, str) or not 1 <= len(uuid) <= 64 or not uuid.isprintable() or " " in uuid:
        raise InvalidRecord(f"{where}: uuid = {uuid!r:.60} is not a run id; nothing of it was recorded")
    outcome = payload.get("outcome")
    saved = SavedRun(uuid, valid_fingerprint(payload.get("fingerprint"), where),
                     valid_context(payload.get("run"), where),
                     None if outcome is None else valid_outcome(outcome, where))
    valid_physics(saved.fingerprint, saved.context, saved.outcome, where)
    return saved


def _from_format_1(p: dict) -> dict:
    """The first format: the run's fields, the probe's result dict, stage rows and samples apart."""
    run = dict(p.get("run") or {}) if isinstance(p.get("run"), dict) else p.get("run")
    if isinstance(run, dict) and isinstance(run.get("device"), str):  # what schema 5 derives for older rows
        run.update({k: v for k, v in legacy_run_fields(run["device"], run.get("estimate")).items()
                    if run.get(k) is None})
        run["device"] = run["device"].split(",")[0]
    result = p.get("result")
    outcome = None
    if isinstance(result, dict):
        outcome = {"status": result.get("status"), "last_stage": result.get("last_stage"),
                   "error": result.get("error"), "oom": result.get("oom"), "series": result.get("series"),
                   "wall_s": result.get("wall_s"), "sampler_overhead": result.get("sampler_overhead"),
                   "result": {k: v for k, v in result.items() if k != "samples"}, "stages": p.get("stages"),
                   "samples": p.get("samples")}
    elif result is not None:
        outcome = result  # refused by the validator, with the field named
    return {**p, "format": FORMAT, "run": run, "outcome": outcome}


def record_saved(store: Store, path: str | os.PathLike) -> tuple[int, bool]:
    """Record a saved run into ``store`` once, by its uuid: (run id, whether anything was added). A run
    already recorded with that uuid but other contents is refused in one line (the file stays)."""
    saved = load_saved(path)
    existing = store.run_id_of(saved.uuid)
    if existing is not None:
        have = store.run(existing)
        same = (have.context.model, have.context.ctx, have.context.batch, have.context.command) == (
            saved.context.model, saved.context.ctx, saved.context.batch, saved.context.command)
        if not same:
            raise UserError(f"{path}: {store.label} already holds another run with the id {saved.uuid} (run "
                            f"{existing}, {have.context.model}); nothing was recorded and the file is kept")
        if have.outcome is not None or saved.outcome is None:
            return existing, False
    run_id = store.record_run(saved.fingerprint, saved.context, saved.outcome, uuid=saved.uuid)
    return run_id, True
