"""Ground truth for the tests: what a really loaded model and a really filled cache hold.

The counting is the probe child's own (``vramcal.probes.child``): the same code measures in the field
and in the tests, and the tests check it against estimates built by entirely separate code.
"""

from vramcal.probes.child import cache_bytes, held_weight_storages

held_tensors = held_weight_storages

__all__ = ["cache_bytes", "default_sigint", "device_key", "from_pretrained_map", "held_tensors", "quantization_config"]


def device_key(name):
    """``cuda:1`` -> 1, as accelerate keys devices."""
    from vramcal.workload import parse_device

    return parse_device(name, placement=True).accelerate_key


def quantization_config(spec, **extra):
    """The ``BitsAndBytesConfig`` of a QuantSpec (None for none), with ``extra`` arguments."""
    import torch
    from transformers import BitsAndBytesConfig

    kwargs = spec.bnb_config_kwargs()
    if not kwargs:
        return None
    kwargs = {**kwargs, **extra}
    if "bnb_4bit_compute_dtype" in kwargs:
        kwargs["bnb_4bit_compute_dtype"] = getattr(torch, kwargs["bnb_4bit_compute_dtype"])
    return BitsAndBytesConfig(**kwargs)


class _Stop(Exception):
    pass


def from_pretrained_map(monkeypatch, path, spec=None, max_memory=None, strategy="auto", device_map=None,
                        kwargs=None, **extra):
    """What the real ``from_pretrained`` computes for a device map, stopped right after it (the GPUs named
    need not exist): (map or None, exception text or None, the model it built). The spy calls the
    installed ``_get_device_map`` and changes nothing. ``kwargs``: ``from_pretrained``'s arguments as
    given (instead of ``spec`` / ``max_memory`` / ``strategy``)."""
    import pytest
    import torch
    import transformers.integrations.accelerate as hf_acc
    import transformers.modeling_utils as hf_mu
    from transformers import AutoModelForCausalLM

    seen = {}
    real = hf_mu._get_device_map
    real_infer = hf_acc.infer_auto_device_map

    def spy(model, device_map, max_memory, hf_quantizer):
        seen["model"] = model
        try:
            seen["map"] = real(model, device_map, max_memory, hf_quantizer)
        except ValueError as exc:  # the quantizer refused the map it was given: keep what infer returned
            seen["error"] = str(exc)
        raise _Stop

    def infer_spy(*args, **kw):
        seen["map"] = real_infer(*args, **kw)
        return seen["map"]

    monkeypatch.setattr(hf_mu, "_get_device_map", spy)
    monkeypatch.setattr(hf_acc, "infer_auto_device_map", infer_spy)
    if kwargs is None:
        accel = {device_key(k): v for k, v in max_memory.items()} if max_memory else None
        kwargs = {"device_map": device_map or strategy, "max_memory": accel,
                  "quantization_config": quantization_config(spec, **extra), "dtype": getattr(torch, spec.dtype)}
    with pytest.raises(_Stop):
        AutoModelForCausalLM.from_pretrained(path, **kwargs)
    monkeypatch.undo()
    return seen.get("map"), seen.get("error"), seen["model"]


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


def default_sigint() -> None:
    """``preexec_fn`` of a parent the tests stop with SIGINT: SIGINT's default disposition first (a suite
    started in the background of a non-interactive shell has it ignored, and a Python that starts with
    SIGINT ignored never raises KeyboardInterrupt)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


class BlindCollection:
    """One of issue 27's blind collections of published vLLM startups (benchmarks/published/vllm/NAME): its rows,
    and vramcal's result for each as benchmarks/published_vllm.py computes it (once per test process)."""

    def __init__(self, name: str):
        import csv
        from pathlib import Path

        self.root = Path(__file__).parent.parent
        self.corpus_dir = self.root / "benchmarks" / "published" / "vllm"
        self.path = self.corpus_dir / name
        with open(self.path, newline="") as fh:
            self.rows = list(csv.DictReader(fh))
        self._results: dict[str, dict] | None = None

    def results(self) -> dict[str, dict]:
        if self._results is None:
            import sys

            sys.path.insert(0, str(self.root / "benchmarks"))
            from published_vllm import run_row

            self._results = {r["id"]: run_row({**r, "collection": self.path.name}, self.corpus_dir) for r in self.rows}
        return self._results
