"""The child process of a probe: load the model through ``from_pretrained``, generate the asked
number of new tokens (16 by default), and stream stage markers to the parent as they happen, one JSON
object per line on a pipe.

Run as ``python -m vramcal.probes.child SPEC_JSON FD``. The parent samples memory from outside, so if
this process dies (CUDA OOM, a CUDA error, SIGKILL) the timeline and the last stage survive.
``python -m vramcal.probes.child write-synthetic CONFIG_JSON OUT_DIR PARENT_PID TEMP_DIR`` writes a
``--synthetic`` checkpoint (:mod:`vramcal.probes.synthetic`) under the same lifeline.

The lifeline (:func:`die_with_parent`): both kinds of process end when the parent does. The parent
starts them in their own session (a Ctrl-C at the terminal reaches the parent only, which decides),
and kills their process group on every way out; if the parent itself is killed (SIGKILL, where it
cannot clean up), Linux sends this process SIGTERM (``PR_SET_PDEATHSIG``), and it removes the parent's
temporary folder (the synthetic checkpoint) before it exits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time

_OOM_SIZE = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


class Emitter:
    def __init__(self, fd: int):
        self.out = os.fdopen(fd, "w", buffering=1)

    def __call__(self, event: str, **fields) -> None:
        fields.update(event=event, t=time.monotonic())
        self.out.write(json.dumps(fields) + "\n")
        self.out.flush()


TEMP_PREFIX = "vramcal-probe-"  # the parent's temporary folders: vramcal-probe-PID-START-random
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def remove_temp_folder(path: str | None) -> None:
    """Remove a probe's temporary folder; refuses anything not named like one."""
    import shutil

    if path and os.path.basename(os.path.normpath(path)).startswith(TEMP_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def die_with_parent(parent_pid: int, temp_dir: str | None) -> None:
    """End this process, after removing ``temp_dir``, on SIGTERM, and ask Linux for a SIGTERM when
    the parent dies. SIGTERM is taken by a thread in ``sigwait`` rather than a Python handler, so it is
    served even while the main thread is inside a long C call (loading, a CUDA synchronize).

    Linux sends the parent-death signal when the *thread* that started this process ends; the probe
    keeps that thread waiting until this process is gone, so in practice that is the parent's end."""
    code = 128 + signal.SIGTERM

    def leave() -> None:
        remove_temp_folder(temp_dir)
        os._exit(code)

    if hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwait"):
        # blocked here, before any other thread exists: every thread torch starts inherits the mask (so
        # would a program it ran; the parent's SIGKILL to the group reaches those all the same)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

        def watch() -> None:
            signal.sigwait({signal.SIGTERM})
            leave()

        threading.Thread(target=watch, name="vramcal-lifeline", daemon=True).start()
    else:
        signal.signal(signal.SIGTERM, lambda *_: leave())
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl in this libc: the parent's sweep still removes the folder
            pass
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        leave()


def _rss() -> int | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except (ImportError, OSError):  # psutil's errors are OSError subclasses; "not read" is None
        return None


def requested_bytes(message: str) -> int | None:
    m = _OOM_SIZE.search(message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of the given tensors, each storage once (tied and shared tensors)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and hasattr(t, "untyped_storage"):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return seen


def param_tensors(p) -> list:
    """A parameter and every tensor its quantization keeps beside it (4-bit state, LLM.int8 scales)."""
    objs = [p]
    qs = getattr(p, "quant_state", None)
    if qs is not None:
        objs += [qs.absmax, qs.code, qs.offset]
        if getattr(qs, "nested", False):
            objs += [qs.state2.absmax, qs.state2.code]
    objs += [getattr(p, "SCB", None), getattr(p, "CB", None)]
    return [t for t in objs if t is not None]


def held_weight_storages(model) -> dict[int, int]:
    """Every parameter, buffer and quantization-state tensor the loaded model holds."""
    objs = [t for p in model.parameters() for t in param_tensors(p)]
    objs += list(model.buffers())
    return storages(objs)


def held_weight_bytes(model) -> int:
    return sum(held_weight_storages(model).values())


def cache_bytes(cache) -> int | None:
    """Bytes of every tensor storage a transformers cache object holds (its layers' K/V and states)."""
    if cache is None:
        return None
    objs = []
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if hasattr(value, "untyped_storage") and value.dim() >= 2:
                objs.append(value)
            elif isinstance(value, (tuple, list)):
                objs += [v for v in value if hasattr(v, "untyped_storage") and v.dim() >= 2]
    return sum(storages(objs).values())


def _preimport(spec: dict):
    """Import the code ``from_pretrained`` will import (the model's module, bitsandbytes, the image
    processor), so the baseline includes it and the stages measure tensors, not Python modules. Returns
    the auto class that builds the class the checkpoint names (:func:`~vramcal.estimator.meta.auto_class_for`)."""
    from transformers import AutoConfig
    from transformers.models.auto.auto_factory import _get_model_class

    from ..estimator.meta import auto_class_for

    config = AutoConfig.from_pretrained(spec["model_dir"])
    auto = auto_class_for(config, getattr(config, "architectures", None))
    try:
        _get_model_class(config, auto._model_mapping)
    except (KeyError, ValueError):
        pass  # a config class the auto mapping does not know: from_pretrained says so in its own words
    if spec.get("bnb") and "config_class" not in spec["bnb"]:
        import bitsandbytes  # noqa: F401
    if spec.get("images"):
        from . import images  # noqa: F401  (PIL, numpy and the image processors)
    import gc

    gc.collect()
    return auto


def _cache_kwargs(model, spec: dict, cache_len: int) -> dict:
    """The cache ``generate`` fills, as the estimate assumed it: transformers' fp8 QuantizedCache for
    ``--kv-dtype fp8``, a StaticCache pre-allocated to the whole context for ``--cache static``; passed
    as ``cache`` where the model takes it (transformers deprecates ``past_key_values``)."""
    from transformers import QuantizedCache, StaticCache

    from ..estimator.dryrun import cache_keyword

    key = cache_keyword(model)
    if spec.get("kv_dtype", "auto") == "fp8":
        return {key: QuantizedCache(backend="fp8", config=model.config)}
    if spec.get("cache", "dynamic") == "static":
        return {key: StaticCache(config=model.config, max_cache_len=cache_len)}
    return {}


def _multimodal_prompt(model, spec: dict, prompt: int, vocab: int, gen, dtype):
    """Random text ids with the images laid out as the family's processor lays them out, the pixel
    inputs from the real image processor at the asked size, and the text-side inputs the processor
    returns (:mod:`vramcal.estimator.vision`). Returns (ids, inputs, image tokens per prompt)."""
    import torch

    from ..estimator.inventory import built_config_dict
    from ..estimator.vision import plan_images, prompt_ids, reserved_ids, text_side_inputs
    from .images import real_image_inputs

    size = tuple(spec["image_size"]) if spec.get("image_size") else None
    images = plan_images(built_config_dict(model.config), spec.get("processor") or {}, int(spec["images"]), size)
    reserved = reserved_ids(model.config)

    def text(n: int) -> list[int]:
        out = torch.randint(3, max(4, vocab - 1), (n,), generator=gen).tolist()
        return [t if t not in reserved else 3 + (t % 7) for t in out]

    ids = prompt_ids(model.config, images, spec["batch"], prompt, text)
    extra = {**text_side_inputs(model.config, images, ids),
             **real_image_inputs(model.config.model_type, images, spec.get("processor"), spec["batch"], dtype)}
    return ids, extra, images.tokens


def _vision_window(model, emit, cuda_device):
    """Report the vision encoder's stretch of the prefill (from its first module to the language model):
    when it ran and, on a GPU, torch's allocated bytes when it started and the highest since the
    post-load marker when it ended. Returns the function that removes the hooks."""
    import torch

    from ..estimator.inventory import model_parts

    modules = dict(model.named_modules())
    decoder = model.get_decoder()
    state: dict = {}

    def stats() -> dict:
        if cuda_device is None:
            return {"rss": _rss()}
        torch.cuda.synchronize(cuda_device)
        return {"allocated": torch.cuda.memory_allocated(cuda_device),
                "max_allocated": torch.cuda.max_memory_allocated(cuda_device)}

    def opened(*_):
        if not state:
            state["start"] = {"t": time.monotonic(), **stats()}

    def closed(*_):
        if "start" in state and "end" not in state:
            state["end"] = {"t": time.monotonic(), **stats()}
            emit("vision", t_start=state["start"]["t"], t_end=state["end"]["t"],
                 allocated_start=state["start"].get("allocated"), max_allocated=state["end"].get("max_allocated"))

    hooks = [modules[n].register_forward_pre_hook(opened) for n in model_parts(model) if modules[n] is not decoder]
    hooks.append(decoder.register_forward_pre_hook(closed))

    def remove() -> None:
        for h in hooks:
            h.remove()

    return remove


def run(spec: dict, emit: Emitter) -> int:
    phase = "baseline"
    try:
        import torch
        from ..estimator.loading import load_kwargs, materialize

        device = spec["device"]
        cuda = device.startswith("cuda")
        auto = _preimport(spec)
        emit("stage", name="baseline", rss=_rss())

        def torch_stats() -> dict:
            if not cuda:
                return {"rss": _rss()}
            free, total = torch.cuda.mem_get_info(device)  # device-wide, like NVML: the fallback without it
            stats = {"rss": _rss(), "mem_get_info_used": int(total - free),
                     "torch_allocated": torch.cuda.memory_allocated(device),
                     "torch_reserved": torch.cuda.memory_reserved(device),
                     "torch_max_allocated": torch.cuda.max_memory_allocated(device),
                     "torch_max_reserved": torch.cuda.max_memory_reserved(device)}
            torch.cuda.reset_peak_memory_stats(device)
            return stats

        if cuda:
            phase = "context"
            torch.cuda.init()
            for gpu in spec.get("gpus") or [device]:  # placement: a context on every GPU of the map
                torch.zeros(1, device=gpu)  # the context exists once a first kernel ran
                torch.cuda.synchronize(gpu)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            emit("stage", name="context", **torch_stats())

        phase = "load_peak"
        # placement (docs/placement.md): the plan's device_map, max_memory and, if refused, the flag
        kwargs = load_kwargs(spec["dtype"], device, spec.get("bnb"), spec.get("load"), spec.get("attn"),
                             spec.get("offload_folder"))
        model = auto.from_pretrained(spec["model_dir"], **materialize(kwargs))
        model.eval()
        if cuda:
            torch.cuda.synchronize(device)
        emit("stage", name="load_peak", weights_bytes=held_weight_bytes(model), **torch_stats())
        phase = "post_load"
        import gc

        gc.collect()
        emit("stage", name="post_load", **torch_stats())

        phase = "first_token"
        new = int(spec.get("new_tokens", 16))
        prompt = spec["ctx"] - new
        gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
        vocab = int(model.config.get_text_config().vocab_size)
        extra, image_tokens, window = {}, 0, None
        if spec.get("images"):
            ids, extra, image_tokens = _multimodal_prompt(model, spec, prompt, vocab, gen, getattr(torch, kwargs["dtype"]))
            extra = {k: v.to(model.device) for k, v in extra.items()}
            window = _vision_window(model, emit, device if cuda else None)
        else:
            ids = torch.randint(3, max(4, vocab - 1), (spec["batch"], prompt), generator=gen)
        ids = ids.to(model.device)
        prompt = ids.shape[1]
        state = {"calls": 0}

        class FirstToken:
            """A streamer: its second ``put`` is the first new token (the first is the prompt)."""

            def put(self, value):
                nonlocal phase
                state["calls"] += 1
                if state["calls"] == 2:
                    if cuda:
                        torch.cuda.synchronize(device)
                    emit("stage", name="first_token", **torch_stats())
                    phase = "end"

            def end(self):
                pass

        streamer = FirstToken() if spec["batch"] == 1 else None
        logits_marker = None
        if streamer is None:  # streamers take batch 1 only: mark the first token from a logits processor
            from transformers import LogitsProcessor, LogitsProcessorList

            class Mark(LogitsProcessor):
                def __call__(self, input_ids, scores):
                    nonlocal phase
                    if phase == "first_token":
                        if cuda:
                            torch.cuda.synchronize(device)
                        emit("stage", name="first_token", **torch_stats())
                        phase = "end"
                    return scores

            logits_marker = LogitsProcessorList([Mark()])
        try:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, streamer=streamer,
                                     logits_processor=logits_marker, pad_token_id=0, return_dict_in_generate=True,
                                     **_cache_kwargs(model, spec, cache_len=prompt + new), **extra)
        finally:
            if window is not None:
                window()
        if cuda:
            torch.cuda.synchronize(device)
        emit("stage", name="end", prompt_tokens=prompt, generated=int(out.sequences.shape[1] - prompt),
             kv_bytes=cache_bytes(getattr(out, "past_key_values", None)), image_tokens=image_tokens, **torch_stats())
        emit("done")
        return 0
    except Exception as exc:
        import traceback

        message = f"{type(exc).__name__}: {exc}".strip()
        is_oom = type(exc).__name__ in ("OutOfMemoryError",) or "out of memory" in str(exc).lower()
        if is_oom:
            emit("oom", stage=phase, requested_bytes=requested_bytes(str(exc)), message=message.splitlines()[0])
            return 3
        emit("error", stage=phase, message=message.splitlines()[0][:500], traceback=traceback.format_exc()[-4000:])
        return 4


def main(argv: list[str]) -> int:
    if argv[0] == "write-synthetic":
        config_path, out_dir, parent_pid, temp_dir = argv[1:5]
        die_with_parent(int(parent_pid), temp_dir)
        from .synthetic import main as write

        return write([config_path, out_dir])
    spec = json.loads(argv[0])
    if spec.get("parent_pid") is not None:
        die_with_parent(int(spec["parent_pid"]), spec.get("temp_dir"))
    emit = Emitter(int(argv[1]))
    emit("hello", pid=os.getpid())
    return run(spec, emit)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
