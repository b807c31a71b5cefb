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
from pathlib import Path

from ..errors import UserError
from ..files import atomic_write
from .store import Outcome, RunContext, Store, default_path, new_uuid

FORMAT = "vramcal-unrecorded-run/2"


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


def load_saved(path: str | os.PathLike) -> dict:
    try:
        payload = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not a saved run (bad JSON: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path} is not a saved vramcal run (no format {FORMAT!r})")
    return payload


def record_saved(store: Store, path: str | os.PathLike) -> int:
    """Record a saved run into ``store`` (once: a second call finds it by its uuid); returns its id.
    The file is left in place; remove it once recorded."""
    p = load_saved(path)
    outcome = Outcome.from_dict(p["outcome"]) if p.get("outcome") else None
    return store.record_run(p["fingerprint"], RunContext.from_dict(p["run"]), outcome, uuid=p["uuid"])
