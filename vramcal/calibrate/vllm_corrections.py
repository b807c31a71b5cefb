"""Corrections of the vLLM engine's measured terms, learned from this machine's vLLM runs.

vLLM measures two terms of its budget itself and logs them: the activation peak of its profiling run
and the non-torch memory (DEBUG profile line). A vLLM probe records them beside vramcal's prediction
(the run's ``estimate_json`` holds the prediction, its ``result_json`` the logged terms under
``vllm_logged``; its ``estimate`` is the one compared with, priced for the compile cache's state the log
showed: :func:`vramcal.probes.vllm_probe.priced_as_started`). Per machine -- else its machine class -- and per vLLM version, the correction of a
term is the mean of ``logged - predicted`` over the finished runs of the same tp x pp shape (non-torch
depends on it), else of any shape; applied, it replaces the default in the available KV memory and
everything that follows from it.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from ..records.store import NOT_WITHDRAWN

TERMS = ("activation_bytes", "non_torch_bytes")


def learned_terms(runs: list[dict], version: str, tp: int, pp: int) -> tuple[dict[str, int], list[int], str]:
    """(term -> mean offset, source run ids, scope) from recorded vLLM runs: dicts with ``run_id``,
    ``version``, ``tp``, ``pp``, ``predicted`` and ``logged`` ({term: bytes}). Same shape first."""
    mine = [r for r in runs if r.get("version") == version and r.get("logged") and r.get("predicted")]
    for scope, rows in ((f"vLLM {version}, tp={tp} pp={pp}", [r for r in mine if (r["tp"], r["pp"]) == (tp, pp)]),
                        (f"vLLM {version}, any tp x pp", mine)):
        out: dict[str, int] = {}
        used: set[int] = set()
        for term in TERMS:
            deltas = [(r["logged"][term] - r["predicted"][term], r["run_id"]) for r in rows
                      if r["logged"].get(term) is not None and r["predicted"].get(term) is not None]
            if term == "non_torch_bytes" and (tp, pp) != (1, 1) and "any" in scope:
                deltas = []  # NCCL buffers: another shape's non-torch says nothing about this one's
            if deltas:
                out[term] = int(round(statistics.fmean(d for d, _ in deltas)))
                used |= {i for _, i in deltas}
        if out:
            return out, sorted(used), scope
    return {}, [], ""


def apply_terms(est, terms: dict[str, int], source_runs: list[int], scope: str, redo):
    """The estimate with each rank's terms moved by ``terms``; ``redo(activation, non_torch)`` recomputes
    the estimate with those offsets (the KV arithmetic follows). The raw terms stay in ``correction``."""
    if not terms:
        return est
    fixed = redo(terms.get("activation_bytes", 0), terms.get("non_torch_bytes", 0))
    return replace(fixed, correction={"scope": f"this machine's vLLM runs, {scope}", "source_runs": source_runs,
                                      "delta_bytes": dict(terms),
                                      "raw": {"activation_bytes": est.activation_bytes,
                                              "non_torch_bytes": est.non_torch_bytes,
                                              "kv_cache_bytes": est.kv_cache_bytes,
                                              "kv_cache_tokens": est.kv_cache_tokens}})


VLLM_RUNS = ("SELECT r.id AS run_id, r.estimate_json, s.result_json FROM runs r JOIN results s ON s.run_id = r.id "
             "JOIN machines m ON m.id = r.machine_id WHERE r.estimator_model = ? AND s.status = 'ok' AND "
             + NOT_WITHDRAWN + " AND ")


def runs_of(rows: list[dict]) -> list[dict]:
    """Recorded rows (estimate and result JSON) as :func:`learned_terms` takes them."""
    import json

    out = []
    for row in rows:
        try:
            est = json.loads(row["estimate_json"] or "{}").get("vllm") or {}
            result = json.loads(row["result_json"] or "{}")
            logged = result.get("vllm_logged") or {}
            # what the probe compared with, where it re-priced for the compile state the log showed
            est = ((result.get("estimate") or {}).get("vllm") or est) if isinstance(result, dict) else est
        except (ValueError, AttributeError):
            continue
        raw = (est.get("correction") or {}).get("raw") or {}
        predicted = {t: raw.get(t, est.get(t)) for t in TERMS}
        if est and logged:
            out.append({"run_id": row["run_id"], "version": est.get("version"), "tp": est.get("tensor_parallel_size", 1),
                        "pp": est.get("pipeline_parallel_size", 1), "predicted": predicted,
                        "logged": {t: logged.get(t) for t in TERMS}})
    return out


def recorded_vllm_runs(db: str | None) -> tuple[list[dict], str | None]:
    """This machine's finished vLLM runs, else its machine class's, as :func:`learned_terms` takes them
    (empty when none, or when the records cannot be read: then why)."""
    from ..estimator.vllm.engine import MODEL_ID  # only this arithmetic's runs: an older one priced otherwise
    from ..probes.machine import machine_fingerprint
    from ..records.machines import class_key
    from .corrections import lookup_store

    store, why = lookup_store(db)
    if store is None:
        return [], why
    try:
        with store:
            fp = machine_fingerprint("cuda:0")
            mid = store.find_machine(fp)
            rows = store.query(VLLM_RUNS + "r.machine_id = ? ORDER BY r.id", (MODEL_ID, mid)) if mid is not None else []
            if not rows:
                rows = store.query(VLLM_RUNS + "m.class_key = ? ORDER BY r.id", (MODEL_ID, class_key(fp)))
            return runs_of(rows), None
    except Exception as exc:  # noqa: BLE001 -- a lookup never fails an estimate; it says why
        return [], f"no vLLM correction applied: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}"


def corrected(est, source, args, db: str | None):
    """``est`` corrected by this machine's recorded vLLM runs of its version, when there are any."""
    from ..estimator.vllm.engine import estimate_vllm

    runs, why = recorded_vllm_runs(db)
    terms, ids, scope = learned_terms(runs, est.version, est.tensor_parallel_size, est.pipeline_parallel_size)
    if not terms:
        if why:
            est.notes.append(why)
        return est
    return apply_terms(est, terms, ids, scope,
                       lambda da, dn: estimate_vllm(source, replace(args, vllm_version=est.version),
                                                    offsets={"activation_bytes": da, "non_torch_bytes": dn}))


def learned_offsets(args, db: str | None) -> dict[str, int] | None:
    """The learned term offsets for ``args``' version and shape (``fit`` passes them to every estimate)."""
    from ..estimator.vllm import versions as V

    runs, _ = recorded_vllm_runs(db)
    if not runs:
        return None
    v, _ = V.resolve_version(args.vllm_version)
    terms, _, _ = learned_terms(runs, V.fmt_version(v), args.tensor_parallel_size, args.pipeline_parallel_size)
    return terms or None
