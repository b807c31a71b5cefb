"""Recording a probe: the lowest layer of the loop, which check, memo and fit build on.

- :func:`probe_and_record`: one configuration probed and recorded, whichever way the run ends --
  finished, out of memory, crashed, Ctrl-C, SIGTERM, bad input found late -- with its context written
  before the probe starts and a journal of what the probe saw, so a run whose process is killed
  outright (SIGKILL, a power cut) is folded into the records by the next command that writes
  (:func:`recover_journals`). ``check`` and ``memo --recheck`` both run through it.
- :func:`outcome_of`: a probe result as the store's :class:`~vramcal.records.store.Outcome` (every
  sampled series, per-device stages of a split run), recorded in one transaction.
- :func:`save_probe_unrecorded`: a result the store could not take, kept in a file for
  ``vramcal records import``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from ..errors import RecordedFailure, UserError
from ..paths import state_dir
from ..probes.result import ProbeResult, device_series
from ..records.store import Outcome, RunContext, Store, new_uuid
from ..versions import VRAMCAL_VERSION
from ..workload import STAGES, Configuration
from . import reconcile


def budget_for(device: str, fingerprint: dict, budget: int | None) -> int:
    if budget is not None:
        return budget
    total = fingerprint.get("total_bytes")
    if not total:
        raise UserError(f"cannot read the total memory of {device}: pass --budget, e.g. --budget 24GiB")
    return int(total)


def measured_peak(result: ProbeResult) -> tuple[int | None, str | None]:
    """The highest measured stage (``ProbeResult.measured``: above the baseline on the CPU), counting
    the stage that was under way when the run stopped."""
    readings = [r for name, r in result.measured().items() if name in STAGES]
    unfinished = result.measured_unfinished()
    if unfinished is not None:
        readings.append(unfinished)
    best = max((r for r in readings if r.peak_bytes is not None), key=lambda r: r.peak_bytes, default=None)
    return (None, None) if best is None else (best.peak_bytes, best.stage)


def run_context(config: Configuration, source, spec, estimate, command: str) -> RunContext:
    """What a run of ``config`` records before it starts: the configuration, the estimate it is
    compared with (its JSON, and the estimator model that made it), vramcal's version, and a split
    run's devices."""
    split = list(estimate.devices) if estimate is not None and estimate.devices else None
    return RunContext(model=source.name, config_hash=source.config_hash, quant=spec.name,
                      quant_impl=spec.implementation, dtype=spec.dtype, ctx=config.work.ctx, batch=config.work.batch,
                      kv_dtype=config.kv_dtype, attn=config.attn, device=config.device, command=command,
                      estimate=None if estimate is None else estimate.to_dict(),
                      estimator_model=None if estimate is None else estimate.estimator_model,
                      vramcal_version=VRAMCAL_VERSION, split_devices=split)


def outcome_of(result: ProbeResult) -> Outcome:
    """A probe result as the store records it: every sampled series (a split run's: each GPU of the map
    and the child's RAM), the stages beside the estimate, and per-device stages."""
    keys = [device_series(d) for d in result.devices] if result.devices else ([result.series] if result.series else [])
    samples = [(s["t"], k, s.get(k)) for s in result.samples for k in keys]
    return Outcome(status=result.status, last_stage=result.last_stage, error=result.error,
                   oom=None if result.oom is None else vars(result.oom).copy(), series=result.series,
                   wall_s=result.wall_s, sampler_overhead=result.sampler_overhead,
                   result=result.to_dict(samples=False), stages=reconcile.stage_rows(result),
                   devices=reconcile.device_stage_rows(result) if result.devices else [], samples=samples)


