"""Copy records from one store to another without duplicates: ``vramcal records push --to URL`` (this
machine's SQLite history into the fleet's PostgreSQL) and ``pull --from URL`` (the other way).

Identity travels with the rows: a machine is its fingerprint, a run its ``uuid``, a memo and a
correction theirs. The integer ids are each database's own, so references are translated on the way
(a memo's ``run_id``, a correction's machine and source runs). Each run is copied in one transaction of
the destination with its outcome, stages, per-device stages and samples; a run that was copied while it
was still running gets its outcome on a later copy, and a split run copied by an older vramcal without
its per-device stages gets them. Copying again adds nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..errors import UserError

from .store import (DEVICE_STAGE_FIELDS, STAGE_FIELDS, DeviceStageRow, Outcome, Store, _context_of,
                    _insert_corrections, _insert_device_stages, _insert_machine, _insert_memo, _insert_outcome,
                    _insert_run, _insert_withdrawal, _outcome_of)

CHUNK = 500


@dataclass
class CopyReport:
    source: str
    destination: str
    runs_in_source: int
    machines_added: int = 0
    runs_added: int = 0
    outcomes_added: int = 0  # results (with their stages and samples) of runs added now or copied before unfinished
    device_stages_added: int = 0  # per-device rows of split runs the destination lacked
    skipped: list[str] = field(default_factory=list)  # records that are not what vramcal writes, and why
    memos_added: int = 0
    corrections_added: int = 0
    withdrawals_added: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def nothing_new(self) -> bool:
        return not (self.machines_added or self.runs_added or self.outcomes_added or self.memos_added
                    or self.corrections_added or self.device_stages_added or self.withdrawals_added)


def _chunks(items: list, n: int = CHUNK):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _by_uuid(store: Store, table: str, uuids: list[str], extra: str = "") -> dict[str, dict]:
    out = {}
    for part in _chunks(uuids):
        rows = store.query(f"SELECT t.uuid, t.id{extra} FROM {table} t "
                           + ("LEFT JOIN results s ON s.run_id = t.id " if table == "runs" else "")
                           + f"WHERE t.uuid IN ({', '.join('?' * len(part))})", part)
        out.update({r["uuid"]: r for r in rows})
    return out


class CopyInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a copy: what was copied stays; the message says how far it got."""

    def __init__(self, report: CopyReport):
        super().__init__(f"interrupted after copying {report.runs_added} runs and {report.outcomes_added} outcomes "
                         f"of {report.runs_in_source} in {report.source}; what was copied stays: run it again "
                         "to copy the rest")
        self.report = report


def copy_records(src: Store, dst: Store) -> CopyReport:
    """Copy every machine, run (with outcome, stages, samples), memo and correction of ``src`` that
    ``dst`` lacks. Safe to repeat and to interrupt: what was copied stays, the rest comes next time.
    Every run passes :mod:`vramcal.records.validate` first; one that is not what vramcal writes (a store
    poisoned by an older import) is left out and named in ``skipped``, never copied."""
    report = CopyReport(src.label, dst.label, runs_in_source=src.count("runs"))
    try:
        _copy(src, dst, report)
    except KeyboardInterrupt:
        raise CopyInterrupted(report) from None
    return report


