"""Recording a probe: the lowest layer of the loop, which check, memo and fit build on.

``budget_for`` (the memory a run must fit in), ``measured_peak`` (a result's highest stage),
``record_probe`` (a result's rows into the store), and the run journal: what a probe has seen so far,
appended to a file as it happens, so a run whose process is killed outright (SIGKILL, a power cut)
is folded into the records by the next command that writes, with its last stage and samples.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from ..errors import UserError
from ..records.store import Store
from ..workload import STAGES
from . import reconcile


def budget_for(device: str, fingerprint: dict, budget: int | None) -> int:
    if budget is not None:
        return budget
    total = fingerprint.get("total_bytes")
    if not total:
        raise UserError(f"cannot read the total memory of {device}: pass --budget, e.g. --budget 24GiB")
    return int(total)


def measured_peak(result) -> tuple[int | None, str | None]:
    """The highest measured stage (``ProbeResult.measured``: above the baseline on the CPU), counting
    the stage that was under way when the run stopped."""
    readings = [r for name, r in result.measured().items() if name in STAGES]
    unfinished = result.measured_unfinished()
    if unfinished is not None:
        readings.append(unfinished)
    best = max((r for r in readings if r.peak_bytes is not None), key=lambda r: r.peak_bytes, default=None)
    return (None, None) if best is None else (best.peak_bytes, best.stage)


def begin_run(store: Store, machine_id: int, result_like: dict, estimate: dict | None, command: str,
              uuid: str | None = None) -> int:
    """The run's context, written before the probe starts (``uuid``: the client's id of the run, so a
    retry records it once)."""
    return store.begin_run(machine_id, uuid=uuid, model=result_like["model"],
                           config_hash=(estimate or {}).get("config_hash") or result_like.get("config_hash"),
                           quant=result_like["quant"], quant_impl=result_like.get("quant_implementation"),
                           dtype=result_like.get("dtype"), ctx=result_like["ctx"], batch=result_like["batch"],
                           kv_dtype=(estimate or {}).get("kv_dtype") or result_like.get("kv_dtype"),
                           attn=result_like.get("attn"), device=result_like["device"], command=command,
                           estimate=estimate)


def record_probe(store: Store, machine_id: int, result, estimate: dict | None, run_id: int | None = None) -> int:
    if run_id is None:
        run_id = begin_run(store, machine_id, {"model": result.model, "quant": result.quant,
                                               "quant_implementation": result.quant_implementation,
                                               "dtype": result.dtype, "ctx": result.ctx, "batch": result.batch,
                                               "attn": result.attn, "device": result.device}, estimate,
                           result.command)
    d = result.to_dict()
    devices = getattr(result, "devices", None)
    # a split run keeps every sampled series (each GPU of the map, the child's RAM); others their one
    keys = ([f"gpu{dev.split(':')[1]}" for dev in devices if dev.startswith("cuda")] + ["rss"]) if devices \
        else ([result.series] if result.series else [])
    samples = [(s["t"], k, s.get(k)) for s in d.pop("samples") for k in keys]
    store.finish_run(run_id, d, reconcile.stage_rows(result), samples)
    if devices:
        store.add_device_stages(run_id, reconcile.device_stage_rows(result))
    return run_id


def record_failure(store: Store, run_id: int, status: str, message: str, last_stage: str | None = None) -> None:
    """Close a run that ended before its probe produced a result (bad input found late, a failed start)."""
    store.finish_run(run_id, {"status": status, "error": message, "last_stage": last_stage, "stages": {},
                              "samples": []}, [], [])


# ------------------------------------------------------------------------------------------ journal

def journal_dir(store: Store) -> Path:
    """Beside an SQLite file; for a server database, under the user's state directory."""
    path = getattr(store, "path", None)
    if path is not None and "://" not in str(path):
        return Path(str(path) + "-journal.d")
    ident = hashlib.sha256(str(getattr(store, "display", path)).encode()).hexdigest()[:16]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "vramcal" / "journal" / ident


class Journal:
    """The probe's events for one run (``run_probe(journal=...)``), one JSON line each, as they arrive.
    Removed once the run's result is in the store; left behind only if this process dies first, and
    then folded into the records by :func:`recover_journals`."""

    def __init__(self, store: Store, run_id: int):
        self.path = journal_dir(store) / f"{run_id}.{os.getpid()}.jsonl"
        self._fh = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)
        except OSError:
            self._fh = None  # no journal: only a SIGKILL of this process would lose more than it does now

    def __call__(self, event: dict) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError, ValueError):
                self._fh.write(json.dumps(event, default=str) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None
        with contextlib.suppress(OSError):
            self.path.unlink()


def recover_journals(store: Store) -> list[int]:
    """Fold the journals of processes that are gone into records: the probe's result rebuilt from its
    events (``probes.probe.recover``: status ``interrupted``, the last stage, the samples so far), or,
    if the child never started, a run closed as ``killed``. Returns the run ids recovered."""
    from ..probes.probe import process_alive, recover

    d = journal_dir(store)
    if not d.is_dir():
        return []
    done = []
    for path in sorted(d.glob("*.jsonl")):
        try:
            run_id, pid = (int(x) for x in path.name.split(".")[:2])
        except ValueError:
            continue
        if process_alive(pid):
            continue
        events = []
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue  # the last line of a killed writer may be cut short
        run = store.run(run_id)
        if run is not None and run.get("status") is None:
            try:
                result = recover(e for e in events if isinstance(e, dict))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a journal damaged beyond reading
                record_failure(store, run_id, "killed", f"the recording process (pid {pid}) was killed and its "
                                                        f"journal {path} is damaged ({type(exc).__name__}); "
                                                        "no measurement could be recovered")
                done.append(run_id)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if result is None:
                record_failure(store, run_id, "killed", f"the recording process (pid {pid}) was killed before "
                                                        "the probe started")
            else:
                record_probe(store, run["machine_id"], result, result.estimate, run_id=run_id)
            done.append(run_id)
        with contextlib.suppress(OSError):
            path.unlink()
    return done
