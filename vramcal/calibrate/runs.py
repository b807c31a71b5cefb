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
from types import SimpleNamespace

from ..errors import UserError
from ..records.store import Store
from . import reconcile


def budget_for(device: str, fingerprint: dict, budget: int | None) -> int:
    if budget is not None:
        return budget
    total = fingerprint.get("total_bytes")
    if not total:
        raise UserError(f"cannot read the total memory of {device}: pass --budget, e.g. --budget 24GiB")
    return int(total)


def measured_peak(result) -> tuple[int | None, str | None]:
    """The highest measured stage (above the baseline on the CPU), counting a stage that was under way
    when the run stopped."""
    best: tuple[int | None, str | None] = (None, None)
    for r in reconcile.stage_rows(result):
        if r["stage"] in reconcile.STAGES and r["measured_peak_bytes"] is not None:
            if best[0] is None or r["measured_peak_bytes"] > best[0]:
                best = (r["measured_peak_bytes"], r["stage"])
    if result.unfinished and result.unfinished.get("peak_bytes") is not None:
        p = reconcile.unfinished_peak(result)
        if p is not None and (best[0] is None or p > best[0]):
            best = (p, result.unfinished.get("stage"))
    return best


def begin_run(store: Store, machine_id: int, result_like: dict, estimate: dict | None, command: str) -> int:
    """The run's context, written before the probe starts."""
    return store.begin_run(machine_id, model=result_like["model"],
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
    if path is not None and not str(path).startswith("postgresql"):
        return Path(str(path) + "-journal.d")
    ident = hashlib.sha256(getattr(store, "display", str(path)).encode()).hexdigest()[:16]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "vramcal" / "journal" / ident


class Journal:
    """Append-only JSON lines for one run: stage markers and samples as they arrive. Removed once the
    run's result is in the store; left behind only if this process dies first."""

    def __init__(self, store: Store, run_id: int, series: str | None = None):
        self.dir = journal_dir(store)
        self.path = self.dir / f"{run_id}.{os.getpid()}.jsonl"
        self.run_id, self.series = run_id, series
        self._fh = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)
        except OSError:
            self._fh = None  # no journal: only a SIGKILL of this process would lose more than it does now

    def __call__(self, kind: str, payload: dict) -> None:
        if self._fh is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._fh.write(json.dumps({"kind": kind, **payload}, default=str) + "\n")

    def close(self, remove: bool = True) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()


def recover_journals(store: Store) -> list[int]:
    """Fold journals of processes that are gone into records: status ``killed``, the last stage the
    journal saw and its samples. Returns the run ids recovered."""
    d = journal_dir(store)
    if not d.is_dir():
        return []
    done = []
    for path in sorted(d.glob("*.jsonl")):
        try:
            run_id, pid = (int(x) for x in path.name.split(".")[:2])
        except ValueError:
            continue
        if _alive(pid):
            continue
        stages: dict[str, dict] = {}
        samples: list[tuple[float, str, int | None]] = []
        series = None
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # the last line of a killed writer may be cut short
            if ev.get("kind") == "stage":
                stages[ev["name"]] = {k: v for k, v in ev.items() if k not in ("kind", "name")}
                series = ev.get("series", series)
            elif ev.get("kind") == "samples":
                series = ev.get("series", series)
                samples += [(s["t"], series, s.get("bytes")) for s in ev.get("samples", [])]
        run = store.run(run_id)
        if run is not None and run.get("status") is None:
            last = list(stages)[-1] if stages else None
            rows = reconcile.stage_rows(SimpleNamespace(series=series, stages=stages, estimate=None))
            store.finish_run(run_id, {"status": "killed", "last_stage": last, "series": series,
                                      "error": f"the process recording this run (pid {pid}) was killed after "
                                               f"stage {last or 'none'}; recovered from its journal",
                                      "stages": stages, "samples": len(samples)}, rows, samples)
            done.append(run_id)
        with contextlib.suppress(OSError):
            path.unlink()
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