def context_of_result(result: ProbeResult, config_hash: str | None = None) -> RunContext:
    """The run context of a probe that ran outside :func:`probe_and_record` (a benchmark's matrix)."""
    est = result.estimate
    return RunContext(model=result.model, quant=result.quant, ctx=result.ctx, batch=result.batch,
                      device=result.device, command=result.command, config_hash=config_hash or (est and est.config_hash),
                      quant_impl=result.quant_implementation, dtype=result.dtype, kv_dtype=result.kv_dtype,
                      attn=result.attn, estimate=None if est is None else est.to_dict(),
                      estimator_model=None if est is None else est.estimator_model, vramcal_version=VRAMCAL_VERSION,
                      split_devices=list(result.devices) if result.devices else None)


def record_result(store: Store, fingerprint: dict, result: ProbeResult, config_hash: str | None = None) -> int:
    """A finished probe's whole record -- machine, context, outcome -- in one transaction; its run id."""
    return store.record_run(fingerprint, context_of_result(result, config_hash), outcome_of(result))


def record_probe(store: Store, run_id: int, result: ProbeResult) -> None:
    """A run's outcome, stages, per-device stages and samples, in one transaction."""
    store.finish_run(run_id, outcome_of(result))


def record_failure(store: Store, run_id: int, status: str, message: str, last_stage: str | None = None) -> None:
    """Close a run that ended before its probe produced a result (bad input found late, a failed start)."""
    store.finish_run(run_id, Outcome(status=status, error=message, last_stage=last_stage))


def begin_engine_run(db, device: str, context: RunContext) -> int:
    """An engine probe's run (vLLM, llama.cpp), recorded before its child starts: if this process is
    then killed outright, the records keep the run with no outcome, which they show as interrupted."""
    from ..probes.machine import machine_fingerprint

    with Store(db) as store:
        return store.begin_run(store.machine_id(machine_fingerprint(device)), context)


def finish_engine_run(db, run_id: int, outcome: Outcome) -> None:
    """The outcome of an engine probe begun by :func:`begin_engine_run` (finished, failed or interrupted)."""
    with Store(db) as store:
        store.finish_run(run_id, outcome)


def recorded_engine_probe(db, device: str, context: RunContext, probe, outcome) -> tuple[int, object]:
    """An engine probe (vLLM, llama.cpp) from record to record: the run is recorded before ``probe()`` starts
    its child, then finished with ``outcome(result)``. A probe that raises instead of returning a result
    (a bug, a missing library found late) still closes its run, as failed with the error, before the error
    goes on. Returns ``(run_id, result)``; the caller shows the result, then raises
    :class:`~vramcal.probes.lifecycle.ProbeInterrupted` for an interrupted one (:func:`end_engine_probe`)."""
    run_id = begin_engine_run(db, device, context)
    try:
        result = probe()
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "error"
        finish_engine_run(db, run_id, Outcome(status=status, error=f"{type(e).__name__}: {e}"[:2000]))
        raise
    finish_engine_run(db, run_id, outcome(result))
    return run_id, result


def end_engine_probe(result) -> None:
    """After the result is shown: an interrupted engine probe leaves with exit 130 / 143, as every probe does."""
    if result.interrupted:
        from ..probes.lifecycle import ProbeInterrupted

        raise ProbeInterrupted(result, result.interrupted)


def save_probe_unrecorded(fingerprint: dict, context: RunContext, result: ProbeResult, *, run_uuid: str, error: str,
                          folder=None) -> Path:
    """Keep a probe whose record could not be written (the server went away, the file is locked or
    read-only) as one JSON file with the outcome the store would have recorded; returns its path.
    ``run_uuid`` is the one the run's context was (or was to be) recorded with, so ``vramcal records
    import`` completes that run rather than adding another."""
    from ..records.unrecorded import run_payload, save_unrecorded

    return save_unrecorded(run_payload(fingerprint, context, outcome_of(result), uuid=run_uuid, error=error), folder)


