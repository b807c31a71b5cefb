"""Ground truth for the tests: what a really loaded model and a really filled cache hold.

The counting is the probe child's own (``vramcal.probes.child``): the same code measures in the field
and in the tests, and the tests check it against estimates built by entirely separate code.
"""

from vramcal.probes.child import cache_bytes, held_weight_storages

held_tensors = held_weight_storages

__all__ = ["cache_bytes", "held_tensors"]


def context(**kw):
    """A run's context for the records tests: a small CPU run unless told otherwise."""
    from vramcal.records.store import RunContext

    args = {"model": "m", "quant": "nf4", "ctx": 64, "batch": 1, "device": "cpu", "command": "c"}
    args.update(kw)
    return RunContext(**args)


def outcome(status: str = "ok", stages=(), samples=(), devices=(), **kw):
    """A run's outcome for the records tests; ``stages`` and ``devices`` as dicts of their columns."""
    from vramcal.records.store import DeviceStageRow, Outcome, StageRow

    return Outcome(status=status, stages=[StageRow(**r) for r in stages], samples=[tuple(x) for x in samples],
                   devices=[DeviceStageRow(**r) for r in devices], **kw)
