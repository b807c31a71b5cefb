"""Export runs with their stages as one table, through pandas: CSV, JSON or Parquet.

Every row says whether its run is withdrawn (``records withdraw RUN --why``): ``withdrawn`` (a bool) and
``withdrawn_why`` (the reasons, oldest first, joined by ``"; "`` where a fleet copied in more than one;
null for a run not withdrawn). A withdrawn run stays in the export, as it stays in the records: what it
is kept out of is the corrections."""

from __future__ import annotations

from ..errors import UserError
from ..files import atomic_write, check_writable
from .store import Store

FORMATS = ("csv", "json", "parquet")
_COLUMNS = ("run_id", "run_uuid", "created_at", "machine_kind", "gpu_name", "device_total_bytes", "hostname", "torch",
            "transformers", "bitsandbytes", "model", "config_hash", "quant", "quant_impl", "dtype", "ctx", "batch",
            "kv_dtype", "attn", "device", "status", "last_stage", "error", "withdrawn", "withdrawn_why", "stage", "estimated_bytes",
            "measured_peak_bytes", "measured_used_bytes", "torch_max_allocated", "torch_max_reserved", "command")
_BYTES = ("estimated_bytes", "measured_peak_bytes", "measured_used_bytes", "torch_max_allocated",
          "torch_max_reserved", "device_total_bytes")


def runs_frame(store: Store):
    import pandas as pd

    rows = store.query(
        "SELECT r.id AS run_id, r.uuid AS run_uuid, r.created_at, m.kind AS machine_kind, m.gpu_name, "
        "m.total_bytes AS device_total_bytes, m.hostname, m.torch, m.transformers, m.bitsandbytes, r.model, "
        "r.config_hash, r.quant, r.quant_impl, r.dtype, r.ctx, r.batch, r.kv_dtype, r.attn, r.device, "
        "COALESCE(s.status, 'interrupted') AS status, s.last_stage, s.error, st.stage, st.estimated_bytes, "
        "st.measured_peak_bytes, st.measured_used_bytes, st.torch_max_allocated, st.torch_max_reserved, r.command "
        "FROM runs r JOIN machines m ON m.id = r.machine_id LEFT JOIN results s ON s.run_id = r.id "
        "LEFT JOIN stages st ON st.run_id = r.id ORDER BY r.id, st.seq")
    whys: dict[int, list[str]] = {}
    for w in store.withdrawals():  # oldest first; read apart from the join, in every engine's SQL alike
        whys.setdefault(w["run_id"], []).append(w["why"])
    for row in rows:
        row["withdrawn"] = row["run_id"] in whys
        row["withdrawn_why"] = "; ".join(whys[row["run_id"]]) if row["withdrawn"] else None
    frame = pd.DataFrame.from_records(rows, columns=list(_COLUMNS))
    frame["withdrawn"] = frame["withdrawn"].astype(bool)
    for col in _BYTES:
        frame[col] = frame[col].astype("Int64")  # integers with NULL as <NA>, never 0
    return frame


def export(store: Store, fmt: str, out: str | None) -> str | None:
    """The table as text (``out=None``), or written to ``out`` atomically; never onto the database."""
    if fmt not in FORMATS:
        raise UserError(f"unknown --format {fmt!r}: choose csv, json or parquet")
    if fmt == "parquet" and not out:
        raise UserError("parquet is binary: pass --out FILE.parquet")
    protect = (store.path,) if store.path else ()
    if out:
        check_writable(out, "--out", protect)  # before the query: nothing is computed for a bad target
    frame = runs_frame(store)
    if fmt == "parquet":
        import io

        buf = io.BytesIO()
        try:
            frame.to_parquet(buf, index=False)
        except ImportError:
            raise UserError("parquet export needs pyarrow: pip install pyarrow") from None
        atomic_write(out, buf.getvalue(), "--out", protect)
        return None
    text = frame.to_csv(index=False) if fmt == "csv" else frame.to_json(orient="records", indent=1)
    if out:
        atomic_write(out, text, "--out", protect)
        return None
    return text