def probe_and_record(store: Store, fingerprint: dict, config: Configuration, source, spec, estimate, *,
                     command: str, interval_ms: float = 5.0, on_event=None) -> tuple[int, int, ProbeResult]:
    """Probe ``config`` exactly -- every flag it holds reaches the probe -- and record the run whichever
    way it ends. Returns (run id, machine id, result). Ctrl-C or SIGTERM: the run is recorded with what
    was measured, then :class:`~vramcal.probes.lifecycle.ProbeInterrupted` goes on up; bad input the
    probe finds late: the run is closed as ``error`` and the UserError goes on up. If the store cannot
    take the result, it is kept in a file and the UserError says where."""
    from ..probes.probe import ProbeInterrupted, run_probe

    recover_journals(store)
    machine_id = store.machine_id(fingerprint)
    run_uuid = new_uuid()
    context = run_context(config, source, spec, estimate, command)
    run_id = store.begin_run(machine_id, context, uuid=run_uuid)
    journal = Journal(store, run_id)

    def keep(result: ProbeResult) -> None:
        result.estimate = estimate  # estimated once, before the run was recorded
        try:
            record_probe(store, run_id, result)
        except UserError as exc:
            path = save_probe_unrecorded(fingerprint, context, result, run_uuid=run_uuid, error=str(exc))
            raise UserError(f"{exc}; the measurement is kept in {path}: `vramcal records import {path}` "
                            "records it once the database is back") from None
        journal.close()

    work = config.work
    try:
        result = run_probe(source, config.quant, work.ctx, work.batch, device=config.device,
                           synthetic=config.synthetic, interval_ms=interval_ms, dtype=config.dtype, attn=config.attn,
                           command=command, with_estimate=False, estimate=estimate, new_tokens=work.new_tokens,
                           kv_dtype=config.kv_dtype, cache=config.cache, journal=journal, on_event=on_event,
                           max_memory=config.max_memory, device_map=config.device_map, images=work.images,
                           image_size=work.image_size)
    except ProbeInterrupted as exc:  # Ctrl-C or SIGTERM: the record keeps what was measured
        keep(exc.result)
        raise
    except UserError as exc:
        message = " ".join(str(exc).split())
        record_failure(store, run_id, "error", message)
        journal.close()
        raise RecordedFailure(f"{message[:400]}; recorded as run {run_id} (error)") from None
    keep(result)
    return run_id, machine_id, result


# ------------------------------------------------------------------------------------------ journal

def journal_dir(store: Store) -> Path:
    """Beside an SQLite file; for a server database, under the user's state directory."""
    if store.path is not None:
        return Path(str(store.path) + "-journal.d")
    ident = hashlib.sha256(str(store.label).encode()).hexdigest()[:16]
    return state_dir() / "journal" / ident


class Journal:
    """The probe's events for one run (``run_probe(journal=...)``), one JSON line each, as they arrive.
    Named ``RUN.PID.START.jsonl`` (this process's id and start time: a later process that reuses the
    pid is not taken for it). Removed once the run's result is in the store; left behind only if this
    process dies first, and then folded into the records by :func:`recover_journals`."""

    def __init__(self, store: Store, run_id: int):
        from ..probes.lifecycle import start_time

        pid = os.getpid()
        self.path = journal_dir(store) / f"{run_id}.{pid}.{start_time(pid) or 0}.jsonl"
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
    events (``probes.result.recover``: status ``interrupted``, the last stage, the samples so far), or,
    if the child never started, a run closed as ``killed``. Returns the run ids recovered."""
    from ..probes.lifecycle import process_alive
    from ..probes.result import recover

    d = journal_dir(store)
    if not d.is_dir():
        return []
    done = []
    for path in sorted(d.glob("*.jsonl")):
        if not path.is_file() or path.is_symlink():  # a FIFO would block the read below; vramcal writes files
            continue
        parts = path.name.split(".")
        try:
            run_id, pid = int(parts[0]), int(parts[1])
            start = int(parts[2]) if len(parts) == 4 else None
        except (ValueError, IndexError):
            continue
        if process_alive(pid, start):
            continue
        events = []
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue  # the last line of a killed writer may be cut short
        run = store.run(run_id)
        if run is not None and run.outcome is None:
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
                record_probe(store, run_id, result)
            done.append(run_id)
        with contextlib.suppress(OSError):
            path.unlink()
    return done