def _copy(src: Store, dst: Store, report: CopyReport) -> None:
    from .validate import InvalidRecord, valid_context, valid_fingerprint, valid_outcome, valid_physics

    # machines, by fingerprint
    machine_map: dict[int, int] = {}
    fingerprints: dict[int, dict] = {}
    for m in src.machines():
        try:
            fp = valid_fingerprint(json.loads(m["fingerprint"]), f"machine {m['id']} of {src.label}")
        except (ValueError, TypeError, InvalidRecord) as exc:
            report.skipped.append(str(exc) if isinstance(exc, UserError) else f"machine {m['id']}: not JSON")
            continue
        known = dst.find_machine(fp)
        if known is None:
            known = dst._write(lambda tx, fp=fp, at=m["created_at"]: _insert_machine(tx, fp, at))
            report.machines_added += 1
        machine_map[m["id"]] = known
        fingerprints[m["id"]] = fp

    # runs, by uuid; an outcome where the destination has none; per-device rows where it lacks them
    runs = src.query("SELECT r.*, s.run_id AS has_outcome, (SELECT count(*) FROM device_stages d "
                     "WHERE d.run_id = r.id) AS device_rows FROM runs r LEFT JOIN results s ON s.run_id = r.id "
                     "ORDER BY r.id")
    there = _by_uuid(dst, "runs", [r["uuid"] for r in runs],
                     ", s.run_id AS has_outcome, (SELECT count(*) FROM device_stages d WHERE d.run_id = t.id) "
                     "AS device_rows")
    run_map: dict[int, int] = {}
    withdrawals = [w for w in src.withdrawals() if isinstance(w["why"], str) and w["why"].strip()]
    withdrawals_of: dict[int, list[dict]] = {}
    for w in withdrawals:
        withdrawals_of.setdefault(w["run_id"], []).append(w)
    for run in runs:
        have = there.get(run["uuid"])
        if have is not None:
            run_map[run["id"]] = have["id"]
            if have["has_outcome"] is not None:
                if run["device_rows"] and not have["device_rows"]:
                    rows = _read_device_stages(src, run["id"])
                    report.device_stages_added += dst._write(
                        lambda tx, rid=have["id"], rows=rows: _insert_device_stages(tx, rid, rows))
                continue
            if run["has_outcome"] is None:
                continue
        if run["machine_id"] not in machine_map:
            report.skipped.append(f"run {run['id']} of {src.label}: its machine was left out")
            continue
        where = f"run {run['id']} of {src.label}"
        try:
            outcome = _read_outcome(src, run) if run["has_outcome"] is not None else None
            context = valid_context(_context_of(run).to_dict(), where)
            outcome = None if outcome is None else valid_outcome(outcome.to_dict(), where)
            valid_physics(fingerprints[run["machine_id"]], context, outcome, where)
        except InvalidRecord as exc:
            report.skipped.append(str(exc))
            continue
        except (ValueError, TypeError):  # stored JSON that does not parse
            report.skipped.append(f"{where}: its stored JSON is damaged; not copied")
            continue

        def fn(tx, run=run, context=context, outcome=outcome):
            run_id, new = _insert_run(tx, machine_map[run["machine_id"]], context, run["uuid"], run["created_at"])
            added = False
            if outcome is not None:
                added = _insert_outcome(tx, run_id, outcome)
            # its withdrawals in the same transaction: a withdrawn run is never, even for a moment, a
            # run the destination's corrections could be fitted from
            withdrawn = sum(_insert_withdrawal(tx, run_id, w["why"], w["hostname"], w["uuid"], w["created_at"])[1]
                            for w in withdrawals_of.get(run["id"], ()))
            return run_id, new, added, withdrawn

        run_id, new, added, withdrawn = dst._write(fn)
        run_map[run["id"]] = run_id
        report.runs_added += new
        report.outcomes_added += added
        report.withdrawals_added += withdrawn

    # withdrawals, by uuid, of runs the destination held before: a withdrawn run stays withdrawn wherever
    # it goes (those of runs copied now went in with them)
    known_w = _by_uuid(dst, "withdrawals", [w["uuid"] for w in withdrawals])
    for w in withdrawals:
        if w["uuid"] in known_w or w["run_id"] not in run_map:
            continue
        report.withdrawals_added += dst._write(lambda tx, w=w: _insert_withdrawal(
            tx, run_map[w["run_id"]], w["why"], w["hostname"], w["uuid"], w["created_at"])[1])

    # memos: their JSON names the run by its id, which is the destination's now
    memos = src.query("SELECT * FROM memos ORDER BY id")
    known_memos = _by_uuid(dst, "memos", [m["uuid"] for m in memos])
    for memo in memos:
        if memo["uuid"] in known_memos or memo["run_id"] not in run_map:
            continue
        body = json.loads(memo["memo_json"])
        if body.get("run_id") == memo["run_id"]:
            body["run_id"] = run_map[memo["run_id"]]
        dst._write(lambda tx, memo=memo, body=body: _insert_memo(tx, run_map[memo["run_id"]], json.dumps(body),
                                                                   memo["uuid"], memo["created_at"]))
        report.memos_added += 1

    # corrections: machine and source runs translated
    corrections = src.corrections()
    known_corr = _by_uuid(dst, "corrections", [c["uuid"] for c in corrections])
    todo = [c for c in corrections if c["uuid"] not in known_corr and c["machine_id"] in machine_map]
    for c in todo:
        c["source_runs"] = [run_map[r] for r in c["source_runs"] if r in run_map]
    for part in _chunks(todo, 100):
        report.corrections_added += dst._write(lambda tx, part=part: sum(
            _insert_corrections(tx, machine_map[c["machine_id"]], c["stack"], [c], c["created_at"],
                                c.get("estimator_model")) for c in part))


def _read_outcome(src: Store, run: dict) -> Outcome:
    result = src.query("SELECT * FROM results WHERE run_id = ?", (run["id"],))[0]
    stages = src.query(f"SELECT {', '.join(STAGE_FIELDS)} FROM stages WHERE run_id = ? ORDER BY seq", (run["id"],))
    outcome = _outcome_of(result, stages, [])
    outcome.devices = _read_device_stages(src, run["id"])
    outcome.samples = [(s["t"], s["series"], s["bytes"]) for s in
                       src.query("SELECT t, series, bytes FROM samples WHERE run_id = ? ORDER BY t", (run["id"],))]
    return outcome


def _read_device_stages(src: Store, run_id: int) -> list[DeviceStageRow]:
    return [DeviceStageRow(**r) for r in src.query(
        f"SELECT {', '.join(DEVICE_STAGE_FIELDS)} FROM device_stages WHERE run_id = ? ORDER BY device, stage",
        (run_id,))]


def _readable(src: Store) -> Store:
    """Read the whole source once before the destination is opened (or created): a source damaged
    inside says so in one line and nothing is written anywhere."""
    for table in ("machines", "runs", "results", "stages", "device_stages", "samples", "memos", "corrections",
                  "withdrawals"):
        src.count(table)
    src.machines()
    return src


def push(local_db, url: str) -> CopyReport:
    """This machine's records (``local_db``, read-only) into the store at ``url``."""
    with Store(local_db, create=False, readonly=True) as src:
        _readable(src)
        with Store(url) as dst:
            return copy_records(src, dst)


def pull(url: str, local_db) -> CopyReport:
    """The records of the store at ``url`` (read-only) into ``local_db``."""
    with Store(url, create=False, readonly=True) as src:
        _readable(src)
        with Store(local_db) as dst:
            return copy_records(src, dst)
