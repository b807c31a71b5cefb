"""Nothing measured is lost: a run whose record cannot be written (the server is down, the file is
locked or read-only) is kept as one JSON file, and recorded later, once, by its ``uuid``.

The folder is ``$VRAMCAL_UNRECORDED`` if set, else ``unrecorded/`` beside the default SQLite database
(``~/.local/share/vramcal/unrecorded/``); if that cannot be written, the system's temporary folder.
``vramcal records import FILE...`` (:func:`record_saved`) records them into any store.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from ..errors import UserError
from ..files import atomic_write
from .store import RUN_FIELDS, Store, default_path, new_uuid

FORMAT = "vramcal-unrecorded-run/1"


def unrecorded_dir() -> Path:
    if os.environ.get("VRAMCAL_UNRECORDED"):
        return Path(os.environ["VRAMCAL_UNRECORDED"])
    return default_path().parent / "unrecorded"


def run_payload(fingerprint: dict, run: dict, result: dict | None, stage_rows: list[dict] = (),
                samples: list[tuple[float, str, int]] = (), uuid: str | None = None,
                error: str | None = None) -> dict:
    """Everything :meth:`Store.record_run` needs, as plain JSON: the machine, the run's context
    (:data:`~vramcal.records.store.RUN_FIELDS`, ``estimate``, ``created_at``), the outcome, the stage
    rows and the samples; ``error`` says why it was not recorded."""
    return {"format": FORMAT, "uuid": uuid or run.get("uuid") or new_uuid(), "saved_at": time.time(),
            "not_recorded_because": error, "fingerprint": fingerprint,
            "run": {**{k: run.get(k) for k in RUN_FIELDS}, "estimate": run.get("estimate"),
                    "created_at": run.get("created_at") or time.time()},
            "result": result, "stages": list(stage_rows), "samples": [list(s) for s in samples]}


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
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not a saved run (bad JSON: {exc.msg} at line {exc.lineno})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path} is not a saved vramcal run (no format {FORMAT!r})")
    return payload


def record_saved(store: Store, path: str | os.PathLike) -> int:
    """Record a saved run into ``store`` (once: a second call finds it by its uuid); returns its id.
    The file is left in place; remove it once recorded."""
    p = load_saved(path)
    return store.record_run(p["fingerprint"], p["run"], p["result"], p.get("stages") or [],
                            [tuple(s) for s in p.get("samples") or []], uuid=p["uuid"])
